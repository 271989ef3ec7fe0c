"""A request's KV offloaded to a host-memory tier and loaded back into other slots, its canary
records carried both ways (kc.copy_records out, canary.copy_records back in: the same copy, told
to the canary, whose polls then know when the slots got their records): the reloaded KV verifies
clean, and a bit that flipped in host memory while the request was away is reported at the next
forward that reads it.

Runs on the CPU by default (both tiers in host memory); ``--device cuda`` (with CuPy) keeps the
serving pool on the GPU, and the records cross between the GPU and the host.
"""

import argparse

import numpy as np

import kvcanary_cupy as kc

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N for the serving pool (default cpu)")
device = parser.parse_args().device
xp = np
if device != "cpu":
    try:
        import cupy as xp
    except ImportError:
        parser.exit(2, f"--device {device} needs CuPy: pip install -e '.[cuda12]' (or cuda13)\n")
    xp.cuda.Device(int(device.partition(":")[2] or 0)).use()  # the arrays below on that GPU

# --- the serving pool (K and V [pages, page_size, heads, head_dim]) and its canary ----------------
pages, page_size, heads, head_dim = 32, 4, 2, 8
k_pool = xp.zeros((pages, page_size, heads, head_dim), dtype=xp.float16)
v_pool = xp.zeros((pages, page_size, heads, head_dim), dtype=xp.float16)
req_to_token = xp.zeros((3, 64), dtype=xp.int32)
canary = kc.Canary(
    pool_slot_count=pages * page_size, req_to_token=req_to_token, device=device,
    capacities=kc.Capacities.from_args(req_to_token_pool_size=3, max_seq_len_per_req=64,
                                       pool_slot_count=pages * page_size, max_prefill_tokens=64),
    real_kv_sources=kc.layouts.paged([k_pool], [v_pool]), hash_mode=kc.HashMode.ALL, mode="raise")

# --- the host tier: its own pool (pages of 8 here) and a canary context that only holds records ---
host_pages, host_page_size = 8, 8
host_k = np.zeros((host_pages, host_page_size, heads, head_dim), dtype=np.float16)
host_v = np.zeros((host_pages, host_page_size, heads, head_dim), dtype=np.float16)
host = kc.CanaryContext.allocate(host_pages * host_page_size, device="cpu", hash_mode=kc.HashMode.ALL,
                                 real_kv_sources=kc.layouts.paged([host_k], [host_v]))

rng = np.random.default_rng(0)
requests = {"a": dict(row=1, slots=[], cached=0), "b": dict(row=2, slots=[], cached=0)}
free = list(range(page_size, pages * page_size))  # page 0 holds the padding slot


def forward(new_tokens: dict) -> None:
    """One forward pass: ``new_tokens`` maps a request to how many tokens it adds."""
    names = list(new_tokens)
    ids, positions, locs = [], [], []
    for name in names:
        request = requests[name]
        pos = np.arange(request["cached"], request["cached"] + new_tokens[name])
        while len(request["slots"]) < pos[-1] + 1:
            request["slots"].append(free.pop(0))
        loc = np.asarray(request["slots"])[pos]
        req_to_token[request["row"], pos] = xp.asarray(loc.astype(np.int32))
        ids.append(rng.integers(1, 32_000, size=pos.size)), positions.append(pos), locs.append(loc)
    put = lambda parts: xp.asarray(np.concatenate(parts).astype(np.int64))  # noqa: E731
    batch = kc.ForwardBatch(
        req_pool_indices=xp.asarray([requests[n]["row"] for n in names], dtype=xp.int64),
        prefix_lens=xp.asarray([requests[n]["cached"] for n in names], dtype=xp.int64),
        extend_seq_lens=xp.asarray([new_tokens[n] for n in names], dtype=xp.int64),
        input_ids=put(ids), positions=put(positions), out_cache_loc=put(locs), req_ids=names)
    canary.before_forward(batch)
    loc = put(locs)
    for pool in (k_pool, v_pool):  # the "model" writes the new tokens' K and V
        pool[loc // page_size, loc % page_size] = xp.asarray(
            rng.standard_normal((int(loc.size), heads, head_dim)).astype(np.float16))
    canary.after_forward(batch)
    for name in names:
        requests[name]["cached"] += new_tokens[name]


def offload(name: str) -> np.ndarray:
    """The request's cached KV and records to the host tier (its slots there returned); its serving
    slots go back to the free list."""
    request = requests[name]
    slots = np.asarray(request["slots"][:request["cached"]])
    host_slots = np.arange(host_page_size, host_page_size + slots.size)  # from host page 1 on
    on_device = xp.asarray(slots)
    for pool, host_pool in ((k_pool, host_k), (v_pool, host_v)):
        rows = pool[on_device // page_size, on_device % page_size]
        host_pool[host_slots // host_page_size, host_slots % host_page_size] = rows.get() if xp is not np else rows
    kc.copy_records(src=canary.context, dst=host, src_slots=xp.asarray(slots.astype(np.int64)), dst_slots=host_slots)
    free[:0] = request["slots"]  # handed out first
    request["slots"] = []
    return host_slots


def load(name: str, host_slots: np.ndarray) -> None:
    """The request's KV and records back from the host tier, into serving slots it gets now."""
    request = requests[name]
    request["slots"] = [free.pop(0) for _ in range(request["cached"])]
    slots = np.asarray(request["slots"])
    on_device = xp.asarray(slots)
    for pool, host_pool in ((k_pool, host_k), (v_pool, host_v)):
        rows = host_pool[host_slots // host_page_size, host_slots % host_page_size]
        pool[on_device // page_size, on_device % page_size] = xp.asarray(rows)
    canary.copy_records(src=host, dst=canary.context, src_slots=host_slots,
                        dst_slots=xp.asarray(slots.astype(np.int64)))
    req_to_token[request["row"], :request["cached"]] = xp.asarray(slots.astype(np.int32))


forward({"a": 10, "b": 6})                    # prefill
forward({"a": 1, "b": 1})                     # decode
host_slots = offload("a")                     # a waits: its 11 cached tokens to the host tier
forward({"b": 14})                            # b takes the freed slots meanwhile
load("a", host_slots)                         # a comes back, into other serving slots
forward({"a": 1, "b": 1})                     # its HEAD verify reads the reloaded prefix
report = canary.poll()
print(f"after offloading and reloading request a: {report.total} violation(s) over {report.forwards} forwards")

host_slots = offload("a")
host_v.view(np.uint8)[host_slots[5] // host_page_size, host_slots[5] % host_page_size, 1, 3] ^= 0x10  # host memory
load("a", host_slots)
forward({"a": 1})
try:
    canary.poll()
except kc.CanaryViolation as caught:          # an engine would recompute request a
    print(f"after a bit flip in host memory while a was offloaded: {caught.report.total} violation(s)")
    for event in caught.report:
        print(event.describe())
