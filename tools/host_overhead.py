"""Host time per op call with small GPU (or CPU) batches, and where it goes (cProfile).

    PYTHONPATH=. python tools/host_overhead.py [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np

import kvcanary_cupy as kc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    xp = np
    if args.device != "cpu":
        import cupy as xp  # noqa: PLC0415
    bs = 8
    ctx = kc.CanaryContext.allocate(4096, device=args.device)
    vplan = kc.VerifyPlan.allocate(1024, device=args.device)
    wplan = kc.WritePlan.allocate(bs, device=args.device)
    table = np.zeros((bs + 1, 64), np.int32)
    table[1:] = np.arange(1, bs * 64 + 1).reshape(bs, 64)
    batch = dict(req_pool_indices=xp.asarray(np.arange(1, bs + 1)), prefix_lens=xp.zeros(bs, dtype=xp.int64),
                 extend_seq_lens=xp.ones(bs, dtype=xp.int64), req_to_token=xp.asarray(table))
    ids, pos, loc = xp.arange(bs, dtype=xp.int64), xp.zeros(bs, dtype=xp.int64), xp.asarray(table[1:, 0].astype(np.int64))
    # the session's forward (before + after) and the prepared step, over the same batch
    canary = kc.Canary(pool_slot_count=4096, req_to_token=batch["req_to_token"], device=args.device, mode="log",
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=bs + 1, max_seq_len_per_req=64,
                                                          pool_slot_count=4096, max_prefill_tokens=64))
    forward = kc.ForwardBatch(**{k: v for k, v in batch.items() if k != "req_to_token"}, input_ids=ids,
                              positions=pos, out_cache_loc=loc)
    step = kc.CanaryStep(ctx, verify_capacity=1024, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                         write_tag=kc.LaunchTag.TAIL_K_FULL, **batch, input_ids=ids, positions=pos, out_cache_loc=loc)

    def session_forward():
        canary.before_forward(forward)
        canary.after_forward(forward)
        if len(canary.groups[0].log) > 4096:  # poll now and then, as an engine does (not timed apart)
            canary.poll()

    calls = {
        "session forward (before_forward + after_forward)": session_forward,
        "CanaryStep.launch": step.launch,
        "plan": lambda: kc.plan(vplan, wplan, **batch),
        "verify": lambda: kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL),
        "write": lambda: kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=ids, positions=pos,
                                  out_cache_loc=loc),
    }
    for name, call in calls.items():
        for _ in range(50):
            call()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - start) / args.calls * 1e6
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            call()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(8)
        print(f"== {name}: {host:.1f} us host per call")
        print("\n".join(line for line in out.getvalue().splitlines() if "/" in line or "ncalls" in line))
    ctx.violations()


if __name__ == "__main__":
    main()
