// plan: builds the verify plan and the write plan of one forward batch (SPEC 3.3 and 4).
//
// One launch. Requests are taken in tiles of kTile (one request per thread). Every block scans
// the verify entry counts of a tile redundantly (a few KB, L2-resident), keeps each request's
// first entry index, pool row and first position in shared memory, then the grid strides over
// the tile's verify entries: each entry finds its request by binary search and the four plan
// arrays are written coalesced. Block 0 also scans the extend lengths and writes the write plan.
// With more than one tile, a first pass sums the counts, since the entries are written only when
// the total fits the verify capacity. Totals are int64; the verify total saturates (it is only
// compared with the capacity), the write offsets wrap like int64 arithmetic.
#include "canary_common.cuh"

namespace {
constexpr int kTile = 1024;
constexpr int kTileWarps = kTile / 32;
}

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

__device__ __forceinline__ kvc_i64 kvc_resolve(const KvcPlanIn& in, kvc_i64 rp, kvc_i64 pos) {
    if (rp < 0 || rp >= in.rows || pos < 0 || pos >= in.width) return KVC_UNRESOLVED_SLOT;
    const kvc_i64 s = (kvc_i64)in.req_to_token[rp * in.row_stride + pos];
    if (!in.has_lut || s < 0) return s;
    return s < in.lut_len ? in.lut[s] : KVC_UNRESOLVED_SLOT;
}

__device__ __forceinline__ kvc_i64 kvc_expected(const KvcPlanIn& in, kvc_i64 r, kvc_i64 rp,
                                                kvc_i64 pos) {
    if (!in.has_expected) return KVC_NO_EXPECTED_TOKEN;
    // pos >= 0, so pos + token_offset can only overflow upwards, past any valid length.
    if (in.token_offset > 0 && pos > KVC_I64_MAX - in.token_offset) return KVC_NO_EXPECTED_TOKEN;
    const kvc_i64 column = pos + in.token_offset;
    if (column < 0 || column >= in.valid_lens[r]) return KVC_NO_EXPECTED_TOKEN;
    if (rp < 0 || rp >= in.exp_rows || column >= in.exp_cols) return KVC_NO_EXPECTED_TOKEN;
    return (kvc_i64)in.expected_pool[rp * in.exp_stride + column];
}

// Inclusive block scan over kTile threads (saturating or wrapping add). *total gets the sum of
// the tile. Uses s_warp[kTileWarps]; ends with a barrier so s_warp can be reused at once.
template <bool kSaturate>
__device__ __forceinline__ kvc_i64 kvc_block_scan(kvc_i64 v, kvc_i64* s_warp, kvc_i64* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const kvc_i64 t = __shfl_up_sync(KVC_FULL_MASK, v, off);
        if (lane >= off) v = kSaturate ? kvc_sat_add(v, t) : kvc_wrap_add(v, t);
    }
    if (lane == 31) s_warp[warp] = v;
    __syncthreads();
    if (warp == 0) {
        kvc_i64 w = s_warp[lane];
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const kvc_i64 t = __shfl_up_sync(KVC_FULL_MASK, w, off);
            if (lane >= off) w = kSaturate ? kvc_sat_add(w, t) : kvc_wrap_add(w, t);
        }
        s_warp[lane] = w;
    }
    __syncthreads();
    if (warp > 0) {
        const kvc_i64 p = s_warp[warp - 1];
        v = kSaturate ? kvc_sat_add(p, v) : kvc_wrap_add(p, v);
    }
    *total = s_warp[kTileWarps - 1];
    __syncthreads();
    return v;
}

// Verify entries of request r: first position and count (0 for padding or empty prefixes).
__device__ __forceinline__ kvc_i64 kvc_verify_count(const KvcPlanIn& in, kvc_i64 rp,
                                                    kvc_i64 prefix, kvc_i64* first_pos) {
    *first_pos = 0;
    if (rp == 0 || prefix <= 0) return 0;
    kvc_i64 start = 0;
    if (in.swa_window > 0) start = kvc_max64(0, prefix - in.swa_window);
    *first_pos = start;
    return prefix - start;
}

