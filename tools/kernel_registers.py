"""Registers, spills and shared memory of every canary kernel, from ptxas (no GPU needed).

    python tools/kernel_registers.py [--arch sm_90] [-D NAME=VALUE ...] [source ...]

Compiles each source exactly as the loader does (NVRTC from the ``nvidia-cuda-nvrtc-cu12`` wheel,
through ``cuda-bindings``) with ``-Xptxas -v`` and prints ptxas's report per kernel instantiation, so a
change to a kernel's register budget is visible before it reaches a GPU.
"""

from __future__ import annotations

import argparse
import re
import sys

from cuda.bindings import nvrtc

from kvcanary_cupy.rawkernels import _loader


def _ok(result):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(str(err))
    return rest[0] if len(rest) == 1 else rest


def ptxas_report(spec, arch: str, defines: list[str]) -> str:
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
            raise RuntimeError(f"{spec.filename}: {err}\n{text}")
        return text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def summarise(text: str) -> list[str]:
    """One line per kernel: its (demangled-ish) name, registers, spill bytes, shared memory."""
    lines, name, spill = [], None, ""
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = f"spill {m.group(1)}/{m.group(2)} B"
        m = re.search(r"Used (\d+) registers(.*)", line)
        if m and name:
            smem = re.search(r"(\d+) bytes smem", m.group(2))
            lines.append(f"{m.group(1):>4} regs  {spill:18s} smem {smem.group(1) if smem else 0:>6} B  {name}")
            name, spill = None, ""
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", help="source names (default: all)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="extra NVRTC define")
    args = parser.parse_args(argv)
    for spec in _loader.compile_specs():
        if args.sources and spec.name not in args.sources:
            continue
        print(f"{spec.filename} [{args.arch}]")
        for line in summarise(ptxas_report(spec, args.arch, args.defines)):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
