"""scatter_req_token_ids on the CPU."""

from __future__ import annotations

import numpy as np

from .... import _layout as L
from .hashing import JIT, njit

_INT64_MAX = np.int64(L.INT64_MAX)


@njit(**JIT)
def _scatter(flat_in, offsets, req_pool_indices, pool_out):
    rows, width = pool_out.shape
    available = flat_in.shape[0]
    for r in range(req_pool_indices.shape[0]):
        pool_row = req_pool_indices[r]
        if pool_row < 0 or pool_row >= rows:
            continue
        begin = offsets[r]
        end = offsets[r + 1]
        if end <= begin:
            continue
        # end - begin overflows int64 exactly when begin < 0 and end > INT64_MAX + begin; the row is
        # then filled to its width.
        count = width if begin < 0 and end > _INT64_MAX + begin else min(end - begin, width)
        for j in range(count):
            source = begin + j
            if 0 <= source < available:
                pool_out[pool_row, j] = np.int32(flat_in[source])


def scatter(batch, *, stream=None) -> None:
    _scatter(batch.flat_in, batch.offsets, batch.req_pool_indices, batch.pool_out)
