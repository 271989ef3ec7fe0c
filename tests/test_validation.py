"""Host-side validation (SPEC §4): every rule raises ``ValueError``/``TypeError`` with a ``kv-canary: ``
message naming the argument, and a rejected op call changes nothing (every buffer is compared)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import SourceSpec, context_arrays, expected_kv_hash, fields, plan_arrays, snapshot
from _devices import BACKENDS, int64s_on, requires_gpu, to_device, to_numpy

# --- the SPEC's four messages, verbatim -----------------------------------------------------------


def test_seed_message_page_size():
    with pytest.raises(ValueError) as info:
        kc.RealKvSource(tensor=np.zeros((4, 64), np.uint8), page_size=0, num_bytes_per_token=16, read_bytes=16)
    assert str(info.value) == "kv-canary: RealKvSource.page_size must be >= 1, got 0"


def test_seed_message_tensor_ndim():
    with pytest.raises(ValueError) as info:
        kc.RealKvSource(tensor=np.zeros(64, np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16)
    assert str(info.value) == "kv-canary: RealKvSource.tensor must be at least 2-D, got shape (64,)"


def test_seed_message_verify_capacity():
    with pytest.raises(ValueError) as info:
        kc.VerifyPlan.allocate(-1)
    assert str(info.value) == "kv-canary: verify_capacity must be non-negative, got -1"


def test_seed_message_pool_slot_count():
    with pytest.raises(ValueError) as info:
        kc.Capacities.from_args(req_to_token_pool_size=8, max_seq_len_per_req=128, pool_slot_count=0,
                                max_prefill_tokens=256)
    assert str(info.value) == "kv-canary: pool_slot_count must be positive, got 0"


# --- construction rules -----------------------------------------------------------------------------

def _u8(rows, cols):
    return np.arange(rows * cols, dtype=np.uint64).astype(np.uint8).reshape(rows, cols)


def _source(**kw):
    args = dict(tensor=_u8(4, 64), page_size=1, num_bytes_per_token=32, read_bytes=32)
    args.update(kw)
    return lambda: kc.RealKvSource(**args)


def _misaligned():
    raw = np.zeros(4 * 64 + 16, np.uint8)
    start = (-raw.ctypes.data) % 16 + 8
    return raw[start:start + 4 * 48].reshape(4, 48)


def _read_only(array):
    array.flags.writeable = False
    return array


def _misaligned_int64(count):
    raw = np.zeros(8 * count + 8, np.uint8)
    start = (-raw.ctypes.data) % 8 + 4
    return raw[start:start + 8 * count].view(np.int64)


def _ctx_arrays(**kw):
    args = dict(canary_buf=np.zeros((8, 32), np.uint8), violation_ring=np.zeros((4, 8), np.int64),
                violation_write_index=np.zeros(1, np.int32), slot_run_counter=np.zeros(1, np.int64),
                kernel_run_counter=np.zeros(1, np.int64), chain_position_assert=np.zeros(1, np.int32))
    args.update(kw)
    return lambda: kc.CanaryContext(**args)



@pytest.mark.parametrize("build", ["allocate", "own arrays"])
def test_a_context_keeps_the_sources_it_was_given(build):
    """The caller's list of sources, changed after the context was built, changes neither the
    context's sources nor what a write hashes."""
    rng = np.random.default_rng(44)
    specs = [SourceSpec(rng.integers(1, 256, size=(8, 32), dtype=np.uint8), 1, 32, 32) for _ in range(2)]
    given = [specs[0].build("cpu")]
    kwargs = dict(real_kv_sources=given, hash_mode=kc.HashMode.ALL)
    ctx = kc.CanaryContext.allocate(8, **kwargs) if build == "allocate" else _ctx_arrays(**kwargs)()
    given.append(specs[1].build("cpu"))
    given[0] = given[1]
    assert isinstance(ctx.real_kv_sources, tuple) and len(ctx.real_kv_sources) == 1
    assert ctx.kv_read_lengths == (32,)
    kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=1),
             tag=kc.LaunchTag.HEAD_K_FULL, input_ids=np.array([7]), positions=np.array([0]),
             out_cache_loc=np.array([3]))
    assert fields(ctx.canary_buf, 3)[3] == expected_kv_hash(specs[:1], kc.HashMode.ALL, 3)

def _vplan_arrays(**kw):
    args = dict(slot_indices=np.zeros(4, np.int64), expected_tokens=np.zeros(4, np.int64),
                expected_positions=np.zeros(4, np.int64), prev_slot_indices=np.zeros(4, np.int64),
                num_valid=np.zeros(1, np.int32), enable=np.zeros(1, np.int32))
    args.update(kw)
    return lambda: kc.VerifyPlan(**args)


def _wplan_arrays(**kw):
    args = dict(offsets=np.zeros(5, np.int64), seed_slot_indices=np.zeros(4, np.int64),
                num_valid_reqs=np.zeros(1, np.int32))
    args.update(kw)
    return lambda: kc.WritePlan(**args)


def _misaligned_bytes(rows, cols):
    raw = _noise(rows * cols + 16, np.uint8)
    start = (-raw.ctypes.data) % 8 + 4
    return raw[start:start + rows * cols].reshape(rows, cols)


def _noise(shape, dtype):
    return np.random.default_rng(93).integers(1, 100, size=shape).astype(dtype)


# memory two arrays of one bundle would share
_CELL64, _CELL32, _VEC, _BUF = np.zeros(1, np.int64), np.zeros(1, np.int32), np.zeros(8, np.int64), np.zeros((16, 32), np.uint8)

