"""plan (SPEC §3.3, §4): verify entries and write plan from engine metadata; SWA windows with a LUT;
expected-token gathers; overflow; unresolved slots; plan -> write -> verify end to end."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
import _fuzzcases as F
from _builders import pipeline, random_batch, ring_rows
from _devices import BACKENDS, requires_gpu, to_device, to_numpy

UNRESOLVED = kc.UNRESOLVED_SLOT


def _expected_entries(batch, prefix_lens, *, window=0, lut=None, expected=None, valid_lens=None, offset=0,
                      table=None):
    """SPEC §3.3 verify entries for in-range inputs, as a list of (slot, token, position, prev)."""
    table = batch.req_to_token if table is None else table
    tr = (lambda s: s) if lut is None else (lambda s: int(lut[s]) if s >= 0 else s)
    out = []
    for r in range(batch.bs):
        rp = int(batch.req_pool_indices[r])
        prefix = int(prefix_lens[r])
        if rp == 0:
            continue
        start = max(0, prefix - window) if window > 0 else 0
        for pos in range(start, prefix):
            tok = -1
            if expected is not None and 0 <= pos + offset < valid_lens[r]:
                tok = int(expected[rp, pos + offset])
            prev = tr(int(table[rp, pos - 1])) if pos > 0 else -1
            out.append((tr(int(table[rp, pos])), tok, pos, prev))
    return out


def _plan_entries(vplan):
    n = int(to_numpy(vplan.num_valid)[0])
    cols = [to_numpy(a)[:n].tolist() for a in (vplan.slot_indices, vplan.expected_tokens, vplan.expected_positions,
                                               vplan.prev_slot_indices)]
    return list(zip(*cols))


def _expected_write_plan(batch, prefix_lens, extend_lens, *, lut=None):
    tr = (lambda s: s) if lut is None else (lambda s: int(lut[s]) if s >= 0 else s)
    offsets, seeds, running = [], [], 0
    for r in range(batch.bs):
        rp = int(batch.req_pool_indices[r])
        offsets.append(running)
        live = rp != 0 and extend_lens[r] > 0
        running += int(extend_lens[r]) if live else 0
        seeds.append(tr(int(batch.req_to_token[rp, prefix_lens[r] - 1])) if live and prefix_lens[r] > 0 else -1)
    return offsets + [running], seeds


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_plan_matches_spec(device, seed):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, bs=int(rng.integers(1, 7)), padding_requests=int(rng.integers(0, 3)))
    # Some requests with no extend (decode-free) and some with a negative extend: neither writes.
    ext = batch.extend_lens.copy()
    ext[rng.random(batch.bs) < 0.3] = int(rng.choice([0, -2]))
    p = pipeline(batch, device)
    p.plan(batch.prefix_lens, ext)
    assert _plan_entries(p.vplan) == _expected_entries(batch, batch.prefix_lens)
    assert int(to_numpy(p.vplan.enable)[0]) == 1
    offsets, seeds = _expected_write_plan(batch, batch.prefix_lens, ext)
    got_offsets = to_numpy(p.wplan.offsets).tolist()
    assert got_offsets[:batch.bs + 1] == offsets
    assert all(v == 0 for v in got_offsets[batch.bs + 1:])
    assert to_numpy(p.wplan.seed_slot_indices)[:batch.bs].tolist() == seeds
    assert int(to_numpy(p.wplan.num_valid_reqs)[0]) == batch.bs


@pytest.mark.parametrize("device", BACKENDS)
def test_stale_entries_past_batch_cleared(device):
    rng = np.random.default_rng(11)
    big = random_batch(rng, bs=5)
    p = pipeline(big, device)
    p.plan()
    stale = to_numpy(p.wplan.offsets).copy()
    assert stale[3:6].any(), "the big batch's plan fills the cells past the small one's"
    small = random_batch(rng, bs=2)
    p.batch = small
    p.plan()
    offsets = to_numpy(p.wplan.offsets)
    assert offsets[3:].tolist() == [0] * (len(offsets) - 3)
    assert int(to_numpy(p.wplan.num_valid_reqs)[0]) == 2
    want_offsets, want_seeds = _expected_write_plan(small, small.prefix_lens, small.extend_lens)
    assert offsets[:3].tolist() == want_offsets
    assert to_numpy(p.wplan.seed_slot_indices)[:2].tolist() == want_seeds
    assert _plan_entries(p.vplan) == _expected_entries(small, small.prefix_lens)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("short", [False, True])
def test_expected_token_gather(device, offset, short):
    rng = np.random.default_rng(offset * 2 + short)
    batch = random_batch(rng, bs=4, min_prefix=2, padding_requests=1)
    valid = batch.prefix_lens.copy()
    if short:  # fewer valid tokens than prefix positions: the tail gets -1
        valid = np.maximum(valid - rng.integers(0, 3, size=batch.bs), 0)
    p = pipeline(batch, device)
    p.plan(expected=True, token_offset=offset, valid_lens=valid)
    want = _expected_entries(batch, batch.prefix_lens, expected=batch.tokens, valid_lens=valid, offset=offset)
    assert _plan_entries(p.vplan) == want
    if offset == 1 and not short:
        # An EAGLE draft checks position pos against the token at pos + 1.
        r = batch.live()[0]
        first = next(e for e in want if e[0] == batch.slot(r, 0))
        assert first[1] == batch.token(r, 1)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 100])
def test_swa_plan_with_lut(device, window):
    rng = np.random.default_rng(window)
    batch = random_batch(rng, bs=3, min_prefix=4, max_prefix=10)
    swa_slots = batch.num_slots + 3
    lut = rng.permutation(np.arange(swa_slots))[:batch.num_slots].astype(np.int64)
    lut[0] = 0
    p = pipeline(batch, device)
    p.plan(swa_window_size=window, full_to_swa_index_mapping=to_device(lut, device))
    want = _expected_entries(batch, batch.prefix_lens, window=window, lut=lut)
    assert _plan_entries(p.vplan) == want
    # The window does not restart the chain: the first windowed entry has a real predecessor.
    for r in batch.live():
        start = max(0, int(batch.prefix_lens[r]) - window)
        if start > 0:
            entry = next(e for e in want if e[0] == lut[batch.slot(r, start)])
            assert entry[3] == lut[batch.slot(r, start - 1)]
    _, seeds = _expected_write_plan(batch, batch.prefix_lens, batch.extend_lens, lut=lut)
    assert to_numpy(p.wplan.seed_slot_indices)[:batch.bs].tolist() == seeds


@pytest.mark.parametrize("device", BACKENDS)
def test_swa_end_to_end(device):
    """Writes into an SWA canary through the LUT, then verifies the window clean."""
    rng = np.random.default_rng(21)
    batch = random_batch(rng, bs=3, min_prefix=3)
    swa_slots = batch.num_slots + 4
    lut = rng.permutation(np.arange(1, swa_slots))[:batch.num_slots].astype(np.int64)
    lut[0] = 0
    swa_table = lut[batch.req_to_token].astype(np.int32)
    p = pipeline(batch, device, num_slots=swa_slots)
    kw = dict(swa_window_size=4, full_to_swa_index_mapping=to_device(lut, device))
    p.write(np.zeros(batch.bs, np.int64), batch.prefix_lens, table=swa_table, **kw)
    p.write(table=swa_table, **kw)
    p.verify_all(tag=kc.LaunchTag.TAIL_K_SWA, **kw)
    assert ring_rows(p.ctx) == []
    assert int(to_numpy(p.vplan.num_valid)[0]) == sum(min(4, int(batch.seq_lens[r])) for r in batch.live())


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("cell, mapped", [(-1, -1), (0, 9)])
def test_negative_cells_pass_the_lut_and_a_cell_of_0_maps_through_it(device, cell, mapped):
    """Pool row 1 holds 3, ``cell``, 2; the LUT maps 0 to 9. A negative cell passes unmapped; a cell
    of 0 (the padding slot, which a torn or stale table row can hold) is a pool slot like any other,
    mapped for its entry's slot and for the next entry's predecessor."""
    table = np.array([[0, 0, 0], [3, cell, 2]], dtype=np.int32)
    lut = np.array([9, 5, 6, 7], dtype=np.int64)
    vplan = kc.VerifyPlan.allocate(8, device=device)
    wplan = kc.WritePlan.allocate(2, device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    kc.plan(vplan, wplan, req_pool_indices=put([1]), prefix_lens=put([3]), extend_seq_lens=put([1]),
            req_to_token=to_device(table, device), swa_window_size=8, full_to_swa_index_mapping=put(lut))
    assert _plan_entries(vplan) == [(7, -1, 0, -1), (mapped, -1, 1, 7), (6, -1, 2, mapped)]
    assert to_numpy(wplan.seed_slot_indices)[:1].tolist() == [6]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("extra", [-1, 0])
def test_overflow_disables(device, extra):
    rng = np.random.default_rng(5)
    batch = random_batch(rng, bs=3, min_prefix=2)
    total = int(batch.prefix_lens.sum())
    p = pipeline(batch, device, verify_capacity=total + extra)
    sentinel = 987654321
    for name in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
        getattr(p.vplan, name)[...] = sentinel
    p.plan()
    assert int(to_numpy(p.vplan.num_valid)[0]) == min(total, total + extra)
    assert int(to_numpy(p.vplan.enable)[0]) == (1 if extra == 0 else 0)
    if extra < 0:
        for name in ("slot_indices", "expected_tokens", "expected_positions", "prev_slot_indices"):
            assert (to_numpy(getattr(p.vplan, name)) == sentinel).all(), name
        # The write plan is still built; verify skips the step.
        assert to_numpy(p.wplan.offsets)[batch.bs] == int(batch.extend_lens.sum())
        kc.verify(p.ctx, p.vplan, tag=0)
        assert p.ctx.counters() == {"slot_run_counter": 0, "kernel_run_counter": 1, "violations": 0}
    else:
        assert _plan_entries(p.vplan) == _expected_entries(batch, batch.prefix_lens)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("prefix", [[2**62] * 4, [2**63 - 1, 2, 0, 1]])
def test_total_past_int64_overflows(device, prefix):
    """Prefixes adding up past int64 saturate the total: the plan overflows, nothing is written."""
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan = kc.VerifyPlan.allocate(16, device=device)
    wplan = kc.WritePlan.allocate(4, device=device)
    sentinel = 987654321
    vplan.slot_indices[...] = sentinel
    kc.plan(vplan, wplan, req_pool_indices=put([1, 2, 3, 4]), prefix_lens=put(prefix), extend_seq_lens=put([0] * 4),
            req_to_token=to_device(np.ones((5, 8), np.int32), device))
    assert (int(to_numpy(vplan.num_valid)[0]), int(to_numpy(vplan.enable)[0])) == (16, 0)
    assert (to_numpy(vplan.slot_indices) == sentinel).all()


@pytest.mark.parametrize("device", BACKENDS)
def test_unresolved_markers(device):
    table = np.array([[0] * 4, [1, 2, 3, 4], [5, 6, 7, 9]], dtype=np.int32)
    lut = np.array([0, 1, 2, 3, 4, 5, 6, 7], dtype=np.int64)  # no entry for full slot 9
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan = kc.VerifyPlan.allocate(32, device=device)
    wplan = kc.WritePlan.allocate(4, device=device)
    # Row 7 is outside the table; request 1's prefix 6 runs past width 4; request 2 reaches slot 9.
    kc.plan(vplan, wplan, req_pool_indices=put([7, 1, 2]), prefix_lens=put([1, 6, 4]),
            extend_seq_lens=put([1, 1, 1]), req_to_token=to_device(table, device), swa_window_size=100,
            full_to_swa_index_mapping=put(lut))
    U = UNRESOLVED
    assert _plan_entries(vplan) == [
        (U, -1, 0, -1),
        (1, -1, 0, -1), (2, -1, 1, 1), (3, -1, 2, 2), (4, -1, 3, 3), (U, -1, 4, 4), (U, -1, 5, U),
        (5, -1, 0, -1), (6, -1, 1, 5), (7, -1, 2, 6), (U, -1, 3, 7),
    ]
    assert to_numpy(wplan.seed_slot_indices)[:3].tolist() == [U, U, U]
    # The following verify reports every unresolved entry with bit 64.
    ctx = kc.CanaryContext.allocate(10, device=device, ring_capacity=64)
    kc.verify(ctx, vplan, tag=0)
    oor = [r for r in ring_rows(ctx) if r[7] & 64]
    assert sorted(oor) == sorted((0, U, pos, 0, -1, 0, 0, 64) for pos in (0, 4, 5, 3))
    # A write seeded from an unresolved slot reports it and falls back to the anchor.
    kc.write(ctx, wplan, tag=1, input_ids=put([1, 2, 3]), positions=put([1, 6, 4]), out_cache_loc=put([8, 8, 8]))
    assert [r for r in ring_rows(ctx) if r[0] == 1] == [(1, U, 0, 0, 0, 0, 0, 64)] * 3


@pytest.mark.parametrize("device", BACKENDS)
def test_the_first_pool_row_past_a_table_view_resolves_nothing(device):
    """req_to_token is the first three rows of a larger table, so the row after it holds slots in
    memory: request 0 names pool row 3, the first past the view, and its entries, predecessors and
    seed are UNRESOLVED; request 1 (row 2, the view's last) resolves."""
    whole = to_device(np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], dtype=np.int32), device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan = kc.VerifyPlan.allocate(8, device=device)
    wplan = kc.WritePlan.allocate(2, device=device)
    kc.plan(vplan, wplan, req_pool_indices=put([3, 2]), prefix_lens=put([2, 2]), extend_seq_lens=put([1, 1]),
            req_to_token=whole[:3])
    U = UNRESOLVED
    assert _plan_entries(vplan) == [(U, -1, 0, -1), (U, -1, 1, U), (7, -1, 0, -1), (8, -1, 1, 7)]
    assert to_numpy(wplan.seed_slot_indices).tolist() == [U, 8]


