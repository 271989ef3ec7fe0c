"""kc.Canary.poll: each violation row named by the forward, request and position that recorded it.

A row carries no launch id, so poll infers it. The oracle here: the same workload polled after
every forward (each row then has a single forward it can come from) and every few forwards must
report the same events, for faults that last (KV bytes, a canary record, a table cell pointed at
another request's slot) in engines that share prefixes, prefill in chunks, leave requests out of
a batch, pad batches, sweep, check expected tokens and keep a sliding-window group.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import DLPackOnly, Unprintable, one_forward, session_capacities
from _devices import BACKENDS, int64s_on, requires_gpu, to_device, to_numpy

SLOTS, ROWS, WIDTH = 128, 8, 64


class _Engine:
    """Requests in pool rows over a 128-slot pool with one layer of K, on ``device``; host mirrors
    of the tables, copied to the device after each change."""

    def __init__(self, device, *, swa_window=0, expected=False, ring=1024, verify_capacity=None,
                 chain_position_assert=False, max_logged_forwards=1024):
        self.device = device
        self.rng = np.random.default_rng(0)
        self.table = np.zeros((ROWS, WIDTH), np.int32)
        self.table_dev = to_device(self.table, device)
        self.k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        caps = session_capacities(ROWS, WIDTH, SLOTS, 4096, verify_capacity)
        swa = None
        if swa_window:
            self.lut = np.zeros(SLOTS + 1, np.int64)
            self.lut_dev = to_device(self.lut, device)
            self.swa_k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
            self.swa_free = list(range(1, SLOTS))
            swa = kc.SwaGroup(window=swa_window, lut=self.lut_dev, num_slots=SLOTS,
                              real_kv_sources=kc.layouts.per_layer([self.swa_k]))
        self.expected = np.zeros((ROWS, WIDTH), np.int32) if expected else None
        self.expected_dev = None if self.expected is None else to_device(self.expected, device)
        self.canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=self.table_dev, device=device,
                                real_kv_sources=kc.layouts.per_layer([self.k]), hash_mode=kc.HashMode.ALL,
                                ring_capacity=ring, swa=swa, expected_tokens=self.expected_dev,
                                chain_position_assert=chain_position_assert, max_logged_forwards=max_logged_forwards)
        self.free = list(range(1, SLOTS))
        self.requests: dict = {}

    def sync(self):
        self.table_dev[...] = to_device(self.table, self.device)
        if self.expected is not None:
            self.expected_dev[...] = to_device(self.expected, self.device)
        if hasattr(self, "lut"):
            self.lut_dev[...] = to_device(self.lut, self.device)

    def add(self, rid, row, share=None, shared=0, prompt=None):
        request = dict(row=row, slots=[], tokens=[], len=0)
        if prompt is not None:  # its tokens; two requests of one prompt write alike records
            request["prompt"] = prompt
        if share is not None:  # the first `shared` tokens are another request's slots, as a radix cache shares them
            other = self.requests[share]
            request.update(slots=list(other["slots"][:shared]), tokens=list(other["tokens"][:shared]), len=shared)
            self.table[row, :shared] = request["slots"]
            if self.expected is not None:
                self.expected[row, :shared] = request["tokens"]
        self.requests[rid] = request

    def forward(self, extend: dict, padding_rows=0):
        rows, prefix, lens, ids, positions, slots = [], [], [], [], [], []
        for rid, count in extend.items():
            request = self.requests[rid]
            rows.append(request["row"]), prefix.append(request["len"]), lens.append(count)
            for position in range(request["len"], request["len"] + count):
                slot = self.free.pop(0)
                if hasattr(self, "lut"):
                    self.lut[slot] = self.swa_free.pop(0)
                token = request.get("prompt", 1000 * request["row"]) + position
                request["slots"].append(slot), request["tokens"].append(token)
                self.table[request["row"], position] = slot
                if self.expected is not None:
                    self.expected[request["row"], position] = token
                ids.append(token), positions.append(position), slots.append(slot)
        rows += [0] * padding_rows
        prefix += [0] * padding_rows
        lens += [0] * padding_rows
        self.sync()
        i64 = int64s_on(self.device)
        batch = kc.ForwardBatch(req_pool_indices=i64(rows), prefix_lens=i64(prefix), extend_seq_lens=i64(lens),
                                input_ids=i64(ids), positions=i64(positions), out_cache_loc=i64(slots),
                                req_ids=list(extend) + [f"pad{i}" for i in range(padding_rows)])
        self.canary.before_forward(batch)
        n = len(slots)
        pooled = [slot for slot in slots if slot < SLOTS]  # a slot past the pool has no KV bytes
        self.k[i64(pooled)] = to_device(self.rng.standard_normal((len(pooled), 2, 8)).astype(np.float32),
                                        self.device)
        if hasattr(self, "lut"):
            self.swa_k[i64(self.lut[slots])] = to_device(self.rng.standard_normal((n, 2, 8)).astype(np.float32),
                                                          self.device)
        self.canary.after_forward(batch)
        for rid, count in extend.items():
            self.requests[rid]["len"] += count

    def next_slots(self, rids) -> list:
        """A free slot for each request's next position, set in its table row: for a batch the test
        builds itself (the requests' lengths are its to advance)."""
        slots = [self.free.pop(0) for _ in rids]
        for rid, slot in zip(rids, slots):
            request = self.requests[rid]
            self.table[request["row"], request["len"]] = slot
        self.sync()
        return slots

    def hand_out_first(self, slots) -> None:
        """The next slots handed out are ``slots``, in order, then the other free ones (``slots``
        need not be free: a page freed while in use)."""
        self.free = list(slots) + [slot for slot in self.free if slot not in slots]

    def finish(self, rid):
        """The request ends: its pool row cleared, its slots free again (handed out first, in
        order), their SWA slots too."""
        request = self.requests.pop(rid)
        self.table[request["row"], :] = 0
        for slot in sorted(request["slots"], reverse=True):
            self.free.insert(0, slot)
            if hasattr(self, "lut") and self.lut[slot]:
                self.swa_free.insert(0, int(self.lut[slot]))
                self.lut[slot] = 0
        self.sync()

    def sweep(self):
        rids = list(self.requests)
        i64 = int64s_on(self.device)
        self.canary.sweep(kc.LiveRequests(req_pool_indices=i64([self.requests[r]["row"] for r in rids]),
                                          seq_lens=i64([self.requests[r]["len"] for r in rids]), req_ids=rids))


def _prompts(eng: _Engine, tick, chunked: bool, share: bool) -> None:
    """The random workloads' opening: a's and c's prompts (in two chunks, or one), then b's, which
    shares a's first five tokens where ``share``; ``tick`` after each forward."""
    eng.add("a", 1)
    eng.add("c", 3)
    for extend in ([{"a": 4, "c": 3}] * 2 if chunked else [{"a": 8, "c": 6}]):
        eng.forward(extend)
        tick()
    eng.add("b", 2, share="a" if share else None, shared=5 if share else 0)
    eng.forward({"b": 3})
    tick()


def _workload(seed: int):
    """A random engine shape and one lasting fault, as a function of the engine and a poll tick."""
    rng = np.random.default_rng(seed)
    shape = dict(swa_window=int(rng.integers(2)) * 4, expected=bool(rng.integers(2)))
    share, chunked, sweeps, padding = (bool(rng.integers(2)) for _ in range(4))
    fault_at, kind = int(rng.integers(2, 7)), ("kv", "alias", "canary")[int(rng.integers(3))]
    batches = [[str(rid) for rid in rng.permutation(["a", "b", "c"])[: int(rng.integers(1, 4))]] for _ in range(10)]
    target = str(rng.choice(["a", "b", "c"]))
    other = str(rng.choice([rid for rid in "abc" if rid != target]))
    draws = rng.random(40)

    def run(eng: _Engine, tick) -> None:
        _prompts(eng, tick, chunked, share)
        for number, rids in enumerate(batches):
            if number == fault_at:
                request = eng.requests[target]
                low = max(0, request["len"] - 3)  # inside an SWA window too
                position = low + int(draws[number] * (request["len"] - low))
                slot = request["slots"][position]
                if kind == "kv" and shape["swa_window"] and draws[number + 20] < 0.5:
                    eng.swa_k[int(eng.lut[slot]), 0, 1] += 1.0
                elif kind == "kv":
                    eng.k[slot, 0, 1] += 1.0
                elif kind == "canary":  # the stored token's low byte
                    eng.canary.context.canary_buf[slot, 0] ^= 1
                else:
                    donor = eng.requests[other]
                    eng.table[request["row"], position] = donor["slots"][min(position, donor["len"] - 1)]
            eng.forward({rid: 1 for rid in rids}, padding_rows=int(padding and draws[number] < 0.5))
            tick()
            if sweeps and draws[number + 10] < 0.3:
                eng.sweep()

    return shape, run


def _events(device, seed: int, every: int, poll=lambda canary: canary.poll(), mode: str = "log") -> list:
    shape, run = _workload(seed)
    eng = _Engine(device, **shape)
    eng.canary.mode = mode
    found, ticks = [], [0]

    def polled():
        try:
            return poll(eng.canary)
        except kc.CanaryViolation as violation:
            return violation.report

    def tick():
        ticks[0] += 1
        if ticks[0] % every == 0:
            found.extend(polled())

    run(eng, tick)
    found.extend(polled())
    return sorted(((e.group, e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in found), key=repr)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every", [3, 5])
def test_polling_every_few_forwards_names_what_polling_every_forward_names(device, every):
    found = 0
    for seed in range(30):
        each = _events(device, seed, 1)
        found += bool(each)  # a fault no later forward reads finds nothing
        assert _events(device, seed, every) == each, seed
    assert found >= 25


class _Interruption:
    """``error`` raised once each armed poll, at the point where it is called (the ``skip`` calls
    before let through); how many times it was raised is counted."""

    def __init__(self, error: BaseException, skip: int = 0):
        self.error = error
        self.skip = skip
        self.armed = False
        self.skipping = 0
        self.raised = 0

    def arm(self) -> None:
        self.armed, self.skipping = True, self.skip

    def __call__(self) -> None:
        if self.armed and self.skipping:
            self.skipping -= 1
        elif self.armed:
            self.armed, self.raised = False, self.raised + 1
            raise self.error

    def warning(self, message) -> None:  # a logger, for the canary's logger
        self()

    def poll(self, canary):
        """``canary.poll()``, interrupted once here, then polled again."""
        self.arm()
        try:
            return canary.poll()
        except type(self.error):
            return canary.poll()
        finally:
            self.armed = False


def _interrupt_at(where: str, interruption: _Interruption, monkeypatch) -> None:
    """Make a poll raise ``interruption``'s exception, once armed: while it maps the rows of the last
    group (the SWA group's after the full group's, when there is one), makes its report's message,
    in the canary's logger, or as it empties a ring."""
    if where == "mapping":
        resolve = kc._mapping.RowMapper.resolve

        def interrupted(mapper, group, *args):
            if group is mapper.canary.groups[-1]:
                interruption()
            return resolve(mapper, group, *args)

        monkeypatch.setattr(kc._mapping.RowMapper, "resolve", interrupted)
    elif where == "describe":
        describe = kc.CanaryReport.describe
        monkeypatch.setattr(kc.CanaryReport, "describe", lambda report, *a: interruption() or describe(report, *a))
    elif where == "logger":
        monkeypatch.setattr(kc.session, "_LOG", interruption)  # the logger of every canary built from here on
    else:
        clear = kc.CanaryContext.clear_violations
        monkeypatch.setattr(kc.CanaryContext, "clear_violations", lambda ctx: interruption() or clear(ctx))


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("where, error, mode", [("mapping", KeyboardInterrupt, "log"),
                                                ("describe", MemoryError, "log"),
                                                ("describe", KeyboardInterrupt, "raise"),
                                                ("logger", KeyboardInterrupt, "log")])
def test_a_poll_interrupted_before_its_report_is_made_leaves_its_rows_to_the_next(device, where, error, mode,
                                                                                  monkeypatch):
    """Interrupted before it hands its report over (mapping the SWA group's rows after the full
    group's, making the report's message or the CanaryViolation's, logging it), a poll has
    changed nothing: the poll after it reports every row, named as polling after every forward
    names them."""
    interruption = _Interruption(error())
    expected = {seed: _events(device, seed, 1) for seed in range(8)}
    _interrupt_at(where, interruption, monkeypatch)
    for seed, each in expected.items():
        assert _events(device, seed, 1, interruption.poll, mode) == each, seed
    assert interruption.raised >= 6


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("emptied", [0, 1])
def test_a_poll_interrupted_while_it_empties_the_rings_loses_no_row(device, emptied, monkeypatch):
    """Interrupted once its report is made, as it empties the rings (the first, or the SWA group's
    with the full group's emptied), a poll leaves its report to the next one, which hands it over
    first: no row is lost, and those of a ring it had not emptied are reported again, by the next
    poll, with no step (the log and the rings it left need not agree)."""
    interruption = _Interruption(KeyboardInterrupt(), skip=emptied)
    expected = {seed: _events(device, seed, 1) for seed in range(8)}
    _interrupt_at("clearing", interruption, monkeypatch)
    interrupted = 0
    for seed, each in expected.items():
        raised = interruption.raised
        found = _events(device, seed, 1, interruption.poll)
        assert [event for event in found if event[2] is not None] == each, seed
        again = {(group, phase, slot, reasons) for group, phase, step, _, _, slot, reasons in found if step is None}
        assert again <= {(group, phase, slot, reasons) for group, phase, _, _, _, slot, reasons in each}, seed
        assert bool(again) == (interruption.raised > raised), seed
        interrupted += interruption.raised > raised
    assert interrupted >= (6, 1)[emptied]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_replay_polled_alone_keeps_its_step_after_an_interrupted_poll(device, monkeypatch):
    """A graph's replays are counted on the device; a poll interrupted before its report is made
    leaves the counts to the next one, which numbers the replay as the interrupted one would have."""
    interruption = _Interruption(KeyboardInterrupt())
    _interrupt_at("logger", interruption, monkeypatch)
    each = _static_decode_events(device, 1, replays=True, monkeypatch=monkeypatch, poll=interruption.poll)
    assert each == [(phase, step, "a", 2) for step in (3, 4, 5) for phase in ("head", "tail")]
    assert interruption.raised == 3


def _interrupting(method, interruption: _Interruption):
    """``method``, with ``interruption`` called first."""
    def interrupted(self, *args):
        interruption()
        return method(self, *args)
    return interrupted


def _forget_interrupted_events(device, monkeypatch, mode: str, where: Optional[str]) -> list:
    """Four spans of a decode of request a through a static forward run eagerly (its runs logged),
    a KV fault more read in each, the first span with an eager forward past the verify capacity,
    each span polled. With ``where`` (a method of the canary's), the first poll is interrupted in
    it, once its report is made, as it forgets what it read, and the second poll as it makes its
    report's message: the third hands over the first's report. What each poll that returned (or
    raised CanaryViolation) reported, and a last poll's."""
    interruptions = {name: _Interruption(KeyboardInterrupt() if name != "describe" else MemoryError())
                     for name in ("_zero_run_counts", "_drop_closed_static_forwards", "describe")}
    if where is not None:
        for cls, name in ((kc.Canary, "_zero_run_counts"), (kc.Canary, "_drop_closed_static_forwards"),
                          (kc.CanaryReport, "describe")):
            monkeypatch.setattr(cls, name, _interrupting(getattr(cls, name), interruptions[name]))
    eng = _Engine(device, verify_capacity=12)
    eng.canary.mode = mode
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.add("b", 2)
    eng.forward({"b": 8})
    arrays = {name: to_device(np.zeros(1, np.int64), device) for name in
              ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions", "out_cache_loc")}
    decode = eng.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=["a"]))

    def decode_a():
        request = eng.requests["a"]
        slot, position = eng.next_slots(["a"])[0], request["len"]
        for name, value in (("req_pool_indices", 1), ("prefix_lens", position), ("extend_seq_lens", 1),
                            ("input_ids", 1000 + position), ("positions", position), ("out_cache_loc", slot)):
            arrays[name][...] = to_device(np.array([value], np.int64), device)
        decode.before()
        eng.k[slot] = to_device(eng.rng.standard_normal((2, 8)).astype(np.float32), device)
        decode.after()
        request["slots"].append(slot)
        request["len"] += 1

    def poll():
        try:
            report = eng.canary.poll()
        except kc.CanaryViolation as violation:
            report = violation.report
        return [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in report] + [
            (report.total, report.dropped, report.capacity_overflows, report.forwards)]

    found = []
    assert not eng.canary.poll()
    for span, interrupted in enumerate((where, "describe", None, None)):
        eng.k[eng.requests["a"]["slots"][span], 0, 0] += 1.0
        decode_a()
        if span == 0:
            eng.forward({"a": 1, "b": 1})  # 7 + 8 prefix entries, past the capacity: its verify checks nothing
        if where is not None and interrupted is not None:
            interruptions[interrupted].arm()
            with pytest.raises((KeyboardInterrupt, MemoryError)):
                eng.canary.poll()
            continue
        found.append(poll())
    found.append(poll())
    return found


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", ["log", "raise"])
@pytest.mark.parametrize("where", ["_zero_run_counts", "_drop_closed_static_forwards"])
def test_a_poll_interrupted_as_it_forgets_hands_its_report_over_once(device, monkeypatch, mode, where):
    """Interrupted once it has made its report, as it forgets what it read (the rings emptied), a
    poll leaves its report to the next poll that completes, a poll interrupted before its own
    report in between: that one hands it over, its events first and its counts added, before its
    own events (with no step). Nothing is reported twice: neither the rows nor the verify launches
    skipped for capacity. The forwards are counted as ever, and the poll after names its rows
    with their steps."""
    first, second, third, fourth, last = _forget_interrupted_events(device, monkeypatch, mode, None)
    assert first[-1][2] == 2 and all(event[1] is not None for event in first[:-1] + second[:-1] + third[:-1])
    handed, after, quiet = _forget_interrupted_events(device, monkeypatch, mode, where)
    own = [event[:1] + (None,) + event[2:] for event in second[:-1] + third[:-1]]
    assert handed[:-1] == first[:-1] + own
    assert handed[-1] == tuple(map(sum, zip(first[-1][:3], second[-1][:3], third[-1][:3]))) + third[-1][3:]
    assert after == fourth and quiet == last == [(0, 0, 0, fourth[-1][-1])]


def _position_2_bad_then_decoded(device, *, ring: int, decodes: int) -> "_Engine":
    """An engine of ``ring`` ring rows: a's 6-token prompt, the K bytes of its position 2 changed,
    then ``decodes`` decode forwards, each of which reads the bad slot."""
    eng = _Engine(device, ring=ring)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    for _ in range(decodes):
        eng.forward({"a": 1})
    return eng


@pytest.mark.parametrize("device", BACKENDS)
def test_a_full_ring_a_poll_read_before_it_was_interrupted_is_handed_over_whole(device, monkeypatch):
    """A ring that dropped rows, read by a poll interrupted as it forgets (the rings emptied): the
    next poll hands over the report, the rows the ring dropped counted, and the one after it has
    nothing to report."""
    eng = _position_2_bad_then_decoded(device, ring=2, decodes=3)
    interruption = _Interruption(KeyboardInterrupt())
    monkeypatch.setattr(kc.Canary, "_zero_run_counts", _interrupting(kc.Canary._zero_run_counts, interruption))
    interruption.arm()
    with pytest.raises(KeyboardInterrupt):
        eng.canary.poll()
    report = eng.canary.poll()
    assert (report.total, report.dropped) == (6, 4)
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", None, "a", 2),
                                                                         ("tail", None, "a", 2)]
    assert not eng.canary.poll()


