"""CPU benchmarks: the numba backend against the plain-Python model (``kvcanary_cupy.reference``) on
the same inputs, for verify, write (ALL hash mode with a real-KV source), plan and copy_records at ~100k
entries.

    pytest benchmarks/bench_cpu.py --benchmark-only

``KVCANARY_BENCH_SCALE`` (default 1.0) scales the entry count, e.g. 0.1 for a quick run. The numba
op is timed by pytest-benchmark as usual (after one warm-up call that loads or compiles it); the
reference is slow, so it runs once (``pedantic(rounds=1, iterations=1)``) on the very same arrays.
Each reference case records ``numba_s``, ``reference_s`` and ``speedup`` in ``extra_info`` and the
session ends with a summary table.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import reference as ref

SCALE = float(os.environ.get("KVCANARY_BENCH_SCALE", "1"))
ENTRIES = max(1000, int(100_000 * SCALE))
REQUESTS = 64
BYTES_PER_TOKEN = 128  # e.g. 64 fp16 values of one head
READ_BYTES = 64


def _best_of(fn, repeats=5):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Workload:
    """A pool of ENTRIES + 1 slots, REQUESTS requests whose positions cover every slot once (in a random
    slot order), a real-KV source with random bytes, the plans of one batch and the write inputs."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.num_slots = ENTRIES + 1
        lens = np.full(REQUESTS, ENTRIES // REQUESTS, np.int64)
        lens[: ENTRIES % REQUESTS] += 1
        width = int(lens.max())
        self.table = np.zeros((REQUESTS + 1, width), np.int32)
        slots = rng.permutation(np.arange(1, self.num_slots))
        tokens = np.zeros((REQUESTS + 1, width), np.int32)
        self.rpi = np.arange(1, REQUESTS + 1, dtype=np.int64)
        ids, pos, loc = [], [], []
        start = 0
        for r in range(REQUESTS):
            n = int(lens[r])
            self.table[r + 1, :n] = slots[start:start + n]
            tokens[r + 1, :n] = rng.integers(1, 2**31 - 1, size=n)
            ids.append(tokens[r + 1, :n]), pos.append(np.arange(n)), loc.append(slots[start:start + n])
            start += n
        self.tokens = tokens
        self.ids, self.pos, self.loc = (np.concatenate(a).astype(np.int64) for a in (ids, pos, loc))
        self.lens = lens
        self.kv = rng.integers(1, 256, size=(self.num_slots, BYTES_PER_TOKEN), dtype=np.uint8)
        self.ctx = self.context()
        # Write plan of a prefill of everything; verify plan of everything as prefix.
        self.wplan = kc.WritePlan.allocate(REQUESTS)
        self.vplan = kc.VerifyPlan.allocate(ENTRIES)
        self.plan_args = dict(req_pool_indices=self.rpi, prefix_lens=np.zeros(REQUESTS, np.int64),
                              extend_seq_lens=lens, req_to_token=self.table)
        kc.plan(self.vplan, self.wplan, **self.plan_args)
        self.write_args = dict(tag=kc.LaunchTag.HEAD_K_FULL, input_ids=self.ids, positions=self.pos,
                               out_cache_loc=self.loc)
        kc.write(self.ctx, self.wplan, **self.write_args)
        self.verify_plan_args = dict(req_pool_indices=self.rpi, prefix_lens=lens,
                                     extend_seq_lens=np.ones(REQUESTS, np.int64), req_to_token=self.table,
                                     req_to_verify_expected_tokens=tokens,
                                     req_to_verify_expected_tokens_valid_lens=lens)
        kc.plan(self.vplan, kc.WritePlan.allocate(REQUESTS), **self.verify_plan_args)
        assert int(self.vplan.num_valid[0]) == ENTRIES and int(self.vplan.enable[0]) == 1

    def context(self):
        source = kc.RealKvSource(tensor=self.kv, page_size=1, num_bytes_per_token=BYTES_PER_TOKEN,
                                 read_bytes=READ_BYTES)
        return kc.CanaryContext.allocate(self.num_slots, ring_capacity=1024, real_kv_sources=(source,),
                                         hash_mode=kc.HashMode.ALL)

    def ref_sources(self):
        return [(self.kv, 1, BYTES_PER_TOKEN, READ_BYTES)]

    def ring_args(self, ctx):
        return (ctx.canary_buf, self.ref_sources(), ctx.violation_ring, ctx.violation_write_index,
                ctx.slot_run_counter, ctx.kernel_run_counter)


@pytest.fixture(scope="module")
def work():
    return Workload()


def _record(benchmark, ratio_log, op, numba_s, run_reference):
    start = time.perf_counter()
    benchmark.pedantic(run_reference, rounds=1, iterations=1)
    reference_s = time.perf_counter() - start
    benchmark.extra_info.update(entries=ENTRIES, numba_s=numba_s, reference_s=reference_s,
                                speedup=reference_s / numba_s)
    ratio_log.append((op, ENTRIES, numba_s, reference_s))


# --- verify ---------------------------------------------------------------------------------------

def _numba_verify(work):
    kc.verify(work.ctx, work.vplan, tag=kc.LaunchTag.HEAD_K_FULL, check_expected_token=True)


@pytest.mark.benchmark(group="verify")
def test_verify_numba(benchmark, work):
    benchmark.extra_info["entries"] = ENTRIES
    benchmark.pedantic(_numba_verify, args=(work,), rounds=10, iterations=1, warmup_rounds=1)
    assert work.ctx.violations().total == 0


@pytest.mark.benchmark(group="verify")
def test_verify_reference(benchmark, work, ratio_log):
    v = work.vplan
    ctx = work.context()
    ctx.canary_buf[...] = work.ctx.canary_buf

    def run():
        ref.verify(*work.ring_args(ctx), slots=v.slot_indices, expected_tokens=v.expected_tokens,
                   expected_positions=v.expected_positions, prev_slots=v.prev_slot_indices, num_valid=v.num_valid,
                   enable=v.enable, check_expected_token=True, tag=int(kc.LaunchTag.HEAD_K_FULL))

    _record(benchmark, ratio_log, "verify", _best_of(lambda: _numba_verify(work)), run)
    assert ctx.violations().total == 0


# --- write ----------------------------------------------------------------------------------------

def _numba_write(work):
    kc.write(work.ctx, work.wplan, **work.write_args)


@pytest.mark.benchmark(group="write")
def test_write_numba(benchmark, work):
    benchmark.extra_info["entries"] = ENTRIES
    benchmark.pedantic(_numba_write, args=(work,), rounds=10, iterations=1, warmup_rounds=1)
    assert work.ctx.violations().total == 0


@pytest.mark.benchmark(group="write")
def test_write_reference(benchmark, work, ratio_log):
    w = work.wplan
    ctx = work.context()

    def run():
        ref.write(*work.ring_args(ctx), offsets=w.offsets, seed_slots=w.seed_slot_indices,
                  num_valid_reqs=w.num_valid_reqs, input_ids=work.ids, positions=work.pos, out_cache_loc=work.loc,
                  expected_tokens=None, expected_positions=None, chain_position_assert=ctx.chain_position_assert,
                  tag=int(kc.LaunchTag.HEAD_K_FULL))

    _record(benchmark, ratio_log, "write", _best_of(lambda: _numba_write(work)), run)
    assert np.array_equal(ctx.canary_buf, work.ctx.canary_buf), "the two implementations disagree"


# --- plan -----------------------------------------------------------------------------------------

def _numba_plan(work, vplan, wplan):
    kc.plan(vplan, wplan, **work.verify_plan_args)


@pytest.mark.benchmark(group="plan")
def test_plan_numba(benchmark, work):
    vplan, wplan = kc.VerifyPlan.allocate(ENTRIES), kc.WritePlan.allocate(REQUESTS)
    benchmark.extra_info["entries"] = ENTRIES
    benchmark.pedantic(_numba_plan, args=(work, vplan, wplan), rounds=10, iterations=1, warmup_rounds=1)
    assert int(vplan.num_valid[0]) == ENTRIES


@pytest.mark.benchmark(group="plan")
def test_plan_reference(benchmark, work, ratio_log):
    vplan, wplan = kc.VerifyPlan.allocate(ENTRIES), kc.WritePlan.allocate(REQUESTS)
    a = work.verify_plan_args

    def run():
        ref.plan(req_pool_indices=a["req_pool_indices"], prefix_lens=a["prefix_lens"], extend_lens=a["extend_seq_lens"],
                 req_to_token=a["req_to_token"], swa_window=0, lut=None,
                 expected_pool=a["req_to_verify_expected_tokens"],
                 valid_lens=a["req_to_verify_expected_tokens_valid_lens"], token_offset=0,
                 v_slots=vplan.slot_indices, v_tokens=vplan.expected_tokens, v_positions=vplan.expected_positions,
                 v_prev=vplan.prev_slot_indices, v_num_valid=vplan.num_valid, v_enable=vplan.enable,
                 w_offsets=wplan.offsets, w_seeds=wplan.seed_slot_indices, w_num_valid_reqs=wplan.num_valid_reqs)

    fast_v, fast_w = kc.VerifyPlan.allocate(ENTRIES), kc.WritePlan.allocate(REQUESTS)
    _record(benchmark, ratio_log, "plan", _best_of(lambda: _numba_plan(work, fast_v, fast_w)), run)
    for got, want in zip((vplan.slot_indices, vplan.prev_slot_indices, vplan.expected_tokens, wplan.offsets),
                         (fast_v.slot_indices, fast_v.prev_slot_indices, fast_v.expected_tokens, fast_w.offsets)):
        assert np.array_equal(got, want), "the two implementations disagree"


# --- copy_records ---------------------------------------------------------------------------------

def _copy_pairs(work):
    """Every written slot's record to a random other slot of a second canary (a host tier's)."""
    rng = np.random.default_rng(1)
    return work.loc, rng.permutation(np.arange(1, work.num_slots))[:ENTRIES].astype(np.int64)


def _numba_copy(work, tier, pairs):
    kc.copy_records(src=work.ctx, dst=tier, src_slots=pairs[0], dst_slots=pairs[1])


@pytest.mark.benchmark(group="copy_records")
def test_copy_records_numba(benchmark, work):
    tier, pairs = work.context(), _copy_pairs(work)
    benchmark.extra_info["entries"] = ENTRIES
    benchmark.pedantic(_numba_copy, args=(work, tier, pairs), rounds=10, iterations=1, warmup_rounds=1)
    assert np.array_equal(tier.canary_buf[pairs[1]], work.ctx.canary_buf[pairs[0]])


@pytest.mark.benchmark(group="copy_records")
def test_copy_records_reference(benchmark, work, ratio_log):
    tier, fast_tier, pairs = work.context(), work.context(), _copy_pairs(work)

    def run():
        ref.copy_records(src_buf=work.ctx.canary_buf, dst_buf=tier.canary_buf, src_slots=pairs[0], dst_slots=pairs[1])

    _record(benchmark, ratio_log, "copy_records", _best_of(lambda: _numba_copy(work, fast_tier, pairs)), run)
    assert np.array_equal(tier.canary_buf, fast_tier.canary_buf), "the two implementations disagree"
    assert tier.canary_buf[pairs[1]].any()