@pytest.mark.parametrize("device", BACKENDS)
def test_padding_requests_ignored(device):
    table = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan = kc.VerifyPlan.allocate(8, device=device)
    wplan = kc.WritePlan.allocate(3, device=device)
    kc.plan(vplan, wplan, req_pool_indices=put([0, 1, 0]), prefix_lens=put([2, 2, 3]),
            extend_seq_lens=put([1, 1, 2]), req_to_token=to_device(table, device))
    assert _plan_entries(vplan) == [(4, -1, 0, -1), (5, -1, 1, 4)]
    assert to_numpy(wplan.offsets).tolist() == [0, 0, 1, 1]
    assert to_numpy(wplan.seed_slot_indices).tolist() == [-1, 5, -1]


@pytest.mark.parametrize("device", BACKENDS)
def test_empty_batch(device):
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan = kc.VerifyPlan.allocate(0, device=device)
    wplan = kc.WritePlan.allocate(0, device=device)
    kc.plan(vplan, wplan, req_pool_indices=put([]), prefix_lens=put([]), extend_seq_lens=put([]),
            req_to_token=to_device(np.zeros((1, 4), np.int32), device))
    assert (int(to_numpy(vplan.num_valid)[0]), int(to_numpy(vplan.enable)[0])) == (0, 1)
    assert to_numpy(wplan.offsets).tolist() == [0]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_decode_steps_end_to_end(device, seed):
    """Prefill, then several one-token decode steps, verifying before and after each."""
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, bs=3, min_prefix=1, max_prefix=6, max_extend=1, width=16)
    # Lay out slots for the decode positions too.
    total = int(batch.seq_lens.sum())
    steps = 4
    free = list(range(batch.num_slots, batch.num_slots + steps * batch.bs))
    for r in batch.live():
        rp = batch.req_pool_indices[r]
        for k in range(steps):
            pos = int(batch.seq_lens[r]) + k
            batch.req_to_token[rp, pos] = free.pop()
            batch.tokens[rp, pos] = rng.integers(1, 1000)
    batch.num_slots += steps * batch.bs
    p = pipeline(batch, device, verify_capacity=total + steps * batch.bs, chain_position_assert=True)
    p.write(np.zeros(batch.bs, np.int64), batch.prefix_lens)
    prefix = batch.prefix_lens.copy()
    ones = np.ones(batch.bs, np.int64)
    for _ in range(steps + 1):
        p.plan(prefix, ones, expected=True, valid_lens=prefix + 1)
        kc.verify(p.ctx, p.vplan, tag=kc.LaunchTag.HEAD_K_FULL, check_expected_token=True)
        p.write(prefix, ones, tag=kc.LaunchTag.TAIL_K_FULL)
        prefix = prefix + 1
    assert ring_rows(p.ctx) == []


