"""kc.copy_records: slots' records carried to other slots, of another canary on any device, as
their KV moves (a host-memory tier and back): the destination then verifies the moved KV against
the hashes it had when it was written, and its chain and positions as before."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from _builders import snapshot
from kvcanary_cupy._dlpack import cuda_device_count, from_host, parse_device
from kvcanary_cupy.ops.batches import RecordCopy
from kvcanary_cupy.ops.copy_records import run_record_copy, stored_destinations
from _devices import HAS_CUDA, requires_gpu, to_device, to_numpy

ALL = kc.HashMode.ALL
TAIL = kc.LaunchTag.TAIL_K_FULL
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA device")]
# (source tier, destination tier): every pair of backends
TIERS = [("cpu", "cpu"), pytest.param("cuda", "cpu", marks=_GPU), pytest.param("cpu", "cuda", marks=_GPU),
         pytest.param("cuda", "cuda", marks=_GPU)]
I64 = np.int64


def _put(array: np.ndarray, device: str):
    """``array`` on ``device`` ("cpu", "cuda" or "cuda:N")."""
    return from_host(array, parse_device(device))


def _i64(values, device):
    return _put(np.asarray(values, I64), device)


class _Tier:
    """A KV pool of ``slots`` slots (one layer of K, 64 bytes a token, in pages of ``page_size``)
    and its canary, on ``device``."""

    def __init__(self, device: str, slots: int, page_size: int, seed: int):
        self.device, self.page_size = device, page_size
        self.k = to_device(np.random.default_rng(seed).standard_normal((slots // page_size, page_size, 2, 8))
                           .astype(np.float32), device)
        self.ctx = kc.CanaryContext.allocate(slots, device=device, hash_mode=ALL,
                                             real_kv_sources=kc.layouts.paged([self.k]))

    def rows(self, slots):
        """The K bytes of ``slots`` (host copies), in order."""
        k = to_numpy(self.k)
        return np.stack([k[s // self.page_size, s % self.page_size] for s in slots])

    def put(self, slots, rows) -> None:
        for slot, row in zip(slots, rows):
            self.k[slot // self.page_size, slot % self.page_size] = to_device(row, self.device)

    def write_chain(self, slots, tokens) -> None:
        """One request's tokens at positions 0.. in ``slots``, fingerprinted."""
        plan = kc.WritePlan.from_host(offsets=[0, len(slots)], seed_slot_indices=[-1], num_valid_reqs=1,
                                      device=self.device)
        kc.write(self.ctx, plan, tag=kc.LaunchTag.HEAD_K_FULL, input_ids=_i64(tokens, self.device),
                 positions=_i64(np.arange(len(slots)), self.device), out_cache_loc=_i64(slots, self.device))

    def verify_chain(self, slots) -> list:
        """Every position of one request held in ``slots`` verified: the rows, as described."""
        table = np.zeros((2, len(slots)), np.int32)
        table[1] = slots
        vplan = kc.VerifyPlan.allocate(len(slots), device=self.device)
        kc.plan(vplan, kc.WritePlan.allocate(2, device=self.device), req_pool_indices=_i64([1], self.device),
                prefix_lens=_i64([len(slots)], self.device), extend_seq_lens=_i64([0], self.device),
                req_to_token=to_device(table, self.device))
        kc.verify(self.ctx, vplan, tag=TAIL)
        rows = [(v.slot_idx, v.position, v.fail_reason) for v in self.ctx.violations()]
        self.ctx.clear_violations()
        return rows


