"""EGGROLL and CoPESLowRank: the batched population forward against explicit per-member models, untouched weights,
the update against a dense sum of outer products, learning on an MLP and a tiny Qwen3, determinism, resume, the
hybrid's per-member groups, and argument errors.

The oracle never reads the strategy's factors: it regenerates them from the noise contract
(ck.lowrank_factors(seed=step_seed(seed, t), member=j, tensor_id=crc32(name))) and materialises W_j densely.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3ForCausalLM

import copes_kernels as ck
from copes.es.fitness import shape_fitness
from copes.es.selection import tensor_id_for
from copes.es.strategies import EGGROLL, CoPESLowRank
from copes.es.strategies.copes import step_seed

from helpers.tiny_models import tiny_qwen3

SEED = 7


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
        ).to(dtype)


def tiny_lm(tied: bool = True, seed: int = 0) -> Qwen3ForCausalLM:
    return tiny_qwen3(seed=seed, vocab_size=61, tie_word_embeddings=tied)


def make_strategy(model: nn.Module, num_subspaces: int, **kwargs) -> EGGROLL | CoPESLowRank:
    settings = dict(population=4, sigma=0.05, lr=0.01, rank=2, seed=SEED) | kwargs
    if num_subspaces == 1:
        return EGGROLL(model, **settings)
    return CoPESLowRank(model, num_subspaces=num_subspaces, **settings)


def member_model(model: nn.Module, es: EGGROLL | CoPESLowRank, member: int) -> nn.Module:
    """A copy of `model` whose weights ARE member `member`'s: W + sigma_k / sqrt(r) A B^T on its group's matrices."""
    plan = es.plan()
    clone = copy.deepcopy(model)  # deepcopy keeps tied weights tied
    params = dict(clone.named_parameters())
    sigma_k = math.sqrt(es.num_subspaces) * es.sigma
    with torch.no_grad():
        for matrix, group in zip(es.matrices, plan.partition):
            if int(group[0]) != member % es.num_subspaces:
                continue
            weight = params[matrix.param.name]
            A, B = ck.lowrank_factors(
                seed=step_seed(SEED, plan.step),
                member=member,
                tensor_id=tensor_id_for(matrix.param.name),
                out_features=weight.shape[0],
                in_features=weight.shape[1],
                rank=es.rank,
            )
            weight += sigma_k / math.sqrt(es.rank) * (A @ B.T)
    return clone


def batched_outputs(
    es: EGGROLL | CoPESLowRank, inputs: torch.Tensor, member_of_row: torch.Tensor, forward
) -> torch.Tensor:
    """Run `forward(model, inputs)` once inside row_members, as a fitness_fn would; returns what it computed."""
    captured = []

    def fitness_fn(model, row_members):
        with row_members(member_of_row):
            captured.append(forward(model, inputs))
        return torch.zeros(es.population)

    es.evaluate(fitness_fn)
    return captured[0]


def lm_logits(model: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=token_ids).logits


# A subset of rows in shuffled member order, as the rollout loop sends once some sequences have finished.
MEMBER_OF_ROW = torch.tensor([3, 0, 2, 2, 1, 3, 0])


@pytest.mark.parametrize("num_subspaces", [1, 2])
def test_batched_forward_equals_per_member_forward_on_an_mlp(num_subspaces):
    model = mlp()
    es = make_strategy(model, num_subspaces)
    inputs = torch.randn(len(MEMBER_OF_ROW), 6, generator=torch.Generator().manual_seed(1))
    batched = batched_outputs(es, inputs, MEMBER_OF_ROW, lambda m, x: m(x))
    for row, member in enumerate(MEMBER_OF_ROW.tolist()):
        explicit = member_model(model, es, member)(inputs[row : row + 1])
        torch.testing.assert_close(batched[row : row + 1], explicit, rtol=1e-5, atol=1e-6)
    # The noise is visible: the batched output is not the unperturbed one.
    assert not torch.allclose(batched, model(inputs), atol=1e-3)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("num_subspaces", [1, 3])
def test_batched_forward_equals_per_member_forward_on_a_tiny_qwen3(tied, num_subspaces):
    model = tiny_lm(tied)
    es = make_strategy(model, num_subspaces, population=6)
    member_of_row = torch.tensor([5, 0, 2, 2, 1, 3, 4])
    token_ids = torch.randint(0, 61, (len(member_of_row), 9), generator=torch.Generator().manual_seed(2))
    targeted = {m.param.name for m in es.matrices}
    assert ("model.embed_tokens.weight" in targeted) == tied  # a tied lm_head is one matrix named by its first use
    assert "model.layers.0.self_attn.q_proj.weight" in targeted and "model.norm.weight" in es.frozen_names
    batched = batched_outputs(es, token_ids, member_of_row, lm_logits)
    for row, member in enumerate(member_of_row.tolist()):
        explicit = lm_logits(member_model(model, es, member), token_ids[row : row + 1])
        # Two float32 stacks of ~20 GEMMs that differ only in summation order.
        torch.testing.assert_close(batched[row : row + 1], explicit, rtol=1e-4, atol=1e-5)


def test_evaluation_never_writes_the_weights_and_the_update_only_moves_matrices():
    model = tiny_lm()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    es = make_strategy(model, 1)
    rewards = es.evaluate(lambda m, rows: _lm_rewards(m, rows, es.population))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed during evaluation"
    stats = es.apply_update(rewards)
    assert stats.update_norm > 0 and stats.restore_seconds == 0.0
    targeted = {m.param.name for m in es.matrices}
    for name, tensor in model.state_dict().items():
        canonical = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(tensor, before[name]) != (canonical in targeted), name


@pytest.mark.parametrize("num_subspaces", [1, 2])
def test_update_equals_the_dense_sum_of_outer_products(num_subspaces):
    model = mlp()
    es = make_strategy(model, num_subspaces, population=6, fitness="per_question")
    weights_before = {m.param.name: m.weight.detach().double().clone() for m in es.matrices}
    plan = es.plan()
    rewards = torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    stats = es.apply_update(rewards)
    r_hat, _ = shape_fitness(rewards, "per_question")
    members_per_group = 6 // num_subspaces
    squared_norm = 0.0
    for matrix, group in zip(es.matrices, plan.partition):
        name = matrix.param.name
        delta = torch.zeros_like(weights_before[name])
        for member in range(6):
            if member % num_subspaces != int(group[0]):
                continue
            A, B = ck.lowrank_factors(
                seed=step_seed(SEED, 0),
                member=member,
                tensor_id=tensor_id_for(name),
                out_features=delta.shape[0],
                in_features=delta.shape[1],
                rank=es.rank,
            )
            delta += float(r_hat[member]) * (A.double() @ B.double().T)
        delta *= es.lr / (members_per_group * math.sqrt(es.rank))
        weight = matrix.weight.detach().double()
        torch.testing.assert_close(weight, weights_before[name] + delta, rtol=0, atol=1e-6)
        squared_norm += float((weight - weights_before[name]).square().sum())
    assert stats.update_norm == pytest.approx(math.sqrt(squared_norm), rel=1e-6)


def test_equal_rewards_give_a_zero_update_not_nan():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    stats = make_strategy(model, 1).step(lambda m, rows: torch.full((4, 3), 0.5))
    assert stats.zero_update and stats.update_norm == 0.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------- learning


def _regression_problem() -> tuple[torch.Tensor, torch.Tensor]:
    teacher = mlp(seed=1)
    inputs = torch.randn(12, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return inputs, teacher(inputs)


def _mlp_rewards(model: nn.Module, row_members, population: int) -> torch.Tensor:
    """-MSE per (member, data point): every data point is one question, repeated for each member."""
    inputs, targets = _regression_problem()
    inputs = inputs.to(next(model.parameters()).dtype)
    member_of_row = torch.arange(population).repeat_interleave(len(inputs))
    with row_members(member_of_row):
        outputs = model(inputs.repeat(population, 1))
    return -(outputs.float() - targets.repeat(population, 1)).square().mean(dim=1).view(population, -1)


LM_CONTEXT = torch.randint(0, 61, (4, 10), generator=torch.Generator().manual_seed(5))
LM_TARGET = 7  # the token every question should be continued with


def _lm_rewards(model: nn.Module, row_members, population: int) -> torch.Tensor:
    """Log-probability of the fixed target token after each context, per (member, question), from the logits."""
    member_of_row = torch.arange(population).repeat_interleave(len(LM_CONTEXT))
    with row_members(member_of_row):
        logits = model(input_ids=LM_CONTEXT.repeat(population, 1)).logits[:, -1]
    return logits.log_softmax(dim=-1)[:, LM_TARGET].view(population, -1)


def _base_reward(model: nn.Module, rewards_fn: Callable) -> float:
    """The unperturbed model's mean reward: a population of one, outside any row_members block."""
    with torch.no_grad():
        return float(rewards_fn(model, lambda rows: contextlib.nullcontext(), 1).mean())


