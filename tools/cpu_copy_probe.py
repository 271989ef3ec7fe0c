"""What a CPU ``kc.copy_records`` of many random pairs spends its time on, and whether another loop
would spend less.

    PYTHONPATH=. python tools/cpu_copy_probe.py [--records N] [--tries T]

Two canaries of N + 1 slots with random records, N pairs from a random permutation of one's slots to
a random permutation of the other's (as ``benchmarks/bench_cpu.py`` copies them). Times, best and
median of ``--tries`` calls each, in a table:

* ``kc.copy_records``: the op, its host checks included;
* ``the backend's loop``: the numba loop the op runs, alone;
* ``random reads``, ``random stores``: the same slots' records only read (folded into one word), or
  only stored;
* ``in-order copy``: the same bytes copied slot by slot, in order (no random access);
* variants of the loop: lines asked for further ahead, or for writing, and two threads that each
  store the pairs whose destination lies in their half of the slots (pair order kept per slot).

Every variant's destination is checked against the backend's loop. Each try of a pass runs its
calls in turn, so a shared machine's slow spells fall on all of them alike.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numba
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy import _layout as L  # noqa: E402
from kvcanary_cupy.ops.backends._cpu import records  # noqa: E402
from kvcanary_cupy.ops.backends._cpu.hashing import _cache_line_hint, prefetch, slot_words  # noqa: E402

_FIELDS = L.SLOT_FIELD_COUNT


_prefetch_for_write = _cache_line_hint(for_write=True)


@numba.njit
def _reads_only(words, slots):
    folded = 0
    for i in range(slots.shape[0]):
        for f in range(_FIELDS):
            folded ^= words[slots[i], f]
    return folded


@numba.njit
def _stores_only(words, slots):
    for i in range(slots.shape[0]):
        for f in range(_FIELDS):
            words[slots[i], f] = i + f


@numba.njit
def _in_order(src_words, dst_words):
    for s in range(src_words.shape[0]):
        for f in range(_FIELDS):
            dst_words[s, f] = src_words[s, f]


@numba.njit
def _ahead(src_words, src_slots, dst_words, dst_slots, ahead, for_write):
    """The backend's loop with another distance and hint for the lines it asks for."""
    count, src_count, dst_count = src_slots.shape[0], src_words.shape[0], dst_words.shape[0]
    for i in range(count):
        if i + ahead < count:
            if 0 <= src_slots[i + ahead] < src_count:
                prefetch(src_words, src_slots[i + ahead] * src_words.shape[1])
            if 0 <= dst_slots[i + ahead] < dst_count:
                if for_write:
                    _prefetch_for_write(dst_words, dst_slots[i + ahead] * dst_words.shape[1])
                else:
                    prefetch(dst_words, dst_slots[i + ahead] * dst_words.shape[1])
        source, destination = src_slots[i], dst_slots[i]
        if 0 <= source < src_count and 0 <= destination < dst_count:
            for f in range(_FIELDS):
                dst_words[destination, f] = src_words[source, f]


@numba.njit(parallel=True)
def _halves(src_words, src_slots, dst_words, dst_slots):
    """Two threads, each walking every pair in order and storing those whose destination lies in its
    half of the slots: where pairs name one destination twice, the last one's record still lands."""
    src_count, dst_count = src_words.shape[0], dst_words.shape[0]
    for half in numba.prange(2):
        low, high = dst_count * half // 2, dst_count * (half + 1) // 2
        for i in range(src_slots.shape[0]):
            source, destination = src_slots[i], dst_slots[i]
            if low <= destination < high and 0 <= source < src_count:
                for f in range(_FIELDS):
                    dst_words[destination, f] = src_words[source, f]


def _canary(slot_count: int, rng) -> kc.CanaryContext:
    ctx = kc.CanaryContext.allocate(slot_count, ring_capacity=16)
    slot_words(ctx)[:] = rng.integers(1, 2**62, size=slot_words(ctx).shape)
    return ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--tries", type=int, default=40)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    src, dst = _canary(args.records + 1, rng), _canary(args.records + 1, rng)
    src_words, dst_words = slot_words(src), slot_words(dst)
    src_slots = rng.permutation(np.arange(1, args.records + 1)).astype(np.int64)
    dst_slots = rng.permutation(np.arange(1, args.records + 1)).astype(np.int64)
    before = dst_words.copy()
    scratch = before.copy()
    expected = before.copy()
    records._copy(src_words, src_slots, expected, dst_slots)
    passes = {
        "kc.copy_records": lambda: kc.copy_records(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots),
        "the backend's loop": lambda: records._copy(src_words, src_slots, scratch, dst_slots),
        "random reads": lambda: _reads_only(src_words, src_slots),
        "random stores": lambda: _stores_only(scratch, dst_slots),
        "in-order copy": lambda: _in_order(src_words, scratch),
    }
    for ahead in (8, 16, 32, 64):
        passes[f"asked {ahead} ahead"] = lambda a=ahead: _ahead(src_words, src_slots, scratch, dst_slots, a, False)
        passes[f"asked {ahead} ahead, for writing"] = (
            lambda a=ahead: _ahead(src_words, src_slots, scratch, dst_slots, a, True))
    passes["two threads, a half of the slots each"] = lambda: _halves(src_words, src_slots, scratch, dst_slots)

    for name, run in passes.items():
        scratch[:] = before
        run()  # compiles
        if name.startswith(("asked", "two threads")):
            assert np.array_equal(scratch, expected), name
    assert np.array_equal(dst_words, expected)
    times = {name: [] for name in passes}
    for _ in range(args.tries):
        for name, run in passes.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"{args.records:,} records of 32 bytes between two canaries, numba {numba.__version__}, "
          f"{numba.get_num_threads()} threads; ms, over {args.tries} tries")
    print(f"{'pass':<40} {'best':>7} {'median':>7}")
    for name, spent in times.items():
        print(f"{name:<40} {min(spent) * 1e3:7.3f} {np.median(spent) * 1e3:7.3f}")


if __name__ == "__main__":
    main()
