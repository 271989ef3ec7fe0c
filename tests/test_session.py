"""kc.Canary: per-forward calls, reports mapped to requests, modes, overflow, layout builders."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from _devices import BACKENDS, requires_gpu, spin_kernel, to_device, to_numpy

SLOTS = 64
ROWS = 4
WIDTH = 32


class Tiny:
    """Two requests in a 64-slot pool with per-layer K/V buffers, on ``device``."""

    def __init__(self, device, mode="log", verify_capacity=None, swa=False, hash_mode=kc.HashMode.ALL, stream=None):
        self.device = device
        self.stream = stream
        self.spin = spin_kernel() if stream is not None else None
        self.table = to_device(np.zeros((ROWS, WIDTH), np.int32), device)
        self.k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        self.v = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
        caps = kc.Capacities.from_args(req_to_token_pool_size=ROWS, max_seq_len_per_req=WIDTH, pool_slot_count=SLOTS,
                                       max_prefill_tokens=64)
        if verify_capacity is not None:
            caps = kc.Capacities(caps.max_bs, verify_capacity, caps.write_req_capacity, caps.write_entry_capacity)
        group = None
        if swa:
            self.lut = to_device(np.arange(SLOTS + 1, dtype=np.int64)[::-1].copy() % SLOTS, device)
            self.swa_k = to_device(np.zeros((SLOTS, 2, 8), np.float32), device)
            group = kc.SwaGroup(window=4, lut=self.lut, num_slots=SLOTS,
                                real_kv_sources=kc.layouts.per_layer([self.swa_k]))
        self.canary = kc.Canary(pool_slot_count=SLOTS, capacities=caps, req_to_token=self.table, device=device,
                                real_kv_sources=kc.layouts.per_layer([self.k], [self.v]), hash_mode=hash_mode,
                                mode=mode, swa=group, chain_position_assert=True)
        self.rows = {"a": 1, "b": 2}
        self.lens = {"a": 0, "b": 0}
        self.next_slot = 1
        self.rng = np.random.default_rng(0)

    def step(self, extend: dict) -> kc.ForwardBatch:
        rids = list(extend)
        ids, pos, loc = [], [], []
        table = to_numpy(self.table).copy()
        for rid in rids:
            for p in range(self.lens[rid], self.lens[rid] + extend[rid]):
                table[self.rows[rid], p] = self.next_slot
                ids.append(1000 * self.rows[rid] + p)
                pos.append(p)
                loc.append(self.next_slot)
                self.next_slot += 1
        self.table[...] = to_device(table, self.device)
        i64 = lambda a: to_device(np.asarray(a, np.int64), self.device)  # noqa: E731
        batch = kc.ForwardBatch(req_pool_indices=i64([self.rows[r] for r in rids]),
                                prefix_lens=i64([self.lens[r] for r in rids]),
                                extend_seq_lens=i64([extend[r] for r in rids]), input_ids=i64(ids),
                                positions=i64(pos), out_cache_loc=i64(loc), req_ids=rids)
        self.call(self.canary.before_forward, batch)
        n = len(loc)
        for buf in (self.k, self.v):
            buf[i64(loc)] = to_device(self.rng.standard_normal((n, 2, 8)).astype(np.float32), self.device)
        if hasattr(self, "swa_k"):
            swa = to_numpy(self.lut)[loc]
            self.swa_k[i64(swa)] = to_device(self.rng.standard_normal((n, 2, 8)).astype(np.float32), self.device)
        self.call(self.canary.after_forward, batch)
        for rid in rids:
            self.lens[rid] += extend[rid]
        return batch

    def call(self, op, argument) -> None:
        """``op(argument)``; with a stream, the op runs on it while it is still busy with a spin and
        the engine's own array work stays on the current stream (the engine waits for both)."""
        if self.stream is None:
            op(argument)
            return
        import cupy

        cupy.cuda.Device().synchronize()
        with self.stream:
            self.spin((1,), (1,), (cupy.uint64(2_000_000),))
        op(argument, stream=self.stream)
        self.stream.synchronize()

    def slot(self, rid, position):
        return int(to_numpy(self.table)[self.rows[rid], position])


@pytest.mark.parametrize("device", BACKENDS)
def test_clean_forwards_and_sweep(device):
    eng = Tiny(device)
    eng.step({"a": 5, "b": 3})
    for _ in range(4):
        eng.step({"a": 1, "b": 1})
    eng.canary.sweep(kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), device),
                                     seq_lens=to_device(np.array([9, 7], np.int64), device), req_ids=["a", "b"]))
    report = eng.canary.poll()
    assert not report and report.total == 0 and report.capacity_overflows == 0
    assert report.forwards == 5


