"""scatter_req_token_ids on a CUDA device (SPEC §3.4): blocks over requests, threads over a row."""

from __future__ import annotations

from ....rawkernels import _loader
from . import decode_shaped, i64, kernel, launch, ptr, sm_count, table_args

_BLOCK = _loader.SPECS["scatter"].constant("KVC_SCATTER_THREADS")
_DECODE_BLOCK = _loader.SPECS["scatter"].constant("KVC_SCATTER_DECODE_THREADS")
# the grid's blocks an SM at most, which the kDecode kernel's launch bounds keep resident at once
_BLOCKS_PER_SM = _loader.SPECS["scatter"].constant("KVC_SCATTER_BLOCKS_PER_SM")
# the most requests a block of the grid takes in turn in kDecode, as far as it was measured
_DECODE_REQUESTS_A_BLOCK = 4


def decode_form(batch_size: int, num_tokens: int, sm_count: int) -> bool:
    """scatter.cu's kDecode: decode-shaped, and at most _DECODE_REQUESTS_A_BLOCK requests for each
    block of the grid (which takes at most _BLOCKS_PER_SM blocks an SM). A bs-4096 decode scatter,
    four requests a block on 132 SMs, took 13.9 us so and 17.2 in the general form."""
    max_requests = _DECODE_REQUESTS_A_BLOCK * _BLOCKS_PER_SM * sm_count
    return decode_shaped(batch_size, num_tokens) and batch_size <= max_requests


def long_rows(batch_size: int, num_tokens: int) -> bool:
    """scatter.cu's kLongRows: rows of at least two of its strides on average (a prefill chunk's)."""
    return num_tokens >= 2 * _BLOCK * batch_size


def scatter_form(batch_size: int, num_tokens: int, sm_count: int) -> tuple[bool, bool]:
    """kvc_scatter's (kDecode, kLongRows) for a batch: the decode form, the long-rows form or
    neither, never both."""
    decode = decode_form(batch_size, num_tokens, sm_count)
    return decode, not decode and long_rows(batch_size, num_tokens)


def scatter(batch, *, stream) -> None:
    bs = batch.batch_size
    pool, rows, width, stride = table_args(batch.pool_out)
    if bs == 0 or rows == 0 or width == 0:
        return
    device_id = batch.device.index
    sms = sm_count(device_id)
    num_tokens = int(batch.flat_in.shape[0])
    decode, long = scatter_form(bs, num_tokens, sms)
    fn = kernel("scatter", _loader.instance("kvc_scatter", decode, long), device_id)
    grid = max(1, min(bs, _BLOCKS_PER_SM * sms))
    args = (
        ptr(batch.flat_in), i64(num_tokens), ptr(batch.offsets),
        ptr(batch.req_pool_indices), i64(bs), pool, i64(rows), i64(width), i64(stride),
    )
    launch(fn, grid, _DECODE_BLOCK if decode else _BLOCK, args, stream)
