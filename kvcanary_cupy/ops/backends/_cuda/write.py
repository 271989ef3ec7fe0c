"""write on a CUDA device (SPEC §3.1): a warp per request chain, hashing spread over the grid."""

from __future__ import annotations

from . import i64, kernel, launch, ptr, resident_grid, vec16

_BLOCK = 256          # kThreads in write.cu
_WARPS = _BLOCK // 32


def write(ctx, wplan, batch, *, stream) -> None:
    device_id = ctx.device.index
    name = "kvc_write<true>" if vec16(ctx.canary_buf) else "kvc_write<false>"
    fn = kernel("write", name, device_id)
    capacity = int(wplan.capacity)
    table = ctx.source_table
    nsrc = int(table.shape[0])
    resident = resident_grid("write", name, device_id, _BLOCK)
    if nsrc > 0:
        grid = resident  # long requests hand their hashing to every block
    else:
        grid = max(1, min(resident, capacity))  # one chain per block while requests are few
    expected_tokens = batch.expected_input_tokens
    expected_positions = batch.expected_input_positions
    num_entries = min(int(batch.input_ids.shape[0]), int(batch.positions.shape[0]),
                      int(batch.out_cache_loc.shape[0]))
    if expected_tokens is not None and expected_positions is not None:
        num_entries = min(num_entries, int(expected_tokens.shape[0]),
                          int(expected_positions.shape[0]))
    else:
        expected_tokens = expected_positions = None
    args = (
        ptr(ctx.canary_buf), i64(ctx.num_slots), i64(ctx.slot_stride_bytes),
        ptr(wplan.offsets), ptr(wplan.seed_slot_indices), ptr(wplan.num_valid_reqs), i64(capacity),
        ptr(batch.input_ids), ptr(batch.positions), ptr(batch.out_cache_loc),
        ptr(expected_tokens), ptr(expected_positions), i64(num_entries),
        ptr(ctx.chain_position_assert), ptr(ctx.violation_ring), i64(ctx.ring_capacity),
        ptr(ctx.violation_write_index), ptr(ctx.slot_run_counter), ptr(ctx.kernel_run_counter),
        ptr(table), i64(nsrc), i64(int(batch.tag)),
    )
    launch(fn, grid, _BLOCK, args, stream)
