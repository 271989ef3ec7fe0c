"""DLPack interop (SPEC §5): NumPy and PyTorch CPU tensors are used in place (ops write into the
caller's memory), odd dtypes work as real-KV sources, and arrays on different devices are refused."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import DLPackOnly, SourceSpec, expected_kv_hash, fields, link_of, plan_arrays, ring_rows, signed

torch = pytest.importorskip("torch")


class FakeCuda:
    """Claims to live on CUDA device 0, or on the DLPack device given (never dereferenced: the device
    check comes first)."""

    shape = (4,)

    def __init__(self, dlpack_device: tuple = (2, 0)):
        self.dlpack_device = dlpack_device

    def __dlpack_device__(self):
        return self.dlpack_device

    def __dlpack__(self, **kwargs):
        raise AssertionError("a mixed-device call must be refused before any view is taken")


def _torch_ctx(num_slots=8, **kwargs):
    t = dict(canary_buf=torch.zeros((num_slots, 32), dtype=torch.uint8),
             violation_ring=torch.zeros((16, 8), dtype=torch.int64),
             violation_write_index=torch.zeros(1, dtype=torch.int32),
             slot_run_counter=torch.zeros(1, dtype=torch.int64), kernel_run_counter=torch.zeros(1, dtype=torch.int64),
             chain_position_assert=torch.zeros(1, dtype=torch.int32))
    return t, kc.CanaryContext(**t, **kwargs)


def test_torch_end_to_end_in_place():
    t, ctx = _torch_ctx()
    assert ctx.canary_buf.ctypes.data == t["canary_buf"].data_ptr()
    vp = {k: torch.zeros(8, dtype=torch.int64) for k in ("slot_indices", "expected_tokens", "expected_positions",
                                                          "prev_slot_indices")}
    vp.update(num_valid=torch.zeros(1, dtype=torch.int32), enable=torch.zeros(1, dtype=torch.int32))
    vplan = kc.VerifyPlan(**vp)
    wp = dict(offsets=torch.zeros(3, dtype=torch.int64), seed_slot_indices=torch.zeros(2, dtype=torch.int64),
              num_valid_reqs=torch.zeros(1, dtype=torch.int32))
    wplan = kc.WritePlan(**wp)
    table = torch.tensor([[0, 0, 0, 0], [3, 5, 1, 0], [2, 4, 6, 7]], dtype=torch.int32)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    # Write 3 tokens of row 1 and 4 of row 2 (no prefix).
    kc.plan(vplan, wplan, req_pool_indices=i64([1, 2]), prefix_lens=i64([0, 0]), extend_seq_lens=i64([3, 4]),
            req_to_token=table)
    assert wp["offsets"].tolist() == [0, 3, 7] and wp["seed_slot_indices"].tolist() == [-1, -1]
    assert wp["num_valid_reqs"].item() == 2
    kc.write(ctx, wplan, tag=kc.LaunchTag.HEAD_K_FULL, input_ids=i64([10, 11, 12, 20, 21, 22, 23]),
             positions=i64([0, 1, 2, 0, 1, 2, 3]), out_cache_loc=i64([3, 5, 1, 2, 4, 6, 7]))
    words = t["canary_buf"].view(torch.int64)
    assert words[5, 0].item() == 11 and words[5, 1].item() == 1
    assert t["kernel_run_counter"].item() == 1 and t["slot_run_counter"].item() == 7
    # Verify everything through the torch plan.
    kc.plan(vplan, wplan, req_pool_indices=i64([1, 2]), prefix_lens=i64([3, 4]), extend_seq_lens=i64([0, 0]),
            req_to_token=table)
    assert vp["num_valid"].item() == 7 and vp["enable"].item() == 1
    assert vp["slot_indices"][:7].tolist() == [3, 5, 1, 2, 4, 6, 7]
    kc.verify(ctx, vplan, tag=kc.LaunchTag.TAIL_K_FULL)
    assert t["violation_write_index"].item() == 0
    # A corruption made through the caller's tensor is seen, and the row lands in the caller's ring.
    words[4, 0] = 99
    kc.verify(ctx, vplan, tag=kc.LaunchTag.TAIL_K_FULL)
    assert t["violation_write_index"].item() == 1
    assert t["violation_ring"][0].tolist()[:3] == [int(kc.LaunchTag.TAIL_K_FULL), 6, 2]
    assert ring_rows(ctx)[0][7] == 1


def test_torch_scatter_in_place():
    pool = torch.full((3, 4), -1, dtype=torch.int32)
    kc.scatter_req_token_ids(flat_in=torch.arange(5, dtype=torch.int64), offsets=torch.tensor([0, 2, 5]),
                             req_pool_indices=torch.tensor([2, 1]), pool_out=pool)
    assert pool.tolist() == [[-1] * 4, [2, 3, 4, -1], [0, 1, -1, -1]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("strided", [False, True])
def test_torch_source_dtypes(dtype, strided):
    """A KV pool of any dtype, [rows, heads, head_dim] and optionally with padded rows, hashes the same
    bytes as its NumPy byte view."""
    torch_dtype = getattr(torch, dtype, None)
    if torch_dtype is None:
        pytest.skip(f"torch has no {dtype}")
    rng = np.random.default_rng(3)
    rows, bpt = 8, 64
    pad = 32 if strided else 0
    raw = rng.integers(1, 256, size=(rows, bpt + pad), dtype=np.uint8)
    parent = torch.from_numpy(raw.copy()).view(torch_dtype)
    itemsize = parent.element_size()
    tensor = parent[:, :bpt // itemsize].reshape(rows, 2, bpt // itemsize // 2) if not strided else \
        parent[:, :bpt // itemsize].unflatten(1, (2, bpt // itemsize // 2))
    source = kc.RealKvSource(tensor=tensor, page_size=1, num_bytes_per_token=bpt, read_bytes=48)
    assert source.row_stride_bytes == bpt + pad
    _, ctx = _torch_ctx(rows, real_kv_sources=(source,), hash_mode=kc.HashMode.ALL)
    kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1), tag=0,
             input_ids=torch.tensor([1, 2]), positions=torch.tensor([0, 1]), out_cache_loc=torch.tensor([3, 7]))
    spec = SourceSpec(raw[:, :bpt], 1, bpt, 48)
    for slot in (3, 7):
        assert fields(ctx.canary_buf, slot)[3] == expected_kv_hash([spec], kc.HashMode.ALL, slot)
    # Changing the caller's tensor changes what verify sees (the view is zero-copy).
    vplan = kc.VerifyPlan(slot_indices=torch.tensor([3, 7]), expected_tokens=torch.tensor([-1, -1]),
                          expected_positions=torch.tensor([0, 1]), prev_slot_indices=torch.tensor([-1, 3]),
                          num_valid=torch.tensor([2], dtype=torch.int32), enable=torch.tensor([1], dtype=torch.int32))
    kc.verify(ctx, vplan, tag=0)
    assert ctx.violations().total == 0
    parent.view(torch.uint8)[7, 5] ^= 0x11
    kc.verify(ctx, vplan, tag=0)
    assert [(r[1], r[7]) for r in ring_rows(ctx)] == [(7, 4)]


def test_torch_tensor_requiring_grad_refused():
    """A tensor that PyTorch will not export (it requires grad) is refused with the package's message."""
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource\.tensor cannot be shared through DLPack: .*"
                                         r"require.*grad"):
        kc.RealKvSource(tensor=torch.zeros(8, 16, requires_grad=True), page_size=1, num_bytes_per_token=64,
                        read_bytes=64)


