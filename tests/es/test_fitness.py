"""Fitness shaping: each mode against a hand computation, degenerate rewards, and invalid rewards."""

from __future__ import annotations

import math

import pytest
import torch

from copes.es.fitness import FITNESS_MODES, sanitize_rewards, shape_fitness

NAN, INF = math.nan, math.inf


def test_joint_is_the_zscore_of_member_means():
    rewards = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 1.0], [5.0, 4.0]])
    r_hat, info = shape_fitness(rewards, "joint")
    means = rewards.double().mean(dim=1)
    expected = (means - means.mean()) / means.std(correction=0)
    assert r_hat.dtype == torch.float64
    torch.testing.assert_close(r_hat, expected)
    assert info["mean"] == pytest.approx(float(means.mean()))
    assert info["max"] == 4.5 and info["min"] == 0.5
    assert info["num_invalid"] == 0 and info["zero_update"] is False


def test_per_subspace_standardises_each_group_separately():
    rewards = torch.tensor([1.0, 100.0, 2.0, 200.0, 3.0, 300.0])  # group 1 lives on a 100x larger scale
    groups = torch.tensor([0, 1, 0, 1, 0, 1])
    r_hat, _ = shape_fitness(rewards, "per_subspace", member_subspaces=groups)
    for group in (0, 1):
        selected = r_hat[groups == group]
        assert float(selected.mean()) == pytest.approx(0.0, abs=1e-12)
        assert float(selected.std(correction=0)) == pytest.approx(1.0)
    torch.testing.assert_close(r_hat[groups == 0], r_hat[groups == 1])


def test_per_subspace_needs_one_subspace_per_member():
    with pytest.raises(ValueError, match="member_subspaces"):
        shape_fitness(torch.arange(4.0), "per_subspace")
    with pytest.raises(ValueError, match="member_subspaces has 3 entries"):
        shape_fitness(torch.arange(4.0), "per_subspace", member_subspaces=[0, 1, 0])


def test_centered_ranks_span_half_interval_and_average_ties():
    r_hat, _ = shape_fitness(torch.tensor([10.0, -3.0, 7.0, 7.0, 0.5]), "centered_rank")
    # ranks: -3 -> 0, 0.5 -> 1, the two 7s share (2 + 3) / 2, 10 -> 4; mapped by rank / 4 - 0.5
    torch.testing.assert_close(r_hat, torch.tensor([0.5, -0.5, 0.125, 0.125, -0.25], dtype=torch.float64))
    # Ranks ignore the scale: a monotone transform of the rewards changes nothing.
    transformed, _ = shape_fitness(torch.tensor([10.0, -3.0, 7.0, 7.0, 0.5]).exp(), "centered_rank")
    torch.testing.assert_close(transformed, r_hat)


def test_per_question_zscores_columns_then_averages():
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    r_hat, info = shape_fitness(rewards, "per_question")
    columns = rewards.double()
    z = (columns - columns.mean(0)) / columns.std(0, correction=0)
    z[:, 2] = 0.0  # every member solved question 2: no signal, not 0/0
    torch.testing.assert_close(r_hat, z.mean(dim=1))
    assert not info["zero_update"]


def test_one_dimensional_rewards_make_per_question_equal_joint():
    rewards = torch.tensor([0.3, 0.9, 0.1, 0.5])
    torch.testing.assert_close(shape_fitness(rewards, "per_question")[0], shape_fitness(rewards, "joint")[0])


@pytest.mark.parametrize("mode", FITNESS_MODES)
def test_equal_rewards_give_zero_update_without_nan(mode):
    r_hat, info = shape_fitness(torch.full((8, 3), 0.25), mode, member_subspaces=torch.arange(8) % 4)
    assert torch.equal(r_hat, torch.zeros(8, dtype=torch.float64))
    assert info["zero_update"] is True and info["std"] == 0.0


def test_spread_below_the_std_floor_counts_as_no_signal():
    rewards = torch.tensor([1.0, 1.0 + 1e-12, 1.0])
    assert shape_fitness(rewards, std_floor=1e-8)[1]["zero_update"] is True
    assert shape_fitness(rewards, std_floor=0.0)[1]["zero_update"] is False


def test_sanitize_scores_invalid_rewards_as_the_worst_finite_one():
    rewards = torch.tensor([0.5, NAN, -2.0, INF, -INF, 1.0])
    clean, replaced = sanitize_rewards(rewards)
    assert replaced == 3
    assert torch.equal(clean, torch.tensor([0.5, -2.0, -2.0, -2.0, -2.0, 1.0], dtype=torch.float64))
    assert math.isnan(float(rewards[1])), "the caller's tensor must not be modified"


def test_sanitize_all_invalid_gives_zeros():
    clean, replaced = sanitize_rewards(torch.tensor([[NAN, INF], [NAN, NAN]]))
    assert replaced == 4 and torch.equal(clean, torch.zeros(2, 2, dtype=torch.float64))


@pytest.mark.parametrize("mode", FITNESS_MODES)
def test_invalid_rewards_are_counted_and_never_win(mode):
    rewards = torch.tensor([[0.2, 0.4], [NAN, 0.9], [0.8, 0.6], [0.1, 0.3]])
    r_hat, info = shape_fitness(rewards, mode, member_subspaces=[0, 0, 0, 0])
    assert info["num_invalid"] == 1
    assert bool(torch.isfinite(r_hat).all())
    # Member 1's missing answer is scored as the worst reward (0.1), so it cannot beat member 2.
    assert float(r_hat[1]) < float(r_hat[2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mode="zscore"), "fitness mode"),
        (dict(std_floor=-1.0), "std_floor"),
        (dict(std_floor=NAN), "std_floor"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shape_fitness(torch.arange(4.0), **kwargs)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (2, 2, 2), ()])
def test_bad_reward_shapes_raise(shape):
    with pytest.raises(ValueError, match="rewards must be"):
        shape_fitness(torch.zeros(shape))
