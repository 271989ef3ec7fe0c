"""verify (SPEC §3.2, §4): clean chains pass; each single corruption gives exactly the expected rows
and bits; padding, predecessors, out-of-range indices, enable/num_valid, ring overflow, counters."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvcanary_cupy as kc
import _fuzzcases as F
from _builders import (ANCHOR_LINK, SourceSpec, as_multiset, assert_only_views_changed, assert_rows, expected_kv_hash,
                       fields, guarded_context, host_verify_plan, link_of, one_forward, pipeline, random_batch,
                       random_source, ring_rows, signed, snapshot)
from _devices import BACKENDS, cupy_module, requires_gpu, to_device, to_numpy

TAG = int(kc.LaunchTag.TAIL_K_FULL)
UNRESOLVED = kc.UNRESOLVED_SLOT


def _set_field(ctx, slot, field, value):
    ctx.canary_buf.view(np.int64)[slot, field] = value


def _filled(device, seed, *, mode=kc.HashMode.NONE, sources=None, **kwargs):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, bs=3, min_prefix=3, max_prefix=8, padding_requests=1)
    if sources is None:
        sources = [random_source(rng, batch.num_slots, page_size=2, num_bytes_per_token=64, read_bytes=48,
                                 pad_bytes=16)] if mode != kc.HashMode.NONE else []
    p = pipeline(batch, device, hash_mode=mode, sources=sources, **kwargs)
    p.fill()
    assert ring_rows(p.ctx) == []
    r = batch.live()[int(rng.integers(0, len(batch.live())))]
    pos = int(rng.integers(1, int(batch.seq_lens[r]) - 1))
    return p, r, pos


def _verify(p, **kwargs):
    p.ctx.clear_violations()
    p.verify_all(tag=TAG, **kwargs)
    return ring_rows(p.ctx)


def _check(device, rows, expected):
    assert_rows(device, rows, expected)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_clean_chain_has_no_violations(device, seed):
    p, _, _ = _filled(device, seed, mode=kc.HashMode.ALL)
    buf = snapshot(p.ctx.canary_buf)[0]
    assert _verify(p, check_expected_token=True, expected=True) == []
    assert np.array_equal(to_numpy(p.ctx.canary_buf), buf)
    # the two writes of fill() stored every live token once; the verify checked each of them once
    # (padding requests add no entry)
    total = int(p.batch.seq_lens[p.batch.live()].sum())
    assert int(to_numpy(p.vplan.num_valid)[0]) == total
    assert p.ctx.counters() == {"slot_run_counter": 2 * total, "kernel_run_counter": 3, "violations": 0}


# --- single corruptions ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("check_token", [False, True])
def test_corrupt_token(device, seed, check_token):
    p, r, pos = _filled(device, seed)
    b, buf = p.batch, p.ctx.canary_buf
    s, s_next, s_prev = b.slot(r, pos), b.slot(r, pos + 1), b.slot(r, pos - 1)
    _set_field(p.ctx, s, 0, b.token(r, pos) + 1)
    rows = _verify(p, check_expected_token=check_token, expected=check_token)
    want_next = b.token(r, pos + 1) if check_token else -1
    expected = [(TAG, s_next, pos + 1, b.token(r, pos + 1), want_next, fields(buf, s_next)[2], link_of(buf, s), 1)]
    if check_token:
        expected.insert(0, (TAG, s, pos, b.token(r, pos) + 1, b.token(r, pos), fields(buf, s)[2],
                            link_of(buf, s_prev), 32))
    _check(device, rows, expected)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_corrupt_position(device, seed):
    p, r, pos = _filled(device, seed)
    b, buf = p.batch, p.ctx.canary_buf
    s, s_next, s_prev = b.slot(r, pos), b.slot(r, pos + 1), b.slot(r, pos - 1)
    _set_field(p.ctx, s, 1, pos + 100)
    expected = [(TAG, s, pos + 100, b.token(r, pos), -1, fields(buf, s)[2], link_of(buf, s_prev), 2),
                (TAG, s_next, pos + 1, b.token(r, pos + 1), -1, fields(buf, s_next)[2], link_of(buf, s), 1)]
    _check(device, _verify(p), expected)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_corrupt_prev_hash(device, seed):
    p, r, pos = _filled(device, seed)
    b, buf = p.batch, p.ctx.canary_buf
    s, s_next, s_prev = b.slot(r, pos), b.slot(r, pos + 1), b.slot(r, pos - 1)
    bad = fields(buf, s)[2] ^ 1
    _set_field(p.ctx, s, 2, bad)
    expected = [(TAG, s, pos, b.token(r, pos), -1, bad, link_of(buf, s_prev), 1),
                (TAG, s_next, pos + 1, b.token(r, pos + 1), -1, fields(buf, s_next)[2], link_of(buf, s), 1)]
    _check(device, _verify(p), expected)


@pytest.mark.parametrize("device", BACKENDS)
def test_corrupt_first_position_prev_hash(device):
    """Position 0 is checked against the anchor link ``sm(ANCHOR)``."""
    p, r, _ = _filled(device, 4)
    b, buf = p.batch, p.ctx.canary_buf
    s, s_next = b.slot(r, 0), b.slot(r, 1)
    _set_field(p.ctx, s, 2, 12345)
    expected = [(TAG, s, 0, b.token(r, 0), -1, 12345, signed(ANCHOR_LINK), 1),
                (TAG, s_next, 1, b.token(r, 1), -1, fields(buf, s_next)[2], link_of(buf, s), 1)]
    _check(device, _verify(p), expected)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode,byte,hit", [(kc.HashMode.PARTIAL, 0, True), (kc.HashMode.PARTIAL, 15, True),
                                           (kc.HashMode.PARTIAL, 16, False), (kc.HashMode.ALL, 16, True),
                                           (kc.HashMode.ALL, 47, True), (kc.HashMode.ALL, 48, False),
                                           (kc.HashMode.NONE, 0, False)])
def test_corrupt_real_kv_byte(device, mode, byte, hit):
    """A byte inside the read window (16 bytes PARTIAL, read_bytes=48 ALL) is caught; outside is not."""
    p, r, pos = _filled(device, 7, mode=mode, sources=None if mode != kc.HashMode.NONE else [
        random_source(np.random.default_rng(0), 64, num_bytes_per_token=64)])
    b, buf = p.batch, p.ctx.canary_buf
    s, s_prev = b.slot(r, pos), b.slot(r, pos - 1)
    source = p.ctx.real_kv_sources[0]
    page = source.page_size
    row, column = divmod(s, page)
    source.tensor[row, column * source.num_bytes_per_token + byte] ^= 0x5A
    expected = [(TAG, s, pos, b.token(r, pos), -1, fields(buf, s)[2], link_of(buf, s_prev), 4)] if hit else []
    _check(device, _verify(p), expected)


def test_a_context_hashes_its_sources_when_its_mode_asks():
    """The SPEC's default hash mode (§6) is NONE: a context hashes its sources when given PARTIAL or
    ALL; kc.Canary, a session of this package's own, defaults to PARTIAL."""
    k = np.arange(8 * 32, dtype=np.int64).astype(np.uint8).reshape(8, 32)
    sources = kc.layouts.per_layer([k], [k])
    ctx = kc.CanaryContext.allocate(8, real_kv_sources=sources)
    assert ctx.hash_mode == kc.HashMode.NONE and ctx.kv_read_lengths == ()
    own = kc.CanaryContext(canary_buf=np.zeros((8, 32), np.uint8), violation_ring=np.zeros((4, 8), np.int64),
                           violation_write_index=np.zeros(1, np.int32), slot_run_counter=np.zeros(1, np.int64),
                           kernel_run_counter=np.zeros(1, np.int64), chain_position_assert=np.zeros(1, np.int32),
                           real_kv_sources=sources)
    assert own.kv_read_lengths == ()
    assert kc.CanaryContext.allocate(8, real_kv_sources=sources, hash_mode=kc.HashMode.PARTIAL).kv_read_lengths == (16, 16)
    canary = kc.Canary(pool_slot_count=8, req_to_token=np.zeros((2, 4), np.int32), real_kv_sources=sources,
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=2, max_seq_len_per_req=4,
                                                          pool_slot_count=8, max_prefill_tokens=4))
    assert canary.context.kv_read_lengths == (16, 16)


