"""Wall-clock timing shared by the tools that time host-side work (no CuPy needed)."""

from __future__ import annotations

import statistics
import time


def median_us(run, reps: int = 200) -> float:
    """The median wall time of ``run()`` over ``reps`` calls, in µs, after one untimed warm-up call."""
    run()
    spent = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e6
