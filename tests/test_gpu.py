"""GPU-only behaviour: differential runs against the CPU oracle, streams, devices, CUDA graphs and
DLPack round trips with CuPy, PyTorch and JAX. Skipped without CuPy and a CUDA device."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.rawkernels import _loader
import _fuzzcases as F
from _builders import one_forward
from _devices import HAS_CUDA, StaleSharedMemory, force_write_team, stale_shared_memory

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA device")]

if HAS_CUDA:
    import cupy


def _agree_with_the_oracle(op: str, rng: np.random.Generator, cases: int, *, large: int, large_every: int) -> None:
    """``cases`` random cases of ``op``, every ``large_every``-th of ``large`` entries: the GPU's
    outputs are the CPU oracle's."""
    for i in range(cases):
        case = F.MAKERS[op](rng, large if i % large_every == large_every - 1 else 3000)
        oracle = F.RUNNERS[op](case, "cpu")
        gpu = F.RUNNERS[op](case, "cuda")
        assert F.compare_overflow_aware(op, case, oracle, gpu) == [], f"{op} case {i}"


@pytest.mark.parametrize("op", list(F.MAKERS))
def test_differential_against_cpu_oracle(op):
    _agree_with_the_oracle(op, np.random.default_rng([2026, list(F.MAKERS).index(op)]), 150, large=200_000,
                           large_every=50)


def test_a_kernel_finds_in_shared_memory_the_words_a_stale_fill_left():
    """The premise of ``--stale-shared`` (tools/differential_fuzz.py): a kernel's shared memory holds,
    before it stores any, what the fill before it on its stream stored (odd words; zeros are even),
    the driver's reserved bytes at its start included."""
    stale = StaleSharedMemory()
    stream = cupy.cuda.Stream(non_blocking=True)
    found = stale.read_back(stream)
    stale(stream)
    found_after_a_fill = stale.read_back(stream)
    stream.synchronize()
    odd = float((found_after_a_fill & 1).mean())
    assert odd > 0.9, f"{odd:.1%} of the shared words a kernel finds after a fill are the fill's"
    # the bytes the driver reserves at the start of each block's window too: a kernel's array
    # indexed at -1 reads the last of them
    reserved = found_after_a_fill[:, : stale.reserved // 8]
    odd = float((reserved & 1).mean())
    assert reserved.size and odd > 0.9, f"{odd:.1%} of the reserved words are the fill's"
    assert bool(cupy.any(found != found_after_a_fill))


@pytest.mark.parametrize("op,team", [(op, "auto") for op in F.MAKERS] + [("write", team) for team in ("thread", "one", "two")])
def test_differential_against_cpu_oracle_over_stale_shared_memory(op, team, monkeypatch):
    """Every kernel launched after a fill of each SM's shared memory with non-zero words: none reads a
    shared word it has not stored (such a kernel may pass over the zeros of a fresh card). The
    write also through each of its forms, whose shared memory differs."""
    stale = stale_shared_memory(monkeypatch.setattr)
    if team != "auto":
        force_write_team(team, monkeypatch.setattr)
    # the write's forms on the same cases
    _agree_with_the_oracle(op, np.random.default_rng([2028, list(F.MAKERS).index(op)]), 60, large=100_000,
                           large_every=20)
    assert stale.fills >= 30, "the op's kernels ran after a fill"


@pytest.mark.parametrize("tile", _loader.PLAN_TILES)
def test_each_plan_tile_equals_the_cpu_backend(tile, monkeypatch):
    """The launcher picks the plan kernel's block size from the batch (plan_tile); every instance is
    forced here on the same cases, batch sizes past one tile included."""
    from kvcanary_cupy.ops.backends._cuda import plan as cuda_plan

    monkeypatch.setattr(cuda_plan, "plan_tile", lambda batch_size, most_entries: tile)
    rng = np.random.default_rng([2026, tile])
    for i in range(60):
        case = F.make_plan_case(rng, 20_000 if i % 20 == 19 else 3000)
        oracle = F.RUNNERS["plan"](case, "cpu")
        gpu = F.RUNNERS["plan"](case, "cuda")
        assert F.compare("plan", case, oracle, gpu) == [], f"tile {tile} case {i}"


def test_resident_grids_are_the_drivers_occupancy_times_the_sms():
    """The grids the loader figures from a kernel's registers and shared memory (one wave of blocks,
    the most the card holds at once: the step's block 0 waits for its verify blocks) are CUDA's own
    occupancy figure for each kernel and block size, times the SMs."""
    for op in F.MAKERS:
        case = F.MAKERS[op](np.random.default_rng([2027, list(F.MAKERS).index(op)]), 3000)
        F.RUNNERS[op](case, "cuda")
    figured = dict(_loader._resident)
    assert {source for source, _, _, _ in figured} >= {"verify", "step", "plan", "records"}, figured
    for (source, kernel, device_id, block), grid in figured.items():
        function = _loader.get_kernel(source, kernel, device_id).kernel  # the RawKernel's cupy.cuda.Function
        with cupy.cuda.Device(device_id):
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, block, 0)
        assert grid == per_sm * _loader.device_info(device_id).sm_count, (source, kernel, block, grid, per_sm)


# --- an engine-shaped step ------------------------------------------------------------------------


