"""A plain-Python model of the ops (plan, verify, write, scatter and copy_records), written straight
from the specification.

It is slow on purpose: Python integers, one entry at a time, no NumPy in the loops. It serves as the
independent second opinion in the tests (the numba backend must agree with it) and as the naive
baseline in ``benchmarks/bench_cpu.py``. It works on NumPy arrays and never validates anything; the
public ops do that before any backend runs.
"""

from __future__ import annotations

import numpy as np

from . import _layout as L

_MASK = L.U64_MASK


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def sm(x: int) -> int:
    """splitmix64 finalizer on the low 64 bits of ``x``; returns an unsigned value."""
    x &= _MASK
    x = ((x ^ (x >> L.SPLITMIX_SHIFT_1)) * L.SPLITMIX_MUL_1) & _MASK
    x = ((x ^ (x >> L.SPLITMIX_SHIFT_2)) * L.SPLITMIX_MUL_2) & _MASK
    return x ^ (x >> L.SPLITMIX_SHIFT_3)


def mix3(a: int, b: int, c: int) -> int:
    return sm(sm(sm(a) ^ (b & _MASK)) ^ (c & _MASK))


def fold(data: bytes) -> int:
    acc = 0
    for offset in range(0, len(data), 8):
        acc = sm(acc ^ int.from_bytes(data[offset:offset + 8], "little"))
    return acc


ANCHOR_LINK = sm(L.CHAIN_ANCHOR)


class _Ring:
    def __init__(self, ring: np.ndarray, write_index: np.ndarray):
        self.ring = ring
        self.write_index = write_index

    def record(self, *row: int) -> None:
        index = int(self.write_index[0])
        self.write_index[0] = np.int32(_signed32(index + 1))
        if 0 <= index < self.ring.shape[0]:
            self.ring[index, :] = [_signed(v) for v in row]


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


class _Slots:
    """Field access on a uint8 canary buffer with Python integers."""

    def __init__(self, canary_buf: np.ndarray):
        self.words = canary_buf.view(np.int64)
        self.count = canary_buf.shape[0]

    def field(self, slot: int, field: int) -> int:
        return int(self.words[slot, field])

    def link(self, slot: int) -> int:
        if slot < 0:
            return ANCHOR_LINK
        w = self.words[slot]
        return mix3(int(w[L.FIELD_PREV_HASH]), int(w[L.FIELD_TOKEN]), int(w[L.FIELD_POSITION]))


def real_kv_hash(sources, slot: int) -> tuple[int, bool]:
    """``(hash, out_of_range)`` for ``slot``; ``sources`` holds ``(rows_u8, page, bpt, read)``."""
    acc = 0
    out_of_range = False
    for rows_u8, page_size, bytes_per_token, read_len in sources:
        row = slot // page_size
        if row >= rows_u8.shape[0]:
            out_of_range = True
            acc = sm(acc ^ 0)
            continue
        start = (slot % page_size) * bytes_per_token
        acc = sm(acc ^ fold(rows_u8[row, start:start + read_len].tobytes()))
    return acc, out_of_range


