"""The simulated engine's KV arrays, in the layout its configuration names, on any device (the
serving pool on the engine's device, the host tier's in host memory)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from .. import _layout as L
from .. import layouts
from .._dlpack import filled

if TYPE_CHECKING:
    from .engine import SimConfig


@dataclasses.dataclass
class KvPool:
    """KV arrays of one pool in the configured layout. ``targets``: uint8 [slots, bytes] views the
    model writes; ``target_source_bytes``: bytes per token of the canary source each target byte
    belongs to (interleaved rows hold two)."""

    sources: list
    buffers: list
    targets: list
    target_source_bytes: list


KV_DTYPE = np.float16  # the element of every KV array of the simulated engine


def kv_shapes(c: "SimConfig", num_slots: int) -> list[tuple[int, ...]]:
    """The shapes of the KV arrays of ``num_slots`` slots (a whole number of pages) in ``c.layout``,
    in the order of :attr:`KvPool.buffers` (each layer's K, then its V where they are apart)."""
    n, pages = num_slots, num_slots // c.page_size
    if c.layout == "paged":
        return [(pages, c.page_size, c.heads, c.head_dim)] * (2 * c.layers)
    if c.layout == "per_layer":
        return [(n, c.heads, c.head_dim)] * (2 * c.layers)
    if c.layout == "interleaved":
        return [(n, 2, c.heads, c.head_dim)] * c.layers
    return [(n, 1, 4 * c.head_dim + 32)] * c.layers  # mla


def swa_shape(c: "SimConfig", num_slots: int) -> tuple[int, ...]:
    """The shape of the sliding-window group's KV array of ``num_slots`` slots."""
    return (num_slots, c.heads, c.head_dim)


def slot_bytes(c: "SimConfig", *, with_swa: bool) -> int:
    """The bytes each slot of a pool takes where the pool lives: its KV (:func:`kv_pool`, and
    :func:`swa_pool`'s beside it ``with_swa``) and each group's canary record (a row of its
    context's canary buffer, allocated at the smallest stride, ``L.MIN_SLOT_STRIDE_BYTES``). The
    arrays a pool certainly has, not its free lists nor its tables of pages."""
    itemsize = np.dtype(KV_DTYPE).itemsize
    kv = sum(math.prod(shape) for shape in kv_shapes(c, c.page_size)) * itemsize // c.page_size
    records = L.MIN_SLOT_STRIDE_BYTES
    if with_swa:
        kv += math.prod(swa_shape(c, 1)) * itemsize
        records *= 2
    return kv + records


def kv_pool(c: "SimConfig", device, num_slots: int) -> KvPool:
    """The KV arrays of ``num_slots`` slots (a whole number of pages) on ``device`` in ``c.layout``."""
    buffers = [filled(shape, KV_DTYPE, device) for shape in kv_shapes(c, num_slots)]
    if c.layout == "paged":
        sources = layouts.paged(buffers[0::2], buffers[1::2])
    elif c.layout == "per_layer":
        sources = layouts.per_layer(buffers[0::2], buffers[1::2])
    elif c.layout == "interleaved":
        sources = layouts.interleaved(buffers)
    else:
        sources = layouts.mla(buffers)
    n = num_slots
    targets = [b.reshape(n, -1).view(np.uint8) for b in buffers]
    halves = 2 if c.layout == "interleaved" else 1
    return KvPool(sources, buffers, targets, [int(t.shape[1]) // halves for t in targets])


def swa_pool(c: "SimConfig", device, num_slots: int) -> KvPool:
    """The sliding-window group's KV: one array of ``num_slots`` rows."""
    kv = filled(swa_shape(c, num_slots), KV_DTYPE, device)
    target = kv.reshape(num_slots, -1).view(np.uint8)
    return KvPool(layouts.per_layer([kv]), [kv], [target], [int(target.shape[1])])
