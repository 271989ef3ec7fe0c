"""write: fingerprint and chain the new tokens of a batch, on each named case."""

from __future__ import annotations

from conftest import case_params


@case_params("write")
def test_write(benchmark, harness, case):
    state = harness.state(case)
    xp = state.xp
    info = harness.measure(benchmark, state, "write", state.write, naive=state.naive_write)
    # writing the same batch again is idempotent; the baseline must store the very same bytes
    loc = state.copies[0].out_cache_loc
    state.write(0)
    state.sync()
    ours = state.ctx.canary_buf[loc].copy()
    state.ctx.canary_buf[loc] = 0  # poison what the op writes: a baseline that stored nothing would agree
    state.naive_write(0)
    state.sync()
    info["naive_agrees"] = bool(xp.array_equal(state.ctx.canary_buf[loc], ours))
    state.write(0)
    assert info["naive_agrees"]
