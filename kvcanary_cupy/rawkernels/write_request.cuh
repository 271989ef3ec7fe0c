// The write's inputs (SPEC 3.1) and how an entry's are requested, shared by the write kernels and
// the step; and one request's write walked by a single thread, for batches whose requests write a
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

// The parameters of both write kernels, kvc_write and kvc_write_decode (the launcher passes the same
// arguments to either).
#define KVC_WRITE_PARAMS                                                                           \
    unsigned char *canary, kvc_i64 num_slots, kvc_i64 slot_stride,                                \
        const kvc_i64 *__restrict__ offsets, const kvc_i64 *__restrict__ seed_slots,               \
        const int *__restrict__ num_valid_reqs, kvc_i64 capacity,                                  \
        const kvc_i64 *__restrict__ input_ids, const kvc_i64 *__restrict__ positions,              \
        const kvc_i64 *__restrict__ out_cache_loc, const kvc_i64 *__restrict__ expected_tokens,    \
        const kvc_i64 *__restrict__ expected_positions, kvc_i64 num_entries,                       \
        const int *__restrict__ chain_position_assert, kvc_i64 *ring_rows, kvc_i64 ring_capacity,  \
        int *ring_write_index, unsigned long long *slot_run_counter,                               \
        unsigned long long *kernel_run_counter, const kvc_i64 *__restrict__ source_table,          \
        kvc_i64 num_sources, kvc_i64 tag
// The write's inputs from those parameters (with `ring` and `src` in scope).
#define KVC_WRITE_IN_FROM_PARAMS                                                                   \
    KvcWriteIn {                                                                                   \
        input_ids, positions, out_cache_loc, expected_tokens, expected_positions, num_entries,     \
            *chain_position_assert != 0, ring, src, tag                                            \
    }

// One new token's inputs, requested with kvc_ld_early where they are written so that they overlap
// other work: the write kernel requests a chunk while it chains the one before; a decode write,
// with little else in flight, requests entry i + 1 (and the first entry beside the seed) early.
struct KvcWriteEntry {
    kvc_i64 slot, tok, pos, etok, epos;
};

__device__ __forceinline__ bool kvc_checks_expected(const KvcWriteIn& w) {
    return w.expected_tokens != nullptr && w.expected_positions != nullptr;
}

// Asks L2 for every entry's inputs (kvc_prefetch_l2, the block's threads a line each), for a write
// that reads them once a grid-wide handoff is done.
__device__ __forceinline__ void kvc_prefetch_write_entries(const KvcWriteIn& w) {
    kvc_prefetch_l2(w.input_ids, w.num_entries * 8);
    kvc_prefetch_l2(w.positions, w.num_entries * 8);
    kvc_prefetch_l2(w.out_cache_loc, w.num_entries * 8);
    kvc_prefetch_l2(w.expected_tokens, w.num_entries * 8);
    kvc_prefetch_l2(w.expected_positions, w.num_entries * 8);
}

// kPredicated: every read one predicated load (kvc_ld_early_if), in the block of the loads beside it,
// for kvc_write_decode, whose guess is the first round trip's; the other callers keep the branch (in
// kvc_write on sm_80 the predicated form spilled).
template <bool kPredicated = false>
__device__ __forceinline__ KvcWriteEntry kvc_request_write_entry(const KvcWriteIn& w, kvc_i64 i) {
    const bool listed = i >= 0 && i < w.num_entries;
    const bool expected = listed && kvc_checks_expected(w);
    KvcWriteEntry e = {-1, 0, 0, 0, 0};
    if (kPredicated) {
        const kvc_i64 at = listed ? i : 0;  // not read unless listed
        e.slot = kvc_ld_early_if(w.out_cache_loc + at, listed, -1);
        e.tok = kvc_ld_early_if(w.input_ids + at, listed, 0);
        e.pos = kvc_ld_early_if(w.positions + at, listed, 0);
        e.etok = kvc_ld_early_if(expected ? w.expected_tokens + at : w.input_ids, expected, 0);
        e.epos = kvc_ld_early_if(expected ? w.expected_positions + at : w.input_ids, expected, 0);
    } else if (listed) {
        e.slot = kvc_ld_early(w.out_cache_loc + i);
        e.tok = kvc_ld_early(w.input_ids + i);
        e.pos = kvc_ld_early(w.positions + i);
        if (expected) {
            e.etok = kvc_ld_early(w.expected_tokens + i);
            e.epos = kvc_ld_early(w.expected_positions + i);
        }
    }
    return e;
}

