"""scatter_req_token_ids: copy per-request token ids into pool rows (SPEC §3.4)."""

from __future__ import annotations

from typing import Any

from ._dispatch import backend_module, launch_scope
from .batches import ScatterBatch


def scatter_req_token_ids(*, flat_in: Any, offsets: Any, req_pool_indices: Any, pool_out: Any,
                          stream: Any = None) -> None:
    """``pool_out[req_pool_indices[r], :L] = flat_in[offsets[r] : offsets[r] + L]`` for every request."""
    batch = ScatterBatch(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out)
    with launch_scope({"flat_in": batch.device}, stream) as (device, resolved):
        backend_module(device, "scatter").scatter(batch, stream=resolved)
