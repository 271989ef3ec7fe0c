"""The ceilings every result is read against, measured in the same run on the same device.

* ``copy_gbps``: a large device-to-device copy, counting bytes read plus bytes written (1 GiB each
  way on a GPU): the memory-bandwidth ceiling ("% of the copy ceiling").
* ``gather32_entries_per_s``: 16M random 32-byte gathers from a 32M-slot table (1 GiB, far larger
  than L2) by a minimal RawKernel, each reading its int64 index and writing its 32 bytes: the rate
  ceiling of any op that touches one canary slot per entry at random.
* ``read32_entries_per_s``: the same random 32-byte reads with nothing written per entry (each warp
  folds its 32 rows into one word), indexed by int32 as ``req_to_token`` is: what DRAM gives random
  sectors when no output stream shares the bus, as a verify's reads. Verify and step rows report the
  random sectors they read a second against it (``pct_random_read``).
* ``plan_stream_entries_per_s``: a minimal RawKernel that moves a plan's bytes, an entry a thread:
  it reads 16M int32 slots (each entry's and its predecessor's, as a plan reads ``req_to_token``) and
  writes four int64 arrays of 16M (512 MiB). The rate ceiling of the plan of a large batch, whose
  writes are fixed by the plan's layout (SPEC 3.3), and how far the copy ceiling is from it.
* ``empty_kernel_us``: an empty RawKernel launched through CuPy: device time between CUDA events,
  bracketed exactly as every op is (``empty_kernel_us``; ``empty_kernel_warm_us`` without the L2
  eviction before it), as a one-node graph replay (``empty_graph_us``) and host time per launch
  (``empty_launch_host_us``). The floor of any single launch.

On the CPU the same five are a NumPy copy, a NumPy row gather, a numba loop of the folded reads, the
plan's arrays written by NumPy and a call of an empty numba function.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from _shapes import rand_bytes, rand_u64
from _timing import CpuTimer, GpuTimer

_GATHER_SOURCE = r"""
extern "C" __global__ void kvc_bench_gather32(const ulonglong2* __restrict__ src, const long long* __restrict__ idx,
                                              ulonglong2* __restrict__ dst, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        long long s = idx[i];
        ulonglong2 a = src[2 * s], b = src[2 * s + 1];
        dst[2 * i] = a;
        dst[2 * i + 1] = b;
    }
}
extern "C" __global__ void kvc_bench_read32(const ulonglong2* __restrict__ src, const int* __restrict__ idx,
                                            unsigned long long* __restrict__ warp_xor, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long v = 0;
    if (i < n) {
        long long s = idx[i];
        ulonglong2 a = src[2 * s], b = src[2 * s + 1];
        v = a.x ^ a.y ^ b.x ^ b.y;
    }
    for (int off = 16; off > 0; off >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) == 0 && i < n) warp_xor[i >> 5] = v;
}
extern "C" __global__ void kvc_bench_plan_stream(const int* __restrict__ slots, long long n, long long* slot_out,
                                                  long long* token_out, long long* position_out,
                                                  long long* prev_out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        slot_out[i] = slots[i];
        token_out[i] = -1;
        position_out[i] = i;
        prev_out[i] = i > 0 ? slots[i - 1] : -1;
    }
}
extern "C" __global__ void kvc_bench_empty() {}
"""


def measure(timer, xp, *, scale: float = 1.0) -> dict[str, Any]:
    if getattr(timer, "is_gpu", False):
        return _measure_gpu(timer, xp, scale)
    return _measure_cpu(timer, scale)


def _measure_gpu(timer: GpuTimer, cupy, scale: float) -> dict[str, Any]:
    out: dict[str, Any] = {"device_name": _device_name(cupy)}
    stream = timer.stream
    with stream:
        n_bytes = max(int((1 << 30) * scale), 1 << 24)
        src = rand_bytes(cupy, (n_bytes,), 7)
        dst = cupy.empty_like(src)
        t = timer.eager(lambda _: cupy.copyto(dst, src), 1, warmup=3, reps=20, cold=False)
        out["copy_bytes"] = 2 * n_bytes
        out["copy_us"] = t.median_s * 1e6
        out["copy_gbps"] = 2 * n_bytes / t.median_s / 1e9
        del src, dst

        module = cupy.RawModule(code=_GATHER_SOURCE)
        gather = module.get_function("kvc_bench_gather32")
        empty = module.get_function("kvc_bench_empty")
        n = max(int((16 << 20) * scale * scale), 1 << 16)
        pool = 2 * n
        table = rand_bytes(cupy, (pool, 32), 8)
        idx = (rand_u64(cupy, n, 9) % cupy.uint64(pool)).astype(cupy.int64)
        dst = cupy.empty((n, 32), dtype=cupy.uint8)
        block = 256
        grid = (n + block - 1) // block
        launch = lambda _: gather((grid,), (block,), (table, idx, dst, cupy.int64(n)), stream=stream)  # noqa: E731
        t = timer.eager(launch, 1, warmup=3, reps=30, cold=True)
        assert bool((dst[: min(n, 4096)] == table[idx[: min(n, 4096)]]).all()), "gather ceiling kernel is wrong"
        out.update(_gather32_result(n, t.median_s))
        del dst

        read = module.get_function("kvc_bench_read32")
        idx32 = idx.astype(cupy.int32)
        folds = cupy.empty((n + 31) // 32, dtype=cupy.uint64)
        launch = lambda _: read((grid,), (block,), (table, idx32, folds, cupy.int64(n)), stream=stream)  # noqa: E731
        t = timer.eager(launch, 1, warmup=3, reps=30, cold=True)
        _check_read32(cupy.asnumpy(table[idx[: min(n, 4096)]]), cupy.asnumpy(folds))
        out.update(_read32_result(n, t.median_s))
        del table, idx, idx32, folds

        out.update(_plan_stream_gpu(timer, cupy, module.get_function("kvc_bench_plan_stream"), n))

        launch = lambda _: empty((1,), (1,), (), stream=stream)  # noqa: E731
        t = timer.eager(launch, 1, warmup=20, reps=200, cold=False)
        out["empty_kernel_warm_us"] = t.median_s * 1e6
        # timed exactly as the ops are (after the L2 eviction), the reference of "x empty kernel"
        out["empty_kernel_us"] = _empty_kernel_us(timer, launch)
        graph = timer.capture(lambda: launch(0))
        t = timer.graph([graph], warmup=20, reps=200, cold=False)
        out["empty_graph_us"] = t.median_s * 1e6
        out["empty_launch_host_us"] = timer.host_per_call(launch, 1, 500) * 1e6
        out["empty_launch_wall_us"] = timer.wall_per_call(launch, 1, 500) * 1e6
    return out


def _gather32_result(n: int, seconds: float) -> dict[str, Any]:
    """Per entry: its int64 index read, 32 bytes gathered, 32 bytes written."""
    return dict(gather32_entries=n, gather32_us=seconds * 1e6, gather32_entries_per_s=n / seconds,
                gather32_gbps=n * (8 + 32 + 32) / seconds / 1e9)


def _read32_result(n: int, seconds: float) -> dict[str, Any]:
    return dict(read32_entries=n, read32_us=seconds * 1e6, read32_entries_per_s=n / seconds,
                read32_gbps=n * (4 + 32) / seconds / 1e9)


def _check_read32(rows: np.ndarray, folds: np.ndarray) -> None:
    """rows: the first entries' 32-byte rows, gathered apart; folds: the kernel's word a warp."""
    whole = rows.shape[0] // 32
    want = np.bitwise_xor.reduce(rows[: whole * 32].view(np.uint64).reshape(whole, -1), axis=1)
    assert whole > 0 and bool((folds[:whole] == want).all()), "random read ceiling kernel is wrong"


def _plan_stream_result(n: int, seconds: float) -> dict[str, Any]:
    return dict(plan_stream_entries=n, plan_stream_us=seconds * 1e6, plan_stream_entries_per_s=n / seconds,
                plan_stream_gbps=n * (4 + 4 * 8) / seconds / 1e9)


def _plan_stream_arrays(xp, n: int):
    """n random int32 slots and the four int64 arrays a plan of n entries writes."""
    slots = (rand_u64(xp, n, 10) >> xp.uint64(33)).astype(xp.int32)
    return slots, [xp.empty(n, dtype=xp.int64) for _ in range(4)]


def _plan_stream_gpu(timer: GpuTimer, cupy, kernel, n: int) -> dict[str, Any]:
    slots, outs = _plan_stream_arrays(cupy, n)
    block = 256
    grid = (n + block - 1) // block
    launch = lambda _: kernel((grid,), (block,), (slots, cupy.int64(n), *outs), stream=timer.stream)  # noqa: E731
    t = timer.eager(launch, 1, warmup=3, reps=30, cold=True)
    _check_plan_stream(cupy, slots, outs)
    return _plan_stream_result(n, t.median_s)


def _check_plan_stream(xp, slots, outs) -> None:
    head = min(int(slots.shape[0]), 4096)
    s = slots[:head].astype(xp.int64)
    prev = xp.concatenate([xp.full(1, -1, dtype=xp.int64), s[:-1]])
    want = (s, xp.full(head, -1, dtype=xp.int64), xp.arange(head, dtype=xp.int64), prev)
    assert all(bool((o[:head] == w).all()) for o, w in zip(outs, want)), "plan stream ceiling kernel is wrong"


def _plan_stream_cpu(timer: CpuTimer, n: int) -> dict[str, Any]:
    slots, outs = _plan_stream_arrays(np, n)
    positions = np.arange(n, dtype=np.int64)

    def stream(_):
        slot_out, token_out, position_out, prev_out = outs
        slot_out[:] = slots
        token_out.fill(-1)
        position_out[:] = positions
        prev_out[0] = -1
        prev_out[1:] = slots[:-1]

    t = timer.eager(stream, 1, warmup=1, reps=5)
    _check_plan_stream(np, slots, outs)
    return _plan_stream_result(n, t.median_s)


def _measure_cpu(timer: CpuTimer, scale: float) -> dict[str, Any]:
    import os  # noqa: PLC0415

    import numba  # noqa: PLC0415

    out: dict[str, Any] = {"device_name": f"cpu ({os.cpu_count()} logical cores, numba {numba.get_num_threads()} "
                                          f"threads)"}
    n_bytes = max(int((256 << 20) * scale), 1 << 22)
    src = rand_bytes(np, (n_bytes,), 7)
    dst = np.empty_like(src)
    t = timer.eager(lambda _: np.copyto(dst, src), 1, warmup=1, reps=5)
    out.update(copy_bytes=2 * n_bytes, copy_us=t.median_s * 1e6, copy_gbps=2 * n_bytes / t.median_s / 1e9)
    n = max(int((16 << 20) * scale * scale), 1 << 16)
    table = rand_bytes(np, (2 * n, 32), 8).view(np.int64)
    idx = (rand_u64(np, n, 9) % np.uint64(2 * n)).astype(np.int64)
    got = np.empty((n, 4), dtype=np.int64)
    t = timer.eager(lambda _: np.take(table, idx, axis=0, out=got), 1, warmup=1, reps=5)
    out.update(_gather32_result(n, t.median_s))

    @numba.njit(parallel=True)
    def read32(words, rows, folds):
        for w in numba.prange(folds.shape[0]):
            v = np.uint64(0)
            for i in range(w * 32, min(w * 32 + 32, rows.shape[0])):
                s = rows[i]
                v ^= words[s, 0] ^ words[s, 1] ^ words[s, 2] ^ words[s, 3]
            folds[w] = v

    idx32 = idx.astype(np.int32)
    words = table.view(np.uint64)
    folds = np.empty((n + 31) // 32, dtype=np.uint64)
    t = timer.eager(lambda _: read32(words, idx32, folds), 1, warmup=1, reps=5)
    _check_read32(table[idx[: min(n, 4096)]], folds)
    out.update(_read32_result(n, t.median_s))
    out.update(_plan_stream_cpu(timer, n))

    @numba.njit
    def nothing():
        return 0

    nothing()
    empty_us = _empty_kernel_us(timer, lambda _: nothing())
    out.update(empty_kernel_us=empty_us, empty_graph_us=None, empty_launch_host_us=empty_us,
               empty_launch_wall_us=empty_us)
    return out


def _empty_kernel_us(timer, launch) -> float:
    """The yardstick of the decode rows' "x empty kernel": an empty launch timed as the ops are."""
    if getattr(timer, "is_gpu", False):
        return timer.eager(launch, 1, warmup=0, reps=200, cold=True).median_s * 1e6
    return timer.eager(launch, 1, warmup=10, reps=200).median_s * 1e6


def empty_kernel_again(timer, xp) -> float:
    """The empty launch measured again as ``measure`` does, for the end of a run: the yardstick drifts
    between runs by as much as some decode rows lie from their bar, and within a run it can too."""
    if getattr(timer, "is_gpu", False):
        empty = xp.RawModule(code=_GATHER_SOURCE).get_function("kvc_bench_empty")
        launch = lambda _: empty((1,), (1,), (), stream=timer.stream)  # noqa: E731
        launch(0)
        timer.sync()
        return _empty_kernel_us(timer, launch)
    import numba  # noqa: PLC0415

    nothing = numba.njit(lambda: 0)
    nothing()
    return _empty_kernel_us(timer, lambda _: nothing())


def _device_name(cupy) -> str:
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # pragma: no cover - informational only
        return "cuda"


def l2_bytes(cupy) -> int:
    try:
        return int(cupy.cuda.Device().attributes["L2CacheSize"])
    except Exception:  # pragma: no cover
        return 60 << 20