@pytest.mark.parametrize("device, tier", TIERS)
def test_a_request_offloaded_and_loaded_back_verifies_clean_and_catches_what_changed(device, tier):
    """A request's KV and records go to slots of a host tier (another layout: pages of 4) and back
    to new slots: clean at each end; a bit flipped while offloaded is reported at its position,
    and pages loaded back out of order at theirs."""
    gpu, host = _Tier(device, 64, 1, seed=1), _Tier(tier, 48, 4, seed=2)
    rng = np.random.default_rng(3)
    slots = rng.permutation(np.arange(1, 64))[:12]
    gpu.write_chain(slots, rng.integers(0, 32_000, 12))
    assert gpu.verify_chain(slots) == []
    offloaded = rng.permutation(np.arange(1, 48))[:12]  # the host tier's slots
    host.put(offloaded, gpu.rows(slots))
    kc.copy_records(src=gpu.ctx, dst=host.ctx, src_slots=_i64(slots, device), dst_slots=_i64(offloaded, tier))
    assert host.verify_chain(offloaded) == []
    loaded = rng.permutation(np.setdiff1d(np.arange(1, 64), slots))[:12]  # new GPU slots
    gpu.put(loaded, host.rows(offloaded))
    kc.copy_records(src=host.ctx, dst=gpu.ctx, src_slots=_i64(offloaded, tier), dst_slots=_i64(loaded, device))
    assert gpu.verify_chain(loaded) == []
    assert np.array_equal(to_numpy(gpu.ctx.canary_buf)[loaded], to_numpy(gpu.ctx.canary_buf)[slots])

    flipped = host.rows(offloaded[5:6])
    flipped[0, 1, 3] += 1.0  # host memory changed while the request was offloaded
    host.put(offloaded[5:6], flipped)
    gpu.put(loaded, host.rows(offloaded))
    assert gpu.verify_chain(loaded) == [(int(loaded[5]), 5, kc.FailReason.REAL_KV_HASH)]
    swapped = loaded.copy()  # the K bytes and records of positions 8 and 9 loaded into each other's slots
    swapped[[8, 9]] = loaded[[9, 8]]
    gpu.put(swapped, host.rows(offloaded))
    kc.copy_records(src=host.ctx, dst=gpu.ctx, src_slots=_i64(offloaded, tier), dst_slots=_i64(swapped, device))
    # each of the two slots holds the other position's record (its position and the link it holds
    # are the other's) and the other's K bytes (which match that record); position 10 links to the
    # record in the slot of position 9; position 5's host bytes are still the flipped ones
    chain, position = kc.FailReason.CHAIN_HASH, kc.FailReason.POSITION
    assert sorted(gpu.verify_chain(loaded)) == sorted([
        (int(loaded[5]), 5, kc.FailReason.REAL_KV_HASH), (int(loaded[8]), 9, chain | position),
        (int(loaded[9]), 8, chain | position), (int(loaded[10]), 10, chain)])


