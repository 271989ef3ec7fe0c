"""A fuzz of ``kc.Canary`` through its public API: a random but correct engine must report nothing,
and the same engine with one corruption injected must be reported, naming the request it harms.

    PYTHONPATH=. python tools/canary_fuzz.py --device cpu --seeds 200 --forwards 40 --json fuzz.json

Each seed draws an engine (the real-KV layout or none, hash mode, an SWA group, expected tokens,
speculative chains or trees, static forwards, CUDA graphs on a GPU (half of them, once captured,
kept by the engine as graphs alone), a host tier, compaction, a verify capacity small enough to
overflow, poll and sweep periods, prefix sharing between requests and from a cache of finished
requests' prefixes, evicted prefixes kept in the host tier and loaded back for a later sharer, a
finished request's tokens sent again where no prefix is shared, into the slots it left (the records
they held written again as they were), an EAGLE draft model with a canary of its own, eager or
through static forwards, the canary off throughout, or switched off for a few forwards and on again
once every request live while it was off has finished (no admissions meanwhile, the prefixes kept
from those requests dropped, its graphs captured anew; a fault comes after), a launch log of a few
forwards (``max_logged_forwards``) that polls every few forwards pass, and on a GPU torch tensors as
batch and static forwards' arrays and a stream of the canary's own, for its record copies too) and a
workload of chunked prefills, decodes, finishing requests and reused slots and rows, and runs it
twice. In the clean run any violation is a false positive, and the counters the canary exposes
(forwards, skipped verify launches, each group's kernel and slot run counters) must equal what the
engine asked of it while it was on; with ``mode="off"`` throughout they must all read zero and no
record may be written. In the second run (none for mode "off") one corruption the configuration is
documented to catch is injected (a KV byte flipped on the device, in the host tier, in a cached
prefix no request holds, on the device or in the host tier, or in the draft model's KV, a live slot
written by another request, a ``req_to_token`` cell pointed at another request's slot, a dropped
write, a wrong token id, a draft model's KV written for the wrong token), now and then on a slot
that several requests share, and must be reported, and the reports must name the request it harms
and the position it harms (:meth:`FuzzEngine.misnamed`). An exception in either run is a crash. A
row of ``--json`` is one seed: its configuration, the clean run's findings and counter mismatches,
the fault and whether it was reported and named; the table sums the rows by feature. With
``--brief-rows`` a seed that ran clean keeps only its outcome and its work (``BRIEF_FIELDS``): the
configuration is the seed's, and ``--start SEED --seeds 1`` draws it again; a failing seed's row
stays whole. A ``--json`` path that ends in ``.xz`` is written compressed. The exit status is 1 when
any seed had a false positive, a counter mismatch, a missed or misnamed fault or a crash.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import lzma
import logging
import pathlib
import sys
import time
import traceback
import weakref
from typing import Any, Optional

import numpy as np

import kvcanary_cupy as kc

LAYOUTS = ("paged", "per_layer", "interleaved", "mla", "none")
SPECULATIVE = ("off", "chain_all", "chain_kept", "tree")  # chain_all: after_forward gets every draft
FAULTS = ("kv_flip", "swa_kv_flip", "host_flip", "draft_kv_flip", "slot_steal", "table_alias", "prefix_flip",
          "dropped_write", "wrong_token", "draft_token")
BETWEEN_FORWARDS = FAULTS[:7]  # the others change what one forward hands after_forward
ON_A_SLOT = ("kv_flip", "swa_kv_flip", "draft_kv_flip", "slot_steal")  # these may be aimed at a shared slot
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
    mode: str  # "log", "raise" or "off"
    prefix_sharing: bool  # a new request may start with the cached slots of a prefix of another's tokens
    prefix_cache: int  # finished requests' prefixes kept cached (a reference on each slot), at most
    draft_model: bool  # an EAGLE draft model: a KV pool and a canary (token_offset=1) of its own
    torch_arrays: bool  # GPU only: batch arrays are torch CUDA tensors
    side_stream: bool  # GPU only: the canary's calls run on a CuPy stream of their own (stream=)
    prefix_tier: bool  # a prefix the cache evicts, held by no request, may be kept in the host tier
    static_torch: bool  # GPU only: static forwards' arrays are torch CUDA tensors, refilled with torch ops
    draft_static: bool  # the draft model's canary runs through static forwards (graphs too with static "graph")
    records_on_side: bool  # kc.copy_records runs on the canary's side stream too (stream=)
    pause_at: int = 0  # the forward at which the engine switches its canaries off (0: never)
    pause_len: int = 0  # forwards run while off (requests admitted too) before the engine drains
    max_logged: int = 1024  # the canaries' max_logged_forwards: a few, so that polls every few forwards pass it
    graphs_only: bool = False  # GPU: once captured, the engine keeps a static forward's graphs, not the forward
    records_told: bool = False  # records copied into a canary's pool through Canary.copy_records, not kc.copy_records
    padded_pairs: bool = False  # record copies padded with pairs that store nothing (a slot -1 or past the end)
    # with no prefix sharing, a new request may send a finished request's tokens again, prefilled
    # anew into that request's slots where they came free (an allocator that hands freed slots out
    # again first, in order): records alike to those the slots held, only the KV bytes new
    repeated_prompts: bool = False

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
                f"mode={self.mode}", f"prefix_sharing={on[self.prefix_sharing]}",
                f"prefix_cache={on[self.prefix_cache > 0]}", f"draft_model={on[self.draft_model]}",
                f"arrays={'torch' if self.torch_arrays else 'native'}",
                f"stream={'side' if self.side_stream else 'current'}", f"prefix_tier={on[self.prefix_tier]}",
                f"static_arrays={'torch' if self.static_torch else 'native'}",
                f"draft_static={on[self.draft_static]}",
                f"copy_stream={'side' if self.records_on_side else 'current'}",
                f"pause={on[self.pause_at > 0]}", f"log_cap={'few' if self.max_logged < 1024 else 'default'}",
                f"graphs_only={on[self.graphs_only]}",
                f"records_in={'told' if self.records_told else 'kc' if self.host_tier or self.compaction else 'n/a'}",
                f"padded_pairs={on[self.padded_pairs]}", f"repeated_prompts={on[self.repeated_prompts]}"]


def draw_config(seed: int, device: str, torch_ok: bool = False) -> SeedConfig:
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
    config = SeedConfig(
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
        mode=pick(("log", "raise")), prefix_sharing=False, prefix_cache=0, draft_model=False,
        torch_arrays=False, side_stream=False, prefix_tier=False, static_torch=False, draft_static=False,
        records_on_side=False)
    more = np.random.default_rng([seed, 5])  # the later features: a seed's other draws stay as they were
    sharing, cache, draft = bool(more.random() < 0.5), int(more.integers(0, 4)), bool(more.random() < 0.3)
    off, torch_arrays, side_stream = (bool(more.random() < p) for p in (0.08, 0.5, 0.5))
    on_gpu = device != "cpu"
    config = dataclasses.replace(
        config, prefix_sharing=sharing, prefix_cache=cache if sharing else 0, draft_model=draft,
        mode="off" if off else config.mode,
        # a graph captured with the canary off would hold no node at all: its capture is left out
        static="eager" if off and config.static == "graph" else config.static,
        torch_arrays=torch_arrays and on_gpu and torch_ok, side_stream=side_stream and on_gpu)
    newer = np.random.default_rng([seed, 6])  # the features after those: every draw above stays as it was
    prefix_tier, static_torch, draft_static, records_on_side = (bool(newer.random() < 0.5) for _ in range(4))
    static = config.static != "off"
    config = dataclasses.replace(
        config, prefix_tier=prefix_tier and config.prefix_cache > 0,
        static_torch=static_torch and static and on_gpu and torch_ok,
        draft_static=draft_static and static and config.draft_model,
        records_on_side=records_on_side and config.side_stream)
    latest = np.random.default_rng([seed, 7])  # switched off and on again: every draw above stays as it was
    pauses, pause_at, pause_len = latest.random() < 0.15, int(latest.integers(2, 13)), int(latest.integers(1, 5))
    if pauses and config.mode != "off":
        config = dataclasses.replace(config, pause_at=pause_at, pause_len=pause_len)
    capped = np.random.default_rng([seed, 8])  # a log of a few forwards: every draw above stays as it was
    if capped.random() < 0.2:
        config = dataclasses.replace(config, max_logged=int(capped.integers(1, 4)))
    if config.static == "graph" and np.random.default_rng([seed, 9]).random() < 0.5:
        config = dataclasses.replace(config, graphs_only=True)
    if np.random.default_rng([seed, 10]).random() < 0.5 and (config.host_tier or config.compaction):
        config = dataclasses.replace(config, records_told=True)
    if np.random.default_rng([seed, 11]).random() < 0.5 and (config.host_tier or config.compaction):
        config = dataclasses.replace(config, padded_pairs=True)
    # with prefixes shared, a prompt sent again would share its cached slots: only an engine that
    # shares none prefills it anew (a generator of its own, keyed so that the seeds
    # tests/test_tools.py pins for other features keep the workloads they were pinned for)
    if not config.prefix_sharing and np.random.default_rng([seed, 44]).random() < 0.5:
        config = dataclasses.replace(config, repeated_prompts=True)
    return config


def applicable_faults(c: SeedConfig) -> list[str]:
    """The faults ``c`` is documented to catch (docs/detection.md, integration.md §2): changed KV
    bytes only where they are hashed; a wrong token id only where an independent record of the
    intended tokens exists; a dropped write (at a position >= 1, so that a stale record of another
    request fails its chain link) only where KV hashes or expected tokens are checked, since the
    request's own rejected draft of that position, fingerprinted with a wrong token (chain_all),
    chains as the right token would; an alias only where a second request can hold slots. A draft
    model's canary always checks the expected tokens (its KV at position p against the token at
    p + 1), so a draft KV written for the wrong token is always caught. A changed byte of a cached
    prefix no request holds is caught where it is hashed, by the first request that shares it."""
    kinds = ["slot_steal"] + (["table_alias"] if c.max_running > 1 else [])
    kinds += ["kv_flip"] if c.hashes_kv else []
    kinds += ["swa_kv_flip"] if c.hashes_swa_kv else []
    kinds += ["prefix_flip"] if c.prefix_cache and c.hashes_kv else []
    kinds += ["host_flip"] if c.host_tier and c.hashes_kv else []
    kinds += ["dropped_write"] if c.hashes_kv or c.expected_pool else []
    kinds += ["wrong_token"] if c.input_asserts or c.expected_pool else []
    kinds += ["draft_kv_flip"] if c.draft_model and c.hash_mode != "NONE" else []
    kinds += ["draft_token"] if c.draft_model else []
    return kinds


@dataclasses.dataclass
class Fault:
    """The corruption of a seed's second run: injected at forward ``at`` or the first one after it
    where the engine holds what it needs (a live request with two cached tokens, say), and the
    requests it harms (see :meth:`FuzzEngine.misnamed`)."""

    kind: str
    at: int
    rng: np.random.Generator
    shared: bool = False  # aimed at a slot more than one holder references (requests, cached prefixes)
    armed: bool = False  # done with it (a slot_steal is injected once the allocator hands the slot out)
    steal: Optional[int] = None  # slot_steal: the live slot the allocator hands out next
    stolen_from: Optional[tuple] = None  # slot_steal: (request, position) the slot holds
    injected_at: Optional[int] = None
    what: str = ""
    in_static: bool = False  # injected into what a static forward's after() reads
    unlogged: bool = False  # injected in a span of more forwards and sweeps than the canaries log
    bad_slots: set = dataclasses.field(default_factory=set)  # slots whose record or KV is wrong, followed when moved
    victims: set = dataclasses.field(default_factory=set)  # requests reading a bad slot or cell: one must be named
    bystanders: set = dataclasses.field(default_factory=set)  # requests that may be named too (a steal's thief)
    position: Optional[int] = None  # the victims' position it harms (shared slots and prefixes are at the same one)
    alias: Optional[tuple] = None  # table_alias: (request, position) whose req_to_token cell points elsewhere


def draw_fault(c: SeedConfig, forwards: int) -> Fault:
    rng = np.random.default_rng([c.seed, 4])
    kinds = applicable_faults(c)
    fault = Fault(kinds[int(rng.integers(len(kinds)))], int(rng.integers(1, max(2, 2 * forwards // 3))), rng)
    fault.shared = bool(c.prefix_sharing and fault.kind in ON_A_SLOT and rng.random() < 0.5)
    return fault


class Device:
    """Arrays on the fuzz's device: NumPy on the CPU, CuPy (imported only then) on a GPU, and torch
    CUDA tensors for batch and static forwards' arrays where torch is installed."""

    def __init__(self, name: str):
        self.name, self.index = name, 0
        self.cupy = self.torch = None
        if name != "cpu":
            import cupy  # noqa: PLC0415 (a machine without CuPy runs the CPU fuzz)

            self.index = int(name.partition(":")[2] or 0)
            cupy.cuda.Device(self.index).use()  # where cupy.asarray puts arrays
            self.cupy = cupy
            try:
                import torch  # noqa: PLC0415 (optional: without it no seed passes torch tensors)

                self.torch = torch if torch.cuda.is_available() else None
            except ImportError:
                pass

    def put(self, host: np.ndarray):
        return host if self.cupy is None else self.cupy.asarray(host)

    def get(self, array) -> np.ndarray:
        return np.asarray(array) if self.cupy is None else self.cupy.asnumpy(array)

    def i64(self, values) -> Any:
        return self.put(np.asarray(values, np.int64))

    def tensor(self, values) -> Any:
        """Int64 values as a torch tensor on the fuzz's GPU, copied there on torch's current stream."""
        return self.torch.as_tensor(np.asarray(values, np.int64), device=f"cuda:{self.index}")

    def fill(self, array, values: np.ndarray) -> None:
        """``values`` into ``array`` in place: a torch tensor with torch's own copy, on its stream."""
        if self.torch is not None and isinstance(array, self.torch.Tensor):
            array.copy_(self.torch.from_numpy(np.asarray(values, np.int64)))
        else:
            array[...] = self.put(values)

    def torch_zeros(self, size: int) -> Any:
        return self.torch.zeros(size, dtype=self.torch.int64, device=f"cuda:{self.index}")

    def settle_torch(self) -> None:
        """Torch's stream done with what it was given: a graph replay reads the arrays it refilled,
        and inside a capture the canary does not order itself after torch's stream (README)."""
        if self.torch is not None:
            self.torch.cuda.current_stream().synchronize()

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


