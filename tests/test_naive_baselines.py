"""The benchmarks' vectorised baselines (benchmarks/_naive.py) agree with the package's CPU backend.

A baseline that computed something else would make every "x naive" ratio meaningless, so each one is
run with NumPy on small random engine batches and compared with the op it stands in for.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import as_multiset, pipeline, random_batch, random_source, ring_rows

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import _naive as N  # noqa: E402
import _shapes as S  # noqa: E402

MODES = [kc.HashMode.NONE, kc.HashMode.PARTIAL, kc.HashMode.ALL]


def _sources(rng, num_slots, count):
    specs = []
    for _ in range(count):
        page = int(rng.choice([1, 2, 16]))
        bpt = int(rng.choice([16, 32, 64]))
        specs.append(random_source(rng, num_slots, page_size=page, num_bytes_per_token=bpt,
                                   read_bytes=16 * int(rng.integers(1, bpt // 16 + 1)),
                                   pad_bytes=int(rng.choice([0, 16]))))
    return specs


def test_hash_matches_spec_test_values():
    sm = lambda v: int(N.sm(np, np.array([v], dtype=np.uint64))[0])  # noqa: E731
    mix3 = lambda a, b, c: int(N.mix3(np, *(np.array([v], dtype=np.uint64) for v in (a, b, c)))[0])  # noqa: E731
    assert sm(0) == 0
    assert sm(0xC0FFEE1234567890) == 0xDE7FAE23A9A1B716
    assert mix3(1, 2, 3) == 0xA55BDF37C08724B5
    assert int(N.anchor_link(np)) == 0xDE7FAE23A9A1B716


@pytest.mark.parametrize("seed", range(12))
def test_plan_matches_cpu_backend(seed):
    rng = np.random.default_rng([77, seed])
    b = random_batch(rng, bs=int(rng.integers(1, 9)), max_prefix=40, max_extend=7, min_extend=0,
                     padding_requests=int(rng.integers(0, 3)))
    swa = int(rng.choice([0, 0, 3, 16]))
    lut = rng.permutation(b.num_slots + 4).astype(np.int64) if swa else None
    expected = bool(rng.integers(0, 2))
    offset = int(rng.choice([0, 1]))
    capacity = int((b.prefix_lens * (b.req_pool_indices != 0)).sum()) + int(rng.choice([0, 3]))
    if seed % 4 == 3:
        capacity = max(capacity - 5, 0)  # overflow: verify disabled, entries untouched
    extra = {}
    if expected:
        extra = dict(req_to_verify_expected_tokens=b.tokens, req_to_verify_expected_tokens_valid_lens=b.seq_lens - 1,
                     kv_token_id_vs_position_offset=offset)
    vplan, wplan = kc.VerifyPlan.allocate(capacity), kc.WritePlan.allocate(b.bs + 2)
    kc.plan(vplan, wplan, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens,
            extend_seq_lens=b.extend_lens, req_to_token=b.req_to_token, swa_window_size=swa,
            full_to_swa_index_mapping=lut, **extra)
    nv, nw = kc.VerifyPlan.allocate(capacity), kc.WritePlan.allocate(b.bs + 2)
    N.plan_into(np, nv, nw, req_pool_indices=b.req_pool_indices, prefix_lens=b.prefix_lens, extend_lens=b.extend_lens,
                req_to_token=b.req_to_token, swa_window=swa, lut=lut,
                expected_pool=b.tokens if expected else None, valid_lens=b.seq_lens - 1 if expected else None,
                token_offset=offset)
    assert int(nv.num_valid[0]) == int(vplan.num_valid[0]) and int(nv.enable[0]) == int(vplan.enable[0])
    n = int(vplan.num_valid[0]) if int(vplan.enable[0]) else 0
    for name in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
        assert np.array_equal(getattr(nv, name)[:n], getattr(vplan, name)[:n]), name
    assert np.array_equal(nw.offsets, wplan.offsets)
    assert np.array_equal(nw.seed_slot_indices, wplan.seed_slot_indices)
    assert int(nw.num_valid_reqs[0]) == int(wplan.num_valid_reqs[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_write_matches_cpu_backend(mode, seed):
    rng = np.random.default_rng([78, seed, int(mode)])
    b = random_batch(rng, bs=int(rng.integers(1, 7)), max_prefix=20, max_extend=9, padding_requests=1)
    specs = _sources(rng, b.num_slots, int(rng.integers(1, 4)))
    p = pipeline(b, "cpu", hash_mode=mode, sources=specs)
    p.write(np.zeros(b.bs, np.int64), b.prefix_lens)  # prefixes stored by the package
    before = p.ctx.canary_buf.copy()
    ids, pos, loc = b.entries(b.prefix_lens, b.extend_lens)
    if loc.size > 2:
        loc[rng.integers(0, loc.size)] = -1  # a padded entry: skipped, chain not advanced
    p.plan()
    kc.write(p.ctx, p.wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=ids, positions=pos, out_cache_loc=loc)
    ours = before.copy()
    stored = N.write(np, ours, N.sources_of(p.ctx), offsets=p.wplan.offsets, seed_slots=p.wplan.seed_slot_indices,
                     num_valid_reqs=int(p.wplan.num_valid_reqs[0]), input_ids=ids, positions=pos,
                     out_cache_loc=loc)
    assert stored == int((loc >= 0).sum())
    assert np.array_equal(ours, p.ctx.canary_buf)
    assert not np.array_equal(ours, before)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_verify_matches_cpu_backend(mode, seed):
    rng = np.random.default_rng([79, seed, int(mode)])
    b = random_batch(rng, bs=int(rng.integers(1, 7)), max_prefix=30, max_extend=6, padding_requests=1)
    specs = _sources(rng, b.num_slots, int(rng.integers(1, 4)))
    p = pipeline(b, "cpu", hash_mode=mode, sources=specs, ring_capacity=4096)
    p.fill()
    # corrupt a few slots: a token, a position, a chain hash, a KV byte
    slots = np.unique(b.req_to_token[b.req_pool_indices[b.req_pool_indices != 0]])
    slots = slots[slots != 0]
    for _ in range(int(rng.integers(1, 6))):
        victim = int(rng.choice(slots))
        byte = int(rng.integers(0, 32))
        p.ctx.canary_buf[victim, byte] ^= np.uint8(1 << int(rng.integers(0, 8)))
    if mode != kc.HashMode.NONE:
        victim = int(rng.choice(slots))
        specs[0].window(victim, 16)[int(rng.integers(0, 16))] ^= 0x40
    check_token = bool(seed % 2)
    p.verify_all(check_expected_token=check_token, expected=True)
    rows = ring_rows(p.ctx)
    assert p.ctx.violations().dropped == 0
    active = int(p.vplan.num_valid[0])
    got = N.verify(np, p.ctx.canary_buf, N.sources_of(p.ctx), slots=p.vplan.slot_indices,
                   expected_tokens=p.vplan.expected_tokens, expected_positions=p.vplan.expected_positions,
                   prev_slots=p.vplan.prev_slot_indices, active=active, check_expected_token=check_token,
                   tag=int(kc.LaunchTag.TAIL_K_FULL))
    assert as_multiset(got.tolist()) == as_multiset(rows)
    assert len(rows) > 0


def test_verify_clean_state_has_no_rows():
    rng = np.random.default_rng(80)
    b = random_batch(rng, bs=5, max_prefix=30)
    specs = _sources(rng, b.num_slots, 2)
    p = pipeline(b, "cpu", hash_mode=kc.HashMode.ALL, sources=specs)
    p.fill()
    p.verify_all()
    assert p.ctx.violations().total == 0
    got = N.verify(np, p.ctx.canary_buf, N.sources_of(p.ctx), slots=p.vplan.slot_indices,
                   expected_tokens=p.vplan.expected_tokens, expected_positions=p.vplan.expected_positions,
                   prev_slots=p.vplan.prev_slot_indices, active=int(p.vplan.num_valid[0]))
    assert got.shape == (0, 8)


@pytest.mark.parametrize("seed", range(8))
def test_scatter_matches_cpu_backend(seed):
    rng = np.random.default_rng([81, seed])
    bs, rows, width = int(rng.integers(1, 9)), 12, int(rng.integers(1, 20))
    lens = rng.integers(0, 25, size=bs)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = rng.integers(-2**40, 2**40, size=int(offsets[-1]) + int(rng.integers(0, 3))).astype(np.int64)
    rpi = rng.permutation(rows)[:bs].astype(np.int64)
    pool = rng.integers(-99, 99, size=(rows, width)).astype(np.int32)
    ours = pool.copy()
    kc.scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=pool)
    N.scatter(np, flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=ours)
    assert np.array_equal(ours, pool)


class _SmallHarness:
    """The suite's harness without its timing: each case's engine state, built small on the CPU."""

    scale = 1 / 64

    def __init__(self) -> None:
        self.states: dict[str, S.EngineState] = {}

    def state(self, case: S.Case) -> S.EngineState:
        if case.name not in self.states:
            self.states[case.name] = S.build_state(case.scaled(self.scale), "cpu", scale=self.scale, l2_bytes=1 << 20)
        return self.states[case.name]

    def measure(self, benchmark, state, op, fn, **_) -> dict:
        return {}


def _bench_test(module: str, name: str):
    """``name`` of benchmarks/<module>.py, which imports the suite's conftest by that bare name: this
    folder's conftest holds it meanwhile, so a stand-in with the one decorator it takes does."""
    stand_in = types.ModuleType("conftest")
    stand_in.case_params = lambda op: (lambda fn: fn)
    saved = sys.modules.get("conftest")
    sys.modules["conftest"] = stand_in
    try:
        spec = importlib.util.spec_from_file_location(f"kvcanary_{module}", BENCH / f"{module}.py")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    finally:
        if saved is None:
            del sys.modules["conftest"]
        else:
            sys.modules["conftest"] = saved
    return getattr(loaded, name)


