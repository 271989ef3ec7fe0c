"""Compiles the canary's CUDA sources with NVRTC (through CuPy) once per device architecture.

The sources are package files (``*.cu`` beside this module, sharing ``canary_common.cuh``). Every
wire-format constant reaches them as ``-D`` options from :func:`kvcanary_cupy._layout.nvrtc_defines`,
and each kernel's launch geometry (block size, ...) from its :class:`KernelSpec`, which its launcher
reads too.
:func:`compile_specs` says exactly what gets compiled (source text, options, name expressions); the
CPU-only NVRTC test compiles the same thing, so a source that loads here compiles there.

CuPy is imported lazily: the package imports without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import itertools
import pathlib
import threading

from .. import _layout

RAWKERNEL_DIR = pathlib.Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One compilation unit: a ``.cu`` file and the kernels taken from it."""

    name: str                              # its SPECS key: "verify", "write", ..., "session", "records"
    filename: str                          # the .cu file in RAWKERNEL_DIR
    name_expressions: tuple[str, ...]      # templates to instantiate (empty: extern "C" kernels)
    kernels: tuple[str, ...]               # names passed to get_function
    # what the kernel and its launcher must agree on, handed to the source as -D<name>=<value>
    geometry: tuple[tuple[str, int], ...] = ()

    def constant(self, name: str) -> int:
        return dict(self.geometry)[name]

    def defines(self) -> tuple[str, ...]:
        return tuple(f"-D{name}={value}" for name, value in self.geometry)


def instance(template: str, *flags: bool) -> str:
    """A kernel template's name with its bool parameters: ``instance("kvc_write", True, False)`` is
    ``"kvc_write<true, false>"``. The launchers and the specs below both name kernels with it."""
    return f"{template}<{', '.join('true' if flag else 'false' for flag in flags)}>"


def _instances(template: str, arity: int) -> tuple[str, ...]:
    """Every instantiation of a template of ``arity`` bool parameters."""
    return tuple(instance(template, *flags) for flags in itertools.product((True, False), repeat=arity))


_VERIFY_KERNELS = _instances("kvc_verify", 1)
_WRITE_KERNELS = _instances("kvc_write", 3)  # vec16, paired, real-KV sources
# vec16, real-KV sources, short reads (only with sources)
_WRITE_DECODE_KERNELS = tuple(instance("kvc_write_decode", vec16, real_kv, short)
                              for vec16 in (True, False)
                              for real_kv, short in ((True, True), (True, False), (False, False)))
_STEP_KERNELS = _instances("kvc_step", 3)  # vec16, tail write, real-KV sources
# decode-shaped, long rows (never both)
_SCATTER_KERNELS = tuple(instance("kvc_scatter", *forms) for forms in ((True, False), (False, False), (False, True)))
# The plan kernel's tiles (requests staged at once, one a thread: its block size), smallest first.
PLAN_TILES = (256, 1024)


def plan_instance(tile: int, lut: bool) -> str:
    """The plan kernel for a tile and for batches with (or without) a LUT."""
    return f"kvc_plan<{tile}, {'true' if lut else 'false'}>"


_PLAN_KERNELS = tuple(plan_instance(tile, lut) for tile in PLAN_TILES for lut in (True, False))
_SESSION_KERNELS = ("kvc_count_disabled", "kvc_count_run", "kvc_translate_slots")  # extern "C"
_RECORDS_KERNELS = ("kvc_gather_records", "kvc_scatter_records", "kvc_copy_records")  # extern "C"
# kc.block_tables' kernels: the mirror for int32 and int64 block tables, the batch (which takes
# either dtype for each input) extern "C"
BLOCK_TABLE_CTYPES = ("int", "long long")
_MIRROR_KERNELS = tuple(f"kvc_mirror_blocks<{ctype}>" for ctype in BLOCK_TABLE_CTYPES)

