"""kc.block_tables on the CPU: NumPy, whose integers wrap as the CUDA kernels' unsigned arithmetic does."""

from __future__ import annotations

import numpy as np

from .... import _layout as L

_INT32_MAX = np.int64(L.INT32_MAX)


def mirror(req_to_token, table, rows, block_size: int, first_block: int, *, stream=None) -> None:
    """``rows``: the canary rows (int64), or None for ``1 .. n``."""
    count, blocks = table.shape
    if rows is None:
        rows = np.arange(1, count + 1, dtype=np.int64)
    start = first_block * block_size
    offsets = np.arange(block_size, dtype=np.int64)
    blocks_of = table.astype(np.int64)[:, :, None]
    # a slot int32 cannot hold is stored as -1 (read as OUT_OF_RANGE), as block_tables.cu does
    fits = (blocks_of >= 0) & (blocks_of <= (_INT32_MAX - offsets) // block_size)
    slots = np.where(fits, np.where(fits, blocks_of, 0) * block_size + offsets, -1)
    req_to_token[rows, start:start + blocks * block_size] = slots.reshape(count, blocks * block_size).astype(np.int32)


def fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens, *, stream=None) -> None:
    """A batch's fields from its offsets. ``rows``: the batch's rows, or None for ``1 .. bs``;
    ``tokens``: ``(source, out)`` pairs, each source widened into its out."""
    starts = query_start_loc.astype(np.int64)
    with np.errstate(over="ignore"):
        extend = starts[1:] - starts[:-1]
        prefix_out[...] = seq_lens.astype(np.int64) - extend
    extend_out[...] = extend
    rows_out[...] = np.arange(1, seq_lens.shape[0] + 1) if rows is None else rows
    for source, out in tokens:
        out[:source.shape[0]] = source


def prepare_fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens):
    """:func:`fill` bound to its arrays, called with a stream (ignored), as the CUDA backend's."""
    return lambda stream=None: fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens)