@pytest.mark.parametrize("device", BACKENDS)
def test_a_full_ring_names_its_rows_without_a_step(device):
    """The ring keeps the rows it stored first and drops the rest: the forwards that recorded the
    kept rows cannot be told from those that read the slot before it went bad, so the rows name
    their request and position and no step. The kept ones are counted by launch."""
    eng = _position_2_bad_then_decoded(device, ring=4, decodes=4)
    report = eng.canary.poll()
    assert report.dropped == 4 and [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", None, "a", 2), ("tail", None, "a", 2)] * 2
    assert report.counts_by_tag() == {"HEAD_K_FULL": 2, "TAIL_K_FULL": 2}



@pytest.mark.parametrize("device", BACKENDS)
def test_a_full_ring_polled_after_one_forward_keeps_its_rows_step(device):
    """a and b share a prompt's first four slots; polled clean, then slot 2's K bytes changed and
    one decode of both read it: four rows (HEAD and TAIL, a and b), a ring of 3 keeps both HEAD
    rows and one TAIL row. Only that forward's TAIL launch ran since the previous poll, so it
    recorded the kept TAIL row: the row has its step, and no request (either reader may have
    recorded it)."""
    eng = _Engine(device, ring=3)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.add("b", 2, share="a", shared=4)
    eng.forward({"b": 2})
    assert eng.canary.poll().total == 0
    bad = eng.requests["a"]["slots"][2]
    eng.k[bad, 0, 0] += 1.0
    eng.forward({"a": 1, "b": 1})
    report = eng.canary.poll()
    assert (report.total, report.dropped, report.forwards) == (4, 1, 3)
    assert _events_of_slot(report, bad) == sorted([
        ("head", 3, "a", 2, ("REAL_KV_HASH",)), ("head", 3, "b", 2, ("REAL_KV_HASH",)),
        ("tail", 3, None, None, ("REAL_KV_HASH",))], key=repr)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_forward_whose_verify_overflowed_found_nothing(device):
    """A forward whose prefixes exceed the verify capacity checked nothing: the rows go to the
    forwards that did check."""
    eng = _Engine(device, verify_capacity=12)
    eng.add("a", 1)
    eng.add("b", 2)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})  # 6 entries
    eng.forward({"b": 8})  # no prefix: writes only
    eng.forward({"a": 1, "b": 1})  # 7 + 8 entries: past the capacity
    report = eng.canary.poll()
    assert report.capacity_overflows == 2  # its HEAD and TAIL verify
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 2), ("tail", 2, "a", 2)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_verify_whose_prefixes_add_up_past_int64_found_nothing(device):
    """Prefixes whose sum passes 2^63 overflow the plan (its total saturates): that forward checked
    nothing, and the rows stay with the forward that recorded them."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})
    i64 = int64s_on(device)
    huge = kc.ForwardBatch(req_pool_indices=i64([1, 1]), prefix_lens=i64([2 ** 62, 2 ** 62]),
                           extend_seq_lens=i64([0, 0]), input_ids=i64([]), positions=i64([]), out_cache_loc=i64([]))
    one_forward(eng.canary, huge)
    report = eng.canary.poll()
    assert report.capacity_overflows == 2
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 2), ("tail", 2, "a", 2)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_shared_slot_is_named_for_each_request_that_reads_it(device):
    """Two requests share a prefix slot whose KV changed: each forward names both readers, and a
    request whose alias reads another's slot is named for its own chain, not for the owner's."""
    eng = _Engine(device, expected=True)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.add("b", 2, share="a", shared=4)
    eng.forward({"b": 2})
    eng.k[eng.requests["a"]["slots"][3], 0, 0] += 1.0
    eng.forward({"a": 1, "b": 1})
    report = eng.canary.poll()
    assert sorted((e.phase, e.request, e.position) for e in report) == [
        ("head", "a", 3), ("head", "b", 3), ("tail", "a", 3), ("tail", "b", 3)]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_no_launch_explains_keep_their_phase_and_no_step(device):
    """A request finished and its pool row reused before the poll: rows its old cells recorded are
    reported with their phase, and no request, position or step is guessed for them."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][1], 0, 0] += 1.0
    eng.forward({"a": 1})
    eng.table[1, :] = 0  # a finished; its pool row cleared before the poll
    eng.sync()
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", None, None, None),
                                                                         ("tail", None, None, None)]


