"""Kernels made ready before the first op: a serving engine warms up before it takes traffic."""

from __future__ import annotations

import itertools
from typing import Any, Iterable

from . import validate as check
from ._dlpack import parse_device, require_device
from .rawkernels import _loader

# A model hashing K and V of every layer has twice its layers in sources: a few hundred at most. A
# larger count is a mistake, and warming it would build a list that long before numba refused it.
MOST_SOURCES_WARMED = 1 << 16


def compile_kernels(*, device: Any = "cuda", source_counts: Iterable[int] = (0, 1)) -> None:
    """Compile every kernel of the package for ``device`` ("cuda", "cuda:N", N or "cpu") and load
    them, so that no op pays for it later.

    Kernels are otherwise compiled when an op first needs them, and a forward that triggers it
    stalls that long: a first compile on a machine takes a few seconds for the CUDA kernels (NVRTC)
    and 15–20 s on two cores for the CPU backend's (numba). Both keep what they compiled in an
    on-disk cache, so later processes on the machine only load it.

    ``source_counts`` matters on the CPU only, where numba compiles a build of the hashing ops for
    each number of real-KV sources a context hashes (0 when its hash mode is NONE): pass the counts
    of your contexts (``len(ctx.source_words)``; each at most 65536, checked on every device).
    ``copy_records`` hashes nothing and is made ready whatever the counts, so ``device="cpu",
    source_counts=[]`` readies only it: what a host tier of records beside GPU canaries runs on
    the host side.
    """
    where = parse_device(device)
    if not isinstance(source_counts, (list, tuple, range)):
        raise TypeError(f"{check.PREFIX}source_counts must be a list, tuple or range of ints, "
                        f"got {type(source_counts).__name__} {source_counts!r}")
    counts = sorted({_source_count(count) for count in source_counts})
    if not where.is_cuda:
        _warm_cpu(counts)
        return
    require_device(where)
    _loader.load_all(where.index)


def _source_count(count: Any) -> int:
    count = check.non_negative("source_counts item", count)
    if count > MOST_SOURCES_WARMED:
        raise ValueError(f"{check.PREFIX}source_counts item must be at most {MOST_SOURCES_WARMED} (a context's "
                         f"number of real-KV sources), got {count}")
    return count


def _warm_cpu(source_counts: Iterable[int]) -> None:
    """Runs each CPU op on host arrays (the hashing ones once for each number of hashed sources) at a
    size that takes its parallel build and at one that takes its serial build, so that numba
    compiles (or loads) them."""
    import numpy as np

    from . import _layout as L
    from .context import CanaryContext, VerifyPlan, WritePlan
    from .ops import copy_records, plan, scatter_req_token_ids, verify, write
    from .ops._dispatch import backend_module
    from .sources import RealKvSource

    cpu = parse_device("cpu")
    large = max(backend_module(cpu, op).PARALLEL_MIN_ENTRIES for op in ("plan", "verify", "write"))
    for count, tokens in itertools.product(source_counts, (large, 2)):
        slots = np.arange(1, tokens + 1, dtype=np.int64)
        req_to_token = np.zeros((2, tokens + 1), np.int32)
        req_to_token[1, :tokens] = slots
        kv = np.arange((tokens + 1) * 16, dtype=np.int64).astype(np.uint8).reshape(tokens + 1, 16)
        sources = [RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=16, read_bytes=16)] * count
        ctx = CanaryContext.allocate(tokens + 1, hash_mode=L.HashMode.PARTIAL if count else L.HashMode.NONE,
                                     real_kv_sources=sources)
        vplan, wplan = VerifyPlan.allocate(tokens), WritePlan.allocate(1)
        batch = dict(req_pool_indices=np.array([1]), req_to_token=req_to_token)
        plan(vplan, wplan, prefix_lens=np.array([0]), extend_seq_lens=np.array([tokens]), **batch)
        write(ctx, wplan, tag=L.LaunchTag.TAIL_K_FULL, input_ids=slots, positions=slots - 1, out_cache_loc=slots)
        plan(vplan, wplan, prefix_lens=np.array([tokens]), extend_seq_lens=np.array([1]), **batch)
        verify(ctx, vplan, tag=L.LaunchTag.HEAD_K_FULL)
        scatter_req_token_ids(flat_in=slots, offsets=np.array([0, tokens]), req_pool_indices=np.array([1]),
                              pool_out=req_to_token)
    # between two canaries, and within one: staged, as records crossing to or from a GPU are
    slots = np.arange(1, 3, dtype=np.int64)
    canaries = [CanaryContext.allocate(4, ring_capacity=0) for _ in range(2)]
    copy_records(src=canaries[0], dst=canaries[1], src_slots=slots, dst_slots=slots)
    copy_records(src=canaries[1], dst=canaries[1], src_slots=slots, dst_slots=slots[::-1].copy())
