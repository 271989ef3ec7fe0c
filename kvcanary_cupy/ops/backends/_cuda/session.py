"""kc.Canary's device bookkeeping between its ops on a CUDA device: one launch each."""

from __future__ import annotations

from typing import Optional

from ....rawkernels import _loader
from . import Launch, i64, kernel, ptr, resident_grid

_BLOCK = _loader.SPECS["session"].constant("KVC_SESSION_THREADS")


def count_disabled(vplan, disabled, *, stream) -> None:
    """``disabled[0] += 1`` when ``vplan``'s verify was skipped (its ``enable`` cell 0)."""
    prepare_count_disabled(vplan, disabled)(stream)


def prepare_count_disabled(vplan, disabled, *, packed: bool = False) -> Launch:
    fn = kernel("session", "kvc_count_disabled", vplan.device.index)
    return Launch(fn, 1, 1, (ptr(vplan.enable), ptr(disabled)), packed=packed)


def prepare_count_run(runs, *, packed: bool = False) -> Launch:
    """The launch of ``runs[0] += 1`` (a static forward's run count)."""
    return Launch(kernel("session", "kvc_count_run", runs.device.id), 1, 1, (ptr(runs),), packed=packed)


def translate_slots(out_cache_loc, lut, out, *, stream) -> None:
    """``out[i] = lut[out_cache_loc[i]]`` where the slot lies in the LUT, else -1."""
    launch = prepare_translate_slots(out_cache_loc, lut, out)
    if launch is not None:
        launch(stream)


def prepare_translate_slots(out_cache_loc, lut, out, *, packed: bool = False) -> Optional[Launch]:
    """The launch of :func:`translate_slots`, or ``None`` for no slots."""
    count = int(out_cache_loc.shape[0])
    if count == 0:
        return None
    device_id = out.device.id
    fn = kernel("session", "kvc_translate_slots", device_id)
    grid = max(1, min(resident_grid("session", "kvc_translate_slots", device_id, _BLOCK), -(-count // _BLOCK)))
    return Launch(fn, grid, _BLOCK, (ptr(out_cache_loc), i64(count), ptr(lut), i64(int(lut.shape[0])), ptr(out)),
                  packed=packed)
