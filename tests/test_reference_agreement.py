"""The numba backend agrees byte for byte with the plain-Python model ``kvcanary_cupy.reference`` on
randomized inputs, garbage included: out-of-range and negative indices, UNRESOLVED markers, sources
too short for the pool, duplicate slots, broken offsets, ring overflow.

``KVCANARY_AGREEMENT_SEEDS=N`` draws N random cases an op instead of 40 (a deeper run than the
suite's; the first 40 are the suite's own), and ``KVCANARY_AGREEMENT_FIRST_SEED=S`` starts them at
seed S instead of 0, so that a later deep run draws cases no earlier one did."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import reference as ref
from _builders import random_source

U = kc.UNRESOLVED_SLOT
FIRST_SEED = int(os.environ.get("KVCANARY_AGREEMENT_FIRST_SEED", "0"))
SEEDS = range(FIRST_SEED, FIRST_SEED + int(os.environ.get("KVCANARY_AGREEMENT_SEEDS", "40")))


def _index(rng, low, high, extras=(U,), p_extra=0.05):
    """An int64 index in [low, high), now and then one of ``extras``."""
    if extras and rng.random() < p_extra:
        return int(rng.choice(np.array(extras, dtype=np.int64)))
    return int(rng.integers(low, high))


def _sources(rng, num_slots):
    specs = []
    for _ in range(int(rng.integers(0, 4))):
        page = int(rng.choice([1, 2, 3, 4]))
        bpt = int(rng.choice([16, 32, 64]))
        read = int(rng.choice([r for r in (16, 32, 48, 64) if r <= bpt]))
        full_rows = -(-num_slots // page)
        short = int(rng.integers(0, full_rows + 1)) if rng.random() < 0.3 else 0
        specs.append(random_source(rng, num_slots, page_size=page, num_bytes_per_token=bpt, read_bytes=read,
                                   pad_bytes=int(rng.choice([0, 16, 48])), extra_rows=-short))
    return specs


def _context(rng, num_slots, specs, mode, ring_capacity, stride, buf, assert_flag=0):
    return kc.CanaryContext(canary_buf=buf.copy(), violation_ring=np.full((ring_capacity, 8), -5, np.int64),
                            violation_write_index=np.zeros(1, np.int32),
                            slot_run_counter=np.array([7], np.int64), kernel_run_counter=np.array([3], np.int64),
                            chain_position_assert=np.array([assert_flag], np.int32),
                            real_kv_sources=tuple(s.build("cpu") for s in specs), hash_mode=mode)


def _reference_state(ctx):
    return (ctx.canary_buf.copy(), ctx.violation_ring.copy(), ctx.violation_write_index.copy(),
            ctx.slot_run_counter.copy(), ctx.kernel_run_counter.copy())


def _assert_same(ctx, state):
    names = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")
    for name, expected in zip(names, state):
        got = getattr(ctx, name)
        assert got.tobytes() == expected.tobytes(), name


def _ref_sources(specs, mode):
    return [] if mode == kc.HashMode.NONE else [s.reference_tuple(mode) for s in specs]


def _random_buffer(rng, num_slots, stride, specs, mode):
    """A canary buffer holding a few real chains (written by the model) plus random damage."""
    buf = np.zeros((num_slots, stride), np.uint8)
    n = int(rng.integers(0, 2 * num_slots))
    loc = rng.integers(1, num_slots, size=n) if num_slots > 1 else np.zeros(n, np.int64)
    cuts = np.sort(rng.integers(0, n + 1, size=3))
    offsets = np.array([0, *cuts, n], np.int64)
    ring = np.zeros((64, 8), np.int64)
    ref.write(buf, _ref_sources(specs, mode), ring, np.zeros(1, np.int32), np.zeros(1, np.int64),
              np.zeros(1, np.int64), offsets=offsets, seed_slots=np.full(4, -1, np.int64),
              num_valid_reqs=np.array([4], np.int32), input_ids=rng.integers(0, 50, size=n),
              positions=np.arange(n, dtype=np.int64), out_cache_loc=loc.astype(np.int64), expected_tokens=None,
              expected_positions=None, chain_position_assert=np.zeros(1, np.int32), tag=0)
    for _ in range(int(rng.integers(0, 4))):
        buf[int(rng.integers(0, num_slots)), int(rng.integers(0, 32))] ^= np.uint8(rng.integers(1, 256))
    return buf


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_agrees(seed):
    rng = np.random.default_rng(1000 + seed)
    num_slots = int(rng.integers(1, 40))
    stride = int(rng.choice([32, 40, 64]))
    mode = kc.HashMode(int(rng.integers(0, 3)))
    specs = _sources(rng, num_slots)
    buf = _random_buffer(rng, num_slots, stride, specs, mode)
    ctx = _context(rng, num_slots, specs, mode, int(rng.integers(0, 12)), stride, buf)
    cap = int(rng.integers(0, 3 * num_slots + 2))
    words = buf.view(np.int64)
    slots = np.array([_index(rng, -2, num_slots + 2) for _ in range(cap)], np.int64)
    prevs = np.array([_index(rng, -3, num_slots + 2, extras=(U, -1, 0), p_extra=0.3) for _ in range(cap)], np.int64)
    in_range = (slots >= 0) & (slots < num_slots)
    tokens = np.where(rng.random(cap) < 0.5, -1, rng.integers(0, 50, size=cap))
    tokens = np.where(in_range & (rng.random(cap) < 0.5), words[np.where(in_range, slots, 0), 0], tokens)
    positions = np.where(in_range & (rng.random(cap) < 0.7), words[np.where(in_range, slots, 0), 1],
                         rng.integers(0, 9, size=cap))
    num_valid = np.array([int(rng.integers(-2, cap + 3))], np.int32)
    enable = np.array([0 if rng.random() < 0.1 else 1], np.int32)
    check_token = bool(rng.random() < 0.5)
    tag = int(rng.integers(0, 12))

    state = _context(rng, num_slots, specs, mode, ctx.ring_capacity, stride, buf)
    expected = _reference_state(state)
    ref.verify(expected[0], _ref_sources(specs, mode), expected[1], expected[2], expected[3], expected[4],
               slots=slots, expected_tokens=tokens, expected_positions=positions, prev_slots=prevs,
               num_valid=num_valid, enable=enable, check_expected_token=check_token, tag=tag)
    vplan = kc.VerifyPlan(slot_indices=slots.copy(), expected_tokens=tokens.astype(np.int64),
                          expected_positions=positions.astype(np.int64), prev_slot_indices=prevs.copy(),
                          num_valid=num_valid.copy(), enable=enable.copy())
    kc.verify(ctx, vplan, tag=tag, check_expected_token=check_token)
    _assert_same(ctx, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_write_agrees(seed):
    rng = np.random.default_rng(2000 + seed)
    num_slots = int(rng.integers(1, 40))
    stride = int(rng.choice([32, 48]))
    mode = kc.HashMode(int(rng.integers(0, 3)))
    specs = _sources(rng, num_slots)
    buf = _random_buffer(rng, num_slots, stride, specs, mode)
    assert_flag = int(rng.integers(0, 2))
    ring_capacity = int(rng.integers(0, 10))
    ctx = _context(rng, num_slots, specs, mode, ring_capacity, stride, buf, assert_flag)
    n = int(rng.integers(0, 3 * num_slots + 2))
    cap = int(rng.integers(0, 6))
    offsets = np.sort(rng.integers(0, n + 1, size=cap + 1)).astype(np.int64)
    if cap and rng.random() < 0.3:  # broken offsets: past the entries, negative, or decreasing
        offsets[int(rng.integers(0, cap + 1))] = int(rng.choice([n + 3, -2, 0]))
    seeds = np.array([_index(rng, -2, num_slots + 2, extras=(U, -1), p_extra=0.3) for _ in range(cap)], np.int64)
    loc = np.array([_index(rng, -2, num_slots + 2, extras=(-1, 0), p_extra=0.1) for _ in range(n)], np.int64)
    ids = rng.integers(0, 30, size=n).astype(np.int64)
    pos = (np.arange(n) + (rng.random(n) < 0.1) * rng.integers(-3, 4, size=n)).astype(np.int64)
    has_expected = bool(rng.random() < 0.5)
    exp_ids = np.where(rng.random(n) < 0.1, ids + 1, ids) if has_expected else None
    exp_pos = np.where(rng.random(n) < 0.1, pos + 1, pos) if has_expected else None
    num_valid_reqs = np.array([int(rng.integers(-1, cap + 2))], np.int32)
    tag = int(rng.integers(0, 12))

    state = _context(rng, num_slots, specs, mode, ring_capacity, stride, buf, assert_flag)
    expected = _reference_state(state)
    ref.write(expected[0], _ref_sources(specs, mode), expected[1], expected[2], expected[3], expected[4],
              offsets=offsets, seed_slots=seeds, num_valid_reqs=num_valid_reqs, input_ids=ids, positions=pos,
              out_cache_loc=loc, expected_tokens=exp_ids, expected_positions=exp_pos,
              chain_position_assert=np.array([assert_flag], np.int32), tag=tag)
    wplan = kc.WritePlan(offsets=offsets.copy(), seed_slot_indices=seeds.copy(), num_valid_reqs=num_valid_reqs.copy())
    kc.write(ctx, wplan, tag=tag, input_ids=ids.copy(), positions=pos.copy(), out_cache_loc=loc.copy(),
             expected_input_tokens=None if exp_ids is None else exp_ids.astype(np.int64),
             expected_input_positions=None if exp_pos is None else exp_pos.astype(np.int64))
    _assert_same(ctx, expected)


@pytest.mark.parametrize("enable, first_row", [(2, 0), (-1, 0), (2**31 - 1, 0), (1, 2**31 - 3)],
                         ids=["2", "-1", "int32-max", "write-index-wraps"])
def test_verify_agrees_for_any_non_zero_enable(enable, first_row):
    """SPEC §3.2 step 1 stops only when ``enable == 0``: the model checks a plan whose ``enable`` holds
    any other value, as the backend does, and finds the damage in it. A ring write index that
    passes int32's maximum on the way wraps to its minimum in both (the rows past the ring are
    counted, not stored)."""
    rng = np.random.default_rng(1500 + enable % 97)
    num_slots = 24
    specs = _sources(rng, num_slots)
    mode = kc.HashMode.ALL
    buf = _random_buffer(rng, num_slots, 32, specs, mode)
    words = buf.view(np.int64)
    slots = rng.permutation(np.arange(1, num_slots)).astype(np.int64)
    prevs = np.array([_index(rng, -1, num_slots, extras=(0,), p_extra=0.2) for _ in slots], np.int64)
    positions = words[slots, 1] + (rng.random(slots.shape[0]) < 0.3)  # some positions are off by one
    tokens = words[slots, 0].copy()
    ctx = _context(rng, num_slots, specs, mode, 64, 32, buf)
    ctx.violation_write_index[0] = first_row
    expected = _reference_state(ctx)
    plan = dict(slots=slots, expected_tokens=tokens, expected_positions=positions, prev_slots=prevs,
                num_valid=np.array([slots.shape[0]], np.int32), enable=np.array([enable], np.int32))
    ref.verify(expected[0], _ref_sources(specs, mode), expected[1], expected[2], expected[3], expected[4],
               check_expected_token=True, tag=3, **plan)
    found = (int(expected[2][0]) - first_row) % 2**32  # rows were found: the model did not skip the step
    assert found > (3 if first_row else 0) and (int(expected[2][0]) < 0) == bool(first_row)
    assert int(expected[3][0]) == 7 + slots.shape[0]
    kc.verify(ctx, kc.VerifyPlan(slot_indices=slots, expected_tokens=tokens, expected_positions=positions,
                                 prev_slot_indices=prevs, num_valid=plan["num_valid"], enable=plan["enable"]),
              tag=3, check_expected_token=True)
    _assert_same(ctx, expected)


def test_write_agrees_past_the_int64_maximum_position():
    """SPEC §2 (arithmetic wraps modulo 2^64): with the chain position assert on, an entry after a
    predecessor at position 2^63 - 1 is expected at -2^63, in the model as in the backend; any other
    position is recorded with that expectation."""
    rng = np.random.default_rng(2063)
    num_slots = 8
    low, high = -(1 << 63), (1 << 63) - 1
    buf = rng.integers(0, 256, size=(num_slots, 32), dtype=np.uint8)
    words = buf.view(np.int64)
    words[1, :3] = [int(rng.integers(1, 2**31)), high, int(rng.integers(1, 2**62))]  # the seed, at the maximum
    ids = rng.integers(1, 2**31, size=4).astype(np.int64)
    pos = np.array([low, low + 1, int(rng.integers(1, 10**9)), high], np.int64)
    loc = np.array([2, 3, 4, 5], np.int64)
    write = dict(offsets=np.array([0, 2, 3, 4], np.int64), seed_slots=np.array([1, 1, 1], np.int64),
                 num_valid_reqs=np.array([3], np.int32), input_ids=ids, positions=pos, out_cache_loc=loc)
    ctx = _context(rng, num_slots, [], kc.HashMode.NONE, 8, 32, buf, assert_flag=1)
    expected = _reference_state(ctx)
    ref.write(expected[0], [], expected[1], expected[2], expected[3], expected[4], expected_tokens=None,
              expected_positions=None, chain_position_assert=np.array([1], np.int32), tag=2, **write)
    rows = expected[1][:int(expected[2][0])]
    assert [(int(r[1]), int(r[6]), int(r[7])) for r in rows] == [(4, low, int(kc.FailReason.WRITE_POSITION)),
                                                                (5, low, int(kc.FailReason.WRITE_POSITION))]
    kc.write(ctx, kc.WritePlan(offsets=write["offsets"], seed_slot_indices=write["seed_slots"],
                               num_valid_reqs=write["num_valid_reqs"]),
             tag=2, input_ids=ids, positions=pos, out_cache_loc=loc)
    _assert_same(ctx, expected)


def test_write_agrees_on_the_padding_slot_as_seed_and_an_empty_request():
    """A request seeded by slot 0 takes slot 0's position as its predecessor's under the chain
    position assert (SPEC §3.1 step 2: any seed of 0 or more), and a request with no entries records
    nothing, not even for a seed past the pool; the model and the backend alike."""
    rng = np.random.default_rng(2064)
    num_slots = 8
    buf = rng.integers(0, 256, size=(num_slots, 32), dtype=np.uint8)
    words = buf.view(np.int64)
    seed_position = int(rng.integers(1, 10**6))
    words[0, 1] = seed_position
    ids = rng.integers(1, 2**31, size=3).astype(np.int64)
    pos = np.array([seed_position + 5, seed_position + 6, seed_position + 1], np.int64)
    write = dict(offsets=np.array([0, 2, 2, 3], np.int64), seed_slots=np.array([0, num_slots + 1, 0], np.int64),
                 num_valid_reqs=np.array([3], np.int32), input_ids=ids, positions=pos,
                 out_cache_loc=np.array([2, 3, 5], np.int64))
    ctx = _context(rng, num_slots, [], kc.HashMode.NONE, 8, 32, buf, assert_flag=1)
    expected = _reference_state(ctx)
    ref.write(expected[0], [], expected[1], expected[2], expected[3], expected[4], expected_tokens=None,
              expected_positions=None, chain_position_assert=np.array([1], np.int32), tag=2, **write)
    rows = expected[1][:int(expected[2][0])]
    assert [(int(r[1]), int(r[2]), int(r[6]), int(r[7])) for r in rows] == [
        (2, seed_position + 5, seed_position + 1, int(kc.FailReason.WRITE_POSITION))]
    kc.write(ctx, kc.WritePlan(offsets=write["offsets"], seed_slot_indices=write["seed_slots"],
                               num_valid_reqs=write["num_valid_reqs"]),
             tag=2, input_ids=ids, positions=pos, out_cache_loc=write["out_cache_loc"])
    _assert_same(ctx, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_plan_agrees(seed):
    rng = np.random.default_rng(3000 + seed)
    rows, width, pool = int(rng.integers(1, 6)), int(rng.integers(1, 10)), int(rng.integers(1, 30))
    bs = int(rng.integers(0, 6))
    table = rng.integers(-2, pool + 2, size=(rows, width)).astype(np.int32)
    rpi = np.array([_index(rng, -1, rows + 2, extras=(0,), p_extra=0.2) for _ in range(bs)], np.int64)
    prefix = rng.integers(-1, width + 3, size=bs).astype(np.int64)
    extend = rng.integers(-2, 5, size=bs).astype(np.int64)
    window = int(rng.choice([0, 0, 1, 2, 5]))
    lut = rng.integers(-1, pool, size=int(rng.integers(0, pool + 3))).astype(np.int64) if window else None
    has_expected = bool(rng.random() < 0.5)
    ctx_len = int(rng.integers(1, width + 3))
    expected_pool = rng.integers(0, 99, size=(int(rng.integers(1, rows + 2)), ctx_len)).astype(np.int32) \
        if has_expected else None
    valid = rng.integers(-1, ctx_len + 3, size=bs).astype(np.int64) if has_expected else None
    offset = int(rng.choice([-1, 0, 1]))
    vcap = int(rng.integers(0, bs * (width + 2) + 2))
    wcap = bs + int(rng.integers(0, 3))
    garbage = lambda n: rng.integers(-50, 50, size=n).astype(np.int64)  # noqa: E731
    v_init = [garbage(vcap) for _ in range(4)] + [np.array([77], np.int32), np.array([5], np.int32)]
    w_init = [garbage(wcap + 1), garbage(wcap), np.array([9], np.int32)]

    v_ref = [a.copy() for a in v_init]
    w_ref = [a.copy() for a in w_init]
    ref.plan(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=table, swa_window=window,
             lut=lut, expected_pool=expected_pool, valid_lens=valid, token_offset=offset,
             v_slots=v_ref[0], v_tokens=v_ref[1], v_positions=v_ref[2], v_prev=v_ref[3], v_num_valid=v_ref[4],
             v_enable=v_ref[5], w_offsets=w_ref[0], w_seeds=w_ref[1], w_num_valid_reqs=w_ref[2])
    v = [a.copy() for a in v_init]
    w = [a.copy() for a in w_init]
    vplan = kc.VerifyPlan(*v[:4], num_valid=v[4], enable=v[5])
    wplan = kc.WritePlan(offsets=w[0], seed_slot_indices=w[1], num_valid_reqs=w[2])
    kc.plan(vplan, wplan, req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, req_to_token=table,
            swa_window_size=window, full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=expected_pool,
            req_to_verify_expected_tokens_valid_lens=valid, kv_token_id_vs_position_offset=offset)
    for index, (got, want) in enumerate(zip(v + w, v_ref + w_ref)):
        assert got.tobytes() == want.tobytes(), index


@pytest.mark.parametrize("seed", SEEDS)
def test_scatter_agrees(seed):
    rng = np.random.default_rng(4000 + seed)
    rows, width, bs, n = (int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.integers(0, 6)),
                          int(rng.integers(0, 25)))
    flat = rng.integers(-2**31, 2**31, size=n).astype(np.int64)
    offsets = (np.concatenate([[0], np.cumsum(rng.integers(-1, 8, size=bs))]) + rng.integers(-2, 3, size=bs + 1))
    offsets = offsets.astype(np.int64)
    rpi = rng.integers(-1, rows + 2, size=bs).astype(np.int64)
    init = rng.integers(-9, 9, size=(rows, width)).astype(np.int32)
    want, got = init.copy(), init.copy()
    ref.scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=want)
    kc.scatter_req_token_ids(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=got)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("seed", range(3))
def test_parallel_paths_agree(seed):
    """Batches large enough for the backend's multi-threaded paths still agree with the model."""
    rng = np.random.default_rng(5000 + seed)
    num_slots = 20000
    specs = [random_source(rng, num_slots, page_size=4, num_bytes_per_token=32, read_bytes=32,
                           extra_rows=-10)]
    mode = kc.HashMode.ALL
    buf = np.zeros((num_slots, 32), np.uint8)
    ctx = _context(rng, num_slots, specs, mode, 64, 32, buf)
    n = 17000
    loc = rng.integers(-1, num_slots + 3, size=n).astype(np.int64)
    ids = rng.integers(0, 99, size=n).astype(np.int64)
    pos = np.arange(n, dtype=np.int64)
    offsets = np.array([0, 5000, 12000, n], np.int64)
    seeds = np.array([-1, int(loc[4999]), num_slots + 1], np.int64)
    expected = _reference_state(_context(rng, num_slots, specs, mode, 64, 32, buf))
    ref.write(expected[0], _ref_sources(specs, mode), expected[1], expected[2], expected[3], expected[4],
              offsets=offsets, seed_slots=seeds, num_valid_reqs=np.array([3], np.int32), input_ids=ids,
              positions=pos, out_cache_loc=loc, expected_tokens=None, expected_positions=None,
              chain_position_assert=np.zeros(1, np.int32), tag=2)
    kc.write(ctx, kc.WritePlan(offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=np.array([3], np.int32)),
             tag=2, input_ids=ids, positions=pos, out_cache_loc=loc)
    _assert_same(ctx, expected)
    # Verify every written slot (and some garbage) through the parallel path.
    slots = np.concatenate([loc, rng.integers(-2, num_slots + 2, size=200)]).astype(np.int64)
    prevs = np.concatenate([[-1], loc[:-1], rng.integers(-2, num_slots + 2, size=200)]).astype(np.int64)
    tokens = np.concatenate([ids, rng.integers(-1, 99, size=200)]).astype(np.int64)
    positions = np.concatenate([pos, rng.integers(0, n, size=200)]).astype(np.int64)
    ctx.clear_violations()
    state = _reference_state(ctx)
    state = (state[0], state[1], state[2], state[3], state[4])
    ref.verify(state[0], _ref_sources(specs, mode), state[1], state[2], state[3], state[4], slots=slots,
               expected_tokens=tokens, expected_positions=positions, prev_slots=prevs,
               num_valid=np.array([len(slots)], np.int32), enable=np.array([1], np.int32),
               check_expected_token=True, tag=4)
    kc.verify(ctx, kc.VerifyPlan(slot_indices=slots, expected_tokens=tokens, expected_positions=positions,
                                 prev_slot_indices=prevs, num_valid=np.array([len(slots)], np.int32),
                                 enable=np.array([1], np.int32)), tag=4, check_expected_token=True)
    _assert_same(ctx, state)


