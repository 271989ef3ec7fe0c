// verify: re-checks the canary slots named by a verify plan (SPEC 3.2 and 4).
//
// One thread per plan entry, grid-stride. The canary buffer is only read. Rows are recorded in
// whatever order threads reach the ring; the set of rows is the reference's.
#include "canary_common.cuh"

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

    const KvcRing ring = {ring_rows, ring_capacity, ring_write_index};
    const KvcSources src = {source_table, (int)num_sources};
    const bool check_token = check_expected_token != 0;
    const kvc_i64 step = (kvc_i64)gridDim.x * blockDim.x;

    for (kvc_i64 k = (kvc_i64)blockIdx.x * blockDim.x + threadIdx.x; k < active; k += step) {
        const kvc_i64 slot = slots[k];
        if (slot == KVC_PADDING_SLOT) continue;
        const kvc_i64 expected_token = expected_tokens[k];
        const kvc_i64 expected_position = expected_positions[k];
        const kvc_i64 prev = prev_slots[k];
        const kvc_i64 report_token = check_token ? expected_token : KVC_NO_EXPECTED_TOKEN;
        if (slot < 0 || slot >= num_slots) {
            kvc_record(ring, tag, slot, expected_position, 0, report_token, 0, 0,
                       KVC_BIT_OUT_OF_RANGE);
            continue;
        }
        const KvcSlot s = kvc_load_slot<kVec16, true>(canary, slot_stride, slot);
        const kvc_i64 token = s.w[KVC_FIELD_TOKEN];
        const kvc_i64 position = s.w[KVC_FIELD_POSITION];
        const kvc_i64 prev_hash = s.w[KVC_FIELD_PREV_HASH];
        const kvc_i64 stored_kv = s.w[KVC_FIELD_REAL_KV_HASH];

        kvc_i64 bits = 0;
        const bool chain_checked = prev != KVC_PADDING_SLOT && prev < num_slots;
        if (prev >= num_slots) bits |= KVC_BIT_OUT_OF_RANGE;
        kvc_i64 expected_chain = prev_hash;
        if (chain_checked) {
            kvc_u64 link;
            if (prev < 0) {
                link = kvc_anchor_link();
            } else {
                const KvcSlot p = kvc_load_slot<kVec16, true>(canary, slot_stride, prev);
                link = kvc_slot_link(p);
            }
            expected_chain = (kvc_i64)link;
            if ((kvc_u64)prev_hash != link) bits |= KVC_BIT_CHAIN_HASH;
        }
        if (check_token && expected_token != KVC_NO_EXPECTED_TOKEN && token != expected_token)
            bits |= KVC_BIT_VERIFY_TOKEN;
        if (position != expected_position) bits |= KVC_BIT_POSITION;
        bool kv_oor = false;
        const kvc_u64 kv = src.count > 0 ? kvc_real_kv_hash(src, slot, &kv_oor) : 0ull;
        if (kv_oor) bits |= KVC_BIT_OUT_OF_RANGE;
        if ((kvc_u64)stored_kv != kv) bits |= KVC_BIT_REAL_KV_HASH;
        if (bits) {
            kvc_record(ring, tag, slot, position, token, report_token, prev_hash, expected_chain,
                       bits);
        }
    }
}
