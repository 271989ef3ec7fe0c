// The check of one verify entry (SPEC 3.2), shared by the plan-driven verify kernel and the step
// kernel, which derives its entries from the batch metadata.
#pragma once
#include "canary_common.cuh"

// The canary buffer as the kernels address it.
struct KvcCanary {
    unsigned char* buf;
    kvc_i64 num_slots;
    kvc_i64 slot_stride;
};

struct KvcVerifyOut {
    KvcRing ring;
    KvcSources src;
    kvc_i64 tag;
    bool check_token;
};

// Reads the slot (and its predecessor) through the read-only path: the buffer is not written
// while entries are checked.
template <bool kVec16>
__device__ __forceinline__ void kvc_verify_entry(const KvcCanary& c, const KvcVerifyOut& out,
                                                 kvc_i64 slot, kvc_i64 expected_token,
                                                 kvc_i64 expected_position, kvc_i64 prev) {
    if (slot == KVC_PADDING_SLOT) return;
    const kvc_i64 report_token = out.check_token ? expected_token : KVC_NO_EXPECTED_TOKEN;
    if (slot < 0 || slot >= c.num_slots) {
        kvc_record(out.ring, out.tag, slot, expected_position, 0, report_token, 0, 0,
                   KVC_BIT_OUT_OF_RANGE);
        return;
    }
    const KvcSlot s = kvc_load_slot<kVec16, true>(c.buf, c.slot_stride, slot);
    const kvc_i64 token = s.w[KVC_FIELD_TOKEN];
    const kvc_i64 position = s.w[KVC_FIELD_POSITION];
    const kvc_i64 prev_hash = s.w[KVC_FIELD_PREV_HASH];
    const kvc_i64 stored_kv = s.w[KVC_FIELD_REAL_KV_HASH];

    kvc_i64 bits = 0;
    const bool chain_checked = prev != KVC_PADDING_SLOT && prev < c.num_slots;
    if (prev >= c.num_slots) bits |= KVC_BIT_OUT_OF_RANGE;
    kvc_i64 expected_chain = prev_hash;
    if (chain_checked) {
        kvc_u64 link;
        if (prev < 0) {
            link = kvc_anchor_link();
        } else {
            const KvcSlot p = kvc_load_slot<kVec16, true>(c.buf, c.slot_stride, prev);
            link = kvc_slot_link(p);
        }
        expected_chain = (kvc_i64)link;
        if ((kvc_u64)prev_hash != link) bits |= KVC_BIT_CHAIN_HASH;
    }
    if (out.check_token && expected_token != KVC_NO_EXPECTED_TOKEN && token != expected_token)
        bits |= KVC_BIT_VERIFY_TOKEN;
    if (position != expected_position) bits |= KVC_BIT_POSITION;
    bool kv_oor = false;
    const kvc_u64 kv = out.src.count > 0 ? kvc_real_kv_hash(out.src, slot, &kv_oor) : 0ull;
    if (kv_oor) bits |= KVC_BIT_OUT_OF_RANGE;
    if ((kvc_u64)stored_kv != kv) bits |= KVC_BIT_REAL_KV_HASH;
    if (bits) {
        kvc_record(out.ring, out.tag, slot, position, token, report_token, prev_hash,
                   expected_chain, bits);
    }
}
