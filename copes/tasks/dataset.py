"""What the dataset-backed tasks (math, QA) share: named splits built on demand and cached, and the two optional
reward terms on top of correctness (format, tool bonus)."""

from __future__ import annotations

from collections.abc import Callable

from copes.rewards import format_reward, tool_bonus
from copes.tasks.base import Example, TaskBase
from copes.tasks.loading import CachedSplits


class DatasetTask(TaskBase):
    """A dataset as a `Task`; `splits` maps each split name to a function building its examples. A subclass sets
    `kind` and `chat` and implements `prompt` and `score` (using `_shaped_reward` for the extra terms)."""

    kind: str
    chat: bool

    def __init__(
        self,
        name: str,
        splits: dict[str, Callable[[], list[Example]]],
        *,
        format_reward: bool = True,
        tool_bonus: bool = True,
    ) -> None:
        self.name = name
        self.use_format_reward = format_reward
        self.use_tool_bonus = tool_bonus
        self._splits = CachedSplits(name, splits)

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        return self._splits.get(split, limit)

    @property
    def splits(self) -> list[str]:
        return self._splits.splits

    def _shaped_reward(self, value: float, completion: str, correct: bool, used_tool: bool) -> float:
        """`value` plus the format term (for this task's kind) and the tool bonus, each when switched on."""
        reward = value
        if self.use_format_reward:
            reward += format_reward(completion, self.kind)
        if self.use_tool_bonus:
            reward += tool_bonus(correct, used_tool)
        return reward
