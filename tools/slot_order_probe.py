"""Whether a verify that reads its slots in slot order beats the random-order reads, all passes counted.

    python tools/slot_order_probe.py [--entries N] [--pool SLOTS] [--sources K] [--row-bytes B]
                                     [--read-bytes R] [--run L]

``tools/sector_layout_probe.py --orders random,sorted`` shows DRAM giving a verify's sectors faster
when the same slots come sorted. A verify cannot sort its entries for free, and each entry's check
needs its predecessor's chain link in entry order. These minimal kernels make the same reads and
the same per-entry fold two ways, and check both give the same bits:

* ``direct``: a thread an entry, in entry order: the canary slot (32 B), the predecessor's slot (the
  previous entry's, except at the start of each run of ``--run`` entries: a request) and each
  source's ``--read-bytes`` of the slot's row; one launch.
* ``slot order``, three launches: ``mark`` stores each entry's index at its slot in a pool-sized
  map (int32, kept at -1 between calls); ``gather`` walks the map in slot order, and for each
  slot an entry owns reads the canary slot and the sources, clears the map, and stores what the
  check needs (32 B an entry: three record words and the slot's chain link) at the entry's index
  with a flag byte (which ``mark`` cleared); ``check`` walks the entries in order and folds each
  one's gathered words with its predecessor's link (an entry the map did not give, e.g. a second
  entry of one slot, reads directly).

Times (as the benchmarks do: host head start, L2 evicted, median) each way and each pass.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import cupy
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _probe import cold_timer  # noqa: E402
from _shapes import rand_bytes, rand_perm  # noqa: E402

_SOURCE = r"""
#define MAX_SOURCES 8
typedef unsigned long long u64;

__device__ __forceinline__ u64 link_of(ulonglong2 a, ulonglong2 b) { return a.x * 3ull + b.y; }

__device__ __forceinline__ u64 kv_fold(const u64* __restrict__ source_rows, int nsrc, long long row_words,
                                       int read_pieces, long long s) {
    u64 kv = 0;
    #pragma unroll
    for (int k = 0; k < MAX_SOURCES; ++k) {
        if (k < nsrc) {
            const ulonglong2* p = (const ulonglong2*)source_rows[k] + row_words * s;
            ulonglong2 c = __ldg(p);
            kv ^= c.x * (2 * k + 1) ^ c.y;
            if (read_pieces > 1) { ulonglong2 d = __ldg(p + 1); kv ^= d.x ^ d.y * 5; }
        }
    }
    return kv;
}

__device__ __forceinline__ void warp_out(u64 v, long long i, long long n, u64* __restrict__ out) {
    for (int off = 16; off > 0; off >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) == 0 && i < n) out[i >> 5] = v;
}

__device__ __forceinline__ u64 direct_value(const ulonglong2* __restrict__ canary, const u64* __restrict__ source_rows,
                                            int nsrc, long long row_words, int read_pieces,
                                            const int* __restrict__ slots, long long i, int run) {
    const long long s = slots[i];
    const ulonglong2 a = __ldg(canary + 2 * s), b = __ldg(canary + 2 * s + 1);
    u64 v = a.x ^ kv_fold(source_rows, nsrc, row_words, read_pieces, s) ^ a.y ^ b.x;
    if (i % run) {
        const long long p = slots[i - 1];
        v ^= link_of(__ldg(canary + 2 * p), __ldg(canary + 2 * p + 1));
    }
    return v;
}

extern "C" __global__ void direct(const ulonglong2* __restrict__ canary, const u64* __restrict__ source_rows, int nsrc,
                                  long long row_words, int read_pieces, const int* __restrict__ slots, long long n,
                                  int run, u64* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u64 v = 0;
    if (i < n) v = direct_value(canary, source_rows, nsrc, row_words, read_pieces, slots, i, run);
    warp_out(v, i, n, out);
}

extern "C" __global__ void mark(const int* __restrict__ slots, long long n, int* __restrict__ owner,
                                unsigned char* __restrict__ flag) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        owner[slots[i]] = (int)i;
        flag[i] = 0;
    }
}

extern "C" __global__ void gather(const ulonglong2* __restrict__ canary, const u64* __restrict__ source_rows, int nsrc,
                                  long long row_words, int read_pieces, int* __restrict__ owner, long long pool,
                                  ulonglong2* __restrict__ gathered, unsigned char* __restrict__ flag) {
    const long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= pool) return;
    const int i = owner[s];
    if (i < 0) return;
    owner[s] = -1;
    const ulonglong2 a = __ldg(canary + 2 * s), b = __ldg(canary + 2 * s + 1);
    const u64 kv = kv_fold(source_rows, nsrc, row_words, read_pieces, s);
    gathered[2 * (long long)i] = make_ulonglong2(a.x ^ kv, a.y);
    gathered[2 * (long long)i + 1] = make_ulonglong2(b.x, link_of(a, b));
    flag[i] = 1;
}

