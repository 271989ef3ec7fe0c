"""Options, fixtures and the shared measuring harness of the benchmark suite.

``pytest benchmarks --benchmark-only`` collects ``bench_*.py``. Options: ``--device`` (auto, cpu or
cuda; env ``KVCANARY_BENCH_DEVICE``), ``--scale`` (env ``KVCANARY_BENCH_SCALE``; default 1 on a GPU,
1/8 on the CPU), ``--bench-budget`` (seconds of timed repetitions per benchmark, default 0.25).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
from typing import Any, Callable, Optional

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import _ceilings  # noqa: E402
import _shapes as S  # noqa: E402
import _timing as T  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("kvcanary benchmarks")
    group.addoption("--device", default=os.environ.get("KVCANARY_BENCH_DEVICE", "auto"),
                    choices=["auto", "cpu", "cuda"], help="where the benchmarks run (default: cuda when available)")
    group.addoption("--scale", type=float, default=None,
                    help="shrink every case (bs, prefix, extend, window, pool) by this factor; "
                         "env KVCANARY_BENCH_SCALE; default 1 on a GPU, 0.125 on the CPU")
    group.addoption("--bench-budget", type=float, default=0.25,
                    help="seconds of timed repetitions per benchmark (default 0.25)")


def pytest_collect_file(file_path, parent):
    # files named on the command line are collected by pytest itself
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_") and file_path.parent == BENCH_DIR
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(session, config, items):
    # the empty launch measured again once everything else has run (bench_ceilings.py)
    last = [item for item in items if item.name == "test_empty_kernel_at_end"]
    items[:] = [item for item in items if item.name != "test_empty_kernel_at_end"] + last


def _device(config) -> str:
    choice = config.getoption("--device")
    if choice != "auto":
        return choice
    from kvcanary_cupy._dlpack import cuda_device_count  # noqa: PLC0415
    return "cuda" if cuda_device_count() > 0 else "cpu"


def _scale(config, device: str) -> float:
    value = config.getoption("--scale")
    if value is None and os.environ.get("KVCANARY_BENCH_SCALE"):
        value = float(os.environ["KVCANARY_BENCH_SCALE"])
    if value is None:
        value = 1.0 if device == "cuda" else 0.125
    if not 0 < value <= 1:
        raise pytest.UsageError(f"--scale must be in (0, 1], got {value}")
    return value


_CONFIG: Any = None


def progress(line: str) -> None:
    """One line to the terminal's stderr, past pytest's output capture, so long runs show where they are."""
    text = f"[kvcanary-bench {time.strftime('%H:%M:%S')}] {line}\n"
    capman = _CONFIG.pluginmanager.getplugin("capturemanager") if _CONFIG is not None else None
    if capman is not None:
        with capman.global_and_fixture_disabled():
            sys.stderr.write(text)
            sys.stderr.flush()
    else:
        sys.__stderr__.write(text)
        sys.__stderr__.flush()


# --- what each op moves --------------------------------------------------------------------------

def work_of(case: S.Case, op: str) -> tuple[int, int]:
    """``(entries, bytes)`` of one op on one batch: the fewest bytes a fused kernel must move.

    verify: per entry 24 B of plan (slot, position, predecessor), the 32-B canary slot and the source
    bytes hashed. write: per token 24 B of input (id, position, slot), the 32-B slot stored and the
    source bytes; 16 B of plan per request. plan: per verify entry 4 B of ``req_to_token`` read and
    32 B of plan written; 56 B per request. scatter: per token 8 B read and 4 B written. step_ops
    (three ops): plan + verify + write. step (``kc.CanaryStep``, which derives each verify entry from
    ``req_to_token`` where it checks it and never stores or reads a verify plan): the same less the
    plan's 32-B row stored and its 24 B read back per verify entry, so per verify entry 4 B of
    ``req_to_token``, the 32-B slot and the source bytes. copy_records: per cached slot (a verify
    entry) its two slot indices, its 32-B record read and 32 B stored.
    """
    src = case.source_read_bytes
    if op == "verify":
        return case.n_verify, case.n_verify * (24 + 32 + src)
    if op == "write":
        return case.n_write, case.n_write * (24 + 32 + src) + case.bs * 16
    if op == "plan":
        return case.n_verify, case.n_verify * 36 + case.bs * 56
    if op == "scatter":
        return case.n_write, case.n_write * 12
    if op == "copy_records":  # a record a cached slot: two slots read, 32 B read and 32 B stored
        return case.n_verify, case.n_verify * (16 + 32 + 32)
    if op in ("step", "step_ops"):
        parts = [work_of(case, o) for o in ("plan", "verify", "write")]
        nbytes = sum(p[1] for p in parts)
        if op == "step":  # no plan row stored (32 B) nor read back (24 B)
            nbytes -= case.n_verify * (32 + 24)
        return case.n_verify + case.n_write, nbytes
    raise ValueError(op)


def _verify_sectors(case: S.Case) -> int:
    """Random 32-byte sectors a verify entry reads: its canary slot and, for each source hashed, the
    sectors its read spans (the cases' source rows are 16 bytes or a multiple of 32, so a read of n
    bytes spans ceil(n / 32) of them: two for a 64-byte read). The predecessor's slot is, nearly
    always, the entry before it, read beside it."""
    if case.hash_mode == S.kc.HashMode.NONE:
        return 1
    return 1 + case.sources.count * max(1, -(-case.sources.read_length(case.hash_mode) // 32))


# --- session fixtures -----------------------------------------------------------------------------

class Harness:
    """Runs one benchmark: device timing through pytest-benchmark, host costs, the baseline, checks,
    metrics and targets into ``extra_info``, a progress line."""

    def __init__(self, config) -> None:
        global _CONFIG
        _CONFIG = config
        self.device = _device(config)
        self.scale = _scale(config, self.device)
        self.budget = float(config.getoption("--bench-budget"))
        self.stream = None
        self.cupy = None
        if self.device == "cuda":
            import cupy  # noqa: PLC0415
            self.cupy = cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.l2 = _ceilings.l2_bytes(cupy)
            self.timer: Any = T.GpuTimer(cupy, self.stream, l2_bytes=self.l2)
        else:
            self.l2 = 32 << 20
            self.timer = T.CpuTimer()
        self._states: dict[str, S.EngineState] = {}
        self._ceilings: Optional[dict] = None
        self.results: dict[tuple[str, str], float] = {}  # (case, op) -> median seconds
        self.count = 0
        progress(f"device={self.device} scale={self.scale} budget={self.budget}s per benchmark")

    @property
    def xp(self):
        import numpy  # noqa: PLC0415
        return self.cupy if self.cupy is not None else numpy

    def ceilings(self) -> dict:
        if self._ceilings is None:
            start = time.perf_counter()
            self._ceilings = _ceilings.measure(self.timer, self.xp, scale=self.scale)
            c = self._ceilings
            progress(f"ceilings ({time.perf_counter() - start:.1f}s): copy {c['copy_gbps']:.0f} GB/s, gather32 "
                     f"{c['gather32_entries_per_s'] / 1e9:.2f} G entries/s, read32 "
                     f"{c['read32_entries_per_s'] / 1e9:.2f} G entries/s, plan stream "
                     f"{c['plan_stream_entries_per_s'] / 1e9:.2f} G entries/s, "
                     f"empty kernel {c['empty_kernel_us']:.2f} us")
        return self._ceilings

    def state(self, case: S.Case) -> S.EngineState:
        scaled = case.scaled(self.scale)
        if case.name not in self._states:
            start = time.perf_counter()
            self._states[case.name] = S.build_state(scaled, self.device, scale=self.scale, l2_bytes=self.l2,
                                                    stream=self.stream)
            st = self._states[case.name]
            progress(f"built {case.name} ({scaled.describe()}): pool {st.pool_slots} slots, "
                     f"{st.footprint_bytes() / 2**20:.0f} MiB canary+sources, {st.n_copies} copies "
                     f"({time.perf_counter() - start:.1f}s)")
        return self._states[case.name]

    # --- measuring -------------------------------------------------------------------------------
    def rounds(self, fn: Callable[[int], Any], copies: int) -> tuple[int, float]:
        fn(0)  # warm-up: compilation, module load
        self.timer.sync()
        estimate = self.timer.bracket(lambda: fn(1 % copies))
        return T.reps_for(estimate, budget_s=self.budget, lo=5, hi=300), estimate

    def measure(self, benchmark, state: S.EngineState, op: str, fn: Callable[[int], Any], *,
                naive: Optional[Callable[[int], Any]] = None, graph: bool = False,
                lead_ns: Optional[int] = None) -> dict:
        """Time ``fn(copy_index)`` (eager launches, or their CUDA graphs with ``graph``) into
        ``benchmark``; returns (and stores in ``extra_info``) the metrics."""
        case, copies = state.case, state.n_copies
        ceil = self.ceilings()
        info = benchmark.extra_info
        rounds, _ = self.rounds(fn, copies)
        if graph:
            graphs = [self.timer.capture(lambda i=i: fn(i)) for i in range(copies)]
            timing = T.run_pytest_benchmark(
                benchmark, self.timer,
                lambda k: self.timer.bracket(lambda: graphs[k % copies].launch(self.stream)), rounds=rounds, warmup=3)
            timing.method = "cuda_graph_replay_cold_l2"
            info["graph_wall_us"] = self.timer.wall_per_call(lambda k: graphs[k % copies].launch(self.stream),
                                                             copies, 200) * 1e6
        else:
            timing = T.run_pytest_benchmark(
                benchmark, self.timer, lambda k: self.timer.bracket(lambda: fn(k % copies), lead_ns=lead_ns),
                rounds=rounds, warmup=3)
            if self.timer.is_gpu:
                timing.method = "cuda_events_cold_l2"
                info["host_us_per_call"] = self.timer.host_per_call(fn, copies, 100) * 1e6
                info["wall_us_per_call"] = self.timer.wall_per_call(fn, copies, 100) * 1e6
        seconds = timing.median_s
        entries, nbytes = work_of(case, op)
        info.update(
            case=case.name, op=op, mode="graph" if graph else "eager", device=self.device, scale=self.scale,
            shape=case.describe(), copies=copies, pool_slots=state.pool_slots,
            entries=entries, bytes=nbytes, time_us=seconds * 1e6, **timing.summary("device"),
            entries_per_s=entries / seconds, gbps=nbytes / seconds / 1e9,
            pct_copy_ceiling=100.0 * nbytes / seconds / 1e9 / ceil["copy_gbps"],
            copy_ceiling_gbps=ceil["copy_gbps"], empty_kernel_us=ceil["empty_kernel_us"],
            x_empty_kernel=seconds * 1e6 / ceil["empty_kernel_us"],
        )
        if op in ("verify", "step") and case.n_verify and ceil.get("read32_entries_per_s"):
            # the random sectors its entries read a second, against the bare random-read kernel
            sectors = _verify_sectors(case)
            sectors_per_s = case.n_verify * sectors / seconds
            info.update(random_sectors_per_entry=sectors, random_sectors_per_s=sectors_per_s,
                        pct_random_read=100.0 * sectors_per_s / ceil["read32_entries_per_s"])
        if op == "plan" and ceil.get("plan_stream_entries_per_s"):
            # a large plan's rate against a bare kernel that moves the same bytes an entry a thread
            info["pct_plan_stream"] = 100.0 * entries / seconds / ceil["plan_stream_entries_per_s"]
        if naive is not None:
            # on the timed stream, so that the events bracket its device work and not only its
            # host time (CuPy's default stream does not wait for, nor is waited on by, this one)
            naive = self._on_stream(naive)
            naive(0)
            self.timer.sync()
            estimate = self.timer.bracket(lambda: naive(1 % copies))
            reps = T.reps_for(estimate, budget_s=min(2.0, 4 * self.budget), lo=2, hi=30)
            nt = self.timer.eager(naive, copies, warmup=0, reps=reps)
            info.update(naive_us=nt.median_s * 1e6, naive_reps=reps, x_naive=nt.median_s / seconds)
            # Wall against wall too: the device basis above hides our host time (Python, checks,
            # launch) under the lead spin, while the naive version's reads back to the host put
            # much of its own in the bracket. An eager caller pays the larger of host and device.
            naive_wall = self.timer.wall_per_call(naive, copies, reps, loops=1)
            ours_wall = max(seconds, info.get("wall_us_per_call", 0.0) * 1e-6)
            info.update(naive_wall_us=naive_wall * 1e6, x_naive_wall=naive_wall / ours_wall)
        self.results[(case.name, op + ("_graph" if graph else ""))] = seconds
        self._targets(state, op, graph, info)
        violations = state.violations()
        info["violations_after"] = violations
        assert violations == 0, f"{case.name} {op}: {violations} violations on a clean state"
        self.count += 1
        naive_text = f" x{info['x_naive']:.1f} naive" if "x_naive" in info else ""
        progress(f"#{self.count:<3d} {op + ('/graph' if graph else ''):13s} {case.name:32s} "
                 f"{seconds * 1e6:10.2f} us {entries / seconds:10.3g} entries/s {info['gbps']:8.1f} GB/s "
                 f"({info['pct_copy_ceiling']:5.1f}% copy){naive_text}")
        return info

    def _on_stream(self, fn: Callable[[int], Any]) -> Callable[[int], Any]:
        """``fn`` run with the timed stream current (as is, on the CPU)."""
        if self.stream is None:
            return fn

        def on_stream(i: int) -> Any:
            with self.stream:
                return fn(i)
        return on_stream

    def _targets(self, state: S.EngineState, op: str, graph: bool, info: dict) -> None:
        case = state.case
        us = info["time_us"]
        gpu = self.device == "cuda"
        full = self.scale >= 1.0
        targets = []

        def add(name, achieved, want, ok):
            targets.append(dict(name=name, achieved=achieved, target=want, met=bool(ok), binding=gpu and full))

        rate_targets = {("verify_16m", "verify"): 15e9, ("e2e_decode_steady", "verify"): 22e9,
                        ("e2e_decode_steady_hash", "verify"): 5e9}
        if (case.name, op) in rate_targets and not graph:
            want = rate_targets[(case.name, op)]
            add("verify entries/s", info["entries_per_s"], f">= {want:.3g}", info["entries_per_s"] >= want)
        if case.name == "e2e_prefill_chunk_first" and op == "write":
            ns = us * 1e3 / max(info["entries"], 1)
            add("write ns/token", ns, "<= 100", ns <= 100)
        if case.name == "plan_bs1024_prefix4096" and op == "plan":
            add("plan % copy ceiling", info["pct_copy_ceiling"], ">= 50", info["pct_copy_ceiling"] >= 50)
        if op == "write" and case.name in S.NO_HASH_TWIN and case.hash_mode == S.kc.HashMode.ALL:
            twin = self.results.get((S.NO_HASH_TWIN[case.name], "write"))
            if twin:
                ratio = us * 1e-6 / twin
                info["x_no_hash_twin"] = ratio
                add(f"ALL-hash write / {S.NO_HASH_TWIN[case.name]} write", ratio, "<= 1.2", ratio <= 1.2)
        if op in ("plan", "verify", "write", "scatter") and case.decode and case.bs <= 1024 and gpu:
            # decode-shaped (bs <= 1024) and launch-bound: its bytes move in under 1 us at copy bandwidth
            if info["bytes"] / (info["copy_ceiling_gbps"] * 1e9) < 1e-6:
                add("x empty kernel (decode-shaped)", info["x_empty_kernel"], "<= 2", info["x_empty_kernel"] <= 2)
        if op == "step" and not graph and (case.name, "verify") in rate_targets and gpu:
            # Entries derived inside the kernel: no plan row is read, so the bar is the gather model
            # itself: 85 % of the same-run random 32-byte gather rate over the sectors an entry reads.
            want = 0.85 * self.ceilings()["gather32_entries_per_s"] / _verify_sectors(case)
            rate = case.n_verify / (us * 1e-6)
            info["verify_entries_per_s"] = rate
            add("step verify entries/s (raised bar: 85 % of gather / sectors)", rate, f">= {want:.3g}", rate >= want)
        if op in ("step", "step_ops") and case.peer_us:
            if graph:
                mine = max(us, info.get("graph_wall_us", 0.0))
                peer = case.peer_graph_us or case.peer_us
            else:
                mine = max(us, info.get("wall_us_per_call", 0.0))
                peer = case.peer_us
            info.update(peer_us=peer, x_peer=peer / mine, peer_compared_us=mine)
            # The package's canary step is kc.CanaryStep ("step"). The same work as three public
            # op calls ("step_ops") is reported beside it with its ratio, but the target is the
            # step's.
            if op == "step":
                add("x faster than peer step", peer / mine, ">= 2", peer / mine >= 2)
        if op == "plan" and case.peer_plan_us:
            info.update(peer_us=case.peer_plan_us, x_peer=case.peer_plan_us / us)
            add("x faster than peer plan", case.peer_plan_us / us, ">= 2", case.peer_plan_us / us >= 2)
        if gpu and "x_naive" in info:
            # both ways of timing it: device time, and wall time of back-to-back eager calls
            slower = min(info["x_naive"], info["x_naive_wall"])
            add("x faster than naive (device and wall)", slower, ">= 5", slower >= 5)
        if not gpu and op == "verify" and info["entries"] >= 65536:
            add("cpu verify entries/s", info["entries_per_s"], ">= 2e7", info["entries_per_s"] >= 2e7)
        info["targets"] = targets
        info["targets_met"] = all(t["met"] for t in targets) if targets else None


_HARNESS: Optional[Harness] = None


@pytest.fixture(scope="session")
def harness(pytestconfig) -> Harness:
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness(pytestconfig)
    return _HARNESS


def case_params(op: str):
    """``pytest.mark.parametrize`` arguments over the named cases of ``op``."""
    return pytest.mark.parametrize("case", S.cases_for(op), ids=[c.name for c in S.cases_for(op)])


# --- the CPU benchmarks' ratio summary (bench_cpu.py) ---------------------------------------------
# ``ratio_log`` collects (op, entries, numba s, reference s); the terminal summary prints the speedups.

_RATIOS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def ratio_log(pytestconfig):
    return pytestconfig.stash.setdefault(_RATIOS, [])


def pytest_terminal_summary(terminalreporter, config):
    rows = config.stash.get(_RATIOS, [])
    if not rows:
        return
    terminalreporter.section("numba backend vs plain-Python reference")
    for op, entries, fast, slow in rows:
        terminalreporter.write_line(f"{op:>7}: {entries} entries  numba {fast * 1e3:9.3f} ms  "
                                    f"reference {slow * 1e3:10.1f} ms  speedup x{slow / fast:,.0f}")


def pytest_benchmark_update_commit_info(config, commit_info):
    """Where the tree travels without its git metadata (a lent GPU machine), KVCANARY_COMMIT names it."""
    import os  # noqa: PLC0415

    commit = os.environ.get("KVCANARY_COMMIT")
    if commit:
        commit_info.update({"id": commit, "error": None})