class Step:
    """One forward of a small engine on the GPU: plan → HEAD verify → write, and the new token ids
    scattered into a per-request token pool."""

    def __init__(self, seed: int, num_slots: int = 16384, bs: int = 16, width: int = 512):
        rng = np.random.default_rng(seed)
        self.kv = cupy.asarray(rng.integers(0, 256, size=(num_slots, 64), dtype=np.uint8))
        self.ctx = kc.CanaryContext.allocate(
            num_slots, device="cuda", ring_capacity=256, hash_mode=kc.HashMode.ALL,
            real_kv_sources=[kc.RealKvSource(tensor=self.kv, page_size=1, num_bytes_per_token=64, read_bytes=64)])
        self.vplan = kc.VerifyPlan.allocate(bs * width, device="cuda")
        self.wplan = kc.WritePlan.allocate(bs, device="cuda")
        slots = rng.permutation(num_slots - 1)[: bs * width] + 1
        table = np.zeros((bs + 1, width), dtype=np.int32)  # pool row 0 is the padding row
        table[1:] = slots.reshape(bs, width)
        self.req_to_token = cupy.asarray(table)
        self.bs, self.width = bs, width
        self.req_pool_indices = cupy.asarray(np.arange(1, bs + 1, dtype=np.int64))
        self.prefix_lens = cupy.zeros(bs, dtype=cupy.int64)
        self.extend_lens = cupy.zeros(bs, dtype=cupy.int64)
        self.input_ids = cupy.zeros(bs * 8, dtype=cupy.int64)
        self.positions = cupy.zeros(bs * 8, dtype=cupy.int64)
        self.out_cache_loc = cupy.full(bs * 8, -1, dtype=cupy.int64)
        self.scatter_offsets = cupy.zeros(bs + 1, dtype=cupy.int64)
        self.token_pool = cupy.full((bs + 1, width), -1, dtype=cupy.int32)
        self.seed = seed

    def refresh(self, prefix: int, extend: int) -> None:
        """New batch metadata written in place (what an engine does before a graph replay)."""
        n = self.bs * extend
        self.prefix_lens.fill(prefix)
        self.extend_lens.fill(extend)
        table = self.req_to_token.get()
        locs = table[1:, prefix:prefix + extend].reshape(-1).astype(np.int64)
        ids = np.random.default_rng([self.seed, prefix, extend]).integers(0, 150_000, size=n)
        self.input_ids[:n] = cupy.asarray(ids)
        self.positions[:n] = cupy.asarray(np.tile(np.arange(prefix, prefix + extend), self.bs))
        self.out_cache_loc[:n] = cupy.asarray(locs)
        self.out_cache_loc[n:] = -1
        self.scatter_offsets[...] = cupy.arange(self.bs + 1, dtype=cupy.int64) * extend
        cupy.cuda.get_current_stream().synchronize()  # graph replays run on a non-blocking stream

    def launch(self, stream) -> None:
        kc.plan(self.vplan, self.wplan, req_pool_indices=self.req_pool_indices, prefix_lens=self.prefix_lens,
                extend_seq_lens=self.extend_lens, req_to_token=self.req_to_token, stream=stream)
        kc.verify(self.ctx, self.vplan, tag=kc.LaunchTag.HEAD_K_FULL, stream=stream)
        kc.write(self.ctx, self.wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=self.input_ids,
                 positions=self.positions, out_cache_loc=self.out_cache_loc, stream=stream)
        kc.scatter_req_token_ids(flat_in=self.input_ids, offsets=self.scatter_offsets,
                                 req_pool_indices=self.req_pool_indices, pool_out=self.token_pool, stream=stream)


def test_graph_replay_matches_eager_launches():
    warm = Step(99)  # compile and load every kernel before capture
    warm.refresh(0, 4)
    warm.launch(None)
    eager, graphed = Step(7), Step(7)
    stream = cupy.cuda.Stream(non_blocking=True)
    graphed.refresh(0, 4)
    with stream:
        stream.begin_capture()
        graphed.launch(stream)
        graph = stream.end_capture()
    for prefix, extend in [(0, 4), (4, 4), (8, 8), (16, 8), (24, 8)]:
        eager.refresh(prefix, extend)
        eager.launch(None)
        graphed.refresh(prefix, extend)
        graph.launch(stream)
        stream.synchronize()
        assert cupy.array_equal(eager.ctx.canary_buf, graphed.ctx.canary_buf)
        assert cupy.array_equal(eager.token_pool, graphed.token_pool)
        # scatter ran: each request's row starts with the ids this forward drew for it
        ids = np.random.default_rng([graphed.seed, prefix, extend]).integers(0, 150_000, size=graphed.bs * extend)
        assert np.array_equal(graphed.token_pool[1:, :extend].get(), ids.reshape(graphed.bs, extend))
        assert eager.ctx.counters() == graphed.ctx.counters()
    assert eager.ctx.violations().total == 0
    assert graphed.ctx.violations().total == 0
    # A corruption introduced between replays is found by the next replay's HEAD verify. The
    # real-KV hash field is not part of the chain link, so exactly one row names the victim.
    victim = int(graphed.req_to_token[3, 5].get())
    graphed.ctx.canary_buf[victim, 24] ^= 1
    graphed.refresh(32, 1)
    graph.launch(stream)
    report = graphed.ctx.violations()  # waits for the replay on the non-blocking stream
    assert report.total == 1 and report[0].slot_idx == victim
    assert report[0].fail_reason == kc.FailReason.REAL_KV_HASH