def test_a_full_ring_no_launch_explains_is_reported_unnamed():
    """1,024 rows that no launch explains any more (the request's pool row cleared), polled after
    many forwards of another request: every row reported, none named."""
    eng = _Engine("cpu")
    eng.add("a", 1)
    eng.forward({"a": 30})
    for slot in eng.requests["a"]["slots"]:
        eng.k[slot, 0, 0] += 1.0
    for _ in range(20):  # 30 rows a verify: the ring is full after 18 launches
        eng.forward({"a": 1})
    eng.table[1, :] = 0
    eng.sync()
    eng.add("b", 2)
    for _ in range(60):
        eng.forward({"b": 1})
    report = eng.canary.poll()
    # each of a's 20 forwards read its 30 changed slots twice (HEAD and TAIL): 1,200 rows, the ring
    # kept the first 1,024
    assert (report.total, report.dropped, len(report)) == (1200, 176, 1024)
    assert all(e.request is None and e.step is None and e.reasons == ("REAL_KV_HASH",) for e in report)
    assert {e.slot for e in report} == set(int(s) for s in eng.requests["a"]["slots"][:30])


def _static_decode_events(device, every: int, replays: bool = False, monkeypatch=None,
                          poll=lambda canary: canary.poll()) -> list:
    """An eager prefill, then decode steps of one request through a static forward refilled in
    place (run eagerly, as on the CPU or before a capture; with ``replays``, unlogged as a graph's
    replays are), a KV fault after the first."""
    if replays:
        monkeypatch.setattr(kc.session.StaticForward, "_log", lambda *args, **kwargs: None)
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 6})
    arrays = {name: to_device(np.zeros(1, np.int64), device) for name in
              ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions", "out_cache_loc")}
    decode = eng.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=["a"]))
    found = []
    for number in range(4):
        request, slot = eng.requests["a"], eng.free.pop(0)
        position = request["len"]
        eng.table[1, position] = slot
        eng.sync()
        for name, value in (("req_pool_indices", 1), ("prefix_lens", position), ("extend_seq_lens", 1),
                            ("input_ids", 1000 + position), ("positions", position), ("out_cache_loc", slot)):
            arrays[name][...] = to_device(np.array([value], np.int64), device)
        if number == 1:
            eng.k[request["slots"][2], 0, 0] += 1.0
        decode.before()
        eng.k[slot] = to_device(eng.rng.standard_normal((2, 8)).astype(np.float32), device)
        decode.after()
        request["slots"].append(slot)
        request["len"] += 1
        if (number + 1) % every == 0:
            found.extend(poll(eng.canary))
    found.extend(report := poll(eng.canary))
    assert report.forwards == 5
    return [(e.phase, e.step, e.request, e.position) for e in found]


@pytest.mark.parametrize("device", BACKENDS)
def test_static_forward_runs_are_placed_among_the_forwards(device):
    """A static forward run eagerly is logged as a forward is, and numbered among them: polled
    late, its rows are its own, at its steps, and the eager prefill before the fault is given none."""
    each = _static_decode_events(device, 1)
    assert each == [("head", step, "a", 2) if phase == "head" else ("tail", step, "a", 2)
                    for step in (3, 4, 5) for phase in ("head", "tail")]
    assert _static_decode_events(device, 4) == each


@pytest.mark.parametrize("device", BACKENDS)
def test_a_replay_polled_alone_has_its_step(device, monkeypatch):
    """Replays leave no trace on the host: a poll after each forward numbers a replay's rows (the
    forward after the previous poll's); polled after several, their order among the others is
    not known, and no row of that span has a step."""
    each = _static_decode_events(device, 1, replays=True, monkeypatch=monkeypatch)
    assert each == [(phase, step, "a", 2) for step in (3, 4, 5) for phase in ("head", "tail")]
    late = _static_decode_events(device, 4, replays=True, monkeypatch=monkeypatch)
    assert {step for _, step, _, _ in late} == {None} and len(late) == len(each)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("clear_row", [False, True])
def test_rows_of_a_slot_written_again_are_not_given_to_its_clean_reader(device, clear_row):
    """a's KV at position 3 changes, a forward reads it bad, a finishes; c, the same prompt (so the
    same records), takes the freed slots and reads them clean. Polled once at the end, no row goes
    to c: the slot's bytes are clean now, so rows reporting changed bytes came before c wrote it.
    They name a at step 2 while a's pool row still holds its cells; once the engine has cleared it,
    no launch that read the slot bad can be told, and the rows keep their phase alone."""
    eng = _Engine(device)
    eng.add("a", 1, prompt=7000)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][3], 0, 0] += 1.0
    eng.forward({"a": 1})
    row = eng.table[1].copy()
    eng.finish("a")
    if not clear_row:
        eng.table[1] = row
        eng.sync()
    eng.add("c", 3, prompt=7000)
    eng.forward({"c": 7})
    eng.forward({"c": 1})
    named = [("head", None, None, None), ("tail", None, None, None)] if clear_row else [
        ("head", 2, "a", 3), ("tail", 2, "a", 3)]
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == named


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every_forward", [True, False])
def test_a_row_recorded_between_rewrites_of_its_slots_predecessor_and_the_slot_is_not_its_clean_readers(
        device, every_forward):
    """a (prompt 7000) writes seven tokens and reads them clean; d shares them; a finishes, its pool
    row left as it was. c, the same prompt, prefills into a's freed slots in two chunks, the first
    ending at position 2: the predecessor of position 3's slot is written again (the same record),
    then that slot's KV changes, d reads it bad and finishes (its pool row cleared), then c's second
    chunk writes the slot again, clean. Polled after each forward, the rows are d's; polled once at
    the end, no launch whose entries are judged recorded them, and they are not a's: a row that does
    not show its slot's record now came before the slot's last write, which is after the
    predecessor's, so it may have been recorded after the predecessor was written again, and a's
    launch read the predecessor's earlier record (the rows keep their phase alone)."""
    eng = _Engine(device)
    forward, found = _forwards_polled(eng, every_forward)
    eng.add("a", 1, prompt=7000)
    forward({"a": 6})
    forward({"a": 1})
    slots = list(eng.requests["a"]["slots"])
    eng.add("d", 4, share="a", shared=7)
    row = eng.table[1].copy()
    eng.finish("a")
    eng.table[1] = row
    eng.hand_out_first(slots[:3])
    eng.add("c", 3, prompt=7000)
    forward({"c": 3})
    eng.k[slots[3], 0, 0] += 1.0
    eng.hand_out_first([s for s in eng.free if s not in slots][:1])  # d's next token not in a's slots
    forward({"d": 1})
    eng.finish("d")
    eng.free = [slot for slot in eng.free if slot not in slots[:3]]  # c holds them
    eng.hand_out_first(slots[3:])
    forward({"c": 4})
    forward({"c": 1})
    found.extend(eng.canary.poll())
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in found] == [
        (phase, 4, "d", 3, slots[3]) if every_forward else (phase, None, None, None, slots[3])
        for phase in ("head", "tail")]


def _forwards_polled(eng: _Engine, every_forward: bool):
    """``(forward, found)``: ``eng.forward``, followed by a poll whose events go to ``found`` when
    ``every_forward``."""
    found: list = []

    def forward(extend):
        eng.forward(extend)
        if every_forward:
            found.extend(eng.canary.poll())
    return forward, found


def _a_read_by_x_then_y(device, every_forward: bool, *, between, before_x=None):
    """a writes four tokens and z four of its own; x and y share a's; ``before_x(eng, a's slots)``
    where given, x reads them, ``between(eng, a's slots)``, y reads them. ``(engine, forward,
    found, a's slots)``, with :func:`_forwards_polled`'s ``forward`` and ``found``."""
    eng = _Engine(device)
    forward, found = _forwards_polled(eng, every_forward)
    eng.add("a", 1)
    forward({"a": 4})
    eng.add("z", 4)
    forward({"z": 4})
    eng.add("x", 2, share="a", shared=4)
    eng.add("y", 3, share="a", shared=4)
    shared = eng.requests["a"]["slots"]
    if before_x is not None:
        before_x(eng, shared)
    forward({"x": 1})
    between(eng, shared)
    forward({"y": 1})
    return eng, forward, found, shared


def _x_and_y_sharing_a(device, **engine) -> _Engine:
    """a writes four tokens in pool row 1; x (row 2) and y (row 3) share them."""
    eng = _Engine(device, **engine)
    eng.add("a", 1)
    eng.forward({"a": 4})
    eng.add("x", 2, share="a", shared=4)
    eng.add("y", 3, share="a", shared=4)
    return eng


def _change_kv_at_2(eng: _Engine, shared: list) -> None:
    eng.k[shared[2], 0, 0] += 1.0