def verify(canary_buf, sources, ring, write_index, slot_run_counter, kernel_run_counter, *,
           slots, expected_tokens, expected_positions, prev_slots, num_valid, enable,
           check_expected_token, tag):
    kernel_run_counter[0] += 1
    if int(enable[0]) == 0:
        return
    table = _Slots(canary_buf)
    out = _Ring(ring, write_index)
    active = min(max(int(num_valid[0]), 0), slots.shape[0])
    slot_run_counter[0] += active
    for k in range(active):
        slot = int(slots[k])
        if slot == L.PADDING_SLOT:
            continue
        expected_token = int(expected_tokens[k])
        expected_position = int(expected_positions[k])
        if slot < 0 or slot >= table.count:
            report_token = expected_token if check_expected_token else L.NO_EXPECTED_TOKEN
            out.record(tag, slot, expected_position, 0, report_token, 0, 0, L.FailReason.OUT_OF_RANGE)
            continue
        token = table.field(slot, L.FIELD_TOKEN)
        position = table.field(slot, L.FIELD_POSITION)
        prev_hash = table.field(slot, L.FIELD_PREV_HASH)
        stored_kv = table.field(slot, L.FIELD_REAL_KV_HASH)
        prev = int(prev_slots[k])
        bits = 0
        chain_checked = prev != L.PADDING_SLOT and prev < table.count
        if prev >= table.count:
            bits |= L.FailReason.OUT_OF_RANGE
        expected_chain = table.link(prev) if chain_checked else prev_hash & _MASK
        if chain_checked and (prev_hash & _MASK) != expected_chain:
            bits |= L.FailReason.CHAIN_HASH
        token_checked = check_expected_token and expected_token != L.NO_EXPECTED_TOKEN
        if token_checked and token != expected_token:
            bits |= L.FailReason.VERIFY_TOKEN
        if position != expected_position:
            bits |= L.FailReason.POSITION
        kv_hash, kv_out_of_range = real_kv_hash(sources, slot)
        if kv_out_of_range:
            bits |= L.FailReason.OUT_OF_RANGE
        if (stored_kv & _MASK) != kv_hash:
            bits |= L.FailReason.REAL_KV_HASH
        if bits:
            report_token = expected_token if check_expected_token else L.NO_EXPECTED_TOKEN
            out.record(tag, slot, position, token, report_token, prev_hash, expected_chain, bits)


