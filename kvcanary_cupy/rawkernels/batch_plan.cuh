// Engine batch metadata and how plan entries are derived from it (SPEC 3.3), shared by the plan
// kernel, which materialises the entries, and the step kernel, which checks them where it derives
// them.
#pragma once
#include "canary_common.cuh"

struct KvcPlanIn {
    const kvc_i64* req_pool_indices;
    const kvc_i64* prefix_lens;
    const kvc_i64* extend_lens;
    kvc_i64 bs;
    const int* req_to_token;
    kvc_i64 rows, width, row_stride;  // row_stride in elements
    kvc_i64 swa_window;
    bool has_lut;  // a LUT was given (it may be empty: then every slot >= 0 is unresolved)
    const kvc_i64* lut;
    kvc_i64 lut_len;
    bool has_expected;  // an expected-token pool (and its valid lengths) was given
    const int* expected_pool;
    kvc_i64 exp_rows, exp_cols, exp_stride;
    const kvc_i64* valid_lens;
    kvc_i64 token_offset;
};

// The batch metadata as kernel parameters (the plan and step kernels take the same ones, in this
// order: ops/backends/_cuda/plan.py batch_args) and the KvcPlanIn made of them.
#define KVC_PLAN_IN_PARAMS                                                                         \
    const kvc_i64 *__restrict__ req_pool_indices, const kvc_i64 *__restrict__ prefix_lens,         \
        const kvc_i64 *__restrict__ extend_lens, kvc_i64 bs, const int *__restrict__ req_to_token, \
        kvc_i64 rows, kvc_i64 width, kvc_i64 row_stride, kvc_i64 swa_window, kvc_i64 has_lut,      \
        const kvc_i64 *__restrict__ lut, kvc_i64 lut_len, kvc_i64 has_expected,                    \
        const int *__restrict__ expected_pool, kvc_i64 exp_rows, kvc_i64 exp_cols,                 \
        kvc_i64 exp_stride, const kvc_i64 *__restrict__ valid_lens, kvc_i64 token_offset
#define KVC_PLAN_IN_FROM_PARAMS                                                                    \
    KvcPlanIn {                                                                                    \
        req_pool_indices, prefix_lens, extend_lens, bs, req_to_token, rows, width, row_stride,     \
            swa_window, has_lut != 0, lut, lut_len, has_expected != 0, expected_pool, exp_rows,    \
            exp_cols, exp_stride, valid_lens, token_offset                                         \
    }

// Whether (rp, pos) is a cell of req_to_token.
__device__ __forceinline__ bool kvc_in_table(const KvcPlanIn& in, kvc_i64 rp, kvc_i64 pos) {
    return rp >= 0 && rp < in.rows && pos >= 0 && pos < in.width;
}

// tr(req_to_token[rp, pos]), or UNRESOLVED for a cell outside the table.
__device__ __forceinline__ kvc_i64 kvc_resolve(const KvcPlanIn& in, kvc_i64 rp, kvc_i64 pos) {
    if (!kvc_in_table(in, rp, pos)) return KVC_UNRESOLVED_SLOT;
    const kvc_i64 s = (kvc_i64)in.req_to_token[rp * in.row_stride + pos];
    if (!in.has_lut || s < 0) return s;
    return s < in.lut_len ? in.lut[s] : KVC_UNRESOLVED_SLOT;
}

// The expected-token pool's column for pos, and whether (rp, column) is a cell of the pool (never
// when no pool was given). pos >= 0, so pos + token_offset can only overflow upwards, past any
// valid length: the column is then -1, outside the pool.
struct KvcExpectedCell {
    kvc_i64 column;
    bool in_pool;
};

__device__ __forceinline__ KvcExpectedCell kvc_expected_cell(const KvcPlanIn& in, kvc_i64 rp,
                                                             kvc_i64 pos) {
    const bool overflows = in.token_offset > 0 && pos > KVC_I64_MAX - in.token_offset;
    const kvc_i64 column = overflows ? -1 : pos + in.token_offset;
    const bool in_pool = in.has_expected && column >= 0 && rp >= 0 && rp < in.exp_rows &&
                         column < in.exp_cols;
    return {column, in_pool};
}

