"""Side by side with what users compare against: GRPO (TRL's GRPOTrainer, full parameter) vs CoPES vs standard ES vs
EGGROLL at an equal wall-clock training budget, and the memory of one GRPO update vs one ES member against context.

Race. Every method starts from the embedded tiny model on the arithmetic task, gets the same reward function (the
task's own `score`), the same held-out set (the first `--eval-size` validation problems, greedy, through the
trainer's `held_out`) and the same training budget in CPU seconds of the run's own process (`time.process_time`),
with the clock paused while held-out accuracy is measured (so evaluations cost no method its budget). Each run has
one torch thread, so on an idle core its CPU seconds equal wall seconds; on a shared machine wall seconds also count
the time the run waited for a core, which would make the budget unfair between runs, so the wall seconds are only
recorded beside the CPU ones (the CSV's `wall_seconds` column). ES methods run their presets
through the trainer's own step (`Trainer.population_step`); GRPO runs TRL with a callback that keeps the same clock.
GRPO's learning rate is swept on the first seed; the best one then runs every seed. The share of GRPO's gain is
each method's mean held-out gain over GRPO's (best lr) mean gain.

Memory. Peak memory of one GRPO update (sampling `--new-tokens` tokens, then forward + backward over prompt and
completion) and one ES member (the same sampling under no_grad, with its KV cache) on a random Qwen3-architecture
model at each context length, each measured in a fresh process over what the loaded model already held
(CUDA: max_memory_allocated; CPU: the resident high-water mark). Adam state and a reference model, which GRPO
would add, are not counted.

    pip install -e ".[bench]"        # TRL
    python bench/vs_grpo.py [--budget-s 150] [--seeds 3] [--grpo-lrs 1e-4 3e-4 1e-3] [--workers 2]
    python bench/vs_grpo.py --part memory --lengths 256 1024 4096 16384
    python bench/vs_grpo.py --part race --methods EGGROLL --seeds 1 --budget-s 60 --set population=256 --name screen
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.harness import RESULTS_DIR, machine_note, pin_one_thread, report, worker_pool, write_csv
from common.memory_probe import PeakMemory
from common.models import train_config

GRPO = "GRPO (TRL)"
# Each ES method as `copes-run --algorithm X` runs it: the tiny model's preset for X (copes/assets/tiny/copes.yaml,
# or copes.X.yaml where X has its own), standard ES being CoPES's preset with K=1.
ES_METHODS: dict[str, dict[str, Any]] = {
    "CoPES": {"algorithm": "copes"},
    "ES (K=1)": {"algorithm": "es"},
    "EGGROLL": {"algorithm": "eggroll"},
}
# GRPO as the reference run: 8 completions per prompt, 16 prompts per step, temperature 1, no KL term.
GRPO_GENERATIONS = 8
GRPO_PROMPTS_PER_STEP = 16
MEMORY_PLOT_NAME = "vs_grpo_memory.png"


@dataclass
class Curve:
    """Held-out accuracy against training seconds for one run (the first point is before training)."""

    method: str
    seed: int
    lr: float | None
    seconds: list[float] = field(default_factory=list)  # training CPU seconds at each evaluation
    wall_seconds: list[float] = field(default_factory=list)  # training wall seconds at the same evaluations
    accuracies: list[float] = field(default_factory=list)
    steps: int = 0

    @property
    def gain(self) -> float:
        return self.accuracies[-1] - self.accuracies[0]


class TrainingClock:
    """Seconds of training only, in this process's CPU time (`time.process_time`: fair between runs that share
    cores), with the wall seconds kept beside them; held-out evaluations run with the clock stopped. `due()` says
    when the next of `evaluations` evenly spaced evaluations (the last at the budget) has come."""

    def __init__(self, budget_s: float, evaluations: int) -> None:
        self.budget_s, self.marks = budget_s, [budget_s * (i + 1) / evaluations for i in range(evaluations)]
        self.elapsed, self.wall_elapsed, self._started = 0.0, 0.0, (0.0, 0.0)

    def start(self) -> None:
        self._started = (time.process_time(), time.perf_counter())

    def stop(self) -> None:
        cpu_started, wall_started = self._started
        self.elapsed += time.process_time() - cpu_started
        self.wall_elapsed += time.perf_counter() - wall_started

    def due(self) -> bool:
        passed = [mark for mark in self.marks if self.elapsed >= mark]
        self.marks = self.marks[len(passed):]  # a step longer than the spacing passes several marks at once
        return bool(passed)

    @property
    def over(self) -> bool:
        return self.elapsed >= self.budget_s


def _evaluate(trainer: Any, curve: Curve, clock: TrainingClock, step: int) -> None:
    curve.seconds.append(round(clock.elapsed, 2))
    curve.wall_seconds.append(round(clock.wall_elapsed, 2))
    curve.accuracies.append(trainer.held_out(step)["accuracy"])


def _first_evaluation(trainer: Any, curve: Curve, clock: TrainingClock) -> None:
    """The evaluation before training, unless the curve already starts at a value measured once for every run."""
    if not curve.accuracies:
        _evaluate(trainer, curve, clock, 0)


def _final_evaluation(trainer: Any, curve: Curve, clock: TrainingClock) -> Curve:
    """Every run ends with an evaluation at its last step, also when the budget ran out between marks."""
    if curve.seconds[-1] != round(clock.elapsed, 2):
        trainer.model.eval()
        _evaluate(trainer, curve, clock, curve.steps)
    return curve


def es_curve(trainer: Any, curve: Curve, clock: TrainingClock, max_steps: int | None = None,
             evaluations: int = 1) -> Curve:
    """ES steps until the clock's budget is spent, or `max_steps` steps (an equal number of evaluations). A run of
    `max_steps` spaces its `evaluations` by steps (its clock has no budget to space them over)."""
    from copes.run.trainer import batch_indices

    cfg = trainer.cfg
    every = max(max_steps // evaluations, 1) if max_steps else None
    _first_evaluation(trainer, curve, clock)
    while not clock.over and (max_steps is None or curve.steps < max_steps):
        clock.start()
        examples = [trainer.train_set[i]
                    for i in batch_indices(curve.steps, cfg.prompt_batch, len(trainer.train_set), cfg.seed)]
        trainer.population_step(curve.steps, examples)
        clock.stop()
        curve.steps += 1
        if clock.due() or (every is not None and curve.steps % every == 0):
            _evaluate(trainer, curve, clock, curve.steps)
    return _final_evaluation(trainer, curve, clock)


def grpo_curve(trainer: Any, curve: Curve, clock: TrainingClock, output_dir: str) -> Curve:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from copes.rollout import render_prompt

    task, train_set, tokenizer = trainer.task, trainer.train_set, trainer.tokenizer

    def prompt(example: Any) -> str:  # the text an ES rollout starts from (a chat task's user turn, rendered)
        text = task.prompt(example)
        return render_prompt(tokenizer, [{"role": "user", "content": text}]) if task.chat else text

    prompts = Dataset.from_list([{"prompt": prompt(example), "index": i} for i, example in enumerate(train_set)])

    def reward(prompts: list[str], completions: list[str], index: list[int], **_: Any) -> list[float]:
        return [task.score(completion, train_set[i]).reward for completion, i in zip(completions, index)]

    class SameClock(TrainerCallback):
        """Stops the clock around held-out evaluations and ends training at the budget."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            clock.stop()
            curve.steps = state.global_step
            if clock.due():
                trainer.model.eval()
                _evaluate(trainer, curve, clock, curve.steps)
                trainer.model.train()
            control.should_training_stop = clock.over

    config = GRPOConfig(
        output_dir=output_dir, learning_rate=curve.lr, seed=curve.seed, num_generations=GRPO_GENERATIONS,
        per_device_train_batch_size=GRPO_GENERATIONS * GRPO_PROMPTS_PER_STEP,
        max_completion_length=trainer.cfg.max_new_tokens,
        temperature=1.0, beta=0.0, max_steps=10**6, use_cpu=True, report_to=[], save_strategy="no", logging_steps=10**6,
        disable_tqdm=True, dataloader_num_workers=0, bf16=False,
    )
    _first_evaluation(trainer, curve, clock)
    trainer.model.requires_grad_(True)  # copes.modeling.load_model freezes every weight for ES; GRPO trains them
    grpo = GRPOTrainer(model=trainer.model, reward_funcs=reward, args=config, train_dataset=prompts,
                       processing_class=trainer.tokenizer, callbacks=[SameClock()])
    grpo.train()
    return _final_evaluation(trainer, curve, clock)


