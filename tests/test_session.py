"""kc.Canary: per-forward calls, reports mapped to requests, modes, overflow, layout builders."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import pickle
import weakref

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import DLPackOnly, Unprintable, one_forward, replay_by_mistake, session_capacities
from _devices import BACKENDS, int64s_on, requires_gpu, spin_kernel, to_device, to_numpy

SLOTS = 64
ROWS = 4
WIDTH = 32


class Tiny:
    """Two requests in a 64-slot pool with per-layer K/V buffers, on ``device``."""

    def __init__(self, device, mode="log", verify_capacity=None, swa=False, hash_mode=kc.HashMode.ALL, stream=None,
                 static=False, frame=None, bound=False, swa_slots_given=False, **canary_options):
        self.device = device
        self.stream = stream
        # static: the batch arrays are buffers refilled in place, one per field and length, as a
        # CUDA-graph engine's are; frame: a function the batch arrays are passed through (torch views);
        # bound: each batch shape's forwards go through one StaticForward over its buffers
        self.buffers = {} if static or bound else None
        self.bound = {} if bound else None
        self.frame = frame or (lambda array: array)
        # swa_slots_given: each batch names its SWA slots (swa_out_cache_loc) instead of the canary
        # translating its full slots through the LUT
        self.swa_slots_given = swa_slots_given
        self.spin = spin_kernel() if stream is not None else None
        self.table = to_device(np.zeros((ROWS, WIDTH), np.int32), device)
        self.k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        self.v = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        caps = canary_options.pop("capacities", None) or session_capacities(ROWS, WIDTH, SLOTS, 64, verify_capacity)
        group = None
        if swa:
            self.lut = to_device(np.arange(SLOTS + 1, dtype=np.int64)[::-1].copy() % SLOTS, device)
            self.swa_k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
            group = kc.SwaGroup(window=4, lut=self.lut, num_slots=SLOTS,
                                real_kv_sources=kc.layouts.per_layer([self.swa_k]))
        self.canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=self.table, device=device,
                                real_kv_sources=kc.layouts.per_layer([self.k], [self.v]), hash_mode=hash_mode,
                                mode=mode, swa=group, chain_position_assert=True, **canary_options)
        self.rows = {"a": 1, "b": 2}
        self.lens = {"a": 0, "b": 0}
        self.next_slot = 1
        self.rng = np.random.default_rng(0)

    def step(self, extend: dict, stale_position: dict | None = None, before: bool = True) -> kc.ForwardBatch:
        """One forward; ``stale_position`` writes a request's new tokens that many positions back;
        without ``before`` only its after_forward runs (a forward of its own, planned there)."""
        rids = list(extend)
        ids, pos, loc = [], [], []
        table = to_numpy(self.table).copy()
        for rid in rids:
            for p in range(self.lens[rid], self.lens[rid] + extend[rid]):
                table[self.rows[rid], p] = self.next_slot
                ids.append(1000 * self.rows[rid] + p)
                pos.append(p - (stale_position or {}).get(rid, 0))
                loc.append(self.next_slot)
                self.next_slot += 1
        self.table[...] = to_device(table, self.device)
        i64 = int64s_on(self.device)
        fields = dict(req_pool_indices=[self.rows[r] for r in rids], prefix_lens=[self.lens[r] for r in rids],
                      extend_seq_lens=[extend[r] for r in rids], input_ids=ids, positions=pos, out_cache_loc=loc)
        if self.swa_slots_given:
            fields["swa_out_cache_loc"] = to_numpy(self.lut)[loc].tolist()
        batch = kc.ForwardBatch(**{name: self.frame(self.array(name, values)) for name, values in fields.items()},
                                req_ids=rids)
        before_op, after_op = self.canary.before_forward, self.canary.after_forward
        if self.bound is not None:
            shape = tuple(len(values) for values in fields.values())
            if shape not in self.bound:
                self.bound[shape] = self.canary.static_forward(batch)
            forward = self.bound[shape]
            before_op, after_op = (lambda _, **kw: forward.before(**kw)), (lambda _, **kw: forward.after(**kw))
        if before:
            self.call(before_op, batch)
        n = len(loc)
        for buf in (self.k, self.v):
            buf[i64(loc)] = to_device(self.rng.standard_normal((n, 2, 8)).astype(np.float32), self.device)
        if hasattr(self, "swa_k"):
            swa = to_numpy(self.lut)[loc]
            self.swa_k[i64(swa)] = to_device(self.rng.standard_normal((n, 2, 8)).astype(np.float32), self.device)
        self.call(after_op, batch)
        for rid in rids:
            self.lens[rid] += extend[rid]
        return batch

    def set_table(self, index, values) -> None:
        """``req_to_token[index] = values``, written through a host copy as an engine's scheduler
        writes its table."""
        table = to_numpy(self.table).copy()
        table[index] = values
        self.table[...] = to_device(table, self.device)

    def array(self, name: str, values: list):
        """The batch's array ``name``: new, or with ``static`` the field's buffer refilled in place."""
        values = to_device(np.asarray(values, np.int64), self.device)
        if self.buffers is None:
            return values
        buffer = self.buffers.setdefault((name, len(values)), values)
        buffer[...] = values
        return buffer

    def call(self, op, argument) -> None:
        """``op(argument)``; with a stream, the op runs on it while it is still busy with a spin and
        the engine's own array work stays on the current stream (the engine waits for both)."""
        if self.stream is None:
            op(argument)
            return
        import cupy

        cupy.cuda.Device().synchronize()
        with self.stream:
            self.spin((1,), (1,), (cupy.uint64(2_000_000),))
        op(argument, stream=self.stream)
        self.stream.synchronize()

    def slot(self, rid, position):
        return int(to_numpy(self.table)[self.rows[rid], position])


@pytest.mark.parametrize("device", BACKENDS)
def test_clean_forwards_and_sweep(device):
    eng = Tiny(device)
    eng.step({"a": 5, "b": 3})
    for _ in range(4):
        eng.step({"a": 1, "b": 1})
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), device),
                                     seq_lens=to_device(np.array([9, 7], np.int64), device), req_ids=["a", "b"]))
    report = eng.canary.poll()
    assert not report and report.total == 0 and report.capacity_overflows == 0
    assert report.forwards == 5 and eng.canary.forwards == 5  # a sweep is no forward
    eng.canary.after_forward(_next_token_of_a(eng))  # an after_forward alone is a forward of its own
    assert eng.canary.forwards == 6 and not eng.canary.poll()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("sweep", [False, True])
def test_events_carry_the_step_of_the_forward_that_found_them(device, sweep):
    """Polled every few forwards, a slot that went bad after forwards that read it clean is
    reported at the forwards that read it bad, not at the first forward that read it."""
    eng = Tiny(device)
    eng.step({"a": 6, "b": 4})
    eng.step({"a": 1, "b": 1})
    eng.step({"a": 1, "b": 1})  # forwards 2 and 3 read b's position 2 clean
    eng.k[eng.slot("b", 2), 0, 0] += 1.0
    eng.step({"a": 1, "b": 1})
    if sweep:
        eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), device),
                                         seq_lens=to_device(np.array([9, 7], np.int64), device), req_ids=["a", "b"]))
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    found = [(e.phase, e.step, e.request, e.position) for e in report]
    expected = [("head", 4, "b", 2), ("tail", 4, "b", 2), ("head", 5, "b", 2), ("tail", 5, "b", 2)]
    if sweep:
        expected.insert(2, ("sweep", 4, "b", 2))
    assert found == expected


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("lost_row", [ROWS, ROWS + 3])
@pytest.mark.parametrize("beside_a_prefix", [False, True], ids=["beside-a-prefill", "beside-a-prefix"])
def test_cells_outside_the_table_name_their_request(device, lost_row, beside_a_prefix):
    """A pool row past ``req_to_token`` (the first one past it too) resolves no slot: each verify
    entry and the write's seed are reported with the request and the position of the cell, and the
    slot said to be unresolved; a request of the table that verifies the same positions beside it
    (its prefix cached) is not taken for it."""
    eng = Tiny(device)
    i64 = int64s_on(device)
    if beside_a_prefix:
        eng.step({"a": 2})
        assert eng.canary.poll().total == 0
        batch = kc.ForwardBatch(req_pool_indices=i64([1, lost_row]), prefix_lens=i64([2, 2]),
                                extend_seq_lens=i64([1, 1]), input_ids=i64([5, 7]), positions=i64([2, 2]),
                                out_cache_loc=i64([40, 41]), req_ids=["a", "lost"])
    else:
        batch = kc.ForwardBatch(req_pool_indices=i64([1, lost_row]), prefix_lens=i64([0, 2]),
                                extend_seq_lens=i64([2, 1]), input_ids=i64([5, 6, 7]), positions=i64([0, 1, 2]),
                                out_cache_loc=i64([1, 2, 3]), req_ids=["a", "lost"])
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    assert {(e.phase, e.request, e.position) for e in report} == {
        ("head", "lost", 0), ("head", "lost", 1), ("write", "lost", 1), ("tail", "lost", 0), ("tail", "lost", 1)}
    assert all(e.reasons == ("OUT_OF_RANGE",) for e in report)
    assert "request 'lost' position 1 slot unresolved (no cell of req_to_token or the LUT)" in report.describe()
    # no record lies at an unresolved slot: the row's fields are not called stored ones
    assert "stored token" not in report.describe() and "OUT_OF_RANGE (row's token 0 position 1)" in report.describe()


def test_entries_past_the_batch_arrays_name_their_request():
    """``extend_seq_lens`` that add up past the flat arrays: the write reports the request whose
    entries run out, at the first position without one."""
    eng = Tiny("cpu")
    i64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]), extend_seq_lens=i64([2, 3]),
                            input_ids=i64([5, 6, 7]), positions=i64([0, 1, 0]), out_cache_loc=i64([1, 2, 3]),
                            req_ids=["a", "b"])
    one_forward(eng.canary, batch)
    (event,) = eng.canary.poll()
    assert (event.phase, event.request, event.position, event.reasons) == ("write", "b", 1, ("OUT_OF_RANGE",))
    assert "slot none (the request's entries reach past input_ids)" in event.describe()


@pytest.mark.parametrize("device", BACKENDS)
def test_kv_corruption_names_request_and_position(device):
    eng = Tiny(device)
    eng.step({"a": 6, "b": 4})
    eng.k[eng.slot("b", 2), 0, 0] += 1.0
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    # read by the HEAD and the TAIL verify of the forward after the change, nothing else
    assert [(e.tag, e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in report] == [
        (kc.LaunchTag.HEAD_K_FULL, "head", 2, "b", 2, eng.slot("b", 2), ("REAL_KV_HASH",)),
        (kc.LaunchTag.TAIL_K_FULL, "tail", 2, "b", 2, eng.slot("b", 2), ("REAL_KV_HASH",))]
    event = report[0]
    assert event.tag == kc.LaunchTag.HEAD_K_FULL and event.phase == "head" and event.step == 2
    assert report.counts_by_tag()["HEAD_K_FULL"] == 1
    assert eng.canary.poll().total == 0, "poll clears the ring"


def _position_and_kv_of_a_1_changed(device):
    """Request a's position 1, whose record's position (now 9) and KV both changed after forward 1,
    read by forward 2: the engine and the slot."""
    eng = Tiny(device)
    eng.step({"a": 3})
    slot = eng.slot("a", 1)
    eng.canary.context.canary_buf[slot, 8:16] = to_device(np.frombuffer(np.int64(9).tobytes(), np.uint8), device)
    eng.k[slot, 0, 0] += 1.0
    eng.step({"a": 1})
    return eng, slot


@pytest.mark.parametrize("device", BACKENDS)
def test_counts_by_reason_count_every_reason_of_an_event(device):
    """A slot whose position and KV both changed fails two checks in one row: each reason counts."""
    eng, slot = _position_and_kv_of_a_1_changed(device)
    report = eng.canary.poll()
    assert {(e.phase, e.position, e.reasons) for e in report} == {
        (phase, 1, ("POSITION", "REAL_KV_HASH")) for phase in ("head", "tail")} | {
        (phase, 2, ("CHAIN_HASH",)) for phase in ("head", "tail")}
    assert report.counts_by_reason() == {"POSITION": 2, "REAL_KV_HASH": 2, "CHAIN_HASH": 2}


@pytest.mark.parametrize("device", BACKENDS)
def test_an_event_of_two_reasons_is_described_by_its_own_position_and_both_reasons(device):
    """A verify row failing POSITION and REAL_KV_HASH at position 1 of forward 2: its line names
    position 1 (not the step), both reasons, and the position the record holds; a verify row's
    ``expected_aux`` is its predecessor's chain, not a position, and is not shown as one."""
    eng, slot = _position_and_kv_of_a_1_changed(device)
    (event,) = [e for e in eng.canary.poll() if e.phase == "head" and e.position == 1]
    assert event.describe() == (f"[HEAD_K_FULL step 2] request 'a' position 1 slot {slot}: POSITION|REAL_KV_HASH "
                                f"(stored token {event.violation.stored_token} position 9)")


def test_a_verify_row_of_slot_minus_one_is_described_by_its_slot():
    """A table cell of -1 read by a verify is out of range, its slot -1 shown as such: only a write
    row's slot -1 means entries past ``input_ids``."""
    eng = Tiny("cpu")
    eng.step({"a": 3})
    eng.table[1, 1] = -1
    eng.step({"a": 1})
    events = [e for e in eng.canary.poll() if e.slot == -1]
    assert [(e.phase, e.position) for e in events] == [("head", 1), ("tail", 1)]
    assert all(" slot -1: OUT_OF_RANGE " in e.describe() for e in events)


@pytest.mark.parametrize("device", BACKENDS)
def test_alias_resolves_to_the_reading_request(device):
    eng = Tiny(device)
    eng.step({"a": 6, "b": 6})
    eng.set_table(np.s_[1, 3], to_numpy(eng.table)[2, 3])  # a's position 3 now points at b's position 3
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    first = [e for e in report if e.phase == "head"]
    assert {(e.request, e.position) for e in first} == {("a", 3), ("a", 4)}


@pytest.mark.parametrize("device", BACKENDS)
def test_write_assert_names_entry(device):
    eng = Tiny(device)
    eng.step({"a": 4, "b": 4})
    # b's new token written at a stale position: the chain position assert flags the write itself
    rids = ["a", "b"]
    i64 = int64s_on(device)
    eng.set_table(np.s_[[1, 2], 4], [40, 41])
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([1, 1]),
                            input_ids=i64([7, 8]), positions=i64([4, 2]), out_cache_loc=i64([40, 41]), req_ids=rids)
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    writes = [e for e in report if e.phase == "write"]
    assert [(e.request, e.position, e.slot) for e in writes] == [("b", 4, 41)]
    assert "WRITE_POSITION" in writes[0].reasons
    # what the write stored, and the position its chain wanted (the predecessor's 3, plus 1)
    # the slot it wrote (only a write row's slot -1 means entries past input_ids)
    assert " request 'b' position 4 slot 41: " in writes[0].describe()
    assert writes[0].describe().endswith("(stored token 8 position 2, expected position 4)")


@pytest.mark.parametrize("device", BACKENDS)
def test_write_rows_skip_padding_rows(device):
    """A padding row (pool row 0) before a request writes nothing (SPEC 3.3: its offset counts 0), so
    the request's tokens come first in the flat arrays; a write row is named by the request whose
    entries hold it, not by the padding row."""
    eng = Tiny(device)
    eng.step({"a": 4, "b": 4})
    i64 = int64s_on(device)
    eng.set_table(np.s_[2, 4], 41)
    batch = kc.ForwardBatch(req_pool_indices=i64([0, 2]), prefix_lens=i64([0, 4]), extend_seq_lens=i64([1, 1]),
                            input_ids=i64([8, 0]), positions=i64([2, 0]), out_cache_loc=i64([41, 0]),
                            req_ids=["padding", "b"])
    one_forward(eng.canary, batch)
    writes = [e for e in eng.canary.poll() if e.phase == "write"]
    assert [(e.request, e.position, e.slot) for e in writes] == [("b", 4, 41)]
    assert "WRITE_POSITION" in writes[0].reasons


@pytest.mark.parametrize("device", BACKENDS)
def test_raise_mode_raises(device):
    eng = Tiny(device, mode="raise")
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    eng.step({"a": 1})
    with pytest.raises(kc.CanaryViolation) as info:
        eng.canary.poll()
    # the changed token word breaks the link that position 2's record holds
    report = info.value.report
    assert [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in report] == [
        ("head", 2, "a", 2, eng.slot("a", 2), ("CHAIN_HASH",)), ("tail", 2, "a", 2, eng.slot("a", 2), ("CHAIN_HASH",))]
    assert report.requests == {"a"}
    # a line for each event shown, and one counting those left out only when any is
    assert report.describe(limit=2).splitlines()[1:] == ["  " + e.describe() for e in report]
    assert report.describe(limit=1).splitlines()[1:] == ["  " + report[0].describe(), "  ... 1 more"]
    assert "kv-canary" in str(info.value)
    assert "request 'a' position 2" in str(info.value)
    # an engine whose scheduler runs in a worker process hands the exception to its parent
    # (pickled), or copies it: it keeps its report, its message and what was added to it
    info.value.worker = "scheduler 3"
    for again in (pickle.loads(pickle.dumps(info.value)), copy.copy(info.value), copy.deepcopy(info.value)):
        assert type(again) is kc.CanaryViolation
        assert again.report == info.value.report and again.report.requests == {"a"}
        assert str(again) == str(info.value) and again.worker == "scheduler 3"


def test_off_mode_does_nothing():
    eng = Tiny("cpu", mode="off")
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    eng.step({"a": 1})
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=np.array([1], np.int64), seq_lens=np.array([4], np.int64)))
    assert eng.canary.poll().total == 0
    assert eng.canary.stats()["full"]["kernel_run_counter"] == 0


def test_log_mode_logs(caplog):
    eng = Tiny("cpu", mode="log")
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.step({"a": 1})
        report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position, e.reasons) for e in report] == [
        ("head", 2, "a", 2, ("CHAIN_HASH",)), ("tail", 2, "a", 2, ("CHAIN_HASH",))]
    assert "2 violation(s)" in caplog.text
    assert f"[HEAD_K_FULL step 2] request 'a' position 2 slot {eng.slot('a', 2)}: CHAIN_HASH" in caplog.text


class _MessageOnly:
    """An engine's logger: a ``warning`` method taking the message alone."""

    def __init__(self):
        self.messages = []

    def warning(self, message):
        self.messages.append(message)


class _Failing:
    def warning(self, *args, **kwargs):
        raise RuntimeError("log sink down")


@pytest.mark.parametrize("device", BACKENDS)
def test_a_logger_taking_the_message_alone_gets_every_warning(device):
    eng = Tiny(device, mode="log", logger=_MessageOnly())
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    eng.step({"a": 1})
    report = eng.canary.poll()
    assert len(report) == 2
    assert eng.canary.logger.messages == [report.describe()]
    batch = eng.step({"a": 1})
    eng.canary.before_forward(batch)  # a before with no after, then another before
    eng.canary.before_forward(batch)
    assert any("had no after" in message for message in eng.canary.logger.messages)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_logger_that_raises_loses_no_report_and_no_launch(device, caplog):
    """The engine's logger failing does not take the report with it (the rings are emptied by the
    poll) nor stop a forward half-way: the message goes to the package's logger instead."""
    eng = Tiny(device, mode="log", logger=_Failing(), max_logged_forwards=1)
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.step({"a": 1})  # past max_logged_forwards: its launches are counted, unlogged, with a warning
        report = eng.canary.poll()
    assert [(e.phase, e.request, e.position, e.reasons) for e in report] == [
        ("head", None, None, ("CHAIN_HASH",)), ("tail", None, None, ("CHAIN_HASH",))]
    assert "log sink down" in caplog.text and "more than 1 forwards" in caplog.text
    assert report.describe() in caplog.text
    assert eng.canary.stats()["full"]["kernel_run_counter"] == 6
    eng.step({"a": 1})
    assert {(e.phase, e.request, e.position) for e in eng.canary.poll()} == {("head", "a", 2), ("tail", "a", 2)}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("swa", [False, True])
