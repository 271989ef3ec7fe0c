"""kc.CanaryStep: one forward's verify and write, prepared once, equal to kc.plan + kc.verify + kc.write."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvcanary_cupy as kc
import _fuzzcases as F
from _builders import fields, link_of, ring_rows, slot_words
from _devices import BACKENDS, requires_gpu, spin_kernel, to_device, to_numpy


def _assert_step_equals_plan_verify_write(case: dict, device: str, label: str) -> dict:
    """The step on ``device`` against plan + verify + write on the CPU, every row compared where the
    ring overflowed; returns the CPU's outputs."""
    fused = F.run_step(case, device)
    unfused = F.run_step_unfused(case, "cpu")
    assert F.compare_overflow_aware("step", case, unfused, fused) == [], label
    return unfused


@pytest.mark.parametrize("device", BACKENDS)
def test_step_equals_plan_verify_write(device):
    rng = np.random.default_rng(404)
    for i in range(120 if device == "cpu" else 300):
        case = F.make_step_case(rng, 50_000 if i % 40 == 39 else 2000)
        _assert_step_equals_plan_verify_write(case, device, f"case {i}")


@pytest.mark.parametrize("device", BACKENDS)
def test_step_skips_prefix_cells_of_the_padding_slot_as_plan_verify_write_do(device):
    """SPEC §3.2 checks only entries with ``slot != 0``. An engine's table may hold the padding
    slot inside a live prefix; the step's own verify must skip those entries as kc.verify does,
    not check them against slot 0's record (one random step case in ten has such cells; here every
    case has). The cell padded lies before the prefix's last, so the seeds and the new tokens'
    slots stay those of the case; a request sharing the row may take it as its seed."""
    rng = np.random.default_rng(406)
    checked = 0
    while checked < (12 if device == "cpu" else 40):
        case = F.make_step_case(rng, 4000)
        if case["swa_window_size"]:
            continue  # through the SWA table the padding cell resolves to another slot
        if not F.pad_prefix_cells(rng, case["req_pool_indices"], case["prefix_lens"], case["req_to_token"]):
            continue
        _assert_step_equals_plan_verify_write(case, device, f"case {checked}")
        checked += 1


@pytest.mark.parametrize("device", BACKENDS)
def test_step_stores_a_token_sent_to_the_padding_slot_as_plan_verify_write_do(device):
    """SPEC §3.1 skips only negative slots: a token an engine sends to the padding slot is stored
    there like any other, its real-KV hash included, though verify never reads it back. Each of the
    step's write paths (the last block's warp, block 0 with the new slots hashed ahead, a second
    launch) must store it as kc.write does (one random step case in ten has such a token; here
    every case has)."""
    from kvcanary_cupy._layout import PADDING_SLOT

    rng = np.random.default_rng(408)
    checked = 0
    while checked < (12 if device == "cpu" else 60):
        case = F.make_step_case(rng, 2000)
        seeds = F.seed_slots(case["req_pool_indices"], case["prefix_lens"], case["req_to_token"],
                             case["full_to_swa_index_mapping"])
        if not F.write_padding_slot(rng, case["out_cache_loc"], seeds):
            continue
        before = case["pool"]["canary"][PADDING_SLOT].copy()
        unfused = _assert_step_equals_plan_verify_write(case, device, f"case {checked}")
        checked += int(not np.array_equal(unfused["canary"][PADDING_SLOT], before))


@pytest.mark.parametrize("device", BACKENDS)
def test_step_relaunch_accumulates(device):
    """Launching twice is two steps: the second verifies what the first wrote (and the GPU's
    block-completion counter is reset between launches)."""
    rng = np.random.default_rng(7)
    bs, width, num_slots = 8, 32, 1024
    ctx = kc.CanaryContext.allocate(num_slots, device=device, ring_capacity=64)
    table = np.zeros((bs + 1, width), np.int32)
    table[1:] = (rng.permutation(num_slots - 1)[: bs * width] + 1).reshape(bs, width)
    rtt = to_device(table, device)
    rpi = to_device(np.arange(1, bs + 1, dtype=np.int64), device)
    prefix = to_device(np.zeros(bs, np.int64), device)
    extend = to_device(np.ones(bs, np.int64), device)
    ids = to_device(np.zeros(bs, np.int64), device)
    pos = to_device(np.zeros(bs, np.int64), device)
    loc = to_device(np.zeros(bs, np.int64), device)
    step = kc.CanaryStep(ctx, verify_capacity=bs * width, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                         write_tag=kc.LaunchTag.TAIL_K_FULL, req_pool_indices=rpi, prefix_lens=prefix,
                         extend_seq_lens=extend, req_to_token=rtt, input_ids=ids, positions=pos, out_cache_loc=loc)
    steps = 12
    tokens = rng.integers(1, 150_000, size=(steps, bs)).astype(np.int64)  # tokens[t, r]: request r's at position t
    for t in range(steps):  # a decode of `steps` tokens, metadata refilled in place
        prefix[...] = t
        pos[...] = t
        ids[...] = to_device(tokens[t], device)
        loc[...] = to_device(table[1:, t].astype(np.int64), device)
        step.launch()
    report = ctx.violations()
    assert report.total == 0
    verified = bs * sum(range(steps))
    assert ctx.counters() == {"slot_run_counter": verified + bs * steps, "kernel_run_counter": 2 * steps,
                              "violations": 0}
    # a bit flipped in a written slot is found by the next step's verify, once
    victim = int(table[3, 4])
    buf = ctx.canary_buf
    buf[victim, 0] ^= 1
    prefix[...] = steps
    pos[...] = steps
    loc[...] = to_device(table[1:, steps].astype(np.int64), device)
    step.launch()
    # the token word is not in the slot's own check (no expected tokens): the chain link of the
    # next position's record, which hashes it, no longer matches
    after = int(table[3, 5])
    assert ring_rows(ctx) == [(int(kc.LaunchTag.HEAD_K_FULL), after, 5, int(tokens[5, 2]), -1,
                               fields(buf, after)[2], link_of(buf, victim), int(kc.FailReason.CHAIN_HASH))]
    assert ctx.counters() == {"slot_run_counter": verified + bs * steps + bs * steps + bs,
                              "kernel_run_counter": 2 * steps + 2, "violations": 1}