def _random_records(device: str, slots: int, seed: int, stride: int = 32) -> kc.CanaryContext:
    """A canary of ``slots`` slots of ``stride`` bytes, every byte random (past the record too)."""
    ctx = kc.CanaryContext.allocate(slots, device=device, slot_stride_bytes=stride)
    words = np.random.default_rng(seed).integers(-2**63, 2**63 - 1, (slots, stride // 8), dtype=I64, endpoint=True)
    ctx.canary_buf[...] = _put(words.view(np.uint8).reshape(slots, stride), device)
    return ctx


def _expected(src: np.ndarray, dst: np.ndarray, src_slots, dst_slots) -> np.ndarray:
    """The destination's buffer after the copy, pair by pair (a later pair wins)."""
    out = dst.copy()
    for s, d in zip(src_slots, dst_slots):
        if 0 <= s < src.shape[0] and 0 <= d < out.shape[0]:
            out[d, :32] = src[s, :32]  # the record; the slot's bytes past it stay
    return out


@pytest.mark.parametrize("device, tier", TIERS)
def test_pairs_out_of_range_store_nothing(device, tier):
    src, dst = _random_records(device, 40, 4), _random_records(tier, 24, 5)
    src_slots = [3, -1, 40, 2**40, 7, 0, 39, 12]
    dst_slots = [5, 6, 7, 8, -1, 24, 23, 2**62]
    before = (to_numpy(src.canary_buf).copy(), to_numpy(dst.canary_buf).copy())
    kc.copy_records(src=src, dst=dst, src_slots=_i64(src_slots, device), dst_slots=_i64(dst_slots, tier))
    assert np.array_equal(to_numpy(src.canary_buf), before[0])
    assert np.array_equal(to_numpy(dst.canary_buf), _expected(*before, src_slots, dst_slots))


@pytest.mark.parametrize("device, tier", TIERS)
def test_the_destinations_a_copy_stored_are_those_of_its_pairs_in_range(device, tier):
    """What ``Canary.copy_records`` tells its poll: each pair's destination where both slots are in
    range, -1 for the pairs that stored nothing, on the destination's device."""
    src, dst = _random_records(device, 40, 4), _random_records(tier, 24, 5)
    move = RecordCopy(src=src, dst=dst, src_slots=_i64([3, -1, 40, 2**40, 7, 0, 39, 12, 0, 9], device),
                      dst_slots=_i64([5, 6, 7, 8, -1, 24, 23, 2**62, 9, 0], tier))
    stored = stored_destinations(move, run_record_copy(move))
    assert type(stored) is type(move.dst_slots) and stored is not move.dst_slots
    assert to_numpy(stored).tolist() == [5, -1, -1, -1, -1, -1, 23, -1, 9, 0]  # the padding slot like any other


@pytest.mark.parametrize("device, tier", TIERS)
def test_the_padding_slot_is_copied_like_any_other(device, tier):
    """Slot 0 lies in range (SPEC §4 bounds slots by ``[0, num_slots)``): a pair naming it as its
    source or its destination copies the record as any other pair does."""
    src, dst = _random_records(device, 16, 8), _random_records(tier, 16, 9)
    src_slots, dst_slots = [5, 0, 9], [0, 7, 3]
    before = (to_numpy(src.canary_buf).copy(), to_numpy(dst.canary_buf).copy())
    kc.copy_records(src=src, dst=dst, src_slots=_i64(src_slots, device), dst_slots=_i64(dst_slots, tier))
    assert np.array_equal(to_numpy(dst.canary_buf), _expected(*before, src_slots, dst_slots))
    assert np.array_equal(to_numpy(dst.canary_buf)[0, :32], before[0][5, :32])


def test_pairs_naming_one_destination_twice_leave_the_last_on_the_cpu():
    src, dst = _random_records("cpu", 16, 6), _random_records("cpu", 16, 7)
    kc.copy_records(src=src, dst=dst, src_slots=np.array([1, 2, 3], I64), dst_slots=np.array([9, 9, 4], I64))
    assert np.array_equal(dst.canary_buf[9], src.canary_buf[2]) and np.array_equal(dst.canary_buf[4], src.canary_buf[3])


@requires_gpu
@pytest.mark.parametrize("tier", ["cpu", "cuda"])
def test_the_gpu_copies_what_the_cpu_copies(tier):
    """Random pairs (in and out of range, no destination named twice) over wide slot strides: the
    GPU source's copy leaves the destination's bytes as the CPU's does."""
    rng = np.random.default_rng(8)
    for case in range(20):
        n = int(rng.integers(0, 1500))
        src_slots = rng.integers(-5, 1100, n)
        dst_slots = rng.permutation(np.arange(-50, 1600))[:n]
        results = []
        for device, dst_device in (("cpu", "cpu"), ("cuda", tier)):
            src = _random_records(device, 1000, case, stride=(32, 40, 64)[case % 3])
            dst = _random_records(dst_device, 1500, case + 100, stride=(48, 32, 136)[case % 3])
            kc.copy_records(src=src, dst=dst, src_slots=_i64(src_slots, device), dst_slots=_i64(dst_slots, dst_device))
            results.append(to_numpy(dst.canary_buf))
        assert np.array_equal(*results), case


@requires_gpu
def test_on_a_busy_non_blocking_stream():
    """On one GPU both launches queue on the stream given, behind its work."""
    import cupy
    from _devices import spin_kernel

    src, dst = _random_records("cuda", 64, 9), _random_records("cuda", 64, 10)
    expected = _expected(to_numpy(src.canary_buf), to_numpy(dst.canary_buf), range(1, 40), range(20, 59))
    src_slots, dst_slots = _i64(range(1, 40), "cuda"), _i64(range(20, 59), "cuda")
    # the slots were uploaded on the current stream, which a non-blocking stream does not wait for
    # (a spin alone does not order them: under time-slicing with other processes it can end first)
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin_kernel()((1,), (1,), (cupy.uint64(2_000_000),))
    kc.copy_records(src=src, dst=dst, src_slots=src_slots, dst_slots=dst_slots, stream=stream)
    stream.synchronize()
    assert np.array_equal(to_numpy(dst.canary_buf), expected)


def test_contexts_that_hash_nothing_copy_records_whatever_their_sources():
    """In mode NONE no source is read: a context with sources and one without hash a slot's KV
    alike (not at all), so records go from one to the other."""
    kv = np.random.default_rng(96).integers(1, 256, size=(8, 32), dtype=np.uint8)
    src = kc.CanaryContext.allocate(8, real_kv_sources=kc.layouts.per_layer([kv]), hash_mode=kc.HashMode.NONE)
    dst = kc.CanaryContext.allocate(8)
    src.canary_buf[3] = np.random.default_rng(97).integers(1, 256, size=32, dtype=np.uint8)
    kc.copy_records(src=src, dst=dst, src_slots=np.array([3], I64), dst_slots=np.array([5], I64))
    assert np.array_equal(dst.canary_buf[5], src.canary_buf[3])


@pytest.mark.parametrize("call, error, message", [
    (lambda s, d: kc.copy_records(src=s.canary_buf, dst=d, src_slots=np.array([1], I64), dst_slots=np.array([1], I64)),
     TypeError, r"^kv-canary: src must be a CanaryContext, got ndarray"),
    (lambda s, d: kc.copy_records(src=s, dst=d, src_slots=np.array([1], np.int32), dst_slots=np.array([1], I64)),
     TypeError, r"^kv-canary: src_slots must have dtype int64"),
    (lambda s, d: kc.copy_records(src=s, dst=d, src_slots=np.array([1, 2], I64), dst_slots=np.array([1], I64)),
     ValueError, r"^kv-canary: dst_slots must have length 2 \(one per pair, as src_slots\), got 1"),
    (lambda s, d: kc.copy_records(src=s, dst=kc.CanaryContext.allocate(8, hash_mode=kc.HashMode.NONE),
                                  src_slots=np.array([1], I64), dst_slots=np.array([1], I64)),
     ValueError, r"^kv-canary: dst must hash the KV bytes of a slot as src does .* got src \[64\] \(ALL\) and dst "
                 r"\[\] \(NONE\)"),
    (lambda s, d: kc.copy_records(src=s, dst=d, src_slots=np.array([1], I64), dst_slots=np.array([1], I64),
                                  stream="bogus"),
     TypeError, r"^kv-canary: stream must be None"),
])
def test_a_refused_copy_names_the_argument_and_changes_nothing(call, error, message):
    src, dst = _Tier("cpu", 16, 1, seed=11), _Tier("cpu", 16, 4, seed=12)
    src.write_chain(np.arange(1, 5), [7, 8, 9, 10])
    before = snapshot(src.ctx.canary_buf, dst.ctx.canary_buf)
    with pytest.raises(error, match=message):
        call(src.ctx, dst.ctx)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(src.ctx.canary_buf, dst.ctx.canary_buf)))


