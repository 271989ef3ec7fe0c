"""write: store new tokens' fingerprints and extend their chains (SPEC §3.1)."""

from __future__ import annotations

from typing import Any, Optional

from .. import validate as check
from ..context import CanaryContext, WritePlan, require_intact
from ._dispatch import backend_module, launch_scope
from .batches import WriteBatch


def write(ctx: CanaryContext, wplan: WritePlan, *, tag: int, input_ids: Any, positions: Any, out_cache_loc: Any,
          expected_input_tokens: Optional[Any] = None, expected_input_positions: Optional[Any] = None,
          stream: Any = None) -> None:
    """Fingerprint each entry into its slot ``out_cache_loc[i]``, chaining per request of ``wplan``.

    With ``expected_input_*`` every entry is also checked against what the engine meant to write;
    the context's ``chain_position_assert`` flag checks positions grow by one along each chain.
    """
    check.instance("ctx", ctx, CanaryContext)
    check.instance("wplan", wplan, WritePlan)
    require_intact(ctx, CanaryContext.WRITE_WRITES)
    require_intact(wplan, writes=())  # read only, but its capacity bounds the requests written
    batch = WriteBatch(tag=tag, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                       expected_input_tokens=expected_input_tokens,
                       expected_input_positions=expected_input_positions)
    devices = {"ctx": ctx.device, "wplan": wplan.device, "input_ids": batch.device}
    with launch_scope(devices, stream) as (device, resolved):
        backend_module(device, "write").write(ctx, wplan, batch, stream=resolved)
