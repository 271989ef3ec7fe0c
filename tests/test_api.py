"""The public contract of SPEC §6: the names, enum values, defaults and call forms users and outside
test suites rely on."""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect

import numpy as np
import pytest

import kvcanary_cupy as kc

KW = inspect.Parameter.KEYWORD_ONLY
POS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
REQUIRED = inspect.Parameter.empty


def _params(fn) -> dict:
    return dict(inspect.signature(fn).parameters)


def _check(fn, positional: list[str], keyword: dict) -> None:
    """``fn`` takes ``positional`` first (positionally), then every name of ``keyword`` as a
    keyword-only argument whose default is the value given (``REQUIRED``: no default)."""
    params = _params(fn)
    names = list(params)
    assert names[:len(positional)] == positional, names
    for name in positional:
        assert params[name].kind in POS, name
    for name, default in keyword.items():
        assert name in params, name
        assert params[name].kind == KW, name
        assert params[name].default is default or params[name].default == default, (name, params[name].default)


def test_enums_hold_the_values_of_section_2():
    assert issubclass(kc.HashMode, enum.IntEnum)
    assert {m.name: int(m) for m in kc.HashMode} == {"NONE": 0, "PARTIAL": 1, "ALL": 2}
    assert issubclass(kc.LaunchTag, enum.IntEnum)
    names = [f"{phase}_{kv}_{group}" for group in ("FULL", "SWA") for phase in ("HEAD", "TAIL", "SWEEP")
             for kv in ("K", "V")]
    assert {m.name: int(m) for m in kc.LaunchTag} == {name: value for value, name in enumerate(names)}
    assert issubclass(kc.FailReason, enum.IntFlag)
    assert {m.name: int(m) for m in kc.FailReason} == {
        "CHAIN_HASH": 1, "POSITION": 2, "REAL_KV_HASH": 4, "WRITE_TOKEN": 8, "WRITE_POSITION": 16,
        "VERIFY_TOKEN": 32, "OUT_OF_RANGE": 64}
    assert kc.UNRESOLVED_SLOT == 2**63 - 1


def test_allocation_defaults():
    """``CanaryContext.allocate(num_slots, *, device="cpu", ring_capacity=1024, slot_stride_bytes=32,
    real_kv_sources=(), hash_mode=NONE)``; the plans' ``allocate(capacity, device=...)``."""
    _check(kc.CanaryContext.allocate, ["num_slots"],
           dict(device="cpu", ring_capacity=1024, slot_stride_bytes=32, real_kv_sources=(),
                hash_mode=kc.HashMode.NONE))
    ctx = kc.CanaryContext.allocate(5)
    assert ctx.ring_capacity == 1024 and ctx.slot_stride_bytes == 32 and ctx.num_slots == 5
    assert ctx.hash_mode == kc.HashMode.NONE and tuple(ctx.real_kv_sources) == ()
    assert ctx.canary_buf.shape == (5, 32) and ctx.canary_buf.dtype == np.uint8
    assert ctx.violation_ring.shape == (1024, 8) and ctx.violation_ring.dtype == np.int64
    for name, dtype in (("violation_write_index", np.int32), ("slot_run_counter", np.int64),
                        ("kernel_run_counter", np.int64), ("chain_position_assert", np.int32)):
        cell = getattr(ctx, name)
        assert cell.shape == (1,) and cell.dtype == dtype, name
    assert "device" in _params(kc.VerifyPlan.allocate) and "device" in _params(kc.WritePlan.allocate)
    vplan, wplan = kc.VerifyPlan.allocate(6), kc.WritePlan.allocate(3)
    assert [f.name for f in dataclasses.fields(vplan) if f.init] == [
        "slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices", "num_valid", "enable"]
    assert [f.name for f in dataclasses.fields(wplan) if f.init] == ["offsets", "seed_slot_indices", "num_valid_reqs"]
    assert vplan.slot_indices.shape == (6,) and wplan.offsets.shape == (4,) and wplan.seed_slot_indices.shape == (3,)


