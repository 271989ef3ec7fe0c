"""write on the CPU: real-KV hashes of all entries in parallel, then each request's chain in order."""

from __future__ import annotations

import numpy as np

from .... import _layout as L
from .hashing import (BIT_OUT_OF_RANGE, F_POSITION, F_PREV_HASH, F_REAL_KV_HASH, F_TOKEN, JIT,
                      PARALLEL_MIN_ENTRIES, as_i64, njit,
                      hash_slots_parallel, hash_slots_serial, link, mix3, one_parallel_call_at_a_time, record,
                      slot_words, source_arguments, threads_can_hash)

_BIT_TOKEN = int(L.FailReason.WRITE_TOKEN)
_BIT_POSITION = int(L.FailReason.WRITE_POSITION)


@njit(**JIT)
def _write(words, hashes, out_of_range, offsets, seed_slots, num_valid_reqs, input_ids, positions, out_cache_loc,
           has_input_assert, expected_tokens, expected_positions, chain_position_assert, tag, ring, write_index,
           slot_run_counter, kernel_run_counter):
    kernel_run_counter[0] += 1
    num_slots = words.shape[0]
    num_entries = input_ids.shape[0]
    requests = min(max(np.int64(num_valid_reqs[0]), 0), seed_slots.shape[0])
    stored = 0
    for r in range(requests):
        begin = offsets[r]
        end = offsets[r + 1]
        if begin >= end:
            continue
        seed = seed_slots[r]
        if seed >= num_slots:
            record(ring, write_index, tag, seed, 0, 0, 0, 0, 0, BIT_OUT_OF_RANGE)
            seed = -1
        running = link(words, seed)
        position_assert = seed >= 0 and chain_position_assert[0] != 0
        prev_pos = words[seed, F_POSITION] if seed >= 0 else 0
        if begin < 0 or begin >= num_entries:
            record(ring, write_index, tag, -1, 0, 0, 0, as_i64(running), 0, BIT_OUT_OF_RANGE)
            continue
        # Bounded by the entries, as range(begin, end) could overflow its length (end - begin >= 2**63).
        for i in range(begin, min(end, num_entries + 1)):
            if i >= num_entries:
                record(ring, write_index, tag, -1, 0, 0, 0, as_i64(running), 0, BIT_OUT_OF_RANGE)
                break
            slot = out_cache_loc[i]
            if slot < 0:
                continue
            token = input_ids[i]
            position = positions[i]
            if slot >= num_slots:
                record(ring, write_index, tag, slot, position, token, token, as_i64(running), position,
                       BIT_OUT_OF_RANGE)
                continue
            if out_of_range[i]:
                record(ring, write_index, tag, slot, position, token, token, as_i64(running), position,
                       BIT_OUT_OF_RANGE)
            if has_input_assert:
                bits = 0
                if token != expected_tokens[i]:
                    bits |= _BIT_TOKEN
                if position != expected_positions[i]:
                    bits |= _BIT_POSITION
                if bits:
                    record(ring, write_index, tag, slot, position, token, expected_tokens[i], as_i64(running),
                           expected_positions[i], bits)
            if position_assert:
                if position != prev_pos + 1:
                    record(ring, write_index, tag, slot, position, token, token, as_i64(running), prev_pos + 1,
                           _BIT_POSITION)
                prev_pos = position
            words[slot, F_TOKEN] = token
            words[slot, F_POSITION] = position
            words[slot, F_PREV_HASH] = as_i64(running)
            words[slot, F_REAL_KV_HASH] = as_i64(hashes[i])
            running = mix3(running, np.uint64(token), np.uint64(position))
            stored += 1
    slot_run_counter[0] += stored


def write(ctx, wplan, batch, *, stream=None) -> None:
    words = slot_words(ctx)
    count = batch.num_entries
    hashes = np.zeros(count, dtype=np.uint64)
    out_of_range = np.zeros(count, dtype=np.bool_)
    sources, table = source_arguments(ctx)
    if table.shape[0]:
        threads = count >= PARALLEL_MIN_ENTRIES and threads_can_hash(sources)
        hash_slots = hash_slots_parallel if threads else hash_slots_serial
        with one_parallel_call_at_a_time(threads):
            hash_slots(words.shape[0], sources, table, batch.out_cache_loc, hashes, out_of_range)
    unused = batch.input_ids[:0]
    _write(words, hashes, out_of_range, wplan.offsets, wplan.seed_slot_indices, wplan.num_valid_reqs,
           batch.input_ids, batch.positions, batch.out_cache_loc, batch.has_input_assert,
           batch.expected_input_tokens if batch.has_input_assert else unused,
           batch.expected_input_positions if batch.has_input_assert else unused,
           ctx.chain_position_assert, batch.tag, ctx.violation_ring, ctx.violation_write_index,
           ctx.slot_run_counter, ctx.kernel_run_counter)
