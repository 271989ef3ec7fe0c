"""scatter_req_token_ids on the CPU."""

from __future__ import annotations

import numba
import numpy as np

from .hashing import JIT


@numba.njit(**JIT)
def _scatter(flat_in, offsets, req_pool_indices, pool_out):
    rows, width = pool_out.shape
    available = flat_in.shape[0]
    for r in range(req_pool_indices.shape[0]):
        pool_row = req_pool_indices[r]
        if pool_row < 0 or pool_row >= rows:
            continue
        begin = offsets[r]
        count = min(offsets[r + 1] - begin, width)
        for j in range(max(count, 0)):
            source = begin + j
            if 0 <= source < available:
                pool_out[pool_row, j] = np.int32(flat_in[source])


def scatter(batch, *, stream=None) -> None:
    _scatter(batch.flat_in, batch.offsets, batch.req_pool_indices, batch.pool_out)
