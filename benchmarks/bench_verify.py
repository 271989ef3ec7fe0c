"""verify: the HEAD check of every prefix slot a batch reads, on each named case."""

from __future__ import annotations

from conftest import case_params


@case_params("verify")
def test_verify(benchmark, harness, case):
    state = harness.state(case)
    info = harness.measure(benchmark, state, "verify", state.verify, naive=state.naive_verify)
    rows = state.naive_verify(0)
    info["naive_agrees"] = bool(int(rows.shape[0]) == 0)  # a clean state: neither finds anything
    assert info["naive_agrees"]
