"""write (SPEC §3.1, §4): stored fields, chains, input and chain-position asserts, real-KV hashes,
out-of-range indices, counters; plus the SPEC's hash test values."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import reference as ref
from _builders import (ANCHOR_LINK, BIT, SourceSpec, assert_only_views_changed, assert_rows, expected_kv_hash, fields,
                       guarded_context, host_verify_plan, link_of, pipeline, random_batch, random_source, ring_rows,
                       signed, slot_words)
from _devices import BACKENDS, force_write_team, requires_gpu, spin_kernel, to_device, to_numpy

TAG = int(kc.LaunchTag.HEAD_V_FULL)
L_INT64_MAX = (1 << 63) - 1
UNRESOLVED = kc.UNRESOLVED_SLOT


# --- the SPEC's test values ---------------------------------------------------------------------

def test_spec_hash_values_reference():
    assert ref.sm(0) == 0
    assert ref.sm(0xC0FFEE1234567890) == 0xDE7FAE23A9A1B716
    assert ref.mix3(1, 2, 3) == 0xA55BDF37C08724B5
    assert ref.mix3(ref.sm(0xC0FFEE1234567890), 42, 0) == 0x1B798564098041C9
    assert ref.fold(bytes(range(16))) == 0x447F1B95028CE131
    assert ref.fold(bytes(range(32))) == 0xFAB780417B7BE8AD


def test_spec_hash_values_numba():
    from kvcanary_cupy.ops.backends._cpu import hashing
    u = np.uint64
    assert int(hashing.sm(u(0))) == 0
    assert int(hashing.sm(u(0xC0FFEE1234567890))) == 0xDE7FAE23A9A1B716
    assert int(hashing.mix3(u(1), u(2), u(3))) == 0xA55BDF37C08724B5
    assert int(hashing.mix3(hashing.sm(u(0xC0FFEE1234567890)), u(42), u(0))) == 0x1B798564098041C9


def _ctx(device, num_slots=8, **kwargs):
    return kc.CanaryContext.allocate(num_slots, device=device, **kwargs)


def _write(ctx, offsets, seeds, ids, pos, loc, *, device, num_valid_reqs=None, tag=TAG, expected=None):
    plan = kc.WritePlan.from_host(offsets=offsets, seed_slot_indices=seeds,
                                  num_valid_reqs=len(seeds) if num_valid_reqs is None else num_valid_reqs,
                                  device=device)
    put = lambda v: to_device(np.array(v, dtype=np.int64), device)  # noqa: E731
    extra = {}
    if expected is not None:
        extra = dict(expected_input_tokens=put(expected[0]), expected_input_positions=put(expected[1]))
    kc.write(ctx, plan, tag=tag, input_ids=put(ids), positions=put(pos), out_cache_loc=put(loc), **extra)


@pytest.mark.parametrize("device", BACKENDS)
def test_chain_values_through_write(device):
    """A two-token chain from no predecessor reproduces ``sm(ANCHOR)`` and ``mix3(sm(ANCHOR), 42, 0)``."""
    ctx = _ctx(device)
    _write(ctx, [0, 2], [-1], [42, 7], [0, 1], [3, 5], device=device)
    assert fields(ctx.canary_buf, 3) == (42, 0, signed(0xDE7FAE23A9A1B716), 0)
    assert fields(ctx.canary_buf, 5) == (7, 1, signed(0x1B798564098041C9), 0)
    assert ctx.violations().total == 0


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode,expected", [(kc.HashMode.NONE, 0),
                                           (kc.HashMode.PARTIAL, ref.sm(0x447F1B95028CE131)),
                                           (kc.HashMode.ALL, ref.sm(0xFAB780417B7BE8AD))])
def test_fold_values_through_write(device, mode, expected):
    """The SPEC's fold values, from the bytes 0..31 of the written slot's row; the other rows hold
    random bytes, so a hash of another row than the slot's gives another value."""
    data = np.random.default_rng(2).integers(1, 256, size=(4, 32), dtype=np.uint8)
    data[2] = np.arange(32, dtype=np.uint8)
    src = SourceSpec(data, page_size=1, num_bytes_per_token=32, read_bytes=32)
    ctx = _ctx(device, 4, real_kv_sources=(src.build(device),), hash_mode=mode)
    _write(ctx, [0, 1], [-1], [5], [0], [2], device=device)
    assert fields(ctx.canary_buf, 2)[3] == signed(expected)
    if mode != kc.HashMode.NONE:  # every other row hashes to another value
        assert all(expected_kv_hash([src], mode, row) != signed(expected) for row in (0, 1, 3))


# --- clean runs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", list(kc.HashMode))
@pytest.mark.parametrize("seed", range(3))
def test_write_then_verify_random_batches(device, mode, seed):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, bs=int(rng.integers(1, 6)), padding_requests=int(rng.integers(0, 3)))
    sources = [random_source(rng, batch.num_slots, page_size=int(rng.choice([1, 4])),
                             num_bytes_per_token=64, read_bytes=int(rng.choice([16, 48, 64])),
                             pad_bytes=int(rng.choice([0, 32]))) for _ in range(int(rng.integers(1, 3)))]
    p = pipeline(batch, device, hash_mode=mode, sources=sources, chain_position_assert=True)
    p.fill()
    assert ring_rows(p.ctx) == []
    p.verify_all(check_expected_token=True, expected=True)
    assert ring_rows(p.ctx) == []
    # Every stored field matches the batch; every chain is intact.
    for r in batch.live():
        for pos in range(int(batch.seq_lens[r])):
            slot = batch.slot(r, pos)
            prev = batch.slot(r, pos - 1) if pos else -1
            assert fields(p.ctx.canary_buf, slot) == (batch.token(r, pos), pos, link_of(p.ctx.canary_buf, prev),
                                                      expected_kv_hash(sources, mode, slot))
    # Slot 0 (padding) and the spare slots were never written.
    used = {batch.slot(r, pos) for r in batch.live() for pos in range(int(batch.seq_lens[r]))}
    words = slot_words(p.ctx.canary_buf)
    for s in set(range(batch.num_slots)) - used:
        assert not words[s].any()


@pytest.mark.parametrize("device", BACKENDS)
def test_stride_bytes_beyond_fields_untouched(device):
    ctx = _ctx(device, 4, slot_stride_bytes=48)
    buf = to_numpy(ctx.canary_buf)
    if device == "cpu":
        buf[:, 32:] = 0xAB
    else:
        ctx.canary_buf[:, 32:] = 0xAB
    _write(ctx, [0, 2], [-1], [1, 2], [0, 1], [1, 3], device=device)
    after = to_numpy(ctx.canary_buf)
    assert (after[:, 32:] == 0xAB).all()
    assert fields(ctx.canary_buf, 3)[:2] == (2, 1)


# --- real-KV hashes -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
@pytest.mark.parametrize("page_size,pad", [(1, 0), (4, 0), (3, 48), (8, 16)])
def test_real_kv_hash_paged_and_strided(device, mode, page_size, pad):
    rng = np.random.default_rng(page_size * 7 + pad)
    num_slots = 20
    specs = [random_source(rng, num_slots, page_size=page_size, num_bytes_per_token=48, read_bytes=32,
                           pad_bytes=pad),
             random_source(rng, num_slots, page_size=page_size, num_bytes_per_token=16, read_bytes=16)]
    ctx = _ctx(device, num_slots, real_kv_sources=tuple(s.build(device) for s in specs), hash_mode=mode)
    slots = list(range(num_slots))  # the padding slot 0 too: its bytes open every source
    _write(ctx, [0, len(slots)], [-1], slots, list(range(len(slots))), slots, device=device)
    for s in slots:
        assert fields(ctx.canary_buf, s)[3] == expected_kv_hash(specs, mode, s), s
    assert ctx.violations().total == 0


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 3, 4, 6])
def test_real_kv_hash_paged_decode(device, page_size):
    """A decode-shaped write (a token a request, on CUDA the form whose lanes share a request's
    sources) hashes paged sources of power-of-two and other page sizes, and links each token to its
    seed's slot."""
    rng = np.random.default_rng(page_size)
    num_slots = 40
    specs = [random_source(rng, num_slots, page_size=page_size, num_bytes_per_token=48, read_bytes=32),
             random_source(rng, num_slots, page_size=page_size, num_bytes_per_token=16, read_bytes=16),
             random_source(rng, num_slots, page_size=page_size, num_bytes_per_token=64, read_bytes=64)]
    ctx = _ctx(device, num_slots, real_kv_sources=tuple(s.build(device) for s in specs), hash_mode=kc.HashMode.ALL)
    seeds = [int(s) for s in rng.permutation(np.arange(1, 20))[:8]]
    slots = [int(s) for s in rng.permutation(np.arange(20, num_slots))[:8]]
    _write(ctx, list(range(9)), [-1] * 8, [100 + s for s in seeds], [5] * 8, seeds, device=device)
    _write(ctx, list(range(9)), seeds, list(range(8)), [6] * 8, slots, device=device)
    for seed, slot in zip(seeds, slots):
        assert fields(ctx.canary_buf, slot)[2] == link_of(ctx.canary_buf, seed), slot
        assert fields(ctx.canary_buf, slot)[3] == expected_kv_hash(specs, kc.HashMode.ALL, slot), slot
    assert ctx.violations().total == 0


