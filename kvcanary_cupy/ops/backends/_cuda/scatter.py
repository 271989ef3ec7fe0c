"""scatter_req_token_ids on a CUDA device (SPEC §3.4): blocks (warps for large decode batches) over
requests, threads over a row."""

from __future__ import annotations

from ....rawkernels import _loader
from . import decode_shaped, i64, kernel, launch, ptr, sm_count

_BLOCK = _loader.SPECS["scatter"].constant("KVC_SCATTER_THREADS")
_DECODE_BLOCK = _loader.SPECS["scatter"].constant("KVC_SCATTER_DECODE_THREADS")
# the grid's blocks an SM at most, which the kDecode kernel's launch bounds keep resident at once
_BLOCKS_PER_SM = _loader.SPECS["scatter"].constant("KVC_SCATTER_BLOCKS_PER_SM")
# requests a kDecode block takes at once in the kWarpRequests form, a warp each
_DECODE_TEAMS = _DECODE_BLOCK // 32


def decode_form(batch_size: int, num_tokens: int, sm_count: int) -> bool:
    """scatter.cu's kDecode with a block a request: decode-shaped, and a block for every request
    (the grid takes at most _BLOCKS_PER_SM blocks an SM)."""
    return decode_shaped(batch_size, num_tokens) and batch_size <= _BLOCKS_PER_SM * sm_count


def decode_warps_form(batch_size: int, num_tokens: int, sm_count: int) -> bool:
    """scatter.cu's kDecode with a warp a request (kWarpRequests), for decode-shaped batches that
    decode_form's wave cannot hold: a warp for every request in one wave."""
    return decode_shaped(batch_size, num_tokens) and batch_size <= _BLOCKS_PER_SM * sm_count * _DECODE_TEAMS


def long_rows(batch_size: int, num_tokens: int) -> bool:
    """scatter.cu's kLongRows: rows of at least two of its strides on average (a prefill chunk's)."""
    return num_tokens >= 2 * _BLOCK * batch_size


def scatter(batch, *, stream) -> None:
    bs = batch.batch_size
    pool = batch.pool_out
    rows, width = int(pool.shape[0]), int(pool.shape[1])
    if bs == 0 or rows == 0 or width == 0:
        return
    device_id = batch.device.index
    sms = sm_count(device_id)
    num_tokens = int(batch.flat_in.shape[0])
    warps = not decode_form(bs, num_tokens, sms) and decode_warps_form(bs, num_tokens, sms)
    decode = warps or decode_form(bs, num_tokens, sms)
    long = not decode and long_rows(bs, num_tokens)
    fn = kernel("scatter", _loader.instance("kvc_scatter", decode, long, warps), device_id)
    stride = int(pool.strides[0]) // int(pool.itemsize) if rows > 1 else width
    requests_a_block = _DECODE_TEAMS if warps else 1
    grid = max(1, min(-(-bs // requests_a_block), _BLOCKS_PER_SM * sms))
    args = (
        ptr(batch.flat_in), i64(num_tokens), ptr(batch.offsets),
        ptr(batch.req_pool_indices), i64(bs), ptr(pool), i64(rows), i64(width), i64(stride),
    )
    launch(fn, grid, _DECODE_BLOCK if decode else _BLOCK, args, stream)