CONSTRUCTION = [
    ("source page_size negative", _source(page_size=-2), ValueError, r"RealKvSource\.page_size must be >= 1, got -2"),
    ("source page_size float", _source(page_size=1.0), TypeError, r"RealKvSource\.page_size must be an int"),
    ("source bytes_per_token not x16", _source(num_bytes_per_token=24, read_bytes=16), ValueError,
     r"RealKvSource\.num_bytes_per_token must be a positive multiple of 16, got 24"),
    ("source bytes_per_token zero", _source(num_bytes_per_token=0, read_bytes=16), ValueError,
     r"num_bytes_per_token .*got 0"),
    ("source read_bytes too big", _source(read_bytes=48), ValueError, r"RealKvSource\.read_bytes .*got 48"),
    ("source read_bytes not x16", _source(read_bytes=8), ValueError, r"RealKvSource\.read_bytes .*got 8"),
    ("source read_bytes zero", _source(read_bytes=0), ValueError, r"RealKvSource\.read_bytes .*got 0"),
    ("source rows too short", _source(page_size=4), ValueError, r"RealKvSource\.tensor rows must hold .*128"),
    # a row short of one token by a part of its bytes, or rows overlapping by one, are as wrong as any
    ("source rows a part short", _source(tensor=_u8(4, 48), page_size=2), ValueError,
     r"RealKvSource\.tensor rows must hold page_size \* num_bytes_per_token = 64 bytes, got 48 bytes per row"),
    ("source rows overlap by a part", lambda: kc.RealKvSource(
        tensor=np.lib.stride_tricks.as_strided(_u8(1, 4096)[0], shape=(8, 64), strides=(48, 1)),
        page_size=1, num_bytes_per_token=64, read_bytes=64), ValueError,
     r"RealKvSource.tensor rows must not overlap: row stride >= page_size \* num_bytes_per_token = 64 bytes, got 48"),
    ("source row stride not x16", _source(tensor=_u8(4, 40)[:, :32]), ValueError,
     r"RealKvSource\.tensor row stride must be a multiple of 16 bytes, got 40"),
    ("source misaligned", _source(tensor=_misaligned()), ValueError, r"RealKvSource\.tensor must be 16-byte aligned"),
    ("source bytes not contiguous", _source(tensor=_u8(4, 128)[:, ::2]), ValueError,
     r"RealKvSource\.tensor must have contiguous bytes within each row"),
    ("source not an array", _source(tensor=[[1, 2]]), TypeError, r"RealKvSource\.tensor must be an array"),
    ("ctx num_slots zero", lambda: kc.CanaryContext.allocate(0), ValueError, r"num_slots must be positive, got 0"),
    ("ctx stride not x8", lambda: kc.CanaryContext.allocate(4, slot_stride_bytes=36), ValueError,
     r"slot_stride_bytes must be a multiple of 8, got 36"),
    ("ctx stride small", lambda: kc.CanaryContext.allocate(4, slot_stride_bytes=24), ValueError,
     r"slot_stride_bytes must be >= 32, got 24"),
    ("ctx ring negative", lambda: kc.CanaryContext.allocate(4, ring_capacity=-1), ValueError,
     r"ring_capacity must be non-negative, got -1"),
    ("ctx hash_mode", lambda: kc.CanaryContext.allocate(4, hash_mode=7), ValueError,
     r"hash_mode must be a HashMode \(NONE=0, PARTIAL=1, ALL=2\), got 7"),
    ("ctx hash_mode bool", lambda: kc.CanaryContext.allocate(4, hash_mode=True), TypeError,
     r"hash_mode must be a HashMode, got bool True"),
    ("ctx hash_mode name", lambda: kc.CanaryContext.allocate(4, hash_mode="PARTIAL"), TypeError,
     r"hash_mode must be a HashMode, got str 'PARTIAL'"),
    ("ctx sources None", lambda: kc.CanaryContext.allocate(4, real_kv_sources=None), TypeError,
     r"real_kv_sources must be a list or tuple of RealKvSource, got NoneType"),
    ("ctx one source bare", lambda: kc.CanaryContext.allocate(4, real_kv_sources=_source()()), TypeError,
     r"real_kv_sources must be a list or tuple of RealKvSource, got RealKvSource"),
    ("ctx sources None given arrays", _ctx_arrays(real_kv_sources=None), TypeError,
     r"real_kv_sources must be a list or tuple"),
    # sizes are checked before anything is allocated
    ("ctx num_slots past int32", lambda: kc.CanaryContext.allocate(2**45), ValueError,
     r"num_slots must be <= 2\*\*31 \(slot indices fit in int32\), got 35184372088832"),
    ("ctx ring past int32", lambda: kc.CanaryContext.allocate(4, ring_capacity=2**31), ValueError,
     r"ring_capacity must fit in int32 \(<= 2147483647\), got 2147483648"),
    ("ctx buf read-only", _ctx_arrays(canary_buf=_read_only(np.zeros((8, 32), np.uint8))), ValueError,
     r"canary_buf must be writable"),
    ("ctx ring read-only", _ctx_arrays(violation_ring=_read_only(np.zeros((4, 8), np.int64))), ValueError,
     r"violation_ring must be writable"),
    ("ctx counter read-only", _ctx_arrays(slot_run_counter=_read_only(np.zeros(1, np.int64))), ValueError,
     r"slot_run_counter must be writable"),
    ("source negative row stride", _source(tensor=_u8(8, 64)[::-1]), ValueError,
     r"RealKvSource\.tensor must have a non-negative row stride, got -64"),
    ("source object dtype", _source(tensor=np.zeros((4, 64), object)), TypeError,
     r"RealKvSource\.tensor must hold plain bytes"),
    ("wplan big-endian", _wplan_arrays(offsets=np.zeros(5, ">i8")), TypeError,
     r"WritePlan\.offsets must have dtype int64, got int64 in non-native byte order \('>i8'\)"),
    ("wplan misaligned", _wplan_arrays(offsets=_misaligned_int64(5)), ValueError,
     r"WritePlan\.offsets must be 8-byte aligned"),
    ("ctx device", lambda: kc.CanaryContext.allocate(4, device="tpu"), ValueError, r"device must be"),
    ("ctx assert flag", lambda: kc.CanaryContext.allocate(4, chain_position_assert=1), TypeError,
     r"chain_position_assert must be a bool"),
    ("ctx source type", lambda: kc.CanaryContext.allocate(4, real_kv_sources=(np.zeros((4, 16)),)), TypeError,
     r"real_kv_sources\[0\] must be a RealKvSource"),
    ("ctx buf dtype", _ctx_arrays(canary_buf=np.zeros((8, 32), np.int8)), TypeError,
     r"canary_buf must have dtype uint8, got int8"),
    ("ctx buf 1-D", _ctx_arrays(canary_buf=np.zeros(256, np.uint8)), ValueError, r"canary_buf must be 2-D"),
    ("ctx buf stride", _ctx_arrays(canary_buf=np.zeros((8, 20), np.uint8)), ValueError,
     r"canary_buf slot_stride_bytes .*got 20"),
    ("ctx buf not contiguous", _ctx_arrays(canary_buf=np.zeros((8, 64), np.uint8)[:, :32]), ValueError,
     r"canary_buf must be C-contiguous"),
    ("ctx ring columns", _ctx_arrays(violation_ring=np.zeros((4, 7), np.int64)), ValueError,
     r"violation_ring must have 8 columns"),
    # the caller's own arrays past int32 (views of a few cells: refused before any cell is read)
    ("ctx own ring past int32", _ctx_arrays(violation_ring=np.lib.stride_tricks.as_strided(
        _noise(8, np.int64), shape=(2**31, 8), strides=(64, 8))), ValueError,
     r"violation_ring capacity must fit in int32 \(<= 2147483647\), got 2147483648$"),
    ("ctx own buf past int32 slots", _ctx_arrays(canary_buf=np.lib.stride_tricks.as_strided(
        _noise(32, np.uint8), shape=(2**31 + 1, 32), strides=(32, 1))), ValueError,
     r"canary_buf num_slots must be <= 2\*\*31 \(slot indices fit in int32\), got 2147483649$"),
    ("ctx own arrays hash_mode bool", _ctx_arrays(hash_mode=True), TypeError,
     r"hash_mode must be a HashMode, got bool True$"),
    ("wplan count dtype", _wplan_arrays(num_valid_reqs=_noise(1, np.int64)), TypeError,
     r"WritePlan\.num_valid_reqs must have dtype int32, got int64$"),
    ("wplan count length", _wplan_arrays(num_valid_reqs=_noise(2, np.int32)), ValueError,
     r"WritePlan\.num_valid_reqs must have length 1 \(a single cell\), got 2$"),
    ("ctx ring of too many columns", _ctx_arrays(violation_ring=_noise((4, 9), np.int64)), ValueError,
     r"violation_ring must have 8 columns, got shape \(4, 9\)$"),
    ("ctx buf slots of 24 bytes", _ctx_arrays(canary_buf=_noise((8, 24), np.uint8)), ValueError,
     r"canary_buf slot_stride_bytes \(shape\[1\]\) must be >= 32 and a multiple of 8, got 24$"),
    ("ctx buf misaligned", _ctx_arrays(canary_buf=_misaligned_bytes(8, 32)), ValueError,
     r"canary_buf must be 8-byte aligned, got address"),
    ("ctx ring dtype", _ctx_arrays(violation_ring=np.zeros((4, 8), np.int32)), TypeError,
     r"violation_ring must have dtype int64"),
    ("ctx write index dtype", _ctx_arrays(violation_write_index=np.zeros(1, np.int64)), TypeError,
     r"violation_write_index must have dtype int32"),
    ("ctx counter length", _ctx_arrays(slot_run_counter=np.zeros(2, np.int64)), ValueError,
     r"slot_run_counter must have length 1"),
    ("ctx kernel counter dtype", _ctx_arrays(kernel_run_counter=np.zeros(1, np.float64)), TypeError,
     r"kernel_run_counter must have dtype int64"),
    ("ctx assert cell dtype", _ctx_arrays(chain_position_assert=np.zeros(1, np.int64)), TypeError,
     r"chain_position_assert must have dtype int32"),
    ("ctx not an array", _ctx_arrays(canary_buf=b"x" * 64), TypeError, r"canary_buf must be an array"),
    ("vplan field length", _vplan_arrays(expected_tokens=np.zeros(3, np.int64)), ValueError,
     r"VerifyPlan\.expected_tokens must have length 4"),
    ("vplan dtype", _vplan_arrays(prev_slot_indices=np.zeros(4, np.int32)), TypeError,
     r"VerifyPlan\.prev_slot_indices must have dtype int64"),
    ("vplan num_valid dtype", _vplan_arrays(num_valid=np.zeros(1, np.int64)), TypeError,
     r"VerifyPlan\.num_valid must have dtype int32"),
    ("vplan enable length", _vplan_arrays(enable=np.zeros(2, np.int32)), ValueError,
     r"VerifyPlan\.enable must have length 1"),
    ("vplan capacity type", lambda: kc.VerifyPlan.allocate(2.0), TypeError, r"verify_capacity must be an int"),
    ("wplan offsets length", _wplan_arrays(offsets=np.zeros(4, np.int64)), ValueError,
     r"WritePlan\.offsets must have length 5"),
    ("wplan seeds dtype", _wplan_arrays(seed_slot_indices=np.zeros(4, np.int32)), TypeError,
     r"WritePlan\.seed_slot_indices must have dtype int64"),
    ("wplan allocate negative", lambda: kc.WritePlan.allocate(-1), ValueError,
     r"write_req_capacity must be non-negative, got -1"),
    ("ctx ring misaligned", _ctx_arrays(violation_ring=np.frombuffer(bytes(8 * 33), np.uint8)[4:260].view(np.int64)
                                        .reshape(4, 8)), ValueError, r"violation_ring must be 8-byte aligned"),
    ("ctx stride past int32", lambda: kc.CanaryContext.allocate(4, slot_stride_bytes=2**63), ValueError,
     r"slot_stride_bytes must fit in int32"),
    ("wplan host float offsets", lambda: kc.WritePlan.from_host(offsets=[0.5, 1.7], seed_slot_indices=[-1],
                                                                num_valid_reqs=1), TypeError,
     r"offsets\[0\] must be an int, got float 0.5"),
    ("wplan host offsets past int64", lambda: kc.WritePlan.from_host(offsets=[0, 2**64], seed_slot_indices=[-1],
                                                                     num_valid_reqs=1), ValueError,
     r"offsets\[1\] must fit in int64"),
    ("wplan host range below int64", lambda: kc.WritePlan.from_host(offsets=range(-2**63 - 2, -2**63),
                                                                    seed_slot_indices=[-1], num_valid_reqs=1),
     ValueError, r"offsets must fit in int64 \[-9223372036854775808, 9223372036854775807\], got -9223372036854775810$"),
    ("wplan host range past int64", lambda: kc.WritePlan.from_host(offsets=range(2**63 - 1, 2**63 + 1),
                                                                   seed_slot_indices=[-1], num_valid_reqs=1),
     ValueError, r"offsets must fit in int64 \[-9223372036854775808, 9223372036854775807\], got 9223372036854775808$"),
    ("wplan host count bool", lambda: kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1],
                                                             num_valid_reqs=True), TypeError,
     r"num_valid_reqs must be an int, got bool"),
    ("wplan host count past int32", lambda: kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1],
                                                                   num_valid_reqs=2**31), ValueError,
     r"num_valid_reqs must fit in int32"),
    ("wplan host seeds float array", lambda: kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=np.zeros(1),
                                                                    num_valid_reqs=1), TypeError,
     r"seed_slot_indices must hold integers, got dtype float64"),
    ("wplan host seeds bool array", lambda: kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=np.array([True]),
                                                                   num_valid_reqs=1), TypeError,
     r"seed_slot_indices must hold integers, got dtype bool$"),
    # an unsigned value one past int64's maximum would wrap to its minimum
    ("wplan host unsigned past int64", lambda: kc.WritePlan.from_host(offsets=np.array([0, 2**63], np.uint64),
                                                                      seed_slot_indices=[-1], num_valid_reqs=1),
     ValueError, r"offsets must fit in int64, got 9223372036854775808$"),
    ("layouts v_buffers None", lambda: kc.layouts.per_layer([np.zeros((4, 2, 8))], None), TypeError,
     r"v_buffers must be a list or tuple"),
    ("layouts interleaved 0-d", lambda: kc.layouts.interleaved([np.zeros(())]), ValueError,
     r"buffers\[0\] must be at least 2-D"),
    ("layouts interleaved strided", lambda: kc.layouts.interleaved([np.zeros((4, 2, 32), np.float32)[..., ::2]]),
     ValueError, r"contiguous bytes within each row"),
    ("layouts interleaved split", lambda: kc.layouts.interleaved([np.zeros((4, 2, 16), np.uint8)], split=None),
     TypeError, r"split must be a bool"),
    ("layouts name the K buffer", lambda: kc.layouts.per_layer([np.zeros((4, 16), np.uint8), np.zeros((4, 8), np.uint8)]),
     ValueError, r"k_buffers\[1\] bytes per token must be a positive multiple of 16, got 8"),
    ("layouts name the V buffer", lambda: kc.layouts.per_layer([np.zeros((4, 32), np.uint8)],
                                                               [np.zeros((4, 40), np.uint8)[:, :32]]),
     ValueError, r"v_buffers\[0\] row stride must be a multiple of 16 bytes, got 40"),
    ("layouts name the picked layer", lambda: kc.layouts.mla([np.zeros((4, 1, 32), np.uint8)] * 2
                                                             + [np.zeros((4, 1, 32), np.uint8)[:, :, :24]], layers=[-1]),
     ValueError, r"buffers\[2\] bytes per token must be a positive multiple of 16, got 24"),
    ("layouts paged rank", lambda: kc.layouts.paged([np.zeros((4, 16), np.uint8)]), ValueError,
     r"k_buffers\[0\] must be 4-D \[pages, page_size, heads, head_dim\], got shape \(4, 16\) \(one token a row, "
     r"\[slots, heads, head_dim\], is kc.layouts.per_layer; other shapes, kc.layouts.from_buffer with page_size=\)$"),
    ("layouts paged of five dimensions", lambda: kc.layouts.paged([_noise((4, 2, 2, 8, 16), np.uint8)]), ValueError,
     r"k_buffers\[0\] must be 4-D \[pages, page_size, heads, head_dim\], got shape \(4, 2, 2, 8, 16\) "),
    ("layouts interleaved halves not x16", lambda: kc.layouts.interleaved([_noise((4, 2, 24), np.uint8)]), ValueError,
     r"buffers\[0\] rows must split into two halves \(K, V\) of a multiple of 16 bytes, got 48 bytes per row$"),
    ("layouts paged per-layer buffer", lambda: kc.layouts.paged([np.zeros((16, 2, 8), np.float16)]), ValueError,
     r"k_buffers\[0\] must be 4-D \[pages, page_size, heads, head_dim\], got shape \(16, 2, 8\) "),
    ("layouts broadcast rows", lambda: kc.layouts.per_layer([np.broadcast_to(np.ones((1, 16), np.uint8), (4, 16))]),
     ValueError, r"k_buffers\[0\] must have a row of its own for every row index, got row stride 0 \(a broadcast "
                 r"view, shape \(4, 16\)\)"),
    ("source rows overlap", lambda: kc.RealKvSource(
        tensor=np.lib.stride_tricks.as_strided(np.zeros(4096, np.uint8), shape=(8, 64), strides=(16, 1)),
        page_size=1, num_bytes_per_token=64, read_bytes=64), ValueError,
     r"RealKvSource.tensor rows must not overlap: row stride >= page_size \* num_bytes_per_token = 64 bytes, got 16"),
    ("layouts from_buffer rows overlap", lambda: kc.layouts.from_buffer(
        np.lib.stride_tricks.as_strided(_noise(256, np.uint8), shape=(4, 32), strides=(16, 1)), page_size=2),
     ValueError, r"buffer rows must not overlap: row stride >= page_size \* num_bytes_per_token = 32 bytes, got 16 "
                 r"\(shape \(4, 32\)\)$"),
    ("layouts paged page_size", lambda: kc.layouts.paged([np.zeros((4, 2, 8, 16), np.uint8)], page_size=8),
     ValueError, r"page_size must be the tokens a page of k_buffers\[0\] holds, shape\[1\] of \[pages, page_size, "
                 r"heads, head_dim\]: got 8 for shape \(4, 2, 8, 16\) \(head_major=True takes"),
    ("layouts paged head_major page_size", lambda: kc.layouts.paged([np.zeros((4, 2, 8, 16), np.uint8)], page_size=2,
                                                                    head_major=True),
     ValueError, r"shape\[2\] of \[pages, heads, page_size, head_dim\]: got 2 for shape \(4, 2, 8, 16\) "
                 r"\(head_major=False takes \[pages, page_size, heads, head_dim\]\)$"),
    ("layouts paged page_size checked first", lambda: kc.layouts.paged([], page_size=0), ValueError,
     r"page_size must be"),
    ("layouts mla page_size checked first", lambda: kc.layouts.mla([], page_size=0), ValueError,
     r"page_size must be"),
    ("layouts paged pages of no token", lambda: kc.layouts.paged([np.zeros((4, 0, 2, 16), np.uint8)]), ValueError,
     r"k_buffers\[0\] must hold at least one token a page, shape\[1\] of \[pages, page_size, heads, head_dim\], "
     r"got shape \(4, 0, 2, 16\)$"),
    ("layouts paged head_major pages of no token",
     lambda: kc.layouts.paged([np.zeros((4, 2, 0, 16), np.uint8)], head_major=True), ValueError,
     r"k_buffers\[0\] must hold at least one token a page, shape\[2\] of \[pages, heads, page_size, head_dim\]"),
    ("layouts mla pages of no token", lambda: kc.layouts.mla([np.zeros((4, 0, 1, 32), np.uint8)]), ValueError,
     r"buffers\[0\] must hold at least one token a page, shape\[1\] of \[pages, page_size, 1, latent\], "
     r"got shape \(4, 0, 1, 32\)$"),
    ("layouts paged head_major bool", lambda: kc.layouts.paged([np.zeros((4, 2, 8, 16), np.uint8)], head_major=1),
     TypeError, r"head_major must be a bool"),
    ("layouts mla paged latent", lambda: kc.layouts.mla([np.zeros((4, 8, 32), np.uint8)]), ValueError,
     r"buffers\[0\] must be \[slots, 1, latent\] .*\(a paged \[pages, page_size, latent\] is "
     r"kc.layouts.from_buffer with page_size=\)$"),
    ("layouts read_bytes", lambda: kc.layouts.per_layer([np.zeros((4, 16), np.uint8)], read_bytes=8), ValueError,
     r"read_bytes must be a positive multiple of 16 in \(0, num_bytes_per_token=16\], got 8"),
    ("ctx counters share a cell", _ctx_arrays(slot_run_counter=_CELL64, kernel_run_counter=_CELL64), ValueError,
     r"slot_run_counter and kernel_run_counter must not share memory \(each is stored into on its own\), got bytes "),
    ("ctx ring over the canary buffer", _ctx_arrays(canary_buf=_BUF[:12], violation_ring=_BUF[8:].view(np.int64).reshape(4, 8)),
     ValueError, r"canary_buf and violation_ring must not share memory"),
    ("ctx write index is the assert flag", _ctx_arrays(violation_write_index=_CELL32, chain_position_assert=_CELL32),
     ValueError, r"violation_write_index and chain_position_assert must not share memory"),
    ("ctx source over the canary buffer", _ctx_arrays(canary_buf=_BUF[:8], real_kv_sources=(kc.RealKvSource(
        tensor=_BUF[:8], page_size=1, num_bytes_per_token=32, read_bytes=32),), hash_mode=kc.HashMode.ALL),
     ValueError, r"canary_buf and real_kv_sources\[0\]\.tensor must not share memory \(canary_buf is stored into\)"),
    ("ctx source over the ring", _ctx_arrays(violation_ring=_BUF[8:].view(np.int64).reshape(4, 8),
                                             real_kv_sources=(kc.RealKvSource(tensor=_BUF[10:], page_size=1,
                                                                              num_bytes_per_token=16, read_bytes=16),)),
     ValueError, r"violation_ring and real_kv_sources\[0\]\.tensor must not share memory"),
    ("vplan num_valid is enable", _vplan_arrays(num_valid=_CELL32, enable=_CELL32), ValueError,
     r"VerifyPlan\.num_valid and VerifyPlan\.enable must not share memory"),
    ("vplan fields overlap", _vplan_arrays(expected_tokens=_VEC[0:4], expected_positions=_VEC[3:7]), ValueError,
     r"VerifyPlan\.expected_tokens and VerifyPlan\.expected_positions must not share memory"),
    ("wplan offsets over seeds", _wplan_arrays(offsets=_VEC[0:5], seed_slot_indices=_VEC[4:8]), ValueError,
     r"WritePlan\.offsets and WritePlan\.seed_slot_indices must not share memory"),
    ("session logger", lambda: kc.Canary(pool_slot_count=16, req_to_token=np.zeros((4, 8), np.int32), logger="x",
                                         capacities=kc.Capacities.from_args(
                                             req_to_token_pool_size=4, max_seq_len_per_req=8, pool_slot_count=16,
                                             max_prefill_tokens=8)), TypeError, r"logger must be None or a"),
]