def test_capacity_overflow_is_reported(device, swa):
    """The verify launches skipped for capacity since the previous poll, in every group: a poll
    counts them once."""
    eng = Tiny(device, verify_capacity=3, swa=swa)
    eng.step({"a": 6})
    eng.step({"a": 1})  # 6 prefix entries (the SWA group's window: 4) > capacity 3: verify skipped, and said so
    report = eng.canary.poll()
    skipped = 2 * len(eng.canary.groups)  # HEAD and TAIL of step 2 (step 1 has no prefix)
    assert report.capacity_overflows == skipped
    assert report.total == 0
    assert "capacity" in report.describe()
    assert eng.canary.poll().capacity_overflows == 0
    eng.step({"a": 1})
    assert eng.canary.poll().capacity_overflows == skipped


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", ["log", "raise"])
def test_capacity_overflow_alone_is_logged_and_not_raised(device, mode, caplog):
    """README: verify launches skipped for capacity are logged in modes "log" and "raise", and
    "raise" raises for violations only."""
    eng = Tiny(device, mode=mode, verify_capacity=4)
    eng.step({"a": 6})
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.step({"a": 1})
        report = eng.canary.poll()
    assert (report.total, report.capacity_overflows) == (0, 2)
    assert not report  # skipped launches are no violation
    assert "2 verify launch(es) skipped: plan capacity exceeded" in caplog.text


@pytest.mark.parametrize("device", BACKENDS)
def test_swa_group(device):
    eng = Tiny(device, swa=True)
    eng.step({"a": 6, "b": 2})
    eng.step({"a": 1, "b": 1})
    assert eng.canary.poll().total == 0
    lut = to_numpy(eng.lut)
    eng.swa_k[int(lut[eng.slot("a", 5)]), 0, 0] += 1.0  # inside a's window
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    swa_slot = int(lut[eng.slot("a", 5)])
    assert [(e.group, e.tag, e.step, e.request, e.position, e.slot, e.reasons) for e in report] == [
        ("swa", kc.LaunchTag.HEAD_K_SWA, 3, "a", 5, swa_slot, ("REAL_KV_HASH",)),
        ("swa", kc.LaunchTag.TAIL_K_SWA, 3, "a", 5, swa_slot, ("REAL_KV_HASH",))]


@pytest.mark.parametrize("device", BACKENDS)
def test_swa_sweeps_are_tagged_and_counted_as_the_swa_groups(device):
    """A sweep's rows in the SWA group carry the SWA sweep tag, ``stats`` counts each group's
    launches and entries, and each group's ring holds ``ring_capacity`` rows."""
    eng = Tiny(device, swa=True, ring_capacity=8)
    assert eng.canary.context.ring_capacity == eng.canary.swa_context.ring_capacity == 8
    assert Tiny(device).canary.swa_context is None  # without an SWA group
    eng.step({"a": 6})
    lut = to_numpy(eng.lut)
    swa_slot = int(lut[eng.slot("a", 4)])
    eng.swa_k[swa_slot, 0, 0] += 1.0
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1], np.int64), device),
                                     seq_lens=to_device(np.array([6], np.int64), device), req_ids=["a"]))
    stats = eng.canary.stats()
    report = eng.canary.poll()
    assert [(e.group, e.tag, e.phase, e.request, e.position, e.slot) for e in report] == [
        ("swa", kc.LaunchTag.SWEEP_K_SWA, "sweep", "a", 4, swa_slot)]
    assert set(stats) == {"full", "swa"}
    # the prompt's head and tail (no prefix: no entry) and write (6 tokens), then the sweep (the window's 4)
    assert stats["swa"] == {"kernel_run_counter": 4, "slot_run_counter": 0 + 6 + 0 + 4, "violations": 1}


@pytest.mark.parametrize("device", BACKENDS)
def test_expected_tokens_are_read_at_the_token_offset(device):
    """``token_offset=1`` (an EAGLE draft's pool, a position's token one cell on): each position is
    checked against the pool's next cell, so a pool laid out that way reports nothing."""
    pool = np.random.default_rng(95).integers(1, 30000, size=(ROWS, WIDTH)).astype(np.int32)
    for row in range(ROWS):
        pool[row, 1:] = 1000 * row + np.arange(WIDTH - 1)  # the token Tiny writes at position p, in cell p + 1
    eng = Tiny(device, expected_tokens=to_device(pool, device), token_offset=1)
    eng.step({"a": 3, "b": 2})
    eng.step({"a": 1, "b": 1})
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), device),
                                     seq_lens=to_device(np.array([4, 3], np.int64), device)))
    assert not eng.canary.poll()
    token_7 = np.frombuffer(np.int64(7).tobytes(), np.uint8)
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = to_device(token_7, device)
    eng.step({"a": 1})
    tokens = {(e.phase, e.position, e.violation.expected_token)
              for e in eng.canary.poll() if "VERIFY_TOKEN" in e.reasons}
    assert tokens == {("head", 1, 1001), ("tail", 1, 1001)}  # the next position's chain breaks too


def _overflow_swa_and_sweep(eng: Tiny, k_corrupted=(("b", 1),)) -> kc.CanaryReport:
    """Three forwards with an SWA row and the K rows of ``k_corrupted`` (request, position) corrupted
    before the third, then a sweep of 12 entries, past a verify capacity of 10; the poll's report."""
    eng.step({"a": 6, "b": 2})
    eng.step({"a": 1, "b": 1})
    eng.swa_k[int(to_numpy(eng.lut)[eng.slot("a", 5)]), 0, 0] += 1.0
    for rid, position in k_corrupted:
        eng.k[eng.slot(rid, position), 1, 3] -= 1.0
    eng.step({"a": 1, "b": 1})
    eng.call(eng.canary.sweep, kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), eng.device),
                                               seq_lens=to_device(np.array([8, 4], np.int64), eng.device),
                                               req_ids=["a", "b"]))
    return eng.canary.poll()


def _event_keys(report: kc.CanaryReport) -> list:
    # repr orders events whose request or position is unknown (None) too
    return sorted(((e.group, e.phase, e.tag, e.request, e.position, e.slot, e.step, tuple(e.reasons)) for e in report),
                  key=repr)


@requires_gpu
def test_session_on_a_busy_non_blocking_stream_matches_the_cpu():
    """A canary whose ops are given a non-blocking stream, still busy when each op is called, while
    the engine's own work stays on the current stream: its overflow counts, SWA slot translation and
    sweep must follow the ops on their stream, so the report equals the CPU's."""
    import cupy

    expected = _overflow_swa_and_sweep(Tiny("cpu", verify_capacity=10, swa=True))
    assert expected.capacity_overflows > 0 and {e.group for e in expected} == {"full", "swa"}
    stream = cupy.cuda.Stream(non_blocking=True)
    report = _overflow_swa_and_sweep(Tiny("cuda", verify_capacity=10, swa=True, stream=stream))
    assert (report.total, report.dropped, report.capacity_overflows, report.forwards) == (
        expected.total, expected.dropped, expected.capacity_overflows, expected.forwards)
    assert _event_keys(report) == _event_keys(expected)


def _decode_run(device, frame=None, static=True, bound=False, swa_slots_given=False, before=True):
    """A prefill, then decode forwards of one geometry (so a GPU canary prepares their launches at
    the second and launches them from then on), over static buffers refilled in place or fresh
    arrays, with a KV corruption, a stale write position (write rows in both groups) and an SWA
    corruption on the way; polled after each forward. ``swa_slots_given``: the batches name their
    SWA slots; without ``before`` the decode forwards are after_forward calls alone."""
    eng = Tiny(device, swa=True, static=static, frame=frame, bound=bound, swa_slots_given=swa_slots_given)
    events = []
    eng.step({"a": 4, "b": 3})
    for forward in range(7):
        if forward == 2:
            eng.k[eng.slot("b", 1), 0, 0] += 1.0
        if forward == 5:
            eng.swa_k[int(to_numpy(eng.lut)[eng.slot("a", eng.lens["a"] - 2)]), 1, 2] -= 1.0
        eng.step({"a": 1, "b": 1}, stale_position={"b": 2} if forward == 3 else None, before=before)
        report = eng.canary.poll()
        events.append((report.total, report.capacity_overflows, _event_keys(report)))
    buffers = [to_numpy(group.ctx.canary_buf) for group in eng.canary.groups]
    return eng, events, buffers


@requires_gpu
@pytest.mark.parametrize("static", [True, False], ids=["static", "fresh"])
@pytest.mark.parametrize("frame", ["cupy", "torch"])
def test_prepared_launches_match_the_cpu(frame, static):
    """A GPU canary launches prepared launches from the second meeting of a batch geometry on
    (plans, writes, the SWA slots' translation), over the same buffers or fresh arrays at other
    addresses, without validating or converting again: its reports and canary buffers equal the
    CPU's forward by forward. A misaligned array of a prepared geometry is still refused, and so is
    a torch tensor of one whose memory holds other values than it shows (its negative bit set)."""
    import cupy

    if frame == "torch":
        torch = pytest.importorskip("torch")
        frame_fn = torch.from_dlpack
    else:
        frame_fn = None
    _, expected, expected_buffers = _decode_run("cpu")
    assert [total for total, _, _ in expected] == [0, 0, 2, 4, 8, 8, 8]
    kinds = {key[:2] for _, _, keys in expected for key in keys}
    assert {("full", "head"), ("full", "write"), ("swa", "head"), ("swa", "write")} <= kinds
    eng, events, buffers = _decode_run("cuda", frame_fn, static)
    assert events == expected
    for ours, theirs in zip(buffers, expected_buffers):
        assert np.array_equal(ours, theirs)
    canary = eng.canary
    assert len(canary._prepared_plans.prepared) == 1 and len(canary._prepared_writes.prepared) == 1
    assert next(iter(canary._prepared_writes.prepared.values())).translate is not None
    if frame == "cupy":
        i64 = lambda values: cupy.asarray(np.asarray(values, np.int64))  # noqa: E731
        raw = cupy.zeros(8 * 3, cupy.uint8)
        misaligned = raw[4:20].view(cupy.int64)
        misaligned[...] = i64([5, 5])
        batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=misaligned, extend_seq_lens=i64([1, 1]),
                                input_ids=i64([1, 2]), positions=i64([5, 5]), out_cache_loc=i64([60, 61]))
        forwards = canary.forwards
        with pytest.raises(ValueError, match=r"^kv-canary: prefix_lens must be 8-byte aligned"):
            canary.before_forward(batch)
        assert canary.forwards == forwards
    else:
        t64 = lambda values: torch.as_tensor(np.asarray(values, np.int64), device="cuda")  # noqa: E731
        negated = t64([-5, -5])._neg_view()
        assert negated.is_neg() and negated.tolist() == [5, 5]
        batch = kc.ForwardBatch(req_pool_indices=t64([1, 2]), prefix_lens=negated, extend_seq_lens=t64([1, 1]),
                                input_ids=t64([1, 2]), positions=t64([5, 5]), out_cache_loc=t64([60, 61]))
        forwards = canary.forwards
        with pytest.raises(ValueError, match=r"^kv-canary: \S*prefix_lens must hold its values in memory, got a "
                                             r"torch tensor with its negative bit set"):
            canary.before_forward(batch)
        assert canary.forwards == forwards


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("form", ["swa slots given", "after_forward alone"])
def test_prepared_launches_of_given_swa_slots_and_of_an_after_forward_alone_match_the_cpu(device, form):
    """Two more ways a batch geometry comes back: batches that name their SWA slots (the prepared
    write binds them, no translation), and decode forwards that call after_forward alone (planned
    there, and prepared there at the second meeting). Each reports what the usual run reports,
    less its HEAD rows where no before_forward ran, and leaves the same canary buffers; on a GPU
    it equals the CPU forward by forward, its plans and writes prepared once."""
    options = {"swa_slots_given": True} if form == "swa slots given" else {"before": False}
    _, expected, expected_buffers = _decode_run("cpu", **options)
    _, usual, usual_buffers = _decode_run("cpu")
    kept = (lambda key: True) if form == "swa slots given" else (lambda key: key[1] != "head")
    assert [sorted(keys) for _, _, keys in expected] == [sorted(filter(kept, keys)) for _, _, keys in usual]
    assert [total for total, _, _ in expected][-1] > 0
    assert all(np.array_equal(ours, theirs) for ours, theirs in zip(expected_buffers, usual_buffers))
    eng, events, buffers = _decode_run(device, **options)
    assert events == expected
    for ours, theirs in zip(buffers, expected_buffers):
        assert np.array_equal(ours, theirs)
    if device == "cuda":
        canary = eng.canary
        assert len(canary._prepared_plans.prepared) == 1 and len(canary._prepared_writes.prepared) == 1
        prepared_writes = next(iter(canary._prepared_writes.prepared.values()))
        assert (prepared_writes.translate is None) == (form == "swa slots given")


def _forward_frames() -> list[dict]:
    """A prefill of two requests and five decode forwards: each forward's table and batch values."""
    table = np.zeros((ROWS, WIDTH), np.int32)
    lens, next_slot, frames = {1: 0, 2: 0}, 1, []
    for extend in [{1: 4, 2: 3}] + [{1: 1, 2: 1}] * 5:
        ids, positions, loc = [], [], []
        for row, count in extend.items():
            for position in range(lens[row], lens[row] + count):
                table[row, position] = next_slot
                ids.append(1000 * row + position)
                positions.append(position)
                loc.append(next_slot)
                next_slot += 1
        frames.append({"req_to_token": table.copy(), "req_pool_indices": list(extend),
                       "prefix_lens": [lens[row] for row in extend], "extend_seq_lens": list(extend.values()),
                       "input_ids": ids, "positions": positions, "out_cache_loc": loc})
        for row, count in extend.items():
            lens[row] += count
    return frames


class _Engine:
    """Runs ``_forward_frames`` through a canary with an SWA group and no real-KV sources, refilling
    one array a field and length in place each forward (the table included), on the host."""

    device = "cpu"

    def zeros(self, name: str, shape):
        return np.zeros(shape, np.int32 if name == "req_to_token" else np.int64)

    def fill(self, target, values) -> None:
        target[...] = values

    def forward(self, canary: kc.Canary, batch: kc.ForwardBatch) -> None:
        one_forward(canary, batch)

    def run(self):
        """Each forward's events, the canary buffer, and the canary."""
        frames = _forward_frames()
        caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=WIDTH,
                                       pool_slot_count=SLOTS, max_prefill_tokens=64)
        arrays = {("req_to_token", 0): self.zeros("req_to_token", (ROWS, WIDTH))}
        lut = np.arange(SLOTS + 1, dtype=np.int64)[::-1] % SLOTS  # an SWA group whose slots are translated
        swa = kc.SwaGroup(window=4, lut=self.zeros("lut", lut.shape), num_slots=SLOTS)
        self.fill(swa.lut, lut)
        canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=arrays[("req_to_token", 0)],
                           device=self.device, swa=swa)
        events = []
        for frame in frames:
            fields = {}
            for name, values in frame.items():
                key = (name, 0 if name == "req_to_token" else len(values))
                target = arrays.setdefault(key, self.zeros(name, np.shape(values)))
                self.fill(target, np.asarray(values))
                fields[name] = target
            del fields["req_to_token"]
            self.forward(canary, kc.ForwardBatch(**fields))
            report = canary.poll()
            events.append((report.total, _event_keys(report)))
        return events, [to_numpy(group.ctx.canary_buf) for group in canary.groups], canary


class _LateTorchEngine(_Engine):
    """The same forwards in CUDA torch tensors that a side torch stream, current during the canary's
    calls, fills late (after a spin), while the canary launches on a third, non-blocking CuPy stream:
    only a wait for torch's stream orders the canary's reads after the fill."""

    device = "cuda"

    def __init__(self, torch):
        import cupy

        self.torch = torch
        self.side = torch.cuda.Stream()
        self.launch_stream = cupy.cuda.Stream(non_blocking=True)

    def zeros(self, name: str, shape):
        return self.torch.zeros(shape, dtype=self.torch.int32 if name == "req_to_token" else self.torch.int64,
                                device="cuda")

    def fill(self, target, values) -> None:
        source = self.torch.as_tensor(values, device="cuda").to(target.dtype)
        self.side.wait_stream(self.torch.cuda.current_stream())
        with self.torch.cuda.stream(self.side):
            self.torch.cuda._sleep(20_000_000)  # each copy about 10 ms late
            target.copy_(source)
        source.record_stream(self.side)  # torch must not hand its memory to the next source before the copy

    def forward(self, canary: kc.Canary, batch: kc.ForwardBatch) -> None:
        with self.torch.cuda.stream(self.side):
            canary.before_forward(batch, stream=self.launch_stream)
            canary.after_forward(batch, stream=self.launch_stream)
        self.launch_stream.synchronize()
        self.torch.cuda.synchronize()


@requires_gpu
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "control"])
def test_torch_batches_are_read_after_torchs_stream_on_the_stream_given(monkeypatch, ordered):
    """A table and batch arrays that torch fills on its current stream are read only after that
    fill by the stream passed as ``stream=`` (neither torch's current stream nor CuPy's), on the
    validating forwards and the prepared ones alike: the canary equals the CPU's forward by forward.
    The control, with the wait taken out, reads them early and differs."""
    torch = pytest.importorskip("torch")
    from kvcanary_cupy import session

    expected_events, expected_buffers, _ = _Engine().run()
    assert [total for total, _ in expected_events] == [0] * 6 and all(np.any(b) for b in expected_buffers)
    if not ordered:
        monkeypatch.setattr(session, "order_after_torch", lambda index: None)
    events, buffers, canary = _LateTorchEngine(torch).run()
    same = events == expected_events and all(np.array_equal(*pair) for pair in zip(buffers, expected_buffers))
    if ordered:
        assert same
        assert len(canary._prepared_plans.prepared) == 1 and len(canary._prepared_writes.prepared) == 1
    else:
        assert not same


@pytest.mark.parametrize("device", BACKENDS)
def test_static_forwards_match_eager_forwards(device):
    """Forwards through StaticForwards (one a batch shape, over arrays refilled in place) report what
    eager forwards on the CPU report, mapped to the same requests, positions and steps, and leave
    the same canary buffers: KV and SWA corruptions and a stale write position included."""
    _, expected, expected_buffers = _decode_run("cpu")
    eng, events, buffers = _decode_run(device, bound=True)
    assert events == expected
    assert {key[6] for _, _, keys in events for key in keys} != {None}
    for ours, theirs in zip(buffers, expected_buffers):
        assert np.array_equal(ours, theirs)
    assert len(eng.bound) == 2 and eng.canary.forwards == 0


@pytest.mark.parametrize("device", BACKENDS)
def test_static_forwards_count_overflows_and_mix_with_eager_ones(device):
    """A StaticForward's plan overflowing the verify capacity is counted as an eager one is; eager
    forwards and a sweep between static ones find what they find on the CPU's eager run."""
    expected = _overflow_swa_and_sweep(Tiny("cpu", verify_capacity=10, swa=True))
    eng = Tiny(device, verify_capacity=10, swa=True, bound=True)
    eng.step({"a": 6, "b": 2})
    eng.bound = None  # the next forward eager, over the same buffers
    eng.step({"a": 1, "b": 1})
    eng.bound = {}
    eng.swa_k[int(to_numpy(eng.lut)[eng.slot("a", 5)]), 0, 0] += 1.0
    eng.k[eng.slot("b", 1), 1, 3] -= 1.0
    eng.step({"a": 1, "b": 1})
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), device),
                                     seq_lens=to_device(np.array([8, 4], np.int64), device), req_ids=["a", "b"]))
    report = eng.canary.poll()
    assert expected.capacity_overflows > 0
    assert (report.total, report.dropped, report.capacity_overflows) == (
        expected.total, expected.dropped, expected.capacity_overflows)
    assert _event_keys(report) == _event_keys(expected)  # steps included: static runs are numbered among the forwards


@pytest.mark.parametrize("device", BACKENDS)
def test_static_forward_checks_its_batch_once_and_follows_the_mode(device):
    """A static forward is checked when it is built, whatever the mode (a rejected one changes
    nothing); ``before``/``after`` read the mode when called."""
    eng = _warm(device)
    before = _state(eng.canary)
    int32 = to_device(np.array([3], np.int32), device)
    with pytest.raises(TypeError, match=r"^kv-canary: prefix_lens must have dtype int64"):
        eng.canary.static_forward(_batch(device, prefix_lens=int32))
    with pytest.raises(TypeError, match=r"^kv-canary: input_ids must have dtype int64"):
        eng.canary.static_forward(_batch(device, input_ids=to_device(np.array([7.0]), device)))
    with pytest.raises(ValueError, match=r"^kv-canary: req_ids must have at most one id per batch row"):
        eng.canary.static_forward(_batch(device, req_ids=["a", "b"]))
    _assert_same(before, _state(eng.canary))
    assert all(not group.static_log for group in eng.canary.groups)
    off = Tiny(device, mode="off")
    with pytest.raises(TypeError, match=r"^kv-canary: input_ids must have dtype int64"):
        off.canary.static_forward(_batch(device, input_ids=int32))
    forward = off.canary.static_forward(_batch(device))
    forward.before()
    forward.after()
    assert not np.any(to_numpy(off.canary.context.canary_buf))
    off.canary.mode = "log"
    forward.before()
    forward.after()
    assert np.any(to_numpy(off.canary.context.canary_buf)) and off.canary.poll().forwards == 1