def _row_of_y_to_w(eng: _Engine, forward) -> None:
    """y finishes (a and x hold its shared slots still), and its pool row goes to w, whose first
    forward shows it there."""
    held = set(eng.requests["y"]["slots"])
    eng.finish("y")
    eng.free = [slot for slot in eng.free if slot not in held]
    eng.add("w", 3)
    forward({"w": 1})


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every_forward", [True, False])
def test_rows_recorded_after_a_write_are_not_given_to_a_reader_before_it(device, every_forward):
    """x and y share a's four tokens; x reads them clean, then y's next token is written over the
    shared slot at position 2 (a page freed while in use), and y's TAIL records that slot and the
    next, whose chain link reads it. y finishes and its pool row goes to w, which a logged forward
    shows. Polled after each forward, the rows are y's; polled once at the end, y's entries are
    not judged (its row holds w's cells now), and x's forward, before the write, read neither
    record the rows show: no row names x (the rows keep their phase alone)."""
    eng, forward, found, shared = _a_read_by_x_then_y(device, every_forward,
                                                      between=lambda eng, shared: eng.free.insert(0, shared[2]))
    _row_of_y_to_w(eng, forward)
    found.extend(eng.canary.poll())
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in found] == [
        ("tail", 4, "y", position, shared[position]) if every_forward else ("tail", None, None, None, shared[position])
        for position in (2, 3)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every_forward", [True, False])
@pytest.mark.parametrize("position", [0, 2])
def test_rows_a_reader_handed_on_may_have_recorded_are_given_to_no_reader_before_it(device, every_forward, position):
    """x and y share a's four tokens; x reads them clean, then a's KV at ``position`` changes (the
    first of the positions y checks, or one inside them), and y reads it. y finishes and its pool
    row goes to w, which a logged forward shows. Polled after each forward, the rows are y's;
    polled once at the end, y's entries are not judged (its row holds w's cells now), and the rows
    are not x's, which read the slot before it changed: a bad slot's rows go to its last readers,
    and y's forward, the last, may have read it through the row it handed on (the rows keep their
    phase alone)."""

    def change_kv(eng, shared):
        eng.k[shared[position], 0, 0] += 1.0

    eng, forward, found, shared = _a_read_by_x_then_y(device, every_forward, between=change_kv)
    _row_of_y_to_w(eng, forward)
    found.extend(eng.canary.poll())
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in found] == [
        (phase, 4, "y", position, shared[position], ("REAL_KV_HASH",)) if every_forward
        else (phase, None, None, None, shared[position], ("REAL_KV_HASH",)) for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_the_rows_a_full_ring_keeps_are_given_to_no_reader_after_a_hidden_one(device):
    """a's KV at position 2 changes; y reads it, then x, and the ring, of two rows, keeps y's HEAD
    and TAIL rows and drops x's. y finishes and its pool row goes to w before the one poll: a full
    ring keeps the first rows, which y may have recorded through the row it handed on, so they
    name no one, not x, the one reader whose entries are judged."""
    eng = _x_and_y_sharing_a(device, ring=2)
    _change_kv_at_2(eng, eng.requests["a"]["slots"])
    eng.forward({"y": 1})
    eng.forward({"x": 1})
    _row_of_y_to_w(eng, eng.forward)
    report = eng.canary.poll()
    assert report.dropped == 2
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", None, None, None), ("tail", None, None, None)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("hidden_reader", [False, True])
def test_rows_a_full_ring_keeps_named_without_a_step_are_given_to_no_reader_after_a_hidden_one(device, hidden_reader):
    """a's KV at position 2 changes; x reads it in two forwards, and the ring, of two rows, keeps
    the first HEAD and TAIL rows: x's, from one of its forwards, which the ring does not tell, so
    they go to no one launch and name x without a step. Where y then reads the slot and its pool
    row goes to w before the one poll, a row that went to no one launch is not known to come
    before y's hidden read, and names no one."""
    eng = _x_and_y_sharing_a(device, ring=2)
    _change_kv_at_2(eng, eng.requests["a"]["slots"])
    eng.forward({"x": 1})
    eng.forward({"x": 1})
    if hidden_reader:
        eng.forward({"y": 1})
        _row_of_y_to_w(eng, eng.forward)
    report = eng.canary.poll()
    named = None if hidden_reader else "x"
    assert [(e.phase, e.step, e.request) for e in report] == [("head", None, named), ("tail", None, named)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("hidden_reader", [False, True])
def test_a_row_a_full_ring_keeps_with_a_step_and_no_request_keeps_no_step_after_a_hidden_reader(device, hidden_reader):
    """a's KV at position 2 changes; x and z read it in one forward, and the ring, of one row,
    keeps the first HEAD row, which either may have recorded: it tells the step and no request.
    Where y then reads the slot and its pool row goes to w before the one poll, a full ring's
    kept row may be y's, and tells its phase alone."""
    eng = _x_and_y_sharing_a(device, ring=1)
    eng.add("z", 4, share="a", shared=4)
    _change_kv_at_2(eng, eng.requests["a"]["slots"])
    eng.forward({"x": 1, "z": 1})
    if hidden_reader:
        eng.forward({"y": 1})
        _row_of_y_to_w(eng, eng.forward)
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request) for e in report] == [("head", None if hidden_reader else 2, None)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_reader_handed_on_whose_launch_overflowed_takes_no_name_from_the_rows(device):
    """x and y share a's four tokens, y has four of its own; a's KV at position 2 changes, x reads
    it, then y's forward, eight entries past a verify capacity of six, checks nothing. y finishes
    and its pool row goes to w before the one poll: y's launch could have recorded no row, so the
    rows are x's still."""
    eng = _x_and_y_sharing_a(device, verify_capacity=6)
    eng.forward({"y": 4})
    _change_kv_at_2(eng, eng.requests["a"]["slots"])
    eng.forward({"x": 1})
    eng.forward({"y": 1})
    _row_of_y_to_w(eng, eng.forward)
    report = eng.canary.poll()
    assert report.capacity_overflows == 2  # y's HEAD and TAIL
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        (phase, 3, "x", 2) for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_reader_handed_on_with_nothing_cached_takes_no_name_from_the_rows(device):
    """z's next token is written over a's slot at position 2, which x shares; x reads it (a
    position and chain mismatch there, whose row reports the position stored, not the one x
    checked, and a chain mismatch at position 3). Then y prefills with nothing cached, finishes,
    and its pool row goes to w before the one poll: y's forward checked no position through the
    row it handed on, so it cannot have recorded a row, and the rows are x's."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 4})
    eng.add("z", 4)
    eng.forward({"z": 4})
    eng.add("x", 2, share="a", shared=4)
    shared = eng.requests["a"]["slots"]
    eng.free.insert(0, shared[2])
    eng.forward({"z": 1})
    eng.forward({"x": 1})
    eng.add("y", 3)
    eng.forward({"y": 2})
    _row_of_y_to_w(eng, eng.forward)
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in eng.canary.poll()] == [
        (phase, 4, "x", position, shared[position], reasons) for phase in ("head", "tail")
        for position, reasons in ((2, ("CHAIN_HASH", "POSITION")), (3, ("CHAIN_HASH",)))]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_reader_handed_on_takes_no_name_from_rows_at_positions_it_did_not_check(device):
    """x has three tokens of its own after a's four, which y shares alone; the KV of x's own token
    at position 4 changes, x reads it, then y reads a's, finishes, and its pool row goes to w
    before the one poll. y checked positions 0-3 through the row it handed on, so x's rows at
    position 4 are x's still."""
    eng = _x_and_y_sharing_a(device)
    eng.forward({"x": 3})
    own = eng.requests["x"]["slots"][4]
    eng.k[own, 0, 0] += 1.0
    eng.forward({"x": 1})
    eng.forward({"y": 1})
    _row_of_y_to_w(eng, eng.forward)
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()] == [
        (phase, 3, "x", 4, own) for phase in ("head", "tail")]


def _copied_over_a_shared_slot(device, *, told: bool, every_forward: bool, corrupt_first: bool = False):
    """z's record at position 2 and its KV copied over a's slot at position 2 between x's and y's
    reads (a compaction the engine got wrong), through ``Canary.copy_records`` when ``told`` (else
    ``kc.copy_records``). With ``corrupt_first``, a's KV there was already changed when x read it.
    The engine, the events and a's slots."""

    def copy_z_over_2(eng, shared):
        moved = eng.requests["z"]["slots"][2]
        i64 = int64s_on(device)
        copy = eng.canary.copy_records if told else kc.copy_records
        copy(src=eng.canary.context, dst=eng.canary.context, src_slots=i64([moved]), dst_slots=i64([shared[2]]))
        eng.k[shared[2]] = eng.k[moved]

    eng, _, found, shared = _a_read_by_x_then_y(device, every_forward, between=copy_z_over_2,
                                                before_x=_change_kv_at_2 if corrupt_first else None)
    return eng, found, shared


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every_forward", [True, False])
@pytest.mark.parametrize("told", [True, False])
def test_rows_of_a_record_copied_in_are_not_given_to_a_reader_before_the_copy(device, every_forward, told):
    """y's HEAD and TAIL record the slot and the next (whose chain link reads it). y finishes and
    its pool row goes to w, which a logged forward shows. Polled after each forward, the rows are
    y's; polled once at the end, y's entries are not judged, and x, which read the slots before
    the copy, is not named (the rows keep their phase alone): y's forward, after x's, may have
    read the slots through its handed-on row, whether or not the canary was told of the copy."""
    eng, found, shared = _copied_over_a_shared_slot(device, told=told, every_forward=every_forward)
    _row_of_y_to_w(eng, eng.forward)
    found.extend(eng.canary.poll())
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in found] == [
        (phase, 4, "y", position, shared[position]) if every_forward else (phase, None, None, None, shared[position])
        for phase in ("head", "tail") for position in (2, 3)]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_of_a_record_a_copy_replaced_are_named_for_the_readers_before_it(device):
    """a's KV at position 2 changed before x read it, then the copy (told to the canary) replaced
    the slot's record and KV: x's rows, showing the record the slot held before, are x's; y's,
    showing the copied record, y's. Through ``kc.copy_records`` the poll cannot tell when the
    record changed, and x's rows keep their phase alone."""
    for told in (True, False):
        eng, _, shared = _copied_over_a_shared_slot(device, told=told, every_forward=False, corrupt_first=True)
        x_rows = [(phase, 3, "x", 2, shared[2]) if told else (phase, None, None, None, shared[2])
                  for phase in ("head", "tail")]
        y_rows = [(phase, 4, "y", position, shared[position]) for phase in ("head", "tail") for position in (2, 3)]
        assert [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()] == x_rows + y_rows, told


@requires_gpu
def test_a_copy_told_to_the_canary_can_be_captured_in_a_cuda_graph():
    """From another canary's buffer the copy is one launch, which a CUDA graph may capture; the
    capture tells the canary nothing (it copies no slots while the stream captures), and the
    graph's replay moves the records: the forward after it reads them clean."""
    import cupy

    eng, tier = _Engine("cuda"), _Engine("cuda")
    eng.add("a", 1)
    eng.forward({"a": 4})
    tier.add("a", 2)
    tier.forward({"a": 4})  # another row's tokens: other records, each chained to the one before
    slots = eng.requests["a"]["slots"]
    tier_slots = tier.requests["a"]["slots"]
    eng.k[int64s_on("cuda")(slots)] = tier.k[int64s_on("cuda")(tier_slots)]
    before = to_numpy(eng.canary.context.canary_buf).copy()
    logged = [len(group.log) for group in eng.canary.groups]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        src_slots, dst_slots = cupy.asarray(tier_slots, dtype=cupy.int64), cupy.asarray(slots, dtype=cupy.int64)
        stream.begin_capture()
        try:
            eng.canary.copy_records(src=tier.canary.context, dst=eng.canary.context, src_slots=src_slots,
                                    dst_slots=dst_slots, stream=stream)
        finally:
            graph = stream.end_capture()
    assert np.array_equal(to_numpy(eng.canary.context.canary_buf), before)  # captured, not yet run
    assert [len(group.log) for group in eng.canary.groups] == logged
    assert not np.array_equal(before[slots], to_numpy(tier.canary.context.canary_buf)[tier_slots])
    graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(to_numpy(eng.canary.context.canary_buf)[slots],
                          to_numpy(tier.canary.context.canary_buf)[tier_slots])
    eng.forward({"a": 1})
    assert len(eng.canary.poll()) == 0


