"""Drive a kc.Canary through a few forward passes of two requests, corrupt one request's KV, poll.

Runs on the CPU by default; ``--device cuda`` (with CuPy) runs the same code on a GPU.
"""

import argparse

import numpy as np

import kvcanary_cupy as kc

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
device = parser.parse_args().device
xp = np
if device != "cpu":
    try:
        import cupy as xp
    except ImportError:
        parser.exit(2, f"--device {device} needs CuPy: pip install -e '.[cuda12]' (or cuda13)\n")
    xp.cuda.Device(int(device.partition(":")[2] or 0)).use()  # the arrays below on that GPU

# --- the engine's memory: a paged KV pool of one layer, K and V [pages, page_size, heads, head_dim] --
pages, page_size, heads, head_dim = 64, 4, 2, 8
num_slots = pages * page_size                                  # slot s lives in page s // page_size
k_pool = xp.zeros((pages, page_size, heads, head_dim), dtype=xp.float16)
v_pool = xp.zeros((pages, page_size, heads, head_dim), dtype=xp.float16)
req_to_token = xp.zeros((3, 64), dtype=xp.int32)              # pool rows 1 and 2 hold our requests

canary = kc.Canary(
    pool_slot_count=num_slots, req_to_token=req_to_token, device=device,
    capacities=kc.Capacities.from_args(req_to_token_pool_size=3, max_seq_len_per_req=64,
                                       pool_slot_count=num_slots, max_prefill_tokens=64),
    real_kv_sources=kc.layouts.paged([k_pool], [v_pool]),      # two sources: K, then V
    hash_mode=kc.HashMode.ALL,                                 # fingerprint every KV byte of a slot
    mode="raise")                                              # poll() raises kc.CanaryViolation

# --- a toy scheduler: request "a" (pool row 1, pages 1-4) and "b" (pool row 2, pages 5-8) --------
rng = np.random.default_rng(0)
rows = {"a": 1, "b": 2}
slots = {"a": np.arange(1 * page_size, 5 * page_size), "b": np.arange(5 * page_size, 9 * page_size)}
for name, row in rows.items():
    req_to_token[row, :len(slots[name])] = xp.asarray(slots[name].astype(np.int32))
cached = {"a": 0, "b": 0}                                      # tokens of each request in the cache


def forward(new_tokens: dict) -> None:
    """One forward pass: ``new_tokens`` maps a request to how many tokens it adds (prefill or decode)."""
    names = list(new_tokens)
    ids, positions, locs = [], [], []
    for name in names:
        pos = np.arange(cached[name], cached[name] + new_tokens[name])
        positions.append(pos)
        ids.append(rng.integers(1, 32_000, size=pos.size))
        locs.append(slots[name][pos])
    put = lambda parts: xp.asarray(np.concatenate(parts).astype(np.int64))  # noqa: E731
    batch = kc.ForwardBatch(
        req_pool_indices=xp.asarray([rows[n] for n in names], dtype=xp.int64),
        prefix_lens=xp.asarray([cached[n] for n in names], dtype=xp.int64),
        extend_seq_lens=xp.asarray([new_tokens[n] for n in names], dtype=xp.int64),
        input_ids=put(ids), positions=put(positions), out_cache_loc=put(locs),
        req_ids=names)                                         # names requests in reports
    canary.before_forward(batch)               # HEAD: verify every cached slot the batch will read
    loc = xp.asarray(np.concatenate(locs))     # the "model": write KV bytes of the new tokens
    for pool in (k_pool, v_pool):
        data = rng.standard_normal((loc.size, heads, head_dim)).astype(np.float16)
        pool[loc // page_size, loc % page_size] = xp.asarray(data)
    canary.after_forward(batch)                # fingerprint the new tokens, TAIL verify
    for name in names:
        cached[name] += new_tokens[name]


forward({"a": 10, "b": 6})                     # prefill both prompts
forward({"a": 1, "b": 1})                      # two decode steps
forward({"a": 1, "b": 1})
canary.sweep(kc.LiveRequests(req_pool_indices=xp.asarray([1, 2], dtype=xp.int64),
                             seq_lens=xp.asarray([cached["a"], cached["b"]], dtype=xp.int64),
                             req_ids=["a", "b"]))  # now and then: re-check every live request
report = canary.poll()                         # the one call that waits for the device
print(f"after {report.forwards} forwards: {report.total} violation(s)")

# A silent corruption: one bit of request b's V bytes at position 3 flips.
slot = int(slots["b"][3])
v_bytes = v_pool.view(xp.uint8)                # [pages, page_size, heads, 2 * head_dim] bytes
v_bytes[slot // page_size, slot % page_size, 1, 5] ^= 0x04

forward({"a": 1, "b": 1})                      # the next decode's HEAD verify re-reads that slot
try:
    canary.poll()
except kc.CanaryViolation as caught:         # .report: a kc.CanaryReport of kc.CanaryEvents
    for event in caught.report:                # .request .position .slot .reasons .violation (raw row)
        print(event.describe())
