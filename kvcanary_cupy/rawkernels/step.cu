// step: one forward's canary work straight from the engine's batch metadata (SPEC 3.3, 3.2 and
// 3.1 in one launch): the verify of every prefix slot the batch reads, then the write of its new
// tokens. Equal to plan (with a verify plan of capacity v_capacity) + verify + write.
//
// * Verify entries are derived where they are checked: each block stages a tile of requests
//   (scan of the entry counts, as the plan kernel does) and the grid strides over the tile's
//   entries, reading req_to_token (coalesced, 4 bytes an entry) instead of a 32-byte plan row
//   written by one kernel and read back by the next.
// * kTailWrite (decode batches of at most 32 requests, picked on the host from the shapes): the
//   last block to finish its verify work writes the new tokens, a lane of its first warp per
//   request, the write plan scanned with shuffles. Verify reads every slot before any is written,
//   as with separate launches: every block publishes its completion (an acq_rel add) and only the
//   last one writes; it resets the counter for the next launch or graph replay.
//   Such a step is a chain of memory round trips with little else in flight, so it shortens the
//   chain: the batch's verify entries are staged per warp (no block scan), the write's metadata
//   and the entry each request writes in a decode batch are requested when the kernel starts, and
//   the launch's counters take one atomic each.
// * Otherwise block 0 stores the write plan (and verifies nothing, in a grid of several blocks).
//   For decode batches of up to kThreads requests (the host's plan_block_write) it then writes
//   them too, a thread a request: it reads the plan it stored, the entries, the seeds' slots and
//   the new slots' real-KV bytes (hashed ahead, an entry a thread) while the other blocks verify,
//   waits until every one of them has published its completion, and stores. Otherwise the write
//   kernel runs next.
// * kRealKv, as in the write kernel: without real-KV sources the hashing code is compiled out,
//   which a decode step with cold instruction caches feels as much as its memory round trips.
#include "batch_plan.cuh"
#include "write_request.cuh"

// Blocks per SM the register budget must allow. Verify is a latency-bound gather that wants warps
// in flight: two blocks (64 registers a thread) fit the verify body without spilling. The last-block
// write of kTailWrite needs more, and runs for small batches only. KVC_STEP_MIN_BLOCKS overrides
// the verify variant's bound (tools/decode_probe.py tries others).
#ifndef KVC_STEP_MIN_BLOCKS
#define KVC_STEP_MIN_BLOCKS 2
#endif

namespace {
constexpr int kThreads = KVC_STEP_THREADS;  // the launcher's block size
constexpr int kWarps = kThreads / 32;
constexpr int kTailMaxRequests = KVC_STEP_TAIL_MAX_REQUESTS;  // the host's tail_write bound
// How long block 0 waits for the verify blocks before it writes anyway: far past any verify share
// a decode batch of kThreads requests can have, even time-sliced with other work on the GPU.
constexpr unsigned long long kWaitLimitNs = 1000000000ull;
static_assert(kTailMaxRequests <= 32, "the tail write takes a request per lane of one warp");
// The new tokens whose real-KV hash block 0 computes ahead: the host's plan_block_write sends at
// most kThreads requests and at most two new tokens a request on average (num_entries <= 2 * bs),
// so every entry of the batch is below this bound.
constexpr int kAheadEntries = 2 * kThreads;
}

// What the write plan needs of request r (pool row, prefix and extend lengths), requested early.
struct KvcWriteMeta {
    kvc_i64 rp, prefix, ext;
};

__device__ __forceinline__ KvcWriteMeta kvc_request_write_meta(const KvcPlanIn& in, kvc_i64 r) {
    KvcWriteMeta m = {0, 0, 0};
    if (r < in.bs) {
        m.rp = kvc_ld_early(in.req_pool_indices + r);
        m.prefix = kvc_ld_early(in.prefix_lens + r);
        m.ext = kvc_ld_early(in.extend_lens + r);
    }
    return m;
}

