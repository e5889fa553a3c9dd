"""The wall-time budget (--budget-hours): one deadline, checked before each member of a step (one process) and
before each batch of a held-out evaluation, so a run overshoots by at most one member's or one batch's time.
The steps stop early enough to leave the final held-out evaluation the time the first one took (`reserve`), so a
budget-stopped run still reports accuracy after training. A stop between members is a clean resume point: the
journal holds every member already scored, and --resume rolls out only the rest of the step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


class BudgetSpent(Exception):
    """Raised between members when the budget is spent (the trainer ends the run cleanly)."""


@dataclass
class Budget:
    hours: float | None
    started: float = field(default_factory=lambda: time.perf_counter())
    reserved_seconds: float = 0.0  # kept back from the steps for the final held-out evaluation

    @property
    def deadline(self) -> float | None:
        """The perf_counter time the budget ends (None: no budget)."""
        return None if self.hours is None else self.started + self.hours * 3600

    @contextlib.contextmanager
    def reserve_as_long_as(self) -> Iterator[None]:
        """Keep back from the steps as long as the block takes (the first held-out evaluation: the final one, over
        the same questions, takes about as long)."""
        start = time.perf_counter()
        yield
        self.reserved_seconds = time.perf_counter() - start

    def spent(self) -> bool:
        """Whether the steps' share of the budget is over."""
        return self.deadline is not None and time.perf_counter() > self.deadline - self.reserved_seconds

    def check(self) -> None:
        if self.spent():
            raise BudgetSpent