def test_parallel_plan_agrees():
    rng = np.random.default_rng(6000)
    rows, width, bs = 10, 12000, 8
    table = rng.integers(-1, 80000, size=(rows, width)).astype(np.int32)
    rpi = np.array([1, 2, 0, 3, 11, 4, 5, 6], np.int64)
    prefix = np.array([12000, 11999, 50, 12000, 3, 12001, 10000, 12000], np.int64)
    extend = np.ones(bs, np.int64)
    lut = rng.integers(0, 70000, size=75000).astype(np.int64)
    expected_pool = rng.integers(0, 99, size=(rows, width)).astype(np.int32)
    valid = np.full(bs, width - 5, np.int64)
    outs = []
    for run in range(2):
        v = [np.zeros(80000, np.int64) for _ in range(4)] + [np.zeros(1, np.int32), np.zeros(1, np.int32)]
        w = [np.zeros(bs + 1, np.int64), np.zeros(bs, np.int64), np.zeros(1, np.int32)]
        args = dict(req_pool_indices=rpi, prefix_lens=prefix, req_to_token=table, swa_window_size=60000,
                    full_to_swa_index_mapping=lut, req_to_verify_expected_tokens=expected_pool,
                    req_to_verify_expected_tokens_valid_lens=valid, kv_token_id_vs_position_offset=1)
        if run == 0:
            ref.plan(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=table,
                     swa_window=60000, lut=lut, expected_pool=expected_pool, valid_lens=valid, token_offset=1,
                     v_slots=v[0], v_tokens=v[1], v_positions=v[2], v_prev=v[3], v_num_valid=v[4], v_enable=v[5],
                     w_offsets=w[0], w_seeds=w[1], w_num_valid_reqs=w[2])
        else:
            kc.plan(kc.VerifyPlan(*v[:4], num_valid=v[4], enable=v[5]),
                    kc.WritePlan(offsets=w[0], seed_slot_indices=w[1], num_valid_reqs=w[2]),
                    extend_seq_lens=extend, **args)
        outs.append(v + w)
    assert int(outs[0][4][0]) >= 65536  # the backend's parallel fill
    for index, (got, want) in enumerate(zip(outs[1], outs[0])):
        assert got.tobytes() == want.tobytes(), index


