"""CUDA backend: thin launchers of the RawKernels in ``kvcanary_cupy/rawkernels``.

The public ops validate every argument, pick the device and resolve the stream before calling in
here; the launchers only turn arrays into pointers, pick grids and launch on the given stream.
They never synchronise, never read device values on the host and allocate nothing, so every
launch can be captured in a CUDA graph (compile and load the kernels once before capturing:
the first call of each op on a device does that).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ....rawkernels import _loader

__all__ = ["Launch", "ptr", "i64", "i32", "context_args", "table_args", "decode_shaped", "kernel",
           "resident_grid", "sm_count", "vec16"]


_NULL = np.uint64(0)


def ptr(array):
    """A kernel pointer argument: the CuPy array itself (CuPy passes its data pointer), or a null
    pointer for None."""
    return _NULL if array is None else array


def i64(value: int) -> np.int64:
    return np.int64(value)


def i32(value: int) -> np.int32:
    return np.int32(value)


def context_args(ctx) -> tuple:
    """The canary context's ring, counters and sources, in the order every kernel that records
    violations takes them."""
    table = ctx.source_table
    return (ptr(ctx.violation_ring), i64(ctx.ring_capacity), ptr(ctx.violation_write_index),
            ptr(ctx.slot_run_counter), ptr(ctx.kernel_run_counter), ptr(table), i64(int(table.shape[0])))


def table_args(array):
    """(pointer, rows, width, row stride in elements) of an int32 table, or zeros for None."""
    if array is None:
        return ptr(None), 0, 0, 0
    rows, width = int(array.shape[0]), int(array.shape[1])
    stride = int(array.strides[0]) // int(array.itemsize) if rows > 1 else width
    return ptr(array), rows, width, stride


def kernel(source: str, name: str, device_id: int):
    return _loader.get_kernel(source, name, device_id)


def resident_grid(source: str, name: str, device_id: int, block: int) -> int:
    return _loader.resident_grid(source, name, device_id, block)


def sm_count(device_id: int) -> int:
    return _loader.device_info(device_id).sm_count


def decode_shaped(batch_size: int, num_tokens: int) -> bool:
    """At most two new tokens a request on average: the shape for which the launchers pick the
    kernels' decode forms (the write's kvc_write_decode, and one warp a request instead of two in
    kvc_write; the one-launch step; scatter's kDecode)."""
    return num_tokens <= 2 * batch_size


def vec16(canary_buf) -> bool:
    """Slots can be read as 16-byte vectors: 16-aligned base and a stride that is a multiple of 16."""
    return canary_buf.data.ptr % 16 == 0 and int(canary_buf.shape[1]) % 16 == 0


# Kernel parameter types: what each launcher passes, as the C value the kernel receives.
_C_SCALARS = {np.dtype(np.int64): ctypes.c_int64, np.dtype(np.int32): ctypes.c_int32,
              np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.uint32): ctypes.c_uint32}


def _c_parameter(value):
    """One kernel parameter as a ctypes value: a device array's address or a NumPy scalar."""
    if isinstance(value, np.generic):
        ctype = _C_SCALARS.get(value.dtype)
        if ctype is None:
            raise TypeError(f"kv-canary: kernel parameter of dtype {value.dtype} has no C type here")
        return ctype(value.item())
    data = getattr(value, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return ctypes.c_uint64(int(data.ptr))
    raise TypeError(f"kv-canary: kernel parameter of type {type(value).__name__} cannot be packed")


class _PackedParameters:
    """The ``void**`` parameter array of one launch, built once: a relaunch is one driver call
    instead of CuPy converting every argument again (a step kernel takes over fifty). The arrays
    whose addresses it holds are kept alive by the owning :class:`Launch`'s ``args``."""

    __slots__ = ("values", "pointers", "address", "function")

    def __init__(self, fn, args: tuple):
        self.values = [_c_parameter(a) for a in args]
        self.pointers = (ctypes.c_void_p * max(len(self.values), 1))(
            *[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.pointers)
        self.function = fn.kernel.ptr  # the CUfunction on the current device


class Launch:
    """One kernel launch with every argument fixed: calling it launches on the given stream.

    ``packed``: the parameters are packed once here (the current device must be the kernel's), and
    each call goes straight to ``cuLaunchKernel``; for launches that are prepared once and run
    every step."""

    __slots__ = ("fn", "grid", "block", "args", "_packed")

    def __init__(self, fn, grid: int, block: int, args: tuple, *, packed: bool = False):
        self.fn = fn
        self.grid = (int(grid),)
        self.block = (int(block),)
        self.args = args
        self._packed = _PackedParameters(fn, args) if packed else None

    def parameters_of(self, array) -> list[int]:
        """The indices of the parameters that point at ``array`` (the object itself)."""
        return [index for index, argument in enumerate(self.args) if argument is array]

    def detach(self) -> "Launch":
        """This packed launch without its references to the arrays it points at, for a cache keyed by
        those arrays' geometry: before each call, :meth:`rebind` points it at the caller's arrays
        of that geometry."""
        if self._packed is None:
            raise ValueError("kv-canary: only a packed launch holds its parameters without its arrays")
        self.args = ()
        return self

    def rebind(self, bindings: tuple, addresses: list) -> None:
        """Set each ``(parameter index, slot)`` of ``bindings`` to ``addresses[slot]``."""
        values = self._packed.values
        for index, slot in bindings:
            values[index].value = addresses[slot]

    def __call__(self, stream) -> None:
        packed = self._packed
        if packed is None:
            with stream:
                self.fn(self.grid, self.block, self.args)
            return
        from cupy.cuda import driver

        driver.launchKernel(packed.function, self.grid[0], 1, 1, self.block[0], 1, 1, 0, stream.ptr,
                            packed.address, 0)


def launch(fn, grid: int, block: int, args: tuple, stream) -> None:
    Launch(fn, grid, block, args)(stream)
