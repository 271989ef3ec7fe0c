"""Real-KV sources: views of the engine's KV memory whose bytes are fingerprinted per slot."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _layout as L
from . import validate as check
from ._dlpack import Device, data_pointer, device_of, native_view, own_view


# eq=False: a source is its memory, so equal and hashed by identity (comparing its array's
# elements would say nothing about the memory, and arrays are not hashable)
@dataclasses.dataclass(frozen=True, eq=False)
class RealKvSource:
    """One piece of real KV memory the canary fingerprints.

    Slot ``s`` reads row ``s // page_size`` of ``tensor`` (rows may be strided), starting at byte
    ``(s % page_size) * num_bytes_per_token`` of that row: the first 16 bytes in PARTIAL mode, the
    first ``read_bytes`` in ALL mode. ``tensor`` may be any DLPack array of any dtype; it is kept as
    a zero-copy view.
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    device: Device = dataclasses.field(init=False, repr=False, compare=False)
    num_rows: int = dataclasses.field(init=False, repr=False, compare=False)
    row_stride_bytes: int = dataclasses.field(init=False, repr=False, compare=False)
    base_address: int = dataclasses.field(init=False, repr=False, compare=False)
    _native: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        page_size = check.integer("RealKvSource.page_size", self.page_size)
        if page_size < 1:
            raise ValueError(f"{check.PREFIX}RealKvSource.page_size must be >= 1, got {page_size}")
        bytes_per_token = check.positive_multiple(
            "RealKvSource.num_bytes_per_token", self.num_bytes_per_token, L.SOURCE_ALIGN_BYTES
        )
        read_bytes = check.source_read_bytes("RealKvSource.read_bytes", self.read_bytes, bytes_per_token)
        device = device_of(self.tensor, "RealKvSource.tensor")
        # a view of its own (see own_view): contexts built from it later read what was checked here,
        # whatever is done in place to the caller's array object meanwhile
        view = native_view(own_view(self.tensor), "RealKvSource.tensor", device)
        row_stride = check.source_rows("RealKvSource.tensor", view, page_size * bytes_per_token)
        for name, value in (("page_size", page_size), ("num_bytes_per_token", bytes_per_token),
                            ("read_bytes", read_bytes), ("device", device), ("num_rows", int(view.shape[0])),
                            ("row_stride_bytes", row_stride), ("base_address", data_pointer(view)),
                            ("_native", view)):
            object.__setattr__(self, name, value)

    def read_length(self, hash_mode: L.HashMode) -> int:
        """Bytes per slot folded in ``hash_mode`` (0 when nothing is read)."""
        if hash_mode == L.HashMode.PARTIAL:
            return L.PARTIAL_READ_BYTES
        if hash_mode == L.HashMode.ALL:
            return self.read_bytes
        return 0

    def descriptor(self, hash_mode: L.HashMode) -> list[int]:
        """This source as one row of the kernels' source table (``_layout.SRC_*``)."""
        row = [0] * L.SOURCE_DESCRIPTOR_WORDS
        row[L.SRC_BASE_ADDRESS] = self.base_address
        row[L.SRC_ROW_STRIDE_BYTES] = self.row_stride_bytes
        row[L.SRC_NUM_ROWS] = self.num_rows
        row[L.SRC_PAGE_SIZE] = self.page_size
        row[L.SRC_BYTES_PER_TOKEN] = self.num_bytes_per_token
        row[L.SRC_READ_BYTES] = self.read_length(hash_mode)
        return row

    def host_words(self) -> np.ndarray:
        """The source's memory as one flat uint64 host array from row 0 to the end of its last
        used byte (gaps between strided rows included), for the CPU backend."""
        if self.device.is_cuda:
            raise RuntimeError("kv-canary: host_words() needs a host source")
        used_bytes = self.page_size * self.num_bytes_per_token
        if self.num_rows == 0:
            return np.zeros(0, dtype=np.uint64)
        span_bytes = (self.num_rows - 1) * self.row_stride_bytes + used_bytes
        first_word = byte_rows(self._native)[:1, :8].view(np.uint64)
        return np.lib.stride_tricks.as_strided(first_word, shape=(span_bytes // 8,), strides=(8,))


def byte_rows(view):
    """``view``, whose rows are contiguous bytes inside as :class:`RealKvSource` requires (the rows
    themselves may be strided), as ``[rows, row_bytes]`` uint8 over the same memory."""
    rows = view.reshape(int(view.shape[0]), int(np.prod(view.shape[1:])))
    return rows if rows.dtype == np.uint8 else rows.view(np.uint8)


def source_list(name: str, sources: Any) -> tuple:
    """``sources`` as a tuple of :class:`RealKvSource`: a list or tuple of them, nothing else."""
    if not isinstance(sources, (list, tuple)):
        raise TypeError(f"{check.PREFIX}{name} must be a list or tuple of RealKvSource, got {type(sources).__name__}")
    for index, source in enumerate(sources):
        check.instance(f"{name}[{index}]", source, RealKvSource)
    return tuple(sources)