class _StreamProtocol:
    def __init__(self, stream):
        self._stream = stream

    def __cuda_stream__(self):
        return (0, self._stream.ptr)


@pytest.mark.parametrize("kind", ["cupy", "handle", "protocol", "default"])
def test_stream_argument_forms(kind):
    """Each form of ``stream=`` launches the same step, and none through an API CuPy deprecates (a
    raw handle or the protocol is taken with ``Stream.from_external`` where CuPy has it)."""
    reference, step = Step(11), Step(11)
    reference.refresh(0, 4)
    reference.launch(None)
    stream = cupy.cuda.Stream(non_blocking=True)
    given = {"cupy": stream, "handle": stream.ptr, "protocol": _StreamProtocol(stream), "default": None}[kind]
    step.refresh(0, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.launch(given)
    stream.synchronize()
    assert cupy.array_equal(reference.ctx.canary_buf, step.ctx.canary_buf)
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]


def test_host_words_of_a_source_in_device_memory_are_refused():
    """``RealKvSource.host_words()`` serves the CPU backend: a source in device memory has none."""
    from _builders import random_source

    source = random_source(np.random.default_rng(5), 8).build("cuda")
    with pytest.raises(RuntimeError, match=r"^kv-canary: host_words\(\) needs a host source"):
        source.host_words()


def test_buffers_on_each_device_run_on_that_device():
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip("needs two GPUs")
    steps = []
    for device in range(2):
        with cupy.cuda.Device(device):
            step = Step(100 + device)
            step.refresh(0, 4)
        steps.append(step)
    with cupy.cuda.Device(0):  # the current device must not matter
        for step in steps:
            step.launch(None)
    for device, step in enumerate(steps):
        assert step.ctx.device == kc._dlpack.Device("cuda", device)
        assert step.ctx.canary_buf.device.id == device
        with cupy.cuda.Device(device):
            step.refresh(4, 1)
            step.launch(None)
            assert step.ctx.violations().total == 0
            step.ctx.counters()


def test_streams_resolve_on_the_arrays_device():
    """With another device current, the default stream is the current stream of the arrays' device
    (for the ops and for kc.Canary alike), and a stream of another device is refused before any
    launch."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(0):
        foreign = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(1):
        own = cupy.cuda.Stream(non_blocking=True)
        ctx = kc.CanaryContext.allocate(64, device="cuda:1")
        vplan = kc.VerifyPlan.allocate(8, device="cuda:1")
        table = cupy.zeros((2, 8), cupy.int32)
        table[1, :3] = cupy.arange(1, 4, dtype=cupy.int32)
        canary = kc.Canary(pool_slot_count=64, req_to_token=table, device="cuda:1", mode="log",
                           capacities=kc.Capacities.from_args(req_to_token_pool_size=2, max_seq_len_per_req=8,
                                                              pool_slot_count=64, max_prefill_tokens=8))
        batch = kc.ForwardBatch(req_pool_indices=cupy.array([1]), prefix_lens=cupy.array([0]),
                                extend_seq_lens=cupy.array([3]), input_ids=cupy.array([7, 8, 9]),
                                positions=cupy.arange(3), out_cache_loc=cupy.arange(1, 4))
        cupy.cuda.Device(1).synchronize()  # the batch, made on device 1's default stream, before own reads it
    with cupy.cuda.Device(1), own, cupy.cuda.Device(0):  # own: device 1's current stream; device 0 current
        assert canary._stream(None).ptr == own.ptr
        one_forward(canary, batch)
        kc.verify(ctx, vplan, tag=0)
        before = (canary.forwards, [list(group.log) for group in canary.groups])
        with pytest.raises(ValueError, match=r"^kv-canary: stream must belong to the arrays' device cuda:1, "
                                             r"got a stream of cuda:0"):
            kc.verify(ctx, vplan, tag=0, stream=foreign)
        with pytest.raises(ValueError, match=r"^kv-canary: stream must belong"):
            canary.before_forward(batch, stream=foreign)
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            with pytest.raises(ValueError, match=r"^kv-canary: stream must belong .* got a stream of cuda:0"):
                kc.verify(ctx, vplan, tag=0, stream=torch.cuda.Stream(device=0))
        assert (canary.forwards, [list(group.log) for group in canary.groups]) == before
    own.synchronize()
    report = canary.poll()
    assert (report.total, report.forwards) == (0, 1)
    assert ctx.counters()["kernel_run_counter"] == 1
    assert canary.context.counters()["slot_run_counter"] == 3


def test_a_stream_of_another_device_is_refused_on_a_machine_of_one_gpu():
    """A stream that says it belongs to another GPU than the arrays' (torch's form: ``cuda_stream``
    and ``device.index``) is refused before any launch, where only one GPU is there to make a real
    one; the same stream saying the arrays' device runs the op."""
    import types

    ctx = kc.CanaryContext.allocate(64, device="cuda:0")
    vplan = kc.VerifyPlan.allocate(8, device="cuda:0")
    handle = cupy.cuda.Stream(non_blocking=True)

    def stream_of(index):
        return types.SimpleNamespace(cuda_stream=handle.ptr, device=types.SimpleNamespace(index=index))

    with pytest.raises(ValueError, match=r"^kv-canary: stream must belong to the arrays' device cuda:0, "
                                         r"got a stream of cuda:1$"):
        kc.verify(ctx, vplan, tag=0, stream=stream_of(1))
    assert ctx.counters()["kernel_run_counter"] == 0
    kc.verify(ctx, vplan, tag=0, stream=stream_of(0))
    handle.synchronize()
    assert ctx.counters()["kernel_run_counter"] == 1