@dataclass(frozen=True)
class Job:
    """One race run. `overrides` are TrainConfig fields over an ES method's preset (screening other settings)."""

    method: str
    seed: int
    lr: float | None
    budget_s: float
    evaluations: int
    eval_size: int
    overrides: tuple[tuple[str, Any], ...] = ()
    max_steps: int | None = None  # ES methods: stop after this many steps (equal evaluations) or at the budget
    model: str = "tiny"  # an embedded model's name (its preset is the method's base) or a model folder
    # Held-out accuracy before training, when already measured for this model, held-out set and decoding (it is the
    # same for every method and seed): the run starts its curve there instead of evaluating again.
    before: float | None = None


def job_config(job: Job, output_dir: str) -> Any:
    """The run's TrainConfig: the method's preset on the job's model under the job's overrides and the race's own
    settings (seed, one thread, no checkpoints, the shared held-out size)."""
    return train_config(job.model, {**ES_METHODS.get(job.method, {}), **dict(job.overrides), "seed": job.seed,
                                 "checkpoint_every": 0, "cpu_threads": 1, "eval_size": job.eval_size,
                                 "output_dir": output_dir})


def run_job(job: Job) -> Curve:
    """One (method, seed, lr) run in its own process: one torch thread, a fresh model, its own output folder."""
    pin_one_thread()
    from transformers.utils import logging as hf_logging

    from copes.run.trainer import Trainer

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a bar per loaded model, from every worker, is noise in a log
    with tempfile.TemporaryDirectory(prefix="copes-vs-grpo-") as output_dir:
        trainer = Trainer(job_config(job, output_dir), progress=False)
        curve, clock = Curve(job.method, job.seed, job.lr), TrainingClock(job.budget_s, job.evaluations)
        if job.before is not None:
            curve.seconds, curve.wall_seconds, curve.accuracies = [0.0], [0.0], [job.before]
        if job.method == GRPO:
            return grpo_curve(trainer, curve, clock, output_dir)
        return es_curve(trainer, curve, clock, job.max_steps, job.evaluations)