@pytest.mark.parametrize("device", BACKENDS)
def test_a_copy_told_to_a_canary_that_is_off_copies_and_logs_nothing(device):
    """While the canary is off its polls return at once, so none would empty its log: a copy told
    to it moves the records and leaves the log as it was."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 4})
    eng.add("z", 4)
    eng.forward({"z": 4})
    assert len(eng.canary.poll()) == 0
    eng.canary.mode = "off"
    context, i64 = eng.canary.context, int64s_on(device)
    a, z = eng.requests["a"]["slots"], eng.requests["z"]["slots"]
    eng.canary.copy_records(src=context, dst=context, src_slots=i64(z), dst_slots=i64(a))
    records = to_numpy(context.canary_buf)
    assert np.array_equal(records[a], records[z])
    assert all(not group.log for group in eng.canary.groups)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_refused_copy_told_to_the_canary_copies_nothing(device):
    """``Canary.copy_records`` checks its arguments as ``kc.copy_records`` does, before anything."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 4})
    slots = eng.requests["a"]["slots"]
    before = to_numpy(eng.canary.context.canary_buf).copy()
    with pytest.raises(ValueError, match=r"^kv-canary: dst_slots .*one per pair"):
        eng.canary.copy_records(src=eng.canary.context, dst=eng.canary.context,
                                src_slots=int64s_on(device)(slots[:3]), dst_slots=int64s_on(device)(slots[3:]))
    assert np.array_equal(to_numpy(eng.canary.context.canary_buf), before)
    eng.forward({"a": 1})
    assert len(eng.canary.poll()) == 0


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("source", ["pool", "host tier"])
def test_pairs_of_a_told_copy_that_store_nothing_leave_every_reader_its_rows(device, source):
    """a's KV at position 2 changed before x read it. Between x's read and y's, a copy told to the
    canary (from the pool itself, or from a canary in host memory) has a's slots at positions 2
    and 3 as the destinations of pairs whose source slots are out of range (past the source's
    slots, negative): they store nothing, and x's rows of the slot are x's, y's y's (where the
    poll took every destination for a slot given a record, x's went unnamed)."""

    def copy_from_no_slot(eng, shared):
        src = eng.canary.context if source == "pool" else kc.CanaryContext.allocate(
            16, device="cpu", ring_capacity=0, hash_mode=kc.HashMode.ALL,
            real_kv_sources=kc.layouts.per_layer([eng.rng.standard_normal((16, 2, 8)).astype(np.float32)]))
        before = to_numpy(eng.canary.context.canary_buf).copy()
        out_of_range = int64s_on("cpu" if source == "host tier" else device)([src.num_slots, -1])
        eng.canary.copy_records(src=src, dst=eng.canary.context, src_slots=out_of_range,
                                dst_slots=int64s_on(device)(shared[2:4]))
        assert np.array_equal(to_numpy(eng.canary.context.canary_buf), before)

    eng, _, _, shared = _a_read_by_x_then_y(device, False, between=copy_from_no_slot, before_x=_change_kv_at_2)
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()] == [
        (phase, step, request, 2, shared[2]) for step, request in ((3, "x"), (4, "y")) for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_write_rows_are_named_by_their_token_and_position(device):
    """Two entries of one forward write slot 10 (a at position 0, b at position 0) and b's token is
    not the one expected: the row names b, whose token it holds."""
    eng = _Engine(device)
    i64 = int64s_on(device)
    eng.table[1, 0], eng.table[2, :2] = 10, [10, 11]
    eng.sync()
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]), extend_seq_lens=i64([1, 2]),
                            input_ids=i64([100, 999, 201]), positions=i64([0, 0, 1]), out_cache_loc=i64([10, 10, 11]),
                            req_ids=["a", "b"], expected_input_tokens=i64([100, 200, 201]),
                            expected_input_positions=i64([0, 0, 1]))
    one_forward(eng.canary, batch)
    events = eng.canary.poll()
    assert [(e.phase, e.request, e.position, e.reasons) for e in events] == [("write", "b", 0, ("WRITE_TOKEN",))]
    assert events[0].describe().endswith("WRITE_TOKEN (stored token 999 position 0, expected token 200)")


@pytest.mark.parametrize("device", BACKENDS)
def test_a_token_the_engine_did_not_expect_is_described_with_the_one_it_did(device):
    """A wrong token in the expected-tokens pool (or, as the canary sees it, in the slot): the
    event says which token the slot holds and which one the engine expects there."""
    eng = _Engine(device, expected=True)
    eng.add("a", 1)
    eng.forward({"a": 4})
    eng.expected[1, 2] = 777
    eng.sync()
    eng.forward({"a": 1})
    events = [e for e in eng.canary.poll() if e.phase == "head"]
    assert [(e.request, e.position, e.reasons) for e in events] == [("a", 2, ("VERIFY_TOKEN",))]
    assert events[0].describe() == ("[HEAD_K_FULL step 2] request 'a' position 2 slot 3: VERIFY_TOKEN "
                                    "(stored token 1002 position 2, expected token 777)")


@pytest.mark.parametrize("device", BACKENDS)
def test_describe_shows_at_most_limit_events_and_counts_the_rest(device):
    """``describe(limit)`` lists the first ``limit`` events and counts those left out; a limit that
    is not a non-negative int is refused by name."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 4})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})
    report = eng.canary.poll()
    assert len(report) == 2
    for limit, shown, more in ((0, 0, "  ... 2 more"), (1, 1, "  ... 1 more"), (2, 2, None), (5, 2, None)):
        lines = report.describe(limit).splitlines()
        assert lines[1:1 + shown] == ["  " + e.describe() for e in report.events[:shown]]
        assert lines[1 + shown:] == ([more] if more else [])
    for limit, error in ((-1, ValueError), (None, TypeError), (1.5, TypeError), ("3", TypeError)):
        with pytest.raises(error, match=r"^kv-canary: CanaryReport.describe limit must be"):
            report.describe(limit)


def _decode_over_a_changed_slot(eng, device, req_ids) -> int:
    """Request "a" prefilled 4 tokens, then one decode forward (named by ``req_ids``) after the KV
    of its position 2 changed: both its checks find that slot, which is returned."""
    eng.add("a", 1)
    eng.forward({"a": 4})
    slot = eng.requests["a"]["slots"][2]
    eng.k[slot, 0, 0] += 1.0
    i64 = int64s_on(device)
    eng.table[1, 4] = 40
    eng.sync()
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([1]),
                            input_ids=i64([1004]), positions=i64([4]), out_cache_loc=i64([40]), req_ids=req_ids)
    one_forward(eng.canary, batch)
    return slot


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("ids, shown", [(np.array(["a"]), "request 'a'"), (np.array([17]), "request 17")])
def test_ids_from_a_numpy_array_are_described_by_their_value(device, ids, shown):
    """``req_ids`` may be a 1-D NumPy array: each event's request is its element, and describe()
    shows the value it holds (not ``np.str_('a')`` or ``np.int64(17)``)."""
    eng = _Engine(device)
    slot = _decode_over_a_changed_slot(eng, device, ids)
    report = eng.canary.poll()
    assert [(e.phase, e.request, e.position) for e in report] == [("head", ids[0], 2), ("tail", ids[0], 2)]
    assert report.requests == {ids[0]}
    assert report[0].describe().startswith(f"[HEAD_K_FULL step 2] {shown} position 2 slot {slot}: REAL_KV_HASH")


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", ["log", "raise"])
@pytest.mark.parametrize("returns", [None, 17])
def test_a_request_id_that_cannot_be_shown_costs_no_report(device, mode, returns, caplog):
    """An engine's request object whose ``__repr__`` raises (or returns no str) is the events'
    request all the same; described, it is a placeholder naming its type, so that the logged
    message and the CanaryViolation's are made and the report reaches the caller."""
    eng = _Engine(device)
    eng.canary.mode = mode
    request = Unprintable("a", returns)
    slot = _decode_over_a_changed_slot(eng, device, [request])
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        if mode == "raise":
            with pytest.raises(kc.CanaryViolation) as info:
                eng.canary.poll()
            report, message = info.value.report, str(info.value)
        else:
            report = eng.canary.poll()
            message = caplog.text
    assert [(e.phase, e.request, e.position) for e in report] == [("head", request, 2), ("tail", request, 2)]
    assert report.requests == {request}
    shown = f"[HEAD_K_FULL step 2] request <unprintable request id of type Unprintable> position 2 slot {slot}"
    assert report[0].describe().startswith(shown)
    assert shown in message and report.describe() in message
    assert "request=<unprintable request id of type Unprintable>, position=2" in repr(report)
    assert not eng.canary.poll()  # the rows were reported once


class _Unformattable(str):
    """A str whose own ``__str__`` and ``__format__`` raise: what an engine's ``__repr__`` may return."""

    def __str__(self):
        raise RuntimeError("not formatted")

    def __format__(self, spec):
        raise RuntimeError("not formatted")


@pytest.mark.parametrize("device", BACKENDS)
def test_a_request_id_shown_as_a_str_subclass_is_described_by_its_text(device):
    """A request id whose ``__repr__`` gives a str subclass that cannot be formatted is shown by the
    text it holds: the report is described and returned."""
    eng = _Engine(device)
    request = Unprintable("a", _Unformattable("<request a>"))
    slot = _decode_over_a_changed_slot(eng, device, [request])
    report = eng.canary.poll()
    assert [(e.phase, e.request) for e in report] == [("head", request), ("tail", request)]
    assert report[0].describe().startswith(f"[HEAD_K_FULL step 2] request <request a> position 2 slot {slot}")
    assert "request=<request a>, position=2" in repr(report)


@pytest.mark.parametrize("device", BACKENDS)
def test_request_ids_need_not_be_hashable(device):
    """An engine's own request objects as ids (a dataclass with ``eq``, hence unhashable) name the
    events, write rows included; only ``CanaryReport.requests``, a set, needs hashable ids."""

    @dataclasses.dataclass
    class Req:
        rid: str

    eng = _Engine(device)
    i64 = int64s_on(device)
    eng.table[1, :2] = [10, 11]
    eng.sync()
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([0]), extend_seq_lens=i64([2]),
                            input_ids=i64([100, 999]), positions=i64([0, 1]), out_cache_loc=i64([10, 11]),
                            req_ids=[Req("a")], expected_input_tokens=i64([100, 101]),
                            expected_input_positions=i64([0, 1]))
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    assert [(e.phase, e.request, e.position, e.reasons) for e in report] == [("write", Req("a"), 1, ("WRITE_TOKEN",))]
    with pytest.raises(TypeError, match=r"^kv-canary: CanaryReport.requests needs hashable req_ids, got Req"):
        report.requests

    class UnprintableReq(Unprintable):
        __hash__ = None

    unprintable = kc.CanaryReport((dataclasses.replace(report[0], request=UnprintableReq("a")),), total=1)
    with pytest.raises(TypeError, match=r"^kv-canary: CanaryReport.requests needs hashable req_ids, got "
                                        r"UnprintableReq <unprintable request id of type UnprintableReq>"):
        unprintable.requests
    assert not eng.canary.poll()  # the rings were emptied as ever


def test_requests_refused_for_an_unhashable_id_names_that_id():
    """A report whose first event's id is hashable and a later one's is not: the TypeError shows
    the id that cannot be hashed, the one the engine must change."""

    @dataclasses.dataclass
    class Req:
        rid: str

    eng = _Engine("cpu")
    _decode_over_a_changed_slot(eng, "cpu", ["a"])
    head, tail = eng.canary.poll()
    report = kc.CanaryReport((head, dataclasses.replace(tail, request=Req("b"))), total=2)
    with pytest.raises(TypeError, match=r"^kv-canary: CanaryReport.requests needs hashable req_ids, got "
                                        r"Req \S*Req\(rid='b'\): read each event's request instead$"):
        report.requests


def test_requests_refused_for_an_id_whose_hash_raises_names_that_id():
    """An id whose ``__hash__`` raises another error than TypeError (an engine's object whose hash
    reads a field not set yet) is refused as an unhashable one is, with the package's message."""

    class HalfBuilt:
        def __hash__(self):
            raise AttributeError("rid")

        def __repr__(self):
            return "HalfBuilt()"

    eng = _Engine("cpu")
    _decode_over_a_changed_slot(eng, "cpu", ["a"])
    head, tail = eng.canary.poll()
    report = kc.CanaryReport((head, dataclasses.replace(tail, request=HalfBuilt())), total=2)
    with pytest.raises(TypeError, match=r"^kv-canary: CanaryReport.requests needs hashable req_ids, got "
                                        r"HalfBuilt HalfBuilt\(\): read each event's request instead$"):
        report.requests
    assert "HalfBuilt()" in report.describe()


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_dropped_by_each_groups_ring_are_all_counted(device):
    """The full and the SWA group's rings, 2 rows each, both fill: the report counts every row
    recorded and every row dropped, of both groups."""
    eng = _Engine(device, swa_window=8, ring=2)
    eng.add("a", 1)
    eng.forward({"a": 6})
    slot = eng.requests["a"]["slots"][2]
    eng.k[slot, 0, 0] += 1.0
    eng.swa_k[int(eng.lut[slot]), 0, 0] += 1.0
    for _ in range(3):
        eng.forward({"a": 1})
    report = eng.canary.poll()
    assert (report.total, report.dropped, len(report)) == (12, 8, 4)
    assert {(e.group, e.request, e.position) for e in report} == {("full", "a", 2), ("swa", "a", 2)}
    assert report.describe().splitlines()[0] == ("kv-canary: 12 violation(s) since the previous poll (4 forward(s) "
                                                 "so far), 8 dropped by the ring")