def _one_token_batch(device) -> dict:
    """A step's arrays for one request (pool row 1) writing its position 2 into slot 11."""
    i64 = lambda values: to_device(np.array(values, np.int64), device)  # noqa: E731
    return dict(req_pool_indices=i64([1]), prefix_lens=i64([2]), extend_seq_lens=i64([1]),
                req_to_token=to_device(np.arange(16, dtype=np.int32).reshape(2, 8), device),
                input_ids=i64([5]), positions=i64([2]), out_cache_loc=i64([11]))


@pytest.mark.parametrize("device", BACKENDS)
def test_step_rejects_bad_arguments_and_changes_nothing(device):
    ctx = kc.CanaryContext.allocate(64, device=device)
    good = dict(verify_capacity=16, verify_tag=0, write_tag=2, **_one_token_batch(device))
    before = [to_numpy(a).copy() for a in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index,
                                          ctx.slot_run_counter, ctx.kernel_run_counter)]
    bad = [
        (dict(verify_capacity=-1), ValueError, "verify_capacity must be non-negative, got -1"),
        (dict(verify_capacity=2**31), ValueError, "verify_capacity must fit in int32 (<= 2147483647), got 2147483648"),
        (dict(verify_tag=12), ValueError, "tag must be a LaunchTag (a value in [0, 11]), got 12"),
        (dict(write_tag="x"), TypeError, "tag must be a LaunchTag"),
        (dict(check_expected_token=1), TypeError, "check_expected_token must be a bool"),
        (dict(input_ids=to_device(np.array([5], np.int32), device)), TypeError, "input_ids must have dtype int64"),
        (dict(positions=to_device(np.array([2, 3], np.int64), device)), ValueError, "positions must have length 1"),
        (dict(prefix_lens=to_device(np.array([2, 2], np.int64), device)), ValueError, "prefix_lens must have length 1"),
        (dict(swa_window_size=4), ValueError, "full_to_swa_index_mapping is required"),
    ]
    for change, error, text in bad:
        with pytest.raises(error, match="^kv-canary: ") as info:
            kc.CanaryStep(ctx, **{**good, **change})
        assert text in str(info.value)
    with pytest.raises(TypeError, match="^kv-canary: ctx must be a CanaryContext"):
        kc.CanaryStep(object(), **good)
    after = [to_numpy(a) for a in (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index,
                                   ctx.slot_run_counter, ctx.kernel_run_counter)]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    kc.CanaryStep(ctx, **good).launch()
    assert tuple(int(to_numpy(c)[0]) for c in (ctx.slot_run_counter, ctx.kernel_run_counter)) == (3, 2)


_OVER_CONTEXT = {
    "out_cache_loc": lambda ctx: ctx.violation_ring[0, :1],
    "req_to_token": lambda ctx: ctx.canary_buf[:2].view(np.int32),  # 2 x 8 int32 over two slots
    "prefix_lens": lambda ctx: ctx.slot_run_counter,
    "input_ids": lambda ctx: ctx.kernel_run_counter,
}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("read", sorted(_OVER_CONTEXT))
def test_step_over_arrays_of_its_context_is_refused_and_changes_nothing(device, read):
    """A batch array over memory the step stores into (the canary buffer, the ring, a counter) would
    change as the step runs: after the whole verify on the CPU, amid it in a GPU launch. Refused."""
    ctx = kc.CanaryContext.allocate(64, ring_capacity=4, device=device)
    arrays = _one_token_batch(device)
    arrays[read] = _OVER_CONTEXT[read](ctx)
    outputs = (ctx.canary_buf, ctx.violation_ring, ctx.violation_write_index, ctx.slot_run_counter,
               ctx.kernel_run_counter)
    before = [to_numpy(a).copy() for a in outputs]
    with pytest.raises(ValueError, match=rf"^kv-canary: ctx\.\w+ and {read} must not share memory "
                                         r"\(ctx\.\w+ is stored into\)"):
        kc.CanaryStep(ctx, verify_capacity=16, verify_tag=0, write_tag=2, **arrays)
    assert all(np.array_equal(x, to_numpy(y)) for x, y in zip(before, outputs))