def write(canary_buf, sources, ring, write_index, slot_run_counter, kernel_run_counter, *,
          offsets, seed_slots, num_valid_reqs, input_ids, positions, out_cache_loc,
          expected_tokens, expected_positions, chain_position_assert, tag):
    kernel_run_counter[0] += 1
    table = _Slots(canary_buf)
    out = _Ring(ring, write_index)
    capacity = seed_slots.shape[0]
    num_entries = input_ids.shape[0]
    stored = 0
    for r in range(min(max(int(num_valid_reqs[0]), 0), capacity)):
        begin, end = int(offsets[r]), int(offsets[r + 1])
        if begin >= end:
            continue
        seed = int(seed_slots[r])
        if seed >= table.count:
            out.record(tag, seed, 0, 0, 0, 0, 0, L.FailReason.OUT_OF_RANGE)
            seed = L.NO_PREDECESSOR
        running = table.link(seed)
        position_assert = seed >= 0 and int(chain_position_assert[0]) != 0
        prev_pos = table.field(seed, L.FIELD_POSITION) if seed >= 0 else 0
        for i in range(begin, end):
            if i < 0 or i >= num_entries:
                out.record(tag, -1, 0, 0, 0, running, 0, L.FailReason.OUT_OF_RANGE)
                break
            slot = int(out_cache_loc[i])
            if slot < 0:
                continue
            token = int(input_ids[i])
            position = int(positions[i])
            if slot >= table.count:
                out.record(tag, slot, position, token, token, running, position,
                           L.FailReason.OUT_OF_RANGE)
                continue
            kv_hash, kv_out_of_range = real_kv_hash(sources, slot)
            if kv_out_of_range:
                out.record(tag, slot, position, token, token, running, position,
                           L.FailReason.OUT_OF_RANGE)
            if expected_tokens is not None:
                bits = 0
                if token != int(expected_tokens[i]):
                    bits |= L.FailReason.WRITE_TOKEN
                if position != int(expected_positions[i]):
                    bits |= L.FailReason.WRITE_POSITION
                if bits:
                    out.record(tag, slot, position, token, int(expected_tokens[i]), running,
                               int(expected_positions[i]), bits)
            if position_assert:
                if position != _signed(prev_pos + 1):
                    out.record(tag, slot, position, token, token, running, prev_pos + 1,
                               L.FailReason.WRITE_POSITION)
                prev_pos = position
            words = table.words[slot]
            words[L.FIELD_TOKEN] = token
            words[L.FIELD_POSITION] = position
            words[L.FIELD_PREV_HASH] = _signed(running)
            words[L.FIELD_REAL_KV_HASH] = _signed(kv_hash)
            running = mix3(running, token, position)
            stored += 1
    slot_run_counter[0] += stored


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, swa_window, lut,
         expected_pool, valid_lens, token_offset,
         v_slots, v_tokens, v_positions, v_prev, v_num_valid, v_enable,
         w_offsets, w_seeds, w_num_valid_reqs):
    rows, width = req_to_token.shape

    def translate(slot: int) -> int:
        if lut is None or slot < 0:
            return slot
        return int(lut[slot]) if slot < lut.shape[0] else L.UNRESOLVED_SLOT

    def resolve(rp: int, pos: int) -> int:
        if rp < 0 or rp >= rows or pos < 0 or pos >= width:
            return L.UNRESOLVED_SLOT
        return translate(int(req_to_token[rp, pos]))

    def expected(r: int, rp: int, pos: int) -> int:
        if expected_pool is None:
            return L.NO_EXPECTED_TOKEN
        column = pos + token_offset
        if not (0 <= column < int(valid_lens[r])):
            return L.NO_EXPECTED_TOKEN
        if rp < 0 or rp >= expected_pool.shape[0] or column >= expected_pool.shape[1]:
            return L.NO_EXPECTED_TOKEN
        return int(expected_pool[rp, column])

    bs = req_pool_indices.shape[0]
    entries = []
    for r in range(bs):
        rp = int(req_pool_indices[r])
        prefix = int(prefix_lens[r])
        if rp == 0 or prefix <= 0:
            continue
        start = max(0, prefix - swa_window) if swa_window > 0 else 0
        for pos in range(start, prefix):
            prev = resolve(rp, pos - 1) if pos > 0 else L.NO_PREDECESSOR
            entries.append((resolve(rp, pos), expected(r, rp, pos), pos, prev))
    capacity = v_slots.shape[0]
    total = len(entries)
    v_num_valid[0] = min(total, capacity)
    v_enable[0] = 1 if total <= capacity else 0
    if total <= capacity:
        for k, (slot, token, pos, prev) in enumerate(entries):
            v_slots[k], v_tokens[k], v_positions[k], v_prev[k] = slot, token, pos, prev

    running = 0
    for r in range(bs):
        rp = int(req_pool_indices[r])
        extend = int(extend_lens[r])
        prefix = int(prefix_lens[r])
        w_offsets[r] = running
        live = rp != 0 and extend > 0
        if live:
            running = _signed(running + extend)  # int64 offsets wrap as the kernels' do (SPEC 3.3)
        w_seeds[r] = resolve(rp, prefix - 1) if live and prefix > 0 else L.NO_PREDECESSOR
    w_offsets[bs] = running
    w_offsets[bs + 1:] = 0
    w_seeds[bs:] = L.NO_PREDECESSOR
    w_num_valid_reqs[0] = bs


def scatter_req_token_ids(*, flat_in, offsets, req_pool_indices, pool_out):
    rows, width = pool_out.shape
    n = flat_in.shape[0]
    for r in range(req_pool_indices.shape[0]):
        rp = int(req_pool_indices[r])
        if rp < 0 or rp >= rows:
            continue
        begin = int(offsets[r])
        length = min(int(offsets[r + 1]) - begin, width)
        for j in range(max(length, 0)):
            if 0 <= begin + j < n:
                pool_out[rp, j] = np.int64(flat_in[begin + j]).astype(pool_out.dtype)


def copy_records(*, src_buf, dst_buf, src_slots, dst_slots):
    """Every pair's source record read first, then each stored in pair order where both slots are in
    range (one buffer may be both: what is read is what was there before the copy)."""
    src_words, dst_words = src_buf.view(np.int64), dst_buf.view(np.int64)
    fields = L.SLOT_FIELD_COUNT
    records = [src_words[s, :fields].copy() if 0 <= s < src_words.shape[0] else None for s in map(int, src_slots)]
    for record, d in zip(records, map(int, dst_slots)):
        if record is not None and 0 <= d < dst_words.shape[0]:
            dst_words[d, :fields] = record
