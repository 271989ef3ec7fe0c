"""How :meth:`kc.Canary.poll` maps violation rows back to the launch, request and position that
recorded them.

A row carries its launch's tag but no launch id (SPEC 2), so each row is matched against the
launches the canary logged since the previous poll, through their batch arrays and the tables as
they are when it polls. A verify row is matched to an entry only where the entry would have
recorded exactly that row (:meth:`RowMapper.fits`), so a slot that several requests read is named
for the reader whose expectations the row shows.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import _layout as L
from . import reference as _ref
from ._dlpack import native_view, to_host

_BIT_CHAIN = int(L.FailReason.CHAIN_HASH)
_BIT_POSITION = int(L.FailReason.POSITION)
_BIT_TOKEN = int(L.FailReason.VERIFY_TOKEN)
WRITE_BITS = int(L.FailReason.WRITE_TOKEN | L.FailReason.WRITE_POSITION)
OUT_OF_RANGE = int(L.FailReason.OUT_OF_RANGE)


def _lengths(batch) -> Any:
    """What a verify launch over ``batch`` checks of each request: a sweep its cached tokens, a
    forward its prefix."""
    return batch.seq_lens if hasattr(batch, "seq_lens") else batch.prefix_lens


def request_name(batch, row: int):
    """The name of ``batch``'s row ``row``: its id, or the row itself without one."""
    ids = batch.req_ids
    return ids[row] if ids is not None and row < len(ids) else row


