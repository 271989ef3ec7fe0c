"""verify on the CPU: entries checked in parallel, violations recorded in entry order."""

from __future__ import annotations

import numba
import numpy as np

from .... import _layout as L
from .hashing import (BIT_OUT_OF_RANGE, F_POSITION, F_PREV_HASH, F_REAL_KV_HASH, F_TOKEN, INLINE, JIT,
                      PARALLEL_MIN_ENTRIES, PREFETCH_AHEAD, njit,
                      as_i64, hash_slots_parallel, hash_slots_serial, hashable, link, one_parallel_call_at_a_time,
                      prefetch, real_kv_hash, record, serial_and_parallel, slot_words, source_arguments,
                      threads_can_hash)

_PADDING = L.PADDING_SLOT
_NO_TOKEN = L.NO_EXPECTED_TOKEN
_BIT_CHAIN = int(L.FailReason.CHAIN_HASH)
_BIT_POSITION = int(L.FailReason.POSITION)
_BIT_KV = int(L.FailReason.REAL_KV_HASH)
_BIT_TOKEN = int(L.FailReason.VERIFY_TOKEN)


@njit(**INLINE)
def check_entry(k, words, slots, expected_tokens, expected_positions, prev_slots, check_token, kv_hash,
                kv_out_of_range):
    """The violation row of entry ``k`` as ``(bits, slot, position, token, expected_token, chain, aux)``;
    ``bits == 0`` means the entry is clean. ``kv_hash``/``kv_out_of_range`` are the slot's recomputed
    real-KV hash (unused when the slot itself is padding or out of range)."""
    num_slots = words.shape[0]
    slot = slots[k]
    report_token = expected_tokens[k] if check_token else _NO_TOKEN
    if slot == _PADDING:
        return 0, slot, 0, 0, 0, 0, 0
    if slot < 0 or slot >= num_slots:
        return BIT_OUT_OF_RANGE, slot, expected_positions[k], 0, report_token, 0, 0
    token = words[slot, F_TOKEN]
    position = words[slot, F_POSITION]
    prev_hash = words[slot, F_PREV_HASH]
    bits = 0
    prev = prev_slots[k]
    expected_chain = prev_hash
    if prev >= num_slots:
        bits |= BIT_OUT_OF_RANGE
    elif prev != _PADDING:
        expected_chain = as_i64(link(words, prev))
        if prev_hash != expected_chain:
            bits |= _BIT_CHAIN
    if check_token and expected_tokens[k] != _NO_TOKEN and token != expected_tokens[k]:
        bits |= _BIT_TOKEN
    if position != expected_positions[k]:
        bits |= _BIT_POSITION
    if kv_out_of_range:
        bits |= BIT_OUT_OF_RANGE
    if words[slot, F_REAL_KV_HASH] != as_i64(kv_hash):
        bits |= _BIT_KV
    return bits, slot, position, token, report_token, prev_hash, expected_chain


def _entry_bits(active, words, slots, expected_tokens, expected_positions, prev_slots, check_token, hashes,
                out_of_range, bits_out):
    num_slots, words_per_slot = words.shape[0], words.shape[1]
    for k in numba.prange(active):
        # the slot and predecessor of an entry further on: random reads, asked for ahead of use
        ahead = k + PREFETCH_AHEAD
        if ahead < active:
            slot, prev = slots[ahead], prev_slots[ahead]
            if 0 <= slot < num_slots:
                prefetch(words, slot * words_per_slot)
            if 0 <= prev < num_slots:
                prefetch(words, prev * words_per_slot)
        bits_out[k] = check_entry(k, words, slots, expected_tokens, expected_positions, prev_slots, check_token,
                                  hashes[k], out_of_range[k])[0]


_entry_bits_serial, _entry_bits_parallel = serial_and_parallel(_entry_bits)


