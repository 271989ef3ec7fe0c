"""Kernels made ready before the first op: a serving engine warms up before it takes traffic."""

from __future__ import annotations

from typing import Any

from ._dlpack import cuda_device_count, parse_device, require_cupy
from .rawkernels import _loader


def compile_kernels(*, device: Any = "cuda") -> None:
    """Compile every CUDA kernel of the package for ``device`` ("cuda", "cuda:N" or N) and load them,
    so that no op pays for it later.

    Kernels are otherwise compiled when an op first needs them. A first compile on a machine
    takes a few seconds (NVRTC), and a forward that triggers it stalls that long. CuPy keeps the
    binaries in its on-disk cache, so later processes on the machine only load them. On ``"cpu"``
    there is nothing to do: numba compiles each op at its first call and caches it on disk too.
    """
    where = parse_device(device)
    if not where.is_cuda:
        return
    require_cupy("device")
    count = cuda_device_count()
    if where.index >= count:
        raise ValueError(f"kv-canary: device must be one of the {count} CUDA device(s) seen, got {where}")
    _loader.load_all(where.index)