_SPECS = (
    KernelSpec("verify", "verify.cu", _VERIFY_KERNELS, _VERIFY_KERNELS, (("KVC_VERIFY_THREADS", 256),)),
    KernelSpec("write", "write.cu", _WRITE_KERNELS, _WRITE_KERNELS,
               (("KVC_WRITE_WARPS", 8), ("KVC_WRITE_CHUNK", 32))),
    KernelSpec("write_decode", "write_decode.cu", _WRITE_DECODE_KERNELS, _WRITE_DECODE_KERNELS,
               (("KVC_WRITE_DECODE_THREADS", 128), ("KVC_WRITE_DECODE_LANES", 8))),
    KernelSpec("plan", "plan.cu", _PLAN_KERNELS, _PLAN_KERNELS),
    KernelSpec("scatter", "scatter.cu", _SCATTER_KERNELS, _SCATTER_KERNELS,
               (("KVC_SCATTER_THREADS", 256), ("KVC_SCATTER_DECODE_THREADS", 128),
                ("KVC_SCATTER_BLOCKS_PER_SM", 8))),
    # the step's tail write (kTailWrite) writes a request per lane of one warp: at most 32 requests
    KernelSpec("step", "step.cu", _STEP_KERNELS, _STEP_KERNELS,
               (("KVC_STEP_THREADS", 512), ("KVC_STEP_TAIL_MAX_REQUESTS", 32))),
    KernelSpec("session", "session.cu", (), _SESSION_KERNELS, (("KVC_SESSION_THREADS", 256),)),
    KernelSpec("records", "records.cu", (), _RECORDS_KERNELS, (("KVC_RECORDS_THREADS", 256),)),
    KernelSpec("block_tables", "block_tables.cu", _MIRROR_KERNELS, _MIRROR_KERNELS + ("kvc_batch_from_offsets",),
               (("KVC_BLOCK_TABLES_THREADS", 256),)),
)
SPECS = {spec.name: spec for spec in _SPECS}


@functools.lru_cache(maxsize=None)
def _read(filename: str) -> str:
    return (RAWKERNEL_DIR / filename).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _header_digest() -> str:
    # CuPy's kernel cache is keyed by the source text and the options, not by included headers;
    # the headers' digest in the options makes a changed header a new cache entry.
    digest = hashlib.sha256()
    for header in sorted(RAWKERNEL_DIR.glob("*.cuh")):
        digest.update(header.name.encode("utf-8"))
        digest.update(_read(header.name).encode("utf-8"))
    return digest.hexdigest()[:16]


def nvrtc_options() -> tuple[str, ...]:
    """The NVRTC options of every canary source (no architecture: CuPy adds the device's)."""
    return (
        "--std=c++17",
        f"-I{RAWKERNEL_DIR}",
        f"-DKVC_COMMON_DIGEST=0x{_header_digest()}ULL",
        *_layout.nvrtc_defines(),
    )


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """Exactly what is handed to NVRTC for one source."""

    name: str
    filename: str
    code: str
    options: tuple[str, ...]
    name_expressions: tuple[str, ...]
    kernels: tuple[str, ...]


def compile_specs() -> tuple[CompileSpec, ...]:
    """Every canary source with the options and name expressions the loader compiles it with."""
    options = nvrtc_options()
    return tuple(
        CompileSpec(spec.name, spec.filename, _read(spec.filename), options + spec.defines(),
                    spec.name_expressions, spec.kernels)
        for spec in _SPECS
    )


_lock = threading.Lock()  # guards _key_locks
_key_locks: dict = {}  # a lock a module: one source compiles once, different sources at once
_modules: dict = {}
# (module key, device id) of each module loaded on a device: CuPy loads a module on each device
# apart (its kernels are per device), so devices of one architecture share the compiled module but
# each loads it itself
_loaded: set = set()


