"""copy_records: slots' records carried to other slots, of the same canary or of another one on
any device, as their KV moves (to a host-memory tier and back, to another device, within a pool)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _layout as L
from .. import validate as check
from .._dlpack import Device, data_pointer, require_cupy, stream_capturing, to_host
from ..context import require_intact
from ._dispatch import backend_module, check_stream_form, on_device, resolve_stream
from .batches import RecordCopy


def copy_records(*, src: Any, dst: Any, src_slots: Any, dst_slots: Any, stream: Any = None) -> None:
    """For each pair ``i``, the record (token, position, chain hash, real-KV hash) of
    ``src_slots[i]`` in ``src`` stored at ``dst_slots[i]`` in ``dst``: a pair with either slot out
    of range stores nothing. Move the KV bytes too, and the next verify at the destination checks
    them against the hash they had when they were written, their chain and positions as before.

    ``src`` and ``dst`` must hash KV alike (:attr:`CanaryContext.kv_read_lengths`: the same bytes
    a source, in order; that the sources are the same layers, K and V in the same order, is the
    caller's to keep). They may be one canary: every record is read before any is stored. Pairs
    naming one destination twice leave the last one's record on the CPU, an undefined one on a GPU.

    On one device it is one launch on ``stream`` (two within one buffer) and nothing waits. Across
    devices the records travel through host memory: the call waits for the source's stream
    (``stream`` when the source is the one GPU side, else its device's current stream), and the
    store is queued on the destination's (done on return for a CPU destination); ``stream`` must be
    None between two GPUs. A copy that stages its records (within one buffer, or across devices)
    cannot be captured in a CUDA graph.
    """
    run_record_copy(RecordCopy(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots), stream)


def run_record_copy(move: RecordCopy, stream: Any = None) -> Any:
    """:func:`copy_records` of a validated ``move``; returns the destination's stream (None on the
    CPU), where the records are stored."""
    for ctx in (move.src, move.dst):  # their forms (RecordCopy checked what the copy writes)
        require_intact(ctx, writes=())
    src_stream, dst_stream = _streams(move.src.device, move.dst.device, stream)
    one_device = move.dst.device == move.src.device
    direct = one_device and not _overlapping(move.src.canary_buf, move.dst.canary_buf)
    if not direct and any(stream_capturing(s) for s in (src_stream, dst_stream)):
        raise ValueError(f"{check.PREFIX}stream must not be capturing a CUDA graph for a copy that stages its "
                         f"records (across devices, or within one canary's buffer), got a capturing stream")
    if move.count == 0:
        return dst_stream
    if direct:
        with on_device(move.src.device, src_stream):
            backend_module(move.src.device, "records").copy(move.src, move.dst, move.src_slots, move.dst_slots,
                                                            stream=src_stream)
        return dst_stream
    # across devices, or within one buffer (every record read before any is stored)
    staged = _staging(move.count, move.src.device, src_stream)
    with on_device(move.src.device, src_stream):
        backend_module(move.src.device, "records").gather(move.src, move.src_slots, staged, stream=src_stream)
    if not one_device:
        staged = _carried(staged, src_stream, move.dst.device, dst_stream)
    with on_device(move.dst.device, dst_stream):
        backend_module(move.dst.device, "records").scatter(move.dst, move.dst_slots, staged, stream=dst_stream)
    return dst_stream


def stored_destinations(move: RecordCopy, dst_stream: Any) -> Any:
    """A new array, on the destination's device: each pair's destination slot where both its slots
    are in range, -1 where either is not (such a pair stores nothing). Call it once
    :func:`run_record_copy` has run the copy: across devices that has waited for the source's
    slots, read here from the host."""
    src_slots = move.src_slots if move.src.device == move.dst.device else to_host(move.src_slots)
    with on_device(move.dst.device, dst_stream):
        xp = require_cupy("device") if move.dst.device.is_cuda else np
        src_slots, dst_slots = xp.asarray(src_slots), move.dst_slots
        stores = (src_slots >= 0) & (src_slots < move.src.num_slots) & (dst_slots >= 0) & \
            (dst_slots < move.dst.num_slots)
        return xp.where(stores, dst_slots, -1)


def _overlapping(a, b) -> bool:
    """Whether two canary buffers share any byte (one canary, or views of one allocation)."""
    start_a, start_b = data_pointer(a), data_pointer(b)
    return start_a < start_b + int(b.nbytes) and start_b < start_a + int(a.nbytes)


def _streams(src: Device, dst: Device, stream: Any) -> tuple[Any, Any]:
    """The stream of each side (None on the CPU), after ``stream``'s form is checked."""
    check_stream_form(stream)
    if src.is_cuda and dst.is_cuda and src != dst and stream is not None:
        raise ValueError(f"{check.PREFIX}stream must be None when src and dst are on different GPUs "
                         f"({src} and {dst}: each side runs on its device's current stream), got {stream!r}")
    return tuple(resolve_stream(stream, device) if device.is_cuda else None for device in (src, dst))


def _staging(count: int, device: Device, stream: Any):
    """Rows for ``count`` staged records on ``device``, allocated for ``stream`` (every cell is
    written by the gather)."""
    if not device.is_cuda:
        return np.empty((count, L.STAGED_RECORD_WORDS), np.int64)
    with on_device(device, stream):
        return require_cupy("device").empty((count, L.STAGED_RECORD_WORDS), np.int64)


def _carried(staged, src_stream: Any, device: Device, stream: Any):
    """The staged rows on ``device``, once the gather that fills them is done."""
    if src_stream is not None:
        src_stream.synchronize()
    host = to_host(staged)
    if not device.is_cuda:
        return host
    with on_device(device, stream):
        return require_cupy("device").asarray(host)