@pytest.mark.parametrize("name,make,exc,pattern", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_construction_rules(name, make, exc, pattern):
    with pytest.raises(exc) as info:
        make()
    assert type(info.value) is exc
    assert str(info.value).startswith("kv-canary: ")
    assert len(re.findall(pattern, str(info.value))) == 1, str(info.value)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("descending", [False, True])
def test_bundle_arrays_may_be_adjacent_slices_of_one_buffer(device, descending):
    """Arrays of one context or plan must not share memory, but slices of one buffer that only
    touch are apart, whichever of two comes first in memory, and the ops store into each of them."""
    first, second = (slice(1, 2), slice(0, 1)) if descending else (slice(0, 1), slice(1, 2))
    cells = to_device(np.zeros(4, np.int64), device)
    ints = to_device(np.array([0, 0, 1], np.int32), device)
    ctx = kc.CanaryContext(canary_buf=to_device(np.zeros((8, 32), np.uint8), device),
                           violation_ring=to_device(np.zeros((4, 8), np.int64), device),
                           violation_write_index=ints[first], slot_run_counter=cells[first],
                           kernel_run_counter=cells[second], chain_position_assert=ints[second])
    words = [-1, 0, 1, 99] if descending else [0, 1, -1, 99]
    plan_words = to_device(np.array(words), device)
    offsets, seeds = (plan_words[1:3], plan_words[0:1]) if descending else (plan_words[0:2], plan_words[2:3])
    wplan = kc.WritePlan(offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=ints[2:3])
    i64 = int64s_on(device)
    kc.write(ctx, wplan, tag=0, input_ids=i64([7]), positions=i64([0]), out_cache_loc=i64([3]))
    assert to_numpy(cells).tolist() == [1, 1, 0, 0] and to_numpy(ints).tolist() == [0, 0, 1]
    assert to_numpy(plan_words).tolist() == words


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "uint16"])
def test_a_dtype_numpy_lacks_is_named_as_the_callers(dtype, device):
    """A torch tensor of a dtype NumPy or CuPy cannot hold, passed where integers are wanted, is
    refused naming its own dtype (it is viewed as raw bytes underneath)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    tensor = torch.zeros(4, 8, dtype=getattr(torch, dtype), device=device)
    caps = kc.Capacities.from_args(req_to_token_pool_size=4, max_seq_len_per_req=8, pool_slot_count=64,
                                   max_prefill_tokens=8)
    with pytest.raises(TypeError, match=rf"^kv-canary: req_to_token must have dtype int32, got {dtype}$"):
        kc.Canary(pool_slot_count=64, capacities=caps, req_to_token=tensor, device=device)
    with pytest.raises(TypeError, match=rf"^kv-canary: canary_buf must have dtype uint8, got {dtype}$"):
        arrays = kc.CanaryContext.allocate(16, device=device)
        kc.CanaryContext(canary_buf=torch.zeros(16, 32, dtype=getattr(torch, dtype), device=device),
                         **{name: getattr(arrays, name) for name in ("violation_ring", "violation_write_index",
                                                                      "slot_run_counter", "kernel_run_counter",
                                                                      "chain_position_assert")})
    # its own shape where NumPy or CuPy views the dtype (CuPy 14 has bfloat16), else its bytes'
    with pytest.raises(ValueError, match=rf"^kv-canary: k_buffers\[0\] must be 4-D \[pages, page_size, heads, head_dim\], "
                                         rf"got shape (?:\(4, 8\)|\(4, \d+\) in bytes of a {dtype} array of shape \(4, 8\)) \(one "):
        kc.layouts.paged([tensor])
    cells = [to_device(np.zeros(8, np.int64), device) for _ in range(3)]
    with pytest.raises(TypeError, match=rf"^kv-canary: VerifyPlan.slot_indices must have dtype int64, got {dtype}$"):
        kc.VerifyPlan(slot_indices=tensor[0], expected_tokens=cells[0], expected_positions=cells[1],
                      prev_slot_indices=cells[2], num_valid=to_device(np.zeros(1, np.int32), device),
                      enable=to_device(np.ones(1, np.int32), device))


# --- op rules, each leaving every buffer as it was ----------------------------------------------

class World:
    """A context (with a source), both plans and one batch's inputs, all filled with noise."""

    def __init__(self, device):
        rng = np.random.default_rng(0)
        self.device = device
        put = lambda a: to_device(np.ascontiguousarray(a), device)  # noqa: E731
        self.put = put
        self.spec = SourceSpec(rng.integers(1, 256, size=(8, 32), dtype=np.uint8), 1, 32, 32)
        self.ctx = kc.CanaryContext(
            canary_buf=put(rng.integers(0, 256, size=(8, 32), dtype=np.uint8)),
            violation_ring=put(rng.integers(-9, 9, size=(4, 8))), violation_write_index=put(np.array([2], np.int32)),
            slot_run_counter=put(np.array([5])), kernel_run_counter=put(np.array([6])),
            chain_position_assert=put(np.array([1], np.int32)), real_kv_sources=(self.spec.build(device),),
            hash_mode=kc.HashMode.ALL)
        i64 = lambda *shape: put(rng.integers(-3, 9, size=shape).astype(np.int64))  # noqa: E731
        self.vplan = kc.VerifyPlan(slot_indices=i64(6), expected_tokens=i64(6), expected_positions=i64(6),
                                   prev_slot_indices=i64(6), num_valid=put(np.array([6], np.int32)),
                                   enable=put(np.array([1], np.int32)))
        self.wplan = kc.WritePlan(offsets=put(np.array([0, 1, 3])), seed_slot_indices=put(np.array([-1, 2])),
                                  num_valid_reqs=put(np.array([2], np.int32)))
        self.ids, self.pos, self.loc = put(np.array([1, 2, 3])), put(np.array([0, 1, 2])), put(np.array([3, 4, 5]))
        self.rpi, self.prefix, self.extend = put(np.array([1, 2])), put(np.array([1, 2])), put(np.array([1, 1]))
        self.table = put(rng.integers(1, 8, size=(3, 6)).astype(np.int32))
        self.pool = put(np.zeros((3, 6), np.int32))
        self.flat = put(np.arange(4))
        self.lut = put(np.arange(8))

    def buffers(self):
        c, v, w = self.ctx, self.vplan, self.wplan
        return [c.canary_buf, c.violation_ring, c.violation_write_index, c.slot_run_counter, c.kernel_run_counter,
                c.chain_position_assert, c.real_kv_sources[0].tensor, v.slot_indices, v.expected_tokens,
                v.expected_positions, v.prev_slot_indices, v.num_valid, v.enable, w.offsets, w.seed_slot_indices,
                w.num_valid_reqs, self.ids, self.pos, self.loc, self.rpi, self.prefix, self.extend, self.table,
                self.pool, self.flat, self.lut]

    def write(self, **kw):
        args = dict(tag=0, input_ids=self.ids, positions=self.pos, out_cache_loc=self.loc)
        args.update(kw)
        ctx = args.pop("ctx", self.ctx)
        wplan = args.pop("wplan", self.wplan)
        kc.write(ctx, wplan, **args)

    def verify(self, **kw):
        args = dict(tag=0)
        args.update(kw)
        ctx = args.pop("ctx", self.ctx)
        vplan = args.pop("vplan", self.vplan)
        kc.verify(ctx, vplan, **args)

    def plan(self, **kw):
        args = dict(req_pool_indices=self.rpi, prefix_lens=self.prefix, extend_seq_lens=self.extend,
                    req_to_token=self.table)
        args.update(kw)
        vplan = args.pop("vplan", self.vplan)
        wplan = args.pop("wplan", self.wplan)
        kc.plan(vplan, wplan, **args)

    def step(self, **kw):
        self.build_step(**kw).launch()

    def build_step(self, **kw):
        args = dict(verify_capacity=6, verify_tag=0, write_tag=2, req_pool_indices=self.rpi, prefix_lens=self.prefix,
                    extend_seq_lens=self.extend, req_to_token=self.table, input_ids=self.ids[:2],
                    positions=self.pos[:2], out_cache_loc=self.loc[:2])
        args.update(kw)
        return kc.CanaryStep(args.pop("ctx", self.ctx), **args)

    def copy(self, **kw):
        args = dict(src=self.ctx, dst=self.ctx, src_slots=self.put(np.array([1])), dst_slots=self.put(np.array([2])))
        args.update(kw)
        kc.copy_records(**args)

    def scatter(self, **kw):
        args = dict(flat_in=self.flat, offsets=self.put(np.array([0, 2, 4])), req_pool_indices=self.rpi,
                    pool_out=self.pool)
        args.update(kw)
        kc.scatter_req_token_ids(**args)


