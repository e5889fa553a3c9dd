"""What a run leaves behind, in one place: the journal (every scored member and applied update: the durable
record), checkpoint exports, metrics.jsonl, rollout samples, the summary and its curve.

Only rank 0 writes (`writer=True`); every rank keeps the in-memory views the loop needs: which members of the
step in progress are already journaled, the held-out evaluations so far, the newest checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from copes.config.options import DEFAULT_OUTPUT_DIR, TrainConfig
from copes.errors import ConfigError
from copes.es.strategies.base import Strategy
from copes.run import checkpoint as ckpt
from copes.run.journal import JOURNAL_NAME, JournalWriter, RunJournal, build_header, journal_path
from copes.run.metrics import MetricsLog, log_table, plot_curves, start_wandb
from copes.run.replay import open_run, rebuild_weights
from copes.run.samples import SAMPLES_FILE, RolloutSamples
from copes.tasks import Example


def check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_test.{os.getpid()}"  # per process: torchrun ranks probe at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"output dir {folder} is not writable: {error.strerror or error}") from None


# What a run writes into its output folder (the journal first: it alone makes a folder "hold a run" for resume).
RUN_FILES = (JOURNAL_NAME, "metrics.jsonl", SAMPLES_FILE, "summary.json", "curve.png", "checkpoints", "tensorboard")


def occupied_error(out: Path) -> ConfigError:
    return ConfigError(f"{out} holds a run already: continue it with --resume {out}, start a new one with "
                       "--output-dir NEW_DIR, or replace it with --overwrite")


def holds_run(folder: Path) -> bool:
    return any((folder / name).exists() for name in RUN_FILES)


LOCK_NAME = ".copes-lock"  # a dotfile: not among RUN_FILES, so --overwrite never deletes it
_held_locks: dict[Path, int] = {}  # folder -> the open lock file's descriptor, held until this process ends


def lock_output_dir(folder: Path) -> None:
    """Make this process the only one writing `folder`, or refuse in one line naming the process that is. The
    lock is an flock on `folder/.copes-lock`: the kernel drops it when its holder ends, however it ends, so a killed
    run never blocks the next one, while a stopped one still holds it. Held until this process exits; taking it
    again in the same process is a no-op."""
    folder = folder.resolve()
    if folder in _held_locks:
        return
    check_writable(folder)
    path = folder / LOCK_NAME
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ConfigError(f"output dir {folder} is not writable: {error.strerror or error}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(descriptor, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(descriptor)
        raise ConfigError(f"{folder} is in use by {holder}; wait for it to end, or choose another "
                          "--output-dir") from None
    os.ftruncate(descriptor, 0)
    holder = f"{Path(sys.argv[0]).name} (pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')})"
    os.pwrite(descriptor, f"{holder}\n".encode(), 0)
    _held_locks[folder] = descriptor


def claim_output_dir(cfg: TrainConfig, *, resuming: bool, may_move: bool = True) -> TrainConfig:
    """The config of a run about to start, its output folder made safe: no run destroys another. A fresh run into a
    folder holding one is refused in one line, except that the default folder moves on to the first free
    `runs/copes-N` (said on stderr; `may_move=False` where ranks could not agree on one) and that `--overwrite`
    deletes the earlier run's files first. A resume continues its own folder. The folder is locked for this process
    (`lock_output_dir`), except in a torchrun's ranks other than 0, which write nothing: rank 0 holds it."""
    out = Path(cfg.output_dir)
    take_lock = lock_output_dir if os.environ.get("RANK", "0") == "0" else (lambda folder: None)
    if resuming or not holds_run(out):
        take_lock(out)
        return cfg
    if cfg.overwrite:
        take_lock(out)  # a live run's folder is refused before anything is deleted
        for name in RUN_FILES:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        print(f"note: --overwrite: deleted the earlier run in {out}", file=sys.stderr, flush=True)
        return cfg
    if may_move and cfg.output_dir == DEFAULT_OUTPUT_DIR:
        number = 2
        while holds_run(fresh := Path(f"{DEFAULT_OUTPUT_DIR}-{number}")):
            number += 1
        take_lock(fresh)
        print(f"note: {out} holds an earlier run; this run writes to {fresh} (--resume {out} continues that one, "
              "--output-dir chooses the folder)", file=sys.stderr, flush=True)
        return dataclasses.replace(cfg, output_dir=str(fresh))
    raise occupied_error(out)