def _module(name: str, device_id: int):
    """The compiled RawModule of source ``name`` for the device's architecture (cached), its kernels
    loaded on device ``device_id``."""
    import cupy

    arch = cupy.cuda.Device(device_id).compute_capability
    spec = SPECS[name]
    code = _read(spec.filename)
    options = nvrtc_options() + spec.defines()
    key = (name, code, options, arch)
    if (key, device_id) not in _loaded:  # a module is cached only once some device has loaded it
        with _lock:
            key_lock = _key_locks.setdefault(key, threading.Lock())
        with key_lock:
            module = _modules.get(key)
            if (key, device_id) not in _loaded:
                with cupy.cuda.Device(device_id):
                    if module is None:
                        kwargs = {"code": code, "options": options}
                        if spec.name_expressions:
                            kwargs["name_expressions"] = spec.name_expressions
                        module = cupy.RawModule(**kwargs)
                    for kernel in spec.kernels:
                        module.get_function(kernel)  # compile and load now, not at first launch
                _modules[key] = module
                _loaded.add((key, device_id))
    return _modules[key]


def load_all(device_id: int) -> None:
    """Every source's module compiled (or loaded from CuPy's cache) for the device, its kernels loaded.
    The sources compile in threads of their own: NVRTC compiles programs concurrently, so a first
    compile on a machine takes about as long as its largest source instead of all of them."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(_SPECS)) as pool:
        for compiled in [pool.submit(_module, spec.name, device_id) for spec in _SPECS]:
            compiled.result()


_functions: dict = {}


def get_kernel(name: str, kernel: str, device_id: int):
    """The ``cupy.RawKernel`` ``kernel`` of source ``name`` on device ``device_id`` (cached)."""
    key = (name, kernel, device_id)
    fn = _functions.get(key)
    if fn is None:
        import cupy

        with cupy.cuda.Device(device_id):
            fn = _module(name, device_id).get_function(kernel)
        _functions[key] = fn
    return fn


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    sm_count: int
    max_threads_per_sm: int
    regs_per_sm: int
    max_blocks_per_sm: int


_device_info: dict = {}


def device_info(device_id: int) -> DeviceInfo:
    info = _device_info.get(device_id)
    if info is None:
        import cupy

        attrs = cupy.cuda.Device(device_id).attributes
        info = DeviceInfo(
            sm_count=int(attrs["MultiProcessorCount"]),
            max_threads_per_sm=int(attrs["MaxThreadsPerMultiProcessor"]),
            regs_per_sm=int(attrs.get("MaxRegistersPerMultiprocessor", 65536)),
            max_blocks_per_sm=int(attrs.get("MaxBlocksPerMultiprocessor", 16)),
        )
        _device_info[device_id] = info
    return info


_resident: dict = {}


def resident_grid(name: str, kernel: str, device_id: int, block: int) -> int:
    """Blocks that fill every SM once (occupancy from the kernel's registers and shared memory)."""
    key = (name, kernel, device_id, block)
    grid = _resident.get(key)
    if grid is None:
        fn = get_kernel(name, kernel, device_id)
        info = device_info(device_id)
        warps = (block + 31) // 32
        by_threads = info.max_threads_per_sm // block
        regs = max(int(getattr(fn, "num_regs", 0) or 0), 1)
        regs_per_warp = ((regs * 32 + 255) // 256) * 256
        by_regs = info.regs_per_sm // (regs_per_warp * warps)
        per_sm = max(1, min(by_threads, by_regs, info.max_blocks_per_sm))
        smem = int(getattr(fn, "shared_size_bytes", 0) or 0)
        if smem > 0:
            import cupy

            attrs = cupy.cuda.Device(device_id).attributes
            smem_sm = int(attrs.get("MaxSharedMemoryPerMultiprocessor", 0) or 0)
            if smem_sm > 0:
                per_sm = max(1, min(per_sm, smem_sm // (smem + 1024)))
        grid = per_sm * info.sm_count
        _resident[key] = grid
    return grid
