// block_tables: an engine's block tables and cumulative offsets in the canary's terms
// (kc.block_tables). Each is one launch, where array expressions would be several on every forward
// (a host cost a forward larger than the canary's own). Grid-stride loops; every index the host
// checked (rows inside req_to_token, columns inside its width), so nothing is read or written
// past the arrays whatever the values. Lengths are computed in unsigned arithmetic, as NumPy's
// wrapping integers are, so garbage offsets give the CPU's bits, not undefined behaviour.
#include "canary_common.cuh"

// req_to_token[row(i), first_cell + c] = table[i, c / block_size] * block_size + c % block_size for
// c < blocks * block_size, with row(i) = rows[i] (host-checked request rows) or i + 1 when rows is
// null. A slot that int32 cannot hold (a negative block id, or one past 2^31 / block_size) is
// stored as -1, which the plan passes on and verify reports OUT_OF_RANGE: its low 32 bits could
// name a real slot, or the padding slot that is never checked. Table strides are in elements.
template <typename Block>
__global__ void __launch_bounds__(KVC_BLOCK_TABLES_THREADS) kvc_mirror_blocks(const Block* __restrict__ table, kvc_i64 table_count, kvc_i64 blocks,
                                  kvc_i64 table_row_stride, kvc_i64 table_col_stride,
                                  const kvc_i64* __restrict__ rows, kvc_i64 block_size, kvc_i64 first_cell,
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

// A batch's lengths from cumulative offsets: extend[r] = qsl[r + 1] - qsl[r], prefix[r] = seq_lens[r]
// - extend[r], rows_out[r] = rows[r] (or r + 1 when rows is null), all int64. Strides in elements.
// rows may be rows_out itself (a batch refilled from its own row array): each thread reads its
// cell before it stores it.
template <typename Length, typename Row>
__global__ void __launch_bounds__(KVC_BLOCK_TABLES_THREADS) kvc_batch_lengths(const Length* __restrict__ query_start_loc, kvc_i64 qsl_stride,
                                  const Length* __restrict__ seq_lens, kvc_i64 seq_stride,
                                  const Row* rows, kvc_i64 rows_stride, kvc_i64 bs,
                                  kvc_i64* rows_out, kvc_i64* __restrict__ prefix_out,
                                  kvc_i64* __restrict__ extend_out) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 r = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; r < bs; r += step) {
        const kvc_u64 start = (kvc_u64)(kvc_i64)query_start_loc[r * qsl_stride];
        const kvc_u64 end = (kvc_u64)(kvc_i64)query_start_loc[(r + 1) * qsl_stride];
        const kvc_u64 extend = end - start;
        extend_out[r] = (kvc_i64)extend;
        prefix_out[r] = (kvc_i64)((kvc_u64)(kvc_i64)seq_lens[r * seq_stride] - extend);
        rows_out[r] = rows ? (kvc_i64)rows[r * rows_stride] : r + 1;
    }
}

// out[i] = src[i * stride] as int64, i < n: a token array widened (or copied) into the batch's own.
template <typename Value>
__global__ void __launch_bounds__(KVC_BLOCK_TABLES_THREADS) kvc_widen(const Value* __restrict__ src, kvc_i64 stride, kvc_i64 n, kvc_i64* __restrict__ out) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 i = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        out[i] = (kvc_i64)src[i * stride];
    }
}