@requires_gpu
def test_slots_on_another_device_than_their_canary_are_refused():
    src, dst = _random_records("cuda", 16, 13), _random_records("cpu", 16, 14)
    with pytest.raises(ValueError, match=r"^kv-canary: src_slots must be on the device of src, cuda:0, got cpu"):
        kc.copy_records(src=src, dst=dst, src_slots=np.array([1], I64), dst_slots=np.array([1], I64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
def test_within_one_canary_every_record_is_read_before_any_is_stored(device):
    """Slots rotated within one pool (a compaction): each lands where the pair says, read before
    the copy overwrote it."""
    ctx = _random_records(device, 64, 15)
    before = to_numpy(ctx.canary_buf).copy()
    src_slots = np.arange(1, 41)
    dst_slots = np.roll(src_slots, 1)
    kc.copy_records(src=ctx, dst=ctx, src_slots=_i64(src_slots, device), dst_slots=_i64(dst_slots, device))
    assert np.array_equal(to_numpy(ctx.canary_buf), _expected(before, before, src_slots, dst_slots))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
def test_within_one_canary_pairs_out_of_range_store_nothing(device):
    """A copy within one buffer stages its records, and keeps the rule of a direct copy: a pair
    whose source or destination is out of range stores nothing (no zeroed record either)."""
    ctx = _random_records(device, 40, 16)
    before = to_numpy(ctx.canary_buf).copy()
    src_slots = [3, -1, 40, 2**40, 7, 0, 39, 12]
    dst_slots = [5, 6, 7, 8, -1, 24, 23, 2**62]
    kc.copy_records(src=ctx, dst=ctx, src_slots=_i64(src_slots, device), dst_slots=_i64(dst_slots, device))
    assert np.array_equal(to_numpy(ctx.canary_buf), _expected(before, before, src_slots, dst_slots))


def _views_of(base: kc.CanaryContext, firsts, slots: int) -> list:
    """Canaries over ``slots`` slots of ``base``'s buffer from each of ``firsts``, sharing its ring
    and counters."""
    return [kc.CanaryContext(canary_buf=base.canary_buf[first:first + slots], violation_ring=base.violation_ring,
                             violation_write_index=base.violation_write_index,
                             slot_run_counter=base.slot_run_counter, kernel_run_counter=base.kernel_run_counter,
                             chain_position_assert=base.chain_position_assert) for first in firsts]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
def test_two_canaries_over_overlapping_bytes_read_every_record_first(device):
    """Canaries over overlapping views of one buffer (slot i of one is slot i + 1 of the other):
    every record is read before any is stored, as within one canary."""
    base = _random_records(device, 40, 16)
    rows = base.canary_buf
    views = _views_of(base, (0, 1), 32)
    before = to_numpy(rows).copy()
    slots = np.arange(0, 31)
    kc.copy_records(src=views[0], dst=views[1], src_slots=_i64(slots, device), dst_slots=_i64(slots, device))
    expected = before.copy()
    expected[1:32] = before[0:31]
    assert np.array_equal(to_numpy(rows), expected)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_GPU)])
