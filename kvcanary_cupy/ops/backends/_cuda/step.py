"""The canary step on a CUDA device: one launch for decode batches (verify entries derived from the
metadata, then the write: by the last block's first warp up to 32 requests; by block 0, which
stores the write plan and waits for the verify blocks, a thread a request up to 512), otherwise
the step kernel (verify and the write plan) followed by the write kernel."""

from __future__ import annotations

import numpy as np

from ...._dlpack import filled, settle
from ....rawkernels import _loader
from . import Launch, context_args, decode_shaped, i64, kernel, ptr, resident_grid, vec16
from .plan import batch_args, most_verify_entries, write_plan_args
from .write import entry_args, has_real_kv, prepare as prepare_write

_BLOCK = _loader.SPECS["step"].constant("KVC_STEP_THREADS")
# The kTailWrite kernel's last block writes a request per lane of its first warp, with the small
# batch path alone in its code. The kernel's bound (it writes nothing past it).
TAIL_MAX_REQUESTS = _loader.SPECS["step"].constant("KVC_STEP_TAIL_MAX_REQUESTS")


def tail_write(batch_size: int, num_entries: int) -> bool:
    """Decode-shaped and small: at most two new tokens per request on average, at most
    TAIL_MAX_REQUESTS requests."""
    return batch_size <= TAIL_MAX_REQUESTS and decode_shaped(batch_size, num_entries)


def plan_block_write(batch_size: int, num_entries: int) -> bool:
    """Past tail_write: the step kernel's block 0, which stores the write plan, also writes, a
    thread a request, once the other blocks have verified, instead of a second launch.
    Decode-shaped and at most one request a thread of a block, so at most two entries a thread:
    with real-KV sources block 0 hashes that many new slots ahead (the kernel's kAheadEntries)
    while the other blocks verify."""
    return decode_shaped(batch_size, num_entries) and batch_size <= _BLOCK


def prepare(ctx, wplan, batch, writes, *, verify_capacity: int, verify_tag: int,
            check_expected_token: bool) -> list[Launch]:
    device_id = ctx.device.index
    bs = batch.batch_size
    real_kv = has_real_kv(ctx)
    tail = tail_write(bs, writes.num_entries)
    plan_block = not tail and plan_block_write(bs, writes.num_entries)
    name = _loader.instance("kvc_step", vec16(ctx.canary_buf), tail, real_kv)
    fn = kernel("step", name, device_id)
    # Entries live on the device; the grid is sized by what they can be at most (the grid-stride
    # loop is exact for any grid).
    most = most_verify_entries(batch, verify_capacity)
    verify_blocks = -(-most // _BLOCK)
    if not tail:
        verify_blocks += 1  # block 0 stores the write plan, apart from the verify
    grid = max(1 if tail else 2, min(resident_grid("step", name, device_id, _BLOCK), verify_blocks))
    blocks_done = filled((1,), np.uint32, ctx.device)  # zero at the first launch, whatever its stream
    settle(ctx.device)
    args = (
        ptr(ctx.canary_buf), i64(ctx.num_slots), i64(ctx.slot_stride_bytes), *context_args(ctx),
        ptr(ctx.chain_position_assert),
        *batch_args(batch),
        i64(int(verify_capacity)), i64(int(verify_tag)), i64(1 if check_expected_token else 0),
        *write_plan_args(wplan),
        *entry_args(writes), i64(int(writes.tag)), blocks_done, i64(1 if plan_block else 0),
    )
    # Packed once: a step relaunches with the same arguments every forward.
    launches = [Launch(fn, grid, _BLOCK, args, packed=True)]
    if not (tail or plan_block):
        launches.append(prepare_write(ctx, wplan, writes, packed=True))
    return launches