def test_every_batch_shape_names_a_compiled_plan_kernel():
    """The plan launcher's kernel for any batch size and entry bound, with a LUT or without, is one
    the plan module compiles: the small tile only for batches it can stage at once."""
    from kvcanary_cupy.ops.backends._cuda.plan import SMALL_TILE, SMALL_TILE_MAX_ENTRIES, TILE, plan_tile
    from kvcanary_cupy.rawkernels import _loader

    for bs in (1, 32, SMALL_TILE, SMALL_TILE + 1, 4096):
        for most in (0, 1, SMALL_TILE_MAX_ENTRIES, SMALL_TILE_MAX_ENTRIES + 1, 1 << 24):
            tile = plan_tile(bs, most)
            assert tile == (SMALL_TILE if bs <= SMALL_TILE and most <= SMALL_TILE_MAX_ENTRIES else TILE)
            for lut in (True, False):
                assert _loader.plan_instance(tile, lut) in _loader.SPECS["plan"].kernels
    # the bound as measured (plan_tile's docstring): batches of up to 64 K entries take the small tile
    assert plan_tile(SMALL_TILE, 1 << 16) == SMALL_TILE and plan_tile(1, (1 << 16) + 1) == TILE


def test_the_cuda_plan_grid_is_a_write_block_and_a_block_a_tile_of_entries_up_to_the_resident_grid(monkeypatch):
    """The CUDA plan launch, on the host with the kernel stood in for: block 0 writes the write plan,
    and the entry blocks are one a tile of the entries the batch can have at most, or of the write
    plan's offsets they pad, whichever is more; never fewer than one, and never past the blocks
    that fill the GPU once (here 6)."""
    from kvcanary_cupy.ops.backends._cuda import plan as launcher
    from kvcanary_cupy.ops.batches import PlanBatch

    monkeypatch.setattr(launcher, "kernel", lambda source, name, device_id: name)
    monkeypatch.setattr(launcher, "resident_grid", lambda source, name, device_id, block: 6)

    def grid(batch_size, verify_capacity, write_capacity=None):
        batch = PlanBatch(req_pool_indices=np.arange(batch_size), prefix_lens=np.full(batch_size, 40),
                          extend_seq_lens=np.ones(batch_size, np.int64),
                          req_to_token=np.zeros((batch_size, 4096), np.int32))
        launch = launcher.prepare(kc.VerifyPlan.allocate(verify_capacity),
                                  kc.WritePlan.allocate(write_capacity or batch_size), batch)
        assert launch.block == (launcher.plan_tile(batch_size, launcher.most_verify_entries(batch, verify_capacity)),)
        return launch.grid[0]

    small = launcher.SMALL_TILE
    assert grid(1, 8) == 2  # one entry block for a few entries
    assert grid(3, 2 * small + 1) == 4  # three tiles of entries
    assert grid(3, 0) == 2  # no entries: one entry block still pads the write plan
    assert grid(3, 8, write_capacity=2 * small + 1) == 4  # a write plan of three tiles of offsets
    assert grid(64, 64 * 4096) == 6  # the resident grid


