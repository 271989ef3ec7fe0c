"""A fuzz of ``kc.Canary`` through its public API: a random but correct engine must report nothing,
and the same engine with one corruption injected must be reported.

    PYTHONPATH=. python tools/canary_fuzz.py --device cpu --seeds 200 --forwards 40 --json fuzz.json

Each seed draws an engine (the real-KV layout or none, hash mode, an SWA group, expected tokens,
speculative chains or trees, static forwards, CUDA graphs on a GPU, a host tier, compaction, a
verify capacity small enough to overflow, poll and sweep periods) and a workload of chunked
prefills, decodes, finishing requests and reused slots and rows, and runs it twice. In the clean
run any violation is a false positive, and the counters the canary exposes (forwards, skipped
verify launches, each group's kernel and slot run counters) must equal what the engine asked of
it. In the second run one corruption the configuration is documented to catch is injected (a KV
byte flipped on the device or in the host tier, a live slot written by another request, a
``req_to_token`` cell pointed at another request's slot, a dropped write, a wrong token id) and must
be reported. An exception in either run is a crash. A row of ``--json`` is one seed: its
configuration, the clean run's findings and counter mismatches, the fault and whether it was
reported; the table sums the rows by feature. The exit status is 1 when any seed had a false
positive, a counter mismatch, a missed fault or a crash.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np

import kvcanary_cupy as kc

LAYOUTS = ("paged", "per_layer", "interleaved", "mla", "none")
SPECULATIVE = ("off", "chain_all", "chain_kept", "tree")  # chain_all: after_forward gets every draft
FAULTS = ("kv_flip", "swa_kv_flip", "host_flip", "slot_steal", "table_alias", "dropped_write", "wrong_token")
BETWEEN_FORWARDS = FAULTS[:5]  # the others change what one forward hands after_forward
VOCAB = 32000
ROW_FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens")
ENTRY_FIELDS = ("input_ids", "positions", "out_cache_loc")
ASSERT_FIELDS = ("expected_input_tokens", "expected_input_positions")

# poll() logs what it finds in modes "log" and "raise"; the fuzz reads the reports instead
QUIET = logging.getLogger("kvcanary_fuzz")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False


@dataclasses.dataclass(frozen=True)
class SeedConfig:
    """One seed's engine: its KV pools, the canary's settings and the workload's knobs."""

    seed: int
    layout: str  # LAYOUTS; "none": the canary has no real-KV source
    layers: int
    heads: int
    head_units: int  # 16-byte units of one head of one token
    dtype: str
    page_size: int  # tokens a row of a paged (or paged MLA) buffer holds
    hash_mode: str  # a kc.HashMode name
    read_bytes: Optional[int]  # ALL mode: bytes of each source hashed (None: every byte)
    swa_window: int  # 0: no SWA group
    swa_sources: bool  # the SWA pool has K/V buffers of its own
    swa_evict: bool  # SWA slots of positions that left the window are freed, their LUT cells zeroed
    expected_pool: bool  # an expected_tokens pool: verify checks stored tokens
    explicit_valid_lens: bool  # batches pass expected_valid_lens (their prefix lengths) themselves
    input_asserts: bool  # batches carry expected_input_tokens/positions: the write input assert
    chain_position_assert: bool
    speculative: str  # SPECULATIVE
    drafts: int
    kept_move: str  # chain_kept and tree: kept drafts moved to other slots "before" or "after" after_forward, or "none"
    static: str  # "off", "eager" (StaticForward.before()/after() called), "graph" (also CUDA graphs)
    host_tier: bool  # requests offloaded to host memory and loaded back, records carried
    compaction: bool  # cached tokens moved to other slots of the pool, records carried
    verify_capacity: int  # 0: Capacities.from_args; else a hand-made one that whole batches overflow
    max_running: int
    max_len: int
    chunk: int  # prefill tokens a request gets in one forward, at most
    poll_every: int
    sweep_every: int
    ring_capacity: int
    mode: str  # "log" or "raise"

    @property
    def hashes_kv(self) -> bool:
        return self.layout != "none" and self.hash_mode != "NONE"

    @property
    def hashes_swa_kv(self) -> bool:
        return self.swa_window > 0 and self.swa_sources and self.hash_mode != "NONE"

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one source (a layer's K or V, or an MLA latent)."""
        return 16 * self.heads * self.head_units

    def features(self) -> list[str]:
        """The keys this seed is counted under in the final table."""
        on = {True: "on", False: "off"}
        return [f"layout={self.layout}", f"hash={self.hash_mode}", f"swa={on[self.swa_window > 0]}",
                f"expected_tokens={on[self.expected_pool]}", f"input_asserts={on[self.input_asserts]}",
                f"speculative={self.speculative}", f"static={self.static}",
                f"kept_move={self.kept_move if self.speculative in ('chain_kept', 'tree') else 'n/a'}",
                f"host_tier={on[self.host_tier]}",
                f"compaction={on[self.compaction]}", f"capacity={'tiny' if self.verify_capacity else 'derived'}",
                f"mode={self.mode}"]


def draw_config(seed: int, device: str) -> SeedConfig:
    rng = np.random.default_rng([seed, 1])

    def pick(options):
        return options[int(rng.integers(len(options)))]

    layout, hash_mode, max_len = pick(LAYOUTS), pick(("NONE", "PARTIAL", "ALL")), int(rng.integers(6, 41))
    heads, head_units = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    read_bytes = None
    if hash_mode == "ALL" and rng.random() < 0.4:
        read_bytes = 16 * int(rng.integers(1, heads * head_units + 1))
    window = int(rng.integers(1, max_len)) if rng.random() < 0.4 else 0
    # graphs need a GPU; on the CPU a static forward's before()/after() run the ops eagerly
    statics = ("off", "eager", "graph") if device != "cpu" else ("off", "eager")
    max_running = int(rng.integers(1, 7))
    return SeedConfig(
        seed=seed, layout=layout, layers=int(rng.integers(1, 3)), heads=heads, head_units=head_units,
        dtype=pick(("float16", "float32", "uint8")),
        page_size=pick((1, 2, 4, 8)) if layout in ("paged", "mla") else 1, hash_mode=hash_mode,
        read_bytes=read_bytes, swa_window=window, swa_sources=bool(rng.random() < 0.7),
        swa_evict=bool(rng.random() < 0.5), expected_pool=bool(rng.random() < 0.5),
        explicit_valid_lens=bool(rng.random() < 0.5), input_asserts=bool(rng.random() < 0.5),
        chain_position_assert=bool(rng.random() < 0.5), speculative=pick(SPECULATIVE),
        drafts=int(rng.integers(1, 5)), kept_move=pick(("none", "before", "after")), static=pick(statics),
        host_tier=bool(rng.random() < 0.5),
        compaction=bool(rng.random() < 0.4),
        # one request alone always fits, so a sweep of it is never skipped
        verify_capacity=int(rng.integers(max_len, 2 * max_len + 1)) if rng.random() < 0.3 else 0,
        max_running=max_running, max_len=max_len, chunk=int(rng.integers(1, 17)),
        poll_every=pick((1, 1, 2, 5)), sweep_every=pick((2, 5, 9)), ring_capacity=pick((0, 1, 4, 1024)),
        mode=pick(("log", "raise")))


def applicable_faults(c: SeedConfig) -> list[str]:
    """The faults ``c`` is documented to catch (docs/detection.md, integration.md §2): changed KV
    bytes only where they are hashed; a wrong token id only where an independent record of the
    intended tokens exists; a dropped write (at a position >= 1, so that a stale record of another
    request fails its chain link) only where KV hashes or expected tokens are checked, since the
    request's own rejected draft of that position, fingerprinted with a wrong token (chain_all),
    chains as the right token would; an alias only where a second request can hold slots."""
    kinds = ["slot_steal"] + (["table_alias"] if c.max_running > 1 else [])
    kinds += ["kv_flip"] if c.hashes_kv else []
    kinds += ["swa_kv_flip"] if c.hashes_swa_kv else []
    kinds += ["host_flip"] if c.host_tier and c.hashes_kv else []
    kinds += ["dropped_write"] if c.hashes_kv or c.expected_pool else []
    kinds += ["wrong_token"] if c.input_asserts or c.expected_pool else []
    return kinds


@dataclasses.dataclass
class Fault:
    """The corruption of a seed's second run: injected at forward ``at`` or the first one after it
    where the engine holds what it needs (a live request with two cached tokens, say)."""

    kind: str
    at: int
    rng: np.random.Generator
    armed: bool = False  # done with it (a slot_steal is injected once the allocator hands the slot out)
    steal: Optional[int] = None  # slot_steal: the live slot the allocator hands out next
    injected_at: Optional[int] = None
    what: str = ""


def draw_fault(c: SeedConfig, forwards: int) -> Fault:
    rng = np.random.default_rng([c.seed, 4])
    kinds = applicable_faults(c)
    return Fault(kinds[int(rng.integers(len(kinds)))], int(rng.integers(1, max(2, 2 * forwards // 3))), rng)


class Device:
    """Arrays on the fuzz's device: NumPy on the CPU, CuPy (imported only then) on a GPU."""

    def __init__(self, name: str):
        self.name = name
        self.cupy = None
        if name != "cpu":
            import cupy  # noqa: PLC0415 (a machine without CuPy runs the CPU fuzz)

            cupy.cuda.Device(int(name.partition(":")[2] or 0)).use()  # where cupy.asarray puts arrays
            self.cupy = cupy

    def put(self, host: np.ndarray):
        return host if self.cupy is None else self.cupy.asarray(host)

    def get(self, array) -> np.ndarray:
        return np.asarray(array) if self.cupy is None else self.cupy.asnumpy(array)

    def i64(self, values) -> Any:
        return self.put(np.asarray(values, np.int64))

    def push(self, host: np.ndarray, mirror) -> None:
        """The engine's host table copied into its device mirror (on the CPU they are one array)."""
        if self.cupy is not None:
            mirror[...] = self.cupy.asarray(host)


@dataclasses.dataclass
class KvPool:
    """A pool's real-KV sources and, for each, a uint8 ``[slots, token bytes]`` view of the same
    memory: where the model writes and where faults flip bits."""

    sources: tuple
    views: list


def build_kv(c: SeedConfig, dev: Device, slots: int, rng: np.random.Generator) -> KvPool:
    """Buffers of random bytes (the engine's KV is never all-zero) in ``c.layout``, built with
    ``kc.layouts``."""
    if c.layout == "none":
        return KvPool((), [])
    dtype = np.dtype(c.dtype)
    head, ps, layers = 16 * c.head_units // dtype.itemsize, c.page_size, range(c.layers)

    def buffer(*shape):
        return dev.put(np.frombuffer(rng.bytes(int(np.prod(shape)) * dtype.itemsize), dtype).reshape(shape).copy())

    def rows(buf):
        return buf.reshape(slots, -1).view(np.uint8)

    if c.layout in ("paged", "per_layer"):
        shape = (slots // ps, ps, c.heads, head) if c.layout == "paged" else (slots, c.heads, head)
        ks, vs = [buffer(*shape) for _ in layers], [buffer(*shape) for _ in layers]
        build = kc.layouts.paged if c.layout == "paged" else kc.layouts.per_layer
        return KvPool(build(ks, vs, read_bytes=c.read_bytes), [rows(b) for pair in zip(ks, vs) for b in pair])
    if c.layout == "interleaved":
        bufs = [buffer(slots, 2, c.heads, head) for _ in layers]
        halves = [part for b in bufs for part in (rows(b)[:, :c.token_bytes], rows(b)[:, c.token_bytes:])]
        return KvPool(kc.layouts.interleaved(bufs, read_bytes=c.read_bytes), halves)
    latent = c.token_bytes // dtype.itemsize
    bufs = [buffer(slots, 1, latent) if ps == 1 else buffer(slots // ps, ps, 1, latent) for _ in layers]
    return KvPool(kc.layouts.mla(bufs, read_bytes=c.read_bytes), [rows(b) for b in bufs])


@dataclasses.dataclass
class TierGroup:
    """One pool's half of the host tier: host KV (a token a row, whatever the pool's layout) and a
    context hashing the same bytes of each slot, which holds only carried records."""

    context: kc.CanaryContext
    views: list


def tier_group(pool: KvPool, hash_mode: kc.HashMode, slots: int, rng: np.random.Generator) -> TierGroup:
    views = [np.frombuffer(rng.bytes(slots * int(v.shape[1])), np.uint8).reshape(slots, -1).copy() for v in pool.views]
    sources = tuple(kc.layouts.from_buffer(view, read_bytes=source.read_bytes, name=f"host[{i}]")
                    for i, (view, source) in enumerate(zip(views, pool.sources)))
    return TierGroup(kc.CanaryContext.allocate(slots, device="cpu", ring_capacity=0, real_kv_sources=sources,
                                               hash_mode=hash_mode), views)


@dataclasses.dataclass
class Request:
    rid: int
    row: int
    tokens: np.ndarray  # every token it will hold: the prompt, then what decoding produces
    prompt_len: int
    slots: list = dataclasses.field(default_factory=list)  # the slot of each cached position (the truth)
    host_slots: Optional[np.ndarray] = None  # while offloaded: the host slot of each cached position
    swa_copied: Optional[np.ndarray] = None  # while offloaded: which of them had an SWA slot
    away_since: int = 0
    swa_evicted: int = 0  # positions below it have no SWA slot any more
    pinned: bool = False  # holds the injected fault: never finished, offloaded or moved
    frozen: bool = False  # scheduled no more (a waiting request), so that its SWA window holds still

    @property
    def away(self) -> bool:
        return self.host_slots is not None

    @property
    def cached(self) -> int:
        return len(self.host_slots) if self.away else len(self.slots)

    @property
    def total(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class Scheduled:
    """A request's part of one forward: the tokens it runs, ``(token, position, slot)`` in the
    forward's flat order (a tree's breadth first), and those it keeps, in path order."""

    request: Request
    prefix: int
    nodes: list
    kept: list
    moved_from: list = dataclasses.field(default_factory=list)  # slots its kept drafts left


@dataclasses.dataclass
class StaticEntry:
    """A padded batch shape: its arrays, refilled in place each forward, the canary's StaticForward
    over them and, on a GPU once it ran eagerly, CUDA graphs of its before() and after()."""

    forward: Any
    arrays: dict
    req_ids: list
    shape: tuple
    graphs: Optional[tuple] = None


@dataclasses.dataclass
class Ledger:
    """What the canary's counters must read, from what the engine asked of it (SPEC 3.1-3.3: every
    verify and write launch counts a kernel run; a verify its entries, unless its plan overflowed,
    which counts a skipped launch; a write its stored entries)."""

    forwards: int = 0
    eager_forwards: int = 0
    overflows: int = 0
    kernel_runs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    slot_runs: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def verify(self, group: str, entries: int, capacity: int) -> None:
        self.kernel_runs[group] += 1
        if entries <= capacity:
            self.slot_runs[group] += entries
        else:
            self.overflows += 1

    def write(self, group: str, entries: int) -> None:
        self.kernel_runs[group] += 1
        self.slot_runs[group] += entries


def next_pow2(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


def wrong_token(token: int) -> int:
    return token % (VOCAB - 1) + 1


def columns(nodes: list) -> tuple[list, list, list]:
    return [n[0] for n in nodes], [n[1] for n in nodes], [n[2] for n in nodes]


class FuzzEngine:
    """A small serving engine driving a ``kc.Canary`` as docs/integration.md says; with ``fault`` it
    injects that corruption once."""

    def __init__(self, c: SeedConfig, dev: Device, fault: Optional[Fault] = None):
        self.c, self.dev, self.fault = c, dev, fault
        self.rng = np.random.default_rng([c.seed, 2])  # the workload
        self.kv_rng = np.random.default_rng([c.seed, 3])  # the bytes the model writes
        self.nodes_per_decode = 1 + (4 * c.drafts if c.speculative == "tree" else c.drafts)
        # room for every request's tokens, its in-flight drafts and their moves, and a compaction's
        slots = 1 + c.max_running * (c.max_len + self.nodes_per_decode + c.drafts) + 8
        self.pool_slots = -(-slots // c.page_size) * c.page_size
        self.free = collections.deque(int(s) for s in self.rng.permutation(np.arange(1, self.pool_slots)))
        self.swa_free = collections.deque(range(1, self.pool_slots))
        self.free_rows = collections.deque(range(1, c.max_running + 1))  # pool row 0 is the padding row
        self.table_host = np.zeros((c.max_running + 1, c.max_len), np.int32)
        self.expected_host = np.zeros_like(self.table_host)
        self.lut_host = np.zeros(self.pool_slots + 1, np.int64)
        self.table, self.expected, self.lut = (dev.put(a.copy()) if dev.cupy is not None else a
                                               for a in (self.table_host, self.expected_host, self.lut_host))
        self.kv = build_kv(c, dev, self.pool_slots, self.kv_rng)
        swa_layout = dataclasses.replace(c, layout="per_layer", layers=1, page_size=1)
        self.swa_kv = build_kv(swa_layout, dev, self.pool_slots, self.kv_rng) if c.swa_window and c.swa_sources \
            else KvPool((), [])
        self.canary = self.build_canary()
        self.groups = [("full", 0)] + ([("swa", c.swa_window)] if c.swa_window else [])
        self.tier, self.tier_free = None, collections.deque()
        if c.host_tier:
            tier_slots = 1 + c.max_running * c.max_len  # host slot 0 unused, as the pool's
            self.tier = {"full": tier_group(self.kv, self.canary.hash_mode, tier_slots, self.kv_rng)}
            if c.swa_window:
                self.tier["swa"] = tier_group(self.swa_kv, self.canary.hash_mode, tier_slots, self.kv_rng)
            self.tier_free = collections.deque(range(1, tier_slots))
        self.requests: list[Request] = []
        self.statics: dict = {}
        self.ledger, self.tally = Ledger(), collections.Counter()
        self.index = self.next_rid = 0
        self.found = self.found_after_fault = self.overflows_seen = self.reported_forwards = 0
        self.first_found: Optional[int] = None
        self.examples: list[str] = []
        self.report_errors: list[str] = []

    def build_canary(self) -> kc.Canary:
        c, rows = self.c, self.c.max_running + 1
        max_bs = next_pow2(c.max_running)  # static forwards pad their batches to a power of two
        if c.verify_capacity:
            caps = kc.Capacities(max_bs=max_bs, verify_capacity=c.verify_capacity, write_req_capacity=max_bs,
                                 write_entry_capacity=max_bs * self.nodes_per_decode)
        else:
            caps = kc.Capacities.from_args(req_to_token_pool_size=rows, max_seq_len_per_req=c.max_len,
                                           pool_slot_count=self.pool_slots, cuda_graph_max_bs=max_bs,
                                           max_prefill_tokens=rows * max(c.chunk, self.nodes_per_decode),
                                           speculative_num_draft_tokens=self.nodes_per_decode)
        swa = kc.SwaGroup(window=c.swa_window, lut=self.lut, num_slots=self.pool_slots,
                          real_kv_sources=self.swa_kv.sources) if c.swa_window else None
        return kc.Canary(pool_slot_count=self.pool_slots, capacities=caps, req_to_token=self.table,
                         device=self.dev.name, real_kv_sources=self.kv.sources, hash_mode=kc.HashMode[c.hash_mode],
                         ring_capacity=c.ring_capacity, mode=c.mode, swa=swa,
                         expected_tokens=self.expected if c.expected_pool else None,
                         chain_position_assert=c.chain_position_assert, logger=QUIET)

    # --- the run ----------------------------------------------------------------------------------
    def run(self, forwards: int) -> "FuzzEngine":
        for index in range(forwards):
            self.step(index)
        self.finish()
        return self

    def step(self, index: int) -> None:
        c, self.index = self.c, index
        self.admit()
        self.move_kv()
        if self.fault and not self.fault.armed and index >= self.fault.at and self.fault.kind in BETWEEN_FORWARDS:
            self.fault.armed = getattr(self, f"inject_{self.fault.kind}")(self.fault.rng)
        if self.statics and self.rng.random() < 0.05:  # graphs rebuilt: the old static forwards closed
            for entry in self.statics.values():
                entry.forward.close()
            self.statics.clear()
        scheduled = self.schedule()
        if scheduled:
            self.forward(scheduled)
        self.retire()
        self.evict_swa()
        if (index + 1) % c.sweep_every == 0:
            self.sweep(self.live())
        if (index + 1) % c.poll_every == 0:
            self.poll()

    def finish(self) -> None:
        """Load back every offloaded request, then sweep each live request alone (it always fits the
        verify capacity), so that a fault is read at least once whatever overflowed before."""
        for request in [r for r in self.requests if r.away]:
            self.reload(request)
        for request in self.live():
            self.sweep([request])
        self.poll()

    def live(self) -> list[Request]:
        """Requests holding cached KV in the pool (offloaded ones are not live: integration.md §5)."""
        return [r for r in self.requests if not r.away and r.cached > 0]

    # --- requests and slots -----------------------------------------------------------------------
    def admit(self) -> None:
        for _ in range(int(self.rng.integers(0, 3)) if self.requests else 1):
            if not self.free_rows:
                return
            total = int(self.rng.integers(2, self.c.max_len + 1))
            tokens = self.rng.integers(1, VOCAB, total)
            row = self.free_rows.popleft()
            self.expected_host[row] = 0
            self.expected_host[row, :total] = tokens
            self.requests.append(Request(self.next_rid, row, tokens, int(self.rng.integers(1, total))))
            self.next_rid += 1

    def take_slot(self, *, kept: bool, with_swa: bool = True) -> int:
        """A free slot, or the armed slot_steal's live one for a token that is kept (a rejected
        draft's record is never written, so stealing for it would only move KV bytes)."""
        fault = self.fault
        if fault is not None and fault.steal is not None and kept:
            slot, fault.steal, fault.injected_at = fault.steal, None, self.index
        elif self.free:
            slot = self.free.popleft()
        else:
            raise RuntimeError("fuzz engine: the pool ran out of slots (the fuzz sized it wrong)")
        if with_swa and self.c.swa_window:
            self.lut_host[slot] = self.swa_free.popleft()
        return slot

    def release_slot(self, slot: int) -> None:
        """Back to the free list (often its front, so that slots are reused soon), with its SWA slot."""
        if self.c.swa_window and self.lut_host[slot]:
            self.swa_free.append(int(self.lut_host[slot]))
            self.lut_host[slot] = 0
        (self.free.appendleft if self.rng.random() < 0.5 else self.free.append)(slot)

    def retire(self) -> None:
        for request in [r for r in self.requests if not r.away and not r.pinned and r.cached >= r.total]:
            for slot in request.slots:
                self.release_slot(slot)
            self.free_rows.append(request.row)
            self.requests.remove(request)
            self.tally["finished"] += 1

    def evict_swa(self) -> None:
        """Free the SWA slots of positions that left every later window, zeroing their LUT cells
        (integration.md §2: 0 means no predecessor to check)."""
        if not (self.c.swa_window and self.c.swa_evict):
            return
        for request in self.live():
            end = request.cached - self.c.swa_window
            for position in range(request.swa_evicted, end):
                slot = request.slots[position]
                if self.lut_host[slot]:
                    self.swa_free.append(int(self.lut_host[slot]))
                    self.lut_host[slot] = 0
            request.swa_evicted = max(request.swa_evicted, end)

    def sync_tables(self) -> None:
        for host, mirror in ((self.table_host, self.table), (self.expected_host, self.expected),
                             (self.lut_host, self.lut)):
            self.dev.push(host, mirror)

    # --- scheduling -------------------------------------------------------------------------------
    def schedule(self) -> list[Scheduled]:
        ready = [r for r in self.requests if not r.away and not r.frozen and r.cached < r.total]
        chosen = [r for r in ready if self.rng.random() < 0.8] or ready[:1]
        return [self.schedule_one(r) for r in chosen]

    def schedule_one(self, request: Request) -> Scheduled:
        """A prefill chunk, a decode, or a decode with a chain or a tree of drafts (each draft wrong
        with chance 0.3; the kept path ends before the first wrong one)."""
        start, c, rng = request.cached, self.c, self.rng
        truth = request.tokens
        if start < request.prompt_len or c.speculative == "off":
            n = int(rng.integers(1, min(c.chunk, request.prompt_len - start) + 1)) if start < request.prompt_len else 1
            tokens, positions, kept = list(truth[start:start + n]), list(range(start, start + n)), list(range(n))
        elif c.speculative == "tree":
            tokens, positions, kept = self.draft_tree(truth, start)
        else:
            n = min(1 + c.drafts, request.total - start)
            right = [True] + [bool(rng.random() >= 0.3) for _ in range(n - 1)]
            tokens = [int(t) if ok else wrong_token(int(t)) for t, ok in zip(truth[start:start + n], right)]
            positions = list(range(start, start + n))
            kept = list(range(right.index(False) if False in right else n))
            self.tally["drafts"] += n - 1
            self.tally["drafts_kept"] += len(kept) - 1
        keep = set(kept)
        nodes = [(int(t), p, self.take_slot(kept=i in keep)) for i, (t, p) in enumerate(zip(tokens, positions))]
        return Scheduled(request, start, nodes, kept)

    def draft_tree(self, truth: np.ndarray, start: int) -> tuple[list, list, list]:
        """A tree rooted at the pending token: each node of the frontier (two at most) gets one or two
        children, at most one of them the target's token; the kept path follows right children."""
        rng = self.rng
        tokens, positions, parents, right = [int(truth[start])], [start], [-1], [True]
        frontier = [0]
        for depth in range(1, min(self.c.drafts, len(truth) - start - 1) + 1):
            grown = []
            for parent in frontier:
                children = int(rng.integers(1, 3))
                good = int(rng.integers(children)) if right[parent] and rng.random() >= 0.3 else -1
                for child in range(children):
                    token = int(truth[start + depth])
                    tokens.append(token if child == good else wrong_token(token))
                    positions.append(start + depth)
                    parents.append(parent)
                    right.append(child == good)
                    grown.append(len(tokens) - 1)
            frontier = grown[:2]
        kept = [0]
        while True:
            child = next((i for i, p in enumerate(parents) if p == kept[-1] and right[i]), None)
            if child is None:
                break
            kept.append(child)
        self.tally["drafts"] += len(tokens) - 1
        self.tally["drafts_kept"] += len(kept) - 1
        return tokens, positions, kept

    # --- one forward ------------------------------------------------------------------------------
    def forward(self, scheduled: list[Scheduled]) -> None:
        """before_forward (or a static forward's before()), the model's KV writes for every token,
        then after_forward with what the forward keeps (integration.md §2, "Speculative decoding")."""
        c = self.c
        verify = self.batch(scheduled)
        keeps_all = c.speculative in ("off", "chain_all")  # the forward's own batch is fingerprinted
        entry = self.static_entry(scheduled) if c.static != "off" and self.rng.random() < 0.7 else None
        self.sync_tables()
        if entry is None:
            self.canary.before_forward(verify)
        else:
            self.refill(entry, scheduled)
            self.static_before(entry, replay=keeps_all)
        self.model_write([slot for s in scheduled for _, _, slot in s.nodes])
        if not keeps_all and c.kept_move == "before":
            self.move_kept(scheduled, records=False)
            self.sync_tables()  # the LUT cells of the destination slots, which the SWA write reads
        after_nodes = [s.nodes if keeps_all else [s.nodes[i] for i in s.kept] for s in scheduled]
        change = self.inject_in_forward(scheduled, after_nodes)
        if entry is not None and keeps_all:
            if change:
                entry.arrays[change[0]][change[1]] = change[2]
            self.static_after(entry)
        else:
            after = verify if keeps_all else self.kept_batch(verify, after_nodes)
            if change:
                values = self.dev.get(getattr(after, change[0])).copy()
                values[change[1]] = change[2]
                after = dataclasses.replace(after, **{change[0]: self.dev.put(values)})
            self.canary.after_forward(after)
        written = sum(len(nodes) for nodes in after_nodes) - (change is not None and change[0] == "out_cache_loc")
        self.account_forward(scheduled, written, eager=entry is None)
        if not keeps_all and c.kept_move == "after":
            self.move_kept(scheduled, records=True)
        self.commit(scheduled)

    def batch(self, scheduled: list[Scheduled]) -> kc.ForwardBatch:
        i64, c = self.dev.i64, self.c
        tokens, positions, slots = columns([node for s in scheduled for node in s.nodes])
        prefixes = [s.prefix for s in scheduled]
        asserts = c.input_asserts
        return kc.ForwardBatch(
            req_pool_indices=i64([s.request.row for s in scheduled]), prefix_lens=i64(prefixes),
            extend_seq_lens=i64([len(s.nodes) for s in scheduled]), input_ids=i64(tokens),
            positions=i64(positions), out_cache_loc=i64(slots), req_ids=[s.request.rid for s in scheduled],
            expected_input_tokens=i64(tokens) if asserts else None,
            expected_input_positions=i64(positions) if asserts else None,
            expected_valid_lens=i64(prefixes) if c.expected_pool and c.explicit_valid_lens else None)

    def kept_batch(self, verify: kc.ForwardBatch, after_nodes: list) -> kc.ForwardBatch:
        """The verify batch's requests and prefixes with each one's kept path: every per-token field
        replaced."""
        i64 = self.dev.i64
        tokens, positions, slots = columns([node for nodes in after_nodes for node in nodes])
        fields = dict(extend_seq_lens=i64([len(nodes) for nodes in after_nodes]), input_ids=i64(tokens),
                      positions=i64(positions), out_cache_loc=i64(slots))
        if self.c.input_asserts:
            fields.update(expected_input_tokens=i64(tokens), expected_input_positions=i64(positions))
        return dataclasses.replace(verify, **fields)

    def model_write(self, slots: list) -> None:
        """The "model": random bytes into every token's K/V, in both pools (never all-zero: byte 0
        of each token is odd)."""
        for views, where in ((self.kv.views, slots), (self.swa_kv.views, self.lut_host[slots].tolist())):
            index = self.dev.i64(where)
            for view in views:
                data = np.frombuffer(self.kv_rng.bytes(len(where) * int(view.shape[1])), np.uint8).copy()
                data = data.reshape(len(where), -1)
                data[:, 0] |= 1
                view[index] = self.dev.put(data)

    def commit(self, scheduled: list[Scheduled]) -> None:
        """Kept tokens into the request and its table row (the cells at and past a prefix are read by
        no launch of the forward: its write seeds from position prefix - 1); rejected drafts' slots
        back to the free list, after after_forward as integration.md §2 asks."""
        for s in scheduled:
            keep = set(s.kept)
            for i in s.kept:
                token, position, slot = s.nodes[i]
                assert position == len(s.request.slots), "fuzz engine: a kept path out of order"
                s.request.slots.append(slot)
                self.table_host[s.request.row, position] = slot
            for slot in [slot for i, (_, _, slot) in enumerate(s.nodes) if i not in keep] + s.moved_from:
                self.release_slot(slot)
            self.tally["tokens"] += len(s.kept)

    def account_forward(self, scheduled: list[Scheduled], written: int, *, eager: bool) -> None:
        ledger, capacity = self.ledger, self.canary.capacities.verify_capacity
        ledger.forwards += 1
        ledger.eager_forwards += eager
        for group, window in self.groups:
            entries = sum(min(s.prefix, window) if window else s.prefix for s in scheduled)
            ledger.verify(group, entries, capacity)  # HEAD
            ledger.write(group, written)
            ledger.verify(group, entries, capacity)  # TAIL

    # --- static forwards --------------------------------------------------------------------------
    def static_entry(self, scheduled: list[Scheduled]) -> StaticEntry:
        """The static forward of the batch's padded shape (rows and tokens to powers of two)."""
        shape = (next_pow2(len(scheduled)), next_pow2(sum(len(s.nodes) for s in scheduled)))
        if shape not in self.statics:
            entry_fields = ENTRY_FIELDS + (ASSERT_FIELDS if self.c.input_asserts else ())
            arrays = {name: self.dev.put(np.zeros(shape[0] if name in ROW_FIELDS else shape[1], np.int64))
                      for name in ROW_FIELDS + entry_fields}
            req_ids = [f"pad{i}" for i in range(shape[0])]
            forward = self.canary.static_forward(kc.ForwardBatch(**arrays, req_ids=req_ids))
            self.statics[shape] = StaticEntry(forward, arrays, req_ids, shape)
        return self.statics[shape]

    def refill(self, entry: StaticEntry, scheduled: list[Scheduled]) -> None:
        """The batch into the entry's arrays in place: real rows and tokens first, then padding rows
        (pool row 0) and tokens whose other fields hold junk, which no plan may read."""
        rows, entries = entry.shape
        tokens, positions, slots = columns([node for s in scheduled for node in s.nodes])

        def padded(values, size):
            out = self.rng.integers(0, 4, size)
            out[:len(values)] = values
            return out

        values = {"req_pool_indices": padded([s.request.row for s in scheduled], rows),
                  "prefix_lens": padded([s.prefix for s in scheduled], rows),
                  "extend_seq_lens": padded([len(s.nodes) for s in scheduled], rows),
                  "input_ids": padded(tokens, entries), "positions": padded(positions, entries),
                  "out_cache_loc": padded(slots, entries), "expected_input_tokens": padded(tokens, entries),
                  "expected_input_positions": padded(positions, entries)}
        values["req_pool_indices"][len(scheduled):] = 0
        for name, array in entry.arrays.items():
            array[...] = self.dev.put(values[name])
        entry.req_ids[:] = [s.request.rid for s in scheduled] + [f"pad{i}" for i in range(len(scheduled), rows)]

    def static_before(self, entry: StaticEntry, *, replay: bool) -> None:
        """A graph replay once captured, when its after() runs too; otherwise before() eagerly (a
        kept path goes to an eager after_forward, which needs an eager before: integration.md §2)."""
        if entry.graphs is not None and replay:
            entry.graphs[0].launch()
            self.tally["graph_replays"] += 1
        else:
            entry.forward.before()
        self.tally["static_runs"] += 1

    def static_after(self, entry: StaticEntry) -> None:
        if entry.graphs is not None:
            entry.graphs[1].launch()
            return
        entry.forward.after()
        if self.c.static == "graph":  # ran once eagerly, every kernel loaded: captured for the next runs
            entry.graphs = self.capture(entry.forward)

    def capture(self, forward) -> tuple:
        """before() and after() each in a CuPy CUDA graph, captured on a stream of their own and
        replayed on the current stream, where the engine refills the arrays and writes KV."""
        cupy = self.dev.cupy
        stream, graphs = cupy.cuda.Stream(non_blocking=True), []
        for launch in (forward.before, forward.after):
            with stream:
                stream.begin_capture()
                launch(stream=stream)
                graphs.append(stream.end_capture())
        return tuple(graphs)

    # --- sweeps and polls -------------------------------------------------------------------------
    def sweep(self, requests: list[Request]) -> None:
        if not requests:
            return
        requests = [requests[i] for i in self.rng.permutation(len(requests))]
        i64 = self.dev.i64
        self.sync_tables()
        self.canary.sweep(kc.LiveRequests(req_pool_indices=i64([r.row for r in requests]),
                                          seq_lens=i64([r.cached for r in requests]),
                                          req_ids=[r.rid for r in requests]))
        for group, window in self.groups:
            entries = sum(min(r.cached, window) if window else r.cached for r in requests)
            self.ledger.verify(group, entries, self.canary.capacities.verify_capacity)
        self.tally["sweeps"] += 1

    def poll(self) -> None:
        try:
            report = self.canary.poll()
        except kc.CanaryViolation as caught:  # mode "raise"
            report = caught.report
        self.reported_forwards = report.forwards
        per_group = collections.Counter(event.group for event in report.events)
        stored = max(per_group.values(), default=0)
        if len(report.events) + report.dropped != report.total or stored > self.c.ring_capacity:
            self.report_errors.append(f"forward {self.index}: {len(report.events)} events + {report.dropped} dropped "
                                      f"!= total {report.total}, or a group's events {dict(per_group)} past the "
                                      f"ring's {self.c.ring_capacity}")
        self.overflows_seen += report.capacity_overflows
        self.found += report.total
        if self.fault is not None and self.fault.injected_at is not None:
            self.found_after_fault += report.total
        if report.total and self.first_found is None:
            self.first_found = self.index
            self.examples = [event.describe() for event in report.events[:3]]

    def counter_errors(self) -> list[str]:
        """Where the canary's public counters disagree with the ledger (after the final poll), and the
        reports that did not add up. A fault changes no launch; a dropped write stores one entry less."""
        expected = self.ledger
        errors = list(self.report_errors)
        if self.reported_forwards != expected.forwards:
            errors.append(f"CanaryReport.forwards {self.reported_forwards} != {expected.forwards} forwards run")
        if self.canary.forwards != expected.eager_forwards:
            errors.append(f"Canary.forwards {self.canary.forwards} != {expected.eager_forwards} eager forwards")
        if self.overflows_seen != expected.overflows:
            errors.append(f"capacity_overflows {self.overflows_seen} != {expected.overflows} skipped verifies")
        for group, counters in self.canary.stats().items():
            for name, want in (("kernel_run_counter", expected.kernel_runs[group]),
                               ("slot_run_counter", expected.slot_runs[group]), ("violations", 0)):
                if counters[name] != want:
                    errors.append(f"stats()[{group!r}][{name!r}] {counters[name]} != {want}")
        return errors

    # --- moves: the host tier and compaction (integration.md §4) ---------------------------------
    def move_kv(self) -> None:
        c, rng = self.c, self.rng
        movable = [r for r in self.live() if not r.pinned and not r.frozen]
        if c.host_tier:
            for request in [r for r in self.requests if r.away and self.index - r.away_since >= 2]:
                self.reload(request)
            if movable and rng.random() < 0.15:
                self.offload(movable.pop(int(rng.integers(len(movable)))))
        if c.compaction and movable and rng.random() < 0.15:
            self.compact(movable[int(rng.integers(len(movable)))])

    def context_of(self, group: str) -> kc.CanaryContext:
        return self.canary.context if group == "full" else self.canary.swa_context

    def carry(self, group: str, views: list, slots: np.ndarray, host: np.ndarray, *, out: bool) -> None:
        """KV bytes, then their records (kc.copy_records), between pool ``slots`` and ``host`` slots."""
        if not len(slots):
            return
        tier, on_device = self.tier[group], self.dev.i64(slots)
        for view, host_view in zip(views, tier.views):
            if out:
                host_view[host] = self.dev.get(view[on_device])
            else:
                view[on_device] = self.dev.put(np.ascontiguousarray(host_view[host]))
        ends = (self.context_of(group), on_device, tier.context, host)
        src, src_slots, dst, dst_slots = ends if out else ends[2:] + ends[:2]
        kc.copy_records(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots)

    def offload(self, request: Request) -> None:
        """A preempted request: KV and records to the host tier, its slots freed; not live now."""
        slots = np.asarray(request.slots, np.int64)
        host = np.asarray([self.tier_free.popleft() for _ in slots], np.int64)
        self.carry("full", self.kv.views, slots, host, out=True)
        if self.c.swa_window:
            swa_slots = self.lut_host[slots]
            request.swa_copied = swa_slots != 0
            self.carry("swa", self.swa_kv.views, swa_slots[request.swa_copied], host[request.swa_copied], out=True)
        for slot in request.slots:
            self.release_slot(slot)
        request.slots, request.host_slots, request.away_since = [], host, self.index
        self.tally["offloads"] += 1

    def reload(self, request: Request) -> None:
        """Back into new slots (new SWA slots for the positions that had one), the table row rewritten."""
        host = request.host_slots
        slots = np.asarray([self.take_slot(kept=False, with_swa=False) for _ in host], np.int64)
        self.carry("full", self.kv.views, slots, host, out=False)
        if self.c.swa_window:
            for slot, copied in zip(slots, request.swa_copied):
                self.lut_host[slot] = self.swa_free.popleft() if copied else 0
            copied = request.swa_copied
            self.carry("swa", self.swa_kv.views, self.lut_host[slots][copied], host[copied], out=False)
        self.tier_free.extend(int(s) for s in host)
        request.slots, request.host_slots = slots.tolist(), None
        self.table_host[request.row, :len(slots)] = slots
        self.tally["reloads"] += 1

    def compact(self, request: Request) -> None:
        """Some cached tokens moved to other slots of the pool, their records with them
        (copy_records within one canary); an SWA copy stays put, only its LUT cell moves."""
        rng = self.rng
        positions = rng.choice(request.cached, size=min(request.cached, int(rng.integers(1, 5))), replace=False)
        old = np.asarray([request.slots[p] for p in positions], np.int64)
        new = np.asarray([self.take_slot(kept=False, with_swa=False) for _ in positions], np.int64)
        self.move_slots(old, new, records=True)
        for position, slot in zip(positions, new):
            request.slots[position] = int(slot)
            self.table_host[request.row, position] = slot
        for slot in old:
            self.release_slot(int(slot))
        self.tally["compactions"] += 1

    def move_kept(self, scheduled: list[Scheduled], *, records: bool) -> None:
        """Each request's kept drafts moved to other slots (to keep pages whole, integration.md §2):
        before after_forward, which then hashes them where they are, or after it, their records
        carried."""
        for s in scheduled:
            drafts = s.kept[1:]
            old = [s.nodes[i][2] for i in drafts]
            new = [self.take_slot(kept=False, with_swa=False) for _ in drafts]
            if drafts:
                self.move_slots(old, new, records=records)
            for i, slot in zip(drafts, new):
                s.nodes[i] = s.nodes[i][:2] + (slot,)
            s.moved_from += old

    def move_slots(self, old, new, *, records: bool) -> None:
        """KV bytes from pool slots ``old`` to ``new``, and their records when ``records`` (within one
        canary); an SWA copy stays where it is, only its LUT cell moves."""
        on_old, on_new = self.dev.i64(old), self.dev.i64(new)
        for view in self.kv.views:
            view[on_new] = view[on_old]
        if records:
            kc.copy_records(src=self.canary.context, dst=self.canary.context, src_slots=on_old, dst_slots=on_new)
        self.lut_host[new] = self.lut_host[old]
        self.lut_host[old] = 0

    # --- faults -----------------------------------------------------------------------------------
    def pin(self, request: Request, what: str, *, injected: bool = True) -> bool:
        request.pinned = True
        self.fault.what = what
        if injected:
            self.fault.injected_at = self.index
        return True

    def flip(self, view, row: int, byte: int, bit: int) -> None:
        values = self.dev.get(view[row]).copy()
        values[byte] ^= np.uint8(1 << bit)
        view[row] = self.dev.put(values)

    def inject_kv_flip(self, rng: np.random.Generator) -> bool:
        """A bit of a hashed byte of a live token's KV."""
        live = self.live()
        if not live:
            return False
        request = live[int(rng.integers(len(live)))]
        position, source = int(rng.integers(request.cached)), int(rng.integers(len(self.kv.views)))
        byte = int(rng.integers(self.canary.context.kv_read_lengths[source]))
        self.flip(self.kv.views[source], request.slots[position], byte, int(rng.integers(8)))
        return self.pin(request, f"request {request.rid} position {position} source {source} byte {byte}")

    def inject_swa_kv_flip(self, rng: np.random.Generator) -> bool:
        """A bit of a hashed byte of the SWA KV of a position in a live request's window; the request
        waits from then on, so that the window holds still."""
        window = self.c.swa_window
        inside = [(r, p) for r in self.live() for p in range(max(0, r.cached - window), r.cached)
                  if self.lut_host[r.slots[p]]]
        if not inside:
            return False
        request, position = inside[int(rng.integers(len(inside)))]
        source = int(rng.integers(len(self.swa_kv.views)))
        byte = int(rng.integers(self.canary.swa_context.kv_read_lengths[source]))
        self.flip(self.swa_kv.views[source], int(self.lut_host[request.slots[position]]), byte, int(rng.integers(8)))
        request.frozen = True
        return self.pin(request, f"request {request.rid} SWA position {position} source {source} byte {byte}")

    def inject_host_flip(self, rng: np.random.Generator) -> bool:
        """A bit of a hashed byte in the host tier while its request is away (offloaded now if no
        request is)."""
        away = [r for r in self.requests if r.away]
        if not away:
            movable = [r for r in self.live() if not r.pinned]
            if not movable:
                return False
            self.offload(movable[int(rng.integers(len(movable)))])
            away = [r for r in self.requests if r.away]
        request = away[int(rng.integers(len(away)))]
        position, source = int(rng.integers(request.cached)), int(rng.integers(len(self.kv.views)))
        byte = int(rng.integers(self.tier["full"].context.kv_read_lengths[source]))
        self.tier["full"].views[source][request.host_slots[position], byte] ^= np.uint8(1 << int(rng.integers(8)))
        return self.pin(request, f"request {request.rid} offloaded position {position} source {source} byte {byte}")

    def victim_position(self, rng: np.random.Generator) -> Optional[tuple[Request, int]]:
        """A live request and one of its cached positions with a cached successor, whose chain link
        reports a changed record even where the record's own fields happen to match (position 0)."""
        live = [r for r in self.live() if r.cached >= 2]
        if not live:
            return None
        request = live[int(rng.integers(len(live)))]
        return request, int(rng.integers(request.cached - 1))

    def inject_slot_steal(self, rng: np.random.Generator) -> bool:
        """The allocator hands a live slot to the next kept token (a use after free)."""
        victim = self.victim_position(rng)
        if victim is None:
            return False
        request, position = victim
        self.fault.steal = request.slots[position]
        return self.pin(request, f"request {request.rid} position {position} slot {self.fault.steal}",
                        injected=False)

    def inject_table_alias(self, rng: np.random.Generator) -> bool:
        """A req_to_token cell pointed at another live request's slot."""
        victim = self.victim_position(rng)
        others = [r for r in self.live() if victim and r is not victim[0]]
        if not others:
            return False
        request, position = victim
        other = others[int(rng.integers(len(others)))]
        target = other.slots[int(rng.integers(other.cached))]
        self.table_host[request.row, position] = target
        return self.pin(request, f"request {request.rid} position {position} -> slot {target} of {other.rid}")

    def inject_in_forward(self, scheduled: list[Scheduled], after_nodes: list) -> Optional[tuple[str, int, int]]:
        """For dropped_write and wrong_token, from forward ``at`` on: ``(field, entry, value)`` to
        change in what after_forward (or after()) gets, for one kept token."""
        fault = self.fault
        if fault is None or fault.armed or fault.kind in BETWEEN_FORWARDS or self.index < fault.at:
            return None
        candidates, entry = [], 0
        for s, nodes in zip(scheduled, after_nodes):
            kept = {s.nodes[i][2] for i in s.kept}
            for token, position, slot in nodes:
                if slot in kept and (position >= 1 or fault.kind == "wrong_token"):
                    candidates.append((entry, s.request, token, position))
                entry += 1
        if not candidates:
            return None
        entry, request, token, position = candidates[int(fault.rng.integers(len(candidates)))]
        fault.armed = self.pin(request, f"request {request.rid} position {position} entry {entry}")
        if fault.kind == "dropped_write":
            return "out_cache_loc", entry, -1  # a negative slot: the write skips the entry
        return "input_ids", entry, wrong_token(token)


# --- seeds, rows and the table -------------------------------------------------------------------
def run_seed(seed: int, dev: Device, forwards: int) -> dict:
    c = draw_config(seed, dev.name)
    fault = draw_fault(c, forwards)
    row = {"seed": seed, "config": dataclasses.asdict(c), "features": c.features() + [f"fault={fault.kind}"],
           "false_positives": 0, "counter_errors": [], "examples": [], "fault": fault.kind, "injected": False,
           "detected": False, "missed": False, "crash": None}
    started = time.perf_counter()
    try:
        clean = FuzzEngine(c, dev).run(forwards)
        row.update(false_positives=clean.found, counter_errors=clean.counter_errors(), examples=clean.examples,
                   work=dict(clean.tally, forwards=clean.ledger.forwards, overflows=clean.ledger.overflows))
    except Exception:  # noqa: BLE001 (a crash is a finding: recorded, and the next seed runs)
        row["crash"] = "clean run: " + traceback.format_exc(limit=8)
    try:
        faulty = FuzzEngine(c, dev, fault).run(forwards)
        injected = fault.injected_at is not None
        row["counter_errors"] += [f"fault run: {error}" for error in faulty.counter_errors()]
        row.update(injected=injected, detected=faulty.found_after_fault > 0, fault_at=fault.injected_at,
                   fault_where=fault.what, first_report=faulty.first_found, fault_examples=faulty.examples)
        row["missed"] = injected and not row["detected"]
    except Exception:  # noqa: BLE001
        row["crash"] = (row["crash"] or "") + "fault run: " + traceback.format_exc(limit=8)
    row["wall_s"] = round(time.perf_counter() - started, 3)
    return row


def failed(row: dict) -> bool:
    return bool(row["false_positives"] or row["counter_errors"] or row["missed"] or row["crash"])


def describe_failure(row: dict) -> str:
    what = [f"{row['false_positives']} false positive(s)"] if row["false_positives"] else []
    what += [f"counters: {'; '.join(row['counter_errors'])}"] if row["counter_errors"] else []
    what += [f"missed {row['fault']} ({row.get('fault_where')})"] if row["missed"] else []
    what += [f"crash: {row['crash'].strip().splitlines()[-1]}"] if row["crash"] else []
    lines = [f"seed {row['seed']} FAILED (alone: --start {row['seed']} --seeds 1): {', '.join(what)}",
             f"  config: {row['config']}"]
    lines += [f"  {example}" for example in row["examples"]]
    return "\n".join(lines)


TABLE_COLUMNS = ("runs", "false+", "counters", "injected", "missed", "crashes")


def table(rows: list[dict]) -> dict:
    by_feature: dict = collections.defaultdict(collections.Counter)
    for row in rows:
        for feature in row["features"]:
            counts = by_feature[feature]
            for column, value in zip(TABLE_COLUMNS, (1, row["false_positives"] > 0, bool(row["counter_errors"]),
                                                     row["injected"], row["missed"], row["crash"] is not None)):
                counts[column] += int(value)
    return dict(sorted(by_feature.items()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (CuPy): static forwards then also in CUDA graphs")
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--forwards", type=int, default=40, help="forwards a run, before its final sweeps")
    parser.add_argument("--json", help="write every seed's row and the totals here")
    args = parser.parse_args(argv)
    dev = Device(args.device)
    rows, started, shown = [], time.perf_counter(), time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        rows.append(run_seed(seed, dev, args.forwards))
        if failed(rows[-1]):
            print(describe_failure(rows[-1]), flush=True)
        if time.perf_counter() - shown > 10 or len(rows) == args.seeds:
            shown = time.perf_counter()
            print(f"[{len(rows)}/{args.seeds} seeds, {shown - started:.0f} s] "
                  f"{sum(failed(r) for r in rows)} failing", flush=True)
    by_feature = table(rows)
    print(f"{'feature':<26}" + "".join(f"{column:>10}" for column in TABLE_COLUMNS))
    for feature, counts in by_feature.items():
        print(f"{feature:<26}" + "".join(f"{counts[column]:>10}" for column in TABLE_COLUMNS))
    total = {"runs": len(rows), "false_positives": sum(r["false_positives"] > 0 for r in rows),
             "counter_errors": sum(bool(r["counter_errors"]) for r in rows),
             "injected": sum(r["injected"] for r in rows), "not_injected": sum(not r["injected"] for r in rows),
             "missed": sum(r["missed"] for r in rows), "crashes": sum(r["crash"] is not None for r in rows),
             "wall_s": round(time.perf_counter() - started, 1)}
    print(f"{total['runs']} seeds x {args.forwards} forwards on {args.device} in {total['wall_s']} s: "
          f"{total['false_positives']} with false positives, {total['counter_errors']} with counter mismatches, "
          f"{total['injected']} faults injected ({total['not_injected']} found no place), {total['missed']} missed, "
          f"{total['crashes']} crashes")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": args.device, "forwards": args.forwards, "rows": rows, "by_feature": by_feature,
                       "total": total}, handle, indent=1, default=int)
    return int(any(failed(r) for r in rows))


if __name__ == "__main__":
    sys.exit(main())
