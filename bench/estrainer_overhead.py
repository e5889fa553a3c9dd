"""What copes.ESTrainer adds to a step: the same run through `copes-run` and through ESTrainer, side by side.

Both train the embedded tiny model on the same rows (a .jsonl file for copes-run, the same rows as a
datasets.Dataset for ESTrainer) with the same reward on the same path: the built-in `exact` (`--reward exact`;
`reward_funcs=["exact"]`), called in process by both. A user's MODULE:FUNCTION reward would not do: copes-run calls
it in a worker process of its own (a deadline, isolation from the trainer), ESTrainer calls a Python callable in
process as TRL does, and that difference is the reward's path, not ESTrainer's overhead. The same ES settings and
seed; the step time of each is the Trainer's own training wall time (summary.json `wall_seconds`, no held-out
evaluation, model loading excluded) over the steps; rounds alternate the two, and each keeps its fastest round (a
shared machine only ever adds time). Goal: ESTrainer / copes-run <= 1.02.

    python bench/estrainer_overhead.py [--steps 5] [--rounds 3] [--population 8] [--prompt-batch 32]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from common.harness import machine_note, report

REWARD = "exact"  # a built-in: both paths call it in process


def rows(count: int = 500) -> list[dict[str, str]]:
    rng = random.Random(0)
    pairs = [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(count)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def settings(options: argparse.Namespace) -> dict[str, object]:
    """TrainConfig options both runs share (copes-run also reads the tiny model's preset; these override it)."""
    return dict(algorithm="copes", population=options.population, subspaces=2, sigma=0.01, lr=0.0025,
                prompt_batch=options.prompt_batch, max_new_tokens=6, chunk_size=4096, steps=options.steps, seed=0,
                eval_size=0, cpu_threads=1, checkpoint_every=0, sample_every=0, budget_hours=10.0)


def through_copes_run(data: Path, out: Path, options: argparse.Namespace) -> float:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in settings(options).items()]
    subprocess.run([sys.executable, "-c", "from copes.cli import run_command; run_command()", *flags,
                    f"--task={data}", "--task-options", "chat=false", f"--reward={REWARD}", "--model=tiny",
                    f"--output-dir={out}", "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())["wall_seconds"] / options.steps


def through_estrainer(data: list[dict[str, str]], out: Path, options: argparse.Namespace) -> float:
    from datasets import Dataset

    from copes import ESConfig, ESTrainer
    from copes.trl.config import GRPO_NAMES

    es_fields = {GRPO_NAMES.get(name, name): value for name, value in settings(options).items()}
    trainer = ESTrainer(model="tiny", reward_funcs=[REWARD], args=ESConfig(output_dir=str(out), **es_fields),
                        train_dataset=Dataset.from_list(data))
    trainer.train()
    return trainer.summary["wall_seconds"] / options.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompt-batch", type=int, default=32)
    options = parser.parse_args()
    data = rows()
    best = {"copes-run": float("inf"), "ESTrainer": float("inf")}
    with tempfile.TemporaryDirectory(prefix="estrainer-bench-") as folder:
        data_file = Path(folder) / "sums.jsonl"
        data_file.write_text("".join(json.dumps(row) + "\n" for row in data))
        for round_index in range(options.rounds):
            best["copes-run"] = min(best["copes-run"],
                                    through_copes_run(data_file, Path(folder) / f"run-{round_index}", options))
            best["ESTrainer"] = min(best["ESTrainer"],
                                    through_estrainer(data, Path(folder) / f"es-{round_index}", options))
    report("estrainer_overhead", [
        {"path": "copes-run", "seconds_per_step": best["copes-run"], "ratio": 1.0},
        {"path": "ESTrainer", "seconds_per_step": best["ESTrainer"],
         "ratio": best["ESTrainer"] / best["copes-run"]},
    ], f"ESTrainer vs copes-run, {options.steps} steps, N={options.population}, {options.prompt_batch} questions per "
       f"step, best of {options.rounds} rounds ({machine_note()})")


if __name__ == "__main__":
    main()
