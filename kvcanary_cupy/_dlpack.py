"""Zero-copy views of caller arrays, wherever they live.

Every array argument of the public API may be a NumPy array, a CuPy array or any object speaking
DLPack (PyTorch, JAX, numba device arrays...). This module turns each one into a *native* view —
``numpy.ndarray`` for host memory, ``cupy.ndarray`` for device memory — over the caller's own bytes,
so ops write into the caller's memory. Dtypes NumPy/CuPy cannot express (bfloat16, float8...) are
read straight from the DLPack capsule and viewed as raw bytes, which is all the real-KV sources need.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import sys
import weakref
from typing import Any, Optional

import numpy as np

# DLPack device types (dlpack.h).
_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3
_DL_CUDA_MANAGED = 13
_HOST_DEVICE_TYPES = (_DL_CPU, _DL_CUDA_HOST)
_CUDA_DEVICE_TYPES = (_DL_CUDA, _DL_CUDA_MANAGED)


@dataclasses.dataclass(frozen=True)
class Device:
    """Where an array lives: ``Device("cpu")`` or ``Device("cuda", index)``."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


CPU = Device("cpu")


@functools.lru_cache(maxsize=None)
def cuda_device(index: int) -> Device:
    """``Device("cuda", index)``, made once: every op asks it of each of its arrays."""
    return Device("cuda", index)


@functools.lru_cache(maxsize=1)
def cupy_module():
    """CuPy, or ``None`` when it is not installed or cannot initialise."""
    global _CUPY_IMPORT_ERROR
    try:
        import cupy  # noqa: PLC0415
    except Exception as error:  # ImportError, or a CUDA library failing to load
        _CUPY_IMPORT_ERROR = error
        return None
    if getattr(cupy, "__file__", None) is None:
        # a cupy directory left without its __init__.py (an uninstall that removed CuPy's files but
        # not all of the directory) imports as an empty namespace package, with none of CuPy's names
        _CUPY_IMPORT_ERROR = ImportError(f"cupy in {', '.join(cupy.__path__)} is a directory without CuPy's "
                                         "modules, left by an uninstall: reinstall CuPy")
        return None
    return cupy


_CUPY_IMPORT_ERROR: Optional[BaseException] = None  # why an installed CuPy failed to import


def cupy_failure() -> Optional[str]:
    """Why an installed CuPy fails to import (None: it imports, or it is not installed)."""
    cupy_module()
    return installed_but_failing(_CUPY_IMPORT_ERROR, "cupy")