// The check of one lane's entry (kvc_verify_entry's), every lane of the warp taking part. When
// lane - 1 holds entry k - 1 of the same request, its slot is this entry's predecessor: the slot
// number and the chain link it gives come from that lane instead of a second read.
template <bool kVec16>
__device__ __forceinline__ void kvc_verify_warp_entry(const KvcPlanIn& in, const KvcCanary& c,
                                                      const KvcVerifyOut& out, const KvcEntry& e) {
    const int lane = threadIdx.x & 31;
    const kvc_i64 slot = e.live ? kvc_resolve(in, e.rp, e.pos) : KVC_PADDING_SLOT;
    const kvc_i64 left_request = __shfl_up_sync(KVC_FULL_MASK, e.live ? e.request : -1, 1);
    const kvc_i64 left_slot = __shfl_up_sync(KVC_FULL_MASK, slot, 1);
    const bool from_left = e.live && lane > 0 && left_request == e.request;
    kvc_i64 prev = -1;
    if (from_left) prev = left_slot;
    else if (e.live && e.pos > 0) prev = kvc_resolve(in, e.rp, e.pos - 1);

    const bool readable = e.live && kvc_slot_in_range(c, slot);
    KvcSlot s = {{0, 0, 0, 0}};
    kvc_u64 own_link = 0;
    if (readable) {
        s = kvc_load_slot<kVec16, true>(c.buf, c.slot_stride, slot);
        own_link = kvc_slot_link(s);
    }
    const kvc_u64 left_link = __shfl_up_sync(KVC_FULL_MASK, own_link, 1);
    if (!e.live || slot == KVC_PADDING_SLOT) return;
    const kvc_i64 expected =
        out.check_token ? kvc_expected(in, e.request, e.rp, e.pos) : KVC_NO_EXPECTED_TOKEN;
    if (!readable) {
        kvc_record_out_of_range(out, slot, expected, e.pos);
        return;
    }
    // from_left with prev in range: the left lane read prev and computed its link
    const kvc_u64 link = kvc_predecessor_link<kVec16>(c, prev, from_left, left_link);
    kvc_check_slot(c, out, slot, s, expected, e.pos, prev, link);
}