@pytest.mark.parametrize("device", BACKENDS)
def test_more_sources_than_numba_threads_take_are_hashed(device):
    """numba unpacks at most 100 tuple items into a parallel region: a canary of 101 sources (51
    layers' K and V would be 102) hashes them serially on the CPU, as many entries as take threads
    otherwise; the GPU's kernels walk any number of sources."""
    tokens, sources = 16_400, 101  # past the CPU verify's and write's thread thresholds
    rng = np.random.default_rng(5)
    buffers = [to_device(rng.integers(0, 256, size=(tokens + 2, 16), dtype=np.uint8), device) for _ in range(sources)]
    table = to_device(np.zeros((2, tokens + 1), np.int32), device)
    table[1] = to_device(np.arange(1, tokens + 2, dtype=np.int32), device)
    canary = kc.Canary(pool_slot_count=tokens + 2, req_to_token=table, hash_mode=kc.HashMode.ALL, device=device,
                       real_kv_sources=kc.layouts.per_layer(buffers),
                       capacities=kc.Capacities.from_args(req_to_token_pool_size=2, max_seq_len_per_req=tokens + 1,
                                                          pool_slot_count=tokens + 2, max_prefill_tokens=tokens))
    i64 = lambda *values: to_device(np.array(values, np.int64), device)  # noqa: E731
    prefill = kc.ForwardBatch(req_pool_indices=i64(1), prefix_lens=i64(0), extend_seq_lens=i64(tokens),
                              input_ids=to_device(np.arange(tokens) + 7, device),
                              positions=to_device(np.arange(tokens), device),
                              out_cache_loc=to_device(np.arange(1, tokens + 1), device))
    one_forward(canary, prefill)
    buffers[100][1234, 3] ^= 0x10  # the last source's byte of slot 1234 (position 1233)
    decode = kc.ForwardBatch(req_pool_indices=i64(1), prefix_lens=i64(tokens), extend_seq_lens=i64(1),
                             input_ids=i64(5), positions=i64(tokens), out_cache_loc=i64(tokens + 1))
    one_forward(canary, decode)
    assert [(e.phase, e.position, e.slot, e.reasons) for e in canary.poll()] == [
        ("head", 1233, 1234, ("REAL_KV_HASH",)), ("tail", 1233, 1234, ("REAL_KV_HASH",))]


