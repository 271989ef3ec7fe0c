"""Capacities.from_args (SPEC §3.5)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc


def _caps(**kw):
    args = dict(req_to_token_pool_size=64, max_seq_len_per_req=4096, pool_slot_count=10000, max_prefill_tokens=8192)
    args.update(kw)
    return kc.Capacities.from_args(**args)


def test_basic_values():
    c = _caps()
    assert (c.max_bs, c.verify_capacity, c.write_req_capacity, c.write_entry_capacity) == (64, 30000, 64, 8192)


def test_graph_bs_and_drafts():
    c = _caps(cuda_graph_max_bs=160, speculative_num_draft_tokens=4, max_prefill_tokens=100)
    assert c.max_bs == 160 and c.write_req_capacity == 160
    assert c.write_entry_capacity == 640


@pytest.mark.parametrize("chunked,entries", [(None, 8192), (0, 8192), (-1, 8192), (2048, 2048), (100000, 8192)])
def test_chunked_prefill(chunked, entries):
    assert _caps(chunked_prefill_size=chunked, req_to_token_pool_size=8).write_entry_capacity == entries


def test_entry_capacity_at_least_max_bs():
    assert _caps(req_to_token_pool_size=500, max_prefill_tokens=16).write_entry_capacity == 500


def test_workspace_bytes():
    c = _caps()
    assert c.verify_plan_bytes == 30000 * 32 + 8
    assert c.write_plan_bytes == 64 * 16 + 8 + 4
    assert c.workspace_bytes == c.verify_plan_bytes + c.write_plan_bytes
    assert "verify_capacity=30000" in c.describe()


def test_numpy_integers_are_kept_as_ints():
    """Capacities given as NumPy integers are stored as Python ints, so the byte counts derived
    from them do not wrap (an int32 capacity times 32 bytes would)."""
    c = kc.Capacities(max_bs=np.int32(1), verify_capacity=np.int32(2**31 - 1),
                      write_req_capacity=np.int32(2**31 - 1), write_entry_capacity=np.int64(1))
    assert all(type(getattr(c, name)) is int
               for name in ("max_bs", "verify_capacity", "write_req_capacity", "write_entry_capacity"))
    assert c.verify_plan_bytes == (2**31 - 1) * 32 + 8
    assert c.write_plan_bytes == (2**31 - 1) * 16 + 8 + 4
    assert c == kc.Capacities(max_bs=1, verify_capacity=2**31 - 1, write_req_capacity=2**31 - 1, write_entry_capacity=1)


def test_plans_allocate_from_capacities():
    c = _caps(pool_slot_count=100, req_to_token_pool_size=4)
    v = kc.VerifyPlan.allocate(c.verify_capacity)
    w = kc.WritePlan.allocate(c.write_req_capacity)
    assert v.capacity == 300 and w.capacity == 4 and w.offsets.shape == (5,)


@pytest.mark.parametrize("name,value,message", [
    ("pool_slot_count", 0, "kv-canary: pool_slot_count must be positive, got 0"),
    ("req_to_token_pool_size", -3, "kv-canary: req_to_token_pool_size must be positive, got -3"),
    ("max_seq_len_per_req", 0, "kv-canary: max_seq_len_per_req must be positive, got 0"),
    ("max_prefill_tokens", 0, "kv-canary: max_prefill_tokens must be positive, got 0"),
    ("cuda_graph_max_bs", -1, "kv-canary: cuda_graph_max_bs must be non-negative, got -1"),
    ("speculative_num_draft_tokens", -1, "kv-canary: speculative_num_draft_tokens must be non-negative, got -1"),
])
def test_bad_values(name, value, message):
    with pytest.raises(ValueError) as info:
        _caps(**{name: value})
    assert str(info.value) == message


@pytest.mark.parametrize("name", ["pool_slot_count", "max_prefill_tokens", "chunked_prefill_size"])
def test_bad_types(name):
    with pytest.raises(TypeError, match=rf"^kv-canary: {name} must be an int"):
        _caps(**{name: 1.5})


@pytest.mark.parametrize("arguments,named,derived", [
    (dict(pool_slot_count=2**30), "pool_slot_count", "verify_capacity"),
    (dict(req_to_token_pool_size=2**31), "req_to_token_pool_size", "max_bs"),
    (dict(cuda_graph_max_bs=2**31), "cuda_graph_max_bs", "max_bs"),
    (dict(speculative_num_draft_tokens=2**30), "speculative_num_draft_tokens", "write_entry_capacity"),
    (dict(max_prefill_tokens=2**31, chunked_prefill_size=None), "max_prefill_tokens", "write_entry_capacity"),
    # the chunk is the smaller of the two: past int32 only through the one the engine set lower
    (dict(chunked_prefill_size=2**31, max_prefill_tokens=2**32), "chunked_prefill_size", "write_entry_capacity"),
])
def test_int32_bound_names_the_argument(arguments, named, derived):
    """A derived capacity past int32 is reported against the argument the user passed."""
    with pytest.raises(ValueError, match=rf"^kv-canary: {named} must be <= \d+, as {derived} = .* must fit in int32, "
                                         rf"got {list(arguments.values())[0]}"):
        _caps(**arguments)
    # The derived values themselves are bounded too, when given directly.
    with pytest.raises(ValueError, match=r"^kv-canary: max_bs must fit in int32"):
        kc.Capacities(max_bs=2**31, verify_capacity=1, write_req_capacity=1, write_entry_capacity=1)


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("arguments,derived,value", [
    (dict(pool_slot_count=INT32_MAX // 3), "verify_capacity", 3 * (INT32_MAX // 3)),
    (dict(req_to_token_pool_size=INT32_MAX), "max_bs", INT32_MAX),
    (dict(cuda_graph_max_bs=INT32_MAX), "max_bs", INT32_MAX),
    (dict(speculative_num_draft_tokens=INT32_MAX // 64), "write_entry_capacity", 64 * (INT32_MAX // 64)),
    (dict(max_prefill_tokens=INT32_MAX, chunked_prefill_size=None), "write_entry_capacity", INT32_MAX),
])
def test_int32_bound_takes_each_argument_at_its_limit(arguments, derived, value):
    """The bound is int32's maximum itself: an argument whose derived capacity lands on it exactly
    is taken, and the capacity is that maximum's share."""
    assert getattr(_caps(**arguments), derived) == value
