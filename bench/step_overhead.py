"""Engine overhead of one CoPES step: perturb + restore + update as a fraction of the step's wall time.

A step is N x (perturb, rollout, restore) plus one update; the strategy times each phase itself (StepStats).
Two workloads, each timed in this run:

  tiny   the embedded default model on the default task (synthetic arithmetic), driven through the real
         trainer (`Trainer.population_step`: batched rollouts, scoring, CoPES), the model's own preset settings.
  large  the random ~100M-parameter Qwen3.5-architecture model; each member greedily generates a continuation
         of a fixed batch of random prompts and is rewarded with its mean log-likelihood (continuous, so every
         step really updates).

Per member the engine costs (perturb + restore + update / N); evaluation time is whatever the workload costs.
The table therefore also gives the evaluation time per member at which the overhead would fall to 5%: with the
update's cost proportional to N (each member's noise is regenerated once), that figure does not depend on N.

    python bench/step_overhead.py [--tiny-model PATH] [--large-population 8] ...
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import copes
from copes.config.components import batch_indices
from copes.es.strategies import StepStats
from copes.run.trainer import Trainer

from common.harness import machine_note, pin_one_thread, report
from common.models import (
    LargeModelShape,
    add_large_model_arguments,
    add_preset_arguments,
    build_large_model,
    greedy_log_likelihood,
    large_model_shape,
    parameter_count,
    preset_overrides,
    random_prompts,
    train_config,
)

GOAL_OVERHEAD = 0.05
ENGINE_PHASES = ("perturb", "restore", "update")


@dataclass
class PhaseTotals:
    """Phase seconds summed over the timed steps."""

    steps: int = 0
    perturb: float = 0.0
    rollout: float = 0.0
    restore: float = 0.0
    update: float = 0.0
    updated_steps: int = 0  # steps whose rewards had spread (a zero-spread step skips its update)

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.perturb += stats.perturb_seconds
        self.rollout += stats.rollout_seconds
        self.restore += stats.restore_seconds
        self.update += stats.update_seconds
        self.updated_steps += not stats.zero_update

    @property
    def engine(self) -> float:
        return sum(getattr(self, phase) for phase in ENGINE_PHASES)

    @property
    def total(self) -> float:
        return self.engine + self.rollout


def time_steps(step: Callable[[int], StepStats], *, warmup: int, steps: int) -> PhaseTotals:
    """Run `warmup` untimed then `steps` timed ES steps; step(i) runs step i and returns its StepStats."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    totals = PhaseTotals()
    for index in range(warmup + steps):
        stats = step(index)
        if index >= warmup:
            totals.add(stats)
    return totals


def tiny_trainer(
    model: str, output_dir: str, *, population: int, subspaces: int, prompt_batch: int, overrides: dict[str, Any]
) -> Trainer:
    """The real trainer on the default task with the model's preset, CoPES with N and K as given."""
    flags = {
        "algorithm": "copes", "population": population, "subspaces": subspaces, "prompt_batch": prompt_batch,
        "eval_size": 0, "checkpoint_every": 0, "cpu_threads": 1, "output_dir": output_dir, **overrides,
    }
    return Trainer(train_config(model, flags), progress=False)


def tiny_step(trainer: Trainer) -> Callable[[int], StepStats]:
    def step(index: int) -> StepStats:
        indices = batch_indices(index, trainer.cfg.prompt_batch, len(trainer.train_set), trainer.cfg.seed)
        return trainer.population_step(index, [trainer.train_set[i] for i in indices])

    return step


def large_step(strategy: copes.CoPES, prompts: torch.Tensor, new_tokens: int) -> Callable[[int], StepStats]:
    return lambda index: strategy.step(lambda model: greedy_log_likelihood(model, prompts, new_tokens))


