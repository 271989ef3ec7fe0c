"""verify on a CUDA device (SPEC §3.2): one thread per plan entry."""

from __future__ import annotations

from ....rawkernels import _loader
from . import Launch, context_args, i64, kernel, ptr, resident_grid, vec16

_BLOCK = _loader.SPECS["verify"].constant("KVC_VERIFY_THREADS")


def verify(ctx, vplan, *, tag: int, check_expected_token: bool, stream) -> None:
    prepare(ctx, vplan, tag=tag, check_expected_token=check_expected_token)(stream)


def prepare(ctx, vplan, *, tag: int, check_expected_token: bool, packed: bool = False) -> Launch:
    device_id = ctx.device.index
    name = _loader.instance("kvc_verify", vec16(ctx.canary_buf))
    fn = kernel("verify", name, device_id)
    capacity = int(vplan.capacity)
    grid = max(1, min(resident_grid("verify", name, device_id, _BLOCK),
                      (capacity + _BLOCK - 1) // _BLOCK))
    args = (
        ptr(ctx.canary_buf), i64(ctx.num_slots), i64(ctx.slot_stride_bytes),
        ptr(vplan.slot_indices), ptr(vplan.expected_tokens), ptr(vplan.expected_positions),
        ptr(vplan.prev_slot_indices), ptr(vplan.num_valid), ptr(vplan.enable), i64(capacity),
        *context_args(ctx), i64(int(tag)), i64(1 if check_expected_token else 0),
    )
    return Launch(fn, grid, _BLOCK, args, packed=packed)