def _d(w, array):
    return w.put(np.asarray(array))


OPS = [
    ("write ids dtype", lambda w: w.write(input_ids=_d(w, np.array([1, 2, 3], np.int32))), TypeError,
     r"input_ids must have dtype int64, got int32"),
    ("write positions length", lambda w: w.write(positions=_d(w, np.array([0, 1]))), ValueError,
     r"positions must have length 3"),
    ("write loc 2-D", lambda w: w.write(out_cache_loc=_d(w, np.zeros((3, 1), np.int64))), ValueError,
     r"out_cache_loc must be 1-D"),
    ("write ids strided", lambda w: w.write(input_ids=w.put(np.arange(6))[::2]), ValueError,
     r"input_ids must be C-contiguous"),
    ("write expected half", lambda w: w.write(expected_input_tokens=w.ids), ValueError,
     r"expected_input_tokens requires expected_input_positions"),
    ("write expected half 2", lambda w: w.write(expected_input_positions=w.pos), ValueError,
     r"expected_input_positions requires expected_input_tokens"),
    ("write expected length", lambda w: w.write(expected_input_tokens=_d(w, np.arange(2)),
                                                expected_input_positions=_d(w, np.arange(2))), ValueError,
     r"expected_input_tokens must have length 3"),
    ("write expected positions length", lambda w: w.write(expected_input_tokens=w.ids,
                                                          expected_input_positions=_d(w, np.arange(2))), ValueError,
     r"expected_input_positions must have length 3"),
    ("write tag range", lambda w: w.write(tag=12), ValueError, r"tag must be a LaunchTag \(.*\), got 12"),
    ("write tag type", lambda w: w.write(tag="HEAD"), TypeError, r"tag must be a LaunchTag"),
    ("write tag bool", lambda w: w.write(tag=True), TypeError, r"tag must be a LaunchTag"),
    ("write tag of another enum", lambda w: w.write(tag=kc.HashMode.ALL), TypeError,
     r"tag must be a LaunchTag, got HashMode <HashMode.ALL: 2>"),
    ("write ctx type", lambda w: w.write(ctx=object()), TypeError, r"ctx must be a CanaryContext"),
    ("write wplan type", lambda w: w.write(wplan=w.vplan), TypeError, r"wplan must be a WritePlan"),
    ("write ids list", lambda w: w.write(input_ids=[1, 2, 3]), TypeError, r"input_ids must be an array"),
    ("verify tag negative", lambda w: w.verify(tag=-1), ValueError, r"tag must be a LaunchTag \(.*\), got -1"),
    ("verify check flag", lambda w: w.verify(check_expected_token=1), TypeError,
     r"check_expected_token must be a bool"),
    ("verify vplan type", lambda w: w.verify(vplan=w.wplan), TypeError, r"vplan must be a VerifyPlan"),
    ("verify ctx type", lambda w: w.verify(ctx=None), TypeError, r"ctx must be a CanaryContext"),
    ("plan swa without lut", lambda w: w.plan(swa_window_size=4), ValueError,
     r"full_to_swa_index_mapping is required when swa_window_size > 0"),
    ("plan swa of one without lut", lambda w: w.plan(swa_window_size=1), ValueError,
     r"full_to_swa_index_mapping is required when swa_window_size > 0, got None with swa_window_size=1$"),
    ("plan lut without swa", lambda w: w.plan(full_to_swa_index_mapping=w.lut), ValueError,
     r"full_to_swa_index_mapping is only used with swa_window_size > 0"),
    ("plan swa negative", lambda w: w.plan(swa_window_size=-1), ValueError,
     r"swa_window_size must be non-negative, got -1"),
    ("plan lut dtype", lambda w: w.plan(swa_window_size=2, full_to_swa_index_mapping=_d(w, np.arange(8, dtype=np.int32))),
     TypeError, r"full_to_swa_index_mapping must have dtype int64"),
    ("plan expected without lens", lambda w: w.plan(req_to_verify_expected_tokens=w.table), ValueError,
     r"req_to_verify_expected_tokens requires req_to_verify_expected_tokens_valid_lens"),
    ("plan lens without expected", lambda w: w.plan(req_to_verify_expected_tokens_valid_lens=w.prefix), ValueError,
     r"req_to_verify_expected_tokens_valid_lens requires req_to_verify_expected_tokens"),
    ("plan expected dtype", lambda w: w.plan(req_to_verify_expected_tokens=_d(w, np.zeros((3, 6), np.int64)),
                                             req_to_verify_expected_tokens_valid_lens=w.prefix), TypeError,
     r"req_to_verify_expected_tokens must have dtype int32"),
    ("plan valid lens length", lambda w: w.plan(req_to_verify_expected_tokens=w.table,
                                                req_to_verify_expected_tokens_valid_lens=_d(w, np.arange(3))),
     ValueError, r"req_to_verify_expected_tokens_valid_lens must have length 2"),
    ("plan offset type", lambda w: w.plan(kv_token_id_vs_position_offset=1.0), TypeError,
     r"kv_token_id_vs_position_offset must be an int"),
    ("plan offset past int64", lambda w: w.plan(kv_token_id_vs_position_offset=2**64), ValueError,
     r"kv_token_id_vs_position_offset must fit in int64 \[.*\], got 18446744073709551616"),
    ("plan offset below int64", lambda w: w.plan(kv_token_id_vs_position_offset=-2**63 - 1), ValueError,
     r"kv_token_id_vs_position_offset must fit in int64"),
    ("plan swa past int64", lambda w: w.plan(swa_window_size=2**64, full_to_swa_index_mapping=w.lut), ValueError,
     r"swa_window_size must fit in int64"),
    ("plan table dtype", lambda w: w.plan(req_to_token=_d(w, np.zeros((3, 6), np.int64))), TypeError,
     r"req_to_token must have dtype int32"),
    ("plan table 1-D", lambda w: w.plan(req_to_token=_d(w, np.zeros(6, np.int32))), ValueError,
     r"req_to_token must be 2-D"),
    ("plan table column stride", lambda w: w.plan(req_to_token=w.put(np.zeros((3, 12), np.int32))[:, ::2]),
     ValueError, r"req_to_token must have a contiguous last dimension, got strides \(48, 8\) in bytes$"),
    # the rules hold for the smallest tables too: two rows laid out backwards, two columns apart
    ("plan table rows reversed", lambda w: w.plan(req_to_token=w.table[:2][::-1]), ValueError,
     r"req_to_token must have a non-negative row stride, got -24$"),
    ("plan table of two strided columns", lambda w: w.plan(req_to_token=w.table[:, :4:2]), ValueError,
     r"req_to_token must have a contiguous last dimension, got strides \(24, 8\) in bytes$"),
    ("write ids None", lambda w: w.write(input_ids=None), TypeError, r"input_ids must be an array, got None$"),
    ("plan rows dtype", lambda w: w.plan(req_pool_indices=_d(w, np.array([1, 2], np.int32))), TypeError,
     r"req_pool_indices must have dtype int64, got int32"),
    ("plan rows 2-D", lambda w: w.plan(req_pool_indices=_d(w, np.array([[1], [2]]))), ValueError,
     r"req_pool_indices must be 1-D"),
    ("plan prefix length", lambda w: w.plan(prefix_lens=_d(w, np.arange(3))), ValueError,
     r"prefix_lens must have length 2"),
    ("plan extend dtype", lambda w: w.plan(extend_seq_lens=_d(w, np.arange(2, dtype=np.int32))), TypeError,
     r"extend_seq_lens must have dtype int64"),
    ("plan bs above capacity", lambda w: w.plan(req_pool_indices=_d(w, np.arange(3)), prefix_lens=_d(w, np.ones(3, np.int64)),
                                                extend_seq_lens=_d(w, np.ones(3, np.int64))), ValueError,
     r"batch size must be <= the write plan's capacity 2, got 3"),
    ("plan vplan type", lambda w: w.plan(vplan=w.wplan), TypeError, r"vplan must be a VerifyPlan"),
    ("plan wplan type", lambda w: w.plan(wplan=w.vplan), TypeError, r"wplan must be a WritePlan"),
    ("scatter offsets length", lambda w: w.scatter(offsets=_d(w, np.arange(2))), ValueError,
     r"offsets must have length 3"),
    ("scatter pool dtype", lambda w: w.scatter(pool_out=_d(w, np.zeros((3, 6), np.int64))), TypeError,
     r"pool_out must have dtype int32"),
    ("scatter flat 2-D", lambda w: w.scatter(flat_in=_d(w, np.zeros((2, 2), np.int64))), ValueError,
     r"flat_in must be 1-D"),
    ("scatter rows dtype", lambda w: w.scatter(req_pool_indices=_d(w, np.arange(2, dtype=np.int32))), TypeError,
     r"req_pool_indices must have dtype int64"),
    ("copy src type", lambda w: w.copy(src=w.vplan), TypeError, r"src must be a CanaryContext, got VerifyPlan"),
    ("copy dst type", lambda w: w.copy(dst=w.wplan), TypeError, r"dst must be a CanaryContext, got WritePlan"),
]


