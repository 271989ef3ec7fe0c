"""kc.Canary.static_forward in a random engine: each batch geometry's forwards go through one
StaticForward over arrays allocated once and refilled in place.

The oracle: test_session_poll's random workloads (shared prefixes, chunked prefill, partial and
padded batches, sweeps, expected tokens, an SWA group, a lasting fault in KV bytes, a canary record
or a table cell), driven through eager forwards and through static ones, run eagerly (logged, as
on the CPU or before a capture) or as a graph engine runs them (one eager run, then replays that
leave no trace on the host: emulated on the CPU by a StaticForward whose ``_log`` does nothing),
report the same events, steps included, and count the same forwards when polled after each forward.
Polled every few forwards, replays' events lose their step, and may lose their request and
position (their forward's arrays refilled since they ran), exactly in the spans where a replay ran
beside another forward.
"""

from __future__ import annotations

import collections

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

    def __init__(self, canary: kc.Canary, device, *, static: bool = True, pad: bool = False, replays=None,
                 poll_sweeps: bool = False, befores: bool = True):
        self.canary, self.device, self.static, self.pad, self.replays = canary, device, static, pad, replays
        self.poll_sweeps, self.befores = poll_sweeps, befores  # befores False: after() alone
        self.found: list = []  # every poll's events
        self.bound: dict = {}  # geometry -> (StaticForward, its arrays, its req_ids list)
        self.launches: list = []  # ("forward", replayed) or ("sweep", None), in call order
        self.polled: list = [0]  # len(self.launches) at each poll

    def __getattr__(self, name):
        return getattr(self.canary, name)

    def _geometry(self, batch: kc.ForwardBatch) -> tuple:
        bs, n = int(batch.req_pool_indices.shape[0]), int(batch.input_ids.shape[0])
        return (4, 4 if n <= 4 else 16) if self.pad else (bs, n)

    def before_forward(self, batch: kc.ForwardBatch) -> None:
        if not self.static:
            self.launches.append(("forward", False))
            self.canary.before_forward(batch)
            return
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
        if self.befores:
            forward.before()

    def after_forward(self, batch: kc.ForwardBatch) -> None:
        if not self.static:
            self.canary.after_forward(batch)
            return
        forward, _, _ = self.bound[self._geometry(batch)]
        forward.after()
        if self.replays == "first":  # run once eagerly; captured then, and replayed from now on
            forward._log = _unlogged

    def sweep(self, live_requests: kc.LiveRequests) -> None:
        if self.poll_sweeps:  # a sweep alone between two polls
            self.poll()
        self.launches.append(("sweep", None))
        self.canary.sweep(live_requests)
        if self.poll_sweeps:
            self.poll()

    def poll(self) -> kc.CanaryReport:
        self.polled.append(len(self.launches))
        report = self.canary.poll()
        self.found.extend(report)
        return report


def _run(device, seed: int, every: int, **driven) -> tuple[list, int, _StaticForwards]:
    """The seed's workload through a :class:`_StaticForwards` (``driven``: its options; ``static``
    False for eager forwards), polled after every ``every``-th forward and at the end: the events
    of every poll, the last report's forward count, and the driver."""
    shape, run = _workload(seed)
    eng = _Engine(device, **shape)
    eng.canary = driven = _StaticForwards(eng.canary, device, **driven)
    ticks = [0]

    def tick():
        ticks[0] += 1
        if ticks[0] % every == 0:
            driven.poll()

    run(eng, tick)
    forwards = driven.poll().forwards
    return _keys(driven.found), forwards, driven


