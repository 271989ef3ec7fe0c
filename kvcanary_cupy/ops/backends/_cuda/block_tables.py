"""kc.block_tables on a CUDA device: one launch each (rawkernels/block_tables.cu)."""

from __future__ import annotations

import numpy as np

from ....rawkernels import _loader
from . import i64, kernel, launch, ptr, sm_count

_BLOCK = _loader.SPECS["block_tables"].constant("KVC_BLOCK_TABLES_THREADS")
_BLOCKS_PER_SM = 8  # enough resident threads to cover a copy's latency; the loops stride past them
_CTYPES = dict(zip((np.dtype(np.int32), np.dtype(np.int64)), _loader.BLOCK_TABLE_CTYPES))


def _element_stride(array, axis: int = 0) -> int:
    return int(array.strides[axis]) // int(array.itemsize) if array.shape[axis] > 1 else 0


def _launch(template: str, dtypes: tuple, count: int, args: tuple, device_id: int, stream) -> None:
    fn = kernel("block_tables", f"{template}<{', '.join(_CTYPES[np.dtype(dtype)] for dtype in dtypes)}>", device_id)
    grid = max(1, min(-(-count // _BLOCK), _BLOCKS_PER_SM * sm_count(device_id)))
    launch(fn, grid, _BLOCK, args, stream)


def mirror(req_to_token, table, rows, block_size: int, first_block: int, *, stream) -> None:
    """``rows``: the canary rows on the device (int64), or None for ``1 .. n``."""
    count, blocks = int(table.shape[0]), int(table.shape[1])
    device_id = req_to_token.device.id
    row_stride = int(req_to_token.strides[0]) // int(req_to_token.itemsize)
    args = (table, i64(count), i64(blocks), i64(_element_stride(table, 0)), i64(_element_stride(table, 1)),
            ptr(rows), i64(block_size), i64(first_block * block_size), req_to_token, i64(row_stride))
    _launch("kvc_mirror_blocks", (table.dtype,), count * blocks * block_size, args, device_id, stream)


def lengths(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, *, stream) -> None:
    """``query_start_loc`` and ``seq_lens`` of one dtype; ``rows``: the batch's rows, or None for ``1 .. bs``."""
    bs = int(seq_lens.shape[0])
    args = (query_start_loc, i64(_element_stride(query_start_loc)), seq_lens, i64(_element_stride(seq_lens)),
            ptr(rows), i64(0 if rows is None else _element_stride(rows)), i64(bs), rows_out, prefix_out, extend_out)
    row_dtype = seq_lens.dtype if rows is None else rows.dtype
    _launch("kvc_batch_lengths", (seq_lens.dtype, row_dtype), bs, args, seq_lens.device.id, stream)


def widen(source, out, *, stream) -> None:
    count = int(source.shape[0])
    args = (source, i64(_element_stride(source)), i64(count), out)
    _launch("kvc_widen", (source.dtype,), count, args, source.device.id, stream)
