"""The canary's whole work for one forward: plan, HEAD verify of the prefixes, write of the new tokens.

Timed eagerly (three launches from Python, as an engine without graphs runs it) and as one CUDA-graph
replay (how a decode step runs in a serving engine), each against the peer engine's step time and the
vectorised baseline."""

from __future__ import annotations

import pytest

from conftest import case_params


@case_params("step")
def test_step_eager(benchmark, harness, case):
    state = harness.state(case)
    harness.measure(benchmark, state, "step", state.step, naive=state.naive_step, lead_ns=400_000)


@case_params("step")
def test_step_graph(benchmark, harness, case):
    if not harness.timer.is_gpu:
        pytest.skip("CUDA graphs need a GPU")
    state = harness.state(case)
    harness.measure(benchmark, state, "step", state.step, graph=True)