@pytest.mark.parametrize("same_canary", [False, True])
@pytest.mark.parametrize("name", ["src_slots", "dst_slots"])
def test_slots_over_the_destination_buffer_are_refused(device, same_canary, name):
    """Slots read from the bytes the copy stores into would change as it reads them (a pair's
    record landing over the slots of the pairs after it): refused, and nothing is stored."""
    src = _random_records(device, 16, 20)
    dst = src if same_canary else _random_records(device, 16, 21)
    words = dst.canary_buf.view(I64).reshape(-1)
    words[4:8] = _i64([1, 2, 3, 4], device)  # slot 1's record: pair 0 stores over the slots of pairs 1-3
    slots = {"src_slots": _i64([5, 6, 7, 8], device), "dst_slots": _i64([5, 6, 7, 8], device)}
    slots[name] = words[4:8]
    before = snapshot(src.canary_buf, dst.canary_buf)
    with pytest.raises(ValueError, match=rf"^kv-canary: dst canary_buf and {name} must not share memory "
                                         rf"\(dst canary_buf is stored into\), got bytes"):
        kc.copy_records(src=src, dst=dst, **slots)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(src.canary_buf, dst.canary_buf)))


@requires_gpu
def test_a_staged_copy_is_refused_while_its_stream_captures():
    import cupy

    ctx = _random_records("cuda", 16, 17)
    stream = cupy.cuda.Stream(non_blocking=True)
    before = to_numpy(ctx.canary_buf).copy()
    slots = _i64([1, 2], "cuda")
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match=r"^kv-canary: stream must not be capturing a CUDA graph"):
                kc.copy_records(src=ctx, dst=ctx, src_slots=slots, dst_slots=slots, stream=stream)
        finally:
            stream.end_capture()
    assert np.array_equal(to_numpy(ctx.canary_buf), before)