def _ctx_state(ctx):
    return [a.copy() for a in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index,
                               ctx.slot_run_counter, ctx.kernel_run_counter)]


def test_tensor_with_its_negative_bit_set_is_refused():
    """A lazily negated tensor (``x.conj().imag``, ``_neg_view``) keeps its values negated only in
    torch's view of it: DLPack exports the memory un-negated, so an op would read the other sign.
    Refused, whatever its dtype (bfloat16 too, viewed as raw bytes), and nothing is written."""
    negated = torch.arange(1, 5, dtype=torch.int64)._neg_view()
    assert negated.is_neg() and negated.tolist() == [-1, -2, -3, -4]
    ctx = kc.CanaryContext.allocate(8)
    before = _ctx_state(ctx)
    ones = np.ones(4, np.int64)
    with pytest.raises(ValueError, match=r"^kv-canary: input_ids must hold its values in memory, got a torch tensor "
                                         r"with its negative bit set .*resolve_neg\(\)"):
        kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 4], seed_slot_indices=[-1], num_valid_reqs=1), tag=0,
                 input_ids=negated, positions=np.arange(4), out_cache_loc=ones * 3)
    assert all((a == b).all() for a, b in zip(before, _ctx_state(ctx)))
    kv = torch.zeros((8, 16), dtype=torch.complex64).conj().imag
    for tensor in (kv, kv.to(torch.bfloat16)._neg_view()):
        assert tensor.is_neg()
        with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource\.tensor must hold its values in memory"):
            kc.RealKvSource(tensor=tensor, page_size=1, num_bytes_per_token=16, read_bytes=16)
    counter = torch.zeros(1, dtype=torch.int64)._neg_view()
    with pytest.raises(ValueError, match=r"^kv-canary: kernel_run_counter must hold its values in memory"):
        kc.CanaryContext(canary_buf=np.zeros((8, 32), np.uint8), violation_ring=np.zeros((4, 8), np.int64),
                         violation_write_index=np.zeros(1, np.int32), slot_run_counter=np.zeros(1, np.int64),
                         kernel_run_counter=counter, chain_position_assert=np.zeros(1, np.int32))


