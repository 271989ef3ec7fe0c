"""What the GPU probes in tools/ share: graph-timed device time, and kernel variants built from
patched sources that the package's launchers then use."""

from __future__ import annotations

import cupy
import numpy as np

from kvcanary_cupy.rawkernels import _loader


def timed(fn, reps: int = 30, per_graph: int = 20) -> float:
    """Device time of one ``fn()`` in us: ``per_graph`` calls captured in one CUDA graph, replayed."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(per_graph):
            fn()
        graph = stream.end_capture()
    graph.launch(stream)
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        graph.launch(stream)
        b.record(stream)
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3 / per_graph)
    return float(np.median(times))


def cold_timer():
    """The benchmarks' timer (benchmarks/_timing.py) on a stream of its own: host head start and L2
    eviction before each bracketed repetition."""
    import _ceilings
    from _timing import GpuTimer

    return GpuTimer(cupy, cupy.cuda.Stream(non_blocking=True), l2_bytes=_ceilings.l2_bytes(cupy))


def timed_cold(fn, reps: int = 60) -> float:
    """Device time of one ``fn()`` in us as the benchmarks take it: a one-call CUDA graph replayed
    after a host head start and an L2 eviction, median of ``reps``."""
    timer = cold_timer()
    graph = timer.capture(fn)
    return timer.graph([graph], warmup=5, reps=reps, cold=True).median_s * 1e6


def install_variant(source: str, code: str, options: tuple[str, ...], patch: tuple = ()):
    """Compiles ``code`` (with ``patch``, (old, new) replacements each matching once) as the source
    ``source`` ("step", "write", ...) and makes the launchers use its kernels; returns the module."""
    for old, new in patch:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    spec = _loader.SPECS[source]
    module = cupy.RawModule(code=code, options=options, name_expressions=list(spec.name_expressions))
    for kernel in spec.kernels:
        _loader._functions[(source, kernel, 0)] = module.get_function(kernel)
    _loader._resident.clear()
    return module