def test_the_cpu_loops_serial_builds_count_no_references():
    """The CPU backend's serial builds of its check, hash and plan loops run without numba's
    reference counting (docs/design.md): counted, the check and the hash took four to six times as
    long an entry. A numba without the option, or one whose JIT is off, keeps its default."""
    from kvcanary_cupy.ops.backends._cpu import hashing, plan, verify

    builds = (verify._entry_bits_serial, hashing.hash_slots_serial, plan._fill_entries_serial)
    if not hasattr(hashing.CPUTargetOptions, "_nrt") or not all(hasattr(b, "targetoptions") for b in builds):
        pytest.skip("this numba builds every loop with its reference counting")
    assert [b.targetoptions.get("_nrt") for b in builds] == [False] * 3
    parallel = (verify._entry_bits_parallel, hashing.hash_slots_parallel, plan._fill_entries_parallel)
    assert [b.targetoptions.get("parallel") for b in parallel] == [True] * 3


@pytest.mark.parametrize("device", BACKENDS)
def test_counters_with_more_sources_than_numba_threads_take(device):
    """SPEC §3.2 steps 1-2 hold however many sources a canary hashes: with 101 (verified serially on
    the CPU) each verify counts its launch, and its entries only when its plan is enabled."""
    rng = np.random.default_rng(75)
    buffers = [to_device(rng.integers(1, 256, size=(8, 16), dtype=np.uint8), device) for _ in range(101)]
    ctx = _chain(device, 8, real_kv_sources=kc.layouts.per_layer(buffers), hash_mode=kc.HashMode.PARTIAL)
    assert ctx.counters() == {"slot_run_counter": 4, "kernel_run_counter": 1, "violations": 0}
    for enable, runs, entries in ((1, 2, 4 + 3), (0, 3, 4 + 3)):
        plan = host_verify_plan([1, 2, 3], [-1] * 3, [0, 1, 2], [-1, 1, 2], enable=enable, device=device)
        kc.verify(ctx, plan, tag=TAG)
        assert ctx.counters() == {"slot_run_counter": entries, "kernel_run_counter": runs, "violations": 0}


@pytest.mark.parametrize("device", BACKENDS)
def test_row_padding_bytes_ignored(device):
    """Bytes between strided rows are never read."""
    p, r, pos = _filled(device, 8, mode=kc.HashMode.ALL)
    spec = p.sources[0]
    if device == "cpu":
        spec.array.base[:, spec.array.shape[1]:] ^= 0xFF
    else:
        pytest.skip("device copy of the padding is not reachable through the view")
    assert _verify(p) == []


@pytest.mark.parametrize("device", BACKENDS)
def test_corrupt_stored_real_kv_hash(device):
    p, r, pos = _filled(device, 9, mode=kc.HashMode.PARTIAL)
    b, buf = p.batch, p.ctx.canary_buf
    s, s_prev = b.slot(r, pos), b.slot(r, pos - 1)
    _set_field(p.ctx, s, 3, 77)
    _check(device, _verify(p), [(TAG, s, pos, b.token(r, pos), -1, fields(buf, s)[2], link_of(buf, s_prev), 4)])


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_req_to_token_points_at_other_request(device, seed):
    p, r, pos = _filled(device, seed)
    b, buf = p.batch, p.ctx.canary_buf
    other = next(q for q in b.live() if q != r)
    pos_b = next(q for q in range(int(b.seq_lens[other])) if q != pos)
    stolen = b.slot(other, pos_b)
    table = b.req_to_token.copy()
    table[b.req_pool_indices[r], pos] = stolen
    s_next, s_prev = b.slot(r, pos + 1), b.slot(r, pos - 1)
    p.ctx.clear_violations()
    p.plan(b.seq_lens, np.zeros(b.bs, np.int64), req_to_token=table)
    kc.verify(p.ctx, p.vplan, tag=TAG)
    expected = [(TAG, stolen, pos_b, b.token(other, pos_b), -1, fields(buf, stolen)[2], link_of(buf, s_prev), 3),
                (TAG, s_next, pos + 1, b.token(r, pos + 1), -1, fields(buf, s_next)[2], link_of(buf, stolen), 1)]
    _check(device, ring_rows(p.ctx), expected)


# --- hand-written plans ---------------------------------------------------------------------------