def test_efficient_zero_tensor_is_refused():
    """An efficient zero tensor (autograd makes them) has no memory: DLPack exports a buffer of
    whatever bytes it finds, not its zeros, and what an op stores there nothing sees. Refused."""
    zeros = torch._efficientzerotensor(3, dtype=torch.int64)
    assert zeros._is_zerotensor() and zeros.data_ptr() == 0
    vplan, wplan = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(3)
    before = [a.copy() for a in (vplan.num_valid, vplan.enable, wplan.offsets, wplan.num_valid_reqs)]
    with pytest.raises(ValueError, match=r"^kv-canary: prefix_lens must hold its values in memory, got a torch "
                                         r"efficient zero tensor"):
        kc.plan(vplan, wplan, req_pool_indices=np.array([1, 2, 3]), prefix_lens=zeros,
                extend_seq_lens=np.ones(3, np.int64), req_to_token=np.zeros((4, 4), np.int32))
    assert all((a == b).all() for a, b in zip(before, (vplan.num_valid, vplan.enable, wplan.offsets,
                                                       wplan.num_valid_reqs)))
    with pytest.raises(ValueError, match=r"^kv-canary: slot_run_counter must hold its values in memory"):
        kc.CanaryContext(canary_buf=np.zeros((8, 32), np.uint8), violation_ring=np.zeros((4, 8), np.int64),
                         violation_write_index=np.zeros(1, np.int32),
                         slot_run_counter=torch._efficientzerotensor(1, dtype=torch.int64),
                         kernel_run_counter=np.zeros(1, np.int64), chain_position_assert=np.zeros(1, np.int32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_zero_d_tensor_of_a_dtype_numpy_lacks_is_a_shape_error(dtype):
    """A 0-d tensor of a dtype NumPy cannot express is refused as a 0-d NumPy array is: a ValueError
    that shows the shape received, and nothing is written."""
    torch_dtype = getattr(torch, dtype, None)
    if torch_dtype is None:
        pytest.skip(f"torch has no {dtype}")
    scalar = torch.zeros((), dtype=torch.float32).to(torch_dtype)
    with pytest.raises(ValueError, match=rf"^kv-canary: RealKvSource\.tensor must be an array with at least one "
                                         rf"dimension, got shape \(\) \(a 0-d {dtype} array\)$"):
        kc.RealKvSource(tensor=scalar, page_size=1, num_bytes_per_token=16, read_bytes=16)
    ctx = kc.CanaryContext.allocate(8)
    before = [a.copy() for a in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index,
                                 ctx.slot_run_counter, ctx.kernel_run_counter)]
    with pytest.raises(ValueError, match=r"^kv-canary: input_ids must be an array with at least one dimension, "
                                         r"got shape \(\)"):
        kc.write(ctx, kc.WritePlan.allocate(1), tag=0, input_ids=scalar, positions=np.zeros(1, np.int64),
                 out_cache_loc=np.zeros(1, np.int64))
    assert all(np.array_equal(a, b) for a, b in zip(before, (ctx.canary_buf, ctx.violation_ring,
               ctx.violation_write_index, ctx.slot_run_counter, ctx.kernel_run_counter)))


def test_generic_dlpack_objects():
    buf = np.zeros((6, 32), np.uint8)
    ctx = kc.CanaryContext(canary_buf=DLPackOnly(buf), violation_ring=DLPackOnly(np.zeros((4, 8), np.int64)),
                           violation_write_index=DLPackOnly(np.zeros(1, np.int32)),
                           slot_run_counter=DLPackOnly(np.zeros(1, np.int64)),
                           kernel_run_counter=DLPackOnly(np.zeros(1, np.int64)),
                           chain_position_assert=DLPackOnly(np.zeros(1, np.int32)))
    a = lambda v: DLPackOnly(np.array(v, dtype=np.int64))  # noqa: E731
    kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1), tag=0,
             input_ids=a([5, 6]), positions=a([0, 1]), out_cache_loc=a([2, 4]))
    assert buf.view(np.int64)[4, 0] == 6
    assert buf.view(np.int64)[4, 2] == link_of(buf, 2)
    assert buf.view(np.int64)[2, 2] == signed(0xDE7FAE23A9A1B716)



def _optional_arrays_run(wrap):
    """A write whose second entry is not what the engine meant (one input-assert row), then a plan
    with a SWA window and expected tokens; every array given through ``wrap``."""
    a = lambda v: wrap(np.array(v, dtype=np.int64))  # noqa: E731
    ctx = kc.CanaryContext.allocate(8, device="cpu")
    kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1), tag=0,
             input_ids=a([5, 6]), positions=a([0, 1]), out_cache_loc=a([2, 4]),
             expected_input_tokens=a([5, 7]), expected_input_positions=a([0, 1]))
    vplan, wplan = kc.VerifyPlan.allocate(8), kc.WritePlan.allocate(1)
    kc.plan(vplan, wplan, req_pool_indices=a([1]), prefix_lens=a([2]), extend_seq_lens=a([1]),
            req_to_token=wrap(np.array([[0, 0, 0, 0], [2, 4, 6, 0]], np.int32)), swa_window_size=2,
            full_to_swa_index_mapping=a([7, 6, 5, 4, 3, 2, 1, 0]),
            req_to_verify_expected_tokens=wrap(np.array([[0, 0, 0, 0], [5, 9, 0, 0]], np.int32)),
            req_to_verify_expected_tokens_valid_lens=a([2]))
    return ring_rows(ctx), [np.asarray(x).tolist() for x in plan_arrays(vplan, wplan)]


