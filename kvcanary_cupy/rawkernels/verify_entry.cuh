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

// Whether an entry's chain is checked against its predecessor prev: not for the padding slot, nor
// for a prev past the buffer (which sets OUT_OF_RANGE instead); a negative prev checks against the
// anchor's link.
__device__ __forceinline__ bool kvc_chain_checked(const KvcCanary& c, kvc_i64 prev) {
    return prev != KVC_PADDING_SLOT && prev < c.num_slots;
}

// The chain hash that predecessor prev gives, where the chain is checked (kvc_chain_checked; 0
// elsewhere): the anchor's link for a negative prev, else the link of prev's slot, read through the
// read-only path unless the caller has it already (known, with have_known).
template <bool kVec16>
__device__ __forceinline__ kvc_u64 kvc_predecessor_link(const KvcCanary& c, kvc_i64 prev,
                                                        bool have_known = false,
                                                        kvc_u64 known = 0) {
    if (!kvc_chain_checked(c, prev)) return 0;
    if (prev < 0) return kvc_anchor_link();
    if (have_known) return known;
    return kvc_slot_link(kvc_load_slot<kVec16, true>(c.buf, c.slot_stride, prev));
}

// The checks of an entry whose slot is in range and was read (s). prev: the predecessor slot;
// link: the chain hash it gives (kvc_predecessor_link; used only when the chain is checked).
__device__ __forceinline__ void kvc_check_slot(const KvcCanary& c, const KvcVerifyOut& out,
                                               kvc_i64 slot, const KvcSlot& s,
                                               kvc_i64 expected_token, kvc_i64 expected_position,
                                               kvc_i64 prev, kvc_u64 link) {
    const kvc_i64 report_token = out.check_token ? expected_token : KVC_NO_EXPECTED_TOKEN;
    const kvc_i64 token = s.w[KVC_FIELD_TOKEN];
    const kvc_i64 position = s.w[KVC_FIELD_POSITION];
    const kvc_i64 prev_hash = s.w[KVC_FIELD_PREV_HASH];
    const kvc_i64 stored_kv = s.w[KVC_FIELD_REAL_KV_HASH];

    kvc_i64 bits = 0;
    if (prev >= c.num_slots) bits |= KVC_BIT_OUT_OF_RANGE;
    kvc_i64 expected_chain = prev_hash;
    if (kvc_chain_checked(c, prev)) {
        expected_chain = (kvc_i64)link;
        if ((kvc_u64)prev_hash != link) bits |= KVC_BIT_CHAIN_HASH;
    }
    if (out.check_token && expected_token != KVC_NO_EXPECTED_TOKEN && token != expected_token)
        bits |= KVC_BIT_VERIFY_TOKEN;
    if (position != expected_position) bits |= KVC_BIT_POSITION;
    bool kv_oor = false;
    const kvc_u64 kv = out.src.count > 0 ? kvc_real_kv_hash<1>(out.src, slot, &kv_oor) : 0ull;
    if (kv_oor) bits |= KVC_BIT_OUT_OF_RANGE;
    if ((kvc_u64)stored_kv != kv) bits |= KVC_BIT_REAL_KV_HASH;
    if (bits) {
        kvc_record(out.ring, out.tag, slot, position, token, report_token, prev_hash,
                   expected_chain, bits);
    }
}

// A slot outside the canary buffer: recorded without reading anything.
__device__ __forceinline__ void kvc_record_out_of_range(const KvcVerifyOut& out, kvc_i64 slot,
                                                        kvc_i64 expected_token,
                                                        kvc_i64 expected_position) {
    kvc_record(out.ring, out.tag, slot, expected_position, 0,
               out.check_token ? expected_token : KVC_NO_EXPECTED_TOKEN, 0, 0,
               KVC_BIT_OUT_OF_RANGE);
}

__device__ __forceinline__ bool kvc_slot_in_range(const KvcCanary& c, kvc_i64 slot) {
    return slot >= 0 && slot < c.num_slots;
}

// Reads the slot (and its predecessor) through the read-only path: the buffer is not written
// while entries are checked.
template <bool kVec16>
__device__ __forceinline__ void kvc_verify_entry(const KvcCanary& c, const KvcVerifyOut& out,
                                                 kvc_i64 slot, kvc_i64 expected_token,
                                                 kvc_i64 expected_position, kvc_i64 prev) {
    if (slot == KVC_PADDING_SLOT) return;
    if (!kvc_slot_in_range(c, slot)) {
        kvc_record_out_of_range(out, slot, expected_token, expected_position);
        return;
    }
    const KvcSlot s = kvc_load_slot<kVec16, true>(c.buf, c.slot_stride, slot);
    const kvc_u64 link = kvc_predecessor_link<kVec16>(c, prev);
    kvc_check_slot(c, out, slot, s, expected_token, expected_position, prev, link);
}