@dataclass
class RunRecord:
    cfg: TrainConfig
    writer: bool  # rank 0 writes; the other ranks keep only the in-memory views
    journal: RunJournal | None = None  # opened by resume(), or started fresh by start_journal()
    eval_before: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    saved_step: int | None = None  # the step of the newest checkpoint on disk
    samples: RolloutSamples | None = None  # opened by open_logs(); a caller driving steps itself samples none
    metrics: MetricsLog | None = None
    wandb_run: Any = None

    def __post_init__(self) -> None:
        self.out = Path(self.cfg.output_dir)
        check_writable(self.out)

    def start_journal(self, model: torch.nn.Module, strategy: Strategy, model_path: str,
                      share: Callable[[str], str] = lambda value: value, data_files: Sequence[Path] = ()) -> None:
        """A fresh journal for a new run; `share` hands rank 0's run id to every rank; `data_files` are hashed."""
        run_id = share(uuid.uuid4().hex)
        writer = None
        if self.writer:
            if journal_path(self.out).exists() and not self.cfg.overwrite:  # a caller that skipped claim_output_dir
                raise occupied_error(self.out)
            header = build_header(self.cfg, model, strategy, model_path, run_id=run_id, data_files=data_files)
            writer = JournalWriter.create(journal_path(self.out), header)
        self.journal = RunJournal(run_id, writer)

    def resume(self, path: str, model: torch.nn.Module, strategy: Strategy, *, progress: bool,
               save: Callable[[int], None], share: Callable[[Any], Any]) -> int:
        """Continue the run journaled in `path` (its newest checkpoint plus a replay of every journaled update
        after it, `save(step)` writing on the way the checkpoints it lacks; `share` hands rank 0's findings to every
        rank); returns the number of steps done."""
        resumed = open_run(path, self.cfg, model, strategy, writer=self.writer)
        steps_done = resumed.contents.steps_done
        self.journal = resumed.journal
        self.eval_before, self.evals = resumed.contents.eval_before, resumed.contents.evals(steps_done)
        self.saved_step = rebuild_weights(resumed, self.cfg, model, strategy, save=save, share=share,
                                          writer=self.writer, progress=progress) or None
        if self.writer:  # the journal holds every finished step's metrics record, whatever metrics.jsonl kept
            records = resumed.contents.updates
            ckpt.write_text_atomic(self.out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        return steps_done

    def open_logs(self, start_step: int, sample_questions: Sequence[Example]) -> None:
        cfg = self.cfg
        if cfg.wandb and self.writer:
            self.wandb_run = start_wandb(cfg.wandb_project, self.out, cfg.to_dict())
        self.metrics = MetricsLog(self.out / "metrics.jsonl" if self.writer else None, keep_through_step=start_step,
                                  tensorboard=cfg.tensorboard, wandb_run=self.wandb_run)
        self.samples = RolloutSamples(self.out / SAMPLES_FILE if self.writer else None, sample_questions,
                                      cfg.sample_every, keep_through_step=start_step)

    def write_samples(self, step: int, rewards: Sequence[torch.Tensor]) -> None:
        if (written := self.samples.write(step, rewards)) and self.wandb_run is not None:
            log_table(self.wandb_run, "samples", written, step)

    def record_eval_before(self, record: dict[str, Any]) -> None:
        self.eval_before = record
        self.journal.record_eval_before(record)

    def record_step(self, step: int, record: dict[str, Any]) -> None:
        self.journal.record_update(step, record)
        self.metrics.append(record)

    def save(self, step: int, model: torch.nn.Module, tokenizer: Any, strategy: Strategy) -> None:
        if self.writer:
            state = {"step": step, "config": self.cfg.to_dict(), "eval_before": self.eval_before,
                     "evals": [record for record in self.evals if record["step"] <= step],  # one written on resume
                     "run_id": self.journal.run_id}
            ckpt.save_checkpoint(self.out / "checkpoints", step, model=model, tokenizer=tokenizer,
                                 es_state=strategy.state_dict(), trainer_state=state)
        self.saved_step = step

    def write_summary(self, summary: dict[str, Any], title: str) -> None:
        ckpt.write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=1))
        plot_curves(self.metrics.records, self.evals, self.out / "curve.png", title)
        if self.wandb_run is not None:
            self.wandb_run.summary.update({"eval_before_accuracy": self.eval_before["accuracy"],
                                           "eval_after_accuracy": summary["eval_after"]["accuracy"],
                                           "steps": summary["steps"]})
            self.wandb_run.finish()