def test_generic_dlpack_objects_as_the_optional_arrays():
    """The optional arrays (write's expected inputs, plan's LUT and expected tokens) are taken from
    any DLPack object as the required ones are."""
    rows, plans = _optional_arrays_run(DLPackOnly)
    assert [row[:5] for row in rows] == [(0, 4, 1, 6, 7)]
    assert plans[:6] == [[5, 3, 0, 0, 0, 0, 0, 0], [5, 9, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0],
                         [-1, 5, 0, 0, 0, 0, 0, 0], [2], [1]]
    assert (rows, plans) == _optional_arrays_run(lambda array: array)

def test_numpy_in_place():
    ring = np.zeros((2, 8), np.int64)
    ctx = kc.CanaryContext(canary_buf=np.zeros((4, 32), np.uint8), violation_ring=ring,
                           violation_write_index=np.zeros(1, np.int32), slot_run_counter=np.zeros(1, np.int64),
                           kernel_run_counter=np.zeros(1, np.int64), chain_position_assert=np.zeros(1, np.int32))
    assert np.shares_memory(ctx.violation_ring, ring)
    kc.verify(ctx, kc.VerifyPlan(slot_indices=np.array([9]), expected_tokens=np.array([-1]),
                                 expected_positions=np.array([4]), prev_slot_indices=np.array([-1]),
                                 num_valid=np.array([1], np.int32), enable=np.array([1], np.int32)), tag=3)
    assert ring[0].tolist() == [3, 9, 4, 0, -1, 0, 0, 64]


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # NumPy's word on its matrix class
def test_numpy_subclasses_in_place(tmp_path):
    """A masked array, a matrix and a memmap are taken as the plain arrays of their memory (as DLPack
    exports them): ops run on them and write into them, where the backend would otherwise refuse
    the subclass's type and a matrix canary would index its slots as no other array does."""
    buf = np.asmatrix(np.zeros((4, 32), np.uint8))
    ring = np.memmap(tmp_path / "ring", dtype=np.int64, mode="w+", shape=(2, 8))
    ctx = kc.CanaryContext(canary_buf=buf, violation_ring=ring, violation_write_index=np.zeros(1, np.int32),
                           slot_run_counter=np.zeros(1, np.int64), kernel_run_counter=np.zeros(1, np.int64),
                           chain_position_assert=np.zeros(1, np.int32))
    masked = lambda values: np.ma.array(np.array(values, np.int64), mask=[False] * len(values))  # noqa: E731
    kc.write(ctx, kc.WritePlan.from_host(offsets=[0, 2], seed_slot_indices=[-1], num_valid_reqs=1), tag=0,
             input_ids=masked([5, 6]), positions=masked([0, 1]), out_cache_loc=masked([2, 9]))
    assert np.asarray(buf).view(np.int64)[2, 0] == 5 and ctx.slot_fields(2)["token"] == 5
    row = ring[0].tolist()  # slot 9, past the canary's 4, recorded in the memmap
    assert row[:5] == [0, 9, 1, 6, 6] and row[6:] == [1, 64] and int(ctx.violation_write_index[0]) == 1


# --- devices ---------------------------------------------------------------------------------------

MIXED = [
    ("VerifyPlan", lambda: kc.VerifyPlan(slot_indices=np.zeros(4, np.int64), expected_tokens=FakeCuda(),
                                         expected_positions=np.zeros(4, np.int64),
                                         prev_slot_indices=np.zeros(4, np.int64), num_valid=np.zeros(1, np.int32),
                                         enable=np.zeros(1, np.int32))),
    ("WritePlan", lambda: kc.WritePlan(offsets=np.zeros(3, np.int64), seed_slot_indices=np.zeros(2, np.int64),
                                       num_valid_reqs=FakeCuda())),
    ("CanaryContext", lambda: kc.CanaryContext(canary_buf=np.zeros((4, 32), np.uint8),
                                               violation_ring=np.zeros((4, 8), np.int64),
                                               violation_write_index=np.zeros(1, np.int32),
                                               slot_run_counter=FakeCuda(), kernel_run_counter=np.zeros(1, np.int64),
                                               chain_position_assert=np.zeros(1, np.int32))),
    ("write", lambda: kc.write(kc.CanaryContext.allocate(4), kc.WritePlan.allocate(1), tag=0,
                               input_ids=np.zeros(2, np.int64), positions=FakeCuda(),
                               out_cache_loc=np.zeros(2, np.int64))),
    ("plan", lambda: kc.plan(kc.VerifyPlan.allocate(4), kc.WritePlan.allocate(1), req_pool_indices=np.zeros(1, np.int64),
                             prefix_lens=np.zeros(1, np.int64), extend_seq_lens=np.zeros(1, np.int64),
                             req_to_token=FakeCuda())),
    ("scatter", lambda: kc.scatter_req_token_ids(flat_in=np.zeros(4, np.int64), offsets=np.zeros(2, np.int64),
                                                 req_pool_indices=np.zeros(1, np.int64), pool_out=FakeCuda())),
]


