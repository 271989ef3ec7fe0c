"""copy_records on host arrays: slots' records staged in rows, and stored from them."""

from __future__ import annotations

import numpy as np

from .... import _layout as L
from .hashing import slot_words


def gather(ctx, slots, staged, *, stream=None) -> None:
    """``staged[i]``: the record of ``slots[i]`` and 1 where the slot is in range, else zeros."""
    words = slot_words(ctx)
    inside = (slots >= 0) & (slots < words.shape[0])
    staged[...] = 0
    staged[inside, :L.SLOT_FIELD_COUNT] = words[slots[inside], :L.SLOT_FIELD_COUNT]
    staged[:, L.STAGED_IN_RANGE] = inside


def scatter(ctx, slots, staged, *, stream=None) -> None:
    """The record staged for each pair stored at ``slots[i]`` where it was gathered in range and the
    slot is in range; where pairs name one slot twice, the last one's."""
    words = slot_words(ctx)
    store = np.flatnonzero((staged[:, L.STAGED_IN_RANGE] != 0) & (slots >= 0) & (slots < words.shape[0]))
    # the last pair of each slot: unique's first index in the reversed order
    _, last = np.unique(slots[store][::-1], return_index=True)
    pairs = store[::-1][last]
    words[slots[pairs], :L.SLOT_FIELD_COUNT] = staged[pairs, :L.SLOT_FIELD_COUNT]


def copy(src, dst, src_slots, dst_slots, *, stream=None) -> None:
    """The record of ``src_slots[i]`` stored at ``dst_slots[i]`` where both are in range (pairs
    naming one destination twice: the last one's)."""
    staged = np.empty((src_slots.shape[0], L.STAGED_RECORD_WORDS), np.int64)
    gather(src, src_slots, staged)
    scatter(dst, dst_slots, staged)
