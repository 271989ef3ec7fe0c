"""plan on a CUDA device (SPEC §3.3): one launch builds the verify plan and the write plan."""

from __future__ import annotations

from ....rawkernels import _loader
from . import Launch, i64, kernel, ptr, resident_grid, table_args

SMALL_TILE, TILE = _loader.PLAN_TILES
# Verify entries up to which a batch that fits the small tile takes it.
SMALL_TILE_MAX_ENTRIES = 1 << 16


def most_verify_entries(batch, verify_capacity: int) -> int:
    """How many verify entries the batch can have at most, as far as the host knows without its
    lengths (they live on the device): what sizes a grid whose loop over the entries is exact for
    any grid."""
    width = int(batch.req_to_token.shape[1])
    window = int(batch.swa_window_size)
    per_request = min(width, window) if window > 0 else width
    return min(int(verify_capacity), batch.batch_size * max(per_request, 1))


def plan_tile(batch_size: int, most_entries: int) -> int:
    """The plan kernel's block size. A batch of a few verify entries at most (decode batches of short
    prefixes or an SWA window, a request of a long one) is a chain of memory round trips, which
    blocks of SMALL_TILE threads start and finish sooner: bs 1 to 256 with up to 64 K entries
    measured 0.3-0.7 us faster than with 1024 threads. Past that, TILE: bs 32 x 4096 entries measured
    0.4 us slower in small blocks, and a batch of several small tiles (a first pass for the total,
    a barrier a tile) twice as slow at bs 4096 x 512."""
    small = batch_size <= SMALL_TILE and most_entries <= SMALL_TILE_MAX_ENTRIES
    return SMALL_TILE if small else TILE


def batch_args(batch) -> tuple:
    """The batch metadata in the order plan.cu and step.cu take it (``KvcPlanIn``)."""
    rtt, rows, width, stride = table_args(batch.req_to_token)
    lut = batch.full_to_swa_index_mapping
    lut_len = int(lut.shape[0]) if lut is not None else 0
    pool = batch.req_to_verify_expected_tokens
    valid_lens = batch.req_to_verify_expected_tokens_valid_lens
    if pool is None or valid_lens is None:
        pool = valid_lens = None
    exp, exp_rows, exp_cols, exp_stride = table_args(pool)
    return (
        ptr(batch.req_pool_indices), ptr(batch.prefix_lens), ptr(batch.extend_seq_lens),
        i64(batch.batch_size),
        rtt, i64(rows), i64(width), i64(stride), i64(int(batch.swa_window_size)),
        i64(0 if lut is None else 1), ptr(lut), i64(lut_len),
        i64(0 if pool is None else 1), exp, i64(exp_rows), i64(exp_cols), i64(exp_stride),
        ptr(valid_lens), i64(int(batch.kv_token_id_vs_position_offset)),
    )


def write_plan_args(wplan) -> tuple:
    return (ptr(wplan.offsets), ptr(wplan.seed_slot_indices), ptr(wplan.num_valid_reqs),
            i64(int(wplan.capacity)))


def plan(vplan, wplan, batch, *, stream) -> None:
    prepare(vplan, wplan, batch)(stream)


def prepare(vplan, wplan, batch, *, packed: bool = False) -> Launch:
    device_id = batch.device.index
    v_capacity = int(vplan.capacity)
    w_capacity = int(wplan.capacity)
    most = most_verify_entries(batch, v_capacity)
    tile = plan_tile(batch.batch_size, most)
    name = _loader.plan_instance(tile, batch.full_to_swa_index_mapping is not None)
    fn = kernel("plan", name, device_id)
    # block 0 writes the write plan, the others the verify plan (every block pads the write plan)
    entry_blocks = max(1, min(resident_grid("plan", name, device_id, tile) - 1,
                              max(-(-most // tile), (w_capacity + tile) // tile)))
    grid = 1 + entry_blocks
    args = (
        *batch_args(batch),
        ptr(vplan.slot_indices), ptr(vplan.expected_tokens), ptr(vplan.expected_positions),
        ptr(vplan.prev_slot_indices), ptr(vplan.num_valid), ptr(vplan.enable), i64(v_capacity),
        *write_plan_args(wplan),
    )
    return Launch(fn, grid, tile, args, packed=packed)
