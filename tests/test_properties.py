"""Property-based tests: random valid engine batches never crash, and after write every chain is
intact (each slot's prev_hash is the link of the slot holding the previous position) and verify
finds nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from _builders import expected_kv_hash, fields, link_of, pipeline, random_batch, random_source, ring_rows
from _devices import BACKENDS, to_numpy

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

batches = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1),
    "bs": st.integers(1, 6),
    "max_prefix": st.integers(0, 12),
    "max_extend": st.integers(1, 8),
    "padding_requests": st.integers(0, 2),
    "spare_slots": st.integers(0, 6),
    "mode": st.sampled_from(list(kc.HashMode)),
    "page_size": st.sampled_from([1, 2, 5, 16]),
    "bytes_per_token": st.sampled_from([16, 32, 64]),
    "read_words": st.integers(1, 4),
    "pad_bytes": st.sampled_from([0, 16, 48]),
    "num_sources": st.integers(0, 3),
    "stride": st.sampled_from([32, 40, 64]),
    "chain_position_assert": st.booleans(),
})


def _build(device, p):
    rng = np.random.default_rng(p["seed"])
    batch = random_batch(rng, bs=p["bs"], max_prefix=p["max_prefix"], max_extend=p["max_extend"],
                         padding_requests=p["padding_requests"], spare_slots=p["spare_slots"])
    read = min(16 * p["read_words"], p["bytes_per_token"])
    sources = [random_source(rng, batch.num_slots, page_size=p["page_size"], num_bytes_per_token=p["bytes_per_token"],
                             read_bytes=read, pad_bytes=p["pad_bytes"]) for _ in range(p["num_sources"])]
    return pipeline(batch, device, hash_mode=p["mode"], sources=sources, slot_stride_bytes=p["stride"],
                    chain_position_assert=p["chain_position_assert"])


def _assert_chains(pipe):
    b, buf = pipe.batch, pipe.ctx.canary_buf
    for r in b.live():
        for pos in range(int(b.seq_lens[r])):
            slot = b.slot(r, pos)
            prev = b.slot(r, pos - 1) if pos else -1
            token, position, prev_hash, kv = fields(buf, slot)
            assert (token, position) == (b.token(r, pos), pos)
            assert prev_hash == link_of(buf, prev)
            assert kv == expected_kv_hash(pipe.sources, pipe.hash_mode, slot)


@pytest.mark.parametrize("device", BACKENDS)
@SETTINGS
@given(p=batches)
def test_write_keeps_chain_invariant(device, p):
    pipe = _build(device, p)
    pipe.fill()
    _assert_chains(pipe)
    pipe.verify_all(check_expected_token=True, expected=True)
    assert ring_rows(pipe.ctx) == []
    counters = pipe.ctx.counters()
    written = int(pipe.batch.seq_lens[pipe.batch.live()].sum())
    assert counters["slot_run_counter"] == written + int(to_numpy(pipe.vplan.num_valid)[0])
    assert counters["kernel_run_counter"] == 3


@pytest.mark.parametrize("device", BACKENDS)
@SETTINGS
@given(p=batches, split=st.integers(1, 4))
def test_chunked_writes_keep_chain_invariant(device, p, split):
    """Writing each sequence in several chunks (chunked prefill / decode) gives the same chains."""
    pipe = _build(device, p)
    b = pipe.batch
    done = np.zeros(b.bs, np.int64)
    total = b.seq_lens
    while (done < total).any():
        step = np.minimum(np.maximum((total + split - 1) // split, 1), total - done)
        pipe.plan(done, step)
        kc.verify(pipe.ctx, pipe.vplan, tag=kc.LaunchTag.HEAD_K_FULL)
        pipe.write(done, step)
        done = done + step
    _assert_chains(pipe)
    assert ring_rows(pipe.ctx) == []


@pytest.mark.parametrize("device", BACKENDS)
@SETTINGS
@given(p=batches, data=st.data())
def test_single_corruption_always_detected(device, p, data):
    """Any single token/position/prev_hash change of a written slot is reported on that slot or its successor."""
    pipe = _build(device, p)
    pipe.fill()
    b = pipe.batch
    written = [(r, pos) for r in b.live() for pos in range(int(b.seq_lens[r]))]
    if not written:
        return
    r, pos = data.draw(st.sampled_from(written))
    field = data.draw(st.sampled_from([0, 1, 2]))
    delta = data.draw(st.integers(1, 2**40))
    slot = b.slot(r, pos)
    pipe.ctx.canary_buf.view(np.int64)[slot, field] += delta
    pipe.verify_all(check_expected_token=True, expected=True)  # a lone token needs the expected pool
    rows = ring_rows(pipe.ctx)
    assert slot in [row[1] for row in rows] or (
        pos + 1 < int(b.seq_lens[r]) and b.slot(r, pos + 1) in [row[1] for row in rows])
