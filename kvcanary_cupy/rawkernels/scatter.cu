// scatter_req_token_ids: pool_out[rp, :L] = flat_in[offsets[r] : offsets[r] + L] with
// L = min(offsets[r+1] - offsets[r], width), requests in order (SPEC 3.4 and 4).
//
// Blocks stride over requests, threads over the row. Rows outside pool_out are skipped, reads
// outside flat_in are skipped, values are truncated to int32. When a later request of the batch
// names the same pool row, the columns it writes are left to it, so the row ends as a sequential
// pass leaves it whatever the order blocks run in. A request's row and offsets are read at once,
// and the later requests' pool rows kDupAhead strides a round trip (one a stride: a bs-4096
// scatter of the general form took 17.5 us, 16.9 so).
//
// kDecode (a few tokens a request, picked on the host from the shapes, for batches of up to about
// four requests a block): such a scatter is a chain of memory round trips, a token a request. Its
// reads are requested before any is used (the request's row and offsets and the first kDupAhead
// strides of later rows), and its first value before the comparison: two round trips (offsets,
// then values). Blocks are smaller, and the launch bounds keep KVC_SCATTER_BLOCKS_PER_SM of them on
// an SM, the launcher's grid at most. A bs-4096 decode scatter (four requests a block): 13.9 us
// so, 17.2 in the general form (tools/scatter_forms_probe.py); with a warp a request, four a block
// in one wave, 15.1.
//
// kLongRows (rows of several strides on average, a prefill chunk's: picked on the host): a row
// that no later request shares is copied kCopyAhead strides at a time, their reads all in flight
// before the first store (a 4096-token row: 11.2 -> 6.0 us). Short rows keep the plain loop: the
// unrolled one, compiled into their kernel, made a bs-4096 decode scatter 17.9 -> 22.5 us.
#include "canary_common.cuh"

namespace {
constexpr int kMaxDup = 64;
constexpr int kCopyAhead = 8;  // kLongRows: strides of a row read at once
constexpr int kDupAhead = 8;   // strides of later requests' rows read at once
}

// the launcher's block sizes
#define KVC_SCATTER_BLOCK(kDecode) ((kDecode) ? KVC_SCATTER_DECODE_THREADS : KVC_SCATTER_THREADS)

// Columns [j_lo, j_hi) that a request with offsets [begin, end) writes into its pool row; false
// when it writes none.
__device__ __forceinline__ bool kvc_scatter_span(kvc_i64 begin, kvc_i64 end, kvc_i64 n,
                                                 kvc_i64 width, kvc_u64& j_lo, kvc_u64& j_hi) {
    if (end <= begin || width <= 0 || begin >= n) return false;
    // end - begin is exact as an unsigned number (0 < end - begin < 2^64).
    const kvc_u64 span = (kvc_u64)end - (kvc_u64)begin;
    const kvc_u64 len = span < (kvc_u64)width ? span : (kvc_u64)width;
    // begin + j lies in [0, n)  <=>  j_lo <= j < n - begin, all exact in unsigned arithmetic.
    j_lo = begin < 0 ? (kvc_u64)0 - (kvc_u64)begin : 0ull;
    const kvc_u64 j_hi_in = (kvc_u64)n - (kvc_u64)begin;
    j_hi = j_hi_in < len ? j_hi_in : len;
    return j_lo < j_hi;
}

// Where column col of a row read from offset begin lies in flat_in (in it, by kvc_scatter_span).
__device__ __forceinline__ const kvc_i64* kvc_scatter_source(const kvc_i64* flat_in, kvc_i64 begin,
                                                             kvc_u64 col) {
    return flat_in + (kvc_i64)((kvc_u64)begin + col);
}

// A token id as the int32 pool stores it: its low 32 bits.
__device__ __forceinline__ int kvc_pool_token(kvc_i64 v) { return (int)(unsigned)(kvc_u64)v; }

// kvc_scatter_span of request r's offsets.
__device__ __forceinline__ bool kvc_scatter_cols(const kvc_i64* offsets, kvc_i64 r, kvc_i64 n,
                                                 kvc_i64 width, kvc_u64& j_lo, kvc_u64& j_hi) {
    return kvc_scatter_span(offsets[r], offsets[r + 1], n, width, j_lo, j_hi);
}

// Request r2, which writes the same pool row as the block's request, takes columns [a, b) of it:
// noted in the block's list (s_ndup entries; past kMaxDup the list overflows and is not used).
__device__ __forceinline__ void kvc_note_later_row(const kvc_i64* offsets, kvc_i64 r2, kvc_i64 n,
                                                   kvc_i64 width, int* s_ndup, kvc_u64* s_dup_lo,
                                                   kvc_u64* s_dup_hi) {
    kvc_u64 a, b;
    if (!kvc_scatter_cols(offsets, r2, n, width, a, b)) return;
    const int d = atomicAdd(s_ndup, 1);
    if (d < kMaxDup) {
        s_dup_lo[d] = a;
        s_dup_hi[d] = b;
    }
}

// The pool rows of the kDupAhead later requests base, base + kThreads, ... (-1 past the batch).
// kEarly: requested where this is written (kvc_ld_early), for the decode form's first batch of
// them, read beside the request's own row.
template <int kThreads, bool kEarly>
__device__ __forceinline__ void kvc_later_rows(const kvc_i64* req_pool_indices, kvc_i64 bs,
                                               kvc_i64 base, kvc_i64 (&later_rp)[kDupAhead]) {
#pragma unroll
    for (int u = 0; u < kDupAhead; ++u) {
        const kvc_i64 r2 = base + (kvc_i64)u * kThreads;
        if (r2 >= bs) later_rp[u] = -1;
        else later_rp[u] = kEarly ? kvc_ld_early(req_pool_indices + r2) : req_pool_indices[r2];
    }
}