def import_error(module: str) -> Optional[BaseException]:
    """What importing ``module`` raises (None: it imports)."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        return error
    return None


def installed_but_failing(error: Optional[BaseException], module: str) -> Optional[str]:
    """Why an installed ``module`` fails to import, from its import's ``error``: None where there is
    no error or the module is not installed at all (an install to advise, not a failure to report)."""
    if error is None or (isinstance(error, ModuleNotFoundError) and error.name == module):
        return None
    return error_text(error)


def error_text(error: BaseException) -> str:
    """An exception's message, or its type's name where it has none."""
    return str(error).strip() or type(error).__name__


def cuda_device_count() -> int:
    cupy = cupy_module()
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device
        return 0


_DEVICE_FORMS = "'cpu', 'cuda', 'cuda:N', an int or a torch.device"


def parse_device(spec: Any) -> Device:
    """``"cpu"``, ``"cuda"`` (CuPy's current device), ``"cuda:N"``, an int N, a ``torch.device``
    (read as those: a torch engine passes its tensors' ``.device``; one of type cuda without an
    index is torch's current device, as torch reads it), or a :class:`Device`."""
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"kv-canary: device must be {_DEVICE_FORMS}, got {spec!r}")
    if type(spec).__module__ == "torch" and type(spec).__name__ == "device":
        if spec.type not in ("cpu", "cuda"):
            raise ValueError(f"kv-canary: device must be a torch.device of type 'cpu' or 'cuda', got {spec!r}")
        if spec.type == "cuda" and spec.index is None:
            return Device("cuda", _torch_current_cuda_device())
        spec = str(spec)  # 'cpu' or 'cuda:N', read as those strings are below
    if isinstance(spec, (int, np.integer)):
        if int(spec) < 0:
            raise ValueError(f"kv-canary: device index must be non-negative, got {int(spec)}")
        return Device("cuda", int(spec))
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "cpu":
            return CPU
        if text == "cuda":
            return Device("cuda", _current_cuda_device())
        if text.startswith("cuda:") and text[5:].isdecimal():  # not isdigit: "²" is a digit int() refuses
            return Device("cuda", int(text[5:]))
        raise ValueError(f"kv-canary: device must be 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
    raise TypeError(f"kv-canary: device must be {_DEVICE_FORMS}, got {spec!r}")


def _torch_current_cuda_device() -> int:
    """torch's current CUDA device (which ``torch.cuda.set_device`` sets, apart from CuPy's); CuPy's
    where torch cannot say (a build without CUDA, a machine without a GPU)."""
    try:
        return int(sys.modules["torch"].cuda.current_device())
    except Exception:
        return _current_cuda_device()


def _current_cuda_device() -> int:
    cupy = cupy_module()
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.runtime.getDevice())
    except Exception:
        return 0


def device_of(obj: Any, name: str) -> Device:
    """The device an array-like argument lives on."""
    if isinstance(obj, np.ndarray):
        return CPU
    cupy = cupy_module()
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return cuda_device(obj.data.device_id)  # not obj.device, which makes a cupy Device a call
    if _is_cuda_torch_tensor(obj):
        return cuda_device(obj.get_device())
    probe = getattr(obj, "__dlpack_device__", None)
    if probe is None and hasattr(obj, "__cuda_array_interface__"):
        return Device("cuda", _cuda_interface_device(obj, name))
    if probe is None:
        raise TypeError(
            f"kv-canary: {name} must be an array supporting DLPack (NumPy, CuPy, PyTorch, JAX...), "
            f"got {type(obj).__name__}"
        )
    try:
        device_type, device_id = probe()
    except Exception as error:  # e.g. torch's meta tensors, which have no DLPack device
        raise ValueError(f"kv-canary: {name} has no DLPack device (only host memory and CUDA devices are "
                         f"supported): {error}") from error
    device_type = int(device_type)
    if device_type in _HOST_DEVICE_TYPES:
        return CPU
    if device_type in _CUDA_DEVICE_TYPES:
        return Device("cuda", int(device_id))
    raise ValueError(
        f"kv-canary: {name} lives on an unsupported DLPack device type {device_type}; "
        "only host memory and CUDA devices are supported"
    )


def _cuda_interface_device(obj: Any, name: str) -> int:
    """The device of an object exposing only ``__cuda_array_interface__`` (numba device arrays)."""
    cupy = require_cupy(name)
    pointer = int(obj.__cuda_array_interface__["data"][0])
    if pointer == 0:
        return _current_cuda_device()
    return int(cupy.cuda.runtime.pointerGetAttributes(pointer).device)


def own_view(obj: Any):
    """A new view of a NumPy or CuPy array (``obj`` itself otherwise, whose native view is new anyway).

    A bundle that keeps arrays across calls keeps its own views of them: what it validated once
    (shape, strides, dtype) then stays what its launches read, whatever is later done in place to
    the caller's array object (``a.shape = ...``, ``a.dtype = ...``), which could otherwise turn a
    checked buffer into one a kernel reads or writes past."""
    if isinstance(obj, np.ndarray):
        return obj.view()
    cupy = sys.modules.get("cupy")  # a CuPy array means CuPy is imported
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return obj.view()
    return obj


def native_view(obj: Any, name: str, device: Device | None = None):
    """A NumPy (host) or CuPy (CUDA) view of ``obj`` sharing its memory."""
    device = device_of(obj, name) if device is None else device
    if not device.is_cuda:
        if isinstance(obj, np.ndarray):
            # a subclass (a masked array, a matrix, a memmap) as the plain array of its memory, as
            # DLPack would export it: the backend compiles for plain arrays, and a matrix indexes
            # as no other array does
            return obj if type(obj) is np.ndarray else obj.view(np.ndarray)
        _require_export(obj, name)
        _require_memory_holds_values(obj, name)
        try:
            return np.from_dlpack(obj)
        except (BufferError, TypeError, ValueError, RuntimeError):
            return raw_byte_view(obj, name)
    cupy = require_cupy(name)
    if isinstance(obj, cupy.ndarray):
        return obj
    if _is_cuda_torch_tensor(obj):
        view = _torch_view(cupy, obj, device)
        if view is not None:
            return view
    if not hasattr(obj, "__dlpack__") and hasattr(obj, "__cuda_array_interface__"):
        with cupy.cuda.Device(device.index):
            return cupy.asarray(obj)  # zero-copy over the interface's pointer (numba device arrays)
    _require_export(obj, name)
    _require_memory_holds_values(obj, name)
    try:
        return cupy.from_dlpack(obj)
    except (BufferError, TypeError, ValueError, RuntimeError):
        return raw_byte_view(obj, name)


def _require_export(obj: Any, name: str) -> None:
    """An object that names its DLPack device but cannot export its memory (no ``__dlpack__``) is no
    array an op can use."""
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"kv-canary: {name} must be an array supporting DLPack (NumPy, CuPy, PyTorch, JAX...), "
                        f"got {type(obj).__name__}, which has __dlpack_device__ but no __dlpack__")