@requires_gpu
@pytest.mark.parametrize("src_first", [True, False])
def test_canaries_over_views_that_only_touch_copy_directly_inside_a_graph_capture(src_first):
    """Canaries over views of one buffer that touch but share no byte (slots 0-19 and 20-39) are
    told apart: the copy goes straight from one to the other, so it can be captured in a CUDA graph
    (a copy that must stage its records is refused there), and the graph's replay moves them."""
    import cupy

    base = _random_records("cuda", 40, 22)
    low, high = _views_of(base, (0, 20), 20)
    src, dst = (low, high) if src_first else (high, low)
    before = to_numpy(base.canary_buf).copy()
    src_slots, dst_slots = np.arange(20), np.arange(19, -1, -1)
    slots = _i64(src_slots, "cuda"), _i64(dst_slots, "cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            kc.copy_records(src=src, dst=dst, src_slots=slots[0], dst_slots=slots[1], stream=stream)
        finally:
            graph = stream.end_capture()
    assert np.array_equal(to_numpy(base.canary_buf), before)  # captured, not yet run
    graph.launch(stream)
    stream.synchronize()
    src_rows, dst_rows = (before[:20], before[20:]) if src_first else (before[20:], before[:20])
    moved = _expected(src_rows, dst_rows, src_slots, dst_slots)
    expected = np.concatenate([before[:20], moved] if src_first else [moved, before[20:]])
    assert np.array_equal(to_numpy(base.canary_buf), expected)


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs two GPUs")
@pytest.mark.gpu
@pytest.mark.parametrize("pair", [("cuda:1", "cuda:1"), ("cuda:0", "cuda:1"), ("cuda:1", "cpu")])
def test_canaries_on_a_gpu_that_is_not_current(pair):
    """Each launch on its canary's GPU whichever is current: the copy equals the CPU's."""
    import cupy

    src_slots, dst_slots = np.arange(1, 30), np.arange(30, 1, -1)
    want = _expected(to_numpy(_random_records("cpu", 40, 18).canary_buf),
                     to_numpy(_random_records("cpu", 40, 19).canary_buf), src_slots, dst_slots)
    with cupy.cuda.Device(0):
        src, dst = _random_records(pair[0], 40, 18), _random_records(pair[1], 40, 19)
        kc.copy_records(src=src, dst=dst, src_slots=_i64(src_slots, pair[0]), dst_slots=_i64(dst_slots, pair[1]))
    assert np.array_equal(to_numpy(dst.canary_buf), want)


def test_a_copy_between_two_gpus_takes_no_stream(monkeypatch):
    """Records copied between two GPUs run on each device's current stream: a stream given for such a
    copy is refused in words before any stream is resolved, which the host decides without a GPU.
    Within one GPU, or between it and the host, the stream is the GPU side's; between host canaries
    its form is checked, then ignored (streams resolved by a stand-in)."""
    import importlib

    op = importlib.import_module("kvcanary_cupy.ops.copy_records")  # the module, not the op it exports
    monkeypatch.setattr(op, "resolve_stream", lambda stream, device: (stream, str(device)))
    _streams = op._streams

    with pytest.raises(ValueError, match=r"^kv-canary: stream must be None when src and dst are on different "
                                         r"GPUs \(cuda:0 and cuda:1: each side runs on its device's current "
                                         r"stream\), got 7$"):
        _streams(parse_device("cuda:0"), parse_device("cuda:1"), 7)
    assert _streams(parse_device("cpu"), parse_device("cpu"), 7) == (None, None)
    assert _streams(parse_device("cuda:1"), parse_device("cuda:1"), 7) == ((7, "cuda:1"), (7, "cuda:1"))
    assert _streams(parse_device("cpu"), parse_device("cuda:1"), 7) == (None, (7, "cuda:1"))
    assert _streams(parse_device("cuda:0"), parse_device("cpu"), 7) == ((7, "cuda:0"), None)
    assert _streams(parse_device("cuda:0"), parse_device("cuda:1"), None) == ((None, "cuda:0"), (None, "cuda:1"))
    with pytest.raises(TypeError, match=r"^kv-canary: stream must be None, a CuPy or torch stream"):
        _streams(parse_device("cuda:0"), parse_device("cuda:1"), "fast")
