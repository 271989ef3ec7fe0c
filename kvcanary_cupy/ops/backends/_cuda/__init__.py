"""CUDA backend: thin launchers of the RawKernels in ``kvcanary_cupy/rawkernels``.

The public ops validate every argument, pick the device and resolve the stream before calling in
here; the launchers only turn arrays into pointers, pick grids and launch on the given stream.
They never synchronise, never read device values on the host and allocate nothing, so every
launch can be captured in a CUDA graph (compile and load the kernels once before capturing:
the first call of each op on a device does that).
"""

from __future__ import annotations

import numpy as np

from ....rawkernels import _loader

__all__ = ["Launch", "ptr", "i64", "i32", "kernel", "resident_grid", "sm_count", "vec16"]


_NULL = np.uint64(0)


def ptr(array):
    """A kernel pointer argument: the CuPy array itself (CuPy passes its data pointer), or a null
    pointer for None."""
    return _NULL if array is None else array


def i64(value: int) -> np.int64:
    return np.int64(value)


def i32(value: int) -> np.int32:
    return np.int32(value)


def kernel(source: str, name: str, device_id: int):
    return _loader.get_kernel(source, name, device_id)


def resident_grid(source: str, name: str, device_id: int, block: int) -> int:
    return _loader.resident_grid(source, name, device_id, block)


def sm_count(device_id: int) -> int:
    return _loader.device_info(device_id).sm_count


def vec16(canary_buf) -> bool:
    """Slots can be read as 16-byte vectors: 16-aligned base and a stride that is a multiple of 16."""
    return canary_buf.data.ptr % 16 == 0 and int(canary_buf.shape[1]) % 16 == 0


class Launch:
    """One kernel launch with every argument fixed: calling it launches on the given stream."""

    __slots__ = ("fn", "grid", "block", "args")

    def __init__(self, fn, grid: int, block: int, args: tuple):
        self.fn = fn
        self.grid = (int(grid),)
        self.block = (int(block),)
        self.args = args

    def __call__(self, stream) -> None:
        with stream:
            self.fn(self.grid, self.block, self.args)


def launch(fn, grid: int, block: int, args: tuple, stream) -> None:
    Launch(fn, grid, block, args)(stream)