class _Incomparable:
    """An engine's request object whose ``==`` raises against any other object."""

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other):
        if other is self:
            return True
        raise RuntimeError("request objects are not compared")

    __hash__ = object.__hash__

    def __str__(self):
        return self.name


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("id_kind", [str, _Incomparable])
def test_requests_past_the_batch_arrays_are_counted_per_forward(device, id_kind):
    """Forward 1 has two requests whose entries reach past its arrays, forward 2 one: polled once,
    forward 1's two rows cannot be told apart and name no request, forward 2's names its own.
    Telling them apart compares their ids: ids whose ``==`` raises are told apart all the same."""
    eng = _Engine(device)
    i64 = int64s_on(device)
    for rows, extends, ids in (([1, 2], [2, 2], ["a", "b"]), ([3], [2], ["c"])):
        batch = kc.ForwardBatch(req_pool_indices=i64(rows), prefix_lens=i64([0] * len(rows)),
                                extend_seq_lens=i64(extends), input_ids=i64([5]), positions=i64([0]),
                                out_cache_loc=i64([10 + rows[0]]), req_ids=[id_kind(name) for name in ids])
        one_forward(eng.canary, batch)
    assert sorted((e.phase, e.step, str(e.request), e.position) for e in eng.canary.poll()) == [
        ("write", 1, "None", None), ("write", 1, "None", None), ("write", 2, "c", 1)]


def _pair(name: str):
    """A request id as a small NumPy array, whose ``==`` gives an array: no truth value."""
    return np.array([ord(name), 7])


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("id_kind", [str, _Incomparable, _pair])
def test_requests_past_empty_arrays_share_a_position_and_name_neither(device, id_kind):
    """a and b's entries all reach past a forward's empty arrays: each request's row is at the
    first position past them, 0 for both, so their rows cannot be told apart and name neither,
    whatever their ids: equal, ids whose ``==`` raises, or gives no truth value (the poll does
    not fail on them)."""
    eng = _Engine(device)
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]), extend_seq_lens=i64([2, 2]),
                            input_ids=i64([]), positions=i64([]), out_cache_loc=i64([]),
                            req_ids=[id_kind("a"), id_kind("b")])
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in report] == [("write", 1, None, None, -1)] * 2


def test_names_are_told_apart_by_request_and_position():
    """A row's candidate names, ``(request, position)``, are one name only where both agree: a
    request at two positions is two names, and an id is its own request even where its ``==``
    gives no truth value (a static forward's ids are the same objects at every run)."""
    distinct = kc._mapping._distinct
    assert distinct([("a", 1), ("a", 2)]) == [("a", 1), ("a", 2)]
    assert distinct([("a", 1), ("b", 1), ("a", 1)]) == [("a", 1), ("b", 1)]
    one = _pair("a")
    (request, position), = distinct([(one, 1), (one, 1)])
    assert request is one and position == 1
    assert len(distinct([(one, 1), (_pair("a"), 1)])) == 2


@pytest.mark.parametrize("device", BACKENDS)
def test_a_full_ring_names_no_reader_that_may_have_read_the_slot_before_it_went_bad(device):
    """b shares a's prefix and reads a's slot at position 2 while it is sound; then the slot's K
    bytes change and a reads it twice. The ring keeps a's first two rows: any of the three readers
    may have recorded them as far as the poll can tell (the ring does not say when the slot went
    bad), and they name different requests, so the rows name none (never b, which read the slot
    before it went bad)."""
    eng = _Engine(device, ring=2)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.add("b", 2, share="a", shared=5)
    eng.forward({"b": 1})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})
    eng.forward({"a": 1})  # its rows dropped
    report = eng.canary.poll()
    assert report.dropped == 2 and [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", None, None, None), ("tail", None, None, None)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_full_ring_keeps_the_step_where_every_reader_recorded(device):
    """A ring of one row, filled by the only launch that could have recorded it (the TAIL check's
    row dropped): that row keeps its step."""
    eng = _Engine(device, ring=1)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})
    report = eng.canary.poll()
    assert report.dropped == 1 and [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 2)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_full_ring_keeps_the_steps_of_a_slots_first_reader_and_of_another_reader_after_it(device):
    """a's slot at position 3 goes bad and b's cell 3 is pointed at it: a, b and a again read it. The
    ring keeps the first reads' rows (a's HEAD and TAIL row, b's HEAD row). The first HEAD row kept
    fits as many HEAD entries (a's at steps 3 and 5) as the ring kept HEAD rows of the slot, so the
    HEAD rows go to the first readers with their steps; the TAIL row, one kept of the two TAIL
    entries it fits, has none."""
    eng = _Engine(device, ring=3)
    eng.add("a", 1)
    eng.add("b", 2)
    eng.forward({"a": 6})
    eng.forward({"b": 4})
    bad = eng.requests["a"]["slots"][3]
    eng.k[bad, 0, 0] += 1.0
    eng.table[2, 3] = bad
    eng.sync()
    eng.forward({"a": 1})  # step 3
    eng.forward({"b": 1})  # step 4: b's row also breaks the chain (its predecessor is b's own slot)
    eng.forward({"a": 1})  # step 5: its rows dropped
    report = eng.canary.poll()
    assert report.dropped == 3 and [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", 3, "a", 3), ("tail", None, "a", 3), ("head", 4, "b", 3)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_slot_past_the_pool_written_then_read_is_reported_and_cleared(device):
    """An allocator hands out slot 200 of a 128-slot pool; a forward writes it and the next reads
    it as prefix. Poll reports the slot as OUT_OF_RANGE, named by its request, and a second poll
    finds nothing (the rows were cleared, not left to fail every later poll)."""
    eng = _Engine(device)
    i64 = int64s_on(device)
    eng.table[1, :3] = [3, 200, 4]
    eng.sync()
    for prefix, tokens, positions, slots in ((0, [10, 11], [0, 1], [3, 200]), (2, [12], [2], [4])):
        batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([prefix]),
                                extend_seq_lens=i64([len(tokens)]), input_ids=i64(tokens), positions=i64(positions),
                                out_cache_loc=i64(slots), req_ids=["a"])
        one_forward(eng.canary, batch)
    report = eng.canary.poll()
    # the write of forward 1 skips the slot; forward 2's HEAD and TAIL read it as position 1, and its
    # write is seeded from it
    oor = (200, ("OUT_OF_RANGE",))
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in report] == [
        ("write", 1, "a", 1, *oor), ("head", 2, "a", 1, *oor), ("write", 2, "a", 1, *oor), ("tail", 2, "a", 1, *oor)]
    assert len(eng.canary.poll()) == 0


def _stale_row_events(device, every_forward: bool, twice: bool) -> list:
    """a (pool row 1) and b (row 2) prefill six tokens each; a finishes and b moves to row 1, whose
    cells the engine leaves as a's (slots 1 to 6: a stale row). c takes a's freed slots 4, 5, 6 for
    its positions 0 to 2, so b's stale row reads them at positions 3 to 5 (POSITION, and slot 4's
    chain), then the forward that reads them writes c's position 3 to slot 3, the predecessor of
    slot 4 in b's row: slot 4's HEAD row carries the link slot 3 had before the write, which fits
    its entry only with the chain left unjudged. With ``twice``, b decodes once before that forward
    too, reading the same slots."""
    eng = _Engine(device)
    found = []
    eng.add("a", 1)
    eng.add("b", 2)
    eng.forward({"a": 6, "b": 6})
    stale = eng.table[1].copy()
    eng.finish("a")
    eng.table[1], eng.table[2] = stale, 0
    eng.sync()
    eng.requests["b"]["row"] = 1
    taken = [4, 5, 6] + [13] * twice + [14, 3]  # c's prefill, b's decodes, then c's decode takes slot 3
    eng.hand_out_first(taken)
    eng.add("c", 3)
    forwards = [{"c": 3}] + [{"b": 1}] * twice + [{"b": 1, "c": 1}]
    for extend in forwards:
        if every_forward:
            found.extend(eng.canary.poll())
        eng.forward(extend)
    found.extend(eng.canary.poll())
    return [(e.phase, e.step, e.request, e.position, e.slot) for e in found]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every_forward", [True, False])
def test_a_row_whose_predecessor_its_forward_wrote_keeps_the_step(device, every_forward):
    """The HEAD row of slot 4 fits b's entry only but for the chain (slot 3 written after it, in
    the same forward): the only launch of its tag that checked the slot, its forward is known, and
    the row has its step as the others do, polled after every forward or once at the end."""
    found = _stale_row_events(device, every_forward, twice=False)
    assert found == [("head", 3, "b", position, position + 1) for position in (3, 4, 5)] + [
        ("tail", 3, "b", position, position + 1) for position in (2, 3, 4, 5)]


def _a_bad_slot_read_by_two_chains(eng: "_Engine") -> int:
    """a and b prefill six tokens each, polled clean; b's cell at position 3 is pointed at a's slot
    there, whose KV then goes bad, and b's next slot is a's slot at position 2 (a page freed while
    in use). The next forward, ``{"b": 1, "a": 1}``, reads the bad slot for b (its chain broken) and
    for a (its chain whole), in that order, then writes b's token over a's predecessor of it.
    Returns the bad slot."""
    slots = _b_pointed_at_a_slot(eng)
    eng.k[slots[3], 0, 0] += 1.0
    eng.free.insert(0, slots[2])
    return slots[3]


def _b_pointed_at_a_slot(eng: "_Engine") -> list:
    """a and b prefill six tokens each; b's cell at position 3 is then pointed at a's slot there,
    polled clean (nothing has read it since). Returns a's slots."""
    eng.add("a", 1)
    eng.add("b", 2)
    eng.forward({"a": 6, "b": 6})
    slots = eng.requests["a"]["slots"]
    eng.table[2, 3] = slots[3]
    eng.sync()
    assert eng.canary.poll().total == 0
    return slots


def _events_of_slot(report, slot: int) -> list:
    return sorted(((e.phase, e.step, e.request, e.position, e.reasons) for e in report if e.slot == slot), key=repr)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_row_fitting_its_entry_is_named_beside_one_fitting_but_for_the_chain(device):
    """Polled after the forward, a's HEAD row of the bad slot fits a's entry only but for the chain
    (a's predecessor written later in the forward), and b's row, before it in the ring, fits b's
    entry exactly: each row keeps its request, position and step."""
    eng = _Engine(device)
    bad = _a_bad_slot_read_by_two_chains(eng)
    eng.forward({"b": 1, "a": 1})
    assert _events_of_slot(eng.canary.poll(), bad) == [
        ("head", 2, "a", 3, ("REAL_KV_HASH",)), ("head", 2, "b", 3, ("CHAIN_HASH", "REAL_KV_HASH")),
        ("tail", 2, "a", 3, ("CHAIN_HASH", "REAL_KV_HASH")), ("tail", 2, "b", 3, ("CHAIN_HASH", "REAL_KV_HASH"))]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_row_goes_to_the_launch_it_fits_not_a_later_one_it_fits_but_for_the_chain(device):
    """b's cell at position 3 is pointed at a's slot there, so b's reads of that slot find its chain
    broken and a's do not. b reads it in forward 2; in forward 3 a reads it clean, then writes its
    next token over its own position 2 (a page freed while in use). Polled once, forward 3's entry
    of a fits b's HEAD row but for the chain (its predecessor written after it), and no row of
    forward 3's HEAD is left to take it: the row is b's, of forward 2, whose entry it fits exactly."""
    eng = _Engine(device)
    slots = _b_pointed_at_a_slot(eng)
    eng.forward({"b": 1})
    eng.free.insert(0, slots[2])
    eng.forward({"a": 1})
    report = eng.canary.poll()
    assert [(e.step, e.request, e.position, e.reasons) for e in report if e.phase == "head" and e.slot == slots[3]] \
        == [(2, "b", 3, ("CHAIN_HASH",))]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("handed", [False, True])
