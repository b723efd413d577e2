"""What a benchmark's CPU figures need beside them to compare across machines."""

from __future__ import annotations

import time


def cpu_reference_ms(iterations: int = 2_000_000) -> float:
    """CPU ms of a fixed pure-Python loop on this machine (best of 3). The planner and the
    dispatcher's loop are interpreter-bound, so their ms on two machines compare after dividing
    by this."""
    best = float("inf")
    for _ in range(3):
        c0, total = time.thread_time(), 0
        for i in range(iterations):
            total += i
        best = min(best, time.thread_time() - c0)
    return round(best * 1e3, 1)