// expected_pool[rp, pos + token_offset] when that cell lies below the request's valid length,
// else NO_EXPECTED_TOKEN.
__device__ __forceinline__ kvc_i64 kvc_expected(const KvcPlanIn& in, kvc_i64 r, kvc_i64 rp,
                                                kvc_i64 pos) {
    if (!in.has_expected) return KVC_NO_EXPECTED_TOKEN;
    const KvcExpectedCell cell = kvc_expected_cell(in, rp, pos);
    if (!cell.in_pool || cell.column >= in.valid_lens[r]) return KVC_NO_EXPECTED_TOKEN;
    return (kvc_i64)in.expected_pool[rp * in.exp_stride + cell.column];
}

// The plan entry of (request r, pool row rp, position pos), for the plan kernel's batches with a
// LUT (SWA): kvc_resolve of pos and of its predecessor and kvc_expected, every read of the first
// round requested before any of the second (the LUT's), as predicated loads. Written as
// kvc_resolve and kvc_expected are, ptxas issued the predecessor's cell and the expected token
// only after the slot had been stored: five round trips instead of two (swa_decode_long_prefix
// plan 8.03 -> 7.42 us). Batches without a LUT keep the plain form in an instance of their own:
// this one made a bandwidth-bound plan (bs 256 x 4096 entries) 1-4 % slower.
struct KvcPlanEntry {
    kvc_i64 slot, token, prev;
};

// req_to_token[rp, pos] when `wanted`, or UNRESOLVED for a cell outside the table; -1 when not
// wanted (a first position's predecessor).
__device__ __forceinline__ kvc_i64 kvc_cell_early(const KvcPlanIn& in, kvc_i64 rp, kvc_i64 pos,
                                                  bool wanted) {
    const bool in_table = kvc_in_table(in, rp, pos);
    const bool read = wanted && in_table;
    const int cell = kvc_ld_early_if(in.req_to_token + (read ? rp * in.row_stride + pos : 0), read, 0);
    if (!wanted) return -1;
    return in_table ? (kvc_i64)cell : KVC_UNRESOLVED_SLOT;
}

// A cell through the LUT, as kvc_resolve maps it: negative and UNRESOLVED cells stay.
__device__ __forceinline__ kvc_i64 kvc_lut_slot(const KvcPlanIn& in, kvc_i64 cell) {
    const bool mapped = in.has_lut && cell >= 0 && cell < in.lut_len;
    const kvc_i64 slot = kvc_ld_early_if(in.lut + (mapped ? cell : 0), mapped, KVC_UNRESOLVED_SLOT);
    return !in.has_lut || cell < 0 ? cell : slot;
}

__device__ __forceinline__ KvcPlanEntry kvc_plan_entry_early(const KvcPlanIn& in, kvc_i64 r,
                                                             kvc_i64 rp, kvc_i64 pos) {
    const kvc_i64 cell = kvc_cell_early(in, rp, pos, true);
    const kvc_i64 prev_cell = kvc_cell_early(in, rp, pos - 1, pos > 0);
    // the expected token's valid length and pool cell together: the cell whenever it lies
    // inside the pool, kept only below the valid length
    const KvcExpectedCell exp = kvc_expected_cell(in, rp, pos);
    const kvc_i64 valid_len = kvc_ld_early_if(in.valid_lens + r, exp.in_pool, 0);
    const int token = kvc_ld_early_if(
        in.expected_pool + (exp.in_pool ? rp * in.exp_stride + exp.column : 0), exp.in_pool, 0);
    KvcPlanEntry e;
    e.slot = kvc_lut_slot(in, cell);
    e.prev = kvc_lut_slot(in, prev_cell);
    e.token = exp.in_pool && exp.column < valid_len ? (kvc_i64)token : KVC_NO_EXPECTED_TOKEN;
    return e;
}

// Inclusive scan over the 32 lanes of a warp (saturating or wrapping add), every lane taking part.
template <bool kSaturate>
__device__ __forceinline__ kvc_i64 kvc_warp_scan(kvc_i64 v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const kvc_i64 t = __shfl_up_sync(KVC_FULL_MASK, v, off);
        if (lane >= off) v = kSaturate ? kvc_sat_add(v, t) : kvc_wrap_add(v, t);
    }
    return v;
}

