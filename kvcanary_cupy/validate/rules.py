"""The host-side rules, one function each.

Every message starts with ``kv-canary: ``, names the argument, states the rule and shows the value
received. ``TypeError`` is for a wrong type or dtype, ``ValueError`` for a wrong value or shape.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import numpy as np

from .._dlpack import Device, byte_view_dtype, byte_view_shape, data_pointer, device_of, native_view, own_view
from .._layout import INT32_MAX, INT64_MAX, SOURCE_ALIGN_BYTES

PREFIX = "kv-canary: "
INT64_MIN = -INT64_MAX - 1


def integer(name: str, value: Any) -> int:
    """``value`` as a Python int; bools, floats and strings are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{PREFIX}{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def instance(name: str, value: Any, kind: type) -> Any:
    """``value``, which must be a ``kind`` (an argument bundle, a plan, a context...)."""
    if not isinstance(value, kind):
        raise TypeError(f"{PREFIX}{name} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def positive(name: str, value: Any) -> int:
    value = integer(name, value)
    if value <= 0:
        raise ValueError(f"{PREFIX}{name} must be positive, got {value}")
    return value


def non_negative(name: str, value: Any) -> int:
    value = integer(name, value)
    if value < 0:
        raise ValueError(f"{PREFIX}{name} must be non-negative, got {value}")
    return value


def at_least(name: str, value: Any, minimum: int) -> int:
    value = integer(name, value)
    if value < minimum:
        raise ValueError(f"{PREFIX}{name} must be >= {minimum}, got {value}")
    return value


def fits_int32(name: str, value: int) -> int:
    if value > INT32_MAX:
        raise ValueError(f"{PREFIX}{name} must fit in int32 (<= {INT32_MAX}), got {value}")
    return value


def slot_count(name: str, value: Any) -> int:
    """A pool's number of slots: positive, and at most 2**31 (slot indices fit in int32)."""
    value = positive(name, value)
    if value > INT32_MAX + 1:
        raise ValueError(f"{PREFIX}{name} must be <= 2**31 (slot indices fit in int32), got {value}")
    return value


def int32_scalar(name: str, value: Any) -> int:
    """An int that goes into an int32 cell."""
    value = integer(name, value)
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{PREFIX}{name} must fit in int32 [{-INT32_MAX - 1}, {INT32_MAX}], got {value}")
    return value


def host_int64(name: str, values: Any) -> np.ndarray:
    """A host sequence of integers (a list, tuple or 1-D NumPy array of an integer dtype) as a
    contiguous int64 array: floats and bools are refused rather than truncated, values past int64
    rather than wrapped, and arrays of another rank rather than flattened or widened (a 2-D array
    whose first dimension has the expected length would pass a length check with more values than
    it names)."""
    if isinstance(values, range) and len(values):
        low, high = sorted((values[0], values[-1]))  # a range's ends, by index: no element iterated
        if low < INT64_MIN or high > INT64_MAX:
            raise ValueError(f"{PREFIX}{name} must fit in int64 [{INT64_MIN}, {INT64_MAX}], got "
                             f"{low if low < INT64_MIN else high}")
    if isinstance(values, range) or (hasattr(values, "__array__") and not isinstance(values, np.ndarray)):
        try:
            values = np.asarray(values)  # a range, or a host array of another library
        except (TypeError, ValueError, RuntimeError) as error:  # a device array (CuPy, a CUDA tensor)
            raise TypeError(f"{PREFIX}{name} must be host integers (a list, tuple or NumPy array), got "
                            f"{type(values).__name__}, which NumPy cannot read: {error}") from None
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{PREFIX}{name} must be 1-D, got shape {values.shape}")
        if values.dtype == np.bool_ or values.dtype.kind not in "iu":
            raise TypeError(f"{PREFIX}{name} must hold integers, got dtype {values.dtype}")
        if values.dtype.kind == "u" and values.size and int(values.max()) > INT64_MAX:
            raise ValueError(f"{PREFIX}{name} must fit in int64, got {int(values.max())}")
        return np.ascontiguousarray(values, dtype=np.int64)
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{PREFIX}{name} must be a list, tuple or NumPy array of integers, got {type(values).__name__}")
    return np.array([int64_scalar(f"{name}[{index}]", value) for index, value in enumerate(values)], dtype=np.int64)


def int64_scalar(name: str, value: Any) -> int:
    """An int that the kernels receive as an int64 argument."""
    value = integer(name, value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{PREFIX}{name} must fit in int64 [{INT64_MIN}, {INT64_MAX}], got {value}")
    return value


def positive_multiple(name: str, value: Any, multiple: int) -> int:
    value = integer(name, value)
    if value <= 0 or value % multiple:
        raise ValueError(f"{PREFIX}{name} must be a positive multiple of {multiple}, got {value}")
    return value


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{PREFIX}{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def dtype(name: str, array, expected) -> None:
    """``array``'s dtype is ``expected`` (a dtype, or a tuple of the dtypes allowed)."""
    allowed = tuple(np.dtype(each) for each in (expected if isinstance(expected, tuple) else (expected,)))
    got = np.dtype(array.dtype)
    foreign = byte_view_dtype(array)  # a bfloat16 tensor is viewed as bytes: it is no uint8 array
    if got not in allowed or foreign is not None:
        # A byte-swapped int64 is named int64 too: show its byte order.
        shown = got.name if got.isnative else f"{got.name} in non-native byte order ({got.str!r})"
        raise TypeError(f"{PREFIX}{name} must have dtype {' or '.join(each.name for each in allowed)}, "
                        f"got {foreign or shown}")


def shape_text(array) -> str:
    """``array``'s shape for a message, said to be in bytes where it views a dtype NumPy lacks."""
    foreign = byte_view_dtype(array)
    shape = tuple(array.shape)
    if foreign is None:
        return f"{shape}"
    own = byte_view_shape(array)
    return f"{shape} in bytes of a {foreign} array" + ("" if own is None else f" of shape {own}")


def choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value``, a string among ``choices``."""
    if not isinstance(value, str):
        raise TypeError(f"{PREFIX}{name} must be a str, one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{PREFIX}{name} must be one of {choices}, got {value!r}")
    return value


def member(name: str, value: Any, kind: type) -> Any:
    """``value`` as a member of the int enum ``kind``; bools, floats and strings are refused."""
    if isinstance(value, kind):
        return value
    # a member of another enum (a HashMode passed as a tag) is a mistake, not the int it holds
    if isinstance(value, (bool, np.bool_, enum.Enum)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{PREFIX}{name} must be a {kind.__name__}, got {type(value).__name__} {value!r}")
    try:
        return kind(int(value))
    except ValueError:
        values = sorted(int(m) for m in kind)
        allowed = (", ".join(f"{m.name}={int(m)}" for m in kind) if len(values) <= 4
                   else f"a value in [{values[0]}, {values[-1]}]")
        raise ValueError(f"{PREFIX}{name} must be a {kind.__name__} ({allowed}), got {int(value)}") from None


def ndim(name: str, array, expected: int) -> None:
    if array.ndim != expected:
        raise ValueError(f"{PREFIX}{name} must be {expected}-D, got shape {tuple(array.shape)}")


def length(name: str, array, expected: int, why: str) -> None:
    if array.shape[0] != expected:
        raise ValueError(f"{PREFIX}{name} must have length {expected} ({why}), got {array.shape[0]}")


def c_contiguous(name: str, array) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{PREFIX}{name} must be C-contiguous, got strides {tuple(array.strides)} in bytes")


def rows_contiguous(name: str, array) -> None:
    """Each row contiguous (last dimension unit-stride); rows may be strided. An empty array has
    no rows to read, whatever strides it reports."""
    if array.size == 0:
        return
    if array.ndim >= 2 and array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
        raise ValueError(
            f"{PREFIX}{name} must have a contiguous last dimension, got strides {tuple(array.strides)} in bytes"
        )
    if array.ndim >= 2:
        non_negative_row_stride(name, array)


def non_negative_row_stride(name: str, array) -> None:
    """Rows laid out forwards: the kernels address row r at base + r * stride with a stride they
    take to be non-negative."""
    if array.shape[0] > 1 and array.strides[0] < 0:
        raise ValueError(f"{PREFIX}{name} must have a non-negative row stride, got {array.strides[0]}")


def rows_apart(name: str, array) -> None:
    """The rows of a 2-D array an op writes do not overlap: each starts past the previous one's
    end. Rows sharing memory (a zero or short row stride, as a broadcast view has) would be
    written by several GPU blocks in no fixed order."""
    rows, width = array.shape[0], array.shape[1]
    if rows > 1 and width > 0 and array.strides[0] < width * array.itemsize:
        raise ValueError(f"{PREFIX}{name} rows must not overlap (row stride >= width * itemsize = "
                         f"{width * array.itemsize} bytes), got row stride {array.strides[0]}")


def apart(arrays: Mapping[str, Any]) -> None:
    """The arrays of one bundle (C-contiguous, so each holds the bytes ``[address, address + nbytes)``)
    share no byte: an op stores into each on its own, and one cell passed twice (``num_valid`` as
    ``enable``, one counter as another) would have one value overwrite the other."""
    spans = [(name, data_pointer(array), data_pointer(array) + int(array.nbytes))
             for name, array in arrays.items() if array.size]
    for index, (name, start, end) in enumerate(spans):
        for other, other_start, other_end in spans[index + 1:]:
            if start < other_end and other_start < end:
                raise ValueError(f"{PREFIX}{name} and {other} must not share memory (each is stored into on its "
                                 f"own), got bytes [0x{start:x}, 0x{end:x}) and [0x{other_start:x}, 0x{other_end:x})")


def _span(array) -> tuple[int, int]:
    """The bytes ``[first, end)`` an array's elements lie in, whatever its strides' signs."""
    start, low, high = data_pointer(array), 0, 0
    for size, stride in zip(array.shape, array.strides):
        reach = (int(size) - 1) * int(stride)
        low, high = low + min(reach, 0), high + max(reach, 0)
    return start + low, start + high + int(array.itemsize)


def _same_cells(first, second) -> bool:
    """Two 1-D arrays of the same elements: one dtype, address, length and stride."""
    return (np.dtype(first.dtype) == np.dtype(second.dtype) and first.shape == second.shape
            and data_pointer(first) == data_pointer(second)
            and (first.shape[0] <= 1 or first.strides == second.strides))


def stored_apart(stored: Mapping[str, Any], read: Mapping[str, Any], in_place: frozenset = frozenset()) -> None:
    """The arrays an op stores into share no byte with each other nor with the arrays it reads
    (each taken as the bytes from its first element to its last), but the ``(stored, read)`` 1-D
    pairs of ``in_place``, which may be the same cells (one dtype, address, length and stride),
    each read before it is stored by the thread that stores it; overlapping otherwise (a reversed,
    shifted or retyped view of the same memory), they are refused too. Any other overlap has one
    thread read what another stores, in no fixed order."""
    arrays = {**stored, **read}
    spans = {name: _span(array) for name, array in arrays.items() if array.size}
    order = {name: index for index, name in enumerate(spans)}  # the stored ones first
    for name in stored:
        if name not in spans:
            continue
        start, end = spans[name]
        for other, (other_start, other_end) in spans.items():
            if order[other] <= order[name] and other in stored:
                continue
            if not (start < other_end and other_start < end):
                continue
            if (name, other) in in_place:
                if _same_cells(arrays[name], arrays[other]):
                    continue
                raise ValueError(f"{PREFIX}{name} and {other} must be the same array (same dtype, address, length "
                                 f"and stride: each cell read and stored by one thread) or share no memory, got "
                                 f"{arrays[other].dtype} at bytes [0x{other_start:x}, 0x{other_end:x}) stride "
                                 f"{tuple(arrays[other].strides)} over {arrays[name].dtype} at bytes "
                                 f"[0x{start:x}, 0x{end:x}) stride {tuple(arrays[name].strides)}")
            raise ValueError(f"{PREFIX}{name} and {other} must not share memory ({name} is stored into), "
                             f"got bytes [0x{start:x}, 0x{end:x}) and [0x{other_start:x}, 0x{other_end:x})")


def aligned(name: str, array, alignment: int) -> None:
    address = data_pointer(array)
    if array.size and address % alignment:
        raise ValueError(f"{PREFIX}{name} must be {alignment}-byte aligned, got address 0x{address:x}")


def elements_aligned(name: str, array) -> None:
    """Each element at an address that is a multiple of its size: the kernels load elements whole,
    and a GPU faults on a misaligned load."""
    if array.size == 0:
        return
    # NumPy's flag costs a twentieth of reading the address through ctypes.
    fits = array.flags.aligned if isinstance(array, np.ndarray) else data_pointer(array) % array.itemsize == 0
    if not fits:
        aligned(name, array, array.itemsize)


def writable(name: str, array) -> None:
    """An array an op stores into: a read-only NumPy array (a read-only DLPack export included) is
    refused before anything is written. Device arrays have no such flag (CuPy's are writable)."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        raise ValueError(f"{PREFIX}{name} must be writable (the op stores into it), got a read-only array")


def vector(name: str, array, dtype_: np.dtype, expected_length: int | None = None, why: str = "") -> None:
    """A 1-D C-contiguous array of ``dtype_`` (and of ``expected_length`` if given)."""
    dtype(name, array, dtype_)
    ndim(name, array, 1)
    c_contiguous(name, array)
    elements_aligned(name, array)
    if expected_length is not None:
        length(name, array, expected_length, why)


def scalar_cell(name: str, array, dtype_: np.dtype) -> None:
    """A one-element device/host cell such as ``num_valid`` or a counter."""
    vector(name, array, dtype_, 1, "a single cell")


def table(name: str, array, dtype_: np.dtype) -> None:
    """A 2-D table whose rows are contiguous (``req_to_token``, ``pool_out``...)."""
    dtype(name, array, dtype_)
    ndim(name, array, 2)
    rows_contiguous(name, array)
    elements_aligned(name, array)
    if array.shape[0] > 1 and array.strides[0] % array.itemsize:
        raise ValueError(f"{PREFIX}{name} row stride must be a whole number of elements, got {array.strides[0]} bytes")


def request_rows(name: str, rows: np.ndarray, table_rows: int) -> None:
    """Host row numbers of a table of ``table_rows`` rows that requests own: row 0 is the padding
    row (a block-table row ``r`` is canary row ``r + 1``), and no row is given twice."""
    bad = np.flatnonzero((rows < 1) | (rows >= table_rows))
    if bad.size:
        index = int(bad[0])
        raise ValueError(f"{PREFIX}{name} must be request rows in [1, {table_rows}) (row 0 is the padding row: "
                         f"block-table row r is canary row r + 1), got {name}[{index}] = {int(rows[index])}")
    unique, counts = np.unique(rows, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{PREFIX}{name} must not name a row twice, got row {int(unique[counts > 1][0])} "
                         f"{int(counts[counts > 1][0])} times")


def one_device(devices: Mapping[str, Device]) -> Device:
    """All named arrays on one device; returns it."""
    items = list(devices.items())
    first_name, first = items[0]
    for other_name, other in items[1:]:
        if other != first:
            raise ValueError(
                f"{PREFIX}all arrays of one call must be on one device, got {first_name} on {first} "
                f"and {other_name} on {other}"
            )
    return first


def both_or_neither(first: tuple[str, Any], second: tuple[str, Any]) -> None:
    (name_a, value_a), (name_b, value_b) = first, second
    if (value_a is None) != (value_b is None):
        given, missing = (name_a, name_b) if value_b is None else (name_b, name_a)
        raise ValueError(f"{PREFIX}{given} requires {missing}: pass both or neither, got {missing}=None")


def adopt_views(owner: Any, labels: Mapping[str, str], *, optional: bool = False,
                own: bool = False) -> dict[str, Device]:
    """Swap each named field of a frozen dataclass for a zero-copy native view of it.

    ``labels`` maps attribute names to the names used in messages; ``None`` is refused unless
    ``optional`` (then it stays ``None``). ``own``: a bundle kept across calls takes views of its
    own even of NumPy and CuPy arrays (see ``own_view``). All arrays must share one device;
    that is checked before any view is taken, so mixing devices is reported as such. Returns the
    devices by label.
    """
    values = {attribute: getattr(owner, attribute) for attribute in labels}
    for attribute, value in values.items():
        if value is None and not optional:
            raise TypeError(f"{PREFIX}{labels[attribute]} must be an array, got None")
    values = {attribute: value for attribute, value in values.items() if value is not None}
    devices = {labels[attribute]: device_of(value, labels[attribute]) for attribute, value in values.items()}
    if devices:
        one_device(devices)
    for attribute, value in values.items():
        label = labels[attribute]
        object.__setattr__(owner, attribute, native_view(own_view(value) if own else value, label, devices[label]))
    return devices


def source_read_bytes(name: str, read_bytes: Any, bytes_per_token: int) -> int:
    """``read_bytes`` of a source of ``bytes_per_token``: a positive multiple of 16 up to it."""
    read_bytes = integer(name, read_bytes)
    if read_bytes <= 0 or read_bytes > bytes_per_token or read_bytes % SOURCE_ALIGN_BYTES:
        raise ValueError(
            f"{PREFIX}{name} must be a positive multiple of 16 in "
            f"(0, num_bytes_per_token={bytes_per_token}], got {read_bytes}"
        )
    return read_bytes


def row_bytes(view: Any) -> int:
    """Bytes in one row (dim 0 indexes rows) of ``view``, however it is strided."""
    return int(np.prod(view.shape[1:])) * int(view.itemsize)


def source_rows(name: str, view: Any, needed_row_bytes: int) -> int:
    """Checks ``view`` (named ``name``) as the rows of a real-KV source whose rows must hold
    ``needed_row_bytes``; returns its row stride in bytes."""
    if view.ndim < 2:
        raise ValueError(f"{PREFIX}{name} must be at least 2-D, got shape {shape_text(view)}")
    if np.dtype(view.dtype).hasobject:
        raise TypeError(f"{PREFIX}{name} must hold plain bytes (a numeric dtype), got dtype {view.dtype}")
    _require_contiguous_rows(name, view)
    held = row_bytes(view)
    if held < needed_row_bytes:
        raise ValueError(
            f"{PREFIX}{name} rows must hold page_size * num_bytes_per_token = "
            f"{needed_row_bytes} bytes, got {held} bytes per row (shape {shape_text(view)})"
        )
    if view.shape[0] <= 1:
        # only row 0 is ever read, and frameworks give a size-1 dimension any stride (a DLPack
        # export may say 0 or 1): any multiple of 16 serves
        row_stride = -(-held // SOURCE_ALIGN_BYTES) * SOURCE_ALIGN_BYTES
    else:
        non_negative_row_stride(name, view)
        row_stride = int(view.strides[0])
        if row_stride == 0:
            raise ValueError(f"{PREFIX}{name} must have a row of its own for every row index, got row stride 0 "
                             f"(a broadcast view, shape {shape_text(view)}): every slot would share one row")
        if row_stride < needed_row_bytes:
            raise ValueError(f"{PREFIX}{name} rows must not overlap: row stride >= page_size * num_bytes_per_token "
                             f"= {needed_row_bytes} bytes, got {row_stride} (shape {shape_text(view)})")
    if row_stride % SOURCE_ALIGN_BYTES:
        raise ValueError(
            f"{PREFIX}{name} row stride must be a multiple of 16 bytes, "
            f"got {row_stride} bytes (shape {shape_text(view)}"
            + ("" if byte_view_dtype(view) else f", dtype {view.dtype}") + ")"
        )
    aligned(name, view, SOURCE_ALIGN_BYTES)
    return row_stride


def _require_contiguous_rows(name: str, view) -> None:
    """Bytes inside a row must be contiguous: dims 1.. laid out C-order."""
    if view.size == 0:
        return
    expected = view.itemsize
    for size, stride in zip(reversed(view.shape[1:]), reversed(view.strides[1:])):
        if size > 1 and stride != expected:
            raise ValueError(
                f"{PREFIX}{name} must have contiguous bytes within each row, "
                f"got strides {tuple(view.strides)} in bytes for shape {shape_text(view)}"
            )
        expected *= size