def _assert_unchanged(before: list, buffers) -> None:
    """Every buffer as ``before`` holds it: a rejected call changed nothing."""
    for index, (old, new) in enumerate(zip(before, buffers)):
        assert np.array_equal(old, to_numpy(new)), f"buffer {index} changed by a rejected call"


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("name,call,exc,pattern", OPS, ids=[c[0] for c in OPS])
def test_op_rules_change_nothing(device, name, call, exc, pattern):
    w = World(device)
    before = snapshot(*w.buffers())
    with pytest.raises(exc) as info:
        call(w)
    assert type(info.value) is exc
    assert str(info.value).startswith("kv-canary: ")
    assert re.search(pattern, str(info.value)), str(info.value)
    _assert_unchanged(before, w.buffers())


READ_ONLY_OUTPUTS = [
    ("verify", "ctx", "violation_ring", r"CanaryContext\.violation_ring must be writable"),
    ("verify", "ctx", "slot_run_counter", r"CanaryContext\.slot_run_counter must be writable"),
    ("write", "ctx", "canary_buf", r"CanaryContext\.canary_buf must be writable"),
    ("write", "ctx", "kernel_run_counter", r"CanaryContext\.kernel_run_counter must be writable"),
    ("plan", "vplan", "slot_indices", r"VerifyPlan\.slot_indices must be writable"),
    ("plan", "vplan", "enable", r"VerifyPlan\.enable must be writable"),
    ("plan", "wplan", "offsets", r"WritePlan\.offsets must be writable"),
    ("plan", "wplan", "num_valid_reqs", r"WritePlan\.num_valid_reqs must be writable"),
    ("scatter", None, "pool", r"scatter_req_token_ids pool_out must be writable"),
    ("copy", "ctx", "canary_buf", r"dst canary_buf must be writable"),
    ("step", "ctx", "canary_buf", r"CanaryContext\.canary_buf must be writable"),
    ("step", "ctx", "violation_write_index", r"CanaryContext\.violation_write_index must be writable"),
]


@pytest.mark.parametrize("op,owner,field,pattern", READ_ONLY_OUTPUTS, ids=[f"{c[0]} {c[2]}" for c in READ_ONLY_OUTPUTS])
def test_read_only_outputs_change_nothing(op, owner, field, pattern):
    """An output that NumPy marks read-only, even after its bundle was built, is refused before any
    other output is written."""
    w = World("cpu")
    if owner is None:
        _read_only(getattr(w, field))
    else:
        _read_only(getattr(getattr(w, owner), field))
    before = snapshot(*w.buffers())
    with pytest.raises(ValueError, match="^kv-canary: " + pattern):
        getattr(w, op)()
    _assert_unchanged(before, w.buffers())


@pytest.mark.parametrize("field", ["canary_buf", "violation_ring", "kernel_run_counter"])
def test_a_step_whose_context_became_read_only_launches_nothing(field):
    """A step is validated once, when built; an array NumPy marks read-only after that is still
    refused at launch, before the verify half writes anything."""
    w = World("cpu")
    step = w.build_step()
    _read_only(getattr(w.ctx, field))
    before = snapshot(*w.buffers())
    with pytest.raises(ValueError, match=rf"^kv-canary: CanaryContext\.{field} must be writable"):
        step.launch()
    _assert_unchanged(before, w.buffers())


@pytest.mark.parametrize("field", ["canary_buf", "violation_ring", "slot_run_counter"])
def test_a_step_over_a_context_made_read_only_is_refused_when_built(field):
    """A step is validated when it is built (a GPU launch checks nothing again): a context an
    output of which NumPy marks read-only is refused there, and nothing changes."""
    w = World("cpu")
    _read_only(getattr(w.ctx, field))
    before = snapshot(*w.buffers())
    with pytest.raises(ValueError, match=rf"^kv-canary: CanaryContext\.{field} must be writable"):
        w.build_step()
    _assert_unchanged(before, w.buffers())


@pytest.mark.parametrize("call,field", [(lambda ctx: ctx.clear_violations(), "violation_write_index"),
                                        (lambda ctx: ctx.set_chain_position_assert(False), "chain_position_assert")])
def test_context_methods_refuse_read_only_arrays_whole(call, field):
    """Clearing the ring or flipping the chain flag into a read-only array is refused before any
    array is changed (the ring is not emptied when its write index cannot be)."""
    w = World("cpu")
    _read_only(getattr(w.ctx, field))
    before = snapshot(*w.buffers())
    with pytest.raises(ValueError, match=rf"^kv-canary: CanaryContext\.{field} must be writable"):
        call(w.ctx)
    _assert_unchanged(before, w.buffers())


