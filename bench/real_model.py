"""The real pretrained model (docs/real-model.md): SmolLM2-135M-Instruct from its GGUF release, trained by CoPES (K=4),
standard ES (K=1), EGGROLL and GRPO (TRL's GRPOTrainer, full-parameter, bench/vs_grpo.py's race harness) on one
task, paired by seed, at equal rollouts (ES methods: the same steps of N x prompt batch rollouts) and at equal wall
clock (CPU seconds of training). Resumable: each cell (budget, method, seed) is saved as it ends under
bench/results/real_model/, with its command, commit, versions, machine and seed, and its process's peak memory.
The untrained model's held-out accuracy is measured once per model file, held-out rows and decoding settings, saved
beside the cells, and every cell starts from it. The results section of docs/real-model.md is rewritten from the
saved cells of the settings given, with Holm-corrected paired tests; a section with fewer cells than the page holds
is written beside the page instead.

    python bench/real_model.py                       # every cell (long: hours on two CPU cores)
    python bench/real_model.py --seeds 1 --methods "CoPES (K=4)" --budgets "equal rollouts"   # one cell
    python bench/real_model.py --write-only          # the page from the saved cells of these settings
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import re
import resource
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from vs_grpo import GRPO, Job, run_job

from common.harness import RESULTS_DIR, run_provenance
from common.stats import holm, interval, paired, sign_flip_floor, sign_flip_p

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "real-model.md"
RESULTS_MARK, END_MARK = "<!-- results: written by bench/real_model.py -->", "<!-- end of results -->"
MODEL = "smollm2-135m-instruct"
ES = ("CoPES (K=4)", "ES (K=1)", "EGGROLL")
METHODS = (*ES, GRPO)
# The race harness's method names and each one's settings over the paper defaults (no preset for a GGUF).
RACE_METHOD = {"CoPES (K=4)": ("CoPES", {"subspaces": 4}), "ES (K=1)": ("ES (K=1)", {}),
               "EGGROLL": ("EGGROLL", {}), GRPO: (GRPO, {})}
BUDGETS = ("equal rollouts", "equal wall clock")
PAPER_SHARE = {"CoPES (K=4)": "92%", "ES (K=1)": "67%"}  # of GRPO's gain, the paper's Qwen 4B figures


# The task where SmolLM2-135M-Instruct starts in the middle (docs/real-model.md: 43.8% of 48 held-out questions,
# where every built-in task measured gave 0%): a + b for a, b in 0..30 through its chat template, one committed
# answer paid by the built-in math reward. 200 held-out pairs, the other 761 to train on.
CHAT_SUMS = "chat-sums"


def chat_sum_files(folder: Path) -> tuple[Path, Path]:
    """(train, eval) JSONL files of the chat sums task, written once (the same rows every time: seed 0)."""
    import random

    train, held_out = folder / "train.jsonl", folder / "eval.jsonl"
    if not held_out.is_file():
        pairs = [(a, b) for a in range(31) for b in range(31)]
        random.Random(0).shuffle(pairs)
        folder.mkdir(parents=True, exist_ok=True)
        for path, rows in ((held_out, pairs[:200]), (train, pairs[200:])):
            path.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? Put the final answer in \\boxed{{}}.",
                                                "answer": str(a + b)}) + "\n" for a, b in rows), encoding="utf-8")
    return train, held_out


@dataclass(frozen=True)
class Settings:
    task: str = CHAT_SUMS
    seeds: int = 5
    steps: int = 8  # equal rollouts: ES steps per run
    budget_s: float = 1800.0  # equal wall clock: CPU seconds of training per run
    eval_size: int = 100
    population: int = 8
    prompt_batch: int = 8
    max_new_tokens: int = 256
    grpo_lr: float = 1e-6


def cell_path(results: Path, budget: str, method: str, seed: int) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in method).strip("_")
    return results / budget.replace(" ", "_") / f"{slug}__seed{seed}.json"


def task_overrides(settings: Settings, results: Path) -> dict[str, Any]:
    if settings.task != CHAT_SUMS:
        return {"task": settings.task}
    train, held_out = chat_sum_files(results / CHAT_SUMS)
    return {"task": str(train), "task_options": {"eval_file": str(held_out), "chat": True}, "reward": ["math"]}


def job_for(settings: Settings, results: Path, budget: str, method: str, seed: int) -> Job:
    race_method, own = RACE_METHOD[method]
    overrides = {**own, **task_overrides(settings, results), "tools": False, "population": settings.population,
                 "prompt_batch": settings.prompt_batch, "max_new_tokens": settings.max_new_tokens,
                 "dtype": "float32", "budget_hours": None}
    equal_rollouts = budget == "equal rollouts"
    return Job(race_method, seed, settings.grpo_lr if method == GRPO else None,
               float("inf") if equal_rollouts else settings.budget_s, settings.steps if equal_rollouts else 1,
               settings.eval_size,
               tuple(sorted(overrides.items())), max_steps=settings.steps if equal_rollouts else None, model=MODEL)


def measure(job: Job) -> dict[str, Any]:
    """One run in this (fresh) process: its curve and the process's peak resident memory."""
    curve = run_job(job)
    return {"steps": curve.steps, "before": curve.accuracies[0], "after": curve.accuracies[-1],
            "gain_points": 100 * curve.gain, "cpu_seconds": curve.seconds[-1],
            "wall_seconds": curve.wall_seconds[-1], "curve": {"seconds": curve.seconds, "accuracy": curve.accuracies},
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def in_fresh_process(job: Job) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # peak memory of this run alone
        return pool.apply(measure, (job,))


def before_training(settings: Settings, results: Path) -> float:
    """Held-out accuracy of the untrained model, where every cell's curve starts. It depends only on the model file,
    the held-out rows and the greedy decoding settings, not on the method or seed, so it is measured once (a run of
    0 steps in a fresh process) and saved beside the cells under a key of those."""
    from copes.downloads import fetch_model
    from copes.user_code import sha256_of

    task = task_overrides(settings, results)
    held_out = task.get("task_options", {}).get("eval_file")
    key = {"model_sha256": sha256_of(fetch_model(MODEL)), "task": settings.task,
           "held_out_sha256": sha256_of(Path(held_out)) if held_out else None, "eval_size": settings.eval_size,
           "max_new_tokens": settings.max_new_tokens, "dtype": "float32", "decoding": "greedy, no tools"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    path = results / "before_training" / f"{digest[:16]}.json"
    if not path.is_file():
        provenance = run_provenance(0)
        measured = in_fresh_process(replace(job_for(settings, results, BUDGETS[0], ES[0], 0), max_steps=0))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**key, "accuracy": measured["before"], "provenance": provenance}, indent=1))
    return json.loads(path.read_text())["accuracy"]