@pytest.mark.parametrize("device", BACKENDS)
def test_kv_corruption_names_request_and_position(device):
    eng = Tiny(device)
    eng.step({"a": 6, "b": 4})
    eng.k[eng.slot("b", 2), 0, 0] += 1.0
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    assert report.total >= 1
    event = report[0]
    assert (event.request, event.position, event.slot) == ("b", 2, eng.slot("b", 2))
    assert "REAL_KV_HASH" in event.reasons
    assert event.tag == kc.LaunchTag.HEAD_K_FULL and event.phase == "head" and event.step == 2
    assert report.counts_by_tag()["HEAD_K_FULL"] == 1
    assert eng.canary.poll().total == 0, "poll clears the ring"


@pytest.mark.parametrize("device", BACKENDS)
def test_alias_resolves_to_the_reading_request(device):
    eng = Tiny(device)
    eng.step({"a": 6, "b": 6})
    table = to_numpy(eng.table).copy()
    table[1, 3] = table[2, 3]  # a's position 3 now points at b's position 3
    eng.table[...] = to_device(table, device)
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    first = [e for e in report if e.phase == "head"]
    assert {(e.request, e.position) for e in first} == {("a", 3), ("a", 4)}


@pytest.mark.parametrize("device", BACKENDS)
def test_write_assert_names_entry(device):
    eng = Tiny(device)
    eng.step({"a": 4, "b": 4})
    # b's new token written at a stale position: the chain position assert flags the write itself
    rids = ["a", "b"]
    i64 = lambda a: to_device(np.asarray(a, np.int64), device)  # noqa: E731
    table = to_numpy(eng.table).copy()
    table[1, 4], table[2, 4] = 40, 41
    eng.table[...] = to_device(table, device)
    batch = kc.ForwardBatch(req_pool_indices=i64([1, 2]), prefix_lens=i64([4, 4]), extend_seq_lens=i64([1, 1]),
                            input_ids=i64([7, 8]), positions=i64([4, 2]), out_cache_loc=i64([40, 41]), req_ids=rids)
    eng.canary.before_forward(batch)
    eng.canary.after_forward(batch)
    report = eng.canary.poll()
    writes = [e for e in report if e.phase == "write"]
    assert [(e.request, e.position, e.slot) for e in writes] == [("b", 4, 41)]
    assert "WRITE_POSITION" in writes[0].reasons


@pytest.mark.parametrize("device", BACKENDS)
def test_raise_mode_raises(device):
    eng = Tiny(device, mode="raise")
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    eng.step({"a": 1})
    with pytest.raises(kc.CanaryViolation) as info:
        eng.canary.poll()
    assert info.value.report.total >= 1
    assert "a" in info.value.report.requests
    assert "kv-canary" in str(info.value)


def test_off_mode_does_nothing():
    eng = Tiny("cpu", mode="off")
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    eng.step({"a": 1})
    assert eng.canary.poll().total == 0
    assert eng.canary.stats()["full"]["kernel_run_counter"] == 0


def test_log_mode_logs(caplog):
    eng = Tiny("cpu", mode="log")
    eng.step({"a": 3})
    eng.canary.context.canary_buf[eng.slot("a", 1), :8] = 0xAB
    with caplog.at_level("WARNING", logger="kvcanary_cupy"):
        eng.step({"a": 1})
        report = eng.canary.poll()
    assert report.total >= 1
    assert "violation" in caplog.text


@pytest.mark.parametrize("device", BACKENDS)
def test_capacity_overflow_is_reported(device):
    eng = Tiny(device, verify_capacity=4)
    eng.step({"a": 6})
    eng.step({"a": 1})  # 6 prefix entries > capacity 4: verify skipped, and said so
    report = eng.canary.poll()
    assert report.capacity_overflows == 2  # HEAD and TAIL of step 2 (step 1 has no prefix)
    assert report.total == 0
    assert "capacity" in report.describe()


@pytest.mark.parametrize("device", BACKENDS)
def test_swa_group(device):
    eng = Tiny(device, swa=True)
    eng.step({"a": 6, "b": 2})
    eng.step({"a": 1, "b": 1})
    assert eng.canary.poll().total == 0
    lut = to_numpy(eng.lut)
    eng.swa_k[int(lut[eng.slot("a", 5)]), 0, 0] += 1.0  # inside a's window
    eng.step({"a": 1, "b": 1})
    report = eng.canary.poll()
    swa = [e for e in report if e.group == "swa"]
    assert swa and swa[0].tag == kc.LaunchTag.HEAD_K_SWA
    assert (swa[0].request, swa[0].position) == ("a", 5)
    assert not [e for e in report if e.group == "full"]


