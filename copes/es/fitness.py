"""Fitness shaping: raw member rewards -> the coefficients r_hat that weight each member's noise in the update.

Rewards arrive as `[N]` (one score per member) or `[N, Q]` (one score per member and question). Every mode
returns float64 coefficients `r_hat [N]`:

- `joint` (CoPES default): z-score of the per-member mean reward over all N members, whatever their subspace.
- `per_subspace`: z-score inside each subspace's group of members (needs `member_subspaces`).
- `centered_rank`: ranks of the per-member mean reward mapped linearly onto [-0.5, 0.5]; ties share their
  average rank, so equal rewards give equal (zero) coefficients.
- `per_question` (EGGROLL default): z-score each question's column across members, then average over questions,
  so an easy question everyone solves carries no weight.

A z-score whose standard deviation is below `std_floor` is replaced by zeros: equal rewards mean no signal, and
the update is exactly zero instead of 0/0 = NaN. Standard deviations are population ones (divide by the count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from copes.choices import FITNESS_MODES


def sanitize_rewards(rewards: torch.Tensor | Sequence[Any]) -> tuple[torch.Tensor, int]:
    """Score NaN / +-inf rewards (a crashed or missing rollout) as failures.

    Each invalid entry becomes the worst finite reward of the whole tensor (0 when none is finite), so one bad
    member can neither poison the statistics nor win. Returns (a clean float64 copy, number replaced).
    """
    clean = torch.as_tensor(rewards, dtype=torch.float64).detach().to("cpu").clone()
    invalid = ~torch.isfinite(clean)
    num_invalid = int(invalid.sum())
    if num_invalid:
        finite = clean[~invalid]
        clean[invalid] = finite.min() if finite.numel() else 0.0
    return clean, num_invalid


def _zscore(values: torch.Tensor, std_floor: float) -> torch.Tensor:
    """(values - mean) / std along dim 0; columns whose std is below the floor become zeros."""
    centered = values - values.mean(dim=0, keepdim=True)
    std = values.std(dim=0, correction=0, keepdim=True)
    return torch.where(std >= std_floor, centered / std.clamp_min(std_floor), torch.zeros_like(centered))


def _centered_ranks(values: torch.Tensor) -> torch.Tensor:
    """Average ranks (0 .. N-1, ties averaged) mapped onto [-0.5, 0.5]; all zeros for N = 1."""
    n = values.numel()
    if n == 1:
        return torch.zeros_like(values)
    # O(N^2) comparisons: N is a population size (tens), and this form gives tie-averaged ranks directly.
    below = (values[None, :] < values[:, None]).sum(dim=1).to(torch.float64)
    equal = (values[None, :] == values[:, None]).sum(dim=1).to(torch.float64)
    ranks = below + (equal - 1) / 2
    return ranks / (n - 1) - 0.5


def _member_subspaces(member_subspaces: torch.Tensor | Sequence[int] | None, n: int) -> torch.Tensor:
    if member_subspaces is None:
        raise ValueError("fitness mode 'per_subspace' needs member_subspaces (the subspace of each member)")
    groups = torch.as_tensor(member_subspaces, dtype=torch.int64).to("cpu").reshape(-1)
    if groups.numel() != n:
        raise ValueError(f"member_subspaces has {groups.numel()} entries but there are {n} members")
    return groups


def shape_fitness(
    rewards: torch.Tensor | Sequence[Any],
    mode: str = "joint",
    *,
    member_subspaces: torch.Tensor | Sequence[int] | None = None,
    std_floor: float = 1e-8,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Shape raw rewards `[N]` or `[N, Q]` into update coefficients `r_hat [N]` (float64).

    Returns `(r_hat, info)` with info = {mean, std, max, min} of the per-member mean reward (after
    sanitising), `num_invalid` (NaN/inf entries scored as failures) and `zero_update` (True when every
    coefficient is zero: no reward spread above `std_floor`, so the step must not move the weights).
    """
    if mode not in FITNESS_MODES:
        raise ValueError(f"fitness mode must be one of {FITNESS_MODES}, got {mode!r}")
    if not (math.isfinite(std_floor) and std_floor >= 0):
        raise ValueError(f"std_floor must be a finite number >= 0, got {std_floor}")
    clean, num_invalid = sanitize_rewards(rewards)
    if clean.dim() not in (1, 2) or clean.shape[0] == 0 or clean.numel() == 0:
        raise ValueError(f"rewards must be [N] or [N, Q] with N, Q >= 1, got shape {tuple(clean.shape)}")
    per_question = clean if clean.dim() == 2 else clean[:, None]
    per_member = per_question.mean(dim=1)

    if mode == "joint":
        r_hat = _zscore(per_member, std_floor)
    elif mode == "per_subspace":
        groups = _member_subspaces(member_subspaces, per_member.numel())
        r_hat = torch.zeros_like(per_member)
        for group in torch.unique(groups):
            in_group = groups == group
            r_hat[in_group] = _zscore(per_member[in_group], std_floor)
    elif mode == "centered_rank":
        r_hat = _centered_ranks(per_member)
    else:  # per_question
        r_hat = _zscore(per_question, std_floor).mean(dim=1)

    info = {
        "mean": float(per_member.mean()),
        "std": float(per_member.std(correction=0)),
        "max": float(per_member.max()),
        "min": float(per_member.min()),
        "num_invalid": num_invalid,
        "zero_update": not bool(r_hat.any()),
    }
    return r_hat, info
