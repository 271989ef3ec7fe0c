"""kc.block_tables on a CUDA device: one launch each (rawkernels/block_tables.cu)."""

from __future__ import annotations

import numpy as np

from ....rawkernels import _loader
from . import Launch, i32, i64, kernel, launch, ptr, sm_count

_BLOCK = _loader.SPECS["block_tables"].constant("KVC_BLOCK_TABLES_THREADS")
_BLOCKS_PER_SM = 8  # enough resident threads to cover a copy's latency; the loops stride past them
_CTYPES = dict(zip((np.dtype(np.int32), np.dtype(np.int64)), _loader.BLOCK_TABLE_CTYPES))


def _element_stride(array, axis: int = 0) -> int:
    return int(array.strides[axis]) // int(array.itemsize) if array.shape[axis] > 1 else 0


def _grid(count: int, device_id: int) -> int:
    return max(1, min(-(-count // _BLOCK), _BLOCKS_PER_SM * sm_count(device_id)))


def mirror(req_to_token, table, rows, block_size: int, first_block: int, *, stream) -> None:
    """``rows``: the canary rows on the device (int64), or None for ``1 .. n``."""
    count, blocks = int(table.shape[0]), int(table.shape[1])
    device_id = req_to_token.device.id
    row_stride = int(req_to_token.strides[0]) // int(req_to_token.itemsize)
    fn = kernel("block_tables", f"kvc_mirror_blocks<{_CTYPES[table.dtype]}>", device_id)
    args = (table, i64(count), i64(blocks), i64(_element_stride(table, 0)), i64(_element_stride(table, 1)),
            ptr(rows), i64(block_size), i64(first_block * block_size), req_to_token, i64(row_stride))
    launch(fn, _grid(count * blocks * block_size, device_id), _BLOCK, args, stream)


def prepare_fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens) -> Launch:
    """A batch's fields from its offsets, one launch, its parameters packed once (the current device
    the arrays'): call it with a stream. ``rows``: the batch's rows, or None for ``1 .. bs``;
    ``tokens``: up to three ``(source, out)`` pairs, each source widened into its out."""
    bs = int(seq_lens.shape[0])
    pairs = list(tokens) + [(None, None)] * (3 - len(tokens))
    inputs = (query_start_loc, seq_lens, rows) + tuple(source for source, _ in pairs)
    mask = sum(1 << bit for bit, array in enumerate(inputs) if array is not None and array.dtype == np.int32)
    counts = [0 if source is None else int(source.shape[0]) for source, _ in pairs]
    args = (query_start_loc, seq_lens, ptr(rows), i64(_element_stride(query_start_loc)),
            i64(_element_stride(seq_lens)), i64(0 if rows is None else _element_stride(rows)), i32(mask), i64(bs),
            rows_out, prefix_out, extend_out, *(ptr(source) for source, _ in pairs),
            *(i64(0 if source is None else _element_stride(source)) for source, _ in pairs),
            *(i64(count) for count in counts), *(ptr(out) for _, out in pairs))
    device_id = seq_lens.device.id
    fn = kernel("block_tables", "kvc_batch_from_offsets", device_id)
    return Launch(fn, _grid(bs + sum(counts), device_id), _BLOCK, args, packed=True)


def fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens, *, stream) -> None:
    """:func:`prepare_fill`'s launch, once."""
    prepare_fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens)(stream)