@pytest.mark.parametrize("device", BACKENDS)
def test_many_sources_accepted(device):
    """(extension) More than the engine's four sources."""
    rng = np.random.default_rng(5)
    specs = [random_source(rng, 6, num_bytes_per_token=16) for _ in range(6)]
    ctx = _ctx(device, 6, real_kv_sources=tuple(s.build(device) for s in specs), hash_mode=kc.HashMode.ALL)
    ids = _tokens(rng, 2)
    _write(ctx, [0, 2], [-1], ids, [0, 1], [2, 4], device=device)
    assert fields(ctx.canary_buf, 2) == (ids[0], 0, signed(ANCHOR_LINK), expected_kv_hash(specs, kc.HashMode.ALL, 2))
    assert fields(ctx.canary_buf, 4) == (ids[1], 1, link_of(ctx.canary_buf, 2),
                                         expected_kv_hash(specs, kc.HashMode.ALL, 4))
    # every source counts: the hash of the first five alone is another value
    assert fields(ctx.canary_buf, 4)[3] != expected_kv_hash(specs[:5], kc.HashMode.ALL, 4)
    assert ctx.violations().total == 0


@pytest.mark.parametrize("device", BACKENDS)
def test_source_row_out_of_range(device):
    """A slot past the source's rows folds as 0 and records bit 64; the store still happens."""
    rng = np.random.default_rng(1)
    spec = random_source(rng, 4, page_size=2, num_bytes_per_token=16)  # rows for slots 0..3 only
    ctx = _ctx(device, 8, real_kv_sources=(spec.build(device),), hash_mode=kc.HashMode.PARTIAL)
    _write(ctx, [0, 2], [-1], [11, 12], [0, 1], [3, 6], device=device)
    running = link_of(ctx.canary_buf, 3)
    assert ring_rows(ctx) == [(TAG, 6, 1, 12, 12, running, 1, 64)]
    assert fields(ctx.canary_buf, 6) == (12, 1, running, signed(ref.sm(0)))
    assert ctx.counters()["slot_run_counter"] == 2


# --- asserts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
def test_input_assert(device):
    ctx = _ctx(device)
    ids, pos, loc = [10, 11, 12, 13], [0, 1, 2, 3], [1, 2, 3, 4]
    expected_ids, expected_pos = [10, 99, 12, 98], [0, 1, 7, 6]
    _write(ctx, [0, 4], [-1], ids, pos, loc, device=device, expected=(expected_ids, expected_pos))
    chain = [fields(ctx.canary_buf, s)[2] for s in loc]
    assert_rows(device, ring_rows(ctx), [
        (TAG, 2, 1, 11, 99, chain[1], 1, int(BIT.WRITE_TOKEN)),
        (TAG, 3, 2, 12, 12, chain[2], 7, int(BIT.WRITE_POSITION)),
        (TAG, 4, 3, 13, 98, chain[3], 6, int(BIT.WRITE_TOKEN | BIT.WRITE_POSITION)),
    ])
    # The chain advanced on the actual values: no cascade.
    for a, b in zip(loc, loc[1:]):
        assert fields(ctx.canary_buf, b)[2] == link_of(ctx.canary_buf, a)
    assert fields(ctx.canary_buf, 2)[:2] == (11, 1)


@pytest.mark.parametrize("device", BACKENDS)
def test_chain_position_assert_is_off_by_default(device):
    """``CanaryContext.allocate`` leaves the chain position assert off (its flag 0): positions that
    jump after a seed record nothing until it is turned on."""
    ctx = _ctx(device, 10)
    assert to_numpy(ctx.chain_position_assert).tolist() == [0]
    _write(ctx, [0, 2], [-1], [1, 2], [0, 1], [1, 2], device=device)  # the prefix: positions 0, 1
    _write(ctx, [0, 2], [2], [3, 4], [2, 4], [3, 4], device=device)  # position 4 jumps past 3
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("flag", [False, True])
def test_chain_position_assert(device, flag):
    ctx = _ctx(device, 10)
    _write(ctx, [0, 2], [-1], [1, 2], [0, 1], [1, 2], device=device)  # the prefix: positions 0, 1
    ctx.set_chain_position_assert(flag)
    # Continues from seed slot 2 (position 1): 2 ok, 4 jumps, 5 follows 4, 5 again repeats.
    _write(ctx, [0, 4], [2], [3, 4, 5, 6], [2, 4, 5, 5], [3, 4, 5, 6], device=device)
    chain = [fields(ctx.canary_buf, s)[2] for s in (3, 4, 5, 6)]
    expected = [(TAG, 4, 4, 4, 4, chain[1], 3, 16), (TAG, 6, 5, 6, 6, chain[3], 6, 16)] if flag else []
    assert_rows(device, ring_rows(ctx), expected)
    # No seed: no assert even with the flag on.
    ctx.clear_violations()
    _write(ctx, [0, 2], [-1], [1, 2], [5, 9], [7, 8], device=device)
    assert ring_rows(ctx) == []


@pytest.mark.parametrize("device", BACKENDS)
def test_seed_links_to_existing_chain(device):
    ctx = _ctx(device)
    _write(ctx, [0, 3], [-1], [1, 2, 3], [0, 1, 2], [5, 1, 7], device=device)
    _write(ctx, [0, 1, 3], [7, 1], [4, 8, 9], [3, 2, 3], [2, 3, 4], device=device)
    assert fields(ctx.canary_buf, 2)[2] == link_of(ctx.canary_buf, 7)
    assert fields(ctx.canary_buf, 3)[2] == link_of(ctx.canary_buf, 1)
    assert fields(ctx.canary_buf, 4)[2] == link_of(ctx.canary_buf, 3)


@pytest.mark.parametrize("device", BACKENDS)
def test_negative_seed_is_anchor(device):
    ctx = _ctx(device)
    _write(ctx, [0, 1, 2], [-1, -9], [1, 2], [0, 0], [2, 3], device=device)
    assert fields(ctx.canary_buf, 2)[2] == fields(ctx.canary_buf, 3)[2] == signed(ANCHOR_LINK)


# --- skipped entries, out-of-range indices, counters ----------------------------------------------

@pytest.mark.parametrize("device", BACKENDS)
def test_negative_slot_skipped(device):
    ctx = _ctx(device)
    _write(ctx, [0, 3], [-1], [1, 2, 3], [0, 1, 2], [1, -1, 2], device=device)
    assert not slot_words(ctx.canary_buf)[0].any()
    assert fields(ctx.canary_buf, 2)[2] == link_of(ctx.canary_buf, 1)  # chain not advanced by the skip
    assert ctx.counters() == {"slot_run_counter": 2, "kernel_run_counter": 1, "violations": 0}