def test_host_side_fills_run_on_the_arrays_device():
    """clear_violations, set_chain_position_assert and a poll's zeroing fill cells of a canary on
    cuda:1 with device 0 current: each is done when it returns, however busy device 0 is (CuPy
    queues a fill on the current device's stream unless the arrays' device is made current)."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    from _devices import spin_kernel

    with cupy.cuda.Device(1):
        ctx = kc.CanaryContext.allocate(64, device="cuda:1")
        ctx.violation_write_index[...] = 3
        ctx.violation_ring[...] = 7
        cupy.cuda.Device(1).synchronize()
    with cupy.cuda.Device(0):
        spin = spin_kernel()
        spin((1,), (1,), (cupy.uint64(300_000_000),))  # device 0's current stream busy for 0.3 s
        ctx.clear_violations()
        ctx.set_chain_position_assert(True)
        assert ctx.counters()["violations"] == 0  # waits for device 1 only
        with cupy.cuda.Device(1):
            assert int(ctx.violation_ring.sum()) == 0
            assert int(ctx.chain_position_assert[0]) == 1
        cupy.cuda.Device(0).synchronize()


def test_slot_fields_waits_for_every_stream():
    """slot_fields reads a slot once a write on a busy non-blocking stream is done."""
    from _devices import spin_kernel

    ctx = kc.CanaryContext.allocate(64, device="cuda")
    wplan = kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=1, device="cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        spin_kernel()((1,), (1,), (cupy.uint64(300_000_000),))
    kc.write(ctx, wplan, tag=0, input_ids=cupy.asarray([41]), positions=cupy.asarray([0]),
             out_cache_loc=cupy.asarray([5]), stream=stream)
    assert ctx.slot_fields(5)["token"] == 41


def _dlpack_write_roundtrip(make, read):
    """Ops on arrays from another framework write into that framework's memory."""
    rng = np.random.default_rng(5)
    n = 64
    canary = make(np.zeros((256, 32), np.uint8))
    ring = make(np.zeros((16, 8), np.int64))
    cells = [make(np.zeros(1, np.int32)), make(np.zeros(1, np.int64)), make(np.zeros(1, np.int64)),
             make(np.zeros(1, np.int32))]
    kv = make(rng.integers(0, 256, size=(256, 32), dtype=np.uint8))
    ctx = kc.CanaryContext(canary_buf=canary, violation_ring=ring, violation_write_index=cells[0],
                           slot_run_counter=cells[1], kernel_run_counter=cells[2], chain_position_assert=cells[3],
                           real_kv_sources=[kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=32,
                                                            read_bytes=32)],
                           hash_mode=kc.HashMode.ALL)
    wplan = kc.WritePlan(offsets=make(np.array([0, n], np.int64)), seed_slot_indices=make(np.array([-1], np.int64)),
                         num_valid_reqs=make(np.array([1], np.int32)))
    slots = rng.permutation(255)[:n] + 1
    kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=make(rng.integers(0, 1000, size=n)),
             positions=make(np.arange(n, dtype=np.int64)), out_cache_loc=make(slots.astype(np.int64)))
    cupy.cuda.get_current_stream().synchronize()
    written = read(canary)
    assert np.count_nonzero(written[slots]) > 0, "the write must land in the caller's buffer"
    assert np.count_nonzero(written[np.setdiff1d(np.arange(256), slots)]) == 0
    assert int(read(cells[1])[0]) == n
    if make is not np.asarray:  # the records the CPU backend stores for the same write, byte for byte
        assert np.array_equal(written, _dlpack_write_roundtrip(np.asarray, lambda a: a))
    return written


def test_dlpack_roundtrip_cupy_torch_jax():
    expected = _dlpack_write_roundtrip(cupy.asarray, lambda a: a.get())
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    got = _dlpack_write_roundtrip(lambda a: torch.from_numpy(a).cuda(), lambda t: t.cpu().numpy())
    assert np.array_equal(got, expected)
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # int64 plans and rings, not JAX's default int32
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX without a GPU")
    got = _dlpack_write_roundtrip(lambda a: jax.device_put(a, gpus[0]),
                                  lambda a: cupy.from_dlpack(a).get())
    assert np.array_equal(got, expected)


