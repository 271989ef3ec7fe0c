"""copy_records on host arrays: one serial loop over the pairs, in their order (so where pairs name
one destination twice, the last one's record lands), each record read and stored as four words.
The slots are random, so the records of a pair further on are asked for ahead of their use,
written out in each loop: through a helper, even an inlined one, the copy of 65,536 records took
about three times as long."""

from __future__ import annotations

from .... import _layout as L
from .hashing import JIT, PREFETCH_AHEAD, njit, prefetch, slot_words

_FIELDS = L.SLOT_FIELD_COUNT
_IN_RANGE = L.STAGED_IN_RANGE


@njit(**JIT)
def _copy(src_words, src_slots, dst_words, dst_slots):
    count, src_count, dst_count = src_slots.shape[0], src_words.shape[0], dst_words.shape[0]
    for i in range(count):
        ahead = i + PREFETCH_AHEAD
        if ahead < count:
            if 0 <= src_slots[ahead] < src_count:
                prefetch(src_words, src_slots[ahead] * src_words.shape[1])
            if 0 <= dst_slots[ahead] < dst_count:
                prefetch(dst_words, dst_slots[ahead] * dst_words.shape[1])
        source, destination = src_slots[i], dst_slots[i]
        if 0 <= source < src_count and 0 <= destination < dst_count:
            for f in range(_FIELDS):
                dst_words[destination, f] = src_words[source, f]


@njit(**JIT)
def _gather(words, slots, staged):
    count, slot_count = slots.shape[0], words.shape[0]
    for i in range(count):
        ahead = i + PREFETCH_AHEAD
        if ahead < count and 0 <= slots[ahead] < slot_count:
            prefetch(words, slots[ahead] * words.shape[1])
        slot = slots[i]
        inside = 0 <= slot < slot_count
        for f in range(_FIELDS):
            staged[i, f] = words[slot, f] if inside else 0
        staged[i, _IN_RANGE] = 1 if inside else 0


@njit(**JIT)
def _scatter(words, slots, staged):
    count, slot_count = slots.shape[0], words.shape[0]
    for i in range(count):
        ahead = i + PREFETCH_AHEAD
        if ahead < count and 0 <= slots[ahead] < slot_count:
            prefetch(words, slots[ahead] * words.shape[1])
        slot = slots[i]
        if staged[i, _IN_RANGE] != 0 and 0 <= slot < slot_count:
            for f in range(_FIELDS):
                words[slot, f] = staged[i, f]


def gather(ctx, slots, staged, *, stream=None) -> None:
    """``staged[i]``: the record of ``slots[i]`` and 1 where the slot is in range, else zeros."""
    _gather(slot_words(ctx), slots, staged)


def scatter(ctx, slots, staged, *, stream=None) -> None:
    """The record staged for each pair stored at ``slots[i]`` where it was gathered in range and the
    slot is in range; where pairs name one slot twice, the last one's."""
    _scatter(slot_words(ctx), slots, staged)


def copy(src, dst, src_slots, dst_slots, *, stream=None) -> None:
    """The record of ``src_slots[i]`` stored at ``dst_slots[i]`` where both are in range (two
    canaries whose buffers do not overlap; pairs naming one destination twice: the last one's)."""
    _copy(slot_words(src), src_slots, slot_words(dst), dst_slots)