@pytest.mark.parametrize("device", BACKENDS)
def test_entry_slot_out_of_range(device):
    ctx = _ctx(device, 4)
    _write(ctx, [0, 3], [-1], [1, 2, 3], [0, 1, 2], [1, 4, 2], device=device)
    running = link_of(ctx.canary_buf, 1)
    assert ring_rows(ctx) == [(TAG, 4, 1, 2, 2, running, 1, 64)]
    assert fields(ctx.canary_buf, 2)[2] == running
    assert ctx.counters()["slot_run_counter"] == 2


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", [4, 1000, UNRESOLVED])
def test_seed_out_of_range(device, seed):
    ctx = _ctx(device, 4)
    ctx.set_chain_position_assert(True)
    _write(ctx, [0, 2], [seed], [1, 2], [5, 9], [1, 2], device=device)
    assert ring_rows(ctx) == [(TAG, seed, 0, 0, 0, 0, 0, 64)]  # no position assert after the fallback
    assert fields(ctx.canary_buf, 1)[2] == signed(ANCHOR_LINK)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("offsets,stored", [([0, 5], 3), ([-2, 1], 0), ([2, 7, 0], 1),
                                            # -1: where negative indices count from the end, the last entry
                                            ([-1, 2], 0),
                                            # spans of 2**63 or more: no int64 length may wrap
                                            ([-2, 2**63 - 1], 0), ([1, 2**63 - 1], 2), ([-2**63, 2], 0)])
def test_offsets_outside_entries(device, offsets, stored):
    ctx = _ctx(device)
    seeds = [-1] * (len(offsets) - 1)
    _write(ctx, offsets, seeds, [1, 2, 3], [0, 1, 2], [1, 2, 3], device=device)
    rows = ring_rows(ctx)
    assert len(rows) == 1
    kind, slot, pos, tok, exp, chain, aux, bits = rows[0]
    assert (kind, slot, pos, tok, exp, aux, bits) == (TAG, -1, 0, 0, 0, 0, 64)
    last = [1, 2, 3][offsets[0] + stored - 1] if stored else -1
    assert chain == link_of(ctx.canary_buf, last)
    assert ctx.counters()["slot_run_counter"] == stored


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("num_valid_reqs,stored", [(-1, 0), (0, 0), (1, 1), (2, 3), (50, 3)])
def test_num_valid_reqs_clamped(device, num_valid_reqs, stored):
    ctx = _ctx(device)
    _write(ctx, [0, 1, 3], [-1, -1], [1, 2, 3], [0, 0, 1], [1, 2, 3], device=device, num_valid_reqs=num_valid_reqs)
    assert ctx.counters() == {"slot_run_counter": stored, "kernel_run_counter": 1, "violations": 0}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("num_valid_reqs,stored", [(-2**31, 0), (2**31 - 1, 3)])
def test_num_valid_reqs_at_either_end_of_int32_is_clamped(device, num_valid_reqs, stored):
    """SPEC §3.1 clamps ``num_valid_reqs`` to ``[0, cap]``: any int32 the cell holds is a count the
    plan accepts, the most negative one included."""
    ctx = _ctx(device)
    _write(ctx, [0, 1, 3], [-1, -1], [1, 2, 3], [0, 0, 1], [1, 2, 3], device=device, num_valid_reqs=num_valid_reqs)
    assert ctx.counters() == {"slot_run_counter": stored, "kernel_run_counter": 1, "violations": 0}


@pytest.mark.parametrize("device", BACKENDS)
def test_duplicate_slots_last_wins(device):
    ctx = _ctx(device)
    _write(ctx, [0, 3], [-1], [1, 2, 3], [0, 1, 2], [4, 5, 4], device=device)
    assert fields(ctx.canary_buf, 4)[:2] == (3, 2)
    assert fields(ctx.canary_buf, 4)[2] == signed(ref.mix3(fields(ctx.canary_buf, 5)[2], 2, 1))


@pytest.mark.parametrize("device", BACKENDS)
def test_counters_accumulate(device):
    ctx = _ctx(device)
    for n in range(1, 4):
        _write(ctx, [0, n], [-1], list(range(n)), list(range(n)), list(range(1, n + 1)), device=device)
    _write(ctx, [0, 0], [-1], [], [], [], device=device)
    assert ctx.counters() == {"slot_run_counter": 6, "kernel_run_counter": 4, "violations": 0}


@pytest.mark.parametrize("device", BACKENDS)
def test_ring_overflow_on_write(device):
    ctx = _ctx(device, 12, ring_capacity=2)
    n = 6
    _write(ctx, [0, n], [-1], list(range(n)), list(range(n)), list(range(1, n + 1)), device=device,
           expected=([100 + i for i in range(n)], list(range(n))))
    report = ctx.violations()
    assert (report.total, report.dropped, len(report)) == (6, 4, 2)
    assert ctx.counters()["violations"] == 6
    rows = ring_rows(ctx)
    if device == "cpu":
        assert [r[1] for r in rows] == [1, 2]
    assert all(r[7] == 8 for r in rows)


# --- SPEC rules pinned one at a time ----------------------------------------------------------------

def _tokens(rng, n):
    return [int(t) for t in rng.integers(1, 2**40, size=n)]


@pytest.mark.parametrize("device", BACKENDS)
def test_padding_slot_is_written_like_any_other(device):
    """SPEC §3.1 skips only negative slots: a token an engine points at slot 0 (the padding slot of
    §2, which verify never checks) is stored, chained and counted like any other."""
    rng = np.random.default_rng(31)
    ids, pos = _tokens(rng, 3), [int(p) for p in rng.integers(1, 1000, size=3)]
    ctx = _ctx(device, 8)
    _write(ctx, [0, 3], [-1], ids, pos, [3, 0, 5], device=device)
    assert fields(ctx.canary_buf, 0) == (ids[1], pos[1], link_of(ctx.canary_buf, 3), 0)
    assert fields(ctx.canary_buf, 5)[2] == link_of(ctx.canary_buf, 0)
    assert ctx.counters() == {"slot_run_counter": 3, "kernel_run_counter": 1, "violations": 0}


