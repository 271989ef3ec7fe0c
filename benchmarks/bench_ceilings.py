"""The ceilings of this device, measured once per run and stored in this benchmark's extra_info:
device-to-device copy bandwidth, random 32-byte gather rate, empty-kernel launch latency. The
benchmark's own statistics are the empty launch (an empty CuPy RawKernel, or an empty numba call on
the CPU). The empty launch is measured again after every other benchmark (conftest moves
``test_empty_kernel_at_end`` last), so that a run shows how far its yardstick drifted."""

from __future__ import annotations

import _ceilings
import _timing as T
from conftest import progress


def test_ceilings(benchmark, harness):
    ceilings = harness.ceilings()
    benchmark.extra_info.update(ceilings, case="ceilings", op="ceilings", device=harness.device, scale=harness.scale)
    if harness.timer.is_gpu:
        cupy = harness.cupy
        empty = cupy.RawKernel('extern "C" __global__ void kvc_bench_nothing() {}', "kvc_bench_nothing")
        launch = lambda: empty((1,), (1,), (), stream=harness.stream)  # noqa: E731
    else:
        import numba  # noqa: PLC0415

        launch = numba.njit(lambda: 0)
    launch()
    harness.timer.sync()
    T.run_pytest_benchmark(benchmark, harness.timer, lambda _: harness.timer.bracket(launch, cold=False),
                           rounds=200, warmup=10)


def test_empty_kernel_at_end(benchmark, harness):
    start = harness.ceilings()["empty_kernel_us"]
    end = _ceilings.empty_kernel_again(harness.timer, harness.xp)
    benchmark.extra_info.update(case="ceilings", op="ceilings_end", device=harness.device, scale=harness.scale,
                                empty_kernel_us=end, empty_kernel_us_at_start=start)
    progress(f"empty kernel {start:.2f} us at the start of the run, {end:.2f} us at its end")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
