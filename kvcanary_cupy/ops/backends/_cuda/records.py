"""copy_records on a CUDA device: one grid-stride launch between two canaries of the device; across
devices, one to stage the records and one to store them."""

from __future__ import annotations

from .... import _layout as L
from ....rawkernels import _loader
from . import i64, kernel, launch, ptr, resident_grid

_BLOCK = _loader.SPECS["records"].constant("KVC_RECORDS_THREADS")


def _slot_words(ctx) -> tuple:
    """A canary's buffer, its slot stride in words and its slot count, as the kernels take them."""
    return ptr(ctx.canary_buf), i64(ctx.slot_stride_bytes // L.SLOT_WORD_BYTES), i64(ctx.num_slots)


def _launch(name: str, device_id: int, count: int, args: tuple, stream) -> None:
    if count == 0:
        return
    grid = max(1, min(resident_grid("records", name, device_id, _BLOCK), -(-count // _BLOCK)))
    launch(kernel("records", name, device_id), grid, _BLOCK, args, stream)


def copy(src, dst, src_slots, dst_slots, *, stream) -> None:
    """The record of ``src_slots[i]`` stored at ``dst_slots[i]`` where both are in range (both
    canaries on this device)."""
    count = int(src_slots.shape[0])
    _launch("kvc_copy_records", src.device.index, count * L.SLOT_FIELD_COUNT,  # a thread a word
            (*_slot_words(src), ptr(src_slots), *_slot_words(dst), ptr(dst_slots), i64(count)), stream)


def gather(ctx, slots, staged, *, stream) -> None:
    """``staged[i]``: the record of ``slots[i]`` and 1 where the slot is in range, else zeros."""
    count = int(slots.shape[0])
    _launch("kvc_gather_records", ctx.device.index, count, (*_slot_words(ctx), ptr(slots), i64(count), ptr(staged)),
            stream)


def scatter(ctx, slots, staged, *, stream) -> None:
    """The record staged for each pair stored at ``slots[i]`` where it was gathered in range and the
    slot is in range (pairs naming one slot twice: which one lands is unspecified)."""
    count = int(slots.shape[0])
    _launch("kvc_scatter_records", ctx.device.index, count, (*_slot_words(ctx), ptr(slots), i64(count), ptr(staged)),
            stream)
