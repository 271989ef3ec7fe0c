"""plan: build the verify and write plans of one forward batch (SPEC §3.3)."""

from __future__ import annotations

from typing import Any, Optional

from .. import validate as check
from ..context import VerifyPlan, WritePlan, require_intact
from ._dispatch import backend_module, launch_scope
from .batches import PlanBatch


def plan(vplan: VerifyPlan, wplan: WritePlan, *, req_pool_indices: Any, prefix_lens: Any, extend_seq_lens: Any,
         req_to_token: Any, swa_window_size: int = 0, full_to_swa_index_mapping: Optional[Any] = None,
         req_to_verify_expected_tokens: Optional[Any] = None,
         req_to_verify_expected_tokens_valid_lens: Optional[Any] = None,
         kv_token_id_vs_position_offset: int = 0, stream: Any = None) -> None:
    """Fill ``vplan`` with every prefix slot the batch reads and ``wplan`` with its new-token ranges.

    A batch whose prefixes exceed ``vplan``'s capacity sets ``enable = 0`` (verify then skips the
    step) and leaves the entry arrays untouched.
    """
    check.instance("vplan", vplan, VerifyPlan)
    check.instance("wplan", wplan, WritePlan)
    batch = PlanBatch.from_arguments(locals())
    require_intact(vplan)
    require_intact(wplan)
    if batch.batch_size > wplan.capacity:
        raise ValueError(f"{check.PREFIX}batch size must be <= the write plan's capacity {wplan.capacity}, "
                         f"got {batch.batch_size}")
    devices = {"vplan": vplan.device, "wplan": wplan.device, "req_pool_indices": batch.device}
    with launch_scope(devices, stream) as (device, resolved):
        backend_module(device, "plan").plan(vplan, wplan, batch, stream=resolved)