# The CPU ops switch to their parallel builds (threads, rows prefetched ahead) from
# PARALLEL_MIN_ENTRIES entries on: batches past it, garbage included, agree with the model too.
LARGE = 20_000


@pytest.mark.parametrize("seed", range(2))
def test_large_verify_agrees(seed):
    from kvcanary_cupy.ops.backends._cpu.verify import PARALLEL_MIN_ENTRIES

    rng = np.random.default_rng(5000 + seed)
    num_slots, cap = LARGE, LARGE
    assert cap >= PARALLEL_MIN_ENTRIES
    stride, mode = 32, kc.HashMode.ALL
    specs = [random_source(rng, num_slots, page_size=1, num_bytes_per_token=64, read_bytes=64),
             random_source(rng, num_slots, page_size=4, num_bytes_per_token=32, read_bytes=16, extra_rows=-9)]
    buf = _random_buffer(rng, num_slots, stride, specs, mode)
    ctx = _context(rng, num_slots, specs, mode, 4096, stride, buf)
    words = buf.view(np.int64)
    slots = rng.integers(-2, num_slots + 2, size=cap).astype(np.int64)
    prevs = np.where(rng.random(cap) < 0.9, np.roll(slots, 1), rng.integers(-3, num_slots + 2, size=cap))
    in_range = (slots >= 0) & (slots < num_slots)
    tokens = np.where(in_range, words[np.where(in_range, slots, 0), 0], -1)
    positions = np.where(in_range & (rng.random(cap) < 0.99), words[np.where(in_range, slots, 0), 1], 3)
    num_valid, enable = np.array([cap], np.int32), np.array([1], np.int32)

    state = _context(rng, num_slots, specs, mode, ctx.ring_capacity, stride, buf)
    expected = _reference_state(state)
    ref.verify(expected[0], _ref_sources(specs, mode), expected[1], expected[2], expected[3], expected[4],
               slots=slots, expected_tokens=tokens, expected_positions=positions, prev_slots=prevs,
               num_valid=num_valid, enable=enable, check_expected_token=True, tag=1)
    vplan = kc.VerifyPlan(slot_indices=slots.copy(), expected_tokens=tokens.astype(np.int64),
                          expected_positions=positions.astype(np.int64), prev_slot_indices=prevs.astype(np.int64),
                          num_valid=num_valid.copy(), enable=enable.copy())
    kc.verify(ctx, vplan, tag=1, check_expected_token=True)
    assert int(ctx.violation_write_index[0]) > 0  # the damage and the random predecessors are seen
    _assert_same(ctx, expected)


