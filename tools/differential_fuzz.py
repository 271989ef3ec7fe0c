"""Randomised differential run: every op on the GPU against the numba CPU oracle.

    python tools/differential_fuzz.py --cases 10000 --json out.json

Each op gets ``--cases`` random cases (sizes from 1 entry to ``--max-entries``, a few percent of
them large). Outputs are compared byte for byte; violation rows as a multiset. A case whose ring
overflows (it keeps the rows recorded first) runs again with a ring that keeps every row, compared
too. Exit status 1 on any mismatch. ``--device cpu`` runs the oracle against itself (a smoke test
of the generator).
``--write-team thread|one|two`` forces the CUDA write's form for every batch: kvc_write_decode (a
thread a request, or with real-KV sources a group of lanes a request), or kvc_write with one or two
warps a request (by default the host picks from the batch's shape and sources: decode-shaped cases
get kvc_write_decode, or one warp a request when they have sources and more than a token a request;
the rest two warps).
Every array a case hands the package sits between guard bands of known bytes (``_fuzzcases``),
and a case whose bands changed is a mismatch: a store past an output's end shows. With
``--exact-allocations`` there are no bands and CuPy's memory pool is off, so that each array is
an allocation of its exact size: under compute-sanitizer's memcheck a read one element past an
input shows too (the sanitizer runs use it; it is slower), and each op's run begins with the cases
only memcheck can judge, which random draws reach too rarely (``_fuzzcases.memcheck_cases``).
``--stale-shared`` runs every kernel of the package after one that fills each SM's shared memory
with non-zero words (``_devices.StaleSharedMemory``): a kernel that reads a shared word it has not
stored then gives a wrong answer, where the zero a fresh card mostly holds might have given the
right one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import _fuzzcases as F  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000, help="cases per op")
    parser.add_argument("--ops", nargs="+", default=list(F.MAKERS), choices=list(F.MAKERS))
    parser.add_argument("--max-entries", type=int, default=1 << 20, help="largest case size (entries)")
    parser.add_argument("--small-entries", type=int, default=4096, help="size cap of the common small cases")
    parser.add_argument("--large-every", type=int, default=250, help="one case in this many is large")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--write-team", choices=("auto", "thread", "one", "two"), default="auto",
                        help="threads or warps a request in the CUDA write (write and step): as the "
                             "host picks, or forced for every batch")
    parser.add_argument("--exact-allocations", action="store_true",
                        help="no guard bands, and CuPy's memory pool off (for compute-sanitizer)")
    parser.add_argument("--stale-shared", action="store_true",
                        help="every CUDA kernel launched after a fill of each SM's shared memory with "
                             "non-zero words")
    args = parser.parse_args(argv)
    if args.stale_shared and args.device == "cpu":
        parser.error("--stale-shared fills a GPU's shared memory: it needs --device cuda")
    F.guard_arrays(not args.exact_allocations)
    if args.exact_allocations:
        F.exact_allocations(args.device)
    if args.write_team != "auto":
        from _devices import force_write_team  # noqa: PLC0415 (it asks for a CUDA device on import)

        force_write_team(args.write_team)
    if args.stale_shared:
        from _devices import stale_shared_memory  # noqa: PLC0415

        stale_shared_memory()

    try:
        summary = {"device": args.device, "seed": args.seed, "write_team": args.write_team,
                   "exact_allocations": args.exact_allocations, "stale_shared": args.stale_shared, "ops": {}}
        failed = False
        for op in args.ops:
            op_index = list(F.MAKERS).index(op)
            rng = np.random.default_rng([args.seed, op_index])
            started = time.time()
            mismatches, examples, largest, entries = 0, [], 0, 0
            # under exact allocations, first the cases only memcheck can judge (drawn apart, so
            # that the random cases stay those of the seed)
            firsts = (F.memcheck_cases(op, np.random.default_rng([args.seed, op_index, 1]))
                      if args.exact_allocations else [])
            cases = len(firsts) + args.cases
            for i in range(cases):
                k = i - len(firsts)
                cap = args.max_entries if k % args.large_every == args.large_every - 1 else args.small_entries
                case = firsts[i] if k < 0 else F.MAKERS[op](rng, cap)
                oracle = F.RUNNERS[op](case, "cpu")
                whole = None
                if op in F.RING_OPS and F.ring_overflowed(oracle):
                    # The ring keeps only the rows recorded first (on a GPU, mostly the first blocks'):
                    # the case runs again with a ring that keeps every row, and those are compared too.
                    whole = F.with_ring(case, oracle["write_index"])
                    whole_oracle = F.RUNNERS[op](whole, "cpu")
                    case["_full_rows"] = Counter(map(tuple, whole_oracle["ring"].tolist()))
                other = F.RUNNERS[op](case, args.device)
                size = _size(op, case)
                largest, entries = max(largest, size), entries + size
                problems = F.compare(op, case, oracle, other)
                if whole is not None:
                    problems += [f"{problem} (every row kept)" for problem in
                                 F.compare(op, whole, whole_oracle, F.RUNNERS[op](whole, args.device))]
                problems += F.guard_problems()
                if problems:
                    mismatches += 1
                    if len(examples) < 5:
                        examples.append({"case": i, "size": size, "problems": problems})
                if (i + 1) % max(1, cases // 10) == 0:
                    print(f"  {op}: {i + 1}/{cases} cases, {mismatches} mismatches", flush=True)
            summary["ops"][op] = {"cases": cases, "mismatches": mismatches, "largest_case_entries": largest,
                                  "total_entries": entries, "seconds": round(time.time() - started, 1),
                                  "examples": examples}
            failed |= mismatches > 0
    finally:
        F.guard_arrays(False)
    print(f"{'op':10} {'cases':>7} {'mismatches':>10} {'largest':>9} {'seconds':>8}")
    for op, row in summary["ops"].items():
        print(f"{op:10} {row['cases']:>7} {row['mismatches']:>10} {row['largest_case_entries']:>9} {row['seconds']:>8}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if failed else 0


def _size(op: str, case: dict) -> int:
    if op == "verify":
        return len(case["slot_indices"])
    if op == "write":
        return len(case["input_ids"])
    if op == "step":
        return min(F.verify_total(case["req_pool_indices"], case["prefix_lens"], case["swa_window_size"]),
                   case["verify_capacity"]) + len(case["input_ids"])
    if op == "plan":
        return int(case["verify_capacity"])
    if op == "records":
        return len(case["src_slots"])
    return len(case["flat_in"])


if __name__ == "__main__":
    sys.exit(main())