def _narrower(array):
    """The same bytes as rows half as wide (a vector as two columns): what a caller can do in
    place, through ``array.shape =``, to an array object it handed to a bundle."""
    rows = array.shape[0] * 2 if array.ndim == 2 else array.shape[0] // 2
    array.shape = (rows, array.shape[-1] // 2) if array.ndim == 2 else (rows, 2)


@pytest.mark.parametrize("device", BACKENDS)
def test_arrays_reshaped_in_place_after_building_change_nothing(device):
    """A context, its plans and a step keep views of their own: the caller's array objects reshaped
    in place afterwards (a canary buffer of 16-byte rows would be written past its end, a ring of
    4 columns past its last row) leave every op's result as it was."""
    outcomes = []
    for reshaped in (False, True):
        rng = np.random.default_rng(5)
        put = lambda a: to_device(np.ascontiguousarray(a), device)  # noqa: E731
        given = dict(canary_buf=put(rng.integers(0, 256, size=(8, 32), dtype=np.uint8)),
                     violation_ring=put(np.zeros((4, 8), np.int64)), violation_write_index=put(np.zeros(1, np.int32)),
                     slot_run_counter=put(np.zeros(1, np.int64)), kernel_run_counter=put(np.zeros(1, np.int64)),
                     chain_position_assert=put(np.ones(1, np.int32)))
        ctx = kc.CanaryContext(**given)
        plan_given = dict(slot_indices=put(np.zeros(6, np.int64)), expected_tokens=put(np.zeros(6, np.int64)),
                          expected_positions=put(np.zeros(6, np.int64)), prev_slot_indices=put(np.zeros(6, np.int64)))
        vplan = kc.VerifyPlan(**plan_given, num_valid=put(np.zeros(1, np.int32)), enable=put(np.ones(1, np.int32)))
        wplan = kc.WritePlan.allocate(4, device=device)
        step_given = dict(input_ids=put(np.array([11, 12, 13, 14])), positions=put(np.array([3, 4, 5, 6])),
                          out_cache_loc=put(np.array([7, 6, 5, 1])))
        table = put(rng.integers(1, 8, size=(4, 8)).astype(np.int32))
        batch = dict(req_pool_indices=put(np.array([0, 1, 2, 3])), prefix_lens=put(np.array([3, 4, 5, 6])),
                     extend_seq_lens=put(np.array([1, 1, 1, 1])), req_to_token=table)
        step = kc.CanaryStep(ctx, verify_capacity=32, verify_tag=0, write_tag=2, **batch, **step_given)
        if reshaped:
            for array in (*given.values(), *plan_given.values(), *step_given.values()):
                if array.shape[-1] > 1:
                    _narrower(array)
        kc.plan(vplan, wplan, **batch)
        kc.verify(ctx, vplan, tag=1)
        step.launch()
        outcomes.append([to_numpy(a).tobytes() for a in (*given.values(), *plan_given.values())])
    assert outcomes[0] == outcomes[1]
    assert np.frombuffer(outcomes[0][2], np.int32)[0] > 0  # rows were recorded: the ring is compared at work


def test_source_array_retyped_in_place_after_building_changes_nothing():
    """A real-KV source keeps a view of its own too: the caller's array object reshaped and re-typed
    in place after the source was built (its bytes as one 256-byte element) leaves the hashes of a
    context built from the source as they were, where it had failed with NumPy's own error."""
    rng = np.random.default_rng(9)
    raw = rng.integers(0, 256, size=(8, 32), dtype=np.uint8)
    hashes = []
    for retyped in (False, True):
        kv = raw.copy()
        source = kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=32, read_bytes=32)
        if retyped:
            kv.shape = (256,)
            kv.dtype = np.dtype("V256")
        ctx = kc.CanaryContext.allocate(8, real_kv_sources=[source], hash_mode=kc.HashMode.ALL)
        kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 7], seed_slot_indices=[-1], num_valid_reqs=1), tag=2,
                 input_ids=np.zeros(7, np.int64), positions=np.arange(7), out_cache_loc=np.arange(1, 8))
        hashes.append(ctx.canary_buf.view(np.int64)[:, 3].copy())
    assert np.array_equal(hashes[0], hashes[1]) and hashes[0][1:].all()


@pytest.mark.parametrize("device", BACKENDS)
def test_own_arrays_changed_in_place_through_their_attributes_are_refused(device):
    """A bundle's own arrays are reachable through its attributes; one reshaped or re-typed there
    (a ring of 4 columns would be written past its last row, a write plan re-typed to twice its
    capacity past its offsets, a canary buffer of half-width rows past its last slot, a verify
    plan's slots re-typed to twice its capacity past its other fields) is refused by
    every op that takes the bundle, before anything is written, and the same op runs once it has
    its form back."""
    ctx = kc.CanaryContext.allocate(8, ring_capacity=2, device=device)
    vplan, wplan = kc.VerifyPlan.allocate(4, device=device), kc.WritePlan.allocate(2, device=device)
    batch = dict(req_pool_indices=to_device(np.array([1, 1]), device), prefix_lens=to_device(np.array([2, 3]), device),
                 extend_seq_lens=to_device(np.array([1, 1]), device),
                 req_to_token=to_device(np.arange(1, 9, dtype=np.int32).reshape(2, 4), device))
    state = lambda: [a.tobytes() for a in snapshot(*context_arrays(ctx), *plan_arrays(vplan, wplan))]  # noqa: E731
    other, slots = kc.CanaryContext.allocate(8, device=device), to_device(np.array([7]), device)
    entries = {name: to_device(np.array(values), device) for name, values in
               (("input_ids", [5, 6]), ("positions", [0, 0]), ("out_cache_loc", [1, 2]))}
    cases = [(ctx, "violation_ring", (4, 4), None, lambda: kc.verify(ctx, vplan, tag=1)),
             (ctx, "canary_buf", (16, 16), None,  # slot 15 of 16-byte rows: past a buffer of 8 slots
              lambda: kc.copy_records(src=other, dst=ctx, src_slots=slots, dst_slots=slots * 2 + 1)),
             (wplan, "seed_slot_indices", None, np.int32, lambda: kc.plan(vplan, wplan, **batch)),
             (vplan, "expected_positions", (2, 2), None, lambda: kc.plan(vplan, wplan, **batch)),
             # slot indices read as twice the plan's capacity: every other field read past its end
             (vplan, "slot_indices", None, np.int32, lambda: kc.verify(ctx, vplan, tag=1)),
             (wplan, "offsets", (3, 1), None, lambda: kc.write(ctx, wplan, tag=1, **entries)),
             # re-typed to another dtype of its size: the same shape and strides, cells read as floats
             (ctx, "slot_run_counter", None, np.float64, lambda: kc.verify(ctx, vplan, tag=1))]
    for owner, field, shape, dtype, call in cases:
        array = getattr(owner, field)
        attribute, changed = ("shape", shape) if shape is not None else ("dtype", dtype)
        kept = getattr(array, attribute)
        try:
            setattr(array, attribute, changed)
        except AttributeError:  # CuPy arrays cannot be re-typed in place
            continue
        before = state()
        with pytest.raises(ValueError, match=rf"^kv-canary: {type(owner).__name__}\.{field} must keep the shape, "
                                             r"strides and dtype it was validated with .*: changed in place$"):
            call()
        assert state() == before
        setattr(array, attribute, kept)
        call()


@requires_gpu
def test_misaligned_cuda_arrays_refused():
    """A CuPy view whose int64 elements straddle 8-byte boundaries is refused on the host: loading
    it in a kernel would fault, and a fault ends the CUDA context."""
    import cupy

    w = World("cuda")
    before = snapshot(*w.buffers())
    raw = cupy.zeros(8 * 4, cupy.uint8)
    misaligned = raw[4:4 + 8 * 3].view(cupy.int64)
    assert misaligned.data.ptr % 8 == 4
    calls = [
        (lambda: w.write(input_ids=misaligned), r"input_ids must be 8-byte aligned"),
        (lambda: w.scatter(flat_in=misaligned[:2]), r"flat_in must be 8-byte aligned"),
        (lambda: w.plan(prefix_lens=misaligned[:2]), r"prefix_lens must be 8-byte aligned"),
    ]
    for call, pattern in calls:
        with pytest.raises(ValueError, match="^kv-canary: .*" + pattern):
            call()
    _assert_unchanged(before, w.buffers())
    w.write()  # the context still works
    assert w.ctx.counters()["kernel_run_counter"] == 7


def test_empty_tables_accepted():
    """A table with no rows (NumPy gives it zero strides) resolves nothing; it is not an error."""
    vplan, wplan = kc.VerifyPlan.allocate(4), kc.WritePlan.allocate(1)
    kc.plan(vplan, wplan, req_pool_indices=np.array([1]), prefix_lens=np.array([2]), extend_seq_lens=np.array([1]),
            req_to_token=np.zeros((0, 8), np.int32))
    assert vplan.slot_indices[:2].tolist() == [kc.UNRESOLVED_SLOT] * 2
    pool = np.zeros((0, 4), np.int32)
    kc.scatter_req_token_ids(flat_in=np.arange(3), offsets=np.array([0, 3]), req_pool_indices=np.array([0]),
                             pool_out=pool)


@pytest.mark.parametrize("device", BACKENDS)
def test_valid_world_calls_run(device):
    """The same world accepts the unmodified calls (so each rule above is what rejected its call)."""
    w = World(device)
    w.write()
    w.verify(check_expected_token=True)
    w.plan()
    w.scatter()
    assert w.ctx.counters()["kernel_run_counter"] == 6 + 2


@pytest.mark.parametrize("stream", ["bogus", 1.5, True, object()])
def test_stream_forms_refused_on_the_cpu_too(stream):
    """A stream= a GPU would refuse is refused on the CPU as well, where it is otherwise ignored,
    by every op, which then changes nothing."""
    w = World("cpu")
    pattern = r"^kv-canary: stream must be None, a CuPy or torch stream, a raw CUDA stream handle"
    i64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    before = snapshot(*w.buffers())
    for call in (w.verify, w.write, w.plan, w.scatter,
                 lambda stream: kc.copy_records(src=w.ctx, dst=w.ctx, src_slots=i64([1]), dst_slots=i64([2]),
                                                stream=stream)):
        with pytest.raises(TypeError, match=pattern):
            call(stream=stream)
    assert all(np.array_equal(old, to_numpy(new)) for old, new in zip(before, w.buffers()))
    step = kc.CanaryStep(w.ctx, verify_capacity=4, verify_tag=0, write_tag=2, req_pool_indices=i64([1]),
                         prefix_lens=i64([0]), extend_seq_lens=i64([1]), req_to_token=np.zeros((2, 4), np.int32),
                         input_ids=i64([5]), positions=i64([0]), out_cache_loc=i64([1]))
    with pytest.raises(TypeError, match=pattern):
        step.launch(stream=stream)