def test_a_row_two_entries_fit_as_the_tables_are_now_names_neither(device, handed):
    """A forward reads a's bad slot; then b finishes and, before the poll, its pool row goes to c,
    which shares a's first three tokens (no logged forward shows c). As the table is then, the
    forward's entry of b reads that slot at the same position too: each row fits two entries, one
    of a reader that recorded nothing, and the poll names neither (the step is the forward's)."""
    eng = _Engine(device)
    eng.add("b", 2)
    eng.add("a", 1)
    eng.forward({"b": 3, "a": 3})
    assert eng.canary.poll().total == 0
    bad = eng.requests["a"]["slots"][1]
    eng.k[bad, 0, 0] += 1.0
    eng.forward({"b": 1, "a": 1})
    if handed:
        eng.add("c", 2, share="a", shared=3)
        eng.sync()
    request, position = (None, None) if handed else ("a", 1)
    assert _events_of_slot(eng.canary.poll(), bad) == [(phase, 2, request, position, ("REAL_KV_HASH",))
                                                      for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_row_fitting_but_for_the_chain_several_forwards_has_no_step(device):
    """b reads its stale row in forwards 3 and 4, slot 3 written in forward 4 after its HEAD check.
    Polled after each forward, every row has its step. Polled once, forward 4's HEAD row of slot 4
    fits forward 3's entry as well once the chain is not judged: it names b at position 3 with no
    step; forward 3's rows of slot 4 no longer fit any entry and keep their phase alone."""
    rows = [(phase, step, "b", position, position + 1) for step in (3, 4) for phase in ("head", "tail")
            for position in ((2, 3, 4, 5) if (step, phase) == (4, "tail") else (3, 4, 5))]
    assert _stale_row_events(device, True, twice=True) == rows
    late = [(phase, None, None, None, 4) if (step, position) == (3, 3) else
            (phase, None, "b", 3, 4) if (phase, step, position) == ("head", 4, 3) else
            (phase, step, request, position, slot) for phase, step, request, position, slot in rows]
    assert _stale_row_events(device, False, twice=True) == late


def _prefilled(device, i64) -> kc.Canary:
    """A canary whose request in pool row 1 has written its positions 0 and 1 into slots 1 and 2
    (slot 3 is its position 2's), its batch arrays made by ``i64``."""
    table = np.zeros((2, 8), np.int32)
    table[1, :3] = [1, 2, 3]
    canary = kc.Canary(pool_slot_count=16, capacities=session_capacities(2, 8, 16, 8),
                       req_to_token=to_device(table, device), device=device)
    prefill = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([0]), extend_seq_lens=i64([2]),
                              input_ids=i64([7, 8]), positions=i64([0, 1]), out_cache_loc=i64([1, 2]))
    one_forward(canary, prefill)
    return canary


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("tokens", ["2-D drafts", "float", "list"])
def test_token_fields_before_forward_does_not_check_leave_its_rows_named(device, tokens, caplog):
    """``before_forward`` checks the plan fields alone: a verify batch whose per-token fields are
    of another form (a speculative engine's ``[bs, k + 1]`` drafts, a float array, a list), its
    kept tokens passed to ``after_forward``, is no batch changed since its forward: poll names its
    HEAD rows with their step and request, warns of nothing, and the polls after it work."""
    i64 = int64s_on(device)
    canary = _prefilled(device, i64)
    kept = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([2]), extend_seq_lens=i64([1]),
                           input_ids=i64([9]), positions=i64([2]), out_cache_loc=i64([3]), req_ids=["a"])
    odd = {"2-D drafts": i64([[9, 5]]), "float": to_device(np.array([9.0, 5.0]), device), "list": [9, 5]}[tokens]
    verify = dataclasses.replace(kept, extend_seq_lens=i64([2]), input_ids=odd, positions=odd)
    canary.context.canary_buf[1, 0] ^= 1  # position 0's record: position 1's chain no longer matches
    canary.before_forward(verify)
    canary.after_forward(kept)
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        report = canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 1), ("tail", 2, "a", 1)]
    assert "re-typed in place since" not in caplog.text
    canary.context.canary_buf[1, 0] ^= 1
    assert not canary.poll()


@pytest.mark.parametrize("device", BACKENDS)
def test_batches_of_arrays_that_speak_dlpack_alone_are_polled(device):
    """The calls take any array that speaks DLPack; the poll after them reads their form through
    that too, so it names the rows of such batches and sweeps rather than failing (and every
    poll after it)."""
    i64 = lambda values: DLPackOnly(to_device(np.asarray(values, np.int64), device))  # noqa: E731
    canary = _prefilled(device, i64)
    step = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([2]), extend_seq_lens=i64([1]),
                           input_ids=i64([9]), positions=i64([2]), out_cache_loc=i64([3]), req_ids=["a"])
    canary.context.canary_buf[1, 0] ^= 1  # position 0's record: position 1's chain no longer matches
    one_forward(canary, step)
    canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([3]), req_ids=["a"]))
    report = canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", 2, "a", 1), ("tail", 2, "a", 1), ("sweep", 2, "a", 1)]
    canary.context.canary_buf[1, 0] ^= 1
    assert not canary.poll()


def _events_after_a_change(device, change) -> tuple[list, list]:
    """Request "a" written at positions 0-3, ``change(eng)`` made, then one more token forwarded:
    its slots as the first forward left them, and the poll's events as (phase, step, request,
    position, slot, reasons)."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 4})
    slots = list(eng.requests["a"]["slots"][:4])
    change(eng)
    eng.forward({"a": 1})
    return slots, [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in eng.canary.poll()]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_chain_broken_at_position_0_is_named_by_its_request(device):
    """A first position's chain is checked against the anchor's link (SPEC §2: no predecessor
    links as ``sm(ANCHOR)``), so a row that found it broken fits that entry: poll names it. The
    changed ``prev_hash`` changes the slot's own link too, breaking position 1's chain as well."""
    def flip_first_prev_hash(eng):
        eng.canary.context.canary_buf[eng.requests["a"]["slots"][0], 16] ^= 1  # prev_hash's low byte

    (first, second, *_), events = _events_after_a_change(device, flip_first_prev_hash)
    chain = ("CHAIN_HASH",)
    assert events == [("head", 2, "a", 0, first, chain), ("head", 2, "a", 1, second, chain),
                      ("tail", 2, "a", 0, first, chain), ("tail", 2, "a", 1, second, chain)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_predecessor_cell_holding_the_pool_size_is_out_of_range_and_named(device):
    """SPEC §4: a predecessor from ``num_slots`` on is out of range, the chain left unchecked; poll
    judges the rows of such an entry as the kernels do, from ``num_slots`` itself on, and names
    them by their request (the entry that read the cell as a slot is named too)."""
    def point_past_the_pool(eng):
        eng.table[1, 2] = SLOTS  # the first slot past the pool
        eng.sync()

    (*_, after), events = _events_after_a_change(device, point_past_the_pool)
    oor = ("OUT_OF_RANGE",)
    assert events == [("head", 2, "a", 2, SLOTS, oor), ("head", 2, "a", 3, after, oor),
                      ("tail", 2, "a", 2, SLOTS, oor), ("tail", 2, "a", 3, after, oor)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_slot_past_the_pool_that_a_later_write_is_handed_keeps_its_readers_rows(device):
    """a's cell at position 2 holds the pool size and a forward reads it; then b's one token is
    handed that slot. A write stores nothing outside the pool (SPEC §4), so the slot has no record
    for the write to have given it since: a's rows are a's still, and b's write row b's."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 4})
    after = eng.requests["a"]["slots"][3]
    eng.table[1, 2] = SLOTS
    eng.forward({"a": 1})
    eng.add("b", 2)
    eng.hand_out_first([SLOTS])
    eng.forward({"b": 1})
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in eng.canary.poll()] == [
        (phase, 2, "a", position, slot, ("OUT_OF_RANGE",)) for phase in ("head", "tail")
        for position, slot in ((2, SLOTS), (3, after))] + [("write", 3, "b", 0, SLOTS, ("OUT_OF_RANGE",))]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_position_at_the_expected_valid_length_is_named_with_no_expected_token(device):
    """``expected_valid_lens`` bounds the expected-token pool (SPEC §3.3: a token is expected below
    the valid length only): the entry at the bound reports -1, and poll, judging the row by the
    token its entry reported, names it."""
    eng = _Engine(device, expected=True)
    eng.add("a", 1)
    eng.forward({"a": 4})
    slot = eng.requests["a"]["slots"][3]
    eng.canary.context.canary_buf[slot, 8] ^= 1  # the stored position's low byte
    nxt = eng.free.pop(0)
    eng.table[1, 4], eng.expected[1, 4] = nxt, 1004
    eng.sync()
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([1]),
                            input_ids=i64([1004]), positions=i64([4]), out_cache_loc=i64([nxt]), req_ids=["a"],
                            expected_valid_lens=i64([3]))
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons, e.violation.expected_token)
            for e in report] == [("head", 2, "a", 3, slot, ("POSITION",), -1),
                                 ("tail", 2, "a", 3, slot, ("POSITION",), -1)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_padding_rows_cells_are_not_taken_for_slots_written(device):
    """SPEC §3.3: a padding row (pool row 0) writes nothing, whatever its extend length and whatever
    slot its cells of ``out_cache_loc`` hold. A poll every few forwards takes none of those slots
    for one written again: a slot whose KV changed, held there, is named at every step that read
    it."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.add("b", 2)
    eng.forward({"a": 4, "b": 3})
    flipped = eng.requests["a"]["slots"][2]
    eng.k[flipped, 0, 1] += 1.0
    i64 = int64s_on(device)
    for _ in range(3):
        a, b = eng.requests["a"], eng.requests["b"]
        loc = eng.next_slots(["a", "b"])
        batch = kc.ForwardBatch(req_pool_indices=i64([1, 2, 0]), prefix_lens=i64([a["len"], b["len"], 0]),
                                extend_seq_lens=i64([1, 1, 1]), input_ids=i64([1000 + a["len"], 2000 + b["len"], 7]),
                                positions=i64([a["len"], b["len"], 0]), out_cache_loc=i64(loc + [flipped]),
                                req_ids=["a", "b", "pad"])
        one_forward(eng.canary, batch)
        a["len"], b["len"] = a["len"] + 1, b["len"] + 1
    report = eng.canary.poll()
    assert sorted(((e.step, e.phase, e.request, e.position, e.slot) for e in report), key=str) == [
        (step, phase, "a", 2, flipped) for step in (2, 3, 4) for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_request_past_the_ids_given_is_named_by_its_batch_row(device):
    """``req_ids`` may stop short of the batch (rows past the ids are named by their index): a row
    of a request past them is named by its batch row."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.add("b", 2)
    eng.forward({"a": 3, "b": 3})
    flipped = eng.requests["b"]["slots"][1]
    eng.k[flipped, 0, 1] += 1.0
    loc = eng.next_slots(["a", "b"])  # position 3 of each
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([3, 3]), extend_seq_lens=i64([1, 1]),
                            input_ids=i64([1003, 2003]), positions=i64([3, 3]), out_cache_loc=i64(loc), req_ids=["a"])
    one_forward(eng.canary, batch)
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()] == [
        ("head", 2, 1, 1, flipped), ("tail", 2, 1, 1, flipped)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_cell_past_a_requests_length_is_not_taken_for_an_entry(device):
    """A table row may hold cells past its request's length (a page shared whole with a longer
    request, as a radix cache shares them): verify checks only the positions below the length, so
    a row of the slot such a cell holds is named for the request that read it."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.add("b", 2, share="a", shared=3)
    flipped = eng.requests["a"]["slots"][3]
    eng.table[2, 3] = flipped  # b's row one cell past its length: a's slot, behind the same chain
    eng.sync()
    eng.k[flipped, 0, 1] += 1.0
    eng.forward({"a": 1, "b": 0})
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()] == [
        ("head", 2, "a", 3, flipped), ("tail", 2, "a", 3, flipped)]


@pytest.mark.parametrize("device", BACKENDS)
def test_requests_of_one_token_count_toward_the_verify_capacity(device):
    """A request of one cached token is one verify entry (SPEC 3.3): a forward whose single-token
    requests take its plan past the capacity checked nothing, and the rows stay with the forward
    that recorded them."""
    eng = _Engine(device, verify_capacity=8)
    eng.add("a", 1)
    eng.add("b", 2)
    eng.add("c", 3)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})  # 6 entries
    eng.forward({"b": 1, "c": 1})  # no prefix: writes only
    eng.forward({"a": 1, "b": 1, "c": 1})  # 7 + 1 + 1 entries: past the capacity
    report = eng.canary.poll()
    assert report.capacity_overflows == 2  # its HEAD and TAIL verify
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 2), ("tail", 2, "a", 2)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_first_position_checked_against_its_expected_token_is_named(device):
    """Position 0 has an expected token like any other (SPEC 3.3: the pool's cell at the position
    plus the token offset): a row found there carries it, and poll, judging the row by that
    token, names its request."""
    eng = _Engine(device, expected=True)
    eng.add("a", 1)
    eng.forward({"a": 3})
    first = eng.requests["a"]["slots"][0]
    eng.k[first, 0, 1] += 1.0
    eng.forward({"a": 1})
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.violation.expected_token) for e in report] == [
        ("head", 2, "a", 0, first, 1000), ("tail", 2, "a", 0, first, 1000)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_seed_at_position_0_past_the_pool_is_named_by_its_request(device):
    """A request of one cached token seeds its write from position 0 (SPEC 4): a cell there past
    the pool is reported by the write as its seed, named by the request at position 0, as each
    verify entry that read it is."""
    eng = _Engine(device)
    eng.add("a", 1)
    eng.forward({"a": 1})
    eng.table[1, 0] = SLOTS
    eng.sync()
    eng.forward({"a": 1})
    assert sorted((e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()) == [
        ("head", 2, "a", 0, SLOTS), ("tail", 2, "a", 0, SLOTS), ("write", 2, "a", 0, SLOTS)]


@pytest.mark.parametrize("device", BACKENDS)
def test_an_swa_row_whose_predecessor_moved_in_the_lut_keeps_its_request(device):
    """In an SWA group the predecessor of a window's first position lies outside the window, and
    the engine may move its LUT entry to another slot once the window has passed it. A row that
    found its chain whole then cannot be judged by the chain as the LUT is now: poll names it by
    its request and step all the same."""
    eng = _Engine(device, swa_window=2)
    eng.add("a", 1)
    eng.forward({"a": 4})
    slots = eng.requests["a"]["slots"]
    bad = int(eng.lut[slots[2]])
    eng.swa_k[bad, 0, 1] += 1.0
    eng.forward({"a": 1})  # its SWA verify checks positions 2 and 3
    eng.lut[slots[1]] = eng.swa_free.pop()  # position 1's SWA slot, moved once past the window
    eng.sync()
    swa = [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll() if e.group == "swa"]
    assert swa == [("head", 2, "a", 2, bad), ("tail", 2, "a", 2, bad)]


@pytest.mark.parametrize("device", BACKENDS)
def test_an_swa_row_fitting_but_for_the_chain_is_not_given_an_entry_another_row_fits_exactly(device):
    """a and c share a prompt's slots. a's forward reads the bad SWA slot at position 2 with its
    chain whole; then position 1's SWA slot moves in the LUT, and c's forward reads the slot with
    its chain broken. c's row fits c's entry exactly; a's row fits it only but for the chain, and
    an entry records one row, so a's row is a's, named without a step (c's entry fits it too but
    for the chain)."""
    eng = _Engine(device, swa_window=2)
    eng.add("a", 1)
    eng.forward({"a": 4})
    eng.add("c", 3, share="a", shared=4)
    slots = eng.requests["a"]["slots"]
    bad = int(eng.lut[slots[2]])
    eng.swa_k[bad, 0, 1] += 1.0
    eng.forward({"a": 1})  # step 2: its SWA verify checks positions 2 and 3
    eng.lut[slots[1]] = eng.swa_free.pop()
    eng.sync()
    eng.forward({"c": 1})  # step 3
    swa = [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll() if e.group == "swa"]
    assert swa == [("head", None, "a", 2, bad), ("tail", None, "a", 2, bad),
                   ("head", 3, "c", 2, bad), ("tail", 3, "c", 2, bad)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_write_row_two_forwards_could_record_goes_to_the_forward_of_the_rows_before_it(device):
    """a's prompt token at position 0 goes to a slot in forward 1; a finishes, and in forward 2 c,
    the same prompt, takes the slot with the token the engine did not expect. Either write could
    have recorded c's row (same slot, token and position): ring order tells it, since the rows
    before it in the ring, b's bad slot as forward 2's HEAD read it, are forward 2's."""
    eng = _Engine(device)
    eng.add("a", 1, prompt=7000)
    eng.add("b", 2)
    eng.forward({"a": 1, "b": 3})
    reused = eng.requests["a"]["slots"][0]
    flipped = eng.requests["b"]["slots"][1]
    eng.k[flipped, 0, 1] += 1.0
    eng.finish("a")
    eng.add("c", 3, prompt=7000)
    loc = eng.next_slots(["c", "b"])
    assert loc[0] == reused
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([3, 2]), prefix_lens=i64([0, 3]), extend_seq_lens=i64([1, 1]),
                            input_ids=i64([7000, 2003]), positions=i64([0, 3]), out_cache_loc=i64(loc),
                            req_ids=["c", "b"], expected_input_tokens=i64([7777, 2003]),
                            expected_input_positions=i64([0, 3]))
    one_forward(eng.canary, batch)
    assert [(e.phase, e.step, e.request, e.position, e.slot) for e in eng.canary.poll()] == [
        ("head", 2, "b", 1, flipped), ("write", 2, "c", 0, reused), ("tail", 2, "b", 1, flipped)]


