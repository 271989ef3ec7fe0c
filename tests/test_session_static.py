"""kc.Canary.static_forward in a random engine: each batch geometry's forwards go through one
StaticForward over arrays refilled in place.

The oracle: the workloads of test_session_poll (shared prefixes, chunked prefill, partial and
padded batches, sweeps, expected tokens, an SWA group, a lasting fault in KV bytes, a canary record
or a table cell) driven through eager forwards and through static ones, run eagerly (logged, as on
the CPU or before a capture) or as a graph engine runs them (one eager run, then replays that leave
no host trace, emulated on the CPU by an unlogging ``_log``), report the same events and forward
count when polled after each forward. Polled every few forwards, the replays' events differ from
the eager ones only in their step: None where the span between two polls held a replay and
anything else the canary logged.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from _devices import BACKENDS, to_device, to_numpy
from test_session_poll import _Engine, _workload

_FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions", "out_cache_loc")
_PER_ROW = _FIELDS[:3]
SEEDS = range(12)


def _unlogged(*args, **kwargs) -> None:
    """StaticForward._log of a replay: a replayed graph leaves no trace on the host."""


class _StaticForwards:
    """The canary as an engine of static buffers drives it: each ``before_forward``/``after_forward``
    pair of the wrapped canary becomes a run of the StaticForward of its batch's geometry, whose
    arrays (and ``req_ids`` list) are allocated once and refilled in place. ``pad``: batches padded
    with pool row 0 (and entries past the real ones) up to 4 rows and 4 or 16 entries, so that
    prefill chunks and decode steps of every size share two forwards. ``replays``: None, every run
    eager and logged; "first" (a graph engine: one eager run, then a captured graph replayed), or
    "all" (every run a replay). Everything else goes to the canary."""

    def __init__(self, canary: kc.Canary, device, *, pad: bool, replays):
        self.canary, self.device, self.pad, self.replays = canary, device, pad, replays
        self.bound: dict = {}  # geometry -> (StaticForward, its arrays, its req_ids list)
        self.launches: list = []  # ("forward", replayed) or ("sweep", None), in call order
        self.polled: list = [0]  # len(self.launches) at each poll

    def __getattr__(self, name):
        return getattr(self.canary, name)

    def _geometry(self, batch: kc.ForwardBatch) -> tuple:
        bs, n = int(batch.req_pool_indices.shape[0]), int(batch.input_ids.shape[0])
        return (4, 4 if n <= 4 else 16) if self.pad else (bs, n)

    def before_forward(self, batch: kc.ForwardBatch) -> None:
        geometry = self._geometry(batch)
        if geometry not in self.bound:
            bs, n = geometry
            arrays = {name: to_device(np.zeros(bs if name in _PER_ROW else n, np.int64), self.device)
                      for name in _FIELDS}
            ids = [None] * bs
            forward = self.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=ids))
            if self.replays == "all":
                forward._log = _unlogged
            self.bound[geometry] = (forward, arrays, ids)
        forward, arrays, ids = self.bound[geometry]
        for name in _FIELDS:  # the real rows and entries first, then padding (pool row 0, slot 0)
            values = to_numpy(getattr(batch, name))
            padded = np.zeros(arrays[name].shape[0], np.int64)
            padded[: values.shape[0]] = values
            arrays[name][...] = to_device(padded, self.device)
        ids[:] = list(batch.req_ids) + [f"pad{i}" for i in range(len(ids) - len(batch.req_ids))]
        self.launches.append(("forward", forward._log is _unlogged))
        forward.before()

    def after_forward(self, batch: kc.ForwardBatch) -> None:
        forward, _, _ = self.bound[self._geometry(batch)]
        forward.after()
        if self.replays == "first":  # run once eagerly; captured then, and replayed from now on
            forward._log = _unlogged

    def sweep(self, live_requests: kc.LiveRequests) -> None:
        self.launches.append(("sweep", None))
        self.canary.sweep(live_requests)

    def poll(self) -> kc.CanaryReport:
        self.polled.append(len(self.launches))
        return self.canary.poll()


def _run(device, seed: int, every: int, static: bool = False, pad: bool = False, replays=None):
    """The seed's workload on an engine whose forwards are eager (``static`` False) or go through
    StaticForwards, polled after every ``every``-th forward and at the end: its events, the final
    report's forward count, and the engine."""
    shape, run = _workload(seed)
    eng = _Engine(device, **shape)
    if static:
        eng.canary = _StaticForwards(eng.canary, device, pad=pad, replays=replays)
    found, ticks = [], [0]

    def tick():
        ticks[0] += 1
        if ticks[0] % every == 0:
            found.extend(eng.canary.poll())

    run(eng, tick)
    found.extend(report := eng.canary.poll())
    events = sorted(((e.group, e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in found), key=repr)
    return events, report.forwards, eng


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("replays", [None, "first", "all"])
def test_static_forwards_polled_after_each_forward_name_what_eager_forwards_name(device, pad, replays):
    named = 0
    for seed in SEEDS:
        eager, forwards, _ = _run(device, seed, 1)
        named += bool(eager)
        static, static_forwards, eng = _run(device, seed, 1, static=True, pad=pad, replays=replays)
        assert static_forwards == forwards, seed
        assert static == eager, seed
    assert named >= len(SEEDS) - 3
