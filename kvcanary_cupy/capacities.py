"""Plan capacities derived from an engine's configuration (SPEC §3.5)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import _layout as L
from . import validate as check

_VERIFY_ENTRY_BYTES = 4 * 8  # slot, expected token, expected position, predecessor (int64 each)
_WRITE_REQ_BYTES = 2 * 8  # offset and seed slot (int64 each); offsets has one extra cell
_CELL_BYTES = 4  # an int32 device cell (num_valid, enable, num_valid_reqs)
PREFIX_SHARING_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class Capacities:
    """How large the verify and write plans must be for an engine's limits.

    ``verify_capacity`` bounds a forward's verify entries (past it the verify is skipped and
    counted, SPEC 3.3) and ``write_req_capacity`` its requests (past it a batch is refused).
    ``write_entry_capacity`` is the SPEC's figure for engines that stage a forward's new tokens in a
    buffer of their own; here a write reads the batch's own arrays, so it limits nothing."""

    max_bs: int
    verify_capacity: int
    write_req_capacity: int
    write_entry_capacity: int

    def __post_init__(self) -> None:
        for name in ("max_bs", "verify_capacity", "write_req_capacity", "write_entry_capacity"):
            value = check.non_negative(name, getattr(self, name))
            # kept as a Python int: a NumPy integer would wrap in the byte counts below
            object.__setattr__(self, name, check.fits_int32(name, value))

    @classmethod
    def from_args(cls, *, req_to_token_pool_size: int, max_seq_len_per_req: int, pool_slot_count: int,
                  max_prefill_tokens: int, cuda_graph_max_bs: int = 0, speculative_num_draft_tokens: int = 0,
                  chunked_prefill_size: Optional[int] = None) -> "Capacities":
        """Capacities for an engine, as SPEC §3.5 derives them: ``max_bs`` and ``write_req_capacity``
        (the most requests a forward may hold) are the larger of ``req_to_token_pool_size`` (the rows
        of ``req_to_token``) and ``cuda_graph_max_bs``; ``verify_capacity`` is three times
        ``pool_slot_count``; ``write_entry_capacity`` is the larger of ``max_bs`` times the draft
        tokens and the prefill chunk. ``chunked_prefill_size`` of ``None`` or ``<= 0`` means no
        chunking. ``max_seq_len_per_req`` is checked (a positive int) but sizes nothing."""
        pool_rows = check.positive("req_to_token_pool_size", req_to_token_pool_size)
        check.positive("max_seq_len_per_req", max_seq_len_per_req)
        slots = check.positive("pool_slot_count", pool_slot_count)
        prefill = check.positive("max_prefill_tokens", max_prefill_tokens)
        graph_bs = check.non_negative("cuda_graph_max_bs", cuda_graph_max_bs)
        drafts = check.non_negative("speculative_num_draft_tokens", speculative_num_draft_tokens)
        if chunked_prefill_size is not None:
            chunked_prefill_size = check.integer("chunked_prefill_size", chunked_prefill_size)
        chunk = prefill if chunked_prefill_size is None or chunked_prefill_size <= 0 else min(
            prefill, chunked_prefill_size)
        max_bs = max(graph_bs, pool_rows)
        # Each derived capacity must fit in int32: name the argument that breaks it.
        for derived, limit, argument, value in (
                ("verify_capacity = 3 * pool_slot_count", L.INT32_MAX // PREFIX_SHARING_FACTOR,
                 "pool_slot_count", slots),
                ("max_bs = max(cuda_graph_max_bs, req_to_token_pool_size)", L.INT32_MAX,
                 "cuda_graph_max_bs" if graph_bs >= pool_rows else "req_to_token_pool_size", max_bs),
                ("write_entry_capacity = max_bs * speculative_num_draft_tokens", L.INT32_MAX // max_bs,
                 "speculative_num_draft_tokens", drafts),
                ("write_entry_capacity = the prefill chunk", L.INT32_MAX,
                 "max_prefill_tokens" if chunk == prefill else "chunked_prefill_size", chunk)):
            if value > limit:
                raise ValueError(f"{check.PREFIX}{argument} must be <= {limit}, as {derived} must fit in "
                                 f"int32, got {value}")
        return cls(
            max_bs=max_bs,
            verify_capacity=PREFIX_SHARING_FACTOR * slots,
            write_req_capacity=max_bs,
            write_entry_capacity=max(max_bs * max(1, drafts), chunk),
        )

    @property
    def verify_plan_bytes(self) -> int:
        return self.verify_capacity * _VERIFY_ENTRY_BYTES + 2 * _CELL_BYTES

    @property
    def write_plan_bytes(self) -> int:
        return self.write_req_capacity * _WRITE_REQ_BYTES + 8 + _CELL_BYTES

    @property
    def workspace_bytes(self) -> int:
        """Device (or host) bytes both plans occupy."""
        return self.verify_plan_bytes + self.write_plan_bytes

    def describe(self) -> str:
        return (f"max_bs={self.max_bs} verify_capacity={self.verify_capacity} "
                f"write_req_capacity={self.write_req_capacity} write_entry_capacity={self.write_entry_capacity} "
                f"workspace={self.workspace_bytes / 2**20:.2f} MiB "
                f"(verify plan {self.verify_plan_bytes} B, write plan {self.write_plan_bytes} B)")
