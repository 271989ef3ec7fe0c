"""copy_records: every cached slot of a batch's requests carried to another canary of the device
(a second tier), in a random order of its slots."""

from __future__ import annotations

import pytest

import _naive as N
import _shapes as S
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
