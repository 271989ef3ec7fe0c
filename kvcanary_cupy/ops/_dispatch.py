"""The one place an op picks its backend and, on a GPU, its device and stream."""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator, Mapping

import numpy as np

from .. import validate as check
from .._dlpack import Device, cupy_module, import_error, installed_but_failing, require_cupy


def backend_module(device: Device, op: str):
    """``ops.backends._cpu.<op>`` or ``ops.backends._cuda.<op>``."""
    package = "_cuda" if device.is_cuda else "_cpu"
    try:
        return importlib.import_module(f"{__package__}.backends.{package}.{op}")
    except ImportError:
        numba_error = import_error("numba") if package == "_cpu" else None
        if numba_error is None:  # numba imports: the error is another's
            raise
        why = installed_but_failing(numba_error, "numba")
        if why is None:
            # numba is a dependency of the package, so only a broken install lacks it
            raise RuntimeError(f"{check.PREFIX}arrays on the CPU run on the numba backend, and numba is not "
                               "installed: pip install numba") from None
        # numba refusing the NumPy it finds (it supports a range of NumPy versions, and upgrading NumPy
        # alone can leave it out of range) is a broken install too, not a fault of the op
        raise RuntimeError(f"{check.PREFIX}arrays on the CPU run on the numba backend, and numba is installed "
                           f"but fails to import ({why})") from None


def resolve_stream(stream: Any, device: Device):
    """A CuPy stream object for ``stream`` (None, a CuPy stream, a raw handle, ``__cuda_stream__``)
    on ``device``: None is CuPy's current stream of that device, whichever device is current."""
    cupy = require_cupy("stream")
    form = stream_form(stream)
    if form == "current":
        return cupy.cuda.get_current_stream(device.index)
    if form == "cupy":
        _same_device(getattr(stream, "device_id", -1), device)
        return stream
    if form == "protocol":
        handle = stream.__cuda_stream__()[1]
    elif form == "torch_cuda":
        _same_device(getattr(getattr(stream, "device", None), "index", None), device)
        handle = stream.cuda_stream
    elif form == "handle":
        handle = int(stream)
    else:  # a stream of another kind of device (a torch CPU stream)
        raise TypeError(f"{check.PREFIX}stream must be a CUDA stream for arrays on {device}, "
                        f"got {type(stream).__name__} {stream!r}")
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14 deprecates ExternalStream in favour of the protocol
        with cupy.cuda.Device(device.index):  # the stream is taken to be the current device's
            return from_external(_StreamHandle(int(handle)))
    return cupy.cuda.ExternalStream(int(handle), device.index)


def stream_form(stream: Any) -> str:
    """Which of the forms ``stream=`` takes ``stream`` is: "current" (None), "cupy", "protocol"
    (``__cuda_stream__``), "torch_cuda" (``cuda_stream``), "handle" (a raw integer) or
    "torch_other" (a device-agnostic engine's torch stream, of the CPU too); anything else is
    refused, on the CPU too (where ``stream=`` is ignored), so that a call a CPU run accepts is not
    refused on a GPU for its stream's type."""
    cupy = cupy_module()
    if stream is None:
        return "current"
    if cupy is not None and isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return "cupy"
    if hasattr(stream, "__cuda_stream__"):
        return "protocol"
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return "torch_cuda"
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, (bool, np.bool_)):
        if not 0 <= int(stream) < 2**64:  # a cudaStream_t is a pointer
            raise ValueError(f"{check.PREFIX}stream, a raw CUDA stream handle, must be in [0, 2**64), got {int(stream)}")
        return "handle"
    if _is_torch_stream(stream):
        return "torch_other"
    raise TypeError(f"{check.PREFIX}stream must be None, a CuPy or torch stream, a raw CUDA stream handle or "
                    f"an object with __cuda_stream__, got {type(stream).__name__}")


def check_stream_form(stream: Any) -> None:
    """Refuse a ``stream=`` of no form :func:`stream_form` knows."""
    stream_form(stream)


def _is_torch_stream(stream: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch stream means torch is imported
    return torch is not None and isinstance(stream, getattr(torch, "Stream", ()))


def _same_device(owner, device: Device) -> None:
    """A stream whose device is known (``owner``; -1 or None: not known) must be the arrays'."""
    if owner not in (-1, None, device.index):
        raise ValueError(f"{check.PREFIX}stream must belong to the arrays' device {device}, "
                         f"got a stream of cuda:{owner}")


class _StreamHandle:
    """A raw ``cudaStream_t`` presented through the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@contextlib.contextmanager
def on_device(device: Device, stream: Any) -> Iterator[None]:
    """``device`` and ``stream`` (resolved) current, on a GPU (nothing to do on the CPU): a launch or
    an array's work queued there, and not on another stream that would not wait for the launches
    before it (nor they for it)."""
    if device.is_cuda:
        with cupy_module().cuda.Device(device.index), stream:
            yield
    else:
        yield


@contextlib.contextmanager
def launch_scope(devices: Mapping[str, Device], stream: Any) -> Iterator[tuple[Device, Any]]:
    """Check the call's arrays share one device; on a GPU make it current and resolve the stream."""
    device = check.one_device(devices)
    if not device.is_cuda:
        check_stream_form(stream)
        yield device, None
        return
    cupy = require_cupy("arrays")
    with cupy.cuda.Device(device.index):
        yield device, resolve_stream(stream, device)