def _chain(device, num_slots=8, **kwargs):
    """Slots 1..4 hold positions 0..3 of one chain (tokens 10..13)."""
    ctx = kc.CanaryContext.allocate(num_slots, device=device, **kwargs)
    wplan = kc.WritePlan.from_host(offsets=[0, 4], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.write(ctx, wplan, tag=0, input_ids=put([10, 11, 12, 13]), positions=put([0, 1, 2, 3]),
             out_cache_loc=put([1, 2, 3, 4]))
    ctx.clear_violations()
    return ctx


@pytest.mark.parametrize("device", BACKENDS)
def test_padding_slot_and_padding_predecessor(device):
    ctx = _chain(device)
    buf = ctx.canary_buf
    # slot 0 is never checked; prev 0 leaves the chain unchecked (aux = stored prev_hash).
    plan = host_verify_plan([0, 3, 3], [-1, -1, -1], [99, 2, 5], [2, 0, 0], device=device)
    kc.verify(ctx, plan, tag=TAG)
    assert ring_rows(ctx) == [(TAG, 3, 2, 12, -1, fields(buf, 3)[2], fields(buf, 3)[2], 2)]
    assert ctx.counters()["slot_run_counter"] == 4 + 3


@pytest.mark.parametrize("device", BACKENDS)
def test_negative_predecessor_is_anchor(device):
    ctx = _chain(device)
    buf = ctx.canary_buf
    plan = host_verify_plan([1, 2], [-1, -1], [0, 1], [-7, -1], device=device)
    kc.verify(ctx, plan, tag=TAG)
    # slot 1 is at position 0: any negative predecessor checks against the anchor and passes;
    # slot 2 is not at the chain's start: the anchor does not match.
    assert ring_rows(ctx) == [(TAG, 2, 1, 11, -1, fields(buf, 2)[2], signed(ANCHOR_LINK), 1)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("check_token", [False, True])
def test_expected_token_minus_one_not_checked(device, check_token):
    ctx = _chain(device)
    buf = ctx.canary_buf
    plan = host_verify_plan([1, 2, 3], [-1, 11, 99], [0, 1, 2], [-1, 1, 2], device=device)
    kc.verify(ctx, plan, tag=TAG, check_expected_token=check_token)
    expected = [(TAG, 3, 2, 12, 99, fields(buf, 3)[2], link_of(buf, 2), 32)] if check_token else []
    assert ring_rows(ctx) == expected


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("check_token", [False, True])
def test_slot_out_of_range(device, check_token):
    ctx = _chain(device, 8)
    plan = host_verify_plan([8, -3, UNRESOLVED, 2], [5, 6, 7, 11], [1, 2, 3, 1], [1, 1, 1, 1], device=device)
    kc.verify(ctx, plan, tag=TAG, check_expected_token=check_token)
    tok = (lambda t: t) if check_token else (lambda t: -1)
    assert_rows(device, ring_rows(ctx), [(TAG, 8, 1, 0, tok(5), 0, 0, 64), (TAG, -3, 2, 0, tok(6), 0, 0, 64),
                                         (TAG, UNRESOLVED, 3, 0, tok(7), 0, 0, 64)])


@pytest.mark.parametrize("device", BACKENDS)
def test_predecessor_out_of_range(device):
    ctx = _chain(device, 8)
    buf = ctx.canary_buf
    plan = host_verify_plan([2, 3], [-1, -1], [1, 7], [8, UNRESOLVED], device=device)
    kc.verify(ctx, plan, tag=TAG)
    h2, h3 = fields(buf, 2)[2], fields(buf, 3)[2]
    assert_rows(device, ring_rows(ctx), [(TAG, 2, 1, 11, -1, h2, h2, 64), (TAG, 3, 2, 12, -1, h3, h3, 64 | 2)])


@pytest.mark.parametrize("device", BACKENDS)
def test_source_row_out_of_range_on_verify(device):
    rng = np.random.default_rng(3)
    spec = random_source(rng, 6, page_size=2, num_bytes_per_token=16)  # rows for slots 0..5
    ctx = _chain(device, 8, real_kv_sources=(spec.build(device),), hash_mode=kc.HashMode.PARTIAL)
    # Slots 1..4 were written with real hashes and pass; slot 6 (row 3, past the source) folds as 0,
    # so sm(0) == 0 matches a zero stored hash and only bit 64 is set, while a non-zero one adds bit 4.
    plan = host_verify_plan([4, 6], [-1, -1], [3, 0], [3, 0], device=device)
    kc.verify(ctx, plan, tag=TAG)
    assert ring_rows(ctx) == [(TAG, 6, 0, 0, -1, 0, 0, 64)]
    ctx.clear_violations()
    _set_field(ctx, 6, 3, 77)
    kc.verify(ctx, plan, tag=TAG)
    assert ring_rows(ctx) == [(TAG, 6, 0, 0, -1, 0, 0, 64 | 4)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_first_slot_past_a_token_per_row_source_is_out_of_range(device, mode):
    """SPEC §4 with ``page_size == 1``: slot ``rows`` is the first slot past the source, even where
    the memory after its last row can be read (here more rows of the array it views). Its fold is
    0 and bit 64 is set, by the write that stores it and by the verify that checks it."""
    rng = np.random.default_rng(74)
    parent = rng.integers(1, 256, size=(9, 32), dtype=np.uint8)
    source = kc.RealKvSource(tensor=to_device(parent[:6], device), page_size=1, num_bytes_per_token=32,
                             read_bytes=32)  # rows for slots 0..5
    ctx = kc.CanaryContext.allocate(8, device=device, real_kv_sources=(source,), hash_mode=mode)
    ids = [int(t) for t in rng.integers(1, 2**40, size=2)]
    wplan = kc.WritePlan.from_host(offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.write(ctx, wplan, tag=0, input_ids=put(ids), positions=put([0, 1]), out_cache_loc=put([5, 6]))
    buf = ctx.canary_buf
    assert ring_rows(ctx) == [(0, 6, 1, ids[1], ids[1], link_of(buf, 5), 1, 64)]
    assert fields(buf, 6)[3] == 0  # sm(0 ^ 0): the source folded as 0
    ctx.clear_violations()
    kc.verify(ctx, host_verify_plan([5, 6], [-1, -1], [0, 1], [-1, 5], device=device), tag=TAG)
    assert ring_rows(ctx) == [(TAG, 6, 1, ids[1], -1, link_of(buf, 5), link_of(buf, 5), 64)]


@pytest.mark.parametrize("device", BACKENDS)
def test_a_source_of_no_rows_puts_every_slot_out_of_range(device):
    """SPEC §4: a source of no rows holds no slot's row. It stays one of the context's sources, so
    every slot it would be read for gets bit 64 (its fold 0), by the write and by the verify."""
    rng = np.random.default_rng(92)
    empty = kc.RealKvSource(tensor=to_device(rng.integers(1, 256, size=(4, 32), dtype=np.uint8), device)[:0],
                            page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = kc.CanaryContext.allocate(8, device=device, real_kv_sources=(empty,), hash_mode=kc.HashMode.PARTIAL)
    ids = [int(t) for t in rng.integers(1, 2**40, size=2)]
    wplan = kc.WritePlan.from_host(offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.write(ctx, wplan, tag=0, input_ids=put(ids), positions=put([0, 1]), out_cache_loc=put([3, 5]))
    buf = ctx.canary_buf
    assert sorted(ring_rows(ctx)) == sorted([(0, 3, 0, ids[0], ids[0], signed(ANCHOR_LINK), 0, 64),
                                             (0, 5, 1, ids[1], ids[1], link_of(buf, 3), 1, 64)])
    ctx.clear_violations()
    kc.verify(ctx, host_verify_plan([3, 5], [-1, -1], [0, 1], [-1, 3], device=device), tag=TAG)
    assert sorted(ring_rows(ctx)) == sorted([(TAG, 3, 0, ids[0], -1, signed(ANCHOR_LINK), signed(ANCHOR_LINK), 64),
                                             (TAG, 5, 1, ids[1], -1, link_of(buf, 3), link_of(buf, 3), 64)])


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("num_valid,active", [(-5, 0), (0, 0), (2, 2), (4, 4), (100, 4)])
def test_num_valid_clamped(device, num_valid, active):
    ctx = _chain(device)
    plan = host_verify_plan([1, 2, 3, 4], [-1] * 4, [9, 9, 9, 9], [-1, 1, 2, 3], num_valid=num_valid,
                            device=device)
    before = ctx.counters()
    kc.verify(ctx, plan, tag=TAG)
    after = ctx.counters()
    assert after["slot_run_counter"] - before["slot_run_counter"] == active
    assert after["kernel_run_counter"] - before["kernel_run_counter"] == 1
    assert sorted(r[1] for r in ring_rows(ctx)) == [1, 2, 3, 4][:active]


@pytest.mark.parametrize("device", BACKENDS)
def test_disabled_plan_skips(device):
    ctx = _chain(device)
    plan = host_verify_plan([1, 2], [-1, -1], [9, 9], [-1, 1], enable=0, device=device)
    before = ctx.counters()
    kc.verify(ctx, plan, tag=TAG)
    after = ctx.counters()
    assert after["kernel_run_counter"] == before["kernel_run_counter"] + 1
    assert after["slot_run_counter"] == before["slot_run_counter"]
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("tag", list(kc.LaunchTag))
def test_tag_recorded(device, tag):
    ctx = _chain(device)
    kc.verify(ctx, host_verify_plan([2], [-1], [5], [1], device=device), tag=tag)
    report = ctx.violations()
    assert report[0].kernel_kind == tag and report[0].fail_reason == kc.FailReason.POSITION


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("capacity", [0, 1, 3])
def test_ring_overflow_keeps_first_rows(device, capacity):
    full = _chain(device, 12, ring_capacity=64)
    small = _chain(device, 12, ring_capacity=capacity)
    n = 9
    plan_args = ([1 + (k % 4) for k in range(n)], [-1] * n, [50 + k for k in range(n)], [0] * n)
    kc.verify(full, host_verify_plan(*plan_args, device=device), tag=TAG)
    kc.verify(small, host_verify_plan(*plan_args, device=device), tag=TAG)
    all_rows = ring_rows(full)
    report = small.violations()
    assert (report.total, report.dropped, len(report)) == (n, n - capacity, capacity)
    if device == "cpu":
        assert ring_rows(small) == all_rows[:capacity]
    else:
        kept, pool = as_multiset(ring_rows(small)), as_multiset(all_rows)
        assert all(pool.get(row, 0) >= c for row, c in kept.items())
    # Further violations are still counted.
    kc.verify(small, host_verify_plan(*plan_args, device=device), tag=TAG)
    assert small.violations().total == 2 * n


@pytest.mark.parametrize("device", BACKENDS)
def test_clear_violations_zeroes_the_rows_and_the_write_index(device):
    """``clear_violations`` empties the ring, its rows as well as its write index: a caller reading
    the ring's own array afterwards finds no row of before."""
    ctx = _chain(device, 8, ring_capacity=4)
    kc.verify(ctx, host_verify_plan([2, 3], [-1, -1], [7, 9], [1, 2], device=device), tag=TAG)
    assert len(ring_rows(ctx)) == 2
    ctx.clear_violations()
    assert not to_numpy(ctx.violation_ring).any()
    assert to_numpy(ctx.violation_write_index).tolist() == [0]


@pytest.mark.parametrize("device", BACKENDS)
def test_verify_is_read_only(device):
    ctx = _chain(device)
    buf = snapshot(ctx.canary_buf)[0]
    kc.verify(ctx, host_verify_plan([1, 2, 3, 9, 4], [1, 2, 3, 4, 5], [3, 2, 1, 0, 0], [4, 3, 2, 1, 9],
                                    device=device), tag=TAG, check_expected_token=True)
    assert ctx.violations().total > 0
    assert np.array_equal(to_numpy(ctx.canary_buf), buf)


def test_ops_from_several_threads_with_numba_workqueue_layer():
    """Canaries driven from several Python threads at once (two canaries, a host tier's thread beside
    the engine's): numba's workqueue threading layer, its fallback where neither TBB nor OpenMP is
    installed, ends the process when two threads run parallel regions at once, so the CPU ops run
    their parallel builds one call at a time. Batches past every op's parallel threshold."""
    import subprocess
    import sys

    code = '''
import threading
import numpy as np
import kvcanary_cupy as kc

def work(found):
    n = 70000
    ctx = kc.CanaryContext.allocate(n + 1)
    vplan, wplan = kc.VerifyPlan.allocate(n), kc.WritePlan.allocate(1)
    slots = np.arange(1, n + 1, dtype=np.int64)
    table = np.zeros((2, n + 1), np.int32)
    table[1, :n] = slots
    batch = dict(req_pool_indices=np.array([1]), req_to_token=table)
    for _ in range(6):
        kc.plan(vplan, wplan, prefix_lens=np.array([0]), extend_seq_lens=np.array([n]), **batch)
        kc.write(ctx, wplan, tag=2, input_ids=slots, positions=slots - 1, out_cache_loc=slots)
        kc.plan(vplan, wplan, prefix_lens=np.array([n]), extend_seq_lens=np.array([0]), **batch)
        kc.verify(ctx, vplan, tag=0)
    found.append(ctx.violations().total)

found = []
threads = [threading.Thread(target=work, args=(found,)) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
import numba
print(numba.threading_layer(), found)
'''
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["workqueue", "[0,", "0,", "0]"], done.stdout


# --- SPEC rules pinned one at a time ----------------------------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("enable", [2, -1, 2**31 - 1])
def test_any_non_zero_enable_runs(device, enable):
    """SPEC §3.2 step 1 stops only when ``enable == 0``: any other value checks the entries."""
    ctx = _chain(device)
    buf = ctx.canary_buf
    plan = host_verify_plan([1, 2, 3], [-1, -1, -1], [0, 1, 9], [-1, 1, 2], enable=enable, device=device)
    before = ctx.counters()
    kc.verify(ctx, plan, tag=TAG)
    assert ring_rows(ctx) == [(TAG, 3, 2, 12, -1, fields(buf, 3)[2], link_of(buf, 2), 2)]
    after = ctx.counters()
    assert after["slot_run_counter"] - before["slot_run_counter"] == 3
    assert after["kernel_run_counter"] - before["kernel_run_counter"] == 1


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_short_source_among_several_on_verify(device, mode):
    """SPEC §4: a slot past one source's rows, among several sources, recomputes its hash with that
    source folded as 0 in its place: a slot written so matches it (bit 64 alone, chain and
    position intact); bytes changed in another source's row add bit 4."""
    rng = np.random.default_rng(41)
    num_slots = 12
    specs = [random_source(rng, num_slots, page_size=2, num_bytes_per_token=32),
             random_source(rng, 6, page_size=3, num_bytes_per_token=16),  # rows for slots 0..5
             random_source(rng, num_slots, page_size=1, num_bytes_per_token=64, read_bytes=48)]
    ctx = kc.CanaryContext.allocate(num_slots, device=device, real_kv_sources=tuple(s.build(device) for s in specs),
                                    hash_mode=mode)
    slots = [4, 10, 7]
    ids = [int(t) for t in rng.integers(1, 2**40, size=3)]
    wplan = kc.WritePlan.from_host(offsets=[0, 3], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.write(ctx, wplan, tag=0, input_ids=put(ids), positions=put([0, 1, 2]), out_cache_loc=put(slots))
    ctx.clear_violations()
    buf = ctx.canary_buf
    plan = host_verify_plan(slots, [-1] * 3, [0, 1, 2], [-1, 4, 10], device=device)
    kc.verify(ctx, plan, tag=TAG)
    rows = [(TAG, 10, 1, ids[1], -1, fields(buf, 10)[2], link_of(buf, 4), 64),
            (TAG, 7, 2, ids[2], -1, fields(buf, 7)[2], link_of(buf, 10), 64)]
    assert ring_rows(ctx) == rows
    ctx.clear_violations()
    ctx.real_kv_sources[2].tensor[10, 3] ^= 0x21  # inside the read window of the last source
    kc.verify(ctx, plan, tag=TAG)
    assert ring_rows(ctx) == [rows[0][:7] + (64 | 4,), rows[1]]


_CONTEXT_ARRAYS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
                   "chain_position_assert")


def _context_below_a_long_row(num_slots: int, held: np.ndarray, row_bytes: int, device: str):
    """The arrays of ``CanaryContext.allocate(num_slots, ring_capacity=8)`` (by name) and, after
    them in one allocation, ``held``'s bytes as a source row of ``row_bytes`` bytes (a 1-row view:
    a source reads row 0 only, at its slots' columns, so its row may claim far more than ``held``
    has). Everything the ops store lies below the claimed row, as the package requires, wherever
    the allocator puts the block."""
    template = kc.CanaryContext.allocate(num_slots, ring_capacity=8)
    spans, used = {}, 0
    for name in _CONTEXT_ARRAYS:
        spans[name] = used
        used += -(-getattr(template, name).nbytes // 256) * 256
    xp = np if device == "cpu" else cupy_module()
    block = xp.zeros(used + held.size, dtype=np.uint8)
    block[used:] = xp.asarray(held)
    arrays = {}
    for name, at in spans.items():
        like = getattr(template, name)
        arrays[name] = block[at:at + like.nbytes].view(like.dtype).reshape(like.shape)
        arrays[name][...] = xp.asarray(like)
    row = xp.lib.stride_tricks.as_strided(block[used:], shape=(1, row_bytes), strides=(row_bytes, 1))
    return arrays, row


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_source_page_of_more_than_2_to_the_32_tokens(device, mode):
    """A page of more tokens than 32 bits count, and no power of two: the kernels divide a slot by
    it in 64 bits. Every slot of the pool is then in row 0, at column slot * bytes a token. Beside
    a source of 3-token pages (a 32-bit division of each slot just before), a write stores each
    slot's SPEC §2 hash and a verify of the slots finds nothing; a byte changed in the big page is
    found at its slot alone. The big source's rows claim 64 GiB over the bytes its slots read."""
    rng = np.random.default_rng(47)
    num_slots, per_token, big_page = 40, 16, (1 << 32) + 3
    small = random_source(rng, num_slots, page_size=3, num_bytes_per_token=per_token)
    held = rng.integers(1, 256, size=num_slots * per_token, dtype=np.uint8)
    big = SourceSpec(np.lib.stride_tricks.as_strided(held, shape=(1, big_page * per_token), strides=(0, 1)),
                     big_page, per_token, per_token)  # the host copy the expected hashes are read from
    arrays, row = _context_below_a_long_row(num_slots, held, big_page * per_token, device)
    slots = [5, 17, 38, 2, 30]
    ids = [int(t) for t in rng.integers(1, 2**40, size=len(slots))]
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    try:  # a failure's traceback would show the package's frames, whose arguments include the 64 GiB view
        ctx = kc.CanaryContext(**arrays, hash_mode=mode,
                               real_kv_sources=(small.build(device), kc.RealKvSource(tensor=row, page_size=big_page,
                                                                                      num_bytes_per_token=per_token,
                                                                                      read_bytes=per_token)))
        wplan = kc.WritePlan.from_host(offsets=[0, len(slots)], seed_slot_indices=[-1], num_valid_reqs=1,
                                       device=device)
        kc.write(ctx, wplan, tag=0, input_ids=put(ids), positions=put(range(len(slots))), out_cache_loc=put(slots))
        written = ring_rows(ctx)
        hashes = [fields(ctx.canary_buf, slot)[3] for slot in slots]
        plan = host_verify_plan(slots, [-1] * len(slots), list(range(len(slots))), [-1] + slots[:-1], device=device)
        kc.verify(ctx, plan, tag=TAG)
        clean = ring_rows(ctx)
        row[0, slots[2] * per_token + 3] ^= 0x44  # inside the read window of slot 38 in the big page
        kc.verify(ctx, plan, tag=TAG)
        found = [(r[1], r[7]) for r in ring_rows(ctx)]
    except Exception as error:
        raise AssertionError(f"{type(error).__name__}: {error}") from None
    want = [expected_kv_hash([small, big], mode, slot) for slot in slots]
    assert written == [] and clean == []
    assert hashes == want
    assert len(set(want)) == len(slots)  # the slots' bytes differ, so each hash is its own slot's
    assert found == [(slots[2], int(kc.FailReason.REAL_KV_HASH))]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("check_token", [False, True])
def test_padding_slot_entry_is_skipped_whole(device, check_token):
    """SPEC §3.2 step 3 checks only entries with ``slot != 0``: an entry of slot 0 records nothing,
    not even for a predecessor out of range (§4's bit 64 is a check of an entry that is checked),
    yet it is counted in ``slot_run_counter``."""
    ctx = _chain(device, 8)
    plan = host_verify_plan([0, 0, 0], [99, 98, 97], [7, 8, 9], [8, UNRESOLVED, -4], device=device)
    before = ctx.counters()
    kc.verify(ctx, plan, tag=TAG, check_expected_token=check_token)
    assert ring_rows(ctx) == []
    assert ctx.counters()["slot_run_counter"] - before["slot_run_counter"] == 3


@pytest.mark.parametrize("device", BACKENDS)
def test_ring_capacity_zero_counts_every_verify_violation_and_stores_none(device):
    """SPEC §2, fill-once with ``ring_capacity = 0`` (README: allowed): each entry that would record
    a row (a position mismatch, a slot and a predecessor out of range, a broken chain) advances
    ``write_index`` and stores nothing, and nothing is written outside the context's arrays; the
    canary buffer is left as it was (verify is read-only)."""
    rng = np.random.default_rng(71)
    ctx, backings, before = guarded_context(device, rng, 10)
    ids = [int(t) for t in rng.integers(1, 2**40, size=4)]
    slots = [5, 2, 7, 3]
    wplan = kc.WritePlan.from_host(offsets=[0, 4], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.write(ctx, wplan, tag=0, input_ids=put(ids), positions=put([0, 1, 2, 3]), out_cache_loc=put(slots))
    assert ctx.counters() == {"slot_run_counter": 4, "kernel_run_counter": 1, "violations": 0}
    buf = snapshot(ctx.canary_buf)[0]
    plan = host_verify_plan([5, 2, 7, 12, 3, 3, 0], [-1] * 7, [0, 1, 9, 4, 3, 3, 5], [-1, 5, 2, 7, 40, 2, 3],
                            device=device)
    kc.verify(ctx, plan, tag=TAG)
    report = ctx.violations()
    assert (report.total, report.dropped, len(report)) == (4, 4, 0)
    assert ctx.counters() == {"slot_run_counter": 4 + 7, "kernel_run_counter": 2, "violations": 4}
    assert np.array_equal(to_numpy(ctx.canary_buf), buf)
    assert to_numpy(backings["violation_write_index"])[1] == 4  # the caller's own int32 cell
    assert_only_views_changed(backings, before)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_short_source_bit_joins_every_other_bit(device, mode):
    """SPEC §4: a slot past the source's rows folds it as 0 and sets bit 64, which joins whatever
    else the entry finds, in one row: chain (1), position (2), real-KV (4) and token (32) together
    give 103; an entry that is otherwise right records 64 alone."""
    rng = np.random.default_rng(72)
    spec = random_source(rng, 6, page_size=2, num_bytes_per_token=32)  # rows for slots 0..5
    ctx = kc.CanaryContext.allocate(12, device=device, real_kv_sources=(spec.build(device),), hash_mode=mode)
    ids = [int(t) for t in rng.integers(1, 2**40, size=3)]
    first = int(rng.integers(0, 10**6))
    pos = [first, first + 1, first + 2]
    wplan = kc.WritePlan.from_host(offsets=[0, 3], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.write(ctx, wplan, tag=0, input_ids=put(ids), positions=put(pos), out_cache_loc=put([4, 9, 11]))
    assert [r[1] for r in ring_rows(ctx)] == [9, 11]  # the write's own rows for slots past the source
    ctx.clear_violations()
    buf = ctx.canary_buf
    assert fields(buf, 9)[3] == 0  # sm(0 ^ 0): the source folded as 0
    bad_hash = int(rng.integers(1, 2**62))
    _set_field(ctx, 9, 3, bad_hash)
    # slot 9 with a wrong expected token and position and a wrong predecessor (11); slot 11 right
    plan = host_verify_plan([9, 11], [ids[1] + 1, ids[2]], [pos[1] + 4, pos[2]], [11, 9], device=device)
    kc.verify(ctx, plan, tag=TAG, check_expected_token=True)
    h9, h11 = fields(buf, 9)[2], fields(buf, 11)[2]
    assert (h9, h11) == (link_of(buf, 4), link_of(buf, 9))  # the chain itself is intact
    assert_rows(device, ring_rows(ctx), [
        (TAG, 9, pos[1], ids[1], ids[1] + 1, h9, link_of(buf, 11), 1 | 2 | 4 | 32 | 64),
        (TAG, 11, pos[2], ids[2], ids[2], h11, link_of(buf, 9), 64)])


@requires_gpu
@pytest.mark.parametrize("dense", [False, True], ids=["fuzz_cases", "every_entry_a_row"])
def test_more_entries_than_one_pass_of_the_grid_equal_the_cpu_backend(dense):
    """Each thread of the verify grid takes every grid-th entry, its next plan row loaded while it
    checks this one: plans of more entries than one pass of any grid the GPU holds at once equal
    the CPU backend. The fuzz's cases are rarely that large, and their few corrupted slots rarely
    fall where an entry left unchecked would be; over a canary of random words (``dense``) nearly
    every entry records a row, so an entry left unchecked is a row missing."""
    for seed in (81, 82):
        assert F.past_one_grid_pass_equal_the_cpu_backend("verify", seed, dense=dense) == [], f"seed {seed}"
