"""What durability costs and buys: the run journal against full checkpoints, measured side by side in one run.

  bytes per step    journal bytes a step appends (N member records + one update record) vs one full checkpoint
                    (save_pretrained weights + ES state), for the tiny model and the 102M-parameter model
  resume at step S  a run killed right after step S's update record (S = 100 by default), resumed from the
                    journal alone (replay from the base model) vs from a checkpoint at step S: `Trainer.resume`
  replay speed      `copes-replay` steps per second against the training steps per second of the same run

tiny   the embedded model through the real trainer (synthetic arithmetic, per-question rewards), S steps.
large  the random 102M-parameter Qwen3.5-architecture model under CoPES, rewarded with the mean log-likelihood
       of its greedy continuation of random prompts (per prompt), journaled with the trainer's own RunJournal.

    python bench/journal_cost.py [--steps 100] [--population 8] [--large-steps 2] [--skip-large]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import copes
from copes.config.options import build_config
from copes.run import checkpoint as ckpt
from copes.run.journal import JournalContents, JournalWriter, RunJournal, build_header, journal_path, read_journal
from copes.run.replay import replay_run, replay_steps
from copes.run.trainer import Trainer

from common.harness import machine_note, pin_one_thread, report
from common.models import (
    LargeModelShape,
    add_large_model_arguments,
    build_large_model,
    greedy_log_likelihood,
    large_model_shape,
    parameter_count,
    random_prompts,
    train_config,
)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def bytes_per_step(run_dir: Path) -> float:
    """Journal bytes appended per step: everything after the header and the evaluation before training."""
    lines = journal_path(run_dir).read_bytes().splitlines(keepends=True)
    steps = read_journal(run_dir).steps_done
    return sum(len(line) for line in lines if b'"kind":"member"' in line or b'"kind":"update"' in line) / steps


def timed_resume(cfg_flags: dict[str, Any], model: str, run_dir: Path) -> float:
    """Seconds of `Trainer.resume` (fingerprint, journal read, checkpoint load or replay) on a fresh trainer."""
    trainer = Trainer(train_config(model, {**cfg_flags, "output_dir": str(run_dir)}), progress=False)
    start = time.perf_counter()
    trainer.resume(str(run_dir))
    return time.perf_counter() - start


def measure_tiny(model: str, *, steps: int, population: int, subspaces: int, prompt_batch: int) -> list[dict[str, Any]]:
    flags = {"population": population, "subspaces": subspaces, "prompt_batch": prompt_batch, "steps": steps,
             "eval_size": 0, "checkpoint_every": 0, "cpu_threads": 1}
    with tempfile.TemporaryDirectory(prefix="copes-journal-bench-") as scratch:
        with_checkpoint = Path(scratch) / "with-checkpoint"
        trainer = Trainer(train_config(model, {**flags, "output_dir": str(with_checkpoint)}), progress=False)
        summary = trainer.train()  # ends with its one checkpoint, at step S
        phases = summary["phase_seconds"]
        train_s_per_step = sum(v for k, v in phases.items() if k not in ("evaluate", "checkpoint")) / steps
        checkpoint_bytes = folder_bytes(with_checkpoint / "checkpoints" / f"step-{steps:06d}")
        journal_only = Path(scratch) / "journal-only"
        shutil.copytree(with_checkpoint, journal_only)
        shutil.rmtree(journal_only / "checkpoints")  # as if killed right after step S's update record
        resume_checkpoint = timed_resume(flags, model, with_checkpoint)
        resume_journal = timed_resume(flags, model, journal_only)
        replayed, replay_seconds = replay_run(journal_only, Path(scratch) / "replayed", progress=False)
        journal_bytes = bytes_per_step(journal_only)
    name = f"tiny ({parameter_count(trainer.model) / 1e6:.2f}M), N={population}, {prompt_batch} questions"
    return [{
        "workload": name, "steps": steps, "journal_B_per_step": round(journal_bytes),
        "checkpoint_B": checkpoint_bytes, "checkpoint_over_journal_step": round(checkpoint_bytes / journal_bytes),
        "resume_journal_only_s": resume_journal, "resume_from_checkpoint_s": resume_checkpoint,
        "train_s_per_step": train_s_per_step, "replay_s_per_step": replay_seconds / replayed,
        "replay_speedup_vs_training": train_s_per_step * replayed / replay_seconds,
    }]


def measure_large(shape: LargeModelShape, *, steps: int, population: int, subspaces: int, prompt_batch: int,
                  prompt_tokens: int, new_tokens: int) -> list[dict[str, Any]]:
    model = build_large_model(shape)
    prompts = random_prompts(prompt_batch, prompt_tokens, vocab_size=shape.vocab_size)
    settings = dict(population=population, num_subspaces=subspaces, sigma=1e-3, lr=5e-4)
    strategy = copes.CoPES(model, **settings)
    cfg = build_config({"model": "random-qwen3.5", "population": population, "subspaces": subspaces, "sigma": 1e-3,
                        "lr": 5e-4, "prompt_batch": prompt_batch})
    with tempfile.TemporaryDirectory(prefix="copes-journal-bench-") as scratch:
        run_dir = Path(scratch)
        header = build_header(cfg, model, strategy, "random Qwen3.5 architecture", run_id="bench")
        journal = RunJournal("bench", JournalWriter.create(journal_path(run_dir), header))
        contents = JournalContents(path=journal_path(run_dir), header=header)
        started = time.perf_counter()
        for step in range(1, steps + 1):
            rewards = {m: strategy.evaluate_member(m, lambda lm: greedy_log_likelihood(lm, prompts, new_tokens))
                       for m in range(population)}
            journal.record_members(step, rewards)
            stats = strategy.apply_update(torch.stack([rewards[m] for m in range(population)]))
            # The trainer's metrics record: the stats without their seconds, and the seconds per phase.
            record = {k: v for k, v in asdict(stats).items() if not k.endswith("_seconds")}
            record["time"] = {k: round(v, 4) for k, v in asdict(stats).items() if k.endswith("_seconds")}
            journal.record_update(step, record)
            contents.members[step] = rewards
            contents.updates.append(record)
        train_s_per_step = (time.perf_counter() - started) / steps
        journal.writer.close()
        journal_bytes = bytes_per_step(run_dir)
        export = run_dir / "export"
        model.save_pretrained(export, safe_serialization=True)
        skeleton, tensors = ckpt.flatten_state(strategy.state_dict())
        save_file(tensors, str(export / "es_state.safetensors"))
        checkpoint_bytes = folder_bytes(export)
    trained = [p.detach().clone() for p in model.parameters()]
    del strategy, model
    fresh = build_large_model(shape)
    replayer = copes.CoPES(fresh, **settings)
    started = time.perf_counter()
    replay_steps(replayer, contents, 1, steps, with_members=False, progress=False)
    replay_seconds = time.perf_counter() - started
    assert all(torch.equal(a, b) for a, b in zip(trained, fresh.parameters())), "replay is not bitwise the run"
    return [{
        "workload": f"large ({parameter_count(fresh) / 1e6:.1f}M), N={population}, {prompt_batch} prompts",
        "steps": steps, "journal_B_per_step": round(journal_bytes), "checkpoint_B": checkpoint_bytes,
        "checkpoint_over_journal_step": round(checkpoint_bytes / journal_bytes),
        "resume_journal_only_s": "", "resume_from_checkpoint_s": "",
        "train_s_per_step": train_s_per_step, "replay_s_per_step": replay_seconds / steps,
        "replay_speedup_vs_training": train_s_per_step / (replay_seconds / steps),
    }]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-model", default="tiny", help="model folder for the tiny workload (default: embedded)")
    parser.add_argument("--steps", type=int, default=100, help="tiny: steps run before the kill")
    parser.add_argument("--population", type=int, default=8, help="tiny: N")
    parser.add_argument("--subspaces", type=int, default=4, help="K for both workloads")
    parser.add_argument("--prompt-batch", type=int, default=32, help="tiny: questions per step")
    parser.add_argument("--large-steps", type=int, default=2, help="large: journaled steps")
    parser.add_argument("--large-population", type=int, default=8, help="large: N")
    parser.add_argument("--large-prompt-batch", type=int, default=8, help="large: prompts each member continues")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="large: prompt length")
    parser.add_argument("--new-tokens", type=int, default=8, help="large: generated tokens per prompt")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny workload")
    add_large_model_arguments(parser)
    args = parser.parse_args(argv)
    pin_one_thread()
    rows = measure_tiny(args.tiny_model, steps=args.steps, population=args.population, subspaces=args.subspaces,
                        prompt_batch=args.prompt_batch)
    if not args.skip_large:
        rows += measure_large(large_model_shape(args), steps=args.large_steps, population=args.large_population,
                              subspaces=args.subspaces, prompt_batch=args.large_prompt_batch,
                              prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    report("journal_cost", rows, f"journal vs checkpoint: bytes, resume time, replay speed ({machine_note()})")


if __name__ == "__main__":
    main()
