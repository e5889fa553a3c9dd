"""The paper's claims, tested as far as this machine reaches: writes docs/paper-claims.md.

The ablations run on the embedded tiny model (copes/assets/tiny) and its arithmetic task, every configuration at
the same seeds (a seed fixes the prompt order, the noise and the partitions, so runs are paired by seed), in two
budgets: equal evaluations (the same number of member rollouts: `--steps` steps of N x prompt batch) and equal wall
clock (the same CPU seconds of training, `--budget-s`, the clock stopped during held-out evaluations; the existing
GRPO race of bench/vs_grpo.py joins here at the same seeds). Each cell (configuration, budget, seed) is one run in
its own process and is saved as JSON under the results folder as soon as it ends, so a stopped table resumes where
it stopped. The page gives each configuration's held-out gain (points) as mean ± 95% CI over seeds, and each
comparison as the mean paired difference ± 95% CI with a paired t-test's p-value.

Memory against context comes from bench/memory_context.py's CSV (the page quotes it) and the plan's GRPO column from
`copes-run --plan`.

    python bench/paper_claims.py --quick            # every cell at a tiny size (minutes), the page from it
    nice -n 15 python bench/paper_claims.py         # the full table (resumes from bench/results/paper_claims/)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vs_grpo import GRPO, Job, run_job

from harness import RESULTS_DIR

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "paper-claims.md"
TINY_SIGMA = 0.01  # copes/assets/tiny/copes.yaml
# Binding row names: K = 1 ... K = 8, "per-subspace", "σ√K". Each is `copes-run` on the tiny model's preset with
# these overrides (N = 40 for the per-member rows; EGGROLL and the hybrid at their own presets' rollouts per step).
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "K = 1": ("ES (K=1)", {}),
    "K = 2": ("CoPES", {"subspaces": 2}),
    "K = 4": ("CoPES", {"subspaces": 4}),
    "K = 8": ("CoPES", {"subspaces": 8}),
    "K = 4, per-subspace standardization": ("CoPES", {"subspaces": 4, "fitness": "per_subspace"}),
    "K = 1 at σ√K (σ = 0.02)": ("ES (K=1)", {"sigma": TINY_SIGMA * 2}),
    "EGGROLL": ("EGGROLL", {}),
    "hybrid (copes-lowrank, K = 4)": ("CoPES", {"algorithm": "copes-lowrank", "subspaces": 4, "rank": 1}),
}
# (claim, configuration, baseline, the sign of configuration - baseline the paper reports: +1 better, -1 worse,
# 0 no claim, shown beside), the paper's words.
COMPARISONS = [
    ("CoPES beats ES", "K = 4", "K = 1", +1, "CoPES > ES on every metric (92% vs 67% of GRPO's gain at 4B)"),
    ("K = 4 beats K = 2", "K = 2", "K = 4", -1, "K = 4 is best"),
    ("K = 8 is worse than K = 4", "K = 8", "K = 4", -1, "K = 8 is worse than K = 4"),
    ("joint beats per-subspace standardization", "K = 4, per-subspace standardization", "K = 4", -1,
     "joint standardization is better"),
    ("ES at σ√K is worse, not better", "K = 1 at σ√K (σ = 0.02)", "K = 4", -1,
     "ES given CoPES's per-coordinate scale σ√K is worse"),
    ("EGGROLL beside CoPES", "EGGROLL", "K = 4", 0, "-"),
    ("the hybrid beside CoPES", "hybrid (copes-lowrank, K = 4)", "K = 4", 0, "-"),
]
BUDGETS = ("equal evaluations", "equal wall clock")


@dataclass(frozen=True)
class Settings:
    seeds: int
    steps: int  # equal evaluations: ES steps per run
    budget_s: float  # equal wall clock: CPU seconds of training per run
    eval_size: int
    grpo_lr: float
    results: Path


FULL = dict(seeds=5, steps=12, budget_s=60.0, eval_size=500, grpo_lr=1e-4)
QUICK = dict(seeds=5, steps=1, budget_s=2.0, eval_size=16, grpo_lr=1e-4)


def cell_path(settings: Settings, budget: str, config: str, seed: int) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in config).strip("_")
    return settings.results / budget.replace(" ", "_") / f"{slug}__seed{seed}.json"


def run_cell(settings: Settings, budget: str, config: str, seed: int) -> dict[str, Any]:
    """One run, or its saved result (resumable cell by cell)."""
    path = cell_path(settings, budget, config, seed)
    if path.is_file():
        return json.loads(path.read_text())
    if config == GRPO:
        job = Job(GRPO, seed, settings.grpo_lr, settings.budget_s, 1, settings.eval_size)
    else:
        method, overrides = CONFIGS[config]
        equal_evaluations = budget == "equal evaluations"
        job = Job(method, seed, None, math.inf if equal_evaluations else settings.budget_s, 1, settings.eval_size,
                  tuple(sorted(overrides.items())), max_steps=settings.steps if equal_evaluations else None)
    curve = run_job(job)
    result = {"config": config, "budget": budget, "seed": seed, "steps": curve.steps,
              "before": curve.accuracies[0], "after": curve.accuracies[-1], "gain_points": 100 * curve.gain,
              "cpu_seconds": curve.seconds[-1], "wall_seconds": curve.wall_seconds[-1]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired(first: Sequence[float], second: Sequence[float]) -> tuple[float, float, float]:
    """Mean paired difference, its 95% half-width and the paired t-test's two-sided p-value."""
    from scipy import stats

    differences = [a - b for a, b in zip(first, second)]
    mean, half = interval(differences)
    p = stats.ttest_rel(first, second).pvalue if len(differences) > 1 and len(set(differences)) > 1 else math.nan
    return mean, half, float(p)