# (model, rewards, strategy settings, steps, the least gain): the MLP's reward is -MSE, so its gain is relative; the
# LM's is a log probability in nats, from near log(1/61) = -4.1 for a random model.
LEARNING_PROBLEMS = {
    "mlp regression": (mlp, _mlp_rewards, {"population": 16, "sigma": 0.05, "lr": 0.02}, 30,
                       lambda initial: 0.3 * abs(initial)),
    "tiny qwen3 target log-probability": (tiny_lm, _lm_rewards, {"population": 8, "sigma": 0.02, "lr": 0.05}, 20,
                                          lambda initial: 0.5),
}


@pytest.mark.parametrize("problem", sorted(LEARNING_PROBLEMS))
@pytest.mark.parametrize("num_subspaces", [1, 2])
def test_both_strategies_learn(num_subspaces, problem):
    build, rewards_fn, settings, steps, least_gain = LEARNING_PROBLEMS[problem]
    model = build()
    es = make_strategy(model, num_subspaces, rank=1, **settings)
    initial = _base_reward(model, rewards_fn)
    for _ in range(steps):
        es.step(lambda m, rows: rewards_fn(m, rows, es.population))
    final = _base_reward(model, rewards_fn)
    assert final > initial + least_gain(initial), (initial, final)


# ---------------------------------------------------------------- determinism and resume


