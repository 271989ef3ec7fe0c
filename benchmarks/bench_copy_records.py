"""copy_records: every cached slot of a batch's requests carried to another canary of the device
(a second tier), in a random order of its slots."""

from __future__ import annotations

import pytest

import _naive as N
import _shapes as S
import _timing as T
import kvcanary_cupy as kc

# a batch of decode requests' whole caches (1M records), one long request's (12K), one short (5K)
CASES = [case for case in S.CASES if case.name in ("e2e_decode_steady", "e2e_prefill_chunk_last", "e2e_decode_tail")]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_copy_records(benchmark, harness, case):
    state = harness.state(case)
    xp, n = state.xp, state.case.n_verify
    tier = kc.CanaryContext.allocate(state.pool_slots, device=state.device, hash_mode=state.ctx.hash_mode,
                                     real_kv_sources=state.ctx.real_kv_sources)
    moves = [(copy.vplan.slot_indices[:n], S.rand_perm(xp, state.pool_slots, 17 + i)[:n])
             for i, copy in enumerate(state.copies)]

    def ours(i: int) -> None:
        kc.copy_records(src=state.ctx, dst=tier, src_slots=moves[i][0], dst_slots=moves[i][1], stream=state.stream)

    def naive(i: int) -> None:
        N.copy_records(xp, src_buf=state.ctx.canary_buf, dst_buf=tier.canary_buf, src_slots=moves[i][0],
                       dst_slots=moves[i][1])

    info = harness.measure(benchmark, state, "copy_records", ours, naive=naive)
    ours(0)
    state.sync()
    copied = tier.canary_buf[moves[0][1]].copy()
    tier.canary_buf[moves[0][1]] = 0
    naive(0)
    state.sync()
    info["naive_agrees"] = bool(xp.array_equal(tier.canary_buf[moves[0][1]], copied))
    assert info["naive_agrees"] and bool(xp.any(copied))


# --- through host memory: an offload's records to a host tier and back ----------------------------
HOST_POOL = 1 << 20  # slots of each canary
HOST_COUNTS = (4096, 65536)  # one long request's cache; sixteen of them
REPS = 50  # timed calls of each function


@pytest.mark.parametrize("count", HOST_COUNTS)
@pytest.mark.parametrize("direction", ("to_host", "from_host"))
def test_copy_records_through_host(benchmark, harness, direction, count):
    """Records of ``count`` random slots between a GPU canary and a host canary, as an offload
    and a reload carry them: host wall time a call (the call waits for its copies), against the
    same bytes moved contiguously between the GPU and host memory and against the naive
    fancy-indexed assignment through a host array. Kept out of the main table (no ``case``)."""
    if harness.device != "cuda":
        pytest.skip("needs a GPU canary beside the host one")
    import numpy as np

    cupy = harness.cupy
    gpu = kc.CanaryContext.allocate(HOST_POOL, device="cuda")
    host = kc.CanaryContext.allocate(HOST_POOL, device="cpu")
    gpu.canary_buf[...] = S.rand_u64(cupy, HOST_POOL * 4, 31).view(cupy.uint8).reshape(gpu.canary_buf.shape)
    host.canary_buf[...] = S.rand_u64(np, HOST_POOL * 4, 32).view(np.uint8).reshape(host.canary_buf.shape)
    gpu_slots = S.rand_perm(cupy, HOST_POOL, 33)[:count]
    host_slots = S.rand_perm(np, HOST_POOL, 34)[:count]
    if direction == "to_host":
        def ours() -> None:
            kc.copy_records(src=gpu, dst=host, src_slots=gpu_slots, dst_slots=host_slots)

        def naive() -> None:
            N.copy_records(np, src_buf=cupy.asnumpy(gpu.canary_buf.view(cupy.int64)[gpu_slots]).view(np.uint8),
                           dst_buf=host.canary_buf, src_slots=np.arange(count), dst_slots=host_slots)

        staged = S.rand_u64(cupy, count * 4, 35)

        def bare() -> None:
            cupy.asnumpy(staged)
    else:
        def ours() -> None:
            # the store is only queued on the GPU's stream (cupy.asarray stages the records through
            # pinned memory without waiting): wait for it, as the naive version and the bare transfer do
            kc.copy_records(src=host, dst=gpu, src_slots=host_slots, dst_slots=gpu_slots)
            cupy.cuda.get_current_stream().synchronize()

        def naive() -> None:
            rows = cupy.asarray(host.canary_buf.view(np.int64)[host_slots])
            N.copy_records(cupy, src_buf=rows.view(cupy.uint8), dst_buf=gpu.canary_buf,
                           src_slots=cupy.arange(count), dst_slots=gpu_slots)
            cupy.cuda.get_current_stream().synchronize()

        staged = S.rand_u64(np, count * 4, 35)

        def bare() -> None:
            cupy.asarray(staged)
            cupy.cuda.get_current_stream().synchronize()

    def destination() -> np.ndarray:
        return host.canary_buf[host_slots].copy() if direction == "to_host" else cupy.asnumpy(gpu.canary_buf[gpu_slots])

    source = cupy.asnumpy(gpu.canary_buf[gpu_slots]) if direction == "to_host" else host.canary_buf[host_slots].copy()
    before = destination()
    host_clock = T.CpuTimer()  # each call waits for its copies, so its wall time is the cost
    ours_us = 1e6 * T.run_pytest_benchmark(benchmark, host_clock, lambda _: host_clock.once(ours),
                                           rounds=REPS, warmup=3).median_s
    assert np.array_equal(destination(), source) and not np.array_equal(before, source)
    naive_us, bare_us = (1e6 * host_clock.eager(lambda _: fn(), 1, warmup=1, reps=REPS).median_s
                         for fn in (naive, bare))
    benchmark.extra_info.update(op="copy_records_host", direction=direction, records=count, pool_slots=HOST_POOL,
                                wall_us=ours_us, records_per_s=count / (ours_us * 1e-6), naive_us=naive_us,
                                x_naive=naive_us / ours_us, bare_transfer_us=bare_us,
                                x_bare_transfer=ours_us / bare_us)
