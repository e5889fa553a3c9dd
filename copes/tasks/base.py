"""The task interface: every dataset the trainer and the evaluator can use speaks it.

A task turns dataset rows into `Example`s, says how to prompt the model for one, and scores a finished
rollout. Rollouts (copes.rollout) know nothing about datasets; the trainer knows nothing about formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


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
    kind: str  # "math" | "qa" | "synthetic": picks the system prompt, the answer format and the tool budgets
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


TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}


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
