"""copy_records on a CUDA device: one grid-stride launch to stage the records, one to store them."""

from __future__ import annotations

from .... import _layout as L
from ....rawkernels import _loader
from . import i64, kernel, launch, ptr, resident_grid

_BLOCK = _loader.SPECS["records"].constant("KVC_RECORDS_THREADS")


def _launch(name: str, ctx, slots, staged, stream) -> None:
    count = int(slots.shape[0])
    if count == 0:
        return
    device_id = ctx.device.index
    grid = max(1, min(resident_grid("records", name, device_id, _BLOCK), -(-count // _BLOCK)))
    args = (ptr(ctx.canary_buf), i64(ctx.slot_stride_bytes // L.SLOT_WORD_BYTES), i64(ctx.num_slots), ptr(slots),
            i64(count), ptr(staged))
    launch(kernel("records", name, device_id), grid, _BLOCK, args, stream)


def gather(ctx, slots, staged, *, stream) -> None:
    """``staged[i]``: the record of ``slots[i]`` and 1 where the slot is in range, else zeros."""
    _launch("kvc_gather_records", ctx, slots, staged, stream)


def scatter(ctx, slots, staged, *, stream) -> None:
    """The record staged for each pair stored at ``slots[i]`` where it was gathered in range and the
    slot is in range (pairs naming one slot twice: which one lands is unspecified)."""
    _launch("kvc_scatter_records", ctx, slots, staged, stream)
