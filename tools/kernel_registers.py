"""Registers, spills and shared memory of every canary kernel, from ptxas (no GPU needed).

    python tools/kernel_registers.py [--arch sm_90] [-D NAME=VALUE ...] [source ...]

Compiles each source exactly as the loader does, with ``-Xptxas -v``, and prints ptxas's report per
kernel instantiation, so a change to a kernel's register budget is visible before it reaches a GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kvcanary_cupy.rawkernels import _loader, _ptxas  # noqa: E402


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
        for k in _ptxas.kernel_usage(spec, args.arch, tuple(args.defines)):
            spill = f"spill {k.spill_stores}/{k.spill_loads} B"
            print(f"  {k.registers:4d} regs  {spill:18s} smem {k.shared_bytes:6d} B  {k.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
