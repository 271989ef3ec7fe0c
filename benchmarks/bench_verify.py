"""verify: the HEAD check of every prefix slot a batch reads, on each named case."""

from __future__ import annotations

import contextlib

import _shapes as S
from conftest import case_params

CHANGED_ENTRIES = 64  # entries whose records the baseline's check changes, at most


@case_params("verify")
def test_verify(benchmark, harness, case):
    state = harness.state(case)
    info = harness.measure(benchmark, state, "verify", state.verify, naive=state.naive_verify)
    info["naive_agrees"] = baseline_agrees(state)
    assert info["naive_agrees"]


def baseline_agrees(state: S.EngineState) -> bool:
    """Whether the baseline finds what the op finds: nothing on the clean state, where a baseline
    that checks nothing would agree too, then the same rows once the records of a copy's first
    entries hold another position (each fails its position check, and its successor its chain
    link). The records are put back and the ring emptied after, for the benchmarks to come."""
    if int(state.naive_verify(0).shape[0]) != 0:
        return False
    ctx, n = state.ctx, min(state.case.n_verify, CHANGED_ENTRIES)
    if n == 0:
        return True
    slots = state.copies[0].vplan.slot_indices[:n]
    with state.stream if state.stream is not None else contextlib.nullcontext():
        saved = ctx.canary_buf[slots].copy()
        ctx.canary_buf[slots, 8] ^= 1  # the low byte of each record's position
        state.verify(0)
        found = S._host(state.naive_verify(0))
        report = ctx.violations()
        ours = S._host(ctx.violation_ring[:len(report)]).copy()  # emptied below
        ctx.canary_buf[slots] = saved
        ctx.clear_violations()
    state.sync()
    # rows as a multiset (a GPU launch records them in any order), the launch tag aside: the baseline has none
    return report.dropped == 0 and len(report) >= n and sorted(map(tuple, found[:, 1:].tolist())) == sorted(
        map(tuple, ours[:, 1:].tolist()))