def _keys(events) -> list:
    return sorted(((e.group, e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in events), key=repr)


def _shared_spans(driven: _StaticForwards) -> tuple[list, list]:
    """For each forward (by number, from 1): whether it was a replay, and whether the span between
    two of ``driven``'s polls that held it held a replay and another forward."""
    replayed, shared = [], []
    for start, end in zip(driven.polled, driven.polled[1:]):
        span = [flag for kind, flag in driven.launches[start:end] if kind == "forward"]
        replayed += span
        shared += [any(span) and len(span) > 1] * len(span)
    return replayed, shared


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("replays", [None, "first", "all"])
def test_static_forwards_polled_after_each_forward_name_what_eager_forwards_name(device, pad, replays):
    """Polled after each forward (and each sweep alone: see
    test_a_sweep_beside_a_lone_replay_leaves_the_replay_its_step), static forwards, run eagerly or
    replayed, report the eager forwards' events, steps included, and count the same forwards."""
    named = 0
    for seed in SEEDS:
        eager, forwards, _ = _run(device, seed, 1, static=False, poll_sweeps=True)
        named += bool(eager)
        static, static_forwards, driven = _run(device, seed, 1, pad=pad, replays=replays, poll_sweeps=True)
        assert static_forwards == forwards, seed
        assert static == eager, seed
        replayed, _ = _shared_spans(driven)
        assert len(driven.bound) <= (2 if pad else 8)  # most forwards refill a forward's arrays
        assert sum(replayed) == {None: 0, "first": forwards - len(driven.bound), "all": forwards}[replays]
    assert named >= len(SEEDS) - 3


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("replays", ["first", "all"])
def test_replays_polled_every_few_forwards_lose_steps_only_where_they_shared_a_span(device, pad, replays):
    """Polled every 3 forwards (and each sweep alone), replays report the eager forwards' events
    but where a replay ran beside another forward between two polls: there every event has no step
    (the replays' order among them is not known on the host), and one whose forward's arrays were
    refilled before the poll names no request or position (poll reads the arrays as they are then);
    never another request or position. A span of one replay keeps its step."""
    lost_steps = replay_steps = unnamed = 0
    for seed in SEEDS:
        eager, forwards, _ = _run(device, seed, 1, static=False, poll_sweeps=True)
        static, static_forwards, driven = _run(device, seed, 3, pad=pad, replays=replays, poll_sweeps=True)
        assert static_forwards == forwards, seed
        replayed, shared = _shared_spans(driven)
        # a sweep's step is the forward's before it; polled alone, it keeps it
        expected = sorted(((group, phase, None if phase != "sweep" and step is not None and shared[step - 1] else step,
                            *rest) for group, phase, step, *rest in eager), key=repr)
        anonymous = lambda events: sorted((event[:3] + event[5:] for event in events), key=repr)  # noqa: E731
        assert anonymous(static) == anonymous(expected), seed
        unnamed_here = collections.Counter(static) - collections.Counter(expected)
        assert all(event[1] != "sweep" and event[2:5] == (None, None, None) for event in unnamed_here), seed
        lost_steps += sum(step is None for _, _, step, *_ in static)
        replay_steps += sum(step is not None and phase != "sweep" and replayed[step - 1]
                            for _, phase, step, *_ in static)
        unnamed += sum(unnamed_here.values())
    assert lost_steps and replay_steps and unnamed


@pytest.mark.parametrize("device", BACKENDS)
def test_a_sweep_beside_a_lone_replay_leaves_the_replay_its_step(device):
    """A poll, a sweep, one replay, a poll: the replay is the only forward since the previous poll,
    so its rows have its step, as CanaryEvent's docstring says (a replay is numbered at poll when
    it ran alone; "polled after each forward every event has its step"). Only the sweep's own step
    is not known (the forward's before it: the replay's, if it ran first), and is not asserted."""

    def last_poll(static: bool):
        eng = _Engine(device)
        eng.canary = driven = _StaticForwards(eng.canary, device, static=static, replays="first")
        eng.add("a", 1)
        eng.forward({"a": 6})
        eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
        eng.forward({"a": 1})  # the decode forward's eager run
        driven.poll()
        eng.sweep()
        eng.forward({"a": 1})  # its replay
        report = driven.poll()
        return report.forwards, [(e.phase, e.step, e.request, e.position) for e in report]

    forwards, eager = last_poll(False)
    assert forwards == 3 and eager == [("sweep", 2, "a", 2), ("head", 3, "a", 2), ("tail", 3, "a", 2)]
    static_forwards, static = last_poll(True)
    assert static_forwards == 3
    assert [(phase, request, position) for phase, _, request, position in static] == [
        ("sweep", "a", 2), ("head", "a", 2), ("tail", "a", 2)]
    assert [(phase, step) for phase, step, _, _ in static if phase != "sweep"] == [("head", 3), ("tail", 3)]


def _decode_after_a_fault(device, **driven) -> tuple[_Engine, _StaticForwards]:
    """a's prompt (forward 1, eager) and a decode forward (2, static, logged), polled clean; then
    a's KV at position 2 goes bad and the canary is driven by a :class:`_StaticForwards`."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 6})
    first = eng.canary = _StaticForwards(eng.canary, device)
    eng.forward({"a": 1})
    assert eng.canary.poll().total == 0
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.canary = _StaticForwards(first.canary, device, **driven)
    eng.canary.first = first  # its static forward still held, as an engine holds one it may replay
    return eng, eng.canary


@pytest.mark.parametrize("device", BACKENDS)
def test_an_after_without_its_before_belongs_to_no_forward(device):
    """A static forward's after() whose before() did not run (or ran with the canary off) is no
    counted forward: its rows have no step, not the last forward's."""
    eng, driven = _decode_after_a_fault(device, befores=False)
    eng.forward({"a": 1})
    report = driven.poll()
    assert report.forwards == 2
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("tail", None, "a", 2)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_forward_let_go_and_run_by_mistake_leaves_its_span_without_steps(device, monkeypatch):
    """A static forward closed and let go by a poll, its graph replayed by mistake beside a new
    forward's lone replay: the mistaken run's rows fit the new forward's entries too, so no row of
    the span has a step; the next lone replay has its step again."""
    eng, driven = _decode_after_a_fault(device)
    (record,) = driven.canary.groups[0].static_log  # the decode forward, run once and polled
    old = record.forward()
    old.close()
    assert driven.poll().total == 0  # lets it go
    monkeypatch.setattr(kc.session.StaticForward, "_log", _unlogged)  # replays from here on
    old.before()  # its graph replayed by mistake
    old.after()
    eng.forward({"a": 1})  # a new static forward's replay
    report = driven.poll()
    assert report.forwards == 3 and len(report) == 4 and {e.step for e in report} == {None}
    eng.forward({"a": 1})
    report = driven.poll()
    assert report.forwards == 4
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 4, "a", 2), ("tail", 4, "a", 2)]
