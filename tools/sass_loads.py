"""Each canary kernel's global loads, branches and barriers in SASS order, to find sunk loads.

A load that ptxas sinks past a branch costs a decode-sized launch a round trip more on its chain.

    python tools/sass_loads.py build DIR [--arch sm_90] [source ...]   # here: NVRTC, no GPU needed
    python tools/sass_loads.py show DIR [--until-barrier] [-k SUBSTRING ...]   # needs nvdisasm

``build`` compiles every source as the loader does into DIR/<source>-<arch>.cubin. ``show`` runs
nvdisasm on each cubin in DIR (on the GPU machine it is /usr/local/cuda/bin/nvdisasm; elsewhere the
``nvidia-cuda-nvdisasm`` wheel holds one: ``pip download nvidia-cuda-nvdisasm --no-deps``, unzip it and
put its ``nvidia/cu13/bin`` on PATH, no GPU needed) and prints, per
kernel, the SASS lines that load from global memory (LDG), branch (BRA), wait at a barrier (BAR) or
exit, in program order, with their addresses. A load that a kernel requests early in its source and
that shows up only after a branch was sunk by ptxas: the scatter's offsets were, until its row and
span became one predicate. ``build`` uses this machine's NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel);
the GPU machine's CuPy compiles with its own, whose code may differ in detail, so time a change there
(``tools/ab_probe.py``) before trusting what the SASS suggests.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_MARKS = re.compile(r"\b(LDG|BRA|BAR|EXIT|ATOMG|RED)\b")
_ENTRY = re.compile(r"^\.text\.(\S+):$")


def build(directory: pathlib.Path, arch: str, sources: list[str]) -> None:
    from kvcanary_cupy.rawkernels import _loader, _ptxas

    directory.mkdir(parents=True, exist_ok=True)
    for spec in _loader.compile_specs():
        if sources and spec.name not in sources:
            continue
        compiled = _ptxas.compile_spec(spec, arch)
        if not compiled.ok:
            raise SystemExit(f"{spec.filename} [{arch}]: {compiled.error}\n{compiled.log}")
        path = directory / f"{spec.name}-{arch}.cubin"
        path.write_bytes(compiled.cubin)
        print(f"{path}: {', '.join(compiled.lowered)}")


def marked_lines(sass: str, until_barrier: bool) -> dict[str, list[str]]:
    """kernel -> its LDG/BRA/BAR/EXIT/atomic lines, in program order."""
    kernels: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        entry = _ENTRY.match(line.strip())
        if entry:
            current = entry.group(1)
            kernels[current] = []
            continue
        if current is None or not _MARKS.search(line):
            continue
        lines = kernels[current]
        if until_barrier and lines and "BAR" in lines[-1]:
            continue
        lines.append(" ".join(line.split()))
    return kernels


def show(directory: pathlib.Path, until_barrier: bool, wanted: list[str]) -> None:
    nvdisasm = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    for cubin in sorted(directory.glob("*.cubin")):
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
        for kernel, lines in marked_lines(sass, until_barrier).items():
            if wanted and not any(w in kernel for w in wanted):
                continue
            print(f"== {cubin.name} {kernel}")
            for line in lines:
                print(f"   {line}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the sources into DIR (no GPU needed)")
    b.add_argument("dir", type=pathlib.Path)
    b.add_argument("--arch", default="sm_90")
    b.add_argument("sources", nargs="*", help="source names (default: all)")
    s = sub.add_parser("show", help="the marked SASS lines of each cubin in DIR (needs nvdisasm)")
    s.add_argument("dir", type=pathlib.Path)
    s.add_argument("--until-barrier", action="store_true", help="stop each kernel at its first barrier")
    s.add_argument("-k", dest="kernels", action="append", default=[],
                   help="show only kernels whose mangled name contains this (repeatable)")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.dir, args.arch, args.sources)
    else:
        show(args.dir, args.until_barrier, args.kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
