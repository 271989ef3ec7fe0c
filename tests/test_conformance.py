"""The shared conformance cases, run through the public API on every available backend.

Skipped when ``../shared`` is absent (a user's checkout has none).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import kvcanary_cupy as kc
from _conformance import canary_buffer, i64, load_cases, source_views
from _devices import BACKENDS, to_device, to_numpy

CASES = load_cases()
pytestmark = pytest.mark.skipif(not CASES, reason="shared conformance cases not present")


def _ids(op: str):
    return [(i, c) for i, c in enumerate(CASES) if c["op"] == op]


def _context(case: dict, device: str, ring_capacity: int | None = None) -> kc.CanaryContext:
    buf = to_device(canary_buffer(case), device)
    sources = tuple(
        kc.RealKvSource(tensor=to_device(view, device, keep_strides=True), page_size=s["page_size"],
                        num_bytes_per_token=s["num_bytes_per_token"], read_bytes=s["read_bytes"])
        for view, s in source_views(case)
    )
    return kc.CanaryContext(
        canary_buf=buf,
        violation_ring=to_device(np.zeros((ring_capacity or case["ring_capacity"], 8), np.int64), device),
        violation_write_index=to_device(np.zeros(1, np.int32), device),
        slot_run_counter=to_device(np.zeros(1, np.int64), device),
        kernel_run_counter=to_device(np.zeros(1, np.int64), device),
        chain_position_assert=to_device(np.array([case.get("chain_position_assert", 0)], np.int32), device),
        real_kv_sources=sources,
        hash_mode=kc.HashMode(case["hash_mode"]),
    )


def _rows(ctx: kc.CanaryContext) -> list[list[int]]:
    return [[int(r.kernel_kind), r.slot_idx, r.position, r.stored_token, r.expected_token, r.stored_chain_hash,
             r.expected_aux, int(r.fail_reason)] for r in ctx.violations()]


def _check_ring(ctx: kc.CanaryContext, expected: dict, ordered: bool, all_rows=None) -> None:
    """Rows in entry order on the CPU; as a multiset on the GPU, where an overflowing ring keeps
    whichever rows claimed the first cells: then they must be among ``all_rows()``, the launch's
    complete row set (from the CPU with a ring large enough)."""
    report = ctx.violations()
    got = _rows(ctx)
    if ordered:
        assert got == expected["violations"]
    elif report.dropped and all_rows is not None:
        assert len(got) == ctx.ring_capacity
        assert not Counter(map(tuple, got)) - Counter(map(tuple, all_rows()))
    else:
        assert Counter(map(tuple, got)) == Counter(map(tuple, expected["violations"]))
    assert report.total == expected["violation_write_index"]
    counters = ctx.counters()
    assert counters["slot_run_counter"] == expected["slot_run_counter"]
    assert counters["kernel_run_counter"] == expected["kernel_run_counter"]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("index,case", _ids("verify"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_verify_case(device, index, case):
    ctx = _run_verify(case, device)
    assert to_numpy(ctx.canary_buf).tobytes().hex() == case["canary_buf"], "verify must not modify the canary buffer"
    total = case["expected"]["violation_write_index"]
    _check_ring(ctx, case["expected"], ordered=device == "cpu",
                all_rows=lambda: _rows(_run_verify(case, "cpu", ring_capacity=total)))


def _run_verify(case: dict, device: str, ring_capacity: int | None = None) -> kc.CanaryContext:
    ctx = _context(case, device, ring_capacity)
    vplan = kc.VerifyPlan(
        slot_indices=to_device(i64(case["slot_indices"]), device),
        expected_tokens=to_device(i64(case["expected_tokens"]), device),
        expected_positions=to_device(i64(case["expected_positions"]), device),
        prev_slot_indices=to_device(i64(case["prev_slot_indices"]), device),
        num_valid=to_device(np.array([case["num_valid"]], np.int32), device),
        enable=to_device(np.array([case["enable"]], np.int32), device),
    )
    kc.verify(ctx, vplan, tag=case["tag"], check_expected_token=case["check_expected_token"])
    return ctx


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("index,case", _ids("write"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_write_case(device, index, case):
    ctx = _run_write(case, device)
    assert to_numpy(ctx.canary_buf).tobytes().hex() == case["expected"]["canary_buf"]
    total = case["expected"]["violation_write_index"]
    _check_ring(ctx, case["expected"], ordered=device == "cpu",
                all_rows=lambda: _rows(_run_write(case, "cpu", ring_capacity=total)))


def _run_write(case: dict, device: str, ring_capacity: int | None = None) -> kc.CanaryContext:
    ctx = _context(case, device, ring_capacity)
    wplan = kc.WritePlan.from_host(offsets=case["offsets"], seed_slot_indices=case["seed_slot_indices"],
                                   num_valid_reqs=case["num_valid_reqs"], device=device)
    expected_tokens = case["expected_input_tokens"]
    kc.write(
        ctx, wplan, tag=case["tag"],
        input_ids=to_device(i64(case["input_ids"]), device),
        positions=to_device(i64(case["positions"]), device),
        out_cache_loc=to_device(i64(case["out_cache_loc"]), device),
        expected_input_tokens=None if expected_tokens is None else to_device(i64(expected_tokens), device),
        expected_input_positions=None if expected_tokens is None else to_device(
            i64(case["expected_input_positions"]), device),
    )
    return ctx


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("index,case", _ids("plan"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_plan_case(device, index, case):
    bs = len(case["req_pool_indices"])
    vplan = kc.VerifyPlan.allocate(case["verify_capacity"], device=device)
    wplan = kc.WritePlan.allocate(case["write_req_capacity"], device=device)
    table = case["req_to_token"]
    req_to_token = np.array(table, dtype=np.int32).reshape(len(table), len(table[0]) if table else 0)
    lut = case["full_to_swa_index_mapping"]
    expected_pool = case["req_to_verify_expected_tokens"]
    kc.plan(
        vplan, wplan,
        req_pool_indices=to_device(i64(case["req_pool_indices"]), device),
        prefix_lens=to_device(i64(case["prefix_lens"]), device),
        extend_seq_lens=to_device(i64(case["extend_seq_lens"]), device),
        req_to_token=to_device(req_to_token, device),
        swa_window_size=case["swa_window_size"],
        full_to_swa_index_mapping=None if lut is None else to_device(i64(lut), device),
        req_to_verify_expected_tokens=None if expected_pool is None else to_device(
            np.array(expected_pool, dtype=np.int32), device),
        req_to_verify_expected_tokens_valid_lens=None if expected_pool is None else to_device(
            i64(case["req_to_verify_expected_tokens_valid_lens"]), device),
        kv_token_id_vs_position_offset=case["kv_token_id_vs_position_offset"],
    )
    expected = case["expected"]
    num_valid = int(to_numpy(vplan.num_valid)[0])
    assert num_valid == expected["num_valid"]
    assert int(to_numpy(vplan.enable)[0]) == expected["enable"]
    if expected["enable"]:
        for field in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
            assert to_numpy(getattr(vplan, field))[:num_valid].tolist() == expected[field], field
    assert to_numpy(wplan.offsets).tolist() == expected["offsets"]
    assert to_numpy(wplan.seed_slot_indices)[:bs].tolist() == expected["seed_slot_indices"]
    assert int(to_numpy(wplan.num_valid_reqs)[0]) == expected["num_valid_reqs"]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("index,case", _ids("scatter_req_token_ids"),
                         ids=lambda v: str(v) if isinstance(v, int) else "")
def test_scatter_case(device, index, case):
    pool_out = to_device(np.array(case["pool_out"], dtype=np.int32), device)
    kc.scatter_req_token_ids(flat_in=to_device(i64(case["flat_in"]), device),
                             offsets=to_device(i64(case["offsets"]), device),
                             req_pool_indices=to_device(i64(case["req_pool_indices"]), device), pool_out=pool_out)
    assert to_numpy(pool_out).tolist() == case["expected"]["pool_out"]


def test_spec_test_values():
    from kvcanary_cupy.ops.backends._cpu import hashing
    values = __import__("json").loads(__import__("_conformance").CASES_PATH.read_text())["spec_test_values"]
    assert int(hashing.sm(np.uint64(0))) == values["sm_0"]
    assert int(hashing.sm(np.uint64(kc._layout.CHAIN_ANCHOR))) == values["sm_anchor"]
    assert int(hashing.mix3(np.uint64(1), np.uint64(2), np.uint64(3))) == values["mix3_1_2_3"]