def _decode_of_a(device, **tiny) -> tuple[Tiny, kc.StaticForward]:
    """a's 4-token prompt run eagerly, and a static forward of its next token (position 4, slot 60)."""
    eng = Tiny(device, **tiny)
    eng.step({"a": 4})
    i64 = int64s_on(device)
    eng.set_table(np.s_[1, 4], 60)
    return eng, eng.canary.static_forward(kc.ForwardBatch(
        req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([1]), input_ids=i64([1004]),
        positions=i64([4]), out_cache_loc=i64([60]), req_ids=["a"]))


def _next_decode_of_a_is_clean(eng: Tiny, *, next_slot: int, forwards: int) -> None:
    """a's token at position 5 decoded eagerly into ``next_slot`` after :func:`_decode_of_a`'s
    forward: the poll reports nothing after ``forwards`` forwards, and slot 60 holds position 4 as
    that forward wrote it."""
    eng.lens["a"], eng.next_slot = 5, next_slot
    eng.step({"a": 1})
    report = eng.canary.poll()
    assert not report and report.forwards == forwards
    assert eng.canary.context.slot_fields(60)["position"] == 4


@pytest.mark.parametrize("device", BACKENDS)
def test_a_static_forward_switched_on_between_before_and_after_plans_its_own_batch(device):
    """``before()`` while the canary is off plans nothing; switched on, ``after()`` plans its batch
    (a forward of its own, as an ``after_forward`` with no ``before_forward``) instead of writing
    with the plans of the forward before: every token is fingerprinted where it belongs."""
    eng, forward = _decode_of_a(device)
    eng.canary.mode = "off"
    forward.before()
    eng.canary.mode = "log"
    forward.after()
    _next_decode_of_a_is_clean(eng, next_slot=61, forwards=3)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_before_forward_while_off_ends_the_forward_planned_before_it(device):
    """A ``before_forward`` while off is a forward of its own, whose plans the canary never made:
    the ``after_forward`` of that batch once on again plans it and counts it as a forward (its
    events take its own step), even when the batch is the very object a forward planned while on
    took (an engine's buffers refilled in place) and whose ``after_forward`` never came."""
    eng = Tiny(device)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    i64 = int64s_on(device)
    eng.set_table(np.s_[1, 4], 60)
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([1]),
                            input_ids=i64([1004]), positions=i64([4]), out_cache_loc=i64([60]), req_ids=["a"])
    eng.canary.before_forward(batch)  # a forward the engine dropped before it ran
    eng.canary.mode = "off"
    eng.canary.before_forward(batch)
    eng.canary.mode = "log"
    for buffer in (eng.k, eng.v):
        buffer[60] = to_device(eng.rng.standard_normal((2, 8)).astype(np.float32), device)
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.canary.after_forward(batch)
    report = eng.canary.poll()
    assert report.forwards == 3
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("tail", 3, "a", 1)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("static", [False, True])
def test_a_forward_whose_after_came_while_off_leaves_nothing_planned(device, static, caplog):
    """A forward planned while on whose ``after_forward`` (or ``after()``) came while off is over:
    the next forward's ``before_forward`` while on warns of nothing, and an ``after_forward`` whose
    ``before_forward`` came while off, once switched on, is a forward of its own (its events take
    its own step), not the tail of the forward switched off in the middle."""
    eng, forward = _decode_of_a(device)
    i64 = int64s_on(device)
    if static:
        forward.before()
        eng.canary.mode = "off"
        forward.after()
    else:
        eng.canary.before_forward(forward.batch)
        eng.canary.mode = "off"
        eng.canary.after_forward(forward.batch)
    assert not eng.canary.poll() and eng.canary.poll().forwards == 2  # the one owed, then none
    eng.set_table(np.s_[1, 5], 61)
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([5]), extend_seq_lens=i64([1]),
                            input_ids=i64([1005]), positions=i64([5]), out_cache_loc=i64([61]), req_ids=["a"])
    eng.canary.before_forward(batch)
    eng.canary.mode = "log"
    eng.k[eng.slot("a", 1), 0, 0] += 1.0  # during that forward, after its HEAD verify was skipped
    eng.canary.after_forward(batch)
    report = eng.canary.poll()
    assert report.forwards == 3
    # position 4 was written while off: no record (as the mode's docs say), which its reader and
    # the chain-position assert of its successor's write report
    assert {(e.phase, e.step, e.request, e.position) for e in report} == {
        ("tail", 3, "a", 1), ("tail", 3, "a", 4), ("write", 3, "a", 5)}
    eng.canary.mode = "off"
    eng.canary.before_forward(batch)
    eng.canary.mode = "log"
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        one_forward(eng.canary, batch)
    assert "had no after" not in caplog.text
    assert eng.canary.poll().forwards == 4


@pytest.mark.parametrize("device", BACKENDS)
def test_a_report_whose_rows_the_ring_dropped_is_true(device):
    """A ring of no row keeps none of what it counts: the report has no event, but it found
    violations, and says so."""
    eng = Tiny(device, ring_capacity=0)
    eng.step({"a": 3})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    report = eng.canary.poll()
    assert report and not report.events and report.dropped == report.total == 2


@pytest.mark.parametrize("device", BACKENDS)
def test_a_static_before_while_off_ends_the_forward_planned_before_it(device):
    """A static forward's ``before()`` while off is a forward of its own, as a ``before_forward``
    while off is: the ``after_forward`` of the batch planned before it, once on again, plans that
    batch and counts a forward of its own."""
    eng, forward = _decode_of_a(device)
    eng.canary.before_forward(forward.batch)  # a forward the engine dropped before it ran
    eng.canary.mode = "off"
    forward.before()
    eng.canary.mode = "log"
    for buffer in (eng.k, eng.v):
        buffer[60] = to_device(eng.rng.standard_normal((2, 8)).astype(np.float32), device)
    eng.canary.after_forward(forward.batch)
    assert eng.canary.poll().forwards == 3


@pytest.mark.parametrize("device", BACKENDS)
def test_a_static_after_behind_another_batchs_before_forward_plans_its_own(device):
    """``after()`` whose ``before()`` did not run last (another batch's ``before_forward`` did, a
    forward dropped before it ran) plans its own batch, a forward of its own, rather than write with
    the other batch's plans: its token is fingerprinted where it belongs."""
    eng, forward = _decode_of_a(device)
    i64 = int64s_on(device)
    eng.set_table(np.s_[2, :2], [61, 62])
    eng.canary.before_forward(kc.ForwardBatch(
        req_pool_indices=i64([2]), prefix_lens=i64([0]), extend_seq_lens=i64([2]), input_ids=i64([2000, 2001]),
        positions=i64([0, 1]), out_cache_loc=i64([61, 62]), req_ids=["b"]))
    for buffer in (eng.k, eng.v):
        buffer[60] = to_device(eng.rng.standard_normal((2, 8)).astype(np.float32), device)
    forward.after()
    _next_decode_of_a_is_clean(eng, next_slot=63, forwards=4)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("static", [False, True])
def test_an_after_forward_while_off_ends_the_forward_before_it(device, static, caplog):
    """A forward planned while on whose ``after_forward`` (or ``after()``) came while off is over:
    switched on, the next forward's ``before_forward`` warns of nothing, and its tokens are
    fingerprinted."""
    eng, forward = _decode_of_a(device)
    before, after = (forward.before, forward.after) if static else (
        lambda: eng.canary.before_forward(forward.batch), lambda: eng.canary.after_forward(forward.batch))
    before()
    eng.canary.mode = "off"
    after()
    eng.canary.mode = "log"
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.step({"b": 3})
    assert "had no after" not in caplog.text
    assert eng.canary.context.slot_fields(eng.slot("b", 2))["token"] == 2002


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", ["log", "raise"])
def test_the_first_poll_after_switching_off_reports_the_forwards_before_it(device, mode, caplog):
    """Switched off with forwards not yet polled, the canary owes them one poll: the first poll
    while it is off reports their rows, named and numbered from their batches, and logs or raises
    as the mode it was switched off from (an engine that never switches it on again still hears of
    them); later polls while off return at once."""
    eng = Tiny(device, mode=mode)
    eng.step({"a": 4})
    eng.step({"b": 4})
    assert not eng.canary.poll()
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    eng.canary.mode = "off"
    eng.lens["a"] += 1
    eng.step({"b": 1})
    expected = [("head", 3, "a", 1), ("tail", 3, "a", 1)]
    with caplog.at_level(logging.WARNING):
        if mode == "raise":
            with pytest.raises(kc.CanaryViolation) as info:
                eng.canary.poll()
            report = info.value.report
        else:
            report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == expected
    assert report.forwards == 3
    assert ("REAL_KV_HASH" in caplog.text) == (mode == "log")
    later = eng.canary.poll()
    assert not later and later.total == 0 and later.forwards == 3
    eng.canary.mode = mode
    assert not eng.canary.poll()


@pytest.mark.parametrize("device", BACKENDS)
def test_switching_off_again_while_off_keeps_the_poll_owed_in_the_mode_switched_off_from(device):
    """The poll owed once the canary is switched off acts as the mode it was switched off from;
    setting ``"off"`` again while it is off changes nothing of that."""
    eng = Tiny(device, mode="raise")
    eng.step({"a": 4})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    eng.canary.mode = "off"
    eng.canary.mode = "off"
    with pytest.raises(kc.CanaryViolation) as info:
        eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in info.value.report] == [("head", 2, "a", 1),
                                                                                      ("tail", 2, "a", 1)]


@pytest.mark.parametrize("device", BACKENDS)
def test_polls_while_off_after_the_owed_one_return_at_once(device, caplog):
    """Only the first poll after switching off decodes the rings: later ones while off return at
    once, leaving rows recorded meanwhile (by a captured graph, which runs whatever the mode; here
    a verify on the canary's context) to the first poll once it is on again."""
    eng = Tiny(device, mode="raise")
    eng.step({"a": 4})
    eng.canary.mode = "off"
    assert not eng.canary.poll()
    i64 = int64s_on(device)
    vplan, wplan = kc.VerifyPlan.allocate(8, device=device), kc.WritePlan.allocate(1, device=device)
    kc.plan(vplan, wplan, req_pool_indices=i64([1]), prefix_lens=i64([4]), extend_seq_lens=i64([0]),
            req_to_token=eng.table)
    eng.k[eng.slot("a", 2), 0, 0] += 1.0
    kc.verify(eng.canary.context, vplan, tag=kc.LaunchTag.HEAD_K_FULL)
    with caplog.at_level(logging.WARNING, logger="kvcanary_cupy"):
        quiet = eng.canary.poll()
    assert not quiet and quiet.total == 0 and quiet.forwards == 1 and not caplog.records
    eng.canary.mode = "log"
    found = eng.canary.poll()
    assert found.total == 1 and [(e.phase, e.slot) for e in found] == [("head", eng.slot("a", 2))]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_static_forward_let_go_without_close_is_closed(device):
    """A static forward the engine drops without ``close()`` is closed once collected: the next
    poll still counts and maps its run (a bit flipped in a record of the prefix it read is
    named), then the canary keeps nothing of it."""
    eng, forward = _decode_of_a(device)
    flipped = eng.slot("a", 1)
    eng.canary.context.canary_buf[flipped, 0] ^= 1
    forward.before()
    forward.after()
    del forward
    gc.collect()
    assert all(record.closed for group in eng.canary.groups for record in group.static_log)
    report = eng.canary.poll()
    assert report.forwards == 2
    # the changed token breaks the link the next position's record holds
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 2), ("tail", 2, "a", 2)]
    assert all(not group.static_log for group in eng.canary.groups)


@pytest.mark.parametrize("retype", ["dtype", "shape"])
def test_a_static_forwards_arrays_retyped_in_place_are_polled_as_they_were_bound(retype):
    """The engine's array objects reshaped or re-typed in place after the static forward was built
    reach neither its launches nor the poll that maps their rows (which reads them as bound), so
    the poll names the request as it would have, and the polls after it still work."""
    eng, forward = _decode_of_a("cpu")
    eng.canary.context.canary_buf[eng.slot("a", 1), 0] ^= 1
    forward.before()
    forward.after()
    if retype == "dtype":
        forward.batch.req_pool_indices.dtype = np.int32  # two rows now, beside one prefix length
    else:
        for name in ("req_pool_indices", "prefix_lens", "out_cache_loc"):
            getattr(forward.batch, name).shape = (1, 1)
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 2, "a", 2), ("tail", 2, "a", 2)]
    assert not eng.canary.poll()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("change", ["retyped", "retyped-float", "reshaped", "resized", "torch-float"])
def test_an_eager_batch_changed_in_place_before_the_poll_leaves_its_rows_unplaced(device, change, caplog):
    """An engine that re-types (to another integer type or to floats), reshapes or resizes a batch's
    array object in place between the forward and the poll, or puts a float tensor of torch's in its
    place: that forward's launches are left out
    of the log (a warning says so), so its rows are reported without a step or a request, and the
    polls after it work and name requests again."""
    eng = Tiny(device)
    eng.step({"a": 4})
    eng.canary.context.canary_buf[eng.slot("a", 1), 0] ^= 1
    batch = eng.step({"a": 1})
    rows = batch.req_pool_indices
    if change.startswith("retyped"):
        if device != "cpu":
            pytest.skip("CuPy arrays cannot be re-typed in place")
        # two rows now, beside one prefix length; or the same row's bytes, read as a float
        rows.dtype = np.int32 if change == "retyped" else np.float64
    elif change == "reshaped":
        rows.shape = (1, 1)
    elif change == "torch-float":  # of the same length; torch's dtypes say what they are in their own way
        torch = pytest.importorskip("torch")
        object.__setattr__(batch, "req_pool_indices", torch.ones(1, dtype=torch.float64))
    else:  # an engine's buffer grown for a larger batch: its object now holds other rows
        object.__setattr__(batch, "req_pool_indices", to_device(np.array([1, 2], np.int64), device))
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        report = eng.canary.poll()
    assert [(e.phase, e.step, e.request) for e in report] == [("head", None, None), ("tail", None, None)]
    assert report.requests == set()  # the requests the events name: none
    assert "re-typed in place since" in caplog.text
    eng.canary.context.canary_buf[eng.slot("a", 2), 0] ^= 1
    eng.step({"a": 1})
    later = eng.canary.poll()
    assert later and {(e.step, e.request) for e in later} == {(3, "a")} and {e.position for e in later} == {2, 3}


@pytest.mark.parametrize("device", BACKENDS)
def test_a_pool_row_handed_to_a_request_sharing_a_prefix_before_the_poll_names_no_earlier_holder(device):
    """Forward 2 has a, which reads a changed slot, and b, which does not. b then finishes and its
    pool row goes to c, which shares a's first two tokens (the table row now holds that slot), and
    forward 3 has c. Read through the table as it is at the poll, b's entry in forward 2 would fit
    the slot; forward 3 shows the row holding another request, so forward 2's rows name a alone,
    and forward 3's name c."""
    eng = Tiny(device)
    eng.step({"a": 4, "b": 3})
    assert not eng.canary.poll()
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1, "b": 1})
    eng.rows["c"], eng.lens["c"] = eng.rows.pop("b"), 2
    shared = to_numpy(eng.table)[eng.rows["a"], :2]
    eng.set_table(np.s_[eng.rows["c"]], np.r_[shared, np.zeros(WIDTH - len(shared), np.int32)])
    eng.step({"c": 1})
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == [
        ("head", 2, "a", 1), ("tail", 2, "a", 1), ("head", 3, "c", 1), ("tail", 3, "c", 1)]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_of_a_record_a_copy_replaced_before_the_poll_name_no_later_reader_of_the_slot(device):
    """a's first slot holds b's record (a slot handed out while in use) when forward 2 reads it.
    a then finishes and its pool row goes to c; a compaction moves c's first token, KV and
    record (kc.copy_records), into that freed slot, and forward 4 reads it there, clean. Nothing
    the canary logged wrote the slot, and its record now is not the one forward 2's rows hold: as
    the tables are now, only c's forwards check the slot, but c never read the old record. Those
    rows get their phase alone; forward 4 finds nothing."""
    eng = Tiny(device)
    eng.step({"a": 4, "b": 3})
    assert not eng.canary.poll()
    stolen = eng.slot("a", 0)
    kc.copy_records(src=eng.canary.context, dst=eng.canary.context, src_slots=int64s_on(device)([eng.slot("b", 2)]),
                    dst_slots=int64s_on(device)([stolen]))
    eng.step({"a": 1})
    eng.rows["c"], eng.lens["c"] = eng.rows.pop("a"), 0
    eng.set_table(np.s_[eng.rows["c"]], np.zeros(WIDTH, np.int32))
    eng.step({"c": 2})
    old = eng.slot("c", 0)
    for buf in (eng.k, eng.v):
        buf[stolen] = buf[old]
    kc.copy_records(src=eng.canary.context, dst=eng.canary.context, src_slots=int64s_on(device)([old]),
                    dst_slots=int64s_on(device)([stolen]))
    eng.set_table((eng.rows["c"], 0), stolen)
    eng.step({"c": 1})
    report = eng.canary.poll()
    assert report and all(event.request != "c" for event in report)
    assert {(e.phase, e.step, e.request, e.position) for e in report if e.slot == stolen} == {
        ("head", None, None, None), ("tail", None, None, None)}


class _InterruptedOnce:
    """A logger that raises KeyboardInterrupt at its first warning, as an engine's logger can when
    the process is interrupted, and takes the later ones."""

    def __init__(self):
        self.interrupted = False
        self.messages: list = []

    def warning(self, message):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        self.messages.append(message)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("interrupted", [False, True])
def test_rows_of_a_batch_changed_in_place_are_not_given_the_step_of_a_clean_reader(device, interrupted):
    """Forward 2 reads a's slot clean; it goes bad; forward 3 reads it, and its batch is reshaped in
    place before the poll. Forward 3's launches are left out of the log, but its rows fit forward
    2's entries as the tables are now: they get neither forward 2's step nor a name, since any
    HEAD or TAIL row may be forward 3's. A poll interrupted once it has left them out (its logger
    interrupted at the warning saying so) leaves the next poll as unsure of its log."""
    logger = _InterruptedOnce() if interrupted else None
    eng = Tiny(device, logger=logger)
    eng.step({"a": 4})
    eng.step({"a": 1})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    batch = eng.step({"a": 1})
    batch.req_pool_indices.shape = (1, 1)
    if interrupted:
        with pytest.raises(KeyboardInterrupt):
            eng.canary.poll()
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", None, None, None),
                                                                         ("tail", None, None, None)]
    eng.step({"a": 1})
    assert {(e.step, e.request) for e in eng.canary.poll()} == {(4, "a")}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("change", ["input_ids", "positions", "out_cache_loc"])
def test_a_write_whose_token_arrays_changed_in_place_leaves_its_rows_unplaced(device, change, caplog):
    """The arrays only a write reads (its entries' ids and slots) changed in place between the
    forward and the poll: that forward's write launch is left out of the log, as any launch whose
    arrays changed is (a warning says so), though the same batch's verify launches, which read
    neither, are kept."""
    eng = Tiny(device)
    eng.step({"a": 4})
    batch = eng.step({"a": 1}, stale_position={"a": 2})
    getattr(batch, change).shape = (1, 1)
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        report = eng.canary.poll()
    assert "re-typed in place since" in caplog.text
    assert report and all((e.phase, e.step, e.request) == ("write", None, None) for e in report)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("field", ["input_ids", "positions"])
def test_a_write_whose_ids_or_positions_shrank_before_the_poll_leaves_its_rows_unplaced(device, field, caplog):
    """An engine's token array resized between the forward and the poll to fewer entries than the
    write's slots (its buffer swapped for a smaller batch's): the write's rows are reported
    unplaced, with a warning, rather than this poll and every later one failing on an index past
    the array, and the forwards after it are named again."""
    eng = Tiny(device)
    eng.step({"a": 4})
    batch = eng.step({"a": 2}, stale_position={"a": 2})
    object.__setattr__(batch, field, to_device(np.zeros(0, np.int64), device))
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        report = eng.canary.poll()
    assert "re-typed in place since" in caplog.text
    assert [(e.phase, e.step, e.request) for e in report] == [("write", None, None)]
    assert not eng.canary.poll()
    eng.step({"a": 1})  # it reads the positions the stale write left without the records they need
    later = eng.canary.poll()
    assert later and {(e.step, e.request) for e in later} == {(3, "a")}