__global__ void __launch_bounds__(kTile) kvc_plan(
    const kvc_i64* __restrict__ req_pool_indices, const kvc_i64* __restrict__ prefix_lens,
    const kvc_i64* __restrict__ extend_lens, kvc_i64 bs, const int* __restrict__ req_to_token,
    kvc_i64 rows, kvc_i64 width, kvc_i64 row_stride, kvc_i64 swa_window, kvc_i64 has_lut,
    const kvc_i64* __restrict__ lut, kvc_i64 lut_len, kvc_i64 has_expected,
    const int* __restrict__ expected_pool, kvc_i64 exp_rows, kvc_i64 exp_cols, kvc_i64 exp_stride,
    const kvc_i64* __restrict__ valid_lens, kvc_i64 token_offset, kvc_i64* v_slots,
    kvc_i64* v_tokens, kvc_i64* v_positions, kvc_i64* v_prev, int* v_num_valid, int* v_enable,
    kvc_i64 v_capacity, kvc_i64* w_offsets, kvc_i64* w_seeds, int* w_num_valid_reqs,
    kvc_i64 w_capacity) {
    __shared__ kvc_i64 s_warp[kTileWarps];
    __shared__ kvc_i64 s_start[kTile];
    __shared__ kvc_i64 s_rp[kTile];
    __shared__ kvc_i64 s_pos0[kTile];

    const KvcPlanIn in = {req_pool_indices, prefix_lens, extend_lens, bs, req_to_token, rows,
                          width, row_stride, swa_window, has_lut != 0, lut, lut_len,
                          has_expected != 0, expected_pool, exp_rows, exp_cols, exp_stride,
                          valid_lens, token_offset};
    const int tid = threadIdx.x;
    const kvc_i64 ntiles = bs > 0 ? (bs + kTile - 1) / kTile : 0;
    const kvc_i64 grid_threads = (kvc_i64)gridDim.x * kTile;

    // With several tiles the total is needed before any entry is written.
    kvc_i64 total = 0;
    if (ntiles > 1) {
        for (kvc_i64 tile = 0; tile < bs; tile += kTile) {
            const kvc_i64 r = tile + tid;
            kvc_i64 cnt = 0, first;
            if (r < bs) cnt = kvc_verify_count(in, req_pool_indices[r], prefix_lens[r], &first);
            kvc_i64 tile_total;
            kvc_block_scan<true>(cnt, s_warp, &tile_total);
            total = kvc_sat_add(total, tile_total);
        }
    }

    kvc_i64 carry_v = 0;
    kvc_i64 carry_w = 0;
    for (kvc_i64 tile = 0; tile < bs; tile += kTile) {
        const kvc_i64 r = tile + tid;
        const bool live_row = r < bs;
        const kvc_i64 rp = live_row ? req_pool_indices[r] : 0;
        const kvc_i64 prefix = live_row ? prefix_lens[r] : 0;
        kvc_i64 first_pos;
        const kvc_i64 cnt = live_row ? kvc_verify_count(in, rp, prefix, &first_pos) : 0;
        if (!live_row) first_pos = 0;
        kvc_i64 tile_total;
        const kvc_i64 incl = kvc_block_scan<true>(cnt, s_warp, &tile_total);
        // Exact whenever the entries get written (the total then fits the capacity).
        s_start[tid] = kvc_sat_add(carry_v, incl - cnt);
        s_rp[tid] = rp;
        s_pos0[tid] = first_pos;
        if (ntiles == 1) total = tile_total;

        if (blockIdx.x == 0) {
            const kvc_i64 ext = live_row ? extend_lens[r] : 0;
            const bool live = live_row && rp != 0 && ext > 0;
            const kvc_i64 wcnt = live ? ext : 0;
            kvc_i64 wtotal;
            const kvc_i64 wincl = kvc_block_scan<false>(wcnt, s_warp, &wtotal);
            if (live_row && r < w_capacity) {
                w_offsets[r] = kvc_wrap_add(carry_w, wincl - wcnt);
                w_seeds[r] = (live && prefix > 0) ? kvc_resolve(in, rp, prefix - 1) : -1;
            }
            carry_w = kvc_wrap_add(carry_w, wtotal);
        }
        __syncthreads();

        if (total <= v_capacity) {
            const kvc_i64 tile_n = kvc_min64(kTile, bs - tile);
            const kvc_i64 lo = carry_v;
            const kvc_i64 hi = carry_v + tile_total;  // <= total <= capacity: no overflow
            for (kvc_i64 k = lo + (kvc_i64)blockIdx.x * kTile + tid; k < hi; k += grid_threads) {
                // last request whose first entry is <= k (requests without entries share it)
                int a = 0, z = (int)tile_n;
                while (z - a > 1) {
                    const int mid = (a + z) >> 1;
                    if (s_start[mid] <= k) a = mid; else z = mid;
                }
                const kvc_i64 rq = tile + a;
                const kvc_i64 rpj = s_rp[a];
                const kvc_i64 pos = s_pos0[a] + (k - s_start[a]);
                v_slots[k] = kvc_resolve(in, rpj, pos);
                v_tokens[k] = kvc_expected(in, rq, rpj, pos);
                v_positions[k] = pos;
                v_prev[k] = pos > 0 ? kvc_resolve(in, rpj, pos - 1) : -1;
            }
        }
        carry_v = kvc_sat_add(carry_v, tile_total);
        __syncthreads();
    }

    if (blockIdx.x == 0 && tid == 0) {
        if (bs <= w_capacity) w_offsets[bs] = carry_w;
        *w_num_valid_reqs = (int)bs;
        const kvc_i64 nv = kvc_min64(total, v_capacity);
        *v_num_valid = (int)kvc_min64(nv, 0x7FFFFFFFLL);
        *v_enable = total <= v_capacity ? 1 : 0;
    }
    // Past bs: offsets zeroed, seeds "no predecessor".
    for (kvc_i64 i = bs + 1 + (kvc_i64)blockIdx.x * kTile + tid; i <= w_capacity;
         i += grid_threads)
        w_offsets[i] = 0;
    for (kvc_i64 i = bs + (kvc_i64)blockIdx.x * kTile + tid; i < w_capacity; i += grid_threads)
        w_seeds[i] = -1;
}
