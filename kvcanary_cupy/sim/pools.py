"""The simulated engine's KV arrays, in the layout its configuration names, on any device (the
serving pool on the engine's device, the host tier's in host memory)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

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


def kv_pool(c: "SimConfig", device, num_slots: int) -> KvPool:
    """The KV arrays of ``num_slots`` slots (a whole number of pages) on ``device`` in ``c.layout``."""
    f16, n, pages = np.float16, num_slots, num_slots // c.page_size
    if c.layout == "paged":
        ks = [filled((pages, c.page_size, c.heads, c.head_dim), f16, device) for _ in range(c.layers)]
        vs = [filled((pages, c.page_size, c.heads, c.head_dim), f16, device) for _ in range(c.layers)]
        sources = layouts.paged(ks, vs)
        buffers = [b for pair in zip(ks, vs) for b in pair]
    elif c.layout == "per_layer":
        ks = [filled((n, c.heads, c.head_dim), f16, device) for _ in range(c.layers)]
        vs = [filled((n, c.heads, c.head_dim), f16, device) for _ in range(c.layers)]
        sources = layouts.per_layer(ks, vs)
        buffers = [b for pair in zip(ks, vs) for b in pair]
    elif c.layout == "interleaved":
        buffers = [filled((n, 2, c.heads, c.head_dim), f16, device) for _ in range(c.layers)]
        sources = layouts.interleaved(buffers)
    else:
        buffers = [filled((n, 1, 4 * c.head_dim + 32), f16, device) for _ in range(c.layers)]
        sources = layouts.mla(buffers)
    targets = [b.reshape(n, -1).view(np.uint8) for b in buffers]
    halves = 2 if c.layout == "interleaved" else 1
    return KvPool(sources, buffers, targets, [int(t.shape[1]) // halves for t in targets])


def swa_pool(c: "SimConfig", device, num_slots: int) -> KvPool:
    """The sliding-window group's KV: one array of ``num_slots`` rows."""
    kv = filled((num_slots, c.heads, c.head_dim), np.float16, device)
    target = kv.reshape(num_slots, -1).view(np.uint8)
    return KvPool(layouts.per_layer([kv]), [kv], [target], [int(target.shape[1])])
