// write: stores (token, position, chain, real-KV hash) into the canary slots of the tokens a
// forward pass writes, chaining each slot to its predecessor (SPEC 3.1 and 4).
//
// Work split (kvc_write; decode-shaped batches take kvc_write_decode, in write_decode.cu)
// * The chain of a request is serial: running = mix3(running, token, position). One warp owns a
//   request (or a pair of warps, below). Its 32 lanes load and check 32 entries at a time (the
//   loads of its next 32 are in flight meanwhile); then every lane walks the stored entries of
//   the chunk in lockstep, reading each entry's token and position from shared memory, so the
//   serial part is a chain of mix3 with no global memory access on it. Each lane keeps the chain
//   value (and the previous position) seen just before its own entry, then records its violations
//   and stores its slot in parallel. When a slot repeats inside a chunk only its last entry
//   stores; chunks are ordered by __syncwarp (by the handoff with kPaired), so the slot ends up as
//   the reference leaves it.
// * real_kv_hash(slot) depends on the slot alone, not on the chain, and every entry that is
//   stored gets the same value whichever entry stores it. Requests of up to kInlineMax entries
//   hash inside their own warp (a chunk of a few entries spreads its sources over the lanes).
//   Longer requests hand their hashing to the whole grid: chunk j of request r goes to block
//   (r + 1 + j) mod gridDim, which stores the real_kv_hash word of the slot itself, so hashing
//   runs on many SMs beside the chain.
// * kPaired (requests of several chunks, picked on the host from the shapes): two warps chain a
//   request, walking its chunks in turn. The warp that walked chunk k stores its slots and hands
//   the chain value (and last position) to its partner through shared memory and a named barrier
//   of the two warps, then records chunk k's violations while the partner walks chunk k + 1; the
//   partner checked and staged chunk k + 1 while chunk k was walked. The serial path is then the
//   walks and one handoff a chunk, instead of every chunk's loads, checks, stores and records too.
// * Requests are spread over warps (pairs of warps when kPaired): request r is chained by team
//   (r / gridDim) % teams of block r % gridDim; offloaded hash chunks go to the block's warps from
//   the last one down.
//
// * kRealKv (the context has real-KV sources, picked on the host): without sources the hashing
//   code is compiled out. It is most of the kernel's code, and a decode-sized write with cold
//   instruction caches (after a model forward) spent as long fetching past it as on its memory
//   round trips (tools/decode_probe.py --code).
//
// Rows of one launch reach the ring in no fixed order; the set of rows is the reference's.
// Requests run concurrently. Two requests of one launch may write the same slot only with the same
// record (the same token, position and chain: docs/integration.md's prefix hits on blocks computed
// in the same forward), which the stores leave whole whichever lands last; a request that seeds
// from a slot another writes in the launch races (an engine never builds such a batch).
#include "write_request.cuh"

namespace {
constexpr int kWarps = KVC_WRITE_WARPS;  // the launcher's block size / 32
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = KVC_WRITE_CHUNK;  // entries per warp step and per offloaded hash task
constexpr int kInlineMax = 32;   // requests with at most this many entries hash in their warp
}

// Named barrier 1 + team: both warps of a team (64 threads) meet at each handoff and at the end of
// each request. The giver reaches it after its walk; the taker has by then checked and staged its
// chunk and usually waits there already. (barrier.sync, not bar.sync: lanes may arrive diverged.)
__device__ __forceinline__ void kvc_team_sync(int team) {
    asm volatile("barrier.sync %0, 64;" ::"r"(1 + team) : "memory");
}

// Where the walk of a request that ends at offset e stops: there, or at the end of the n entries
// (the entries past them are one out-of-range row).
__device__ __forceinline__ kvc_i64 kvc_write_end(kvc_i64 e, kvc_i64 n) { return e < n ? e : n; }