@pytest.mark.parametrize("name,call", MIXED, ids=[m[0] for m in MIXED])
def test_mixed_devices_refused(name, call):
    with pytest.raises(ValueError, match=r"^kv-canary: all arrays of one call must be on one device, got .* on "
                                         r"(cpu|cuda:0) and .* on (cpu|cuda:0)"):
        call()


def test_unsupported_device_type():
    class OnVulkan:
        def __dlpack_device__(self):
            return (7, 0)

    with pytest.raises(ValueError, match=r"^kv-canary: input_ids lives on an unsupported DLPack device type 7"):
        kc.write(kc.CanaryContext.allocate(4), kc.WritePlan.allocate(1), tag=0, input_ids=OnVulkan(),
                 positions=np.zeros(0, np.int64), out_cache_loc=np.zeros(0, np.int64))


def test_not_an_array():
    with pytest.raises(TypeError, match=r"^kv-canary: pool_out must be an array supporting DLPack"):
        kc.scatter_req_token_ids(flat_in=np.zeros(4, np.int64), offsets=np.zeros(2, np.int64),
                                 req_pool_indices=np.zeros(1, np.int64), pool_out=[[0]])


class _DeviceOnly:
    """Names a host DLPack device but cannot export its memory (no ``__dlpack__``)."""

    shape = (1,)

    def __dlpack_device__(self):
        return (1, 0)


class _NoCapsule(_DeviceOnly):
    """Answers ``__dlpack__`` with something that is no DLPack capsule."""

    def __dlpack__(self, **kwargs):
        return None


@pytest.mark.parametrize("obj,exc,pattern", [
    (_DeviceOnly(), TypeError, r"^kv-canary: input_ids must be an array supporting DLPack .*got _DeviceOnly, which "
                               r"has __dlpack_device__ but no __dlpack__$"),
    (_NoCapsule(), ValueError, r"^kv-canary: input_ids must export a DLPack capsule from __dlpack__\(\), got NoneType"),
])
def test_half_a_dlpack_protocol_is_refused_with_the_packages_message(obj, exc, pattern):
    """An object that speaks half of DLPack is refused under its argument's name (not with a raw
    AttributeError or ctypes ValueError), and nothing is written."""
    ctx = kc.CanaryContext.allocate(16)
    wplan = kc.WritePlan.from_host(offsets=np.array([0, 1]), seed_slot_indices=np.array([-1]), num_valid_reqs=1)
    before = [a.copy() for a in (ctx.canary_buf, ctx.violation_write_index, ctx.kernel_run_counter)]
    with pytest.raises(exc, match=pattern):
        kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=obj, positions=np.array([0]),
                 out_cache_loc=np.array([3]))
    assert all(np.array_equal(a, b) for a, b in zip(before, (ctx.canary_buf, ctx.violation_write_index,
                                                             ctx.kernel_run_counter)))
    with pytest.raises(exc, match=pattern.replace("input_ids", r"RealKvSource\.tensor")):
        kc.RealKvSource(tensor=obj, page_size=1, num_bytes_per_token=16, read_bytes=16)


def test_a_tensor_without_a_dlpack_device_is_named():
    """A torch meta tensor has no memory and no DLPack device: refused under its argument's name."""
    torch = pytest.importorskip("torch")
    ctx = kc.CanaryContext.allocate(16)
    wplan = kc.WritePlan.from_host(offsets=np.array([0, 1]), seed_slot_indices=np.array([-1]), num_valid_reqs=1)
    before = ctx.canary_buf.copy()
    with pytest.raises(ValueError, match=r"^kv-canary: input_ids has no DLPack device \(only host memory and CUDA "):
        kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=torch.empty(1, dtype=torch.int64, device="meta"),
                 positions=np.array([0]), out_cache_loc=np.array([3]))
    assert np.array_equal(ctx.canary_buf, before)


def test_a_negative_device_index_is_refused():
    with pytest.raises(ValueError, match=r"^kv-canary: device index must be non-negative, got -1"):
        kc.CanaryContext.allocate(4, device=-1)


class _PinnedHost:
    """Host memory that names DLPack's CUDA-host device type (pinned memory, as torch's
    ``pin_memory()`` tensors do)."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return (3, 0)

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__()


def test_pinned_host_memory_is_host_memory():
    kv = np.random.default_rng(41).standard_normal((6, 2, 8)).astype(np.float32)
    source = kc.RealKvSource(tensor=_PinnedHost(kv), page_size=1, num_bytes_per_token=64, read_bytes=64)
    assert source.device == kc._dlpack.CPU and source.num_rows == 6
    assert source.base_address == kv.ctypes.data


def test_a_torch_device_is_read_as_its_string():
    """A torch engine passes its tensors' ``.device``: read as "cpu" or "cuda:N" are, and a device
    the package has no backend for is refused under the argument's name."""
    from kvcanary_cupy._dlpack import Device, parse_device
    kv = torch.zeros((8, 16), dtype=torch.uint8)
    ctx = kc.CanaryContext.allocate(8, device=kv.device)
    assert ctx.canary_buf.shape == (8, 32) and isinstance(ctx.canary_buf, np.ndarray)
    assert parse_device(torch.device("cuda", 1)) == Device("cuda", 1)
    with pytest.raises(ValueError, match=r"^kv-canary: device must be a torch.device of type 'cpu' or 'cuda', "
                                         r"got device\(type='meta'\)"):
        kc.CanaryContext.allocate(8, device=torch.device("meta"))