@pytest.mark.parametrize("device", BACKENDS)
def test_write_offsets_past_int64_wrap_as_in_the_reference(device):
    """Extends that add up past 2^63 - 1: the write plan's offsets are int64 sums and wrap, on every
    backend as in the plain-Python reference model."""
    from kvcanary_cupy import reference

    big = 1 << 62
    table = np.zeros((3, 16), np.int32)
    table[1, :4], table[2, :4] = [1, 2, 3, 4], [5, 6, 7, 8]
    batch = dict(req_pool_indices=np.array([1, 2, 1]), prefix_lens=np.array([0, 0, 0]),
                 extend_seq_lens=np.array([big, big, 5]), req_to_token=table)
    vplan, wplan = kc.VerifyPlan.allocate(64, device=device), kc.WritePlan.allocate(4, device=device)
    kc.plan(vplan, wplan, **{name: to_device(value, device) for name, value in batch.items()})
    offsets, seeds, valid = np.zeros(5, np.int64), np.zeros(4, np.int64), np.zeros(1, np.int32)
    verify = [np.zeros(64, np.int64) for _ in range(4)]
    reference.plan(req_pool_indices=batch["req_pool_indices"], prefix_lens=batch["prefix_lens"],
                   extend_lens=batch["extend_seq_lens"], req_to_token=table, swa_window=0, lut=None,
                   expected_pool=None, valid_lens=None, token_offset=0, v_slots=verify[0], v_tokens=verify[1],
                   v_positions=verify[2], v_prev=verify[3], v_num_valid=np.zeros(1, np.int32),
                   v_enable=np.zeros(1, np.int32), w_offsets=offsets, w_seeds=seeds, w_num_valid_reqs=valid)
    assert offsets.tolist() == [0, big, -(1 << 63), -(1 << 63) + 5, 0]
    assert to_numpy(wplan.offsets).tolist() == offsets.tolist()


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("bs", [4, 300])
def test_lengths_that_alias_the_plan_it_fills_stay_inside_it(device, bs):
    """prefix_lens is a view of the verify plan's own slot array: the slots the plan stores change
    the lengths as it fills. The lengths are the caller's mistake, but every request writes at most
    the entries counted for it, so the cells past the plan's capacity are never touched."""
    guard, sentinel = 64, -7
    capacity = bs + 1
    backing = [to_device(np.full(capacity + guard, sentinel, np.int64), device) for _ in range(4)]
    vplan = kc.VerifyPlan(*(b[:capacity] for b in backing), num_valid=to_device(np.zeros(1, np.int32), device),
                          enable=to_device(np.zeros(1, np.int32), device))
    prefix_lens = backing[0][1:1 + bs]
    # request 0's bs entries overwrite the lengths of requests 1 .. bs - 2 as it fills; the counted
    # total, bs + 1, equals the capacity, so the plan fills
    prefix_lens[...] = 0
    prefix_lens[0], prefix_lens[1] = bs, 1
    table = np.full((bs + 1, 64), 40, np.int32)  # every slot read back as a length of 40
    kc.plan(vplan, kc.WritePlan.allocate(bs, device=device), req_pool_indices=to_device(np.arange(1, bs + 1), device),
            prefix_lens=prefix_lens, extend_seq_lens=to_device(np.zeros(bs, np.int64), device),
            req_to_token=to_device(table, device))
    assert int(to_numpy(vplan.num_valid)[0]) == capacity
    for b in backing:
        assert (to_numpy(b)[capacity:] == sentinel).all()