def run_jobs(jobs: Sequence[Job], workers: int) -> list[Curve]:
    if workers == 1:
        return [run_job(job) for job in jobs]
    with worker_pool(workers) as pool:
        return pool.map(run_job, jobs, chunksize=1)


def best_grpo_lr(curves: Sequence[Curve]) -> float | None:
    """The swept learning rate whose seed-0 run gained the most held-out accuracy (None without GRPO runs)."""
    sweep = [c for c in curves if c.method == GRPO and c.seed == 0]
    return max(sweep, key=lambda c: c.gain).lr if sweep else None


def race(args: argparse.Namespace) -> list[Curve]:
    base = (args.budget_s, args.evaluations, args.eval_size)
    overrides = tuple(sorted(args.set.items()))
    es_methods = [method for method in args.methods if method != GRPO]
    grpo_lrs = args.grpo_lrs if GRPO in args.methods else []
    sweep = run_jobs([Job(GRPO, 0, lr, *base) for lr in grpo_lrs]
                     + [Job(method, seed, None, *base, overrides)
                        for method in es_methods for seed in range(args.seeds)],
                     args.workers)
    if not grpo_lrs:
        return sweep
    best_lr = best_grpo_lr(sweep)
    return sweep + run_jobs([Job(GRPO, seed, best_lr, *base) for seed in range(1, args.seeds)], args.workers)


def _label(method: str, lr: float | None) -> str:
    return method if lr is None else f"{method} lr={lr:g}"


def _by_label(curves: Sequence[Curve]) -> dict[str, list[Curve]]:
    groups: dict[str, list[Curve]] = {}
    for curve in curves:
        groups.setdefault(_label(curve.method, curve.lr), []).append(curve)
    return groups


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values)


def race_rows(curves: Sequence[Curve]) -> list[dict[str, Any]]:
    """One row per method (GRPO at its best lr, plus one row per other swept lr): gain, std, share of GRPO's."""
    groups, best_lr = _by_label(curves), best_grpo_lr(curves)
    grpo_gain = statistics.fmean(c.gain for c in groups[_label(GRPO, best_lr)]) if best_lr is not None else 0.0
    rows = []
    for label, runs in groups.items():
        gain, gain_std = _mean_std([100 * c.gain for c in runs])
        rows.append({
            "method": label, "seeds": len(runs),
            "acc_before_pct": 100 * runs[0].accuracies[0],
            "acc_after_pct": 100 * statistics.fmean(c.accuracies[-1] for c in runs),
            "gain_pts": gain, "gain_std": gain_std,
            "share_of_grpo_pct": 100 * gain / (100 * grpo_gain) if grpo_gain else float("nan"),
            "steps": statistics.fmean(c.steps for c in runs),
            "gains_pts": " ".join(f"{100 * c.gain:+.1f}" for c in runs),
            "wall_s": statistics.fmean(c.wall_seconds[-1] for c in runs),
        })
    return rows