def _block_zero_case(rng: np.random.Generator) -> dict:
    """A step case that the GPU runs as one launch whose block 0 hashes the new slots' real-KV bytes
    ahead (33 to 512 requests, decode-shaped, real-KV sources), with its first source a few rows
    short and some new tokens written into the slots past its rows (their hash flags out of range)."""
    while True:
        case = F.make_step_case(rng, 2000)
        bs, n = len(case["req_pool_indices"]), len(case["input_ids"])
        pool = case["pool"]
        if not (32 < bs <= 512 and 0 < n <= 2 * bs and pool["sources"] and pool["hash_mode"] != 0):
            continue
        src = pool["sources"][0]
        rows = max(1, pool["num_slots"] // src["page_size"] - 3)
        src["data"] = src["data"][:rows]
        taken = set(case["out_cache_loc"].tolist()) | F.seed_slots(
            case["req_pool_indices"], case["prefix_lens"], case["req_to_token"], case["full_to_swa_index_mapping"])
        past = [s for s in range(rows * src["page_size"], pool["num_slots"]) if s not in taken]
        live = np.flatnonzero(case["out_cache_loc"] >= 0)
        for i, slot in zip(rng.permutation(live)[:3], past):
            case["out_cache_loc"][i] = slot
        return case


@requires_gpu
def test_step_block_zero_write_with_sources_equals_plan_verify_write():
    """Decode batches past 32 requests with real-KV sources: one launch, whose block 0 hashes every
    new slot ahead while the other blocks verify, equal to plan + verify + write on the CPU, slots
    past a source's rows included."""
    rng = np.random.default_rng(2026)
    for i in range(40):
        case = _block_zero_case(rng)
        arrays = {k: (None if case[k] is None else to_device(case[k], "cuda")) for k in F.STEP_ARRAYS}
        ctx = F.build_context(case["pool"], "cuda")
        assert kc.CanaryStep(ctx, **arrays, **{k: case[k] for k in F.STEP_SETTINGS}).num_launches == 1
        _assert_step_equals_plan_verify_write(case, "cuda", f"case {i}")


@requires_gpu
@pytest.mark.parametrize("bs, n, sources, launches", [
    (1, 1, True, 1), (32, 64, True, 1), (32, 65, True, 2), (33, 33, True, 1), (256, 256, True, 1),
    (512, 1024, True, 1), (513, 513, True, 2), (256, 513, True, 2),
    (33, 33, False, 1), (256, 256, False, 1), (512, 1024, False, 1), (513, 513, False, 2), (256, 513, False, 2),
    (1, 4096, False, 2)])
def test_step_launch_count_on_gpu(bs, n, sources, launches):
    """Decode batches (at most two new tokens a request on average) of up to a block's threads (512)
    requests are one launch, with or without real-KV sources."""
    import cupy

    kw = {}
    if sources:
        kv = cupy.ones((8192, 16), cupy.uint8)
        kw = dict(hash_mode=kc.HashMode.ALL, real_kv_sources=[
            kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=16, read_bytes=16)])
    ctx = kc.CanaryContext.allocate(8192, device="cuda", **kw)
    z = lambda k: cupy.zeros(k, dtype=cupy.int64)  # noqa: E731
    step = kc.CanaryStep(ctx, verify_capacity=10, verify_tag=0, write_tag=2, req_pool_indices=z(bs),
                         prefix_lens=z(bs), extend_seq_lens=z(bs), req_to_token=cupy.zeros((2, 4), cupy.int32),
                         input_ids=z(n), positions=z(n), out_cache_loc=z(n))
    assert step.num_launches == launches


