"""The GPU probes in tools/, imported on any machine: they import CuPy at the top, but what the
tests read of them (their kernel patches, their helpers' names) needs none, so a stand-in module is
enough where CuPy is not installed."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))


def import_tools(*names: str) -> list[types.ModuleType]:
    """The tools/ modules ``names``, imported (with benchmarks/ on the path, as they expect)."""
    for path in (ROOT / "tools", ROOT / "benchmarks"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    stand_in = "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None
    if stand_in:
        sys.modules["cupy"] = types.ModuleType("cupy")
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        if stand_in:
            del sys.modules["cupy"]
            from kvcanary_cupy._dlpack import cupy_module

            cupy_module.cache_clear()  # in case anything asked for CuPy while the stand-in was there
