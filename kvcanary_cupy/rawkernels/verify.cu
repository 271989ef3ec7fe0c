// verify: re-checks the canary slots named by a verify plan (SPEC 3.2 and 4).
//
// One thread per plan entry, grid-stride. The canary buffer is only read. Rows are recorded in
// whatever order threads reach the ring; the set of rows is the reference's.
#include "verify_entry.cuh"

template <bool kVec16>
__global__ void __launch_bounds__(256) kvc_verify(
    const unsigned char* __restrict__ canary, kvc_i64 num_slots, kvc_i64 slot_stride,
    const kvc_i64* __restrict__ slots, const kvc_i64* __restrict__ expected_tokens,
    const kvc_i64* __restrict__ expected_positions, const kvc_i64* __restrict__ prev_slots,
    const int* __restrict__ num_valid, const int* __restrict__ enable, kvc_i64 capacity,
    kvc_i64* ring_rows, kvc_i64 ring_capacity, int* ring_write_index,
    unsigned long long* slot_run_counter, unsigned long long* kernel_run_counter,
    const kvc_i64* __restrict__ source_table, kvc_i64 num_sources, kvc_i64 tag,
    kvc_i64 check_expected_token) {
    const bool enabled = *enable != 0;
    const kvc_i64 active = kvc_clamp_count(*num_valid, capacity);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(kernel_run_counter, 1ull);
        if (enabled) atomicAdd(slot_run_counter, (unsigned long long)active);
    }
    if (!enabled) return;

    const KvcCanary c = {const_cast<unsigned char*>(canary), num_slots, slot_stride};
    const KvcVerifyOut out = {{ring_rows, ring_capacity, ring_write_index},
                              {source_table, (int)num_sources}, tag, check_expected_token != 0};
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    for (kvc_i64 k = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; k < active; k += step) {
        kvc_verify_entry<kVec16>(c, out, slots[k], expected_tokens[k], expected_positions[k],
                                 prev_slots[k]);
    }
}