extern "C" __global__ void check(const ulonglong2* __restrict__ canary, const u64* __restrict__ source_rows, int nsrc,
                                 long long row_words, int read_pieces, const int* __restrict__ slots, long long n,
                                 int run, const ulonglong2* __restrict__ gathered, unsigned char* __restrict__ flag,
                                 u64* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u64 v = 0;
    if (i < n) {
        const bool mine = flag[i];
        const bool prev_mine = (i % run) && flag[i - 1];
        if (mine && ((i % run) == 0 || prev_mine)) {
            const ulonglong2 g = gathered[2 * i], h = gathered[2 * i + 1];
            v = g.x ^ g.y ^ h.x;
            if (i % run) v ^= gathered[2 * i - 1].y;
        } else {
            v = direct_value(canary, source_rows, nsrc, row_words, read_pieces, slots, i, run);
        }
    }
    warp_out(v, i, n, out);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1 << 20, help="entries (bs256 x 4096: 1M)")
    parser.add_argument("--pool", type=int, default=1 << 22, help="slots (the benchmarks' 4M)")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--row-bytes", type=int, default=64)
    parser.add_argument("--read-bytes", type=int, default=32, choices=(16, 32))
    parser.add_argument("--run", type=int, default=4096, help="entries a request (predecessor chains)")
    args = parser.parse_args()
    n, pool = args.entries, args.pool
    assert n <= pool and 0 <= args.sources <= 8 and args.row_bytes % 16 == 0
    timer = cold_timer()
    module = cupy.RawModule(code=_SOURCE)
    kernels = {name: module.get_function(name) for name in ("direct", "mark", "gather", "check")}
    canary = rand_bytes(cupy, (pool, 32), 1)
    sources = [rand_bytes(cupy, (pool, args.row_bytes), 10 + k) for k in range(args.sources)]
    source_rows = cupy.asarray(np.array([s.data.ptr for s in sources], dtype=np.uint64))
    slots = rand_perm(cupy, pool, 2)[:n].astype(cupy.int32)
    owner = cupy.full(pool, -1, dtype=cupy.int32)
    gathered = cupy.empty((n, 32), dtype=cupy.uint8)
    flag = cupy.zeros(n, dtype=cupy.uint8)
    out_direct = cupy.empty((n + 31) // 32, dtype=cupy.uint64)
    out_sorted = cupy.empty_like(out_direct)
    block = 256
    grid = lambda count: ((count + block - 1) // block,)  # noqa: E731
    common = (np.int32(args.sources), np.int64(args.row_bytes // 16), np.int32(args.read_bytes // 16))

    def direct():
        kernels["direct"](grid(n), (block,), (canary, source_rows, *common, slots, np.int64(n), np.int32(args.run),
                                               out_direct), stream=timer.stream)

    def mark():
        kernels["mark"](grid(n), (block,), (slots, np.int64(n), owner, flag), stream=timer.stream)

    def gather():
        kernels["gather"](grid(pool), (block,), (canary, source_rows, *common, owner, np.int64(pool), gathered, flag),
                          stream=timer.stream)

    def check():
        kernels["check"](grid(n), (block,), (canary, source_rows, *common, slots, np.int64(n), np.int32(args.run),
                                              gathered, flag, out_sorted), stream=timer.stream)

    def slot_order():
        mark()
        gather()
        check()

    with timer.stream:
        direct()
        slot_order()
        timer.sync()
        assert bool((out_direct == out_sorted).all()), "the two ways disagree"
        assert bool((owner == -1).all()), "the slot map not left clean"
    print(f"{n} entries over {pool} slots, {args.sources} sources of {args.row_bytes}-byte rows reading "
          f"{args.read_bytes}; {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; same bits both ways")
    # mark and gather leave the scratch as check expects it only as a sequence: time the parts inside
    # a whole run (mark + gather, then + check) and take differences.
    rows = {"direct": [direct], "mark": [mark], "mark+gather": [mark, gather], "slot order": [mark, gather, check]}
    medians = {}
    for label, parts in rows.items():
        def seq(parts=parts):
            for p in parts:
                p()
        graph = timer.capture(seq)
        t = timer.graph([graph], warmup=3, reps=30, cold=True)
        if label == "mark" or label == "mark+gather":
            with timer.stream:  # the clean map the next row expects
                owner.fill(-1)
                timer.sync()
        medians[label] = t.median_s * 1e6
        print(f"  {label:12s} {medians[label]:9.2f} us", flush=True)
    print(f"  slot order / direct: {medians['slot order'] / medians['direct']:.3f}")


if __name__ == "__main__":
    main()