@pytest.mark.parametrize("case_name", ["smoke_decode_empty", "small_extend_batch_hash"])
@pytest.mark.parametrize("op", ["plan", "write", "scatter"])
def test_each_benchmark_fails_a_baseline_that_leaves_the_output_alone(op, case_name):
    """The benchmark's own agreement check (``naive_agrees``) compares the baseline's output with the
    op's: a baseline that stores nothing must fail it, not find the op's output already there."""
    bench = _bench_test(f"bench_{op}", f"test_{op}")
    harness, case = _SmallHarness(), S.BY_NAME[case_name]
    bench(None, harness, case)  # the real baseline agrees
    setattr(harness.state(case), f"naive_{op}", lambda i: None)
    with pytest.raises(AssertionError):
        bench(None, harness, case)


def test_the_copy_records_benchmark_fails_a_baseline_that_leaves_the_output_alone(monkeypatch):
    bench = _bench_test("bench_copy_records", "test_copy_records")
    harness, case = _SmallHarness(), S.BY_NAME["e2e_decode_tail"]
    bench(None, harness, case)
    monkeypatch.setattr(N, "copy_records", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError):
        bench(None, harness, case)


@pytest.mark.parametrize("case_name", ["small_extend_batch", "small_extend_batch_hash", "swa_decode_short_prefix"])
def test_the_verify_benchmark_fails_a_baseline_that_finds_nothing(case_name):
    """On the benchmark's clean state a baseline that checks nothing finds what the op finds (no
    row): the check changes a few records and compares the rows found, then puts them back."""
    bench = _bench_test("bench_verify", "test_verify")
    harness, case = _SmallHarness(), S.BY_NAME[case_name]
    state = harness.state(case)
    before = state.ctx.canary_buf.copy()
    bench(None, harness, case)  # the real baseline agrees
    assert np.array_equal(state.ctx.canary_buf, before) and state.violations() == 0
    real = state.naive_verify
    state.naive_verify = lambda i: real(i)[:0]
    with pytest.raises(AssertionError):
        bench(None, harness, case)
    state.naive_verify = lambda i: real(i)[1:]  # one row short
    with pytest.raises(AssertionError):
        bench(None, harness, case)


@pytest.mark.parametrize("stride", [32, 64])
@pytest.mark.parametrize("seed", range(3))
def test_copy_records_matches_cpu_backend(seed, stride):
    rng = np.random.default_rng([82, seed, stride])
    b = random_batch(rng, bs=int(rng.integers(1, 7)), max_prefix=20, max_extend=6)
    p = pipeline(b, "cpu", slot_stride_bytes=stride)
    p.fill()
    written = np.unique(b.req_to_token[b.req_pool_indices])
    src_slots = rng.permutation(written[written != 0]).astype(np.int64)
    dst_slots = rng.permutation(b.num_slots)[:src_slots.size].astype(np.int64)
    ours, naive = (kc.CanaryContext.allocate(b.num_slots, device="cpu", slot_stride_bytes=stride) for _ in range(2))
    kc.copy_records(src=p.ctx, dst=ours, src_slots=src_slots, dst_slots=dst_slots)
    N.copy_records(np, src_buf=p.ctx.canary_buf, dst_buf=naive.canary_buf, src_slots=src_slots, dst_slots=dst_slots)
    assert np.array_equal(naive.canary_buf, ours.canary_buf)
    assert ours.canary_buf[dst_slots].any()
