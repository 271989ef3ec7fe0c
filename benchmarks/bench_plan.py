"""plan: both plans of a batch from the engine's metadata, on each named case."""

from __future__ import annotations

from conftest import case_params


@case_params("plan")
def test_plan(benchmark, harness, case):
    state = harness.state(case)
    xp = state.xp
    info = harness.measure(benchmark, state, "plan", state.plan, naive=state.naive_plan)
    c = state.copies[0]
    n = state.case.n_verify
    fields = (c.vplan.slot_indices[:n], c.vplan.expected_tokens[:n], c.vplan.expected_positions[:n],
              c.vplan.prev_slot_indices[:n], c.vplan.num_valid, c.vplan.enable, c.wplan.offsets,
              c.wplan.seed_slot_indices, c.wplan.num_valid_reqs)
    state.plan(0)
    state.sync()
    ours = [f.copy() for f in fields]
    for f in fields:
        f[...] = -7  # poison what the plan writes: a baseline that left a field alone would agree
    state.naive_plan(0)
    state.sync()
    info["naive_agrees"] = all(bool(xp.array_equal(f, o)) for f, o in zip(fields, ours))
    state.plan(0)
    assert info["naive_agrees"]