@requires_gpu
# one launch (the first warp of the last block writes), one (block 0 writes, hashing the sources
# ahead), one (block 0 writes), two
@pytest.mark.parametrize("bs, sources", [(8, True), (64, True), (64, False), (600, False)])
def test_step_graph_replay_matches_eager(bs, sources):
    """A captured CanaryStep replayed after refilling its inputs in place equals eager launches."""
    import cupy

    def build():
        rng = np.random.default_rng(5)
        width, num_slots = 64, 65536
        kv = cupy.asarray(rng.integers(0, 256, size=(num_slots, 32), dtype=np.uint8))
        kw = {}
        if sources:
            kw = dict(hash_mode=kc.HashMode.ALL, real_kv_sources=[
                kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=32, read_bytes=32)])
        ctx = kc.CanaryContext.allocate(num_slots, device="cuda", ring_capacity=64, **kw)
        table = np.zeros((bs + 1, width), np.int32)
        table[1:] = (rng.permutation(num_slots - 1)[: bs * width] + 1).reshape(bs, width)
        arrays = dict(req_pool_indices=cupy.arange(1, bs + 1, dtype=cupy.int64),
                      prefix_lens=cupy.zeros(bs, cupy.int64), extend_seq_lens=cupy.ones(bs, cupy.int64),
                      req_to_token=cupy.asarray(table), input_ids=cupy.zeros(bs, cupy.int64),
                      positions=cupy.zeros(bs, cupy.int64), out_cache_loc=cupy.zeros(bs, cupy.int64))
        step = kc.CanaryStep(ctx, verify_capacity=bs * width, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                             write_tag=kc.LaunchTag.TAIL_K_FULL, **arrays)
        return ctx, table, arrays, step

    def refresh(arrays, table, t):
        arrays["prefix_lens"].fill(t)
        arrays["positions"].fill(t)
        arrays["input_ids"][...] = cupy.asarray(np.random.default_rng(t).integers(0, 150_000, size=bs))
        arrays["out_cache_loc"][...] = cupy.asarray(table[1:, t].astype(np.int64))
        cupy.cuda.get_current_stream().synchronize()

    eager, graphed = build(), build()
    stream = cupy.cuda.Stream(non_blocking=True)
    for ctx, table, arrays, step in (eager, graphed):  # step 0 eagerly on both; loads the kernels
        refresh(arrays, table, 0)
        step.launch(stream=stream)
        stream.synchronize()
    with stream:
        stream.begin_capture()
        graphed[3].launch(stream=stream)
        graph = stream.end_capture()
    for t in range(1, 10):
        refresh(eager[2], eager[1], t)
        eager[3].launch()
        refresh(graphed[2], graphed[1], t)
        graph.launch(stream)
        stream.synchronize()
        cupy.cuda.get_current_stream().synchronize()
        assert cupy.array_equal(eager[0].canary_buf, graphed[0].canary_buf)
    assert eager[0].violations().total == 0 and graphed[0].violations().total == 0
    counters = graphed[0].counters()
    assert counters["kernel_run_counter"] == 2 * 10 and counters["violations"] == 0


@requires_gpu
@pytest.mark.parametrize("dense", [False, True], ids=["fuzz_cases", "every_entry_a_row"])
def test_more_verify_entries_than_one_pass_of_the_grid_equal_the_cpu_backend(dense):
    """The step's stride over a batch's verify entries, a block taking every grid-th stride:
    batches of more entries than one pass of any grid the GPU holds at once equal the CPU backend.
    The fuzz's cases are rarely that large, and their few corrupted slots rarely fall where a
    stride that no block took would be: over a canary of random words (``dense``, a step whose
    block 0 stores the write plan apart from the verify blocks), nearly every entry records a row,
    so an entry left unverified is a row missing."""
    for seed in (71, 72):
        assert F.past_one_grid_pass_equal_the_cpu_backend("step", seed, dense=dense, tail_write=not dense) == [], \
            f"seed {seed}"


def _decode_batch(bs: int, prefix: int):
    """A decode batch of bs requests with prefix tokens each, request r on pool row r + 1 whose slots
    are its own (slot 0 unused): the req_to_token table and the new tokens' slots."""
    import cupy

    width = prefix + 1
    table = cupy.arange(1, (bs + 1) * width + 1, dtype=cupy.int32).reshape(bs + 1, width) - width
    return table, table[1:, prefix].astype(cupy.int64)


def _decode_step(ctx, table, new_slots, input_ids) -> kc.CanaryStep:
    import cupy

    bs, prefix = int(new_slots.shape[0]), int(table.shape[1]) - 1
    return kc.CanaryStep(ctx, verify_capacity=bs * prefix, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                         write_tag=kc.LaunchTag.TAIL_K_FULL, req_pool_indices=cupy.arange(1, bs + 1),
                         prefix_lens=cupy.full(bs, prefix, cupy.int64), extend_seq_lens=cupy.ones(bs, cupy.int64),
                         req_to_token=table, input_ids=input_ids, positions=cupy.full(bs, prefix, cupy.int64),
                         out_cache_loc=new_slots)


@requires_gpu
def test_step_built_while_the_current_stream_is_busy_writes_on_another_stream():
    """A one-launch step built while the current stream is busy (the zeroing of its done counter
    queued behind a spin there) and launched at once on a non-blocking stream still writes: the
    zeroing is waited for when the step is built. Done under the running launch, it would drop the
    counts of the blocks that had finished verifying, and no block would find itself last to write."""
    import cupy

    spin = spin_kernel()
    bs, prefix = 512, 16384  # a long verify (every zeroed slot is a violation), one launch (bs <= 512)
    table, new_slots = _decode_batch(bs, prefix)
    ctx = kc.CanaryContext.allocate(int(table.size) - prefix, device="cuda", ring_capacity=16)
    input_ids = cupy.arange(7, 7 + bs, dtype=cupy.int64)

    def build():
        return _decode_step(ctx, table, new_slots, input_ids)

    assert build().num_launches == 1
    build().launch()  # compiles and loads the step's kernels
    spin((1,), (1,), (cupy.uint64(0),))
    cupy.cuda.Device().synchronize()
    ctx.canary_buf[...] = 0
    cupy.cuda.Device().synchronize()

    spin((1,), (1,), (cupy.uint64(500_000),))  # on the current stream
    step = build()
    stream = cupy.cuda.Stream(non_blocking=True)
    step.launch(stream=stream)
    cupy.cuda.Device().synchronize()
    written = slot_words(ctx.canary_buf)[to_numpy(new_slots)]
    assert np.array_equal(written[:, 0], to_numpy(input_ids))  # the token word of every new slot