def _require_memory_holds_values(obj: Any, name: str) -> None:
    """A torch tensor whose memory is not its values is refused: DLPack exports a lazily negated
    tensor's memory un-negated, so an op would read other values than the tensor's (and store
    values the tensor then shows negated), and an efficient zero tensor, which has no memory, as a
    buffer of whatever bytes it finds, which nothing else sees stored into."""
    torch = sys.modules.get("torch")  # a torch tensor means torch is imported; never import it here
    if torch is None or not isinstance(obj, getattr(torch, "Tensor", ())):
        return
    if obj.is_neg():
        raise ValueError(f"kv-canary: {name} must hold its values in memory, got a torch tensor with its negative "
                         "bit set (a lazy negation, which DLPack exports un-negated): pass tensor.resolve_neg()")
    zero = getattr(obj, "_is_zerotensor", None)
    if zero is not None and zero():
        raise ValueError(f"kv-canary: {name} must hold its values in memory, got a torch efficient zero tensor "
                         "(it has no memory to share): pass a tensor of zeros, e.g. torch.zeros")


def launch_geometry(obj: Any):
    """``(geometry, address)`` of a CuPy array or of a CUDA torch tensor that :func:`native_view`
    views from its attributes: the geometry (framework, shape, strides, dtype, device) is what the
    rules an op checks and the launch it prepares depend on, the address is where the launch finds
    the elements. ``None`` for any other array, and for an address its elements are not aligned to
    (a rule refuses that)."""
    cupy = cupy_module()
    if cupy is not None and isinstance(obj, cupy.ndarray):
        address, itemsize = obj.data.ptr, obj.itemsize
        geometry = ("cupy", obj.shape, obj.strides, obj.dtype, obj.data.device_id)
    elif _is_cuda_torch_tensor(obj) and _torch_viewable(obj):
        address, itemsize = obj.data_ptr(), obj.element_size()
        geometry = ("torch", tuple(obj.shape), obj.stride(), obj.dtype, obj.get_device())
    else:
        return None
    if address % itemsize:
        return None
    return geometry, address


def _is_cuda_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor means torch is imported; never import it here
    return torch is not None and isinstance(obj, getattr(torch, "Tensor", ())) and obj.is_cuda


@functools.lru_cache(maxsize=1)
def _torch_dtypes() -> dict:
    """The torch dtypes a CuPy view can have, as NumPy dtypes (torch is imported when this runs)."""
    torch = sys.modules["torch"]
    names = ("int64", "int32", "int16", "int8", "uint8", "float64", "float32", "float16", "bool")
    return {getattr(torch, name): np.dtype(name) for name in names}


