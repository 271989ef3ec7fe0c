// write_decode: the write (SPEC 3.1 and 4) of a decode-shaped batch, kvc_write_decode below. A
// compilation unit of its own: it compiles at the same time as kvc_write's (write.cu), and a
// process that writes only decode batches compiles only this one.
#include "write_request.cuh"

// A decode-shaped write (the host's decode_form: at most two new tokens a request on average, one
// with real-KV sources), walking each request's entries in the reference's order
// (kvc_write_request). Without real-KV sources a thread walks a request: its chains are a token or
// two, so kvc_write's warp a request leaves most lanes idle, and its code is a small part of
// kvc_write's, which a decode write fetches with cold instruction caches (bs 1 to 1024 measured
// 0.5-0.7 us faster). With sources a group of KVC_WRITE_DECODE_LANES lanes walks a request, each
// lane reading a share of its sources, so they are read at once by as many lanes instead of one
// thread reading them all. kShortReads (with sources only): the host found at most
// KVC_WRITE_DECODE_LANES sources, each read in at most 32 bytes (kvc_hash_in_group).
template <bool kVec16, bool kRealKv, bool kShortReads>
__global__ void __launch_bounds__(KVC_WRITE_DECODE_THREADS, kRealKv ? 1 : 0) kvc_write_decode(
    KVC_WRITE_PARAMS) {
    constexpr int kLanes = kRealKv ? KVC_WRITE_DECODE_LANES : 1;
    static_assert(KVC_WRITE_DECODE_THREADS % 32 == 0 && 32 % KVC_WRITE_DECODE_LANES == 0,
                  "a request's lanes are a share of one warp");
    const kvc_i64 r = ((kvc_i64)blockIdx.x * blockDim.x + threadIdx.x) / kLanes;
    // Requested before the request count arrives (rows below the capacity exist, offsets has one
    // more), with entry r, which request r writes in a batch of a token a request.
    kvc_i64 begin = 0, end = 0, seed = -1;
    if (r < capacity) {
        begin = kvc_ld_early(offsets + r);
        end = kvc_ld_early(offsets + r + 1);
        seed = kvc_ld_early(seed_slots + r);
    }
    const KvcRing ring = {ring_rows, ring_capacity, ring_write_index};
    const KvcSources src = {source_table, kRealKv ? (int)num_sources : 0};
    const KvcWriteIn w = KVC_WRITE_IN_FROM_PARAMS;
    const KvcWriteEntry guess = kvc_request_write_entry<true>(w, r);
    // the descriptor of the first source this lane folds, read beside the request's inputs
    const int member = (int)(threadIdx.x % kLanes);
    KvcSourceDesc own_source = {0, 0, 0, 0, 0, 0};
    if (kRealKv && member < src.count) own_source = kvc_source_desc_early(src, member);
    const kvc_i64 nreq = kvc_clamp_count(*num_valid_reqs, capacity);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        atomicAdd(kernel_run_counter, 1ull);
        kvc_prefetch_word(slot_run_counter);  // the warps add their stored slots at the end
    }
    const KvcCanary c = {canary, num_slots, slot_stride};
    unsigned long long stored = 0;
    if (r < nreq) {
        stored = kvc_write_request<kVec16, kLanes, kShortReads>(c, w, begin, end, seed, guess,
                                                                begin == r, nullptr, &own_source);
    }
    stored = kvc_warp_sum(stored);
    if ((threadIdx.x & 31) == 0 && stored) atomicAdd(slot_run_counter, stored);
}
