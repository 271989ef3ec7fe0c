"""The canary's state (canary buffer, violation ring, counters) and the plans of one forward pass."""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, ClassVar, Iterator, Optional, Sequence

import numpy as np

from . import _layout as L
from . import validate as check
from ._dlpack import (CPU, Device, assign, filled, from_host, parse_device, require_cupy, require_device, settle,
                      to_host)
from .sources import RealKvSource, source_list


def ring_index(write_index) -> int:
    """A ring's int32 write index (a one-cell array, or a copy of one) as a count of rows: past
    2**31 rows the index reads negative, and the count goes on as the unsigned value of its bits."""
    recorded = int(to_host(write_index)[0])
    return recorded if recorded >= 0 else recorded + (1 << 32)


@dataclasses.dataclass(frozen=True)
class Violation:
    """One decoded row of the violation ring."""

    kernel_kind: L.LaunchTag | int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason: L.FailReason

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "Violation":
        kind = int(row[L.RING_COL_KERNEL_KIND])
        try:
            tag: L.LaunchTag | int = L.LaunchTag(kind)
        except ValueError:
            tag = kind
        return cls(tag, *(int(v) for v in row[1:L.RING_COL_FAIL_BITS]),
                   L.FailReason(int(row[L.RING_COL_FAIL_BITS]) & 0x7F))

    def describe(self) -> str:
        tag = tag_name(self.kernel_kind)
        reasons = "|".join(reason_names(self.fail_reason)) or "none"
        return (f"{tag}: slot {self.slot_idx} position {self.position} [{reasons}] "
                f"token stored={self.stored_token} expected={self.expected_token} "
                f"chain stored=0x{self.stored_chain_hash & L.U64_MASK:016x} aux=0x{self.expected_aux & L.U64_MASK:016x}")


def tag_name(tag: L.LaunchTag | int) -> str:
    """A row's launch tag by name, or by number where it is no :class:`LaunchTag`."""
    return tag.name if isinstance(tag, L.LaunchTag) else str(tag)


def reason_names(fail_reason: L.FailReason) -> tuple[str, ...]:
    """The names of the reasons a row's bits hold, in the order :class:`FailReason` lists them."""
    return tuple(flag.name for flag in L.FailReason if flag in fail_reason)


@dataclasses.dataclass(frozen=True)
class ViolationReport(collections.abc.Sequence):
    """What the ring holds: the kept rows, every violation ever counted, and how many were dropped.

    A read-only sequence of its rows (the SPEC's list of ``kc.Violation``: ``len``, indexing, ``in``,
    ``index``); true when any violation was counted, kept or dropped."""

    rows: tuple[Violation, ...]
    total: int
    dropped: int

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Violation]:
        return iter(self.rows)

    def __getitem__(self, index: int) -> Violation:
        return self.rows[index]

    def __bool__(self) -> bool:
        return self.total > 0


