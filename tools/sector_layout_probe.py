"""How fast DRAM gives a verify's random sectors when they come in an engine's layout, on a GPU.

    python tools/sector_layout_probe.py [--entries N] [--pool SLOTS] [--sources K]

A hashed verify entry reads its canary slot and, for each of K real-KV sources, the same slot's row
of that source: K + 1 random sectors an entry, the K source reads at one offset (slot x row bytes)
in K separate buffers, as an engine's per-layer KV buffers are laid out. Minimal kernels, a thread
an entry indexed by a random permutation (int32, as req_to_token), each folding what it reads so
nothing is written but a word a warp, time (as the benchmarks do: host head start, L2 evicted,
median) the same reads in four layouts:

* ``one sector``: the canary slot only (the benchmarks' bare random-read ceiling, on this pool);
* ``engine layout``: the canary slot and each source's row of the same slot;
* ``sources apart``: the same count of reads, each source's row at a slot of its own (a bijection
  of the entry's slot), so that no two reads of an entry share an offset;
* ``one buffer``: K + 1 random sectors of the canary alone;
* ``one big buffer``: the same within one buffer at least as large as the canary and the sources
  together: whether reads from K + 1 buffers cost more than reads spread as wide in one.

``--orders`` repeats the layouts with the same slots sorted, or sorted by bucket of slots, as a
verify that sorted its entries first would read them: whether DRAM gives sectors faster when nearby
slots come together, and what the sort costs. ``--l2-fetch`` sets the device's L2 fetch
granularity hint (how much L2 asks DRAM for on a miss) before anything runs.

Sectors a second against ``one sector``'s rate say whether the engine layout itself costs DRAM
throughput (the verify cannot choose where the engine keeps its KV) or the verify's own work does.
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

// layout 0: canary only; 1: engine layout; 2: sources apart; 3: every read from the canary
extern "C" __global__ void sector_probe(const ulonglong2* __restrict__ canary,
                                        const unsigned long long* __restrict__ source_rows, int nsrc,
                                        long long row_words, const int* __restrict__ perm, long long n,
                                        long long pool_mask, int layout, unsigned long long* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long v = 0;
    if (i < n) {
        const long long s = perm[i];
        ulonglong2 a = canary[2 * s], b = canary[2 * s + 1];
        v = a.x ^ a.y ^ b.x ^ b.y;
        if (layout > 0) {
            #pragma unroll
            for (int k = 0; k < MAX_SOURCES; ++k) {
                if (k < nsrc) {
                    // an odd multiplier mod a power of two: a bijection, so every slot is read once
                    const long long t = layout == 1 ? s : ((s * (2 * k + 3) * 0x9E3779B1LL + k + 1) & pool_mask);
                    const ulonglong2* p = layout == 3 ? canary + 2 * t
                                                      : (const ulonglong2*)source_rows[k] + row_words * t;
                    ulonglong2 c = p[0], d = p[1];
                    v ^= c.x ^ c.y ^ d.x ^ d.y;
                }
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) == 0 && i < n) out[i >> 5] = v;
}
"""

LAYOUTS = ("one sector", "engine layout", "sources apart", "one buffer", "one big buffer")
ONE_BIG_BUFFER = 4  # "one buffer"'s kernel (layout 3) over a buffer as large as the canary and sources together


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1 << 20, help="entries (bs256 x 4096: 1M)")
    parser.add_argument("--pool", type=int, default=1 << 22, help="slots, a power of two (the benchmarks' 4M)")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--row-bytes", type=int, default=64, help="a source row's bytes (32 of them are read)")
    parser.add_argument("--orders", default="random",
                        help="comma-separated entry orders: random (as an engine's slots come), sorted (by "
                             "slot), or bucketN (by slot >> N, random within a bucket)")
    parser.add_argument("--l2-fetch", type=int, default=None,
                        help="set the device's L2 fetch granularity hint first "
                             "(cudaLimitMaxL2FetchGranularity, bytes; 64 by default)")
    args = parser.parse_args()
    if args.l2_fetch is not None:
        cupy.cuda.runtime.deviceSetLimit(5, args.l2_fetch)  # cudaLimitMaxL2FetchGranularity
    assert args.pool & (args.pool - 1) == 0 and 0 < args.sources <= 8 and args.row_bytes % 16 == 0
    n, pool = args.entries, args.pool
    timer = cold_timer()
    kernel = cupy.RawModule(code=_SOURCE).get_function("sector_probe")
    canary = rand_bytes(cupy, (pool, 32), 1)
    sources = [rand_bytes(cupy, (pool, args.row_bytes), 10 + k) for k in range(args.sources)]
    source_rows = cupy.asarray(np.array([s.data.ptr for s in sources], dtype=np.uint64))
    # 32-byte sectors at least as many as the canary's and the sources' together, a power of two
    big_slots = 1 << (pool * (32 + args.sources * args.row_bytes) // 32 - 1).bit_length()
    big = rand_bytes(cupy, (big_slots, 32), 3)
    random_slots = rand_perm(cupy, pool, 2)[:n].astype(cupy.int32)
    out = cupy.empty((n + 31) // 32, dtype=cupy.uint64)
    block = 256
    grid = (n + block - 1) // block
    print(f"{n} entries over {pool} slots, {args.sources} sources of {args.row_bytes}-byte rows; "
          f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; L2 fetch granularity hint "
          f"{cupy.cuda.runtime.deviceGetLimit(5)} B")
    base_rate = None
    for order in args.orders.split(","):
        perm = _ordered(random_slots, order)
        print(f" entries in {order} order")
        for layout, label in enumerate(LAYOUTS):
            def launch(_, layout=layout):
                buffer, slots = (big, big_slots) if layout == ONE_BIG_BUFFER else (canary, pool)
                kernel((grid,), (block,), (buffer, source_rows, np.int32(args.sources),
                                           np.int64(args.row_bytes // 16), perm, np.int64(n), np.int64(slots - 1),
                                           np.int32(min(layout, 3)), out), stream=timer.stream)
            t = timer.eager(launch, 1, warmup=3, reps=30, cold=True)
            sectors = n * (1 if layout == 0 else 1 + args.sources)
            rate = sectors / t.median_s
            base_rate = base_rate or rate
            print(f"  {label:14s} {t.median_s * 1e6:9.2f} us  {sectors / 1e6:6.2f} M sectors  "
                  f"{rate / 1e9:6.2f} G sectors/s  {100 * rate / base_rate:5.1f} % of random order's one sector",
                  flush=True)
        if order != "random":
            def put_in_order(_):
                with timer.stream:
                    _ordered(random_slots, order)
            t = timer.eager(put_in_order, 1, warmup=3, reps=30, cold=True)
            print(f"  putting {n} slots in this order with cupy.argsort: {t.median_s * 1e6:9.2f} us", flush=True)


def _ordered(slots, order: str):
    """``slots`` in ``order``: random (as given), sorted, or bucketN (sorted by slot >> N only)."""
    if order == "random":
        return slots
    if order == "sorted":
        return cupy.sort(slots)
    shift = int(order.removeprefix("bucket"))
    return slots[cupy.argsort(slots >> shift)]

if __name__ == "__main__":
    main()
