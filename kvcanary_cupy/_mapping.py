"""How :meth:`kc.Canary.poll` maps violation rows back to the launch, request and position that
recorded them.

A row carries its launch's tag but no launch id (SPEC 2), so each row is matched against the
launches the canary logged since the previous poll, through their batch arrays and the tables as
they are when it polls. A verify row is matched to an entry only where the entry would have
recorded exactly that row (:meth:`RowMapper.fits`), so a slot that several requests read is named
for the reader whose expectations the row shows.
"""

from __future__ import annotations

from typing import Container, Optional, Sequence

import numpy as np

from . import _layout as L
from . import reference as _ref
from ._dlpack import native_view, to_host

_BIT_CHAIN = int(L.FailReason.CHAIN_HASH)
_BIT_POSITION = int(L.FailReason.POSITION)
_BIT_TOKEN = int(L.FailReason.VERIFY_TOKEN)
_BIT_KV = int(L.FailReason.REAL_KV_HASH)
_WRITE_BITS = int(L.FailReason.WRITE_TOKEN | L.FailReason.WRITE_POSITION)
_OUT_OF_RANGE = int(L.FailReason.OUT_OF_RANGE)


def _window_starts(lens: np.ndarray, window: int) -> np.ndarray:
    """The first position each request's verify checks: its last ``window`` tokens in an SWA group
    (as the plan kernels count them), all of them otherwise."""
    return np.maximum(0, lens - window) if window else np.zeros_like(lens)


