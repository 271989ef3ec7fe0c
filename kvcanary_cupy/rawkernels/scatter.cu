// scatter_req_token_ids: pool_out[rp, :L] = flat_in[offsets[r] : offsets[r] + L] with
// L = min(offsets[r+1] - offsets[r], width) (SPEC 3.4 and 4).
//
// Blocks stride over requests, threads over the row. Rows outside pool_out are skipped, reads
// outside flat_in are skipped, values are truncated to int32.
#include "canary_common.cuh"

extern "C" __global__ void __launch_bounds__(256) kvc_scatter(
    const kvc_i64* __restrict__ flat_in, kvc_i64 n, const kvc_i64* __restrict__ offsets,
    const kvc_i64* __restrict__ req_pool_indices, kvc_i64 bs, int* pool_out, kvc_i64 rows,
    kvc_i64 width, kvc_i64 row_stride) {
    for (kvc_i64 r = blockIdx.x; r < bs; r += gridDim.x) {
        const kvc_i64 rp = req_pool_indices[r];
        if (rp < 0 || rp >= rows) continue;
        const kvc_i64 begin = offsets[r];
        const kvc_i64 end = offsets[r + 1];
        if (end <= begin || width <= 0) continue;
        // end - begin is exact as an unsigned number (0 < end - begin < 2^64).
        const kvc_u64 span = (kvc_u64)end - (kvc_u64)begin;
        const kvc_u64 len = span < (kvc_u64)width ? span : (kvc_u64)width;
        // begin + j lies in [0, n)  <=>  j_lo <= j < j_hi, all exact in unsigned arithmetic.
        if (begin >= n) continue;
        const kvc_u64 j_lo = begin < 0 ? (kvc_u64)0 - (kvc_u64)begin : 0ull;
        const kvc_u64 j_hi_in = (kvc_u64)n - (kvc_u64)begin;
        const kvc_u64 j_hi = j_hi_in < len ? j_hi_in : len;
        int* row = pool_out + rp * row_stride;
        for (kvc_u64 j = j_lo + threadIdx.x; j < j_hi; j += blockDim.x) {
            row[j] = (int)(unsigned)(kvc_u64)flat_in[(kvc_i64)((kvc_u64)begin + j)];
        }
    }
}