def test_write_plan_from_host_takes_integer_sequences():
    plan = kc.WritePlan.from_host(offsets=range(3), seed_slot_indices=np.array([-1, 2], np.int32),
                                  num_valid_reqs=np.int64(2))
    assert plan.offsets.tolist() == [0, 1, 2] and plan.seed_slot_indices.tolist() == [-1, 2]
    assert plan.offsets.dtype == np.int64 and plan.seed_slot_indices.dtype == np.int64


def test_write_plan_from_host_takes_unsigned_values_up_to_int64_max():
    """Unsigned host values are refused only past int64, where they would wrap: int64's maximum
    itself is kept as it is."""
    top = np.iinfo(np.int64).max
    plan = kc.WritePlan.from_host(offsets=np.array([0, 3, top], np.uint64),
                                  seed_slot_indices=np.array([top, 7], np.uint64), num_valid_reqs=2)
    assert plan.offsets.tolist() == [0, 3, top] and plan.seed_slot_indices.tolist() == [top, 7]


def test_an_own_canary_buffer_needs_a_slot():
    """A canary buffer of no slot has not even the padding slot: refused before anything reads it."""
    make = _ctx_arrays(canary_buf=np.empty((0, 32), np.uint8))
    with pytest.raises(ValueError, match=r"^kv-canary: canary_buf must have at least one slot, got shape \(0, 32\)$"):
        make()


def test_a_source_row_with_a_gap_in_a_dimension_of_two_is_refused():
    """SPEC §2: the bytes inside a source row are contiguous. A row of two 16-byte halves taken
    every other one of four leaves gaps between them, which a dimension of size 2 shows as well as
    a longer one."""
    rng = np.random.default_rng(86)
    parent = rng.integers(1, 256, size=(8, 4, 16), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource\.tensor must have contiguous bytes within each "
                                         r"row, got strides \(64, 32, 1\) in bytes for shape \(8, 2, 16\)$"):
        kc.RealKvSource(tensor=parent[:, ::2], page_size=1, num_bytes_per_token=32, read_bytes=32)


def test_an_own_canary_buffer_needs_a_slot_stride_that_is_a_multiple_of_8():
    """SPEC §2: ``slot_stride_bytes`` is a multiple of 8, so that every slot's int64 fields are
    aligned; a buffer of the caller's own is held to it as ``allocate`` is."""
    rng = np.random.default_rng(82)
    make = _ctx_arrays(canary_buf=rng.integers(1, 256, size=(8, 36), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"^kv-canary: canary_buf slot_stride_bytes \(shape\[1\]\) must be >= 32 and "
                                         r"a multiple of 8, got 36$"):
        make()


def test_write_plan_from_host_copies_the_callers_arrays():
    """The plan holds a copy of the host values, on the CPU as on a GPU: an unaligned or read-only
    array is taken by value, and the caller's array is neither read again nor stored into."""
    def unaligned(values):
        raw = bytearray(8 * len(values) + 1)
        array = np.frombuffer(memoryview(raw)[1:], np.int64)
        array[...] = values
        return array

    offsets, seeds = unaligned([0, 2, 3]), np.array([-1, 4], np.int64)
    seeds.setflags(write=False)
    assert not offsets.flags.aligned
    plan = kc.WritePlan.from_host(offsets=offsets, seed_slot_indices=seeds, num_valid_reqs=2)
    assert plan.offsets.tolist() == [0, 2, 3] and plan.seed_slot_indices.tolist() == [-1, 4]
    offsets[...] = 9
    assert plan.offsets.tolist() == [0, 2, 3]
    kc.plan(kc.VerifyPlan.allocate(4), plan, req_pool_indices=np.array([1]), prefix_lens=np.array([0]),
            extend_seq_lens=np.array([1]), req_to_token=np.zeros((2, 4), np.int32))
    assert seeds.tolist() == [-1, 4] and plan.seed_slot_indices.tolist() == [-1, -1]


def test_stream_forms_engines_pass_are_accepted_on_the_cpu():
    w = World("cpu")
    for stream in (None, 0, np.int64(7), type("Protocol", (), {"__cuda_stream__": lambda self: (0, 0)})()):
        w.verify(stream=stream)
    torch = pytest.importorskip("torch")
    w.verify(stream=torch.Stream(device="cpu"))  # a device-agnostic engine's current stream


@pytest.mark.parametrize("device", BACKENDS)
def test_a_one_row_source_takes_any_stride_and_hashes_as_row_0(device):
    """Only row 0 of a one-row source is read, and frameworks give a size-1 dimension any stride:
    a row of 40 bytes inside 48-byte rows, on its own, or with a stride of 0 is taken, and slot 1
    (page size 2) hashes as it does in a two-row view of the same bytes."""
    parent = np.random.default_rng(5).integers(0, 256, (4, 48), dtype=np.uint8)
    flipped = parent.copy()
    flipped[0, 16] ^= 1  # slot 1's first byte: a record of its own
    views = [parent[:2, :40], parent[:1, :40], np.ascontiguousarray(parent[0, :40]).reshape(1, 40),
             parent[0, :40][None], flipped[:1, :40]]
    records = []
    for view in views:
        source = kc.RealKvSource(tensor=to_device(view, device, keep_strides=True), page_size=2,
                                 num_bytes_per_token=16, read_bytes=16)
        ctx = kc.CanaryContext.allocate(4, device=device, real_kv_sources=(source,), hash_mode=kc.HashMode.ALL)
        wplan = kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
        i64 = int64s_on(device)
        kc.write(ctx, wplan, tag=kc.LaunchTag.HEAD_K_FULL, input_ids=i64([7]), positions=i64([0]),
                 out_cache_loc=i64([1]))
        assert ctx.violations().total == 0
        records.append(to_numpy(ctx.canary_buf).copy())
    assert all(np.array_equal(record, records[0]) for record in records[1:4])
    assert not np.array_equal(records[4], records[0])


def test_stream_form_names_each_form_a_gpu_launch_resolves():
    from kvcanary_cupy.ops._dispatch import stream_form
    protocol = type("Protocol", (), {"__cuda_stream__": lambda self: (0, 0)})()
    torch_like = type("TorchCudaStream", (), {"cuda_stream": 0})()
    assert [stream_form(s) for s in (None, protocol, torch_like, 7, np.int32(7))] == \
        ["current", "protocol", "torch_cuda", "handle", "handle"]
    for refused in (True, np.bool_(False), 1.5, "0"):
        with pytest.raises(TypeError, match=r"^kv-canary: stream must be None"):
            stream_form(refused)
    for handle in (-1, 2**64, np.int64(-5)):  # not a pointer: refused on every device
        with pytest.raises(ValueError, match=r"^kv-canary: stream, a raw CUDA stream handle, must be in \[0, 2\*\*64\)"):
            stream_form(handle)


def test_a_torch_stream_of_another_gpu_is_refused_before_it_is_resolved(monkeypatch):
    """A stream in torch's form (``cuda_stream`` and ``device.index``) whose device is not the
    arrays' is refused in words, decided on the host; one of the arrays' device, or of no device
    said, is taken as an external stream on the arrays' device (CuPy stood in for)."""
    import contextlib
    import types

    from kvcanary_cupy._dlpack import parse_device
    from kvcanary_cupy.ops import _dispatch

    taken = []

    def from_external(handle):
        taken.append(handle.__cuda_stream__()[1])
        return handle

    monkeypatch.setattr(_dispatch, "require_cupy", lambda name: types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=types.SimpleNamespace(from_external=from_external), Device=lambda index: contextlib.nullcontext())))

    def torch_stream(index):
        return types.SimpleNamespace(cuda_stream=0x5000, device=types.SimpleNamespace(index=index))

    with pytest.raises(ValueError, match=r"^kv-canary: stream must belong to the arrays' device cuda:0, "
                                         r"got a stream of cuda:1$"):
        _dispatch.resolve_stream(torch_stream(1), parse_device("cuda:0"))
    for index in (0, None, -1):
        _dispatch.resolve_stream(torch_stream(index), parse_device("cuda:0"))
    assert taken == [0x5000] * 3


@pytest.mark.parametrize("tag_name", ["verify_tag", "write_tag"])
def test_step_names_the_tag_it_refuses(tag_name):
    i64 = lambda values: np.asarray(values, np.int64)  # noqa: E731
    tags = {"verify_tag": 0, "write_tag": 2, tag_name: 99}
    with pytest.raises(ValueError, match=rf"^kv-canary: {tag_name} must be"):
        kc.CanaryStep(kc.CanaryContext.allocate(8), verify_capacity=4, req_pool_indices=i64([1]), prefix_lens=i64([0]),
                      extend_seq_lens=i64([1]), req_to_token=np.zeros((2, 4), np.int32), input_ids=i64([5]),
                      positions=i64([0]), out_cache_loc=i64([1]), **tags)


def test_int32_capacities():
    with pytest.raises(ValueError, match=r"^kv-canary: verify_capacity must fit in int32"):
        kc.VerifyPlan.allocate(2**31)
    with pytest.raises(ValueError, match=r"^kv-canary: write_req_capacity must fit in int32"):
        kc.WritePlan.allocate(2**31)


def test_slot_fields_range():
    ctx = kc.CanaryContext.allocate(4)
    with pytest.raises(ValueError, match=r"^kv-canary: slot must be in \[0, 4\), got 4"):
        ctx.slot_fields(4)
    assert ctx.slot_fields(3) == {"token": 0, "position": 0, "prev_hash": 0, "real_kv_hash": 0}
    assert ctx.slot_fields(0) == {"token": 0, "position": 0, "prev_hash": 0, "real_kv_hash": 0}


