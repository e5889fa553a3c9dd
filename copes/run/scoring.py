"""Rewards of one prompt batch: roll the agent out, score every trajectory with the task (also the scoring
step of held-out evaluation, `copes.run.evaluation`).

CoPES calls this once per member (the member's perturbation is in the weights); EGGROLL once for the whole
population, each question repeated per member and every batch row mapped to its member through `row_members`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from copes.run.metrics import PhaseTimer
from copes.rollout import AgentConfig, Trajectory, run_agent
from copes.tasks import Example, Score, Task


def score_rollouts(task: Task, examples: Sequence[Example], trajectories: Sequence[Trajectory]) -> list[Score]:
    """Score each trajectory's last turn, the whole batch in one `task.score_batch` call."""
    return task.score_batch([t.final_text for t in trajectories], list(examples), [t.used_tool for t in trajectories])


def rollouts(
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
) -> list[list[tuple[Trajectory, Score]]]:
    """Roll out and score `examples`: one list of (trajectory, score) per question, per member of `members` (a
    batched population, rows routed through `row_members`), or a single list without members."""
    prompts = [task.prompt(example) for example in examples]
    copies = len(members) if members is not None else 1
    row_context = None
    if row_members is not None:
        member_of_row = torch.as_tensor(list(members)).repeat_interleave(len(prompts))
        row_context = lambda indices: row_members(member_of_row[indices])  # noqa: E731
    tools_seconds_before = timer.seconds["tools"]
    with timer("generate"):
        trajectories = run_agent(model, tokenizer, prompts * copies, tools=tools if task.chat else (),
                                 config=agent, chat=task.chat, row_context=row_context,
                                 system_prompt=getattr(task, "system_prompt", None))
    timer.add("generate", -(timer.seconds["tools"] - tools_seconds_before))  # tool time is reported on its own
    scored = list(zip(trajectories, score_rollouts(task, list(examples) * copies, trajectories)))
    return [scored[i * len(prompts) : (i + 1) * len(prompts)] for i in range(copies)]

