"""Timing that a kernel engineer can trust.

GPU: every repetition is bracketed by CUDA events on the benchmark's stream; before it, a short spin
kernel gives the host a head start (so the events measure device time, not Python launch gaps) and a
write of a buffer larger than L2 evicts the previous repetition's data (the canary runs beside a model
forward that streams gigabytes of KV through L2, so its data is cold). Inputs are also rotated among
several copies of the batch that live at different slots. Warm-up repetitions run first; the statistic
reported is the median. The canary step (``step``, ``step_ops``) is timed a second way, as CUDA-graph
replays. Host-side costs
are measured separately: the Python call overhead per launch (no synchronisation) and the
back-to-back wall time per call (throughput of a loop of calls), each the median of several loops.

CPU: the same loop with ``time.perf_counter``.

Both feed pytest-benchmark: :class:`Clock` replaces the fixture's timer so its statistics (min, median,
mean, ...) in the ``--benchmark-json`` output are the per-repetition device times measured here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Sequence

_SPIN_SOURCE = r"""
extern "C" __global__ void kvc_bench_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


@dataclasses.dataclass
class Timing:
    """Per-repetition times in seconds, and how they were taken."""

    times_s: list[float]
    method: str

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    def quantile_s(self, q: float) -> float:
        data = sorted(self.times_s)
        return data[min(len(data) - 1, max(0, round(q * (len(data) - 1))))]

    def summary(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}_us": self.median_s * 1e6, f"{prefix}_p10_us": self.quantile_s(0.1) * 1e6,
                f"{prefix}_p90_us": self.quantile_s(0.9) * 1e6, f"{prefix}_reps": len(self.times_s),
                f"{prefix}_method": self.method}


class Clock:
    """A timer for pytest-benchmark whose reading advances only by the measured repetition times."""

    def __init__(self, name: str = "measured") -> None:
        self.now = 0.0
        self.__name__ = name

    def __call__(self) -> float:
        return self.now

    def __repr__(self) -> str:
        return self.__name__


# Loops of calls per host-cost measurement; the median loop is reported.
LOOPS = 5


def reps_for(estimate_s: float, *, budget_s: float, lo: int, hi: int) -> int:
    """How many repetitions fit ``budget_s`` (each costs the op plus about 0.1 ms of flush and sync)."""
    return int(max(lo, min(hi, budget_s / max(estimate_s + 1e-4, 1e-6))))


