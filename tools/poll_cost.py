"""Host time of kc.Canary.poll when it finds rows: one lasting fault in a large decode batch, the
rows of each forward since the previous poll mapped back to their forward, request and position.

    PYTHONPATH=. python tools/poll_cost.py --device cpu --bs 256 --prefix 4096 --forwards 1 5 20

Each request's cached tokens sit in random slots of the pool. The fault (a stored token's low bit
flipped) lies in one request's prefix, so every HEAD and TAIL verify records one row; the poll
after ``forwards`` decode forwards maps ``2 x forwards`` rows. A clean poll is timed too.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy._dlpack import from_host, parse_device, to_host


def run(device: str, bs: int, prefix: int, forwards: int, seed: int = 0) -> dict:
    where = parse_device(device)
    rng = np.random.default_rng(seed)
    width = prefix + forwards + 1
    slots = bs * width + 1
    table = np.zeros((bs + 1, width), np.int32)
    order = rng.permutation(np.arange(1, slots)).astype(np.int32)
    table[1:, :prefix] = order[: bs * prefix].reshape(bs, prefix)
    free = order[bs * prefix:].tolist()
    caps = kc.Capacities.from_args(req_to_token_pool_size=bs + 1, max_seq_len_per_req=width, pool_slot_count=slots,
                                   max_prefill_tokens=bs * prefix)
    table_dev = from_host(table, where)
    canary = kc.Canary(pool_slot_count=slots, capacities=caps, req_to_token=table_dev, device=device,
                       hash_mode=kc.HashMode.NONE, logger=logging.getLogger("quiet"))
    logging.getLogger("quiet").disabled = True
    i64 = lambda values: from_host(np.asarray(values, np.int64), where)  # noqa: E731
    requests = np.arange(1, bs + 1)
    prefill = kc.ForwardBatch(req_pool_indices=i64(requests), prefix_lens=i64(np.zeros(bs)),
                              extend_seq_lens=i64(np.full(bs, prefix)),
                              input_ids=i64(rng.integers(0, 32_000, bs * prefix)),
                              positions=i64(np.tile(np.arange(prefix), bs)), out_cache_loc=i64(table[1:, :prefix].reshape(-1)))
    canary.before_forward(prefill)
    canary.after_forward(prefill)
    started = time.perf_counter()
    assert canary.poll().total == 0
    clean_ms = 1e3 * (time.perf_counter() - started)
    lens = np.full(bs, prefix)
    for number in range(forwards):
        loc = np.array([free.pop() for _ in range(bs)], np.int64)
        table[requests, lens] = loc
        table_dev[...] = from_host(table, where)
        batch = kc.ForwardBatch(req_pool_indices=i64(requests), prefix_lens=i64(lens), extend_seq_lens=i64(np.ones(bs)),
                                input_ids=i64(rng.integers(0, 32_000, bs)), positions=i64(lens), out_cache_loc=i64(loc))
        if number == 0:
            buf = canary.context.canary_buf
            slot = int(table[bs // 2, prefix // 3])
            row = np.array(to_host(buf[slot]))
            row[0] ^= 1
            buf[slot] = from_host(row, where)
        canary.before_forward(batch)
        canary.after_forward(batch)
        lens += 1
    canary.stats()  # the device is idle: the poll below is mapping, not waiting
    started = time.perf_counter()
    report = canary.poll()
    found_ms = 1e3 * (time.perf_counter() - started)
    named = sorted({(e.step, e.request, e.position) for e in report})
    assert len(report) == 2 * forwards and len(named) == forwards, named
    return dict(bs=bs, prefix=prefix, forwards=forwards, entries_per_verify=bs * prefix, rows=len(report),
                clean_poll_ms=round(clean_ms, 2), poll_ms=round(found_ms, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bs", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--forwards", type=int, nargs="+", default=[1, 5, 20])
    args = parser.parse_args()
    print(f"{'device':>6} {'bs':>5} {'prefix':>6} {'entries':>9} {'forwards':>8} {'rows':>5} "
          f"{'clean poll ms':>13} {'poll ms':>8}")
    for forwards in args.forwards:
        r = run(args.device, args.bs, args.prefix, forwards)
        print(f"{args.device:>6} {r['bs']:>5} {r['prefix']:>6} {r['entries_per_verify']:>9} {r['forwards']:>8} "
              f"{r['rows']:>5} {r['clean_poll_ms']:>13} {r['poll_ms']:>8}")


if __name__ == "__main__":
    main()