// The entries [lo, hi) that request r processes, as the reference walks them. Returns false when
// the request is skipped (begin >= end) or stops at once on a negative begin; a begin at or past n
// returns true with hi <= lo, which the callers' hi - lo > kInlineMax tests read as no entry.
__device__ __forceinline__ bool kvc_write_range(kvc_i64 b, kvc_i64 e, kvc_i64 n, kvc_i64& lo,
                                                kvc_i64& hi) {
    if (b >= e || b < 0) return false;
    lo = b;
    hi = kvc_write_end(e, n);
    return true;
}

// The first chunk of long request r that this block hashes: chunk j goes to block
// (r + 1 + j) mod gridDim, so the block takes j0, j0 + gridDim, ... (none when j0 is past the
// request's chunks).
__device__ __forceinline__ kvc_i64 kvc_first_offloaded_chunk(kvc_i64 r) {
    const kvc_i64 grid = gridDim.x;
    const kvc_i64 block = blockIdx.x;
    return ((block - (r + 1) % grid) % grid + grid) % grid;
}

// The real_kv_hash words of the long requests' chunks handed to this block
// (kvc_first_offloaded_chunk), stored here. Out of line: a decode write has no long
// request and skips it, and with it inline a launch whose code was cold fetched its way past it
// (e2e_decode_steady_hash write with code cold: 12.2 us inline, 9.2 out of line).
__device__ __noinline__ void kvc_write_offloaded_hashes(unsigned char* canary, kvc_i64 num_slots,
                                                        kvc_i64 slot_stride,
                                                        const kvc_i64* __restrict__ offsets,
                                                        const kvc_i64* __restrict__ out_cache_loc,
                                                        kvc_i64 nreq, kvc_i64 n,
                                                        const KvcSources src) {
    __shared__ int s_count;
    __shared__ kvc_i64 s_lo[kThreads];
    __shared__ kvc_i64 s_hi[kThreads];
    __shared__ kvc_i64 s_j0[kThreads];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const kvc_i64 grid = gridDim.x;
    for (kvc_i64 window = 0; window < nreq; window += kThreads) {
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        const kvc_i64 r = window + threadIdx.x;
        kvc_i64 lo, hi;
        if (r < nreq && kvc_write_range(offsets[r], offsets[r + 1], n, lo, hi) &&
            hi - lo > kInlineMax) {
            const kvc_i64 nch = (hi - lo + kChunk - 1) / kChunk;
            const kvc_i64 j0 = kvc_first_offloaded_chunk(r);
            if (j0 < nch) {
                const int d = atomicAdd(&s_count, 1);
                s_lo[d] = lo;
                s_hi[d] = hi;
                s_j0[d] = j0;
            }
        }
        __syncthreads();
        const int count = s_count;
        for (int d = kWarps - 1 - warp; d < count; d += kWarps) {
            const kvc_i64 lo_d = s_lo[d], hi_d = s_hi[d];
            for (kvc_i64 j = s_j0[d]; lo_d + j * kChunk < hi_d; j += grid) {
                const kvc_i64 i = lo_d + j * kChunk + lane;
                if (i >= hi_d) continue;
                const kvc_i64 slot = out_cache_loc[i];
                if (slot < 0 || slot >= num_slots) continue;
                bool oor;
                const kvc_u64 h = kvc_real_kv_hash(src, slot, &oor);
                kvc_slot_words(canary, slot_stride, slot)[KVC_FIELD_REAL_KV_HASH] =
                    (kvc_i64)h;
            }
        }
        __syncthreads();
    }
}

