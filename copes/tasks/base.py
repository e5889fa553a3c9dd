"""The task interface: every dataset the trainer and the evaluator can use speaks it.

A task turns dataset rows into `Example`s, says how to prompt the model for one, and scores a finished
rollout. Rollouts (copes.rollout) know nothing about datasets; the trainer knows nothing about formats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    """One question. `golds` holds every accepted gold answer (math: the final answer; QA: answer + aliases)."""

    id: str
    question: str
    golds: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Score:
    """The reward of one rollout and the plain correctness behind it (accuracy is the mean of `correct`)."""

    reward: float
    correct: bool
    answer: str


class Task(Protocol):
    name: str
    kind: str  # "math" | "qa" | "synthetic": the task family; picks the agent's tool budgets (AgentConfig.for_task)
    # True when prompts go through the tokenizer's chat template; the tiny synthetic task uses raw text.
    chat: bool

    def examples(self, split: str, limit: int | None = None) -> list[Example]:
        """Rows of `split` ("train", "validation" or "test"), in file order; `limit` keeps the first ones."""
        ...

    def prompt(self, example: Example) -> str:
        """The user-turn text (or the raw prompt when `chat` is False)."""
        ...

    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        """Score the model's whole output for `example` (answer extraction included)."""
        ...

    def score_batch(
        self, completions: Sequence[str], examples: Sequence[Example], used_tools: Sequence[bool] | None = None
    ) -> list[Score]:
        """`score` for many rollouts at once (the math tasks verify a whole batch on all workers in parallel)."""
        ...

    def corpus_paragraphs(self, splits: Sequence[str] | None = None) -> list[tuple[str, str]]:
        """(title, text) of every context paragraph the task's data carries (of `splits` only, when given), for a
        local search corpus (QA); empty when it carries none."""
        ...


class TaskBase(ABC):
    """The protocol's batch and corpus methods for a task that scores one rollout at a time and has no corpus."""

    @abstractmethod
    def score(self, completion: str, example: Example, *, used_tool: bool = False) -> Score:
        """Score the model's whole output for `example` (answer extraction included)."""

    def score_batch(
        self, completions: Sequence[str], examples: Sequence[Example], used_tools: Sequence[bool] | None = None
    ) -> list[Score]:
        used = batch_used_tools(completions, examples, used_tools)
        return [self.score(c, e, used_tool=u) for c, e, u in zip(completions, examples, used)]

    def corpus_paragraphs(self, splits: Sequence[str] | None = None) -> list[tuple[str, str]]:
        return []


def batch_used_tools(
    completions: Sequence[str], examples: Sequence[Example], used_tools: Sequence[bool] | None
) -> list[bool]:
    """`used_tools` as a list (all False when None), after checking the three sequences are aligned."""
    used = [False] * len(completions) if used_tools is None else list(used_tools)
    if not len(completions) == len(examples) == len(used):
        raise ValueError(
            f"completions, examples and used_tools differ in length: {len(completions)}, {len(examples)}, {len(used)}"
        )
    return used


TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}
REGISTERED_TASKS: Mapping[str, TaskFactory] = MappingProxyType(_REGISTRY)  # read-only: `name in REGISTERED_TASKS`


def check_split(split: str, limit: int | None, splits: Sequence[str]) -> None:
    """The one check of `examples(split, limit)`'s arguments for a task whose splits are `splits`."""
    if split not in splits:
        raise ValueError(f"split must be one of {tuple(splits)}, got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")


def register(name: str) -> Callable[[TaskFactory], TaskFactory]:
    def wrap(factory: TaskFactory) -> TaskFactory:
        if name in _REGISTRY:
            raise ValueError(f"task {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **options: Any) -> Task:
    """Build a registered task; `options` go to its factory (e.g. data_dir=..., split sizes, reward switches)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(task_names())}")
    return _REGISTRY[name](**options)
