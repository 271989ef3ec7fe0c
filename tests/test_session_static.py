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
import dataclasses

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import one_forward, replay_by_mistake
from _devices import BACKENDS, to_device, to_numpy
from test_session_poll import _a_bad_slot_read_by_two_chains, _Engine, _events_of_slot, _workload

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
        self.dropped = 0  # rows the rings dropped, over every poll
        self.overflows = 0  # verify launches skipped for capacity, over every poll

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
        self.dropped += report.dropped
        self.overflows += report.capacity_overflows
        return report


def _run(device, seed: int, every: int, workload=_workload, **driven) -> tuple[list, int, _StaticForwards]:
    """The seed's ``workload`` through a :class:`_StaticForwards` (``driven``: its options; ``static``
    False for eager forwards), polled after every ``every``-th forward and at the end: the events
    of every poll, the last report's forward count, and the driver."""
    shape, run = workload(seed)
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
    is not known (the forward's before it: the replay's, if it ran first), so it has none."""

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
    assert [(phase, step) for phase, step, _, _ in static] == [("sweep", None), ("head", 3), ("tail", 3)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_lone_replay_beside_an_eager_forward_past_the_log_has_no_step(device):
    """A poll, one replay, a sweep, an eager forward past ``max_logged_forwards`` (1, which the sweep
    has used up), a poll: the log keeps none of the eager forward's launches, but the replay is not
    the only forward since the previous poll, and where it ran among them is not known. Its rows
    keep their request and position and have no step (they had the step after the eager one's)."""
    eng = _Engine(device, max_logged_forwards=1)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.canary = driven = _StaticForwards(eng.canary, device, replays="first")
    eng.forward({"a": 1})  # the decode forward's eager run
    assert driven.poll().total == 0
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})  # its replay, forward 3
    eng.sweep()
    eng.canary = driven.canary
    eng.forward({"a": 1})  # forward 4, eager and left out of the log: its rows are named by phase alone
    report = driven.canary.poll()
    assert report.forwards == 4
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", None, "a", 2), ("tail", None, "a", 2), ("sweep", None, "a", 2),
        ("head", None, None, None), ("tail", None, None, None)]


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
def test_an_after_without_its_before_is_a_forward_of_its_own(device):
    """A static forward's after() run eagerly whose before() did not run (or ran with the canary
    off) plans its batch itself, a counted forward, as an after_forward with no before_forward:
    its rows take its own step, not the last forward's."""
    eng, driven = _decode_after_a_fault(device, befores=False)
    eng.forward({"a": 1})
    report = driven.poll()
    assert report.forwards == 3
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("tail", 3, "a", 2)]


def test_an_after_without_its_before_writes_its_own_batch_not_the_last_plans():
    """After an eager forward of request 1, a static forward of request 2's decode runs only its
    after(): it fingerprints request 2's token from request 2's own chain, not from the plans the
    eager forward left (which chained it to request 1's last slot), so the forward that reads it
    next finds nothing."""
    canary = _small_canary()
    prompts = _batch([1, 2], [0, 0], [5, 3], [11, 12, 13, 14, 15, 21, 22, 23], [0, 1, 2, 3, 4, 0, 1, 2],
                     [1, 2, 3, 4, 5, 9, 10, 11])
    one_forward(canary, prompts)
    decode_1 = _batch([1], [5], [1], [16], [5], [6])
    one_forward(canary, decode_1)
    canary.static_forward(_batch([2], [3], [1], [24], [3], [12])).after()
    decode_2 = _batch([2], [4], [1], [25], [4], [13])
    one_forward(canary, decode_2)
    report = canary.poll()
    assert report.total == 0 and report.forwards == 4


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("beside", ["replay", "eager"])
def test_a_forward_let_go_and_run_by_mistake_leaves_its_span_without_steps(device, beside, monkeypatch):
    """A static forward closed and let go by a poll, its graph replayed by mistake beside a new
    forward's lone replay (or an eager forward): the mistaken run's rows fit the new forward's
    entries too, so no row of the span has a step; the next forward has its step again."""
    eng, driven = _decode_after_a_fault(device)
    (record,) = driven.canary.groups[0].static_log  # the decode forward, run once and polled
    old = record.forward()
    old.close()
    assert driven.poll().total == 0  # lets it go
    monkeypatch.setattr(kc.session.StaticForward, "_log", _unlogged)  # replays from here on
    replay_by_mistake(old)
    driven.static = beside == "replay"
    if not driven.static:  # another forward held, not run: the count array of the mistaken run's cell is read
        driven.canary.static_forward(old.batch)
    eng.forward({"a": 1})  # a new static forward's replay, or an eager forward
    report = driven.poll()
    assert report.forwards == 3 and len(report) == 4 and {e.step for e in report} == {None}
    eng.forward({"a": 1})
    report = driven.poll()
    assert report.forwards == 4
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 4, "a", 2), ("tail", 4, "a", 2)]