// Inclusive scan over a block of kThreads threads (saturating or wrapping add). *total gets the
// block's sum. Uses s_warp[kThreads / 32]; ends with a barrier so s_warp can be reused at once.
template <int kThreads, bool kSaturate>
__device__ __forceinline__ kvc_i64 kvc_block_scan(kvc_i64 v, kvc_i64* s_warp, kvc_i64* total) {
    constexpr int kWarpsInBlock = kThreads / 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = kvc_warp_scan<kSaturate>(v);
    if (lane == 31) s_warp[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const kvc_i64 w = kvc_warp_scan<kSaturate>(lane < kWarpsInBlock ? s_warp[lane] : 0);
        if (lane < kWarpsInBlock) s_warp[lane] = w;
    }
    __syncthreads();
    if (warp > 0) {
        const kvc_i64 p = s_warp[warp - 1];
        v = kSaturate ? kvc_sat_add(p, v) : kvc_wrap_add(p, v);
    }
    *total = s_warp[kWarpsInBlock - 1];
    __syncthreads();
    return v;
}

// Verify entries of a request: first position and count (0 for padding or empty prefixes).
__device__ __forceinline__ kvc_i64 kvc_verify_count(const KvcPlanIn& in, kvc_i64 rp,
                                                    kvc_i64 prefix, kvc_i64* first_pos) {
    *first_pos = 0;
    if (rp == 0 || prefix <= 0) return 0;
    kvc_i64 start = 0;
    if (in.swa_window > 0) start = kvc_max64(0, prefix - in.swa_window);
    *first_pos = start;
    return prefix - start;
}

// The verify total of the whole batch (saturating), every thread of the block taking part: a
// strided sum a thread, then one block scan. The counts are never negative, so the saturating sum
// is the same in any order; one scan instead of one a tile made verify_16m's plan 197.8 -> 194.9 us.
template <int kThreads>
__device__ __forceinline__ kvc_i64 kvc_verify_total(const KvcPlanIn& in, kvc_i64* s_warp) {
    kvc_i64 mine = 0;
#pragma unroll 4
    for (kvc_i64 r = threadIdx.x; r < in.bs; r += kThreads) {
        kvc_i64 first;
        mine = kvc_sat_add(mine,
                           kvc_verify_count(in, in.req_pool_indices[r], in.prefix_lens[r], &first));
    }
    kvc_i64 total;
    kvc_block_scan<kThreads, true>(mine, s_warp, &total);
    return total;
}

// One tile of requests [tile, tile + kThreads) staged for entry lookup: each request's first
// entry index (s_start), pool row and first position. kvc_stage_tile stages it and returns the
// tile's entry count.
struct KvcEntryTile {
    kvc_i64* s_start;
    kvc_i64* s_rp;
    kvc_i64* s_pos0;
};

template <int kThreads>
__device__ __forceinline__ kvc_i64 kvc_stage_tile(const KvcPlanIn& in, kvc_i64 tile,
                                                  kvc_i64 carry, const KvcEntryTile& t,
                                                  kvc_i64* s_warp) {
    const int tid = threadIdx.x;
    const kvc_i64 r = tile + tid;
    const bool live_row = r < in.bs;
    const kvc_i64 rp = live_row ? in.req_pool_indices[r] : 0;
    const kvc_i64 prefix = live_row ? in.prefix_lens[r] : 0;
    kvc_i64 first_pos;
    const kvc_i64 cnt = live_row ? kvc_verify_count(in, rp, prefix, &first_pos) : 0;
    if (!live_row) first_pos = 0;
    kvc_i64 tile_total;
    const kvc_i64 incl = kvc_block_scan<kThreads, true>(cnt, s_warp, &tile_total);
    // Exact whenever entries are produced (the total then fits the verify capacity).
    t.s_start[tid] = kvc_sat_add(carry, incl - cnt);
    t.s_rp[tid] = rp;
    t.s_pos0[tid] = first_pos;
    return tile_total;
}

// One lane's verify entry k = base + lane of a staged tile of n requests (live: k < hi).
struct KvcEntry {
    kvc_i64 request;  // index in the batch
    kvc_i64 rp;       // its pool row
    kvc_i64 pos;
    bool live;
};

