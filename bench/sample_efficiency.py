"""Sample efficiency on the tiny default task: training reward and held-out accuracy against the number of
evaluations (member rollouts, N x prompt batch per step) for

  ES (K=1)              standard one-sided ES, the CoPES engine with one subspace
  CoPES K=2 / 4 / 8     N fixed, so each subspace gets N/K members
  CoPES K=4 per-subspace rewards z-scored inside each subspace instead of jointly
  EGGROLL r=1           rank-1 low-rank noise, the population in one batched forward

with several seeds each (a seed fixes the prompt order, the noise and the partitions; configs with the same
seed see the same prompt batches). Every run goes through the real trainer (`Trainer(cfg).train()`) with the
model's preset; sigma and lr are shared by all configs. The PNG shows the mean over seeds and a band of one
standard deviation. This reproduces the paper's ablations at a small scale: the figures are what was measured.

    python bench/sample_efficiency.py [--tiny-model PATH] [--seeds 3] [--steps 30] ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers.utils import logging as hf_logging

from copes.run.trainer import Trainer

from common.harness import RESULTS_DIR, machine_note, pin_one_thread, report, write_csv
from common.models import add_preset_arguments, preset_overrides, train_config

CONFIGS: dict[str, dict[str, Any]] = {
    "ES (K=1)": {"algorithm": "es"},
    "CoPES K=2": {"algorithm": "copes", "subspaces": 2},
    "CoPES K=4": {"algorithm": "copes", "subspaces": 4},
    "CoPES K=8": {"algorithm": "copes", "subspaces": 8},
    "CoPES K=4 per-subspace": {"algorithm": "copes", "subspaces": 4, "fitness": "per_subspace"},
    "EGGROLL r=1": {"algorithm": "eggroll", "rank": 1},
}
# Each step draws its own prompt batch, whose difficulty moves every config's reward alike: the final training
# reward is averaged over this many steps, and the plotted reward is a trailing mean over as many.
LAST_STEPS = 5
PLOT_NAME = "sample_efficiency.png"


@dataclass
class Curve:
    """One run: population-mean training reward per step and held-out accuracy at each evaluation."""

    config: str
    seed: int
    steps: list[int]
    rewards: list[float]
    eval_steps: list[int]
    accuracies: list[float]
    seconds: float


def run_curve(model: str, config: str, seed: int, settings: dict[str, Any]) -> Curve:
    """Train `config` from the model's weights with the trainer; `settings` are shared TrainConfig fields."""
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {list(CONFIGS)}, got {config!r}")
    with tempfile.TemporaryDirectory(prefix="copes-sample-efficiency-") as output_dir:
        flags = {**settings, **CONFIGS[config], "seed": seed, "output_dir": output_dir, "checkpoint_every": 0,
                 "cpu_threads": 1}
        trainer = Trainer(train_config(model, flags), progress=False)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        lines = (Path(output_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    return Curve(
        config=config,
        seed=seed,
        steps=[record["step"] for record in records],
        rewards=[record["mean_reward"] for record in records],
        eval_steps=[record["step"] for record in trainer.record.evals],
        accuracies=[record["accuracy"] for record in trainer.record.evals],
        seconds=seconds,
    )


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values)


def summarize(curves: Sequence[Curve], evaluations_per_step: int) -> list[dict[str, Any]]:
    """One row per config: held-out accuracy before / after and the final training reward, mean and std."""
    rows = []
    for config in dict.fromkeys(curve.config for curve in curves):
        runs = [curve for curve in curves if curve.config == config]
        before = statistics.fmean(run.accuracies[0] for run in runs)
        after, after_std = _mean_std([run.accuracies[-1] for run in runs])
        gain, gain_std = _mean_std([run.accuracies[-1] - run.accuracies[0] for run in runs])
        final, final_std = _mean_std([statistics.fmean(run.rewards[-LAST_STEPS:]) for run in runs])
        first = statistics.fmean(statistics.fmean(run.rewards[:LAST_STEPS]) for run in runs)
        rows.append({
            "config": config,
            "seeds": len(runs),
            "evaluations": runs[0].steps[-1] * evaluations_per_step,
            "acc_before_pct": 100 * before,
            "acc_after_pct": 100 * after,
            "acc_after_std": 100 * after_std,
            "acc_gain_pts": 100 * gain,
            "acc_gain_std": 100 * gain_std,
            f"reward_first{LAST_STEPS}": first,
            f"reward_last{LAST_STEPS}": final,
            f"reward_last{LAST_STEPS}_std": final_std,
            "seconds_per_run": statistics.fmean(run.seconds for run in runs),
        })
    return rows


def curve_lines(curves: Sequence[Curve], evaluations_per_step: int) -> list[list[Any]]:
    """CSV lines (config, seed, step, evaluations, reward, accuracy) for every step and every evaluation."""
    lines = []
    for curve in curves:
        accuracy_at = dict(zip(curve.eval_steps, curve.accuracies))
        for step in sorted({0, *curve.steps, *curve.eval_steps}):
            reward = curve.rewards[curve.steps.index(step)] if step in curve.steps else ""
            accuracy = accuracy_at.get(step, "")
            lines.append([curve.config, curve.seed, step, step * evaluations_per_step, reward, accuracy])
    return lines


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over the last `window` points (fewer at the start), along the last axis."""
    points = values.shape[-1]
    return np.stack([values[..., max(0, i - window + 1) : i + 1].mean(axis=-1) for i in range(points)], axis=-1)


def plot(curves: Sequence[Curve], evaluations_per_step: int, path: Path, title: str) -> None:
    """Two panels against evaluations: the training reward (trailing mean over LAST_STEPS steps) and held-out
    accuracy; mean over seeds +- one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    for config in dict.fromkeys(curve.config for curve in curves):
        runs = [curve for curve in curves if curve.config == config]
        panels = (
            (reward_axis, runs[0].steps, trailing_mean(np.asarray([run.rewards for run in runs]), LAST_STEPS)),
            (accuracy_axis, runs[0].eval_steps, 100 * np.asarray([run.accuracies for run in runs])),
        )
        for axis, steps, stacked in panels:  # stacked: [seeds, points]
            x = np.asarray(steps) * evaluations_per_step
            mean, std = stacked.mean(axis=0), stacked.std(axis=0)
            (line,) = axis.plot(x, mean, label=config, marker="o" if axis is accuracy_axis else None, markersize=3)
            axis.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    reward_axis.set_ylabel(f"training reward (population mean, trailing {LAST_STEPS}-step mean)")
    accuracy_axis.set_ylabel("held-out accuracy (%)")
    for axis in (reward_axis, accuracy_axis):
        axis.set_xlabel("evaluations (member rollouts)")
        axis.grid(alpha=0.3)
    accuracy_axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-model", default="tiny", help="model folder (default: the embedded tiny model)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                        help=f"configs to run (default: all of {list(CONFIGS)})")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per config")
    parser.add_argument("--steps", type=int, default=40, help="ES steps per run")
    parser.add_argument("--population", type=int, default=40, help="N, the same for every config (paper: 40)")
    parser.add_argument("--prompt-batch", type=int, default=32, help="questions per step")
    parser.add_argument("--eval-size", type=int, default=500, help="held-out (validation) questions")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    add_preset_arguments(parser)
    args = parser.parse_args(argv)
    pin_one_thread()
    hf_logging.disable_progress_bar()  # every run loads and saves the model; their bars would drown the table

    settings = {"population": args.population, "prompt_batch": args.prompt_batch, "steps": args.steps,
                "eval_size": args.eval_size, "eval_every": args.eval_every, **preset_overrides(args)}
    curves = []
    for seed in range(args.seeds):
        for config in args.configs:
            curves.append(run_curve(args.tiny_model, config, seed, settings))
            print(f"{config} seed {seed}: accuracy {100 * curves[-1].accuracies[0]:.1f}% -> "
                  f"{100 * curves[-1].accuracies[-1]:.1f}% in {curves[-1].seconds:.0f}s", flush=True)

    per_step = args.population * args.prompt_batch
    shared = ", ".join(f"{name}={value}" for name, value in settings.items())
    report("sample_efficiency", summarize(curves, per_step),
           f"sample efficiency on the tiny task, {args.seeds} seeds ({shared}; {machine_note()})")
    curves_path = write_csv("sample_efficiency_curves", ["config", "seed", "step", "evaluations", "reward",
                                                         "heldout_accuracy"], curve_lines(curves, per_step))
    plot_path = RESULTS_DIR / PLOT_NAME
    plot(curves, per_step, plot_path,
         f"{Path(args.tiny_model).name} model on the synthetic arithmetic task: mean +- 1 std over {args.seeds} seeds\n"
         f"{shared}")
    print(f"wrote {curves_path} and {plot_path}")


if __name__ == "__main__":
    main()
