"""The named serving shapes and the engine state each one is benchmarked on.

A :class:`Case` is one forward batch of a serving engine: ``bs`` requests, each with ``prefix`` tokens
already in the KV cache (verified) and ``extend`` new ones (written; 1 for a decode step), an optional
sliding window, and the real-KV sources hashed. :func:`build_state` turns it into a realistic state
on a device, with the package's own ops:

* a pool of at least ``MIN_POOL_SLOTS`` slots (4M at scale 1: canary plus sources far larger than
  the H200's 50-60 MB of L2), whose ``req_to_token`` rows are a random permutation of the pool (no
  two neighbouring positions in neighbouring slots);
* random token ids, and real-KV sources filled with random bytes;
* every request's chain written by ``kc.write`` (so a HEAD verify finds zero violations: asserted
  once per case, outside any timing);
* ``copies`` disjoint copies of the batch (different pool rows, hence different slots) so that
  repetitions rotate among inputs when one copy would fit in L2;
* both plans of every copy built by ``kc.plan``, and the write and scatter inputs of its new tokens.

``scale`` (``--scale`` or ``KVCANARY_BENCH_SCALE``) multiplies bs, prefix, extend, window and pool by
the same factor (entry counts by its square) so the suite runs on a CPU in CI time.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Optional

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import _layout as L

import _naive as N

MIN_POOL_SLOTS = 4 << 20
MAX_COPIES = 8
TOKEN_VOCAB = 151_936


@dataclasses.dataclass(frozen=True)
class Sources:
    """``count`` real-KV sources of ``bytes_per_token`` bytes per slot, ``read_bytes`` of them
    hashed in mode ALL (PARTIAL always reads 16)."""

    count: int
    bytes_per_token: int
    read_bytes: int
    page_size: int = 1

    def read_length(self, mode: kc.HashMode) -> int:
        return {kc.HashMode.NONE: 0, kc.HashMode.PARTIAL: L.PARTIAL_READ_BYTES}.get(mode, self.read_bytes)


NO_SOURCES = Sources(0, 16, 16)


@dataclasses.dataclass(frozen=True)
class Case:
    """One named serving shape, with the peer engine's step times where known (µs)."""

    name: str
    bs: int
    prefix: int
    extend: int = 1  # 1: a decode step
    swa_window: int = 0
    sources: Sources = NO_SOURCES
    hash_mode: kc.HashMode = kc.HashMode.NONE
    peer_us: Optional[float] = None  # the peer's whole step, eager
    peer_graph_us: Optional[float] = None  # the peer's whole step as one CUDA-graph replay
    peer_plan_us: Optional[float] = None
    ops: frozenset = frozenset({"plan", "verify", "write", "scatter", "step"})
    large: bool = False

    @property
    def decode(self) -> bool:
        return self.extend == 1

    @property
    def n_verify(self) -> int:
        per = min(self.prefix, self.swa_window) if self.swa_window > 0 else self.prefix
        return self.bs * per

    @property
    def n_write(self) -> int:
        return self.bs * self.extend

    @property
    def width(self) -> int:
        return self.prefix + self.extend

    @property
    def source_read_bytes(self) -> int:
        """Source bytes hashed per slot, all sources together."""
        return self.sources.count * self.sources.read_length(self.hash_mode)

    def scaled(self, scale: float) -> "Case":
        if scale >= 1.0:
            return self
        down = lambda v, lo=1: v if v <= 0 else max(lo, int(round(v * scale)))  # noqa: E731
        return dataclasses.replace(self, bs=down(self.bs), prefix=down(self.prefix),
                                   extend=1 if self.extend == 1 else down(self.extend, 2),
                                   swa_window=down(self.swa_window))

    def describe(self) -> str:
        text = f"bs{self.bs} prefix{self.prefix} " + ("decode" if self.decode else f"extend{self.extend}")
        if self.swa_window:
            text += f" swa{self.swa_window}"
        if self.sources.count and self.hash_mode != kc.HashMode.NONE:
            text += (f" {self.sources.count}x{self.sources.bytes_per_token}B "
                     f"read{self.sources.read_length(self.hash_mode)} {self.hash_mode.name}")
        return text


_P = kc.HashMode.PARTIAL
_A = kc.HashMode.ALL

