"""Rebuilding weights from a journal: resume after a crash, and `copes-replay`.

A journaled step is replayed by handing its recorded rewards to the strategy's own `apply_update`, which
regenerates the noise from the seeds: no rollouts, and the fp32 masters, stochastic rounding and Adam moments
evolve exactly as they did in the run. One exception: `--restore subtract` undoes a perturbation only up to
rounding, so every member's perturb + subtract left its trace in the weights; that mode replays each member's
perturbation and restore too (still without rolling out). Each replayed update's norm must equal the journaled
one bit for bit, so a journal replayed on another backend or copes version fails loudly instead of drifting.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from copes.choices import PER_MEMBER_ALGORITHMS
from copes.config.options import ConfigError, TrainConfig
from copes.errors import UserError
from copes.es.strategies.base import Strategy
from copes.rollout.vllm.views import stored_tensors
from copes.run import checkpoint as ckpt
from copes.run.journal import (
    JournalContents,
    JournalWriter,
    RunJournal,
    check_same_data,
    check_same_model,
    check_same_run,
    read_journal,
)


def replays_members(cfg: TrainConfig) -> bool:
    """Whether evaluating a member changes the weights after its restore (only inexact subtract restore does)."""
    return cfg.algorithm in PER_MEMBER_ALGORITHMS and cfg.restore == "subtract"


def replay_member(strategy: Strategy, member: int, rewards: torch.Tensor) -> None:
    """Perturb and restore `member` as its evaluation did, answering with its journaled rewards."""
    strategy.evaluate_member(member, lambda _model: rewards)


def replay_steps(strategy: Strategy, contents: JournalContents, first: int, last: int, *, with_members: bool,
                 progress: bool, after: Callable[[int], None] = lambda step: None) -> None:
    """Apply the journaled updates of steps first..last (counted from 1) to a strategy that completed first - 1,
    calling `after(step)` once each is applied."""
    for step in tqdm(range(first, last + 1), desc="replaying journal", disable=not progress, leave=False):
        rewards = contents.rewards_of(step)
        if with_members:
            for member in range(contents.population):
                replay_member(strategy, member, rewards[member])
        norm, journaled = strategy.apply_update(rewards).update_norm, contents.updates[step - 1]["update_norm"]
        if norm != journaled:
            raise ConfigError(f"{contents.path}: replaying step {step} gave update norm {norm!r}, the run recorded "
                              f"{journaled!r}: it ran on another device or backend, or another copes version")
        after(step)


def say_torn_tail(contents: JournalContents) -> None:
    """One line when the journal ends in a record a crash cut short: what is used is its complete records only."""
    if contents.torn:
        tqdm.write(f"note: {contents.path} ends in a record cut short by a crash; using its complete records "
                   f"({contents.steps_done} steps)", file=sys.stderr)


@dataclass
class RunCheckpoints:
    """This run's checkpoints (a previous run's in the same folder are ignored), each verified against its
    checksums: the intact ones by step, and the steps of those found corrupt (each said in one warning line)."""
    intact: dict[int, Path]
    corrupt: set[int]

    @classmethod
    def of(cls, run_dir: Path, run_id: str, steps_done: int) -> RunCheckpoints:
        intact: dict[int, Path] = {}
        corrupt: set[int] = set()
        for folder in sorted((run_dir / "checkpoints").glob("step-*"), reverse=True):
            try:  # cheap look first: only this run's checkpoints are worth verifying
                state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                state = {}
            if state.get("run_id") != run_id:
                continue
            try:
                ckpt.verify_checkpoint(folder)
            except UserError as error:  # a flipped byte, a missing file: the journal rebuilds the step anyway
                tqdm.write(f"warning: {error}; skipping it (an older checkpoint or the journal rebuilds its weights)",
                           file=sys.stderr)
                corrupt.add(state["step"])
                continue
            if state["step"] > steps_done:
                raise ConfigError(f"{run_dir}: checkpoint step {state['step']} is newer than the journal's last "
                                  f"update (step {steps_done}): the journal lost records")
            intact[state["step"]] = folder
        return cls(intact, corrupt)

    def missing(self, checkpoint_every: int, steps_done: int) -> list[int]:
        """The steps to write again while replaying: each --checkpoint-every step with no intact checkpoint (a crash
        cut it short, or it is corrupt), and every other corrupt one."""
        due = set(range(checkpoint_every, steps_done + 1, checkpoint_every)) if checkpoint_every else set()
        return sorted(step for step in (due | self.corrupt) - self.intact.keys() if step <= steps_done)

    def start(self, before: int) -> int:
        """The step of the newest intact checkpoint at or before `before` (0: the base model)."""
        return max((step for step in self.intact if step <= before), default=0)


def load_checkpoint_into(folder: Path, model: torch.nn.Module, strategy: Strategy) -> None:
    weights = type(model).from_pretrained(folder, dtype=model.dtype).state_dict()
    # A parameter kept wider than the model's dtype (the vLLM engine's fp32 A_log) comes back at its own precision.
    wider = {name for name, param in model.named_parameters() if param.dtype != model.dtype}
    weights.update(stored_tensors(folder, wider))
    model.load_state_dict(weights, strict=False)
    strategy.load_state_dict(ckpt.load_checkpoint(folder, verified=True)[0])


@dataclass
class Resumed:
    journal: RunJournal
    contents: JournalContents
    run_dir: Path


def open_run(run_dir: str | Path, cfg: TrainConfig, model: torch.nn.Module, strategy: Strategy, *,
             writer: bool) -> Resumed:
    """Check the journal against this run (the model must still be the base model) and open it for appending
    (`writer`: rank 0); `rebuild_weights` then brings the weights to its last step."""
    run_dir = Path(run_dir)
    contents = read_journal(run_dir)
    if writer:
        say_torn_tail(contents)
    check_same_run(run_dir, contents.header, cfg)
    check_same_model(run_dir, contents.header, model, strategy)
    check_same_data(run_dir, contents.header)
    next_step = contents.steps_done + 1
    journal = RunJournal(contents.header["run_id"],
                         JournalWriter(contents.path, keep_bytes=contents.valid_bytes) if writer else None,
                         {next_step: dict(contents.members.get(next_step, {}))})
    return Resumed(journal=journal, contents=contents, run_dir=run_dir)


def rebuild_weights(resumed: Resumed, cfg: TrainConfig, model: torch.nn.Module, strategy: Strategy, *,
                    save: Callable[[int], None], share: Callable[[Any], Any], writer: bool, progress: bool) -> int:
    """Load the run's newest intact checkpoint and replay every journaled update after it, writing on the way the
    checkpoints the run lacks (`save(step)` at each of `RunCheckpoints.missing`; replay then starts from the newest
    intact checkpoint before the first of them). Rank 0 (`writer`) checks the checkpoints and `share`s what it found
    with the other ranks, which must save at the same steps. Returns the step of the newest checkpoint now on disk
    (0: none)."""
    contents = resumed.contents
    found = None
    if writer:
        checkpoints = RunCheckpoints.of(resumed.run_dir, contents.header["run_id"], contents.steps_done)
        missing = checkpoints.missing(cfg.checkpoint_every, contents.steps_done)
        start = checkpoints.start(missing[0] if missing else contents.steps_done)
        found = (missing, start, checkpoints.intact.get(start), max([*checkpoints.intact, *missing], default=0))
    missing, start, folder, newest = share(found)
    if folder is not None:
        load_checkpoint_into(folder, model, strategy)
    if writer:
        ckpt.remove_partial_checkpoints(resumed.run_dir / "checkpoints")
    replay_steps(strategy, contents, start + 1, contents.steps_done, with_members=replays_members(cfg),
                 progress=progress, after=lambda step: save(step) if step in missing else None)
    return newest


def replay_run(run_dir: str | Path, output: str | Path, *, step: int | None = None, device: str | None = None,
               progress: bool = True) -> tuple[int, float]:
    """Rebuild the weights of `step` (default: the last) from the base model and the journal alone and write a
    save_pretrained folder; returns (steps replayed, seconds)."""
    from copes.config.components import build_strategy
    from copes.config.options import FIELD_NAMES, build_config
    from copes.modeling import load_model

    run_dir = Path(run_dir)
    contents = read_journal(run_dir)
    say_torn_tail(contents)
    target = contents.steps_done if step is None else step
    if not 0 <= target <= contents.steps_done:
        raise ConfigError(f"--step {step} is outside the journal of {run_dir}, "
                          f"which holds steps 0..{contents.steps_done}")
    saved = {k: v for k, v in contents.header["config"].items() if k in FIELD_NAMES}
    cfg = build_config(saved, {"device": device})
    model, tokenizer, _ = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    strategy = build_strategy(cfg, model)
    check_same_model(run_dir, contents.header, model, strategy)
    started = time.perf_counter()
    replay_steps(strategy, contents, 1, target, with_members=replays_members(cfg), progress=progress)
    seconds = time.perf_counter() - started
    try:
        Path(output).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(output, safe_serialization=True)
        tokenizer.save_pretrained(output)
    except OSError as error:
        raise ConfigError(f"cannot write {output}: {error.strerror or error}") from None
    return target, seconds
