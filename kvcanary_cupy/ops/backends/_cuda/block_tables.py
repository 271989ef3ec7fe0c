"""kc.block_tables on a CUDA device: one launch each (rawkernels/block_tables.cu)."""

from __future__ import annotations

import threading

import numpy as np

from ....rawkernels import _loader
from ...._recent import RecentlyUsed
from . import Launch, i32, i64, kernel, ptr, sm_count

_BLOCK = _loader.SPECS["block_tables"].constant("KVC_BLOCK_TABLES_THREADS")
_BLOCKS_PER_SM = 8  # enough resident threads to cover a copy's latency; the loops stride past them
_CTYPES = dict(zip((np.dtype(np.int32), np.dtype(np.int64)), _loader.BLOCK_TABLE_CTYPES))


def _element_stride(array, axis: int = 0) -> int:
    return int(array.strides[axis]) // int(array.itemsize) if array.shape[axis] > 1 else 0


def _grid(count: int, device_id: int) -> int:
    return max(1, min(-(-count // _BLOCK), _BLOCKS_PER_SM * sm_count(device_id)))


def mirror(req_to_token, table, rows, block_size: int, first_block: int, *, stream) -> None:
    """``rows``: the canary rows on the device (int64), or None for ``1 .. n``."""
    arrays = (table, rows, req_to_token)
    key = (req_to_token.device.id, block_size, first_block) + _layout(arrays)
    _PREPARED_MIRRORS.launch(key, arrays, stream, lambda: _prepare_mirror(req_to_token, table, rows, block_size,
                                                                          first_block))


def _prepare_mirror(req_to_token, table, rows, block_size: int, first_block: int) -> Launch:
    count, blocks = int(table.shape[0]), int(table.shape[1])
    device_id = req_to_token.device.id
    row_stride = int(req_to_token.strides[0]) // int(req_to_token.itemsize)
    fn = kernel("block_tables", f"kvc_mirror_blocks<{_CTYPES[table.dtype]}>", device_id)
    args = (table, i64(count), i64(blocks), i64(_element_stride(table, 0)), i64(_element_stride(table, 1)),
            ptr(rows), i64(block_size), i64(first_block * block_size), req_to_token, i64(row_stride))
    return Launch(fn, _grid(count * blocks * block_size, device_id), _BLOCK, args, packed=True)


def prepare_fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens) -> Launch:
    """A batch's fields from its offsets, one launch, its parameters packed once (the current device
    the arrays'): call it with a stream. ``rows``: the batch's rows, or None for ``1 .. bs``;
    ``tokens``: up to three ``(source, out)`` pairs, each source widened into its out."""
    arrays = _fill_arrays(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens)
    bs = int(seq_lens.shape[0])
    sources = arrays[6:9]
    mask = sum(1 << bit for bit, array in enumerate(arrays[:3] + sources)
               if array is not None and array.dtype == np.int32)
    counts = [0 if source is None else int(source.shape[0]) for source in sources]
    args = (query_start_loc, seq_lens, ptr(rows), i64(_element_stride(query_start_loc)),
            i64(_element_stride(seq_lens)), i64(0 if rows is None else _element_stride(rows)), i32(mask), i64(bs),
            rows_out, prefix_out, extend_out, *(ptr(source) for source in sources),
            *(i64(0 if source is None else _element_stride(source)) for source in sources),
            *(i64(count) for count in counts), *(ptr(out) for out in arrays[9:]))
    device_id = seq_lens.device.id
    fn = kernel("block_tables", "kvc_batch_from_offsets", device_id)
    return Launch(fn, _grid(bs + sum(counts), device_id), _BLOCK, args, packed=True)


class _PackedByGeometry:
    """Packed launches of one kernel by the geometry of their arrays (dtypes, shapes, strides and the
    scalars the key adds: every parameter but the addresses), on each device, without references to
    any array: a call of a geometry met before sets its arrays' addresses (the parameters
    ``pointers`` names, in the arrays' order) and launches, instead of converting every parameter
    again. A lock keeps one thread's addresses from another's launch."""

    def __init__(self, pointers: tuple) -> None:
        self._bindings = tuple((parameter, slot) for slot, parameter in enumerate(pointers))
        self._launches = RecentlyUsed()
        self._lock = threading.Lock()

    def launch(self, key: tuple, arrays: tuple, stream, prepare) -> None:
        """Launch on ``stream`` with ``arrays`` (None for a null pointer); ``prepare()`` packs the
        launch (the current device the arrays') the first time ``key`` is met: the arrays' device
        and :func:`_layout`, with any scalar parameter the layout does not fix."""
        addresses = [0 if array is None else array.data.ptr for array in arrays]
        with self._lock:
            prepared = self._launches.get(key)
            if prepared is None:
                prepared = self._launches.put(key, prepare().detach())
            prepared.rebind(self._bindings, addresses)
            prepared(stream)

    def clear(self) -> None:
        with self._lock:
            self._launches.clear()


# the parameters of kvc_mirror_blocks that take the block table's, the rows' and the slot table's addresses
_PREPARED_MIRRORS = _PackedByGeometry((0, 5, 8))
# those of kvc_batch_from_offsets that take each of _fill_arrays' addresses, in their order
_PREPARED_FILLS = _PackedByGeometry((0, 1, 2, 8, 9, 10, 11, 12, 13, 20, 21, 22))


def _layout(arrays: tuple) -> tuple:
    return tuple(None if array is None else (array.dtype.num, array.shape, array.strides) for array in arrays)


def _fill_arrays(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens) -> tuple:
    """The fill's twelve arrays (None where absent), in the order of ``_PREPARED_FILLS``' pointers: offsets,
    lengths, rows, the three request outputs, three token sources, their three outputs."""
    pairs = list(tokens) + [(None, None)] * (3 - len(tokens))
    return (query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out,
            *(source for source, _ in pairs), *(out for _, out in pairs))


def fill(query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens, *, stream) -> None:
    """:func:`prepare_fill`'s launch, once (prepared once a geometry)."""
    arguments = (query_start_loc, seq_lens, rows, rows_out, prefix_out, extend_out, tokens)
    arrays = _fill_arrays(*arguments)
    key = (seq_lens.device.id,) + _layout(arrays)
    _PREPARED_FILLS.launch(key, arrays, stream, lambda: prepare_fill(*arguments))