@pytest.mark.parametrize("device", BACKENDS)
def test_seed_at_the_padding_slot_is_linked(device):
    """SPEC §3.1 step 2: any seed ``>= 0`` is a predecessor, slot 0 included (unlike verify's
    ``prev == 0``, §3.2): the chain starts from slot 0's link and the chain position assert, when
    on, continues from slot 0's position."""
    rng = np.random.default_rng(38)
    ids, seed_pos = _tokens(rng, 3), int(rng.integers(10, 500))
    ctx = _ctx(device, 8, chain_position_assert=True)
    _write(ctx, [0, 1], [-1], ids[:1], [seed_pos], [0], device=device)  # an engine's padded token
    _write(ctx, [0, 2], [0], ids[1:], [seed_pos + 1, seed_pos + 3], [4, 6], device=device)
    assert fields(ctx.canary_buf, 4)[2] == link_of(ctx.canary_buf, 0) != signed(ANCHOR_LINK)
    running = link_of(ctx.canary_buf, 4)
    assert ring_rows(ctx) == [(TAG, 6, seed_pos + 3, ids[2], ids[2], running, seed_pos + 2, 16)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("skipped", [-1, -9, 8, 1000])
def test_skipped_entry_does_not_move_the_asserted_position(device, skipped):
    """SPEC §3.1 step 3: a skipped entry (a negative slot, or one >= num_slots, skipped alike by
    §4) is not processed, so ``prev_pos`` stays where the last stored entry left it: the next
    stored entry is asserted against that position + 1, and the chain does not advance either."""
    rng = np.random.default_rng(32 + abs(skipped))
    seed_pos = int(rng.integers(5, 500))
    ids = _tokens(rng, 4)
    ctx = _ctx(device, 8, chain_position_assert=True)
    _write(ctx, [0, 1], [-1], ids[:1], [seed_pos], [2], device=device)  # the seed: slot 2
    positions = [seed_pos + 1, seed_pos + 2, seed_pos + 3]
    _write(ctx, [0, 3], [2], ids[1:], positions, [3, skipped, 4], device=device)
    running = link_of(ctx.canary_buf, 3)
    expected = [(TAG, skipped, positions[1], ids[2], ids[2], running, positions[1], 64)] if skipped >= 8 else []
    expected.append((TAG, 4, positions[2], ids[3], ids[3], running, seed_pos + 2, int(BIT.WRITE_POSITION)))
    assert_rows(device, ring_rows(ctx), expected)
    assert fields(ctx.canary_buf, 4) == (ids[3], positions[2], running, 0)
    assert ctx.counters()["slot_run_counter"] == 1 + 2


@pytest.mark.parametrize("device", BACKENDS)
def test_out_of_range_slot_gets_no_input_assert(device):
    """SPEC §4: an entry slot >= num_slots records its bit-64 row and is skipped like a negative
    slot, so neither it nor a negative slot is compared with the expected inputs; the entries
    stored around them are."""
    rng = np.random.default_rng(33)
    ids, pos = _tokens(rng, 4), [int(p) for p in rng.integers(0, 1000, size=4)]
    expected = ([t + 1 for t in ids], [p + 1 for p in pos])  # every entry mismatches
    ctx = _ctx(device, 6)
    _write(ctx, [0, 4], [-1], ids, pos, [1, 6, -2, 3], device=device, expected=expected)
    anchor, after = signed(ANCHOR_LINK), link_of(ctx.canary_buf, 1)
    both = int(BIT.WRITE_TOKEN | BIT.WRITE_POSITION)
    assert_rows(device, ring_rows(ctx), [(TAG, 1, pos[0], ids[0], ids[0] + 1, anchor, pos[0] + 1, both),
                                         (TAG, 6, pos[1], ids[1], ids[1], after, pos[1], 64),
                                         (TAG, 3, pos[3], ids[3], ids[3] + 1, after, pos[3] + 1, both)])
    assert ctx.counters()["slot_run_counter"] == 2


@pytest.mark.parametrize("device", BACKENDS)
def test_entry_failing_both_asserts_records_both_rows(device):
    """SPEC §3.1 step 3: the input assert's row, then the chain position assert's (aux: the
    predecessor's position + 1, expected token: the token itself); the entry is still stored."""
    rng = np.random.default_rng(34)
    seed_pos = int(rng.integers(10, 500))
    ids = _tokens(rng, 2)
    ctx = _ctx(device, 8, chain_position_assert=True)
    _write(ctx, [0, 1], [-1], ids[:1], [seed_pos], [2], device=device)
    jumped = seed_pos + 3
    _write(ctx, [0, 1], [2], ids[1:], [jumped], [5], device=device, expected=([ids[1] + 7], [seed_pos + 1]))
    running = link_of(ctx.canary_buf, 2)
    assert_rows(device, ring_rows(ctx), [
        (TAG, 5, jumped, ids[1], ids[1] + 7, running, seed_pos + 1, int(BIT.WRITE_TOKEN | BIT.WRITE_POSITION)),
        (TAG, 5, jumped, ids[1], ids[1], running, seed_pos + 1, int(BIT.WRITE_POSITION))])
    assert fields(ctx.canary_buf, 5) == (ids[1], jumped, running, 0)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("flag", [2, -1, 2**31 - 1])
def test_any_non_zero_chain_position_flag_turns_the_assert_on(device, flag):
    """SPEC §3.1 step 2: the chain position assert is on when the device flag is non-zero, not only
    when it is 1 (a context over the caller's own arrays may hold any int32 there)."""
    rng = np.random.default_rng(35)
    put = lambda a: to_device(np.asarray(a), device)  # noqa: E731
    ctx = kc.CanaryContext(canary_buf=put(np.zeros((8, 32), np.uint8)), violation_ring=put(np.zeros((4, 8), np.int64)),
                           violation_write_index=put(np.zeros(1, np.int32)),
                           slot_run_counter=put(np.zeros(1, np.int64)), kernel_run_counter=put(np.zeros(1, np.int64)),
                           chain_position_assert=put(np.array([flag], np.int32)))
    seed_pos = int(rng.integers(0, 100))
    ids = _tokens(rng, 2)
    _write(ctx, [0, 1], [-1], ids[:1], [seed_pos], [1], device=device)
    _write(ctx, [0, 1], [1], ids[1:], [seed_pos + 5], [2], device=device)
    running = link_of(ctx.canary_buf, 1)
    assert ring_rows(ctx) == [(TAG, 2, seed_pos + 5, ids[1], ids[1], running, seed_pos + 1, 16)]


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_slot_0_beside_a_slot_past_a_short_source_is_hashed_whole(device, at):
    """The CPU backend hashes a write's slots four at a time: slot 0 (whose bytes open every source)
    in any place of a group beside a slot past a short source keeps its own hash and records no row."""
    rng = np.random.default_rng(37 + at)
    specs = [random_source(rng, 12, page_size=1, num_bytes_per_token=32),
             random_source(rng, 4, page_size=2, num_bytes_per_token=48, read_bytes=32)]  # rows for slots 0..3
    ctx = _ctx(device, 12, real_kv_sources=tuple(s.build(device) for s in specs), hash_mode=kc.HashMode.ALL)
    loc = [1, 2, 3, 1]
    loc[at], loc[(at + 1) % 4] = 0, 9
    _write(ctx, [0, 4], [-1], _tokens(rng, 4), list(range(4)), loc, device=device)
    assert fields(ctx.canary_buf, 0)[3] == expected_kv_hash(specs, kc.HashMode.ALL, 0)
    assert {row[1] for row in ring_rows(ctx)} == {9}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_short_source_among_several_folds_zero_in_its_place(device, mode):
    """SPEC §2 and §4: with several sources, one whose rows end before a slot's row adds a fold of 0
    in its own place (``acc = sm(acc ^ 0)``, the sources after it folded on top), not the hash of
    the other sources alone; bit 64 is recorded and the slot is still stored. The slots written
    beside it, the padding slot 0 among them (whose bytes open every source), are hashed whole."""
    rng = np.random.default_rng(36)
    num_slots = 12
    specs = [random_source(rng, num_slots, page_size=1, num_bytes_per_token=32),
             random_source(rng, 4, page_size=2, num_bytes_per_token=48, read_bytes=32),  # rows for slots 0..3
             random_source(rng, num_slots, page_size=3, num_bytes_per_token=16)]
    ctx = _ctx(device, num_slots, real_kv_sources=tuple(s.build(device) for s in specs), hash_mode=mode)
    ids, pos = _tokens(rng, 3), [int(p) for p in rng.integers(0, 1000, size=3)]
    _write(ctx, [0, 3], [-1], ids, pos, [0, 3, 9], device=device)
    running = link_of(ctx.canary_buf, 3)
    assert ring_rows(ctx) == [(TAG, 9, pos[2], ids[2], ids[2], running, pos[2], 64)]
    assert [fields(ctx.canary_buf, slot)[3] for slot in (0, 3)] == [expected_kv_hash(specs, mode, 0),
                                                                    expected_kv_hash(specs, mode, 3)]
    stored = fields(ctx.canary_buf, 9)
    assert stored == (ids[2], pos[2], running, expected_kv_hash(specs, mode, 9))
    assert stored[3] != expected_kv_hash([specs[0], specs[2]], mode, 9)
    assert ctx.counters()["slot_run_counter"] == 3


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_bytes_past_the_used_part_of_a_row_are_never_read(device, mode):
    """SPEC §2: a source row may hold more than ``page_size * num_bytes_per_token`` bytes; the bytes
    past those are ignored, by write and by verify."""
    rng = np.random.default_rng(37)
    num_slots, page, per_token, trailing = 10, 2, 32, 48
    rows = rng.integers(1, 256, size=(num_slots // page, page * per_token + trailing), dtype=np.uint8)
    spec = SourceSpec(rows, page, per_token, 32)
    ctx = _ctx(device, num_slots, real_kv_sources=(spec.build(device),), hash_mode=mode)
    slots = [int(s) for s in rng.permutation(np.arange(1, num_slots))]
    ids = _tokens(rng, len(slots))
    _write(ctx, [0, len(slots)], [-1], ids, list(range(len(slots))), slots, device=device)
    for slot in slots:
        assert fields(ctx.canary_buf, slot)[3] == expected_kv_hash([spec], mode, slot)
    ctx.real_kv_sources[0].tensor[:, page * per_token:] ^= 0xFF
    prev = [-1] + slots[:-1]
    kc.verify(ctx, host_verify_plan(slots, [-1] * len(slots), list(range(len(slots))), prev, device=device), tag=TAG)
    assert ring_rows(ctx) == []


# --- the CUDA write's forms (a thread or a lane group a request; one warp a request, or two in turn)

def test_cuda_write_team_follows_the_batch_shape():
    """Two warps a request unless the batch is decode-shaped (at most two new tokens a request over
    the plan's capacity) or no request can reach a second 32-entry chunk."""
    from kvcanary_cupy.ops.backends._cuda.write import paired

    assert paired(4096, 1)            # one prefill chunk
    assert paired(4096, 256)          # the same with a plan sized for a large batch
    assert paired(32 * 128, 32)       # an extend batch
    assert not paired(256, 256)       # decode
    assert not paired(512, 256)       # two tokens a request
    assert not paired(32, 1)          # a single chunk at most


def test_cuda_write_takes_its_decode_form_for_decode_shaped_batches():
    """kvc_write_decode for decode-shaped batches (at most two new tokens a request over the plan's
    capacity; with real-KV sources at most one); kvc_write otherwise."""
    from kvcanary_cupy.ops.backends._cuda.write import decode_form

    assert decode_form(256, 256, False)       # decode
    assert decode_form(1, 1, False)           # the decode tail
    assert decode_form(512, 256, False)       # two tokens a request
    assert decode_form(256, 256, True)        # decode with sources: a group of lanes a request
    assert decode_form(1, 1, True)
    assert not decode_form(512, 256, True)    # with sources, two tokens a request take kvc_write
    assert not decode_form(4096, 1, False)    # a prefill chunk
    assert not decode_form(32 * 128, 32, False)


def test_cuda_kernels_without_sources_have_no_hashing_code():
    """The write and step launchers pick their kernels' kRealKv instance only for a context that
    hashes sources (none in mode NONE), and every instance they can pick is compiled."""
    import itertools

    from kvcanary_cupy.ops.backends._cuda.write import has_real_kv
    from kvcanary_cupy.rawkernels import _loader

    rng = np.random.default_rng(3)
    sources = (random_source(rng, 8, num_bytes_per_token=16).build("cpu"),)
    assert not has_real_kv(_ctx("cpu"))
    assert not has_real_kv(_ctx("cpu", real_kv_sources=sources, hash_mode=kc.HashMode.NONE))
    assert has_real_kv(_ctx("cpu", real_kv_sources=sources, hash_mode=kc.HashMode.PARTIAL))
    for template, source in (("kvc_write", "write"), ("kvc_step", "step")):
        for flags in itertools.product((True, False), repeat=3):
            assert _loader.instance(template, *flags) in _loader.SPECS[source].kernels


@pytest.mark.parametrize("mode", list(kc.HashMode))
@pytest.mark.parametrize("reads", [(), (16,), (32, 32, 16, 32), (64,), (16,) * 8, (16,) * 9])
def test_cuda_decode_write_instance_is_compiled_for_every_context(mode, reads, monkeypatch):
    """The decode write's instance for any context (sources or none, hashed or not, short reads or
    long, few sources or many) is one the write module compiles, and it hashes exactly when the
    context does; the short-reads form only for hashed sources of at most 32 bytes, at most as many
    as a request's lanes."""
    from kvcanary_cupy.ops.backends._cuda import write as cuda_write
    from kvcanary_cupy.rawkernels import _loader

    assert cuda_write._DECODE_LANES == 8  # the reads' bound cases: 8 sources, then 9
    rng = np.random.default_rng(5)
    sources = tuple(random_source(rng, 8, num_bytes_per_token=max(read, 16), read_bytes=read).build("cpu")
                    for read in reads)
    ctx = _ctx("cpu", real_kv_sources=sources, hash_mode=mode)
    hashed = bool(reads) and mode != kc.HashMode.NONE
    read_length = 16 if mode == kc.HashMode.PARTIAL else max(reads, default=0)
    short = hashed and len(reads) <= cuda_write._DECODE_LANES and read_length <= 32
    for vec16 in (True, False):
        monkeypatch.setattr(cuda_write, "vec16", lambda _buf, v=vec16: v)
        name = cuda_write.decode_instance(ctx)
        assert name in _loader.SPECS["write_decode"].kernels
        assert name == _loader.instance("kvc_write_decode", vec16, hashed, short)


def _record_write_kernels(monkeypatch) -> list[str]:
    """The names of the kernels the CUDA write launcher picks from now on, in order."""
    from kvcanary_cupy.ops.backends._cuda import write as cuda_write

    launched: list[str] = []
    pick = cuda_write.kernel
    monkeypatch.setattr(cuda_write, "kernel", lambda source, name, device_id: launched.append(name) or
                        pick(source, name, device_id))
    return launched


@requires_gpu
@pytest.mark.parametrize("mode", [kc.HashMode.NONE, kc.HashMode.ALL])
def test_cuda_write_kernel_follows_the_sources(mode, monkeypatch):
    """A context without hashed sources launches the write kernel without hashing code, and both
    store what the CPU backend stores."""
    launched = _record_write_kernels(monkeypatch)
    rng = np.random.default_rng(4)
    spec = random_source(rng, 16, num_bytes_per_token=32, read_bytes=32)
    canaries = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, 16, real_kv_sources=(spec.build(device),), hash_mode=mode)
        _write(ctx, [0, 3, 5], [-1, 7], [5, 6, 7, 8, 9], [0, 1, 2, 5, 6], [1, 2, 3, 11, 12], device=device)
        canaries[device] = to_numpy(ctx.canary_buf)
    assert launched and all(name.endswith("true>" if mode != kc.HashMode.NONE else "false>") for name in launched)
    assert np.array_equal(canaries["cpu"], canaries["cuda"])


def _long_requests_case(rng: np.random.Generator) -> dict:
    """Requests of several chunks with slots repeated across chunk boundaries, a negative and an
    out-of-range slot, input-assert mismatches, a position jump after a seed, and a request whose
    end is past the entries."""
    n0, n1 = 100, 70
    slots = [1 + (i % 40) for i in range(n0)] + [60 + (i % 45) for i in range(n1)]
    slots[17], slots[55] = -1, 10_000
    positions = list(range(n0)) + [1 + i + (i >= 33) for i in range(n1)]
    ids = [int(t) for t in rng.integers(0, 50_000, size=n0 + n1)]
    expected_ids = list(ids)
    expected_ids[5] += 1
    expected_ids[n0 + 40] += 1
    return dict(offsets=[0, n0, n0 + n1, n0 + n1 + 9], seeds=[-1, 50, -1], ids=ids, positions=positions,
                slots=slots, expected=(expected_ids, positions))


def _end_state(ctx):
    """What a write leaves: the canary's words, the counters and the ring's rows (as a multiset: a
    GPU records a launch's rows in its threads' order)."""
    return slot_words(ctx.canary_buf).copy(), ctx.counters(), sorted(ring_rows(ctx))


@requires_gpu
@pytest.mark.parametrize("team", ["thread", "one", "two"])
def test_cuda_write_forms_equal_the_cpu_backend(team, monkeypatch):
    force_write_team(team, monkeypatch.setattr)
    case = _long_requests_case(np.random.default_rng(11))
    results = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, 256, ring_capacity=64)
        _write(ctx, [0, 1], [-1], [7], [0], [50], device=device)  # the seed of request 1, position 0
        ctx.set_chain_position_assert(True)
        _write(ctx, case["offsets"], case["seeds"], case["ids"], case["positions"], case["slots"], device=device,
               expected=case["expected"])
        results[device] = _end_state(ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    assert cpu[2], "the case records violations"
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


@requires_gpu
@pytest.mark.parametrize("team", ["thread", "one", "two"])
@pytest.mark.parametrize("begin", [L_INT64_MAX - 32, L_INT64_MAX - 1, 1 << 62])
def test_cuda_write_forms_take_begins_near_int64_max(team, begin, monkeypatch):
    """A request whose entries begin far past the arrays (a hostile or wrapped write plan) records
    its one row and stops (SPEC §4) in every CUDA form: a begin plus a chunk must not wrap past
    2^63, where the pair of warps walking one request would walk different chunk counts."""
    force_write_team(team, monkeypatch.setattr)
    rng = np.random.default_rng(begin % 1000)
    n = 100
    ids, positions = _tokens(rng, n), list(range(n))
    slots = [int(s) for s in rng.permutation(np.arange(10, 210))[:n]]  # not the seed, 7: requests run concurrently
    results = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, 256, ring_capacity=16)
        _write(ctx, [0, 1], [-1], [12345], [3], [7], device=device)  # the second request's seed
        _write(ctx, [0, begin, L_INT64_MAX], [-1, 7], ids, positions, slots, device=device)
        results[device] = _end_state(ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    assert [row[1] for row in cpu[2]] == [-1, -1] and cpu[1]["slot_run_counter"] == 1 + n
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


@requires_gpu
@pytest.mark.parametrize("team", ["thread", "one", "two"])
def test_cuda_write_forms_take_seeds_at_the_pool_end(team, monkeypatch):
    """SPEC §4: a seed at or past num_slots records its bit-64 row and its request chains from the
    anchor, in every CUDA form. The seed num_slots itself is the first index past the pool: taken
    for a slot, it would read one record past the canary buffer."""
    force_write_team(team, monkeypatch.setattr)
    rng = np.random.default_rng(17)
    num_slots = 64
    seeds = [num_slots, 5, num_slots + 1, UNRESOLVED, num_slots]
    counts = [1, 3, 2, 1, 40]  # a long request (more than a chunk) among short ones
    starts = [0, 3, 10, 7, 100]  # request 1 continues its seed's chain (position 2)
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    n = offsets[-1]
    slots = [int(s) for s in rng.permutation(np.arange(8, num_slots))[:n]]
    ids = [int(t) for t in rng.integers(0, 50_000, size=n)]
    positions = [p for start, count in zip(starts, counts) for p in range(start, start + count)]
    results = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, num_slots, ring_capacity=16)
        _write(ctx, [0, 1], [-1], [9], [2], [5], device=device)
        ctx.set_chain_position_assert(True)
        _write(ctx, offsets, seeds, ids, positions, slots, device=device)
        results[device] = _end_state(ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    assert cpu[2] == sorted((TAG, seed, 0, 0, 0, 0, 0, 64) for seed in seeds if seed != 5)
    for request in (0, 2, 3, 4):  # each chains from the anchor after its seed's row
        assert cpu[0][slots[offsets[request]], 2] == signed(ANCHOR_LINK)
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


@requires_gpu
@pytest.mark.parametrize("team", ["one", "two"])
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_cuda_write_hashes_a_long_request_past_the_first_block_of_requests(team, mode, monkeypatch):
    """kvc_write's blocks find the long requests (more than 32 entries: the whole grid hashes their
    sources) by reading every request's offsets, a thread a request, striding by the block. Here the
    one long request lies past the block's threads, and the request a block's stride before it is
    empty but begins near the long one's end: taken with that begin, the long request would look
    short, and its slots would be stored without their real-KV hashes."""
    from kvcanary_cupy.ops.backends._cuda.write import _BLOCK

    force_write_team(team, monkeypatch.setattr)
    rng = np.random.default_rng(30 + int(mode) + len(team))
    num_slots, n = 512, 200
    bs, long_request, neighbour = _BLOCK + 44, _BLOCK + 24, 24
    # requests before the neighbour: [195, 195); the neighbour: [195, 100); then [100, 100) up to
    # [100, 0); the long request: [0, 200); the rest: [200, 200). Every one empty but the long one.
    offsets = [195] * (neighbour + 1) + [100] * (long_request - neighbour - 1) + [0] + [n] * (bs - long_request)
    specs = [random_source(rng, num_slots, num_bytes_per_token=48, read_bytes=32),
             random_source(rng, num_slots, num_bytes_per_token=16)]
    slots = [int(s) for s in rng.permutation(np.arange(1, num_slots))[:n]]
    ids = [int(t) for t in rng.integers(0, 50_000, size=n)]
    results = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, num_slots, real_kv_sources=tuple(s.build(device) for s in specs), hash_mode=mode)
        _write(ctx, offsets, [-1] * bs, ids, list(range(n)), slots, device=device)
        results[device] = _end_state(ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    assert cpu[1] == {"slot_run_counter": n, "kernel_run_counter": 1, "violations": 0}
    for slot in (slots[0], slots[n // 2], slots[-1]):
        assert cpu[0][slot, 3] == expected_kv_hash(specs, mode, slot) != 0
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


def _requests_at_the_inline_limit(rng: np.random.Generator, num_slots: int, cut_span: int) -> dict:
    """Requests of 31, 32 and 33 entries around kvc_write's inline limit (a request of at most 32
    entries hashes its sources in its own warp, a longer one by the whole grid), one of 1 entry,
    and a last one whose end lies past the entries, its span cut to ``cut_span``."""
    counts = [31, 32, 1, 33, cut_span]
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    n = offsets[-1]
    offsets[-1] += 9  # the last request's end past the entries: its span is cut to n - its begin
    slots = [int(s) for s in rng.permutation(np.arange(1, num_slots))[:n]]
    return dict(offsets=offsets, seeds=[-1] * len(counts), ids=_tokens(rng, n), positions=list(range(n)),
                slots=slots)


@requires_gpu
@pytest.mark.parametrize("cut_span", [32, 48])
@pytest.mark.parametrize("team", ["one", "two"])
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_cuda_write_hashes_requests_at_the_inline_limit(team, mode, cut_span, monkeypatch):
    """A request of exactly 32 entries (and one cut to 32 by the entries' end) takes its real-KV
    hashes from its own warp; the grid hashes only longer ones. Sent to neither, its slots would be
    stored with the bytes their hash word held before. A span cut to two chunks (48) is walked by
    both warps of a team: the row for its end past the entries carries the chain of the second."""
    force_write_team(team, monkeypatch.setattr)
    rng = np.random.default_rng(40 + int(mode) + len(team))
    num_slots = 256
    case = _requests_at_the_inline_limit(rng, num_slots, cut_span)
    specs = [random_source(rng, num_slots, num_bytes_per_token=48, read_bytes=32),
             random_source(rng, num_slots, num_bytes_per_token=16)]
    results = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, num_slots, ring_capacity=16, real_kv_sources=tuple(s.build(device) for s in specs),
                   hash_mode=mode)
        _write(ctx, case["offsets"], case["seeds"], case["ids"], case["positions"], case["slots"], device=device)
        results[device] = _end_state(ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    for slot in case["slots"]:
        assert cpu[0][slot, 3] == expected_kv_hash(specs, mode, slot) != 0
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


def _write_over_random_words(device: str, num_slots: int, specs, mode, case: dict):
    """``case`` written into a canary of random words with ``specs``' sources: the end state and the
    words it started from."""
    ctx = _ctx(device, num_slots, ring_capacity=16, real_kv_sources=tuple(s.build(device) for s in specs),
               hash_mode=mode)
    start = np.random.default_rng(num_slots).integers(0, 256, size=ctx.canary_buf.shape, dtype=np.uint8)
    ctx.canary_buf[...] = to_device(start, device)
    _write(ctx, case["offsets"], case["seeds"], case["ids"], case["positions"], case["slots"], device=device)
    return _end_state(ctx), slot_words(start)


@requires_gpu
@pytest.mark.parametrize("team", ["one", "two"])
def test_cuda_write_hashes_no_long_request_that_begins_before_the_entries(team, monkeypatch):
    """A request that begins before the entries stops at once (SPEC §4), however long: the grid that
    hashes long requests' real-KV sources takes none of it either. Taken, its slots would get hash
    words no write stored, and out_cache_loc would be read before its start."""
    force_write_team(team, monkeypatch.setattr)
    rng = np.random.default_rng(50 + len(team))
    num_slots, n, cut = 256, 120, 80
    slots = [int(s) for s in rng.permutation(np.arange(1, num_slots))[:n]]
    # request 0 spans 88 entries from -8 (longer than a warp's 32); request 1 is an ordinary one
    case = dict(offsets=[-8, cut, n], seeds=[-1, -1], ids=_tokens(rng, n), positions=list(range(n)), slots=slots)
    specs = [random_source(rng, num_slots, num_bytes_per_token=48, read_bytes=32)]
    results = {device: _write_over_random_words(device, num_slots, specs, kc.HashMode.ALL, case)
               for device in ("cpu", "cuda")}
    (cpu, start), (gpu, _) = results["cpu"], results["cuda"]
    assert np.array_equal(cpu[0][slots[:cut]], start[slots[:cut]])
    assert all(cpu[0][slot, 3] == expected_kv_hash(specs, kc.HashMode.ALL, slot) for slot in slots[cut:])
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


@requires_gpu
@pytest.mark.parametrize("num_sources,mode,widths,pages", [(1, kc.HashMode.PARTIAL, (16, 32, 64), (1,)),
                                                           (3, kc.HashMode.ALL, (16, 32, 64), (1,)),
                                                           (4, kc.HashMode.ALL, (16, 32, 64), (1,)),
                                                           (4, kc.HashMode.ALL, (16, 32), (1,)),
                                                           (4, kc.HashMode.ALL, (16, 32), (3, 4)),
                                                           (5, kc.HashMode.ALL, (16, 32, 64), (1,)),
                                                           (9, kc.HashMode.ALL, (16, 32), (1,)),
                                                           (10, kc.HashMode.ALL, (16, 32, 64), (1, 3, 4))])
def test_cuda_decode_write_with_sources_equals_the_cpu_backend(num_sources, mode, widths, pages, monkeypatch):
    """kvc_write_decode with real-KV sources, a group of lanes a request each folding a share of the
    sources (more sources than lanes take several rounds; reads of at most 32 bytes from at most as
    many sources as lanes take the short-reads form), over sources of a token a row and paged ones
    (pages a power of two and not, in the first round of sources and in later ones): slots past a
    short source's rows, a negative and an out-of-range slot, requests of two tokens and empty ones,
    seeds, position jumps and input-assert mismatches store and record what the CPU backend does.
    With more sources than lanes, the last source is shorter still: slots short only there have
    their out-of-range row from a later round alone."""
    from kvcanary_cupy.ops.backends._cuda.write import _DECODE_LANES, decode_form

    launched = _record_write_kernels(monkeypatch)

    rng = np.random.default_rng(40 + num_sources + len(widths) + len(pages))
    num_slots = 256
    later_round_short = num_sources > _DECODE_LANES
    rows = [num_slots] * num_sources
    rows[num_sources // 2] = 200
    if later_round_short:
        rows[-1] = 150
    specs = []
    for k in range(num_sources):
        width = int(rng.choice(widths))
        specs.append(random_source(rng, rows[k], num_bytes_per_token=width,
                                   read_bytes=int(rng.choice([16, width])), page_size=pages[k % len(pages)]))
    counts = [1] * 40
    counts[3], counts[17], counts[25], counts[30] = 2, 0, 0, 2  # a token a request on average
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    n = offsets[-1]
    order = rng.permutation(num_slots)
    seed_pool, slots = order[:40], order[40:40 + n].tolist()
    slots[5], slots[9] = -1, num_slots + 3
    seeds = [int(s) if i % 7 else -1 for i, s in enumerate(seed_pool)]
    ids = [int(t) for t in rng.integers(0, 50_000, size=n)]
    positions = [int(p) for p in rng.integers(1, 4096, size=n)]
    expected_ids = list(ids)
    expected_ids[2] += 1
    expected_ids[n - 1] += 1
    assert decode_form(n, len(counts), True)
    results = {}
    for device in ("cpu", "cuda"):
        ctx = _ctx(device, num_slots, ring_capacity=256, real_kv_sources=tuple(s.build(device) for s in specs),
                   hash_mode=mode)
        _write(ctx, [0, 40], [-1], list(range(40)), list(range(40)), seed_pool.tolist(), device=device)
        ctx.set_chain_position_assert(True)
        _write(ctx, offsets, seeds, ids, positions, slots, device=device, expected=(expected_ids, positions))
        results[device] = _end_state(ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    reads = [16 if mode == kc.HashMode.PARTIAL else spec.read_bytes for spec in specs]
    short = num_sources <= _DECODE_LANES and max(reads) <= 32
    assert launched[-1].startswith("kvc_write_decode<")
    assert launched[-1].endswith(", true, true>" if short else ", true, false>")
    assert cpu[1]["violations"] > 0 and any(row[7] & int(BIT.OUT_OF_RANGE) for row in cpu[2])
    if later_round_short:
        assert any(row[7] & int(BIT.OUT_OF_RANGE) and 150 <= row[1] < 200 for row in cpu[2])
    assert np.array_equal(cpu[0], gpu[0])
    assert cpu[1:] == gpu[1:]


@requires_gpu
def test_context_from_own_arrays_built_while_the_current_stream_is_busy_hashes_on_another_stream():
    """A CanaryContext built from the caller's arrays while the current stream is busy (its source
    table's upload queued behind a spin there), then written at once on a non-blocking stream, hashes
    with its real table: the upload is waited for when the context is built."""
    import cupy

    from kvcanary_cupy import _layout as L

    spin = spin_kernel()
    rng = np.random.default_rng(9)
    num_slots, n = 64, 24
    spec = random_source(rng, num_slots, num_bytes_per_token=32)
    slots = [int(s) for s in rng.permutation(np.arange(1, num_slots))[:n]]
    batch = dict(offsets=[0, n], seeds=[-1], ids=list(range(100, 100 + n)), pos=list(range(n)), loc=slots)

    expected = _ctx("cpu", num_slots, real_kv_sources=(spec.build("cpu"),), hash_mode=kc.HashMode.ALL)
    _write(expected, batch["offsets"], batch["seeds"], batch["ids"], batch["pos"], batch["loc"], device="cpu")

    def own_arrays():
        return dict(canary_buf=cupy.zeros((num_slots, L.MIN_SLOT_STRIDE_BYTES), cupy.uint8),
                    violation_ring=cupy.zeros((16, L.RING_COLUMNS), cupy.int64),
                    violation_write_index=cupy.zeros((1,), cupy.int32),
                    slot_run_counter=cupy.zeros((1,), cupy.int64), kernel_run_counter=cupy.zeros((1,), cupy.int64),
                    chain_position_assert=cupy.zeros((1,), cupy.int32))

    source = spec.build("cuda")
    plan = kc.WritePlan.from_host(offsets=batch["offsets"], seed_slot_indices=batch["seeds"], num_valid_reqs=1,
                                  device="cuda")
    inputs = {name: cupy.asarray(np.array(batch[key], dtype=np.int64))
              for name, key in (("input_ids", "ids"), ("positions", "pos"), ("out_cache_loc", "loc"))}
    warm = kc.CanaryContext(**own_arrays(), real_kv_sources=(source,), hash_mode=kc.HashMode.ALL)
    kc.write(warm, plan, tag=TAG, **inputs)  # compiles and loads the write's kernels
    arrays = own_arrays()
    spin((1,), (1,), (cupy.uint64(0),))
    cupy.cuda.Device().synchronize()

    spin((1,), (1,), (cupy.uint64(300_000_000),))  # 0.3 s on the current stream
    ctx = kc.CanaryContext(**arrays, real_kv_sources=(source,), hash_mode=kc.HashMode.ALL)
    stream = cupy.cuda.Stream(non_blocking=True)
    kc.write(ctx, plan, tag=TAG, stream=stream, **inputs)
    cupy.cuda.Device().synchronize()
    assert np.array_equal(slot_words(ctx.canary_buf), slot_words(expected.canary_buf))


# --- requests without entries, an empty ring, short sources with asserts, wrapped positions -----------

@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("seed", [8, 1000, UNRESOLVED])
def test_request_without_entries_does_not_read_its_seed(device, seed):
    """README, "Choices where the specification is silent": a request with no entries
    (``offsets[r] >= offsets[r+1]``, empty or reversed) is skipped whole, so its out-of-range seed
    records nothing; a request with entries and the same seed records SPEC §4's row
    ``(kind, seed, 0, 0, 0, 0, 0, 64)`` once, then chains from the anchor with no position assert."""
    rng = np.random.default_rng(60 + seed % 97)
    ids, pos = _tokens(rng, 3), [int(p) for p in rng.integers(1, 10**6, size=3)]
    ctx = _ctx(device, 8, chain_position_assert=True)
    # request 0: [0, 0) empty; request 1: [0, 3); request 2: [3, 1) reversed; request 3: [1, 1) empty
    _write(ctx, [0, 0, 3, 1, 1], [seed] * 4, ids, pos, [5, 2, 7], device=device)
    assert ring_rows(ctx) == [(TAG, seed, 0, 0, 0, 0, 0, 64)]
    chain = ref.ANCHOR_LINK
    for token, position, slot in zip(ids, pos, [5, 2, 7]):
        assert fields(ctx.canary_buf, slot) == (token, position, signed(chain), 0)
        chain = ref.mix3(chain, token, position)
    assert ctx.counters() == {"slot_run_counter": 3, "kernel_run_counter": 1, "violations": 1}
    # Only requests without entries: nothing is recorded at all.
    ctx.clear_violations()
    _write(ctx, [2, 2, 0], [seed] * 2, ids, pos, [5, 2, 7], device=device)
    assert ctx.violations().total == 0
    assert ctx.counters()["slot_run_counter"] == 3


@pytest.mark.parametrize("device", BACKENDS)
def test_ring_capacity_zero_counts_every_write_violation_and_stores_none(device):
    """SPEC §2, fill-once with ``ring_capacity = 0`` (README: allowed): every violation of a write
    (an out-of-range seed, input-assert mismatches, an out-of-range slot, entries past the batch)
    advances ``write_index`` and stores no row, nothing is written outside the context's arrays,
    and the entries are stored exactly as with a ring that has room."""
    rng = np.random.default_rng(61)
    num_slots = 10
    ctx, backings, before = guarded_context(device, rng, num_slots)
    assert ctx.ring_capacity == 0
    ids, pos = _tokens(rng, 4), [int(p) for p in rng.integers(0, 1000, size=4)]
    expected = ([ids[0] + 1, ids[1], ids[2], ids[3] + 2], [pos[0], pos[1] + 1, pos[2], pos[3]])
    # request 0: seed 50 (out of range), entries 0..1; request 1: [2, 2), no entries (its seed is
    # not read); request 2: [2, 9), entries 2..3 with slot 40 (out of range) at entry 2, and past
    # the 4 entries. No slot is written by two requests (on a GPU which one's record a slot keeps
    # would be unspecified).
    _write(ctx, [0, 2, 2, 9], [50, 50, -1], ids, pos, [3, 6, 40, 8], device=device, expected=expected)
    # rows: the seed, entry 0's token, entry 1's position (request 0); entry 2's slot, entry 3's
    # token and the entry past the batch (request 2).
    report = ctx.violations()
    assert (report.total, report.dropped, len(report)) == (6, 6, 0)
    assert ctx.counters() == {"slot_run_counter": 3, "kernel_run_counter": 1, "violations": 6}
    chain = ref.mix3(ref.ANCHOR_LINK, ids[0], pos[0])
    assert fields(ctx.canary_buf, 3) == (ids[0], pos[0], signed(ref.ANCHOR_LINK), 0)
    assert fields(ctx.canary_buf, 6) == (ids[1], pos[1], signed(chain), 0)
    # request 2 wrote slot 8 from the anchor (its entry 2 was skipped)
    assert fields(ctx.canary_buf, 8) == (ids[3], pos[3], signed(ref.ANCHOR_LINK), 0)
    assert to_numpy(backings["violation_write_index"])[1] == 6  # the caller's own int32 cell
    assert_only_views_changed(backings, before)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("mode", [kc.HashMode.PARTIAL, kc.HashMode.ALL])
def test_short_source_with_both_asserts_records_its_rows_in_order(device, mode):
    """SPEC §4 with §3.1 step 3: a slot past the source's rows records ``(kind, slot, pos, tok, tok,
    running, pos, 64)`` beside the input assert's row (8/16) and the chain position assert's (16);
    one entry records them in that order (README, "Choices where the specification is silent"):
    the source's row, the input assert's, the chain position assert's. The slot is stored with the
    source folded as 0, and the chain and the asserted position go on from the actual values."""
    rng = np.random.default_rng(62)
    spec = random_source(rng, 6, page_size=2, num_bytes_per_token=32)  # rows for slots 0..5
    ctx = _ctx(device, 12, real_kv_sources=(spec.build(device),), hash_mode=mode, chain_position_assert=True)
    ids = _tokens(rng, 5)
    p = int(rng.integers(10, 10**6))
    _write(ctx, [0, 1], [-1], ids[:1], [p], [3], device=device)  # the seed: slot 3 at position p
    ctx.clear_violations()
    slots = [9, 4, 10, 11]
    pos = [p + 1, p + 2, p + 7, p + 8]
    expected_ids = [ids[1] + 5, ids[2], ids[3] - 3, ids[4]]
    expected_pos = [p + 1, p + 2, p + 5, p + 8]
    _write(ctx, [0, 4], [3], ids[1:], pos, slots, device=device, expected=(expected_ids, expected_pos))
    chain = [ref.mix3(fields(ctx.canary_buf, 3)[2], ids[0], p)]
    for k in range(3):
        chain.append(ref.mix3(chain[-1], ids[1 + k], pos[k]))
    c = [signed(v) for v in chain]
    want = [(TAG, 9, p + 1, ids[1], ids[1], c[0], p + 1, 64),
            (TAG, 9, p + 1, ids[1], ids[1] + 5, c[0], p + 1, int(BIT.WRITE_TOKEN)),
            (TAG, 10, p + 7, ids[3], ids[3], c[2], p + 7, 64),
            (TAG, 10, p + 7, ids[3], ids[3] - 3, c[2], p + 5, int(BIT.WRITE_TOKEN | BIT.WRITE_POSITION)),
            (TAG, 10, p + 7, ids[3], ids[3], c[2], p + 3, int(BIT.WRITE_POSITION)),
            (TAG, 11, p + 8, ids[4], ids[4], c[3], p + 8, 64)]
    rows = ring_rows(ctx)
    assert_rows(device, rows, want)
    for slot in slots:  # one entry's rows in order, on every backend
        assert [r for r in rows if r[1] == slot] == [r for r in want if r[1] == slot]
    for k, slot in enumerate(slots):
        assert fields(ctx.canary_buf, slot) == (ids[1 + k], pos[k], c[k], expected_kv_hash([spec], mode, slot))
    assert fields(ctx.canary_buf, 10)[3] == signed(ref.sm(0))
    assert ctx.counters()["slot_run_counter"] == 1 + 4


@pytest.mark.parametrize("device", BACKENDS)
def test_chain_position_assert_after_the_int64_maximum_wraps(device):
    """SPEC §2 (arithmetic wraps modulo 2^64, stored as int64) and §3.1 step 3: after a predecessor
    at position 2^63 - 1, ``prev_pos + 1`` is -2^63. An entry at -2^63 passes (and the next at
    -2^63 + 1), any other records the chain position row with aux -2^63, the int64 maximum
    itself included."""
    rng = np.random.default_rng(63)
    ids = _tokens(rng, 5)
    low = -(1 << 63)
    other = int(rng.integers(0, 10**9))
    ctx = _ctx(device, 8, chain_position_assert=True)
    _write(ctx, [0, 1], [-1], ids[:1], [L_INT64_MAX], [2], device=device)  # the seed: slot 2
    assert fields(ctx.canary_buf, 2)[:2] == (ids[0], L_INT64_MAX)
    seed_link = ref.mix3(ref.ANCHOR_LINK, ids[0], L_INT64_MAX)
    # request 0 continues from slot 2 at -2^63 and -2^63 + 1; request 1 at a random position;
    # request 2 at the maximum again
    _write(ctx, [0, 2, 3, 4], [2, 2, 2], ids[1:], [low, low + 1, other, L_INT64_MAX], [3, 4, 5, 6],
           device=device)
    s = signed(seed_link)
    assert_rows(device, ring_rows(ctx), [(TAG, 5, other, ids[3], ids[3], s, low, int(BIT.WRITE_POSITION)),
                                         (TAG, 6, L_INT64_MAX, ids[4], ids[4], s, low, int(BIT.WRITE_POSITION))])
    assert fields(ctx.canary_buf, 3) == (ids[1], low, s, 0)
    assert fields(ctx.canary_buf, 4) == (ids[2], low + 1, signed(ref.mix3(seed_link, ids[1], low)), 0)
    assert fields(ctx.canary_buf, 5) == (ids[3], other, s, 0)
    assert fields(ctx.canary_buf, 6) == (ids[4], L_INT64_MAX, s, 0)
