"""plan: both plans of a batch from the engine's metadata, on each named case."""

from __future__ import annotations

from conftest import case_params


@case_params("plan")
def test_plan(benchmark, harness, case):
    state = harness.state(case)
    xp = state.xp
    info = harness.measure(benchmark, state, "plan", state.plan, naive=state.naive_plan)
    c = state.copies[0]
    n = max(state.case.n_verify, 1)
    fields = (c.vplan.slot_indices, c.vplan.expected_tokens, c.vplan.expected_positions, c.vplan.prev_slot_indices,
              c.wplan.offsets, c.wplan.seed_slot_indices)
    state.plan(0)
    state.sync()
    ours = [f[:n].copy() for f in fields]
    state.naive_plan(0)
    state.sync()
    info["naive_agrees"] = all(bool(xp.array_equal(f[:n], o)) for f, o in zip(fields, ours))
    state.plan(0)
    assert info["naive_agrees"]
