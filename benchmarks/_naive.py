"""BASELINES: the canary ops written the way a user would with vectorised array expressions.

These are the "naive alternative" every benchmark is compared against (the ``x naive`` column): the
same four operations built from whole-array NumPy/CuPy expressions (gathers, ``where``, ``cumsum``,
``searchsorted``) instead of the package's fused kernels. Every function takes the array module
``xp`` (``numpy`` or ``cupy``) and runs on that module's arrays, so CI checks them with NumPy against
the package's CPU backend (``tests/test_naive_baselines.py``) and the GPU suite times them with CuPy.

They implement SPEC §3 for in-range inputs (every slot, predecessor, pool row and source row inside
its buffer); the out-of-range rules of §4 (bit 64, ``UNRESOLVED``) are not modelled, nor the write
input assert or the chain position assert (the benchmarks run neither). Like a user's code they read
small device scalars on the host (``int(...)``) where a length is needed; that synchronisation is
part of their cost.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from kvcanary_cupy import _layout as L

_M1 = np.uint64(L.SPLITMIX_MUL_1)
_M2 = np.uint64(L.SPLITMIX_MUL_2)
_S1 = np.uint64(L.SPLITMIX_SHIFT_1)
_S2 = np.uint64(L.SPLITMIX_SHIFT_2)
_S3 = np.uint64(L.SPLITMIX_SHIFT_3)
_ANCHOR = np.uint64(L.CHAIN_ANCHOR)

# (tensor viewed as uint8 [rows, row_bytes], page_size, num_bytes_per_token, bytes read per slot)
NaiveSource = tuple[Any, int, int, int]


def sm(xp, x):
    """splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> _S1)) * _M1
    x = (x ^ (x >> _S2)) * _M2
    return x ^ (x >> _S3)


def mix3(xp, a, b, c):
    return sm(xp, sm(xp, sm(xp, a) ^ b) ^ c)


def anchor_link(xp):
    return sm(xp, xp.asarray([_ANCHOR], dtype=xp.uint64))[0]


def u64(xp, a):
    """Same bits as uint64."""
    a = xp.asarray(a)
    return a.view(xp.uint64) if a.dtype.itemsize == 8 else a.astype(xp.int64).view(xp.uint64)


def canary_words(xp, canary_buf):
    """``uint64 [num_slots, stride // 8]`` view of a canary buffer (``uint8 [num_slots, stride]``)."""
    return canary_buf.view(xp.uint64)


def sources_of(ctx) -> list[NaiveSource]:
    """The context's hashed sources as :data:`NaiveSource` tuples (empty in mode NONE)."""
    if ctx.hash_mode == L.HashMode.NONE:
        return []
    out = []
    for s in ctx.real_kv_sources:
        t = s._native
        rows = t.reshape(t.shape[0], -1)
        rows = rows.view(np.uint8) if rows.dtype.itemsize != 1 or rows.dtype.kind != "u" else rows
        out.append((rows, s.page_size, s.num_bytes_per_token, s.read_length(ctx.hash_mode)))
    return out