def _small_canary(**kwargs) -> kc.Canary:
    table = np.zeros((3, 8), np.int32)
    table[1], table[2] = np.arange(1, 9), np.arange(9, 17)
    capacities = kc.Capacities.from_args(req_to_token_pool_size=3, max_seq_len_per_req=8, pool_slot_count=32,
                                         max_prefill_tokens=64)
    return kc.Canary(pool_slot_count=32, capacities=capacities, req_to_token=table, **kwargs)


def _batch(rows, prefixes, extends, ids, positions, slots) -> kc.ForwardBatch:
    vector = lambda values: np.array(values, np.int64)  # noqa: E731
    return kc.ForwardBatch(req_pool_indices=vector(rows), prefix_lens=vector(prefixes),
                           extend_seq_lens=vector(extends), input_ids=vector(ids), positions=vector(positions),
                           out_cache_loc=vector(slots))


def test_arrays_retyped_in_place_do_not_reach_a_static_forward():
    """A static forward launches over views of its own (on the CPU, where its runs call the ops):
    the engine's array objects re-typed in place after it was built (int64 read as twice as many
    int32) leave its runs reading what was validated, not past the arrays' ends."""
    guarded = np.full(8, 7777, np.int64)  # positions, then what lies past them
    canary = _small_canary()
    batch = _batch([1], [0], [2], [10, 11], [0, 1], [1, 2])
    positions = guarded[:2]
    positions[:] = [0, 1]
    batch = dataclasses.replace(batch, positions=positions)
    forward = canary.static_forward(batch)
    batch.input_ids.dtype = np.int32  # 4 entries now, over the same bytes
    batch.req_pool_indices[:] = (1 << 32) | 1
    batch.req_pool_indices.dtype = np.int32  # 2 rows now, each pool row 1
    forward.before()
    forward.after()
    assert canary.groups[0].vplan.num_valid[0] == 0 and canary.groups[0].wplan.num_valid_reqs[0] == 1
    assert [canary.context.slot_fields(slot)["position"] for slot in (1, 2, 3)] == [0, 1, 0]
    assert canary.poll().total == 0 and (guarded[2:] == 7777).all()


def test_a_refused_before_changes_nothing():
    """``before(stream=...)`` refused for its stream leaves the forward as it was: its batch, whose
    last ``before`` came while the canary was off, is still planned by its ``after``, not written
    with the plans of the eager forward that ran since."""
    canary = _small_canary()
    for row in (1, 2):
        prefill = _batch([row], [0], [3], [7 * row, 8, 9], [0, 1, 2], canary.req_to_token[row, :3])
        one_forward(canary, prefill)
    forward = canary.static_forward(_batch([1], [3], [1], [10], [3], [canary.req_to_token[1, 3]]))
    canary.mode = "off"
    forward.before()
    canary.mode = "log"
    other = _batch([2], [3], [1], [10], [3], [canary.req_to_token[2, 3]])
    one_forward(canary, other)
    with pytest.raises(TypeError, match="^kv-canary: stream must be"):
        forward.before(stream="not a stream")
    forward.after()
    canary.sweep(kc.LiveRequests(req_pool_indices=np.array([1, 2]), seq_lens=np.array([4, 4])))
    assert canary.poll().total == 0


def test_the_tables_kept_are_views_of_their_own():
    """``req_to_token``, ``expected_tokens`` and the SWA LUT are referenced in place (refilled, the
    canary reads the new values) through views of the canary's own: reshaped in place afterwards,
    the engine's objects leave the canary's shapes as they were."""
    lut = np.arange(32, dtype=np.int64)
    expected = np.zeros((3, 8), np.int32)
    canary = _small_canary(expected_tokens=expected, swa=kc.SwaGroup(window=2, lut=lut, num_slots=32))
    prefill = _batch([1], [0], [3], [5, 6, 7], [0, 1, 2], canary.req_to_token[1, :3])
    expected[1, :3] = [5, 6, 7]  # refilled in place: read
    one_forward(canary, prefill)
    lut.shape, expected.shape = (16, 2), (6, 4)
    decode = _batch([1], [3], [1], [8], [3], canary.req_to_token[1, 3:4])
    one_forward(canary, decode)
    assert canary.poll().total == 0
    assert canary.swa.lut is lut and canary.groups[1].lut.shape == (32,) and canary.expected_tokens.shape == (3, 8)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("static", [True, False])