def _next_token_of_a(eng: Tiny, **fields) -> kc.ForwardBatch:
    """A batch of a's next token, its slot set in a's table row (and ``fields`` added), for a test
    that calls the canary itself."""
    position, slot = eng.lens["a"], eng.next_slot
    eng.set_table(np.s_[eng.rows["a"], position], slot)
    eng.lens["a"], eng.next_slot = position + 1, slot + 1
    eng.k[slot] = to_device(eng.rng.standard_normal((2, 8)).astype(np.float32), eng.device)
    i64 = int64s_on(eng.device)
    return kc.ForwardBatch(req_pool_indices=i64([eng.rows["a"]]), prefix_lens=i64([position]),
                           extend_seq_lens=i64([1]), input_ids=i64([1000 * eng.rows["a"] + position]),
                           positions=i64([position]), out_cache_loc=i64([slot]), req_ids=["a"],
                           **{name: i64(values) for name, values in fields.items()})


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("swa", [False, True])
@pytest.mark.parametrize("change", ["reshaped", "grown"])
def test_a_forward_of_after_forward_alone_whose_token_arrays_changed_keeps_its_verify(device, swa, change, caplog):
    """A forward of ``after_forward`` alone logs its write before its TAIL verify, over one batch:
    its token arrays reshaped (or grown in place, for a larger batch: no longer one per slot
    written) before the poll leave the write out of the log, not the verify, which reads neither,
    and whose row names a's position (with no step: the log is not whole). The warning counts the
    writes left out in every group."""
    eng = Tiny(device, swa=swa)
    eng.step({"a": 4})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    batch = _next_token_of_a(eng)
    eng.canary.after_forward(batch)
    if change == "reshaped":
        batch.input_ids.shape = (1, 1)
    elif device != "cpu":
        pytest.skip("CuPy arrays cannot be grown in place")
    else:
        batch.input_ids.resize(3, refcheck=False)
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        report = eng.canary.poll()
    assert (f"kv-canary: {2 if swa else 1} launch(es) since the last poll() read batch arrays that have been "
            f"reshaped") in caplog.text
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("tail", None, "a", 1)]


@pytest.mark.parametrize("device", BACKENDS)
def test_expected_valid_lens_changed_in_place_leave_the_forwards_rows_unplaced(device, caplog):
    """A canary that checks expected tokens reads ``expected_valid_lens`` to name a row: resized in
    place before the poll, it leaves its forward's launches out of the log, as the other arrays
    the mapping reads do, with a warning."""
    expected = np.add.outer(1000 * np.arange(ROWS), np.arange(WIDTH)).astype(np.int32)  # Tiny's tokens
    eng = Tiny(device, expected_tokens=to_device(expected, device))
    eng.step({"a": 4})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    batch = _next_token_of_a(eng, expected_valid_lens=[4])
    one_forward(eng.canary, batch)
    object.__setattr__(batch, "expected_valid_lens", to_device(np.array([4, 4], np.int64), device))
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        report = eng.canary.poll()
    assert "re-typed in place since" in caplog.text
    assert [(e.phase, e.step, e.request, e.reasons) for e in report] == [("head", None, None, ("REAL_KV_HASH",)),
                                                                         ("tail", None, None, ("REAL_KV_HASH",))]


@pytest.mark.parametrize("device", BACKENDS)
def test_forwards_past_max_logged_forwards_are_checked_but_not_logged(device, caplog):
    """An engine that polls rarely holds the batches of at most ``max_logged_forwards`` forwards:
    later ones are still checked, fingerprinted and counted, their rows reported at the next poll
    without step or request (a warning says so, once), the logged forwards' rows with theirs; after
    the poll, forwards are logged again."""
    eng = Tiny(device, max_logged_forwards=2)
    eng.step({"a": 4, "b": 3})
    assert not eng.canary.poll()
    slot = eng.slot("a", 1)
    eng.k[slot, 0, 0] += 1.0  # every forward of a reads it: HEAD and TAIL report it
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            eng.step({"a": 1, "b": 1})
    warned = [r for r in caplog.records if "more than 2 forwards and sweeps since the last poll()" in r.getMessage()]
    assert len(warned) == 1
    assert all(len(group.log) == 2 * 3 for group in eng.canary.groups)  # head, write and tail of two forwards
    report = eng.canary.poll()
    assert report.forwards == 6 and report.total == 10
    assert {e.slot for e in report} == {slot}
    # the logged forwards' four launches name theirs; the rows of the three forwards left out, none
    assert [(e.phase, e.step, e.request, e.position) for e in report] == \
        [(phase, step, "a", 1) for step in (2, 3) for phase in ("head", "tail")] + \
        [(phase, None, None, None) for _ in range(3) for phase in ("head", "tail")]
    eng.step({"a": 1, "b": 1})
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == [("head", 7, "a", 1),
                                                                                      ("tail", 7, "a", 1)]
    with pytest.raises(ValueError, match=r"^kv-canary: max_logged_forwards must be"):
        Tiny(device, max_logged_forwards=0)


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_before_the_first_forward_left_out_keep_the_step_of_the_forward_that_recorded_them(device):
    """Past ``max_logged_forwards``, the rows before the first forward left out are the logged
    forwards', none dropped: a slot that went bad between two logged forwards that read it is
    reported for the later one, with its step, as a poll of a whole log reports it."""
    eng = Tiny(device, max_logged_forwards=2)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    eng.step({"a": 1})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    eng.step({"a": 1})  # past the cap
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == [
        ("head", 3, "a", 1), ("tail", 3, "a", 1), ("head", None, None, None), ("tail", None, None, None)]


def _b_shares_a_first_two_tokens(eng, device) -> None:
    """a's prefill of 4 tokens, then b's table row holding a's first two slots (b has those two
    tokens), polled clean."""
    eng.step({"a": 4})
    eng.set_table(np.s_[eng.rows["b"], :2], to_numpy(eng.table)[eng.rows["a"], :2])
    eng.lens["b"] = 2
    assert not eng.canary.poll()


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_past_max_logged_forwards_go_to_the_first_forwards_as_the_log_keeps_them(device):
    """The log keeps the first forwards since the poll: the rows recorded before the first forward
    it left out are theirs, in order, with their steps, and the later ones are left unnamed. Here a
    and b (b shares a's first two tokens) read a changed slot with the same records, a in forward
    2, b in forward 3, a again in the two past the cap: the rows name a, then b, then no one."""
    eng = Tiny(device, max_logged_forwards=2)
    _b_shares_a_first_two_tokens(eng, device)
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    for extend in ({"a": 1}, {"b": 1}, {"a": 1}, {"a": 1}):
        eng.step(extend)
    report = eng.canary.poll()
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        (phase, step, request, position)
        for step, request, position in ((2, "a", 1), (3, "b", 1), (None, None, None), (None, None, None))
        for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("past_the_cap", ["sweep", "static forward"])
def test_the_first_launch_past_max_logged_forwards_ends_the_named_rows_whichever_call_makes_it(device, past_the_cap):
    """The rows named are those recorded before the first launch the log leaves out, a sweep's or
    a static forward's eager run as well as an eager forward's: one logged forward of a reads a
    changed slot (named, with its step), then a sweep or a forward past the cap reads it again
    (unnamed), and a later forward's rows are unnamed too."""
    eng = Tiny(device, bound=past_the_cap == "static forward", max_logged_forwards=1)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    if past_the_cap == "sweep":
        eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([eng.rows["a"]], np.int64), device),
                                         seq_lens=to_device(np.array([eng.lens["a"]], np.int64), device),
                                         req_ids=["a"]))
    eng.step({"a": 1})
    events = [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()]
    unnamed = (["sweep"] if past_the_cap == "sweep" else []) + ["head", "tail"]
    assert events == [("head", 2, "a", 1), ("tail", 2, "a", 1)] + [(phase, None, None, None) for phase in unnamed]


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_of_forwards_past_max_logged_forwards_never_take_a_logged_readers_name(device):
    """b's logged forward reads a slot it shares with a while the slot is sound; the slot's K bytes
    change after it, and a's forward, past the cap, records the rows. They fit b's entries as well
    as a's, but no logged launch recorded them: they are left unnamed, not given to b."""
    # under the default cap, the same forwards' rows are a's, named
    for cap, named in ((1, (None, None, None)), (1024, (3, "a", 1))):
        eng = Tiny(device, max_logged_forwards=cap)
        _b_shares_a_first_two_tokens(eng, device)
        eng.step({"b": 1})
        eng.k[eng.slot("a", 1), 0, 0] += 1.0
        eng.step({"a": 1})
        report = eng.canary.poll()
        assert report.forwards == 3
        assert [(e.phase, e.step, e.request, e.position, e.slot) for e in report] == [
            (phase, *named, eng.slot("a", 1)) for phase in ("head", "tail")]


@pytest.mark.parametrize("device", BACKENDS)
def test_graph_replays_a_poll_counted_leave_the_forwards_after_it_logged(device, monkeypatch, caplog):
    """A graph's replays (unlogged here, as a replay is) are numbered among the forwards at the poll
    that counts them, which starts the count toward ``max_logged_forwards`` again from there: the
    forwards after it are logged up to the cap, and their rows keep their steps."""
    eng = Tiny(device, bound=True, max_logged_forwards=2)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    monkeypatch.setattr(kc.session.StaticForward, "_log", lambda *args, **kwargs: None)
    for _ in range(3):
        eng.step({"a": 1})
    assert eng.canary.poll().forwards == 4
    monkeypatch.undo()
    eng.bound = eng.buffers = None  # eager forwards from here, over arrays of their own
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    with caplog.at_level(logging.WARNING, logger="kvcanary_cupy"):
        eng.step({"a": 1})
        eng.step({"a": 1})
        report = eng.canary.poll()
    assert "forwards and sweeps since the last poll()" not in caplog.text
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [
        (phase, step, "a", 1) for step in (5, 6) for phase in ("head", "tail")]


@requires_gpu
def test_a_static_forward_captured_in_a_graph_is_held_until_closed():
    """An engine that keeps only the CUDA graph of a static forward: the canary holds the forward
    (its arrays, and the buffer its graph translates SWA slots into) until ``close()``, so a replay
    after Python dropped it is counted and its rows named."""
    import cupy

    eng, forward = _decode_of_a("cuda", swa=True)
    assert not eng.canary.poll()
    for buffer in (eng.k, eng.v):
        buffer[60] = cupy.asarray(eng.rng.standard_normal((2, 8)).astype(np.float32))
    eng.swa_k[int(eng.lut[60])] = cupy.asarray(eng.rng.standard_normal((2, 8)).astype(np.float32))
    forward.before()  # once eagerly: every kernel loaded before the capture
    forward.after()
    assert not eng.canary.poll()
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        forward.before(stream=stream)
        forward.after(stream=stream)
        graph = stream.end_capture()
    del forward
    gc.collect()
    assert all(not record.closed for group in eng.canary.groups for record in group.static_log)
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    cupy.cuda.Device().synchronize()  # made on the current stream, which the replay's does not wait for
    graph.launch(stream)
    stream.synchronize()
    report = eng.canary.poll()
    assert report.forwards == 3
    assert [(e.group, e.phase, e.step, e.request, e.position) for e in report] == [
        ("full", "head", 3, "a", 1), ("full", "tail", 3, "a", 1)]
    eng.canary.groups[0].static_log[0].captured.close()
    eng.canary.poll()
    assert all(not group.static_log for group in eng.canary.groups)


@pytest.mark.parametrize("device", BACKENDS)
def test_sweeps_count_toward_max_logged_forwards(device):
    """Sweeps between two polls count as forwards do: an idle engine that sweeps and polls rarely
    holds a bounded log too."""
    eng = Tiny(device, max_logged_forwards=3)
    eng.step({"a": 3})
    i64 = int64s_on(device)
    for _ in range(20):
        eng.canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([3]), req_ids=["a"]))
    assert all(len(group.log) == 3 + 2 for group in eng.canary.groups)  # the forward's three, two sweeps
    assert not eng.canary.poll() and all(not group.log for group in eng.canary.groups)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_poll_starts_the_count_of_sweeps_toward_max_logged_forwards_again(device, caplog):
    """The cap bounds the forwards and sweeps since the previous poll, not since the canary was
    built: an engine that sweeps and polls after every forward never reaches it, and its rows keep
    their steps and requests."""
    eng = Tiny(device, max_logged_forwards=2)
    i64 = int64s_on(device)
    with caplog.at_level(logging.WARNING, logger="kvcanary_cupy"):
        eng.step({"a": 3})
        for _ in range(4):
            eng.canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([eng.lens["a"]]),
                                             req_ids=["a"]))
            assert not eng.canary.poll()
            eng.step({"a": 1})
        eng.k[eng.slot("a", 1), 0, 0] += 1.0
        eng.canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([eng.lens["a"]]), req_ids=["a"]))
        report = eng.canary.poll()
    assert "forwards and sweeps since the last poll()" not in caplog.text
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("sweep", 5, "a", 1)]


def test_the_mode_is_checked_when_set_and_the_forwards_kept_while_off():
    eng = Tiny("cpu")
    eng.step({"a": 3})
    with pytest.raises(ValueError, match=r"^kv-canary: mode must be one of \('off', 'log', 'raise'\), got 'loud'"):
        eng.canary.mode = "loud"
    assert eng.canary.mode == "log"
    eng.canary.mode = "off"
    eng.step({"a": 1})
    assert eng.canary.poll().forwards == 1  # counted until it was switched off


class _Requests:
    """Static forwards over a 6-row table with per-layer K on ``device``, the engine's batches
    refilled in place (their ``req_ids`` lists too)."""

    def __init__(self, device):
        self.device = device
        self.table = to_device(np.zeros((6, WIDTH), np.int32), device)
        self.k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        caps = kc.Capacities.from_args(req_to_token_pool_size=6, max_seq_len_per_req=WIDTH, pool_slot_count=SLOTS,
                                       max_prefill_tokens=64)
        self.canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=self.table, device=device,
                                real_kv_sources=kc.layouts.per_layer([self.k]), hash_mode=kc.HashMode.ALL)
        self.rng = np.random.default_rng(1)

    def arrays(self, bs: int, n: int) -> dict:
        zeros = lambda count: to_device(np.zeros(count, np.int64), self.device)  # noqa: E731
        return dict(req_pool_indices=zeros(bs), prefix_lens=zeros(bs), extend_seq_lens=zeros(bs), input_ids=zeros(n),
                    positions=zeros(n), out_cache_loc=zeros(n))

    def fill(self, arrays: dict, requests: list) -> None:
        """``requests``: (pool row, prefix length, new slots) each."""
        table = to_numpy(self.table).copy()
        ids, positions, loc = [], [], []
        for row, prefix, slots in requests:
            for j, slot in enumerate(slots):
                table[row, prefix + j] = slot
                ids.append(1000 * row + prefix + j)
                positions.append(prefix + j)
                loc.append(slot)
        self.table[...] = to_device(table, self.device)
        for name, values in (("req_pool_indices", [r[0] for r in requests]), ("prefix_lens", [r[1] for r in requests]),
                             ("extend_seq_lens", [len(r[2]) for r in requests]), ("input_ids", ids),
                             ("positions", positions), ("out_cache_loc", loc)):
            arrays[name][...] = to_device(np.asarray(values, np.int64), self.device)

    def run(self, forward: kc.StaticForward) -> None:
        forward.before()
        loc = forward.batch.out_cache_loc
        self.k[loc] = to_device(self.rng.standard_normal((int(loc.shape[0]), 2, 8)).astype(np.float32), self.device)
        forward.after()


@pytest.mark.parametrize("device", BACKENDS)
def test_static_forward_rows_are_mapped_by_the_forwards_that_ran(device):
    """poll maps a row only to static forwards that ran since the previous poll, reading their arrays
    and their req_ids lists as the engine left them; a closed forward maps nothing."""
    eng = _Requests(device)
    prefill, prefill_ids = eng.arrays(2, 8), ["x", "w"]
    eng.fill(prefill, [(1, 0, [1, 2, 3, 4]), (2, 0, [5, 6, 7, 8])])
    first = eng.canary.static_forward(kc.ForwardBatch(**prefill, req_ids=prefill_ids))
    eng.run(first)
    assert eng.canary.poll().total == 0
    # x and w finish; y takes pool row 1 and z row 2, the same batch shape with other contents
    eng.fill(prefill, [(1, 0, [10, 11, 12, 13]), (2, 0, [14, 15, 16, 17])])
    prefill_ids[:] = ["y", "z"]
    eng.run(first)
    decode, decode_ids = eng.arrays(2, 2), ["z", "y"]
    second = eng.canary.static_forward(kc.ForwardBatch(**decode, req_ids=decode_ids))
    assert eng.canary.poll().total == 0
    # stale contents in the prefill forward's arrays, which would name y's slots after x: only the
    # decode forward runs
    prefill["prefix_lens"][...] = to_device(np.array([4, 4], np.int64), device)
    prefill_ids[:] = ["x", "w"]
    eng.fill(decode, [(2, 4, [30]), (1, 4, [31])])
    eng.k[11, 0, 0] += 1.0  # y's position 1
    eng.run(second)
    report = eng.canary.poll()
    assert report.forwards == 3
    assert sorted((e.phase, e.request, e.position, e.step) for e in report) == [
        ("head", "y", 1, 3), ("tail", "y", 1, 3)]
    # closed after a run: the next poll still counts and maps it, then lets it go
    eng.fill(decode, [(2, 5, [32]), (1, 5, [33])])
    eng.run(second)
    second.close()
    report = eng.canary.poll()
    assert report.forwards == 4
    assert sorted((e.phase, e.request, e.position) for e in report) == [("head", "y", 1), ("tail", "y", 1)]
    assert all([record.forward() for record in group.static_log] == [first] for group in eng.canary.groups)
    later = eng.arrays(1, 1)
    third = eng.canary.static_forward(kc.ForwardBatch(**later))
    assert third.run_count_at != second.run_count_at  # a count cell serves one forward
    # the closed forward refuses to run, and the refusal changes nothing
    for method in (second.before, second.after):
        with pytest.raises(ValueError, match=r"kv-canary: StaticForward\.(before|after): the forward must be open"):
            method()
    assert eng.canary.poll().forwards == 4
    # rows its arrays no longer explain (refilled before the poll) keep the phase their tags name;
    # the closed forward's graph, replayed by mistake, runs as nobody's forward
    eng.fill(later, [(1, 6, [34])])
    eng.run(third)
    later["req_pool_indices"][...] = 0
    replay_by_mistake(second)  # its arrays still read y's flipped position 1
    report = eng.canary.poll()
    assert report.forwards == 5
    assert sorted((e.phase, e.request, e.position) for e in report) == [("head", None, None)] * 2 + [
        ("tail", None, None)] * 2


@pytest.mark.parametrize("device", BACKENDS)
def test_static_forward_run_counts_past_one_count_array(device):
    """Static forwards past the first array of run counts (64) count their runs apart, and poll
    maps a row through the one that ran."""
    eng = _Requests(device)
    prefill = eng.arrays(1, 4)
    eng.fill(prefill, [(1, 0, [1, 2, 3, 4])])
    eng.run(eng.canary.static_forward(kc.ForwardBatch(**prefill)))
    forwards = []
    for number in range(70):  # the same decode step in arrays of its own each
        arrays = eng.arrays(1, 1)
        eng.fill(arrays, [(1, 4, [5])])
        forwards.append(eng.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=[f"r{number}"])))
    for forward in forwards[:65]:
        eng.run(forward)
    assert eng.canary.poll().forwards == 66
    eng.k[3, 1, 1] += 1.0  # position 2 of the row's request
    eng.run(forwards[66])
    report = eng.canary.poll()
    assert report.forwards == 67
    assert sorted((e.phase, e.request, e.position) for e in report) == [("head", "r66", 2), ("tail", "r66", 2)]