@dataclasses.dataclass(eq=False)  # a request is itself, whatever another holds
class Request:
    rid: int
    row: int
    tokens: np.ndarray  # every token it will hold: the prompt, then what decoding produces
    prompt_len: int
    bonus: int  # the token the target samples after its last one (a draft model's KV of that position holds it)
    slots: list = dataclasses.field(default_factory=list)  # the slot of each cached position (the truth)
    host_slots: Optional[np.ndarray] = None  # while offloaded: the host slot of each cached position
    swa_copied: Optional[np.ndarray] = None  # while offloaded: which of them had an SWA slot
    tainted: tuple = ()  # while offloaded: the positions whose record or KV the fault made wrong
    away_since: int = 0
    swa_evicted: int = 0  # positions below it have no SWA slot any more, unless a sharer still needs it
    pinned: bool = False  # holds the injected fault: never finished, offloaded or moved
    frozen: bool = False  # scheduled no more (a waiting request), so that its SWA window holds still
    unrecorded: bool = False  # live while the canaries were off: some of its tokens may have no record

    @property
    def away(self) -> bool:
        return self.host_slots is not None

    @property
    def cached(self) -> int:
        return len(self.host_slots) if self.away else len(self.slots)

    @property
    def total(self) -> int:
        return len(self.tokens)

    def token_at(self, position: int) -> int:
        return int(self.tokens[position]) if position < self.total else self.bonus


@dataclasses.dataclass(eq=False)  # one kept copy is not another with the same tokens (and arrays)
class CachedPrefix:
    """A finished request's prefix kept by the prefix cache: its slots, each held by a reference,
    and its tokens, one more than its slots (a draft model's KV of the last slot holds that one)."""

    tokens: list
    slots: list  # empty while it is in the host tier
    host_slots: Optional[np.ndarray] = None  # in the host tier: the host slot of each position
    swa_copied: Optional[np.ndarray] = None  # in the host tier: which positions had an SWA slot
    tainted: tuple = ()  # in the host tier: the positions whose KV the fault made wrong
    unrecorded: bool = False  # kept from a request live while the canaries were off


def same_history(a: Request, position_a: int, b: Request, position_b: int) -> bool:
    """Whether ``a`` at ``position_a`` would store the very record ``b`` stores at ``position_b``:
    the same position after the same tokens (a chain hashes tokens, not slots). One slot read for
    the other is then no corruption the canary could see, nor one a real model's KV would show."""
    return position_a == position_b and all(a.token_at(p) == b.token_at(p) for p in range(position_a + 1))


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


