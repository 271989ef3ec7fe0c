// records: a slot's record (its four fields, 32 bytes) carried to another slot, of this canary or
// of another one, as the slot's KV moves (to a host tier and back, to another device). Gathered
// into a staging array on the source's device, scattered from it on the destination's, so that
// the two canaries may live on different devices; the staging rows' layout is the CPU backend's.
#include "canary_common.cuh"

// staged[i] = the record of slots[i] and 1 where 0 <= slots[i] < num_slots, else zeros and 0.
// Grid-stride.
extern "C" __global__ void kvc_gather_records(const kvc_i64* __restrict__ buf, kvc_i64 stride_words,
                                              kvc_i64 num_slots, const kvc_i64* __restrict__ slots, kvc_i64 n,
                                              kvc_i64* __restrict__ staged) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 i = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const kvc_i64 slot = slots[i];
        const bool inside = slot >= 0 && slot < num_slots;
        kvc_i64* out = staged + i * KVC_STAGED_RECORD_WORDS;
#pragma unroll
        for (int w = 0; w < KVC_SLOT_FIELD_COUNT; ++w) out[w] = inside ? buf[slot * stride_words + w] : 0;
        out[KVC_STAGED_IN_RANGE] = inside ? 1 : 0;
    }
}

// The record staged for pair i stored at slots[i], where it was gathered in range and
// 0 <= slots[i] < num_slots; other pairs store nothing. Grid-stride.
extern "C" __global__ void kvc_scatter_records(kvc_i64* __restrict__ buf, kvc_i64 stride_words, kvc_i64 num_slots,
                                               const kvc_i64* __restrict__ slots, kvc_i64 n,
                                               const kvc_i64* __restrict__ staged) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 i = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const kvc_i64 slot = slots[i];
        const kvc_i64* record = staged + i * KVC_STAGED_RECORD_WORDS;
        if (record[KVC_STAGED_IN_RANGE] == 0 || slot < 0 || slot >= num_slots) continue;
#pragma unroll
        for (int w = 0; w < KVC_SLOT_FIELD_COUNT; ++w) buf[slot * stride_words + w] = record[w];
    }
}

// Both canaries on this device: the record of src_slots[i] stored at dst_slots[i] where both are in
// range, with no staging. A thread a word: the four threads of a record read its 32-byte sector
// together and store it together, as a warp's eight records make eight sector requests at once.
// Pairs naming one destination twice: which lands is unspecified. Grid-stride.
extern "C" __global__ void kvc_copy_records(const kvc_i64* __restrict__ src, kvc_i64 src_stride_words,
                                            kvc_i64 src_num_slots, const kvc_i64* __restrict__ src_slots,
                                            kvc_i64* __restrict__ dst, kvc_i64 dst_stride_words,
                                            kvc_i64 dst_num_slots, const kvc_i64* __restrict__ dst_slots,
                                            kvc_i64 n) {
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    const kvc_i64 words = n * KVC_SLOT_FIELD_COUNT;
    for (kvc_i64 t = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; t < words; t += step) {
        const kvc_i64 i = t / KVC_SLOT_FIELD_COUNT;
        const int w = (int)(t % KVC_SLOT_FIELD_COUNT);
        const kvc_i64 from = src_slots[i], to = dst_slots[i];
        if (from < 0 || from >= src_num_slots || to < 0 || to >= dst_num_slots) continue;
        dst[to * dst_stride_words + w] = src[from * src_stride_words + w];
    }
}