# eq=False here and on the plans: a bundle of arrays is its memory, equal and hashed by identity
# (as a RealKvSource is); comparing fields would compare arrays element-wise and raise
@dataclasses.dataclass(frozen=True, eq=False)
class CanaryContext:
    """The canary buffer, violation ring, counters and real-KV sources of one KV pool.

    Build it with :meth:`allocate`, or from your own arrays (any DLPack objects, used in place: it
    keeps views of its own over their memory, so their shape and dtype are read once, here).
    """

    canary_buf: Any
    violation_ring: Any
    violation_write_index: Any
    slot_run_counter: Any
    kernel_run_counter: Any
    chain_position_assert: Any
    real_kv_sources: Sequence[RealKvSource] = ()
    hash_mode: L.HashMode = L.HashMode.NONE  # the SPEC's (§6): sources are hashed when a mode asks
    device: Device = dataclasses.field(init=False, repr=False, compare=False)
    source_table: Any = dataclasses.field(init=False, repr=False, compare=False)
    source_words: tuple = dataclasses.field(init=False, repr=False, compare=False)
    forms: dict = dataclasses.field(init=False, repr=False, compare=False)
    ARRAYS: ClassVar[tuple[str, ...]] = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                                         "kernel_run_counter", "chain_position_assert")
    # What verify stores into (the ring and its counters); write stores into the canary buffer too.
    VERIFY_WRITES: ClassVar[tuple[str, ...]] = ("violation_ring", "violation_write_index", "slot_run_counter",
                                                "kernel_run_counter")
    WRITE_WRITES: ClassVar[tuple[str, ...]] = ("canary_buf",) + VERIFY_WRITES

    def __post_init__(self) -> None:
        names = self.ARRAYS
        devices = check.adopt_views(self, {name: name for name in names}, own=True)
        sources = source_list("real_kv_sources", self.real_kv_sources)
        for index, source in enumerate(sources):
            devices[f"real_kv_sources[{index}].tensor"] = source.device
        device = check.one_device(devices)
        mode = check.member("hash_mode", self.hash_mode, L.HashMode)

        buf = self.canary_buf
        check.dtype("canary_buf", buf, np.uint8)
        check.ndim("canary_buf", buf, 2)
        check.c_contiguous("canary_buf", buf)
        if buf.shape[0] < 1:
            raise ValueError(f"{check.PREFIX}canary_buf must have at least one slot, got shape {tuple(buf.shape)}")
        stride = int(buf.shape[1])
        if stride < L.MIN_SLOT_STRIDE_BYTES or stride % L.SLOT_WORD_BYTES:
            raise ValueError(f"{check.PREFIX}canary_buf slot_stride_bytes (shape[1]) must be >= 32 and a multiple "
                             f"of 8, got {stride}")
        check.aligned("canary_buf", buf, L.SLOT_WORD_BYTES)
        ring = self.violation_ring
        check.dtype("violation_ring", ring, np.int64)
        check.ndim("violation_ring", ring, 2)
        check.c_contiguous("violation_ring", ring)
        check.elements_aligned("violation_ring", ring)
        if ring.shape[1] != L.RING_COLUMNS:
            raise ValueError(f"{check.PREFIX}violation_ring must have {L.RING_COLUMNS} columns, got shape "
                             f"{tuple(ring.shape)}")
        check.fits_int32("violation_ring capacity", int(ring.shape[0]))
        check.slot_count("canary_buf num_slots", int(buf.shape[0]))  # allocate's rule, the slots as received
        check.scalar_cell("violation_write_index", self.violation_write_index, np.int32)
        check.scalar_cell("slot_run_counter", self.slot_run_counter, np.int64)
        check.scalar_cell("kernel_run_counter", self.kernel_run_counter, np.int64)
        check.scalar_cell("chain_position_assert", self.chain_position_assert, np.int32)
        for name in names:
            check.writable(name, getattr(self, name))
        check.apart({name: getattr(self, name) for name in names})
        # the sources are read while the canary buffer and the ring are stored into (on a GPU by
        # other threads, in no fixed order): a source over either would hash what the ops store
        check.stored_apart({name: getattr(self, name) for name in names},
                           {f"real_kv_sources[{index}].tensor": source._native for index, source in enumerate(sources)})

        hashed = sources if mode != L.HashMode.NONE else ()
        descriptors = np.array([s.descriptor(mode) for s in hashed], dtype=np.int64).reshape(
            len(hashed), L.SOURCE_DESCRIPTOR_WORDS)
        words = tuple(s.host_words() for s in hashed) if not device.is_cuda else ()
        for name, value in (("real_kv_sources", sources), ("hash_mode", mode), ("device", device),
                            ("source_table", from_host(descriptors, device)), ("source_words", words)):
            object.__setattr__(self, name, value)
        _remember_forms(self)
        # The source table's upload (and the fills of arrays from allocate) are queued on the
        # current stream; an op launched next on a stream that does not wait for it must find them.
        settle(device)

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def allocate(cls, num_slots: int, *, device: Any = "cpu", ring_capacity: int = 1024,
                 slot_stride_bytes: int = L.MIN_SLOT_STRIDE_BYTES,
                 real_kv_sources: Sequence[RealKvSource] = (), hash_mode: L.HashMode = L.HashMode.NONE,
                 chain_position_assert: bool = False) -> "CanaryContext":
        """A zeroed canary for a pool of ``num_slots`` KV slots (slot 0 is the padding slot). As in
        the SPEC, ``hash_mode`` defaults to NONE: pass PARTIAL or ALL to hash ``real_kv_sources``
        (``kc.Canary``, the session, defaults to PARTIAL)."""
        # Every size is checked before anything is allocated.
        num_slots = check.slot_count("num_slots", num_slots)
        ring_capacity = check.fits_int32("ring_capacity", check.non_negative("ring_capacity", ring_capacity))
        slot_stride_bytes = check.fits_int32(
            "slot_stride_bytes", check.at_least("slot_stride_bytes", slot_stride_bytes, L.MIN_SLOT_STRIDE_BYTES))
        if slot_stride_bytes % L.SLOT_WORD_BYTES:
            raise ValueError(f"{check.PREFIX}slot_stride_bytes must be a multiple of 8, got {slot_stride_bytes}")
        assert_flag = 1 if check.boolean("chain_position_assert", chain_position_assert) else 0
        mode = check.member("hash_mode", hash_mode, L.HashMode)
        sources = source_list("real_kv_sources", real_kv_sources)
        where = parse_device(device)
        require_device(where)
        return cls(
            canary_buf=filled((num_slots, slot_stride_bytes), np.uint8, where),
            violation_ring=filled((ring_capacity, L.RING_COLUMNS), np.int64, where),
            violation_write_index=filled((1,), np.int32, where),
            slot_run_counter=filled((1,), np.int64, where),
            kernel_run_counter=filled((1,), np.int64, where),
            chain_position_assert=filled((1,), np.int32, where, fill=assert_flag),
            real_kv_sources=sources,
            hash_mode=mode,
        )

    # --- facts ----------------------------------------------------------------------------------
    @property
    def kv_read_lengths(self) -> tuple[int, ...]:
        """The bytes of each slot that each hashed source folds into its real-KV hash (empty when
        nothing is hashed): two canaries whose lengths agree hash the same KV bytes alike."""
        lengths = (source.read_length(self.hash_mode) for source in self.real_kv_sources)
        return tuple(length for length in lengths if length)

    @property
    def num_slots(self) -> int:
        return int(self.canary_buf.shape[0])

    @property
    def slot_stride_bytes(self) -> int:
        return int(self.canary_buf.shape[1])

    @property
    def ring_capacity(self) -> int:
        return int(self.violation_ring.shape[0])

    # --- host side (these synchronise) -----------------------------------------------------------
    def violations(self) -> ViolationReport:
        """Decode the ring on the host. On a GPU this waits for the work queued so far on every
        stream of the context's device (launches on a non-blocking stream included)."""
        self._wait_for_device()
        total = self._recorded()
        kept = min(total, self.ring_capacity)
        rows = to_host(self.violation_ring[:kept]) if kept else np.zeros((0, L.RING_COLUMNS), np.int64)
        return ViolationReport(tuple(Violation.from_row(r) for r in rows.tolist()), total, total - kept)

    def counters(self) -> dict[str, int]:
        """``slot_run_counter`` and ``kernel_run_counter`` (counted since the context was built) and
        ``violations``, the rows recorded since the ring was last cleared, on the host."""
        self._wait_for_device()
        return {
            "slot_run_counter": int(to_host(self.slot_run_counter)[0]),
            "kernel_run_counter": int(to_host(self.kernel_run_counter)[0]),
            "violations": self._recorded(),
        }

    def _recorded(self) -> int:
        """The rows recorded since the ring was last cleared (:func:`ring_index`)."""
        return ring_index(self.violation_write_index)

    def _wait_for_device(self) -> None:
        if self.device.is_cuda:
            cupy = require_cupy("device")
            cupy.cuda.Device(self.device.index).synchronize()

    def clear_violations(self) -> None:
        """Empty the ring (rows and write index); counters are kept. Done when this returns, for an
        op launched next on any stream."""
        require_intact(self, ("violation_ring", "violation_write_index"))
        assign(self.violation_ring, 0, self.device)
        assign(self.violation_write_index, 0, self.device)
        settle(self.device)

    def set_chain_position_assert(self, enabled: bool) -> None:
        """Flip the device flag; CUDA graphs captured earlier see the new value. Done when this
        returns, for an op launched next on any stream."""
        flag = 1 if check.boolean("enabled", enabled) else 0
        require_intact(self, ("chain_position_assert",))
        assign(self.chain_position_assert, flag, self.device)
        settle(self.device)

    def slot_fields(self, slot: int) -> dict[str, int]:
        """The four stored fields of one slot, read on the host once the work queued on every stream
        of the context's device is done (as :meth:`violations` waits)."""
        slot = self._slot_in_range(slot)
        self._wait_for_device()
        return self._slot_fields(slot)

    def _slot_fields(self, slot: int) -> dict[str, int]:
        """:meth:`slot_fields` without the wait, for a caller that has waited for the device (a poll)."""
        slot = self._slot_in_range(slot)
        words = to_host(self.canary_buf[slot, :L.MIN_SLOT_STRIDE_BYTES]).view(np.int64)
        return {"token": int(words[L.FIELD_TOKEN]), "position": int(words[L.FIELD_POSITION]),
                "prev_hash": int(words[L.FIELD_PREV_HASH]), "real_kv_hash": int(words[L.FIELD_REAL_KV_HASH])}

    def _slot_in_range(self, slot: Any) -> int:
        slot = check.integer("slot", slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{check.PREFIX}slot must be in [0, {self.num_slots}), got {slot}")
        return slot


def _form(array: Any) -> tuple:
    return array.shape, array.strides, array.dtype


def _remember_forms(bundle) -> None:
    """Keep the form (shape, strides, dtype) of each of ``bundle``'s arrays, as validated."""
    object.__setattr__(bundle, "forms", {name: _form(getattr(bundle, name)) for name in bundle.ARRAYS})


def require_intact(bundle, writes: Optional[Sequence[str]] = None) -> None:
    """An op's rules for a bundle validated once and used call after call, checked every call:
    each of its arrays keeps the shape, strides and dtype it was validated with (its own views,
    but reachable through its attributes: one reshaped or re-typed in place would have a kernel
    read or write past it), and those it stores into (``writes``; default: a plan's every array,
    which the plan op stores into; ``()``: none) are writable (one can be made read-only after it
    was built). Messages are formatted only for a refusal."""
    for name, form in bundle.forms.items():
        array = getattr(bundle, name)
        if _form(array) != form:
            shape, strides, dtype = form
            raise ValueError(f"{check.PREFIX}{type(bundle).__name__}.{name} must keep the shape, strides and dtype "
                             f"it was validated with ({tuple(shape)}, {tuple(strides)}, {dtype}), got "
                             f"{tuple(array.shape)}, {tuple(array.strides)}, {array.dtype}: changed in place")
    for name in bundle.ARRAYS if writes is None else writes:
        array = getattr(bundle, name)
        if isinstance(array, np.ndarray) and not array.flags.writeable:
            check.writable(f"{type(bundle).__name__}.{name}", array)


@dataclasses.dataclass(frozen=True, eq=False)
class VerifyPlan:
    """Which slots a verify launch checks, and against what."""

    slot_indices: Any
    expected_tokens: Any
    expected_positions: Any
    prev_slot_indices: Any
    num_valid: Any
    enable: Any
    device: Device = dataclasses.field(init=False, repr=False, compare=False)
    forms: dict = dataclasses.field(init=False, repr=False, compare=False)

    ARRAYS: ClassVar[tuple[str, ...]] = ("slot_indices", "expected_tokens", "expected_positions",
                                         "prev_slot_indices", "num_valid", "enable")

    def __post_init__(self) -> None:
        names = self.ARRAYS
        devices = check.adopt_views(self, {n: f"VerifyPlan.{n}" for n in names}, own=True)
        object.__setattr__(self, "device", check.one_device(devices))
        check.vector("VerifyPlan.slot_indices", self.slot_indices, np.int64)
        capacity = int(self.slot_indices.shape[0])
        check.fits_int32("VerifyPlan capacity", capacity)
        for name in names[1:4]:
            check.vector(f"VerifyPlan.{name}", getattr(self, name), np.int64, capacity,
                         "the plan's capacity, as slot_indices")
        check.scalar_cell("VerifyPlan.num_valid", self.num_valid, np.int32)
        check.scalar_cell("VerifyPlan.enable", self.enable, np.int32)
        check.apart({f"VerifyPlan.{name}": getattr(self, name) for name in names})
        _remember_forms(self)

    @classmethod
    def allocate(cls, capacity: int, *, device: Any = "cpu") -> "VerifyPlan":
        capacity = check.fits_int32("verify_capacity", check.non_negative("verify_capacity", capacity))
        where = parse_device(device)
        require_device(where)
        plan = cls(*(filled((capacity,), np.int64, where) for _ in range(4)),
                   num_valid=filled((1,), np.int32, where), enable=filled((1,), np.int32, where))
        settle(where)
        return plan

    @property
    def capacity(self) -> int:
        return int(self.slot_indices.shape[0])


@dataclasses.dataclass(frozen=True, eq=False)
class WritePlan:
    """Per-request entry ranges and chain seeds of a write launch."""

    offsets: Any
    seed_slot_indices: Any
    num_valid_reqs: Any
    device: Device = dataclasses.field(init=False, repr=False, compare=False)
    forms: dict = dataclasses.field(init=False, repr=False, compare=False)

    ARRAYS: ClassVar[tuple[str, ...]] = ("offsets", "seed_slot_indices", "num_valid_reqs")

    def __post_init__(self) -> None:
        names = self.ARRAYS
        devices = check.adopt_views(self, {n: f"WritePlan.{n}" for n in names}, own=True)
        object.__setattr__(self, "device", check.one_device(devices))
        check.vector("WritePlan.seed_slot_indices", self.seed_slot_indices, np.int64)
        capacity = int(self.seed_slot_indices.shape[0])
        check.fits_int32("WritePlan capacity", capacity)
        check.vector("WritePlan.offsets", self.offsets, np.int64, capacity + 1,
                     "capacity + 1, one more than seed_slot_indices")
        check.scalar_cell("WritePlan.num_valid_reqs", self.num_valid_reqs, np.int32)
        check.apart({f"WritePlan.{name}": getattr(self, name) for name in names})
        _remember_forms(self)

    @classmethod
    def allocate(cls, req_capacity: int, *, device: Any = "cpu") -> "WritePlan":
        capacity = check.fits_int32("write_req_capacity", check.non_negative("write_req_capacity", req_capacity))
        where = parse_device(device)
        require_device(where)
        plan = cls(offsets=filled((capacity + 1,), np.int64, where),
                   seed_slot_indices=filled((capacity,), np.int64, where, fill=L.NO_PREDECESSOR),
                   num_valid_reqs=filled((1,), np.int32, where))
        settle(where)
        return plan

    @classmethod
    def from_host(cls, *, offsets, seed_slot_indices, num_valid_reqs: int, device: Any = CPU) -> "WritePlan":
        """A plan built on the host (tests, tools) and copied to ``device``."""
        where = parse_device(device)
        require_device(where)
        num_valid_reqs = check.int32_scalar("num_valid_reqs", num_valid_reqs)
        # copied on the CPU too: the caller's array may be unaligned or read-only, and a plan over it
        # would change with it (and store into it), where a GPU's copy does not
        plan = cls(offsets=from_host(check.host_int64("offsets", offsets).copy(), where),
                   seed_slot_indices=from_host(check.host_int64("seed_slot_indices", seed_slot_indices).copy(), where),
                   num_valid_reqs=from_host(np.array([num_valid_reqs], dtype=np.int32), where))
        settle(where)
        return plan

    @property
    def capacity(self) -> int:
        return int(self.seed_slot_indices.shape[0])