class RowMapper:
    """One poll's mapping of one canary's rows; host copies of the arrays it reads are kept for
    the poll."""

    def __init__(self, canary):
        self.canary = canary
        self._cache: dict = {}
        self._checked: dict = {}  # by (group, batch): RowMapper.checked
        self._wanted: dict = {}  # by group: the slots its rows name

    # --- what the launches read, as the plans derive it (SPEC 3.3) -----------------------------------
    def host(self, key, array):
        if key not in self._cache:
            self._cache[key] = None if array is None else np.asarray(to_host(native_view(array, str(key))))
        return self._cache[key]

    def _batch(self, launch, name: str):
        array = getattr(launch.batch, name)
        return self.host(id(array), array)

    def checked(self, group, launch) -> dict:
        """The entries of a verify launch that check a slot some row of the group names: ``{slot:
        [(batch row, position), ...]}``, in batch-row and position order. A batch's HEAD and TAIL
        launches share it (the same entries); derived a block of requests at a time, with no sort
        of the whole batch (a decode batch of a million entries takes tens of milliseconds)."""
        key = (group.name, id(launch.batch))
        if key in self._checked:
            return self._checked[key]
        rows = self._batch(launch, "req_pool_indices")
        lens = _lengths(launch.batch)
        lens = self.host(id(lens), lens)
        table = self.host("req_to_token", self.canary.req_to_token)
        wanted = self._wanted[group.name]
        found: dict = {}
        live = np.flatnonzero((rows > 0) & (rows < table.shape[0]) & (lens > 0))  # padding, or rows resolving nothing
        width = table.shape[1]
        block = max(1, (1 << 22) // max(width, 1))
        for first in range(0, live.shape[0], block):
            owners = live[first:first + block]
            ends = np.minimum(lens[owners], width)
            starts = np.maximum(0, ends - group.window) if group.window else np.zeros_like(ends)
            slots = self._through_lut(group, table[rows[owners]].astype(np.int64))
            columns = np.arange(width)
            hit = (columns >= starts[:, None]) & (columns < ends[:, None]) & np.isin(slots, wanted)
            for at, position in zip(*np.nonzero(hit)):
                found.setdefault(int(slots[at, position]), []).append((int(owners[at]), int(position)))
        self._checked[key] = found
        return found

    def _through_lut(self, group, cells: np.ndarray) -> np.ndarray:
        """``cells`` through the group's LUT as the plan maps them: negative cells pass through,
        cells past the LUT are UNRESOLVED."""
        if group.lut is None:
            return cells
        lut = self.host(("lut", group.name), group.lut)
        inside = (cells >= 0) & (cells < lut.shape[0])
        mapped = lut[np.clip(cells, 0, max(lut.shape[0] - 1, 0))] if lut.shape[0] else cells
        return np.where(cells < 0, cells, np.where(inside, mapped, L.UNRESOLVED_SLOT))

    def overflowed(self, group, launch) -> bool:
        """Whether the launch's plan held more entries than the verify capacity, so that it checked
        nothing (SPEC 3.3)."""
        rows = self._batch(launch, "req_pool_indices").tolist()
        lens = _lengths(launch.batch)
        total = 0
        for row, length in zip(rows, self.host(id(lens), lens).tolist()):
            if row != 0 and length > 0:
                total += min(length, group.window) if group.window else length
        return total > self.canary.capacities.verify_capacity

    def link(self, group, slot: int) -> Optional[int]:
        """``link(slot)`` from the canary's current contents, as the kernels compute it."""
        if slot < 0:
            return _ref._signed(_ref.ANCHOR_LINK)
        if slot >= group.ctx.num_slots:
            return None
        key = ("fields", group.name, slot)
        if key not in self._cache:
            self._cache[key] = group.ctx.slot_fields(slot)
        f = self._cache[key]
        return _ref._signed(_ref.mix3(f["prev_hash"], f["token"], f["position"]))

    def cell_slot(self, group, row: int, position: int) -> int:
        """The group's slot of ``req_to_token[row, position]``, as the plan resolves it (SPEC 3.3, 4):
        UNRESOLVED outside the table or the LUT."""
        table = self.host("req_to_token", self.canary.req_to_token)
        if not (0 <= row < table.shape[0] and 0 <= position < table.shape[1]):
            return L.UNRESOLVED_SLOT
        return int(self._through_lut(group, np.array([table[row, position]], np.int64))[0])

    def predecessor(self, group, row: int, position: int) -> int:
        return L.NO_PREDECESSOR if position <= 0 else self.cell_slot(group, row, position - 1)

    def reported_token(self, launch, r: int, position: int) -> int:
        """The expected token a verify entry records: the pool's token when the canary checks
        them and the position lies below the request's valid length, else -1."""
        canary = self.canary
        if not canary._plans_expect_tokens:
            return L.NO_EXPECTED_TOKEN
        pool = self.host("expected_tokens", canary.expected_tokens)
        batch = launch.batch
        valid = getattr(batch, "expected_valid_lens", None)
        valid = self.host(id(valid), valid) if valid is not None else self.host(id(_lengths(batch)), _lengths(batch))
        row = int(self._batch(launch, "req_pool_indices")[r])
        column = position + canary.token_offset
        if 0 <= row < pool.shape[0] and 0 <= column < pool.shape[1] and column < int(valid[r]):
            return int(pool[row, column])
        return L.NO_EXPECTED_TOKEN

    # --- matching a row to an entry -----------------------------------------------------------------
    def fits(self, group, launch, v, entry: tuple) -> bool:
        """Whether verify entry ``(batch row, position)`` of ``launch`` would record exactly row
        ``v`` (SPEC 3.2), judged from the row's own stored fields: its position, chain and token
        bits and the expected values it carries. The real-KV bit is not judged (the KV bytes are
        not read again): a slot whose bytes changed is bad for every reader."""
        r, position = entry
        bits = int(v.fail_reason)
        reported = self.reported_token(launch, r, position)
        if v.expected_token != reported:
            return False
        if not 0 <= v.slot_idx < group.ctx.num_slots:  # recorded with the entry's own position
            return v.position == position
        if bool(bits & _BIT_POSITION) != (v.position != position):
            return False
        if bool(bits & _BIT_TOKEN) != (reported != L.NO_EXPECTED_TOKEN and v.stored_token != reported):
            return False
        row = int(self._batch(launch, "req_pool_indices")[r])
        prev = self.predecessor(group, row, position)
        if prev == L.PADDING_SLOT or prev >= group.ctx.num_slots:  # the chain is not checked
            return not bits & _BIT_CHAIN and v.expected_aux == v.stored_chain_hash
        expected_chain = self.link(group, prev)
        return v.expected_aux == expected_chain and bool(bits & _BIT_CHAIN) == (v.stored_chain_hash != expected_chain)

    def entries(self, group, launch, slot: int) -> list[tuple]:
        """``(batch row, position)`` of each of the launch's entries that checks ``slot``."""
        return self.checked(group, launch).get(slot, [])

    def match_unresolved(self, group, launch, position: int):
        """``(batch row, position)`` of a verify entry whose slot the plan could not resolve: its row
        records the entry's position (SPEC 4), and the first batch row that checks that position
        through a cell outside the table or the LUT is taken."""
        rows = self._batch(launch, "req_pool_indices")
        lens = _lengths(launch.batch)
        for r, (row, length) in enumerate(zip(rows.tolist(), self.host(id(lens), lens).tolist())):
            start = max(0, length - group.window) if group.window else 0
            if row != 0 and start <= position < length and \
                    self.cell_slot(group, row, position) == L.UNRESOLVED_SLOT:
                return r, position
        return None

    def match_verify(self, group, launch, v):
        """The entry of ``launch`` that recorded ``v``: the first that fits it, else (a predecessor
        written again since) the first whose position agrees with the row's position bit; None
        when no entry of the launch could have recorded it."""
        if v.slot_idx == L.UNRESOLVED_SLOT:
            return self.match_unresolved(group, launch, v.position)
        entries = self.entries(group, launch, v.slot_idx)
        moved = bool(int(v.fail_reason) & _BIT_POSITION)
        return next((e for e in entries if self.fits(group, launch, v, e)), None) or \
            next((e for e in entries if (e[1] != v.position) == moved), None)

    def match_write(self, group, launch, v):
        """``(batch row, position)`` of a write row: the entry that wrote its slot, or for the rows
        SPEC 4 records without one, the request whose seed is that slot (the position is the
        seed's) or whose entries reach past the batch's arrays (the first position past them)."""
        extend = self._batch(launch, "extend_seq_lens")
        prefix = self._batch(launch, "prefix_lens")
        rows = self._batch(launch, "req_pool_indices")
        counted = np.where(rows != 0, np.maximum(extend, 0), 0)  # padding rows write nothing (SPEC 3.3)
        ends = np.cumsum(counted)
        loc = self.host(id(launch.write_loc), launch.write_loc)
        no_entry = (v.position, v.stored_token, v.expected_token, v.expected_aux) == (0, 0, 0, 0)
        writes = np.flatnonzero(counted > 0)
        if no_entry and v.stored_chain_hash == 0 and v.slot_idx != -1:
            seeded = [int(r) for r in writes if prefix[r] > 0
                      and self.cell_slot(group, int(rows[r]), int(prefix[r]) - 1) == v.slot_idx]
            if seeded:
                return seeded[0], int(prefix[seeded[0]]) - 1
        if no_entry and v.slot_idx == -1:
            past = [int(r) for r in writes if ends[r] > loc.shape[0]]
            if len(past) == 1:
                r = past[0]
                return r, int(prefix[r]) + max(0, loc.shape[0] - int(ends[r] - counted[r]))
            return None
        hits = np.flatnonzero(loc == v.slot_idx)
        if hits.size == 0:
            return None
        index = int(hits[0])
        r = int(np.searchsorted(ends, index, "right"))
        return None if r >= len(ends) else (r, int(prefix[r]) + index - int(ends[r] - counted[r]))

    # --- every row of a group -----------------------------------------------------------------------
    def _candidates(self, group, keys: dict) -> dict:
        """For each ``(tag, slot)`` of ``keys``, the logged verify launches of that tag that checked
        the slot and ran (their plan fit the capacity), oldest first."""
        by_tag: dict = {}
        for tag, slot in keys:
            by_tag.setdefault(tag, []).append(slot)
        found: dict = {key: [] for key in keys}
        for index, launch in enumerate(group.log):
            slots = by_tag.get(launch.tag)
            if launch.kind != "verify" or slots is None or self.overflowed(group, launch):
                continue
            checked = self.checked(group, launch)
            for slot in slots:
                if slot in checked:
                    found[(launch.tag, slot)].append(index)
        return found

    def verify_launches(self, group, rows: Sequence, dropped: bool) -> tuple[dict, dict]:
        """The logged verify launch and entry of each row only a verify records: ``{row index:
        (launch index, (batch row, position))}``, and the candidate launches of each ``(tag,
        slot)``. A slot found bad stays bad until it is written again, so every launch that read
        it since recorded it: the rows of one slot and tag, in ring order, go to the last launches
        that checked the slot, each taking from the end one row for each of its entries that fits
        one (the first launch that read the slot may have run before it went bad). When the ring
        dropped rows, the rows kept are the first ones, and are taken from the oldest launches."""
        keyed: dict = {}
        for i, v in enumerate(rows):
            bits = int(v.fail_reason)
            if bits & WRITE_BITS or not bits & ~OUT_OF_RANGE or v.slot_idx == L.UNRESOLVED_SLOT:
                continue  # a write's row, or one either could record: matched in ring order
            keyed.setdefault((int(v.kernel_kind), v.slot_idx), []).append(i)
        candidates = self._candidates(group, keyed)
        found = {}
        for key, pending in keyed.items():
            order = candidates[key] if dropped else candidates[key][::-1]
            for index in order:
                launch, used = group.log[index], set()
                while pending:
                    i = pending[0] if dropped else pending[-1]
                    entry = next((e for e in self.entries(group, launch, key[1])
                                  if e not in used and self.fits(group, launch, rows[i], e)), None)
                    if entry is None:
                        break  # this row, and those before it, came from other launches
                    used.add(entry)
                    found[i] = (index, entry)
                    pending.remove(i)
                if not pending:
                    break
        return found, candidates

    def resolve(self, group, rows: Sequence, dropped: bool, static_ran: set) -> list[tuple]:
        """``(phase, step, request, position)`` of every row (``None`` where unknown)."""
        log = group.log
        self._wanted[group.name] = np.unique(np.array([v.slot_idx for v in rows], np.int64))
        verified, candidates = self.verify_launches(group, rows, dropped)
        out, pointer, misses = [], 0, set()
        for i, v in enumerate(rows):
            found = verified.get(i)
            bits = int(v.fail_reason)
            may_write = not bits & ~(WRITE_BITS | OUT_OF_RANGE)
            may_verify = not bits & WRITE_BITS
            key = (int(v.kernel_kind), v.slot_idx)
            if found is None and not may_write and key in candidates:  # a verify's: the launches that read the slot
                order = [index for index in candidates[key] if index >= pointer] + \
                        [index for index in candidates[key] if index < pointer]
            elif found is None and _row(v) not in misses:
                order = list(range(pointer, len(log))) + list(range(0, pointer))
            else:
                order = []
            for index in order:
                match = self._match(group, log[index], v, may_write, may_verify)
                if match is not None:
                    found = (index, match)
                    break
            if found is None:
                misses.add(_row(v))  # an identical row would walk the log for nothing
                out.append(self._unlogged(group, v, may_write, may_verify, static_ran))
                continue
            pointer, (r, position) = found
            launch = log[pointer]
            out.append((launch.phase, launch.step, request_name(launch.batch, r), position))
        return out

    def _unlogged(self, group, v, may_write: bool, may_verify: bool, static_ran: set) -> tuple:
        """A row no logged launch explains: a static forward's run, else only its phase is known
        (from its tag and bits; the tables have changed since, or the launch was replayed)."""
        for forward, launches in group.static_log:
            if id(forward) not in static_ran:
                continue
            for launch in launches:
                match = self._match(group, launch, v, may_write, may_verify)
                if match is not None:
                    return launch.phase, None, request_name(launch.batch, match[0]), match[1]
        return _phase_of(group, v), None, None, None

    def _match(self, group, launch, v, may_write: bool, may_verify: bool):
        """``(batch row, position)`` of ``v`` in ``launch``, or None."""
        if launch.tag != int(v.kernel_kind):
            return None
        if launch.kind == "write":
            return self.match_write(group, launch, v) if may_write else None
        return self.match_verify(group, launch, v) if may_verify else None


def _row(v) -> tuple:
    return (int(v.kernel_kind), v.slot_idx, v.position, v.stored_token, v.expected_token, v.stored_chain_hash,
            v.expected_aux, int(v.fail_reason))


def _phase_of(group, v) -> str:
    """The phase a row's tag and reasons name, for a row no logged launch of that tag explains."""
    tag = int(v.kernel_kind)
    if tag == group.head_tag:
        return "head"
    if tag == group.sweep_tag:
        return "sweep"
    if tag == group.tail_tag:
        return "write" if int(v.fail_reason) & WRITE_BITS else "tail"
    return "unknown"
