"""scatter_req_token_ids: copy each request's new token ids into its row of a token pool."""

from __future__ import annotations

from conftest import case_params


@case_params("scatter")
def test_scatter(benchmark, harness, case):
    state = harness.state(case)
    xp = state.xp
    info = harness.measure(benchmark, state, "scatter", state.scatter, naive=state.naive_scatter)
    rows = state.copies[0].req_pool_indices
    state.scatter(0)
    state.sync()
    ours = state.expected_pool[rows].copy()
    state.expected_pool[rows, :state.case.extend] = -7  # poison what the op writes
    state.naive_scatter(0)
    state.sync()
    info["naive_agrees"] = bool(xp.array_equal(state.expected_pool[rows], ours))
    assert info["naive_agrees"]
