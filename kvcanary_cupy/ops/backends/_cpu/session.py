"""kc.Canary's bookkeeping between its ops on host arrays."""

from __future__ import annotations

import numpy as np


def count_disabled(vplan, disabled, *, stream=None) -> None:
    """``disabled[0] += 1`` when ``vplan``'s verify was skipped (its ``enable`` cell 0)."""
    if vplan.enable[0] == 0:
        disabled[0] += 1


def count_run(runs, *, stream=None) -> None:
    """``runs[0] += 1``."""
    runs[0] += 1


def translate_slots(out_cache_loc, lut, out, *, stream=None) -> None:
    """``out[i] = lut[out_cache_loc[i]]`` where the slot lies in the LUT, else -1."""
    if lut.shape[0] == 0:
        out[...] = -1
        return
    inside = (out_cache_loc >= 0) & (out_cache_loc < lut.shape[0])
    out[...] = np.where(inside, lut[np.clip(out_cache_loc, 0, lut.shape[0] - 1)], -1)
