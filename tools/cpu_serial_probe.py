"""How long the CPU backend's verify check and real-KV hash loops take an entry, serially and in
threads, and what numba's reference counting costs their serial builds.

    PYTHONPATH=. python tools/cpu_serial_probe.py [--sizes 256,1024,...] [--tries T]

The batch is the benchmarks' ``e2e_decode_steady_hash`` at scale 0.125 (4 real-KV sources of 64
bytes, 32 read; slots a random permutation of a pool of 512K). For each size, the median over
``--tries`` calls of each build, in µs:

* ``check``: the loop that checks each entry's record and its predecessor's link
  (``verify._entry_bits``); ``hash 1`` and ``hash 4``: the real-KV hash of each entry's slot over
  the first source and over all four (``hashing._hash_slots``);
* ``serial``: the package's serial build (no reference counting where numba has the option);
  ``counted``: the same function built serially with numba's reference counting, as any build
  has by default; ``threads``: the package's parallel build on every thread numba has;
  ``1 thread``: the parallel build on one.

Every build's output is checked against the package's serial build. The sizes where ``threads``
overtakes ``serial`` are where the ops' ``PARALLEL_MIN_ENTRIES`` should lie.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import types

import numba
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _shapes  # noqa: E402
from _wall import median_us  # noqa: E402

from kvcanary_cupy.ops.backends._cpu import hashing, verify  # noqa: E402


def _counted(fn):
    """``fn`` built serially with numba's defaults, reference counting included."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_counted")
    return numba.njit(nogil=True)(copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--tries", type=int, default=40)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    case = next(c for c in _shapes.cases_for("verify") if c.name == "e2e_decode_steady_hash").scaled(0.125)
    state = _shapes.build_state(case, "cpu", scale=0.125)
    state.plan(0)
    vplan = state.copies[0].vplan
    entries = int(vplan.num_valid[0])
    if max(sizes) > entries:
        parser.error(f"--sizes: at most {entries} entries")
    words = hashing.slot_words(state.ctx)
    sources, table = hashing.source_arguments(state.ctx)
    counted_check, counted_hash = _counted(verify._entry_bits), _counted(hashing._hash_slots)

    def check(build, size, bits):
        build(size, words, vplan.slot_indices, vplan.expected_tokens, vplan.expected_positions,
              vplan.prev_slot_indices, False, np.zeros(size, np.uint64), np.zeros(size, np.bool_), bits)

    def hash_over(count):
        def run(build, size, out):
            build(words.shape[0], sources[:count], table[:count], vplan.slot_indices[:size], out,
                  np.zeros(size, np.bool_))
        return run

    loops = {"check": (check, verify._entry_bits_serial, counted_check, verify._entry_bits_parallel, np.uint8),
             "hash 1": (hash_over(1), hashing.hash_slots_serial, counted_hash, hashing.hash_slots_parallel,
                        np.uint64),
             "hash 4": (hash_over(4), hashing.hash_slots_serial, counted_hash, hashing.hash_slots_parallel,
                        np.uint64)}
    threads = numba.get_num_threads()
    print(f"{case.describe()}, {entries:,} entries planned; numba {numba.__version__}, {threads} threads; "
          f"median µs of {args.tries} calls")
    print(f"{'loop':<7} {'entries':>7} {'serial':>8} {'counted':>8} {'threads':>8} {'1 thread':>8}")
    for name, (run, serial, counted, parallel, dtype) in loops.items():
        for size in sizes:
            want = np.zeros(size, dtype)
            run(serial, size, want)
            times = {}
            for label, build, count in (("serial", serial, threads), ("counted", counted, threads),
                                        ("threads", parallel, threads), ("1 thread", parallel, 1)):
                numba.set_num_threads(count)
                got = np.zeros(size, dtype)
                run(build, size, got)
                assert np.array_equal(got, want), (name, size, label)
                times[label] = median_us(lambda: run(build, size, got), args.tries)
            numba.set_num_threads(threads)
            print(f"{name:<7} {size:>7} " + " ".join(f"{times[k]:>8.1f}" for k in times))


if __name__ == "__main__":
    main()