def test_a_padded_tail_holding_a_bad_slot_leaves_its_rows_their_steps_and_names(device, static):
    """Token arrays bound for more tokens than a step has keep, past ``query_start_loc[bs]``, the
    slots a bigger step wrote there: the write never reads them, so a poll every few forwards
    takes none of them for a slot written again, and names a slot flipped earlier at every step
    that read it, as it does with a tail of -1."""
    block = 4
    rng = np.random.default_rng(5)
    k = to_device(rng.standard_normal((16, block, 2, 8)).astype(np.float16), device)
    v = to_device(rng.standard_normal((16, block, 2, 8)).astype(np.float16), device)
    table = np.array([[3, 4, 5, 6], [7, 8, 9, 10]], np.int32)
    req_to_token = to_device(np.zeros((3, 4 * block), np.int32), device)
    kc.block_tables.mirror(req_to_token, block_table=to_device(table, device), block_size=block)
    canary = kc.Canary(pool_slot_count=16 * block, req_to_token=req_to_token, device=device,
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=3, max_seq_len_per_req=4 * block,
                                                          pool_slot_count=16 * block, max_prefill_tokens=64),
                       real_kv_sources=kc.layouts.paged([k], [v]), hash_mode=kc.HashMode.ALL)
    slot = lambda row, position: int(table[row, position // block]) * block + position % block  # noqa: E731
    put = lambda values, dtype=np.int64: to_device(np.array(values, dtype), device)  # noqa: E731
    lens = [5, 6]
    prefill = kc.ForwardBatch.from_offsets(
        query_start_loc=put([0, 5, 11], np.int32), seq_lens=put(lens, np.int32), input_ids=put(range(100, 111)),
        positions=put(list(range(5)) + list(range(6))),
        out_cache_loc=put([slot(0, p) for p in range(5)] + [slot(1, p) for p in range(6)]), req_ids=["a", "b"])
    one_forward(canary, prefill)
    assert canary.poll().total == 0
    flipped = slot(0, 2)
    given = dict(query_start_loc=put([0, 1, 2], np.int32), seq_lens=put([6, 7], np.int32), input_ids=put([0] * 4),
                 positions=put([0] * 4), out_cache_loc=put([0, 0, flipped, slot(1, 1)]))  # a bigger step's tail
    batch = kc.ForwardBatch(**{name: put([0] * size) for name, size in [
        ("req_pool_indices", 2), ("prefix_lens", 2), ("extend_seq_lens", 2), ("input_ids", 4), ("positions", 4),
        ("out_cache_loc", 4)]}, req_ids=["a", "b"])
    refill = kc.block_tables.Refill(batch, **given)
    forward = canary.static_forward(batch)
    v[flipped // block, flipped % block, 0, 0] += 1
    for _ in range(3):
        given["seq_lens"][...] = put([lens[0] + 1, lens[1] + 1], np.int32)
        given["positions"][:2] = put(lens)
        given["out_cache_loc"][:2] = put([slot(0, lens[0]), slot(1, lens[1])])
        if static:
            refill.launch()
            forward.before()
            forward.after()
        else:  # int64 token arrays, referenced with their tail
            eager = kc.ForwardBatch.from_offsets(**{name: array.copy() for name, array in given.items()},
                                                 req_ids=["a", "b"])
            one_forward(canary, eager)
        lens = [length + 1 for length in lens]
    report = canary.poll()
    assert report.forwards == 4
    assert sorted(((e.step, e.phase, e.request, e.position) for e in report), key=str) == [
        (step, phase, "a", 2) for step in (2, 3, 4) for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_replayed_row_whose_predecessor_its_forward_wrote_is_named_for_its_own_reader(device):
    """A replay's HEAD reads a bad slot for b, its chain broken, and for a, its chain whole (see
    _a_bad_slot_read_by_two_chains). a's row fits a's entry only but for the chain (a's predecessor
    written by the forward since); b's entry, whose predecessor the forward did not write, is judged
    by the chain, so the row is a's alone."""
    eng = _Engine(device)
    bad = _a_bad_slot_read_by_two_chains(eng)
    eng.canary = driven = _StaticForwards(eng.canary, device, replays="all")
    eng.forward({"b": 1, "a": 1})
    report = driven.poll()
    assert report.forwards == 2 and _events_of_slot(report, bad) == [
        ("head", 2, "a", 3, ("REAL_KV_HASH",)), ("head", 2, "b", 3, ("CHAIN_HASH", "REAL_KV_HASH")),
        ("tail", 2, "a", 3, ("CHAIN_HASH", "REAL_KV_HASH")), ("tail", 2, "b", 3, ("CHAIN_HASH", "REAL_KV_HASH"))]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_replay_reading_a_shared_slot_names_each_reader_as_an_eager_forward_does(device):
    """Two requests share a prefix slot whose KV changed, and one replay reads it for both: its two
    alike rows fit both entries, one each, so they are named for a and for b, as the eager forward's
    are (polled after the replay, its step too)."""

    def events(static: bool):
        eng = _Engine(device)
        eng.add("a", 1)
        eng.forward({"a": 6})
        eng.add("b", 2, share="a", shared=4)
        eng.forward({"b": 2})
        assert not eng.canary.poll()
        eng.k[eng.requests["a"]["slots"][3], 0, 0] += 1.0
        eng.canary = driven = _StaticForwards(eng.canary, device, static=static, replays="all")
        eng.forward({"a": 1, "b": 1})
        report = driven.poll()
        return report.forwards, sorted((e.phase, e.step, e.request, e.position) for e in report)

    expected = [(phase, 3, request, 3) for phase in ("head", "tail") for request in ("a", "b")]
    assert events(False) == (3, expected)
    assert events(True) == (3, expected)
