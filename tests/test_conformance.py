"""The shared conformance cases, run through the public API on every available backend.

Skipped when ``../shared`` is absent (a user's checkout has none).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import reference as ref
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


def _on(device: str, arrays: dict) -> dict:
    """Each of the host ``arrays`` copied to ``device`` (None kept)."""
    return {name: None if array is None else to_device(array, device) for name, array in arrays.items()}


def _verify_plan(case: dict) -> dict:
    """The verify case's plan as host arrays, by ``kc.VerifyPlan``'s field names."""
    fields = ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices")
    return {**{name: i64(case[name]) for name in fields}, "num_valid": np.array([case["num_valid"]], np.int32),
            "enable": np.array([case["enable"]], np.int32)}


def _run_verify(case: dict, device: str, ring_capacity: int | None = None) -> kc.CanaryContext:
    ctx = _context(case, device, ring_capacity)
    vplan = kc.VerifyPlan(**_on(device, _verify_plan(case)))
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
    kc.write(ctx, wplan, tag=case["tag"], **_on(device, _write_inputs(case)))
    return ctx


def _write_inputs(case: dict) -> dict:
    """The write case's entries as host arrays, by ``kc.write``'s argument names (the expected
    tokens and positions None where the case has none)."""
    expected = case["expected_input_tokens"] is not None
    return {"input_ids": i64(case["input_ids"]), "positions": i64(case["positions"]),
            "out_cache_loc": i64(case["out_cache_loc"]),
            "expected_input_tokens": i64(case["expected_input_tokens"]) if expected else None,
            "expected_input_positions": i64(case["expected_input_positions"]) if expected else None}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("index,case", _ids("plan"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_plan_case(device, index, case):
    vplan = kc.VerifyPlan.allocate(case["verify_capacity"], device=device)
    wplan = kc.WritePlan.allocate(case["write_req_capacity"], device=device)
    kc.plan(vplan, wplan, swa_window_size=case["swa_window_size"],
            kv_token_id_vs_position_offset=case["kv_token_id_vs_position_offset"],
            **_on(device, _plan_inputs(case)))
    _assert_plans(case, {name: to_numpy(getattr(vplan, name)) for name in kc.VerifyPlan.ARRAYS},
                  {name: to_numpy(getattr(wplan, name)) for name in kc.WritePlan.ARRAYS})


def _plan_inputs(case: dict) -> dict:
    """The plan case's batch and tables as host arrays, by ``kc.plan``'s argument names (None where
    the case has none)."""
    table, lut = case["req_to_token"], case["full_to_swa_index_mapping"]
    expected_pool = case["req_to_verify_expected_tokens"]
    return {"req_pool_indices": i64(case["req_pool_indices"]), "prefix_lens": i64(case["prefix_lens"]),
            "extend_seq_lens": i64(case["extend_seq_lens"]),
            "req_to_token": np.array(table, dtype=np.int32).reshape(len(table), len(table[0]) if table else 0),
            "full_to_swa_index_mapping": None if lut is None else i64(lut),
            "req_to_verify_expected_tokens": None if expected_pool is None else np.array(expected_pool, np.int32),
            "req_to_verify_expected_tokens_valid_lens": None if expected_pool is None else i64(
                case["req_to_verify_expected_tokens_valid_lens"])}


def _assert_plans(case: dict, vplan: dict, wplan: dict) -> None:
    """``vplan`` and ``wplan`` (host arrays by the plans' field names) are the case's expected plans."""
    expected = case["expected"]
    num_valid = int(vplan["num_valid"][0])
    assert num_valid == expected["num_valid"]
    assert int(vplan["enable"][0]) == expected["enable"]
    if expected["enable"]:
        for field in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
            assert vplan[field][:num_valid].tolist() == expected[field], field
    assert wplan["offsets"].tolist() == expected["offsets"]
    assert wplan["seed_slot_indices"][:len(case["req_pool_indices"])].tolist() == expected["seed_slot_indices"]
    assert int(wplan["num_valid_reqs"][0]) == expected["num_valid_reqs"]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("index,case", _ids("scatter_req_token_ids"),
                         ids=lambda v: str(v) if isinstance(v, int) else "")
def test_scatter_case(device, index, case):
    pool_out = to_device(np.array(case["pool_out"], dtype=np.int32), device)
    kc.scatter_req_token_ids(flat_in=to_device(i64(case["flat_in"]), device),
                             offsets=to_device(i64(case["offsets"]), device),
                             req_pool_indices=to_device(i64(case["req_pool_indices"]), device), pool_out=pool_out)
    assert to_numpy(pool_out).tolist() == case["expected"]["pool_out"]


# The plain-Python model (kvcanary_cupy.reference), which the backends are fuzzed against, meets the
# same cases: the oracle is checked against the specification's own values, not only against them.

def _model_sources(case: dict) -> list:
    if case["hash_mode"] == int(kc.HashMode.NONE):
        return []
    partial = case["hash_mode"] == int(kc.HashMode.PARTIAL)
    return [(view, s["page_size"], s["num_bytes_per_token"],
             kc._layout.PARTIAL_READ_BYTES if partial else s["read_bytes"]) for view, s in source_views(case)]


def _model_run(case: dict, op) -> tuple[np.ndarray, list, int, int, int]:
    """(canary bytes, ring rows, write index, slot and kernel counters) after ``op`` on the case's
    state."""
    buf = canary_buffer(case)
    ring = np.zeros((case["ring_capacity"], 8), np.int64)
    write_index = np.zeros(1, np.int32)
    counters = np.zeros(1, np.int64), np.zeros(1, np.int64)
    op(buf, _model_sources(case), ring, write_index, *counters)
    total = int(write_index[0])
    rows = ring[:max(0, min(total, ring.shape[0]))].tolist()
    return buf, rows, total, int(counters[0][0]), int(counters[1][0])


def _assert_model_state(got, case: dict, canary_hex: str) -> None:
    buf, rows, total, slot_runs, kernel_runs = got
    expected = case["expected"]
    assert buf.tobytes().hex() == canary_hex
    assert rows == expected["violations"]
    assert (total, slot_runs, kernel_runs) == (expected["violation_write_index"], expected["slot_run_counter"],
                                               expected["kernel_run_counter"])


@pytest.mark.parametrize("index,case", _ids("verify"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_model_meets_the_verify_case(index, case):
    plan = _verify_plan(case)
    got = _model_run(case, lambda *state: ref.verify(
        *state, slots=plan["slot_indices"], expected_tokens=plan["expected_tokens"],
        expected_positions=plan["expected_positions"], prev_slots=plan["prev_slot_indices"],
        num_valid=plan["num_valid"], enable=plan["enable"], check_expected_token=case["check_expected_token"],
        tag=case["tag"]))
    _assert_model_state(got, case, case["canary_buf"])


@pytest.mark.parametrize("index,case", _ids("write"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_model_meets_the_write_case(index, case):
    entries = _write_inputs(case)
    got = _model_run(case, lambda *state: ref.write(
        *state, offsets=i64(case["offsets"]), seed_slots=i64(case["seed_slot_indices"]),
        num_valid_reqs=np.array([case["num_valid_reqs"]], np.int32), input_ids=entries["input_ids"],
        positions=entries["positions"], out_cache_loc=entries["out_cache_loc"],
        expected_tokens=entries["expected_input_tokens"], expected_positions=entries["expected_input_positions"],
        chain_position_assert=np.array([case.get("chain_position_assert", 0)], np.int32), tag=case["tag"]))
    _assert_model_state(got, case, case["expected"]["canary_buf"])


@pytest.mark.parametrize("index,case", _ids("plan"), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_model_meets_the_plan_case(index, case):
    inputs = _plan_inputs(case)
    vplan = {name: np.zeros(case["verify_capacity"], np.int64) for name in kc.VerifyPlan.ARRAYS[:4]}
    vplan.update(num_valid=np.zeros(1, np.int32), enable=np.zeros(1, np.int32))
    wplan = {"offsets": np.zeros(case["write_req_capacity"] + 1, np.int64),
             "seed_slot_indices": np.zeros(case["write_req_capacity"], np.int64),
             "num_valid_reqs": np.zeros(1, np.int32)}
    ref.plan(req_pool_indices=inputs["req_pool_indices"], prefix_lens=inputs["prefix_lens"],
             extend_lens=inputs["extend_seq_lens"], req_to_token=inputs["req_to_token"],
             swa_window=case["swa_window_size"], lut=inputs["full_to_swa_index_mapping"],
             expected_pool=inputs["req_to_verify_expected_tokens"],
             valid_lens=inputs["req_to_verify_expected_tokens_valid_lens"],
             token_offset=case["kv_token_id_vs_position_offset"],
             v_slots=vplan["slot_indices"], v_tokens=vplan["expected_tokens"], v_positions=vplan["expected_positions"],
             v_prev=vplan["prev_slot_indices"], v_num_valid=vplan["num_valid"], v_enable=vplan["enable"],
             w_offsets=wplan["offsets"], w_seeds=wplan["seed_slot_indices"], w_num_valid_reqs=wplan["num_valid_reqs"])
    _assert_plans(case, vplan, wplan)


@pytest.mark.parametrize("index,case", _ids("scatter_req_token_ids"),
                         ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_model_meets_the_scatter_case(index, case):
    pool_out = np.array(case["pool_out"], dtype=np.int32)
    ref.scatter_req_token_ids(flat_in=i64(case["flat_in"]), offsets=i64(case["offsets"]),
                              req_pool_indices=i64(case["req_pool_indices"]), pool_out=pool_out)
    assert pool_out.tolist() == case["expected"]["pool_out"]


def test_spec_test_values():
    from kvcanary_cupy.ops.backends._cpu import hashing
    values = __import__("json").loads(__import__("_conformance").CASES_PATH.read_text())["spec_test_values"]
    assert int(hashing.sm(np.uint64(0))) == values["sm_0"]
    assert int(hashing.sm(np.uint64(kc._layout.CHAIN_ANCHOR))) == values["sm_anchor"]
    assert int(hashing.mix3(np.uint64(1), np.uint64(2), np.uint64(3))) == values["mix3_1_2_3"]
