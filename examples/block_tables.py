"""A canary for an engine that keeps block tables instead of a req_to_token table.

Each request owns a row of a block table (block ids of its KV, ``block_size`` tokens a block) and
the engine computes each new token's slot as ``block * block_size + offset``. The canary reads a
per-position slot table, so the engine mirrors each block it hands a request into that table
(``kc.block_tables.mirror``) when the block is given, not each forward. It describes each forward
by cumulative token offsets and total lengths, in int32 (``kc.ForwardBatch.from_offsets``). The KV
cache is one tensor a layer with K and V stacked, ``[2, blocks, block_size, heads, head_dim]``. A
prefix cache shares whole blocks between requests. Then an allocator bug frees a block that request "a" still uses and
hands it to a new request: the next forward that reads a's prefix reports it.

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

# --- the engine's memory --------------------------------------------------------------------------
blocks, block_size, heads, head_dim, layers = 32, 4, 2, 8, 2
max_requests, max_blocks_per_request = 4, 8
kv_caches = [xp.zeros((2, blocks, block_size, heads, head_dim), dtype=xp.float16) for _ in range(layers)]
block_table = np.zeros((max_requests, max_blocks_per_request), dtype=np.int32)  # the engine's own
free_blocks = list(range(1, blocks))  # block 0 is never handed out: its first slot, 0, is the padding slot

# --- the canary's view of it: a slot a position, one row a request (row 0 stays the padding row) --
req_to_token = xp.zeros((max_requests + 1, max_blocks_per_request * block_size), dtype=xp.int32)


def give_blocks(row: int, new_blocks: list) -> None:
    """The engine appends ``new_blocks`` to a request's block table; the canary's table follows."""
    first = int(np.count_nonzero(block_table[row]))
    block_table[row, first:first + len(new_blocks)] = new_blocks
    kc.block_tables.mirror(req_to_token, block_table=xp.asarray(block_table[row:row + 1, first:first + len(new_blocks)]),
                           block_size=block_size, rows=[row + 1], first_block=first)


canary = kc.Canary(
    pool_slot_count=blocks * block_size, req_to_token=req_to_token, device=device,
    capacities=kc.Capacities.from_args(req_to_token_pool_size=max_requests + 1,
                                       max_seq_len_per_req=max_blocks_per_request * block_size,
                                       pool_slot_count=blocks * block_size, max_prefill_tokens=64),
    # K and V of each layer are views of its stacked tensor, [blocks, block_size, heads, head_dim]
    real_kv_sources=kc.layouts.paged([kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]),
    hash_mode=kc.HashMode.ALL,
    mode="raise")                                       # poll() raises kc.CanaryViolation

# --- a toy scheduler ------------------------------------------------------------------------------
rng = np.random.default_rng(0)
requests = {}  # name: dict(row=block-table row, tokens=token ids so far, cached=tokens in the KV cache)


def add_request(name: str, row: int, prompt: np.ndarray, shared_from: str = "", shared_blocks: int = 0) -> None:
    """A new request; ``shared_blocks`` full blocks of its prompt found in the prefix cache."""
    request = dict(row=row, tokens=list(prompt), cached=0)
    if shared_blocks:
        give_blocks(row, list(block_table[requests[shared_from]["row"], :shared_blocks]))
        request["cached"] = shared_blocks * block_size
    requests[name] = request


def forward(new_tokens: dict) -> None:
    """One forward pass: ``new_tokens`` maps a request to how many of its tokens it computes."""
    names = list(new_tokens)
    ids, positions, slots = [], [], []
    for name in names:
        request, count = requests[name], new_tokens[name]
        start = request["cached"]
        while int(np.count_nonzero(block_table[request["row"]])) * block_size < start + count:
            give_blocks(request["row"], [free_blocks.pop(0)])
        pos = np.arange(start, start + count)
        row_blocks = block_table[request["row"]]
        positions.append(pos)
        ids.append(np.asarray(request["tokens"][start:start + count]))
        slots.append(row_blocks[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    put = lambda parts: xp.asarray(np.concatenate(parts).astype(np.int64))  # noqa: E731
    counts = [new_tokens[n] for n in names]
    batch = kc.ForwardBatch.from_offsets(
        req_pool_indices=xp.asarray([requests[n]["row"] + 1 for n in names], dtype=xp.int32),
        query_start_loc=xp.asarray(np.cumsum([0] + counts), dtype=xp.int32),  # request r's tokens [qsl[r], qsl[r + 1])
        seq_lens=xp.asarray([requests[n]["cached"] + new_tokens[n] for n in names], dtype=xp.int32),  # cached + new
        input_ids=put(ids), positions=put(positions), out_cache_loc=put(slots),  # the slot mapping
        req_ids=names)
    canary.before_forward(batch)
    slot = put(slots)  # the "model": new K and V bytes for each computed token
    for kv in kv_caches:
        for k_or_v in (0, 1):
            data = rng.standard_normal((int(slot.size), heads, head_dim)).astype(np.float16)
            kv[k_or_v, slot // block_size, slot % block_size] = xp.asarray(data)
    canary.after_forward(batch)
    for name in names:
        requests[name]["cached"] += new_tokens[name]
        requests[name]["tokens"].append(int(rng.integers(1, 32_000)))  # the token this forward sampled


prompt = rng.integers(1, 32_000, size=10)
add_request("a", 0, prompt)
forward({"a": 10})                                      # a's prompt: blocks of 4, 4 and 2 tokens
add_request("b", 1, np.concatenate([prompt[:8], rng.integers(1, 32_000, size=3)]), shared_from="a",
            shared_blocks=2)                            # b's first 8 tokens hit the prefix cache
forward({"a": 1, "b": 3})                               # a decodes, b computes its last 3 prompt tokens
for _ in range(3):
    forward({"a": 1, "b": 1})
report = canary.poll()
print(f"after {report.forwards} forwards: {report.total} violation(s)")

# The bug: a's third block goes back on the free list while a still uses it, and request "c" gets it.
third = int(block_table[requests["a"]["row"], 2])
free_blocks.insert(0, third)
add_request("c", 2, rng.integers(1, 32_000, size=4))
forward({"c": 4})                                       # c's prompt overwrites a's positions 8-11
forward({"a": 1, "b": 1})                               # a reads its prefix: HEAD finds those slots c's
try:
    canary.poll()
except kc.CanaryViolation as caught:                    # an engine would abort or recompute request a
    report = caught.report
    print(f"after the bug: {report.total} violation(s), requests {sorted(report.requests)}")
    print("HEAD's rows, before the forward (TAIL's, after it, repeat them):")
    for event in report:
        if event.phase == "head":
            print(event.describe())
