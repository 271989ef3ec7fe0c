"""Engines with block tables or cumulative token offsets (vLLM-style metadata), in the canary's terms.

The canary reads a per-position slot table, ``req_to_token`` (SPEC 3.3), and per-request lengths.
An engine that keeps a block table per request (block ids, ``block_size`` tokens a block, a token's
slot ``block * block_size + offset``) mirrors the rows it changes into that table with
:func:`mirror`; one that describes a batch by cumulative token offsets (``query_start_loc``) and
total lengths (``seq_lens``), often int32, builds its :class:`~kvcanary_cupy.ForwardBatch` with
:func:`forward_batch` (also ``ForwardBatch.from_offsets``), or refills a bound one in place with
:func:`refill`.

Each runs on the arrays' own device (NumPy on the host, RawKernels of ``block_tables.cu`` on a GPU:
one launch each, where array expressions would be several a forward; other frameworks' arrays
through DLPack, zero-copy) and queues its work on ``stream`` (CuPy's current stream of that device
when None), so pass the forward's stream to them and to the canary alike. None of them waits for
the device, so values that live on a GPU are not checked: a block id past the pool gives slots the
canary reports as ``OUT_OF_RANGE`` where it reads them, offsets that do not fit the tokens surface
at the next poll. :func:`unmirrored`, a check for an engine's tests, waits and reads them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Sequence

import numpy as np

from . import validate as check
from ._dlpack import cupy_module, data_pointer, device_of, from_host, native_view, own_view, parse_device, to_host
from ._recent import RecentlyUsed
from .ops._dispatch import backend_module, check_stream_form, on_device, resolve_stream

__all__ = ["Refill", "forward_batch", "mirror", "refill", "unmirrored"]

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_PASSED_THROUGH = ("expected_input_tokens", "expected_input_positions", "expected_valid_lens", "swa_out_cache_loc")
_REQUEST_FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens")  # a ForwardBatch's, [bs] each
_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")  # a ForwardBatch's, [n] each
_SOURCE_NAMES = frozenset(("query_start_loc", "seq_lens", "req_pool_indices") + _TOKEN_FIELDS)  # the arrays given


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


def _whole_elements(name: str, view) -> None:
    """Strides the kernels can step in elements (any sign: a view read backwards is read so)."""
    if view.size and any(stride % view.itemsize for stride in view.strides):
        raise ValueError(f"{check.PREFIX}{name} must have strides that are whole elements ({view.itemsize} bytes), "
                         f"got {tuple(view.strides)}")


def _index_array(name: str, view, ndim: int) -> None:
    check.dtype(name, view, _INDEX_DTYPES)
    check.ndim(name, view, ndim)
    _whole_elements(name, view)
    check.elements_aligned(name, view)


def mirror(req_to_token: Any, *, block_table: Any, block_size: int, rows: Optional[Sequence[int]] = None,
           first_block: int = 0, stream: Any = None) -> None:
    """Write the slots of ``block_table``'s rows into ``req_to_token``.

    ``block_table``: ``int32`` or ``int64 [n, blocks]``, the block ids of ``n`` requests (or a
    window of their columns, starting at block ``first_block``; any strides). ``req_to_token``: the
    canary's ``int32`` slot table, each row at least ``(first_block + blocks) * block_size`` wide,
    rows apart (no cell shared) and no byte shared with ``block_table``; ``block_size`` at most
    ``2**31``.
    Block-table row ``i`` goes to canary row ``rows[i]`` (host integers; ``1 .. n`` by default, row 0
    being the padding row): ``req_to_token[rows[i], (first_block + b) * block_size + o] =
    block_table[i, b] * block_size + o``, or ``-1`` where int32 cannot hold that slot (a negative
    block id, or one past ``2**31 / block_size``: its low 32 bits could name a real slot), which
    verify reports as ``OUT_OF_RANGE`` where it reads it. Cells past a request's tokens are written
    too and never read.

    Call it once the engine's table holds a request's blocks (a new request's, prefix-cache hits
    included; appended blocks, or a row that moved) and before the ``before_forward`` of the forward
    that reads them. It writes ``n * blocks * block_size`` cells in one launch on a GPU (and copies
    ``rows`` to the device when they are given): mirror the rows (and columns) that changed, not
    the whole table each forward.
    """
    table = _MirrorArguments.checked(req_to_token, block_table, block_size, rows, first_block, stream)
    if table.count == 0 or table.blocks == 0:
        return
    with on_device(table.device, table.stream):
        device_rows = None if table.rows is None else from_host(table.rows, table.device)
        backend_module(table.device, "block_tables").mirror(table.target, table.table, device_rows, table.block_size,
                                                            table.first_block, stream=table.stream)


@dataclasses.dataclass(frozen=True)
class _MirrorArguments:
    """A mirror's arguments, checked: native views, the canary rows on the host (None: ``1 .. n``)."""

    device: Any
    stream: Any
    target: Any
    table: Any
    rows: Optional[np.ndarray]
    block_size: int
    first_block: int

    @property
    def count(self) -> int:
        return int(self.table.shape[0])

    @property
    def blocks(self) -> int:
        return int(self.table.shape[1])

    @classmethod
    def checked(cls, req_to_token, block_table, block_size, rows, first_block, stream,
                stores: bool = True) -> "_MirrorArguments":
        """``stores``: ``req_to_token`` is stored into (a mirror), else only read (``unmirrored``)."""
        block_size = check.slot_count("block_size", block_size)  # <= 2**31: a block's offsets fit in int32
        first_block = check.non_negative("first_block", first_block)
        device, views, stream = _views({"req_to_token": req_to_token, "block_table": block_table}, stream)
        target, table = views["req_to_token"], views["block_table"]
        key = ("mirror" if stores else "unmirrored", device, _geometry(views, addresses=True), block_size, first_block)
        known = key in _PASSED  # the arrays' rules passed for arrays alike: the rows' values are checked each call
        if not known:
            check.table("req_to_token", target, np.int32)
            if stores:
                check.writable("req_to_token", target)
                check.rows_apart("req_to_token", target)  # rows stored by threads of their own
            _index_array("block_table", table, 2)
            if stores:
                check.stored_apart({"req_to_token": target}, {"block_table": table})
        count, blocks = table.shape
        canary_rows = None if rows is None else check.host_int64("rows", rows)
        if canary_rows is not None:
            check.length("rows", canary_rows, count, "one canary row for each block-table row")
        check.request_rows("rows", np.arange(1, count + 1) if canary_rows is None else canary_rows, target.shape[0])
        if not known:
            stop = (first_block + blocks) * block_size
            if stop > target.shape[1]:
                raise ValueError(f"{check.PREFIX}req_to_token must be at least (first_block + blocks) * block_size = "
                                 f"({first_block} + {blocks}) * {block_size} = {stop} wide (a cell for each slot of "
                                 f"the block table's columns), got width {target.shape[1]}")
            _PASSED.add(key)
        return cls(device, stream, target, table, canary_rows, block_size, first_block)


