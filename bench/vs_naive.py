"""Perturb + restore of one member: the engine (ParameterSpace, restore="device") against the way existing ES code
does it, on the same model in the same run, for K = 1 (standard ES) and K = 4 (CoPES).

The naive way: per parameter, a generator seeded from (seed, member, tensor), a full-size float32 `torch.randn`,
zeroed outside the member's subspace when K > 1 (element masks built once per step, outside the timing and the
memory count), `add_`; to restore, the same noise is regenerated and subtracted. The engine backs up the
subspace's chunks, perturbs them in place from the noise contract, and copies the backup back.

Reported per K: seconds per perturb + restore (speed-up = naive / engine), peak extra memory of one cycle
(ratio = engine / naive; the engine's backup stays resident while the member is evaluated, the naive noise is
transient), and whether the weights come back bit for bit. Time is measured before memory (see PeakMemory).

    python bench/vs_naive.py [--repeats 3] [--hidden-size 640 ...]
"""

from __future__ import annotations

import argparse
import math
from functools import partial
from typing import Any

import torch

from copes.es.params import ParameterSpace

from common.harness import (
    SIGMA,
    SUBSPACES,
    alternating_best_seconds,
    element_masks,
    machine_note,
    pin_one_thread,
    report,
    seeded_randn,
)
from common.memory_probe import PeakMemory, RestoreCheck, compare_weights, reset_weights, snapshot
from common.models import add_large_model_arguments, build_large_model, large_model_shape, parameter_count, weight_bytes

# K = 1 is standard ES; K = SUBSPACES (4, the paper's default) is the only K the naive element masks are built for.
SUBSPACE_COUNTS = (1, SUBSPACES)
SEED, MEMBER, SUBSPACE = 11, 3, 0


class EnginePerturbation:
    """One member's perturbation through the engine, restored from the device backup of its subspace."""

    def __init__(self, space: ParameterSpace, num_subspaces: int) -> None:
        self.space = space
        self.partition = space.partition(SEED, num_subspaces)
        self.sigma = math.sqrt(num_subspaces) * SIGMA

    def perturb(self) -> None:
        self.space.perturb(self.partition, seed=SEED, member=MEMBER, subspace=SUBSPACE, sigma=self.sigma)

    def restore(self) -> None:
        self.space.restore()


class NaivePerturbation:
    """One member's perturbation the way ES code without a noise contract does it (see the module docstring)."""

    def __init__(self, space: ParameterSpace, num_subspaces: int) -> None:
        self.parameters = space.parameters
        self.sigma = math.sqrt(num_subspaces) * SIGMA
        # Per parameter: True for the elements outside the member's subspace (None when K = 1: no mask).
        self.outside: list[torch.Tensor | None] = [None] * len(space.parameters)
        if num_subspaces > 1:
            partition = space.partition(SEED, num_subspaces)
            self.outside = [
                element_masks(chunks, param.numel, space.chunk_size)[SUBSPACE].logical_not_()
                for chunks, param in zip(partition, space.parameters)
            ]

    def _add_noise(self, sign: float) -> None:
        for param, outside in zip(self.parameters, self.outside):
            noise = seeded_randn(param.data.shape, seed=SEED, member=MEMBER, tensor_id=param.tensor_id)
            if outside is not None:
                noise.view(-1).masked_fill_(outside, 0.0)  # in place: no float copy of the mask
            param.data.add_(noise, alpha=sign * self.sigma)

    def perturb(self) -> None:
        self._add_noise(+1.0)

    def restore(self) -> None:
        self._add_noise(-1.0)


Perturbation = EnginePerturbation | NaivePerturbation
IMPLEMENTATIONS: dict[str, type[EnginePerturbation | NaivePerturbation]] = {
    "engine": EnginePerturbation, "naive": NaivePerturbation,
}


def cycle(perturbation: Perturbation) -> None:
    """Perturb one member and undo it (the member's evaluation in between is not part of this benchmark)."""
    perturbation.perturb()
    perturbation.restore()


def check_restore(space: ParameterSpace, perturbation: Perturbation, original: list[torch.Tensor]) -> RestoreCheck:
    """One perturb + restore from the original weights; compare, then put the original weights back."""
    cycle(perturbation)
    check = compare_weights(space, original)
    reset_weights(space, original)
    return check


def peak_cycle_bytes(perturbation: Perturbation) -> int:
    with PeakMemory() as memory:
        cycle(perturbation)
    return memory.peak_bytes


def measure(model: torch.nn.Module, repeats: int) -> list[dict[str, Any]]:
    """Engine vs naive perturb + restore of one member on `model`, for each K: time, peak memory, exactness."""
    space = ParameterSpace(model, restore="device")
    original = snapshot(space)
    weights = weight_bytes(model)
    cases = {(k, name): IMPLEMENTATIONS[name](space, k) for k in SUBSPACE_COUNTS for name in IMPLEMENTATIONS}
    # All timings before any memory measurement: PeakMemory pins the allocator, which slows allocations.
    seconds = {}
    for k in SUBSPACE_COUNTS:
        runs = {name: partial(cycle, cases[(k, name)]) for name in IMPLEMENTATIONS}
        seconds.update({(k, name): value for name, value in alternating_best_seconds(runs, repeats).items()})
    reset_weights(space, original)  # the naive timing cycles drift; start clean
    checks = {key: check_restore(space, perturbation, original) for key, perturbation in cases.items()}
    peaks = {key: peak_cycle_bytes(perturbation) for key, perturbation in cases.items()}
    rows = []
    for (k, name), check in checks.items():
        naive = (k, "naive")
        rows.append({
            "K": k,
            "implementation": name,
            "perturb_restore_s": seconds[(k, name)],
            "speedup_vs_naive": seconds[naive] / seconds[(k, name)],
            "peak_extra_MB": peaks[(k, name)] / 1e6,
            "peak_extra_vs_naive": peaks[(k, name)] / peaks[naive],
            "peak_extra_of_weights": peaks[(k, name)] / weights,
            "exact_restore": "yes" if check.exact else "no",
            "mismatched_elements": check.mismatched,
            "max_abs_error": check.max_abs_error,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed perturb + restore rounds (the best is kept)")
    add_large_model_arguments(parser)
    args = parser.parse_args(argv)
    pin_one_thread()

    model = build_large_model(large_model_shape(args))
    title = (f"one member's perturb + restore, engine vs naive, {parameter_count(model) / 1e6:.1f}M-parameter "
             f"Qwen3.5-architecture model ({machine_note()})")
    report("vs_naive", measure(model, args.repeats), title)


if __name__ == "__main__":
    main()
