"""The wall-time budget (--budget-hours): one deadline, checked before each member of a step (one process) and
before each batch of a held-out evaluation, so a run overshoots by at most one member's or one batch's time.
A stop between members is a clean resume point: the journal holds every member already scored, and --resume
rolls out only the rest of the step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class BudgetSpent(Exception):
    """Raised between members when the budget is spent (the trainer ends the run cleanly)."""


@dataclass
class Budget:
    hours: float | None
    started: float = field(default_factory=lambda: time.perf_counter())

    @property
    def deadline(self) -> float | None:
        """The perf_counter time the budget ends (None: no budget)."""
        return None if self.hours is None else self.started + self.hours * 3600

    def spent(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def check(self) -> None:
        if self.spent():
            raise BudgetSpent