def unmirrored(req_to_token: Any, *, block_table: Any, block_size: int, seq_lens: Any,
               rows: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """The requests whose canary row does not hold what their block-table row gives: ``(canary row,
    first position that differs)`` for each, within its first ``seq_lens[i]`` tokens (host or
    device integers, one a block-table row); ``[]`` when every row is mirrored.

    A check for an engine's tests, or now and then in serving: it waits for the device and copies
    the rows to the host. A row left unmirrored (a request admitted, a block appended or a row
    moved without :func:`mirror`) is read by the canary as the slots it names, and it is reported
    only where those slots' records disagree with the request: a stale row that still holds
    another request's slots of the same prefix goes unseen. Arguments as for :func:`mirror`, whose
    rules they follow but those of a table stored into: ``req_to_token`` is only read (a read-only
    one is taken)."""
    table = _MirrorArguments.checked(req_to_token, block_table, block_size, rows, 0, None, stores=False)
    lens = native_view(seq_lens, "seq_lens")
    _index_array("seq_lens", lens, 1)
    check.length("seq_lens", lens, table.count, "one length for each block-table row")
    canary_rows = np.arange(1, table.count + 1) if table.rows is None else table.rows
    lens = np.asarray(to_host(lens), dtype=np.int64)
    width = table.blocks * table.block_size
    too_long = np.flatnonzero((lens < 0) | (lens > width))
    if too_long.size:
        index = int(too_long[0])
        raise ValueError(f"{check.PREFIX}seq_lens must be in [0, blocks * block_size = {width}] (the tokens the "
                         f"block table's row can hold), got seq_lens[{index}] = {int(lens[index])}")
    held = np.asarray(to_host(table.target[from_host(canary_rows, table.device), :width]))
    expected = np.zeros((table.count, width), np.int32)  # the rows as mirror gives them, on the host
    backend_module(parse_device("cpu"), "block_tables").mirror(
        expected, np.asarray(to_host(table.table)), np.arange(table.count), table.block_size, 0)
    wrong = []
    for index, row in enumerate(canary_rows.tolist()):
        differ = np.flatnonzero(held[index, :lens[index]] != expected[index, :lens[index]])
        if differ.size:
            wrong.append((row, int(differ[0])))
    return wrong


def forward_batch(*, query_start_loc: Any, seq_lens: Any, input_ids: Any, positions: Any, out_cache_loc: Any,
                  req_pool_indices: Any = None, req_ids: Optional[Sequence[Any]] = None, stream: Any = None,
                  **optional: Any):
    """A :class:`~kvcanary_cupy.ForwardBatch` from cumulative token offsets.

    ``query_start_loc``: ``[bs + 1]``, request ``r``'s new tokens are ``[query_start_loc[r],
    query_start_loc[r + 1])`` of ``input_ids``, ``positions`` and ``out_cache_loc`` (the slot
    mapping); ``seq_lens``: ``[bs]``, each request's tokens once this forward has written its own
    (cached plus new); ``req_pool_indices``: ``[bs]`` canary rows (``1 .. bs`` when None: batch row
    ``r`` in canary row ``r + 1``, as :func:`mirror` puts block-table row ``r``). Each may be
    ``int32`` or ``int64``, with any stride; ``extend_seq_lens`` and ``prefix_lens`` are derived, and
    every array is given to the batch as ``int64`` (contiguous ``int64`` token arrays as they are,
    referenced as by any batch, so an engine that refills them before the next poll may have
    reports name the wrong request; others copied), in one launch on a GPU. Tokens past
    ``query_start_loc[bs]`` (a padded tail) are not read. ``optional``: the other fields of
    ``ForwardBatch`` (``expected_input_tokens``...), passed through as given.
    """
    from .session import ForwardBatch, _req_ids  # imported here: the session module takes this as from_offsets

    unknown = sorted(set(optional) - set(_PASSED_THROUGH)) if optional else ()
    if unknown:
        raise TypeError(f"{check.PREFIX}forward_batch takes ForwardBatch's optional fields {_PASSED_THROUGH} as "
                        f"keywords besides its own, got {unknown[0]!r}")
    device, views, stream = _views(_sources(query_start_loc, seq_lens, input_ids, positions, out_cache_loc,
                                            req_pool_indices), stream)
    size = _check_sources(views, device)
    _req_ids(req_ids, views["seq_lens"])
    xp = _xp(device)
    widened = [name for name in _TOKEN_FIELDS if not (views[name].dtype == np.int64 and views[name].flags.c_contiguous)]
    lengths = [(name, size) for name in _REQUEST_FIELDS] + [(name, views[name].shape[0]) for name in widened]
    with on_device(device, stream):
        # one allocation for every array the batch gets anew, cut into its fields
        memory = xp.empty(sum(length for _, length in lengths), dtype=np.int64)
        fields, start = {}, 0
        for name, length in lengths:
            fields[name] = memory[start:start + length]
            start += length
        fields.update({name: views[name] for name in _TOKEN_FIELDS if name not in widened})
        _fill(device, views, fields, stream)
    return ForwardBatch(**fields, req_ids=req_ids, **optional)


def refill(batch: Any, *, query_start_loc: Any, seq_lens: Any, input_ids: Any, positions: Any, out_cache_loc: Any,
           req_pool_indices: Any = None, stream: Any = None) -> None:
    """:func:`forward_batch` into ``batch``'s own arrays, in place: for a batch bound once (a static
    forward's, whose arrays a CUDA graph reads) refilled each step. Its three request fields must
    be ``int64 [bs]``, its token fields ``int64`` and at least as long as the arrays given (a token
    array that is the batch's own is left as it is; ``req_pool_indices`` may be
    ``batch.req_pool_indices`` itself, the same cells, but no other view of its memory); nothing
    is allocated, so on a GPU it is one launch, capturable in a CUDA graph. It stores into every
    field it fills: a batch made by :func:`forward_batch` may hold the engine's own ``int64``
    arrays (it keeps them rather than copy them), so bind arrays of the batch's own to refill.
    A call whose arrays are alike, in all the checks read (dtypes, shapes, strides, addresses), to
    those of a call before skips the checks and reuses its packed launch; :class:`Refill`, bound
    once to arrays the engine refills in place, also skips making the views."""
    bound = _bound_refill(batch, _sources(query_start_loc, seq_lens, input_ids, positions, out_cache_loc,
                                          req_pool_indices), stream)
    with on_device(bound.device, bound.stream):
        _fill(bound.device, bound.views, bound.fields, bound.stream)


class Refill:
    """:func:`refill` bound once to its arrays, checked once: :meth:`launch` fills the batch from
    what the given arrays hold then (the engine refills them in place), one launch of parameters
    packed once on a GPU, a few microseconds of host time. On the CPU each launch checks the
    offsets' values, which the engine may have changed. Shapes are fixed when it is bound (it keeps
    views of its own: an array object reshaped later is read as it was bound): bind one for each
    padded batch size, as a CUDA graph is captured for each."""

    def __init__(self, batch: Any, *, query_start_loc: Any, seq_lens: Any, input_ids: Any, positions: Any,
                 out_cache_loc: Any, req_pool_indices: Any = None) -> None:
        # views of its own, as every bundle kept across calls: what was checked stays what each launch
        # reads and stores, whatever is later done in place to the caller's array objects
        given = _sources(query_start_loc, seq_lens, input_ids, positions, out_cache_loc, req_pool_indices)
        given = {name: array if array is None else own_view(array) for name, array in given.items()}
        bound = _bound_refill(batch, given, None, own=True)
        self.batch, self.device = batch, bound.device
        self._views = bound.views  # kept alive for the packed launch's addresses
        with on_device(bound.device, bound.stream):  # the arrays' device current for the packing
            self._launch = backend_module(bound.device, "block_tables").prepare_fill(
                *_fill_arguments(bound.views, bound.fields))

    def launch(self, *, stream: Any = None) -> None:
        """Fill the batch from the bound arrays, on ``stream`` (CuPy's current stream of the arrays'
        device when None)."""
        if self.device.is_cuda:
            self._launch(resolve_stream(stream, self.device))
        else:
            check_stream_form(stream)
            _host_offsets(self._views)
            self._launch()


@dataclasses.dataclass(frozen=True)
class _BoundRefill:
    device: Any
    stream: Any
    views: dict   # the arrays given, by name
    fields: dict  # the batch's arrays, by field


def _bound_refill(batch, given: dict, stream, own: bool = False) -> _BoundRefill:
    """A refill's arguments, checked (``own``: the batch's fields as views of their own)."""
    from .session import ForwardBatch

    check.instance("batch", batch, ForwardBatch)
    targets = {f"batch.{name}": getattr(batch, name) for name in _REQUEST_FIELDS + _TOKEN_FIELDS}
    for name, field in targets.items():
        if field is None:
            raise TypeError(f"{check.PREFIX}{name} must be an array (refill stores into it), got None")
    if own:
        targets = {name: own_view(field) for name, field in targets.items()}
    device, views, stream = _views({**given, **targets}, stream)
    key = (device, _geometry(views, addresses=True))
    fields = {name: views.pop(f"batch.{name}") for name in _REQUEST_FIELDS + _TOKEN_FIELDS}
    _PASSED.once(key, lambda: _refill_rules(views, fields))
    if not device.is_cuda:
        _host_offsets(views)
    return _BoundRefill(device, stream, views, fields)


def _refill_rules(views: dict, fields: dict) -> None:
    """A refill's rules but the values': the given arrays' and the batch's fields'."""
    _source_rules(views)
    size = views["seq_lens"].shape[0]
    for name in _REQUEST_FIELDS:
        check.vector(f"batch.{name}", fields[name], np.int64, size, "one for each request of seq_lens")
    for name in _TOKEN_FIELDS:
        check.vector(f"batch.{name}", fields[name], np.int64)
        if fields[name].shape[0] < views[name].shape[0]:
            raise ValueError(f"{check.PREFIX}batch.{name} must be at least as long as the {name} given "
                             f"({views[name].shape[0]}), got {fields[name].shape[0]}")
    for name, field in fields.items():
        check.writable(f"batch.{name}", field)
    kept = {name for name in _TOKEN_FIELDS if _same_array(views[name], fields[name])}  # not copied onto itself
    check.stored_apart({f"batch.{name}": field for name, field in fields.items() if name not in kept}, views,
                       in_place=frozenset({("batch.req_pool_indices", "req_pool_indices")}))


def _sources(query_start_loc, seq_lens, input_ids, positions, out_cache_loc, req_pool_indices) -> dict:
    return {"query_start_loc": query_start_loc, "seq_lens": seq_lens, "input_ids": input_ids,
            "positions": positions, "out_cache_loc": out_cache_loc, "req_pool_indices": req_pool_indices}


def _check_sources(views: dict, device) -> int:
    """The given arrays' rules (their geometry's once: see :class:`_PassedChecks`; on the host their
    values' each call); the batch's size."""
    key = (device, _geometry(views, addresses=False))
    _PASSED.once(key, lambda: _source_rules(views))
    if not device.is_cuda:
        _host_offsets(views)
    return views["seq_lens"].shape[0]


def _source_rules(views: dict) -> None:
    for name, view in views.items():
        if name in _SOURCE_NAMES:
            _index_array(name, view, 1)
    size = views["seq_lens"].shape[0]
    check.length("query_start_loc", views["query_start_loc"], size + 1, "one more than seq_lens has requests")
    if "req_pool_indices" in views:
        check.length("req_pool_indices", views["req_pool_indices"], size, "one canary row for each request")


class _PassedChecks:
    """Keys of calls whose checks passed (most recent last, a few dozen kept: an engine's batch sizes
    and array forms). A key holds everything the checks read of the arrays (dtype, shape, strides,
    the address or its alignment, NumPy's read-only flag), none of their values, so a call with a
    key met before passes them again: it skips them, and an engine that calls each step with its
    persistent buffers pays for them once."""

    def __init__(self) -> None:
        self._keys = RecentlyUsed()
        self._lock = threading.Lock()

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._keys

    def once(self, key, rules) -> None:
        """Run ``rules()`` (raising on a broken rule) unless ``key`` passed them before; remember it."""
        if key not in self:
            rules()
            self.add(key)

    def add(self, key) -> None:
        with self._lock:
            self._keys.put(key)

    def clear(self) -> None:
        """Forget every key (what a call costs the first time: ``tools/block_tables_cost.py``)."""
        with self._lock:
            self._keys.clear()


_PASSED = _PassedChecks()


def _geometry(views: dict, *, addresses: bool) -> tuple:
    """What the checks read of each array: with ``addresses``, where it lies (rules on overlaps and
    on arrays that are the same cells), else only its address's alignment (a dtype of no bytes,
    which the checks refuse, has none)."""
    return tuple((name, view.dtype.str, view.shape, view.strides,
                  data_pointer(view) if addresses else data_pointer(view) % max(view.itemsize, 1),
                  not isinstance(view, np.ndarray) or view.flags.writeable) for name, view in views.items())


def _same_array(view, field) -> bool:
    """``view`` is ``field`` itself: the same int64 elements at the same address."""
    return view is field or (view.dtype == np.int64 and view.flags.c_contiguous and view.shape[0] <= field.shape[0]
            and data_pointer(view) == data_pointer(field))


def _fill_arguments(views: dict, fields: dict) -> tuple:
    """The backends' fill arguments: the given offsets, lengths and rows, the batch's request fields,
    and the token arrays to copy (those that are not the batch's own)."""
    tokens = [(views[name], fields[name]) for name in _TOKEN_FIELDS
              if views[name].size and not _same_array(views[name], fields[name])]
    return (views["query_start_loc"], views["seq_lens"], views.get("req_pool_indices"), fields["req_pool_indices"],
            fields["prefix_lens"], fields["extend_seq_lens"], tokens)


def _fill(device, views: dict, fields: dict, stream) -> None:
    """The batch's fields from the given arrays (their rules checked), on the current device and stream."""
    backend_module(device, "block_tables").fill(*_fill_arguments(views, fields), stream=stream)


def _xp(device):
    return cupy_module() if device.is_cuda else np


def _host_offsets(views: dict) -> None:
    """On the host the values can be read without a wait: offsets that start at 0, never fall, end
    within the tokens, and lengths that hold each request's new tokens."""
    starts, lens = views["query_start_loc"].astype(np.int64), views["seq_lens"].astype(np.int64)
    lengths = {name: views[name].shape[0] for name in ("input_ids", "positions", "out_cache_loc")}
    tokens = min(lengths.values())
    steps = np.diff(starts)
    if starts[0] != 0 or (steps < 0).any() or starts[-1] > tokens:
        # the shortest of the token arrays named, and only it where the others are longer
        shortest = [name for name, length in lengths.items() if length == tokens]
        whose = " and ".join(shortest) if len(shortest) < 3 else "input_ids, positions and out_cache_loc"
        raise ValueError(f"{check.PREFIX}query_start_loc must start at 0, never decrease and end within the "
                         f"{tokens} tokens of {whose}, got {_shown(starts)}")
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
