"""Wall seconds per phase of a step (generate, score, tools, update), measured where the work happens: the run's
parts (tools, scoring) and the step loop share one timer, so it lives below both."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates wall seconds per phase; `with timer("generate"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inside: dict[str, int] = defaultdict(int)  # threads inside each `overlapping` phase
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    @contextmanager
    def overlapping(self, phase: str) -> Iterator[None]:
        """A phase that runs on several threads at once (the rows' tool calls): adds the wall time during which at
        least one thread was inside, never the sum over threads, so it can be subtracted from the phase around it."""
        with self._lock:
            if self._inside[phase] == 0:
                self._since[phase] = time.perf_counter()
            self._inside[phase] += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside[phase] -= 1
                if self._inside[phase] == 0:
                    self.seconds[phase] += time.perf_counter() - self._since.pop(phase)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def snapshot(self) -> dict[str, float]:
        return {phase: round(value, 4) for phase, value in sorted(self.seconds.items())}
