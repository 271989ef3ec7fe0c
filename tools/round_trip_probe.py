"""The floor of a decode-sized kernel that is a chain of dependent reads: bare kernels that chase
0 to 4 dependent random 8-byte reads a thread, timed as the benchmarks time ops (host head start,
L2 evicted, replayed in shuffled rounds beside an empty kernel).

    python tools/round_trip_probe.py [--ops-only] [OP:CASE ...]   # e.g. plan:swa_decode_short_prefix

A thread starts at its own index of a random permutation over a pool far larger than L2 and reads
`depth` times, each read's address the value of the one before (as a plan entry reads
req_pool_indices, then req_to_token, then the SWA LUT), then stores what it reached. Grids are the
decode ops': one warp (a bs-1 decode write), and 129 blocks of 256 threads (the SWA-short plan,
32 K entries). Median and interquartile range of 150 rounds, us; the last column is the median
over the empty kernel's. Each OP:CASE adds that op on the benchmark case's state
(benchmarks/_shapes.py) to the same rounds; --ops-only leaves the bare kernels out.
"""

from __future__ import annotations

import pathlib
import sys

import cupy
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
from _probe import cold_timer, interleaved_cold, launch_empty, median_iqr  # noqa: E402
from ab_probe import launcher  # noqa: E402

_SOURCE = r"""
extern "C" __global__ void chase(const long long* __restrict__ next, long long threads, int depth,
                                 long long* __restrict__ reached) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= threads) return;
    long long v = i;
    for (int d = 0; d < depth; ++d) v = __ldg(next + v);
    reached[i] = v;
}
"""
POOL = 1 << 26  # 64 M entries, 512 MiB: far past any L2
GRIDS = {"1 warp": (1, 32), "129 x 256": (129, 256)}
DEPTHS = range(5)


def main() -> None:
    kernel = cupy.RawKernel(_SOURCE, "chase")
    next_index = cupy.random.RandomState(7).permutation(POOL).astype(cupy.int64)
    reached = cupy.zeros(129 * 256, dtype=cupy.int64)
    timer = cold_timer()
    graphs = {"empty kernel": timer.capture(launch_empty)}
    ops_only = "--ops-only" in sys.argv
    specs = [a for a in sys.argv[1:] if a != "--ops-only"]
    for name, (blocks, threads) in ({} if ops_only else GRIDS).items():
        for depth in DEPTHS:
            args = (next_index, cupy.int64(blocks * threads), cupy.int32(depth), reached)
            graphs[f"{name}, {depth} reads"] = timer.capture(
                lambda a=args, b=blocks, t=threads: kernel((b,), (t,), a))
    # the launches hold their states: a graph does not, and a freed state's memory goes to the
    # next state built, under the captured graph's pointers
    launches = []
    for spec in specs:
        op, case_name = spec.split(":")
        launches.append(launcher(op, S.build_state(S.BY_NAME[case_name], "cuda")))
        launches[-1]()
        graphs[f"{op} {case_name}"] = timer.capture(launches[-1])
    times = interleaved_cold(timer, graphs)
    empty = float(np.median(times["empty kernel"]))
    for label, samples in times.items():
        print(f"{label:40s} {median_iqr(samples):22s} {np.median(samples) / empty:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