@njit(**JIT)
def _verify(words, sources, table, slots, expected_tokens, expected_positions, prev_slots, num_valid, enable,
            check_token, tag, ring, write_index, slot_run_counter, kernel_run_counter):
    kernel_run_counter[0] += 1
    if enable[0] == 0:
        return
    active = min(max(np.int64(num_valid[0]), 0), slots.shape[0])
    slot_run_counter[0] += active
    num_slots = words.shape[0]
    # Every entry is checked in a first pass whose random reads are asked for ahead of use (in
    # threads from PARALLEL_MIN_ENTRIES on); only the entries found bad are checked again, in order,
    # to record their rows as the reference does.
    hashes = np.zeros(active, dtype=np.uint64)
    out_of_range = np.zeros(active, dtype=np.bool_)
    bits = np.empty(active, dtype=np.uint8)
    if active >= PARALLEL_MIN_ENTRIES:
        if table.shape[0]:
            hash_slots_parallel(num_slots, sources, table, slots[:active], hashes, out_of_range)
        _entry_bits_parallel(active, words, slots, expected_tokens, expected_positions, prev_slots, check_token,
                             hashes, out_of_range, bits)
    else:
        if table.shape[0]:
            hash_slots_serial(num_slots, sources, table, slots[:active], hashes, out_of_range)
        _entry_bits_serial(active, words, slots, expected_tokens, expected_positions, prev_slots, check_token,
                           hashes, out_of_range, bits)
    _record_rows(active, bits, words, sources, table, slots, expected_tokens, expected_positions, prev_slots,
                 check_token, tag, ring, write_index)


@njit(**INLINE)
def _record_rows(active, bits, words, sources, table, slots, expected_tokens, expected_positions, prev_slots,
                 check_token, tag, ring, write_index):
    """The rows of the entries whose ``bits`` are set, in entry order, each checked again."""
    num_slots = words.shape[0]
    for k in range(active):
        if bits[k] == 0:
            continue
        kv_hash, kv_out_of_range = real_kv_hash(sources, table, hashable(slots[k], num_slots))
        row = check_entry(k, words, slots, expected_tokens, expected_positions, prev_slots, check_token, kv_hash,
                          kv_out_of_range)
        if row[0] != 0:
            record(ring, write_index, tag, row[1], row[2], row[3], row[4], row[5], row[6], row[0])


@njit(**JIT)
def _verify_serially(words, sources, table, slots, expected_tokens, expected_positions, prev_slots, num_valid, enable,
                     check_token, tag, ring, write_index, slot_run_counter, kernel_run_counter):
    """``_verify`` without threads, for more sources than a parallel region takes (threads_can_hash):
    numba would not compile ``_verify`` for them, whose parallel hashing is built in."""
    kernel_run_counter[0] += 1
    if enable[0] == 0:
        return
    active = min(max(np.int64(num_valid[0]), 0), slots.shape[0])
    slot_run_counter[0] += active
    hashes = np.zeros(active, dtype=np.uint64)
    out_of_range = np.zeros(active, dtype=np.bool_)
    bits = np.empty(active, dtype=np.uint8)
    if table.shape[0]:
        hash_slots_serial(words.shape[0], sources, table, slots[:active], hashes, out_of_range)
    _entry_bits_serial(active, words, slots, expected_tokens, expected_positions, prev_slots, check_token,
                       hashes, out_of_range, bits)
    _record_rows(active, bits, words, sources, table, slots, expected_tokens, expected_positions, prev_slots,
                 check_token, tag, ring, write_index)


def verify(ctx, vplan, *, tag: int, check_expected_token: bool, stream=None) -> None:
    sources, table = source_arguments(ctx)
    threads = threads_can_hash(sources)
    run = _verify if threads else _verify_serially
    with one_parallel_call_at_a_time(threads and int(vplan.num_valid[0]) >= PARALLEL_MIN_ENTRIES):
        run(slot_words(ctx), sources, table, vplan.slot_indices, vplan.expected_tokens, vplan.expected_positions,
            vplan.prev_slot_indices, vplan.num_valid, vplan.enable, check_expected_token, tag,
            ctx.violation_ring, ctx.violation_write_index, ctx.slot_run_counter, ctx.kernel_run_counter)