CASES: tuple[Case, ...] = (
    Case("smoke_decode_empty", 1, 0, peer_us=24, peer_graph_us=11.5),
    Case("small_extend_batch", 32, 4096, 128, peer_us=77),
    Case("e2e_decode_steady", 256, 4096, peer_us=112, peer_graph_us=99),
    Case("decode_large_batch_short_prefix", 1024, 1024, peer_us=116),
    Case("e2e_prefill_chunk_first", 1, 0, 4096, peer_us=1080),
    Case("e2e_prefill_chunk_mid", 1, 8192, 4096, peer_us=1198),
    Case("e2e_prefill_chunk_last", 1, 12288, 4096, peer_us=1196),
    Case("e2e_decode_tail", 1, 5120, peer_us=28),
    Case("swa_decode_long_prefix", 128, 10240, swa_window=128, peer_us=34),
    Case("swa_decode_short_prefix", 256, 128, swa_window=128, peer_us=35),
    Case("decode_mid_batch", 128, 4096, peer_us=74),
    Case("small_extend_batch_hash", 32, 4096, 128, sources=Sources(1, 16, 16), hash_mode=_P, peer_us=144),
    Case("e2e_prefill_chunk_hash", 1, 12288, 4096, sources=Sources(2, 64, 64), hash_mode=_A, peer_us=4558),
    Case("e2e_decode_steady_hash", 256, 4096, sources=Sources(4, 64, 32), hash_mode=_A, peer_us=287),
    Case("verify_16m", 4096, 4096, sources=Sources(1, 64, 64), hash_mode=_P, peer_us=1787, peer_plan_us=337,
         large=True),
    Case("prefill_hash_256b", 1, 0, 4096, sources=Sources(2, 256, 256), hash_mode=_A, peer_us=16401, large=True),
    # not a serving case of its own: the shape of the plan-bandwidth target
    Case("plan_bs1024_prefix4096", 1024, 4096, ops=frozenset({"plan"})),
)
# Shapes for the probes in tools/ only, outside the suite and its targets: decode batches small
# enough for the step's tail write (at most 32 requests) with real-KV sources.
PROBE_CASES: tuple[Case, ...] = (
    Case("probe_decode_bs16_hash", 16, 4096, sources=Sources(4, 64, 32), hash_mode=_A),
    Case("probe_decode_bs1_hash", 1, 5120, sources=Sources(2, 64, 64), hash_mode=_A),
)
BY_NAME = {c.name: c for c in CASES + PROBE_CASES}

# A hash case and the same shape without hashing (the "ALL-hash write <= 1.2x no-hash write" target).
NO_HASH_TWIN = {"e2e_prefill_chunk_hash": "e2e_prefill_chunk_last", "prefill_hash_256b": "e2e_prefill_chunk_first",
                "e2e_decode_steady_hash": "e2e_decode_steady", "small_extend_batch_hash": "small_extend_batch"}


def cases_for(op: str) -> list[Case]:
    return [c for c in CASES if op in c.ops]


# --- device-agnostic random data -----------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15


def rand_u64(xp, n: int, seed: int):
    """``n`` pseudo-random uint64 (splitmix64 of a Weyl sequence), generated on ``xp``'s device."""
    x = xp.arange(n, dtype=xp.uint64) * xp.uint64(_GOLDEN) + xp.uint64((seed * 0xD1B54A32D192ED03 + 1) & L.U64_MASK)
    return N.sm(xp, x)