def _torch_viewable(tensor: Any) -> bool:
    """A CUDA tensor CuPy can view as it is: a dtype CuPy has, strided, not empty, and one DLPack
    would export (no grad, no lazy conjugate or negation) and with memory (an efficient zero tensor
    has none: its data pointer is null)."""
    return (tensor.dtype in _torch_dtypes() and not tensor.requires_grad and not tensor.is_conj()
            and not tensor.is_neg() and tensor.layout is sys.modules["torch"].strided and tensor.numel() > 0
            and tensor.data_ptr() != 0)


def _torch_view(cupy, tensor: Any, device: Device):
    """A CuPy view of a CUDA tensor built from its attributes, or ``None`` where DLPack must decide
    (dtypes CuPy has not, tensors DLPack refuses or that are empty). What ``cupy.from_dlpack`` does,
    at a fraction of its host time (about 30 us a tensor on an H200 host): the engine's tensors are
    adopted again every forward. As DLPack's exchange does, CuPy's current stream is made to wait for
    torch's when they differ."""
    if not _torch_viewable(tensor):
        return None
    order_after_torch(device.index)
    dtype = _torch_dtypes()[tensor.dtype]
    itemsize = dtype.itemsize
    shape = tuple(tensor.shape)
    element_strides = tensor.stride()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, element_strides))
    # The storage owns the bytes: the tensor could be pointed at other storage (set_) while viewed.
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), extent * itemsize, tensor.untyped_storage(), device.index)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0),
                        tuple(stride * itemsize for stride in element_strides))


def _torch_current_stream(index: int) -> int:
    """The raw handle of torch's current stream on device ``index``."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch's own kernels ask; no Stream object
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def order_after_torch(index: int) -> None:
    """Make CuPy's current stream of device ``index`` wait for what torch has queued on its current
    stream, as a DLPack exchange between the two does; nothing when they are the same stream, or
    when either is capturing a CUDA graph (an event recorded outside a capture cannot be waited for
    inside it, and a wait captured once would not be made again at each replay: inside a capture
    the caller orders its streams)."""
    cupy = cupy_module()
    producer = _torch_current_stream(index)
    consumer = int(cupy.cuda.get_current_stream(index).ptr)
    if producer == consumer or {producer, consumer} <= {0, 1}:  # 0 and 1: both the legacy default
        return
    if _capturing(cupy, producer) or _capturing(cupy, consumer):
        return
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(index):
        event = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
        try:
            runtime.eventRecord(event, producer)
            runtime.streamWaitEvent(consumer, event)
        finally:
            runtime.eventDestroy(event)


def stream_capturing(stream: Any) -> bool:
    """Whether a CuPy stream (as ops resolve ``stream=``) is capturing a CUDA graph; never for the
    CPU's ``None``."""
    cupy = cupy_module()
    if cupy is None or getattr(stream, "ptr", None) is None:
        return False
    return _capturing(cupy, int(stream.ptr))


def _capturing(cupy, stream: int) -> bool:
    """Whether ``stream`` is capturing a CUDA graph (or cannot be asked because another is)."""
    is_capturing = getattr(cupy.cuda.runtime, "streamIsCapturing", None)
    if is_capturing is None:  # a CuPy without graph capture
        return False
    try:
        return is_capturing(stream) != 0
    except cupy.cuda.runtime.CUDARuntimeError:  # the legacy stream while a blocking stream captures
        return True


class CudaUnavailableError(ValueError, RuntimeError):
    """A CUDA device asked of a machine where CuPy is missing: a bad ``device`` value there
    (ValueError, as SPEC 4 has bad input raise) and an environment that lacks something."""


def require_cupy(name: str):
    cupy = cupy_module()
    if cupy is None:
        why = cupy_failure()
        if why is not None:
            raise CudaUnavailableError(f"kv-canary: {name}: a CUDA device needs CuPy, which is installed but fails "
                                       f"to import ({why}): python -c 'import cupy' tells more")
        raise CudaUnavailableError(
            f"kv-canary: {name}: a CUDA device needs CuPy, which is not installed; install cupy-cuda12x "
            "or cupy-cuda13x (this package's cuda12 or cuda13 extra)"
        )
    return cupy


