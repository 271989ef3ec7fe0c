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