def test_torch_bfloat16_source_is_hashed_as_bytes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    gen = torch.Generator(device="cpu").manual_seed(3)
    kv_host = torch.randn(128, 4, 8, generator=gen).to(torch.bfloat16)  # 64 bytes per slot
    as_bytes = kv_host.view(torch.uint8).reshape(128, 64).numpy()
    results = []
    for tensor in (kv_host.cuda(), cupy.asarray(as_bytes), as_bytes):
        device = "cpu" if isinstance(tensor, np.ndarray) else "cuda"
        ctx = kc.CanaryContext.allocate(128, device=device, hash_mode=kc.HashMode.ALL, real_kv_sources=[
            kc.RealKvSource(tensor=tensor, page_size=1, num_bytes_per_token=64, read_bytes=64)])
        wplan = kc.WritePlan.from_host(offsets=[0, 127], seed_slot_indices=[-1], num_valid_reqs=1, device=device)
        ids = np.arange(127, dtype=np.int64)
        to = (lambda a: a) if device == "cpu" else cupy.asarray
        kc.write(ctx, wplan, tag=0, input_ids=to(ids), positions=to(ids), out_cache_loc=to(ids + 1))
        results.append(ctx.canary_buf if device == "cpu" else ctx.canary_buf.get())
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[1], results[2])


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    return torch


