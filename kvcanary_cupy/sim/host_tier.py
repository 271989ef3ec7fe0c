"""The engine's host-memory KV tier: where a request's cached KV waits while the request is offloaded
(preempted to host memory), and where an evicted shared prefix is kept (as a hierarchical prefix
cache keeps it) until a request with the same prefix loads it back.

The tier keeps KV bytes in host arrays of the engine's layout and, beside them, canary contexts on
the CPU that hold only slot records. Offloading a request copies its KV bytes and carries its slots'
records there (``Canary.copy_records``: ``kc.copy_records`` told to the canary); loading it back
does both the other way, into whatever slots the request is given then. The records still hold
the hashes the KV had when it was written, so KV that changed while it was away fails the first
verify that reads it after the reload.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Optional

import numpy as np

from .._dlpack import from_host, parse_device, settle, to_host
from ..context import CanaryContext

if TYPE_CHECKING:
    from .engine import SimConfig
from .pools import KvPool, kv_pool, swa_pool

_HOST = parse_device("cpu")


@dataclasses.dataclass
class _Group:
    """One slot group's half of the tier: host KV and a context holding only records."""

    kv: KvPool
    context: CanaryContext


class HostTier:
    """``num_slots`` host slots (a whole number of pages), for the full group and, with an SWA
    group, for its sliding-window KV too (a host slot holds one token of each)."""

    def __init__(self, config: SimConfig, num_slots: int, *, with_swa: bool):
        self.num_slots = num_slots
        self.groups = {"full": self._group(kv_pool(config, _HOST, num_slots), config)}
        if with_swa:
            self.groups["swa"] = self._group(swa_pool(config, _HOST, num_slots), config)
        # host slot 0 stays unused, as the pool's padding slot does
        self.free = collections.deque(range(1, num_slots))
        self.offloads = 0
        self.reloads = 0
        self.prefix_stores = 0
        self.prefix_loads = 0
        # host seconds spent carrying KV bytes and records (each call waits for its copies): what
        # carrying the records adds to an offload or a reload, beside the KV that has to move anyway
        self.kv_s = 0.0
        self.records_s = 0.0

    @staticmethod
    def _group(kv: KvPool, config: SimConfig) -> _Group:
        context = CanaryContext.allocate(int(kv.targets[0].shape[0]), device=_HOST, ring_capacity=0,
                                         hash_mode=config.hash_mode, real_kv_sources=kv.sources)
        return _Group(kv, context)

    def take(self, count: int) -> Optional[np.ndarray]:
        """``count`` free host slots, or ``None`` when the tier has fewer."""
        if count > len(self.free):
            return None
        return np.asarray([self.free.popleft() for _ in range(count)], np.int64)

    def give_back(self, host_slots: np.ndarray) -> None:
        self.free.extend(int(s) for s in host_slots)

    def store(self, group: str, *, device, targets: list, context: CanaryContext, slots: np.ndarray,
              host_slots: np.ndarray, copy_records) -> None:
        """Copy the KV bytes of pool ``slots`` into ``host_slots`` and carry their records with
        ``copy_records`` (the canary's)."""
        tier = self.groups[group]
        on_device = from_host(slots, device)
        started = time.perf_counter()
        for target, host_target in zip(targets, tier.kv.targets):
            host_target[host_slots] = to_host(target[on_device])
        self._carry(device, copy_records, src=context, dst=tier.context, src_slots=on_device, dst_slots=host_slots,
                    started=started)

    def load(self, group: str, *, device, targets: list, context: CanaryContext, slots: np.ndarray,
             host_slots: np.ndarray, copy_records) -> None:
        """Copy the KV bytes of ``host_slots`` back into pool ``slots`` and carry their records with
        ``copy_records`` (the canary's, so that its polls know when the slots got them)."""
        tier = self.groups[group]
        on_device = from_host(slots, device)
        started = time.perf_counter()
        for target, host_target in zip(targets, tier.kv.targets):
            target[on_device] = from_host(np.ascontiguousarray(host_target[host_slots]), device)
        self._carry(device, copy_records, src=tier.context, dst=context, src_slots=host_slots, dst_slots=on_device,
                    started=started)

    def _carry(self, device, copy_records, *, src: CanaryContext, dst: CanaryContext, src_slots, dst_slots,
               started: float) -> None:
        """Carry the records after the KV copy that began at ``started``, timing each part (the
        pool's device settled after each, so a queued copy counts where it belongs)."""
        settle(device)
        copied = time.perf_counter()
        copy_records(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots)
        settle(device)
        self.kv_s += copied - started
        self.records_s += time.perf_counter() - copied

    def to_json(self) -> dict:
        return {"slots": self.num_slots, "offloads": self.offloads, "reloads": self.reloads,
                "prefix_stores": self.prefix_stores, "prefix_loads": self.prefix_loads,
                "kv_copy_ms": round(1e3 * self.kv_s, 3), "records_copy_ms": round(1e3 * self.records_s, 3)}
