"""Random engine batches and end-to-end plan -> write -> verify runs through the public API.

A batch is what a serving engine would hand the canary: a pool of KV slots, a ``req_to_token`` table
whose rows hold each request's slots (a random permutation of the pool, so neighbouring positions
never sit in neighbouring slots), prefix and extend lengths, and per-position token ids. Real-KV
sources are filled with random non-zero bytes so a zero fold can never pass by accident.

Everything here is built with NumPy on the host and moved to the backend under test with
``to_device``; results are read back with ``to_numpy``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import _layout as L
from kvcanary_cupy import reference as ref
from _devices import to_device, to_numpy

MASK = (1 << 64) - 1
ANCHOR_LINK = ref.sm(L.CHAIN_ANCHOR)
BIT = kc.FailReason


def signed(value: int) -> int:
    value &= MASK
    return value - (1 << 64) if value >> 63 else value


def unsigned(value: int) -> int:
    return value & MASK


# --- canary buffer inspection ------------------------------------------------------------------

def slot_words(buf) -> np.ndarray:
    """``int64 [num_slots, stride // 8]`` host copy of a canary buffer."""
    return np.ascontiguousarray(to_numpy(buf)).view(np.int64)


def fields(buf, slot: int) -> tuple[int, int, int, int]:
    """``(token, position, prev_hash, real_kv_hash)`` of one slot, signed."""
    w = slot_words(buf)[slot]
    return int(w[0]), int(w[1]), int(w[2]), int(w[3])


def link_of(buf, slot: int) -> int:
    """The chain link of ``slot`` (signed int64 value, as stored in the buffer)."""
    if slot < 0:
        return signed(ANCHOR_LINK)
    token, position, prev_hash, _ = fields(buf, slot)
    return signed(ref.mix3(prev_hash, token, position))


def ring_rows(ctx: kc.CanaryContext) -> list[tuple[int, ...]]:
    """The kept ring rows as plain tuples ``(kind, slot, pos, tok, exp_tok, chain, aux, bits)``."""
    report = ctx.violations()
    return [(int(v.kernel_kind), v.slot_idx, v.position, v.stored_token, v.expected_token, v.stored_chain_hash,
             v.expected_aux, int(v.fail_reason)) for v in report]


def session_capacities(rows: int, width: int, slots: int, max_prefill_tokens: int,
                       verify_capacity: Optional[int] = None) -> kc.Capacities:
    """An engine's capacities (``Capacities.from_args``), with a smaller verify capacity where the
    test overflows it."""
    caps = kc.Capacities.from_args(req_to_token_pool_size=rows, max_seq_len_per_req=width, pool_slot_count=slots,
                                   max_prefill_tokens=max_prefill_tokens)
    if verify_capacity is None:
        return caps
    return kc.Capacities(caps.max_bs, verify_capacity, caps.write_req_capacity, caps.write_entry_capacity)


def snapshot(*arrays) -> list[np.ndarray]:
    return [to_numpy(a).copy() for a in arrays]


def context_arrays(ctx: kc.CanaryContext) -> list:
    return [ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.slot_run_counter,
            ctx.kernel_run_counter, ctx.chain_position_assert]


def plan_arrays(vplan: kc.VerifyPlan, wplan: kc.WritePlan) -> list:
    return [vplan.slot_indices, vplan.expected_tokens, vplan.expected_positions, vplan.prev_slot_indices,
            vplan.num_valid, vplan.enable, wplan.offsets, wplan.seed_slot_indices, wplan.num_valid_reqs]


# --- real-KV sources ---------------------------------------------------------------------------

@dataclasses.dataclass
class SourceSpec:
    """A host array of random non-zero bytes laid out as a real-KV source (possibly strided)."""

    array: np.ndarray  # uint8 [rows, page_size * bytes_per_token], a view into a padded parent when strided
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def build(self, device: str) -> kc.RealKvSource:
        return kc.RealKvSource(tensor=to_device(self.array, device, keep_strides=True), page_size=self.page_size,
                               num_bytes_per_token=self.num_bytes_per_token, read_bytes=self.read_bytes)

    def window(self, slot: int, length: int) -> np.ndarray:
        """The host bytes slot ``slot`` reads (a writable view into ``array``)."""
        row, column = divmod(slot, self.page_size)
        start = column * self.num_bytes_per_token
        return self.array[row, start:start + length]

    def reference_tuple(self, mode: kc.HashMode):
        length = L.PARTIAL_READ_BYTES if mode == kc.HashMode.PARTIAL else self.read_bytes
        return (self.array, self.page_size, self.num_bytes_per_token, length)


def random_source(rng: np.random.Generator, num_slots: int, *, page_size: int = 1, num_bytes_per_token: int = 32,
                  read_bytes: Optional[int] = None, pad_bytes: int = 0, extra_rows: int = 0) -> SourceSpec:
    """Enough rows for ``num_slots`` slots (plus ``extra_rows``); ``pad_bytes`` (a multiple of 16)
    of trailing row padding makes the rows strided."""
    rows = -(-num_slots // page_size) + extra_rows
    row_bytes = page_size * num_bytes_per_token
    parent = rng.integers(1, 256, size=(rows, row_bytes + pad_bytes), dtype=np.uint8)
    array = parent[:, :row_bytes] if pad_bytes else parent
    return SourceSpec(array, page_size, num_bytes_per_token,
                      num_bytes_per_token if read_bytes is None else read_bytes)


def expected_kv_hash(specs: Sequence[SourceSpec], mode: kc.HashMode, slot: int) -> int:
    """``real_kv_hash`` of ``slot`` computed straight from SPEC §2 on the host bytes (signed)."""
    if mode == kc.HashMode.NONE or not specs:
        return 0
    acc = 0
    for spec in specs:
        length = L.PARTIAL_READ_BYTES if mode == kc.HashMode.PARTIAL else spec.read_bytes
        row = slot // spec.page_size
        data = spec.window(slot, length).tobytes() if row < spec.array.shape[0] else None
        folded = 0
        if data is not None:
            for offset in range(0, len(data), 8):
                folded = ref.sm(folded ^ int.from_bytes(data[offset:offset + 8], "little"))
        acc = ref.sm(acc ^ folded)
    return signed(acc)


# --- engine batches ----------------------------------------------------------------------------

@dataclasses.dataclass
class EngineBatch:
    """One forward batch of an engine plus the ground truth of every request's tokens."""

    num_slots: int
    req_pool_indices: np.ndarray  # int64 [bs]; 0 marks a padding request
    prefix_lens: np.ndarray  # int64 [bs]
    extend_lens: np.ndarray  # int64 [bs]
    req_to_token: np.ndarray  # int32 [rows, width]
    tokens: np.ndarray  # int32 [rows, width], the token id at each (pool row, position)

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prefix_lens + self.extend_lens

    def live(self) -> list[int]:
        return [r for r in range(self.bs) if self.req_pool_indices[r] != 0]

    def slot(self, r: int, pos: int) -> int:
        return int(self.req_to_token[self.req_pool_indices[r], pos])

    def token(self, r: int, pos: int) -> int:
        return int(self.tokens[self.req_pool_indices[r], pos])

    def entries(self, starts: np.ndarray, lengths: np.ndarray, table: Optional[np.ndarray] = None):
        """``(input_ids, positions, out_cache_loc)`` of positions ``[starts[r], starts[r] + lengths[r])``
        of every non-padding request, in request order (what the write plan's offsets index)."""
        table = self.req_to_token if table is None else table
        ids, pos, loc = [], [], []
        for r in range(self.bs):
            rp = int(self.req_pool_indices[r])
            if rp == 0 or lengths[r] <= 0:
                continue
            for p in range(int(starts[r]), int(starts[r] + lengths[r])):
                ids.append(int(self.tokens[rp, p]))
                pos.append(p)
                loc.append(int(table[rp, p]))
        as64 = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
        return as64(ids), as64(pos), as64(loc)


def random_batch(rng: np.random.Generator, *, bs: int = 4, max_prefix: int = 12, max_extend: int = 6,
                 min_prefix: int = 0, min_extend: int = 1, spare_slots: int = 5, spare_rows: int = 2,
                 padding_requests: int = 0, width: Optional[int] = None) -> EngineBatch:
    """``bs`` live requests in distinct random pool rows (row 0 stays the padding row) whose
    positions are spread over a random permutation of the pool; ``padding_requests`` extra entries
    point at row 0 with non-zero lengths that must be ignored."""
    prefix = rng.integers(min_prefix, max_prefix + 1, size=bs)
    extend = rng.integers(min_extend, max_extend + 1, size=bs)
    lens = prefix + extend
    width = int(max(lens.max(initial=0), 1)) + 2 if width is None else width
    rows = 1 + bs + spare_rows
    total = int(lens.sum())
    num_slots = 1 + total + spare_slots
    slots = rng.permutation(np.arange(1, num_slots))
    req_to_token = np.zeros((rows, width), dtype=np.int32)
    tokens = np.zeros((rows, width), dtype=np.int32)
    pool_rows = rng.permutation(np.arange(1, rows))[:bs]
    used = 0
    for r in range(bs):
        n = int(lens[r])
        req_to_token[pool_rows[r], :n] = slots[used:used + n]
        tokens[pool_rows[r], :n] = rng.integers(1, 2**31 - 1, size=n)
        used += n
    rpi = list(pool_rows)
    pre, ext = list(prefix), list(extend)
    for _ in range(padding_requests):
        at = int(rng.integers(0, len(rpi) + 1))
        rpi.insert(at, 0)
        pre.insert(at, int(rng.integers(1, 4)))
        ext.insert(at, int(rng.integers(1, 4)))
    as64 = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
    return EngineBatch(num_slots, as64(rpi), as64(pre), as64(ext), req_to_token, tokens)


# --- end to end ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Pipeline:
    """A context, both plans and one batch on one backend, driven through the public API."""

    batch: EngineBatch
    device: str
    ctx: kc.CanaryContext
    vplan: kc.VerifyPlan
    wplan: kc.WritePlan
    sources: list[SourceSpec]
    hash_mode: kc.HashMode

    def put(self, array: np.ndarray):
        return to_device(np.ascontiguousarray(array), self.device)

    def plan(self, prefix_lens=None, extend_lens=None, *, req_to_token=None, expected: bool = False,
             token_offset: int = 0, valid_lens=None, **kwargs) -> None:
        b = self.batch
        prefix_lens = b.prefix_lens if prefix_lens is None else np.asarray(prefix_lens, dtype=np.int64)
        extend_lens = b.extend_lens if extend_lens is None else np.asarray(extend_lens, dtype=np.int64)
        if expected:
            kwargs["req_to_verify_expected_tokens"] = self.put(b.tokens)
            lens = b.seq_lens if valid_lens is None else np.asarray(valid_lens, dtype=np.int64)
            kwargs["req_to_verify_expected_tokens_valid_lens"] = self.put(lens)
            kwargs["kv_token_id_vs_position_offset"] = token_offset
        kc.plan(self.vplan, self.wplan, req_pool_indices=self.put(b.req_pool_indices),
                prefix_lens=self.put(prefix_lens), extend_seq_lens=self.put(extend_lens),
                req_to_token=self.put(b.req_to_token if req_to_token is None else req_to_token), **kwargs)

    def write(self, prefix_lens=None, extend_lens=None, *, tag=kc.LaunchTag.HEAD_K_FULL, with_expected=False,
              table=None, **plan_kwargs) -> None:
        """Plan, then write positions ``[prefix, prefix + extend)`` of every request."""
        b = self.batch
        prefix_lens = b.prefix_lens if prefix_lens is None else np.asarray(prefix_lens, dtype=np.int64)
        extend_lens = b.extend_lens if extend_lens is None else np.asarray(extend_lens, dtype=np.int64)
        self.plan(prefix_lens, extend_lens, **plan_kwargs)
        ids, pos, loc = b.entries(prefix_lens, extend_lens, table)
        extra = {}
        if with_expected:
            extra = dict(expected_input_tokens=self.put(ids), expected_input_positions=self.put(pos))
        kc.write(self.ctx, self.wplan, tag=tag, input_ids=self.put(ids), positions=self.put(pos),
                 out_cache_loc=self.put(loc), **extra)

    def fill(self) -> None:
        """Write every request's prefix, then its extend, as two forward passes."""
        b = self.batch
        self.write(np.zeros(b.bs, np.int64), b.prefix_lens)
        self.write()

    def verify_all(self, *, tag=kc.LaunchTag.TAIL_K_FULL, check_expected_token=False, **plan_kwargs) -> None:
        """Plan with every written token as prefix, then verify it."""
        b = self.batch
        self.plan(b.seq_lens, np.zeros(b.bs, np.int64), **plan_kwargs)
        kc.verify(self.ctx, self.vplan, tag=tag, check_expected_token=check_expected_token)


def pipeline(batch: EngineBatch, device: str, *, hash_mode: kc.HashMode = kc.HashMode.NONE,
             sources: Sequence[SourceSpec] = (), ring_capacity: int = 256, verify_capacity: Optional[int] = None,
             chain_position_assert: bool = False, slot_stride_bytes: int = 32,
             num_slots: Optional[int] = None) -> Pipeline:
    ctx = kc.CanaryContext.allocate(batch.num_slots if num_slots is None else num_slots, device=device,
                                    ring_capacity=ring_capacity, slot_stride_bytes=slot_stride_bytes,
                                    real_kv_sources=tuple(s.build(device) for s in sources), hash_mode=hash_mode,
                                    chain_position_assert=chain_position_assert)
    capacity = int(batch.seq_lens.sum()) + 8 if verify_capacity is None else verify_capacity
    return Pipeline(batch, device, ctx, kc.VerifyPlan.allocate(capacity, device=device),
                    kc.WritePlan.allocate(batch.bs + 2, device=device), list(sources), hash_mode)


def host_verify_plan(slots, expected_tokens, expected_positions, prev_slots, *, num_valid=None, enable=1,
                     device="cpu") -> kc.VerifyPlan:
    """A verify plan written by hand (tests of verify alone)."""
    as64 = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    n = len(slots) if num_valid is None else num_valid
    return kc.VerifyPlan(slot_indices=as64(slots), expected_tokens=as64(expected_tokens),
                         expected_positions=as64(expected_positions), prev_slot_indices=as64(prev_slots),
                         num_valid=to_device(np.array([n], np.int32), device),
                         enable=to_device(np.array([enable], np.int32), device))


def guarded_context(device, rng, num_slots, guard_rows=2, **kwargs):
    """A context over the caller's arrays whose ring has no row and whose every array is a view into
    a larger buffer of random values: a store outside a view changes the buffer around it."""
    put = lambda a: to_device(np.ascontiguousarray(a), device)  # noqa: E731
    backings = dict(
        canary_buf=put(rng.integers(0, 256, size=(num_slots + 2 * guard_rows, 32), dtype=np.uint8)),
        violation_ring=put(rng.integers(-2**62, 2**62, size=(2 * guard_rows, 8), dtype=np.int64)),
        violation_write_index=put(rng.integers(-2**30, 2**30, size=3, dtype=np.int32)),
        slot_run_counter=put(rng.integers(-2**62, 2**62, size=3, dtype=np.int64)),
        kernel_run_counter=put(rng.integers(-2**62, 2**62, size=3, dtype=np.int64)),
        chain_position_assert=put(np.array([7, 1, 9], np.int32)))
    before = {name: to_numpy(b).copy() for name, b in backings.items()}
    views = dict(canary_buf=backings["canary_buf"][guard_rows:guard_rows + num_slots],
                 violation_ring=backings["violation_ring"][guard_rows:guard_rows])
    for name in ("violation_write_index", "slot_run_counter", "kernel_run_counter", "chain_position_assert"):
        views[name] = backings[name][1:2]
    views["violation_write_index"][...] = 0
    views["slot_run_counter"][...] = 0
    views["kernel_run_counter"][...] = 0
    for name in ("violation_write_index", "slot_run_counter", "kernel_run_counter"):
        before[name][1] = 0
    ctx = kc.CanaryContext(**views, **kwargs)
    return ctx, backings, before


def assert_only_views_changed(backings, before, guard_rows=2):
    """Every cell outside the context's views holds what it held before."""
    buf = to_numpy(backings["canary_buf"])
    assert np.array_equal(buf[:guard_rows], before["canary_buf"][:guard_rows])
    assert np.array_equal(buf[-guard_rows:], before["canary_buf"][-guard_rows:])
    assert np.array_equal(to_numpy(backings["violation_ring"]), before["violation_ring"])
    for name in ("violation_write_index", "slot_run_counter", "kernel_run_counter", "chain_position_assert"):
        got = to_numpy(backings[name])
        assert (got[0], got[2]) == (before[name][0], before[name][2]), name


def as_multiset(rows) -> dict:
    counts: dict = {}
    for row in rows:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts


def assert_rows(device: str, got, expected) -> None:
    """Ring rows in order on the CPU; as a multiset on a GPU (row order within a launch is unspecified)."""
    if device == "cpu":
        assert list(got) == list(expected)
    else:
        assert as_multiset(got) == as_multiset(expected)


class DLPackOnly:
    """An array as a framework the package does not know hands it: nothing but the DLPack
    protocol (``__dlpack__``, ``__dlpack_device__``), no NumPy- or torch-style ``dtype`` or ``shape``."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class Unprintable:
    """An engine's request object that cannot be shown: its ``__repr__`` and ``__str__`` raise, or
    (``returns``) give something other than a str."""

    def __init__(self, name: str, returns=None):
        self.name = name
        self.returns = returns

    def __repr__(self):
        if self.returns is None:
            raise RuntimeError(f"request {self.name} cannot be shown")
        return self.returns

    __str__ = __repr__

    def __eq__(self, other):
        return isinstance(other, Unprintable) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


def one_forward(canary: kc.Canary, batch: kc.ForwardBatch) -> None:
    """An eager forward of ``batch`` with nothing between its verify and its write: its
    ``before_forward`` and its ``after_forward``."""
    canary.before_forward(batch)
    canary.after_forward(batch)


def replay_by_mistake(forward: kc.StaticForward) -> None:
    """What a graph captured from ``forward`` before its ``close()`` does when replayed: its
    launches, with nothing logged or noted on the host (the CPU backend captures no graph)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kc.session.StaticForward, "_refuse_if_closed", lambda self, method: None)
        patch.setattr(kc.session.StaticForward, "_log", lambda *args, **kwargs: None)
        patch.setattr(kc.session.Canary, "_note_where_the_log_stops", lambda *args, **kwargs: None)
        forward.before()
        forward.after()