def real_kv_hash(xp, sources: Sequence[NaiveSource], slots):
    """``real_kv_hash`` of every slot in ``slots`` (uint64); words gathered per source, folded with
    a Python loop over the word columns."""
    slots = xp.asarray(slots, dtype=xp.int64)
    acc = xp.zeros(slots.shape, dtype=xp.uint64)
    for rows, page, bpt, length in sources:
        row = slots // page
        start = (slots % page) * bpt  # byte offset inside the row, a multiple of 16
        words = rows.view(xp.uint64)  # [num_rows, row_bytes // 8]
        cols = (start // 8)[:, None] + xp.arange(length // 8, dtype=xp.int64)[None, :]
        data = words[row[:, None], cols]
        folded = xp.zeros(slots.shape, dtype=xp.uint64)
        for j in range(length // 8):
            folded = sm(xp, folded ^ data[:, j])
        acc = sm(xp, acc ^ folded)
    return acc


def verify(xp, canary_buf, sources: Sequence[NaiveSource], *, slots, expected_tokens, expected_positions,
           prev_slots, active: int, check_expected_token: bool = False, tag: int = 0):
    """BASELINE verify (SPEC §3.2): the violation rows ``int64 [k, 8]`` of the first ``active``
    plan entries, in entry order."""
    words = canary_words(xp, canary_buf)
    s = slots[:active]
    prev = prev_slots[:active]
    exp_tok = expected_tokens[:active]
    exp_pos = expected_positions[:active]
    w = words[s, :4]
    tok, pos, prev_hash, kv = w[:, 0], w[:, 1], w[:, 2], w[:, 3]
    pw = words[xp.maximum(prev, 0), :4]
    link = mix3(xp, pw[:, 2], pw[:, 0], pw[:, 1])
    link = xp.where(prev < 0, anchor_link(xp), link)
    checked = prev != 0
    bits = xp.where(checked & (prev_hash != link), 1, 0)
    bits |= xp.where(pos != u64(xp, exp_pos), 2, 0)
    bits |= xp.where(kv != (real_kv_hash(xp, sources, s) if sources else 0), 4, 0)
    if check_expected_token:
        bits |= xp.where((exp_tok != -1) & (tok != u64(xp, exp_tok)), 32, 0)
    bits = xp.where(s == 0, 0, bits)
    bad = xp.nonzero(bits)[0]
    i64 = lambda a: a.view(xp.int64) if a.dtype == xp.uint64 else a.astype(xp.int64)  # noqa: E731
    exp_col = exp_tok[bad] if check_expected_token else xp.full(bad.shape, -1, dtype=xp.int64)
    aux = xp.where(checked[bad], link[bad], prev_hash[bad])
    return xp.stack([xp.full(bad.shape, tag, dtype=xp.int64), s[bad], i64(pos[bad]), i64(tok[bad]), exp_col,
                     i64(prev_hash[bad]), i64(aux), i64(bits[bad])], axis=1)


def write(xp, canary_buf, sources: Sequence[NaiveSource], *, offsets, seed_slots, num_valid_reqs: int, input_ids,
          positions, out_cache_loc):
    """BASELINE write (SPEC §3.1): real-KV hashes of all entries in one vectorised pass, then the
    chains with a Python loop over positions, vectorised across requests. Returns the number of
    entries stored."""
    words = canary_words(xp, canary_buf)
    reqs = min(max(int(num_valid_reqs), 0), int(seed_slots.shape[0]))
    if reqs == 0:
        return 0
    begin = offsets[:reqs]
    lens = xp.maximum(offsets[1:reqs + 1] - begin, 0)
    longest = int(lens.max())
    seed = seed_slots[:reqs]
    sw = words[xp.maximum(seed, 0), :3]
    running = xp.where(seed < 0, anchor_link(xp), mix3(xp, sw[:, 2], sw[:, 0], sw[:, 1]))
    hashes = (real_kv_hash(xp, sources, xp.maximum(out_cache_loc, 0)) if sources
              else xp.zeros(out_cache_loc.shape, dtype=xp.uint64))
    tok_all, pos_all = u64(xp, input_ids), u64(xp, positions)
    stored = 0
    for j in range(longest):
        i = xp.minimum(begin + j, max(int(out_cache_loc.shape[0]) - 1, 0))
        slot = out_cache_loc[i]
        live = (j < lens) & (slot >= 0)
        tok, pos = tok_all[i], pos_all[i]
        sel = xp.nonzero(live)[0]
        if sel.size:
            words[slot[sel], :4] = xp.stack([tok[sel], pos[sel], running[sel], hashes[i[sel]]], axis=1)
            stored += int(sel.size)
        running = xp.where(live, mix3(xp, running, tok, pos), running)
    return stored


def _ranges(xp, counts):
    """For per-request ``counts``: ``(req, k)`` of every element, request-major (cumsum + searchsorted)."""
    ends = xp.cumsum(counts)
    total = int(ends[-1]) if counts.shape[0] else 0
    idx = xp.arange(total, dtype=xp.int64)
    req = xp.searchsorted(ends, idx, side="right")
    k = idx - (ends - counts)[req]
    return req, k, total


def plan(xp, *, req_pool_indices, prefix_lens, extend_lens, req_to_token, swa_window: int = 0,
         lut: Optional[Any] = None, verify_capacity: int, expected_pool=None, valid_lens=None,
         token_offset: int = 0):
    """BASELINE plan (SPEC §3.3). Returns ``(slots, expected_tokens, expected_positions, prev_slots,
    num_valid, enable, offsets, seed_slots)``; the entry arrays hold the ``total`` planned entries."""
    rp = req_pool_indices
    live = rp != 0
    prefix = xp.maximum(prefix_lens, 0)
    start = xp.maximum(prefix - swa_window, 0) if swa_window > 0 else xp.zeros_like(prefix)
    counts = xp.where(live, prefix - start, 0)
    req, k, total = _ranges(xp, counts)
    rows = rp[req]
    pos = start[req] + k
    tr = (lambda s: xp.where(s >= 0, lut[xp.maximum(s, 0)], s)) if lut is not None else (lambda s: s)  # noqa: E731
    slots = tr(req_to_token[rows, pos].astype(xp.int64))
    prev = xp.where(pos > 0, tr(req_to_token[rows, xp.maximum(pos - 1, 0)].astype(xp.int64)), -1)
    if expected_pool is not None:
        col = pos + token_offset
        ok = (col >= 0) & (col < valid_lens[req]) & (col < expected_pool.shape[1])
        expected = xp.where(ok, expected_pool[rows, xp.clip(col, 0, expected_pool.shape[1] - 1)].astype(xp.int64), -1)
    else:
        expected = xp.full(total, -1, dtype=xp.int64)
    ext = xp.where(live & (extend_lens > 0), extend_lens, 0)
    offsets = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(ext)])
    seed_pos = xp.maximum(prefix - 1, 0)
    seeds = xp.where(live & (extend_lens > 0) & (prefix > 0), tr(req_to_token[rp, seed_pos].astype(xp.int64)), -1)
    return slots, expected, pos, prev, min(total, verify_capacity), int(total <= verify_capacity), offsets, seeds