def run_cell(settings: Settings, results: Path, budget: str, method: str, seed: int) -> dict[str, Any]:
    path = cell_path(results, budget, method, seed)
    if path.is_file():
        return json.loads(path.read_text())
    job = replace(job_for(settings, results, budget, method, seed), before=before_training(settings, results))
    provenance = run_provenance(seed)  # the commit the run started from
    measured = in_fresh_process(job)
    result = {"method": method, "budget": budget, "seed": seed, "settings": asdict(settings), **measured,
              "provenance": provenance}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def cells(methods: Sequence[str], budgets: Sequence[str]) -> list[tuple[str, str]]:
    """GRPO's generations are not ES member rollouts: it races at equal wall clock only."""
    return [(budget, method) for budget in budgets for method in methods
            if method != GRPO or budget == "equal wall clock"]


# Settings a cell's numbers do not depend on: the seed count is the run's, equal rollouts ends at its steps and equal
# wall clock at its CPU seconds.
NOT_MEASURED = {"equal rollouts": ("seeds", "budget_s", "grpo_lr"), "equal wall clock": ("seeds", "steps")}


def measured_as(settings: dict[str, Any], budget: str) -> dict[str, Any]:
    return {name: value for name, value in settings.items() if name not in NOT_MEASURED[budget]}


