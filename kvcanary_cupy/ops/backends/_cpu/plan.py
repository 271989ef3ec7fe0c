"""plan on the CPU: per-request counts and a prefix sum, then every request's entries in parallel."""

from __future__ import annotations

import numba
import numpy as np

from .... import _layout as L
from .hashing import JIT, njit, one_parallel_call_at_a_time, serial_and_parallel

_UNRESOLVED = L.UNRESOLVED_SLOT
_NO_PREDECESSOR = L.NO_PREDECESSOR
_NO_TOKEN = L.NO_EXPECTED_TOKEN
_INT64_MAX = np.int64(L.INT64_MAX)
PARALLEL_MIN_ENTRIES = 65536


@njit(**JIT)
def translate(lut, has_lut, slot):
    """Full-pool slot to SWA slot; negative slots pass through, unknown ones are unresolved."""
    if not has_lut or slot < 0:
        return slot
    if slot >= lut.shape[0]:
        return _UNRESOLVED
    return lut[slot]


@njit(**JIT)
def resolve(req_to_token, lut, has_lut, pool_row, position):
    if pool_row < 0 or pool_row >= req_to_token.shape[0] or position < 0 or position >= req_to_token.shape[1]:
        return _UNRESOLVED
    return translate(lut, has_lut, np.int64(req_to_token[pool_row, position]))


@njit(**JIT)
def window_start(prefix, swa_window):
    return max(0, prefix - swa_window) if swa_window > 0 else 0


def _fill_entries(starts, total, req_pool_indices, prefix_lens, req_to_token, swa_window, lut, has_lut,
                  expected_pool, valid_lens, has_expected, token_offset, slots, tokens, positions, prevs):
    bs = req_pool_indices.shape[0]
    for r in numba.prange(bs):
        pool_row = req_pool_indices[r]
        prefix = prefix_lens[r]
        if pool_row == 0 or prefix <= 0:
            continue
        first = window_start(prefix, swa_window)
        k = starts[r]
        # The request's counted share, not its length read again: a length that aliases a plan
        # array changes as the plan fills, and the GPU's entries are bounded by the count alike.
        end = starts[r + 1] if r + 1 < bs else total
        for pos in range(first, min(prefix, first + end - k)):
            slots[k] = resolve(req_to_token, lut, has_lut, pool_row, pos)
            prevs[k] = resolve(req_to_token, lut, has_lut, pool_row, pos - 1) if pos > 0 else _NO_PREDECESSOR
            positions[k] = pos
            token = _NO_TOKEN
            if has_expected:
                column = pos + token_offset
                if (0 <= column < valid_lens[r] and 0 <= pool_row < expected_pool.shape[0]
                        and column < expected_pool.shape[1]):
                    token = np.int64(expected_pool[pool_row, column])
            tokens[k] = token
            k += 1


_fill_entries_serial, _fill_entries_parallel = serial_and_parallel(_fill_entries)


@njit(**JIT)
def _count_entries(req_pool_indices, prefix_lens, swa_window, starts):
    """Each request's first entry and the batch's total, saturating at int64's maximum as the GPU's
    does: a wrapped total could pass for one that fits the plan."""
    total = 0
    for r in range(req_pool_indices.shape[0]):
        starts[r] = total
        prefix = prefix_lens[r]
        if req_pool_indices[r] != 0 and prefix > 0:
            count = prefix - window_start(prefix, swa_window)
            total = _INT64_MAX if total > _INT64_MAX - count else total + count
    return total


@njit(**JIT)
def _write_plan(req_pool_indices, prefix_lens, extend_lens, req_to_token, lut, has_lut, offsets, seeds,
                num_valid_reqs):
    bs = req_pool_indices.shape[0]
    running = 0
    for r in range(bs):
        pool_row = req_pool_indices[r]
        extend = extend_lens[r]
        prefix = prefix_lens[r]
        offsets[r] = running
        live = pool_row != 0 and extend > 0
        if live:
            running += extend
        seeds[r] = resolve(req_to_token, lut, has_lut, pool_row, prefix - 1) if live and prefix > 0 \
            else _NO_PREDECESSOR
    offsets[bs] = running
    offsets[bs + 1:] = 0
    seeds[bs:] = _NO_PREDECESSOR
    num_valid_reqs[0] = bs


def plan(vplan, wplan, batch, *, stream=None) -> None:
    lut = batch.full_to_swa_index_mapping
    has_lut = lut is not None
    lut = lut if has_lut else np.zeros(0, dtype=np.int64)
    has_expected = batch.req_to_verify_expected_tokens is not None
    expected_pool = batch.req_to_verify_expected_tokens if has_expected else np.zeros((0, 0), dtype=np.int32)
    valid_lens = batch.req_to_verify_expected_tokens_valid_lens if has_expected else np.zeros(0, dtype=np.int64)
    starts = np.empty(batch.batch_size, dtype=np.int64)
    total = _count_entries(batch.req_pool_indices, batch.prefix_lens, batch.swa_window_size, starts)
    capacity = vplan.capacity
    vplan.num_valid[0] = min(total, capacity)
    vplan.enable[0] = 1 if total <= capacity else 0
    if total <= capacity:
        threads = total >= PARALLEL_MIN_ENTRIES
        fill = _fill_entries_parallel if threads else _fill_entries_serial
        with one_parallel_call_at_a_time(threads):
            fill(starts, total, batch.req_pool_indices, batch.prefix_lens, batch.req_to_token, batch.swa_window_size,
                 lut, has_lut, expected_pool, valid_lens, has_expected, batch.kv_token_id_vs_position_offset,
                 vplan.slot_indices, vplan.expected_tokens, vplan.expected_positions, vplan.prev_slot_indices)
    _write_plan(batch.req_pool_indices, batch.prefix_lens, batch.extend_seq_lens, batch.req_to_token, lut, has_lut,
                wplan.offsets, wplan.seed_slot_indices, wplan.num_valid_reqs)


def verify_total(batch) -> int:
    """How many verify entries ``batch`` has (what ``plan`` compares with the verify capacity)."""
    starts = np.empty(batch.batch_size, dtype=np.int64)
    return int(_count_entries(batch.req_pool_indices, batch.prefix_lens, batch.swa_window_size, starts))