def test_torch_cuda_tensors_are_viewed_in_place_without_dlpack(monkeypatch):
    """CUDA tensors of the dtypes CuPy has are viewed from their attributes (an engine's tensors are
    adopted every forward, and DLPack's exchange costs about 30 us each): same bytes, shape and
    strides, offsets and strided rows included, writes land in the tensor."""
    torch = _cuda_torch()
    from kvcanary_cupy._dlpack import Device, device_of, native_view

    def no_dlpack(*args, **kwargs):
        raise AssertionError("a plain CUDA tensor must not go through DLPack")

    wide = torch.arange(6 * 40, dtype=torch.int32, device="cuda").reshape(6, 40)
    tensors = [torch.arange(17, dtype=torch.int64, device="cuda"),
               torch.arange(17, dtype=torch.int64, device="cuda")[5:],  # a storage offset
               wide[1:, 3:35],  # strided rows
               torch.ones(3, dtype=torch.bool, device="cuda"),
               torch.randn(4, 8, device="cuda", dtype=torch.float16).t()]  # transposed
    monkeypatch.setattr(cupy, "from_dlpack", no_dlpack)
    for tensor in tensors:
        view = native_view(tensor, "x")
        assert device_of(tensor, "x") == Device("cuda", tensor.get_device())
        assert isinstance(view, cupy.ndarray) and view.data.ptr == tensor.data_ptr()
        assert view.shape == tuple(tensor.shape)
        assert view.strides == tuple(stride * tensor.element_size() for stride in tensor.stride())
        assert np.array_equal(view.get(), tensor.cpu().numpy())
    view = native_view(wide[1:, 3:35], "x")
    view[2, 5] = -7
    assert int(wide[3, 8]) == -7
    # the view keeps the tensor's storage, not only the tensor: pointed elsewhere, its bytes stay
    moved = torch.arange(1 << 16, dtype=torch.int64, device="cuda")
    moved_view = native_view(moved, "x")
    moved.set_(torch.zeros(4, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    reuse = [torch.full((1 << 16,), 7, dtype=torch.int64, device="cuda") for _ in range(4)]
    assert np.array_equal(moved_view.get(), np.arange(1 << 16)) and reuse
    # a plan from torch tensors equals the same plan from CuPy arrays
    table = torch.randint(0, 4096, (9, 64), dtype=torch.int32, device="cuda")
    batch = dict(req_pool_indices=torch.arange(1, 9, device="cuda"), prefix_lens=torch.randint(0, 64, (8,), device="cuda"),
                 extend_seq_lens=torch.ones(8, dtype=torch.int64, device="cuda"), req_to_token=table)
    plans = []
    for convert in (lambda t: t, lambda t: cupy.asarray(t.cpu().numpy())):
        vplan, wplan = kc.VerifyPlan.allocate(1024, device="cuda"), kc.WritePlan.allocate(8, device="cuda")
        kc.plan(vplan, wplan, **{name: convert(value) for name, value in batch.items()})
        plans.append([getattr(vplan, name).get() for name in kc.VerifyPlan.ARRAYS])
    for ours, theirs in zip(*plans):
        assert np.array_equal(ours, theirs)


def test_a_torch_view_spans_the_bytes_from_its_first_element_to_its_last():
    """The memory a tensor's CuPy view is made over covers exactly its elements' span, from the
    first to the end of the last: strided, transposed and broadcast (stride 0) tensors included, and
    a broadcast one reads its single row again and again."""
    torch = _cuda_torch()
    from kvcanary_cupy._dlpack import native_view

    column = torch.arange(1, 4, dtype=torch.int64, device="cuda")
    cases = [(torch.arange(10, dtype=torch.int64, device="cuda")[::2], 9 * 8),  # elements 0, 2, .., 8
             (torch.arange(24, dtype=torch.int16, device="cuda").reshape(4, 6).t(), 24 * 2),
             (column.expand(5, 3), 3 * 8),
             (column[:1].expand(7), 8)]
    for tensor, span in cases:
        view = native_view(tensor, "x")
        assert view.data.ptr == tensor.data_ptr() and view.data.mem.size == span, (tuple(tensor.stride()), span)
        assert np.array_equal(view.get(), tensor.cpu().numpy())
    assert np.array_equal(native_view(column.expand(5, 3), "x").sum(axis=0).get(), [5, 10, 15])


def test_torch_tensors_dlpack_must_judge_still_take_dlpack():
    """bfloat16 is adopted through DLPack (as CuPy's bfloat16 where it has one, else as bytes), a
    tensor requiring grad is refused with the package's message, an empty tensor is adopted."""
    torch = _cuda_torch()
    from kvcanary_cupy._dlpack import native_view

    bf16 = torch.randn(4, 8, device="cuda").to(torch.bfloat16)
    view = native_view(bf16, "kv")
    assert view.data.ptr == bf16.data_ptr() and view.shape[0] == 4 and view.nbytes == 64
    with pytest.raises(ValueError, match=r"^kv-canary: kv cannot be shared through DLPack"):
        native_view(torch.zeros(4, device="cuda", requires_grad=True), "kv")
    assert native_view(torch.zeros(0, dtype=torch.int64, device="cuda"), "x").shape == (0,)


def test_torch_view_waits_for_torchs_current_stream():
    """Under ``torch.cuda.stream(s)``, a tensor torch is still filling on s is read by CuPy's current
    stream only after the fill, as a DLPack exchange would order it."""
    torch = _cuda_torch()
    from kvcanary_cupy._dlpack import native_view

    side = torch.cuda.Stream()
    values = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
    # CuPy's sum loaded and a block in its pool first: a first load or allocation may wait for the
    # whole device, and would hide a view that does not wait
    assert int(cupy.arange(1 << 20, dtype=np.int64).sum()) == ((1 << 20) - 1) << 19
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning on the side stream first
        values.fill_(3)
        view = native_view(values, "values")
        total = int(view.sum())  # on CuPy's current stream, the legacy default
    assert total == 3 << 20
    # The control: the same read without the wait comes before torch's next fill. A busy machine
    # may hold the read back past a short spin (a test process beside this one), so the spin grows.
    before = 3
    for fill, cycles in ((5, 200_000_000), (6, 1_000_000_000), (7, 4_000_000_000)):
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            values.fill_(fill)
            memory = cupy.cuda.UnownedMemory(values.data_ptr(), values.numel() * 8, values, values.get_device())
            early = int(cupy.ndarray(values.shape, np.int64, cupy.cuda.MemoryPointer(memory, 0)).sum())
        torch.cuda.synchronize()
        if early == before << 20:
            break
        before = fill
    else:
        pytest.fail("a read with no wait never came before torch's fill")


def test_torch_view_inside_a_cupy_capture_waits_for_no_event():
    """While CuPy's current stream captures a CUDA graph and torch's current stream is another, a
    tensor's view orders nothing: an event recorded outside a capture cannot be waited for inside it
    (the caller orders its streams there). The capture holds, and its replay reads the tensor."""
    torch = _cuda_torch()
    from kvcanary_cupy._dlpack import native_view

    values = torch.arange(1 << 10, dtype=torch.int64, device="cuda")
    warm = native_view(values, "values")
    warm *= 1  # the kernel compiled and loaded before the capture
    cupy.cuda.Device().synchronize()
    side, capture = torch.cuda.Stream(), cupy.cuda.Stream(non_blocking=True)
    with torch.cuda.stream(side), capture:
        capture.begin_capture()
        try:
            view = native_view(values, "values")
            view *= 3
        finally:
            graph = capture.end_capture()
    assert int(values[5]) == 5  # captured, not yet run
    graph.launch(capture)
    capture.synchronize()
    assert torch.equal(values.cpu(), torch.arange(1 << 10, dtype=torch.int64) * 3)


def test_a_torch_view_makes_an_event_only_where_torch_and_cupy_are_on_different_streams(monkeypatch):
    """Ordering CuPy after torch takes an event only where their current streams differ: none when
    both are the legacy default (under either of its handles, 0 and 1) or one stream both name; one
    when torch works on a side stream. A view is adopted every forward, and an event costs host time."""
    import contextlib

    torch = _cuda_torch()
    from kvcanary_cupy._dlpack import native_view

    values = torch.arange(1 << 10, dtype=torch.int64, device="cuda")
    made = []
    create = cupy.cuda.runtime.eventCreateWithFlags

    def counted(flags):
        made.append(flags)
        return create(flags)

    monkeypatch.setattr(cupy.cuda.runtime, "eventCreateWithFlags", counted)
    shared = cupy.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; the handle is all it needs here
        warnings.simplefilter("ignore", DeprecationWarning)
        legacy = cupy.cuda.ExternalStream(1)
    cases = [("both on the default stream", None, None, 0),
             ("CuPy on the default stream's other handle", legacy, None, 0),
             ("one stream both name", shared, torch.cuda.ExternalStream(shared.ptr), 0),
             ("torch on a side stream", None, torch.cuda.Stream(), 1)]
    for label, cupy_stream, torch_stream, events in cases:
        made.clear()
        with contextlib.ExitStack() as streams:
            if cupy_stream is not None:
                streams.enter_context(cupy_stream)
            if torch_stream is not None:
                streams.enter_context(torch.cuda.stream(torch_stream))
            total = int(native_view(values, "values").sum())
        assert (len(made), total) == (events, (1 << 9) * ((1 << 10) - 1)), label


def test_numba_device_arrays_through_the_cuda_array_interface():
    numba_cuda = pytest.importorskip("numba.cuda")
    if not numba_cuda.is_available():
        pytest.skip("numba without CUDA")
    expected = _dlpack_write_roundtrip(cupy.asarray, lambda a: a.get())
    got = _dlpack_write_roundtrip(numba_cuda.to_device, lambda a: a.copy_to_host())
    assert np.array_equal(got, expected)
    # an empty array has no memory (a null pointer, which names no device): the current device's
    from kvcanary_cupy._dlpack import Device, device_of

    empty = numba_cuda.device_array(0, dtype=np.int64)
    assert empty.__cuda_array_interface__["data"][0] == 0
    assert device_of(empty, "x") == Device("cuda", cupy.cuda.Device().id)


# --- byte offsets past 2**31 and 2**32 -------------------------------------------------------------


def test_slots_whose_byte_offsets_pass_2_31_and_2_32_equal_the_cpu_backend():
    """Real pools are many GiB: a slot's record lies past 2**31 bytes of the canary buffer from slot
    2**26 on, and its KV past 2**31 and 2**32 bytes of a 48-byte-a-token source from slots 44.7M and
    89.5M on. Requests whose slots straddle each of those points (and the pool's last slot) are
    written and verified (through kc.plan/verify/write and kc.CanaryStep), a KV byte and a record
    broken, records copied between the two ends, on the GPU and on the CPU: the records, the ring
    and the counters agree, and nothing outside the slots used is written (an index computed in 32
    bits would land elsewhere)."""
    row_bytes, num_slots = 48, 96 * 2**20 + 5
    need = num_slots * (row_bytes + 32) + 2**30
    if cupy.cuda.runtime.memGetInfo()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    edges = [2**31 // row_bytes, 2**26, 2**32 // row_bytes, num_slots - 20]
    width, bs = 44, len(edges)
    rng = np.random.default_rng(2031)
    table = np.zeros((bs + 1, width), np.int32)  # pool row 0 is the padding row
    for r, edge in enumerate(edges):
        table[r + 1] = rng.permutation(np.arange(edge - 24, edge + 20))
    used = np.unique(table[1:])
    kv_rows = rng.integers(0, 256, size=(used.size, row_bytes), dtype=np.uint8)

    def run(device, xp, kv):
        src = kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=row_bytes, read_bytes=row_bytes)
        ctx = kc.CanaryContext.allocate(num_slots, device=device, ring_capacity=64,
                                        hash_mode=kc.HashMode.ALL, real_kv_sources=[src])
        vplan, wplan = kc.VerifyPlan.allocate(bs * width, device=device), kc.WritePlan.allocate(bs, device=device)
        req_to_token = xp.asarray(table)
        req_pool_indices = xp.arange(1, bs + 1, dtype=xp.int64)
        batch = dict(prefix_lens=xp.zeros(bs, xp.int64), extend_seq_lens=xp.zeros(bs, xp.int64),
                     input_ids=xp.zeros(bs * 24, xp.int64), positions=xp.zeros(bs * 24, xp.int64),
                     out_cache_loc=xp.full(bs * 24, -1, xp.int64))
        step = None
        # three forwards through kc.plan/verify/write, then a decode (one fused launch) and an
        # extend of three tokens a request (two launches) through kc.CanaryStep
        for prefix, extend in [(0, 24), (24, 12), (36, 4), (40, 1), (41, 3)]:
            if prefix == 36:  # one KV byte and one stored token broken before the next forward reads them
                kv[int(table[2, 5]), 7] ^= 0x10
                ctx.canary_buf[int(table[4, 30]), 0] ^= 1
            locs = table[1:, prefix:prefix + extend].reshape(-1).astype(np.int64)
            batch["prefix_lens"][...] = prefix
            batch["extend_seq_lens"][...] = extend
            batch["input_ids"][:locs.size] = xp.asarray(np.random.default_rng([7, prefix]).integers(0, 2**31 - 1, size=locs.size))
            batch["positions"][:locs.size] = xp.asarray(np.tile(np.arange(prefix, prefix + extend), bs))
            batch["out_cache_loc"][:locs.size] = xp.asarray(locs)
            batch["out_cache_loc"][locs.size:] = -1
            if prefix < 40:
                kc.plan(vplan, wplan, req_pool_indices=req_pool_indices, prefix_lens=batch["prefix_lens"],
                        extend_seq_lens=batch["extend_seq_lens"], req_to_token=req_to_token)
                kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL)
                kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=batch["input_ids"][:locs.size],
                         positions=batch["positions"][:locs.size], out_cache_loc=batch["out_cache_loc"][:locs.size])
                continue
            step = step or kc.CanaryStep(ctx, verify_capacity=bs * width, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                                         write_tag=kc.LaunchTag.TAIL_K_FULL, req_pool_indices=req_pool_indices,
                                         req_to_token=req_to_token, **batch)
            step.launch()
        # the last request's records stored over the first's, within one buffer
        kc.copy_records(src=ctx, dst=ctx, src_slots=xp.asarray(table[4, :16].astype(np.int64)),
                        dst_slots=xp.asarray(table[1, 28:].astype(np.int64)))
        report = ctx.violations()
        return ctx, report, ctx.counters()

    host_kv = np.zeros((num_slots, row_bytes), np.uint8)  # pages of zeros are not touched
    host_kv[used] = kv_rows
    cpu_ctx, cpu_report, cpu_counters = run("cpu", np, host_kv)
    device_kv = cupy.zeros((num_slots, row_bytes), cupy.uint8)
    device_kv[cupy.asarray(used)] = cupy.asarray(kv_rows)
    gpu_ctx, gpu_report, gpu_counters = run("cuda", cupy, device_kv)
    del device_kv

    assert cpu_counters == gpu_counters
    assert (cpu_report.total, cpu_report.dropped) == (gpu_report.total, gpu_report.dropped)
    # a launch's rows land in the order its threads record them on a GPU
    assert collections.Counter(cpu_report.rows) == collections.Counter(gpu_report.rows)
    named = {v.slot_idx: v.fail_reason for v in gpu_report}
    # the broken token is read as its successor's chain link
    assert named == {int(table[2, 5]): kc.FailReason.REAL_KV_HASH, int(table[4, 31]): kc.FailReason.CHAIN_HASH}
    device_used = cupy.asarray(used)
    assert np.array_equal(gpu_ctx.canary_buf[device_used].get(), cpu_ctx.canary_buf[used])
    assert np.count_nonzero(cpu_ctx.canary_buf[used].view(np.int64)[:, 0]) > 0
    gpu_ctx.canary_buf[device_used] = 0
    assert int(cupy.count_nonzero(gpu_ctx.canary_buf)) == 0


