"""NVRTC without a GPU: compiles the canary sources and reports ptxas's resources per kernel.

Compiles a source exactly as the loader does, through NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel,
driven by ``cuda-bindings``), for a given architecture (:func:`compile_spec`: log, mangled names,
cubin). With ``-Xptxas -v`` it parses what ptxas says about each kernel instantiation: registers
per thread, spill bytes, shared memory. Used by ``tools/kernel_registers.py`` and by the compile
tests, which also keep the latency-bound verify kernels inside their register budget.
"""

from __future__ import annotations

import dataclasses
import re

from . import _loader


@dataclasses.dataclass(frozen=True)
class KernelUsage:
    name: str             # mangled entry name
    registers: int
    spill_stores: int     # bytes
    spill_loads: int      # bytes
    shared_bytes: int


def _ok(result):
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(str(err))
    return rest[0] if len(rest) == 1 else rest


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What NVRTC made of one program: its error (empty when it compiled), its log, and on success
    the mangled name of each name expression, the PTX and the cubin (for a real architecture)."""

    error: str
    log: str
    lowered: dict
    ptx: str
    cubin: bytes

    @property
    def ok(self) -> bool:
        return not self.error


def nvrtc_compile(code: str, filename: str, name_expressions: tuple[str, ...], options: list[str]) -> Compiled:
    """Compiles ``code`` with exactly ``options`` (give a real ``--gpu-architecture=sm_XX`` for a cubin)."""
    from cuda.bindings import nvrtc

    prog = _ok(nvrtc.nvrtcCreateProgram(code.encode(), filename.encode(), 0, [], []))
    try:
        for expr in name_expressions:
            _ok(nvrtc.nvrtcAddNameExpression(prog, expr.encode()))
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        size = _ok(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        _ok(nvrtc.nvrtcGetProgramLog(prog, log))
        text = log.rstrip(b"\x00 ").decode("utf-8", "replace").strip()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return Compiled(str(err), text, {}, "", b"")
        lowered = {}
        for expr in name_expressions:
            name = _ok(nvrtc.nvrtcGetLoweredName(prog, expr.encode()))
            lowered[expr] = name.decode() if isinstance(name, bytes) else str(name)
        ptx = b" " * _ok(nvrtc.nvrtcGetPTXSize(prog))
        _ok(nvrtc.nvrtcGetPTX(prog, ptx))
        cubin = b""
        if any(o.startswith("--gpu-architecture=sm_") for o in options):
            cubin = b" " * _ok(nvrtc.nvrtcGetCUBINSize(prog))
            _ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return Compiled("", text, lowered, ptx.rstrip(b"\x00 ").decode(), cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_spec(spec: _loader.CompileSpec, arch: str, defines: tuple[str, ...] = (),
                 extra: tuple[str, ...] = ()) -> Compiled:
    """``spec`` compiled for ``arch`` (e.g. ``sm_90``) as the loader compiles it, plus ``-D`` defines."""
    options = [*spec.options, *(f"-D{d}" for d in defines), *extra, f"--gpu-architecture={arch}"]
    return nvrtc_compile(spec.code, spec.filename, spec.name_expressions, options)


def ptxas_log(spec: _loader.CompileSpec, arch: str, defines: tuple[str, ...] = ()) -> str:
    """NVRTC's log of compiling ``spec`` for ``arch`` with ptxas verbose."""
    compiled = compile_spec(spec, arch, defines, extra=("-Xptxas=-v",))
    if not compiled.ok:
        raise RuntimeError(f"{spec.filename} [{arch}]: {compiled.error}\n{compiled.log}")
    return compiled.log


def kernel_usage(spec: _loader.CompileSpec, arch: str, defines: tuple[str, ...] = ()) -> list[KernelUsage]:
    """One entry per kernel instantiation of ``spec``, in ptxas's order."""
    found, name, spills = [], None, (0, 0)
    for line in ptxas_log(spec, arch, defines).splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name, spills = m.group(1), (0, 0)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers(.*)", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", m.group(2))
            found.append(KernelUsage(name, int(m.group(1)), spills[0], spills[1], int(smem.group(1)) if smem else 0))
            name = None
    return found
