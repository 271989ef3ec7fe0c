"""What a kernel that moves a large plan's bytes takes, by launch shape (needs CuPy and a GPU).

    python tools/plan_bytes_probe.py

16M plan entries as verify_16m's plan makes them: 4096 requests of 4096 positions, each request's
slots a row of a random permutation read from a randomly ordered pool row (64 MiB of int32 read),
four int64 arrays written (512 MiB). Every kernel computes the same four values (slot, -1, position,
predecessor slot); what differs is how entries are laid over threads and blocks, and how they are
stored (the streaming hint, 16-byte pairs). Medians of 20
launches between CUDA events, us. The plan kernel's own launch is the grid-stride loop with one
1024-thread block an SM; ``benchmarks/_ceilings.py``'s plan-shaped stream is an entry a thread.
"""

from __future__ import annotations

import pathlib
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _probe import event_timed  # noqa: E402

REQUESTS = POSITIONS = 4096
ENTRIES = REQUESTS * POSITIONS

_SOURCE = r"""
typedef long long i64;
__device__ __forceinline__ void entry(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 k, i64* slot,
                                      i64* token, i64* position, i64* prev, int with_prev) {
    const i64 r = k >> 12, pos = k & 4095;
    const int* p = rtt + rows[r] * 4096 + pos;
    slot[k] = p[0];
    token[k] = -1;
    position[k] = pos;
    prev[k] = with_prev && pos > 0 ? p[-1] : -1;
}
extern "C" __global__ void grid_stride(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 n, i64* a,
                                       i64* b, i64* c, i64* d, int with_prev) {
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x)
        entry(rtt, rows, k, a, b, c, d, with_prev);
}
extern "C" __global__ void chunk_a_block(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 n, i64* a,
                                         i64* b, i64* c, i64* d, int with_prev) {
    const i64 per = (n + gridDim.x - 1) / gridDim.x;
    const i64 lo = per * blockIdx.x, hi = min(n, lo + per);
    for (i64 k = lo + threadIdx.x; k < hi; k += blockDim.x) entry(rtt, rows, k, a, b, c, d, with_prev);
}
// the same values stored with the evict-first (streaming) hint: a plan's rows are not read again by
// the kernel that writes them
__device__ __forceinline__ void entry_cs(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 k, i64* slot,
                                         i64* token, i64* position, i64* prev) {
    const i64 r = k >> 12, pos = k & 4095;
    const int* p = rtt + rows[r] * 4096 + pos;
    __stcs(slot + k, (i64)p[0]);
    __stcs(token + k, -1ll);
    __stcs(position + k, pos);
    __stcs(prev + k, pos > 0 ? (i64)p[-1] : -1ll);
}
extern "C" __global__ void grid_stride_cs(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 n, i64* a,
                                          i64* b, i64* c, i64* d, int) {
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x)
        entry_cs(rtt, rows, k, a, b, c, d);
}
// two consecutive entries of one request a thread, each array's pair stored as one 16-byte vector
extern "C" __global__ void grid_stride_pairs(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 n,
                                             i64* a, i64* b, i64* c, i64* d, int) {
    for (i64 h = (i64)blockIdx.x * blockDim.x + threadIdx.x; 2 * h < n; h += (i64)gridDim.x * blockDim.x) {
        const i64 k = 2 * h, r = k >> 12, pos = k & 4095;
        const int* p = rtt + rows[r] * 4096 + pos;
        const int2 v = *reinterpret_cast<const int2*>(p);
        const i64 before = pos > 0 ? (i64)p[-1] : -1ll;
        reinterpret_cast<longlong2*>(a)[h] = make_longlong2(v.x, v.y);
        reinterpret_cast<longlong2*>(b)[h] = make_longlong2(-1, -1);
        reinterpret_cast<longlong2*>(c)[h] = make_longlong2(pos, pos + 1);
        reinterpret_cast<longlong2*>(d)[h] = make_longlong2(before, v.x);
    }
}
extern "C" __global__ void stores_only(const int* __restrict__ rtt, const i64* __restrict__ rows, i64 n, i64* a,
                                       i64* b, i64* c, i64* d, int with_prev) {
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x) {
        a[k] = k;
        b[k] = -1;
        c[k] = k & 4095;
        d[k] = k - 1;
    }
}
"""


def main() -> None:
    rng = np.random.default_rng(0)
    table = cp.asarray(rng.permutation(ENTRIES * 2)[: (REQUESTS + 1) * POSITIONS].astype(np.int32)
                       .reshape(REQUESTS + 1, POSITIONS))
    rows = cp.asarray((rng.permutation(REQUESTS) + 1).astype(np.int64))
    outs = [cp.empty(ENTRIES, dtype=cp.int64) for _ in range(4)]
    module = cp.RawModule(code=_SOURCE)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]

    def kernel(name, grid, block, with_prev=1):
        fn = module.get_function(name)
        return lambda: fn((grid,), (block,), (table, rows, np.int64(ENTRIES), *outs, np.int32(with_prev)))

    elementwise = cp.ElementwiseKernel("int32 x", "int64 a, int64 b, int64 c, int64 d",
                                       "a = x; b = -1; c = i & 4095; d = x - 1", "plan_bytes_elementwise")
    flat = table[1:].reshape(-1)
    shapes = {
        "stores only, grid-stride, 1 x 1024 an SM": kernel("stores_only", sms, 1024),
        "grid-stride, 1 x 1024 an SM (the plan's launch)": kernel("grid_stride", sms, 1024),
        "the same without the predecessor's read": kernel("grid_stride", sms, 1024, 0),
        "grid-stride, 2 x 1024 an SM": kernel("grid_stride", 2 * sms, 1024),
        "grid-stride, 4 x 512 an SM": kernel("grid_stride", 4 * sms, 512),
        "grid-stride, 8 x 256 an SM": kernel("grid_stride", 8 * sms, 256),
        "grid-stride, 16 x 128 an SM": kernel("grid_stride", 16 * sms, 128),
        "an entry a thread, blocks of 128": kernel("grid_stride", ENTRIES // 128, 128),
        "an entry a thread, blocks of 256": kernel("grid_stride", ENTRIES // 256, 256),
        "an entry a thread, blocks of 1024": kernel("grid_stride", ENTRIES // 1024, 1024),
        "grid-stride, 1 x 1024 an SM, streaming stores": kernel("grid_stride_cs", sms, 1024),
        "grid-stride, 2 x 1024 an SM, streaming stores": kernel("grid_stride_cs", 2 * sms, 1024),
        "an entry a thread, blocks of 256, streaming stores": kernel("grid_stride_cs", ENTRIES // 256, 256),
        "grid-stride, 2 x 1024 an SM, 2 entries a thread": kernel("grid_stride_pairs", 2 * sms, 1024),
        "2 entries a thread, blocks of 256": kernel("grid_stride_pairs", ENTRIES // 512, 256),
        "a contiguous chunk a block, 1 x 1024 an SM": kernel("chunk_a_block", sms, 1024),
        "a contiguous chunk a block, 2 x 1024 an SM": kernel("chunk_a_block", 2 * sms, 1024),
        "CuPy elementwise kernel, contiguous read": lambda: elementwise(flat, *outs),
    }
    for name, launch in shapes.items():
        print(f"{name:52s} {event_timed(launch, reps=20):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