def _train(model: nn.Module, steps: int, state: dict | None = None, **kwargs) -> dict:
    es = make_strategy(model, 2, population=6, **kwargs)
    if state is not None:
        es.load_state_dict(state)
    for _ in range(steps):
        es.step(lambda m, rows: _mlp_rewards(m, rows, es.population))
    return es.state_dict()


def test_two_runs_with_one_seed_give_bitwise_identical_weights():
    first, second, other_seed = mlp(), mlp(), mlp()
    _train(first, 3)
    _train(second, 3)
    _train(other_seed, 3, seed=SEED + 1)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(first.parameters(), other_seed.parameters()))


@pytest.mark.parametrize(
    "dtype, precision",
    [
        (torch.float32, "auto"),
        (torch.bfloat16, "auto"),  # stochastic rounding, keyed by the step seed
        (torch.bfloat16, "master_device"),
        (torch.bfloat16, "master_host"),
    ],
)
def test_state_round_trip_resumes_bit_exactly(dtype, precision):
    straight = mlp(dtype=dtype)
    _train(straight, 4, update_precision=precision)
    first_half = mlp(dtype=dtype)
    state = _train(first_half, 2, update_precision=precision)
    json.dumps({"step": state["step"], "config": state["config"]})  # everything but the tensors is JSON-able
    assert state["step"] == 2 and bool(state["master_weights"]) == precision.startswith("master")
    resumed = mlp(dtype=dtype)
    resumed.load_state_dict(first_half.state_dict())
    _train(resumed, 2, state=state, update_precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_loading_a_state_from_another_configuration_fails():
    state = _train(mlp(), 1)
    es = make_strategy(mlp(), 2, population=6, lr=0.5)
    with pytest.raises(ValueError, match="lr: saved 0.01 vs now 0.5"):
        es.load_state_dict(state)


# ---------------------------------------------------------------- the hybrid's groups


def test_hybrid_member_only_perturbs_its_groups_matrices():
    model = tiny_lm()
    es = make_strategy(model, 3, population=6)
    groups = [int(g[0]) for g in es.plan().partition]
    counts = torch.bincount(torch.tensor(groups), minlength=3)
    assert int(counts.max() - counts.min()) <= 1  # one chunk per matrix, dealt evenly
    # Probe: every linear's output minus the unperturbed F.linear of the same input, per batch row.
    deviations: dict[str, torch.Tensor] = {}

    def probe(name):
        def hook(module, inputs, output):
            base = F.linear(inputs[0], module.weight, module.bias)
            deviations[name] = (output - base).flatten(1).abs().amax(dim=1)

        return hook

    name_of_linear = {id(linear): matrix.param.name for matrix in es.matrices for _, linear in matrix.linears}
    handles = [
        module.register_forward_hook(probe(name_of_linear[id(module)]))
        for module in model.modules()
        if id(module) in name_of_linear
    ]
    member_of_row = torch.arange(6)
    batched_outputs(es, LM_CONTEXT[:1].repeat(6, 1), member_of_row, lm_logits)
    for handle in handles:
        handle.remove()
    assert set(deviations) == set(name_of_linear.values())
    for matrix, group in zip(es.matrices, groups):
        perturbed_rows = deviations[matrix.param.name] > 0
        assert perturbed_rows.tolist() == [member % 3 == group for member in range(6)], matrix.param.name
    # The next step draws a new grouping from its own seed.
    es.apply_update(torch.arange(6.0))
    assert [int(g[0]) for g in es.plan().partition] != groups


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma=0.0), "sigma"),
        (dict(lr=-1e-3), "lr"),
        (dict(sigma=math.nan), "sigma"),
        (dict(rank=0), "rank"),
        (dict(rank=17), "rank"),
        (dict(population=0), "population"),
        (dict(seed=-1), "seed"),
        (dict(fitness="median"), "fitness"),
        (dict(std_floor=-1.0), "std_floor"),
        (dict(update_precision="fp8"), "update_precision"),
        (dict(exclude="*"), "select no parameter"),
        (dict(include="*.bias"), "no nn.Linear weight"),
    ],
)
def test_eggroll_rejects_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EGGROLL(mlp(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_subspaces=0), "num_subspaces"),
        (dict(population=6, num_subspaces=4), "divisible by num_subspaces"),
        (dict(population=10, num_subspaces=5), "num_subspaces=5 exceeds the 4 targeted matrices"),
    ],
)
def test_hybrid_rejects_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CoPESLowRank(mlp(), **kwargs)