def test_large_write_agrees():
    from kvcanary_cupy.ops.backends._cpu.write import PARALLEL_MIN_ENTRIES

    rng = np.random.default_rng(6000)
    num_slots, n = LARGE + 5, LARGE
    mode = kc.HashMode.ALL
    specs = [random_source(rng, num_slots, page_size=2, num_bytes_per_token=64, read_bytes=48, pad_bytes=16)]
    buf = np.zeros((num_slots, 32), np.uint8)
    ctx = _context(rng, num_slots, specs, mode, 64, 32, buf, 1)
    offsets = np.array([0, n // 3, n // 2, n], np.int64)
    seeds = np.array([-1, 7, U], np.int64)
    loc = rng.permutation(num_slots)[:n].astype(np.int64)
    loc[rng.integers(0, n, size=20)] = num_slots + 1  # out of range
    ids = rng.integers(0, 150_000, size=n).astype(np.int64)
    pos = np.arange(n, dtype=np.int64)
    assert n >= PARALLEL_MIN_ENTRIES

    state = _context(rng, num_slots, specs, mode, 64, 32, buf, 1)
    expected = _reference_state(state)
    ref.write(expected[0], _ref_sources(specs, mode), expected[1], expected[2], expected[3], expected[4],
              offsets=offsets, seed_slots=seeds, num_valid_reqs=np.array([3], np.int32), input_ids=ids, positions=pos,
              out_cache_loc=loc, expected_tokens=None, expected_positions=None,
              chain_position_assert=np.array([1], np.int32), tag=2)
    kc.write(ctx, kc.WritePlan(offsets=offsets.copy(), seed_slot_indices=seeds.copy(),
                               num_valid_reqs=np.array([3], np.int32)),
             tag=2, input_ids=ids, positions=pos, out_cache_loc=loc)
    _assert_same(ctx, expected)


def test_large_plan_agrees():
    from kvcanary_cupy.ops.backends._cpu.plan import PARALLEL_MIN_ENTRIES

    rng = np.random.default_rng(7000)
    bs, width = 24, 4096
    rows = bs + 1
    table = rng.integers(-2, 50_000, size=(rows, width)).astype(np.int32)
    rpi = np.arange(1, bs + 1, dtype=np.int64)
    prefix = rng.integers(3000, width, size=bs).astype(np.int64)
    extend = np.ones(bs, np.int64)
    vcap = int(prefix.sum()) + 5
    v_ref = [np.zeros(vcap, np.int64) for _ in range(4)] + [np.zeros(1, np.int32), np.zeros(1, np.int32)]
    w_ref = [np.zeros(bs + 1, np.int64), np.zeros(bs, np.int64), np.zeros(1, np.int32)]
    ref.plan(req_pool_indices=rpi, prefix_lens=prefix, extend_lens=extend, req_to_token=table, swa_window=0,
             lut=None, expected_pool=None, valid_lens=None, token_offset=0,
             v_slots=v_ref[0], v_tokens=v_ref[1], v_positions=v_ref[2], v_prev=v_ref[3], v_num_valid=v_ref[4],
             v_enable=v_ref[5], w_offsets=w_ref[0], w_seeds=w_ref[1], w_num_valid_reqs=w_ref[2])
    assert int(v_ref[4][0]) >= PARALLEL_MIN_ENTRIES
    v = [np.zeros(vcap, np.int64) for _ in range(4)] + [np.zeros(1, np.int32), np.zeros(1, np.int32)]
    w = [np.zeros(bs + 1, np.int64), np.zeros(bs, np.int64), np.zeros(1, np.int32)]
    kc.plan(kc.VerifyPlan(*v[:4], num_valid=v[4], enable=v[5]),
            kc.WritePlan(offsets=w[0], seed_slot_indices=w[1], num_valid_reqs=w[2]),
            req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, req_to_token=table)
    for index, (got, want) in enumerate(zip(v + w, v_ref + w_ref)):
        assert got.tobytes() == want.tobytes(), index


def test_serial_and_parallel_builds_are_distinct():
    """numba caches a build under its function's name, not its flags: the serial and parallel builds of
    one function must carry names of their own, or either may run the other's cached code."""
    from kvcanary_cupy.ops.backends._cpu import hashing, plan

    for serial, parallel in ((hashing.hash_slots_serial, hashing.hash_slots_parallel),
                             (plan._fill_entries_serial, plan._fill_entries_parallel)):
        assert serial.py_func.__qualname__ != parallel.py_func.__qualname__
        assert not serial.targetoptions.get("parallel") and parallel.targetoptions.get("parallel")


@pytest.mark.parametrize("seed", SEEDS)
def test_copy_records_agrees(seed):
    """Between two canaries of other strides and within one, with slots out of range both ways and
    destinations named more than once, sometimes more pairs than the threads' look-ahead."""
    rng = np.random.default_rng(7000 + seed)
    sizes = [int(rng.integers(1, 300)) for _ in range(2)]
    strides = [int(rng.choice([32, 40, 64])) for _ in range(2)]
    bufs = [rng.integers(0, 256, size=(n, s), dtype=np.uint8) for n, s in zip(sizes, strides)]
    contexts = [kc.CanaryContext(canary_buf=buf, violation_ring=np.zeros((1, 8), np.int64),
                                 violation_write_index=np.zeros(1, np.int32), slot_run_counter=np.zeros(1, np.int64),
                                 kernel_run_counter=np.zeros(1, np.int64), chain_position_assert=np.zeros(1, np.int32))
                for buf in bufs]
    within = rng.random() < 0.4
    src, dst = (contexts[0], contexts[0]) if within else contexts
    pairs = int(rng.integers(0, 3 * max(sizes)))
    src_slots = rng.integers(-3, src.num_slots + 3, size=pairs).astype(np.int64)
    dst_slots = rng.integers(-3, dst.num_slots + 3, size=pairs).astype(np.int64)
    want_src, want_dst = src.canary_buf.copy(), dst.canary_buf.copy()
    ref.copy_records(src_buf=want_src, dst_buf=want_src if within else want_dst, src_slots=src_slots,
                     dst_slots=dst_slots)
    kc.copy_records(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots)
    assert dst.canary_buf.tobytes() == (want_src if within else want_dst).tobytes()
    assert src.canary_buf.tobytes() == want_src.tobytes()
