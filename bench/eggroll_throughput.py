"""EGGROLL's batched population forward against plain batched inference on the same batch and tokens.

Every batch row belongs to one of N members (rows_per_member rows each); inside EGGROLL's `row_members` every
linear layer runs as one base GEMM for the whole batch plus a rank-r term per row (`ck.lowrank_linear`), and a
tied embedding gets its per-row correction. The plain run is the same model on the same token ids without
`row_members`. Both process exactly the same tokens (generation is forced to `new_tokens` tokens per row), so
the throughput ratio is plain seconds / population seconds. Goal: >= 0.91, the EGGROLL paper's figure.

Measured for a prefill forward (logits of the last position only, as generation needs) and for greedy
generation, on the tiny model and on the random ~100M-parameter Qwen3.5-architecture model. `factors_s` is the
once-per-step generation of every member's factors; `ratio_with_factors` charges it to this one batch.

    python bench/eggroll_throughput.py [--tiny-model PATH] [--large-population 8] ...
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

import copes
from copes.es.strategies.eggroll import RowMembers
from copes.modeling import load_model

from common.harness import DEVICE, SIGMA, alternating_best_seconds, machine_note, pin_one_thread, report, synchronize
from common.models import (
    add_large_model_arguments,
    build_large_model,
    greedy_generate,
    large_model_shape,
    parameter_count,
    random_prompts,
)

GOAL_RATIO = 0.91
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def prefill(model: PreTrainedModel, prompts: torch.Tensor) -> torch.Tensor:
    """The forward generation starts with: every prompt token, logits of the last position only."""
    with torch.inference_mode():
        return model(prompts, logits_to_keep=1).logits


def factor_seconds(strategy: copes.EGGROLL) -> float:
    """Seconds to generate one step's factors for the whole population (an evaluation that runs nothing)."""
    population = strategy.population
    synchronize()
    start = time.perf_counter()
    strategy.evaluate(lambda model, row_members: [0.0] * population)
    seconds = time.perf_counter() - start
    strategy.apply_update(torch.zeros(population))  # equal rewards: the step ends without moving the weights
    return seconds


def plain_and_population_seconds(
    strategy: copes.EGGROLL, member_of_row: torch.Tensor, run: Callable[[], object], repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Best times of `run` as plain inference and with every batch row perturbed by its member's low-rank noise,
    the two alternating (inside one EGGROLL evaluation, where `row_members` is valid)."""
    best: dict[str, float] = {}

    def fitness(model: PreTrainedModel, row_members: RowMembers) -> list[float]:
        def population() -> None:
            with row_members(member_of_row):
                run()

        best.update(alternating_best_seconds({"plain": run, "population": population}, repeats, clock))
        return [0.0] * strategy.population

    strategy.evaluate(fitness)
    strategy.apply_update(torch.zeros(strategy.population))  # equal rewards: the weights do not move
    return best


def throughput_rows(name: str, model: PreTrainedModel, *, population: int, rows_per_member: int, prompt_tokens: int,
                    new_tokens: int, rank: int, repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Prefill and generation rows for `model`: plain vs population throughput on the same token ids."""
    positions = model.config.max_position_embeddings
    if prompt_tokens + new_tokens > positions:
        raise ValueError(
            f"prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds the {name} model's "
            f"{positions} positions"
        )
    rows = population * rows_per_member
    prompts = random_prompts(rows, prompt_tokens, vocab_size=model.config.vocab_size)
    member_of_row = torch.arange(population, device=DEVICE).repeat_interleave(rows_per_member)
    strategy = copes.EGGROLL(model, population=population, sigma=SIGMA, rank=rank)
    factor_seconds(strategy)  # warm-up: the first call loads the compiled CPU kernels from numba's disk cache
    factors = factor_seconds(strategy)
    workloads = {
        "prefill forward": (lambda: prefill(model, prompts), rows * prompt_tokens),
        "greedy generate": (lambda: greedy_generate(model, prompts, new_tokens), rows * new_tokens),
    }
    results = []
    for workload, (run, tokens) in workloads.items():
        best = plain_and_population_seconds(strategy, member_of_row, run, repeats, clock)
        plain, perturbed = best["plain"], best["population"]
        ratio = plain / perturbed
        results.append({
            "model": name,
            "params_M": round(parameter_count(model) / 1e6, 2),
            "workload": workload,
            "N": population,
            "rows": rows,
            "tokens": tokens,
            "plain_tok_per_s": tokens / plain,
            "population_tok_per_s": tokens / perturbed,
            "ratio": ratio,
            "factors_s": factors,
            "ratio_with_factors": plain / (perturbed + factors),
            "goal_ge_0.91": "met" if ratio >= GOAL_RATIO else "not met",
        })
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-model", default="tiny", help="model folder of the tiny model (default: embedded)")
    parser.add_argument("--tiny-population", type=int, default=40, help="members N on the tiny model (paper: 40)")
    parser.add_argument("--large-population", type=int, default=8, help="members N on the large model")
    parser.add_argument("--rows-per-member", type=int, default=2, help="batch rows (prompts) of each member")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated tokens per row")
    parser.add_argument("--rank", type=int, default=1, help="EGGROLL rank r (paper: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement (the best is kept)")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall time, or the calling thread's CPU time (one torch thread on a crowded machine)")
    add_large_model_arguments(parser)
    args = parser.parse_args(argv)
    pin_one_thread()

    sizes = {"rows_per_member": args.rows_per_member, "prompt_tokens": args.prompt_tokens,
             "new_tokens": args.new_tokens, "rank": args.rank, "repeats": args.repeats, "clock": CLOCKS[args.clock]}
    tiny, _, _ = load_model(args.tiny_model, device=str(DEVICE))
    rows = throughput_rows("tiny", tiny, population=args.tiny_population, **sizes)
    if not args.skip_large:
        large = build_large_model(large_model_shape(args))
        rows += throughput_rows("large", large, population=args.large_population, **sizes)
    report("eggroll_throughput", rows,
           f"EGGROLL rank-{args.rank} population forward vs plain batched inference, {args.clock} clock "
           f"({machine_note()})")


if __name__ == "__main__":
    main()
