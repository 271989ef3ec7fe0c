"""Random cases for differential runs of one backend against another (GPU against the CPU oracle).

Each ``make_*_case(rng, max_entries)`` returns a dict of host arrays describing one call, covering
valid engine traffic and the hostile corners: hash modes, 0–9 real-KV sources with strided rows and
page sizes, SWA LUTs, expected tokens, capacity and ring overflow, corruptions and out-of-range
indices. ``run_*`` executes a case on a device and returns every output as host arrays.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import _layout as L
from kvcanary_cupy.rawkernels import _loader

UNRESOLVED = L.UNRESOLVED_SLOT


LARGE_CASE = 100_000
# Lengths and offsets whose sums or differences overflow int64: totals must saturate and spans must
# stay exact, never wrap into a plan or row that seems to fit.
HUGE = np.array([1 << 62, L.INT64_MAX], np.int64)
HUGE_OFFSETS = np.array([-(1 << 63), -(1 << 62), 1 << 62, L.INT64_MAX], np.int64)
# Request lengths at the CUDA write's edges: one and two chunks (a chunk is the 32 entries a warp
# takes at a time), each less one, exactly and one more.
_CHUNK = _loader.SPECS["write"].constant("KVC_WRITE_CHUNK")
CHUNK_EDGES = np.array([k * _CHUNK + d for k in (1, 2) for d in (-1, 0, 1)], np.int64)


def _and_one_past(sizes) -> list:
    """Batch sizes at a kernel's bounds: each bound, and one past it."""
    return [size + d for size in sizes for d in (0, 1)]


def _one_huge(rng: np.random.Generator, values: np.ndarray, rate: float, choices: np.ndarray = HUGE) -> None:
    """In about ``rate`` of the cases, sets one cell of ``values`` (in place) to a value from ``choices``
    (per case, not per cell: a large batch would otherwise always overflow its plan)."""
    if len(values) and rng.random() < rate:
        values[rng.integers(0, len(values))] = rng.choice(choices)


def verify_total(pool_rows: np.ndarray, prefix: np.ndarray, swa: int) -> int:
    """The verify entries of a batch, exactly (Python ints: prefixes may add up past int64)."""
    return sum(p - (max(0, p - swa) if swa else 0)
               for rp, p in zip(pool_rows.tolist(), prefix.tolist()) if rp != 0 and p > 0)


def verify_entries(case: dict) -> int:
    """The entries a verify, plan or step case's verify checks: a verify's valid ones where its
    plan is enabled, a batch's prefixes otherwise."""
    if case["op"] == "verify":
        return min(max(case["num_valid"], 0), len(case["slot_indices"])) if case["enable"] else 0
    return verify_total(case["req_pool_indices"], case["prefix_lens"], case["swa_window_size"])


def first_drawn(make, rng: np.random.Generator, max_entries: int, wanted, tries: int, what: str) -> dict:
    """The first of up to ``tries`` cases ``make(rng, max_entries)`` draws that is ``wanted``."""
    for _ in range(tries):
        case = make(rng, max_entries)
        if wanted(case):
            return case
    raise AssertionError(f"no {what} in {tries} draws")


def verify_capacity_for(rng: np.random.Generator, total: int, margins: tuple) -> int:
    """A verify capacity at or near ``total`` (one that a plan can allocate when ``total`` is huge)."""
    if total > 1 << 40:
        return int(rng.integers(0, 64))
    return max(0, total + int(rng.choice(margins)))


def _log_uniform(rng: np.random.Generator, high: int) -> int:
    """A size up to ``high``: log-uniform from 1, or from ``high / 8`` when ``high`` is a large cap."""
    if high <= 0:
        return 0
    low = np.log(high / 8) if high >= LARGE_CASE else 0.0
    return int(np.exp(rng.uniform(low, np.log(high + 1))))


# Guard bands (the differential fuzz turns them on): every array a runner hands the package is then
# a view into a buffer of its own with GUARD_BYTES of a known pattern on either side, and
# guard_problems() names the arrays whose bands a backend overwrote. Without them a store one past an
# output's end lands in memory no comparison reads (CuPy's pool rounds allocations up).
GUARD_BYTES = 256
_GUARD_PATTERN = np.random.default_rng(0x6A12D).integers(0, 256, size=GUARD_BYTES, dtype=np.uint8)
_guarded: Optional[list] = None


def exact_allocations(device: str) -> None:
    """Every CuPy array an allocation of its exact size from now on (CuPy's memory pool off), so
    that compute-sanitizer's memcheck sees a read or store one past an array; nothing to do on the
    CPU."""
    if device != "cpu":
        import cupy  # noqa: PLC0415

        cupy.cuda.set_allocator(None)


def guard_arrays(on: bool) -> None:
    """Put the arrays the runners make from now on inside guard bands (or stop)."""
    global _guarded
    _guarded = [] if on else None


def guard_problems() -> list[str]:
    """The guarded arrays made since the last call whose bands changed (and forget them all)."""
    if not _guarded:
        return []
    problems = []
    for backing, device, shape, dtype in _guarded:
        bands = (_host(backing[:GUARD_BYTES]), _host(backing[-GUARD_BYTES:]))
        for side, band in zip(("before", "after"), bands):
            if not np.array_equal(band, _GUARD_PATTERN):
                problems.append(f"bytes {side} a {device} array of shape {shape} and dtype {dtype} were written")
    _guarded.clear()
    return problems


def _to(array: np.ndarray, device: str):
    if _guarded is None:
        if device == "cpu":
            return array.copy()
        import cupy  # noqa: PLC0415

        return cupy.asarray(array)
    array = np.ascontiguousarray(array)
    raw = np.concatenate([_GUARD_PATTERN, array.reshape(-1).view(np.uint8), _GUARD_PATTERN])
    if device != "cpu":
        import cupy  # noqa: PLC0415

        raw = cupy.asarray(raw)
    _guarded.append((raw, device, array.shape, array.dtype))
    return raw[GUARD_BYTES:GUARD_BYTES + array.nbytes].view(array.dtype).reshape(array.shape)


def _host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


# --- pools ---------------------------------------------------------------------------------------


# Pools up to this many slots may have sources of long tokens (up to 384 bytes): reads of 128 bytes
# and more take the kernels' batched folds (8 vectors of 16 bytes in flight, then the next 8), which
# the short reads of engines' smallest heads never reach.
LONG_READ_MAX_SLOTS = 1 << 15
DECODE_LANES = _loader.SPECS["write_decode"].constant("KVC_WRITE_DECODE_LANES")