def _fmt(mean: float, half: float) -> str:
    return f"{mean:+.2f} ± {half:.2f}"


def verdict(mean: float, half: float, expected_sign: int) -> str:
    """`expected_sign`: the sign of the difference the paper reports (0: no claim)."""
    if expected_sign == 0:
        return "no claim (beside it)"
    if math.isnan(half):
        return "not testable (one seed)"
    if abs(mean) <= half:
        return "not reproduced: not separated at 95%"
    return "reproduced" if (mean > 0) == (expected_sign > 0) else "not reproduced: the opposite, separated"


def tables(results: list[dict[str, Any]], settings: Settings) -> list[str]:
    out = []
    for budget in BUDGETS:
        cells = [r for r in results if r["budget"] == budget]
        if not cells:
            continue
        gains = {c: {r["seed"]: r["gain_points"] for r in cells if r["config"] == c}
                 for c in dict.fromkeys(r["config"] for r in cells)}
        what = (f"{settings.steps} steps (N x prompt batch rollouts each)" if budget == "equal evaluations"
                else f"{settings.budget_s:g} CPU seconds of training")
        out += [f"### {budget.capitalize()}: {what}", "",
                "| configuration | seeds | held-out gain (points), mean ± 95% CI | steps (mean) |", "|---|---|---|---|"]
        for config, by_seed in gains.items():
            mean, half = interval(list(by_seed.values()))
            steps = statistics.fmean(r["steps"] for r in cells if r["config"] == config)
            out.append(f"| {config} | {len(by_seed)} | {_fmt(mean, half)} | {steps:.1f} |")
        out += ["", "| comparison (paired by seed) | difference (points), mean ± 95% CI | paired t-test p | verdict |",
                "|---|---|---|---|"]
        for claim, config, baseline, sign, _ in COMPARISONS:
            if config not in gains or baseline not in gains:
                continue
            seeds = sorted(set(gains[config]) & set(gains[baseline]))
            mean, half, p = paired([gains[config][s] for s in seeds], [gains[baseline][s] for s in seeds])
            out.append(f"| {claim}: {config} − {baseline} ({len(seeds)} seeds) | {_fmt(mean, half)} | {p:.3f} | "
                       f"{verdict(mean, half, sign)} |")
        out.append("")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every cell at a tiny size (the smoke run)")
    parser.add_argument("--seeds", type=int)
    parser.add_argument("--steps", type=int, help="equal evaluations: steps per run")
    parser.add_argument("--budget-s", type=float, help="equal wall clock: CPU seconds of training per run")
    parser.add_argument("--eval-size", type=int)
    parser.add_argument("--configs", nargs="+", choices=[*CONFIGS, GRPO], default=[*CONFIGS, GRPO])
    parser.add_argument("--budgets", nargs="+", choices=BUDGETS, default=list(BUDGETS))
    parser.add_argument("--results", type=Path, help="the cells' folder (default bench/results/paper_claims[_quick])")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to write")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    chosen = {name: getattr(args, name) for name in ("seeds", "steps", "budget_s", "eval_size")}
    settings = Settings(**{**base, **{k: v for k, v in chosen.items() if v is not None}},
                        results=args.results or RESULTS_DIR / ("paper_claims_quick" if args.quick else "paper_claims"))
    results = []
    for seed in range(settings.seeds):  # seed-major: a stopped table has every configuration at its first seeds
        for budget in args.budgets:
            for config in args.configs:
                if config == GRPO and budget != "equal wall clock":
                    continue  # GRPO's evaluations are not ES member rollouts: it races at equal wall clock only
                result = run_cell(settings, budget, config, seed)
                results.append(result)
                print(f"{budget} | {config} | seed {seed}: {result['gain_points']:+.2f} points "
                      f"({result['steps']} steps)", flush=True)
    args.page.write_text(render(results, settings, quick=args.quick))
    print(f"wrote {args.page}")


def render(results: list[dict[str, Any]], settings: Settings, *, quick: bool) -> str:
    lines = [f"<!-- written by bench/paper_claims.py{' --quick' if quick else ''}; settings: "
             f"{json.dumps({k: v for k, v in asdict(settings).items() if k != 'results'})} -->"]
    lines += tables(results, settings)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
