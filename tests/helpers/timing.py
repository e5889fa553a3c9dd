"""Wall-clock checks as ratios to a baseline measured in the same run, so that a loaded machine slows both sides:
a bound is `factor * baseline` (plus the deadline under test, where there is one), never a number of seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def seconds(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def reading_seconds(text: str) -> float:
    """What one Python-level pass over `text` costs here and now: the unit of 'linear in the input'."""
    return seconds(lambda: sum(1 for _ in text))
