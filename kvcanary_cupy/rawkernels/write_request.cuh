// One request's write (SPEC 3.1) walked by a single thread, for batches whose requests write a
// token or a few each (decode): a thread per request has nothing to hand to other lanes, and the
// serial walk is the reference's order, entry by entry.
#pragma once
#include "verify_entry.cuh"

struct KvcWriteIn {
    const kvc_i64* input_ids;
    const kvc_i64* positions;
    const kvc_i64* out_cache_loc;
    const kvc_i64* expected_tokens;     // nullptr: no input assert
    const kvc_i64* expected_positions;  // nullptr: no input assert
    kvc_i64 num_entries;
    bool chain_position_assert;
    KvcRing ring;
    KvcSources src;
    kvc_i64 tag;
};

// Writes entries [begin, end) chained from seed; returns how many slots it stored.
template <bool kVec16>
__device__ __forceinline__ unsigned long long kvc_write_request(const KvcCanary& c,
                                                                const KvcWriteIn& w,
                                                                kvc_i64 begin, kvc_i64 end,
                                                                kvc_i64 seed) {
    if (begin >= end) return 0;
    const bool has_expected = w.expected_tokens != nullptr && w.expected_positions != nullptr;
    if (seed >= c.num_slots) {
        kvc_record(w.ring, w.tag, seed, 0, 0, 0, 0, 0, KVC_BIT_OUT_OF_RANGE);
        seed = -1;
    }
    kvc_u64 running;
    kvc_i64 prev_pos;
    if (seed >= 0) {
        const KvcSlot s = kvc_load_slot<kVec16, false>(c.buf, c.slot_stride, seed);
        running = kvc_slot_link(s);
        prev_pos = s.w[KVC_FIELD_POSITION];
    } else {
        running = kvc_anchor_link();
        prev_pos = 0;
    }
    const bool position_assert = seed >= 0 && w.chain_position_assert;
    unsigned long long stored = 0;
    for (kvc_i64 i = begin; i < end; ++i) {
        if (i < 0 || i >= w.num_entries) {
            kvc_record(w.ring, w.tag, -1, 0, 0, 0, (kvc_i64)running, 0, KVC_BIT_OUT_OF_RANGE);
            break;
        }
        const kvc_i64 slot = w.out_cache_loc[i];
        if (slot < 0) continue;
        const kvc_i64 tok = w.input_ids[i];
        const kvc_i64 pos = w.positions[i];
        if (slot >= c.num_slots) {
            kvc_record(w.ring, w.tag, slot, pos, tok, tok, (kvc_i64)running, pos,
                       KVC_BIT_OUT_OF_RANGE);
            continue;
        }
        bool kv_oor = false;
        const kvc_u64 h = w.src.count > 0 ? kvc_real_kv_hash_prefetched(w.src, slot, &kv_oor) : 0ull;
        if (kv_oor) {
            kvc_record(w.ring, w.tag, slot, pos, tok, tok, (kvc_i64)running, pos,
                       KVC_BIT_OUT_OF_RANGE);
        }
        if (has_expected) {
            const kvc_i64 etok = w.expected_tokens[i];
            const kvc_i64 epos = w.expected_positions[i];
            kvc_i64 bits = 0;
            if (tok != etok) bits |= KVC_BIT_WRITE_TOKEN;
            if (pos != epos) bits |= KVC_BIT_WRITE_POSITION;
            if (bits) kvc_record(w.ring, w.tag, slot, pos, tok, etok, (kvc_i64)running, epos, bits);
        }
        if (position_assert) {
            const kvc_i64 want = kvc_wrap_add(prev_pos, 1);
            if (pos != want) {
                kvc_record(w.ring, w.tag, slot, pos, tok, tok, (kvc_i64)running, want,
                           KVC_BIT_WRITE_POSITION);
            }
            prev_pos = pos;
        }
        kvc_store_slot<kVec16>(c.buf, c.slot_stride, slot, tok, pos, running, h, true);
        running = kvc_mix3(running, (kvc_u64)tok, (kvc_u64)pos);
        ++stored;
    }
    return stored;
}

// Adds the block's stored counts to the slot-run counter with one atomic. Every thread of the
// block calls it.
__device__ __forceinline__ void kvc_count_stored(unsigned long long* s_total,
                                                 unsigned long long mine,
                                                 unsigned long long* slot_run_counter) {
    if (threadIdx.x == 0) *s_total = 0;
    __syncthreads();
    if (mine) atomicAdd(s_total, mine);
    __syncthreads();
    if (threadIdx.x == 0 && *s_total) atomicAdd(slot_run_counter, *s_total);
}
