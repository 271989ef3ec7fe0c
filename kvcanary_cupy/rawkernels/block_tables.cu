// block_tables: an engine's block tables and cumulative offsets in the canary's terms
// (kc.block_tables). Each is one launch, where array expressions would be several on every
// forward, and one a CUDA graph can capture. Grid-stride loops over indices the host checked (rows
// inside req_to_token, columns inside its width, outputs as long as their inputs), so nothing is
// read or written past the arrays whatever the values. Lengths are computed in unsigned
// arithmetic, as NumPy's wrapping integers are, so garbage offsets give the CPU's bits, not
// undefined behaviour.
#include "canary_common.cuh"

// req_to_token[row(i), first_cell + c] = table[i, c / block_size] * block_size + c % block_size for
// c < blocks * block_size, with row(i) = rows[i] (host-checked request rows) or i + 1 when rows is
// null. A slot that int32 cannot hold (a negative block id, or one past 2^31 / block_size) is
// stored as -1, which the plan passes on and verify reports OUT_OF_RANGE: its low 32 bits could
// name a real slot, or the padding slot that is never checked. Table strides are in elements.
template <typename Block>
__global__ void __launch_bounds__(KVC_BLOCK_TABLES_THREADS) kvc_mirror_blocks(
        const Block* __restrict__ table, kvc_i64 table_count, kvc_i64 blocks, kvc_i64 table_row_stride,
        kvc_i64 table_col_stride, const kvc_i64* __restrict__ rows, kvc_i64 block_size, kvc_i64 first_cell,
        int* __restrict__ req_to_token, kvc_i64 rtt_row_stride) {
    const kvc_i64 cells = blocks * block_size;
    const kvc_i64 total = table_count * cells;
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 k = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += step) {
        const kvc_i64 i = k / cells;
        const kvc_i64 c = k - i * cells;
        const kvc_i64 b = c / block_size;
        const kvc_i64 block = (kvc_i64)table[i * table_row_stride + b * table_col_stride];
        const kvc_i64 offset = c - b * block_size;
        const bool fits = block >= 0 && block <= (KVC_INT32_MAX - offset) / block_size;
        const kvc_i64 row = rows ? rows[i] : i + 1;
        req_to_token[row * rtt_row_stride + first_cell + c] = fits ? (int)(block * block_size + offset) : -1;
    }
}

// One element of an index array given as int32 or int64 (the caller's dtype, told by a flag).
__device__ __forceinline__ kvc_i64 kvc_index_at(const void* array, bool is_int32, kvc_i64 i) {
    return is_int32 ? (kvc_i64)((const int*)array)[i] : ((const kvc_i64*)array)[i];
}

// A ForwardBatch's arrays from cumulative offsets, in one launch: for r < bs, extend[r] = qsl[r + 1]
// - qsl[r], prefix[r] = seq_lens[r] - extend[r] (unsigned, as NumPy wraps), rows_out[r] = rows[r]
// (r + 1 when rows is null); then for each token array t with n_t > 0, out_t[i] = tokens_t[i]
// widened to int64. int32_mask says which inputs are int32 (bit 0 qsl, 1 seq_lens, 2 rows, 3 + t
// token array t); strides are in elements. rows may be rows_out itself (a batch refilled from its
// own row array): each thread reads its cell before it stores it; no other input is an output.
extern "C" __global__ void __launch_bounds__(KVC_BLOCK_TABLES_THREADS) kvc_batch_from_offsets(
        const void* query_start_loc, const void* seq_lens, const void* rows, kvc_i64 qsl_stride,
        kvc_i64 seq_stride, kvc_i64 rows_stride, int int32_mask, kvc_i64 bs, kvc_i64* rows_out,
        kvc_i64* __restrict__ prefix_out, kvc_i64* __restrict__ extend_out, const void* tokens0,
        const void* tokens1, const void* tokens2, kvc_i64 stride0, kvc_i64 stride1, kvc_i64 stride2,
        kvc_i64 n0, kvc_i64 n1, kvc_i64 n2, kvc_i64* out0, kvc_i64* out1, kvc_i64* out2) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    const kvc_i64 total = bs + n0 + n1 + n2;
    for (kvc_i64 k = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += step) {
        if (k < bs) {
            const kvc_u64 start = (kvc_u64)kvc_index_at(query_start_loc, int32_mask & 1, k * qsl_stride);
            const kvc_u64 end = (kvc_u64)kvc_index_at(query_start_loc, int32_mask & 1, (k + 1) * qsl_stride);
            const kvc_u64 extend = end - start;
            extend_out[k] = (kvc_i64)extend;
            prefix_out[k] = (kvc_i64)((kvc_u64)kvc_index_at(seq_lens, int32_mask & 2, k * seq_stride) - extend);
            rows_out[k] = rows ? kvc_index_at(rows, int32_mask & 4, k * rows_stride) : k + 1;
            continue;
        }
        kvc_i64 i = k - bs;
        if (i < n0) {
            out0[i] = kvc_index_at(tokens0, int32_mask & 8, i * stride0);
        } else if ((i -= n0) < n1) {
            out1[i] = kvc_index_at(tokens1, int32_mask & 16, i * stride1);
        } else {
            i -= n1;
            out2[i] = kvc_index_at(tokens2, int32_mask & 32, i * stride2);
        }
    }
}
