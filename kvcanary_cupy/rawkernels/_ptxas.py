"""ptxas's resource report of every canary kernel, without a GPU.

Compiles a source exactly as the loader does, through NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel,
driven by ``cuda-bindings``), with ``-Xptxas -v`` for a given architecture, and parses what ptxas
says about each kernel instantiation: registers per thread, spill bytes, shared memory. Used by
``tools/kernel_registers.py`` and by the compile tests, which keep the latency-bound verify kernels
inside their register budget.
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


def ptxas_log(spec: _loader.CompileSpec, arch: str, defines: tuple[str, ...] = ()) -> str:
    """NVRTC's log of compiling ``spec`` for ``arch`` (e.g. ``sm_90``) with ptxas verbose."""
    from cuda.bindings import nvrtc

    prog = _ok(nvrtc.nvrtcCreateProgram(spec.code.encode(), spec.filename.encode(), 0, [], []))
    try:
        for expr in spec.name_expressions:
            _ok(nvrtc.nvrtcAddNameExpression(prog, expr.encode()))
        options = [*spec.options, *(f"-D{d}" for d in defines), f"--gpu-architecture={arch}", "-Xptxas=-v"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        size = _ok(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        _ok(nvrtc.nvrtcGetProgramLog(prog, log))
        text = log.rstrip(b"\x00 ").decode("utf-8", "replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{spec.filename} [{arch}]: {err}\n{text}")
        return text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


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