def test_only_a_torch_device_is_read_as_one():
    """Another torch object (a tensor) or another library's class named ``device`` is no device form,
    whatever attributes it has."""
    from kvcanary_cupy._dlpack import parse_device
    look_alike = type("device", (), {"type": "cpu", "index": None, "__str__": lambda self: "cpu"})()
    for spec in (torch.zeros(1), look_alike):
        with pytest.raises(TypeError, match=r"^kv-canary: device must be 'cpu', 'cuda', 'cuda:N', an int or a "
                                            r"torch\.device, got "):
            parse_device(spec)


@pytest.mark.skipif(kc._dlpack.cupy_module() is not None, reason="CuPy is installed")
def test_an_array_of_the_cuda_array_interface_alone_needs_cupy():
    """An object with only ``__cuda_array_interface__`` (a numba device array's form) is a CUDA array:
    without CuPy that is what the refusal says, not that it is no array."""
    class InterfaceOnly:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<i8", "data": (1 << 20, False), "version": 3}

    with pytest.raises(RuntimeError, match=r"^kv-canary: input_ids: a CUDA device needs CuPy"):
        kc.write(kc.CanaryContext.allocate(4), kc.WritePlan.allocate(1), tag=0, input_ids=InterfaceOnly(),
                 positions=np.zeros(4, np.int64), out_cache_loc=np.zeros(4, np.int64))


def test_a_torch_cuda_device_without_an_index_is_torchs_current_device(monkeypatch):
    """torch.device("cuda") means torch's current device (torch.cuda.set_device), which need not be
    CuPy's; where torch cannot say which (no CUDA in its build, no GPU), CuPy's current device, as
    for the string "cuda"."""
    from kvcanary_cupy._dlpack import Device, parse_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert parse_device(torch.device("cuda")) == Device("cuda", 3)
    assert parse_device(torch.device("cuda", 1)) == Device("cuda", 1)
    assert parse_device("cuda") == Device("cuda", kc._dlpack._current_cuda_device())

    def no_cuda():
        raise AssertionError("Torch not compiled with CUDA enabled")
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert parse_device(torch.device("cuda")) == parse_device("cuda")


def test_managed_memory_is_its_cuda_devices():
    """DLPack's CUDA-managed device type (unified memory, 13) names a CUDA device's array."""
    with pytest.raises(ValueError, match=r"^kv-canary: .* on cuda:1 and .* on cpu|^kv-canary: .* on cpu and .* "
                                         r"on cuda:1"):
        kc.write(kc.CanaryContext.allocate(4), kc.WritePlan.allocate(1), tag=0, input_ids=FakeCuda((13, 1)),
                 positions=np.zeros(4, np.int64), out_cache_loc=np.zeros(4, np.int64))


@pytest.mark.skipif(kc._dlpack.cupy_module() is not None, reason="CuPy is installed")
def test_a_cuda_device_without_cupy_is_a_bad_device_value():
    """SPEC 4: a device the machine cannot serve is a bad value (ValueError), as well as a missing
    part of the environment (RuntimeError)."""
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match=r"^kv-canary: device: a CUDA device needs CuPy"):
            kc.CanaryContext.allocate(4, device="cuda:0")


def test_cuda_devices_the_package_counts_are_those_cupy_counts():
    """The GPU tests run where the package counts a CUDA device (``_devices.HAS_CUDA``): a count of 0
    where CuPy sees GPUs would skip them all, and nothing would fail."""
    cupy = pytest.importorskip("cupy")
    try:
        seen = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CuPy without a driver or a device
        seen = 0
    assert kc._dlpack.cuda_device_count() == seen


def test_a_failing_import_is_told_apart_from_a_missing_module():
    from kvcanary_cupy._dlpack import error_text, installed_but_failing
    missing = ModuleNotFoundError("No module named 'numba'", name="numba")
    dependency = ModuleNotFoundError("No module named 'llvmlite'", name="llvmlite")
    assert installed_but_failing(None, "numba") is None
    assert installed_but_failing(missing, "numba") is None  # not installed: advise an install
    assert installed_but_failing(dependency, "numba") == "No module named 'llvmlite'"
    assert installed_but_failing(ImportError("numba needs NumPy <= 2.1"), "numba") == "numba needs NumPy <= 2.1"
    assert error_text(ImportError("  ")) == "ImportError" and error_text(OSError()) == "OSError"