@pytest.mark.parametrize("device", BACKENDS)
def test_an_entry_recording_two_alike_rows_has_both_named(device):
    """An engine that repeats a's position 3 for its next token, expecting position 4, with both
    write asserts on: the input assert and the chain position assert record alike rows for the one
    entry (SPEC 3.1: same token, chain and expected position), and both are named by it."""
    eng = _Engine(device, chain_position_assert=True)
    eng.add("a", 1)
    eng.forward({"a": 4})
    loc = eng.next_slots(["a"])
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([1]),
                            input_ids=i64([1004]), positions=i64([3]), out_cache_loc=i64(loc), req_ids=["a"],
                            expected_input_tokens=i64([1004]), expected_input_positions=i64([4]))
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    assert len({e.violation for e in report}) == 1
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in report] == [
        ("write", 2, "a", 4, loc[0], ("WRITE_POSITION",))] * 2


@pytest.mark.parametrize("device", BACKENDS)
def test_one_request_past_the_verify_capacity_overflows_its_plan(device):
    """A single request whose prefix alone passes the verify capacity overflows the plan (SPEC
    3.3): that forward checked nothing, and the rows stay with the forwards that recorded them."""
    eng = _Engine(device, verify_capacity=8)
    eng.add("a", 1)
    eng.forward({"a": 6})
    eng.k[eng.requests["a"]["slots"][2], 0, 0] += 1.0
    eng.forward({"a": 1})  # 6 entries
    eng.forward({"a": 3})  # 7 entries
    eng.forward({"a": 1})  # 10 entries: past the capacity
    report = eng.canary.poll()
    assert report.capacity_overflows == 2  # its HEAD and TAIL verify
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        ("head", 2, "a", 2), ("tail", 2, "a", 2), ("head", 3, "a", 2), ("tail", 3, "a", 2)]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_outside_the_table_are_named_only_within_their_window(device):
    """Two requests whose pool rows lie past ``req_to_token`` resolve nothing: in the SWA group each
    verify entry of its window records an unresolved row at its position (SPEC 3.3), and the
    positions before a window are none of that request's, so each row names the one request whose
    window holds it."""
    eng = _Engine(device, swa_window=2)
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([ROWS, ROWS + 1]), prefix_lens=i64([6, 2]),
                            extend_seq_lens=i64([0, 0]), input_ids=i64([]), positions=i64([]),
                            out_cache_loc=i64([]), req_ids=["far", "near"])
    one_forward(eng.canary, batch)
    swa = [(e.phase, e.request, e.position) for e in eng.canary.poll() if e.group == "swa"]
    assert sorted(swa) == sorted((phase, request, position) for phase in ("head", "tail")
                                 for request, position in (("far", 4), ("far", 5), ("near", 0), ("near", 1)))


def _a_slot_written_twice_events(device, every_forward: bool) -> tuple[int, list]:
    """a (prompt 7000) reads its position 3 bad in forward 2; the engine hands the slot out twice
    more while a's pool row still names it: to c, the same prompt, at the same position (the same
    record), then to d at position 0, and each reads it clean in the forward after its write."""
    eng = _Engine(device)
    found = []
    eng.add("a", 1, prompt=7000)
    eng.forward({"a": 4})
    slot = eng.requests["a"]["slots"][3]
    eng.k[slot, 0, 1] += 1.0
    eng.forward({"a": 1})
    for rid, row, count in (("c", 2, 4), ("d", 3, 1)):
        if every_forward:
            found.extend(eng.canary.poll())
        eng.free.insert(count - 1, slot)  # the slot of its last prefill position
        eng.add(rid, row, prompt=7000)
        eng.forward({rid: count})
        eng.forward({rid: 1})
    found.extend(eng.canary.poll())
    return slot, [(e.phase, e.step, e.request, e.position, e.slot) for e in found]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_of_a_slot_written_twice_are_not_given_to_a_clean_reader(device):
    """Polled after every forward, a's rows name a at step 2. Polled once, they show the record
    c wrote as well as a's: with the slot written more than once since, which reader saw them is
    not told, and they go to neither (c read the slot clean)."""
    slot, events = _a_slot_written_twice_events(device, True)
    assert events == [("head", 2, "a", 3, slot), ("tail", 2, "a", 3, slot)]
    slot, events = _a_slot_written_twice_events(device, False)
    assert events == [("head", None, None, None, slot), ("tail", None, None, None, slot)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_negative_extend_takes_nothing_from_the_slots_written(device):
    """A request's non-positive extend writes nothing (SPEC 3.3): it takes nothing from the
    entries of the requests after it. c, a's prompt, takes a's freed slots in a batch led by such a
    request: its write of the slot a read bad is still seen, so a's rows are not given to c, which
    read the slot clean."""
    eng = _Engine(device)
    eng.add("a", 1, prompt=7000)
    eng.forward({"a": 6})
    flipped = eng.requests["a"]["slots"][3]
    eng.k[flipped, 0, 0] += 1.0
    eng.forward({"a": 1})
    row = eng.table[1].copy()
    eng.finish("a")
    eng.table[1] = row  # the engine leaves a's cells in its pool row
    eng.add("c", 3, prompt=7000)
    c = eng.requests["c"]
    loc = [eng.free.pop(0) for _ in range(7)]
    eng.table[3, :7] = loc
    eng.sync()
    assert loc[3] == flipped
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([4, 3]), prefix_lens=i64([0, 0]), extend_seq_lens=i64([-5, 7]),
                            input_ids=i64(range(7000, 7007)), positions=i64(range(7)), out_cache_loc=i64(loc),
                            req_ids=["x", "c"])
    eng.canary.before_forward(batch)
    eng.k[i64(loc)] = to_device(eng.rng.standard_normal((7, 2, 8)).astype(np.float32), device)
    eng.canary.after_forward(batch)
    c["len"] = 7
    eng.forward({"c": 1})
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == [
        ("head", 2, "a", 3), ("tail", 2, "a", 3)]
