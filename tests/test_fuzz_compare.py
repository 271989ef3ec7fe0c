"""The differential fuzz's judge, ``_fuzzcases.compare``: the CPU backend run twice, one run's
outputs changed as a GPU bug would change them, must be told apart; changes a GPU may make (the
order of one launch's rows) must not."""

from __future__ import annotations

import numpy as np
import pytest

import _fuzzcases as F
from kvcanary_cupy import _layout as L


def _overflowing(op: str, seed: int) -> dict:
    """A small case of ``op`` whose ring keeps some of its rows but not all."""
    rng = np.random.default_rng(seed)
    for _ in range(400):
        case = F.MAKERS[op](rng, 300)
        out = F.RUNNERS[op](case, "cpu")
        if 1 < out["ring"].shape[0] < out["write_index"]:
            return case
    raise AssertionError(f"no overflowing {op} case")


def _copy(outputs: dict) -> dict:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in outputs.items()}


@pytest.mark.parametrize("op", ["write", "step"])
def test_an_overflowing_ring_is_not_judged_without_every_row(op):
    """The kept rows of an overflowing ring are judged against every row the launch records; a
    caller that leaves those out is told, not passed whatever the ring holds."""
    case = _overflowing(op, 7)
    oracle = F.RUNNERS[op](case, "cpu")
    other = _copy(oracle)
    other["ring"][0, L.RING_COL_POSITION] += 1000
    with pytest.raises(ValueError, match="_full_rows"):
        F.compare(op, case, oracle, other)
    case["_full_rows"] = F.full_rows(op, case, oracle["write_index"])
    assert F.compare(op, case, oracle, _copy(oracle)) == []
    assert F.compare(op, case, oracle, other) == ["kept ring rows are not violations of this launch"]


def _step_with_both(seed: int, overflow: bool) -> tuple[dict, dict]:
    """A step case whose verify and write record rows under tags of their own, and its outputs;
    with ``overflow``, one whose ring keeps only some of the verify's rows."""
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        case = F.make_step_case(rng, 300)
        case["write_tag"] = (case["verify_tag"] + 1) % 12
        out = F.RUNNERS["step"](case, "cpu")
        every = F.run_step(F.with_ring(case, max(out["write_index"], 1)), "cpu")["ring"][:, L.RING_COL_KERNEL_KIND]
        verify_rows = int((every == case["verify_tag"]).sum())
        write_rows = int((every == case["write_tag"]).sum())
        fits = out["write_index"] <= out["ring"].shape[0]
        if write_rows and (1 < out["ring"].shape[0] < verify_rows if overflow else verify_rows and fits):
            return case, out
    raise AssertionError("no such step case")


def test_a_step_write_row_recorded_before_its_verify_rows_is_a_difference():
    """A GPU may order one launch's rows as it likes, but the step's write waits for its verify:
    a write row ahead of a verify row (a write that overtook the verify) is a difference, rows of
    the verify reordered among themselves are not."""
    case, oracle = _step_with_both(3, overflow=False)
    kinds = oracle["ring"][:oracle["write_index"], L.RING_COL_KERNEL_KIND]
    verify_rows = int((kinds == case["verify_tag"]).sum())
    assert list(kinds) == [case["verify_tag"]] * verify_rows + [case["write_tag"]] * (len(kinds) - verify_rows)
    shuffled = _copy(oracle)
    shuffled["ring"][:verify_rows] = oracle["ring"][:verify_rows][::-1]
    assert F.compare("step", case, oracle, shuffled) == []
    overtaken = _copy(oracle)
    overtaken["ring"][:oracle["write_index"]] = np.roll(oracle["ring"][:oracle["write_index"]], 1, axis=0)
    assert F.compare("step", case, oracle, overtaken) == ["ring rows' tags out of launch order"]


def test_an_overflowing_step_ring_keeps_the_verify_rows_first():
    """The rows a full ring keeps are the first recorded: a step's verify rows, not its write's,
    even though the write's are rows of the launch too."""
    case, oracle = _step_with_both(5, overflow=True)
    total = oracle["write_index"]
    case["_full_rows"] = F.full_rows("step", case, total)
    every = F.run_step(F.with_ring(case, total), "cpu")["ring"]
    write_row = every[every[:, L.RING_COL_KERNEL_KIND] == case["write_tag"]][0]
    overtaken = _copy(oracle)
    overtaken["ring"][-1] = write_row
    assert F.compare("step", case, oracle, overtaken) == ["ring rows' tags out of launch order"]