def make_pool(rng: np.random.Generator, num_slots: int) -> dict:
    """A canary pool: random buffer stride, 0–9 real-KV sources (past 8, a decode write's group of
    lanes folds them in two rounds) of 16 to 64 bytes a token, in small pools sometimes up to 384,
    a hash mode and a ring size."""
    stride = int(rng.choice([32, 32, 40, 64]))
    sources = []
    count = int(rng.choice([0, 1, 1, 2, 3, 4, 6, 9]))
    # Now and then only a source past the decode write's first round of lanes is short, by a
    # quarter of its rows: its out-of-range rows are then that later round's alone to record.
    later_round_short = count > DECODE_LANES and rng.random() < 0.4
    for k in range(count):
        page = int(rng.choice([1, 1, 2, 3, 4, 16]))
        units = int(rng.integers(1, 5))
        if num_slots <= LONG_READ_MAX_SLOTS and rng.random() < 0.2:
            units = int(rng.choice([8, 9, 10, 16, 17, 24]))
        bytes_per_token = 16 * units
        read = 16 * int(rng.integers(1, units + 1))
        pad = 16 * int(rng.choice([0, 0, 1, 3]))
        if units >= 16 and rng.random() < 0.5:
            # a long read to the end of an unpadded row: the last row's read ends where its
            # allocation does, so a load past a fold's batches reads outside it
            read, pad = bytes_per_token, 0
        rows = (num_slots + page - 1) // page
        if later_round_short:
            if k == count - 1:
                rows -= max(1, rows // 4)
        elif rng.random() < 0.15:  # too few rows: the last slots read past the source
            rows = max(0, rows - int(rng.integers(1, 4)))
        data = rng.integers(0, 256, size=(rows, page * bytes_per_token + pad), dtype=np.uint8)
        sources.append({"data": data, "row_bytes": page * bytes_per_token, "page_size": page,
                        "num_bytes_per_token": bytes_per_token, "read_bytes": read})
    return {
        "num_slots": num_slots,
        "canary": rng.integers(0, 256, size=(num_slots, stride), dtype=np.uint8),
        "sources": sources,
        "hash_mode": int(rng.integers(0, 3)),
        "ring_capacity": int(rng.choice([0, 1, 4, 64, 4096])),
        "chain_position_assert": int(rng.integers(0, 2)),
    }


def build_context(pool: dict, device: str) -> kc.CanaryContext:
    sources = []
    for src in pool["sources"]:
        parent = _to(src["data"], device)
        sources.append(kc.RealKvSource(tensor=parent[:, : src["row_bytes"]], page_size=src["page_size"],
                                       num_bytes_per_token=src["num_bytes_per_token"], read_bytes=src["read_bytes"]))
    return kc.CanaryContext(
        canary_buf=_to(pool["canary"], device),
        violation_ring=_to(np.zeros((pool["ring_capacity"], 8), np.int64), device),
        violation_write_index=_to(np.zeros(1, np.int32), device),
        slot_run_counter=_to(np.zeros(1, np.int64), device),
        kernel_run_counter=_to(np.zeros(1, np.int64), device),
        chain_position_assert=_to(np.array([pool["chain_position_assert"]], np.int32), device),
        real_kv_sources=tuple(sources),
        hash_mode=kc.HashMode(pool["hash_mode"]),
    )


def _chains(rng: np.random.Generator, num_slots: int, total: int) -> list[np.ndarray]:
    """Requests' slot lists, distinct slots drawn from [1, num_slots)."""
    total = min(total, num_slots - 1)
    if total <= 0:
        return []
    slots = rng.permutation(num_slots - 1)[:total] + 1
    cuts = np.sort(rng.choice(np.arange(1, total), size=min(int(rng.integers(0, 8)), total - 1),
                              replace=False)) if total > 1 else np.array([], dtype=np.int64)
    return [np.asarray(c, dtype=np.int64) for c in np.split(slots, cuts)]


def _seed_valid_chains(pool: dict, chains: list[np.ndarray], rng: np.random.Generator) -> list[tuple]:
    """Write each chain with the CPU backend so most verify entries start out consistent."""
    ctx = build_context(pool, "cpu")
    entries = []
    for chain in chains:
        n = len(chain)
        ids = rng.integers(0, 150_000, size=n, dtype=np.int64)
        pos = np.arange(n, dtype=np.int64)
        plan = kc.WritePlan.from_host(offsets=[0, n], seed_slot_indices=[-1], num_valid_reqs=1)
        kc.write(ctx, plan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=ids, positions=pos, out_cache_loc=chain)
        entries.append((chain, ids, pos))
    pool["canary"] = ctx.canary_buf.copy()
    return entries


def _corrupt(pool: dict, rng: np.random.Generator, count: int) -> None:
    canary = pool["canary"]
    for _ in range(count):
        if pool["sources"] and rng.random() < 0.4:
            src = pool["sources"][int(rng.integers(0, len(pool["sources"])))]
            if src["data"].size:
                flat = src["data"].reshape(-1)
                flat[int(rng.integers(0, flat.size))] ^= np.uint8(1 << int(rng.integers(0, 8)))
        else:
            canary[int(rng.integers(0, canary.shape[0])), int(rng.integers(0, 32))] ^= np.uint8(
                1 << int(rng.integers(0, 8)))


# --- verify --------------------------------------------------------------------------------------


def make_verify_case(rng: np.random.Generator, max_entries: int) -> dict:
    entries = max(1, _log_uniform(rng, max_entries))
    num_slots = max(2, int(entries * rng.uniform(1.1, 3.0)) + 1)
    pool = make_pool(rng, num_slots)
    chains = _seed_valid_chains(pool, _chains(rng, num_slots, entries), rng)
    _corrupt(pool, rng, int(rng.integers(0, 6)))
    slots, tokens, positions, prevs = [], [], [], []
    for chain, ids, pos in chains:
        slots.append(chain)
        tokens.append(np.where(rng.random(len(chain)) < 0.1, -1, ids))
        positions.append(pos)
        prevs.append(np.concatenate([[-1], chain[:-1]]))
    flat = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (slots, tokens, positions, prevs)]
    slot_idx, exp_tok, exp_pos, prev_idx = (a.astype(np.int64) for a in flat)
    n = len(slot_idx)
    if n:
        hostile = rng.random(n) < rng.choice([0.0, 0.01, 0.1])
        slot_idx[hostile] = rng.choice([0, -1, -5, num_slots, num_slots + 7, UNRESOLVED], size=int(hostile.sum()))
        hostile = rng.random(n) < rng.choice([0.0, 0.01, 0.1])
        prev_idx[hostile] = rng.choice([0, -1, -3, num_slots, UNRESOLVED], size=int(hostile.sum()))
        wrong = rng.random(n) < 0.02
        exp_tok[wrong] += 1
        exp_pos[rng.random(n) < 0.02] += 3
    capacity = n + int(rng.choice([0, 0, 3]))
    pad = capacity - n
    filler = rng.integers(-2, num_slots + 2, size=pad)
    return {
        "op": "verify",
        "pool": pool,
        "slot_indices": np.concatenate([slot_idx, filler]).astype(np.int64),
        "expected_tokens": np.concatenate([exp_tok, filler]).astype(np.int64),
        "expected_positions": np.concatenate([exp_pos, filler]).astype(np.int64),
        "prev_slot_indices": np.concatenate([prev_idx, filler]).astype(np.int64),
        "num_valid": int(rng.choice([n, n, n, capacity + 5, -1, max(0, n // 2)])),
        "enable": int(rng.random() < 0.95),
        "check_expected_token": bool(rng.integers(0, 2)),
        "tag": int(rng.integers(0, 12)),
    }


def run_verify(case: dict, device: str) -> dict:
    ctx = build_context(case["pool"], device)
    vplan = kc.VerifyPlan(**{k: _to(case[k], device) for k in ("slot_indices", "expected_tokens",
                                                                "expected_positions", "prev_slot_indices")},
                          num_valid=_to(np.array([case["num_valid"]], np.int32), device),
                          enable=_to(np.array([case["enable"]], np.int32), device))
    kc.verify(ctx, vplan, tag=case["tag"], check_expected_token=case["check_expected_token"])
    return _context_outputs(ctx)


# --- write ---------------------------------------------------------------------------------------


def make_write_case(rng: np.random.Generator, max_entries: int) -> dict:
    entries = max(1, _log_uniform(rng, max_entries))
    num_requests = int(rng.integers(1, 9))
    # Now and then (in large cases, half the time) more requests than the write kernels' grids have
    # blocks: requests share a block's warps, and a warp (or pair of warps) chains several.
    if rng.random() < (0.5 if max_entries >= LARGE_CASE else 0.1):
        num_requests = int(rng.choice([40, 300, 1500, 6000]))
    num_slots = max(4, int(entries * rng.uniform(1.2, 3.0)) + 8) + num_requests
    pool = make_pool(rng, num_slots)
    # Seeds come from a prefix written earlier; new entries never write a seed slot, and no slot is
    # written by two requests (the engine never does either; on a GPU both would race).
    permuted = rng.permutation(num_slots - 1) + 1
    prefix_slots = permuted[:num_requests]
    fresh = permuted[num_requests:num_requests + entries]
    prefix_ctx = build_context(pool, "cpu")
    ids = rng.integers(0, 150_000, size=num_requests, dtype=np.int64)
    pos = rng.integers(0, 5000, size=num_requests, dtype=np.int64)
    plan = kc.WritePlan.from_host(offsets=np.arange(num_requests + 1), seed_slot_indices=np.full(num_requests, -1),
                                  num_valid_reqs=num_requests)
    kc.write(prefix_ctx, plan, tag=0, input_ids=ids, positions=pos, out_cache_loc=prefix_slots)
    pool["canary"] = prefix_ctx.canary_buf.copy()
    n = len(fresh)
    cuts = np.sort(rng.integers(0, n + 1, size=num_requests - 1))
    if rng.random() < 0.15:
        # requests of lengths at the write kernels' edges (a request of at most a chunk hashes its
        # sources in its warp, a longer one across the grid), which uniform cuts rarely give; the
        # last request takes the rest
        cuts = np.minimum(np.cumsum(rng.choice(CHUNK_EDGES, size=num_requests - 1)), n)
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    seeds = np.where(rng.random(num_requests) < 0.7, prefix_slots, -1).astype(np.int64)
    past_pool = rng.random(num_requests) < 0.05  # the first index past the pool among them
    seeds[past_pool] = rng.choice([num_slots, num_slots, num_slots + 3, UNRESOLVED], size=int(past_pool.sum()))
    seeds[rng.random(num_requests) < 0.05] = -7
    seeds[rng.random(num_requests) < 0.03] = 0  # the padding slot (an SWA predecessor's LUT cell): read, not written
    locs = fresh.astype(np.int64)
    # A repeated slot inside one request (its last entry wins), placed once the spans are final: a
    # span cut later would otherwise leave the two entries in two requests, which race on a GPU.
    repeating = int(rng.integers(0, num_requests)) if n and rng.random() < 0.3 else None
    hostile = rng.random(n) < rng.choice([0.0, 0.02, 0.1])
    locs[hostile] = rng.choice([-1, -9, num_slots, num_slots + 100, UNRESOLVED], size=int(hostile.sum()))
    input_ids = rng.integers(0, 150_000, size=n, dtype=np.int64)
    positions = np.empty(n, dtype=np.int64)
    for r in range(num_requests):
        b, e = offsets[r], offsets[r + 1]
        start = pos[r] + 1 if seeds[r] == prefix_slots[r] else 0
        positions[b:e] = np.arange(start, start + (e - b))
    positions[rng.random(n) < 0.02] += 2
    with_assert = rng.random() < 0.5
    expected_tokens = np.where(rng.random(n) < 0.03, input_ids + 1, input_ids) if with_assert else None
    expected_positions = np.where(rng.random(n) < 0.03, positions - 1, positions) if with_assert else None
    if rng.random() < 0.05 and n:  # offsets past the entry arrays
        offsets[-1] = n + int(rng.integers(1, 10))
        if rng.random() < 0.5:
            # the cut span at a chunk edge: which of a team's warps walked its last chunk, and so
            # records the row for its end, turns on the count of chunks
            offsets[:-1] = np.minimum(offsets[:-1], max(0, n - int(rng.choice(CHUNK_EDGES))))
    if rng.random() < 0.03:  # spans past int64, at the ends only: two requests covering one entry race on a GPU
        if rng.random() < 0.5:
            offsets[0] = rng.choice(HUGE_OFFSETS[:2])  # the first request begins before the entries
        if rng.random() < 0.7:
            offsets[-1] = rng.choice(HUGE_OFFSETS[2:])  # the last one runs past them
    if repeating is not None:
        first, last = max(int(offsets[repeating]), 0), min(int(offsets[repeating + 1]), n) - 1
        if last > first:
            locs[last] = locs[first]
    if rng.random() < 0.1:
        write_padding_slot(rng, locs, set(seeds.tolist()))
    if num_requests > 1 and rng.random() < 0.1:
        # The requests in the reverse order of their entries, each followed by an empty request (its
        # begin past its end): spans out of order, none overlapping another (the request that may
        # begin before the entries comes last, the one that may run past them first). A write plan
        # need not come from kc.plan, and a kernel that reads a request's span early must read the
        # right one.
        spans = [(offsets[r], offsets[r + 1], seeds[r]) for r in range(num_requests)][::-1]
        offsets = np.array([bound for b, e, _ in spans for bound in (b, e)], np.int64)
        seeds = np.array([seed for _, _, s in spans for seed in (s, -1)][:-1], np.int64)
        num_requests = len(seeds)
    capacity = num_requests + int(rng.choice([0, 0, 2]))
    full_offsets = np.concatenate([offsets, np.full(capacity - num_requests, offsets[-1])]).astype(np.int64)
    full_seeds = np.concatenate([seeds, np.full(capacity - num_requests, -1)]).astype(np.int64)
    return {
        "op": "write",
        "pool": pool,
        "offsets": full_offsets,
        "seed_slot_indices": full_seeds,
        "num_valid_reqs": int(rng.choice([num_requests, num_requests, capacity + 3, -2, max(0, num_requests - 1)])),
        "input_ids": input_ids,
        "positions": positions,
        "out_cache_loc": locs,
        "expected_input_tokens": expected_tokens,
        "expected_input_positions": expected_positions,
        "tag": int(rng.integers(0, 12)),
    }


def run_write(case: dict, device: str) -> dict:
    ctx = build_context(case["pool"], device)
    wplan = kc.WritePlan(offsets=_to(case["offsets"], device), seed_slot_indices=_to(case["seed_slot_indices"], device),
                         num_valid_reqs=_to(np.array([case["num_valid_reqs"]], np.int32), device))
    optional = {k: None if case[k] is None else _to(case[k], device)
                for k in ("expected_input_tokens", "expected_input_positions")}
    kc.write(ctx, wplan, tag=case["tag"], input_ids=_to(case["input_ids"], device),
             positions=_to(case["positions"], device), out_cache_loc=_to(case["out_cache_loc"], device), **optional)
    return _context_outputs(ctx)


def _context_outputs(ctx: kc.CanaryContext) -> dict:
    return {
        "canary": _host(ctx.canary_buf).copy(),
        "ring": _host(ctx.violation_ring).copy(),
        "write_index": int(_host(ctx.violation_write_index)[0]),
        "slot_run_counter": int(_host(ctx.slot_run_counter)[0]),
        "kernel_run_counter": int(_host(ctx.kernel_run_counter)[0]),
    }


def _past_the_table(rng: np.random.Generator, pool_rows: np.ndarray, rows: int, share: float, further: int) -> None:
    """About ``share`` of the requests get a pool row past a table of ``rows`` rows: its first row
    past the end, where a bound one off reads a row that is not the table's, or ``further`` rows
    beyond it."""
    past = rng.random(len(pool_rows)) < share
    pool_rows[past] = rows + further * rng.integers(0, 2, size=int(past.sum()))


# --- plan ----------------------------------------------------------------------------------------


def make_plan_case(rng: np.random.Generator, max_entries: int) -> dict:
    bs = int(rng.choice([0, 1, 2, 7, 32, *_and_one_past(_loader.PLAN_TILES), 3000]))  # a tile, and one past
    target = max(1, _log_uniform(rng, max_entries))
    per_request = max(1, target // max(bs, 1))
    width = per_request + int(rng.integers(1, 16))
    rows = bs + int(rng.integers(1, 5))
    req_to_token = rng.integers(-2, 5 * width * rows // 4 + 8, size=(rows, width), dtype=np.int64).astype(np.int32)
    req_to_token[rng.random(req_to_token.shape) < 0.01] = 0  # the padding slot, which the LUT maps too
    if rng.random() < 0.3:  # strided rows (a slice of a wider table)
        req_to_token = np.concatenate([req_to_token, np.zeros((rows, 3), np.int32)], axis=1)[:, :width]
    pool_rows = rng.integers(0, rows, size=bs)
    _past_the_table(rng, pool_rows, rows, 0.03, further=2)
    pool_rows[rng.random(bs) < 0.02] = -1
    prefix = rng.integers(0, per_request + 1, size=bs)
    prefix[rng.random(bs) < 0.02] = width + 5
    prefix[rng.random(bs) < 0.02] = -3
    _one_huge(rng, prefix, 0.05)
    extend = rng.integers(-1, 5, size=bs)
    _one_huge(rng, extend, 0.05)
    swa = int(rng.choice([0, 0, 0, 1, 4, 128]))
    lut = None
    if swa:
        lut = rng.integers(-1, 1 << 20, size=int(req_to_token.max(initial=0)) + 1 - int(rng.integers(0, 3)))
    expected = None
    valid = None
    if rng.random() < 0.5:
        expected = rng.integers(0, 150_000, size=(rows, width + int(rng.integers(-2, 3))), dtype=np.int64).astype(
            np.int32)
        valid = rng.integers(-1, width + 3, size=bs)
    total = verify_total(pool_rows, prefix, swa)
    capacity = verify_capacity_for(rng, total, (0, 0, 5, -1, -total))
    return {
        "op": "plan",
        "verify_capacity": capacity,
        "write_req_capacity": bs + int(rng.choice([0, 1, 9])),
        "req_pool_indices": pool_rows.astype(np.int64),
        "prefix_lens": prefix.astype(np.int64),
        "extend_seq_lens": extend.astype(np.int64),
        "req_to_token": req_to_token,
        "swa_window_size": swa,
        "full_to_swa_index_mapping": None if lut is None else lut.astype(np.int64),
        "req_to_verify_expected_tokens": expected,
        "req_to_verify_expected_tokens_valid_lens": None if valid is None else valid.astype(np.int64),
        "kv_token_id_vs_position_offset": int(rng.integers(0, 2)),
    }


def run_plan(case: dict, device: str) -> dict:
    sentinel = np.int64(-0x5A5A5A5A)
    vplan = kc.VerifyPlan(*(_to(np.full(case["verify_capacity"], sentinel, np.int64), device) for _ in range(4)),
                          num_valid=_to(np.full(1, 77, np.int32), device), enable=_to(np.full(1, 77, np.int32), device))
    wcap = case["write_req_capacity"]
    wplan = kc.WritePlan(offsets=_to(np.full(wcap + 1, sentinel, np.int64), device),
                         seed_slot_indices=_to(np.full(wcap, sentinel, np.int64), device),
                         num_valid_reqs=_to(np.full(1, 77, np.int32), device))
    arrays = {k: (None if case[k] is None else _to(case[k], device)) for k in (
        "req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token", "full_to_swa_index_mapping",
        "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens")}
    kc.plan(vplan, wplan, swa_window_size=case["swa_window_size"],
            kv_token_id_vs_position_offset=case["kv_token_id_vs_position_offset"], **arrays)
    out = {name: _host(getattr(vplan, name)).copy() for name in (
        "slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices", "num_valid", "enable")}
    out.update({name: _host(getattr(wplan, name)).copy() for name in ("offsets", "seed_slot_indices",
                                                                         "num_valid_reqs")})
    return out


# --- scatter -------------------------------------------------------------------------------------


def make_scatter_case(rng: np.random.Generator, max_entries: int) -> dict:
    bs = int(rng.choice([0, 1, 3, 64, 512]))
    n = _log_uniform(rng, max_entries)
    rows = bs + int(rng.integers(1, 4))
    width = int(rng.integers(1, max(2, 2 * n // max(bs, 1) + 2)))
    cuts = np.sort(rng.integers(0, n + 1, size=max(bs - 1, 0)))
    offsets = np.concatenate([[0], cuts, [n]])[: bs + 1] if bs else np.zeros(1, np.int64)
    hostile = rng.random(len(offsets)) < 0.03
    offsets[hostile] += rng.integers(-5, 20, size=int(hostile.sum()))
    _one_huge(rng, offsets, 0.05, HUGE_OFFSETS)
    pool_rows = rng.permutation(rows)[:bs] if bs <= rows else rng.integers(0, rows, size=bs)
    if rng.random() < 0.2:  # rows named by several requests: a later one's columns win
        pool_rows = rng.integers(0, max(1, int(rng.choice([1, 2, rows]))), size=bs)
    pool_rows = pool_rows.astype(np.int64)
    _past_the_table(rng, pool_rows, rows, 0.03, further=1)
    return {
        "op": "scatter",
        "flat_in": rng.integers(-(1 << 40), 1 << 40, size=n, dtype=np.int64),
        "offsets": offsets.astype(np.int64),
        "req_pool_indices": pool_rows,
        "pool_out": rng.integers(-5, 5, size=(rows, width), dtype=np.int64).astype(np.int32),
    }


def run_scatter(case: dict, device: str) -> dict:
    pool_out = _to(case["pool_out"], device)
    kc.scatter_req_token_ids(flat_in=_to(case["flat_in"], device), offsets=_to(case["offsets"], device),
                             req_pool_indices=_to(case["req_pool_indices"], device), pool_out=pool_out)
    return {"pool_out": _host(pool_out).copy()}


# --- step ----------------------------------------------------------------------------------------


def through_lut(lut: Optional[np.ndarray], slot: int) -> int:
    """A req_to_token cell as plan resolves it: through the LUT when there is one (negative cells
    pass; cells past the LUT are unresolved)."""
    if lut is None or slot < 0:
        return int(slot)
    return int(lut[slot]) if slot < len(lut) else UNRESOLVED


def live_seed_cells(pool_rows: np.ndarray, prefix: np.ndarray, req_to_token: np.ndarray) -> list:
    """The (pool row, column) of the cell each live request of a step chains from: its prefix's last."""
    rows, width = req_to_token.shape
    return [(int(rp), int(p) - 1) for rp, p in zip(pool_rows, prefix) if 0 < rp < rows and 0 < p <= width]


def seed_slots(pool_rows: np.ndarray, prefix: np.ndarray, req_to_token: np.ndarray,
               lut: Optional[np.ndarray]) -> set:
    """The slots a step's requests chain their new tokens from: a GPU write into one of them races
    with the request that reads it as its seed."""
    return {through_lut(lut, int(req_to_token[cell])) for cell in live_seed_cells(pool_rows, prefix, req_to_token)}


def seed_cells(case: dict) -> list:
    """The live seed cells of a step case that resolve, through the LUT if there is one, to a slot."""
    req_to_token, lut = case["req_to_token"], case["full_to_swa_index_mapping"]
    return [cell for cell in live_seed_cells(case["req_pool_indices"], case["prefix_lens"], req_to_token)
            if through_lut(lut, int(req_to_token[cell])) >= 0]


def seed_past_the_pool(case: dict, cells: list) -> None:
    """Makes each seed cell resolve to ``num_slots``, the first slot past the pool: the write then
    chains from no slot, and a kernel that loaded the seed's words would read past the canary
    buffer (under exact allocations, outside its allocation)."""
    req_to_token, lut = case["req_to_token"], case["full_to_swa_index_mapping"]
    past = case["pool"]["num_slots"]
    for cell in cells:
        if lut is None:
            req_to_token[cell] = past
        else:
            lut[int(req_to_token[cell])] = past


def pad_prefix_cells(rng: np.random.Generator, pool_rows: np.ndarray, prefix: np.ndarray,
                     req_to_token: np.ndarray) -> int:
    """Puts the padding slot in one cell before the last of about half the live prefixes, which
    verify skips (SPEC §3.2); the last cell, a request's seed, is left as it was. Returns how many."""
    rows, width = req_to_token.shape
    padded = 0
    for rp, p in zip(pool_rows, prefix):
        if 0 < rp < rows and 2 <= p <= width and rng.random() < 0.5:
            req_to_token[rp, int(rng.integers(0, p - 1))] = L.PADDING_SLOT
            padded += 1
    return padded


def write_padding_slot(rng: np.random.Generator, out_cache_loc: np.ndarray, seeds: set) -> bool:
    """Sends one new token of a write or step case to the padding slot, as an engine whose allocator
    handed out slot 0 would: the write stores it like any other slot (SPEC §3.1 skips only negative
    ones) and verify never reads it. Not where slot 0 is a request's seed (on a GPU the seed's read
    races the store). Returns whether a token now writes slot 0."""
    if L.PADDING_SLOT in seeds:
        return False
    if (out_cache_loc == L.PADDING_SLOT).any():
        return True
    writes = np.flatnonzero(out_cache_loc >= 0)
    if not writes.size:
        return False
    out_cache_loc[int(rng.choice(writes))] = L.PADDING_SLOT
    return True


def make_step_case(rng: np.random.Generator, max_entries: int) -> dict:
    """An engine batch with chained prefixes (some corrupted) and new tokens, decode-shaped more often
    than not; hostile corners as in the plan and write cases. New tokens never write a seed slot and
    no slot twice (on a GPU those race), but may overwrite another request's prefix slot. A few
    cases have up to four seeds one past the pool (``seed_past_the_pool``)."""
    bs = int(rng.choice([0, 1, 2, 7, 32, 256, 1024, 1500]))
    target = max(1, _log_uniform(rng, max_entries))
    per_request = max(1, target // max(bs, 1))
    decode = rng.random() < 0.6
    prefix = rng.integers(0, per_request + 1, size=bs)
    extend = np.ones(bs, np.int64) if decode else rng.integers(-1, 6, size=bs)
    width = int(per_request + 8)
    rows = bs + int(rng.integers(1, 4))
    pool_rows = (rng.permutation(rows - 1) + 1)[:bs] if bs <= rows - 1 else rng.integers(1, rows, size=bs)
    pool_rows = pool_rows.astype(np.int64)
    pool_rows[rng.random(bs) < 0.05] = 0                 # padding requests
    _past_the_table(rng, pool_rows, rows, 0.01, further=2)
    cells = int(rows * width)
    num_slots = max(8, int(cells * rng.uniform(1.05, 1.5)) + 8)
    pool = make_pool(rng, num_slots)
    req_to_token = ((rng.permutation(num_slots - 1)[:cells] + 1).reshape(rows, width)).astype(np.int32)
    if rng.random() < 0.1:
        req_to_token[rng.random((rows, width)) < 0.01] = -1
    swa = int(rng.choice([0, 0, 0, 1, 4, 128]))
    lut = None
    if swa:  # a permutation of the pool (the SWA pool has as many slots), a few unmapped
        lut = (rng.permutation(num_slots)).astype(np.int64)
        lut[rng.random(num_slots) < 0.01] = -1
        lut = lut[: num_slots - int(rng.integers(0, 3))]

    def tr(slot: int) -> int:
        return through_lut(lut, slot)

    # chain every live prefix on the CPU, so most verify entries start out consistent
    ctx = build_context(pool, "cpu")
    tokens = rng.integers(0, 150_000, size=(rows, width), dtype=np.int64)
    for r in range(bs):
        rp, p = int(pool_rows[r]), int(prefix[r])
        if rp <= 0 or rp >= rows or p <= 0:
            continue
        loc = np.array([tr(int(s)) for s in req_to_token[rp, :p]], np.int64)
        loc[(loc < 0) | (loc >= num_slots)] = -1
        plan = kc.WritePlan.from_host(offsets=[0, p], seed_slot_indices=[-1], num_valid_reqs=1)
        kc.write(ctx, plan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=tokens[rp, :p].copy(),
                 positions=np.arange(p, dtype=np.int64), out_cache_loc=loc)
    pool["canary"] = ctx.canary_buf.copy()
    _corrupt(pool, rng, int(rng.choice([0, 0, 1, 5])))
    prefix[rng.random(bs) < 0.01] = width + 5            # past the table's width
    prefix[rng.random(bs) < 0.01] = -3
    _one_huge(rng, prefix, 0.03)

    seeds = seed_slots(pool_rows, prefix, req_to_token, lut)
    ids, positions, locs = [], [], []
    for r in range(bs):
        rp, p, e = int(pool_rows[r]), int(prefix[r]), int(extend[r])
        if rp == 0 or e <= 0:
            continue
        for j in range(e):
            pos = min(max(p, 0), L.INT64_MAX - e) + j
            slot = tr(int(req_to_token[rp, pos])) if 0 < rp < rows and pos < width else -1
            locs.append(slot)
            ids.append(int(rng.integers(0, 150_000)))
            positions.append(pos)
    n = len(ids)
    locs = np.array(locs, np.int64)
    fresh = rng.permutation(num_slots - 1) + 1
    taken = set(seeds)
    for i in range(n):  # no seed slot is written, and no slot twice
        if locs[i] in taken or (locs[i] >= 0 and rng.random() < 0.02):
            locs[i] = next(int(s) for s in fresh if int(s) not in taken)
        if locs[i] >= 0:
            taken.add(int(locs[i]))
    hostile = rng.random(n) < rng.choice([0.0, 0.01, 0.05])
    locs[hostile] = rng.choice([-1, num_slots, num_slots + 100, UNRESOLVED], size=int(hostile.sum()))
    input_ids = np.array(ids, np.int64)
    positions = np.array(positions, np.int64)
    positions[rng.random(n) < 0.02] += 2
    if n and rng.random() < 0.05:  # fewer entries than the extends add up to
        keep = n - int(rng.integers(1, min(n, 3) + 1))
        input_ids, positions, locs = input_ids[:keep], positions[:keep], locs[:keep]
        n = keep
    with_assert = rng.random() < 0.3
    expected = valid = None
    if rng.random() < 0.5:
        expected = np.where(rng.random(tokens.shape) < 0.01, tokens + 1, tokens).astype(np.int32)
        valid = rng.integers(-1, width + 3, size=bs).astype(np.int64)
    if not swa and rng.random() < 0.1:  # after the new tokens' slots are drawn, none of them slot 0
        pad_prefix_cells(rng, pool_rows, prefix, req_to_token)
    if rng.random() < 0.1:  # after the prefix cells, whose padding may make slot 0 a seed
        write_padding_slot(rng, locs, seed_slots(pool_rows, prefix, req_to_token, lut))
    total = verify_total(pool_rows, prefix, swa)
    case = {
        "op": "step",
        "pool": pool,
        "verify_capacity": verify_capacity_for(rng, total, (0, 0, 5, 1000, -1, -total)),
        "verify_tag": int(rng.integers(0, 12)),
        "write_tag": int(rng.integers(0, 12)),
        "check_expected_token": bool(rng.random() < 0.5),
        "req_pool_indices": pool_rows,
        "prefix_lens": prefix.astype(np.int64),
        "extend_seq_lens": extend.astype(np.int64),
        "req_to_token": req_to_token,
        "swa_window_size": swa,
        "full_to_swa_index_mapping": lut,
        "req_to_verify_expected_tokens": expected,
        "req_to_verify_expected_tokens_valid_lens": valid,
        "kv_token_id_vs_position_offset": int(rng.integers(0, 2)),
        "input_ids": input_ids,
        "positions": positions,
        "out_cache_loc": locs,
        "expected_input_tokens": np.where(rng.random(n) < 0.03, input_ids + 1, input_ids) if with_assert else None,
        "expected_input_positions": np.where(rng.random(n) < 0.03, positions - 1, positions) if with_assert else None,
    }
    if rng.random() < 0.03:  # as in memcheck's step case: the seed's words are not to be read
        cells = seed_cells(case)
        seed_past_the_pool(case, [cells[i] for i in rng.permutation(len(cells))[:4]])
    return case


STEP_ARRAYS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token", "full_to_swa_index_mapping",
               "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens", "input_ids", "positions",
               "out_cache_loc", "expected_input_tokens", "expected_input_positions")
STEP_SETTINGS = ("verify_capacity", "verify_tag", "write_tag", "check_expected_token", "swa_window_size",
                 "kv_token_id_vs_position_offset")


def run_step(case: dict, device: str, launches: int = 1) -> dict:
    ctx = build_context(case["pool"], device)
    arrays = {k: (None if case[k] is None else _to(case[k], device)) for k in STEP_ARRAYS}
    step = kc.CanaryStep(ctx, **arrays, **{k: case[k] for k in STEP_SETTINGS})
    for _ in range(launches):
        step.launch()
    return _context_outputs(ctx)


def run_step_unfused(case: dict, device: str, launches: int = 1) -> dict:
    """The same step as kc.plan, kc.verify and kc.write on their own, ``launches`` times over one
    context (as :func:`run_step` launches a step)."""
    ctx = build_context(case["pool"], device)
    a = {k: (None if case[k] is None else _to(case[k], device)) for k in STEP_ARRAYS}
    bs = len(case["req_pool_indices"])
    vplan = kc.VerifyPlan.allocate(case["verify_capacity"], device=device)
    wplan = kc.WritePlan.allocate(bs, device=device)
    for _ in range(launches):
        kc.plan(vplan, wplan, req_pool_indices=a["req_pool_indices"], prefix_lens=a["prefix_lens"],
                extend_seq_lens=a["extend_seq_lens"], req_to_token=a["req_to_token"],
                swa_window_size=case["swa_window_size"], full_to_swa_index_mapping=a["full_to_swa_index_mapping"],
                req_to_verify_expected_tokens=a["req_to_verify_expected_tokens"],
                req_to_verify_expected_tokens_valid_lens=a["req_to_verify_expected_tokens_valid_lens"],
                kv_token_id_vs_position_offset=case["kv_token_id_vs_position_offset"])
        kc.verify(ctx, vplan, tag=case["verify_tag"], check_expected_token=case["check_expected_token"])
        kc.write(ctx, wplan, tag=case["write_tag"], input_ids=a["input_ids"], positions=a["positions"],
                 out_cache_loc=a["out_cache_loc"], expected_input_tokens=a["expected_input_tokens"],
                 expected_input_positions=a["expected_input_positions"])
    return _context_outputs(ctx)


# --- copy_records ----------------------------------------------------------------------------------


def make_records_case(rng: np.random.Generator, max_entries: int) -> dict:
    """Records carried between two canaries (random bytes, random slot strides) or within one, on
    one device or across the device and the host: source slots in range but a few (negative, past
    the pool, huge), destination slots distinct (a GPU leaves a slot named twice undefined)."""
    n = _log_uniform(rng, max_entries)
    src_slots_count = int(rng.integers(1, 2 * n + 2))
    dst_slots_count = n + int(rng.integers(1, n + 2))
    where = str(rng.choice(["apart", "apart", "one", "to_host", "from_host"]))
    if where == "one":
        dst_slots_count = src_slots_count = max(src_slots_count, dst_slots_count)
    src_slots = rng.integers(0, src_slots_count, size=n)
    if rng.random() < 0.5:  # the last record, whose words end where the canary buffer does
        src_slots[rng.integers(0, n)] = src_slots_count - 1
    dst_slots = rng.permutation(dst_slots_count)[:n] - int(rng.integers(0, 3))  # a few below 0
    for slots, count in ((src_slots, src_slots_count), (dst_slots, dst_slots_count)):
        hostile = rng.random(n) < 0.02
        slots[hostile] = rng.choice([-1, count, count + 7, 1 << 62], size=int(hostile.sum()))
    stride = lambda: int(rng.choice([32, 40, 64, 136]))  # noqa: E731
    src_stride = stride()
    return {
        "op": "records", "where": where,
        "src": rng.integers(0, 256, size=(src_slots_count, src_stride), dtype=np.uint8),
        "dst": rng.integers(0, 256, size=(dst_slots_count, src_stride if where == "one" else stride()), dtype=np.uint8),
        "src_slots": src_slots.astype(np.int64), "dst_slots": dst_slots.astype(np.int64),
    }


def run_records(case: dict, device: str) -> dict:
    where = case["where"]
    src_device = "cpu" if where == "from_host" else device
    dst_device = "cpu" if where == "to_host" else device
    src = build_context(dict(_RECORDS_POOL, num_slots=case["src"].shape[0], canary=case["src"]), src_device)
    dst = src if where == "one" else build_context(
        dict(_RECORDS_POOL, num_slots=case["dst"].shape[0], canary=case["dst"]), dst_device)
    kc.copy_records(src=src, dst=dst, src_slots=_to(case["src_slots"], src_device),
                    dst_slots=_to(case["dst_slots"], dst_device))
    return {"src": _host(src.canary_buf).copy(), "dst": _host(dst.canary_buf).copy()}


_RECORDS_POOL = {"sources": [], "hash_mode": 0, "ring_capacity": 0, "chain_position_assert": 0}


def memcheck_cases(op: str, rng: np.random.Generator) -> list:
    """Cases for compute-sanitizer's memcheck, which random draws reach too rarely: shapes where a
    kernel that read one element past an input would still give every output right, so only
    memcheck (every array an allocation of its own size) can tell. The write: a full plan of at
    least 256 requests (a block's threads each take requests 256 apart, up to the plan's last) with
    real-KV sources and more entries than requests (the warp forms). The scatter: every request
    names one pool row, more later writers than the kernel remembers (64), the first request longer
    than every later one so that its look-up for its last columns runs to the batch's last request;
    and long rows of a pool row each, the last running to the input's end.
    The step: a batch that the step kernel's block 0 writes (decode-shaped, past the tail write's
    bound), fewer requests than the block's threads, whose write plan holds exactly the batch, and
    whose first live requests chain from a seed one past the pool (the slot's words are not read)."""
    if op == "write":
        def full_plan_with_sources(case: dict) -> bool:
            capacity = len(case["offsets"]) - 1
            requests = min(max(case["num_valid_reqs"], 0), capacity)
            return (requests == capacity >= 256 and len(case["input_ids"]) > capacity and bool(case["pool"]["sources"])
                    and case["pool"]["hash_mode"] != int(kc.HashMode.NONE))

        return [first_drawn(make_write_case, rng, 20_000, full_plan_with_sources, 4000,
                            "full write plan of 256 or more requests with sources")]
    if op == "scatter":
        # The first request's columns past every later request's are covered by none of them, so
        # its look-up of later writers walks the batch to its end for each of them.
        bs, width, later_longest = 512, 96, 8
        lengths = np.concatenate([[width], rng.integers(1, later_longest + 1, size=bs - 1)])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        n = int(offsets[-1])
        later_writers = {"op": "scatter", "flat_in": rng.integers(-(1 << 40), 1 << 40, size=n, dtype=np.int64),
                         "offsets": offsets,
                         "req_pool_indices": np.zeros(bs, np.int64),
                         "pool_out": rng.integers(-5, 5, size=(2, width), dtype=np.int64).astype(np.int32)}
        # Long rows (the kernel's kLongRows form), a pool row each, every one shorter than the eight
        # strides it reads ahead, the last running to flat_in's end: reads past a row's end stop
        # there, or the last row's would read past the array.
        from kvcanary_cupy.ops.backends._cuda.scatter import _BLOCK as SCATTER_THREADS

        lengths = rng.integers(2 * SCATTER_THREADS, 8 * SCATTER_THREADS, size=3)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        n = int(offsets[-1])
        long_rows = {"op": "scatter", "flat_in": rng.integers(-(1 << 40), 1 << 40, size=n, dtype=np.int64),
                     "offsets": offsets,
                     "req_pool_indices": rng.permutation(3).astype(np.int64),
                     "pool_out": rng.integers(-5, 5, size=(3, int(lengths.max()) + 3), dtype=np.int64).astype(np.int32)}
        return [later_writers, long_rows]
    if op == "step":
        from kvcanary_cupy.ops.backends._cuda.step import _BLOCK, plan_block_write, tail_write

        def block_0_writes_with_threads_to_spare(case: dict) -> bool:
            bs, n = len(case["req_pool_indices"]), len(case["input_ids"])
            return (plan_block_write(bs, n) and not tail_write(bs, n) and bs < _BLOCK
                    and len(seed_cells(case)) > 0)

        step = first_drawn(make_step_case, rng, 20_000, block_0_writes_with_threads_to_spare, 4000,
                           "step whose kernel's block 0 writes with threads past the batch")
        seed_past_the_pool(step, seed_cells(step)[:4])
        return [step]
    return []


MAKERS = {"verify": make_verify_case, "write": make_write_case, "plan": make_plan_case, "scatter": make_scatter_case,
          "step": make_step_case, "records": make_records_case}
RUNNERS = {"verify": run_verify, "write": run_write, "plan": run_plan, "scatter": run_scatter, "step": run_step,
           "records": run_records}


RING_OPS = ("verify", "write", "step")  # the ops that record violations


def ring_overflowed(outputs: dict) -> bool:
    """Whether a launch recorded more violation rows than its ring keeps."""
    return outputs["write_index"] > outputs["ring"].shape[0]


def compare(op: str, case: dict, oracle: dict, other: dict) -> list[str]:
    """Differences between two backends' outputs (ring rows compared as a multiset, their tags in order)."""
    problems = []
    if op in RING_OPS:
        for key in ("canary", "write_index", "slot_run_counter", "kernel_run_counter"):
            if not np.array_equal(np.asarray(oracle[key]), np.asarray(other[key])):
                problems.append(key)
        kept = min(max(oracle["write_index"], 0), oracle["ring"].shape[0])
        if not ring_overflowed(oracle):
            if Counter(map(tuple, oracle["ring"][:kept].tolist())) != Counter(map(tuple, other["ring"][:kept].tolist())):
                problems.append("ring rows")
        if not np.array_equal(oracle["ring"][kept:], other["ring"][kept:]):
            problems.append("ring rows past the write index")
        # One launch's rows may come in any order, but a step's write records nothing before its
        # verify has finished (a launch after it, or the kernel's wait for every verify block): so the
        # tags down the ring are the oracle's, and an overflowing ring keeps the verify's rows first.
        kinds = slice(0, kept), L.RING_COL_KERNEL_KIND
        if not np.array_equal(oracle["ring"][kinds], other["ring"][kinds]):
            problems.append("ring rows' tags out of launch order")
        if ring_overflowed(oracle):
            if case.get("_full_rows") is None:
                # Without every row of the launch the kept ones could be anything at all.
                raise ValueError(f"{op}: the ring overflowed; compare needs case['_full_rows'] (full_rows())")
            if Counter(map(tuple, other["ring"].tolist())) - case["_full_rows"]:
                problems.append("kept ring rows are not violations of this launch")
        return problems
    if op == "plan":
        for key in ("num_valid", "enable", "offsets", "seed_slot_indices", "num_valid_reqs"):
            if not np.array_equal(oracle[key], other[key]):
                problems.append(key)
        for key in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
            if not np.array_equal(oracle[key], other[key]):
                problems.append(key)
        return problems
    if op == "records":
        return [key for key in ("src", "dst") if not np.array_equal(oracle[key], other[key])]
    if not np.array_equal(oracle["pool_out"], other["pool_out"]):
        problems.append("pool_out")
    return problems


def with_ring(case: dict, capacity: int) -> dict:
    """``case`` with a violation ring of ``capacity`` rows (the same inputs otherwise)."""
    big = dict(case)
    big["pool"] = dict(case["pool"], ring_capacity=capacity)
    big.pop("_full_rows", None)
    return big


def full_rows(op: str, case: dict, total: int, *, run: Callable[[dict], dict] | None = None) -> Counter:
    """Every violation row of ``case`` (``total`` of them) on the CPU, with a ring that keeps all.
    ``run`` runs a case on the CPU where the oracle is not ``op``'s runner (a step launched twice)."""
    out = (run or (lambda c: RUNNERS[op](c, "cpu")))(with_ring(case, total))
    return Counter(map(tuple, out["ring"][:total].tolist()))


def compare_overflow_aware(op: str, case: dict, oracle: dict, other: dict, *,
                           run: Callable[[dict], dict] | None = None) -> list[str]:
    """``compare``, first giving ``case`` every violation row of its launch (``full_rows``, with
    ``run``) where the oracle's ring overflowed, as ``compare`` then needs."""
    if op in RING_OPS and ring_overflowed(oracle):
        case["_full_rows"] = full_rows(op, case, oracle["write_index"], run=run)
    return compare(op, case, oracle, other)


def past_one_grid_pass(op: str, seed: int, *, tail_write: bool = True) -> dict:
    """A fuzz case of ``op`` (verify, plan or step) with more verify entries than one pass of the
    largest grid a GPU holds at once (2048 threads an SM), all within its verify capacity (a
    verify's plan enabled); with ``tail_write=False`` a step the last-block write does not take
    (needs CuPy and a GPU)."""
    from kvcanary_cupy.ops.backends._cuda import sm_count
    from kvcanary_cupy.ops.backends._cuda.step import tail_write as takes_tail_write

    one_pass = 2048 * sm_count(0)

    def past_one_pass(case: dict) -> bool:
        if op != "verify" and not tail_write and takes_tail_write(len(case["req_pool_indices"]),
                                                                  len(case["input_ids"])):
            return False
        capacity = len(case["slot_indices"]) if op == "verify" else case["verify_capacity"]
        return one_pass < verify_entries(case) <= capacity

    return first_drawn(MAKERS[op], np.random.default_rng([seed, len(op)]), 8 * one_pass, past_one_pass, 400,
                       f"{op} case past {one_pass} entries")


def past_one_grid_pass_equal_the_cpu_backend(op: str, seed: int, *, dense: bool = False,
                                             tail_write: bool = True) -> list:
    """``compare``'s problems between the CPU backend and CUDA over ``past_one_grid_pass(op, seed)``
    (verify or step). ``dense``: over a canary of random words, where nearly every entry records a
    row (asserted), so that an entry left unchecked is a row missing."""
    case = past_one_grid_pass(op, seed, tail_write=tail_write)
    if dense:
        canary = case["pool"]["canary"]
        case["pool"]["canary"] = np.random.default_rng(seed).integers(0, 256, size=canary.shape, dtype=np.uint8)
    oracle = RUNNERS[op](case, "cpu")
    if dense:
        total = verify_entries(case)
        assert oracle["write_index"] >= total * 9 // 10, (oracle["write_index"], total)
    return compare_overflow_aware(op, case, oracle, RUNNERS[op](case, "cuda"))