def _graph_run(framework: str, capture: str = "", off: frozenset = frozenset()):
    """``_forward_frames`` with K bytes for each new token and a bit of request 1's cached K flipped
    before the fourth forward, through a canary with an SWA group (slots translated): on the CPU
    eagerly (framework "cpu"); else in CuPy arrays or torch tensors, each batch shape through a
    StaticForward over static buffers, run once eagerly and then captured with the forward's K write
    in a CUDA graph (``capture``: CuPy's stream capture or ``torch.cuda.graph``) and replayed. The
    canary is off for the forwards numbered in ``off`` (from 0) and their polls.
    Returns each forward's events, the canary buffers and the graphs."""
    frames = _forward_frames()
    rng = np.random.default_rng(3)
    for frame in frames:
        frame["new_k"] = rng.standard_normal((len(frame["out_cache_loc"]), 2, 8)).astype(np.float32)
    caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=WIDTH, pool_slot_count=SLOTS,
                                   max_prefill_tokens=64)
    lut = (np.arange(SLOTS + 1, dtype=np.int64)[::-1] % SLOTS).copy()
    if framework != "cpu":
        import cupy
    if framework == "torch" or capture == "torch":
        import torch
    put = {"cpu": np.asarray, "cupy": lambda values: cupy.asarray(values),
           "torch": lambda values: torch.as_tensor(values, device="cuda")}[framework]

    def fill(target, values) -> None:
        if framework == "torch":
            target.copy_(torch.as_tensor(np.asarray(values)))
        else:
            target[...] = put(np.asarray(values))

    if framework == "cupy":
        # the model's K write: one kernel, no temporaries (CuPy's pool must not hand a captured
        # graph's memory to anything else)
        write_rows = cupy.ElementwiseKernel("int64 loc, raw float32 rows", "raw float32 pool",
                                            "for (int j = 0; j < 16; ++j) pool[loc * 16 + j] = rows[i * 16 + j];",
                                            "kvc_test_write_rows")

    def write_k(loc, new_k, stream) -> None:
        if framework == "cpu":
            k_pool[loc] = new_k
        elif framework == "cupy":
            with stream:
                write_rows(loc, new_k, k_pool)
        elif capture == "torch":  # on torch's current stream, the capturing one
            k_pool.index_copy_(0, loc, new_k)
        else:  # on the launch stream, which is not torch's current one
            with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
                k_pool.index_copy_(0, loc, new_k)

    table, k_pool = put(np.zeros((ROWS, WIDTH), np.int32)), put(np.zeros((SLOTS, 2, 8), np.float32))
    canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=table,
                       device="cpu" if framework == "cpu" else "cuda", hash_mode=kc.HashMode.ALL,
                       real_kv_sources=kc.layouts.per_layer([k_pool]),
                       swa=kc.SwaGroup(window=4, lut=put(lut), num_slots=SLOTS))
    buffers, forwards, graphs, events = {}, {}, {}, []
    for number, frame in enumerate(frames):
        canary.mode = "off" if number in off else "log"
        if number == 3:
            flipped = int(frames[0]["req_to_token"][1, 2])
            k_pool[flipped, 1, 5] += 1.0
        arrays = {}
        for name, values in frame.items():
            if name == "req_to_token":
                fill(table, values)
                continue
            key = (name, len(values))
            if key not in buffers:
                buffers[key] = put(np.zeros(np.shape(values), np.float32 if name == "new_k" else np.int64))
            fill(buffers[key], values)
            arrays[name] = buffers[key]
        new_k = arrays.pop("new_k")
        batch = kc.ForwardBatch(**arrays)
        if framework == "cpu":
            canary.before_forward(batch)
            write_k(arrays["out_cache_loc"], new_k, None)
            canary.after_forward(batch)
        else:
            cupy.cuda.Device().synchronize()
            shape = len(arrays["input_ids"])
            if shape not in forwards:
                forwards[shape] = canary.static_forward(batch)
            forward = forwards[shape]
            if capture == "torch":
                def work(forward=forward, loc=arrays["out_cache_loc"], new_k=new_k):
                    stream = torch.cuda.current_stream()
                    forward.before(stream=stream)
                    write_k(loc, new_k, stream)
                    forward.after(stream=stream)
                if shape in graphs:
                    graphs[shape].replay()
                else:  # once eagerly (every kernel loaded), then captured for the forwards to come
                    work()
                    torch.cuda.synchronize()
                    graphs[shape] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graphs[shape]):
                        work()
                torch.cuda.synchronize()
            else:
                stream = cupy.cuda.Stream(non_blocking=True)

                def work(stream=stream, forward=forward, loc=arrays["out_cache_loc"], new_k=new_k):
                    forward.before(stream=stream)
                    write_k(loc, new_k, stream)
                    forward.after(stream=stream)
                if shape in graphs:
                    graphs[shape].launch(stream)
                else:
                    work()
                    with stream:
                        stream.begin_capture()
                        work()
                        graphs[shape] = stream.end_capture()
                stream.synchronize()
        report = canary.poll()
        events.append((report.total, report.capacity_overflows,
                       _event_keys(report)))
    return events, [to_numpy(group.ctx.canary_buf) for group in canary.groups], graphs, canary


@requires_gpu
@pytest.mark.parametrize("framework, capture", [("cupy", "cupy"), ("torch", "torch"), ("torch", "cupy")])
def test_static_forwards_captured_in_cuda_graphs_match_eager_forwards(framework, capture):
    """StaticForwards captured with the forward's K write in CUDA graphs (CuPy's, torch's, and
    CuPy's over torch tensors, whose stream is then not the launch stream) and replayed over
    refilled buffers report what eager forwards report on the CPU, the flipped K bit included, and
    leave the same canary buffers; replays are counted as forwards, and a replay polled alone is
    numbered as the forward after the previous poll's."""
    if framework == "torch":
        pytest.importorskip("torch")
    expected, expected_buffers, _, _ = _graph_run("cpu")
    assert [total for total, _, _ in expected] == [0, 0, 0, 2, 2, 2]
    events, buffers, graphs, canary = _graph_run(framework, capture)
    assert len(graphs) == 2
    assert events == expected
    for ours, theirs in zip(buffers, expected_buffers):
        assert np.array_equal(ours, theirs)
    assert canary.forwards == 0 and canary.poll().forwards == len(events)


@requires_gpu
def test_graph_replays_run_the_canary_while_it_is_off():
    """``mode="off"`` makes the canary's calls return at once, but a graph that captured a static
    forward's ``before()``/``after()`` runs its kernels at every replay: the replays' tokens are
    fingerprinted as if it were on. The first poll after the switch still decodes (the one replay
    since the poll before, named and numbered as on the CPU); the rows of the next replay wait for
    the first poll once it is on again (without steps: that poll covers two forwards)."""
    expected, expected_buffers, _, _ = _graph_run("cpu")
    events, buffers, graphs, canary = _graph_run("cupy", "cupy", off=frozenset({3, 4}))
    assert len(graphs) == 2
    assert [total for total, _, _ in events] == [0, 0, 0, 2, 0, 4]
    assert events[3] == expected[3]
    unstepped = lambda keys: sorted((key[:6] + key[7:] for key in keys), key=repr)  # noqa: E731
    assert unstepped(events[5][2]) == unstepped(sum((keys for _, _, keys in expected[4:]), []))
    assert all(key[6] is None for key in events[5][2])
    for ours, theirs in zip(buffers, expected_buffers):
        assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("device", BACKENDS)
def test_cells_past_the_swa_lut_resolve_nothing(device):
    """A table cell past the pool (a corrupted table) is out of range in the full group and past the
    LUT in the SWA group: the SWA group's writes and verifies find those slots unresolved, and poll
    names the request and position of each cell that did not resolve."""
    i64 = int64s_on(device)
    caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=WIDTH, pool_slot_count=SLOTS,
                                   max_prefill_tokens=64)
    table = np.zeros((ROWS, WIDTH), np.int32)
    table[1, :4] = [SLOTS + 1, SLOTS + 10, SLOTS + 11, 4]  # the first cell the LUT's length itself
    canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=to_device(table, device), device=device,
                       swa=kc.SwaGroup(window=4, lut=i64(np.arange(SLOTS + 1)), num_slots=SLOTS))
    for prefix, extend, slots in ((0, 3, [1, 2, 3]), (3, 1, [4])):
        batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([prefix]), extend_seq_lens=i64([extend]),
                                input_ids=i64(slots), positions=i64(range(prefix, prefix + extend)),
                                out_cache_loc=i64(slots))
        one_forward(canary, batch)
    report = canary.poll()
    swa = [event for event in report if event.group == "swa"]
    assert swa and all(event.request == 0 and event.reasons == ("OUT_OF_RANGE",) for event in swa)
    assert [(e.phase, e.position) for e in swa if e.phase == "head"] == [("head", 0), ("head", 1), ("head", 2)]
    assert ("write", 2) in [(e.phase, e.position) for e in swa]  # the seed, position prefix - 1
    assert "slot unresolved (no cell of req_to_token or the LUT)" in report.describe()
    assert {e.slot for e in report if e.group == "full" and e.phase == "head"} == {SLOTS + 1, SLOTS + 10, SLOTS + 11}


@pytest.mark.parametrize("device", BACKENDS)
def test_a_one_entry_swa_lut_resolves_its_cell_and_nothing_past_it(device):
    """A full pool of one slot has a LUT of one entry: cell 0 resolves through it, a cell past it is
    unresolved, and poll names the rows of both by request and position, as the plan resolved them."""
    i64 = int64s_on(device)
    width, swa_slots, swa_slot = 8, 8, 5
    caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=width, pool_slot_count=1,
                                   max_prefill_tokens=width)
    table = np.zeros((ROWS, width), np.int32)
    table[1, :2] = [0, 6]  # position 1's cell past the pool and the LUT (a corrupted table)
    swa_k = to_device(np.random.default_rng(0).standard_normal((swa_slots, 2, 8)).astype(np.float32), device)
    canary = kc.Canary(pool_slot_count=1, capacities=caps, req_to_token=to_device(table, device), device=device,
                       swa=kc.SwaGroup(window=4, lut=i64([swa_slot]), num_slots=swa_slots,
                                       real_kv_sources=kc.layouts.per_layer([swa_k])), hash_mode=kc.HashMode.ALL)
    for position, cell in enumerate(table[1, :2]):
        batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([position]), extend_seq_lens=i64([1]),
                                input_ids=i64([100 + position]), positions=i64([position]),
                                out_cache_loc=i64([cell]), req_ids=["a"])
        one_forward(canary, batch)
        if position == 0:
            swa_k[swa_slot, 0, 0] += 1.0  # position 0's SWA bytes, changed after its write
    canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([2]), req_ids=["a"]))
    swa = [(e.phase, e.step, e.request, e.position, e.slot, e.reasons) for e in canary.poll() if e.group == "swa"]
    assert sorted(swa) == [("head", 2, "a", 0, swa_slot, ("REAL_KV_HASH",)),
                           ("sweep", 2, "a", 0, swa_slot, ("REAL_KV_HASH",)),
                           ("sweep", 2, "a", 1, kc.UNRESOLVED_SLOT, ("OUT_OF_RANGE",)),
                           ("tail", 2, "a", 0, swa_slot, ("REAL_KV_HASH",))]


@pytest.mark.parametrize("device", BACKENDS)
def test_swa_window_of_a_length_past_the_table_starts_where_the_plan_starts(device):
    """A request whose length reaches past its req_to_token row has its SWA window counted from that
    length, as the plan counts it: its last cells inside the row, the rest unresolved. The positions
    before the window are not among what that launch checked, so a row another launch recorded
    there keeps that launch's step."""
    i64 = int64s_on(device)
    slots, width, window = 128, 16, 4
    caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=width, pool_slot_count=slots,
                                   max_prefill_tokens=width)
    table = np.zeros((ROWS, width), np.int32)
    table[1, :] = np.arange(1, width + 1)
    swa_k = to_device(np.zeros((slots, 2, 8), np.float32), device)
    canary = kc.Canary(pool_slot_count=slots, capacities=caps, req_to_token=to_device(table, device), device=device,
                       swa=kc.SwaGroup(window=window, lut=i64(np.arange(slots + 1)), num_slots=slots,
                                       real_kv_sources=kc.layouts.per_layer([swa_k])), hash_mode=kc.HashMode.ALL)
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([0]), extend_seq_lens=i64([width]),
                            input_ids=i64(range(100, 100 + width)), positions=i64(range(width)),
                            out_cache_loc=i64(range(1, width + 1)),
                            req_ids=["a"])
    one_forward(canary, batch)
    assert canary.poll().total == 0
    swa_k[14, 0, 0] += 1.0  # position 13's SWA slot
    canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([width]), req_ids=["a"]))  # step 1: finds it
    follow = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([width]), extend_seq_lens=i64([0]),
                             input_ids=i64([]), positions=i64([]), out_cache_loc=i64([]), req_ids=["a"])
    canary.before_forward(follow)  # step 2
    canary.after_forward(follow)
    # a length past the row's 16 cells: the window is positions 16..19, none of them in the row (not 12..15)
    canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([20]), req_ids=["a"]))
    report = canary.poll()
    swept = [(e.step, e.request, e.position) for e in report if e.group == "swa" and e.phase == "sweep"]
    assert (1, "a", 13) in swept and (2, "a", 13) not in swept
    assert sorted(p for _, _, p in swept if p != 13) == [16, 17, 18, 19]  # unresolved, named by position


@pytest.mark.parametrize("device", BACKENDS)
def test_swa_write_rows_map_to_the_slots_of_their_forward(device):
    """``poll`` maps an SWA write row through the slots its forward translated, even after the
    engine's LUT has changed (a freed slot's entry zeroed); on a GPU the forward's launches are the
    prepared ones (the batch geometry met before)."""
    eng = Tiny(device, swa=True)
    eng.step({"a": 4, "b": 3})
    for _ in range(3):
        eng.step({"a": 1, "b": 1})
    assert eng.canary.poll().total == 0
    eng.step({"a": 1, "b": 1}, stale_position={"b": 2})
    position = eng.lens["b"] - 1
    lut = to_numpy(eng.lut).copy()
    swa_slot = int(lut[eng.slot("b", position)])
    eng.step({"a": 1, "b": 1})  # another forward of the geometry, into other slots, before the poll
    lut = to_numpy(eng.lut).copy()
    lut[eng.slot("b", position)] = 0
    eng.lut[...] = to_device(lut, device)
    writes = [(e.group, e.request, e.position, e.slot, e.step) for e in eng.canary.poll() if e.phase == "write"]
    assert ("swa", "b", position, swa_slot, 5) in writes
    if device == "cuda":
        assert len(eng.canary._prepared_writes.prepared) == 1


@requires_gpu
def test_prepared_launches_tell_shared_arrays_apart():
    """Forwards that pass one array as both input_ids and positions prepare launches of their own:
    a later batch of the same shapes with two arrays writes its own token ids (the canary buffer
    equals the CPU's)."""
    buffers = []
    for device in ("cpu", "cuda"):
        eng = Tiny(device, hash_mode=kc.HashMode.NONE)
        i64 = int64s_on(device)
        table = np.zeros((ROWS, WIDTH), np.int32)
        table[1, :8], table[2, :8] = np.arange(1, 9), np.arange(11, 19)
        eng.table[...] = to_device(table, device)
        for position in range(8):
            shared = i64([position, position])
            ids, positions = (shared, shared) if position < 4 else (i64([100 + position, 200 + position]),
                                                                    i64([position, position]))
            batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([position, position]),
                                    extend_seq_lens=i64([1, 1]), input_ids=ids, positions=positions,
                                    out_cache_loc=i64([1 + position, 11 + position]))
            one_forward(eng.canary, batch)
        assert eng.canary.poll().total == 0
        if device == "cuda":
            assert len(eng.canary._prepared_writes.prepared) == 2  # one for each way of passing them
        buffers.append(to_numpy(eng.canary.context.canary_buf))
    assert np.array_equal(buffers[0], buffers[1])


def test_settings_are_read_only():
    """Prepared launches take the settings in once, so they cannot be swapped under them."""
    canary = Tiny("cpu").canary
    for name in ("req_to_token", "expected_tokens", "check_expected_token", "token_offset", "capacities"):
        with pytest.raises(AttributeError):
            setattr(canary, name, getattr(canary, name))


def test_the_hash_mode_and_pool_size_cannot_be_set_apart_from_the_contexts():
    """The contexts hash as they were built: a hash mode or pool size set on the canary afterwards
    would change nothing but what the canary says it does."""
    canary = Tiny("cpu").canary
    for name, value in (("hash_mode", kc.HashMode.NONE), ("pool_slot_count", 8)):
        with pytest.raises(AttributeError):
            setattr(canary, name, value)
    assert canary.hash_mode is kc.HashMode.ALL is canary.context.hash_mode
    assert canary.pool_slot_count == SLOTS == canary.context.num_slots


def test_prepared_launches_cache_keeps_what_it_met_twice():
    from kvcanary_cupy._recent import GEOMETRIES_KEPT
    from kvcanary_cupy.session import _Geometry, _PreparedLaunches

    def met(key):
        return _Geometry(key, [], False)

    cache = _PreparedLaunches()
    assert cache.get(None) is None and not cache.second_meeting(None)
    assert not cache.second_meeting(met("k")) and cache.second_meeting(met("k"))
    assert not cache.second_meeting(met("k"))
    assert cache.put(met("k"), 1) == 1 and cache.get(met("k")) == 1
    for index in range(GEOMETRIES_KEPT):
        cache.put(met(index), index)
        cache.second_meeting(met(("once", index)))
    cache.get(met(0))  # the oldest but one now
    cache.put(met("new"), 2)
    assert cache.get(met(0)) == 0 and cache.get(met(1)) is None and len(cache.prepared) == GEOMETRIES_KEPT
    assert len(cache.met_once) == GEOMETRIES_KEPT


def test_bad_mode_rejected():
    with pytest.raises(ValueError, match="kv-canary: mode must be one of"):
        Tiny("cpu", mode="loud")
    with pytest.raises(TypeError, match="kv-canary: mode must be a str"):
        Tiny("cpu", mode=np.array(["log", "off"]))


# --- layout builders ------------------------------------------------------------------------------
def test_layout_builders_geometry():
    k = [np.zeros((16, 2, 8), np.float16) for _ in range(3)]
    v = [np.zeros((16, 2, 8), np.float16) for _ in range(3)]
    sources = kc.layouts.per_layer(k, v, layers=[0, 2])
    assert len(sources) == 4 and all(s.page_size == 1 and s.num_bytes_per_token == 32 for s in sources)
    assert sources[2].tensor is k[2]

    pk = [np.zeros((4, 16, 2, 8), np.float16)]
    (src, src_v) = kc.layouts.paged(pk, pk)
    assert src.page_size == 16 and src.num_bytes_per_token == 32 and src.read_bytes == 32
    assert src == src and src != src_v and len({src, src_v}) == 2  # a source is its memory: by identity

    inter = [np.zeros((16, 2, 2, 8), np.float32)]
    k_part, v_part = kc.layouts.interleaved(inter)
    assert k_part.num_bytes_per_token == v_part.num_bytes_per_token == 64
    assert v_part.base_address == inter[0].ctypes.data + 64
    (whole,) = kc.layouts.interleaved(inter, split=False)
    assert whole.num_bytes_per_token == 128

    latent = [np.zeros((16, 1, 288), np.float16)]
    (m,) = kc.layouts.mla(latent, read_bytes=64)
    assert m.num_bytes_per_token == 576 and m.read_bytes == 64

    with pytest.raises(ValueError, match="kv-canary"):
        kc.layouts.per_layer(k, v[:1])
    # with ``layers`` too: -1 would be K of layer 2 beside V of layer 1, layer 0 a V list cut short
    for picked in ([-1], [0]):
        with pytest.raises(ValueError, match=r"^kv-canary: v_buffers must have one buffer per K buffer, got 2 for 3"):
            kc.layouts.per_layer(k, v[:2], layers=picked)
        with pytest.raises(ValueError, match=r"^kv-canary: v_buffers must have one buffer per K buffer, got 2 for 3"):
            kc.layouts.paged([np.zeros((4, 4, 2, 8), np.float16)] * 3, [np.zeros((4, 4, 2, 8), np.float16)] * 2,
                             layers=picked)
    with pytest.raises(ValueError, match="kv-canary"):
        kc.layouts.paged([np.zeros((4, 16), np.float16)])
    with pytest.raises(TypeError, match=r"^kv-canary: k_buffers must be a list or tuple of arrays .*got NoneType"):
        kc.layouts.per_layer(None)
    with pytest.raises(TypeError, match=r"^kv-canary: layers must be a list, tuple or range .*got int 5"):
        kc.layouts.per_layer(k, layers=5)
    with pytest.raises(ValueError, match=r"^kv-canary: layers must index the 3 buffers of k_buffers, in \[-3, 3\), "
                                         r"got 3"):
        kc.layouts.per_layer(k, layers=range(4))
    with pytest.raises(TypeError, match=r"^kv-canary: layers\[1\] must be an int"):
        kc.layouts.per_layer(k, layers=[0, "1"])
    # a paged buffer taken a page a slot would hash the wrong bytes: refused, pointing at paged
    with pytest.raises(ValueError, match=r"^kv-canary: k_buffers\[0\] must be \[slots, heads, head_dim\] .*got "
                                         r"shape \(4, 2, 2, 8\) .*kc\.layouts\.paged"):
        kc.layouts.per_layer([np.zeros((4, 2, 2, 8), np.float32)])


