"""Argument bundles of the ops: frozen, self-validating, holding zero-copy native views."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import numpy as np

from .. import _layout as L
from .. import validate as check
from .._dlpack import Device, own_view
from ..context import CanaryContext


def _adopt_arrays(owner: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Device:
    """Native views of the named array fields (an optional one may be ``None``); sets ``owner.device``."""
    devices = check.adopt_views(owner, {name: name for name in required})
    devices.update(check.adopt_views(owner, {name: name for name in optional}, optional=True))
    device = check.one_device(devices)
    object.__setattr__(owner, "device", device)
    return device


def launch_tag(tag: Any, name: str = "tag") -> int:
    return int(check.member(name, tag, L.LaunchTag))


@dataclasses.dataclass(frozen=True)
class WriteBatch:
    """The tokens one write launch stores: ids, positions and destination slots, entry-aligned."""

    tag: int
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    expected_input_tokens: Optional[Any] = None
    expected_input_positions: Optional[Any] = None
    device: Device = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", launch_tag(self.tag))
        check.both_or_neither(("expected_input_tokens", self.expected_input_tokens),
                              ("expected_input_positions", self.expected_input_positions))
        _adopt_arrays(self, ("input_ids", "positions", "out_cache_loc"),
                      ("expected_input_tokens", "expected_input_positions"))
        check.vector("input_ids", self.input_ids, np.int64)
        count = int(self.input_ids.shape[0])
        check.fits_int32("input_ids length", count)
        for name in ("positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions"):
            value = getattr(self, name)
            if value is not None:
                check.vector(name, value, np.int64, count, "one per entry, as input_ids")

    @property
    def num_entries(self) -> int:
        return int(self.input_ids.shape[0])

    def for_group(self, tag: int, out_cache_loc: Any) -> "WriteBatch":
        """This batch for another slot group (an SWA pool): its tag and slots, which the caller has
        checked (a native int64 vector of ``num_entries`` on this device); nothing else is checked
        again."""
        return _copy_with(self, tag=tag, out_cache_loc=out_cache_loc)

    @property
    def has_input_assert(self) -> bool:
        return self.expected_input_tokens is not None


@dataclasses.dataclass(frozen=True)
class PlanBatch:
    """Engine metadata of one forward batch, from which both plans are built."""

    req_pool_indices: Any
    prefix_lens: Any
    extend_seq_lens: Any
    req_to_token: Any
    swa_window_size: int = 0
    full_to_swa_index_mapping: Optional[Any] = None
    req_to_verify_expected_tokens: Optional[Any] = None
    req_to_verify_expected_tokens_valid_lens: Optional[Any] = None
    kv_token_id_vs_position_offset: int = 0
    device: Device = dataclasses.field(init=False, repr=False, compare=False)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> "PlanBatch":
        """The batch from the keyword arguments of a public op that takes it (``kc.plan``,
        ``kc.CanaryStep``): pass the op's ``locals()``."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls) if field.init})

    def __post_init__(self) -> None:
        window = check.non_negative("swa_window_size", check.int64_scalar("swa_window_size", self.swa_window_size))
        object.__setattr__(self, "swa_window_size", window)
        object.__setattr__(self, "kv_token_id_vs_position_offset",
                           check.int64_scalar("kv_token_id_vs_position_offset", self.kv_token_id_vs_position_offset))
        if window > 0 and self.full_to_swa_index_mapping is None:
            raise ValueError(f"{check.PREFIX}full_to_swa_index_mapping is required when swa_window_size > 0, "
                             f"got None with swa_window_size={window}")
        if window == 0 and self.full_to_swa_index_mapping is not None:
            raise ValueError(f"{check.PREFIX}full_to_swa_index_mapping is only used with swa_window_size > 0, "
                             f"got a mapping with swa_window_size={window}")
        check.both_or_neither(("req_to_verify_expected_tokens", self.req_to_verify_expected_tokens),
                              ("req_to_verify_expected_tokens_valid_lens",
                               self.req_to_verify_expected_tokens_valid_lens))
        _adopt_arrays(self, ("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token"),
                      ("full_to_swa_index_mapping", "req_to_verify_expected_tokens",
                       "req_to_verify_expected_tokens_valid_lens"))
        check.vector("req_pool_indices", self.req_pool_indices, np.int64)
        bs = self.batch_size
        check.fits_int32("batch size (req_pool_indices length)", bs)
        check.vector("prefix_lens", self.prefix_lens, np.int64, bs, "one per request, as req_pool_indices")
        check.vector("extend_seq_lens", self.extend_seq_lens, np.int64, bs, "one per request, as req_pool_indices")
        check.table("req_to_token", self.req_to_token, np.int32)
        if self.full_to_swa_index_mapping is not None:
            check.vector("full_to_swa_index_mapping", self.full_to_swa_index_mapping, np.int64)
        if self.req_to_verify_expected_tokens is not None:
            check.table("req_to_verify_expected_tokens", self.req_to_verify_expected_tokens, np.int32)
            check.vector("req_to_verify_expected_tokens_valid_lens", self.req_to_verify_expected_tokens_valid_lens,
                         np.int64, bs, "one per request, as req_pool_indices")

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    def for_window(self, window: int, lut: Any) -> "PlanBatch":
        """This batch for a sliding-window group: its window and LUT, which the caller has checked
        (a positive int64 scalar; a native int64 vector on this device); nothing else is checked
        again."""
        return _copy_with(self, swa_window_size=window, full_to_swa_index_mapping=lut)


