"""What the GPU probes in tools/ share: graph-timed device time, and kernel variants built from
patched sources that the package's launchers then use."""

from __future__ import annotations

import functools
import pathlib

import cupy
import numpy as np

from kvcanary_cupy.rawkernels import _loader


@functools.lru_cache(maxsize=None)
def _empty_kernel():
    return cupy.RawKernel('extern "C" __global__ void empty_kernel() {}', "empty_kernel")


def launch_empty() -> None:
    """One warp of an empty kernel on the current stream: the floor a probe times beside its variants."""
    _empty_kernel()((1,), (32,), ())


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


def event_timed(fn, reps: int = 10) -> float:
    """Device time of one ``fn()`` in us between two CUDA events on the current stream, median of
    ``reps`` after one untimed call: for launches long enough that the events' own cost is noise."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
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


def interleaved_cold(timer, graphs: dict, rounds: int = 150, seed: int = 0) -> dict:
    """Device time (us) of each graph's replay as the benchmarks take it (host head start, L2
    evicted), the graphs replayed in a shuffled order each round: drift during the run falls on every
    graph alike, and no kernel finds its code in an SM's instruction cache from its own replay
    before. Returns label -> the rounds' times."""
    import random

    for graph in graphs.values():
        graph.launch(timer.stream)
    timer.sync()
    times = {label: [] for label in graphs}
    order = list(graphs)
    shuffle = random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for label in order:
            times[label].append(timer.bracket(lambda: graphs[label].launch(timer.stream), cold=True) * 1e6)
    return times


def warm_and_cold(timer, graphs: dict, *, passes: int = 3, reps: int = 60, rounds: int = 80) -> tuple[dict, dict]:
    """Each graph's replay times (us) taken two ways: code warm, as the benchmarks time it (one graph
    replayed back to back, L2 evicted; ``passes`` passes of ``reps``), and code cold
    (``interleaved_cold`` over ``rounds``). Returns (warm, cold), each label -> samples."""
    warm = {label: [] for label in graphs}
    for _ in range(passes):
        for label, graph in graphs.items():
            warm[label] += [t * 1e6 for t in timer.graph([graph], warmup=5, reps=reps, cold=True).times_s]
    return warm, interleaved_cold(timer, graphs, rounds=rounds)


def print_warm_and_cold(warm: dict, cold: dict, width: int = 16) -> None:
    """A line a label: warm median and mean, cold median, IQR and mean (us)."""
    for label in warm:
        print(f"   {label:{width}s} warm {np.median(warm[label]):7.2f} (mean {np.mean(warm[label]):.3f})   "
              f"cold {median_iqr(cold[label])} (mean {np.mean(cold[label]):.3f})", flush=True)


def left_behind(state) -> bytes:
    """What a benchmark case's ops leave on copy 0 of ``state``, as bytes: the canary, both plans and
    the scatter pool."""
    copy = state.copies[0]
    arrays = (state.ctx.canary_buf, copy.vplan.slot_indices, copy.vplan.expected_tokens,
              copy.vplan.expected_positions, copy.vplan.prev_slot_indices, copy.vplan.num_valid,
              copy.vplan.enable, copy.wplan.offsets, copy.wplan.seed_slot_indices,
              copy.wplan.num_valid_reqs, state.expected_pool)
    return b"".join(a.get().tobytes() for a in arrays if a is not None)


def run_variants(timer, variants: dict, launch_of, left_behind_of) -> tuple[dict, dict]:
    """Runs each variant of a kernel once on one case's state and captures it for timing.
    ``variants`` maps a label to a no-argument setup (install its kernels, force its form); after
    the setup, ``launch_of()`` gives the launch to run and capture, and ``left_behind_of()`` the bytes
    that run leaves, to compare across variants. Returns the graphs, an empty kernel's first as the
    floor, and each variant's bytes."""
    graphs = {"empty kernel": timer.capture(launch_empty)}
    outputs = {}
    for label, setup in variants.items():
        setup()
        launch = launch_of()
        launch()
        cupy.cuda.Device().synchronize()
        outputs[label] = left_behind_of()
        graphs[label] = timer.capture(launch)
    return graphs, outputs


def median_iqr(samples) -> str:
    return f"{np.median(samples):.2f} ({np.percentile(samples, 25):.2f}-{np.percentile(samples, 75):.2f})"


def use_sources(source: str, directory, patch: tuple = ()):
    """Make the launchers of ``source`` ("write", "plan", ...) use its kernels compiled from the .cu
    file and headers in ``directory`` (another commit's: git archive REV kvcanary_cupy/rawkernels |
    tar -x -C DIR --strip-components=2), with ``patch`` applied; returns the module."""
    spec = next(c for c in _loader.compile_specs() if c.name == source)
    options = tuple(f"-I{directory}" if o.startswith("-I") else o for o in spec.options)
    return install_variant(source, (pathlib.Path(directory) / spec.filename).read_text(), options, patch)


def patched(code: str, patch: tuple, where: str = "") -> str:
    """``code`` with each (old, new) replacement of ``patch`` made; each old must match once."""
    for old, new in patch:
        count = code.count(old)
        assert count == 1, f"{old!r} matches {count} times{' in ' + where if where else ''}"
        code = code.replace(old, new)
    return code


def install_variant(source: str, code: str, options: tuple[str, ...], patch: tuple = ()):
    """Compiles ``code`` (with ``patch``, (old, new) replacements each matching once) as the source
    ``source`` ("step", "write", ...) and makes the launchers use its kernels; returns the module."""
    code = patched(code, patch, source)
    spec = _loader.SPECS[source]
    module = cupy.RawModule(code=code, options=options, name_expressions=list(spec.name_expressions))
    for kernel in spec.kernels:
        _loader._functions[(source, kernel, 0)] = module.get_function(kernel)
    _loader._resident.clear()
    return module