@requires_gpu
def test_steps_on_concurrent_streams_write_at_every_launch():
    """Two one-launch steps (two contexts) launched in turn 200 times each on two non-blocking
    streams, so that their kernels overlap: every launch of each verifies and writes (its kernel run
    counter grows by two), none waits on the other, and the new slots hold their tokens."""
    import cupy

    bs, prefix, launches = 64, 1024, 200
    table, new_slots = _decode_batch(bs, prefix)
    runs = []
    for first_token in (3, 4):
        ctx = kc.CanaryContext.allocate(int(table.size) - prefix, device="cuda", ring_capacity=16)
        input_ids = cupy.arange(first_token, first_token + bs, dtype=cupy.int64)
        step = _decode_step(ctx, table, new_slots, input_ids)
        assert step.num_launches == 1
        runs.append((ctx, step, input_ids, cupy.cuda.Stream(non_blocking=True)))
    cupy.cuda.Device().synchronize()  # the batches' arrays, filled on the current stream, which those do not wait for
    # each step's block 0 waits on a done counter of its own, which the other's blocks never touch
    counters = [step._launches[0].args[-2] for _, step, _, _ in runs]
    assert all(counter.dtype == cupy.uint32 and counter.size == 1 for counter in counters)
    assert counters[0].data.ptr != counters[1].data.ptr
    for _ in range(launches):
        for _, step, _, stream in runs:
            step.launch(stream=stream)
    for _, _, _, stream in runs:
        stream.synchronize()
    for (ctx, _, input_ids, _), counter in zip(runs, counters):
        assert ctx.counters()["kernel_run_counter"] == 2 * launches
        written = slot_words(ctx.canary_buf)[to_numpy(new_slots)]
        assert np.array_equal(written[:, 0], to_numpy(input_ids))
        assert int(counter[0]) == 0  # every launch's block 0 counted its verify blocks and reset it


@requires_gpu
@pytest.mark.parametrize("form", ["current", "cupy", "handle", "protocol"])
def test_step_launches_on_the_given_stream(form):
    """A relaunch (parameters packed once, one driver call) goes to the stream it is given, in every form
    the ops take: behind a 200 ms spin on that stream it has not run yet, and it runs once the spin ends."""
    import cupy

    spin = spin_kernel()
    bs, width = 4, 8
    ctx = kc.CanaryContext.allocate(256, device="cuda")
    table = cupy.asarray(np.arange(bs * width + width, dtype=np.int32).reshape(bs + 1, width))
    step = kc.CanaryStep(ctx, verify_capacity=bs * width, verify_tag=kc.LaunchTag.HEAD_K_FULL,
                         write_tag=kc.LaunchTag.TAIL_K_FULL, req_pool_indices=cupy.arange(1, bs + 1),
                         prefix_lens=cupy.zeros(bs, cupy.int64), extend_seq_lens=cupy.ones(bs, cupy.int64),
                         req_to_token=table, input_ids=cupy.arange(bs), positions=cupy.zeros(bs, cupy.int64),
                         out_cache_loc=table[1:, 0].astype(cupy.int64))
    stream, probe = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)

    def runs_seen_by_probe() -> int:
        with probe:
            return int(ctx.kernel_run_counter.copy()[0])

    # compile and load everything the timed part uses: the step's kernels, the spin, the probe's copy
    step.launch()
    spin((1,), (1,), (cupy.uint64(0),))
    cupy.cuda.Device().synchronize()
    assert runs_seen_by_probe() == 2

    class Protocol:
        def __cuda_stream__(self):
            return (0, stream.ptr)

    with stream:
        spin((1,), (1,), (cupy.uint64(200_000_000),))
    if form == "current":
        with stream:
            step.launch()
    else:
        step.launch(stream={"cupy": stream, "handle": stream.ptr, "protocol": Protocol()}[form])
    early = runs_seen_by_probe()
    stream.synchronize()
    # one launch of a small decode step counts two kernel runs (its verify and its write)
    assert early == 2, "the step ran before the spin on its stream had ended"
    assert int(ctx.kernel_run_counter[0]) == 4