def rand_bytes(xp, shape: tuple[int, ...], seed: int):
    nbytes = int(np.prod(shape))
    return rand_u64(xp, -(-nbytes // 8), seed).view(xp.uint8)[:nbytes].reshape(shape)


def rand_perm(xp, n: int, seed: int):
    """A random permutation of ``range(n)`` (int64)."""
    return xp.argsort(rand_u64(xp, n, seed)).astype(xp.int64)


# --- engine state --------------------------------------------------------------------------------

@dataclasses.dataclass
class BatchCopy:
    """One copy of the case's batch: metadata, both plans (filled), write and scatter inputs."""

    req_pool_indices: Any
    prefix_lens: Any
    extend_lens: Any
    vplan: kc.VerifyPlan
    wplan: kc.WritePlan
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    scatter_offsets: Any


@dataclasses.dataclass
class EngineState:
    case: Case
    xp: Any
    device: str
    ctx: kc.CanaryContext
    req_to_token: Any
    lut: Optional[Any]
    expected_pool: Any  # int32 [rows, width], scatter's output
    kv: list
    copies: list[BatchCopy]
    pool_slots: int
    stream: Any = None

    @property
    def n_copies(self) -> int:
        return len(self.copies)

    def footprint_bytes(self) -> int:
        """Canary buffer plus sources: what the slots are drawn from."""
        total = int(self.ctx.canary_buf.nbytes)
        return total + sum(int(k.nbytes) for k in self.kv)

    # --- the four ops on copy i, as an engine calls them ---------------------------------------
    def plan_kwargs(self, i: int) -> dict:
        c = self.copies[i]
        extra = {}
        if self.case.swa_window:
            extra = dict(swa_window_size=self.case.swa_window, full_to_swa_index_mapping=self.lut)
        return dict(req_pool_indices=c.req_pool_indices, prefix_lens=c.prefix_lens, extend_seq_lens=c.extend_lens,
                    req_to_token=self.req_to_token, **extra)

    def plan(self, i: int) -> None:
        c = self.copies[i]
        kc.plan(c.vplan, c.wplan, stream=self.stream, **self.plan_kwargs(i))

    def verify(self, i: int, tag=kc.LaunchTag.HEAD_K_FULL) -> None:
        kc.verify(self.ctx, self.copies[i].vplan, tag=tag, stream=self.stream)

    def write(self, i: int) -> None:
        c = self.copies[i]
        kc.write(self.ctx, c.wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=c.input_ids, positions=c.positions,
                 out_cache_loc=c.out_cache_loc, stream=self.stream)

    def scatter(self, i: int) -> None:
        c = self.copies[i]
        kc.scatter_req_token_ids(flat_in=c.input_ids, offsets=c.scatter_offsets, req_pool_indices=c.req_pool_indices,
                                 pool_out=self.expected_pool, stream=self.stream)

    def step_ops(self, i: int) -> None:
        """One forward's canary work as three ops: plan, HEAD verify of the prefixes, write of the new tokens."""
        self.plan(i)
        self.verify(i)
        self.write(i)

    def canary_step(self, i: int) -> kc.CanaryStep:
        """The same work as ``step_ops`` prepared once (``kc.CanaryStep``) for copy i."""
        steps = self.__dict__.setdefault("_canary_steps", {})
        if i not in steps:
            c = self.copies[i]
            steps[i] = kc.CanaryStep(self.ctx, verify_capacity=c.vplan.capacity, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                                     write_tag=kc.LaunchTag.TAIL_K_FULL, input_ids=c.input_ids,
                                     positions=c.positions, out_cache_loc=c.out_cache_loc, **self.plan_kwargs(i))
        return steps[i]

    def step(self, i: int) -> None:
        """One forward's canary work through ``kc.CanaryStep``: verify entries derived in the kernel,
        decode-shaped batches in one launch."""
        self.canary_step(i).launch(stream=self.stream)

    # --- the baselines on copy i ----------------------------------------------------------------
    def naive_plan(self, i: int) -> None:
        c = self.copies[i]
        N.plan_into(self.xp, c.vplan, c.wplan, req_pool_indices=c.req_pool_indices, prefix_lens=c.prefix_lens,
                    extend_lens=c.extend_lens, req_to_token=self.req_to_token, swa_window=self.case.swa_window,
                    lut=self.lut)

    def naive_verify(self, i: int):
        c = self.copies[i]
        return N.verify(self.xp, self.ctx.canary_buf, N.sources_of(self.ctx), slots=c.vplan.slot_indices,
                        expected_tokens=c.vplan.expected_tokens, expected_positions=c.vplan.expected_positions,
                        prev_slots=c.vplan.prev_slot_indices, active=self.case.n_verify)

    def naive_write(self, i: int) -> int:
        c = self.copies[i]
        return N.write(self.xp, self.ctx.canary_buf, N.sources_of(self.ctx), offsets=c.wplan.offsets,
                       seed_slots=c.wplan.seed_slot_indices, num_valid_reqs=self.case.bs, input_ids=c.input_ids,
                       positions=c.positions, out_cache_loc=c.out_cache_loc)

    def naive_scatter(self, i: int) -> None:
        c = self.copies[i]
        N.scatter(self.xp, flat_in=c.input_ids, offsets=c.scatter_offsets, req_pool_indices=c.req_pool_indices,
                  pool_out=self.expected_pool)

    def naive_step(self, i: int) -> None:
        self.naive_plan(i)
        self.naive_verify(i)
        self.naive_write(i)

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def violations(self) -> int:
        self.sync()
        return self.ctx.violations().total


def bytes_touched(case: Case) -> int:
    """Rough bytes one copy's ops read and write (to decide how many copies outgrow L2)."""
    src = case.source_read_bytes
    return case.n_verify * (4 + 32 + 32 + 32 + src) + case.n_write * (24 + 32 + 12 + src) + case.bs * 64


def copies_for(case: Case, l2_bytes: int) -> int:
    return int(max(1, min(MAX_COPIES, math.ceil(3 * l2_bytes / max(bytes_touched(case), 1)))))


def build_state(case: Case, device: str, *, scale: float = 1.0, l2_bytes: int = 60 << 20, seed: int = 0,
                stream: Any = None, ring_capacity: int = 1024) -> EngineState:
    """The engine state of ``case`` (already scaled) on ``device`` (``"cpu"`` or ``"cuda"``)."""
    if device == "cpu":
        xp = np
    else:
        import cupy as xp  # noqa: PLC0415
    with (stream if stream is not None else _Null()):
        return _build(case, device, xp, scale, l2_bytes, seed, stream, ring_capacity)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _build(case, device, xp, scale, l2_bytes, seed, stream, ring_capacity):
    seed = seed * 1000 + zlib.crc32(case.name.encode()) % 997
    copies = copies_for(case, l2_bytes)
    per_copy = case.bs * case.width
    pool = max(int(MIN_POOL_SLOTS * scale), copies * per_copy + 1, 2)
    rows = 1 + copies * case.bs
    width = case.width

    # req_to_token: row 0 is the padding row; the others take consecutive runs of a random permutation
    perm = rand_perm(xp, pool - 1, seed + 1)[: copies * per_copy] + 1
    req_to_token = xp.zeros((rows, width), dtype=xp.int32)
    req_to_token[1:] = perm.reshape(copies * case.bs, width).astype(xp.int32)
    del perm
    tokens = (rand_u64(xp, rows * width, seed + 2) % xp.uint64(TOKEN_VOCAB)).astype(xp.int64).reshape(rows, width)
    lut = None
    if case.swa_window:
        lut = xp.zeros(pool + 1, dtype=xp.int64)
        lut[1:pool] = rand_perm(xp, pool - 1, seed + 3) + 1
    kv = [rand_bytes(xp, (pool, case.sources.bytes_per_token * case.sources.page_size), seed + 10 + k)
          for k in range(case.sources.count)] if case.hash_mode != kc.HashMode.NONE else []
    sources = [kc.RealKvSource(tensor=t, page_size=case.sources.page_size,
                               num_bytes_per_token=case.sources.bytes_per_token, read_bytes=case.sources.read_bytes)
               for t in kv]
    ctx = kc.CanaryContext.allocate(pool, device=device, ring_capacity=ring_capacity, real_kv_sources=sources,
                                    hash_mode=case.hash_mode)
    expected_pool = (rand_u64(xp, rows * width, seed + 4) % xp.uint64(TOKEN_VOCAB)).astype(xp.int32)
    expected_pool = expected_pool.reshape(rows, width)

    def tr(slots):
        return lut[slots] if lut is not None else slots

    # Every request's whole sequence (prefix and new tokens) written by the package: one request per
    # pool row, chains anchored at position 0.
    live_rows = rows - 1
    fill_plan = kc.WritePlan(offsets=xp.arange(0, live_rows * width + 1, width, dtype=xp.int64),
                             seed_slot_indices=xp.full(live_rows, -1, dtype=xp.int64),
                             num_valid_reqs=xp.asarray([live_rows], dtype=xp.int32))
    kc.write(ctx, fill_plan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=tokens[1:].reshape(-1),
             positions=xp.tile(xp.arange(width, dtype=xp.int64), live_rows),
             out_cache_loc=tr(req_to_token[1:].reshape(-1).astype(xp.int64)), stream=stream)

    state_copies = []
    for c in range(copies):
        rpi = (1 + c * case.bs + rand_perm(xp, case.bs, seed + 100 + c)).astype(xp.int64)
        prefix_lens = xp.full(case.bs, case.prefix, dtype=xp.int64)
        extend_lens = xp.full(case.bs, case.extend, dtype=xp.int64)
        cols = xp.arange(case.prefix, case.width, dtype=xp.int64)
        ids = tokens[rpi[:, None], cols[None, :]].reshape(-1)
        loc = tr(req_to_token[rpi[:, None], cols[None, :]].reshape(-1).astype(xp.int64))
        positions = xp.tile(cols, case.bs)
        vplan = kc.VerifyPlan.allocate(max(case.n_verify, 1), device=device)
        wplan = kc.WritePlan.allocate(case.bs, device=device)
        state_copies.append(BatchCopy(rpi, prefix_lens, extend_lens, vplan, wplan, xp.ascontiguousarray(ids),
                                      xp.ascontiguousarray(positions), xp.ascontiguousarray(loc),
                                      xp.arange(0, case.n_write + 1, case.extend, dtype=xp.int64)))
    del tokens
    state = EngineState(case, xp, device, ctx, req_to_token, lut, expected_pool, kv, state_copies, pool, stream)
    for i in range(copies):
        state.plan(i)
    check_clean(state)
    return state


def check_clean(state: EngineState) -> None:
    """Every copy's plan holds the case's entries and its HEAD verify finds zero violations."""
    before = state.violations()
    for i, c in enumerate(state.copies):
        state.sync()
        num_valid = int(np.asarray(_host(c.vplan.num_valid))[0])
        enable = int(np.asarray(_host(c.vplan.enable))[0])
        assert enable == 1 and num_valid == state.case.n_verify, (state.case.name, num_valid, enable)
        state.verify(i)
    after = state.violations()
    assert after == before == 0, f"{state.case.name}: HEAD verify of a freshly written state found {after} violations"


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()
