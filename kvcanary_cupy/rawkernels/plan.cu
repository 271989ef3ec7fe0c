// plan: builds the verify plan and the write plan of one forward batch (SPEC 3.3 and 4).
//
// One launch. Block 0 writes the write plan (the extend lengths scanned a tile of kTile requests at
// a time, each request's seed resolved); the other blocks write the verify plan. A decode-sized
// plan is a chain of memory round trips, and the seeds' (req_to_token, then the SWA LUT) would add
// to the verify rows' if one block did both.
// The verify plan: requests are taken in tiles of kTile (one request per thread). Every entry block
// scans the verify entry counts of a tile redundantly (a few KB, L2-resident), keeps each request's
// first entry index, pool row and first position in shared memory, then the entry blocks stride
// over the tile's verify entries: each warp finds its entries' requests (kvc_warp_entry) and the
// four plan arrays are written coalesced. Batches of at most 32 requests are staged by each warp
// instead, with no block barrier. With more than one tile, a first pass sums the counts, since the
// entries are written only when the total fits the verify capacity. Totals are int64; the verify
// total saturates (it is only compared with the capacity), the write offsets wrap like int64
// arithmetic.
#include "batch_plan.cuh"

// kTile: the block size (the launcher's plan_tile). Blocks of 1024 threads an SM asked for: left
// to pick, ptxas chose 32 registers on sm_80 and spilled. kLut: the batch has a LUT (the entries'
// reads then go in two rounds, kvc_plan_entry_early).
template <int kTile, bool kLut>
__global__ void __launch_bounds__(kTile, 1024 / kTile) kvc_plan(
    KVC_PLAN_IN_PARAMS, kvc_i64* v_slots, kvc_i64* v_tokens, kvc_i64* v_positions,
    kvc_i64* v_prev, int* v_num_valid, int* v_enable, kvc_i64 v_capacity, kvc_i64* w_offsets,
    kvc_i64* w_seeds, int* w_num_valid_reqs, kvc_i64 w_capacity) {
    static_assert(kTile % 32 == 0 && kTile <= 1024, "a tile is whole warps of one block");
    constexpr int kTileWarps = kTile / 32;
    __shared__ kvc_i64 s_warp[kTileWarps];
    __shared__ kvc_i64 s_start[kTile];
    __shared__ kvc_i64 s_rp[kTile];
    __shared__ kvc_i64 s_pos0[kTile];

    const KvcPlanIn in = KVC_PLAN_IN_FROM_PARAMS;
    kvc_i64 carry_w = 0;
    if (blockIdx.x == 0) {
        for (kvc_i64 tile = 0; tile < bs; tile += kTile) {
            carry_w = kvc_write_plan_tile<kTile>(in, tile, carry_w, w_offsets, w_seeds, w_capacity,
                                                 s_warp);
        }
    } else {
        const KvcEntryTile entries = {s_start, s_rp, s_pos0};
        const KvcEntryBlocks blocks = {(kvc_i64)blockIdx.x - 1, (kvc_i64)gridDim.x - 1};
        const auto write_rows = [&](const KvcEntry& e, kvc_i64 base) {
            if (!e.live) return;
            const kvc_i64 k = base + (threadIdx.x & 31);
            // the LUT instance reads its entry's values together first; the other reads each
            // value where it is stored (kvc_plan_entry_early says why both)
            const KvcPlanEntry p = kLut ? kvc_plan_entry_early(in, e.request, e.rp, e.pos)
                                        : KvcPlanEntry{};
            v_slots[k] = kLut ? p.slot : kvc_resolve(in, e.rp, e.pos);
            v_tokens[k] = kLut ? p.token : kvc_expected(in, e.request, e.rp, e.pos);
            v_positions[k] = e.pos;
            v_prev[k] = kLut ? p.prev : e.pos > 0 ? kvc_resolve(in, e.rp, e.pos - 1) : -1;
        };
        kvc_i64 total;
        if (bs <= 32) {
            const int lane = threadIdx.x & 31;
            const kvc_i64 rp = lane < bs ? req_pool_indices[lane] : 0;
            const kvc_i64 prefix = lane < bs ? prefix_lens[lane] : 0;
            total = kvc_for_small_batch_verify_entries<kTile>(in, entries, rp, prefix, v_capacity,
                                                              KVC_I64_MAX, blocks, write_rows);
        } else {
            total = kvc_for_verify_entries<kTile>(in, entries, s_warp, v_capacity, KVC_I64_MAX,
                                                  blocks, [](kvc_i64) {}, write_rows);
        }
        if (blockIdx.x == 1 && threadIdx.x == 0) {
            const kvc_i64 nv = kvc_min64(total, v_capacity);
            *v_num_valid = (int)kvc_min64(nv, KVC_INT32_MAX);
            *v_enable = total <= v_capacity ? 1 : 0;
        }
    }
    // block 0's thread 0, which holds the write plan's total, stores its last offset
    kvc_finish_write_plan<kTile>(bs, carry_w, w_offsets, w_seeds, w_num_valid_reqs, w_capacity);
}