# Zeroes a step launch's done counter over and over (a stray write into the canary's memory),
# eating each count the verify blocks add, from before the launch until the launch has written
# (its kernel run counter reaches `until`). out[0]: the counts eaten; out[1]: the most eaten at once
# (the most the counter ever held); out[2]: 1 when the wiper stopped at its own bound of `limit_ns`
# instead, having set the counter past any target so that an unbounded wait would still end.
_WIPER = r'''
extern "C" __global__ void wipe(unsigned int* counter, const unsigned long long* runs, unsigned long long until,
                                unsigned long long limit_ns, unsigned long long* out) {
    unsigned long long t0, t, eaten = 0ull, most = 0ull, stopped = 0ull;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        const unsigned int got = atomicExch(counter, 0u);
        eaten += got;
        if (got > most) most = got;
        if (*(volatile const unsigned long long*)runs >= until) break;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 >= limit_ns) {
            stopped = 1ull;
            atomicExch(counter, 0xFFFFFFFFu);
            break;
        }
    }
    out[0] = eaten;
    out[1] = most;
    out[2] = stopped;
}'''


_WIPED_LAUNCHES = 4


@requires_gpu
def test_step_whose_done_counter_is_wiped_while_it_runs_ends_and_writes():
    """Block 0 of a one-launch step past 32 requests waits for the verify blocks' count before it
    writes. Zeroed over and over from another stream while the launch runs (a stray write into the
    canary's memory), the count never arrives: the wait is bounded, so the launch still ends, writes
    the new tokens and counts its runs, and the next launch finds its counter at zero again.
    A launch is judged by what the wiper saw: where it ate every count the verify blocks added and
    never as many at once as block 0 waits for, the launch could end only through its bound. Blocks
    that finish at the same moment can add them all between two of the wiper's swaps (then block 0
    may see its target and end early), so the wiped launch runs again, up to a few times, until one
    ends through its bound; every one of them must end, write and count its runs."""
    import cupy

    wiper = cupy.RawKernel(_WIPER, "wipe")
    bs, prefix = 256, 64
    table, new_slots = _decode_batch(bs, prefix)
    ctx = kc.CanaryContext.allocate(int(table.size) - prefix, device="cuda", ring_capacity=16)
    input_ids = cupy.arange(11, 11 + bs, dtype=cupy.int64)
    step = _decode_step(ctx, table, new_slots, input_ids)
    grid = step._launches[0].grid[0]
    assert step.num_launches == 1 and grid > 2
    counter = step._launches[0].args[-2]  # the launch's done counter (its last argument but one)
    assert counter.dtype == cupy.uint32 and counter.size == 1
    out = cupy.zeros(3, cupy.uint64)
    step.launch()
    wiper((1,), (1,), (counter, ctx.kernel_run_counter, cupy.uint64(0), cupy.uint64(0), out))  # loads it
    cupy.cuda.Device().synchronize()
    assert int(counter[0]) == 0 and ctx.counters()["kernel_run_counter"] == 2

    wiping, stepping = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    runs = 2
    for _ in range(_WIPED_LAUNCHES):
        with wiping:  # until the launch's write is counted; a 30 s bound only if the launch never ends
            wiper((1,), (1,), (counter, ctx.kernel_run_counter, cupy.uint64(runs + 2), cupy.uint64(30_000_000_000), out))
        step.launch(stream=stepping)
        stepping.synchronize()
        cupy.cuda.Device().synchronize()
        runs += 2
        eaten, most, stopped = (int(v) for v in out.get())
        assert stopped == 0, "the launch did not end while its done counter was wiped"
        assert ctx.counters()["kernel_run_counter"] == runs
        written = slot_words(ctx.canary_buf)[to_numpy(new_slots)]
        assert np.array_equal(written[:, 0], to_numpy(input_ids))
        assert int(counter[0]) == 0
        # Every count eaten, none held whole: block 0 never saw the target, so its bound ended the wait.
        # (Had block 0 seen it, the wiper would have eaten it whole, or block 0 zeroed it first.)
        if eaten == grid - 1 and most < grid - 1:
            break
    else:
        pytest.fail(f"no launch of {_WIPED_LAUNCHES} ended through its bound: the last one's wiper ate {eaten} of "
                    f"{grid - 1} counts, at most {most} at once")

    assert int(counter[0]) == 0  # what the next launch finds
    input_ids[...] = cupy.arange(5000, 5000 + bs, dtype=cupy.int64)  # read in place by the packed launch
    cupy.cuda.Device().synchronize()
    step.launch(stream=stepping)
    stepping.synchronize()
    assert ctx.counters()["kernel_run_counter"] == runs + 2
    written = slot_words(ctx.canary_buf)[to_numpy(new_slots)]
    assert np.array_equal(written[:, 0], np.arange(5000, 5000 + bs))
    assert int(counter[0]) == 0  # reset by block 0 once it had counted every verify block


class _BatchSizeOf:
    """A Generator that gives ``make_step_case`` the batch size ``bs`` (its first draw, from its list
    of sizes), every other draw being the wrapped generator's: the fuzz case's hostile corners at a
    size the list does not hold."""

    _SIZES = [0, 1, 2, 7, 32, 256, 1024, 1500]

    def __init__(self, rng: np.random.Generator, bs: int):
        self._rng, self._bs = rng, bs

    def choice(self, a, *args, **kwargs):
        if not args and not kwargs and isinstance(a, list) and a == self._SIZES:
            return self._bs
        return self._rng.choice(a, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._rng, name)