def test_from_buffer_refuses_rows_that_do_not_split_evenly_into_tokens():
    """``from_buffer``: every byte of a row belongs to its ``page_size`` tokens, evenly. A row of 33
    bytes in pages of 2 tokens would leave a byte to no token, though the 16 bytes a token it
    rounds down to pass the multiple-of-16 rule."""
    rng = np.random.default_rng(85)
    buffer = rng.integers(1, 256, size=(4, 33), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"^kv-canary: buffer rows \(33 bytes\) must split evenly into page_size=2 "
                                         r"tokens, got shape \(4, 33\)$"):
        kc.layouts.from_buffer(buffer, page_size=2)


def test_layers_count_back_to_the_first_buffer():
    """``layers`` indexes the buffers as Python indexes a list: ``-len`` is the first buffer."""
    rng = np.random.default_rng(84)
    k = [rng.standard_normal((16, 2, 8)).astype(np.float16) for _ in range(3)]
    v = [rng.standard_normal((16, 2, 8)).astype(np.float16) for _ in range(3)]
    sources = kc.layouts.per_layer(k, v, layers=[-3, -1])
    assert len(sources) == 4
    assert all(s.tensor is want for s, want in zip(sources, (k[0], v[0], k[2], v[2])))


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_paged_head_major_hashes_each_heads_tokens(device, mode):
    """``paged(head_major=True)`` takes ``[pages, heads, page_size, head_dim]`` buffers (an "HND"
    cache), a source a head: each slot's hash is the fold of its bytes in each head (K heads, then
    V heads), clean forwards report nothing, and a byte flipped in one head of a cached token is
    reported at that token. Without ``head_major``, a ``page_size`` that is not ``shape[1]`` is
    refused, pointing at it."""
    pages, heads, page_size, dim = 6, 3, 4, 16
    rng = np.random.default_rng(5)
    k, v = (to_device(rng.standard_normal((pages, heads, page_size, dim)).astype(np.float16), device) for _ in "kv")
    with pytest.raises(ValueError, match=r"^kv-canary: page_size must be the tokens a page of k_buffers\[0\] holds, "
                                         r"shape\[1\] of \[pages, page_size, heads, head_dim\]: got 4 for shape "
                                         r"\(6, 3, 4, 16\) \(head_major=True takes"):
        kc.layouts.paged([k], [v], page_size=page_size)
    with pytest.raises(ValueError, match=r"^kv-canary: v_buffers\[0\] must have at least one head, shape\[1\] of "
                                         r"\[pages, heads, page_size, head_dim\], got shape \(6, 0, 4, 16\)"):
        kc.layouts.paged([k], [v[:, :0]], head_major=True)  # a buffer with no head: none of its bytes hashed
    sources = kc.layouts.paged([k], [v], page_size=page_size, head_major=True)
    assert len(sources) == 2 * heads and all(s.page_size == page_size and s.num_bytes_per_token == 2 * dim
                                             for s in sources)
    slots = pages * page_size
    table = to_device(np.zeros((2, 16), np.int32), device)
    caps = kc.Capacities.from_args(req_to_token_pool_size=2, max_seq_len_per_req=16, pool_slot_count=slots,
                                   max_prefill_tokens=16)
    canary = kc.Canary(pool_slot_count=slots, capacities=caps, req_to_token=table, device=device,
                       real_kv_sources=sources, hash_mode=mode)
    owned = [5, 9, 14, 22, 3, 17]
    table[1, :len(owned)] = to_device(np.array(owned, np.int32), device)
    i64 = int64s_on(device)
    for prefix, count in ((0, 4), (4, 1), (5, 1)):
        batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([prefix]), extend_seq_lens=i64([count]),
                                input_ids=i64(range(100 + prefix, 100 + prefix + count)),
                                positions=i64(range(prefix, prefix + count)), out_cache_loc=i64(owned[prefix:prefix + count]),
                                req_ids=["a"])
        one_forward(canary, batch)
    assert not canary.poll()
    host = [to_numpy(k), to_numpy(v)]
    read = 16 if mode == kc.HashMode.PARTIAL else 2 * dim
    rows = [(np.ascontiguousarray(buffer[:, head]).reshape(pages, -1).view(np.uint8), page_size, 2 * dim, read)
            for buffer in host for head in range(heads)]
    for slot in owned:
        stored = canary.context.slot_fields(slot)["real_kv_hash"] % 2**64  # an int64 field, the hash a u64
        assert stored == kc.reference.real_kv_hash(rows, slot)[0], slot
    flipped = host[1].copy()
    flipped.view(np.uint8)[22 // page_size, 2, 22 % page_size, 0] ^= 0x10  # V, head 2, byte 0 of slot 22
    v[...] = to_device(flipped, device)
    canary.sweep(kc.LiveRequests(req_pool_indices=i64([1]), seq_lens=i64([6]), req_ids=["a"]))
    report = canary.poll()
    assert [(e.request, e.position, e.slot, e.reasons) for e in report] == [("a", 3, 22, ("REAL_KV_HASH",))]


def test_layout_builders_accept_torch_bfloat16():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(7)
    k = [torch.randn((8, 2, 8), generator=gen).to(torch.bfloat16)]
    (src,) = kc.layouts.per_layer(k)
    assert src.num_bytes_per_token == 32
    buf = [torch.randn((8, 2, 2, 8), generator=gen).to(torch.bfloat16)]
    parts = kc.layouts.interleaved(buf)
    assert [p.num_bytes_per_token for p in parts] == [32, 32]
    # each part hashes its own half of the slot's bytes (K, then V), read in place from torch's memory
    ctx = kc.CanaryContext.allocate(8, real_kv_sources=parts, hash_mode=kc.HashMode.ALL)
    wplan = kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=1)
    one = lambda v: np.array([v], np.int64)  # noqa: E731
    kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=one(5), positions=one(0), out_cache_loc=one(3))
    as_bytes = buf[0].view(torch.uint8).reshape(8, 64).numpy()
    halves = [(np.ascontiguousarray(as_bytes[:, :32]), 1, 32, 32), (np.ascontiguousarray(as_bytes[:, 32:]), 1, 32, 32)]
    assert ctx.slot_fields(3)["real_kv_hash"] % 2**64 == kc.reference.real_kv_hash(halves, 3)[0] != 0
    vplan = kc.VerifyPlan(slot_indices=one(3), expected_tokens=one(5), expected_positions=one(0),
                          prev_slot_indices=one(-1), num_valid=np.array([1], np.int32), enable=np.array([1], np.int32))
    kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL)
    assert ctx.violations().total == 0
    buf[0][3, 1, 0, 0] += 1.5  # V half
    kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL)
    assert [(v.slot_idx, v.position, v.fail_reason) for v in ctx.violations()] == [(3, 0, kc.FailReason.REAL_KV_HASH)]


# --- bad input (SPEC §4): prefixed errors naming the argument, and a rejected call changes nothing ---
def _state(canary: kc.Canary) -> list:
    """Every mutable piece of a session, copied to the host."""
    arrays = []
    for group in canary.groups:
        ctx = group.ctx
        arrays += [ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.slot_run_counter,
                   ctx.kernel_run_counter, group.overflows]
        for plan in (group.vplan, group.wplan, group.sweep_vplan, group.sweep_wplan):
            if plan is not None:
                arrays += [getattr(plan, name) for name in plan.ARRAYS]
    logs = [list(group.log) for group in canary.groups]
    plans = [(group.sweep_vplan is None, group.sweep_wplan is None) for group in canary.groups]
    return [to_numpy(a).copy() for a in arrays] + [canary.forwards, id(canary._planned), logs, plans]


def _assert_same(before: list, after: list) -> None:
    assert len(before) == len(after)
    for a, b in zip(before, after):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b


def _rejected(canary: kc.Canary, call, error: type, *names: str) -> None:
    """``call()`` raises ``error`` with a prefixed message naming each of ``names``, leaving ``canary`` as it was."""
    before = _state(canary)
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert message.startswith("kv-canary: "), message
    for name in names:
        assert name in message, message
    _assert_same(before, _state(canary))


def _batch(device, **overrides) -> kc.ForwardBatch:
    i64 = int64s_on(device)
    fields = dict(req_pool_indices=i64([1]), prefix_lens=i64([3]), extend_seq_lens=i64([1]), input_ids=i64([7]),
                  positions=i64([3]), out_cache_loc=i64([20]))
    fields.update(overrides)
    return kc.ForwardBatch(**fields)


def _warm(device, **kwargs) -> Tiny:
    """A session with some history: a planned-and-written forward and a sweep."""
    eng = Tiny(device, **kwargs)
    eng.step({"a": 3, "b": 2})
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1], np.int64), device),
                                     seq_lens=to_device(np.array([3], np.int64), device)))
    return eng


@pytest.mark.parametrize("device", BACKENDS)
def test_rejected_before_forward_changes_nothing(device):
    eng = _warm(device, swa=True)
    planned = _batch(device)
    eng.canary.before_forward(planned)
    int32 = to_device(np.array([3], np.int32), device)
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, prefix_lens=int32)), TypeError,
              "prefix_lens", "int64", "int32")
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, extend_seq_lens=to_device(
        np.array([1, 1], np.int64), device))), ValueError, "extend_seq_lens", "length 1")
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, req_ids=5)), TypeError, "req_ids")
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, req_ids="ab")), TypeError, "req_ids")
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, req_ids=["a", "b"])), ValueError,
              "req_ids must have at most one id per batch row", "req_pool_indices has 1", "got 2")
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, req_ids=np.array(5))), TypeError,
              "req_ids must be None or a list, tuple or 1-D NumPy array")
    unprintable = np.empty((1, 1), object)
    unprintable[0, 0] = Unprintable("a")  # named in the refusal by a placeholder, not by its failing repr
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, req_ids=unprintable)), TypeError,
              "req_ids must be None", "got ndarray <unprintable req_ids of type ndarray>")
    over = to_device(np.ones(eng.canary.capacities.write_req_capacity + 1, np.int64), device)
    _rejected(eng.canary, lambda: eng.canary.before_forward(_batch(device, req_pool_indices=over, prefix_lens=over,
                                                                   extend_seq_lens=over)),
              ValueError, "write_req_capacity")
    assert eng.canary._planned is planned


def test_expected_valid_lens_are_named_as_the_batch_names_them():
    canary = _construct(expected_tokens=np.zeros((ROWS, WIDTH), np.int32))
    before = _state(canary)
    batch = _batch("cpu", expected_valid_lens=np.array([1], np.int32))
    with pytest.raises(TypeError, match=r"^kv-canary: expected_valid_lens must have dtype int64, got int32"):
        canary.before_forward(batch)
    _assert_same(before, _state(canary))
    short = _batch("cpu", expected_valid_lens=np.array([1, 1], np.int64))
    with pytest.raises(ValueError, match=r"^kv-canary: expected_valid_lens must have length 1 \(one per request, "
                                         r"as req_pool_indices\), got 2$"):
        canary.before_forward(short)
    with pytest.raises(ValueError, match=r"^kv-canary: expected_valid_lens must have length 1"):
        canary.after_forward(short)
    _assert_same(before, _state(canary))


def test_rows_of_an_array_that_speaks_dlpack_alone_bound_what_they_bound_for_others():
    """``req_pool_indices`` with no ``shape`` of its own: its rows still bound ``req_ids`` and
    ``expected_valid_lens``, which are refused as for a NumPy array, under the batch's names."""
    canary = _construct(expected_tokens=np.zeros((ROWS, WIDTH), np.int32))
    before = _state(canary)
    rows = DLPackOnly(np.array([1], np.int64))
    for call in (canary.before_forward, canary.after_forward, canary.static_forward):
        with pytest.raises(ValueError, match=r"^kv-canary: req_ids must have at most one id per batch row "
                                             r"\(req_pool_indices has 1;.*got 2$"):
            call(_batch("cpu", req_pool_indices=rows, req_ids=["a", "b"]))
        with pytest.raises(ValueError, match=r"^kv-canary: expected_valid_lens must have length 1 \(one per "
                                             r"request, as req_pool_indices\), got 2$"):
            call(_batch("cpu", req_pool_indices=rows, expected_valid_lens=np.array([1, 1], np.int64)))
    _assert_same(before, _state(canary))
    assert canary._static_forward_count == 0


@pytest.mark.parametrize("batch", [{"req_pool_indices": np.ones(1, np.int64)}, None])
def test_calls_refuse_what_is_not_a_batch(batch):
    eng = _warm("cpu")
    for call in (eng.canary.before_forward, eng.canary.after_forward):
        _rejected(eng.canary, lambda: call(batch), TypeError, "batch must be a ForwardBatch",
                  type(batch).__name__)
    _rejected(eng.canary, lambda: eng.canary.sweep(batch), TypeError, "live_requests must be a LiveRequests",
              type(batch).__name__)


@pytest.mark.parametrize("device", BACKENDS)
def test_rejected_after_forward_of_an_unplanned_batch_leaves_the_plans(device):
    eng = _warm(device)
    int32 = to_device(np.array([7], np.int32), device)
    _rejected(eng.canary, lambda: eng.canary.after_forward(_batch(device, input_ids=int32)), TypeError,
              "input_ids", "int32")
    _rejected(eng.canary, lambda: eng.canary.after_forward(_batch(device, positions=to_device(
        np.array([3, 4], np.int64), device))), ValueError, "positions")


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("planned", [True, False])
def test_rejected_swa_write_changes_neither_group(device, planned):
    """The full group's write would come first: it must not run when the SWA group's is refused."""
    eng = _warm(device, swa=True)
    bad = _batch(device, swa_out_cache_loc=to_device(np.array([20], np.int32), device))
    if planned:
        eng.canary.before_forward(bad)
    _rejected(eng.canary, lambda: eng.canary.after_forward(bad), TypeError, "swa_out_cache_loc", "int32")
    short = _batch(device, swa_out_cache_loc=to_device(np.zeros(0, np.int64), device))
    _rejected(eng.canary, lambda: eng.canary.after_forward(short), ValueError, "swa_out_cache_loc", "length 1")


def test_rejected_swa_write_of_a_list_changes_nothing():
    eng = _warm("cpu", swa=True)
    _rejected(eng.canary, lambda: eng.canary.after_forward(_batch("cpu", out_cache_loc=[20])), TypeError,
              "out_cache_loc", "list")


@pytest.mark.parametrize("device", BACKENDS)
def test_a_sweep_takes_every_live_request_past_a_forwards_request_capacity(device):
    """Forwards of one request each (``write_req_capacity=1``) leave two live requests: a sweep of
    both checks both, as many as ``req_to_token`` has rows; past them it is refused under the name
    the engine gave."""
    caps = dataclasses.replace(session_capacities(ROWS, WIDTH, SLOTS, 64, None), write_req_capacity=1)
    eng = Tiny(device, capacities=caps)
    eng.step({"a": 5})
    eng.step({"b": 3})
    with pytest.raises(ValueError, match=r"kv-canary: batch size \(req_pool_indices length\) must be <= "
                                         r"capacities.write_req_capacity 1, got 2"):
        eng.step({"a": 1, "b": 1})
    flip = eng.slot("b", 1)
    eng.k[flip] = eng.k[flip] + 1
    live = kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), device),
                           seq_lens=to_device(np.array([5, 3], np.int64), device), req_ids=["a", "b"])
    eng.canary.sweep(live)
    report = eng.canary.poll()
    assert report.requests == {"b"} and {event.position for event in report.events} == {1}
    for group in eng.canary.groups:  # the sweep's write plan holds every request it took
        assert to_numpy(group.sweep_wplan.num_valid_reqs).tolist() == [2]
        assert to_numpy(group.sweep_wplan.offsets)[:3].tolist() == [0, 0, 0] and group.sweep_wplan.capacity >= 2
    every_row = kc.LiveRequests(req_pool_indices=to_device(np.arange(ROWS, dtype=np.int64), device),
                                seq_lens=to_device(np.ones(ROWS, np.int64), device))
    eng.canary.sweep(every_row)  # as many as the table has rows
    assert not eng.canary.poll()
    rows = to_device(np.arange(ROWS + 1, dtype=np.int64) % ROWS, device)
    too_many = kc.LiveRequests(req_pool_indices=rows, seq_lens=to_device(np.ones(ROWS + 1, np.int64), device))
    _rejected(eng.canary, lambda: eng.canary.sweep(too_many), ValueError,
              f"LiveRequests.req_pool_indices length must be <= {ROWS}")


@pytest.mark.parametrize("device", BACKENDS)
def test_rejected_sweep_changes_nothing(device):
    eng = Tiny(device)
    eng.step({"a": 3})
    rows = to_device(np.array([1], np.int64), device)
    cases = [(kc.LiveRequests(req_pool_indices=rows, seq_lens=to_device(np.array([3], np.int32), device)),
              TypeError, "LiveRequests.seq_lens"),
             (kc.LiveRequests(req_pool_indices=rows, seq_lens=to_device(np.array([3, 3], np.int64), device)),
              ValueError, "LiveRequests.seq_lens"),
             (kc.LiveRequests(req_pool_indices=to_device(np.array(1, np.int64), device), seq_lens=rows),
              ValueError, "LiveRequests.req_pool_indices"),
             (kc.LiveRequests(req_pool_indices=[1], seq_lens=rows), TypeError, "LiveRequests.req_pool_indices"),
             (kc.LiveRequests(req_pool_indices=rows, seq_lens=rows, req_ids=["a", "b"]), ValueError, "req_ids")]
    for live, error, name in cases:  # the first sweep would allocate the sweep plans: it must not
        _rejected(eng.canary, lambda: eng.canary.sweep(live), error, name)
    assert all(group.sweep_vplan is None for group in eng.canary.groups)


@pytest.mark.parametrize("stream", ["bogus", 1.5])
def test_a_sweep_of_no_request_still_checks_its_stream(stream):
    """A sweep with nothing to check launches nothing, but its arguments are checked all the same:
    a stream a GPU would refuse is refused here too, whatever the batch."""
    eng = Tiny("cpu")
    eng.step({"a": 3})
    empty = kc.LiveRequests(req_pool_indices=np.zeros(0, np.int64), seq_lens=np.zeros(0, np.int64))
    _rejected(eng.canary, lambda: eng.canary.sweep(empty, stream=stream), TypeError, "stream must be None")
    before = _state(eng.canary)
    eng.canary.sweep(empty)
    _assert_same(before, _state(eng.canary))  # nothing to check: nothing launched, nothing logged


@pytest.mark.parametrize("stream", ["bogus", 1.5])
def test_forward_calls_refuse_a_stream_of_no_form(stream):
    """Each call checks its ``stream=`` before it launches anything, on the CPU too (where a stream
    is otherwise ignored): a refused one changes nothing."""
    eng = _warm("cpu")
    batch = _next_token_of_a(eng)
    live = kc.LiveRequests(req_pool_indices=np.array([1], np.int64), seq_lens=np.array([3], np.int64))
    for call in (lambda: eng.canary.before_forward(batch, stream=stream),
                 lambda: eng.canary.after_forward(batch, stream=stream),
                 lambda: eng.canary.sweep(live, stream=stream)):
        _rejected(eng.canary, call, TypeError, "stream must be None")
    eng.canary.before_forward(batch)
    _rejected(eng.canary, lambda: eng.canary.after_forward(batch, stream=stream), TypeError, "stream must be None")


@pytest.mark.parametrize("device", BACKENDS)
def test_expected_tokens_with_the_check_off_are_not_planned(device):
    """``check_expected_token=False`` with an expected-token pool: verify checks no token and its
    rows expect none (-1), however the pool disagrees with the tokens written."""
    pool = np.random.default_rng(94).integers(1, 30000, size=(ROWS, WIDTH)).astype(np.int32)
    eng = Tiny(device, expected_tokens=to_device(pool, device), check_expected_token=False)
    eng.step({"a": 3})
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    report = eng.canary.poll()
    assert [(e.phase, e.position, e.reasons, e.violation.expected_token) for e in report] == [
        ("head", 1, ("REAL_KV_HASH",), -1), ("tail", 1, ("REAL_KV_HASH",), -1)]


def test_expected_valid_lens_are_ignored_without_expected_tokens():
    """``ForwardBatch.expected_valid_lens`` bound the expected-token pool: a canary that expects no
    token ignores them, whatever they hold, and checks the forward as any other."""
    eng = Tiny("cpu")
    eng.step({"a": 3})
    batch = _next_token_of_a(eng, expected_valid_lens=[7, 7])
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    assert not report and report.forwards == 2
    assert eng.canary.context.slot_fields(eng.slot("a", 3))["token"] == 1003