def _overflow_swa_and_sweep(eng: Tiny) -> kc.CanaryReport:
    eng.step({"a": 6, "b": 2})
    eng.step({"a": 1, "b": 1})
    eng.swa_k[int(to_numpy(eng.lut)[eng.slot("a", 5)]), 0, 0] += 1.0
    eng.k[eng.slot("b", 1), 1, 3] -= 1.0
    eng.step({"a": 1, "b": 1})
    eng.call(eng.canary.sweep, kc.LiveRequests(req_pool_indices=to_device(np.array([1, 2], np.int64), eng.device),
                                               seq_lens=to_device(np.array([8, 4], np.int64), eng.device),
                                               req_ids=["a", "b"]))
    return eng.canary.poll()


def _event_keys(report: kc.CanaryReport) -> list:
    return sorted((e.group, e.phase, e.tag, e.request, e.position, e.slot, e.step, tuple(e.reasons)) for e in report)


@requires_gpu
def test_session_on_a_busy_non_blocking_stream_matches_the_cpu():
    """A canary whose ops are given a non-blocking stream, still busy when each op is called, while
    the engine's own work stays on the current stream: its overflow counts, SWA slot translation and
    sweep must follow the ops on their stream, so the report equals the CPU's."""
    import cupy

    expected = _overflow_swa_and_sweep(Tiny("cpu", verify_capacity=10, swa=True))
    assert expected.capacity_overflows > 0 and {e.group for e in expected} == {"full", "swa"}
    stream = cupy.cuda.Stream(non_blocking=True)
    report = _overflow_swa_and_sweep(Tiny("cuda", verify_capacity=10, swa=True, stream=stream))
    assert (report.total, report.dropped, report.capacity_overflows, report.forwards) == (
        expected.total, expected.dropped, expected.capacity_overflows, expected.forwards)
    assert _event_keys(report) == _event_keys(expected)


def test_bad_mode_rejected():
    with pytest.raises(ValueError, match="kv-canary: mode"):
        Tiny("cpu", mode="loud")


# --- layout builders ------------------------------------------------------------------------------
def test_layout_builders_geometry():
    k = [np.zeros((16, 2, 8), np.float16) for _ in range(3)]
    v = [np.zeros((16, 2, 8), np.float16) for _ in range(3)]
    sources = kc.layouts.per_layer(k, v, layers=[0, 2])
    assert len(sources) == 4 and all(s.page_size == 1 and s.num_bytes_per_token == 32 for s in sources)
    assert sources[2].tensor is k[2]

    pk = [np.zeros((4, 16, 2, 8), np.float16)]
    (src, src_v) = kc.layouts.paged(pk, pk)
    assert src.page_size == 16 and src.num_bytes_per_token == 32 and src.read_bytes == 32

    inter = [np.zeros((16, 2, 2, 8), np.float32)]
    k_part, v_part = kc.layouts.interleaved(inter)
    assert k_part.num_bytes_per_token == v_part.num_bytes_per_token == 64
    assert v_part.base_address == inter[0].ctypes.data + 64
    (whole,) = kc.layouts.interleaved(inter, split=False)
    assert whole.num_bytes_per_token == 128

    latent = [np.zeros((16, 1, 288), np.float16)]
    (m,) = kc.layouts.mla(latent, read_bytes=64)
    assert m.num_bytes_per_token == 576 and m.read_bytes == 64

    with pytest.raises(ValueError, match="kv-canary"):
        kc.layouts.per_layer(k, v[:1])
    with pytest.raises(ValueError, match="kv-canary"):
        kc.layouts.paged([np.zeros((4, 16), np.float16)])


def test_layout_builders_accept_torch_bfloat16():
    torch = pytest.importorskip("torch")
    k = [torch.zeros((8, 2, 8), dtype=torch.bfloat16)]
    (src,) = kc.layouts.per_layer(k)
    assert src.num_bytes_per_token == 32
    buf = [torch.zeros((8, 2, 2, 8), dtype=torch.bfloat16)]
    parts = kc.layouts.interleaved(buf)
    assert [p.num_bytes_per_token for p in parts] == [32, 32]
    # the canary sees a change made through torch
    ctx = kc.CanaryContext.allocate(8, real_kv_sources=parts, hash_mode=kc.HashMode.ALL)
    wplan = kc.WritePlan.from_host(offsets=[0, 1], seed_slot_indices=[-1], num_valid_reqs=1)
    one = lambda v: np.array([v], np.int64)  # noqa: E731
    kc.write(ctx, wplan, tag=kc.LaunchTag.TAIL_K_FULL, input_ids=one(5), positions=one(0), out_cache_loc=one(3))
    vplan = kc.VerifyPlan(slot_indices=one(3), expected_tokens=one(5), expected_positions=one(0),
                          prev_slot_indices=one(-1), num_valid=np.array([1], np.int32), enable=np.array([1], np.int32))
    kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL)
    assert ctx.violations().total == 0
    buf[0][3, 1, 0, 0] = 1.5  # V half
    kc.verify(ctx, vplan, tag=kc.LaunchTag.HEAD_K_FULL)
    assert ctx.violations().total == 1
