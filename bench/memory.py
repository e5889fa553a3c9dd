"""Extra memory of perturb -> evaluate -> restore for each restore strategy, as a fraction of the weights.

For each mode one member is perturbed, evaluated (a prefill forward of a prompt batch) and restored, after one
warm-up member per subspace (so host buffers exist and are touched, as they are mid-step). Measured:

  held        memory still allocated once perturb() returns: the backup, resident while the member is evaluated.
  peak        the engine's own peak: the higher of perturb's peak and held + restore's peak (noise tiles and
              packing copies included); the evaluation's activations come on top of `held` only.
  persistent  what the warm-up members left allocated: the host buffers of the "host" modes.

Goals (from the issue): the device backup holds at most 1/K of the weights plus one chunk; the host backup
keeps at most one chunk on the device. They are judged on `held`. On CPU the host buffers live in the same
memory as the weights, so for the host modes `held` is the extra beyond those persistent buffers, i.e. what a
GPU would hold on the device; bench/gpu_check.sh measures it on a GPU.

    python bench/memory.py [--subspaces 4] [--hidden-size 640 ...]
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

import copes_kernels as ck
from copes.es.params import ParameterSpace

from common.harness import SIGMA, machine_note, pin_one_thread, report
from common.memory_probe import PeakMemory, compare_weights, reset_weights, snapshot
from common.models import (
    add_large_model_arguments,
    build_large_model,
    large_model_shape,
    parameter_count,
    random_prompts,
    weight_bytes,
)

SEED, MEMBER = 5, 0


@dataclass(frozen=True)
class Mode:
    restore: str
    streamed: bool  # stream_elements = one chunk: every parameter is processed one chunk-sized slice at a time


MODES = {
    "device": Mode("device", streamed=False),
    "host": Mode("host", streamed=False),
    "host, streamed": Mode("host", streamed=True),
    "subtract": Mode("subtract", streamed=False),
}


def make_space(model: PreTrainedModel, mode: Mode, chunk_size: int) -> ParameterSpace:
    with warnings.catch_warnings():
        # "subtract" warns that it is inexact; here that is measured (the exact_restore column) on purpose.
        warnings.simplefilter("ignore", UserWarning)
        return ParameterSpace(model, chunk_size=chunk_size, restore=mode.restore,
                              stream_elements=chunk_size if mode.streamed else None)


def subspace_share(space: ParameterSpace, partition: list[torch.Tensor], subspace: int) -> float:
    """Fraction of the trainable elements in `subspace`'s chunks (the partition balances chunk counts, not sizes)."""
    owned = 0
    for param, chunks in zip(space.parameters, partition):
        lengths = torch.full((chunks.numel(),), space.chunk_size, dtype=torch.int64)
        lengths[-1] = param.numel - space.chunk_size * (chunks.numel() - 1)
        owned += int(lengths[chunks.cpu() == subspace].sum())
    return owned / space.numel


def measure_mode(
    space: ParameterSpace, partition: list[torch.Tensor], num_subspaces: int, evaluate: Callable[[], None]
) -> dict[str, int]:
    """Warm up one member per subspace, then perturb, evaluate and restore member MEMBER of subspace 0."""
    sigma = math.sqrt(num_subspaces) * SIGMA
    with PeakMemory() as warmup:
        for subspace in range(num_subspaces):
            space.perturb(partition, seed=SEED, member=MEMBER + 1 + subspace, subspace=subspace, sigma=sigma)
            space.restore()
    with PeakMemory() as perturb:
        space.perturb(partition, seed=SEED, member=MEMBER, subspace=0, sigma=sigma)
    held = perturb.held()
    evaluate()
    with PeakMemory() as restore:
        space.restore()
    return {
        "held": held,
        "peak": max(perturb.peak_bytes, held + restore.peak_bytes),
        "persistent": warmup.held(),
    }


def measure(
    model: PreTrainedModel, *, subspaces: int, chunk_size: int, batch: int, prompt_tokens: int
) -> list[dict[str, Any]]:
    """One row per restore mode: held and peak memory of a perturb -> evaluate -> restore cycle, exactness."""
    prompts = random_prompts(batch, prompt_tokens, vocab_size=model.config.vocab_size)

    def evaluate() -> None:
        with torch.inference_mode():
            model(prompts, logits_to_keep=1)

    evaluate()  # first-call allocations happen here, not inside a measured cycle
    weights = weight_bytes(model)
    chunk_bytes = chunk_size * next(model.parameters()).element_size()
    bounds = {"device": 1 / subspaces + chunk_bytes / weights, "host": chunk_bytes / weights}
    rows = []
    for name, mode in MODES.items():
        space = make_space(model, mode, chunk_size)
        partition = space.partition(SEED, subspaces)
        original = snapshot(space)
        measured = measure_mode(space, partition, subspaces, evaluate)
        check = compare_weights(space, original)
        reset_weights(space, original)  # "subtract" drifts; the next mode starts from the same weights
        bound = bounds.get(mode.restore)
        held = measured["held"] / weights
        rows.append({
            "mode": name,
            "K": subspaces,
            "subspace_share": subspace_share(space, partition, subspace=0),
            "held_MB": measured["held"] / 1e6,
            "held_of_weights": held,
            "peak_MB": measured["peak"] / 1e6,
            "peak_of_weights": measured["peak"] / weights,
            "persistent_host_MB": measured["persistent"] / 1e6 if mode.restore == "host" else 0.0,
            "bound_of_weights": "-" if bound is None else bound,
            "goal_held_le_bound": "-" if bound is None else ("met" if held <= bound else "not met"),
            "exact_restore": "yes" if check.exact else "no",
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subspaces", type=int, default=4, help="K (paper: 4)")
    parser.add_argument("--chunk-size", type=int, default=ck.DEFAULT_CHUNK_SIZE, help="elements per chunk")
    parser.add_argument("--batch", type=int, default=16, help="prompts in the evaluation forward")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    add_large_model_arguments(parser)
    args = parser.parse_args(argv)
    pin_one_thread()

    model = build_large_model(large_model_shape(args))
    rows = measure(model, subspaces=args.subspaces, chunk_size=args.chunk_size, batch=args.batch,
                   prompt_tokens=args.prompt_tokens)
    title = (f"perturb -> evaluate -> restore memory, {parameter_count(model) / 1e6:.1f}M-parameter model, "
             f"{weight_bytes(model) / 1e6:.0f} MB of weights ({machine_note()})")
    report("memory", rows, title)


if __name__ == "__main__":
    main()