def _truncated(case: dict, n: int) -> dict:
    """``case`` with its first ``n`` entries (fewer entries than the extends add up to)."""
    case = dict(case)
    for name in ("input_ids", "positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions"):
        if case[name] is not None:
            case[name] = case[name][:n].copy()
    return case


def _step_form_cases(bs: int, entries: str, count: int, seed: int) -> list:
    """Fuzz step cases of ``bs`` requests whose entry count is at most ``bs`` (``"decode"``), exactly
    ``2 * bs`` (the most a decode-shaped batch has) or ``2 * bs + 1`` (the least one that is not),
    half of them with real-KV sources."""
    rng = np.random.default_rng([seed, bs, len(entries)])
    cases = []
    while len(cases) < count:
        case = F.make_step_case(_BatchSizeOf(rng, bs), 20_000 if len(cases) % 3 == 2 else 2000)
        n = len(case["input_ids"])
        if bool(case["pool"]["sources"]) != (len(cases) % 2 == 0):
            continue
        if entries == "decode":
            if not 0 < n <= bs:
                continue
        else:
            want = 2 * bs + (entries == "past_decode")
            if n < want:
                continue
            case = _truncated(case, want)
        cases.append(case)
    return cases


# Batch sizes at the step's form boundaries: the tail write's 32 requests (a lane each of one
# warp), block 0's 512 (a thread each, and with sources 1024 entries hashed ahead), a tile of
# requests staged by the verify blocks (512).
_STEP_FORM_SIZES = [31, 32, 33, 511, 512, 513]


@pytest.mark.parametrize("bs", _STEP_FORM_SIZES)
@pytest.mark.parametrize("entries", ["decode", "two_a_request", "past_decode"])
def test_step_form_cases_have_the_shape_they_name(bs, entries):
    """The cases below reach the GPU form their shape names (the host's choice, no GPU needed)."""
    from kvcanary_cupy.ops.backends._cuda import step as cuda_step

    for case in _step_form_cases(bs, entries, 1, seed=0):
        n = len(case["input_ids"])
        assert len(case["req_pool_indices"]) == bs
        assert n <= bs if entries == "decode" else n == 2 * bs + (entries == "past_decode")
        tail = cuda_step.tail_write(bs, n)
        block_zero = not tail and cuda_step.plan_block_write(bs, n)
        assert tail == (bs <= 32 and entries != "past_decode")
        assert block_zero == (32 < bs <= 512 and entries != "past_decode")


@requires_gpu
@pytest.mark.parametrize("bs", _STEP_FORM_SIZES)
@pytest.mark.parametrize("entries", ["decode", "two_a_request", "past_decode"])
def test_step_at_its_form_boundaries_equals_plan_verify_write(bs, entries):
    """Batches of 31 to 33 and 511 to 513 requests with up to two entries a request, exactly two and
    one more: the tail write, block 0's write (every thread of the block a request at 512, 1024
    new slots hashed ahead with sources) and the two-launch step, each on either side of its bound,
    launched twice over the same arrays (the completion counter reset between), equal plan + verify +
    write on the CPU launched twice. The fuzz draws batch sizes 32 and 256 for block 0's form, so
    neither its bound nor a tile's is reached otherwise."""
    from kvcanary_cupy.ops.backends._cuda import step as cuda_step

    twice = functools.partial(F.run_step_unfused, device="cpu", launches=2)
    for i, case in enumerate(_step_form_cases(bs, entries, 2, seed=1)):
        n = len(case["input_ids"])
        arrays = {k: (None if case[k] is None else to_device(case[k], "cuda")) for k in F.STEP_ARRAYS}
        ctx = F.build_context(case["pool"], "cuda")
        step = kc.CanaryStep(ctx, **arrays, **{k: case[k] for k in F.STEP_SETTINGS})
        one_launch = cuda_step.tail_write(bs, n) or cuda_step.plan_block_write(bs, n)
        assert step.num_launches == (1 if one_launch else 2)
        for _ in range(2):
            step.launch()
        fused = F._context_outputs(ctx)
        oracle = twice(case)
        assert F.compare_overflow_aware("step", case, oracle, fused, run=twice) == [], \
            f"bs {bs}, {entries}, case {i}"


def _device_array_at(address: int):
    """What a packed launch reads of a device array: its data pointer (no GPU needed)."""
    import types

    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=address))