def plan_into(xp, vplan, wplan, **kwargs):
    """:func:`plan` writing its results into the package's plan dataclasses, as the op does."""
    slots, expected, pos, prev, num_valid, enable, offsets, seeds = plan(
        xp, verify_capacity=int(vplan.slot_indices.shape[0]), **kwargs)
    if enable:
        n = int(slots.shape[0])
        vplan.slot_indices[:n] = slots
        vplan.expected_tokens[:n] = expected
        vplan.expected_positions[:n] = pos
        vplan.prev_slot_indices[:n] = prev
    vplan.num_valid[0] = num_valid
    vplan.enable[0] = enable
    bs = int(seeds.shape[0])
    wplan.offsets[:bs + 1] = offsets
    wplan.offsets[bs + 1:] = 0
    wplan.seed_slot_indices[:bs] = seeds
    wplan.seed_slot_indices[bs:] = L.NO_PREDECESSOR
    wplan.num_valid_reqs[0] = bs


def scatter(xp, *, flat_in, offsets, req_pool_indices, pool_out):
    """BASELINE scatter_req_token_ids (SPEC §3.4): one gather/scatter over every copied token."""
    width = int(pool_out.shape[1])
    n = int(flat_in.shape[0])
    begin = offsets[:-1]
    counts = xp.clip(xp.minimum(offsets[1:] - begin, width), 0, None)
    counts = xp.where(begin >= 0, xp.minimum(counts, xp.maximum(n - begin, 0)), 0)
    req, k, total = _ranges(xp, counts)
    if total:
        pool_out[req_pool_indices[req], k] = flat_in[begin[req] + k].astype(pool_out.dtype)


def copy_records(xp, *, src_buf, dst_buf, src_slots, dst_slots):
    """BASELINE copy_records: the four words of each source slot assigned to its destination slot
    (in-range slots only, as everywhere here)."""
    words = L.SLOT_FIELD_COUNT
    dst_buf.view(xp.int64)[dst_slots, :words] = src_buf.view(xp.int64)[src_slots, :words]
