"""A small serving engine: paged KV pool, request table, chunked prefill, decode, prefix sharing.

It keeps exactly the state a real engine keeps for its KV cache, in the same shapes: a pool of KV
slots handed out a page at a time from a free list, a ``req_to_token`` table, real K/V arrays the
"model" fills with pseudo-random bytes per token, and a prefix cache that lets requests with the same
prompt prefix reuse the slots of an earlier one (as radix caching does). Pages are reference
counted; a page returns to the free list when its last holder lets go, so slots are reused. An
optional sliding-window group keeps a second slot pool and a full-to-SWA slot map.

Host bookkeeping (``Request.pages``) is the ground truth; the tables and KV arrays are what faults
corrupt and what the canary checks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Callable, Optional

import numpy as np

from .. import _layout as L
from .. import validate as check
from .._dlpack import from_host, parse_device, require_device
from ..capacities import Capacities
from ..session import Canary, ForwardBatch, LiveRequests, SwaGroup
from .host_tier import HostTier
from .pools import kv_pool, slot_bytes, swa_pool

LAYOUTS = ("paged", "per_layer", "interleaved", "mla")
# the smallest value of each integer setting (the demo's options take the same bounds)
SMALLEST = {"steps": 1, "seed": 0, "page_size": 1, "max_running": 1, "max_len": 1, "swa_window": 0,
            "sweep_every": 0, "poll_every": 1, "host_slots": 0, "offload_steps": 1, "speculative": 0,
            "chunk_tokens": 1, "templates": 0, "template_len": 0, "layers": 1, "heads": 1, "head_dim": 1,
            "vocab": 2, "ring_capacity": 1}
_FREED = -1


def memory_limit() -> Optional[tuple[int, str]]:
    """The most memory this process may have, and what sets it: the machine's physical memory or,
    when lower, the process's address-space limit (``ulimit -v``); None where neither is known."""
    limits = []
    try:
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's {} of memory"))
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import resource  # noqa: PLC0415 (not on Windows)

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append((soft, "this process's address-space limit of {} (ulimit -v)"))
    except (ImportError, ValueError, OSError):
        pass
    if not limits:
        return None
    size, whose = min(limits)
    return size, whose.format(f"{size / 2**30:.1f} GiB")


def _refuse_past_memory(memory: Optional[tuple[int, str]], name: str, unit_bytes: int, units: int, got: int,
                        what: str, granule: int = 1) -> None:
    """Refuse ``units`` of ``unit_bytes`` each (``what`` they are, its parenthesis left open for the
    total) past ``memory`` (:func:`memory_limit`), naming the setting ``name``, the largest value
    that fits (a multiple of ``granule``) and the value ``got``."""
    needed = units * unit_bytes
    if memory is not None and needed > memory[0]:
        bound = memory[0] // (unit_bytes * granule) * granule
        raise ValueError(f"kv-canary: {name} must be <= {bound}, as {what}: {needed / 2**30:.1f} GiB) must fit in "
                         f"{memory[1]}, got {got}")


