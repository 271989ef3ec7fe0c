"""The demo's engine over a grid of shapes and seeds: every run must find every fault it injects
(hash mode ALL) and report nothing else.

    PYTHONPATH=. python tools/demo_sweep.py --device cuda --seeds 4 --json sweep.json

Each row is one configuration (layout, SWA window, speculative drafts, split batches, static
decode, host tier) run with ``--seeds`` seeds of 300 steps, every fault class injected. A false
positive or a missed fault in any run is a finding; the table says how many of each. As in the
demo, a fault whose requests still ran at the end (in flight) or that changed nothing they read
(a use_after_free whose page was not handed out again before its request was done) is not
missed: the totals count those apart.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import kvcanary_cupy as kc
from kvcanary_cupy.sim import FAULT_CLASSES, SimConfig, run

SHAPES = [dict(layout=layout, swa_window=swa, speculative=drafts, split_batches=split, static_decode=static,
               host_slots=host)
          for layout, swa, drafts, (split, static), host in itertools.product(
              ("paged", "per_layer", "interleaved", "mla"), (0, 24), (0, 3), ((False, False), (True, True)), (2048, 0))
          if not (drafts and static)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write every run's summary here")
    args = parser.parse_args()
    rows, started = [], time.perf_counter()
    for shape in SHAPES:
        for seed in range(args.seeds):
            result = run(SimConfig(steps=args.steps, seed=seed, device=args.device, hash_mode=kc.HashMode.ALL,
                                   **shape), FAULT_CLASSES)
            rows.append(dict(shape, seed=seed, injected=len(result.faults),
                             missed=len(result.missed),  # as the demo counts them: done with, and unreported
                             in_flight=sum(not f.detected and not f.closed for f in result.faults),
                             no_effect=sum(not f.detected and f.closed and not f.took_effect for f in result.faults),
                             false_positives=len(result.false_positives), tokens=result.tokens,
                             verified_entries=result.verified_entries))
    print(f"{'layout':<12}{'swa':>4}{'drafts':>7}{'static':>7}{'tier':>6}{'runs':>5}{'faults':>7}{'missed':>7}"
          f"{'false +':>8}")
    for shape in SHAPES:
        mine = [r for r in rows if all(r[k] == v for k, v in shape.items())]
        print(f"{shape['layout']:<12}{shape['swa_window']:>4}{shape['speculative']:>7}{str(shape['static_decode']):>7}"
              f"{shape['host_slots']:>6}{len(mine):>5}{sum(r['injected'] for r in mine):>7}"
              f"{sum(r['missed'] for r in mine):>7}{sum(r['false_positives'] for r in mine):>8}")
    total = {key: sum(r[key] for r in rows)
             for key in ("injected", "missed", "in_flight", "no_effect", "false_positives", "verified_entries")}
    print(f"{len(rows)} runs on {args.device} in {time.perf_counter() - started:.0f} s: {total['injected']} faults, "
          f"{total['missed']} missed ({total['in_flight']} in flight, {total['no_effect']} without effect, "
          f"not missed), {total['false_positives']} false positives, "
          f"{total['verified_entries']} entries verified")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": args.device, "steps": args.steps, "runs": rows, "total": total}, handle, indent=1)


if __name__ == "__main__":
    main()