def plot_race(curves: Sequence[Curve], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.2), dpi=120)
    best_lr = best_grpo_lr(curves)
    for label, runs in _by_label(curves).items():
        if runs[0].method == GRPO and runs[0].lr != best_lr:  # a swept lr that lost: one seed, faint, no band
            axis.plot(runs[0].seconds, [100 * a for a in runs[0].accuracies], ":", alpha=0.6, label=f"{label} (1 seed)")
            continue
        points = min(len(r.seconds) for r in runs)
        seconds = [statistics.fmean(r.seconds[i] for r in runs) for i in range(points)]
        mean = [100 * statistics.fmean(r.accuracies[i] for r in runs) for i in range(points)]
        std = [100 * statistics.pstdev([r.accuracies[i] for r in runs]) for i in range(points)]
        line, = axis.plot(seconds, mean, "o-", markersize=3, label=f"{label} ({len(runs)} seeds)")
        axis.fill_between(seconds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                          color=line.get_color(), alpha=0.15)
    _finish(fig, axis, path, title, "training CPU seconds (held-out evaluation excluded), one torch thread each",
            "held-out accuracy (%)")


def _finish(fig: Any, axis: Any, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    import matplotlib.pyplot as plt

    axis.set(xlabel=xlabel, ylabel=ylabel)
    axis.set_title(textwrap.fill(title, 100), fontsize=8)
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- memory


def memory_model(vocab_size: int, seed: int = 0) -> Any:
    """A random Qwen3-architecture model of about 4M parameters with SDPA attention (memory linear in context)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def measure_memory(job: tuple[str, int, int, int]) -> dict[str, Any]:
    """Peak memory of one GRPO update or one ES member at one context length, in a fresh process."""
    kind, length, batch, new_tokens = job
    pin_one_thread()
    import torch

    from common.harness import DEVICE

    model = memory_model(vocab_size=4096).to(DEVICE)
    prompts = torch.randint(0, 4096, (batch, length), generator=torch.Generator().manual_seed(length), device=DEVICE)
    sample = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, pad_token_id=0)
    start = time.perf_counter()
    with PeakMemory() as memory:
        if kind == "GRPO update":
            with torch.no_grad():  # TRL samples without gradients, then scores the completions with them
                sequences = model.generate(prompts, **sample)
            model.train()
            logits = model(sequences).logits[:, length - 1 : -1].float()
            completion_logprobs = torch.log_softmax(logits, -1).gather(-1, sequences[:, length:, None])
            (-completion_logprobs.mean()).backward()  # advantage-weighted in GRPO; the memory is the same
        else:
            with torch.inference_mode():
                model.generate(prompts, **sample)
    parameters = sum(p.numel() for p in model.parameters())
    return {"kind": kind, "context": length, "batch": batch, "peak_mib": memory.peak_bytes / 2**20,
            "seconds": time.perf_counter() - start, "parameters": parameters}


def memory_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    jobs = [(kind, length, args.memory_batch, args.new_tokens) for length in args.lengths
            for kind in ("GRPO update", "ES member")]
    context = multiprocessing.get_context("spawn")
    measured = []
    for job in jobs:  # one at a time: a concurrent job would share the machine's memory bandwidth, not its peak
        with context.Pool(1) as pool:
            measured.append(pool.apply(measure_memory, (job,)))
    rows = []
    for length in args.lengths:
        grpo, es = (next(m for m in measured if m["context"] == length and m["kind"] == kind)
                    for kind in ("GRPO update", "ES member"))
        rows.append({"context": length, "batch": args.memory_batch, "grpo_update_mib": grpo["peak_mib"],
                     "es_member_mib": es["peak_mib"], "ratio": grpo["peak_mib"] / es["peak_mib"],
                     "grpo_seconds": grpo["seconds"], "es_seconds": es["seconds"], "parameters": grpo["parameters"]})
    return rows


def plot_memory(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4), dpi=120)
    lengths = [row["context"] for row in rows]
    axis.plot(lengths, [row["grpo_update_mib"] for row in rows], "o-", label="one GRPO update (sample + backward)")
    axis.plot(lengths, [row["es_member_mib"] for row in rows], "o-", label="one ES member (sample, no grad)")
    for row in rows:
        axis.annotate(f"{row['ratio']:.1f}x", (row["context"], row["grpo_update_mib"]), textcoords="offset points",
                      xytext=(0, 6), ha="center", fontsize=7)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    _finish(fig, axis, path, title, "context length (tokens)", "peak memory over the loaded model (MiB)")


def _override(text: str) -> tuple[str, Any]:
    """KEY=VALUE with a YAML value (population=128, fitness=joint), as copes-run's mapping options read them."""
    import yaml

    from copes.config.options import FIELD_NAMES

    key, sep, value = text.partition("=")
    if not sep or key not in FIELD_NAMES:
        raise argparse.ArgumentTypeError(
            f"takes KEY=VALUE with KEY a copes-run option (population, sigma, ...), got {text!r}")
    return key, yaml.safe_load(value)


def _require_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench/vs_grpo.py needs TRL for the GRPO baseline: pip install -e \".[bench]\" (or pip install trl)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("both", "race", "memory"), default="both")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="training CPU seconds per run (its own process; evaluation excluded)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=(GRPO, *ES_METHODS), default=[GRPO, *ES_METHODS],
                        help="which methods race (default: all)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", type=_override,
                        help="TrainConfig fields over every ES method's preset, e.g. population=128 (screening)")
    parser.add_argument("--name", default="vs_grpo", help="stem of the race's CSV and plot in bench/results")
    parser.add_argument("--grpo-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3],
                        help="GRPO learning rates swept on seed 0")
    parser.add_argument("--evaluations", type=int, default=5, help="held-out evaluations per run after the first")
    parser.add_argument("--eval-size", type=int, default=2000,
                        help="validation problems per evaluation (the arithmetic task's split has 2000)")
    parser.add_argument("--workers", type=int, default=2, help="runs at once (one torch thread each)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--memory-batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per row in the memory part")
    args = parser.parse_args(argv)
    args.set = dict(args.set)
    started = time.perf_counter()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if args.part in ("both", "race") and GRPO in args.methods:
        _require_trl()
    # The memory points run one at a time beside the race: memory is what they measure, and the race's budget is
    # each run's own CPU seconds, so sharing the cores costs only wall time, less than running them after it.
    memory_thread = ThreadPoolExecutor(1)
    memory = memory_thread.submit(memory_rows, args) if args.part in ("both", "memory") else None
    if args.part in ("both", "race"):
        curves = race(args)
        lines = [[c.method, c.seed, c.lr or "", s, w, a]
                 for c in curves for s, w, a in zip(c.seconds, c.wall_seconds, c.accuracies)]
        write_csv(f"{args.name}_curves", ["method", "seed", "lr", "training_seconds", "wall_seconds", "accuracy"],
                  lines)
        title = (f"tiny model, arithmetic, {args.budget_s:g} CPU s of training per run, "
                 f"{args.eval_size} validation problems ({machine_note()}, {args.workers} runs at once)")
        if args.set:
            title += f", ES presets under {' '.join(f'{k}={v}' for k, v in sorted(args.set.items()))}"
        report(args.name, race_rows(curves), title)
        plot_race(curves, RESULTS_DIR / f"{args.name}.png", title)
        print(f"wrote {RESULTS_DIR / args.name}.png; race took {time.perf_counter() - started:.0f} s wall")
    if memory is not None:
        rows = memory.result()
        memory_thread.shutdown()
        title = (f"random Qwen3 ({rows[0]['parameters'] / 1e6:.1f}M parameters), batch {args.memory_batch} "
                 f"({machine_note()})")
        report("vs_grpo_memory", rows, title)
        plot_memory(rows, RESULTS_DIR / MEMORY_PLOT_NAME, title)
        print(f"wrote {RESULTS_DIR / MEMORY_PLOT_NAME}")
    print(f"bench/vs_grpo.py --part {args.part} took {time.perf_counter() - started:.0f} s wall")


if __name__ == "__main__":
    main()