def test_context_from_own_arrays_takes_the_named_fields():
    fields = [f.name for f in dataclasses.fields(kc.CanaryContext) if f.init]
    assert fields == ["canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                      "kernel_run_counter", "chain_position_assert", "real_kv_sources", "hash_mode"]


def test_ops_take_keyword_arguments_with_the_specs_defaults():
    _check(kc.plan, ["vplan", "wplan"],
           dict(req_pool_indices=REQUIRED, prefix_lens=REQUIRED, extend_seq_lens=REQUIRED, req_to_token=REQUIRED,
                swa_window_size=0, full_to_swa_index_mapping=None, req_to_verify_expected_tokens=None,
                req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0, stream=None))
    _check(kc.write, ["ctx", "wplan"],
           dict(tag=REQUIRED, input_ids=REQUIRED, positions=REQUIRED, out_cache_loc=REQUIRED,
                expected_input_tokens=None, expected_input_positions=None, stream=None))
    _check(kc.verify, ["ctx", "vplan"], dict(tag=REQUIRED, check_expected_token=False, stream=None))
    _check(kc.scatter_req_token_ids, [],
           dict(flat_in=REQUIRED, offsets=REQUIRED, req_pool_indices=REQUIRED, pool_out=REQUIRED, stream=None))
    _check(kc.Capacities.from_args, [],
           dict(req_to_token_pool_size=REQUIRED, max_seq_len_per_req=REQUIRED, pool_slot_count=REQUIRED,
                max_prefill_tokens=REQUIRED, cuda_graph_max_bs=0, speculative_num_draft_tokens=0,
                chunked_prefill_size=None))
    _check(kc.RealKvSource, [], {})
    assert list(_params(kc.RealKvSource))[:4] == ["tensor", "page_size", "num_bytes_per_token", "read_bytes"]


def test_ops_return_nothing_and_write_in_place():
    rng = np.random.default_rng(61)
    ctx = kc.CanaryContext.allocate(8)
    vplan, wplan = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(2)
    table = np.zeros((2, 4), np.int32)
    table[1, :3] = [3, 5, 6]
    ids = rng.integers(1, 2**40, size=3)
    assert kc.plan(vplan, wplan, req_pool_indices=np.array([1]), prefix_lens=np.array([0]),
                   extend_seq_lens=np.array([3]), req_to_token=table) is None
    assert kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=ids, positions=np.arange(3),
                    out_cache_loc=np.array([3, 5, 6])) is None
    assert ctx.canary_buf.view(np.int64)[5, :2].tolist() == [int(ids[1]), 1]
    assert kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL) is None
    pool = np.zeros((2, 4), np.int32)
    assert kc.scatter_req_token_ids(flat_in=np.array([7, 8]), offsets=np.array([0, 2]), req_pool_indices=np.array([1]),
                                    pool_out=pool) is None
    assert pool[1].tolist() == [7, 8, 0, 0]


def test_bundles_of_arrays_compare_and_hash_by_identity():
    """A context, a plan or a session's batch is its memory, as a RealKvSource is: comparing two,
    or looking one up in a list or a dict, neither compares their arrays' elements nor raises."""
    table = np.zeros((2, 4), np.int32)
    one = np.ones(1, np.int64)
    canary = kc.Canary(pool_slot_count=8, req_to_token=table, capacities=kc.Capacities.from_args(
        req_to_token_pool_size=2, max_seq_len_per_req=4, pool_slot_count=8, max_prefill_tokens=4))
    pairs = [(kc.CanaryContext.allocate(8), kc.CanaryContext.allocate(8)),
             (kc.VerifyPlan.allocate(4), kc.VerifyPlan.allocate(4)),
             (kc.WritePlan.allocate(2), kc.WritePlan.allocate(2)),
             (kc.ForwardBatch(one, one, one, one, one, one), kc.ForwardBatch(one, one, one, one, one, one)),
             (kc.LiveRequests(one, one), kc.LiveRequests(one, one)),
             (kc.SwaGroup(window=2, lut=np.arange(9), num_slots=8), kc.SwaGroup(window=2, lut=np.arange(9), num_slots=8)),
             (canary.context, kc.CanaryContext.allocate(8))]
    for first, second in pairs:
        assert first == first and first != second and second in [first, second]
        assert len({first, second}) == 2


