"""Engines with block tables or cumulative token offsets (vLLM-style metadata), in the canary's terms.

The canary reads a per-position slot table, ``req_to_token`` (SPEC 3.3), and per-request lengths.
An engine that keeps a block table per request (block ids, ``block_size`` tokens a block, a token's
slot ``block * block_size + offset``) mirrors the rows it changes into that table with
:func:`mirror`; one that describes a batch by cumulative token offsets (``query_start_loc``) and
total lengths (``seq_lens``), often int32, builds its :class:`~kvcanary_cupy.ForwardBatch` with
:func:`forward_batch` (also ``ForwardBatch.from_offsets``).

Both run on the arrays' own device (NumPy on the host, CuPy on a GPU, other frameworks' arrays
through DLPack, zero-copy) and queue their work on ``stream`` (CuPy's current stream of that device
when None), so pass the forward's stream to them and to the canary alike. Neither waits for the
device, so values that live on a GPU are not checked: a block id past the pool gives slots the
canary reports as ``OUT_OF_RANGE`` where it reads them, offsets that do not fit the tokens surface
at the next poll.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import validate as check
from ._dlpack import cupy_module, device_of, native_view
from .ops._dispatch import check_stream_form, on_device, resolve_stream

__all__ = ["forward_batch", "mirror"]

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_PASSED_THROUGH = ("expected_input_tokens", "expected_input_positions", "expected_valid_lens", "swa_out_cache_loc")


def _xp(device):
    return cupy_module() if device.is_cuda else np


def _views(arrays: dict, stream: Any):
    """Native views of the named arrays (None left out), all on one device; with the device and
    the resolved stream."""
    given = {name: array for name, array in arrays.items() if array is not None}
    device = check.one_device({name: device_of(array, name) for name, array in given.items()})
    views = {name: native_view(array, name, device) for name, array in given.items()}
    if device.is_cuda:
        stream = resolve_stream(stream, device)
    else:
        check_stream_form(stream)
    return device, views, stream


def mirror(req_to_token: Any, *, block_table: Any, block_size: int, rows: Optional[Sequence[int]] = None,
           first_block: int = 0, stream: Any = None) -> None:
    """Write the slots of ``block_table``'s rows into ``req_to_token``.

    ``block_table``: ``int32`` or ``int64 [n, blocks]``, the block ids of ``n`` requests (or a
    window of their columns, starting at block ``first_block``). ``req_to_token``: the canary's
    ``int32`` slot table, each row at least ``(first_block + blocks) * block_size`` wide. Block-table
    row ``i`` goes to canary row ``rows[i]`` (host integers; ``1 .. n`` by default, row 0 being the
    padding row): ``req_to_token[rows[i], (first_block + b) * block_size + o] = block_table[i, b] *
    block_size + o``. Cells past a request's tokens are written too and never read.

    Call it once the engine's table holds a request's blocks (a new request's, prefix-cache hits
    included; appended blocks, or a row that moved) and before the ``before_forward`` of the forward
    that reads them. It writes ``n * blocks * block_size`` cells: mirror the rows (and columns)
    that changed, not the whole table each forward. Eager only: it allocates temporaries, so do not
    capture it in a CUDA graph.
    """
    block_size = check.positive("block_size", block_size)
    first_block = check.non_negative("first_block", first_block)
    device, views, stream = _views({"req_to_token": req_to_token, "block_table": block_table}, stream)
    target, table = views["req_to_token"], views["block_table"]
    check.table("req_to_token", target, np.int32)
    check.writable("req_to_token", target)
    check.dtype("block_table", table, _INDEX_DTYPES)
    check.ndim("block_table", table, 2)
    count, blocks = table.shape
    canary_rows = (np.arange(1, count + 1, dtype=np.int64) if rows is None
                   else check.host_int64("rows", rows))
    check.length("rows", canary_rows, count, "one canary row for each block-table row")
    check.request_rows("rows", canary_rows, target.shape[0])
    start, stop = first_block * block_size, (first_block + blocks) * block_size
    if stop > target.shape[1]:
        raise ValueError(f"{check.PREFIX}req_to_token must be at least (first_block + blocks) * block_size = "
                         f"({first_block} + {blocks}) * {block_size} = {stop} wide (a cell for each slot of "
                         f"the block table's columns), got width {target.shape[1]}")
    if count == 0 or blocks == 0:
        return
    xp = _xp(device)
    with on_device(device, stream):
        offsets = xp.arange(block_size, dtype=np.int64)
        slots = table.astype(np.int64)[:, :, None] * block_size + offsets
        target[xp.asarray(canary_rows), start:stop] = slots.reshape(count, stop - start).astype(np.int32)


def forward_batch(*, query_start_loc: Any, seq_lens: Any, input_ids: Any, positions: Any, out_cache_loc: Any,
                  req_pool_indices: Any = None, req_ids: Optional[Sequence[Any]] = None, stream: Any = None,
                  **optional: Any):
    """A :class:`~kvcanary_cupy.ForwardBatch` from cumulative token offsets.

    ``query_start_loc``: ``[bs + 1]``, request ``r``'s new tokens are ``[query_start_loc[r],
    query_start_loc[r + 1])`` of ``input_ids``, ``positions`` and ``out_cache_loc`` (the slot
    mapping); ``seq_lens``: ``[bs]``, each request's tokens once this forward has written its own
    (cached plus new); ``req_pool_indices``: ``[bs]`` canary rows (``1 .. bs`` when None: batch row
    ``r`` in canary row ``r + 1``, as :func:`mirror` puts block-table row ``r``). Each may be
    ``int32`` or ``int64``; ``extend_seq_lens`` and ``prefix_lens`` are derived, and every array is
    given to the batch as ``int64`` (a copy only where it is not already). Tokens past
    ``query_start_loc[bs]`` (a padded tail) are not read. ``optional``: the other fields of
    ``ForwardBatch`` (``expected_input_tokens``...), passed through as given.
    """
    from .session import ForwardBatch  # imported here: the session module takes this function as from_offsets

    unknown = sorted(set(optional) - set(_PASSED_THROUGH))
    if unknown:
        raise TypeError(f"{check.PREFIX}forward_batch takes ForwardBatch's optional fields {_PASSED_THROUGH} as "
                        f"keywords besides its own, got {unknown[0]!r}")
    device, views, stream = _views({"query_start_loc": query_start_loc, "seq_lens": seq_lens,
                                    "input_ids": input_ids, "positions": positions,
                                    "out_cache_loc": out_cache_loc, "req_pool_indices": req_pool_indices}, stream)
    for name, view in views.items():
        check.dtype(name, view, _INDEX_DTYPES)
        check.ndim(name, view, 1)
    size = views["seq_lens"].shape[0]
    check.length("query_start_loc", views["query_start_loc"], size + 1, "one more than seq_lens has requests")
    if req_pool_indices is not None:
        check.length("req_pool_indices", views["req_pool_indices"], size, "one canary row for each request")
    if not device.is_cuda:
        _host_offsets(views)
    xp = _xp(device)
    with on_device(device, stream):
        wide = {name: xp.ascontiguousarray(view.astype(np.int64, copy=False)) for name, view in views.items()}
        starts = wide.pop("query_start_loc")
        extend = starts[1:] - starts[:-1]
        rows = wide.pop("req_pool_indices", None)
        if rows is None:
            rows = xp.arange(1, size + 1, dtype=np.int64)
        return ForwardBatch(req_pool_indices=rows, prefix_lens=wide.pop("seq_lens") - extend, extend_seq_lens=extend,
                            req_ids=req_ids, **wide, **optional)


def _host_offsets(views: dict) -> None:
    """On the host the values can be read without a wait: offsets that start at 0, never fall, end
    within the tokens, and lengths that hold each request's new tokens."""
    starts, lens = views["query_start_loc"].astype(np.int64), views["seq_lens"].astype(np.int64)
    tokens = min(views[name].shape[0] for name in ("input_ids", "positions", "out_cache_loc"))
    steps = np.diff(starts)
    if starts[0] != 0 or (steps < 0).any() or starts[-1] > tokens:
        raise ValueError(f"{check.PREFIX}query_start_loc must start at 0, never decrease and end within the "
                         f"{tokens} tokens of input_ids, positions and out_cache_loc, got {_shown(starts)}")
    short = np.flatnonzero(lens < steps)
    if short.size:
        row = int(short[0])
        raise ValueError(f"{check.PREFIX}seq_lens must be at least each request's new tokens (query_start_loc's "
                         f"steps), got seq_lens[{row}] = {int(lens[row])} < {int(steps[row])}")


def _shown(values: np.ndarray) -> str:
    """``values`` for a message, its first and last few where it is long."""
    if values.size <= 12:
        return str(values.tolist())
    return f"[{', '.join(map(str, values[:6].tolist()))}, ..., {', '.join(map(str, values[-3:].tolist()))}]"