// The chain before a request's first entry: its seed slot's link and position (seed_words, as the
// caller read it), or for a request without a seed (seed < 0) the anchor's link and position 0.
__device__ __forceinline__ void kvc_start_chain(kvc_i64 seed, const KvcSlot& seed_words,
                                                kvc_u64& running, kvc_i64& prev_pos) {
    running = seed >= 0 ? kvc_slot_link(seed_words) : kvc_anchor_link();
    prev_pos = seed >= 0 ? seed_words.w[KVC_FIELD_POSITION] : 0;
}

// The rows of an entry whose slot is in range (SPEC 3.1): its real-KV sources out of range, its
// token and position unlike the expected ones, its position not one past the previous one
// (prev_pos). chain: the chain value before the entry. record(slot, position, stored token,
// expected token, stored chain, expected aux, bits) records a row.
template <class Record>
__device__ __forceinline__ void kvc_record_entry_checks(const Record& record, const KvcWriteEntry& e,
                                                        kvc_u64 chain, kvc_i64& prev_pos,
                                                        bool kv_oor, bool has_expected,
                                                        bool position_assert) {
    if (kv_oor) {
        record(e.slot, e.pos, e.tok, e.tok, (kvc_i64)chain, e.pos, KVC_BIT_OUT_OF_RANGE);
    }
    if (has_expected) {
        kvc_i64 bits = 0;
        if (e.tok != e.etok) bits |= KVC_BIT_WRITE_TOKEN;
        if (e.pos != e.epos) bits |= KVC_BIT_WRITE_POSITION;
        if (bits) record(e.slot, e.pos, e.tok, e.etok, (kvc_i64)chain, e.epos, bits);
    }
    if (position_assert) {
        const kvc_i64 want = kvc_wrap_add(prev_pos, 1);
        if (e.pos != want) {
            record(e.slot, e.pos, e.tok, e.tok, (kvc_i64)chain, want, KVC_BIT_WRITE_POSITION);
        }
        prev_pos = e.pos;
    }
}

// The real_kv_hash of the write's entries 0 .. count - 1, computed ahead by a caller that has time
// to spare before it may store (the step's block 0, while the other blocks verify): the hash of
// entry i and its out-of-range flag, bit i % 32 of out_of_range[i / 32]. Entries past count have
// none (the caller's bound keeps every entry below it).
struct KvcAheadHashes {
    const kvc_u64* hash;
    const unsigned* out_of_range;
    kvc_i64 count;
};