template <bool kVec16, bool kTailWrite, bool kRealKv>
__global__ void __launch_bounds__(kThreads, kTailWrite ? 1 : KVC_STEP_MIN_BLOCKS) kvc_step(
    // the canary context
    unsigned char* canary, kvc_i64 num_slots, kvc_i64 slot_stride, kvc_i64* ring_rows,
    kvc_i64 ring_capacity, int* ring_write_index, unsigned long long* slot_run_counter,
    unsigned long long* kernel_run_counter, const kvc_i64* __restrict__ source_table,
    kvc_i64 num_sources, const int* __restrict__ chain_position_assert,
    // the batch metadata, as plan takes it
    KVC_PLAN_IN_PARAMS,
    // the verify
    kvc_i64 v_capacity, kvc_i64 verify_tag, kvc_i64 check_expected_token,
    // the write plan (stored when the write kernel follows)
    kvc_i64* w_offsets, kvc_i64* w_seeds, int* w_num_valid_reqs, kvc_i64 w_capacity,
    // the write (kTailWrite)
    const kvc_i64* __restrict__ input_ids, const kvc_i64* __restrict__ positions,
    const kvc_i64* __restrict__ out_cache_loc, const kvc_i64* __restrict__ expected_tokens,
    const kvc_i64* __restrict__ expected_positions, kvc_i64 num_entries, kvc_i64 write_tag,
    unsigned int* blocks_done,
    // not kTailWrite: block 0 writes (the host's plan_block_write)
    kvc_i64 plan_block_writes) {
    __shared__ kvc_i64 s_warp[kWarps];
    __shared__ kvc_i64 s_start[kThreads];
    __shared__ kvc_i64 s_rp[kThreads];
    __shared__ kvc_i64 s_pos0[kThreads];
    __shared__ bool s_last;
    // the new slots' real-KV hashes, computed ahead by block 0 (plan_block_writes)
    __shared__ kvc_u64 s_kv_hash[kRealKv ? kAheadEntries : 1];
    __shared__ unsigned s_kv_oor[kRealKv ? kAheadEntries / 32 : 1];

    const KvcPlanIn in = KVC_PLAN_IN_FROM_PARAMS;
    const KvcEntryTile entries = {s_start, s_rp, s_pos0};
    const KvcCanary c = {canary, num_slots, slot_stride};
    const KvcRing ring = {ring_rows, ring_capacity, ring_write_index};
    const KvcSources src = {source_table, kRealKv ? (int)num_sources : 0};
    const bool check_token = check_expected_token != 0;
    const KvcVerifyOut out = {ring, src, verify_tag, check_token};
    const int tid = threadIdx.x;

    // kTailWrite is for batches of at most 32 requests (the host's tail_write), so that its kernel
    // holds the small-batch path alone: less code to fetch on a cold SM and no spills.
    if (kTailWrite && bs > kTailMaxRequests) return;
    // kTailWrite: what the write needs first is requested now, in flight while the block verifies.
    // Every warp reads the batch's metadata (its verify entries are staged per warp); the first
    // warp also reads entry `lane`, the entry a decode batch's request `lane` writes.
    const KvcWriteIn w = {input_ids, positions, out_cache_loc, expected_tokens, expected_positions,
                          num_entries, kTailWrite && *chain_position_assert != 0, ring, src,
                          write_tag};
    if (blockIdx.x == 0 && tid == 0) {
        kvc_prefetch_word(kernel_run_counter);
        kvc_prefetch_word(slot_run_counter);
        if ((kTailWrite || plan_block_writes) && gridDim.x > 1) kvc_prefetch_word(blocks_done);
    }
    KvcWriteMeta first_meta = {0, 0, 0};
    KvcWriteEntry guess = {-1, 0, 0, 0, 0};
    if (kTailWrite) first_meta = kvc_request_write_meta(in, tid & 31);
    if (kTailWrite && tid < 32) guess = kvc_request_write_entry(w, tid);
    if (kTailWrite && blockIdx.x == 0 && gridDim.x > 1) {
        // what the last block reads once every block has verified (a grid of one block reads it
        // soon enough: there the prefetch measured 0.5 us slower)
        kvc_prefetch_l2(extend_lens, bs * 8);
        kvc_prefetch_write_entries(w);
    }

    // ---- verify ----------------------------------------------------------------------------
    kvc_i64 carry_w = 0;
    // The lanes of a warp share the entry search and their neighbours' slots. (Deriving a warp's
    // next entries before checking these measured slower: at 64 registers the lookahead spills.)
    // The plan's num_valid is an int32: no entry at or past 2^31 - 1 is checked.
    const auto verify = [&](const KvcEntry& e, kvc_i64) {
        kvc_verify_warp_entry<kVec16>(in, c, out, e);
    };
    // Otherwise block 0 of a grid of several stores the write plan and verifies nothing: the seeds'
    // round trips (req_to_token, then the SWA LUT) would lengthen its verify share, and the launch
    // ends with its slowest block. Block 1, a verify block, counts the launch's runs.
    const bool plan_block_apart = !kTailWrite && gridDim.x > 1;
    const auto write_plan_tile = [&](kvc_i64 tile) {
        carry_w = kvc_write_plan_tile<kThreads>(in, tile, carry_w, w_offsets, w_seeds, w_capacity,
                                                s_warp);
    };
    kvc_i64 total = 0;
    if (kTailWrite) {
        total = kvc_for_small_batch_verify_entries<kThreads>(
            in, entries, first_meta.rp, first_meta.prefix, v_capacity, KVC_INT32_MAX,
            kvc_whole_grid(), verify);
    } else if (plan_block_apart && blockIdx.x == 0) {
        for (kvc_i64 tile = 0; tile < bs; tile += kThreads) write_plan_tile(tile);
        if (plan_block_writes != 0) kvc_prefetch_write_entries(w);
        // With real-KV sources every new slot's bytes are read and hashed now, an entry a thread,
        // while the other blocks verify (no verify reads them). Hashed in the request walk of the
        // write below, with the seed and the first entry held across the wait, they spilled at 64
        // registers.
        if (kRealKv && plan_block_writes != 0) {
#pragma unroll 1
            for (int i = tid; i < kAheadEntries; i += kThreads) {
                const kvc_i64 slot = i < num_entries ? out_cache_loc[i] : -1;
                bool out_of_range = false;
                kvc_u64 hash = 0;
                if (kvc_slot_in_range(c, slot)) {
                    hash = kvc_real_kv_hash<1>(src, slot, &out_of_range);
                }
                s_kv_hash[i] = hash;
                const unsigned oor_bits = __ballot_sync(KVC_FULL_MASK, out_of_range);
                if ((tid & 31) == 0) s_kv_oor[i >> 5] = oor_bits;
            }
        }
    } else {
        const KvcEntryBlocks blocks =
            plan_block_apart ? KvcEntryBlocks{(kvc_i64)blockIdx.x - 1, (kvc_i64)gridDim.x - 1}
                             : kvc_whole_grid();
        total = kvc_for_verify_entries<kThreads>(
            in, entries, s_warp, v_capacity, KVC_INT32_MAX, blocks,
            [&](kvc_i64 tile) {
                if (!plan_block_apart) write_plan_tile(tile);
            },
            verify);
    }
    // slots the verify counts as checked (none when the plan would overflow)
    const unsigned long long verified =
        total <= v_capacity ? (unsigned long long)kvc_min64(total, KVC_INT32_MAX) : 0ull;

    if (!kTailWrite) {
        if (blockIdx.x == (plan_block_apart ? 1u : 0u) && tid == 0) {
            atomicAdd(kernel_run_counter, 1ull);
            if (verified) atomicAdd(slot_run_counter, verified);
        }
        kvc_finish_write_plan<kThreads>(bs, carry_w, w_offsets, w_seeds, w_num_valid_reqs,
                                        w_capacity);
        if (plan_block_writes == 0) return;
        if (blockIdx.x != 0) {
            // a verify block: its reads (and ring rows) are done before it says so
            __syncthreads();
            if (tid == 0) kvc_release_add(blocks_done, 1u);
            return;
        }
        // ---- write of a decode batch of up to kThreads requests, by block 0 ------------------
        // A thread a request (the host's plan_block_write takes at most kThreads), from the write
        // plan this block stored. What it reads is read while the other blocks verify (the seed's
        // slot too: verify writes no slot); it waits for every verify block before it stores
        // anything or records a row.
        __syncthreads();  // the write plan is stored (and the hashes ahead)
        const KvcAheadHashes ahead = {s_kv_hash, s_kv_oor, kvc_min64(num_entries, kAheadEntries)};
        KvcWriteIn wl = w;  // w reads the position-assert cell for kTailWrite only
        wl.chain_position_assert = *chain_position_assert != 0;
        const kvc_i64 rows = kvc_min64(bs, w_capacity);
        kvc_i64 begin = 0, end = 0, seed = -1;
        KvcSlot seed_words = {{0, 0, 0, 0}};
        KvcWriteEntry first = {-1, 0, 0, 0, 0};
        if (tid < rows) {
            begin = w_offsets[tid];
            end = w_offsets[tid + 1];
            seed = w_seeds[tid];
            if (seed >= 0 && seed < num_slots) {
                seed_words = kvc_load_slot<kVec16, false>(canary, slot_stride, seed);
            }
            if (begin < end) first = kvc_request_write_entry(wl, begin);
        }
        if (tid == 0) {
            kvc_wait_for_count(blocks_done, gridDim.x - 1, kWaitLimitNs);
            *blocks_done = 0u;
        }
        __syncthreads();
        unsigned long long stored = 0;
        if (tid < rows) {
            stored = kvc_write_request<kVec16>(c, wl, begin, end, seed, first, true, &seed_words,
                                               nullptr, kRealKv ? &ahead : nullptr);
        }
        stored = kvc_warp_sum(stored);
        if ((tid & 31) == 0 && stored) atomicAdd(slot_run_counter, stored);
        if (tid == 0) atomicAdd(kernel_run_counter, 1ull);
        return;
    }

    // ---- write, by the last block to finish verifying ---------------------------------------
    // The write waits for every verify read: each block says when it is done, and only the last
    // one goes on (it resets the counter below).
    __syncthreads();  // the block's work is done before it says so
    if (gridDim.x > 1) {
        if (tid == 0) s_last = kvc_acq_rel_add(blocks_done, 1u) == gridDim.x - 1;
        __syncthreads();
        if (!s_last) return;
    }
    // A thread per request: the first warp writes, scanning with shuffles, with no barrier left on
    // its path.
    if (tid >= 32) return;
    unsigned long long stored = 0;
    kvc_i64 seed = -1, cnt = 0;
    if (tid < bs) {
        cnt = kvc_write_count(in, first_meta.rp, first_meta.prefix, first_meta.ext, &seed);
    }
    const kvc_i64 incl = kvc_warp_scan<false>(cnt);
    if (tid < bs) {
        const kvc_i64 begin = kvc_wrap_add(incl, -cnt);
        // guess holds entry tid's inputs
        stored = kvc_write_request<kVec16>(c, w, begin, kvc_wrap_add(begin, cnt), seed, guess,
                                           begin == (kvc_i64)tid);
    }
    stored = kvc_warp_sum(stored);
    if (tid == 0) {
        // the verify's run and the write's, counted once the launch has done both
        atomicAdd(kernel_run_counter, 2ull);
        if (verified + stored) atomicAdd(slot_run_counter, verified + stored);
        if (gridDim.x > 1) *blocks_done = 0u;
    }
}
