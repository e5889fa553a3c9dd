"""Rewards of one prompt batch: roll the agent out, score every trajectory with the task (also the scoring
step of held-out evaluation, `copes.run.evaluation`).

CoPES calls this once per member (the member's perturbation is in the weights); EGGROLL once for the whole
population, each question repeated per member and every batch row mapped to its member through `row_members`.

`MemberScoring` takes rewards off the critical path of the per-member loop: a member's trajectories are scored on
one background thread (math-verify runs in its own worker pool, so that thread mostly waits) while the next member
generates; each member's rewards reach `record` in submission order, the same values as scoring in line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from copes.rollout import AgentConfig, Trajectory, run_agent
from copes.tasks import Example, Score, Task
from copes.timing import PhaseTimer


def score_rollouts(task: Task, examples: Sequence[Example], trajectories: Sequence[Trajectory]) -> list[Score]:
    """Score each trajectory's last turn, the whole batch in one `task.score_batch` call."""
    return task.score_batch([t.final_text for t in trajectories], list(examples), [t.used_tool for t in trajectories])


def row_prompts(task: Task, rows: Sequence[Example]) -> list[Any]:
    """The prompt of each rollout row. A task whose rollouts carry per-row state (copes.ESTrainer's environments: one
    instance per rollout, reset with the row) starts it here, through its `start_rollout(rows)`, which returns the
    prompts; `score_batch` then follows for the same rows, in the same order."""
    start = getattr(task, "start_rollout", None)
    return start(list(rows)) if start is not None else [task.prompt(example) for example in rows]


def rollouts(model: Any, tokenizer: Any, task: Task, examples: Sequence[Example],
             **rollout: Any) -> list[list[tuple[Trajectory, Score]]]:
    """`roll_out` (its keywords: tools, agent, timer, members, row_members), then scored: one list of (trajectory,
    score) per question, per member of `members` (a batched population), or a single list without members."""
    trajectories = roll_out(model, tokenizer, task, examples, **rollout)
    members = rollout.get("members")
    copies = len(members) if members is not None else 1
    with rollout["timer"].overlapping("score"):
        scored = list(zip(trajectories, score_rollouts(task, list(examples) * copies, trajectories)))
    return [scored[i * len(examples) : (i + 1) * len(examples)] for i in range(copies)]


def roll_out(
    model: Any,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    tools: Sequence[Any],
    agent: AgentConfig,
    timer: PhaseTimer,
    members: Sequence[int] | None = None,
    row_members: Any = None,
) -> list[Trajectory]:
    """The trajectories of `rollouts`, unscored: every question once per member (or once), in that order."""
    copies = len(members) if members is not None else 1
    prompts = row_prompts(task, list(examples) * copies)
    row_context = None
    if row_members is not None:
        member_of_row = torch.as_tensor(list(members)).repeat_interleave(len(examples))
        row_context = lambda indices: row_members(member_of_row[indices])  # noqa: E731
    tools_seconds_before = timer.seconds["tools"]
    with timer("generate"):
        trajectories = run_agent(model, tokenizer, prompts, tools=tools if task.chat else (),
                                 config=agent, chat=task.chat, row_context=row_context,
                                 system_prompt=getattr(task, "system_prompt", None))
    timer.add("generate", -(timer.seconds["tools"] - tools_seconds_before))  # tool time is reported on its own
    return trajectories


class MemberScoring:
    """Scores members' trajectories on one background thread, in submission order; `record(member, rewards)`
    (float64 [Q], as the strategies return them) runs on that thread as each member's scores are ready. Leaving
    the `with` block waits for every submitted member and raises the first scoring error (unless the block itself
    raised).

    With a `timer`, the scoring's wall time adds to its "score" phase (as scoring in line does) and the time the
    caller waits at the block's end to "score_wait": what overlapping saved is their difference."""

    def __init__(self, task: Task, examples: Sequence[Example], record: Callable[[int, torch.Tensor], None],
                 timer: PhaseTimer | None = None) -> None:
        self.task, self.examples, self.record = task, list(examples), record
        self.timer = timer or PhaseTimer()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="copes-scoring")
        self._pending: list[Future[None]] = []

    def submit(self, member: int, trajectories: Sequence[Trajectory]) -> None:
        self._pending.append(self._pool.submit(self._score, member, list(trajectories)))

    def _score(self, member: int, trajectories: list[Trajectory]) -> None:
        with self.timer.overlapping("score"):
            scores = score_rollouts(self.task, self.examples, trajectories)
        self.record(member, torch.tensor([score.reward for score in scores], dtype=torch.float64))

    def __enter__(self) -> MemberScoring:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *rest: object) -> None:
        try:
            with self.timer("score_wait"):
                for pending in self._pending:
                    if error_type is None:  # an error already leaving the block is the one to report
                        pending.result()
        finally:
            self._pool.shutdown(wait=True)