def require_device(device: Device) -> None:
    """A CUDA ``device`` must be one CuPy sees: said in one line where arrays are made for it, rather
    than by CuPy's error from deep inside (a machine with CuPy and no GPU, or ``cuda:N`` past its
    GPUs). Nothing to check on the CPU."""
    if not device.is_cuda:
        return
    require_cupy("device")
    count = cuda_device_count()
    if device.index >= count:
        raise CudaUnavailableError(f"kv-canary: device must be one of the {count} CUDA device(s) seen, got {device}")


# --- raw DLPack, for dtypes NumPy and CuPy cannot express -------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_get_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_capsule_pointer.restype = ctypes.c_void_p
_get_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _CapsuleKeeper:
    """Holds the producer object and its capsule so the memory outlives our view."""

    def __init__(self, producer: Any, capsule: Any):
        self.producer = producer
        self.capsule = capsule


# The dtype and shape of the array each live byte view stands for, by id (an entry goes with its
# view), so that a rule refusing one names the caller's dtype and shape, not uint8's.
_BYTE_VIEWS: dict[int, tuple[str, Optional[tuple]]] = {}
# DLPack type codes (dlpack.h) of the dtypes NumPy and CuPy cannot express, for objects that do
# not name their dtype themselves.
_DL_CODE_NAMES = {3: "opaque{bits}", 4: "bfloat{bits}", 5: "complex{bits}", 7: "float8_e3m4", 8: "float8_e4m3",
                  9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn", 11: "float8_e4m3fnuz", 12: "float8_e5m2",
                  13: "float8_e5m2fnuz", 14: "float8_e8m0fnu", 15: "float6_e2m3fn", 16: "float6_e3m2fn",
                  17: "float4_e2m1fn"}


def _dtype_name(obj: Any, code: int, bits: int) -> str:
    """The name of ``obj``'s dtype, one NumPy and CuPy cannot express (e.g. ``"bfloat16"``)."""
    declared = getattr(obj, "dtype", None)
    if declared is not None:
        return str(declared).rpartition(".")[2]  # torch.bfloat16 -> bfloat16
    return _DL_CODE_NAMES.get(code, "DLPack type code {code} of {bits} bits").format(code=code, bits=bits)


def _remember_dtype(view: Any, obj: Any, code: int, bits: int) -> Any:
    name = _dtype_name(obj, code, bits)
    shape = getattr(obj, "shape", None)
    key = id(view)
    _BYTE_VIEWS[key] = (name, None if shape is None else tuple(int(n) for n in shape))
    weakref.finalize(view, _BYTE_VIEWS.pop, key, None)
    return view


def byte_view_dtype(array: Any) -> Optional[str]:
    """The dtype of the array a :func:`raw_byte_view` views (e.g. ``"bfloat16"``); ``None`` for any
    other array."""
    seen = _BYTE_VIEWS.get(id(array))
    return None if seen is None else seen[0]


def byte_view_shape(array: Any) -> Optional[tuple]:
    """The shape, in its own elements, of the array a :func:`raw_byte_view` views, when it said."""
    seen = _BYTE_VIEWS.get(id(array))
    return None if seen is None else seen[1]