@dataclasses.dataclass
class SimConfig:
    """Engine shape and workload of one simulation."""

    steps: int = 300
    seed: int = 0
    device: str = "cpu"
    hash_mode: L.HashMode = L.HashMode.PARTIAL
    layout: str = "paged"
    pool_slots: int = 8192
    page_size: int = 16
    max_running: int = 16
    max_len: int = 512
    prompt_len: tuple[int, int] = (16, 200)
    output_len: tuple[int, int] = (16, 120)
    chunk_tokens: int = 256
    arrivals_per_step: float = 1.0
    templates: int = 4
    template_len: int = 64
    share_prob: float = 0.6
    evict_prob: float = 0.05
    layers: int = 2
    heads: int = 2
    head_dim: int = 32
    swa_window: int = 0
    sweep_every: int = 16
    poll_every: int = 1
    expected_checks: bool = True
    split_batches: bool = False  # prefill and decode forwards take turns instead of sharing a forward
    static_decode: bool = False  # decode forwards through static forwards (implies split_batches)
    chain_position_assert: bool = True
    ring_capacity: int = 1024
    host_slots: int = 2048  # slots of the host-memory KV tier (0: no tier)
    offload_prob: float = 0.05  # chance a step offloads a running request to the host tier
    offload_steps: int = 3  # steps an offloaded request waits before it is loaded back
    speculative: int = 0  # drafts (a chain) a decoding request's forward verifies; 0: no speculative decoding
    draft_miss: float = 0.3  # chance that a draft is not the target's token (the drafts after it are rejected)
    vocab: int = 32000

    def __post_init__(self) -> None:
        """Refuse a shape in which the simulation could not run a request (its report would be a
        clean pass of nothing), with the package's messages."""
        for name, minimum in SMALLEST.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"kv-canary: {name} must be an integer >= {minimum}, got {value!r}")
        if self.static_decode and self.poll_every != 1:
            # a static forward's rows are named from its arrays as they are at the poll: a later
            # forward of the same batch size has refilled them by then
            raise ValueError(f"kv-canary: static_decode needs poll_every == 1, got {self.poll_every!r}")
        # one request of max_len tokens must fit in the pages beside the padding slot's
        smallest_pool = (-(-self.max_len // self.page_size) + 1) * self.page_size
        if self.pool_slots < smallest_pool:
            raise ValueError(f"kv-canary: pool_slots must be >= {smallest_pool} (a request of up to "
                             f"{self.max_len} tokens in pages of {self.page_size}, beside the padding page), "
                             f"got {self.pool_slots!r}")
        if 0 < self.host_slots <= self.max_len:
            # the tier must take a whole request beside its unused slot 0
            raise ValueError(f"kv-canary: host_slots must be 0 (no host tier) or more than a request's up to "
                             f"{self.max_len} tokens, "
                             f"got {self.host_slots!r}")
        for name in ("offload_prob", "draft_miss", "share_prob", "evict_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"kv-canary: {name} must be within [0, 1], got {getattr(self, name)!r}")
        if not self.arrivals_per_step >= 0.0:
            raise ValueError(f"kv-canary: arrivals_per_step must be >= 0, got {self.arrivals_per_step!r}")
        for name in ("prompt_len", "output_len"):
            low_high = getattr(self, name)
            if (not isinstance(low_high, (tuple, list)) or len(low_high) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in low_high)
                    or not 1 <= low_high[0] <= low_high[1]):
                raise ValueError(f"kv-canary: {name} must be a pair (low, high) of integers with 1 <= low <= high, "
                                 f"got {low_high!r}")
        if self.templates and self.share_prob and self.max_len < self.template_len + 2:
            # a prompt holds its template and a token of its own, and decodes at least one more
            raise ValueError(f"kv-canary: max_len must be >= template_len + 2 = {self.template_len + 2} where "
                             f"requests share templates, got {self.max_len!r} (templates=0 shares none)")
        if self.speculative and self.static_decode:
            # a static forward binds one token a request; verify forwards take 1 + speculative
            raise ValueError("kv-canary: speculative and static_decode are not run together, got "
                             f"speculative={self.speculative!r} with static_decode")

    @property
    def pool_slot_count(self) -> int:
        """The slots the engine's pool has: ``pool_slots`` rounded down to whole pages."""
        return max(2, self.pool_slots // self.page_size) * self.page_size

    @property
    def splits_batches(self) -> bool:
        """Whether prefill and decode forwards take turns: asked, or implied by static_decode."""
        return self.split_batches or self.static_decode


@dataclasses.dataclass
class Request:
    rid: int
    tokens: np.ndarray
    prompt_len: int
    row: int
    arrived: int
    template: int = -1
    seq_len: int = 0
    pages: list = dataclasses.field(default_factory=list)
    own_pages_needed: int = 0
    own_taken: int = 0

    @property
    def total(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def remaining(self) -> int:
        return self.total - self.seq_len

    @property
    def decoding(self) -> bool:
        return self.seq_len >= self.prompt_len


@dataclasses.dataclass
class Offloaded:
    """A request waiting in the host tier: the host slots of its cached positions, in order."""

    request: Request
    host_slots: np.ndarray
    since: int


@dataclasses.dataclass
class StepBatch:
    """One step's batch on the host, before it is handed to the device."""

    requests: list
    rows: np.ndarray
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    expected_ids: np.ndarray
    expected_positions: np.ndarray
    kept_lens: Optional[np.ndarray] = None  # the tokens each request keeps (None: every one it writes)

    @property
    def kept_counts(self) -> np.ndarray:
        """The tokens each request keeps: every one it writes, or its pending token and the drafts
        the target accepted."""
        return self.extend_lens if self.kept_lens is None else self.kept_lens

    @property
    def keeps_all(self) -> bool:
        return bool((self.kept_counts == self.extend_lens).all())

    def kept(self) -> "StepBatch":
        """The batch of the tokens the requests keep: each request's first ``kept_counts`` entries."""
        if self.keeps_all:
            return self
        entries = np.concatenate([np.arange(*self.entry_range(i))[:int(self.kept_counts[i])]
                                  for i in range(len(self.requests))]).astype(np.int64)
        return StepBatch(self.requests, self.rows, self.prefix_lens, self.kept_counts.copy(), self.input_ids[entries],
                         self.positions[entries], self.out_cache_loc[entries], self.expected_ids[entries],
                         self.expected_positions[entries])

    @property
    def decodes_only(self) -> bool:
        """Every request past its prompt: one new token each, or its pending token and its drafts."""
        return bool(self.requests) and all(r.decoding for r in self.requests)

    def entry_range(self, index: int) -> tuple[int, int]:
        start = int(self.extend_lens[:index].sum())
        return start, start + int(self.extend_lens[index])


class Engine:
    """The simulated engine and its canary session."""

    def __init__(self, config: SimConfig, *, canary_mode: str = "log", logger: Optional[logging.Logger] = None):
        check.choice("layout", config.layout, LAYOUTS)
        self.config = c = config
        self.device = parse_device(c.device)
        require_device(self.device)  # a device that is not there: one line, not CuPy's error from deep inside
        self.rng = np.random.default_rng(c.seed)
        self.kv_rng = np.random.default_rng(c.seed + 1)
        self.draft_rng = np.random.default_rng(c.seed + 3)
        self.drafts_verified = self.drafts_accepted = 0
        self.page_size = ps = c.page_size
        self.num_slots = c.pool_slot_count
        self.num_pages = self.num_slots // ps
        rows = c.max_running + 1
        # a forward's writes: a prefill chunk beside every row's decode, its drafts included; built
        # first, so that a pool or batch too large for the canary's int32 capacities is refused
        # before anything of its size is allocated
        caps = Capacities.from_args(req_to_token_pool_size=rows, max_seq_len_per_req=c.max_len,
                                    pool_slot_count=self.num_slots,
                                    max_prefill_tokens=c.chunk_tokens + rows * (1 + c.speculative),
                                    speculative_num_draft_tokens=c.speculative + 1 if c.speculative else 0)
        # the request tables, req_to_token and the expected tokens: refused at once when they cannot fit
        # in the memory this process may have, rather than after seconds (and gigabytes) spent on the
        # free-row list before their allocation fails
        row_bytes = 2 * c.max_len * np.dtype(np.int32).itemsize
        memory = memory_limit()
        _refuse_past_memory(memory, "req_to_token_pool_size", row_bytes, rows, rows,
                            f"the request tables (req_to_token and the expected tokens, {c.max_len} int32 a row each")
        # the pool and the host tier alike: the bytes of their KV and canary records, refused before anything
        # of their size is allocated (the pool's free-page list, filled first, alone takes seconds for a
        # pool of hundreds of millions of slots)
        with_swa = c.swa_window > 0
        pool_slot_bytes = slot_bytes(c, with_swa=with_swa)
        # only where the pool is host memory: on a GPU it lives in device memory, whose size is not checked here
        if not self.device.is_cuda:
            _refuse_past_memory(memory, "pool_slot_count", pool_slot_bytes, self.num_slots, self.num_slots,
                                f"the KV pool and its canary records ({pool_slot_bytes} bytes a slot")
        host_slot_count = -(-c.host_slots // ps) * ps  # the tier's: whole pages, rounded up
        # the tier is host memory whatever the device; the bound is whole pages, so a host_slots within it
        # stays within it once rounded up
        _refuse_past_memory(memory, "host_slots", pool_slot_bytes, host_slot_count, c.host_slots,
                            f"the host tier's KV and canary records ({pool_slot_bytes} bytes a slot, in whole pages "
                            f"of {ps}", granule=ps)
        # the tables before the lists: near that bound, the allocation that fails is NumPy's, which
        # raises MemoryError (a deque that cannot grow raises SystemError)
        self.table_host = np.zeros((rows, c.max_len), np.int32)
        self.expected_host = np.zeros((rows, c.max_len), np.int32)
        self.free_pages = collections.deque(range(1, self.num_pages))  # page 0 holds the padding slot
        self.page_ref = np.zeros(self.num_pages, np.int64)
        self.reserved_pages = 0
        self.free_rows = collections.deque(range(1, rows))
        self.table = self._mirror(self.table_host)
        self.expected = self._mirror(self.expected_host)
        self.running: list[Request] = []
        self.finished = 0
        self.aborted = 0
        self.next_rid = 0
        self.step_index = 0
        self.last_forward_decoded = False
        self.tokens_written = 0
        self.shared_tokens = 0
        self.reused_pages = 0
        self.ever_used = np.zeros(self.num_pages, np.bool_)
        # pages freed while a request still reads them: called when the page is handed out again
        self.on_retake: dict[int, Callable[[], None]] = {}
        self.template_tokens = [self.rng.integers(1, c.vocab, c.template_len) for _ in range(c.templates)]
        self.prefix_cache: dict[int, list[int]] = {}
        self._build_kv()
        swa = None
        if c.swa_window > 0:
            self.swa_free = collections.deque(range(1, self.num_slots))
            self.lut_host = np.zeros(self.num_slots + 1, np.int64)
            self.lut = self._mirror(self.lut_host)
            swa_kv = swa_pool(c, self.device, self.num_slots)
            self.swa_targets = swa_kv.targets
            swa = SwaGroup(window=c.swa_window, lut=self.lut, num_slots=self.num_slots,
                           real_kv_sources=swa_kv.sources)
        self.canary = Canary(pool_slot_count=self.num_slots, capacities=caps, req_to_token=self.table,
                             device=self.device, real_kv_sources=self.sources, hash_mode=c.hash_mode,
                             ring_capacity=c.ring_capacity, mode=canary_mode, swa=swa,
                             expected_tokens=self.expected if c.expected_checks else None,
                             chain_position_assert=c.chain_position_assert, logger=logger)
        self.offloaded: dict[int, Offloaded] = {}
        self.host_prefixes: dict[int, np.ndarray] = {}  # template -> host slots of its shared prefix
        self.tier_rng = np.random.default_rng(c.seed + 2)
        self.tier = None
        if c.host_slots:
            self.tier = HostTier(c, host_slot_count, with_swa=with_swa)

    # --- memory -----------------------------------------------------------------------------------
    def _mirror(self, host: np.ndarray):
        return host if not self.device.is_cuda else from_host(host.copy(), self.device)

    def _push_tables(self) -> None:
        if not self.device.is_cuda:
            return
        self.table[...] = from_host(self.table_host, self.device)
        self.expected[...] = from_host(self.expected_host, self.device)
        if self.config.swa_window > 0:
            self.lut[...] = from_host(self.lut_host, self.device)

    def _build_kv(self) -> None:
        pool = kv_pool(self.config, self.device, self.num_slots)
        self.sources, self.kv_buffers = pool.sources, pool.buffers
        self.targets, self.target_source_bytes = pool.targets, pool.target_source_bytes

    def _take_page(self) -> int:
        page = self.free_pages.popleft()
        self.page_ref[page] = 1
        if self.ever_used[page]:
            self.reused_pages += 1
        self.ever_used[page] = True
        hook = self.on_retake.pop(page, None)
        if hook is not None:
            hook()
        if self.config.swa_window > 0:
            base = page * self.page_size
            for s in range(base, base + self.page_size):
                self.lut_host[s] = self.swa_free.popleft()
        return page

    def _take_pages_for(self, request: Request, positions: int) -> None:
        """Pages for ``request`` until they hold ``positions`` positions, out of its reservation."""
        while len(request.pages) * self.page_size < positions:
            request.pages.append(self._take_page())
            request.own_taken += 1
            self.reserved_pages -= 1

    def release_page(self, page: int, *, front: bool = False) -> None:
        """Drop one reference; the page goes back to the free list when none is left."""
        if page == _FREED:
            return
        self.page_ref[page] -= 1
        if self.page_ref[page] > 0:
            return
        self.page_ref[page] = 0
        if self.config.swa_window > 0:
            base = page * self.page_size
            self.swa_free.extend(int(v) for v in self.lut_host[base:base + self.page_size])
        (self.free_pages.appendleft if front else self.free_pages.append)(page)

    def slot_of(self, request: Request, position: int) -> int:
        page = request.pages[position // self.page_size]
        return page * self.page_size + position % self.page_size

    def exclusive_positions(self, request: Request, *, full_pages_only: bool = False) -> list[int]:
        """Cached positions whose page only ``request`` holds (the last, partly filled page excluded
        with ``full_pages_only``)."""
        out = []
        ps = self.page_size
        for k, page in enumerate(request.pages):
            if page == _FREED or self.page_ref[page] != 1:
                continue
            lo, hi = k * ps, min((k + 1) * ps, request.seq_len)
            if full_pages_only and (hi - lo < ps or k == len(request.pages) - 1):
                continue
            out.extend(range(lo, hi))
        return out

    # --- requests ---------------------------------------------------------------------------------
    def _new_request(self) -> Request:
        c, rng = self.config, self.rng
        template = int(rng.integers(c.templates)) if c.templates and rng.random() < c.share_prob else -1
        lo, hi = c.prompt_len
        prompt_len = int(rng.integers(lo, hi + 1))
        if template >= 0:
            prompt_len = max(prompt_len, c.template_len + 1)
        output_len = int(rng.integers(c.output_len[0], c.output_len[1] + 1))
        total = min(prompt_len + output_len, c.max_len)
        prompt_len = min(prompt_len, total - 1)
        tokens = rng.integers(1, c.vocab, total)
        if template >= 0:
            tokens[:c.template_len] = self.template_tokens[template]
        request = Request(self.next_rid, tokens, prompt_len, row=0, arrived=self.step_index, template=template)
        self.next_rid += 1
        return request

    def _admit(self, request: Request) -> bool:
        ps = self.page_size
        template = request.template
        shared = self.prefix_cache.get(template, []) if template >= 0 else []
        # a prefix stored in the host tier comes back into pages of its own, held by the prefix cache
        stored_pages = len(self.host_prefixes[template]) // ps if not shared and template in self.host_prefixes else 0
        need = -(-request.total // ps) - len(shared) - stored_pages
        if not self.free_rows or len(self.free_pages) - self.reserved_pages < need + stored_pages:
            return False
        if stored_pages:
            shared = self._load_prefix(template)
        request.row = self.free_rows.popleft()
        request.own_pages_needed = need
        self.reserved_pages += need
        for page in shared:
            self.page_ref[page] += 1
        request.pages = list(shared)
        request.seq_len = len(shared) * ps
        self.shared_tokens += request.seq_len
        self.table_host[request.row, :request.seq_len] = [self.slot_of(request, p) for p in range(request.seq_len)]
        self.expected_host[request.row, :] = 0
        self.expected_host[request.row, :request.total] = request.tokens
        self.running.append(request)
        return True

    def _release(self, request: Request) -> None:
        """Give back a request's reservation, pages and table row, and take it off the running list
        (an offloaded request holds no pages and is not on it)."""
        self.reserved_pages -= request.own_pages_needed - request.own_taken
        for page in request.pages:
            self.release_page(page)
        request.pages = []
        self.free_rows.append(request.row)
        if any(r is request for r in self.running):
            self.running.remove(request)

    def abort(self, rid: int) -> bool:
        """Drop a request (as an engine does when its KV is found corrupt), and the cached prefixes
        that hold any of its pages: one it published in the forward that found it corrupt may
        carry the corruption to the next request that shares it."""
        for request in self.running:
            if request.rid == rid:
                held = set(request.pages)
                for template in [t for t, pages in self.prefix_cache.items() if held.intersection(pages)]:
                    for page in self.prefix_cache.pop(template):
                        self.release_page(page)
                self._release(request)
                self.aborted += 1
                return True
        entry = self.offloaded.pop(rid, None)
        if entry is None:
            return False
        self.tier.give_back(entry.host_slots)
        self._release(entry.request)
        self.aborted += 1
        return True

    # --- the host tier ----------------------------------------------------------------------------
    def can_offload(self, request: Request) -> bool:
        """Whether ``request`` can move to the host tier now: it holds every page it uses, the tier
        has room for its cached tokens, and the pool can keep room for its return (pages it shares
        stay with their other holders, so they are reserved anew)."""
        if self.tier is None or request.seq_len == 0 or _FREED in request.pages:
            return False
        shared = sum(int(self.page_ref[page] > 1) for page in request.pages)
        return len(self.tier.free) >= request.seq_len and len(self.free_pages) - self.reserved_pages >= shared

    def offload(self, request: Request) -> np.ndarray:
        """Move ``request``'s cached KV and its slots' records to the host tier and let go of its
        pages, keeping enough reserved for its return. Returns the host slot of each cached position."""
        slots = self._cached_slots(request)
        host_slots = self.tier.take(slots.size)
        self._tier_copy(self.tier.store, slots, host_slots)
        pages_needed = -(-request.total // self.page_size)
        self.reserved_pages += pages_needed - (request.own_pages_needed - request.own_taken)
        request.own_pages_needed, request.own_taken = pages_needed, 0
        for page in request.pages:
            self.release_page(page)
        request.pages = []
        self.running.remove(request)
        self.offloaded[request.rid] = Offloaded(request, host_slots, self.step_index)
        self.tier.offloads += 1
        return host_slots

    def reload(self, entry: Offloaded) -> None:
        """Load an offloaded request back: new pages for its cached positions, its KV and records
        copied into them from the host tier, its table row pointed at them."""
        request = entry.request
        self._take_pages_for(request, request.seq_len)
        slots = self._cached_slots(request)
        self._tier_copy(self.tier.load, slots, entry.host_slots)
        self.tier.give_back(entry.host_slots)
        self.table_host[request.row, :request.seq_len] = slots
        del self.offloaded[request.rid]
        self.running.append(request)
        self.tier.reloads += 1

    def _store_prefix(self, template: int, pages: list) -> None:
        """Keep an evicted prefix in the host tier (when it has room), as a hierarchical prefix cache
        does, so that a later request with the same prefix loads it instead of computing it again."""
        if self.tier is None or len(self.tier.free) < len(pages) * self.page_size:
            return
        slots = self._page_slots(pages)
        host_slots = self.tier.take(slots.size)
        self._tier_copy(self.tier.store, slots, host_slots)
        self.host_prefixes[template] = host_slots
        self.tier.prefix_stores += 1

    def _load_prefix(self, template: int) -> list:
        """Load a prefix stored in the host tier back into new pages, held by the prefix cache."""
        host_slots = self.host_prefixes.pop(template)
        pages = [self._take_page() for _ in range(host_slots.size // self.page_size)]
        slots = self._page_slots(pages)
        self._tier_copy(self.tier.load, slots, host_slots)
        self.tier.give_back(host_slots)
        self.prefix_cache[template] = pages
        self.tier.prefix_loads += 1
        return pages

    def _cached_slots(self, request: Request) -> np.ndarray:
        return np.asarray([self.slot_of(request, p) for p in range(request.seq_len)], np.int64)

    def _page_slots(self, pages: list) -> np.ndarray:
        return (np.asarray(pages, np.int64)[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)

    def _tier_copy(self, action, slots: np.ndarray, host_slots: np.ndarray) -> None:
        action("full", device=self.device, targets=self.targets, context=self.canary.context, slots=slots,
               host_slots=host_slots, copy_records=self.canary.copy_records)
        if self.config.swa_window > 0:
            action("swa", device=self.device, targets=self.swa_targets, context=self.canary.swa_context,
                   slots=self.lut_host[slots], host_slots=host_slots, copy_records=self.canary.copy_records)

    def tier_turn(self, protected=frozenset()) -> None:
        """Load back the requests whose wait is over, then, with probability ``offload_prob``, offload
        one running request (none whose id ``protected`` holds)."""
        if self.tier is None:
            return
        c = self.config
        for entry in [e for e in self.offloaded.values() if self.step_index - e.since >= c.offload_steps]:
            self.reload(entry)
        if self.tier_rng.random() < c.offload_prob:
            candidates = [r for r in self.running if r.rid not in protected and r.remaining > 0 and self.can_offload(r)]
            if candidates:
                self.offload(candidates[int(self.tier_rng.integers(len(candidates)))])

    def admit_arrivals(self) -> None:
        c = self.config
        arrivals = int(self.rng.poisson(c.arrivals_per_step))
        if len(self.running) < 2:
            arrivals = max(arrivals, 2)
        for _ in range(arrivals):
            if len(self.running) + len(self.offloaded) >= c.max_running:
                break
            if not self._admit(self._new_request()):
                break
        # as a radix cache does, only a prefix no running request holds is evicted
        unheld = [t for t, pages in self.prefix_cache.items() if all(self.page_ref[p] == 1 for p in pages)]
        if unheld and self.rng.random() < c.evict_prob:
            template = unheld[int(self.rng.integers(len(unheld)))]
            pages = self.prefix_cache.pop(template)
            self._store_prefix(template, pages)
            for page in pages:
                self.release_page(page)

    # --- one forward ------------------------------------------------------------------------------
    def _decodes_now(self) -> Optional[bool]:
        """With split batches: whether this forward decodes (True) or prefills (False). Prefill and
        decode take turns while both have work, as in engines that do not mix them in one forward.
        ``None``: one forward holds both."""
        if not self.config.splits_batches:
            return None
        waiting = [r for r in self.running if r.remaining > 0]
        decodes = any(r.decoding for r in waiting)
        prefills = any(not r.decoding for r in waiting)
        return decodes and not (prefills and self.last_forward_decoded)

    def schedule(self) -> StepBatch:
        """Pick this step's tokens (every decode, prefill chunks within the budget) and give them slots."""
        c, ps = self.config, self.page_size
        budget = c.chunk_tokens
        chosen, rows, prefix, extend, kept = [], [], [], [], []
        ids, positions, locs = [], [], []
        decodes_now = self._decodes_now()
        for request in self.running:
            if request.remaining <= 0:
                continue
            if decodes_now is not None and request.decoding != decodes_now:
                continue
            if request.decoding:
                n = min(1 + c.speculative, request.remaining)  # its pending token and its drafts
            else:
                n = min(request.prompt_len - request.seq_len, budget)
                if n <= 0:
                    continue
                budget -= n
            start = request.seq_len
            self._take_pages_for(request, start + n)
            pos = np.arange(start, start + n, dtype=np.int64)
            pages = np.asarray(request.pages, np.int64)[pos // ps]
            slots = pages * ps + pos % ps
            self.table_host[request.row, start:start + n] = slots
            tokens, keeps = self._draft(request.tokens[start:start + n]) if request.decoding else (
                request.tokens[start:start + n], n)
            chosen.append(request)
            rows.append(request.row)
            prefix.append(start)
            extend.append(n)
            kept.append(keeps)
            ids.append(tokens)
            positions.append(pos)
            locs.append(slots)
        if decodes_now is not None:
            self.last_forward_decoded = decodes_now
        cat = (lambda parts: np.concatenate(parts).astype(np.int64)) if chosen else (
            lambda parts: np.zeros(0, np.int64))
        input_ids = cat(ids)
        pos = cat(positions)
        return StepBatch(chosen, np.asarray(rows, np.int64), np.asarray(prefix, np.int64),
                         np.asarray(extend, np.int64), input_ids, pos, cat(locs), input_ids.copy(), pos.copy(),
                         np.asarray(kept, np.int64))

    def _draft(self, truth: np.ndarray) -> tuple[np.ndarray, int]:
        """A decoding request's tokens for a verify forward, its pending token first and then its
        drafts, each one missing the target's token with chance ``draft_miss``; and how many of
        them it keeps: the pending token and the drafts before the first miss."""
        tokens = truth.copy()
        drafts = len(tokens) - 1
        if drafts == 0:
            return tokens, 1
        missed = np.flatnonzero(self.draft_rng.random(drafts) < self.config.draft_miss)
        tokens[1 + missed] = tokens[1 + missed] % (self.config.vocab - 1) + 1
        accepted = int(missed[0]) if missed.size else drafts
        self.drafts_verified += drafts
        self.drafts_accepted += accepted
        return tokens, 1 + accepted

    def forward_batch(self, step: StepBatch) -> ForwardBatch:
        dev = self.device
        put = (lambda a: from_host(np.ascontiguousarray(a), dev))
        checks = self.config.expected_checks
        return ForwardBatch(req_pool_indices=put(step.rows), prefix_lens=put(step.prefix_lens),
                            extend_seq_lens=put(step.extend_lens), input_ids=put(step.input_ids),
                            positions=put(step.positions), out_cache_loc=put(step.out_cache_loc),
                            req_ids=[r.rid for r in step.requests],
                            expected_input_tokens=put(step.expected_ids) if checks else None,
                            expected_input_positions=put(step.expected_positions) if checks else None)

    def model_forward(self, batch: ForwardBatch, step: StepBatch) -> None:
        """The "model": write pseudo-random KV bytes for every new token into the real KV arrays."""
        n = int(step.out_cache_loc.shape[0])
        if n == 0:
            return
        self._fill_kv(self.targets, batch.out_cache_loc[:n], n)  # past n: a padded batch's padding tokens
        if self.config.swa_window > 0:
            self._fill_kv(self.swa_targets, from_host(self.lut_host[step.out_cache_loc], self.device), n)

    def _fill_kv(self, targets: list, locations, n: int) -> None:
        """``n`` rows of pseudo-random bytes into the rows ``locations`` of each of ``targets``."""
        for target in targets:
            data = np.frombuffer(self.kv_rng.bytes(n * int(target.shape[1])), np.uint8).reshape(n, -1)
            target[locations] = from_host(data, self.device)

    def advance(self, step: StepBatch) -> None:
        """Account the step's tokens, publish finished prompt prefixes, retire finished requests."""
        c = self.config
        share_len = (c.template_len // self.page_size) * self.page_size
        for request, n in zip(step.requests, step.kept_counts.tolist()):
            request.seq_len += n
            self.tokens_written += n
            if (request.template >= 0 and share_len and request.template not in self.prefix_cache
                    and request.seq_len >= share_len):
                pages = request.pages[:share_len // self.page_size]
                if _FREED not in pages:
                    for page in pages:
                        self.page_ref[page] += 1
                    self.prefix_cache[request.template] = list(pages)
                    if request.template in self.host_prefixes:  # the host tier's copy is superseded
                        self.tier.give_back(self.host_prefixes.pop(request.template))
        for request in [r for r in self.running if r.remaining <= 0]:
            self._release(request)
            self.finished += 1

    def live_requests(self) -> LiveRequests:
        live = [r for r in self.running if r.seq_len > 0]
        put = (lambda a: from_host(np.asarray(a, np.int64), self.device))
        return LiveRequests(req_pool_indices=put([r.row for r in live]), seq_lens=put([r.seq_len for r in live]),
                            req_ids=[r.rid for r in live])