def test_a_last_dimension_of_one_element_has_no_stride_to_keep():
    """A tensor of a dtype NumPy lacks is viewed as bytes only where its last dimension is
    contiguous; a last dimension of one element is, whatever stride it is given."""
    from kvcanary_cupy._dlpack import native_view
    parent = torch.from_numpy(np.random.default_rng(43).integers(1, 2**15, size=(6, 4), dtype=np.int16))
    column = parent.view(torch.bfloat16)[:, 1::4]  # shape (6, 1), strides (4, 4)
    view = native_view(column, "tensor")
    assert view.shape == (6, 2) and (view.view(np.int16)[:, 0] == parent[:, 1].numpy()).all()
    with pytest.raises(ValueError, match=r"^kv-canary: tensor must have a contiguous last dimension, got strides "
                                         r"\[8, 4\] in bytes"):
        native_view(parent.view(torch.bfloat16)[:, ::2], "tensor")  # shape (6, 2), strides (4, 2)


class _HandMade:
    """A producer that exports a DLPack tensor over ``array``'s bytes as it is told to: any type
    code and bits, no strides (row-major) and a byte offset."""

    def __init__(self, array, shape, *, code, bits, byte_offset=0, lanes=1):
        import ctypes
        from kvcanary_cupy import _dlpack as D
        self.array, self.ndim = array, len(shape)
        self.shape_cells = (ctypes.c_int64 * len(shape))(*shape)
        self.managed = D._DLManagedTensor()
        tensor = self.managed.dl_tensor
        tensor.data, tensor.ndim, tensor.byte_offset = array.ctypes.data, len(shape), byte_offset
        tensor.device.device_type, tensor.device.device_id = 1, 0
        tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = code, bits, lanes
        tensor.shape = self.shape_cells
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self._new = new

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        import ctypes
        return self._new(ctypes.addressof(self.managed), b"dltensor", None)


def test_a_hand_made_dlpack_tensor_is_viewed_at_its_offset_and_row_major():
    from kvcanary_cupy._dlpack import byte_view_dtype, native_view
    raw = np.random.default_rng(105).integers(1, 256, size=64, dtype=np.uint8)
    view = native_view(_HandMade(raw, (3, 2, 4), code=4, bits=16, byte_offset=8), "tensor")  # bfloat16
    assert view.shape == (3, 2, 8) and (view == raw[8:56].reshape(3, 2, 8)).all()
    assert byte_view_dtype(view) == "bfloat16"
    assert byte_view_dtype(native_view(_HandMade(raw, (4,), code=99, bits=8), "tensor")) == \
        "DLPack type code 99 of 8 bits"
    with pytest.raises(TypeError, match=r"^kv-canary: tensor must have elements of whole bytes \(at least one\), got a "
                                        r"DLPack dtype of 0 bits x 1 lanes"):
        native_view(_HandMade(raw, (4,), code=4, bits=0), "tensor")


def test_a_dlpack_dtype_of_several_lanes_is_viewed_as_its_lanes_bytes_together():
    """A vector dtype (DLPack's lanes: e.g. two 16-bit floats an element) has elements of lanes x
    bits: its byte view is 4 bytes an element, and 4-bit values two lanes to an element are whole
    bytes."""
    from kvcanary_cupy._dlpack import native_view
    raw = np.random.default_rng(106).integers(1, 256, size=64, dtype=np.uint8)
    view = native_view(_HandMade(raw, (3, 4), code=2, bits=16, lanes=2), "tensor")
    assert view.shape == (3, 16) and (view == raw[:48].reshape(3, 16)).all()
    packed = native_view(_HandMade(raw, (2, 8), code=1, bits=4, lanes=2), "tensor")
    assert packed.shape == (2, 8) and (packed == raw[:16].reshape(2, 8)).all()


@pytest.mark.parametrize("code, bits", [(17, 4), (15, 6), (16, 6), (1, 12)])
def test_a_dlpack_dtype_of_part_bytes_is_refused(code, bits):
    """Values of fewer bits than a byte (4-bit and 6-bit floats) may be packed several to a byte,
    which a shape alone does not say: a view by the shape could reach past the data, so such a
    dtype is refused and a uint8 view of the bytes asked for."""
    from kvcanary_cupy._dlpack import native_view
    raw = np.random.default_rng(code).integers(1, 256, size=8, dtype=np.uint8)
    with pytest.raises(TypeError, match=rf"^kv-canary: tensor must have elements of whole bytes \(at least one\), "
                                        rf"got a DLPack dtype of {bits} bits x 1 lanes \(pass a uint8 view"):
        native_view(_HandMade(raw, (16,), code=code, bits=bits), "tensor")