def saved_cells(results: Path, settings: Settings) -> list[dict[str, Any]]:
    """The saved cells measured under `settings` (cells of other settings stay saved, off this page's table)."""
    wanted = {budget: measured_as(asdict(settings), budget) for budget in BUDGETS}
    cells = [json.loads(path.read_text()) for budget in BUDGETS
             for path in sorted((results / budget.replace(" ", "_")).glob("*.json"))]
    return [cell for cell in cells if measured_as(cell["settings"], cell["budget"]) == wanted[cell["budget"]]]


def _fmt(mean: float, half: float) -> str:
    return f"{mean:+.1f} (one seed: no interval)" if math.isnan(half) else f"{mean:+.1f} ± {half:.1f}"


def results_section(saved: list[dict[str, Any]]) -> list[str]:
    """Every method's row in each budget ("not run" where no cell is saved yet), the shares of GRPO's gain, and the
    paired comparisons with CoPES, Holm-corrected together."""
    out, comparisons = [], []
    for budget in BUDGETS:
        by_method = {m: {r["seed"]: r for r in saved if r["budget"] == budget and r["method"] == m} for m in METHODS}
        settings = sorted({json.dumps(measured_as(r["settings"], budget), sort_keys=True)
                           for r in saved if r["budget"] == budget})
        out += [f"### {budget.capitalize()}", "", f"Settings: {', '.join(settings) or 'no cell yet'}.", "",
                "| method | seeds | accuracy before (%) | after (%) | gain (points), mean ± 95% CI | steps | "
                "s / step (CPU) | peak memory (GiB) |", "|---|---|---|---|---|---|---|---|"]
        for method, runs in by_method.items():
            if not runs:
                if (budget, method) in cells(METHODS, BUDGETS):
                    out.append(f"| {method} | 0 | not run | not run | not run | - | - | - |")
                continue
            values = list(runs.values())
            before, after = (interval([100 * r[key] for r in values]) for key in ("before", "after"))
            gain = interval([r["gain_points"] for r in values])
            step = statistics.fmean(r["cpu_seconds"] / max(r["steps"], 1) for r in values)
            out.append(f"| {method} | {len(values)} | {before[0]:.1f} | {after[0]:.1f} | {_fmt(*gain)} | "
                       f"{statistics.fmean(r['steps'] for r in values):.1f} | {step:.1f} | "
                       f"{max(r['peak_rss_gib'] for r in values):.2f} |")
        out.append("")
        for method in METHODS[1:]:
            seeds = sorted(set(by_method["CoPES (K=4)"]) & set(by_method[method]))
            if len(seeds) > 1:
                first = [by_method["CoPES (K=4)"][s]["gain_points"] for s in seeds]
                second = [by_method[method][s]["gain_points"] for s in seeds]
                mean, half, p = paired(first, second)
                comparisons.append((budget, method, len(seeds), mean, half, p,
                                    sign_flip_p([a - b for a, b in zip(first, second)])))
        mean_gain = {m: statistics.fmean(r["gain_points"] for r in runs.values())
                     for m, runs in by_method.items() if runs}
        if mean_gain.get(GRPO, 0) > 0:
            shares = [f"{m}: {100 * mean_gain[m] / mean_gain[GRPO]:.0f}% (paper: {PAPER_SHARE.get(m, '-')})"
                      for m in ES if m in mean_gain]
            out += [f"Share of GRPO's mean gain ({mean_gain[GRPO]:+.1f} points): " + "; ".join(shares), ""]
    if comparisons:
        corrected = holm([c[5] for c in comparisons])
        out += ["| comparison (paired by seed) | seeds | difference (points), mean ± 95% CI | t-test p: raw / Holm | "
                "sign-flip p | verdict |", "|---|---|---|---|---|---|"]
        for (budget, method, seeds, mean, half, p, flip), p_holm in zip(comparisons, corrected):
            verdict = ("separated" if p_holm < 0.05 else "not separated") + " (Holm-corrected)"
            out.append(f"| CoPES (K=4) − {method}, {budget} | {seeds} | {_fmt(mean, half)} | {p:.3f} / {p_holm:.3f} | "
                       f"{flip:.3f} (floor {sign_flip_floor(seeds):.4f}) | {verdict} |")
    return out