# --- SPEC rules pinned one at a time ----------------------------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
def test_negative_pool_row_is_unresolved_not_padding(device):
    """SPEC §4: only ``req_pool_indices[r] == 0`` is the padding row. A negative one is a pool row
    outside ``req_to_token``: its entries, predecessors and seed are UNRESOLVED, and its extend is
    counted in the write plan's offsets like any live request's."""
    rng = np.random.default_rng(51)
    table = rng.integers(1, 1000, size=(3, 6)).astype(np.int32)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan, wplan = kc.VerifyPlan.allocate(16, device=device), kc.WritePlan.allocate(3, device=device)
    kc.plan(vplan, wplan, req_pool_indices=put([-1, 2, -5]), prefix_lens=put([2, 3, 0]),
            extend_seq_lens=put([3, 1, 2]), req_to_token=to_device(table, device))
    U = UNRESOLVED
    t = [int(s) for s in table[2, :3]]
    assert _plan_entries(vplan) == [(U, -1, 0, -1), (U, -1, 1, U),
                                    (t[0], -1, 0, -1), (t[1], -1, 1, t[0]), (t[2], -1, 2, t[1])]
    assert to_numpy(wplan.offsets).tolist() == [0, 3, 4, 6]
    assert to_numpy(wplan.seed_slot_indices).tolist() == [U, t[2], -1]


