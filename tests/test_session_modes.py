"""kc.Canary.poll: one workload, driven in the ways the docs say must report the same events.

A random engine (test_session_poll's: shared prefixes, chunked prefill, partial and padded batches,
sweeps, expected tokens, an SWA group), a request finishing and its slots taken by a new one, and
one to three lasting faults (KV bytes, a field of a slot's record, a table cell pointed at another
request's slot, an expected token changed), run as eager forwards and through static forwards (run
eagerly or replayed). Polled after each forward and sweep, every way reports the same events.
Polled every few forwards, eager forwards report the same rows, by group, phase, slot and reasons;
a step, request or position is compared only where both polls name one (a poll every few forwards
may not tell them), and the two never name different ones. Replays polled every few forwards are
left out: a poll names their rows from their arrays as they are when it polls.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from _devices import BACKENDS
from test_session_poll import _Engine, _prompts
from test_session_static import _run

_FAULTS = ("kv", "swa_kv", "token_field", "position_field", "chain_field", "alias", "expected")


def _faulty_workload(seed: int):
    """A random engine shape and a run of it with one to three lasting faults, as a function of
    the engine and a poll tick."""
    rng = np.random.default_rng(seed)
    shape = dict(swa_window=int(rng.integers(2)) * 4, expected=bool(rng.integers(2)))
    share, chunked, sweeps, padding, churn = (bool(rng.integers(2)) for _ in range(5))
    batches = [list(rng.permutation(["a", "b", "c"])[: int(rng.integers(1, 4))]) for _ in range(12)]
    faults = {int(at): str(rng.choice(_FAULTS)) for at in rng.choice(12, int(rng.integers(1, 4)), replace=False)}
    finish_at = int(rng.integers(3, 9)) if churn else -1
    draws = rng.random((12, 6))

    def fault(eng: _Engine, kind: str, draw) -> None:
        live = [rid for rid in eng.requests if eng.requests[rid]["len"]]
        target = eng.requests[live[int(draw[0] * len(live))]]
        low = max(0, target["len"] - 3 if draw[1] < 0.7 else 0)  # inside an SWA window mostly
        position = low + int(draw[2] * (target["len"] - low))
        slot = target["slots"][position]
        if kind == "swa_kv" and shape["swa_window"]:
            eng.swa_k[int(eng.lut[slot]), 0, 1] += 1.0
        elif kind in ("kv", "swa_kv"):
            eng.k[slot, 0, 1] += 1.0
        elif kind.endswith("_field"):  # a byte of the slot's record: its token, position or chain
            context = eng.canary.swa_context if shape["swa_window"] and draw[3] < 0.5 else eng.canary.context
            column = {"token_field": 0, "position_field": 8, "chain_field": 16}[kind]
            where = int(eng.lut[slot]) if context is not eng.canary.context else slot
            context.canary_buf[where, column] ^= 1 + int(draw[4] * 7)
        elif kind == "expected" and shape["expected"]:  # the token the engine expects, not the one stored
            eng.expected[target["row"], position] += 1
        else:  # alias (or an expected token with no pool to hold it): the cell names another request's slot
            others = [rid for rid in live if eng.requests[rid] is not target]
            if others:
                donor = eng.requests[others[int(draw[3] * len(others))]]
                eng.table[target["row"], position] = donor["slots"][min(position, donor["len"] - 1)]

    def run(eng: _Engine, tick) -> None:
        _prompts(eng, tick, chunked, share)
        for number, rids in enumerate(batches):
            if number == finish_at:  # c ends; d takes its slots, in a pool row of its own
                eng.finish("c")
                eng.add("d", 4)
                eng.forward({"d": 4})
                tick()
            if number in faults:
                fault(eng, faults[number], draws[number])
            extend = {rid if rid in eng.requests else "d": 1 for rid in rids}  # d decodes in c's place
            eng.forward(extend, padding_rows=int(padding and draws[number, 5] < 0.5))
            tick()
            if sweeps and draws[number, 4] < 0.3:
                eng.sweep()

    return shape, run


def _sized(**sizes):
    """:func:`_faulty_workload` on an engine of another ring or verify capacity (``sizes``:
    ``ring``, ``verify_capacity``)."""
    def workload(seed: int):
        shape, run = _faulty_workload(seed)
        return {**shape, **sizes}, run
    return workload


def _events(seed: int, every: int, device: str = "cpu", **driven) -> list:
    """The seed's events, every poll's (``driven``: test_session_static's driver's options;
    ``static=False``: eager forwards); the rings are big enough to keep every row."""
    found, _, driver = _run(device, seed, every, _faulty_workload, **driven)
    assert driver.dropped == 0, seed
    return found


def _eager_each_poll(seed: int, device: str) -> list:
    """The seed's events from eager forwards polled after each forward and sweep, the run every
    other is held against: made once a seed and device, for every test of the file."""
    return list(_eager_each_poll_once(seed, device))


@functools.lru_cache(maxsize=None)
def _eager_each_poll_once(seed: int, device: str) -> tuple:
    return tuple(_events(seed, 1, device, static=False, poll_sweeps=True))


def _disagreements(reference: list, other: list) -> list:
    """What ``other`` reports that ``reference`` does not, or the other way round: the events of
    one (group, phase, slot, reasons) paired, a step, request or position of None matching any,
    as many pairs as can be made; the events left unpaired, each marked by the list it is from."""
    def split(events):
        by_row: dict = {}
        for group, phase, step, request, position, slot, reasons in events:
            by_row.setdefault((group, phase, slot, reasons), []).append((step, request, position))
        return by_row

    def agree(a, b):
        return all(x is None or y is None or x == y for x, y in zip(a, b))

    left, right = split(reference), split(other)
    unpaired = []
    for row in sorted(set(left) | set(right), key=repr):
        mine, theirs = left.get(row, []), right.get(row, [])
        paired_with: dict = {}  # theirs index -> mine index, grown by augmenting paths

        def pair(i, seen):
            for j, named in enumerate(theirs):
                if j not in seen and agree(mine[i], named):
                    seen.add(j)
                    if j not in paired_with or pair(paired_with[j], seen):
                        paired_with[j] = i
                        return True
            return False

        paired = {i for i in range(len(mine)) if pair(i, set())}
        unpaired += [("reference", row, mine[i]) for i in range(len(mine)) if i not in paired]
        unpaired += [("other", row, theirs[j]) for j in range(len(theirs)) if j not in paired_with]
    return unpaired


def _kept_as_in(whole: list, device: str, seed: int, every: int, sizes: dict, **driven) -> tuple:
    """The seed's events on an engine of ``sizes`` (:func:`_sized`; ``driven``: the driver's
    options), and the driver, once they are checked against ``whole``, the events of rings and
    capacities big enough: every event is one of ``whole``'s, named as there or not at all, and a
    small ring's kept rows and dropped ones add up to ``whole``'s."""
    kept, _, driver = _run(device, seed, every, _sized(**sizes), **driven)
    assert {side for side, *_ in _disagreements(whole, kept)} <= {"reference"}, (seed, sizes)
    if "ring" in sizes:
        assert len(kept) + driver.dropped == len(whole), (seed, sizes)
    return kept, driver


SEEDS = range(100)


@pytest.mark.parametrize("device", BACKENDS)
def test_eager_and_static_forwards_report_the_same_events(device):
    """Polled after each forward and each sweep, static forwards (run eagerly, replayed after their
    first run, or every run replayed; padded to two geometries or not) report the eager forwards'
    events, steps, requests and positions included: a replay alone since the previous poll is
    numbered, and its rows are named as the same forward's would be when run eagerly."""
    named = 0
    for seed in SEEDS:
        eager = _eager_each_poll(seed, device)
        named += sum(request is not None for _, _, _, request, *_ in eager)
        for pad, replays in ((False, None), (False, "all"), (True, "first"), (True, "all")):
            assert _events(seed, 1, device, pad=pad, replays=replays, poll_sweeps=True) == eager, (seed, pad, replays)
    assert named >= 2000


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every", [2, 3])
@pytest.mark.parametrize("poll_sweeps", [True, False])
def test_eager_forwards_polled_every_few_report_every_row_and_no_other_name(device, every, poll_sweeps):
    """Polled every few forwards (each sweep polled alone, or in the span of the forwards beside
    it), eager forwards report the rows polling after each forward and sweep reports; a row may
    lose its step, request or position (a request finished, a cell or a record changed before the
    poll), never take another."""
    unknown = 0
    for seed in SEEDS:
        each = _eager_each_poll(seed, device)
        few = _events(seed, every, device, static=False, poll_sweeps=poll_sweeps)
        assert _disagreements(each, few) == [], seed
        unknown += sum(None in event[2:5] for event in few) - sum(None in event[2:5] for event in each)
    assert unknown > 0  # the workloads reach what a poll every few forwards cannot tell


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every", [1, 3])
def test_a_ring_too_small_for_every_row_keeps_rows_named_as_a_whole_ring_names_them(device, every):
    """Rings of 1 to 8 rows keep rows of the run a ring big enough for every row reports
    (polled after each forward and sweep), as many fewer as they count dropped, and name them as it
    does or not at all: the ring does not tell when a slot went bad, so a kept row is named only
    where every launch that may have recorded it tells the same request and position."""
    dropped = unnamed = 0
    for seed in [*SEEDS[:40], 244]:  # 244: a slot goes bad after a request sharing it read it, in one span
        whole = _eager_each_poll(seed, device)
        for ring in (1, 3, 5, 8):
            kept, driver = _kept_as_in(whole, device, seed, every, {"ring": ring}, static=False, poll_sweeps=True)
            dropped += driver.dropped
            unnamed += sum(request is None for _, _, _, request, *_ in kept)
    assert dropped > 0 and unnamed > 0


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("every", [1, 3])
def test_verifies_past_the_capacity_take_only_their_own_rows_away(device, every):
    """A verify capacity of 8 to 32 entries skips the verifies of the larger batches (counted in
    ``capacity_overflows``): the run reports rows of the run whose verifies all fit, named as it
    names them or not at all; the other launches' rows are not given to the skipped ones."""
    overflows = missing = 0
    for seed in SEEDS[:40]:
        whole = _eager_each_poll(seed, device)
        for capacity in (8, 16, 32):
            checked, driver = _kept_as_in(whole, device, seed, every, {"verify_capacity": capacity}, static=False,
                                          poll_sweeps=True)
            overflows += driver.overflows
            missing += len(whole) - len(checked)
    assert overflows > 0 and missing > 0


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("pad, replays", [(False, None), (False, "all"), (True, "first"), (True, "all")])
def test_static_forwards_with_small_rings_or_verify_capacities_name_kept_rows_as_a_whole_run(device, pad, replays):
    """Static forwards (run eagerly, replayed after their first run, or every run replayed; padded
    to two geometries or not), polled after each forward and sweep, with rings of 1 to 8 rows or a
    verify capacity of 8 to 32 entries: the rows kept, and those dropped, add up to the eager
    forwards' rows with rings big enough for every row, and each is named as they name it or not
    at all; a skipped verify (padded batches skip more) takes only its own rows away."""
    dropped = unnamed = overflows = missing = 0
    for seed in [*SEEDS[:40], 244]:
        whole = _eager_each_poll(seed, device)
        for sizes in [*({"ring": ring} for ring in (1, 3, 5, 8)),
                      *({"verify_capacity": capacity} for capacity in (8, 16, 32))]:
            kept, driver = _kept_as_in(whole, device, seed, 1, sizes, pad=pad, replays=replays, poll_sweeps=True)
            if "ring" in sizes:
                unnamed += sum(request is None for _, _, _, request, *_ in kept)
            dropped += driver.dropped
            overflows += driver.overflows
            missing += len(whole) - len(kept) - driver.dropped
    assert dropped > 0 and unnamed > 0 and overflows > 0 and missing > 0