class _CudaRuntimeStandIn:
    """Stands in for CuPy's CUDA runtime: records the event calls, and which streams capture."""

    eventDisableTiming = 2

    class CUDARuntimeError(Exception):
        pass

    def __init__(self, capturing=(), unaskable=()):
        self.calls, self.capturing, self.unaskable = [], set(capturing), set(unaskable)

    def streamIsCapturing(self, stream):
        if stream in self.unaskable:
            raise self.CUDARuntimeError("operation not permitted when stream is capturing")
        return 1 if stream in self.capturing else 0

    def eventCreateWithFlags(self, flags):
        self.calls.append(("create", flags))
        return "event"

    def eventRecord(self, event, stream):
        self.calls.append(("record", stream))

    def streamWaitEvent(self, stream, event):
        self.calls.append(("wait", stream))

    def eventDestroy(self, event):
        self.calls.append(("destroy",))


@pytest.mark.parametrize("producer, consumer, runtime_kw, ordered", [
    (7, 7, {}, False),  # one stream both name
    (0, 0, {}, False),
    (0, 1, {}, False),  # the legacy default under its two handles
    (1, 0, {}, False),
    (7, 0, {}, True),
    (0, 7, {}, True),
    (7, 9, {}, True),
    (7, 9, {"capturing": {9}}, False),  # inside a capture the caller orders its streams
    (7, 9, {"capturing": {7}}, False),
    (7, 0, {"unaskable": {0}}, False),  # the legacy stream while a blocking stream captures
], ids=["same", "legacy", "legacy-0-1", "legacy-1-0", "side-to-legacy", "legacy-to-side", "two-streams",
        "consumer-capturing", "producer-capturing", "legacy-unaskable"])
def test_cupy_is_ordered_after_torch_with_an_event_only_between_two_streams_neither_capturing(
        monkeypatch, producer, consumer, runtime_kw, ordered):
    """The order DLPack's exchange makes between torch's current stream and CuPy's, decided on the
    host (CuPy and torch stood in for): an event recorded on torch's stream and waited for on CuPy's,
    on the tensor's device, only where the two are different streams and neither captures a graph.
    A view is taken every forward, so an event that orders nothing costs host time for nothing."""
    import contextlib
    import types

    from kvcanary_cupy import _dlpack

    runtime = _CudaRuntimeStandIn(**runtime_kw)
    asked = []

    def current_stream(index):
        asked.append(("cupy", index))
        return types.SimpleNamespace(ptr=consumer)

    def device(index):
        asked.append(("device", index))
        return contextlib.nullcontext()

    def torch_stream(index):
        asked.append(("torch", index))
        return producer

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, get_current_stream=current_stream,
                                                            Device=device))
    monkeypatch.setattr(_dlpack, "cupy_module", lambda: cupy)
    monkeypatch.setattr(_dlpack, "_torch_current_stream", torch_stream)
    _dlpack.order_after_torch(3)
    expected = [("create", 2), ("record", producer), ("wait", consumer), ("destroy",)] if ordered else []
    assert runtime.calls == expected
    assert set(asked) == ({("cupy", 3), ("torch", 3), ("device", 3)} if ordered else {("cupy", 3), ("torch", 3)})


def test_a_stream_captures_only_where_cupy_says_so_and_the_cpus_none_never(monkeypatch):
    """Whether an op's resolved stream is capturing a CUDA graph, as CuPy's runtime answers for its
    handle (stood in for here); the CPU's ``None`` stream never is, and without CuPy nothing is."""
    import types

    from kvcanary_cupy import _dlpack

    runtime = _CudaRuntimeStandIn(capturing={7}, unaskable={0})
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(_dlpack, "cupy_module", lambda: cupy)
    assert [_dlpack.stream_capturing(types.SimpleNamespace(ptr=ptr)) for ptr in (7, 9, 0)] == [True, False, True]
    assert _dlpack.stream_capturing(None) is False
    monkeypatch.setattr(_dlpack, "cupy_module", lambda: None)
    assert _dlpack.stream_capturing(types.SimpleNamespace(ptr=7)) is False
    assert runtime.calls == []


def test_which_torch_tensors_are_viewed_from_their_attributes():
    """The in-place view of a torch tensor (what CUDA tensors take instead of DLPack's exchange) is
    for a dtype CuPy has, strided, with elements and memory, and nothing DLPack would refuse to
    export: no grad, no lazy conjugate or negation. The rule reads attributes only, so CPU tensors
    show it; every other tensor goes through DLPack, which decides."""
    from kvcanary_cupy._dlpack import _torch_viewable

    plain = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    viewable = [plain, plain[:, 1:3], plain.t(), torch.ones(3, dtype=torch.bool), torch.randn(5).half()]
    complex_values = torch.randn(4, dtype=torch.complex64)
    others = {"bfloat16": torch.randn(4).bfloat16(),
              "complex": complex_values,
              "lazy conjugate": complex_values.conj(),
              "lazy negation": torch._neg_view(torch.arange(4.0)),
              "requires grad": torch.randn(4, requires_grad=True),
              "sparse": plain.to_sparse(),
              "empty": plain[2:2],
              "no elements of a shape": torch.zeros((0, 4), dtype=torch.int64)}
    assert [_torch_viewable(t) for t in viewable] == [True] * len(viewable)
    assert {name: _torch_viewable(t) for name, t in others.items()} == dict.fromkeys(others, False)