class CpuTimer:
    """Host timing of synchronous calls."""

    method = "perf_counter"
    is_gpu = False

    def once(self, fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def bracket(self, launch: Callable[[], Any], **_: Any) -> float:
        return self.once(launch)

    def eager(self, fn: Callable[[int], Any], copies: int, *, warmup: int, reps: int, **_: Any) -> Timing:
        for i in range(warmup):
            fn(i % copies)
        return Timing([self.once(lambda i=i: fn(i % copies)) for i in range(reps)], self.method)

    def host_per_call(self, fn: Callable[[int], Any], copies: int, calls: int, loops: int = 1) -> float:
        return self.wall_per_call(fn, copies, calls, loops)

    def wall_per_call(self, fn: Callable[[int], Any], copies: int, calls: int, loops: int = 1) -> float:
        per_loop = []
        for _ in range(loops):
            start = time.perf_counter()
            for i in range(calls):
                fn(i % copies)
            per_loop.append((time.perf_counter() - start) / calls)
        return statistics.median(per_loop)

    def sync(self) -> None:
        pass


class GpuTimer:
    """CUDA-event timing on one stream, with L2 eviction, a host head start and graph replay."""

    method = "cuda_events"
    is_gpu = True

    def __init__(self, cupy, stream, *, l2_bytes: int, lead_us: float = 50.0) -> None:
        self.cupy = cupy
        self.stream = stream
        self.lead_ns = int(lead_us * 1000)
        with stream:
            # 4x L2, written as int32 so the fill is one plain store kernel
            self.scrub = cupy.empty(max(4 * l2_bytes, 1 << 20) // 4, dtype=cupy.int32)
        self._spin = cupy.RawKernel(_SPIN_SOURCE, "kvc_bench_spin")
        self._fills = 0

    # --- building blocks --------------------------------------------------------------------------
    def sync(self) -> None:
        self.stream.synchronize()

    def evict_l2(self) -> None:
        self._fills += 1
        with self.stream:
            self.scrub.fill(self._fills)

    def lead(self, ns: Optional[int] = None) -> None:
        with self.stream:
            self._spin((1,), (1,), (self.cupy.uint64(self.lead_ns if ns is None else ns),))

    def bracket(self, launch: Callable[[], Any], *, cold: bool = True, lead_ns: Optional[int] = None) -> float:
        """Seconds of device time of what ``launch`` enqueues on the stream (one repetition)."""
        cupy = self.cupy
        self.lead(lead_ns)
        if cold:
            self.evict_l2()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(self.stream)
        launch()
        end.record(self.stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e-3

    # --- timings ----------------------------------------------------------------------------------
    def eager(self, fn: Callable[[int], Any], copies: int, *, warmup: int, reps: int, cold: bool = True,
              lead_ns: Optional[int] = None) -> Timing:
        for i in range(warmup):
            fn(i % copies)
        self.sync()
        return Timing([self.bracket(lambda i=i: fn(i % copies), cold=cold, lead_ns=lead_ns) for i in range(reps)],
                      "cuda_events" + ("_cold_l2" if cold else ""))

    def capture(self, fn: Callable[[], Any]):
        """A CUDA graph of what ``fn`` enqueues on the stream."""
        self.sync()
        with self.stream:
            self.stream.begin_capture()
            try:
                fn()
            finally:
                graph = self.stream.end_capture()
        if hasattr(graph, "upload"):
            graph.upload(self.stream)
        self.sync()
        return graph

    def graph(self, graphs: Sequence[Any], *, warmup: int, reps: int, cold: bool = True) -> Timing:
        for i in range(warmup):
            graphs[i % len(graphs)].launch(self.stream)
        self.sync()
        return Timing([self.bracket(lambda i=i: graphs[i % len(graphs)].launch(self.stream), cold=cold)
                       for i in range(reps)], "cuda_graph_replay" + ("_cold_l2" if cold else ""))

    def host_per_call(self, fn: Callable[[int], Any], copies: int, calls: int, loops: int = LOOPS) -> float:
        """Host seconds per call of ``fn`` (Python + validation + launch), not waiting for the GPU:
        the median over ``loops`` loops of ``calls`` calls. A long spin before each loop keeps the
        device busy so the launch queue never blocks the host."""
        per_loop = []
        for _ in range(loops):
            self.sync()
            self.lead(2_000_000)
            start = time.perf_counter()
            for i in range(calls):
                fn(i % copies)
            per_loop.append((time.perf_counter() - start) / calls)
        self.sync()
        return statistics.median(per_loop)

    def wall_per_call(self, fn: Callable[[int], Any], copies: int, calls: int, loops: int = LOOPS) -> float:
        """Back-to-back wall seconds per call: ``max(host, device)`` throughput of a loop of calls,
        the median over ``loops`` loops (one interpreter or OS hiccup does not decide it)."""
        per_loop = []
        for _ in range(loops):
            self.sync()
            start = time.perf_counter()
            for i in range(calls):
                fn(i % copies)
            self.sync()
            per_loop.append((time.perf_counter() - start) / calls)
        return statistics.median(per_loop)


def run_pytest_benchmark(benchmark, timer, target_rep: Callable[[int], float], *, rounds: int, warmup: int = 1):
    """Hand ``rounds`` repetitions to pytest-benchmark; ``target_rep(i)`` performs repetition ``i``
    and returns its measured seconds, which become the fixture's statistics."""
    clock = Clock(getattr(timer, "method", "measured"))
    if hasattr(benchmark, "_timer"):
        benchmark._timer = clock
    counter = iter(range(1 << 30))
    times: list[float] = []

    def one() -> None:
        seconds = target_rep(next(counter))
        times.append(seconds)
        clock.now += seconds

    benchmark.pedantic(one, rounds=rounds, warmup_rounds=warmup, iterations=1)
    return Timing(times[warmup:] if len(times) > warmup else times, timer.method)
