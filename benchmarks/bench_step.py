"""The canary's whole work for one forward: HEAD verify of the prefixes and write of the new tokens.

``step`` is ``kc.CanaryStep`` (validated once; verify entries derived inside the kernel; one launch
for decode-shaped batches); ``step_ops`` is the same work as three public ops (plan, verify, write).
Each is timed eagerly (launched from Python, as an engine without graphs runs it) and as one
CUDA-graph replay (how a decode step runs in a serving engine), against the peer engine's step time
and the vectorised baseline."""

from __future__ import annotations

import pytest

from conftest import case_params


@case_params("step")
@pytest.mark.parametrize("op", ["step", "step_ops"])
def test_step_eager(benchmark, harness, case, op):
    state = harness.state(case)
    fn = state.step if op == "step" else state.step_ops
    harness.measure(benchmark, state, op, fn, naive=state.naive_step, lead_ns=400_000)


@case_params("step")
@pytest.mark.parametrize("op", ["step", "step_ops"])
def test_step_graph(benchmark, harness, case, op):
    if not harness.timer.is_gpu:
        pytest.skip("CUDA graphs need a GPU")
    state = harness.state(case)
    fn = state.step if op == "step" else state.step_ops
    harness.measure(benchmark, state, op, fn, graph=True)
