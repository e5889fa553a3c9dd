"""Rollout samples: what the reward numbers mean, readable. Every `sample_every` steps, each member this process
rolls out also answers a fixed few questions (the first `sample_prompts` held-out ones, else the first training
ones) under its perturbation; once the step's rewards are in, the full transcripts of the step's best and worst
member (by mean training reward) are appended to `samples.jsonl`, one line per transcript:

    {"step", "role": "best"|"worst", "member", "member_reward", "question_id", "question", "prompt",
     "completion", "model_text", "tool_calls": [{"name", "arguments", "valid", "observation"}], "extracted_answer",
     "gold", "reward", "correct", "finished_by", "num_turns"}

`prompt` is the prompt as the model read it (chat template applied); `extracted_answer` the answer the task's scoring
read from the completion; `gold` the reference answer (a list when the question has several, null without one).

The extra rollouts are greedy, like every rollout, and run inside the member's own evaluation, so they change no
reward, no update and no weight; their seconds count as rollout time at a sampling step. A member whose rewards
came from the journal after a resume was not rolled out again: when it is the step's best or worst, its sample
questions are rolled out under its perturbation before the step's samples are written, so a resumed step writes
what the uninterrupted one did (in one process, with an exact restore; otherwise, and under torchrun, the best and
worst are chosen among the members that have a transcript).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from copes.rollout import Trajectory
from copes.run.metrics import records_through_step
from copes.tasks import Example, Score

SAMPLES_FILE = "samples.jsonl"


def transcript_record(example: Example, trajectory: Trajectory, score: Score) -> dict[str, Any]:
    """One question's whole rollout, as samples.jsonl and the W&B samples table hold it."""
    return {
        "question_id": example.id, "question": example.question, "prompt": trajectory.prompt,
        "completion": trajectory.completion, "model_text": trajectory.model_text,
        "tool_calls": [asdict(call) for call in trajectory.tool_calls], "extracted_answer": score.answer,
        "gold": example.golds[0] if len(example.golds) == 1 else list(example.golds) or None,
        "reward": score.reward, "correct": score.correct, "finished_by": trajectory.finished_by,
        "num_turns": trajectory.num_turns,
    }


def _finite_or_lowest(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


class RolloutSamples:
    """Collects the sample transcripts of the members rolled out in a sampling step and writes the best and worst.

    Under several ranks each collects its own members' transcripts and rank 0 (`path`; the others have None) adds
    every rank's best and worst (`extremes`, `add_transcripts`) before writing, so the step's best and worst are
    chosen over all members. On resume, records past `keep_through_step` are dropped: the steps after the resume
    point are sampled again.
    """

    def __init__(self, path: Path | None, examples: Sequence[Example], every: int, *,
                 keep_through_step: int = 0) -> None:
        self.path, self.examples, self.every = path, list(examples), every
        self._transcripts: dict[int, list[dict[str, Any]]] = {}
        self.records: list[dict[str, Any]] = []
        if path is not None:
            self.records = records_through_step(path, keep_through_step)

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based) is sampled."""
        return bool(self.every and self.examples) and step % self.every == 0

    def add(self, members: Sequence[int], per_member: Sequence[Sequence[tuple[Trajectory, Score]]]) -> None:
        for member, rows in zip(members, per_member, strict=True):
            self._transcripts[member] = [transcript_record(e, t, s)
                                         for e, (t, s) in zip(self.examples, rows, strict=True)]

    def without_transcript(self, rewards: Sequence[torch.Tensor]) -> list[int]:
        """The step's best and worst members by every member's `rewards` that have no transcript here (scored
        before a resume): roll their sample questions out (`add`) before `write`."""
        means = {member: _finite_or_lowest(float(values.double().mean())) for member, values in enumerate(rewards)}
        extremes = {max(means, key=means.__getitem__), min(means, key=means.__getitem__)}
        return sorted(member for member in extremes if member not in self._transcripts)

    def _means(self, rewards: Sequence[torch.Tensor]) -> dict[int, float]:
        """Each collected member's mean reward; a member whose rewards were NaN/inf (scored as failures in the
        update) ranks last."""
        return {member: _finite_or_lowest(float(rewards[member].double().mean())) for member in self._transcripts}

    def extremes(self, rewards: Sequence[torch.Tensor]) -> dict[int, list[dict[str, Any]]]:
        """The transcripts of the best and the worst member collected here (another rank's share for rank 0)."""
        means = self._means(rewards)
        chosen = {max(means, key=means.__getitem__), min(means, key=means.__getitem__)} if means else set()
        return {member: self._transcripts[member] for member in chosen}

    def add_transcripts(self, transcripts: dict[int, list[dict[str, Any]]]) -> None:
        self._transcripts.update(transcripts)

    def write(self, step: int, rewards: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        """Append the best and worst collected member's transcripts for `step`, given every member's rewards;
        returns the records written (none when no member was rolled out here, or with no `path`)."""
        means = self._means(rewards)
        transcripts, self._transcripts = self._transcripts, {}
        if not means or self.path is None:
            return []
        best, worst = max(means, key=means.__getitem__), min(means, key=means.__getitem__)
        roles = [("best", best)] + ([("worst", worst)] if worst != best else [])
        written = [{"step": step, "role": role, "member": member, "member_reward": means[member], **record}
                   for role, member in roles for record in transcripts[member]]
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in written))
        self.records += written
        return written
