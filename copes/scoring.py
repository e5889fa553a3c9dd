"""Rewards of one prompt batch: roll the agent out, score every trajectory with the task.

CoPES calls this once per member (the member's perturbation is in the weights); EGGROLL once for the whole
population, each question repeated per member and every batch row mapped to its member through `row_members`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from copes.metrics import PhaseTimer
from copes.rollout import AgentConfig, Trajectory, run_agent
from copes.tasks import Example, Task


def score_trajectories(task: Task, examples: Sequence[Example], trajectories: Sequence[Trajectory]) -> list[float]:
    """One reward per question; the answer is read from the last assistant turn."""
    texts = [trajectory.final_text for trajectory in trajectories]
    used_tools = [trajectory.used_tool for trajectory in trajectories]
    score_batch = getattr(task, "score_batch", None)  # math tasks verify a whole batch on all workers at once
    if score_batch is not None:
        return [score.reward for score in score_batch(texts, list(examples), used_tools)]
    return [task.score(text, example, used_tool=used).reward for text, example, used in zip(texts, examples, used_tools)]


def rollout_rewards(
    model: Any,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    tools: Sequence[Any],
    agent: AgentConfig,
    timer: PhaseTimer,
    population: int | None = None,
    row_members: Any = None,
) -> list[float] | list[list[float]]:
    """Per-question rewards [Q], or [N][Q] for a batched population (`population` and `row_members` given)."""
    prompts = [task.prompt(example) for example in examples]
    copies = population or 1
    row_context = None
    if row_members is not None:
        member_of_row = torch.arange(copies).repeat_interleave(len(prompts))
        row_context = lambda indices: row_members(member_of_row[indices])  # noqa: E731
    tools_seconds_before = timer.seconds["tools"]
    with timer("generate"):
        trajectories = run_agent(model, tokenizer, prompts * copies, tools=tools if task.chat else (),
                                 config=agent, chat=task.chat, row_context=row_context)
    timer.add("generate", -(timer.seconds["tools"] - tools_seconds_before))  # tool time is reported on its own
    rewards = score_trajectories(task, list(examples) * copies, trajectories)
    if population is None:
        return rewards
    return [rewards[i * len(prompts) : (i + 1) * len(prompts)] for i in range(copies)]