@dataclasses.dataclass
class Watch:
    """A canary the engine drives (the target model's, or the draft model's), what its counters must
    read, and what its polls said."""

    label: str
    canary: kc.Canary
    groups: list  # (group name, SWA window or 0)
    ledger: Ledger = dataclasses.field(default_factory=Ledger)
    reported_forwards: int = 0
    polled_forwards: int = 0  # the ledger's forwards at the previous poll
    overflows_seen: int = 0

    @property
    def contexts(self) -> list:
        return [self.canary.context] + ([self.canary.swa_context] if self.canary.swa_context is not None else [])


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
    """A small serving engine driving a ``kc.Canary`` (and a draft model's) as docs/integration.md
    says; with ``fault`` it injects that corruption once."""

    def __init__(self, c: SeedConfig, dev: Device, fault: Optional[Fault] = None):
        self.c, self.dev, self.fault = c, dev, fault
        self.rng = np.random.default_rng([c.seed, 2])  # the workload
        self.pad_rng = np.random.default_rng([c.seed, 12])  # the record copies' padding pairs
        self.kv_rng = np.random.default_rng([c.seed, 3])  # the bytes the model writes
        self.nodes_per_decode = 1 + (4 * c.drafts if c.speculative == "tree" else c.drafts)
        # room for every request's tokens, its in-flight drafts and their moves, a compaction's, and
        # the prefixes the cache keeps
        slots = 1 + c.max_running * (c.max_len + self.nodes_per_decode + c.drafts) + 8 + c.prefix_cache * c.max_len
        self.pool_slots = -(-slots // c.page_size) * c.page_size
        self.free = collections.deque(int(s) for s in self.rng.permutation(np.arange(1, self.pool_slots)))
        self.refs = np.zeros(self.pool_slots, np.int64)  # holders of each slot: requests and cached prefixes
        self.swa_free = collections.deque(range(1, self.pool_slots))
        self.free_rows = collections.deque(range(1, c.max_running + 1))  # pool row 0 is the padding row
        self.table_host = np.zeros((c.max_running + 1, c.max_len), np.int32)
        self.expected_host = np.zeros_like(self.table_host)
        self.lut_host = np.zeros(self.pool_slots + 1, np.int64)
        self.table, self.expected, self.lut = (dev.put(a.copy()) if dev.cupy is not None else a
                                               for a in (self.table_host, self.expected_host, self.lut_host))
        self.kv = build_kv(c, dev, self.pool_slots, self.kv_rng)
        one_layer = dataclasses.replace(c, layout="per_layer", layers=1, page_size=1)
        self.swa_kv = build_kv(one_layer, dev, self.pool_slots, self.kv_rng) if c.swa_window and c.swa_sources \
            else KvPool((), [])
        self.draft_kv = build_kv(one_layer, dev, self.pool_slots, self.kv_rng) if c.draft_model else KvPool((), [])
        self.array = dev.tensor if c.torch_arrays else dev.i64  # the batches' arrays
        self.side = dev.cupy.cuda.Stream(non_blocking=True) if c.side_stream else None
        self.canary = self.build_canary()
        self.watches = [Watch("", self.canary, [("full", 0)] + ([("swa", c.swa_window)] if c.swa_window else []))]
        self.draft = self.build_draft_canary() if c.draft_model else None
        if self.draft is not None:
            self.watches.append(Watch("draft canary: ", self.draft, [("full", 0)]))
        self.tier, self.tier_free = None, collections.deque()
        self.tier_prefixes: list[CachedPrefix] = []  # evicted prefixes the host tier keeps, oldest first
        if c.host_tier or c.prefix_tier:
            # host slot 0 unused, as the pool's; room for every request, the prefixes the tier keeps
            # and one more being stored while one loads
            tier_slots = 1 + (c.max_running + (c.prefix_cache + 1) * c.prefix_tier) * c.max_len
            self.tier = {"full": tier_group(self.kv, self.canary.hash_mode, tier_slots, self.kv_rng)}
            if c.swa_window:
                self.tier["swa"] = tier_group(self.swa_kv, self.canary.hash_mode, tier_slots, self.kv_rng)
            if self.draft is not None:
                self.tier["draft"] = tier_group(self.draft_kv, self.canary.hash_mode, tier_slots, self.kv_rng)
            self.tier_free = collections.deque(range(1, tier_slots))
        self.requests: list[Request] = []
        self.cache: list[CachedPrefix] = []
        self.finished_tokens: Optional[np.ndarray] = None  # the last finished request's, with repeated_prompts
        self.freed_from: dict = {}  # with repeated_prompts: slot -> (request, position) it held before it came free
        self.statics: dict = {}  # the target canary's static forwards by padded shape
        self.draft_statics: dict = {}  # the draft canary's
        self.tally = collections.Counter()
        self.index = self.next_rid = 0
        self.found = self.found_after_fault = 0
        self.first_found: Optional[int] = None
        self.examples: list[str] = []
        self.report_errors: list[str] = []
        self.named: set = set()  # the requests the events after the fault name (None: an event naming none)
        self.named_at: set = set()  # (request, position) of those events
        # (request, position) of the events polled where the canaries promise exact names, every
        # few forwards included: eager forwards only, and no pool row handed on since the previous
        # poll to a request that no logged forward or sweep has shown holding it (README, "tables
        # changed before the poll")
        self.named_at_exactly: set = set()
        self.rows_read: set = set()  # pool rows read by forwards and sweeps since the previous poll
        self.handed_unseen: set = set()  # of those, rows handed on to a request not shown since
        self.paused = self.draining = self.resumed = False  # the canaries switched off (SeedConfig.pause_at)
        self.poll_owed = False  # switched off, the canaries' next poll decodes what came before
        # forwards and sweeps since the previous poll that decoded (made while the canaries were on,
        # or the first after they were switched off), and the first forward's index: a span of more
        # than max_logged is not all logged
        self.span_calls, self.span_start = 0, 0

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
                         chain_position_assert=c.chain_position_assert, logger=QUIET,
                         max_logged_forwards=c.max_logged)

    def build_draft_canary(self) -> kc.Canary:
        """The draft model's canary (integration.md §2, "Speculative decoding"): over its own KV pool,
        indexed by the target's slots and ``req_to_token`` as an EAGLE draft model's is, its KV at
        position p checked against the pool's token at p + 1 (``token_offset=1``)."""
        c = self.c
        return kc.Canary(pool_slot_count=self.pool_slots, capacities=self.canary.capacities, req_to_token=self.table,
                         device=self.dev.name, real_kv_sources=self.draft_kv.sources,
                         hash_mode=kc.HashMode[c.hash_mode], ring_capacity=c.ring_capacity, mode=c.mode,
                         expected_tokens=self.expected, token_offset=1,
                         chain_position_assert=c.chain_position_assert, logger=QUIET,
                         max_logged_forwards=c.max_logged)

    @contextlib.contextmanager
    def canary_stream(self):
        """The ``stream=`` of a canary call: None (CuPy's current stream), or the canary's own stream,
        which the engine orders after its work so far and its later work after (README: forwards
        run "on one stream, or on streams the engine orders")."""
        if self.side is None:
            yield None
            return
        engine_stream = self.dev.cupy.cuda.get_current_stream()
        self.side.wait_event(engine_stream.record())
        yield self.side
        engine_stream.wait_event(self.side.record())

    def records_stream(self):
        """The ``stream=`` of a kc.copy_records: the canary's own with ``records_on_side`` (between
        the pool and the host tier the call waits for it, or queues the store on it: the engine's
        stream then waits for the side stream, as after any canary call), else None."""
        return self.canary_stream() if self.c.records_on_side else contextlib.nullcontext(None)

    # --- the run ----------------------------------------------------------------------------------
    def run(self, forwards: int) -> "FuzzEngine":
        for index in range(forwards):
            self.step(index)
        self.finish()
        return self

    def step(self, index: int) -> None:
        c, self.index = self.c, index
        self.switch_mode()
        self.admit()
        self.move_kv()
        if self.fault and not self.fault.armed and self.fault.kind in BETWEEN_FORWARDS and self.fault_due:
            self.fault.armed = getattr(self, f"inject_{self.fault.kind}")(self.fault.rng)
        if (self.statics or self.draft_statics) and self.rng.random() < 0.05:  # graphs rebuilt: old ones closed
            self.close_statics()
        scheduled = self.schedule()
        if scheduled:
            self.forward(scheduled)
        self.retire()
        self.evict_swa()
        if self.cache and self.rng.random() < 0.1:
            self.drop_cached(int(self.rng.integers(len(self.cache))))
        if (index + 1) % c.sweep_every == 0:
            self.sweep(self.live())
        if (index + 1) % c.poll_every == 0:
            self.poll()

    def close_statics(self) -> None:
        for statics in (self.statics, self.draft_statics):
            for entry in statics.values():
                entry.forward.close()
            statics.clear()

    @property
    def fault_due(self) -> bool:
        """Whether the fault's forward has come (``Fault.at``) and it may be injected now: not before
        the canaries are on again in a seed that switches them off, since the drain waits for every
        request live while they were off (a fault's victim is pinned, never finished) and their
        reports would be expected anyway."""
        return self.index >= self.fault.at and (not self.c.pause_at or self.resumed)

    def switch_mode(self) -> None:
        """A seed with ``pause_at``: the canaries off at that forward, their graphs closed (a captured
        graph would run the canary's kernels whatever the mode: integration.md §5); after
        ``pause_len`` forwards no request is admitted until every request live while they were off
        has finished and every cached prefix kept from one is dropped; then they are on again and
        must report nothing (the clean run) or the fault injected after."""
        c = self.c
        if not c.pause_at or self.resumed:
            return
        if self.index == c.pause_at:
            self.paused = self.poll_owed = True
            for watch in self.watches:
                watch.canary.mode = "off"
            for request in self.requests:
                request.unrecorded = True
            self.close_statics()
        if not self.paused or self.index < c.pause_at + c.pause_len:
            return
        self.draining = True
        for prefix in [p for p in self.cache if p.unrecorded]:
            self.cache.remove(prefix)
            for slot in prefix.slots:
                self.release_slot(slot)
        for prefix in [p for p in self.tier_prefixes if p.unrecorded]:
            self.tier_prefixes.remove(prefix)
            self.tier_free.extend(int(s) for s in prefix.host_slots)
        if any(request.unrecorded for request in self.requests):
            return
        self.paused = self.draining = False
        self.resumed = True
        for watch in self.watches:
            watch.canary.mode = c.mode
        self.tally["resumed_at"] = self.index

    def finish(self) -> None:
        """Poll what is pending, load back every offloaded request, then sweep each live request
        alone (it always fits the verify capacity) and poll after each, so that a fault is read at
        least once whatever overflowed before, and named from tables that did not change since."""
        self.poll()
        for request in [r for r in self.requests if r.away]:
            self.reload(request)
        for request in self.live():
            self.sweep([request])
            self.poll()

    def live(self) -> list[Request]:
        """Requests holding cached KV in the pool (offloaded ones are not live: integration.md §5)."""
        return [r for r in self.requests if not r.away and r.cached > 0]

    # --- requests, slots and shared prefixes ------------------------------------------------------
    def admit(self) -> None:
        if self.draining:
            return
        for _ in range(int(self.rng.integers(0, 3)) if self.requests else 1):
            if not self.free_rows:
                return
            flipped = self.flipped_prefix()
            shares = self.rng.random() < 0.6 or flipped is not None
            shared = self.draw_shared_prefix(flipped) if self.c.prefix_sharing and shares else None
            self.add_request(*(shared or ([], [])))

    def draw_shared_prefix(self, flipped: Optional[tuple] = None) -> Optional[tuple[list, list]]:
        """The tokens and slots of a prefix to share, of a live request's cached tokens or a cached
        prefix, as a radix cache matches one: ``k`` slots, and their ``k`` tokens (``k + 1`` with a
        draft model, whose KV of position ``k - 1`` holds the token at ``k``). With an SWA group only
        a prefix whose last ``window`` positions still have SWA slots is shared (as SGLang's SWA radix
        cache matches), so that a sharer's window never starts at a freed SWA slot. ``flipped``
        (:meth:`flipped_prefix`) is shared instead, from its flipped position on."""
        prefixes = self.cache + self.tier_prefixes
        sources = [(r.token_at, r.slots) for r in self.live()] + [(e.tokens.__getitem__, e) for e in prefixes]
        if not sources:
            return None
        token_at, slots = sources[int(self.rng.integers(len(sources)))]  # drawn anyway: the clean run's draws
        if flipped is not None:
            token_at, slots = flipped[0].tokens.__getitem__, flipped[0]
        if isinstance(slots, CachedPrefix):  # loaded back first when the host tier holds it
            slots = (self.load_prefix(slots) if slots.host_slots is not None else slots).slots
        window = self.c.swa_window
        lengths = [k for k in range(1 + (flipped[1] if flipped else 0), min(len(slots), self.c.max_len - 2) + 1)
                   if not window or all(self.lut_host[slots[p]] for p in range(max(0, k - window), k))]
        if not lengths:
            return None
        k = lengths[int(self.rng.integers(len(lengths)))]
        return [token_at(p) for p in range(k + self.c.draft_model)], list(slots[:k])

    def flipped_prefix(self) -> Optional[tuple[CachedPrefix, int]]:
        """A prefix_flip's prefix, flipped and not yet read, and the flipped position, most of the
        time: a later request shares it, so that the fault harms someone (drawn from the fault's own
        generator, so that the engine's draws before the flip stay the clean run's)."""
        fault = self.fault
        if fault is None or fault.kind != "prefix_flip" or not fault.armed or fault.injected_at is not None \
                or fault.rng.random() < 0.2:
            return None
        for prefix in self.cache:
            bad = [position for position, slot in enumerate(prefix.slots) if slot in fault.bad_slots]
            if bad:
                return prefix, bad[0]
        return next(((prefix, min(prefix.tainted)) for prefix in self.tier_prefixes if prefix.tainted), None)

    def add_request(self, prefix_tokens: list, shared: list) -> None:
        """A new request, starting with the ``shared`` slots (its row points at them, a reference
        held on each), whose first forward then has ``prefix_lens`` their number; at least one
        prompt token is left to run."""
        k, rng = len(shared), self.rng
        total = int(rng.integers(k + 2, self.c.max_len + 1))
        tokens = rng.integers(1, VOCAB, total)
        if self.c.repeated_prompts and self.finished_tokens is not None and rng.random() < 0.5:
            again = min(total, len(self.finished_tokens))
            tokens[:again] = self.finished_tokens[:again]
        tokens[:len(prefix_tokens)] = prefix_tokens
        row = self.free_rows.popleft()
        if row in self.rows_read:
            self.handed_unseen.add(row)
        self.expected_host[row] = 0
        self.expected_host[row, :total] = tokens
        self.table_host[row, :k] = shared
        np.add.at(self.refs, shared, 1)
        request = Request(self.next_rid, row, tokens, int(rng.integers(k + 1, total)), int(rng.integers(1, VOCAB)),
                          slots=list(shared), unrecorded=self.paused)
        self.requests.append(request)
        self.next_rid += 1
        self.tally["shared_tokens"] += k
        if self.fault is not None and self.fault.bad_slots.intersection(shared):
            self.fault.victims.add(request.rid)  # it reads the corruption too
            if self.fault.kind == "prefix_flip" and self.fault.injected_at is None:
                self.pin(request, self.fault.what)  # the first to read it: a harm now, read by the final sweeps

    def take_slot(self, *, kept: bool, with_swa: bool = True, owner: Optional[Request] = None,
                  position: int = 0) -> int:
        """A free slot, or the armed slot_steal's live one for a token whose record will land in it
        (a rejected draft's record is never written, nor a kept draft's moved before after_forward,
        so stealing for it would only move KV bytes), unless that token's record would be the very
        one the slot holds (:func:`same_history`)."""
        fault = self.fault
        if fault is not None and fault.steal is not None and kept and not same_history(owner, position,
                                                                                       *fault.stolen_from):
            slot, fault.steal, fault.injected_at = fault.steal, None, self.index
            fault.victims |= self.holders(slot)
            fault.bystanders.add(owner.rid)
            self.refs[slot] += 1  # its holders keep it too: it is freed once every one of them let go
        elif self.free:
            slot = self.free.popleft()
            self.refs[slot] = 1
            before = self.freed_from.pop(slot, None)
            if kept and before is not None and same_history(owner, position, *before):
                self.tally["records_alike"] += 1  # a repeated prompt's record where the slot held it
        else:
            raise RuntimeError("fuzz engine: the pool ran out of slots (the fuzz sized it wrong)")
        if with_swa and self.c.swa_window:
            self.lut_host[slot] = self.swa_free.popleft()
        return slot

    def release_slot(self, slot: int) -> None:
        """One holder lets go; at the last, the slot goes back to the free list (often its front, so
        that slots are reused soon), with its SWA slot."""
        self.refs[slot] -= 1
        if self.refs[slot] > 0:
            return
        if self.fault is not None:
            self.fault.bad_slots.discard(slot)  # whatever it held is gone: its next holder writes it anew
        if self.c.swa_window and self.lut_host[slot]:
            self.swa_free.append(int(self.lut_host[slot]))
            self.lut_host[slot] = 0
        (self.free.appendleft if self.rng.random() < 0.5 else self.free.append)(slot)

    def holders(self, slot: int) -> set:
        return {r.rid for r in self.requests if slot in r.slots}

    def retire(self) -> None:
        for request in [r for r in self.requests if not r.away and not r.pinned and r.cached >= r.total]:
            if self.c.prefix_cache and self.rng.random() < 0.5:
                self.keep_prefix(request)
            for slot in request.slots:
                self.release_slot(slot)
            if self.c.repeated_prompts:  # its freed slots handed out next, in its order
                free = set(self.free)
                freed = {slot: (request, position) for position, slot in enumerate(request.slots) if slot in free}
                self.free = collections.deque(list(freed) + [slot for slot in self.free if slot not in freed])
                self.finished_tokens = request.tokens
                self.freed_from.update(freed)
            self.free_rows.append(request.row)
            self.requests.remove(request)
            self.tally["finished"] += 1

    def keep_prefix(self, request: Request) -> None:
        """A prefix of a finished request into the prefix cache (the oldest entry evicted when full)."""
        n = int(self.rng.integers(1, request.cached + 1))
        self.cache.append(CachedPrefix([request.token_at(p) for p in range(n + 1)], request.slots[:n],
                                       unrecorded=request.unrecorded))
        np.add.at(self.refs, request.slots[:n], 1)
        if len(self.cache) > self.c.prefix_cache:
            self.drop_cached(0)

    def drop_cached(self, index: int) -> None:
        """A prefix evicted from the cache; with ``prefix_tier``, one no request holds may be kept in
        the host tier instead of dropped (a request's slot stays with the request anyway)."""
        prefix = self.cache.pop(index)
        if self.c.prefix_tier and self.rng.random() < 0.7 and all(self.refs[s] == 1 for s in prefix.slots):
            self.store_prefix(prefix)
        for slot in prefix.slots:
            self.release_slot(slot)
        prefix.slots = []

    def evict_swa(self) -> None:
        """Free the SWA slots of positions that left every later window, zeroing their LUT cells
        (integration.md §2: 0 means no predecessor to check); a slot another holder references keeps
        its SWA slot until it is freed, since that holder's window may still hold it."""
        if not (self.c.swa_window and self.c.swa_evict):
            return
        for request in self.live():
            end = request.cached - self.c.swa_window
            for position in range(request.swa_evicted, end):
                slot = request.slots[position]
                if self.lut_host[slot] and self.refs[slot] == 1:
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
        moves_before = c.speculative in ("chain_kept", "tree") and c.kept_move == "before"
        lands = set(kept[:1] if moves_before else kept)  # the tokens whose records are written where they ran
        nodes = [(int(t), p, self.take_slot(kept=i in lands, owner=request, position=p))
                 for i, (t, p) in enumerate(zip(tokens, positions))]
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
        then after_forward with what the forward keeps (integration.md §2, "Speculative decoding"),
        then the draft model's forward over the kept tokens."""
        c = self.c
        self.span_calls += not self.paused
        self.shown({s.request.row for s in scheduled})
        verify = self.batch(scheduled)
        keeps_all = c.speculative in ("off", "chain_all")  # the forward's own batch is fingerprinted
        entry = self.static_entry(self.canary, scheduled, sum(len(s.nodes) for s in scheduled)) \
            if c.static != "off" and self.rng.random() < 0.7 else None
        self.sync_tables()
        if entry is None:
            with self.canary_stream() as stream:
                self.canary.before_forward(verify, stream=stream)
        else:
            self.refill(entry, scheduled, [s.nodes for s in scheduled])
            self.static_before(entry, replay=keeps_all)
        self.model_write([slot for s in scheduled for _, _, slot in s.nodes])
        if not keeps_all and c.kept_move == "before":
            self.move_kept(scheduled, records=False)
            self.sync_tables()  # the LUT cells of the destination slots, which the SWA write reads
        after_nodes = [s.nodes if keeps_all else [s.nodes[i] for i in s.kept] for s in scheduled]
        change = self.inject_in_forward(scheduled, after_nodes, static=entry is not None and keeps_all)
        if entry is not None and keeps_all:
            if change:
                entry.arrays[change[0]][change[1]] = change[2]
            self.static_after(entry)
        else:
            after = verify if keeps_all and change is None else self.kept_batch(verify, after_nodes, change)
            with self.canary_stream() as stream:
                self.canary.after_forward(after, stream=stream)
        written = sum(len(nodes) for nodes in after_nodes) - (change is not None and change[0] == "out_cache_loc")
        self.account_forward(self.watches[0], scheduled, written, eager=entry is None)
        if not keeps_all and c.kept_move == "after":
            self.move_kept(scheduled, records=True)
        if self.draft is not None:
            self.draft_forward(scheduled)
        self.commit(scheduled)

    def batch(self, scheduled: list[Scheduled]) -> kc.ForwardBatch:
        array, c = self.array, self.c
        tokens, positions, slots = columns([node for s in scheduled for node in s.nodes])
        prefixes = [s.prefix for s in scheduled]
        asserts = c.input_asserts
        return kc.ForwardBatch(
            req_pool_indices=array([s.request.row for s in scheduled]), prefix_lens=array(prefixes),
            extend_seq_lens=array([len(s.nodes) for s in scheduled]), input_ids=array(tokens),
            positions=array(positions), out_cache_loc=array(slots), req_ids=[s.request.rid for s in scheduled],
            expected_input_tokens=array(tokens) if asserts else None,
            expected_input_positions=array(positions) if asserts else None,
            expected_valid_lens=array(prefixes) if c.expected_pool and c.explicit_valid_lens else None)

    def kept_batch(self, verify: kc.ForwardBatch, after_nodes: list,
                   change: Optional[tuple] = None) -> kc.ForwardBatch:
        """The verify batch's requests and prefixes with each one's kept path: every per-token field
        replaced; ``change`` (a fault's) applied to what the write is given, not to what the write
        input assert expects."""
        array = self.array
        tokens, positions, slots = columns([node for nodes in after_nodes for node in nodes])
        given = {"input_ids": list(tokens), "out_cache_loc": slots}
        if change:
            given[change[0]][change[1]] = change[2]
        fields = dict(extend_seq_lens=array([len(nodes) for nodes in after_nodes]), input_ids=array(given["input_ids"]),
                      positions=array(positions), out_cache_loc=array(given["out_cache_loc"]))
        if self.c.input_asserts:
            fields.update(expected_input_tokens=array(tokens), expected_input_positions=array(positions))
        return dataclasses.replace(verify, **fields)

    def model_write(self, slots: list) -> None:
        """The "model": random bytes into every token's K/V, in both pools."""
        self.write_kv(self.kv.views, slots)
        self.write_kv(self.swa_kv.views, self.lut_host[slots].tolist())

    def write_kv(self, views: list, slots: list) -> None:
        """Random bytes into ``slots`` of ``views`` (never all-zero: byte 0 of each token is odd)."""
        index = self.dev.i64(slots)
        for view in views:
            data = np.frombuffer(self.kv_rng.bytes(len(slots) * int(view.shape[1])), np.uint8).copy()
            data = data.reshape(len(slots), -1)
            data[:, 0] |= 1
            view[index] = self.dev.put(data)

    def draft_forward(self, scheduled: list[Scheduled]) -> None:
        """The EAGLE draft model's forward over the tokens the target kept, at their final slots:
        the forward whose KV the draft model keeps, as integration.md §2 asks (its draft steps,
        whose KV a later forward writes again, are not the canary's). Its KV at position p is the
        token at p + 1's, so that is the token each entry is given (and the write input assert
        expects); the last kept position's is the token the target sampled after it."""
        kept = [[(s.request.token_at(p + 1), p, slot) for _, p, slot in (s.nodes[i] for i in s.kept)]
                for s in scheduled]
        truth, positions, slots = columns([node for nodes in kept for node in nodes])
        given = list(truth)
        wrong = self.inject_draft_token(scheduled, kept)
        if wrong is not None:
            given[wrong[0]] = wrong[1]
        entry = self.static_entry(self.draft, scheduled, len(slots)) \
            if self.c.draft_static and self.rng.random() < 0.7 else None
        if entry is None:
            self.eager_draft_forward(scheduled, kept, given)
        else:  # the draft model's own forward always passes what it wrote: after() may replay in its graph
            self.refill(entry, scheduled, kept, given)
            self.static_before(entry, replay=True)
            self.write_kv(self.draft_kv.views, slots)
            self.static_after(entry)
            if wrong is not None:
                self.fault.in_static = True
        self.account_forward(self.watches[1], scheduled, len(slots), eager=entry is None)

    def eager_draft_forward(self, scheduled: list[Scheduled], kept: list, given: list) -> None:
        array = self.array
        truth, positions, slots = columns([node for nodes in kept for node in nodes])
        batch = kc.ForwardBatch(
            req_pool_indices=array([s.request.row for s in scheduled]),
            prefix_lens=array([s.prefix for s in scheduled]), extend_seq_lens=array([len(nodes) for nodes in kept]),
            input_ids=array(given), positions=array(positions),
            out_cache_loc=array(slots), req_ids=[s.request.rid for s in scheduled],
            expected_input_tokens=array(truth) if self.c.input_asserts else None,
            expected_input_positions=array(positions) if self.c.input_asserts else None)
        with self.canary_stream() as stream:
            self.draft.before_forward(batch, stream=stream)
        self.write_kv(self.draft_kv.views, slots)
        with self.canary_stream() as stream:
            self.draft.after_forward(batch, stream=stream)

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

    def account_forward(self, watch: Watch, scheduled: list[Scheduled], written: int, *, eager: bool) -> None:
        if self.paused:  # every call returned at once
            self.tally["forwards_off"] += watch is self.watches[0]
            return
        ledger, capacity = watch.ledger, self.canary.capacities.verify_capacity
        ledger.forwards += 1
        ledger.eager_forwards += eager
        for group, window in watch.groups:
            entries = sum(min(s.prefix, window) if window else s.prefix for s in scheduled)
            ledger.verify(group, entries, capacity)  # HEAD
            ledger.write(group, written)
            ledger.verify(group, entries, capacity)  # TAIL

    # --- static forwards --------------------------------------------------------------------------
    def static_entry(self, canary: kc.Canary, scheduled: list[Scheduled], entries: int) -> StaticEntry:
        """``canary``'s static forward of the batch's padded shape (rows and tokens to powers of two);
        its arrays are torch tensors with ``static_torch``."""
        statics = self.statics if canary is self.canary else self.draft_statics
        shape = (next_pow2(len(scheduled)), next_pow2(entries))
        if shape not in statics:
            entry_fields = ENTRY_FIELDS + (ASSERT_FIELDS if self.c.input_asserts else ())
            zeros = self.dev.torch_zeros if self.c.static_torch else (lambda n: self.dev.put(np.zeros(n, np.int64)))
            arrays = {name: zeros(shape[0] if name in ROW_FIELDS else shape[1]) for name in ROW_FIELDS + entry_fields}
            req_ids = [f"pad{i}" for i in range(shape[0])]
            forward = canary.static_forward(kc.ForwardBatch(**arrays, req_ids=req_ids))
            statics[shape] = StaticEntry(forward, arrays, req_ids, shape)
        return statics[shape]

    def refill(self, entry: StaticEntry, scheduled: list[Scheduled], nodes: list, given: Optional[list] = None) -> None:
        """The batch (its requests, and ``nodes[i]`` the ``(token, position, slot)`` of request
        ``i``'s tokens; ``given`` the tokens its write gets where they differ) into the entry's
        arrays in place: real rows and tokens first, then padding rows (pool row 0) and tokens whose
        other fields hold junk, which no plan may read."""
        rows, entries = entry.shape
        tokens, positions, slots = columns([node for request_nodes in nodes for node in request_nodes])

        def padded(values, size):
            out = self.rng.integers(0, 4, size)
            out[:len(values)] = values
            return out

        values = {"req_pool_indices": padded([s.request.row for s in scheduled], rows),
                  "prefix_lens": padded([s.prefix for s in scheduled], rows),
                  "extend_seq_lens": padded([len(request_nodes) for request_nodes in nodes], rows),
                  "input_ids": padded(tokens if given is None else given, entries),
                  "positions": padded(positions, entries), "out_cache_loc": padded(slots, entries),
                  "expected_input_tokens": padded(tokens, entries),
                  "expected_input_positions": padded(positions, entries)}
        values["req_pool_indices"][len(scheduled):] = 0
        for name, array in entry.arrays.items():
            self.dev.fill(array, values[name])
        entry.req_ids[:] = [s.request.rid for s in scheduled] + [f"pad{i}" for i in range(len(scheduled), rows)]

    def static_before(self, entry: StaticEntry, *, replay: bool) -> None:
        """A graph replay once captured, when its after() runs too; otherwise before() eagerly (a
        kept path goes to an eager after_forward, which needs an eager before: integration.md §2)."""
        if entry.graphs is not None and replay:
            self.settle_static_arrays()
            entry.graphs[0].launch()
            self.tally["graph_replays"] += 1
        else:
            with self.canary_stream() as stream:
                entry.forward.before(stream=stream)
        self.tally["static_runs"] += 1

    def static_after(self, entry: StaticEntry) -> None:
        if entry.graphs is not None:
            self.settle_static_arrays()
            entry.graphs[1].launch()
            return
        with self.canary_stream() as stream:
            entry.forward.after(stream=stream)
        # ran once eagerly, every kernel loaded: captured for the next runs (not while the canary is off:
        # that graph would hold no node)
        if self.c.static == "graph" and not self.paused:
            entry.graphs = self.capture(entry.forward)
            if self.c.graphs_only:  # the canary holds a captured forward until close() (integration.md §3)
                entry.forward = weakref.proxy(entry.forward)

    def settle_static_arrays(self) -> None:
        if self.c.static_torch:
            self.dev.settle_torch()

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
        array = self.array
        self.sync_tables()
        self.span_calls += not self.paused
        self.shown({r.row for r in requests})
        live = kc.LiveRequests(req_pool_indices=array([r.row for r in requests]),
                               seq_lens=array([r.cached for r in requests]), req_ids=[r.rid for r in requests])
        for watch in self.watches:
            with self.canary_stream() as stream:
                watch.canary.sweep(live, stream=stream)
            for group, window in [] if self.paused else watch.groups:  # off: the sweep returned at once
                entries = sum(min(r.cached, window) if window else r.cached for r in requests)
                watch.ledger.verify(group, entries, self.canary.capacities.verify_capacity)
        self.tally["sweeps"] += 1

    def shown(self, rows: set) -> None:
        """A forward or sweep reads these pool rows, each its current request's: the canaries see
        which request holds each where they log the call (at most max_logged since the poll)."""
        self.rows_read |= rows
        if self.span_calls <= self.c.max_logged:
            self.handed_unseen -= rows

    def poll(self) -> None:
        fault = self.fault
        # a poll while off returns at once, but for the first one after the switch (integration.md §5),
        # and the canaries' span goes on
        decodes, self.poll_owed = not self.paused or self.poll_owed, False
        if decodes:
            if self.span_calls > self.c.max_logged and fault is not None and fault.injected_at is not None \
                    and fault.injected_at >= self.span_start:
                fault.unlogged = True
            self.span_calls, self.span_start = 0, self.index + 1
        exact = decodes and (self.c.poll_every == 1 or self.c.static == "off" and not self.handed_unseen)
        if decodes:
            self.rows_read, self.handed_unseen = set(), set()
        for watch in self.watches:
            try:
                report = watch.canary.poll()
            except kc.CanaryViolation as caught:  # mode "raise"
                report = caught.report
            watch.reported_forwards = report.forwards
            per_group = collections.Counter(event.group for event in report.events)
            stored = max(per_group.values(), default=0)
            if len(report.events) + report.dropped != report.total or stored > self.c.ring_capacity:
                self.report_errors.append(f"{watch.label}forward {self.index}: {len(report.events)} events + "
                                          f"{report.dropped} dropped != total {report.total}, or a group's events "
                                          f"{dict(per_group)} past the ring's {self.c.ring_capacity}")
            self.check_steps(watch, report, decodes)
            watch.overflows_seen += report.capacity_overflows
            self.found += report.total
            if self.fault is not None and self.fault.injected_at is not None:
                self.found_after_fault += report.total
                self.named.update(event.request for event in report.events)
                if exact:
                    self.named_at_exactly.update((event.request, event.position) for event in report.events)
                self.named_at.update((event.request, event.position) for event in report.events)
            if report.total and self.first_found is None:
                self.first_found = self.index
                self.examples = [watch.label + event.describe() for event in report.events[:3]]

    def check_steps(self, watch: Watch, report: kc.CanaryReport, decodes: bool) -> None:
        """Every event's step, where told, is a forward run since the previous poll (a sweep's, the
        forward before it, which may be the last one that poll saw): so, polled after each forward,
        that forward's number (`CanaryEvent.step`), and never past the forwards the canary logs
        (``max_logged_forwards`` since the previous poll: later ones' rows get no step). A poll
        while the canary is off returns at once and maps nothing, but for the first one after the
        switch (integration.md §5), so the window runs from the previous poll that ``decodes``."""
        if not decodes:
            return
        now, since = watch.ledger.forwards, watch.polled_forwards
        watch.polled_forwards = now
        last = min(now, since + self.c.max_logged)
        wrong = [event for event in report.events if event.step is not None
                 and not since + (event.phase != "sweep") <= event.step <= last]
        if wrong:
            self.report_errors.append(f"{watch.label}forward {self.index}: event steps outside forwards "
                                      f"{since + 1}..{last} since the previous poll and logged: "
                                      + "; ".join(event.describe() for event in wrong[:3]))

    def counter_errors(self) -> list[str]:
        """Where the canaries' public counters disagree with the ledgers (after the final poll), and
        the reports that did not add up. A fault changes no launch; a dropped write stores one entry
        less. With mode "off" every call returns at once (integration.md §5): every counter reads 0
        and no canary buffer holds a record."""
        errors = list(self.report_errors)
        for watch in self.watches:
            canary, label, off = watch.canary, watch.label, self.c.mode == "off"
            expected = Ledger() if off else watch.ledger
            if watch.reported_forwards != expected.forwards:
                errors.append(f"{label}CanaryReport.forwards {watch.reported_forwards} != {expected.forwards} "
                              f"forwards run")
            if canary.forwards != expected.eager_forwards:
                errors.append(f"{label}Canary.forwards {canary.forwards} != {expected.eager_forwards} eager forwards")
            if watch.overflows_seen != expected.overflows:
                errors.append(f"{label}capacity_overflows {watch.overflows_seen} != {expected.overflows} "
                              f"skipped verifies")
            for group, counters in canary.stats().items():
                for name, want in (("kernel_run_counter", expected.kernel_runs[group]),
                                   ("slot_run_counter", expected.slot_runs[group]), ("violations", 0)):
                    if counters[name] != want:
                        errors.append(f"{label}stats()[{group!r}][{name!r}] {counters[name]} != {want}")
            if off and any(self.dev.get(ctx.canary_buf).any() for ctx in watch.contexts):
                errors.append(f"{label}mode 'off', yet a canary buffer holds records")
        return errors

    def misnamed(self) -> str:
        """Why the fault run's reports did not name the request the fault harms, or "" when they did
        (or naming is not judged).

        The victims are the requests that read the corrupted state. For a changed KV byte or record
        (kv_flip, swa_kv_flip, host_flip, draft_kv_flip, dropped_write, wrong_token, draft_token)
        that is every request whose cached tokens hold the bad slot: the one it was injected in,
        those that shared the slot then, and those that share it later, from a live request or from
        the prefix cache (the bad slot followed through moves and the host tier); for a prefix_flip,
        in a prefix no request held, only those later sharers. For a slot_steal
        it is every holder of the stolen slot when the allocator hands it out (and later sharers);
        the request it is handed to (the thief), whose own record the slot then holds, may be named
        too. For a table_alias it is only the request whose ``req_to_token`` cell was pointed
        elsewhere: the slot's owner reads its own record, and sharers copy the true slots. An alias
        that healed (:meth:`alias_healed`: its slot let go and written again with the victim's own
        record) need name no one, nor be found.

        Named right: some event names a victim (the final sweeps read each live request alone and
        poll after each, so the pinned victim is read with exact names whatever happened before),
        and one names a victim at the position the fault harms or the next (whose chain link reads
        the changed record, and is all that tells a record written over whole); where every forward
        is polled before the next (poll_every 1: integration.md §5, "call it every step for exact
        names"), no event names anyone but victims and the thief, nor a victim at a position other
        than those two. Polled every few forwards, eager forwards alone, no event names anyone else
        either, where no pool row was handed on since the previous poll to a request that no
        logged forward or sweep showed holding it before the poll (README: the table row may hold
        the new request's slots of a shared prefix then). An event may name no request or no
        position (a row the tables at the poll no longer explain, such as an SWA slot freed after
        the forward): that is not judged.
        Nothing is judged with ring_capacity 0 (the ring keeps no row, only counts), nor for a wrong
        token (a draft model's too) that the write input assert may be the only one to see, in a
        static forward polled after later forwards refilled its arrays (README: "poll after each
        replay for exact names"), or in a span between two polls of more forwards and sweeps than
        ``max_logged_forwards`` (whose later forwards the canaries do not log: integration.md §5).
        A fault injected in such a span may go with no name at all (its rows may all come from the
        forwards past the cap, which name no request); a name given must still be a victim's."""
        fault = self.fault
        if not self.found_after_fault or not self.c.ring_capacity:
            return ""
        only_asserted = {"wrong_token": not self.c.expected_pool, "draft_token": self.c.input_asserts}
        if only_asserted.get(fault.kind) and (fault.in_static and self.c.poll_every > 1 or fault.unlogged):
            return ""
        named = self.named - {None}
        # rows past the log's cap name no one; a healed alias's rows may all come before the poll
        # that saw its slot written again, from tables that no longer explain them
        if not named & fault.victims and (named or not fault.unlogged) and not self.alias_healed():
            return f"no event named a victim {sorted(fault.victims)}: they named {sorted(map(str, named))}"
        strays = {request for request, _ in self.named_at_exactly} - {None} - fault.victims - fault.bystanders
        if strays:
            return f"events named {sorted(map(str, strays))}, neither victims {sorted(fault.victims)} nor thieves"
        at = fault.position
        seen = {position for request, position in self.named_at if request in fault.victims and position is not None}
        if at is None or not seen:
            return ""
        # the record a fault changed may still agree with itself (a slot written over by another
        # request, unhashed): then only the next position's chain link, which reads it, tells
        near = {at, at + 1}
        if not seen & near:
            return f"no event named a victim at position {at} or {at + 1}: they named positions {sorted(seen)}"
        exactly = {position for request, position in self.named_at_exactly
                   if request in fault.victims and position is not None}
        if exactly - near:
            return f"events named victims at positions {sorted(exactly - near)}, neither {at} nor {at + 1}"
        return ""

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
        return {"full": self.canary.context, "swa": self.canary.swa_context,
                "draft": self.draft and self.draft.context}[group]

    def carry(self, group: str, views: list, slots: np.ndarray, host: np.ndarray, *, out: bool) -> None:
        """KV bytes, then their records (:meth:`copy_records`), between pool ``slots`` and ``host`` slots."""
        if not len(slots):
            return
        tier, on_device = self.tier[group], self.dev.i64(slots)
        for view, host_view in zip(views, tier.views):
            if out:
                host_view[host] = self.dev.get(view[on_device])
            else:
                view[on_device] = self.dev.put(np.ascontiguousarray(host_view[host]))
        ends = (self.context_of(group), np.asarray(slots, np.int64), tier.context, host)
        src, src_slots, dst, dst_slots = ends if out else ends[2:] + ends[:2]
        canary = self.draft if group == "draft" else self.canary
        self.copy_records(canary, src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots)

    def copy_records(self, canary: kc.Canary, *, src: kc.CanaryContext, dst: kc.CanaryContext,
                     src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Records carried as ``kc.copy_records`` carries them, told to ``canary`` where the seed
        says (``records_told``): a poll then knows when its pool's slots got them. Where the seed
        pads them (``padded_pairs``), as an engine pads its index arrays to a size it keeps, a few
        pairs that store nothing go with them: a source slot of -1 or past the source's end, with
        a destination the copy does not otherwise name (a slot in use, -1, or past the end)."""
        if self.c.padded_pairs:
            src_slots, dst_slots = self.padded(src, dst, src_slots, dst_slots)
        on = [self.dev.i64(values) if ctx.device.is_cuda else np.asarray(values, np.int64)
              for ctx, values in ((src, src_slots), (dst, dst_slots))]
        with self.records_stream() as stream:
            (canary.copy_records if self.c.records_told else kc.copy_records)(
                src=src, dst=dst, src_slots=on[0], dst_slots=on[1], stream=stream)

    def padded(self, src: kc.CanaryContext, dst: kc.CanaryContext, src_slots: np.ndarray,
               dst_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pairs with one to three padding pairs put among them (:meth:`copy_records`)."""
        rng, count = self.pad_rng, len(src_slots)
        unnamed = np.setdiff1d(np.arange(1, dst.num_slots), dst_slots)
        pads = []
        for _ in range(int(rng.integers(1, 4))):
            source = int(rng.choice([-1, src.num_slots, src.num_slots + int(rng.integers(1, 1 << 40))]))
            target = rng.choice([-1, dst.num_slots, int(rng.choice(unnamed)) if len(unnamed) else -1])
            pads.append((source, int(target)))
        at = np.sort(rng.integers(0, count + 1, len(pads)))
        pairs = np.asarray([src_slots, dst_slots], np.int64).T.reshape(-1, 2)
        pairs = np.insert(pairs, at, np.asarray(pads, np.int64), axis=0)
        return pairs[:, 0].copy(), pairs[:, 1].copy()

    def tier_out(self, slots: list) -> tuple[np.ndarray, Optional[np.ndarray], tuple]:
        """KV and records of pool ``slots`` (the draft model's and SWA pool's too) into free host
        slots: those host slots, which positions had an SWA slot, and the positions the fault made
        wrong (whose bad slots are followed into the tier)."""
        slots = np.asarray(slots, np.int64)
        host = np.asarray([self.tier_free.popleft() for _ in slots], np.int64)
        self.carry("full", self.kv.views, slots, host, out=True)
        if self.draft is not None:
            self.carry("draft", self.draft_kv.views, slots, host, out=True)
        swa_copied = None
        if self.c.swa_window:
            swa_slots = self.lut_host[slots]
            swa_copied = swa_slots != 0
            self.carry("swa", self.swa_kv.views, swa_slots[swa_copied], host[swa_copied], out=True)
        bad = self.fault.bad_slots if self.fault else set()
        return host, swa_copied, tuple(p for p, slot in enumerate(slots) if slot in bad)

    def tier_in(self, host: np.ndarray, swa_copied: Optional[np.ndarray], tainted: tuple) -> list:
        """Host slots back into new pool slots (new SWA slots for the positions that had one), the
        host slots freed; the new slots."""
        slots = np.asarray([self.take_slot(kept=False, with_swa=False) for _ in host], np.int64)
        self.carry("full", self.kv.views, slots, host, out=False)
        if self.draft is not None:
            self.carry("draft", self.draft_kv.views, slots, host, out=False)
        if self.c.swa_window:
            for slot, copied in zip(slots, swa_copied):
                self.lut_host[slot] = self.swa_free.popleft() if copied else 0
            self.carry("swa", self.swa_kv.views, self.lut_host[slots][swa_copied], host[swa_copied], out=False)
        self.tier_free.extend(int(s) for s in host)
        if self.fault is not None:
            self.fault.bad_slots.update(int(slots[p]) for p in tainted)
        return slots.tolist()

    def offload(self, request: Request) -> None:
        """A preempted request: KV and records to the host tier, its slots let go (a slot another
        holder references stays with it); not live now."""
        request.host_slots, request.swa_copied, request.tainted = self.tier_out(request.slots)
        for slot in request.slots:
            self.release_slot(slot)
        request.slots, request.away_since = [], self.index
        self.tally["offloads"] += 1

    def reload(self, request: Request) -> None:
        """Back into new slots, the table row rewritten."""
        slots = self.tier_in(request.host_slots, request.swa_copied, request.tainted)
        request.slots, request.host_slots, request.tainted = slots, None, ()
        self.table_host[request.row, :len(slots)] = slots
        self.tally["reloads"] += 1

    def store_prefix(self, prefix: CachedPrefix) -> None:
        """An evicted prefix kept in the host tier, as a hierarchical prefix cache does (sim/engine.py's
        ``_store_prefix``), the oldest one there let go when the tier keeps ``prefix_cache`` already;
        the caller then lets go of its pool slots."""
        if len(self.tier_prefixes) >= self.c.prefix_cache:
            self.tier_free.extend(int(s) for s in self.tier_prefixes.pop(0).host_slots)
        prefix.host_slots, prefix.swa_copied, prefix.tainted = self.tier_out(prefix.slots)
        self.tier_prefixes.append(prefix)
        self.tally["prefix_stores"] += 1

    def load_prefix(self, prefix: CachedPrefix) -> CachedPrefix:
        """A prefix of the tier back into new slots, held by the prefix cache again (the cache's
        oldest entry evicted first when it is full), for a request about to share it."""
        self.tier_prefixes.remove(prefix)
        if len(self.cache) >= self.c.prefix_cache:
            self.drop_cached(0)
        loaded = CachedPrefix(prefix.tokens, self.tier_in(prefix.host_slots, prefix.swa_copied, prefix.tainted),
                              unrecorded=prefix.unrecorded)
        self.cache.append(loaded)
        self.tally["prefix_loads"] += 1
        return loaded

    def compact(self, request: Request) -> None:
        """Some cached tokens moved to other slots of the pool, their records with them
        (copy_records within one canary); an SWA copy stays put, only its LUT cell moves. Only slots
        the request alone holds: a shared one would move under its other holders' rows."""
        rng = self.rng
        own = [p for p, slot in enumerate(request.slots) if self.refs[slot] == 1]
        if not own:
            return
        positions = rng.choice(own, size=min(len(own), int(rng.integers(1, 5))), replace=False)
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
        """KV bytes from pool slots ``old`` to ``new`` (the draft model's too), and their records
        when ``records`` (within one canary); an SWA copy stays where it is, only its LUT cell moves."""
        on_old, on_new = self.dev.i64(old), self.dev.i64(new)
        for view in self.kv.views + self.draft_kv.views:
            view[on_new] = view[on_old]
        if records:
            for canary in [self.canary] + ([self.draft] if self.draft is not None else []):
                self.copy_records(canary, src=canary.context, dst=canary.context,
                                  src_slots=np.asarray(old, np.int64), dst_slots=np.asarray(new, np.int64))
        self.lut_host[new] = self.lut_host[old]
        self.lut_host[old] = 0
        if self.fault is not None:
            self.fault.bad_slots.update(int(n) for o, n in zip(old, new) if int(o) in self.fault.bad_slots)

    # --- faults -----------------------------------------------------------------------------------
    def pin(self, request: Request, what: str, *, bad: Optional[int] = None, injected: bool = True,
            position: Optional[int] = None) -> bool:
        """``request`` holds the fault (never finished, offloaded or moved, so that the final sweeps
        read it), at ``position``; so does every request whose cached tokens hold the ``bad`` slot."""
        fault = self.fault
        request.pinned = True
        fault.what = what
        if position is not None:
            fault.position = position
        fault.victims.add(request.rid)
        if bad is not None:
            fault.bad_slots.add(bad)
            fault.victims |= self.holders(bad)
        if injected:
            fault.injected_at = self.index
        return True

    def flip(self, view, row: int, byte: int, bit: int) -> None:
        values = self.dev.get(view[row]).copy()
        values[byte] ^= np.uint8(1 << bit)
        view[row] = self.dev.put(values)

    def cached_positions(self, requests: list[Request], *, last: int = 0) -> list[tuple[Request, int]]:
        """``(request, position)`` of the cached positions of ``requests`` but their ``last`` ones;
        for a fault aimed at a shared slot only those whose slot another holder references too."""
        shared = self.fault.shared
        return [(r, p) for r in requests for p in range(r.cached - last) if not shared or self.refs[r.slots[p]] > 1]

    def inject_kv_flip(self, rng: np.random.Generator, pool: Optional[KvPool] = None,
                       context: Optional[kc.CanaryContext] = None, label: str = "") -> bool:
        """A bit of a hashed byte of a live token's KV (of the draft model's pool, for draft_kv_flip)."""
        pool = self.kv if pool is None else pool
        context = self.canary.context if context is None else context
        choices = self.cached_positions(self.live())
        if not choices:
            return False
        request, position = choices[int(rng.integers(len(choices)))]
        source = int(rng.integers(len(pool.views)))
        byte = int(rng.integers(context.kv_read_lengths[source]))
        slot = request.slots[position]
        self.flip(pool.views[source], slot, byte, int(rng.integers(8)))
        return self.pin(request, f"request {request.rid} {label}position {position} slot {slot} source {source} "
                        f"byte {byte}", bad=slot, position=position)

    def inject_draft_kv_flip(self, rng: np.random.Generator) -> bool:
        return self.inject_kv_flip(rng, self.draft_kv, self.draft.context, "draft KV ")

    def inject_swa_kv_flip(self, rng: np.random.Generator) -> bool:
        """A bit of a hashed byte of the SWA KV of a position in a live request's window; the request
        waits from then on, so that the window holds still."""
        window = self.c.swa_window
        inside = [(r, p) for r, p in self.cached_positions(self.live())
                  if p >= r.cached - window and self.lut_host[r.slots[p]]]
        if not inside:
            return False
        request, position = inside[int(rng.integers(len(inside)))]
        source = int(rng.integers(len(self.swa_kv.views)))
        byte = int(rng.integers(self.canary.swa_context.kv_read_lengths[source]))
        self.flip(self.swa_kv.views[source], int(self.lut_host[request.slots[position]]), byte, int(rng.integers(8)))
        request.frozen = True
        return self.pin(request, f"request {request.rid} SWA position {position} source {source} byte {byte}",
                        bad=request.slots[position], position=position)

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
        request.tainted += (position,)  # its slot once it is loaded back is the bad one
        return self.pin(request, f"request {request.rid} offloaded position {position} source {source} byte {byte}",
                        position=position)

    def inject_prefix_flip(self, rng: np.random.Generator) -> bool:
        """A bit of a hashed KV byte of a cached prefix no request holds, in the host tier or in a pool
        slot only the prefix cache references; injected once a later request shares it
        (:meth:`add_request`): a corrupt prefix that nobody reads again harms nobody."""
        on_device = [e for e in self.cache if not any(self.holders(slot) for slot in e.slots)]
        either = [kept for kept in (on_device, self.tier_prefixes) if kept]  # the device's or the tier's, even odds
        if not either:
            return False
        prefixes = either[int(rng.integers(len(either)))]
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        length = len(prefix.slots) if prefix.host_slots is None else len(prefix.host_slots)
        # mostly near its start, which more of the later sharers' prefixes cover
        position = int(rng.integers(int(rng.integers(length)) + 1))
        source = int(rng.integers(len(self.kv.views)))
        byte, bit = int(rng.integers(self.canary.context.kv_read_lengths[source])), int(rng.integers(8))
        if prefix.host_slots is None:
            self.flip(self.kv.views[source], prefix.slots[position], byte, bit)
            self.fault.bad_slots.add(prefix.slots[position])
            where = f"cached prefix slot {prefix.slots[position]}"
        else:
            self.tier["full"].views[source][prefix.host_slots[position], byte] ^= np.uint8(1 << bit)
            prefix.tainted += (position,)  # its slot once it is loaded back is the bad one
            where = f"host-tier prefix host slot {prefix.host_slots[position]}"
        self.fault.what = f"{where} position {position} source {source} byte {byte}"
        self.fault.position = position
        return True

    def victim_position(self, rng: np.random.Generator) -> Optional[tuple[Request, int]]:
        """A live request and one of its cached positions with a cached successor, whose chain link
        reports a changed record even where the record's own fields happen to match (position 0)."""
        choices = self.cached_positions(self.live(), last=1)
        return choices[int(rng.integers(len(choices)))] if choices else None

    def inject_slot_steal(self, rng: np.random.Generator) -> bool:
        """The allocator hands a live slot to the next kept token (a use after free; on a shared
        slot, a reference count dropped once too often)."""
        victim = self.victim_position(rng)
        if victim is None:
            return False
        request, position = victim
        self.fault.steal, self.fault.stolen_from = request.slots[position], victim
        return self.pin(request, f"request {request.rid} position {position} slot {self.fault.steal}",
                        bad=self.fault.steal, injected=False, position=position)

    def inject_table_alias(self, rng: np.random.Generator) -> bool:
        """A req_to_token cell pointed at another live request's slot, one whose record differs from
        the cell's own (a shared prefix's slot at the same position would be no corruption)."""
        victim = self.victim_position(rng)
        if victim is None:
            return False
        request, position = victim
        targets = [(other, p) for other in self.live() if other is not request for p in range(other.cached)
                   if not same_history(request, position, other, p)]
        if not targets:
            return False
        other, at = targets[int(rng.integers(len(targets)))]
        target = other.slots[at]
        self.table_host[request.row, position] = target
        self.fault.alias = (request, position)
        return self.pin(request, f"request {request.rid} position {position} -> slot {target} of {other.rid}",
                        position=position)

    def inject_in_forward(self, scheduled: list[Scheduled], after_nodes: list, *,
                          static: bool) -> Optional[tuple[str, int, int]]:
        """For dropped_write and wrong_token, from forward ``at`` on: ``(field, entry, value)`` to
        change in what after_forward (or after()) gets, for one kept token. A write dropped into a
        slot whose stale record is the one it would have written is no corruption: left out."""
        fault = self.fault
        if fault is None or fault.armed or fault.kind not in ("dropped_write", "wrong_token") or not self.fault_due:
            return None
        candidates, entry = [], 0
        for s, nodes in zip(scheduled, after_nodes):
            kept = {s.nodes[i][2] for i in s.kept}
            for token, position, slot in nodes:
                if slot in kept and (position >= 1 or fault.kind == "wrong_token") and not (
                        fault.kind == "dropped_write" and self.holds_record(slot, token, position)):
                    candidates.append((entry, s.request, token, position, slot))
                entry += 1
        if not candidates:
            return None
        entry, request, token, position, slot = candidates[int(fault.rng.integers(len(candidates)))]
        fault.in_static = static
        fault.armed = self.pin(request, f"request {request.rid} position {position} entry {entry}", bad=slot,
                               position=position)
        if fault.kind == "dropped_write":
            return "out_cache_loc", entry, -1  # a negative slot: the write skips the entry
        return "input_ids", entry, wrong_token(token)

    def alias_healed(self) -> bool:
        """Whether a table_alias's cell now points at a slot holding the record the victim's own
        slot holds (token, position and chain link alike): the slot it was pointed at was let go
        and written again with the victim's history (a sharer's tokens loaded back into it, say).
        Reading one for the other is then no corruption (:func:`same_history`), and the final
        sweeps have nothing to find."""
        if self.fault is None or self.fault.alias is None:
            return False
        request, position = self.fault.alias
        read, own = (self.canary.context.slot_fields(int(slot))
                     for slot in (self.table_host[request.row, position], request.slots[position]))
        return all(read[field] == own[field] for field in ("token", "position", "prev_hash"))

    def holds_record(self, slot: int, token: int, position: int) -> bool:
        fields = self.canary.context.slot_fields(slot)
        return (fields["token"], fields["position"]) == (token, position)

    def inject_draft_token(self, scheduled: list[Scheduled], kept: list) -> Optional[tuple[int, int]]:
        """For draft_token, from forward ``at`` on: ``(entry, token)``, one kept token's draft KV given
        the token at its own position instead of the next one's (the off-by-one ``token_offset=1``
        checks). Only where a check will see it: with the write input assert anywhere, else below
        the request's last kept position, which later verifies check against the token pool."""
        fault = self.fault
        if fault is None or fault.armed or fault.kind != "draft_token" or not self.fault_due:
            return None
        candidates, entry = [], 0
        for s, nodes in zip(scheduled, kept):
            for i, (_, position, slot) in enumerate(nodes):
                own = s.request.token_at(position)
                if (self.c.input_asserts or i + 1 < len(nodes)) and own != s.request.token_at(position + 1):
                    candidates.append((entry, s.request, position, slot, own))
                entry += 1
        if not candidates:
            return None
        entry, request, position, slot, own = candidates[int(fault.rng.integers(len(candidates)))]
        fault.armed = self.pin(request, f"request {request.rid} draft position {position} entry {entry}", bad=slot,
                               position=position)
        return entry, own


# --- seeds, rows and the table -------------------------------------------------------------------
def run_seed(seed: int, dev: Device, forwards: int) -> dict:
    c = draw_config(seed, dev.name, dev.torch is not None)
    fault = draw_fault(c, forwards) if c.mode != "off" else None  # a canary that is off reports nothing
    kind = "none" if fault is None else fault.kind + ("@shared" if fault.shared else "")
    row = {"seed": seed, "config": dataclasses.asdict(c), "features": c.features() + [f"fault={kind}"],
           "false_positives": 0, "counter_errors": [], "examples": [], "fault": kind, "injected": False,
           "detected": False, "missed": False, "misnamed": "", "crash": None}
    started = time.perf_counter()
    try:
        clean = FuzzEngine(c, dev).run(forwards)
        row.update(false_positives=clean.found, counter_errors=clean.counter_errors(), examples=clean.examples,
                   work=dict(clean.tally, forwards=clean.watches[0].ledger.forwards,
                             overflows=clean.watches[0].ledger.overflows))
    except Exception:  # noqa: BLE001 (a crash is a finding: recorded, and the next seed runs)
        row["crash"] = "clean run: " + traceback.format_exc(limit=8)
    try:
        if fault is not None:
            faulty = FuzzEngine(c, dev, fault).run(forwards)
            injected = fault.injected_at is not None
            row["counter_errors"] += [f"fault run: {error}" for error in faulty.counter_errors()]
            row.update(injected=injected, detected=faulty.found_after_fault > 0, fault_at=fault.injected_at,
                       fault_where=fault.what, first_report=faulty.first_found, fault_examples=faulty.examples,
                       misnamed=faulty.misnamed() if injected else "", victims=sorted(fault.victims),
                       named=sorted(map(str, faulty.named)))
            row["missed"] = injected and not row["detected"] and not faulty.alias_healed()
    except Exception:  # noqa: BLE001
        row["crash"] = (row["crash"] or "") + "fault run: " + traceback.format_exc(limit=8)
    row["wall_s"] = round(time.perf_counter() - started, 3)
    return row


def failed(row: dict) -> bool:
    return bool(row["false_positives"] or row["counter_errors"] or row["missed"] or row["misnamed"] or row["crash"])


def describe_failure(row: dict) -> str:
    what = [f"{row['false_positives']} false positive(s)"] if row["false_positives"] else []
    what += [f"counters: {'; '.join(row['counter_errors'])}"] if row["counter_errors"] else []
    what += [f"missed {row['fault']} ({row.get('fault_where')})"] if row["missed"] else []
    what += [f"misnamed {row['fault']} ({row.get('fault_where')}): {row['misnamed']}"] if row["misnamed"] else []
    what += [f"crash: {row['crash'].strip().splitlines()[-1]}"] if row["crash"] else []
    lines = [f"seed {row['seed']} FAILED (alone: --start {row['seed']} --seeds 1): {', '.join(what)}",
             f"  config: {row['config']}"]
    lines += [f"  {example}" for example in row["examples"] + (row.get("fault_examples") or [])]
    return "\n".join(lines)


TABLE_COLUMNS = ("runs", "false+", "counters", "injected", "missed", "misnamed", "crashes")


def table(rows: list[dict]) -> dict:
    by_feature: dict = collections.defaultdict(collections.Counter)
    for row in rows:
        for feature in row["features"]:
            counts = by_feature[feature]
            for column, value in zip(TABLE_COLUMNS, (1, row["false_positives"] > 0, bool(row["counter_errors"]),
                                                     row["injected"], row["missed"], bool(row["misnamed"]),
                                                     row["crash"] is not None)):
                counts[column] += int(value)
    return dict(sorted(by_feature.items()))


# what a clean seed's brief row keeps: which fault, whether and where it was placed and reported,
# and how much the engine did
BRIEF_FIELDS = ("seed", "fault", "injected", "detected", "fault_at", "first_report", "work", "wall_s")


def brief(row: dict) -> dict:
    """``row`` as ``--brief-rows`` keeps it."""
    return dict(row) if failed(row) else {key: row[key] for key in BRIEF_FIELDS if key in row}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (CuPy): static forwards then also in CUDA "
                                                        "graphs, torch tensors (when installed) and side streams")
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--forwards", type=int, default=40, help="forwards a run, before its final sweeps")
    parser.add_argument("--json", help="write every seed's row and the totals here (xz-compressed where it ends in .xz)")
    parser.add_argument("--brief-rows", action="store_true",
                        help="in --json, a seed that ran clean as its outcome and work only (a failing seed's row whole)")
    parser.add_argument("--exact-allocations", action="store_true",
                        help="CuPy's memory pool off: every CuPy array an allocation of its exact size, so that "
                             "compute-sanitizer's memcheck sees a read or store one past it")
    args = parser.parse_args(argv)
    if args.exact_allocations:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
        from _fuzzcases import exact_allocations  # noqa: PLC0415

        exact_allocations(args.device)
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
    print(f"{'feature':<28}" + "".join(f"{column:>10}" for column in TABLE_COLUMNS))
    for feature, counts in by_feature.items():
        print(f"{feature:<28}" + "".join(f"{counts[column]:>10}" for column in TABLE_COLUMNS))
    faulted = [r for r in rows if r["fault"] != "none"]
    total = {"runs": len(rows), "false_positives": sum(r["false_positives"] > 0 for r in rows),
             "counter_errors": sum(bool(r["counter_errors"]) for r in rows), "mode_off": len(rows) - len(faulted),
             "injected": sum(r["injected"] for r in rows), "not_injected": sum(not r["injected"] for r in faulted),
             "missed": sum(r["missed"] for r in rows), "misnamed": sum(bool(r["misnamed"]) for r in rows),
             "crashes": sum(r["crash"] is not None for r in rows), "wall_s": round(time.perf_counter() - started, 1)}
    print(f"{total['runs']} seeds x {args.forwards} forwards on {args.device} in {total['wall_s']} s: "
          f"{total['false_positives']} with false positives, {total['counter_errors']} with counter mismatches, "
          f"{total['injected']} faults injected ({total['not_injected']} found no place, {total['mode_off']} seeds "
          f"with the canary off had none), {total['missed']} missed, {total['misnamed']} misnamed, "
          f"{total['crashes']} crashes")
    if args.json:
        opener = lzma.open if args.json.endswith(".xz") else open
        with opener(args.json, "wt", encoding="utf-8") as handle:
            json.dump({"device": args.device, "forwards": args.forwards,
                       "rows": [brief(r) for r in rows] if args.brief_rows else rows, "by_feature": by_feature,
                       "total": total}, handle, indent=1, default=int)
    return int(any(failed(r) for r in rows))


if __name__ == "__main__":
    sys.exit(main())