// The entries base .. base + 31 of a staged tile, one per lane (base is the same on every lane and
// s_start[0] <= base). The warp finds base's request with two ballots over the tile's starts; a
// lane past that request's end (rare unless requests are short) searches on from there.
template <int kThreads>
__device__ __forceinline__ KvcEntry kvc_warp_entry(const KvcEntryTile& t, int n, kvc_i64 tile,
                                                   kvc_i64 base, kvc_i64 hi) {
    static_assert(kThreads % 32 == 0 && kThreads <= 1024, "a tile is at most 32 strides of 32");
    constexpr int kStride = kThreads / 32;
    const int lane = threadIdx.x & 31;
    const int coarse_at = lane * kStride;
    const unsigned coarse =
        __ballot_sync(KVC_FULL_MASK, coarse_at < n && t.s_start[coarse_at] <= base);
    const int from = (31 - __clz(coarse)) * kStride;
    const int fine_at = from + lane;
    const unsigned fine = __ballot_sync(
        KVC_FULL_MASK, lane < kStride && fine_at < n && t.s_start[fine_at] <= base);
    int a = from + 31 - __clz(fine);

    KvcEntry e;
    const kvc_i64 k = base + lane;
    e.live = k < hi;
    if (e.live && a + 1 < n && t.s_start[a + 1] <= k) {
        // the last request whose first entry is <= k (requests without entries share it)
        int z = n;
        ++a;
        while (z - a > 1) {
            const int mid = (a + z) >> 1;
            if (t.s_start[mid] <= k) a = mid; else z = mid;
        }
    }
    e.request = tile + a;
    e.rp = t.s_rp[a];
    e.pos = t.s_pos0[a] + (k - t.s_start[a]);
    return e;
}

// The blocks of a grid that take verify entries: this one is number `block` of `blocks`.
struct KvcEntryBlocks {
    kvc_i64 block, blocks;
};

__device__ __forceinline__ KvcEntryBlocks kvc_whole_grid() {
    return {(kvc_i64)blockIdx.x, (kvc_i64)gridDim.x};
}

// The entries [first, hi) of a staged tile of n requests (kTileRows at most), the warps of the
// entry blocks striding over them 32 at a time (a block of kThreads threads takes kThreads entries
// a stride): on_entries(e, base) on every lane, base warp-uniform, so every lane takes part in the
// entry search.
template <int kThreads, int kTileRows, class OnEntries>
__device__ __forceinline__ void kvc_for_tile_entries(const KvcEntryTile& entries, int n,
                                                     kvc_i64 tile, kvc_i64 first, kvc_i64 hi,
                                                     KvcEntryBlocks blocks,
                                                     OnEntries on_entries) {
    for (kvc_i64 base = first + blocks.block * kThreads + (threadIdx.x & ~31); base < hi;
         base += blocks.blocks * kThreads) {
        on_entries(kvc_warp_entry<kTileRows>(entries, n, tile, base, hi), base);
    }
}

// Every verify entry of the batch, shared by the entry blocks: requests in tiles of kThreads, each
// tile staged in shared memory, then each warp takes 32 consecutive entries of the tile and hands
// them, their requests found (kvc_warp_entry), to on_entries(e, base) on every lane. on_tile(tile)
// runs on every thread once a tile is staged (the step, in a grid of one block, scans its write
// plan there; in a grid of several, block 0 stores it apart). Entries are visited only when the
// batch's total fits `capacity`, and only below `limit` (the plan's int32 count). Every thread of
// the block calls it; returns the total (saturating).
template <int kThreads, class OnTile, class OnEntries>
__device__ __forceinline__ kvc_i64 kvc_for_verify_entries(const KvcPlanIn& in,
                                                          const KvcEntryTile& entries,
                                                          kvc_i64* s_warp, kvc_i64 capacity,
                                                          kvc_i64 limit,
                                                          KvcEntryBlocks blocks,
                                                          OnTile on_tile, OnEntries on_entries) {
    const kvc_i64 ntiles = in.bs > 0 ? (in.bs + kThreads - 1) / kThreads : 0;
    // With several tiles the total is needed before any entry is visited.
    kvc_i64 total = ntiles > 1 ? kvc_verify_total<kThreads>(in, s_warp) : 0;
    kvc_i64 carry = 0;
    for (kvc_i64 tile = 0; tile < in.bs; tile += kThreads) {
        const kvc_i64 tile_total = kvc_stage_tile<kThreads>(in, tile, carry, entries, s_warp);
        if (ntiles == 1) total = tile_total;
        on_tile(tile);
        __syncthreads();
        if (total <= capacity) {
            // carry + tile_total <= total <= capacity: no overflow
            const kvc_i64 hi = kvc_min64(carry + tile_total, kvc_min64(total, limit));
            const int n = (int)kvc_min64(kThreads, in.bs - tile);
            kvc_for_tile_entries<kThreads, kThreads>(entries, n, tile, carry, hi, blocks,
                                                     on_entries);
        }
        carry = kvc_sat_add(carry, tile_total);
        __syncthreads();
    }
    return total;
}