def raw_byte_view(obj: Any, name: str):
    """A uint8 view with the same byte geometry as ``obj``: shape ``(*shape[:-1], shape[-1] * itemsize)``."""
    try:
        capsule = obj.__dlpack__()
    except (BufferError, RuntimeError) as error:  # e.g. a PyTorch tensor that requires grad
        raise ValueError(f"kv-canary: {name} cannot be shared through DLPack: {error}") from None
    try:
        address = _get_capsule_pointer(capsule, b"dltensor")
    except (TypeError, ValueError) as error:  # not a DLPack capsule (or one already consumed)
        raise ValueError(f"kv-canary: {name} must export a DLPack capsule from __dlpack__(), got "
                         f"{type(capsule).__name__}: {error}") from None
    tensor = _DLManagedTensor.from_address(address).dl_tensor
    element_bits = int(tensor.dtype.bits) * int(tensor.dtype.lanes)
    itemsize = element_bits // 8
    ndim = int(tensor.ndim)
    if ndim == 0:  # a shape error, as for a 0-d array NumPy can view
        dtype_name = _dtype_name(obj, int(tensor.dtype.code), int(tensor.dtype.bits))
        raise ValueError(f"kv-canary: {name} must be an array with at least one dimension, got shape () "
                         f"(a 0-d {dtype_name} array)")
    if itemsize == 0 or element_bits % 8:
        # Values of fewer bits than a byte may be packed several to a byte, which the shape alone
        # does not say: a view by the shape could reach past the data.
        raise TypeError(f"kv-canary: {name} must have elements of whole bytes (at least one), got a DLPack dtype "
                        f"of {tensor.dtype.bits} bits x {tensor.dtype.lanes} lanes (pass a uint8 view of its bytes)")
    shape = [int(tensor.shape[i]) for i in range(ndim)]
    if tensor.strides:
        strides = [int(tensor.strides[i]) * itemsize for i in range(ndim)]
    else:
        strides = [itemsize] * ndim
        for i in range(ndim - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    if strides[-1] != itemsize and shape[-1] > 1:
        raise ValueError(f"kv-canary: {name} must have a contiguous last dimension, got strides {strides} in bytes")
    byte_shape = tuple(shape[:-1]) + (shape[-1] * itemsize,)
    byte_strides = tuple(strides[:-1]) + (1,)
    pointer = int(tensor.data or 0) + int(tensor.byte_offset)
    span = 0 if 0 in byte_shape else 1 + sum((n - 1) * s for n, s in zip(byte_shape, byte_strides))
    keeper = _CapsuleKeeper(obj, capsule)
    if int(tensor.device.device_type) in _HOST_DEVICE_TYPES:
        if span == 0:
            view = np.zeros(byte_shape, dtype=np.uint8)
        else:
            buffer = (ctypes.c_uint8 * span).from_address(pointer)
            buffer._kvcanary_keeper = keeper  # type: ignore[attr-defined]
            flat = np.frombuffer(buffer, dtype=np.uint8)
            view = np.lib.stride_tricks.as_strided(flat, shape=byte_shape, strides=byte_strides)
    else:
        cupy = require_cupy(name)
        memory = cupy.cuda.UnownedMemory(pointer, span, keeper, int(tensor.device.device_id))
        view = cupy.ndarray(byte_shape, dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0),
                            strides=byte_strides)
    return _remember_dtype(view, obj, int(tensor.dtype.code), int(tensor.dtype.bits))


def data_pointer(array) -> int:
    """Address of the first element of a native array."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data.ptr)


def to_host(array) -> np.ndarray:
    """A host copy (or the array itself when it already is one)."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()


def filled(shape, dtype, device: Device, fill: int = 0):
    """An array on ``device`` with every element ``fill`` (zeros by default)."""
    if device.is_cuda:
        cupy = require_cupy("device")
        with cupy.cuda.Device(device.index):
            return cupy.full(shape, fill, dtype=dtype)
    return np.full(shape, fill, dtype=dtype)


def assign(array, value: int, device: Device) -> None:
    """``array[...] = value`` for an array on ``device``, queued on CuPy's current stream of that
    device (the one :func:`settle` waits for). CuPy queues a fill on the current device's stream
    whatever device the array lives on, so on a GPU that device is made current for it."""
    if device.is_cuda:
        cupy = require_cupy("device")
        with cupy.cuda.Device(device.index):
            array[...] = value
    else:
        array[...] = value


def settle(device: Device) -> None:
    """Waits for what is queued on CuPy's current stream of ``device`` (nothing to do on the CPU).
    Called once where arrays a canary keeps are allocated or uploaded (a context's source table
    included): their fills and copies are queued there, and an op launched on a stream that does not
    wait for it (a non-blocking one) could otherwise run first, or have a counter it added to zeroed
    by a late fill."""
    if device.is_cuda:
        cupy = require_cupy("device")
        with cupy.cuda.Device(device.index):
            cupy.cuda.get_current_stream().synchronize()


def from_host(array: np.ndarray, device: Device):
    if not device.is_cuda:
        return array
    cupy = require_cupy("device")
    with cupy.cuda.Device(device.index):
        return cupy.asarray(array)