# --- a canary buffer (and sources) at addresses the allocator never gives ------------------------


def _context_at(pool: dict, device: str, offset: int, source_offset: int) -> kc.CanaryContext:
    """F.build_context's context with its canary buffer ``offset`` bytes into a larger allocation
    and each source's rows ``source_offset`` bytes into theirs (the same bytes, other addresses)."""
    xp = np if device == "cpu" else cupy

    def placed(array: np.ndarray, skip: int):
        flat = xp.zeros(array.size + 64, np.uint8)
        flat[skip:skip + array.size] = xp.asarray(array.reshape(-1))
        return flat[skip:skip + array.size].reshape(array.shape)

    sources = [kc.RealKvSource(tensor=placed(src["data"], source_offset)[:, :src["row_bytes"]],
                               page_size=src["page_size"], num_bytes_per_token=src["num_bytes_per_token"],
                               read_bytes=src["read_bytes"]) for src in pool["sources"]]
    return kc.CanaryContext(
        canary_buf=placed(pool["canary"], offset),
        violation_ring=xp.zeros((pool["ring_capacity"], 8), np.int64),
        violation_write_index=xp.zeros(1, np.int32), slot_run_counter=xp.zeros(1, np.int64),
        kernel_run_counter=xp.zeros(1, np.int64),
        chain_position_assert=xp.asarray(np.array([pool["chain_position_assert"]], np.int32)),
        real_kv_sources=tuple(sources), hash_mode=kc.HashMode(pool["hash_mode"]))


