"""CoPES and standard ES (K=1): learning, the update against a dense reference, exact restores, determinism,
streaming, resume, degenerate and invalid rewards, and argument validation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from transformers import Qwen3ForCausalLM

import copes
from copes.es.strategies import EGGROLL, PER_MEMBER, WHOLE_POPULATION
from copes.es.strategies.copes import CoPES, StepStats, step_seed

from helpers.es_helpers import DTYPES, dense_member_noise, flat_weights, toy_mlp
from helpers.tiny_models import tiny_qwen3

# A fixed regression task for the toy MLP (5 -> 17 -> 3).
_inputs = torch.randn(64, 5, generator=torch.Generator().manual_seed(1))
_targets = torch.sin(_inputs @ torch.randn(5, 3, generator=torch.Generator().manual_seed(2)))
# The target sequence whose log-probability the tiny LM learns to raise.
_target_tokens = torch.tensor([[5, 17, 42, 8, 33, 21, 9, 60]])


@torch.no_grad()
def negative_mse(model: nn.Module) -> float:
    dtype = next(model.parameters()).dtype
    return -float(((model(_inputs.to(dtype)).float() - _targets) ** 2).mean())


@torch.no_grad()
def target_log_prob(model: Qwen3ForCausalLM) -> float:
    """Mean log-probability of each target token given the ones before it (teacher forcing)."""
    logits = model(input_ids=_target_tokens).logits.float()
    log_probs = torch.log_softmax(logits[0, :-1], dim=-1)
    return float(log_probs.gather(1, _target_tokens[0, 1:, None]).mean())


def run_steps(es: CoPES, fitness_fn, steps: int) -> list[StepStats]:
    return [es.step(fitness_fn) for _ in range(steps)]


def zscore(rewards: torch.Tensor) -> torch.Tensor:
    rewards = rewards.double()
    return (rewards - rewards.mean()) / rewards.std(correction=0)


# ---------------------------------------------------------------- learning


@pytest.mark.parametrize("num_subspaces", [4, 1])
def test_mlp_regression_improves(num_subspaces):
    model = toy_mlp()
    es = CoPES(model, population=8, num_subspaces=num_subspaces, sigma=0.03, lr=0.03, seed=3, chunk_size=16)
    before = negative_mse(model)
    stats = run_steps(es, negative_mse, 20)
    assert negative_mse(model) > before + 0.3 * abs(before), f"-MSE {before:.4f} -> {negative_mse(model):.4f}"
    assert [s.step for s in stats] == list(range(20)) and es.step_count == 20


# Standard ES spreads sigma over every weight (CoPES uses sqrt(K) sigma on 1/K of them): a larger lr suits it.
@pytest.mark.parametrize(("num_subspaces", "lr"), [(4, 0.05), (1, 0.08)])
def test_tiny_qwen3_raises_target_log_prob(num_subspaces, lr):
    model = tiny_qwen3()
    es = CoPES(model, population=8, num_subspaces=num_subspaces, sigma=0.05, lr=lr, seed=0, chunk_size=256)
    assert "lm_head.weight" not in es.space.names, "the tied head is the embedding: moved once"
    before = target_log_prob(model)
    run_steps(es, target_log_prob, 12)
    assert target_log_prob(model) > before + 0.2, f"log p {before:.3f} -> {target_log_prob(model):.3f}"


def test_adam_on_the_es_gradient_improves():
    model = toy_mlp()
    es = CoPES(model, population=8, num_subspaces=4, sigma=0.03, lr=0.02, seed=3, chunk_size=16, optimizer="adam")
    before = negative_mse(model)
    run_steps(es, negative_mse, 20)
    assert negative_mse(model) > before + 0.3 * abs(before), f"-MSE {before:.4f} -> {negative_mse(model):.4f}"


# ---------------------------------------------------------------- the math


@pytest.mark.parametrize(
    ("num_subspaces", "antithetic", "scale_sigma"),
    [(4, False, True), (2, True, True), (1, False, False), (4, True, False)],
)
def test_perturbations_and_update_equal_the_dense_reference(num_subspaces, antithetic, scale_sigma):
    model = toy_mlp()
    es = CoPES(model, population=8, num_subspaces=num_subspaces, sigma=0.02, lr=0.1, seed=5, chunk_size=7,
               antithetic=antithetic, scale_sigma=scale_sigma)
    theta = flat_weights(es.space)
    plan = es.plan()
    sigma_k = 0.02 * (math.sqrt(num_subspaces) if scale_sigma else 1.0)
    assert plan.sigma == pytest.approx(sigma_k)

    def member_noise(member: int) -> list[torch.Tensor]:
        return [
            float(plan.noise_sign[member]) * dense_member_noise(
                p.numel, part, chunk_size=7, subspace=int(plan.member_subspace[member]), seed=plan.seed,
                member=int(plan.noise_member[member]), tensor_id=p.tensor_id,
            )
            for p, part in zip(es.space.parameters, plan.partition)
        ]

    rewards = []
    for member in range(8):
        def check_and_score(m: nn.Module, member: int = member) -> float:
            for weights, base, noise in zip(flat_weights(es.space), theta, member_noise(member)):
                torch.testing.assert_close(weights, base + sigma_k * noise, rtol=0, atol=1e-7)
            return negative_mse(m)
        rewards.append(float(es.evaluate_member(member, check_and_score)))

    es.apply_update(torch.tensor(rewards))
    r_hat = zscore(torch.tensor(rewards))
    noises = [member_noise(member) for member in range(8)]
    for index, (after, base) in enumerate(zip(flat_weights(es.space), theta)):
        gradient = sum(float(r_hat[i]) / es.members_per_subspace * noises[i][index] for i in range(8))
        torch.testing.assert_close(after, base + 0.1 * gradient, rtol=1e-5, atol=1e-7)


def test_member_layout_interleaves_subspaces_and_pairs_antithetic_members():
    es = CoPES(toy_mlp(), population=8, num_subspaces=2, chunk_size=8, antithetic=True)
    plan = es.plan()
    assert plan.member_subspace.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert plan.noise_member.tolist() == [0, 1, 0, 1, 4, 5, 4, 5]
    assert plan.noise_sign.tolist() == [1, 1, -1, -1, 1, 1, -1, -1]
    assert plan.members_of(1) == [1, 3, 5, 7]
    assert es.plan() is plan, "one plan per step"


def test_step_seed_is_a_pinned_64_bit_function_of_seed_and_step():
    assert step_seed(0, 0) == 0xCFE358629F6705FA
    assert step_seed(7, 3) == 0x6C7AF8276EF34D79
    seeds = {step_seed(0, t) for t in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**64 for s in seeds)


def test_one_adam_step_is_lr_times_the_normalised_dense_gradient():
    model = toy_mlp()
    es = CoPES(model, population=4, num_subspaces=2, sigma=0.02, lr=1e-3, seed=9, chunk_size=7, optimizer="adam")
    theta = flat_weights(es.space)
    plan = es.plan()
    rewards = torch.tensor([0.1, 0.7, -0.3, 0.2])
    es.apply_update(rewards)
    r_hat = zscore(rewards)
    for param, part, after, base in zip(es.space.parameters, plan.partition, flat_weights(es.space), theta):
        gradient = sum(
            float(r_hat[i]) / 2 * dense_member_noise(
                param.numel, part, chunk_size=7, subspace=i % 2, seed=plan.seed, member=i, tensor_id=param.tensor_id
            )
            for i in range(4)
        )
        # First Adam step: m_hat = g, v_hat = g^2, so the step is lr * g / (|g| + eps).
        torch.testing.assert_close(after, base + 1e-3 * gradient / (gradient.abs() + 1e-8), rtol=1e-5, atol=1e-8)


def test_update_norm_is_the_norm_of_the_applied_change():
    model = toy_mlp()
    es = CoPES(model, population=8, num_subspaces=4, sigma=0.02, lr=0.05, chunk_size=8)
    before = torch.cat(flat_weights(es.space))
    stats = es.step(negative_mse)
    after = torch.cat(flat_weights(es.space))
    assert stats.update_norm == pytest.approx(float(torch.linalg.vector_norm((after - before).double())), rel=1e-9)
    assert stats.update_norm > 0 and not stats.zero_update
    assert stats.max_reward >= stats.mean_reward >= stats.min_reward and stats.std_reward > 0
    assert min(stats.perturb_seconds, stats.rollout_seconds, stats.restore_seconds, stats.update_seconds) > 0


# ---------------------------------------------------------------- exact restore


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("restore", ["device", "host"])
def test_restore_is_bit_exact_after_every_member(dtype, restore):
    model = tiny_qwen3(dtype=dtype)
    es = CoPES(model, population=8, num_subspaces=4, sigma=0.05, chunk_size=64, restore=restore, stream_elements=1000)
    original = flat_weights(es.space)
    plan = es.plan()

    def check(m: nn.Module, member: int) -> float:
        # The previous member's perturbation must be gone: outside this member's subspace nothing has moved.
        subspace = int(plan.member_subspace[member])
        for weights, base, part in zip(flat_weights(es.space), original, plan.partition):
            outside = part.to(torch.int64).repeat_interleave(es.space.chunk_size)[: base.numel()] != subspace
            assert torch.equal(weights[outside], base[outside])
            assert not torch.equal(weights[~outside], base[~outside]) or (~outside).sum() == 0
        return target_log_prob(m)

    rewards = [es.evaluate_member(i, lambda m, i=i: check(m, i)) for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(flat_weights(es.space), original))
    assert all(math.isfinite(float(r)) for r in rewards)


def test_weights_are_restored_when_fitness_raises():
    model = toy_mlp(torch.bfloat16)
    es = CoPES(model, population=4, num_subspaces=2, chunk_size=8)
    original = flat_weights(es.space)

    def crash(_: nn.Module) -> float:
        raise RuntimeError("rollout failed")

    with pytest.raises(RuntimeError, match="rollout failed"):
        es.evaluate_member(1, crash)
    assert all(torch.equal(a, b) for a, b in zip(flat_weights(es.space), original))
    es.step(negative_mse)  # and the step can still run


# ---------------------------------------------------------------- determinism, streaming, resume


def _trained_weights(steps: int = 3, **options) -> list[torch.Tensor]:
    dtype = options.pop("dtype", torch.float32)
    es = CoPES(toy_mlp(dtype), population=8, num_subspaces=4, sigma=0.02, lr=0.05, chunk_size=8, **options)
    run_steps(es, negative_mse, steps)
    return flat_weights(es.space)


def _bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_seed_gives_bitwise_identical_runs():
    assert _bit_equal(_trained_weights(seed=11), _trained_weights(seed=11))
    assert not _bit_equal(_trained_weights(seed=11), _trained_weights(seed=12))


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(dtype=torch.bfloat16),
        dict(dtype=torch.float16, update_precision="master_host", restore="host"),
        dict(dtype=torch.bfloat16, optimizer="adam", antithetic=True),
    ],
)
def test_stream_slices_of_any_size_give_identical_weights(options):
    whole = _trained_weights(**options)
    for stream_elements in (5, 29):
        assert _bit_equal(_trained_weights(stream_elements=stream_elements, **options), whole)


def _json_leaves_or_tensors(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_leaves_or_tensors(v) for k, v in value.items())
    if isinstance(value, torch.Tensor):
        return True
    json.dumps(value)
    return True


@pytest.mark.parametrize(
    "options",
    [dict(), dict(dtype=torch.bfloat16, optimizer="adam", update_precision="master_host", antithetic=True)],
)
def test_state_dict_round_trip_continues_bit_exactly(options):
    dtype = options.pop("dtype", torch.float32)
    settings = dict(population=8, num_subspaces=2, sigma=0.02, lr=0.01, seed=4, chunk_size=8, **options)
    uninterrupted = CoPES(toy_mlp(dtype), **settings)
    run_steps(uninterrupted, negative_mse, 4)

    first = CoPES(toy_mlp(dtype), **settings)
    run_steps(first, negative_mse, 2)
    state = first.state_dict()
    assert _json_leaves_or_tensors(state)
    saved_weights = {k: v.clone() for k, v in first.model.state_dict().items()}

    resumed_model = toy_mlp(dtype, seed=99)  # different weights, replaced by the checkpoint's
    resumed_model.load_state_dict(saved_weights)
    resumed = CoPES(resumed_model, **settings)
    resumed.load_state_dict(state)
    assert resumed.step_count == 2
    run_steps(resumed, negative_mse, 2)
    assert _bit_equal(flat_weights(resumed.space), flat_weights(uninterrupted.space))


def test_load_state_dict_rejects_a_different_configuration():
    state = CoPES(toy_mlp(), population=8, num_subspaces=4, chunk_size=8).state_dict()
    other = CoPES(toy_mlp(), population=8, num_subspaces=2, chunk_size=8, lr=1e-3)
    with pytest.raises(ValueError, match="lr: saved 0.0005 vs now 0.001.*num_subspaces: saved 4 vs now 2"):
        other.load_state_dict(state)


# ---------------------------------------------------------------- degenerate and invalid rewards


def test_equal_rewards_give_a_zero_update():
    es = CoPES(toy_mlp(), population=8, num_subspaces=4, chunk_size=8)
    original = flat_weights(es.space)
    stats = es.step(lambda _: 0.5)
    assert stats.zero_update and stats.update_norm == 0.0 and stats.std_reward == 0.0
    assert _bit_equal(flat_weights(es.space), original)


def test_nan_rewards_are_counted_and_scored_as_the_worst_reward():
    rewards = torch.tensor([0.3, math.nan, -0.2, 0.9, math.inf, 0.1, 0.0, 0.4])
    es_nan = CoPES(toy_mlp(), population=8, num_subspaces=4, chunk_size=8)
    stats = es_nan.apply_update(rewards)
    es_worst = CoPES(toy_mlp(), population=8, num_subspaces=4, chunk_size=8)
    es_worst.apply_update(torch.where(torch.isfinite(rewards), rewards, torch.tensor(-0.2)))
    assert stats.num_invalid_rewards == 2 and math.isfinite(stats.update_norm)
    assert _bit_equal(flat_weights(es_nan.space), flat_weights(es_worst.space))


def test_per_question_rewards_pad_missing_answers_and_report_progress():
    es = CoPES(toy_mlp(), population=4, num_subspaces=2, chunk_size=8, fitness="per_question")
    calls = iter([[1.0, 0.0, 1.0], (0.0, 1.0), [1.0, None, 0.5], torch.tensor([0.5, 0.5, 0.5])])
    seen: list[int] = []
    stats = es.step(lambda _: next(calls), on_member=lambda i, r: seen.append(i))
    assert seen == [0, 1, 2, 3]
    assert stats.num_invalid_rewards == 2  # member 1's third answer is missing, member 2's second is None
    assert not stats.zero_update


def test_mixing_scalar_and_per_question_rewards_fails_clearly():
    es = CoPES(toy_mlp(), population=2, num_subspaces=1, chunk_size=8)
    results = iter([0.5, [0.5, 0.1]])
    with pytest.raises(ValueError, match="scalar for some members"):
        es.step(lambda _: next(results))
    with pytest.raises(TypeError, match="got str"):
        es.step(lambda _: "0.5")


def test_apply_update_checks_the_reward_shape():
    es = CoPES(toy_mlp(), population=4, num_subspaces=2, chunk_size=8)
    with pytest.raises(ValueError, match=r"rewards must be \[4\]"):
        es.apply_update(torch.zeros(3))
    with pytest.raises(ValueError, match="member must be in"):
        es.evaluate_member(4, negative_mse)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(sigma=0.0), "sigma"),
        (dict(sigma=-1e-3), "sigma"),
        (dict(sigma=math.nan), "sigma"),
        (dict(lr=0.0), "lr"),
        (dict(lr=-1.0), "lr"),
        (dict(population=10, num_subspaces=4), "population=10 must be divisible by num_subspaces=4"),
        (dict(population=0), "population"),
        (dict(num_subspaces=0), "num_subspaces"),
        (dict(population=12, num_subspaces=4, antithetic=True), "antithetic"),
        (dict(fitness="rank"), "fitness"),
        (dict(optimizer="rmsprop"), "optimizer"),
        (dict(adam_betas=(0.9, 1.0)), "adam_betas"),
        (dict(adam_eps=0.0), "adam_eps"),
        (dict(std_floor=-1.0), "std_floor"),
        (dict(seed=-1), "seed"),
        (dict(restore="disk"), "restore"),
        (dict(update_precision="fp8"), "update_precision"),
        (dict(optimizer="adam", update_precision="stochastic"), "update_precision='stochastic'"),
        (dict(stream_elements=0), "stream_elements"),
        (dict(include="encoder.*"), "select no parameter"),
    ],
)
def test_invalid_hyperparameters_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CoPES(toy_mlp(), **{"chunk_size": 8, **kwargs})


def test_adam_on_16_bit_weights_keeps_fp32_masters_by_default():
    es = CoPES(toy_mlp(torch.bfloat16), population=4, num_subspaces=2, chunk_size=8, optimizer="adam")
    assert {p.precision for p in es.space.parameters} == {"master_device"}
    assert {p.precision for p in CoPES(toy_mlp(torch.bfloat16), chunk_size=8).space.parameters} == {"stochastic"}


def test_too_few_chunks_shrink_the_chunk_size_with_a_warning():
    with pytest.warns(UserWarning, match="using chunk_size"):
        es = CoPES(toy_mlp(), population=16, num_subspaces=16)
    assert sum(es.space.chunk_counts) >= 16


def test_package_exports_the_strategy():
    assert copes.CoPES is CoPES


def test_each_strategy_names_the_evaluation_shape_the_trainer_dispatches_on():
    assert CoPES(toy_mlp(), population=4, num_subspaces=2).evaluation == PER_MEMBER
    assert EGGROLL(toy_mlp(), population=4).evaluation == WHOLE_POPULATION
    assert isinstance(copes.CoPES, type) and copes.Trainer.__name__ == "Trainer" and callable(copes.train)