// Without real-KV sources ptxas, left to pick the register count, chose 80 and spilled; one block
// per SM, asked for, is what the launch gets anyway and keeps it whole. (0: no request.)
template <bool kVec16, bool kPaired, bool kRealKv>
__global__ void __launch_bounds__(kThreads, kRealKv ? 0 : 1) kvc_write(
    KVC_WRITE_PARAMS) {
    __shared__ unsigned long long s_stored;
    __shared__ kvc_i64 s_tok[kWarps][kChunk];
    __shared__ kvc_i64 s_pos[kWarps][kChunk];
    __shared__ kvc_u64 s_handoff_chain[kWarps];  // indexed by the receiving warp
    __shared__ kvc_i64 s_handoff_pos[kWarps];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const kvc_i64 grid = gridDim.x;
    const kvc_i64 block = blockIdx.x;
    constexpr int kTeamWarps = kPaired ? 2 : 1;
    constexpr int kTeams = kWarps / kTeamWarps;
    const int team = warp / kTeamWarps;
    const int turn = warp % kTeamWarps;  // this warp walks chunks turn, turn + kTeamWarps, ...
    const kvc_i64 first_request = block + grid * team;
    // Requested before the request count arrives (every write plan row below the capacity exists,
    // and offsets has one more): the warp's first request's offsets and seed, and the entries it
    // writes if it begins at entry first_request (a decode batch, a token a request). A small
    // write is then a chain of two memory round trips, not four.
    kvc_i64 first_b = 0, first_e = 0, first_seed = -1;
    if (first_request < capacity) {
        first_b = kvc_ld_early(offsets + first_request);
        first_e = kvc_ld_early(offsets + first_request + 1);
        first_seed = kvc_ld_early(seed_slots + first_request);
    }
    const kvc_i64 n = num_entries;
    const KvcRing ring = {ring_rows, ring_capacity, ring_write_index};
    const KvcSources src = {source_table, kRealKv ? (int)num_sources : 0};
    const KvcWriteIn w = KVC_WRITE_IN_FROM_PARAMS;
    const bool has_expected = kvc_checks_expected(w);
    const auto record = [&](kvc_i64 slot, kvc_i64 pos, kvc_i64 tok, kvc_i64 etok, kvc_i64 chain,
                            kvc_i64 aux, kvc_i64 bits) {
        kvc_record(ring, tag, slot, pos, tok, etok, chain, aux, bits);
    };
    const KvcWriteEntry guess =
        kvc_request_write_entry(w, first_request + turn * kChunk + lane);
    const kvc_i64 nreq = kvc_clamp_count(*num_valid_reqs, capacity);

    if (threadIdx.x == 0) {
        s_stored = 0;
        if (blockIdx.x == 0) {
            atomicAdd(kernel_run_counter, 1ull);
            kvc_prefetch_word(slot_run_counter);  // the blocks add their stored slots at the end
        }
    }

    // ---- offloaded hashing of long requests --------------------------------------------------
    if (src.count > 0) {
        // which requests are long, their offsets also requested before the count arrives
        kvc_i64 row_b = 0, row_e = 0;
        if ((kvc_i64)threadIdx.x < capacity) {
            row_b = kvc_ld_early(offsets + threadIdx.x);
            row_e = kvc_ld_early(offsets + threadIdx.x + 1);
        }
        int mine = 0;
        for (kvc_i64 r = threadIdx.x; r < nreq; r += kThreads) {
            if (r != threadIdx.x) {
                row_b = offsets[r];
                row_e = offsets[r + 1];
            }
            kvc_i64 lo, hi;
            if (!kvc_write_range(row_b, row_e, n, lo, hi) || hi - lo <= kInlineMax) continue;
            const kvc_i64 nch = (hi - lo + kChunk - 1) / kChunk;
            const kvc_i64 j0 = kvc_first_offloaded_chunk(r);
            if (j0 < nch) mine = 1;
        }
        if (__syncthreads_or(mine)) {
            kvc_write_offloaded_hashes(canary, num_slots, slot_stride, offsets, out_cache_loc, nreq,
                                       n, src);
        }
    }
    __syncthreads();

    // ---- chains ------------------------------------------------------------------------------
    // Entry i's inputs are requested early (kvc_request_write_entry): a chunk's are in flight
    // while the chunk before it is chained.
    unsigned long long stored = 0;
    const kvc_i64 team_stride = (kvc_i64)kTeamWarps * kChunk;
    for (kvc_i64 r = first_request; r < nreq; r += grid * kTeams) {
        const bool first = r == first_request;
        const kvc_i64 b = first ? first_b : offsets[r];
        const kvc_i64 e = first ? first_e : offsets[r + 1];
        if (b >= e) continue;
        kvc_i64 seed = first ? first_seed : seed_slots[r];
        const kvc_i64 hi = kvc_write_end(e, n);
        // A begin past the entries walks none: started at hi, so that a begin near 2^63 plus a
        // chunk cannot wrap (the pair's warps would then walk different chunk counts, and hang).
        const kvc_i64 start = b < hi ? b : hi;
        // The first chunk's entry loads go out before the seed's slot is read (both in flight).
        KvcWriteEntry next = {-1, 0, 0, 0, 0};
        const kvc_i64 first_entry = start + turn * kChunk + lane;
        if (b >= 0 && first_entry < hi) {
            next = first && b == first_request ? guess : kvc_request_write_entry(w, first_entry);
        }
        if (seed >= num_slots) {
            if (lane == 0 && turn == 0) {
                kvc_record(ring, tag, seed, 0, 0, 0, 0, 0, KVC_BIT_OUT_OF_RANGE);
            }
            seed = -1;
        }
        // The seed's slot is requested now. One warp a request (short requests, where one memory
        // round trip counts) takes its link just before the first walk, so the first chunk's
        // real-KV reads go out while it is in flight; a pair (long requests) takes it at once,
        // which keeps the registers of its chain loop free.
        KvcSlot seed_words = {{0, 0, 0, 0}};
        if (seed >= 0) seed_words = kvc_load_slot<kVec16, false>(canary, slot_stride, seed);
        kvc_u64 running = 0;
        kvc_i64 prev_pos = 0;
        const auto start_chain = [&]() { kvc_start_chain(seed, seed_words, running, prev_pos); };
        const kvc_i64 first_base = start + turn * kChunk;
        if (kPaired || b < 0 || first_base >= hi) start_chain();
        const bool pos_assert = seed >= 0 && w.chain_position_assert;
        if (b < 0) {
            if (lane == 0 && turn == 0) {
                kvc_record(ring, tag, -1, 0, 0, 0, (kvc_i64)running, 0, KVC_BIT_OUT_OF_RANGE);
            }
            continue;
        }
        const bool inline_hash = hi - b <= kInlineMax;
        // The warp stores real_kv_hash itself unless the grid hashes this request.
        const bool store_hash = src.count == 0 || inline_hash;

        for (kvc_i64 base = first_base; base < hi; base += team_stride) {
            const kvc_i64 i = base + lane;
            const bool valid = i < hi;
            const kvc_i64 slot = next.slot, tok = next.tok, pos = next.pos, etok = next.etok,
                          epos = next.epos;
            next.slot = -1;
            if (base + team_stride < hi) {
                const kvc_i64 i2 = base + team_stride + lane;
                if (i2 < hi) next = kvc_request_write_entry(w, i2);
            }
            const bool in_range = valid && slot >= 0 && slot < num_slots;
            const bool too_big = valid && slot >= num_slots;
            bool kv_oor = false;
            kvc_u64 h = 0;
            const int entries = (int)kvc_min64(hi - base, kChunk);
            if (src.count > 0 && inline_hash && (kvc_i64)entries * src.count <= 32) {
                // decode-shaped: a few entries, their sources folded by several lanes at once
                h = kvc_real_kv_hash_across_lanes(src, slot, in_range, entries, &kv_oor);
            } else if (in_range && src.count > 0) {
                if (inline_hash) {
                    h = kvc_real_kv_hash(src, slot, &kv_oor);
                } else {
                    kv_oor = kvc_sources_out_of_range(src, slot);
                }
            }
            const unsigned mask = __ballot_sync(KVC_FULL_MASK, in_range);
            // Only the last entry of a repeated slot stores; lanes that store nothing get keys
            // of their own (negative, so never equal to a slot). The match needs the slots
            // alone: asked before the walk, its latency (hundreds of cycles) hides behind the
            // chain instead of stalling the warp after it.
            const kvc_i64 key = in_range ? slot : (kvc_i64)(-2 - lane);
            const unsigned peers = __match_any_sync(KVC_FULL_MASK, key);
            const bool last_of_slot = lane == 31 || (peers >> (lane + 1)) == 0u;

            if (!kPaired && base == first_base) start_chain();
            if (kPaired && base != start) {
                // the chain up to this chunk, from the partner that walked the chunk before it
                kvc_team_sync(team);
                running = s_handoff_chain[warp];
                prev_pos = s_handoff_pos[warp];
            }
            // Serial walk over the stored entries of the chunk, in lockstep on every lane.
            kvc_u64 my_running = running;
            kvc_i64 my_prev = prev_pos;
            if (mask == KVC_FULL_MASK) {
                // Every entry is stored (the prefill case): a fixed 32-step walk over the chunk
                // staged in shared memory; entry j's previous position is entry j-1's.
                s_tok[warp][lane] = tok;
                s_pos[warp][lane] = pos;
                const kvc_i64 up = __shfl_up_sync(KVC_FULL_MASK, pos, 1);
                if (lane > 0) my_prev = up;
                const kvc_i64 last_pos = __shfl_sync(KVC_FULL_MASK, pos, 31);
                __syncwarp();
                // Unrolled by 8, not 32: the fully unrolled walk is 4x the code and measured 3 %
                // slower (tools/chain_probe.py).
#pragma unroll 8
                for (int j = 0; j < kChunk; ++j) {
                    const kvc_u64 t = (kvc_u64)s_tok[warp][j];
                    const kvc_u64 p = (kvc_u64)s_pos[warp][j];
                    if (lane == j) my_running = running;
                    running = kvc_mix3(running, t, p);
                }
                prev_pos = last_pos;
            }
            unsigned m = mask == KVC_FULL_MASK ? 0u : mask;
            while (m) {
                const int j = __ffs(m) - 1;
                m &= m - 1;
                const kvc_i64 t = __shfl_sync(KVC_FULL_MASK, tok, j);
                const kvc_i64 p = __shfl_sync(KVC_FULL_MASK, pos, j);
                running = kvc_mix3(running, (kvc_u64)t, (kvc_u64)p);
                prev_pos = p;
                if (lane > j) {
                    my_running = running;
                    my_prev = prev_pos;
                }
            }

            const bool hand_over = kPaired && base + kChunk < hi;
            if (hand_over) {
                // Stored before the partner can store the next chunk: a slot repeated across
                // chunks keeps its later entry's fields, as the reference leaves it.
                if (in_range && last_of_slot) {
                    kvc_store_slot<kVec16>(canary, slot_stride, slot, tok, pos, my_running, h,
                                           store_hash);
                }
                if (lane == 0) {
                    s_handoff_chain[warp ^ 1] = running;
                    s_handoff_pos[warp ^ 1] = prev_pos;
                }
                kvc_team_sync(team);
            }
            if (too_big) {
                kvc_record(ring, tag, slot, pos, tok, tok, (kvc_i64)my_running, pos,
                           KVC_BIT_OUT_OF_RANGE);
            }
            if (in_range) {
                kvc_record_entry_checks(record, {slot, tok, pos, etok, epos}, my_running, my_prev,
                                        kv_oor, has_expected, pos_assert);
            }
            if (!hand_over && in_range && last_of_slot) {
                kvc_store_slot<kVec16>(canary, slot_stride, slot, tok, pos, my_running, h,
                                       store_hash);
            }
            stored += (unsigned long long)__popc(mask);
            __syncwarp();
        }
        // the final chain value is the warp's that walked the last chunk
        const kvc_i64 nchunks = hi > b ? (hi - b + kChunk - 1) / kChunk : 0;
        const int last_turn = nchunks > 0 ? (int)((nchunks - 1) % kTeamWarps) : 0;
        if (e > n && lane == 0 && turn == last_turn) {
            kvc_record(ring, tag, -1, 0, 0, 0, (kvc_i64)running, 0, KVC_BIT_OUT_OF_RANGE);
        }
        // Every handoff of this request is taken before the next request's can be given.
        if (kPaired) kvc_team_sync(team);
    }
    if (lane == 0 && stored) atomicAdd(&s_stored, stored);
    __syncthreads();
    if (threadIdx.x == 0 && s_stored) atomicAdd(slot_run_counter, s_stored);
}