@pytest.mark.parametrize("device", BACKENDS)
def test_non_positive_prefix_gives_no_entries_and_no_seed(device):
    """SPEC §3.3: a request verifies positions ``[start, prefix_len)``, none when the prefix is 0 or
    negative, and is seeded only when ``prefix > 0``; its extend is still written."""
    rng = np.random.default_rng(52)
    table = rng.integers(1, 1000, size=(3, 6)).astype(np.int32)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    vplan, wplan = kc.VerifyPlan.allocate(8, device=device), kc.WritePlan.allocate(3, device=device)
    kc.plan(vplan, wplan, req_pool_indices=put([1, 2, 1]), prefix_lens=put([-3, 0, 2]),
            extend_seq_lens=put([2, 1, 1]), req_to_token=to_device(table, device))
    a, b = int(table[1, 0]), int(table[1, 1])
    assert _plan_entries(vplan) == [(a, -1, 0, -1), (b, -1, 1, a)]
    assert int(to_numpy(vplan.enable)[0]) == 1
    assert to_numpy(wplan.offsets).tolist() == [0, 2, 3, 4]
    assert to_numpy(wplan.seed_slot_indices).tolist() == [-1, -1, b]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("offset", [-1, -3, 2])
def test_expected_token_gather_with_other_offsets(device, offset):
    """SPEC §3.3: the expected token of position ``pos`` is ``expected_pool[rp, pos + token_offset]``
    only where ``0 <= pos + token_offset < valid_lens[r]``, for any offset (negative ones give -1
    below column 0)."""
    rng = np.random.default_rng(53 + offset)
    batch = random_batch(rng, bs=3, min_prefix=4, padding_requests=1)
    valid = batch.prefix_lens + 2
    p = pipeline(batch, device)
    p.plan(expected=True, token_offset=offset, valid_lens=valid)
    want = _expected_entries(batch, batch.prefix_lens, expected=batch.tokens, valid_lens=valid, offset=offset)
    assert _plan_entries(p.vplan) == want
    if offset < 0:
        assert sum(e[1] == -1 for e in want) == -offset * len(batch.live())


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("offset", [0, 1, -2])
def test_expected_pool_narrower_and_shorter_than_valid_lens(device, offset):
    """SPEC §3.3 with README's reading where the SPEC is silent: a column ``pos + token_offset``
    inside ``valid_lens[r]`` but past the width of the expected pool, or a pool row past its rows,
    gives -1, as a column past ``valid_lens`` does; the cells inside it are gathered."""
    rng = np.random.default_rng(80 + offset)
    table = rng.permutation(np.arange(1, 1 + 5 * 9)).reshape(5, 9).astype(np.int32)
    pool = rng.integers(1, 2**31 - 1, size=(3, 5)).astype(np.int32)  # rows 0..2, columns 0..4 only
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    rpi, prefix, valid = [1, 3, 2, 4], [8, 3, 6, 2], [9, 9, 4, 9]
    vplan, wplan = kc.VerifyPlan.allocate(32, device=device), kc.WritePlan.allocate(4, device=device)
    kc.plan(vplan, wplan, req_pool_indices=put(rpi), prefix_lens=put(prefix), extend_seq_lens=put([1] * 4),
            req_to_token=to_device(table, device), req_to_verify_expected_tokens=to_device(pool, device),
            req_to_verify_expected_tokens_valid_lens=put(valid), kv_token_id_vs_position_offset=offset)
    want = []
    for rp, n, v in zip(rpi, prefix, valid):
        for pos in range(n):
            col = pos + offset
            inside = 0 <= col < v and rp < pool.shape[0] and col < pool.shape[1]
            want.append((int(table[rp, pos]), int(pool[rp, col]) if inside else -1, pos,
                         int(table[rp, pos - 1]) if pos else -1))
    assert _plan_entries(vplan) == want
    # rows 3 and 4 are outside the expected pool: every one of their entries expects -1
    assert [e[1] for e in want[8:11]] == [-1] * 3 and [e[1] for e in want[17:]] == [-1] * 2
    # request 0 (valid 9) reads columns offset .. offset + 7, past the pool's 5: those expect -1 too
    assert [e[1] for e in want[:8]].count(-1) == {0: 3, 1: 4, -2: 2 + 1}[offset]


@requires_gpu
@pytest.mark.parametrize("lut", [False, True], ids=["plan", "plan_swa_lut"])
def test_more_verify_entries_than_one_pass_of_the_grid_equal_the_cpu_backend(lut):
    """The plan kernel's verify blocks, a block taking every grid-th stride: batches of more entries
    than one pass of any grid the GPU holds at once equal the CPU backend (the LUT form too, with a
    window past every prefix). The fuzz's cases are rarely that large. The step's own stride is
    ``tests/test_step.py``'s."""
    for seed in (71, 72):
        case = F.past_one_grid_pass("plan", seed)
        if lut:
            cells = int(case["req_to_token"].max(initial=0)) + 1
            case["full_to_swa_index_mapping"] = np.random.default_rng(seed).integers(-1, 1 << 40, size=cells)
            case["swa_window_size"] = 1 << 40
        assert F.compare("plan", case, F.RUNNERS["plan"](case, "cpu"), F.RUNNERS["plan"](case, "cuda")) == [], \
            f"seed {seed}"