def overhead_row(
    workload: str, params: int, population: int, subspaces: int, totals: PhaseTotals
) -> dict[str, Any]:
    fraction = totals.engine / totals.total
    engine_per_member = totals.engine / (totals.steps * population)
    return {
        "workload": workload,
        "params_M": round(params / 1e6, 2),
        "N": population,
        "K": subspaces,
        "steps": totals.steps,
        "updated": totals.updated_steps,
        "perturb_s": totals.perturb,
        "rollout_s": totals.rollout,
        "restore_s": totals.restore,
        "update_s": totals.update,
        "step_s": totals.total / totals.steps,
        "overhead_pct": 100 * fraction,
        "engine_s_per_member": engine_per_member,
        # engine / (engine + rollout) <= 5%  <=>  rollout >= 19 x engine
        "eval_s_per_member_for_5pct": engine_per_member * (1 - GOAL_OVERHEAD) / GOAL_OVERHEAD,
        "goal_le_5pct": "met" if fraction <= GOAL_OVERHEAD else "not met",
    }


def measure_tiny(model: str, *, population: int, subspaces: int, prompt_batch: int, steps: int,
                 overrides: dict[str, Any]) -> dict[str, Any]:
    """The tiny workload's row: one warm-up step, then `steps` timed ones."""
    with tempfile.TemporaryDirectory(prefix="copes-bench-") as output_dir:  # population steps write nothing
        trainer = tiny_trainer(model, output_dir, population=population, subspaces=subspaces,
                               prompt_batch=prompt_batch, overrides=overrides)
        totals = time_steps(tiny_step(trainer), warmup=1, steps=steps)
    return overhead_row(f"tiny ({trainer.cfg.task})", parameter_count(trainer.model), population, subspaces, totals)


def measure_large(shape: LargeModelShape, *, population: int, subspaces: int, prompt_batch: int, prompt_tokens: int,
                  new_tokens: int, steps: int) -> dict[str, Any]:
    """The large workload's row: `steps` timed steps after a warm-up generation."""
    model = build_large_model(shape)
    prompts = random_prompts(prompt_batch, prompt_tokens, vocab_size=shape.vocab_size)
    strategy = copes.CoPES(model, population=population, num_subspaces=subspaces)
    greedy_log_likelihood(model, prompts, new_tokens)  # first-call costs are no phase of a step
    totals = time_steps(large_step(strategy, prompts, new_tokens), warmup=0, steps=steps)
    workload = f"large (generate {prompt_batch}x{new_tokens} tokens)"
    return overhead_row(workload, parameter_count(model), population, subspaces, totals)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-model", default="tiny", help="model folder for the tiny workload (default: embedded)")
    parser.add_argument("--tiny-population", type=int, default=40, help="N for the tiny workload (paper: 40)")
    parser.add_argument("--tiny-prompt-batch", type=int, default=64, help="questions per step (paper: 64)")
    parser.add_argument("--tiny-steps", type=int, default=3, help="timed steps of the tiny workload")
    parser.add_argument("--subspaces", type=int, default=4, help="K for both workloads (paper: 4)")
    parser.add_argument("--large-population", type=int, default=8,
                        help="N for the large workload (the overhead fraction does not depend on N)")
    parser.add_argument("--large-prompt-batch", type=int, default=8, help="prompts each large member continues")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="large workload prompt length")
    parser.add_argument("--new-tokens", type=int, default=32, help="large workload generated tokens per prompt")
    parser.add_argument("--large-steps", type=int, default=1, help="timed steps of the large workload")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny workload")
    add_preset_arguments(parser)
    add_large_model_arguments(parser)
    args = parser.parse_args(argv)
    pin_one_thread()

    rows = [measure_tiny(args.tiny_model, population=args.tiny_population, subspaces=args.subspaces,
                         prompt_batch=args.tiny_prompt_batch, steps=args.tiny_steps, overrides=preset_overrides(args))]
    if not args.skip_large:
        rows.append(measure_large(large_model_shape(args), population=args.large_population, subspaces=args.subspaces,
                                  prompt_batch=args.large_prompt_batch, prompt_tokens=args.prompt_tokens,
                                  new_tokens=args.new_tokens, steps=args.large_steps))
    report("step_overhead", rows,
           f"CoPES step by phase; engine overhead = perturb + restore + update ({machine_note()})")


if __name__ == "__main__":
    main()