def test_real_kv_source_is_frozen():
    source = kc.RealKvSource(tensor=np.ones((4, 32), np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.page_size = 2


def test_violations_decode_rows_with_named_fields():
    """``ctx.violations()``: kc.Violation rows whose fields carry the §2 columns (the fail bits as
    kc.FailReason flags), the total count and how many the ring dropped."""
    ctx = kc.CanaryContext.allocate(4, ring_capacity=1)
    plan = kc.VerifyPlan(slot_indices=np.array([9, 7]), expected_tokens=np.array([5, 6]),
                         expected_positions=np.array([2, 3]), prev_slot_indices=np.array([1, 1]),
                         num_valid=np.array([2], np.int32), enable=np.array([1], np.int32))
    kc.verify(ctx, plan, tag=kc.LaunchTag.SWEEP_V_SWA, check_expected_token=True)
    report = ctx.violations()
    assert (report.total, report.dropped, len(report)) == (2, 1, 1)
    row = report[0]
    assert isinstance(row, kc.Violation)
    assert [f.name for f in dataclasses.fields(row)] == [
        "kernel_kind", "slot_idx", "position", "stored_token", "expected_token", "stored_chain_hash",
        "expected_aux", "fail_reason"]
    assert (row.kernel_kind, row.slot_idx, row.position, row.stored_token, row.expected_token,
            row.stored_chain_hash, row.expected_aux) == (kc.LaunchTag.SWEEP_V_SWA, 9, 2, 0, 5, 0, 0)
    assert row.fail_reason == kc.FailReason.OUT_OF_RANGE and isinstance(row.fail_reason, kc.FailReason)
    assert isinstance(report, collections.abc.Sequence)
    assert list(report) == [row] and row in report and report.index(row) == 0 and report[-1:] == (row,)


def test_violations_of_a_ring_that_kept_no_row_are_true():
    """A ring of no row counts what it cannot keep: the report has no row, but it is true."""
    ctx = kc.CanaryContext.allocate(4, ring_capacity=0)
    plan = kc.VerifyPlan(slot_indices=np.array([9]), expected_tokens=np.array([5]), expected_positions=np.array([2]),
                         prev_slot_indices=np.array([1]), num_valid=np.array([1], np.int32),
                         enable=np.array([1], np.int32))
    kc.verify(ctx, plan, tag=kc.LaunchTag.HEAD_K_FULL)
    report = ctx.violations()
    assert report and len(report) == 0 and (report.total, report.dropped) == (1, 1)


def test_a_report_of_no_violation_is_false():
    """A ring that counted nothing gives an empty report that is false: ``if ctx.violations():``
    is the check an engine writes."""
    report = kc.CanaryContext.allocate(4).violations()
    assert not report and len(report) == 0 and (report.total, report.dropped) == (0, 0)


def _context_over_ring(ring: np.ndarray, rows: int) -> kc.CanaryContext:
    """A context of the caller's own arrays whose ring holds ``ring`` with ``rows`` rows written."""
    return kc.CanaryContext(canary_buf=np.zeros((4, 32), np.uint8), violation_ring=ring,
                            violation_write_index=np.array([rows], np.int32), slot_run_counter=np.zeros(1, np.int64),
                            kernel_run_counter=np.zeros(1, np.int64), chain_position_assert=np.zeros(1, np.int32))


def test_a_row_describes_its_reasons_by_name_or_as_none():
    """``describe()`` lists a row's fail reasons by name, joined with ``|``, and says ``none`` for a
    row that holds no reason bit."""
    ring = np.random.default_rng(99).integers(1, 50, size=(2, 8))
    ring[:, 0] = int(kc.LaunchTag.HEAD_K_FULL)
    ring[0, 7], ring[1, 7] = int(kc.FailReason.CHAIN_HASH | kc.FailReason.POSITION), 0
    first, second = _context_over_ring(ring, 2).violations()
    assert first.describe().startswith(f"HEAD_K_FULL: slot {ring[0, 1]} position {ring[0, 2]} "
                                       "[CHAIN_HASH|POSITION] token")
    assert second.describe().startswith(f"HEAD_K_FULL: slot {ring[1, 1]} position {ring[1, 2]} [none] token")


def test_a_row_describes_its_tokens_chain_and_aux_in_full():
    """``describe()`` gives the stored and expected tokens and the stored chain hash and aux word as
    the 64-bit patterns they are (an int64 cell that reads negative is its unsigned pattern)."""
    from kvcanary_cupy import _layout as L

    ring = np.random.default_rng(97).integers(1, 50, size=(1, 8))
    ring[0, L.RING_COL_KERNEL_KIND] = int(kc.LaunchTag.TAIL_K_FULL)
    ring[0, L.RING_COL_FAIL_BITS] = int(kc.FailReason.CHAIN_HASH)
    ring[0, L.RING_COL_STORED_CHAIN_HASH] = -0x3F1E5A0C9B7D2E41  # the cell of 0xC0E1A5F36482D1BF
    ring[0, L.RING_COL_EXPECTED_AUX] = 0x00A1B2C3D4E5F607
    (row,) = _context_over_ring(ring, 1).violations()
    assert row.describe() == (
        f"TAIL_K_FULL: slot {ring[0, 1]} position {ring[0, 2]} [CHAIN_HASH] token stored={ring[0, 3]} "
        f"expected={ring[0, 4]} chain stored=0xc0e1a5f36482d1bf aux=0x00a1b2c3d4e5f607")


def test_a_row_of_no_launch_tag_keeps_its_kind():
    """A ring row whose kind is no LaunchTag (a ring of the caller's own, written by something else)
    decodes with its kind as the number it is, not as some tag."""
    ring = np.random.default_rng(98).integers(1, 50, size=(2, 8))
    ring[0, 0], ring[0, 7] = 99, int(kc.FailReason.CHAIN_HASH)
    row = _context_over_ring(ring, 1).violations()[0]
    assert row.kernel_kind == 99 and not isinstance(row.kernel_kind, kc.LaunchTag)
    assert row.describe().startswith("99: ")


def test_counters_and_violations_count_past_int32_alike():
    """Past 2**31 rows the int32 write index reads negative: ``counters()`` counts the rows as
    ``violations()`` does, not as a negative number."""
    ctx = kc.CanaryContext.allocate(4, ring_capacity=1)
    ctx.violation_write_index[0] = 2**31 - 1
    plan = kc.VerifyPlan(slot_indices=np.array([9]), expected_tokens=np.array([5]), expected_positions=np.array([2]),
                         prev_slot_indices=np.array([1]), num_valid=np.array([1], np.int32),
                         enable=np.array([1], np.int32))
    kc.verify(ctx, plan, tag=kc.LaunchTag.HEAD_K_FULL)
    assert ctx.violations().total == 2**31
    assert ctx.counters()["violations"] == 2**31