def test_packed_kernel_parameters_are_addresses_or_c_scalars():
    """A packed launch (the step's and every prepared one) turns each parameter into the C value the
    kernel receives: a device array's address, or an int64, int32, uint64 or uint32 scalar. Any
    other value is a launcher's mistake, refused by its type, never passed on as some address."""
    import ctypes

    from kvcanary_cupy.ops.backends._cuda import _c_parameter

    assert _c_parameter(_device_array_at(0x7F00_1000)).value == 0x7F00_1000
    for scalar, ctype in ((np.int64(-5), ctypes.c_int64), (np.int32(-7), ctypes.c_int32),
                          (np.uint64(2**64 - 1), ctypes.c_uint64), (np.uint32(9), ctypes.c_uint32)):
        value = _c_parameter(scalar)
        assert type(value) is ctype and value.value == scalar.item()
    with pytest.raises(TypeError, match=r"^kv-canary: kernel parameter of dtype float64 has no C type here$"):
        _c_parameter(np.float64(1.5))
    for value, name in ((np.arange(2), "ndarray"), (None, "NoneType"), (3, "int")):
        with pytest.raises(TypeError, match=rf"^kv-canary: kernel parameter of type {name} cannot be packed$"):
            _c_parameter(value)


def test_only_a_packed_launch_detaches_from_its_arrays():
    """A prepared launch kept in a cache lets go of the arrays it was built with and is pointed at
    the caller's before each call. An unpacked launch holds nothing but those arrays: detaching it
    is refused, and it keeps them."""
    import types

    from kvcanary_cupy.ops.backends._cuda import Launch

    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00))
    first, second = _device_array_at(0x7F00_1000), _device_array_at(0x7F00_2000)
    packed = Launch(fn, 4, 128, (first, np.int64(3), second, first), packed=True)
    assert packed.parameters_of(first) == [0, 3] and packed.parameters_of(second) == [2]
    assert packed.parameters_of(_device_array_at(0x7F00_1000)) == []  # the object, not its address
    assert packed.detach() is packed and packed.args == ()
    packed.rebind(((0, 1), (3, 1), (2, 0)), [0x7F00_3000, 0x7F00_4000])
    assert [value.value for value in packed._packed.values] == [0x7F00_4000, 3, 0x7F00_3000, 0x7F00_4000]
    plain = Launch(fn, 4, 128, (first, np.int64(3)))
    with pytest.raises(ValueError, match=r"^kv-canary: only a packed launch holds its parameters without its arrays$"):
        plain.detach()
    assert plain.args == (first, np.int64(3))


def test_the_cuda_step_grid_is_a_block_a_tile_of_entries_and_the_write_plans_block_up_to_the_resident_grid(
        monkeypatch):
    """The CUDA step's launches, on the host with the kernels stood in for. The verify blocks are
    one a block of the entries the batch can have at most; block 0, which stores the write plan,
    comes on top but for the tail form, whose last block writes. The grid never passes the blocks
    that fill the GPU once (here 6): where block 0 writes a decode batch it waits for the verify
    blocks, and a block past the resident ones might never start. Batches too large for one launch
    add the write's."""
    from kvcanary_cupy.ops.backends._cuda import step as launcher
    from kvcanary_cupy.ops.backends._cuda import write as write_launcher
    from kvcanary_cupy.ops.batches import PlanBatch, WriteBatch

    for module in (launcher, write_launcher):
        monkeypatch.setattr(module, "kernel", lambda source, name, device_id: name)
        monkeypatch.setattr(module, "resident_grid", lambda source, name, device_id, block: 6)
        monkeypatch.setattr(module, "vec16", lambda array: True)
        monkeypatch.setattr(module, "Launch", lambda fn, grid, block, args, packed=False: (fn, grid, block))
    ctx = kc.CanaryContext.allocate(1 << 16)
    block = launcher._BLOCK

    def launches(batch_size, new_tokens, verify_capacity):
        batch = PlanBatch(req_pool_indices=np.arange(batch_size), prefix_lens=np.full(batch_size, 40),
                          extend_seq_lens=np.full(batch_size, new_tokens, np.int64),
                          req_to_token=np.zeros((batch_size, 4 * block), np.int32))
        entries = np.arange(batch_size * new_tokens)
        writes = WriteBatch(tag=0, input_ids=entries, positions=entries, out_cache_loc=entries)
        made = launcher.prepare(ctx, kc.WritePlan.allocate(batch_size), batch, writes,
                                verify_capacity=verify_capacity, verify_tag=0, check_expected_token=False)
        (name, grid, size), *others = made
        assert name.startswith("kvc_step<") and size == block
        return grid, [other_name for other_name, _, _ in others]

    tail = launcher.TAIL_MAX_REQUESTS
    assert launches(tail, 1, 8) == (1, [])  # the tail form: verify blocks only, at least one
    assert launches(tail, 1, 2 * block + 1) == (3, [])
    assert launches(tail + 1, 1, 8) == (2, [])  # block 0 and a verify block
    assert launches(tail + 1, 1, 2 * block + 1) == (4, [])
    assert launches(tail + 1, 1, 10 * block) == (6, [])  # the resident grid
    grid, writes = launches(3, 300, 2 * block + 1)  # too many new tokens for the step to write
    assert grid == 4 and len(writes) == 1 and writes[0].startswith("kvc_write")