// Writes entries [begin, end) chained from seed; returns how many slots it stored. With
// have_first, `first` holds entry begin's inputs, requested by the caller already; with
// seed_words, the seed's slot as the caller read it (when the seed is in range); with ahead
// (kLanes 1 only), the entries' real_kv_hash as the caller computed them: the walk then reads no
// source, and holds none of their reads' registers.
// kLanes > 1: an aligned group of kLanes lanes walks the request together, each folding a share
// of the real-KV sources (kvc_request_in_group and kvc_hash_in_group, with the lane's own_source);
// the group's first lane records and stores. kShortReads: see kvc_hash_in_group.
template <bool kVec16, int kLanes = 1, bool kShortReads = false>
__device__ __forceinline__ unsigned long long kvc_write_request(
    const KvcCanary& c, const KvcWriteIn& w, kvc_i64 begin, kvc_i64 end, kvc_i64 seed,
    const KvcWriteEntry& first, bool have_first, const KvcSlot* seed_words = nullptr,
    const KvcSourceDesc* own_source = nullptr, const KvcAheadHashes* ahead = nullptr) {
    if (begin >= end) return 0;
    const bool has_expected = kvc_checks_expected(w);
    const bool leader = kLanes == 1 || (threadIdx.x & (kLanes - 1)) == 0;
    // A group records out of line (kvc_record_cold); a thread alone keeps its records inline: in
    // the step, whose block size caps it at 128 registers, the call's saved registers spilled.
    const auto record = [&](kvc_i64 slot, kvc_i64 pos, kvc_i64 tok, kvc_i64 etok, kvc_i64 chain,
                            kvc_i64 aux, kvc_i64 bits) {
        if (kLanes > 1) {
            if (leader) kvc_record_cold(w.ring, w.tag, slot, pos, tok, etok, chain, aux, bits);
        } else {
            kvc_record(w.ring, w.tag, slot, pos, tok, etok, chain, aux, bits);
        }
    };
    KvcWriteEntry next = have_first ? first : kvc_request_write_entry(w, begin);
    if (seed >= c.num_slots) {
        record(seed, 0, 0, 0, 0, 0, KVC_BIT_OUT_OF_RANGE);
        seed = -1;
    }
    // The seed's slot is read now. With real-KV sources it is linked once the first entry's
    // sources are requested, so waiting for the seed never holds their reads back.
    KvcSlot seed_slot = {{0, 0, 0, 0}};
    if (seed >= 0) {
        seed_slot = seed_words != nullptr
                        ? *seed_words
                        : kvc_load_slot<kVec16, false>(c.buf, c.slot_stride, seed);
    }
    kvc_u64 running = 0;
    kvc_i64 prev_pos = 0;
    const auto start_chain = [&]() { kvc_start_chain(seed, seed_slot, running, prev_pos); };
    const bool link_after_sources = w.src.count > 0;
    if (!link_after_sources) start_chain();
    const bool position_assert = seed >= 0 && w.chain_position_assert;
    unsigned long long stored = 0;
    for (kvc_i64 i = begin; i < end; ++i) {
        const bool listed = i >= 0 && i < w.num_entries;
        const KvcWriteEntry e = next;  // slot -1 for an entry that is not listed
        if (listed && i + 1 < end) next = kvc_request_write_entry(w, i + 1);
        const kvc_i64 slot = e.slot;
        bool kv_oor = false;
        kvc_u64 h = 0;
        const bool hashed = w.src.count > 0 && slot >= 0 && slot < c.num_slots;
        // The seed's words pass kvc_after_requests before its link is made: otherwise the link's
        // first steps were hoisted above the loop, and the sources were requested only once the
        // seed's slot had come (SASS of kvc_write_decode and of the step's tail write).
        const auto link_seed_after_requests = [&]() {
#pragma unroll
            for (int f = 0; f < 4; ++f) seed_slot.w[f] = kvc_after_requests(seed_slot.w[f]);
            start_chain();
        };
        if (kLanes == 1) {
            if (hashed && ahead != nullptr) {
                const bool held = i < ahead->count;  // i >= 0: a listed entry
                h = held ? ahead->hash[i] : 0ull;
                kv_oor = held && ((ahead->out_of_range[i >> 5] >> (i & 31)) & 1u) != 0;
            } else if (hashed) {
                h = kvc_real_kv_hash_prefetched(w.src, slot, &kv_oor);
            }
            if (link_after_sources && i == begin) link_seed_after_requests();
        } else {
            // the seed's link is made while the group's sources are read, not after their folds
            KvcGroupSource g = {};
            if (hashed) g = kvc_request_in_group<kLanes>(w.src, *own_source, slot);
            if (link_after_sources && i == begin) link_seed_after_requests();
            if (hashed) h = kvc_hash_in_group<kLanes, kShortReads>(w.src, g, slot, &kv_oor);
        }
        if (!listed) {
            record(-1, 0, 0, 0, (kvc_i64)running, 0, KVC_BIT_OUT_OF_RANGE);
            break;
        }
        if (slot < 0) continue;
        const kvc_i64 tok = e.tok;
        const kvc_i64 pos = e.pos;
        if (slot >= c.num_slots) {
            record(slot, pos, tok, tok, (kvc_i64)running, pos, KVC_BIT_OUT_OF_RANGE);
            continue;
        }
        kvc_record_entry_checks(record, e, running, prev_pos, kv_oor, has_expected, position_assert);
        if (leader) kvc_store_slot<kVec16>(c.buf, c.slot_stride, slot, tok, pos, running, h, true);
        running = kvc_mix3(running, (kvc_u64)tok, (kvc_u64)pos);
        if (leader) ++stored;
    }
    return stored;
}