def owning(bundle: Any) -> Any:
    """A copy of a validated bundle over views of its own of its arrays (``own_view``), for one kept
    and launched call after call: what was validated stays what its launches read, whatever is
    later done in place to the caller's array objects."""
    return _copy_with(bundle, **{name: own_view(value) for name, value in vars(bundle).items()})


def _copy_with(bundle: Any, **changes: Any) -> Any:
    """A copy of a validated frozen bundle with ``changes`` (already checked by the caller), without
    running its validation again: a session derives a group's bundles from the full group's every
    forward."""
    copy = object.__new__(type(bundle))
    copy.__dict__.update(bundle.__dict__, **changes)
    return copy


@dataclasses.dataclass(frozen=True)
class ScatterBatch:
    """Per-request token ids packed flat, and the pool rows they are copied into."""

    flat_in: Any
    offsets: Any
    req_pool_indices: Any
    pool_out: Any
    device: Device = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _adopt_arrays(self, ("flat_in", "offsets", "req_pool_indices", "pool_out"))
        check.vector("scatter_req_token_ids flat_in", self.flat_in, np.int64)
        check.vector("scatter_req_token_ids req_pool_indices", self.req_pool_indices, np.int64)
        bs = self.batch_size
        check.vector("scatter_req_token_ids offsets", self.offsets, np.int64, bs + 1,
                     "batch size + 1, one more than req_pool_indices")
        check.table("scatter_req_token_ids pool_out", self.pool_out, np.int32)
        check.writable("scatter_req_token_ids pool_out", self.pool_out)
        check.rows_apart("scatter_req_token_ids pool_out", self.pool_out)
        # a pool row over the ids, offsets or rows it is filled from would change them as it is
        # filled: row after row on the CPU, in no fixed order on a GPU
        check.stored_apart({"scatter_req_token_ids pool_out": self.pool_out},
                           {f"scatter_req_token_ids {name}": getattr(self, name)
                            for name in ("flat_in", "offsets", "req_pool_indices")})

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])


@dataclasses.dataclass(frozen=True)
class RecordCopy:
    """Slot records carried pair by pair from one canary (``src``) to another or the same
    (``dst``): ``src_slots`` on the source's device, ``dst_slots`` on the destination's."""

    src: Any
    dst: Any
    src_slots: Any
    dst_slots: Any

    def __post_init__(self) -> None:
        check.instance("src", self.src, CanaryContext)
        check.instance("dst", self.dst, CanaryContext)
        for name, owner in (("src_slots", self.src), ("dst_slots", self.dst)):
            device = check.adopt_views(self, {name: name})[name]
            if device != owner.device:
                raise ValueError(f"{check.PREFIX}{name} must be on the device of {name[:3]}, {owner.device}, "
                                 f"got {device}")
        check.vector("src_slots", self.src_slots, np.int64)
        check.vector("dst_slots", self.dst_slots, np.int64, self.count, "one per pair, as src_slots")
        check.writable("dst canary_buf", self.dst.canary_buf)
        # The slots are read pair by pair while records are stored (in order on the CPU, in no fixed
        # order on a GPU): slots over the destination's buffer would change as the copy reads them.
        read = {"dst_slots": self.dst_slots}
        if self.src.device == self.dst.device:
            read["src_slots"] = self.src_slots
        check.stored_apart({"dst canary_buf": self.dst.canary_buf}, read)
        if self.src.kv_read_lengths != self.dst.kv_read_lengths:
            raise ValueError(
                f"{check.PREFIX}dst must hash the KV bytes of a slot as src does (the bytes each hashed source "
                f"reads, in order), got src {list(self.src.kv_read_lengths)} ({self.src.hash_mode.name}) and "
                f"dst {list(self.dst.kv_read_lengths)} ({self.dst.hash_mode.name})")

    @property
    def count(self) -> int:
        return int(self.src_slots.shape[0])