// sm_80: left to pick its register count, ptxas chose 40 for the general kernel and spilled; one
// block per SM, asked for, keeps it whole. Not on sm_90, where it needs no help and the request
// costs occupancy that a bs-1024 scatter measured (6.7 -> 7.7 us). (0: no request.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVC_SCATTER_MIN_BLOCKS 1
#else
#define KVC_SCATTER_MIN_BLOCKS 0
#endif

template <bool kDecode, bool kLongRows>
__global__ void __launch_bounds__(KVC_SCATTER_BLOCK(kDecode),
                                  kDecode ? KVC_SCATTER_BLOCKS_PER_SM : KVC_SCATTER_MIN_BLOCKS)
    kvc_scatter(
    const kvc_i64* __restrict__ flat_in, kvc_i64 n, const kvc_i64* __restrict__ offsets,
    const kvc_i64* __restrict__ req_pool_indices, kvc_i64 bs, int* pool_out, kvc_i64 rows,
    kvc_i64 width, kvc_i64 row_stride) {
    constexpr int kThreads = KVC_SCATTER_BLOCK(kDecode);
    static_assert(kDupAhead <= 32, "a bit a later request");
    __shared__ int s_ndup;
    __shared__ kvc_u64 s_dup_lo[kMaxDup];
    __shared__ kvc_u64 s_dup_hi[kMaxDup];

    for (kvc_i64 r = blockIdx.x; r < bs; r += gridDim.x) {
        const kvc_i64 first_later = r + 1 + threadIdx.x;
        kvc_i64 rp, begin, end;
        kvc_i64 later_rp[kDupAhead];  // pool rows of later requests, a stride apart
        if (kDecode) {
            rp = kvc_ld_early(req_pool_indices + r);
            begin = kvc_ld_early(offsets + r);
            end = kvc_ld_early(offsets + r + 1);
            kvc_later_rows<kThreads, true>(req_pool_indices, bs, first_later, later_rp);
        } else {
            rp = req_pool_indices[r];
            begin = offsets[r];
            end = offsets[r + 1];
        }
        // One predicate of all three reads (& evaluates every operand): with the row checked first
        // and its own branch, ptxas sank the offsets' reads past it, a round trip after the row's.
        kvc_u64 j_lo, j_hi;
        const bool live =
            (rp >= 0) & (rp < rows) & kvc_scatter_span(begin, end, n, width, j_lo, j_hi);
        if (!live) continue;
        // begin + j lies in flat_in for every j in [j_lo, j_hi): kDecode reads its first value
        // before it is known whether a later request takes the column
        const kvc_u64 first_j = j_lo + threadIdx.x;
        kvc_i64 first_value = 0;
        if (kDecode && first_j < j_hi)
            first_value = kvc_ld_early(kvc_scatter_source(flat_in, begin, first_j));

        // Later requests of the same row (an engine sends none; a sequential pass lets them win),
        // kDupAhead strides of them a round trip (kDecode requested the first above).
        if (threadIdx.x == 0) s_ndup = 0;
        __syncthreads();
        for (kvc_i64 base = first_later; base < bs; base += (kvc_i64)kDupAhead * kThreads) {
            if (!kDecode || base != first_later)
                kvc_later_rows<kThreads, false>(req_pool_indices, bs, base, later_rp);
            unsigned same_row = 0;  // bit u: request base + u * kThreads names row rp (>= 0)
#pragma unroll
            for (int u = 0; u < kDupAhead; ++u) same_row |= (later_rp[u] == rp ? 1u : 0u) << u;
            for (; same_row != 0; same_row &= same_row - 1) {
                const kvc_i64 r2 = base + (kvc_i64)(__ffs(same_row) - 1) * kThreads;
                kvc_note_later_row(offsets, r2, n, width, &s_ndup, s_dup_lo, s_dup_hi);
            }
        }
        __syncthreads();
        const int ndup = s_ndup;

        int* row = pool_out + rp * row_stride;
        kvc_u64 j = first_j;
        if (kLongRows && ndup == 0) {
            // kCopyAhead strides of the row read before any is stored: a round trip per
            // kCopyAhead strides instead of one per stride.
            for (; j < j_hi; j += (kvc_u64)kCopyAhead * kThreads) {
                int v[kCopyAhead];
#pragma unroll
                for (int u = 0; u < kCopyAhead; ++u) {
                    const kvc_u64 col = j + (kvc_u64)u * kThreads;
                    if (col < j_hi) v[u] = kvc_pool_token(*kvc_scatter_source(flat_in, begin, col));
                }
#pragma unroll
                for (int u = 0; u < kCopyAhead; ++u) {
                    const kvc_u64 col = j + (kvc_u64)u * kThreads;
                    if (col < j_hi) row[col] = v[u];
                }
            }
        }
        for (; j < j_hi; j += kThreads) {
            bool later = false;
            if (ndup > 0 && ndup <= kMaxDup) {
                for (int d = 0; d < ndup && !later; ++d)
                    later = s_dup_lo[d] <= j && j < s_dup_hi[d];
            } else if (ndup > kMaxDup) {
                for (kvc_i64 r2 = r + 1; r2 < bs && !later; ++r2) {
                    kvc_u64 a, b;
                    if (req_pool_indices[r2] == rp && kvc_scatter_cols(offsets, r2, n, width, a, b))
                        later = a <= j && j < b;
                }
            }
            const kvc_i64 v =
                kDecode && j == first_j ? first_value : *kvc_scatter_source(flat_in, begin, j);
            if (!later) row[j] = kvc_pool_token(v);
        }
        __syncthreads();
    }
}
