"""The same-forward prefix recipe (docs/integration.md) under load: a writer computes a prompt while
1 to 63 hitters of its full blocks list the shared tokens again over its slots, in one forward,
hitters before or after the writer, then two decode steps; every forward must be clean. Then a
wrong hit (one hitter's token differs inside the shared blocks), with and without an expected-token
pool: what is reported, and whom it names.

    PYTHONPATH=. python tools/same_forward_stress.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy._dlpack import from_host, parse_device

PAGE = 16


def trial(device: str, prompt_len: int, hitters: int, hitters_first: bool, mode: kc.HashMode, seed: int,
          wrong: bool = False, expected: bool = False) -> tuple[list[int], list[int]]:
    """Each forward's violation count, and the requests (batch indices) the reports name."""
    rows, blocks_per = hitters + 2, prompt_len // PAGE + 2
    pool = (1 + blocks_per * (hitters + 1) + 8) * PAGE
    rng = np.random.default_rng(seed)
    table = np.zeros((rows, blocks_per * PAGE + 64), np.int32)
    free = iter(range(1, pool // PAGE))
    writer_blocks = [next(free) for _ in range(blocks_per)]
    shared = prompt_len // PAGE
    for row in range(1, hitters + 2):  # row 1 the writer; the others share its full blocks
        own = writer_blocks if row == 1 else writer_blocks[:shared] + [next(free) for _ in range(blocks_per - shared)]
        table[row, :len(own) * PAGE] = (np.array(own)[:, None] * PAGE + np.arange(PAGE)).ravel()
    tokens = np.zeros_like(table)  # what each request believes its positions hold, as an engine's pool
    where = parse_device(device)
    put = lambda a: from_host(a, where)  # noqa: E731
    tokens_on_device = put(tokens)
    kv = put(rng.standard_normal((pool // PAGE, PAGE, 4, 16)).astype(np.float16))
    canary = kc.Canary(pool_slot_count=pool, req_to_token=put(table), device=device, hash_mode=mode,
                       expected_tokens=tokens_on_device if expected else None,
                       real_kv_sources=kc.layouts.paged([kv], page_size=PAGE), chain_position_assert=True,
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=rows, max_seq_len_per_req=table.shape[1],
                                                          pool_slot_count=pool,
                                                          max_prefill_tokens=(hitters + 1) * prompt_len + 64))
    order = list(range(2, hitters + 2)) + [1] if hitters_first else [1] + list(range(2, hitters + 2))
    prompt = rng.integers(1, 32000, prompt_len)
    ids_of = {row: prompt.copy() for row in order}
    if wrong:
        middle = shared * PAGE // 2
        ids_of[2][middle] = ids_of[2][middle] % 31999 + 1

    def forward(prefix: dict, extend: dict, ids: dict) -> kc.CanaryReport:
        for row in order:
            tokens[row, prefix[row]:prefix[row] + extend[row]] = ids[row]
        tokens_on_device[...] = put(tokens)  # refilled in place: the canary references the pool
        vector = lambda values: put(np.asarray(values, np.int64))  # noqa: E731
        batch = kc.ForwardBatch(
            req_pool_indices=vector(order), prefix_lens=vector([prefix[r] for r in order]),
            extend_seq_lens=vector([extend[r] for r in order]), input_ids=vector(np.concatenate([ids[r] for r in order])),
            positions=vector(np.concatenate([np.arange(prefix[r], prefix[r] + extend[r]) for r in order])),
            out_cache_loc=vector(np.concatenate([table[r, prefix[r]:prefix[r] + extend[r]] for r in order])))
        canary.before_forward(batch)
        canary.after_forward(batch)
        return canary.poll()

    reports = [forward({r: 0 for r in order}, {r: prompt_len for r in order}, ids_of)]
    for step in range(2):
        reports.append(forward({r: prompt_len + step for r in order}, {r: 1 for r in order},
                               {r: rng.integers(1, 32000, 1) for r in order}))
    return [report.total for report in reports], sorted({int(e.request) for report in reports for e in report})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write every trial here")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the wrong hits' reports: counted here, not logged
    prompts, hitter_counts = ((200, 1000, 4096), (1, 3, 16, 63)) if args.device != "cpu" else ((200,), (1, 3))
    out: dict = {"device": args.device, "clean": [], "wrong": []}
    start = time.time()
    for prompt_len in prompts:
        for hitters in hitter_counts:
            for hitters_first in (True, False):
                for mode in (kc.HashMode.ALL, kc.HashMode.PARTIAL, kc.HashMode.NONE):
                    for seed in range(3):
                        totals, _ = trial(args.device, prompt_len, hitters, hitters_first, mode, seed,
                                          expected=seed == 2)
                        out["clean"].append(dict(prompt=prompt_len, hitters=hitters, hitters_first=hitters_first,
                                                 mode=mode.name, expected_tokens=seed == 2, totals=totals))
                for expected in (False, True):
                    totals, named = trial(args.device, prompt_len, hitters, hitters_first, kc.HashMode.ALL, 99,
                                          wrong=True, expected=expected)
                    out["wrong"].append(dict(prompt=prompt_len, hitters=hitters, hitters_first=hitters_first,
                                             expected_tokens=expected, totals=totals, named=named))
    dirty = [r for r in out["clean"] if any(r["totals"])]
    unseen = [r for r in out["wrong"] if not any(r["totals"])]
    print(f"clean trials {len(out['clean'])}: {len(dirty)} with violations; wrong hits {len(out['wrong'])}: "
          f"{len(unseen)} unreported; {time.time() - start:.0f} s")
    for r in out["wrong"]:
        writer_at = 0 if not r["hitters_first"] else r["hitters"]
        who = ["writer" if n == writer_at else ("the wrong hitter" if n == (1 if writer_at == 0 else 0) else "a hitter")
               for n in r["named"]]
        print(f"wrong hit: prompt {r['prompt']}, {r['hitters']} hitter(s), "
              f"{'hitters first' if r['hitters_first'] else 'writer first'}, "
              f"{'expected tokens' if r['expected_tokens'] else 'no expected tokens'}: violations {r['totals']}, "
              f"named {who or 'none'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(out, handle, indent=1)


if __name__ == "__main__":
    main()
