"""scatter_req_token_ids on a CUDA device (SPEC §3.4): blocks over requests, threads over a row."""

from __future__ import annotations

from ....rawkernels import _loader
from . import i64, kernel, launch, ptr, sm_count

_BLOCK = _loader.SPECS["scatter"].constant("KVC_SCATTER_THREADS")


def scatter(batch, *, stream) -> None:
    bs = int(batch.req_pool_indices.shape[0])
    pool = batch.pool_out
    rows, width = int(pool.shape[0]), int(pool.shape[1])
    if bs == 0 or rows == 0 or width == 0:
        return
    device_id = batch.device.index
    fn = kernel("scatter", "kvc_scatter", device_id)
    stride = int(pool.strides[0]) // int(pool.itemsize) if rows > 1 else width
    grid = max(1, min(bs, 8 * sm_count(device_id)))
    args = (
        ptr(batch.flat_in), i64(int(batch.flat_in.shape[0])), ptr(batch.offsets),
        ptr(batch.req_pool_indices), i64(bs), ptr(pool), i64(rows), i64(width), i64(stride),
    )
    launch(fn, grid, _BLOCK, args, stream)
