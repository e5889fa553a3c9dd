"""copes.run.metrics: the phase timer."""

from __future__ import annotations

import threading
import time

from copes.timing import PhaseTimer


def test_an_overlapping_phase_counts_wall_time_not_the_sum_over_threads() -> None:
    """Four threads inside the tools phase at once for 0.2 s add about 0.2 s, not 0.8 s (the sum, once subtracted
    from the generate phase around them, made it negative); a later call adds its own time."""
    timer = PhaseTimer()
    started = threading.Barrier(4)

    def call() -> None:
        started.wait()
        with timer.overlapping("tools"):
            time.sleep(0.2)

    threads = [threading.Thread(target=call) for _ in range(4)]
    begun = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begun
    assert 0.2 <= timer.seconds["tools"] <= wall
    with timer.overlapping("tools"):
        time.sleep(0.05)
    assert 0.25 <= timer.seconds["tools"] <= wall + 0.1