def _cases_of_16_byte_slots(op: str, rng: np.random.Generator, count: int) -> list:
    """Fuzz cases of ``op`` whose slot stride is a multiple of 16 (32 or 64 bytes): the strides whose
    records are read and stored as 16-byte vectors when the buffer's address allows."""
    cases = []
    while len(cases) < count:
        case = F.MAKERS[op](rng, 3000)
        if case["pool"]["canary"].shape[1] % 16 == 0:
            cases.append(case)
    return cases


@pytest.mark.parametrize("offset, vectors", [(8, False), (16, True), (24, False), (48, True)])
@pytest.mark.parametrize("op", ["verify", "write", "step"])
def test_canary_buffer_at_any_8_byte_address_equals_the_cpu_backend(op, offset, vectors, monkeypatch):
    """A canary buffer is only 8-byte aligned when it is a view into a larger allocation (CuPy's and
    torch's allocators give 256-byte addresses): the kernels then read and store records as 8-byte
    words (kVec16 false), from the address alone, a slot stride of 32 or 64 bytes notwithstanding;
    at 16 mod 32 bytes they keep their 16-byte vectors. Sources 16 bytes into their allocation are
    read as 16-byte vectors either way. Verify, write and the step equal the CPU on the same bytes
    at the same offsets (the fuzz's buffers all start where the allocator puts them)."""
    from kvcanary_cupy.ops.backends import _cuda

    rng = np.random.default_rng([2027, offset, ["verify", "write", "step"].index(op)])
    for i, case in enumerate(_cases_of_16_byte_slots(op, rng, 12)):
        contexts = {}
        for device in ("cpu", "cuda"):
            monkeypatch.setattr(F, "build_context", lambda pool, dev: contexts.setdefault(
                dev, _context_at(pool, dev, offset, 16)))
            contexts.clear()
            outputs = F.RUNNERS[op](case, device)
            if device == "cpu":
                oracle = outputs
        assert contexts["cuda"].canary_buf.data.ptr % 64 == offset
        assert _cuda.vec16(contexts["cuda"].canary_buf) == vectors
        monkeypatch.undo()
        assert F.compare_overflow_aware(op, case, oracle, outputs) == [], f"{op} at offset {offset}, case {i}"
