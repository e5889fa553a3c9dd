"""Where a run reports: metrics.jsonl, the curve PNG, peak memory, progress and the warnings a
step's numbers call for.

Progress bars draw only on a terminal; in a log file (stderr not a TTY) the outer loop prints a plain line every
`PLAIN_PROGRESS_EVERY_S` seconds instead, and nested bars print nothing, so logs hold no carriage returns."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from copes.errors import UserError

PLAIN_PROGRESS_EVERY_S = 30.0

def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Peak resident host memory of this process and, on CUDA, peak allocated device memory."""
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    host = max_rss if sys.platform == "darwin" else max_rss * 1024  # Linux reports KiB, macOS bytes
    peaks = {"host": int(host)}
    if device.type == "cuda":
        peaks["device"] = int(torch.cuda.max_memory_allocated(device))
    return peaks


def records_through_step(path: Path, keep_through_step: int) -> list[dict[str, Any]]:
    """Rewrite the JSON-lines file `path` (atomically) keeping only its records of steps <= `keep_through_step`,
    and return them: on resume, what lies past the resume point will be written again, and a crash may have torn
    the last line."""
    kept: list[dict[str, Any]] = []
    if keep_through_step and path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line from a crash
            if record.get("step", 0) <= keep_through_step:
                kept.append(record)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(temporary, path)
    return kept


def import_wandb() -> Any:
    """The wandb module, or the one line saying how to install it (asked before the model loads, not after)."""
    try:
        import wandb
    except ImportError:
        raise UserError("W&B logging needs the wandb package: pip install 'copes[wandb]'") from None
    return wandb


def start_wandb(project: str, run_dir: Path, config: dict[str, Any]) -> Any:
    """A Weights & Biases run writing under `run_dir/wandb`; with WANDB_MODE=offline it needs no network (upload it
    later with `wandb sync`)."""
    return import_wandb().init(project=project, name=run_dir.name, dir=str(run_dir), config=config)


def log_table(run: Any, name: str, records: list[dict[str, Any]], step: int) -> None:
    """`records` (dicts with the same keys) as one W&B table at `step`; lists and dicts are shown as JSON."""
    import wandb

    columns = list(records[0])
    rows = [[v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v) for v in r.values()]
            for r in records]
    run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)


def _scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers, nested dicts flattened as `time/rollout`, `eval/accuracy`."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat |= _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            flat[prefix + key] = value
    return flat


class MetricsLog:
    """Append-only metrics.jsonl, flushed per record; on resume, records past the checkpoint are dropped (a
    crash can leave steps that the checkpoint does not hold, and they will be re-run). `path=None` keeps the
    records in memory only (ranks other than 0)."""

    def __init__(self, path: Path | None, *, keep_through_step: int = 0, tensorboard: bool = False,
                 wandb_run: Any = None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.board, self.wandb_run = None, wandb_run
        if path is None:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("TensorBoard output needs the tensorboard package: "
                                "pip install 'copes[tensorboard]'") from None
            self.board = SummaryWriter(str(path.parent / "tensorboard"))
        self.records = records_through_step(path, keep_through_step)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.board.add_scalar(key, value, record["step"])
            self.board.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(_scalars(record), step=record["step"])


def plot_curves(records: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, title: str) -> None:
    """Mean/max training reward per step and held-out accuracy at each evaluation, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, reward_axis = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r["step"] for r in records]
    reward_axis.plot(steps, [r["mean_reward"] for r in records], label="reward (population mean)", color="tab:blue")
    reward_axis.plot(steps, [r["max_reward"] for r in records], label="reward (best member)", color="tab:blue",
                     alpha=0.35)
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel("training reward")
    handles, labels = reward_axis.get_legend_handles_labels()
    evals = [e for e in evals if e.get("accuracy") is not None]  # skipped ones (--eval-size 0, budget spent)
    if evals:
        accuracy_axis = reward_axis.twinx()
        # Two evaluations (before and after, the default) are points, not a trend: a line between them would
        # draw a learning curve that was never measured. Each point is labelled with its value.
        eval_steps, accuracies = [e["step"] for e in evals], [100 * e["accuracy"] for e in evals]
        accuracy_axis.plot(eval_steps, accuracies, "o-" if len(evals) > 2 else "o", color="tab:orange",
                           label="held-out accuracy (%)")
        for step, accuracy in zip(eval_steps, accuracies):
            accuracy_axis.annotate(f"{accuracy:.1f}", (step, accuracy), textcoords="offset points", xytext=(0, 6),
                                   ha="center", fontsize=7, color="tab:orange")
        accuracy_axis.margins(y=0.15)  # room for the value labels
        accuracy_axis.set_ylabel("held-out accuracy (%)")
        more_handles, more_labels = accuracy_axis.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    reward_axis.legend(handles, labels, loc="lower right", fontsize=8)
    reward_axis.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class PlainProgress:
    """A progress bar's content as plain lines for logs: `desc: i/total key=value` at the first item, then at
    most every `interval_s` seconds, and at the last."""

    def __init__(self, iterable: Any, *, desc: str, total: int | None = None, initial: int = 0,
                 interval_s: float = PLAIN_PROGRESS_EVERY_S) -> None:
        self.iterable, self.desc, self.initial, self.interval_s = iterable, desc, initial, interval_s
        self.total = total if total is not None else initial + len(iterable)
        self.postfix = ""

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " ".join(f"{key}={value}" for key, value in values.items())

    def __iter__(self) -> Iterator[Any]:
        last = -float("inf")
        for done, item in enumerate(self.iterable, start=self.initial + 1):
            yield item  # the loop's body runs here; the line reports it finished
            now = time.perf_counter()
            if now - last >= self.interval_s or done == self.total:
                print(f"{self.desc}: {done}/{self.total} {self.postfix}".rstrip(), file=sys.stderr, flush=True)
                last = now


def progress_bar(iterable: Any, *, desc: str, enabled: bool, nested: bool = False, **options: Any) -> Any:
    """A tqdm bar on a terminal; plain periodic lines elsewhere (none for a `nested` bar); nothing when not
    `enabled`. Each supports `set_postfix`."""
    from tqdm.auto import tqdm

    if enabled and sys.stderr.isatty():
        return tqdm(iterable, desc=desc, **options)
    if enabled and not nested:
        return PlainProgress(iterable, desc=desc, total=options.get("total"), initial=options.get("initial", 0))
    return tqdm(iterable, disable=True)


def zero_update_warning(step: int, stats: Any) -> str:
    """Why step `step` left the weights where they were: every member scored the same (the fitness of each
    member, after invalid rewards were scored as the worst, had no spread)."""
    invalid = f"; {stats.num_invalid_rewards} rewards were invalid" if stats.num_invalid_rewards else ""
    return (f"step {step} applied no update: every member scored the same mean reward ({stats.mean_reward:.4g}"
            f"{invalid}), so no direction was better. The task's reward gives this model no signal: check the "
            "samples (samples.jsonl), give partial credit, or start from a model that solves some questions. "
            "(Reported once; metrics.jsonl marks every such step zero_update.)")