@pytest.mark.parametrize("handle", [0, 2**63, 2**64 - 1])
def test_a_raw_stream_handle_takes_every_pointer_value_on_the_cpu(handle):
    """A raw handle is a cudaStream_t, a pointer: any value in [0, 2**64) is a handle's form (the
    CPU then ignores it), the upper half of the range included."""
    w = World("cpu")
    w.verify(stream=handle)
    w.verify(stream=np.uint64(handle))
    with pytest.raises(ValueError, match=r"^kv-canary: stream, a raw CUDA stream handle, must be in \[0, 2\*\*64\)"):
        w.verify(stream=2**64)


def test_copy_records_takes_every_stream_form_on_the_cpu():
    """``kc.copy_records`` between two host canaries takes the stream forms every op takes on the
    CPU (and ignores them), and copies the records."""
    rng = np.random.default_rng(93)
    for stream in (None, 0, 2**64 - 1, type("Protocol", (), {"__cuda_stream__": lambda self: (0, 0)})()):
        src, dst = kc.CanaryContext.allocate(8), kc.CanaryContext.allocate(8)
        src.canary_buf[:] = rng.integers(0, 256, size=src.canary_buf.shape, dtype=np.uint8)
        kc.copy_records(src=src, dst=dst, src_slots=np.array([1, 6]), dst_slots=np.array([7, 2]), stream=stream)
        assert [dst.slot_fields(slot) for slot in (7, 2)] == [src.slot_fields(slot) for slot in (1, 6)]


def test_interleaved_takes_a_one_slot_buffer_whatever_its_row_stride():
    """A pool of one slot has one row, whose stride nothing reads: ``layouts.interleaved`` takes
    such a view (a step of a larger buffer) and its K and V sources lie on its two halves."""
    big = np.random.default_rng(94).random((4, 2, 32)).astype(np.float32)
    view = big[::4]  # one row, row stride 1024 bytes; flattened, NumPy gives it 256
    k_part, v_part = kc.layouts.interleaved([view])
    start = view.__array_interface__["data"][0]
    assert [part.tensor.__array_interface__["data"][0] - start for part in (k_part, v_part)] == [0, 128]
    assert (k_part.num_bytes_per_token, v_part.num_bytes_per_token) == (128, 128)


def test_write_plan_from_host_takes_a_count_at_either_end_of_int32():
    """``num_valid_reqs`` goes into an int32 cell: both of int32's ends are taken as they are (the
    ops then read a count below 0 as none), one past either end is refused, naming the range."""
    for count in (-2**31, 2**31 - 1):
        plan = kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=count)
        assert plan.num_valid_reqs.tolist() == [count]
    for count in (-2**31 - 1, 2**31):
        with pytest.raises(ValueError, match=rf"^kv-canary: num_valid_reqs must fit in int32 "
                                             rf"\[-2147483648, 2147483647\], got {count}$"):
            kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=count)


def test_write_plan_from_host_takes_ranges_to_either_end_of_int64():
    """A range is checked by its two ends, without iterating it: ends at int64's minimum and maximum
    are kept as they are; a range past either is refused, naming its end past int64."""
    low, top = -(1 << 63), (1 << 63) - 1
    plan = kc.WritePlan.from_host(offsets=range(top - 2, top + 1), seed_slot_indices=range(low, low + 2),
                                  num_valid_reqs=2)
    assert plan.offsets.tolist() == [top - 2, top - 1, top] and plan.seed_slot_indices.tolist() == [low, low + 1]
    for offsets, past in ((range(low, top + 2, 1 << 63), top + 1), (range(low - 1, low + 2), low - 1)):
        with pytest.raises(ValueError, match=rf"^kv-canary: offsets must fit in int64 \[{low}, {top}\], got {past}$"):
            kc.WritePlan.from_host(offsets=offsets, seed_slot_indices=[-1, -1], num_valid_reqs=2)


@pytest.mark.parametrize("values", [{0, 1, 2}, {0: 1, 1: 2, 2: 3}, (value for value in range(3))],
                         ids=["set", "dict", "generator"])
def test_write_plan_from_host_refuses_collections_without_an_order_or_a_length(values):
    """Host integers come as a list, a tuple, a range or an array: a set's or a dict's order is not
    the caller's to choose, and a generator is used up by reading it."""
    with pytest.raises(TypeError, match=r"^kv-canary: offsets must be a list, tuple or NumPy array of integers, "
                                        rf"got {type(values).__name__}$"):
        kc.WritePlan.from_host(offsets=values, seed_slot_indices=[-1, -1], num_valid_reqs=2)


def _strided(cells: np.ndarray, shape: tuple, strides: tuple) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(cells, shape=shape, strides=strides)


@pytest.mark.parametrize("layout", ["one row reversed", "one row of stride 0", "one row of a stride splitting an element",
                                    "one column of every other cell", "no columns, rows reversed"])
def test_a_table_is_taken_whatever_the_strides_that_address_no_element(layout):
    """A row stride matters only between two rows, and a cell stride only between two cells: a
    table of one row, one column or no columns is taken whatever those strides are (NumPy reports
    any for such views), and the op stores where the elements lie."""
    cells = np.full(8, -7, np.int32)
    flat_in, offsets, rows = np.array([1, 2, 3], np.int64), np.array([0, 3], np.int64), np.array([0], np.int64)
    expected = [1, 2, 3, -7, -7, -7, -7, -7]
    if layout == "one row reversed":
        pool_out = cells[:4].reshape(1, 4)[::-1]
    elif layout == "one row of stride 0":
        pool_out = _strided(cells, (1, 4), (0, 4))
    elif layout == "one row of a stride splitting an element":
        pool_out = _strided(cells, (1, 4), (18, 4))
    elif layout == "one column of every other cell":
        pool_out = cells.reshape(4, 2)[:, ::2]
        flat_in, offsets, rows = np.array([5, 6], np.int64), np.array([0, 1, 2], np.int64), np.array([2, 0], np.int64)
        expected = [6, -7, -7, -7, 5, -7, -7, -7]
    else:
        pool_out = _strided(cells, (3, 0), (-8, 4))
        expected = [-7] * 8
    kc.scatter_req_token_ids(flat_in=flat_in, offsets=offsets, req_pool_indices=rows, pool_out=pool_out)
    assert cells.tolist() == expected


def test_a_table_whose_row_stride_splits_an_element_is_refused():
    """A row stride that is no whole number of int32 cells puts every other row's cells across
    element boundaries, though the table starts aligned: refused as such."""
    cells = np.random.default_rng(87).integers(1, 9, size=64).astype(np.int32)
    table = np.lib.stride_tricks.as_strided(cells, shape=(3, 4), strides=(18, 4))
    vplan, wplan = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(2)
    before = snapshot(*plan_arrays(vplan, wplan))
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token row stride must be a whole number of elements, "
                                         r"got 18 bytes$"):
        kc.plan(vplan, wplan, req_pool_indices=np.array([1]), prefix_lens=np.array([2]),
                extend_seq_lens=np.array([1]), req_to_token=table)
    assert all(np.array_equal(old, new) for old, new in zip(before, snapshot(*plan_arrays(vplan, wplan))))


def test_an_empty_array_shares_no_memory_wherever_it_points():
    """An empty array holds no byte: a ring of no row whose address lies inside the canary buffer's
    memory (a slice of one arena) shares nothing with it, and the write stores into the buffer."""
    arena = np.random.default_rng(88).integers(1, 2**40, size=64, dtype=np.int64)
    ctx = kc.CanaryContext(canary_buf=arena[:32].view(np.uint8).reshape(8, 32),
                           violation_ring=np.ndarray((0, 8), np.int64, buffer=arena, offset=64),
                           violation_write_index=np.zeros(1, np.int32),
                           slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
                           chain_position_assert=np.zeros(1, np.int32))
    wplan = kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=1)
    kc.write(ctx, wplan, tag=0, input_ids=np.array([77]), positions=np.array([0]), out_cache_loc=np.array([3]))
    assert ctx.slot_fields(3)["token"] == 77 and ctx.ring_capacity == 0


def test_a_source_of_no_rows_is_taken_wherever_it_points():
    """A source of no rows has no byte to align: its address, whatever it is, is not refused."""
    raw = np.random.default_rng(89).integers(1, 256, size=128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16 + 8
    source = kc.RealKvSource(tensor=np.ndarray((0, 32), np.uint8, buffer=raw, offset=start), page_size=1,
                             num_bytes_per_token=32, read_bytes=32)
    assert source.num_rows == 0 and source.base_address % 16 == 8


def test_an_array_starting_inside_the_last_element_of_another_shares_its_memory():
    """An array's memory runs to the end of its last element: a pool whose first int32 cell is the
    upper half of the flat ids' last int64 would be stored over ids still to be read."""
    arena = np.random.default_rng(90).integers(1, 2**40, size=16, dtype=np.int64)
    flat_in = arena[:4]
    pool_out = arena[3:8].view(np.int32)[1:9].reshape(2, 4)
    before = arena.copy()
    with pytest.raises(ValueError, match=r"^kv-canary: scatter_req_token_ids pool_out and "
                                         r"scatter_req_token_ids flat_in must not share memory"):
        kc.scatter_req_token_ids(flat_in=flat_in, offsets=np.array([0, 2, 4]), req_pool_indices=np.array([0, 1]),
                                 pool_out=pool_out)
    assert np.array_equal(arena, before)


@pytest.mark.parametrize("flag", [1, 0, None, "yes"])
def test_the_chain_position_flag_is_set_from_a_bool_only(flag):
    """``set_chain_position_assert`` takes a bool, as ``allocate(chain_position_assert=)`` does: an
    int or anything else is refused and the device flag stays as it was."""
    ctx = kc.CanaryContext.allocate(4, chain_position_assert=True)
    with pytest.raises(TypeError, match=rf"^kv-canary: enabled must be a bool, got {type(flag).__name__} "):
        ctx.set_chain_position_assert(flag)
    assert to_numpy(ctx.chain_position_assert).tolist() == [1]


def test_slot_fields_refuse_a_negative_slot():
    """A negative slot is no slot of the buffer (NumPy would read it from the end): refused."""
    ctx = kc.CanaryContext.allocate(4)
    with pytest.raises(ValueError, match=r"^kv-canary: slot must be in \[0, 4\), got -1$"):
        ctx.slot_fields(-1)