def curve_points(cell: dict[str, Any]) -> tuple[list[float], list[float]]:
    """A cell's curve as (x, held-out accuracy %): x in steps at equal rollouts (a point after every step, or the
    first and last only in cells saved before there was one per step), in training CPU seconds at equal wall
    clock."""
    accuracy = [100 * value for value in cell["curve"]["accuracy"]]
    if cell["budget"] == "equal wall clock":
        return cell["curve"]["seconds"], accuracy
    steps = cell["steps"]
    return (list(range(steps + 1)) if len(accuracy) == steps + 1 else [0, steps]), accuracy


def plot_curves(saved: list[dict[str, Any]], path: Path) -> None:
    """A panel per budget: each method's runs as thin lines and their mean over seeds as a thick one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(BUDGETS), figsize=(12, 4), dpi=100, sharey=True)
    for axis, budget in zip(axes, BUDGETS):
        for color, method in zip(("tab:red", "tab:blue", "tab:green", "tab:purple"), METHODS):
            curves = [curve_points(r) for r in saved if r["budget"] == budget and r["method"] == method]
            for x, y in curves:
                axis.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
            if curves and len({len(x) for x, _ in curves}) == 1:  # the mean where every run has the same points
                mean = [statistics.fmean(values) for values in zip(*(x for x, _ in curves))]
                axis.plot(mean, [statistics.fmean(values) for values in zip(*(y for _, y in curves))], color=color,
                          linewidth=2, marker="o", markersize=3, label=f"{method} ({len(curves)} seeds)")
        if budget == "equal rollouts":
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("ES steps" if budget == "equal rollouts" else "training CPU seconds", fontsize=8)
        axis.set_title(budget, fontsize=9)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    axes[0].set_ylabel("held-out accuracy (%): seeds thin, mean thick", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


CELLS_MARK = "<!-- cells on this page: {} -->"


def write_page(results: Path, settings: Settings, page: Path = PAGE) -> Path:
    """The page with its results section rewritten from the saved cells of `settings`, and their curves plotted
    beside it (the page's name, .png); where that section would hold fewer cells than the page's does now, the page
    stays and the new one is written beside it. Returns the path written."""
    saved = saved_cells(results, settings)
    head, _, rest = page.read_text(encoding="utf-8").partition(RESULTS_MARK)
    section, _, tail = rest.partition(END_MARK)
    held = re.search(CELLS_MARK.format(r"(\d+)"), section)
    target = page if len(saved) >= (int(held[1]) if held else 0) else page.with_name(
        f"{page.stem}.{len(saved)}-cells{page.suffix}")
    plot = target.with_suffix(".png")
    plot_curves(saved, plot)
    target.write_text("\n".join([head.rstrip("\n"), "", RESULTS_MARK, CELLS_MARK.format(len(saved)),
                                 f"![held-out accuracy along each run, by method]({plot.name})", "",
                                 *results_section(saved), END_MARK]) + tail, encoding="utf-8")
    return target


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--budgets", nargs="+", choices=BUDGETS, default=list(BUDGETS))
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "real_model")
    parser.add_argument("--write-only", action="store_true", help="rewrite the page from the saved cells only")
    args = parser.parse_args(argv)
    settings = Settings(**{name: getattr(args, name) for name in asdict(defaults)})
    todo = [] if args.write_only else [(budget, method, seed) for seed in range(settings.seeds)
                                       for budget, method in cells(args.methods, args.budgets)]
    for budget, method, seed in todo:
        result = run_cell(settings, args.results, budget, method, seed)
        print(f"{budget} | {method} | seed {seed}: {result['gain_points']:+.2f} points ({result['steps']} steps)",
              flush=True)
    written = write_page(args.results, settings)
    if written != PAGE:
        print(f"the saved cells of these settings are fewer than the {PAGE.name} holds: wrote {written} beside it")
    else:
        print(f"wrote {PAGE}")


if __name__ == "__main__":
    sys.exit(main())