def _same(a, b) -> bool:
    """Whether two request ids are one: equal, or the same object where equality says nothing
    usable (an id whose ``==`` raises or gives an array)."""
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 (an engine's id type may compare any way)
        return False


def request_name(batch, row: int):
    """The name of ``batch``'s row ``row``: its id, or the row itself without one."""
    ids = batch.req_ids
    return ids[row] if ids is not None and row < len(ids) else row


class RowMapper:
    """One poll's mapping of one canary's rows; host copies of the arrays it reads are kept for
    the poll."""

    def __init__(self, canary, replay_step: Optional[int] = None, log_capped: bool = False):
        self.canary = canary
        self.replay_step = replay_step  # the step of a row only a static forward's replay explains
        # the log may not be whole (launches left out because their arrays changed in place, whose
        # kinds of rows the poll keeps from the mapping; or after an interrupted poll): the first
        # rows go to the first logged launches. (Past max_logged_forwards the poll hands over only
        # the rows recorded before the first launch left out.)
        self.log_capped = log_capped
        self._cache: dict = {}
        self._checked: dict = {}  # by (group, batch): RowMapper.checked
        self._wanted: dict = {}  # by group: the slots its rows name
        self._handed: dict = {}  # by group: RowMapper._handed_on

    # --- what the launches read, as the plans derive it (SPEC 3.3) -----------------------------------
    def host(self, key, array):
        if key not in self._cache:
            self._cache[key] = None if array is None else np.asarray(to_host(native_view(array, str(key))))
        return self._cache[key]

    def _batch(self, launch, name: str):
        array = getattr(launch.batch, name)
        return self.host(id(array), array)

    def _lengths(self, launch):
        """What a verify launch checks of each request: a sweep its cached tokens, a forward its
        prefix."""
        return self._batch(launch, "seq_lens" if hasattr(launch.batch, "seq_lens") else "prefix_lens")

    def _table(self):
        return self.host("req_to_token", self.canary.req_to_token)

    def _write_loc(self, launch):
        """The slots of a write launch's entries (an SWA group's translated), a padded tail included."""
        return self.host(id(launch.write_loc), launch.write_loc)

    def _written(self, launch):
        """The slots a write launch wrote: its entries' alone, not those of a padded tail past them
        (a static forward's arrays bound for more tokens than a step has, whose cells the write
        never reads, may hold any slot, another request's too); a move's destinations that got a
        record (-1 marks a pair that stored none: a slot of it out of range)."""
        loc = self._write_loc(launch)
        if launch.kind == "move":
            return loc[loc >= 0]
        extend, rows = self._batch(launch, "extend_seq_lens"), self._batch(launch, "req_pool_indices")
        # padding rows write nothing (SPEC 3.3); each request's count clamped, so that the sum cannot wrap
        counted = np.where(rows != 0, np.clip(extend, 0, loc.shape[0]), 0)
        return loc[:min(int(counted.sum()), loc.shape[0])]

    def checked(self, group, launch) -> dict:
        """The entries of a verify launch that check a slot some row of the group names: ``{slot:
        [(batch row, position), ...]}``, in batch-row and position order. A batch's HEAD and TAIL
        launches share it (the same entries); derived a block of requests at a time, with no sort
        of the whole batch (a decode batch of a million entries takes tens of milliseconds)."""
        key = (group.name, id(launch.batch))
        if key in self._checked:
            return self._checked[key]
        rows = self._batch(launch, "req_pool_indices")
        lens = self._lengths(launch)
        table = self._table()
        wanted = self._wanted[group.name]
        found: dict = {}
        # padding, rows resolving nothing, and rows whose table row may hold another request's slots now
        live = np.flatnonzero((rows > 0) & (rows < table.shape[0]) & (lens > 0)
                              & ~self._through_handed_on(group, launch))
        width = table.shape[1]
        block = max(1, (1 << 22) // max(width, 1))
        for first in range(0, live.shape[0], block):
            owners = live[first:first + block]
            ends = np.minimum(lens[owners], width)
            starts = _window_starts(lens[owners], group.window)  # from the length, as the plan counts them
            slots = self._through_lut(group, table[rows[owners]].astype(np.int64))
            columns = np.arange(width)
            hit = (columns >= starts[:, None]) & (columns < ends[:, None]) & np.isin(slots, wanted)
            for at, position in zip(*np.nonzero(hit)):
                found.setdefault(int(slots[at, position]), []).append((int(owners[at]), int(position)))
        self._checked[key] = found
        return found

    def _through_handed_on(self, group, launch) -> np.ndarray:
        """For each request of the launch's batch, whether its pool row was handed on since
        (:meth:`_handed_on`): the table row may hold another request's slots now."""
        handed_on = list(self._handed_on(group).get(id(launch.batch), ()))
        return np.isin(self._batch(launch, "req_pool_indices"), handed_on)

    def _handed_on(self, group) -> dict:
        """By batch (``id``): the pool rows that a later launch of the group's log shows holding
        another request (both batches naming their requests). The engine may have written that
        table row for the new request since (a prefix it shares included), so the earlier batch's
        entries there are not judged from the table as it is now: they would name a request that
        never read the slots."""
        if group.name in self._handed:
            return self._handed[group.name]
        later: dict = {}  # pool row: the names later launches give it
        handed, seen = {}, set()
        for launch in reversed(group.log):
            ids = None if launch.kind == "move" else launch.batch.req_ids
            if ids is None or id(launch.batch) in seen:  # a batch's last launch comes first here
                continue
            seen.add(id(launch.batch))
            held = [(int(row), name) for row, name in zip(self._batch(launch, "req_pool_indices").tolist(), ids)
                    if row > 0]
            stale = {row for row, name in held if any(not _same(name, other) for other in later.get(row, ()))}
            if stale:
                handed[id(launch.batch)] = frozenset(stale)
            for row, name in held:
                names = later.setdefault(row, [])
                if len(names) < 2 and not any(_same(name, other) for other in names):
                    names.append(name)
        self._handed[group.name] = handed
        return handed

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
        rows = self._batch(launch, "req_pool_indices")
        lens = self._lengths(launch).astype(np.int64)
        counted = (rows != 0) & (lens > 0)
        capacity = self.canary.capacities.verify_capacity
        # each request's count clamped, so that the sum cannot wrap where the kernels' saturates
        total = int(np.minimum(lens - _window_starts(lens, group.window), capacity + 1)[counted].sum())
        return total > capacity

    def link(self, group, slot: int) -> Optional[int]:
        """``link(slot)`` from the canary's current contents, as the kernels compute it."""
        if slot < 0:
            return _ref._signed(_ref.ANCHOR_LINK)
        if slot >= group.ctx.num_slots:
            return None
        f = self.fields(group, slot)
        return _ref._signed(_ref.mix3(f["prev_hash"], f["token"], f["position"]))

    def fields(self, group, slot: int) -> dict:
        """The slot's record as the canary holds it now, read once a poll."""
        key = ("fields", group.name, slot)
        if key not in self._cache:
            self._cache[key] = group.ctx._slot_fields(slot)  # the poll has waited for the device
        return self._cache[key]

    def cell_slot(self, group, row: int, position: int) -> int:
        """The group's slot of ``req_to_token[row, position]``, as the plan resolves it (SPEC 3.3, 4):
        UNRESOLVED outside the table or the LUT."""
        table = self._table()
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
        valid = getattr(launch.batch, "expected_valid_lens", None)
        valid = self.host(id(valid), valid) if valid is not None else self._lengths(launch)
        row = int(self._batch(launch, "req_pool_indices")[r])
        column = position + canary.token_offset
        if 0 <= row < pool.shape[0] and 0 <= column < pool.shape[1] and column < int(valid[r]):
            return int(pool[row, column])
        return L.NO_EXPECTED_TOKEN

    # --- matching a row to an entry -----------------------------------------------------------------
    def fits(self, group, launch, v, entry: tuple, loose: Optional[Container] = None,
             index: Optional[int] = None) -> bool:
        """Whether verify entry ``(batch row, position)`` of ``launch`` would record exactly row
        ``v`` (SPEC 3.2), judged from the row's own stored fields: its position, chain and token
        bits and the expected values it carries. The real-KV bit is not judged (the KV bytes are
        not read again): a slot whose bytes changed is bad for every reader. With ``loose``, the
        slots the launch's forward wrote after it, the chain is not judged where the predecessor
        may have changed since the launch: a predecessor among those slots (a page freed while in
        use and taken by another request), or in an SWA group a row that found its chain whole or
        did not check it (the predecessor's LUT entry may have moved). With ``_EVERY_SLOT``, the
        chain is not judged at all.
        With ``index``, the launch's place in the group's log: a logged write after it that wrote
        the predecessor (where the chain is judged against the predecessor's record now) gave it a
        record the launch never read, so a row whose link was made from that one is another
        launch's (:meth:`_read_before_rewritten`)."""
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
        if loose is not None:
            if group.lut is not None and not bits & _BIT_CHAIN and v.expected_aux == v.stored_chain_hash:
                return True
            return prev in loose
        if prev == L.PADDING_SLOT or prev >= group.ctx.num_slots:  # the chain is not checked
            return not bits & _BIT_CHAIN and v.expected_aux == v.stored_chain_hash
        if index is not None and not self._read_before_rewritten(group, v, index, prev):
            return False
        expected_chain = self.link(group, prev)
        return v.expected_aux == expected_chain and bool(bits & _BIT_CHAIN) == (v.stored_chain_hash != expected_chain)

    def entries(self, group, launch, key: tuple) -> list[tuple]:
        """``(batch row, position)`` of each of the launch's entries that check the slot of ``key``
        (``(tag, slot, position)``; the position only for the UNRESOLVED marker, whose rows record
        the entry's position: a pool row outside the table, a position past its width, a cell past
        the LUT)."""
        _, slot, position = key
        found = self.checked(group, launch).get(slot, [])
        if slot != L.UNRESOLVED_SLOT:
            return found
        found = [entry for entry in found if entry[1] == position]
        rows = self._batch(launch, "req_pool_indices")
        lens = self._lengths(launch)
        table_rows, width = self._table().shape
        starts = _window_starts(lens, group.window)
        outside = (rows != 0) & ((rows < 0) | (rows >= table_rows) | (position >= width))
        return found + [(int(r), position) for r in np.flatnonzero(outside & (starts <= position) & (position < lens))]

    def match_verify(self, group, launch, v, written: frozenset = frozenset()) -> tuple[list, bool]:
        """The entries of a replayed static forward's ``launch`` that would record exactly ``v``,
        else those that fit it but for the chain (``written``: the slots the forward writes), and
        whether they are of the first kind."""
        key = _verify_key(v)
        entries = self.entries(group, launch, key)
        exact = [e for e in entries if self.fits(group, launch, v, e)]
        return (exact, True) if exact else ([e for e in entries if self.fits(group, launch, v, e, written)], False)

    def match_write(self, group, launch, v) -> list[tuple]:
        """``(batch row, position)`` of each entry or request of ``launch`` that could have
        recorded write row ``v`` (an entry records up to three rows, a request one of each kind
        without an entry): the entries that wrote its slot with
        its token and position, or for the rows SPEC 4 records without an entry, the requests whose
        seed is that slot (the seed's position) or whose entries reach past the batch's arrays
        (the first position past them)."""
        extend = self._batch(launch, "extend_seq_lens")
        prefix = self._batch(launch, "prefix_lens")
        rows = self._batch(launch, "req_pool_indices")
        counted = np.where(rows != 0, np.maximum(extend, 0), 0)  # padding rows write nothing (SPEC 3.3)
        ends = np.cumsum(counted)
        loc = self._write_loc(launch)
        writes = np.flatnonzero(counted > 0)
        if _no_entry(v) and v.slot_idx != -1:  # a seed's row: none where the table names it no more
            return [(int(r), int(prefix[r]) - 1) for r in writes if prefix[r] > 0
                    and self.cell_slot(group, int(rows[r]), int(prefix[r]) - 1) == v.slot_idx]
        if _no_entry(v):
            return [(int(r), int(prefix[r]) + max(0, loc.shape[0] - int(ends[r] - counted[r])))
                    for r in writes if ends[r] > loc.shape[0]]
        tokens, positions = self._batch(launch, "input_ids"), self._batch(launch, "positions")
        found = []
        for i in np.flatnonzero(loc == v.slot_idx).tolist():
            r = int(np.searchsorted(ends, i, "right"))
            if r < len(ends) and tokens[i] == v.stored_token and positions[i] == v.position:
                found.append((r, int(prefix[r]) + i - int(ends[r] - counted[r])))
        return found

    # --- every row of a group -----------------------------------------------------------------------
    def _candidates(self, group, keys: dict) -> dict:
        """For each key of ``keys``, the logged verify launches of its tag that checked its slot and
        ran (their plan fit the capacity), oldest first."""
        found: dict = {key: [] for key in keys}
        for index, launch in enumerate(group.log):
            if launch.kind != "verify" or self.overflowed(group, launch):
                continue
            for key in keys:
                if key[0] == launch.tag and self.entries(group, launch, key):
                    found[key].append(index)
        return found

    def _rewrites(self, group, slots: set) -> dict:
        """For each of ``slots`` in the pool, the logged write launches that wrote it. A slot outside
        the pool has no record to write: its rows read the same before and after such a write."""
        found = {slot: self._writes_of(group, slot).tolist() for slot in slots if 0 <= slot < group.ctx.num_slots}
        return {slot: writes for slot, writes in found.items() if writes}

    def place_verify_rows(self, group, rows: Sequence, dropped: bool, static_ran: set) -> dict:
        """``{row index: (launch index or None, (phase, step, request, position))}`` for the rows
        only a verify records.

        A slot found bad stays bad until it is written again, so every launch that read it since
        recorded it: the rows of one slot and tag, in ring order, go to the last launches that
        checked the slot, each taking from the end one row for each of its entries that fits one.
        When the slot was written before the last of those launches, a row whose stored fields
        are the slot's record now (and that does not report changed KV bytes the slot no longer
        has) came after the write, any other before it (from no launch that checks the slot as the
        tables are now, if none did before the write). When the ring dropped rows, the kept ones are the
        first: they go to the first launches, their step told only where every such launch
        recorded one, their request and position only where every entry of those launches that
        they fit names the same (the ring does not tell when the slot went bad). A row of a slot
        that no logged write wrote, whose stored fields are not the slot's record now, gets its
        phase alone (:meth:`_from_an_older_record`)."""
        log = group.log
        keyed: dict = {}
        for i, v in enumerate(rows):
            if not self.is_write_row(group, v):
                keyed.setdefault(_verify_key(v), []).append(i)
        candidates = self._candidates(group, keyed)
        rewrites = self._rewrites(group, {key[1] for key in keyed})
        placed: dict = {}
        for key, pending in keyed.items():
            order = candidates[key]
            writes = [index for index in rewrites.get(key[1], ()) if order and index < order[-1]]
            if not writes:
                # a static forward's writes are known only from its arrays as they are now, which
                # need not be what each of its runs wrote
                if not static_ran and key[1] not in rewrites:
                    older = self._from_an_older_record(group, rows, key[1], pending)
                    placed.update((i, (None, self.phase_only(group, rows[i]))) for i in older)
                    pending = [i for i in pending if i not in older]
                self._assign(group, rows, key, pending, order, order, dropped, placed)
                continue
            after = [i for i in pending if self._recorded_since(group, rows[i])]
            before = [i for i in pending if i not in after]
            earlier = [index for index in order if index < writes[-1]]
            self._assign(group, rows, key, after, [index for index in order if index > writes[-1]], order, dropped,
                         placed)
            if not earlier or not any(earlier[0] < index < writes[-1] for index in writes[:-1]):
                self._assign(group, rows, key, before, earlier, order, dropped, placed)
            else:  # written more than once: which content a row shows is not told apart
                for i in before:
                    names = _distinct((request_name(log[index].batch, r), position) for index in earlier
                                      for r, position in self._fitting(group, index, key, rows[i]))
                    if len(names) == 1:
                        (name, position), = names
                        placed[i] = (None, (log[earlier[-1]].phase, None, name, position))
        self._unname_where_hidden_readers_came_after(group, rows, placed, dropped)
        return placed

    def _unname_where_hidden_readers_came_after(self, group, rows: Sequence, placed: dict, dropped: bool) -> None:
        """Gives their phase alone to the placed rows that a hidden reader may have recorded
        (:meth:`_hidden_readers`): one after the launch a row went to (a bad slot stays bad, so
        the last rows are the last readers'), or any with a full ring (whose kept rows are the
        first) or where the row went to no one launch."""
        for i, (index, name) in placed.items():
            if name[2] is None and name[1] is None:
                continue
            hidden = self._hidden_readers(group, rows[i])
            if hidden and (dropped or index is None or hidden[-1] > index):
                placed[i] = (index, self.phase_only(group, rows[i]))

    def _hidden_readers(self, group, v) -> list:
        """The log indices of the verify launches of row ``v``'s tag that may have checked its slot
        through a pool row handed on since (:meth:`_handed_on`): the table row holds another
        request's slots now, so which slots the launch checked there is not known, only at which
        positions: the row's, which it stores unless it reports a mismatch (a row of a slot outside
        the pool stores the entry's own)."""
        inside = 0 <= v.slot_idx < group.ctx.num_slots
        position = None if inside and int(v.fail_reason) & _BIT_POSITION else int(v.position)
        return [index for index, spans in self._handed_on_spans(group, int(v.kernel_kind))
                if position is None or bool(np.any((spans[:, 0] <= position) & (position < spans[:, 1])))]

    def _handed_on_spans(self, group, tag: int) -> list:
        """``(log index, spans)`` of each verify launch of ``tag`` that ran with pool rows handed on
        since: ``spans`` holds ``[start, end)`` of the positions it checked through each of them."""
        key = ("handed spans", group.name, tag)
        if key not in self._cache:
            found = []
            for index, launch in enumerate(group.log):
                if launch.kind != "verify" or launch.tag != tag or id(launch.batch) not in self._handed_on(group) \
                        or self.overflowed(group, launch):
                    continue
                lens = self._lengths(launch)
                stale = np.flatnonzero(self._through_handed_on(group, launch) & (lens > 0))
                ends = np.minimum(lens[stale], self._table().shape[1])
                if stale.shape[0]:
                    found.append((index, np.stack([_window_starts(lens[stale], group.window), ends], axis=1)))
            self._cache[key] = found
        return self._cache[key]

    def _recorded_since(self, group, v) -> bool:
        """Whether verify row ``v``, of a slot a logged write wrote, came after that write: it shows
        the slot's record now, and reports changed KV bytes only where the slot's bytes still
        differ from its hash (bytes clean now were written since the row found them changed)."""
        return self._shows_record_now(group, v) and not (int(v.fail_reason) & _BIT_KV
                                                          and not self.kv_changed(group, v.slot_idx))

    def _shows_record_now(self, group, v) -> bool:
        """Whether verify row ``v`` stored the fields its pool slot's record holds now."""
        now = self.fields(group, v.slot_idx)
        return (v.stored_token, v.position, v.stored_chain_hash) == (now["token"], now["position"], now["prev_hash"])

    def _from_an_older_record(self, group, rows: Sequence, slot: int, pending: list) -> list:
        """The rows of ``pending`` (a pool slot's, which no logged write wrote, with eager
        forwards alone since the previous poll) whose stored fields are not the slot's record now:
        something the canary does not show gave the slot another record after they were recorded
        (``kc.copy_records`` moving another token's record into a freed slot: a compaction, a
        reload). Which of the launches that read the slot saw the old record is not known, and a
        launch that checks the slot as the tables are now may have read only the new one: such rows
        get their phase alone."""
        if not 0 <= slot < group.ctx.num_slots:
            return []
        return [i for i in pending if not self._shows_record_now(group, rows[i])]

    def written_after(self, group, index: int) -> frozenset:
        """The slots the write launches of the forward of ``group.log[index]`` wrote after it."""
        key = ("written after", group.name, index)
        if key not in self._cache:
            step, slots = group.log[index].step, set()
            for later in group.log[index + 1:]:
                if later.step != step:
                    break
                if later.kind == "write":
                    slots.update(self._written(later).tolist())
            self._cache[key] = frozenset(slots)
        return self._cache[key]

    def _fitting(self, group, index: int, key: tuple, v, loose: Optional[Container] = None) -> list[tuple]:
        """The entries of the group's logged launch ``index`` that row ``v`` of ``key`` fits: none where
        a logged write after the launch wrote the row's slot and the row shows the record the slot
        holds now (:meth:`_recorded_since`), which the launch never read (a slot outside the pool
        has no record to show)."""
        if 0 <= v.slot_idx < group.ctx.num_slots and self._rewritten_after(group, v.slot_idx, index) \
                and self._recorded_since(group, v):
            return []
        launch = group.log[index]
        return [e for e in self.entries(group, launch, key) if self.fits(group, launch, v, e, loose, index)]

    def _writes_of(self, group, slot: int) -> np.ndarray:
        """The log indices of the group's write launches and moves (``Canary.copy_records``) that
        gave ``slot`` a record, in log order, each once."""
        key = ("writes", group.name)
        if key not in self._cache:
            written = [(np.unique(self._written(launch)).astype(np.int64), i)
                       for i, launch in enumerate(group.log) if launch.kind in ("write", "move")]
            slots = np.concatenate([np.zeros(0, np.int64)] + [w for w, _ in written])
            places = np.concatenate([np.zeros(0, np.int64)] + [np.full(w.shape[0], i, np.int64) for w, i in written])
            order = np.argsort(slots, kind="stable")  # by slot, each slot's writes in log order
            self._cache[key] = (slots[order], places[order])
        slots, places = self._cache[key]
        return places[np.searchsorted(slots, slot):np.searchsorted(slots, slot, "right")]

    def _read_before_rewritten(self, group, v, index: int, prev: int) -> bool:
        """Whether launch ``index`` may have recorded verify row ``v``, as far as its predecessor
        ``prev`` tells: no logged write wrote ``prev`` after the launch, or the row predates the
        first that did, as its own slot's last write shows, which it predates
        (:meth:`_recorded_since`) and which comes no later. (The row's chain, judged against the
        predecessor's record now, then fits only where the write left the link as it was: a
        prompt prefilled again into the same slots.) A row recorded after that write, or not
        known to be before it, is some later launch's: this one read the record before it."""
        writes = self._writes_of(group, prev)
        later = writes[writes > index]
        if not later.shape[0]:
            return True
        own = self._writes_of(group, v.slot_idx)
        return bool(own.shape[0]) and int(own[-1]) <= int(later[0]) and not self._recorded_since(group, v)

    def _rewritten_after(self, group, slot: int, index: int) -> bool:
        """Whether a logged write launch or move after launch ``index`` gave ``slot`` a record."""
        writes = self._writes_of(group, slot)
        return bool(writes.shape[0]) and int(writes[-1]) > index

    def _one_forward(self, group, key: tuple, v, step: int, readers: list) -> bool:
        """Whether every launch of ``readers`` (all those that checked the slot of ``key``) with an
        entry that row ``v`` fits, its chain not judged, is of forward ``step``: only that forward
        can have recorded the row, whatever its predecessor held then."""
        log = group.log
        return all(log[index].step == step or not self._fitting(group, index, key, v, _EVERY_SLOT)
                   for index in readers)

    def _assign(self, group, rows: Sequence, key: tuple, pending: list, order: list, readers: list,
                dropped: bool, placed: dict) -> None:
        """The rows ``pending`` of ``key`` given to the launches ``order`` (oldest first) that
        checked its slot while it held one content (see :meth:`place_verify_rows`): first to the
        entries they fit, then the rows left to entries they fit, or fit but for the chain, whose
        predecessor may have changed since (an entry takes one row; the first pass stops at a row
        of the second kind, which may hide rows of the same launch before it). A row of the second
        kind has its launch's step only where no launch of another forward among ``readers`` (every
        launch that checked the slot) has an entry it fits but for the chain: the chain, which would
        tell such launches apart, is what it cannot be judged by."""
        log = group.log
        if not order or not pending:
            return
        exact = not dropped or sum(len(self._fitting(group, index, key, rows[pending[0]]))
                                   for index in order) == len(pending)
        # launches of one forward only: whichever recorded a row, its step is that forward's
        one_step = len({log[index].step for index in order}) == 1
        used: dict = {}
        for loose in (False, True):
            for index in (order if dropped else order[::-1]):
                launch, taken = log[index], []
                while pending:
                    i = pending[0] if dropped else pending[-1]
                    held = used.get(index, set()) | {entry for _, entry, _, _ in taken}
                    fit = self._fitting(group, index, key, rows[i])
                    judged = any(e not in held for e in fit)
                    if loose and not judged:
                        fit = self._fitting(group, index, key, rows[i], self.written_after(group, index))
                    entry = next((e for e in fit if e not in held), None)
                    if entry is None:
                        break  # this row, and those before it, came from other launches
                    taken.append((i, entry, fit, judged))
                    pending.remove(i)
                used.setdefault(index, set()).update(entry for _, entry, _, _ in taken)
                # fewer rows than entries fitting them: some fit only as the tables are now, and a
                # row is named only where all its fitting entries agree
                alike = _one_entry_each([fit for _, _, fit, judged in taken if judged])
                for i, entry, fit, judged in taken:
                    if not exact and not self.log_capped:  # a full ring: any launch of ``order`` may have recorded it
                        name, position = self._one_reader(group, key, rows[i], order)
                    elif alike and judged:
                        name, position = request_name(launch.batch, entry[0]), entry[1]
                    else:
                        name, position = _one_name(launch, fit)
                    known = exact or one_step if judged else \
                        self._one_forward(group, key, rows[i], launch.step, readers)
                    placed[i] = (index, (launch.phase, launch.step if known else None, name, position))
                if not pending:
                    return

    def _one_reader(self, group, key: tuple, v, order: list) -> tuple:
        """``(request, position)`` where every entry of the launches ``order`` that row ``v`` fits
        (or fits but for the chain, in a launch where none fits it exactly) names the same, else
        ``(None, None)``. The rows a full ring kept are the first recorded, but the ring does not
        tell when the slot went bad: a launch that read it before then recorded nothing, so any of
        the launches may have recorded the row."""
        names: list = []
        for index in order:
            launch = group.log[index]
            fit = self._fitting(group, index, key, v) or \
                self._fitting(group, index, key, v, self.written_after(group, index))
            names += [(request_name(launch.batch, r), position) for r, position in fit]
        return _the_one(names)

    def kv_changed(self, group, slot: int) -> bool:
        """Whether the slot's real-KV bytes now differ from the hash its record holds (False where
        nothing is hashed), recomputed on the host as the kernels fold them."""
        key = ("kv changed", group.name, slot)
        if key not in self._cache:
            ctx = group.ctx
            read = [(_HostRows(source), source.page_size, source.num_bytes_per_token,
                     source.read_length(ctx.hash_mode)) for source in ctx.real_kv_sources]
            self._cache[key] = bool(0 <= slot < ctx.num_slots and any(length for *_, length in read)) and \
                _ref._signed(_ref.real_kv_hash(read, slot)[0]) != self.fields(group, slot)["real_kv_hash"]
        return self._cache[key]

    def is_write_row(self, group, v) -> bool:
        """Whether only a write records a row of this shape (SPEC 3.1, 4): its write bits, or the
        out-of-range rows a write records under the TAIL tag: an entry's slot or source row
        ``(slot, pos, token, token, chain, pos)``, a seed ``(seed, 0, 0, 0, 0, 0)``, entries past
        the batch's arrays ``(-1, 0, 0, 0, chain, 0)``."""
        bits = int(v.fail_reason)
        if bits & _WRITE_BITS:
            return True
        if int(v.kernel_kind) != group.tail_tag or bits & ~_OUT_OF_RANGE:
            return False
        if v.expected_token == v.stored_token and v.expected_aux == v.position and v.stored_chain_hash != 0:
            return True
        return _no_entry(v)

    def resolve(self, group, rows: Sequence, dropped: bool, static_ran: set) -> list[tuple]:
        """``(phase, step, request, position)`` of every row (``None`` where unknown)."""
        log = group.log
        self._wanted[group.name] = np.unique(np.array([v.slot_idx for v in rows], np.int64))
        placed = self.place_verify_rows(group, rows, dropped, static_ran)
        out, pointer, misses = [], 0, set()
        taken: dict = {}  # by (launch, match): the rows given to it, one each an entry or request
        replayed: dict = {}  # by (launch, key): the verify rows a lone replay's launch fits exactly
        for i, v in enumerate(rows):
            if i in placed:
                index, named = placed[i]
                pointer = pointer if index is None else index
                out.append(named)
                continue
            found = None
            if self.is_write_row(group, v) and _row(v) not in misses:  # in ring order, from the last row's launch
                tag = int(v.kernel_kind)
                for index in list(range(pointer, len(log))) + list(range(0, pointer)):
                    if log[index].kind == "write" and log[index].tag == tag:
                        match = self.match_write(group, log[index], v)
                        # an entry records up to three rows (source out of range, input assert,
                        # chain position assert), a seed or a request past the arrays one
                        held = (index, v.slot_idx) if _no_entry(v) else (index, _row(v))
                        if taken.get(held, 0) < len(match) * (1 if _no_entry(v) else 3):
                            taken[held] = taken.get(held, 0) + 1
                            found = (index, match)
                            break
            if found is None:
                misses.add(_row(v))  # an identical row would walk the log for nothing
                out.append(self._unlogged(group, v, static_ran, i, replayed))
                continue
            pointer, match = found
            launch = log[pointer]
            out.append((launch.phase, launch.step) + _one_name(launch, match))
        for fitted in replayed.values():
            _name_alike(fitted, out)
        return out

    def _unlogged(self, group, v, static_ran: set, i: int, replayed: dict) -> tuple:
        """A row no logged launch explains: a static forward's replay, else only its phase is known
        (from its tag and shape; the tables have changed since). The rows of the only replay since
        the previous poll that fit its entries exactly are kept in ``replayed``, to be named
        together (:func:`_name_alike`)."""
        write = self.is_write_row(group, v)
        for record in group.static_log:
            if record.run_count_at not in static_ran:
                continue
            launches = record.launches
            written = frozenset().union(*(self._written(launch).tolist()
                                          for launch in launches if launch.kind == "write"))
            for launch in launches:
                if launch.tag != int(v.kernel_kind) or (launch.kind == "write") != write:
                    continue
                match, exact = (self.match_write(group, launch, v), False) if write else \
                    self.match_verify(group, launch, v, written)
                if match:
                    if exact and self.replay_step is not None:
                        replayed.setdefault((id(launch), _verify_key(v)), []).append((i, launch, match))
                    return (launch.phase, self.replay_step) + _one_name(launch, match)
        return self.phase_only(group, v)

    def phase_only(self, group, v) -> tuple:
        """``(phase, None, None, None)`` for a row whose launch is not known: its phase from its
        tag and shape alone."""
        tag = int(v.kernel_kind)
        phase = ("head" if tag == group.head_tag else "sweep" if tag == group.sweep_tag
                 else ("write" if self.is_write_row(group, v) else "tail") if tag == group.tail_tag
                 else "unknown")
        return phase, None, None, None


class _EverySlot:
    """A container of every slot: :meth:`RowMapper.fits` with it does not judge the chain."""

    def __contains__(self, slot) -> bool:
        return True


_EVERY_SLOT = _EverySlot()


class _HostRows:
    """A real-KV source as the reference model's ``rows_u8`` reads it (``shape[0]``, ``[row,
    columns]``), each row copied to the host only when read."""

    def __init__(self, source):
        self.source = source
        self.shape = (source.num_rows,)

    def __getitem__(self, index):
        row, columns = index
        return np.ascontiguousarray(to_host(self.source._native[row])).reshape(-1).view(np.uint8)[columns]


def _name_alike(fitted: list, out: list) -> None:
    """Name the rows of one slot that one run of a launch recorded, ``(row index, launch, entries
    it fits exactly)`` each, as :meth:`RowMapper._assign` names a logged launch's: where there are
    as many rows as entries they fit, each entry recorded one, so each row takes an entry of its
    own (alike rows of a slot several requests read, one for each reader)."""
    if not _one_entry_each([fit for _, _, fit in fitted]):
        return
    chosen: dict = {}  # entry -> (row index, launch), the rows taken last first, as _assign takes them
    for i, launch, fit in fitted[::-1]:
        entry = next((e for e in fit if e not in chosen), None)
        if entry is None:
            return
        chosen[entry] = (i, launch)
    for (r, position), (i, launch) in chosen.items():
        out[i] = out[i][:2] + (request_name(launch.batch, r), position)


def _one_entry_each(fits: list) -> bool:
    """Whether rows whose fitting entries are ``fits`` (one list a row) are as many as the entries
    they fit together: then each entry recorded one row, and each row may take an entry of its own."""
    return len(fits) == len({entry for fit in fits for entry in fit})


def _one_name(launch, entries: list) -> tuple:
    """``(request, position)`` where every entry that could have recorded a row names the same,
    else ``(None, None)``."""
    return _the_one((request_name(launch.batch, r), position) for r, position in entries)


def _the_one(names) -> tuple:
    """The one ``(request, position)`` among ``names``, else ``(None, None)``."""
    names = _distinct(names)
    return names[0] if len(names) == 1 else (None, None)


def _distinct(names) -> list:
    """``(request, position)`` ``names`` without repeats, the requests compared with ``==`` (an id
    need not be hashable) or, where that raises or gives no truth value, told apart: an engine's
    request object must not stop every later poll."""
    out: list = []
    for request, position in names:
        if not any(position == seen_position and _same(request, seen) for seen, seen_position in out):
            out.append((request, position))
    return out


def _verify_key(v) -> tuple:
    """``(tag, slot, position)`` of a verify row, the position only for the UNRESOLVED marker (whose
    rows record the entry's position): the rows of one key come from the entries that check it."""
    return int(v.kernel_kind), v.slot_idx, v.position if v.slot_idx == L.UNRESOLVED_SLOT else None


def _no_entry(v) -> bool:
    """Whether a write row is one SPEC 4 records without an entry: a seed past the pool ``(seed, 0,
    0, 0, 0, 0)`` or entries past the batch's arrays ``(-1, 0, 0, 0, chain, 0)``. An entry's row of
    token 0 at position 0 has the same zeros, but its slot and a running chain."""
    zeros = (v.position, v.stored_token, v.expected_token, v.expected_aux) == (0, 0, 0, 0)
    return zeros and (v.stored_chain_hash == 0 or v.slot_idx == -1)


def _row(v) -> tuple:
    return (int(v.kernel_kind), v.slot_idx, v.position, v.stored_token, v.expected_token, v.stored_chain_hash,
            v.expected_aux, int(v.fail_reason))
