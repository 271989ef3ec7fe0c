"""Decode forwards the way a CUDA-graph engine runs them: padded to a captured batch size, over
input arrays refilled in place, with the canary's part bound once per size (``kc.StaticForward``).

An engine that replays its decode forward as a CUDA graph captures one graph per batch size (here
the powers of two below ``max_running``, and ``max_running`` itself), pads a batch to the next
size with padding rows (pool row 0, the padding slot) and copies the batch into the graph's static
inputs before each replay. The canary's ``before``/``after`` are then kernel launches over those
same arrays: on a GPU each is captured in a CUDA graph of its own the first time its size runs
(after one eager run) and replayed from then on; on the CPU they run the ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from .._dlpack import filled, from_host, require_cupy
from ..session import ForwardBatch, StaticForward
from .engine import Engine, StepBatch

def batch_sizes(max_running: int) -> list[int]:
    """The padded sizes: powers of two below ``max_running``, and ``max_running``."""
    sizes, size = [], 1
    while size < max_running:
        sizes.append(size)
        size *= 2
    return sizes + [max_running]


@dataclasses.dataclass
class _Size:
    """One padded batch size: its static inputs, the canary's forward over them and, on a GPU once
    it has run eagerly, the captured graphs of its ``before`` and ``after``."""

    inputs: dict
    req_ids: list
    forward: StaticForward
    graphs: Optional[tuple[Any, Any]] = None


class StaticDecode:
    """The decode forwards of ``engine`` through one static forward per padded batch size."""

    def __init__(self, engine: Engine, *, graphs: bool = True):
        self.engine = engine
        self.sizes = batch_sizes(engine.config.max_running)
        self.graphs = graphs and engine.device.is_cuda
        self._by_size: dict[int, _Size] = {}
        self._current: Optional[_Size] = None
        self.forwards = 0
        self.replays = 0  # forwards whose canary work ran as CUDA-graph replays

    def _padded(self, step: StepBatch, size: int) -> dict:
        """The batch's inputs as host arrays of ``size`` rows: padding rows name pool row 0 and write
        slot 0, which the plans skip."""
        def pad(values) -> np.ndarray:
            out = np.zeros(size, np.int64)
            out[:len(values)] = values
            return out
        checks = self.engine.config.expected_checks
        return {"req_pool_indices": pad(step.rows), "prefix_lens": pad(step.prefix_lens),
                "extend_seq_lens": np.ones(size, np.int64), "input_ids": pad(step.input_ids),
                "positions": pad(step.positions), "out_cache_loc": pad(step.out_cache_loc),
                "expected_input_tokens": pad(step.expected_ids) if checks else None,
                "expected_input_positions": pad(step.expected_positions) if checks else None}

    def _new_size(self, host: dict, req_ids: list) -> _Size:
        device = self.engine.device
        inputs = {name: None if values is None else filled(values.shape, np.int64, device)
                  for name, values in host.items()}
        _fill(inputs, host, device)
        forward = self.engine.canary.static_forward(ForwardBatch(req_ids=req_ids, **inputs))
        return _Size(inputs, req_ids, forward)

    def prepare(self, step: StepBatch) -> None:
        """Copy a decode batch into the static inputs of its padded size (the engine's own work before
        a replay); ``before`` and ``after`` then run the canary over them."""
        size = next(s for s in self.sizes if s >= len(step.requests))
        host = self._padded(step, size)
        req_ids = [r.rid for r in step.requests]
        entry = self._by_size.get(size)
        if entry is None:
            entry = self._by_size[size] = self._new_size(host, req_ids)
        else:
            _fill(entry.inputs, host, self.engine.device)
            entry.req_ids[:] = req_ids  # poll reads the list as it is then
        self._current = entry
        self.forwards += 1

    def before(self) -> None:
        """The canary's work before the prepared forward's model pass (a graph replay once captured)."""
        entry = self._current
        if entry.graphs is not None:
            _replay(entry.graphs[0], self.engine.device)
            self.replays += 1
        else:
            entry.forward.before()

    def after(self) -> None:
        """The canary's work after the model pass; the first forward of a size is captured here."""
        entry = self._current
        if entry.graphs is not None:
            _replay(entry.graphs[1], self.engine.device)
        else:
            entry.forward.after()
            if self.graphs:  # run once eagerly, every kernel loaded: capture it for the next forwards
                entry.graphs = _capture(entry.forward, self.engine.device)

    @property
    def batch(self) -> ForwardBatch:
        """The prepared forward's batch: the static inputs of its size."""
        return self._current.forward.batch

    def to_json(self) -> dict:
        return {"forwards": self.forwards, "graph_replays": self.replays,
                "batch_sizes_used": sorted(self._by_size)}


def _fill(inputs: dict, host: dict, device) -> None:
    """The static inputs refilled in place, as the engine refills its tables (on CuPy's current
    stream, which the replays follow)."""
    for name, values in host.items():
        if values is not None:
            inputs[name][...] = from_host(values, device)


def _capture(forward: StaticForward, device) -> tuple[Any, Any]:
    """``forward``'s ``before`` and ``after``, each captured in a CuPy CUDA graph. They are captured on
    a stream of their own and replayed on CuPy's current stream (``_replay``), where the engine
    queues its table uploads, input copies and KV writes, so every replay runs in order with them."""
    cupy = require_cupy("device")
    graphs = []
    with cupy.cuda.Device(device.index):
        stream = cupy.cuda.Stream(non_blocking=True)
        for launch in (forward.before, forward.after):
            with stream:
                stream.begin_capture()
                launch(stream=stream)
                graphs.append(stream.end_capture())
    return graphs[0], graphs[1]


def _replay(graph, device) -> None:
    with require_cupy("device").cuda.Device(device.index):
        graph.launch()


__all__ = ["StaticDecode", "batch_sizes"]
