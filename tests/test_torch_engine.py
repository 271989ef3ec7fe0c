"""A small continuous-batching engine over torch CPU tensors, wired to kc.Canary as
docs/integration.md says, independent of the demo's simulator: a bfloat16 paged pool (pages of 16)
for a full-attention layer and a pool of its own for a sliding-window layer, chunked prefill mixed
with decodes, finished requests' rows and pages handed out again, and a host tier of another layout
that running requests are offloaded to and loaded back from, the records of both groups carried by
kc.copy_records. A clean run reports nothing; each fault is reported at the next forward, named to
its request and position."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc

torch = pytest.importorskip("torch")

PAGE, HEADS, DIM, WINDOW = 16, 2, 8, 6


class Request:
    def __init__(self, rid, tokens, prompt_len):
        self.rid, self.tokens, self.prompt_len = rid, tokens, prompt_len
        self.row, self.pages, self.cached, self.state, self.away = 0, [], 0, "waiting", None

    def slot(self, position):
        return self.pages[position // PAGE] * PAGE + position % PAGE


class Engine:
    def __init__(self, seed, pages=48, rows=8, width=160, budget=40, swa_slots=256, host_slots=256):
        self.rng = np.random.default_rng(seed)
        self.model = torch.Generator().manual_seed(seed)  # the KV the "model" writes
        self.budget, self.requests, self.step_no, self.reports = budget, [], 0, []
        kv = lambda *shape: torch.zeros(shape, dtype=torch.bfloat16)  # noqa: E731
        self.k, self.v = kv(pages, PAGE, HEADS, DIM), kv(pages, PAGE, HEADS, DIM)
        self.swa_k, self.swa_v = kv(swa_slots, HEADS, DIM), kv(swa_slots, HEADS, DIM)
        self.lut = torch.zeros(pages * PAGE + 1, dtype=torch.int64)
        self.table = torch.zeros((rows, width), dtype=torch.int32)
        self.expected = torch.zeros((rows, width), dtype=torch.int32)
        self.free_pages, self.free_rows, self.free_swa = list(range(1, pages)), list(range(1, rows)), \
            list(range(1, swa_slots))
        self.canary = kc.Canary(
            pool_slot_count=pages * PAGE, req_to_token=self.table, device="cpu",
            capacities=kc.Capacities.from_args(req_to_token_pool_size=rows, max_seq_len_per_req=width,
                                               pool_slot_count=pages * PAGE, max_prefill_tokens=budget),
            real_kv_sources=kc.layouts.paged([self.k], [self.v], page_size=PAGE), hash_mode=kc.HashMode.ALL,
            expected_tokens=self.expected, chain_position_assert=True,
            swa=kc.SwaGroup(window=WINDOW, lut=self.lut, num_slots=swa_slots,
                            real_kv_sources=kc.layouts.per_layer([self.swa_k], [self.swa_v])))
        # the host tier: a token a row for both groups, where the full pool is paged
        self.host = {}
        for group, context in (("full", self.canary.context), ("swa", self.canary.swa_context)):
            host_k, host_v = kv(host_slots, HEADS, DIM), kv(host_slots, HEADS, DIM)
            self.host[group] = (host_k, host_v, kc.CanaryContext.allocate(
                host_slots, hash_mode=kc.HashMode.ALL, real_kv_sources=kc.layouts.per_layer([host_k], [host_v])))
            assert self.host[group][2].kv_read_lengths == context.kv_read_lengths
        self.free_host = list(range(1, host_slots))
        self.pages_handed, self.rows_handed, self.offloads, self.reloads = set(), set(), 0, 0
        self.reused_pages = self.reused_rows = self.mixed_forwards = 0

    def submit(self):
        prompt, out = int(self.rng.integers(4, 60)), int(self.rng.integers(3, 20))
        self.requests.append(Request(f"r{len(self.requests)}", self.rng.integers(1, 32_000, prompt + out), prompt))

    def running(self):
        return [r for r in self.requests if r.state == "running"]

    def _take_page(self):
        page = self.free_pages.pop(0)
        self.reused_pages += page in self.pages_handed
        self.pages_handed.add(page)
        return page

    def _take_row(self):
        row = self.free_rows.pop(0)
        self.reused_rows += row in self.rows_handed
        self.rows_handed.add(row)
        return row

    def _drop_swa(self, r, position):
        """Free the SWA slot of a position that left the window, zeroing its LUT cell."""
        cell = r.slot(position)
        if int(self.lut[cell]):
            self.free_swa.append(int(self.lut[cell]))
            self.lut[cell] = 0

    def _release(self, r):
        for position in range(r.cached):
            self._drop_swa(r, position)
        self.free_pages += r.pages
        self.free_rows.append(r.row)
        r.pages, r.row = [], 0

    def step(self, fault=None):
        self.step_no += 1
        for r in self.requests:
            if r.state == "away" and self.step_no >= r.away["back"]:
                self.reload(r)
            if r.state == "waiting" and self.free_rows and len(self.running()) < 5:
                r.row, r.state = self._take_row(), "running"
        plan, used = [], 0
        for r in sorted(self.running(), key=lambda r: r.cached < r.prompt_len):  # decodes first
            n = 1 if r.cached >= r.prompt_len else min(r.prompt_len - r.cached, self.budget - used)
            while n > 0 and len(r.pages) * PAGE < r.cached + n and self.free_pages:
                r.pages.append(self._take_page())
            if n > 0 and len(r.pages) * PAGE >= r.cached + n and len(self.free_swa) >= n:
                plan.append((r, np.arange(r.cached, r.cached + n)))
                used += n
        if not plan:
            return
        self.mixed_forwards += len({r.cached < r.prompt_len for r, _ in plan}) == 2  # prefill chunks and decodes
        for r, positions in plan:  # the tables hold the new slots before the forward
            slots = torch.tensor([r.slot(int(p)) for p in positions])
            self.table[r.row, positions] = slots.to(torch.int32)
            self.expected[r.row, positions] = torch.as_tensor(r.tokens[positions], dtype=torch.int32)
            self.lut[slots] = torch.tensor([self.free_swa.pop(0) for _ in positions])
        flat = lambda parts: torch.as_tensor(np.concatenate(parts), dtype=torch.int64)  # noqa: E731
        batch = kc.ForwardBatch(
            req_pool_indices=torch.tensor([r.row for r, _ in plan]),
            prefix_lens=torch.tensor([r.cached for r, _ in plan]),
            extend_seq_lens=torch.tensor([len(p) for _, p in plan]),
            input_ids=flat([r.tokens[p] for r, p in plan]), positions=flat([p for _, p in plan]),
            out_cache_loc=flat([[r.slot(int(q)) for q in p] for r, p in plan]), req_ids=[r.rid for r, _ in plan])
        if fault is not None:
            fault(self, plan)
        self.canary.before_forward(batch)
        loc = batch.out_cache_loc
        for pool in (self.k, self.v):  # the "model"
            pool[loc // PAGE, loc % PAGE] = torch.randn((len(loc), HEADS, DIM), generator=self.model).to(torch.bfloat16)
        for pool in (self.swa_k, self.swa_v):
            pool[self.lut[loc]] = torch.randn((len(loc), HEADS, DIM), generator=self.model).to(torch.bfloat16)
        self.canary.after_forward(batch)
        for r, positions in plan:
            r.cached += len(positions)
        self.reports.append(self.canary.poll())  # before SWA slots that left the window are freed
        for r, positions in plan:
            for position in range(max(0, int(positions[0]) - WINDOW), r.cached - WINDOW):
                self._drop_swa(r, position)
            if r.cached == len(r.tokens):
                r.state = "done"
                self._release(r)
        if self.step_no % 5 == 0:
            live = [r for r in self.running() if r.cached]
            self.canary.sweep(kc.LiveRequests(req_pool_indices=torch.tensor([r.row for r in live]),
                                              seq_lens=torch.tensor([r.cached for r in live]),
                                              req_ids=[r.rid for r in live]))
            self.reports.append(self.canary.poll())

    def _carry(self, group, slots, host_slots, *, out):
        """A group's KV bytes, then their records, from the pool to the host tier (``out``) or back."""
        pool_kv, index, context = {"full": ((self.k, self.v), lambda s: (s // PAGE, s % PAGE), self.canary.context),
                                   "swa": ((self.swa_k, self.swa_v), lambda s: s, self.canary.swa_context)}[group]
        host_k, host_v, host_context = self.host[group]
        for pool, host in zip(pool_kv, (host_k, host_v)):
            if out:
                host[host_slots] = pool[index(slots)]
            else:
                pool[index(slots)] = host[host_slots]
        if out:
            kc.copy_records(src=context, dst=host_context, src_slots=slots, dst_slots=host_slots)
        else:
            kc.copy_records(src=host_context, dst=context, src_slots=host_slots, dst_slots=slots)

    def offload(self, r):
        """A running request's KV and records to the host tier, its pages and row freed."""
        in_window = [p for p in range(r.cached) if int(self.lut[r.slot(p)])]
        away = {"back": self.step_no + 3, "window": in_window}
        for group, slots in (("full", [r.slot(p) for p in range(r.cached)]),
                             ("swa", [int(self.lut[r.slot(p)]) for p in in_window])):
            away[group] = torch.tensor([self.free_host.pop(0) for _ in slots])
            self._carry(group, torch.tensor(slots), away[group], out=True)
        self._release(r)
        r.state, r.away = "away", away
        self.offloads += 1

    def reload(self, r):
        """The request back into the pages, SWA slots and row it gets now."""
        if not self.free_rows or len(self.free_pages) * PAGE < r.cached:
            return
        r.row = self._take_row()
        while len(r.pages) * PAGE < r.cached:
            r.pages.append(self._take_page())
        slots = torch.tensor([r.slot(p) for p in range(r.cached)])
        swa_slots = torch.tensor([self.free_swa.pop(0) for _ in r.away["window"]])
        for group, new in (("full", slots), ("swa", swa_slots)):
            self._carry(group, new, r.away[group], out=False)
            self.free_host += r.away[group].tolist()
        self.table[r.row, :r.cached] = slots.to(torch.int32)  # before the next forward reads them
        self.expected[r.row, :r.cached] = torch.as_tensor(r.tokens[:r.cached], dtype=torch.int32)
        for position, swa_slot in zip(r.away["window"], swa_slots.tolist()):
            self.lut[r.slot(position)] = swa_slot  # older positions' cells stay 0
        r.state, r.away = "running", None
        self.reloads += 1

    def events(self):
        return [event for report in self.reports for event in report]


def _run(seed, steps, offload_every=0, fault_at=None, fault=None):
    """``steps`` forwards, or fewer: the run stops at the first poll that reports (an engine would
    abort the requests it names there)."""
    engine = Engine(seed)
    for _ in range(5):
        engine.submit()
    for step in range(steps):
        if engine.rng.random() < 0.35:
            engine.submit()
        engine.step(fault if step == fault_at else None)
        if engine.events():
            break
        decoding = [r for r in engine.running() if r.prompt_len <= r.cached < len(r.tokens) - 2]
        if offload_every and step % offload_every == offload_every - 1 and decoding:
            engine.offload(decoding[0])
    return engine


def test_a_clean_run_reports_nothing():
    engine = _run(seed=0, steps=60, offload_every=7)
    assert engine.reused_pages and engine.reused_rows and engine.reloads >= 3 and engine.mixed_forwards >= 5
    assert sum(r.state == "done" for r in engine.requests) >= 8
    assert engine.events() == [] and engine.reports[-1].forwards == engine.step_no
    assert engine.canary.stats()["swa"]["slot_run_counter"] > 0


def _victim(plan):
    """A request of the faulted forward with tokens in its second page and more to come."""
    return next(r for r, positions in plan if r.cached >= PAGE + 4 and len(r.tokens) - r.cached >= 8)


def _flip_kv(engine, plan):
    victim = _victim(plan)
    slot = victim.slot(3)
    engine.k.view(torch.uint8)[slot // PAGE, slot % PAGE, 1, 5] ^= 0x10
    return victim.rid, {3}, {"REAL_KV_HASH"}


def _alias(engine, plan):
    victim = _victim(plan)
    other = next(r for r in engine.running() if r is not victim and r.cached > 2)
    engine.table[victim.row, 9] = other.slot(2)  # another request's live slot, another position
    return victim.rid, {9, 10}, {"POSITION", "CHAIN_HASH"}


def _free_in_use(engine, plan):
    victim = _victim(plan)
    engine.free_pages.insert(0, victim.pages[1])  # the next page handed out: another request's positions
    return victim.rid, None, {"POSITION", "CHAIN_HASH"}


@pytest.mark.parametrize("fault", [_flip_kv, _alias, _free_in_use])
def test_a_fault_is_reported_and_named(fault):
    injected = []
    engine = _run(seed=1, steps=40, fault_at=20, fault=lambda engine, plan: injected.append(fault(engine, plan)))
    (rid, positions, reasons), = injected
    events = engine.events()
    assert events and {event.request for event in events} == {rid}
    assert reasons <= {reason for event in events for reason in event.reasons}
    if positions is not None:  # at the faulted forward's HEAD and TAIL verifies
        assert {event.position for event in events} == positions
        assert {(event.step, event.phase) for event in events} == {(21, "head"), (21, "tail")}


def test_a_bit_flipped_in_the_host_tier_is_reported_when_its_request_reads_it_again():
    engine = _run(seed=2, steps=25)
    victim = next(r for r in engine.running() if WINDOW + 4 < r.cached < len(r.tokens) - 3)
    last = victim.cached - 1  # in the window: its SWA slot goes to the tier too
    engine.offload(victim)
    engine.host["full"][1].view(torch.uint8)[int(victim.away["full"][2]), 0, 0] ^= 0x01
    engine.host["swa"][0].view(torch.uint8)[int(victim.away["swa"][-1]), 1, 3] ^= 0x40
    for _ in range(5):
        engine.step()
    assert {(event.group, event.request, event.position, event.reasons) for event in engine.events()} == {
        ("full", victim.rid, 2, ("REAL_KV_HASH",)), ("swa", victim.rid, last, ("REAL_KV_HASH",))}
