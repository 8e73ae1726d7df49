"""Start-up timings that choose between kernels on the machine the engine runs on."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def fastest_times(calls: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Each call's best time over ``repeats`` rounds, after one untimed warm-up run each
    (a first call may compile or allocate). The calls take turns within every round, so
    a burst of other load on the machine slows all of them alike; timed one after the
    other, such a burst once flipped a kernel choice."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(repeats):
        for i, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return best