// Every verify entry of a batch of at most 32 requests, as kvc_for_verify_entries visits them but
// without a block barrier: each warp stages the whole batch itself (lane r holds request r, read
// by the caller: its pool row rp and prefix length) in its own 32-row slice of the tile arrays,
// then takes its entries of the entry blocks' stride. A small decode step is a chain of latencies,
// and a block scan adds four barriers to it. Returns the total (saturating).
template <int kThreads, class OnEntries>
__device__ __forceinline__ kvc_i64 kvc_for_small_batch_verify_entries(
    const KvcPlanIn& in, const KvcEntryTile& entries, kvc_i64 rp, kvc_i64 prefix,
    kvc_i64 capacity, kvc_i64 limit, KvcEntryBlocks blocks, OnEntries on_entries) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    kvc_i64 first_pos = 0;
    const kvc_i64 cnt = lane < in.bs ? kvc_verify_count(in, rp, prefix, &first_pos) : 0;
    const kvc_i64 incl = kvc_warp_scan<true>(cnt);
    const kvc_i64 total = __shfl_sync(KVC_FULL_MASK, incl, 31);
    const KvcEntryTile mine = {entries.s_start + warp * 32, entries.s_rp + warp * 32,
                               entries.s_pos0 + warp * 32};
    mine.s_start[lane] = incl - cnt;  // exact whenever entries are produced
    mine.s_rp[lane] = rp;
    mine.s_pos0[lane] = first_pos;
    __syncwarp();
    if (total <= capacity) {
        const kvc_i64 hi = kvc_min64(total, limit);
        kvc_for_tile_entries<kThreads, 32>(mine, (int)kvc_min64(32, in.bs), 0, 0, hi, blocks,
                                           on_entries);
    }
    return total;
}

// Write-plan fields of a request (pool row rp, prefix and extend lengths): seed slot (-1: no
// predecessor) and entry count.
__device__ __forceinline__ kvc_i64 kvc_write_count(const KvcPlanIn& in, kvc_i64 rp, kvc_i64 prefix,
                                                   kvc_i64 ext, kvc_i64* seed) {
    const bool live = rp != 0 && ext > 0;
    *seed = (live && prefix > 0) ? kvc_resolve(in, rp, prefix - 1) : -1;
    return live ? ext : 0;
}

// The write plan of requests [tile, tile + kThreads): offsets (wrapping exclusive scan of the
// entry counts, after carry) and seeds, stored for requests below w_capacity. Every thread of the
// block takes part; returns the carry for the next tile.
template <int kThreads>
__device__ __forceinline__ kvc_i64 kvc_write_plan_tile(const KvcPlanIn& in, kvc_i64 tile,
                                                       kvc_i64 carry, kvc_i64* w_offsets,
                                                       kvc_i64* w_seeds, kvc_i64 w_capacity,
                                                       kvc_i64* s_warp) {
    const kvc_i64 r = tile + threadIdx.x;
    const bool live_row = r < in.bs;
    kvc_i64 seed = -1, cnt = 0;
    if (live_row) {
        cnt = kvc_write_count(in, in.req_pool_indices[r], in.prefix_lens[r], in.extend_lens[r],
                              &seed);
    }
    kvc_i64 total;
    const kvc_i64 incl = kvc_block_scan<kThreads, false>(cnt, s_warp, &total);
    if (live_row && r < w_capacity) {
        w_offsets[r] = kvc_wrap_add(carry, incl - cnt);
        w_seeds[r] = seed;
    }
    return kvc_wrap_add(carry, total);
}

// The write plan's last offset, its request count, and the rows past the batch (offsets 0, seeds
// -1), the grid striding over them.
template <int kThreads>
__device__ __forceinline__ void kvc_finish_write_plan(kvc_i64 bs, kvc_i64 total,
                                                      kvc_i64* w_offsets, kvc_i64* w_seeds,
                                                      int* w_num_valid_reqs, kvc_i64 w_capacity) {
    const kvc_i64 first = (kvc_i64)blockIdx.x * kThreads + threadIdx.x;
    const kvc_i64 stride = (kvc_i64)gridDim.x * kThreads;
    if (first == 0) {
        if (bs <= w_capacity) w_offsets[bs] = total;
        *w_num_valid_reqs = (int)bs;
    }
    for (kvc_i64 i = bs + 1 + first; i <= w_capacity; i += stride) w_offsets[i] = 0;
    for (kvc_i64 i = bs + first; i < w_capacity; i += stride) w_seeds[i] = -1;
}