def _construct(**overrides) -> kc.Canary:
    caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=WIDTH, pool_slot_count=SLOTS,
                                   max_prefill_tokens=64)
    args = dict(pool_slot_count=SLOTS, capacities=caps, req_to_token=np.zeros((ROWS, WIDTH), np.int32),
                real_kv_sources=kc.layouts.per_layer([np.zeros((SLOTS, 2, 8), np.float32)]),
                hash_mode=kc.HashMode.ALL)
    args.update(overrides)
    return kc.Canary(**args)


def _said_to_be_on_the_gpu(sources: tuple) -> tuple:
    """Copies of host ``sources`` that say their tensors live on the first GPU (a host with none
    cannot hold one there): the device rule reads what a source says."""
    moved = tuple(copy.copy(source) for source in sources)
    for source in moved:
        object.__setattr__(source, "device", kc._dlpack.cuda_device(0))
    return moved


def _swa(**overrides) -> kc.SwaGroup:
    fields = dict(window=4, lut=np.arange(SLOTS + 1, dtype=np.int64), num_slots=SLOTS)
    fields.update(overrides)
    return kc.SwaGroup(**fields)


@pytest.mark.parametrize("overrides, error, names", [
    ({"hash_mode": 7}, ValueError, ("hash_mode", "7")),
    ({"hash_mode": True}, TypeError, ("hash_mode", "bool")),
    ({"hash_mode": "ALL"}, TypeError, ("hash_mode", "str")),
    ({"hash_mode": 2.0}, TypeError, ("hash_mode", "float")),
    ({"check_expected_token": 1}, TypeError, ("check_expected_token", "bool", "int 1")),
    ({"check_expected_token": "no"}, TypeError, ("check_expected_token", "'no'")),
    ({"check_expected_token": True}, ValueError, ("check_expected_token=True needs expected_tokens",
                                                  "expected_tokens=None")),
    ({"req_to_token": np.zeros((ROWS, WIDTH), np.int64)}, TypeError, ("req_to_token", "int32", "int64")),
    ({"req_to_token": None}, TypeError, ("req_to_token", "NoneType")),
    ({"req_to_token": np.zeros(WIDTH, np.int32)}, ValueError, ("req_to_token", "2-D")),
    ({"expected_tokens": np.zeros((ROWS, WIDTH))}, TypeError, ("expected_tokens", "float64")),
    ({"expected_tokens": np.zeros(WIDTH, np.int32)}, ValueError, ("expected_tokens", "2-D")),
    ({"expected_tokens": np.zeros((ROWS - 1, WIDTH), np.int32)}, ValueError,
     ("expected_tokens must have a row for every req_to_token row", f"rows >= {ROWS}", f"({ROWS - 1}, {WIDTH})")),
    ({"expected_tokens": np.zeros((ROWS, WIDTH - 1), np.int32)}, ValueError,
     ("expected_tokens must have a column for every req_to_token column", f"columns >= {WIDTH}", f"({ROWS}, {WIDTH - 1})")),
    ({"token_offset": 1 << 63}, ValueError, ("token_offset", "int64")),
    ({"real_kv_sources": None}, TypeError, ("real_kv_sources", "NoneType")),
    ({"real_kv_sources": [object()]}, TypeError, ("real_kv_sources[0]", "RealKvSource")),
    ({"swa": _swa(real_kv_sources=None)}, TypeError, ("SwaGroup.real_kv_sources", "NoneType")),
    ({"swa": _swa(real_kv_sources=["k"])}, TypeError, ("SwaGroup.real_kv_sources[0]", "str")),
    ({"swa": _swa(lut=np.arange(SLOTS + 1, dtype=np.int32))}, TypeError, ("SwaGroup.lut", "int32")),
    ({"swa": _swa(num_slots=0)}, ValueError, ("SwaGroup.num_slots", "0")),
    ({"swa": {"window": 4}}, TypeError, ("swa", "SwaGroup", "dict")),
    ({"swa": _swa(window=1 << 64)}, ValueError, ("SwaGroup.window", "int64")),
    ({"swa": _swa(window=0)}, ValueError, ("SwaGroup.window must be positive", "got 0")),
    ({"pool_slot_count": 1 << 63}, ValueError, ("pool_slot_count", "2**31")),
    ({"swa": _swa(num_slots=1 << 40)}, ValueError, ("SwaGroup.num_slots", "2**31")),
    ({"logger": "x"}, TypeError, ("logger", "str")),
    ({"swa": _swa(lut=np.arange(SLOTS - 1, dtype=np.int64))}, ValueError,
     ("SwaGroup.lut must map every slot of the full pool", f"pool_slot_count={SLOTS}", f"got {SLOTS - 1}")),
    ({"real_kv_sources": kc.layouts.per_layer([np.zeros((SLOTS // 2, 2, 8), np.float32)])}, ValueError,
     ("real_kv_sources[0] must hold the KV of every slot of its pool", f"= {SLOTS // 2} slots", f"pool's {SLOTS}")),
    ({"real_kv_sources": kc.layouts.per_layer([np.zeros((SLOTS - 1, 2, 8), np.float32)])}, ValueError,
     ("real_kv_sources[0] must hold the KV of every slot of its pool", f"= {SLOTS - 1} slots", f"pool's {SLOTS}")),
    ({"swa": _swa(real_kv_sources=kc.layouts.paged([np.zeros((3, 4, 2, 8), np.float32)]))}, ValueError,
     ("SwaGroup.real_kv_sources[0]", "3 rows x page_size 4 = 12 slots")),
    # an SWA group's sources on another device are named as such, before the full group is allocated
    ({"swa": _swa(real_kv_sources=_said_to_be_on_the_gpu(kc.layouts.per_layer([np.ones((SLOTS, 2, 8), np.float32)])))},
     ValueError, ("all arrays of one call must be on one device", "the canary on cpu",
                  "SwaGroup.real_kv_sources[0].tensor on cuda:0")),
])
def test_construction_checks_before_allocating(monkeypatch, overrides, error, names):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before every argument was checked")

    monkeypatch.setattr(kc.CanaryContext, "allocate", no_allocation)
    with pytest.raises(error) as info:
        _construct(**overrides)
    message = str(info.value)
    assert message.startswith("kv-canary: "), message
    for name in names:
        assert name in message, message


def test_a_cuda_canary_without_cupy_says_so_first():
    from kvcanary_cupy._dlpack import cupy_module

    if cupy_module() is not None:
        pytest.skip("CuPy is installed")
    with pytest.raises(ValueError, match=r"^kv-canary: device: a CUDA device needs CuPy"):
        _construct(device="cuda")


def test_a_forward_left_without_after_forward_is_logged(caplog):
    eng = Tiny("cpu")
    eng.step({"a": 3, "b": 2})
    i64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([3]), extend_seq_lens=i64([1]),
                            input_ids=i64([9]), positions=i64([3]), out_cache_loc=i64([9]))
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.canary.before_forward(batch)
        assert not caplog.records
        # a refused call changes nothing and tells nothing beyond its error
        with pytest.raises(ValueError, match=r"^kv-canary: .*prefix_lens"):
            eng.canary.before_forward(dataclasses.replace(batch, prefix_lens=i64([3, 3])))
        with pytest.raises(TypeError, match=r"^kv-canary: stream"):
            eng.canary.before_forward(batch, stream="the default one")
        assert not caplog.records
        eng.canary.before_forward(batch)
    (record,) = caplog.records
    assert record.getMessage().startswith("kv-canary: before_forward, but the previous forward's before had no "
                                          "after: if its forward ran, its new tokens were not fingerprinted")
    eng.canary.after_forward(batch)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.canary.before_forward(batch)
    assert not caplog.records


def test_a_static_forward_left_without_after_is_logged(caplog):
    """A static forward's before() after a forward whose before had no after (its own, or an eager
    one) says so, as before_forward does; one after a finished forward says nothing."""
    eng = Tiny("cpu")
    eng.step({"a": 3, "b": 2})
    i64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    batch = kc.ForwardBatch(req_pool_indices=i64([1]), prefix_lens=i64([3]), extend_seq_lens=i64([1]),
                            input_ids=i64([9]), positions=i64([3]), out_cache_loc=i64([9]))
    forward = eng.canary.static_forward(batch)
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        forward.before()
        forward.after()
        forward.before()
        assert not caplog.records
        with pytest.raises(TypeError, match=r"^kv-canary: stream"):
            forward.before(stream="the default one")
        assert not caplog.records
        forward.before()
        forward.after()
        eng.canary.before_forward(batch)
        forward.before()
    said = "kv-canary: StaticForward.before, but the previous forward's before had no after: if its forward ran"
    assert [record.getMessage()[:len(said)] for record in caplog.records] == [said] * 2


def test_mla_buffers_take_their_page_size_from_their_shape():
    (paged,) = kc.layouts.mla([np.zeros((8, 16, 1, 64), np.uint8)])
    (flat,) = kc.layouts.mla([np.zeros((8, 1, 64), np.uint8)], page_size=1)
    assert (paged.page_size, paged.num_bytes_per_token) == (16, 64)
    assert (flat.page_size, flat.num_bytes_per_token) == (1, 64)
    with pytest.raises(ValueError, match=r"^kv-canary: page_size must be the tokens a row of buffers\[0\] holds "
                                         r"\(shape\[1\]\), got 1 for shape \(8, 16, 1, 64\)$"):
        kc.layouts.mla([np.zeros((8, 16, 1, 64), np.uint8)], page_size=1)
    for shape in ((8, 64), (8, 4, 576), (8, 16, 2, 64)):  # a paged buffer without the head is not a token a row
        with pytest.raises(ValueError, match=r"^kv-canary: buffers\[0\] must be \[slots, 1, latent\] or "):
            kc.layouts.mla([np.zeros(shape, np.uint8)])


def test_construction_keeps_the_tables_in_place():
    table, expected = np.zeros((ROWS, WIDTH), np.int32), np.zeros((ROWS, WIDTH), np.int32)
    canary = _construct(req_to_token=table, expected_tokens=expected, check_expected_token=False,
                        hash_mode=np.int64(1))
    # views of the canary's own over the engine's memory, which refills reach and reshapes do not
    assert canary.req_to_token.base is table and canary.expected_tokens.base is expected
    assert canary.hash_mode is kc.HashMode.PARTIAL and canary.check_expected_token is False


def test_construction_keeps_a_torch_table_zero_copy():
    """A table from another framework is kept as a view of its memory: the engine's later writes
    into it are what the canary reads."""
    torch = pytest.importorskip("torch")
    table = torch.zeros((ROWS, WIDTH), dtype=torch.int32)
    canary = _construct(req_to_token=table)
    table[1, 3] = 42
    assert int(canary.req_to_token[1, 3]) == 42


def test_cuda_slot_translation_launches_once_for_slots_and_never_for_none(monkeypatch):
    """The CUDA launcher of an SWA group's slot translation, on the host with the kernel stood in
    for: no slots, no launch (an empty batch of an SWA group costs nothing); slots, one launch on
    the stream given, over them, the LUT and the output, at most the resident grid."""
    import contextlib
    import types

    from kvcanary_cupy.ops.backends._cuda import session as launcher

    launched, entered = [], []
    monkeypatch.setattr(launcher, "kernel", lambda source, name, device_id:
                        lambda grid, block, args: launched.append((name, grid, args)))
    monkeypatch.setattr(launcher, "resident_grid", lambda *args: 4)

    def device_array(length):
        return types.SimpleNamespace(shape=(length,), device=types.SimpleNamespace(id=0))

    @contextlib.contextmanager
    def stream():
        entered.append(len(launched))
        yield

    lut, out = device_array(5), device_array(9)
    launcher.translate_slots(device_array(0), lut, out, stream=stream())
    assert launched == [] and entered == []
    slots = device_array(9)
    launcher.translate_slots(slots, lut, out, stream=stream())
    ((name, grid, args),) = launched
    assert entered == [0] and name == "kvc_translate_slots" and 1 <= grid[0] <= 4
    assert args[0] is slots and args[2] is lut and args[4] is out and (int(args[1]), int(args[3])) == (9, 5)


@pytest.mark.parametrize("device", BACKENDS)
def test_bookkeeping_kernels(device):
    """The session's device bookkeeping: a SWA group's write slots through the LUT (-1 outside it),
    and the tally of verify launches a plan disabled."""
    from kvcanary_cupy._dlpack import parse_device
    from kvcanary_cupy.ops._dispatch import backend_module

    where = parse_device(device)
    ops = backend_module(where, "session")
    stream = None
    if where.is_cuda:
        import cupy

        stream = cupy.cuda.get_current_stream()
    lut = np.array([0, 17, 18, -1, 19], np.int64)
    loc = np.array([-3, 1, 4, 5, 99, 2, 3, 0, -(1 << 62)], np.int64)
    out = to_device(np.full(loc.shape, 1234, np.int64), device)
    ops.translate_slots(to_device(loc, device), to_device(lut, device), out, stream=stream)
    assert to_numpy(out).tolist() == [-1, 17, 19, -1, -1, 18, -1, 0, -1]
    big = np.arange(100_000, dtype=np.int64) - 7  # a grid-stride's worth, past the LUT and below 0
    out = to_device(np.zeros(big.shape, np.int64), device)
    ops.translate_slots(to_device(big, device), to_device(lut, device), out, stream=stream)
    want = np.where((big >= 0) & (big < lut.size), lut[np.clip(big, 0, lut.size - 1)], -1)
    assert np.array_equal(to_numpy(out), want)

    vplan = kc.VerifyPlan.allocate(4, device=device)
    disabled = to_device(np.array([5], np.int64), device)
    for enable, total in ((1, 5), (0, 6), (0, 7), (2, 7)):
        vplan.enable[...] = enable
        ops.count_disabled(vplan, disabled, stream=stream)
        assert int(to_numpy(disabled)[0]) == total


# --- padding rows anywhere in a batch: every event names the request and position it belongs to ---

def _padded_forward_run(seed: int, static: bool, device: str = "cpu") -> tuple[list, dict, np.ndarray, list]:
    """A canary over a few prefilled requests, then one decode-shaped forward whose batch mixes the
    requests (in random order, 0-2 new tokens each) with padding rows (pool row 0, random extends) at
    random places, the flat arrays padded at the end with junk; one cached K row is corrupted and one
    new token written at a stale position. Returns the forward's events, the pool rows by request,
    the table, and each real row's new slots and positions (eagerly, or through a static forward)."""
    rng = np.random.default_rng(seed)
    slots_n, rows, width = 256, 6, 32
    requests = int(rng.integers(2, rows))
    lens = rng.integers(1, 12, requests)
    table = np.zeros((rows, width), np.int32)
    free = list(rng.permutation(np.arange(1, slots_n)))
    for r in range(requests):
        table[r + 1, :width] = [free.pop() for _ in range(width)]
    k = to_device(rng.standard_normal((slots_n, 2, 8)).astype(np.float32), device)
    caps = kc.Capacities.from_args(req_to_token_pool_size=rows, max_seq_len_per_req=width, pool_slot_count=slots_n,
                                   max_prefill_tokens=rows * width, cuda_graph_max_bs=16)
    canary = kc.Canary(pool_slot_count=slots_n, capacities=caps, req_to_token=to_device(table, device), device=device,
                       hash_mode=kc.HashMode.ALL, real_kv_sources=kc.layouts.per_layer([k]), chain_position_assert=True)
    i64 = int64s_on(device)
    names = [f"r{r}" for r in range(requests)]
    prefill = kc.ForwardBatch(
        req_pool_indices=i64(np.arange(1, requests + 1)), prefix_lens=i64(np.zeros(requests)), extend_seq_lens=i64(lens),
        input_ids=i64(np.concatenate([1000 * (r + 1) + np.arange(n) for r, n in enumerate(lens)])),
        positions=i64(np.concatenate([np.arange(n) for n in lens])),
        out_cache_loc=i64(np.concatenate([table[r + 1, :n] for r, n in enumerate(lens)])), req_ids=names)
    one_forward(canary, prefill)
    assert canary.poll().total == 0
    # the forward: requests in random order, padding rows between them
    order = list(rng.permutation(requests)) + [-1] * int(rng.integers(1, 4))
    rng.shuffle(order)
    rows_, prefix, extend, ids, positions, locs, req_ids, written = [], [], [], [], [], [], [], {}
    for r in order:
        if r < 0:
            rows_.append(0), prefix.append(0), extend.append(int(rng.integers(0, 3))), req_ids.append("pad")
            continue
        n = int(rng.integers(0, 3))
        rows_.append(r + 1), prefix.append(int(lens[r])), extend.append(n), req_ids.append(names[r])
        new = [int(lens[r]) + j for j in range(n)]
        written[names[r]] = [(int(table[r + 1, p]), p) for p in new]
        ids += [1000 * (r + 1) + p for p in new]
        positions += new
        locs += [int(table[r + 1, p]) for p in new]
    junk = int(rng.integers(0, 4))
    ids, locs = ids + list(rng.integers(0, 999, junk)), locs + list(rng.integers(0, slots_n, junk))
    positions = positions + list(rng.integers(0, 99, junk))
    victim = int(rng.integers(requests))
    k[table[victim + 1, int(rng.integers(lens[victim]))], 1, 3] += 1.0
    if locs[:len(locs) - junk]:
        stale = int(rng.integers(len(locs) - junk))
        positions[stale] += 5
    batch = kc.ForwardBatch(req_pool_indices=i64(rows_), prefix_lens=i64(prefix), extend_seq_lens=i64(extend),
                            input_ids=i64(ids), positions=i64(positions), out_cache_loc=i64(locs), req_ids=req_ids)
    if static:
        forward = canary.static_forward(batch)
        forward.before()
        forward.after()
    else:
        one_forward(canary, batch)
    report = canary.poll()
    return [(e.phase, e.request, e.position, e.slot, tuple(e.reasons)) for e in report], \
        {names[r]: r + 1 for r in range(requests)}, table, written


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(40))
def test_events_name_their_request_whatever_the_padding_rows(seed, device):
    """Wherever padding rows stand in a batch and whatever they and the junk past the real tokens
    hold, each verify event names a request whose table holds that slot at that position, each
    write event the request that wrote that slot at that position; static forwards report the same."""
    events, row_of, table, written = _padded_forward_run(seed, static=False, device=device)
    assert events, "the corrupted K row is read by every HEAD verify of its request"
    for phase, request, position, slot, reasons in events:
        assert request in row_of, (phase, request, position, slot, reasons)
        if phase in ("head", "tail"):
            assert int(table[row_of[request], position]) == slot, (phase, request, position, slot)
        else:
            assert (slot, position) in written[request], (phase, request, position, slot, reasons)
    static, _, _, _ = _padded_forward_run(seed, static=True, device=device)
    assert sorted(static, key=repr) == sorted(events, key=repr)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("writer_first", [True, False], ids=["writer-first", "hitters-first"])
def test_prefix_hits_on_blocks_the_same_forward_computes(device, writer_first):
    """Parallel sampling in an engine that offers blocks for sharing when it schedules them: three
    requests hit the full blocks of a prompt that a fourth computes in the same forward. Given to
    the canary as integration.md says (each hitter's prefix only what earlier forwards wrote, the
    shared tokens its own to write too: the same records the writer stores), the forward and the
    decodes after it are clean in either batch order, and a bit flipped in a shared block is then
    reported for every sharer; given as the model sees them, the hitters' HEAD reads unwritten
    records (and, hitters first, their writes chain to them)."""
    page, prompt_len, rows = 16, 200, 5
    full = prompt_len // page * page
    pool = (1 + (prompt_len // page + 1) * 4 + 4) * page
    rng = np.random.default_rng(3)
    table = np.zeros((rows, 256), np.int32)
    kv = to_device(rng.standard_normal((pool // page, page, 2, 8)).astype(np.float32), device)
    blocks = iter(range(1, pool // page))
    writer_blocks = [next(blocks) for _ in range(prompt_len // page + 1)]
    for row in range(1, rows):  # the writer (row 1) and three sharers of its full blocks, each its own tail
        own = writer_blocks if row == 1 else writer_blocks[:-1] + [next(blocks)]
        table[row, :len(own) * page] = (np.array(own)[:, None] * page + np.arange(page)).ravel()
    table = to_device(table, device)
    canary = kc.Canary(pool_slot_count=pool, req_to_token=table, device=device, hash_mode=kc.HashMode.ALL,
                       real_kv_sources=kc.layouts.paged([kv], page_size=page), chain_position_assert=True,
                       capacities=session_capacities(rows, 256, pool, 4 * prompt_len, None))
    prompt = rng.integers(1, 32000, prompt_len)
    order = [1, 2, 3, 4] if writer_first else [2, 3, 4, 1]

    def forward(prefixes: dict, extends: dict, ids: dict) -> kc.CanaryReport:
        host = to_numpy(table)
        loc = np.concatenate([host[row, prefixes[row]:prefixes[row] + extends[row]] for row in order])
        vector = int64s_on(device)
        batch = kc.ForwardBatch(req_pool_indices=vector(order), prefix_lens=vector([prefixes[r] for r in order]),
                                extend_seq_lens=vector([extends[r] for r in order]),
                                input_ids=vector(np.concatenate([ids[r] for r in order])),
                                positions=vector(np.concatenate([np.arange(prefixes[r], prefixes[r] + extends[r])
                                                                 for r in order])),
                                out_cache_loc=vector(loc.astype(np.int64)))
        one_forward(canary, batch)
        return canary.poll()

    as_the_model_sees = forward({1: 0, 2: full, 3: full, 4: full}, {1: prompt_len, 2: 8, 3: 8, 4: 8},
                                {1: prompt, 2: prompt[full:], 3: prompt[full:], 4: prompt[full:]})
    assert "head" in {event.phase for event in as_the_model_sees}
    canary.context.canary_buf[...] = 0  # a fresh pool for the recipe
    assert forward({r: 0 for r in order}, {r: prompt_len for r in order}, {r: prompt for r in order}).total == 0
    for step in range(3):
        token = {r: rng.integers(1, 32000, 1) for r in order}
        report = forward({r: prompt_len + step for r in order}, {r: 1 for r in order}, token)
        assert report.total == 0, report.describe()
    kv[3, 5, 1, 2] += 1.0  # a byte of a shared block changes
    report = forward({r: prompt_len + 3 for r in order}, {r: 1 for r in order},
                     {r: rng.integers(1, 32000, 1) for r in order})
    assert report.requests == {0, 1, 2, 3} and all(e.reasons == ("REAL_KV_HASH",) for e in report)


def _static_decodes_closed(eng: Tiny, count: int, run: bool, poll: bool, rng: np.random.Generator) -> list:
    """``count`` static forwards of request a's next tokens, each over arrays of its own, run once
    (``run``) and closed, as an engine that rebuilds its decode forwards does, with a poll after
    each (``poll``); weak references to their batches' ``input_ids``."""
    refs = []
    for _ in range(count):
        position, slot = eng.lens["a"], eng.next_slot
        eng.table[1, position] = slot
        vector = lambda values: np.asarray(values, np.int64)  # noqa: E731
        arrays = dict(req_pool_indices=vector([1]), prefix_lens=vector([position]), extend_seq_lens=vector([1]),
                      input_ids=vector(rng.integers(1, 32000, 1)), positions=vector([position]),
                      out_cache_loc=vector([slot]))
        forward = eng.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=["a"]))
        refs.append(weakref.ref(arrays["input_ids"]))
        if run:
            forward.before()
            for buffer in (eng.k, eng.v):
                buffer[slot] = rng.standard_normal((2, 8)).astype(np.float32)
            forward.after()
            eng.lens["a"], eng.next_slot = position + 1, slot + 1
        forward.close()
        del forward, arrays
        if poll:
            eng.canary.poll()
    gc.collect()
    return refs


def test_closed_static_forwards_are_let_go_while_the_canary_is_off(caplog):
    """An engine that switches the canary off and builds (and closes) static forwards meanwhile, as
    one that captures its graphs again to stop paying for the canary does, must not pile them up
    for weeks: its polls return at once, so the closed forwards' arrays are held to
    ``max_logged_forwards`` like any forward's, without a word (no run of theirs is left unnamed)."""
    eng = Tiny("cpu", max_logged_forwards=4)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    eng.canary.mode = "off"
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        refs = _static_decodes_closed(eng, 40, run=False, poll=True, rng=np.random.default_rng(11))
    assert "closed static forwards" not in caplog.text
    assert sum(ref() is not None for ref in refs) <= 4
    assert all(len(group.static_log) <= 4 for group in eng.canary.groups)
    # on again: forwards let go of without a run leave the next poll's names and steps as they were
    eng.canary.mode = "log"
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == [
        ("head", 2, "a", 1), ("tail", 2, "a", 1)]
    assert all(not group.static_log for group in eng.canary.groups)


def test_closed_static_forwards_between_polls_are_held_to_max_logged_forwards(caplog):
    """Static forwards run once and closed between two polls hold their batches to
    ``max_logged_forwards`` (the log keeps the first runs' batches, the canary at most that many
    closed forwards), and the poll after them still reports a fault they could not name."""
    eng = Tiny("cpu", max_logged_forwards=4)
    eng.step({"a": 4, "b": 2})
    assert not eng.canary.poll()
    with caplog.at_level(logging.WARNING):
        refs = _static_decodes_closed(eng, 20, run=True, poll=False, rng=np.random.default_rng(12))
    assert sum(ref() is not None for ref in refs) <= 2 * 4
    assert len([r for r in caplog.records if "more than 4 closed static forwards" in r.getMessage()]) == 1
    bad = eng.slot("a", 1)
    eng.k[bad, 0, 0] += 1.0
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    assert report.forwards == 1 + 20 + 1
    assert {e.slot for e in report} == {bad} and {e.phase for e in report} == {"head", "tail"}
    assert all(e.request in ("a", None) for e in report)
    assert all(not group.static_log for group in eng.canary.groups)
    eng.step({"a": 1, "b": 1})
    assert [(e.phase, e.step, e.request, e.position) for e in eng.canary.poll()] == [
        ("head", 23, "a", 1), ("tail", 23, "a", 1)]


def test_the_warning_for_closed_static_forwards_let_go_is_said_once_each_poll(caplog):
    """Past ``max_logged_forwards`` closed static forwards between two polls the canary lets go of
    the oldest, and says so once: once between each two polls, since a poll lets go of them all."""
    eng = Tiny("cpu", max_logged_forwards=2)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    rng = np.random.default_rng(14)
    for done in (1, 2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcanary_cupy"):
            _static_decodes_closed(eng, 5, run=True, poll=False, rng=rng)
        assert len([r for r in caplog.records if "more than 2 closed static forwards" in r.getMessage()]) == 1
        report = eng.canary.poll()
        assert not report and report.forwards == 1 + 5 * done
        assert all(not group.static_log for group in eng.canary.groups)


def test_closed_static_forwards_let_go_still_count_their_replays(monkeypatch):
    """A graph's replays leave no trace on the host (unlogged here, as a replay is). Static forwards
    let go of past ``max_logged_forwards`` keep their run count cells, so the next poll still
    counts every run as a forward, and still reports the fault they read."""
    eng = Tiny("cpu", max_logged_forwards=4)
    eng.step({"a": 4, "b": 2})
    assert not eng.canary.poll()
    bad = eng.slot("a", 1)
    eng.k[bad, 0, 0] += 1.0
    monkeypatch.setattr(kc.session.StaticForward, "_log", lambda *args, **kwargs: None)
    refs = _static_decodes_closed(eng, 20, run=True, poll=False, rng=np.random.default_rng(13))
    assert sum(ref() is not None for ref in refs) <= 4
    report = eng.canary.poll()
    assert report.forwards == 1 + 20
    assert report.total == 2 * 20 and {e.slot for e in report} == {bad}
    assert {e.phase for e in report} == {"head", "tail"} and all(e.request in ("a", None) for e in report)
    assert all(not group.static_log for group in eng.canary.groups)


def _decode_forward_of_a(eng: Tiny) -> tuple:
    """A static forward of request a's next token, over arrays of its own, and that token's slot."""
    batch = _next_token_of_a(eng)
    return eng.canary.static_forward(batch), int(to_numpy(batch.out_cache_loc)[0])


def _run(eng: Tiny, forward: kc.session.StaticForward, slot: int) -> None:
    forward.before()
    for buffer in (eng.k, eng.v):
        buffer[slot] = eng.rng.standard_normal((2, 8)).astype(np.float32)
    forward.after()


@pytest.mark.parametrize("max_logged_forwards", [8, 2])
def test_a_count_array_whose_forwards_a_poll_let_go_is_read_no_more(max_logged_forwards):
    """Static forwards run and closed (past ``max_logged_forwards``, some let go before the poll)
    fill a count array alone; the poll after them lets go of them all, and no later poll reads
    that array: a closed forward's graph replayed by mistake afterwards is not counted, as its
    close() says, and leaves the next forward's rows their step."""
    eng = Tiny("cpu", max_logged_forwards=max_logged_forwards)
    eng.step({"a": 4})
    closed = []
    for _ in range(4):
        forward, slot = _decode_forward_of_a(eng)
        _run(eng, forward, slot)
        forward.close()
        closed.append((forward, slot))
    assert eng.canary.poll().forwards == 5
    forward, slot = closed[0]
    replay_by_mistake(forward)  # it writes its token's record again as it was
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    eng.step({"a": 1})
    report = eng.canary.poll()
    assert report.forwards == 6
    assert [(e.phase, e.step, e.request, e.position) for e in report] == [("head", 6, "a", 1), ("tail", 6, "a", 1)]


def test_the_runs_of_a_static_forward_beside_closed_ones_let_go_are_counted_once(monkeypatch):
    """A static forward kept open beside forwards closed and let go of in the same count array: a
    poll counts the let-go forwards' runs from their cells and the open forward's from its own,
    each once (their graph replays unlogged here, as a replay is)."""
    eng = Tiny("cpu", max_logged_forwards=2)
    eng.step({"a": 4})
    assert not eng.canary.poll()
    monkeypatch.setattr(kc.session.StaticForward, "_log", lambda *args, **kwargs: None)
    kept, kept_slot = _decode_forward_of_a(eng)
    _run(eng, kept, kept_slot)
    for _ in range(4):
        forward, slot = _decode_forward_of_a(eng)
        _run(eng, forward, slot)
        forward.close()
    for _ in range(2):
        _run(eng, kept, kept_slot)
    report = eng.canary.poll()
    assert report.total == 0 and report.forwards == 1 + 3 + 4


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("expected", [False, True], ids=["plain", "expected_tokens"])
def test_requests_past_the_table_are_named_for_every_row(device, expected):
    """Hostile batches record out-of-range rows, each named for its request at its position: a
    request whose prefix runs one past its table row (its verify entry at the first position past
    the row, and its write's seed, which lies in the column at the table's width), and one whose
    pool row lies just past the table. With expected tokens, the poll reads them only inside
    their table."""
    pool = (1000 * np.arange(ROWS)[:, None] + np.arange(WIDTH)).astype(np.int32)  # the tokens Tiny writes
    eng = Tiny(device, **({"expected_tokens": to_device(pool, device)} if expected else {}))
    eng.step({"a": 4, "b": 3})
    assert eng.canary.poll().total == 0
    i64 = int64s_on(device)
    for name, row, prefix, positions in (("a", 1, WIDTH + 1, {WIDTH}), ("b", ROWS, 2, {0, 1})):
        batch = kc.ForwardBatch(req_pool_indices=i64([row]), prefix_lens=i64([prefix]), extend_seq_lens=i64([1]),
                                input_ids=i64([7]), positions=i64([prefix]), out_cache_loc=i64([40]), req_ids=[name])
        one_forward(eng.canary, batch)
        events = eng.canary.poll().events
        assert {event.phase for event in events} == {"head", "tail", "write"}
        assert {event.position for event in events} == positions
        assert all(event.request == name and event.slot == 2**63 - 1  # the unresolved slot
                   and event.violation.fail_reason == kc.FailReason.OUT_OF_RANGE for event in events)
    # two requests past the table, of 2 and 3 positions: the rows at position 2 are the longer one's
    batch = kc.ForwardBatch(req_pool_indices=i64([ROWS, ROWS + 1]), prefix_lens=i64([2, 3]),
                            extend_seq_lens=i64([0, 0]), input_ids=i64([]), positions=i64([]), out_cache_loc=i64([]),
                            req_ids=["b", "c"])
    one_forward(eng.canary, batch)
    last = [event for event in eng.canary.poll().events if event.position == 2]
    assert {event.phase for event in last} == {"head", "tail"} and {event.request for event in last} == {"c"}


def _write_events(eng, batch, cleared=None) -> dict:
    """The write rows one hostile forward records, ``{(slot, chain is 0): (request, position)}``;
    ``cleared``: a table cell the engine zeroes before the poll."""
    one_forward(eng.canary, batch)
    if cleared is not None:
        eng.set_table(cleared, 0)
    events = [event for event in eng.canary.poll().events if event.phase == "write"]
    assert all(event.violation.fail_reason == kc.FailReason.OUT_OF_RANGE for event in events)
    named = {(event.slot, event.violation.stored_chain_hash == 0): (event.request, event.position) for event in events}
    assert len(named) == len(events)
    return named


@pytest.mark.parametrize("device", BACKENDS)
def test_write_rows_without_an_entry_are_named_for_the_request_that_recorded_them(device):
    """The out-of-range rows a write records (SPEC 4) are told apart by shape and named for their
    request: an entry into a slot past the pool (at position 0 with token 0, so that its row has
    the zeros of the rows no entry records but a running chain), a seed past the pool, and entries
    past the batch's arrays. Requests that write nothing record none of them, though one shares the
    bad seed and one lies past the arrays; nor does the one whose entries end at the arrays' end. A
    padded tail past the entries, which the write never reads, names no request either, nor a seed
    row whose cell the table no longer names."""
    eng = Tiny(device)
    eng.step({"a": 4, "b": 3})
    assert eng.canary.poll().total == 0
    past_pool = SLOTS + 3
    eng.set_table(np.s_[3, 1], past_pool)
    i64 = int64s_on(device)
    # s: its seed is past the pool; p: token 0 at position 0 into a slot past the pool, ending at the
    # arrays' end; x: runs past them; z: writes nothing, with s's seed, after x
    batch = kc.ForwardBatch(req_pool_indices=i64([3, 3, 3, 3]), prefix_lens=i64([2, 0, 0, 2]),
                            extend_seq_lens=i64([1, 1, 2, 0]), input_ids=i64([9, 0]), positions=i64([2, 0]),
                            out_cache_loc=i64([50, past_pool]), req_ids=["s", "p", "x", "z"])
    assert _write_events(eng, batch) == \
        {(past_pool, False): ("p", 0), (past_pool, True): ("s", 1), (-1, False): ("x", 0)}
    # the same forward, its seed's cell cleared before the poll: that row is no request's
    assert _write_events(eng, batch, cleared=np.s_[3, 1]) == \
        {(past_pool, False): ("p", 0), (past_pool, True): (None, None), (-1, False): ("x", 0)}
    # arrays bound for two entries, the second a copy of the first that the write never reads
    batch = kc.ForwardBatch(req_pool_indices=i64([3]), prefix_lens=i64([0]), extend_seq_lens=i64([1]),
                            input_ids=i64([0, 0]), positions=i64([0, 0]), out_cache_loc=i64([past_pool, past_pool]),
                            req_ids=["t"])
    assert _write_events(eng, batch) == {(past_pool, False): ("t", 0)}


@pytest.mark.parametrize("device", BACKENDS)
def test_verify_rows_past_the_pool_are_not_taken_for_writes(device):
    """With expected tokens a verify's out-of-range rows can look like a write's: the entry after a
    cell past the pool (its chain unchecked, bit 64 alone) carries the token expected, and a cell
    past the pool at position 0 whose expected token is 0 records zeros where a write's seed row
    has them. They are the verify's, named for the request that read them, but for the one shape
    two launches share: a TAIL row of that second kind is a write seed's row as far as its fields
    tell, and where no write's seed explains it, it keeps the write phase alone."""
    pool = (1000 * np.arange(ROWS)[:, None] + np.arange(WIDTH)).astype(np.int32)  # the tokens Tiny writes
    pool[1, 0] = 0
    eng = Tiny(device, expected_tokens=to_device(pool, device))
    eng.step({"a": 4})
    assert eng.canary.poll().total == 0
    eng.set_table(np.s_[1, :2], SLOTS + 5)
    eng.step({"a": 1})
    events = eng.canary.poll().events
    assert all(event.violation.fail_reason == kc.FailReason.OUT_OF_RANGE for event in events)
    assert sorted((event.phase, event.position, event.request) for event in events if event.request) == \
        [("head", 0, "a"), ("head", 1, "a"), ("head", 2, "a"), ("tail", 1, "a"), ("tail", 2, "a")]
    assert [(event.phase, event.slot) for event in events if event.request is None] == [("write", SLOTS + 5)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_slot_at_the_pools_size_that_a_write_named_is_read_as_out_of_range(device):
    """A write into the slot at the pool's size stores nothing there (it has no record), so a later
    verify row of that slot is named for its reader; the poll does not look for a record past the
    pool."""
    eng = Tiny(device)
    eng.step({"a": 2})
    assert eng.canary.poll().total == 0
    i64 = int64s_on(device)
    first = kc.ForwardBatch(req_pool_indices=i64([3]), prefix_lens=i64([0]), extend_seq_lens=i64([1]),
                            input_ids=i64([5]), positions=i64([0]), out_cache_loc=i64([SLOTS]), req_ids=["q"])
    one_forward(eng.canary, first)
    eng.set_table(np.s_[3, 0], SLOTS)
    second = kc.ForwardBatch(req_pool_indices=i64([3]), prefix_lens=i64([1]), extend_seq_lens=i64([1]),
                             input_ids=i64([6]), positions=i64([1]), out_cache_loc=i64([20]), req_ids=["r"])
    one_forward(eng.canary, second)
    events = eng.canary.poll().events
    assert sorted((event.phase, event.step, event.request, event.position) for event in events) == \
        [("head", 3, "r", 0), ("tail", 3, "r", 0), ("write", 2, "q", 0), ("write", 3, "r", 0)]  # r's seed too
    assert {event.slot for event in events} == {SLOTS}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("verify_capacity", [None, 5], ids=["room", "just-fits"])
def test_a_padding_request_is_never_named_whatever_its_table_row_holds(device, verify_capacity):
    """A padding request (pool row 0) checks nothing (SPEC 3.3), whatever row 0 of the table
    holds: a corrupted slot that row 0 also names is put on the request that read it, alone. Nor
    does its length count toward the verify capacity: where the request's own entries just fit (4
    at HEAD, 5 at TAIL), its verifies ran, and their rows are named."""
    eng = Tiny(device, verify_capacity=verify_capacity)
    eng.step({"a": 4, "b": 3})
    assert eng.canary.poll().total == 0
    eng.set_table(np.s_[0, :4], to_numpy(eng.table)[1, :4])  # row 0 names the slots of 'a'
    eng.k[eng.slot("a", 1), 0, 0] += 1.0
    i64 = int64s_on(device)
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 0]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([1, 0]),
                            input_ids=i64([7]), positions=i64([4]), out_cache_loc=i64([40]), req_ids=["a", "padding"])
    one_forward(eng.canary, batch)
    report = eng.canary.poll()
    events = report.events
    assert report.capacity_overflows == 0 and {event.phase for event in events} == {"head", "tail"}
    assert all(event.request == "a" and event.position == 1 and event.slot == eng.slot("a", 1)
               and event.violation.fail_reason & kc.FailReason.REAL_KV_HASH for event in events)


@pytest.mark.parametrize("device", BACKENDS)
def test_a_poll_interrupted_while_it_empties_a_ring_hands_on_every_count(device, monkeypatch):
    """A poll interrupted as it empties the first ring holds its report for the next poll, which
    hands it over with the rows, dropped rows and skipped verifies of the rings it reads again
    (none was emptied): every count twice, the second time with no step."""
    corrupted = [("a", position) for position in range(6)]  # more rows than a ring of 4 holds
    whole = _overflow_swa_and_sweep(Tiny(device, verify_capacity=10, swa=True, ring_capacity=4), corrupted)
    assert whole.dropped > 0 and whole.capacity_overflows > 0 and whole.total > whole.dropped
    eng = Tiny(device, verify_capacity=10, swa=True, ring_capacity=4)
    clear = kc.CanaryContext.clear_violations

    def interrupted(ctx):
        monkeypatch.setattr(kc.CanaryContext, "clear_violations", clear)
        raise KeyboardInterrupt

    monkeypatch.setattr(kc.CanaryContext, "clear_violations", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _overflow_swa_and_sweep(eng, corrupted)
    again = eng.canary.poll()
    assert (again.total, again.dropped, again.capacity_overflows) == (
        2 * whole.total, 2 * whole.dropped, 2 * whole.capacity_overflows)
    assert _event_keys(again.events[:len(whole.events)]) == _event_keys(whole)
    assert all(event.step is None for event in again.events[len(whole.events):])
    assert not eng.canary.poll()
