"""Every cell of docs/detection.md's table over many seeds: how late each fault is reported at
worst, and whether the cell's bound (measured on one seed, which tests/test_sim.py repeats) holds
on the others.

    PYTHONPATH=. python tools/detection_seeds.py --seeds 0 48 --json seeds.json

Each run is the test's: 110 steps, a fault every 10 from step 10, the simulator's defaults. A
cell holds where every fault of a ``missed`` cell goes unreported, every fault of a bounded cell is
reported within its bound, and no run reports a false positive. ``use_after_free`` also records
the steps the allocator took to hand the freed page out again, which the canary cannot shorten.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import sys
import time


@functools.cache
def table_tests():
    """tests/test_sim.py, which reads the table and runs its cells (imported when first asked: the
    test module asks which devices the machine has)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import test_sim  # noqa: PLC0415

    return test_sim


def cell_runs(scenario: str, mode: str, seeds: range, device: str) -> dict:
    """The faults of ``scenario`` in ``mode`` over ``seeds``: counts, latencies and the verdict."""
    tests = table_tests()
    bound_text = tests.TABLE[scenario][mode]
    latencies, reuse_waits = collections.Counter(), collections.Counter()
    faults = unreported = false_positives = 0
    for seed in seeds:
        result = tests.table_run(scenario, mode, seed, device)
        false_positives += len(result.false_positives)
        for fault in result.faults:
            faults += 1
            if fault.detected:
                latencies[fault.latency] += 1
            else:
                unreported += 1
            if fault.reused_step is not None:
                reuse_waits[fault.reused_step - fault.step] += 1
    bound = tests.cell_bound(bound_text)
    holds = not latencies if bound is None else unreported == 0 and max(latencies) <= bound
    return dict(scenario=scenario, mode=mode, cell=bound_text, faults=faults, unreported=unreported,
                worst=max(latencies, default=None), latencies=dict(sorted(latencies.items())),
                reuse_waits=dict(sorted(reuse_waits.items())), false_positives=false_positives,
                holds=holds and false_positives == 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 8), metavar=("FIRST", "END"),
                        help="seeds FIRST to END-1 (default 0 8)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write every cell's counts here")
    args = parser.parse_args()
    seeds, started, rows = range(*args.seeds), time.perf_counter(), []
    tests = table_tests()
    print(f"{'scenario':22} {'mode':8} {'cell':7} {'faults':>6} {'worst':>5}  holds  latencies (steps: faults)")
    for scenario in tests.TABLE:
        for mode in tests.MODES:
            row = cell_runs(scenario, mode, seeds, args.device)
            rows.append(row)
            print(f"{scenario:22} {mode:8} {row['cell']:7} {row['faults']:>6} {str(row['worst']):>5}  "
                  f"{'yes' if row['holds'] else 'NO':5}  {row['latencies']}", flush=True)
    print(f"{sum(r['holds'] for r in rows)} of {len(rows)} cells hold over seeds {seeds.start}-{seeds.stop - 1} "
          f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(seeds=[seeds.start, seeds.stop], device=args.device,
                                                           cells=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
