// verify: re-checks the canary slots named by a verify plan (SPEC 3.2 and 4).
//
// One thread per plan entry, grid-stride, each row read a stride ahead. The canary buffer is only
// read. Rows are recorded in whatever order threads reach the ring; the set of rows is the
// reference's.
#include "verify_entry.cuh"

struct KvcPlanRow {
    kvc_i64 slot, expected_token, expected_position, prev;
};

// Row k of the verify plan, read now (it is used a stride later); padding past `end`.
__device__ __forceinline__ KvcPlanRow kvc_plan_row(const kvc_i64* slots, const kvc_i64* tokens,
                                                   const kvc_i64* positions, const kvc_i64* prevs,
                                                   kvc_i64 k, kvc_i64 end) {
    KvcPlanRow r = {KVC_PADDING_SLOT, 0, 0, KVC_PADDING_SLOT};
    if (k < end) {
        r.slot = kvc_ld_early(slots + k);
        r.expected_token = kvc_ld_early(tokens + k);
        r.expected_position = kvc_ld_early(positions + k);
        r.prev = kvc_ld_early(prevs + k);
    }
    return r;
}

template <bool kVec16>
__global__ void __launch_bounds__(KVC_VERIFY_THREADS) kvc_verify(
    const unsigned char* __restrict__ canary, kvc_i64 num_slots, kvc_i64 slot_stride,
    const kvc_i64* __restrict__ slots, const kvc_i64* __restrict__ expected_tokens,
    const kvc_i64* __restrict__ expected_positions, const kvc_i64* __restrict__ prev_slots,
    const int* __restrict__ num_valid, const int* __restrict__ enable, kvc_i64 capacity,
    kvc_i64* ring_rows, kvc_i64 ring_capacity, int* ring_write_index,
    unsigned long long* slot_run_counter, unsigned long long* kernel_run_counter,
    const kvc_i64* __restrict__ source_table, kvc_i64 num_sources, kvc_i64 tag,
    kvc_i64 check_expected_token) {
    // Plan rows are read one stride ahead: the next row is in flight while this one is checked,
    // and the first is requested before the plan's count arrives (rows below the capacity exist
    // whatever the count), so a decode-sized verify waits for one latency, not two.
    kvc_i64 k = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;
    KvcPlanRow row = kvc_plan_row(slots, expected_tokens, expected_positions, prev_slots, k,
                                  capacity);
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
    for (; k < active; k += step) {
        const KvcPlanRow now = row;
        row = kvc_plan_row(slots, expected_tokens, expected_positions, prev_slots, k + step,
                           active);
        kvc_verify_entry<kVec16>(c, out, now.slot, now.expected_token, now.expected_position,
                                 now.prev);
    }
}