def test_row_members_misuse_fails_clearly():
    model = mlp()
    es = make_strategy(model, 1)
    with pytest.raises(RuntimeError, match="only valid inside fitness_fn"), es.row_members(torch.tensor([0])):
        pass

    def out_of_range(m, rows):
        with rows(torch.tensor([0, 4])):
            return torch.zeros(4)

    def wrong_batch(m, rows):
        with rows(torch.tensor([0, 1])):
            m(torch.randn(3, 6))

    with pytest.raises(ValueError, match=r"values must lie in \[0, 4\)"):
        es.evaluate(out_of_range)
    with pytest.raises(ValueError, match="'0' got input \\(3, 6\\) inside row_members\\(...\\) of 2 rows"):
        es.evaluate(wrong_batch)
    with pytest.raises(ValueError, match=r"rewards must be \[4\] or \[4, Q\]"):
        es.step(lambda m, rows: torch.zeros(3))
    # A failed evaluation leaves the plain layers behind.
    assert all("forward" not in layer.__dict__ for layer in model if isinstance(layer, nn.Linear))


def test_a_tied_weight_read_by_an_unsupported_module_is_rejected():
    class ScaledEmbedding(nn.Embedding):
        pass

    model = nn.Sequential(ScaledEmbedding(20, 8), nn.Linear(8, 20, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match="'0' \\(ScaledEmbedding\\) also reads"):
        EGGROLL(model)
