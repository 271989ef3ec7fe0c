"""Decode-shaped launch costs on a GPU, variant by variant (hot L2; 20 calls captured in one CUDA graph, replayed, median of 30).

    python tools/decode_probe.py [case ...]
    python tools/decode_probe.py --cuts [case ...]   # where the one-launch step's time goes
    python tools/decode_probe.py --cold [--cuts] [case ...]  # one call a replay, L2 evicted before each
    python tools/decode_probe.py --stamps [case]   # %globaltimer stamps at the cut points, cold replays
    python tools/decode_probe.py --code [case ...]  # the kernels with and without their hashing code, code cold too

For each decode case: plan, verify and write as separate ops, and kc.CanaryStep compiled in each of VARIANTS (launch bounds), as one
launch (the last block writes) and as two, whatever the batch size. Prints registers per thread of each kernel.
"""

from __future__ import annotations

import pathlib
import sys

import cupy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import _shapes as S  # noqa: E402
from _probe import cold_timer, install_variant, interleaved_cold, launch_empty, median_iqr, timed, timed_cold  # noqa: E402
from kvcanary_cupy.ops.backends._cuda import step as cuda_step  # noqa: E402
from kvcanary_cupy.rawkernels import _loader  # noqa: E402


def use_step_variant(cut: str = "", patch: tuple = (), **defines: int):
    """Recompile step.cu with -DKVC_STEP_<NAME>=value for each define and make the launchers use it;
    returns the module. ``cut``: every thread returns just before that line of step.cu (the work
    after it is left out)."""
    spec = next(c for c in _loader.compile_specs() if c.name == "step")
    extra = tuple(f"-DKVC_STEP_{name.upper()}={value}" for name, value in defines.items())
    cut_patch = ((cut, "return;\n" + cut),) if cut else ()
    return install_variant("step", spec.code, spec.options + extra, cut_patch + tuple(patch))


TAIL_MAX_REQUESTS = cuda_step.TAIL_MAX_REQUESTS

# (label, step.cu defines): the shipped variant first
VARIANTS = (("mb2", dict(min_blocks=2)), ("mb1", dict(min_blocks=1)))


# where the one-launch step's time goes: each cut leaves out the work from that line on
CUTS = (("launch only", "    // kTailWrite: what the write needs first is requested now"),
        ("+ early reads", "    // ---- verify ---"),
        ("+ verify", "    // slots the verify counts as checked"),
        ("+ last-block hand-off", "    if (tid >= 32) return;\n    unsigned long long stored"),
        ("+ write scan", "    if (tid < bs) {\n        const kvc_i64 begin"),
        ("+ write", "    stored = kvc_warp_sum(stored);\n    if (tid == 0) {"),
        ("whole step", ""))

# whole-step variants timed beside the cuts: (label, ((old, new), ...)) applied to step.cu
PATCHES = (("no counters (floor)",
            (("        atomicAdd(kernel_run_counter, 2ull);\n", ""),
             ("        if (verified + stored) atomicAdd(slot_run_counter, verified + stored);\n", ""))),
           ("no early entry read",
            (("    if (kTailWrite && tid < 32) guess = kvc_request_write_entry(w, tid);", ""),
             ("guess,\n                                           begin == (kvc_i64)tid);", "guess, false);"))),
           ("no counter prefetch",
            (("        kvc_prefetch_word(kernel_run_counter);\n        kvc_prefetch_word(slot_run_counter);\n", ""),
             ("        if ((kTailWrite || plan_block_writes) && gridDim.x > 1) kvc_prefetch_word(blocks_done);\n",
              ""))),
           ("block-scan staging",
            (("    if (kTailWrite) {\n        total", "    if (false) {\n        total"),)))


# %globaltimer stamps by thread 0 at each cut point and at the kernel's end: the kernel's own time,
# phase by phase, apart from the launch and the drain that an event pair also measures. For one-block
# grids (smoke_decode_empty): with more blocks, the early stamps are whichever block wrote last.
_STAMP_DEFS = r"""
__device__ unsigned long long kvc_probe_stamps[16];
#define KVC_PROBE_STAMP(k) do { if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); kvc_probe_stamps[k] = t_; } } while (0)
"""
_KERNEL_END = "        if (gridDim.x > 1) *blocks_done = 0u;\n    }\n}"
_STAMP_POINTS = [line for _, line in CUTS if line]  # stamp k before line k, the last at the end
_STAMP_LABELS = [label for label, line in CUTS if line][1:] + ["counters and end"]  # between stamps


def stamp_patch() -> tuple:
    patch = [('#include "batch_plan.cuh"', _STAMP_DEFS + '#include "batch_plan.cuh"')]
    patch += [(line, f"KVC_PROBE_STAMP({k});\n" + line) for k, line in enumerate(_STAMP_POINTS)]
    patch.append((_KERNEL_END, _KERNEL_END[:-1] + f"    KVC_PROBE_STAMP({len(_STAMP_POINTS)});\n}}"))
    return tuple(patch)


def stamps(name: str = "smoke_decode_empty", reps: int = 60) -> None:
    """Cold one-step replays of ``name`` (as the benchmarks time them), each with the kernel's stamps:
    median us between successive cut points, and the event-timed total."""
    import numpy as np

    case = S.BY_NAME[name]
    state = S.build_state(case, "cuda")
    module = use_step_variant(patch=stamp_patch(), **VARIANTS[0][1])
    step = state.canary_step(0)
    timer = cold_timer()
    graph = timer.capture(lambda: step.launch(stream=cupy.cuda.get_current_stream()))
    cells = module.get_global("kvc_probe_stamps")
    n = len(_STAMP_POINTS) + 1
    totals, rows = [], []
    for _ in range(reps):
        cells.memset_async(0, 8 * 16, timer.stream)
        totals.append(timer.bracket(lambda: graph.launch(timer.stream), cold=True) * 1e6)
        rows.append(cupy.ndarray((16,), cupy.uint64, cells).get()[:n].astype(np.int64))
    use_step_variant(**VARIANTS[0][1])
    assert state.violations() == 0
    deltas = np.median(np.diff(np.array(rows), axis=1), axis=0) / 1e3
    inside = float(np.median([r[-1] - r[0] for r in rows])) / 1e3
    print(f"{name}: event-timed {np.median(totals):.2f} us; stamped from the first point to the end {inside:.2f} us; "
          + " ".join(f"[{label}] {d:.2f}" for label, d in zip(_STAMP_LABELS, deltas)), flush=True)


def code_cold(names: list[str], rounds: int = 150) -> None:
    """The step, write and verify of each case (a context without real-KV sources), with their kernels'
    kRealKv instance (the hashing code in, unused) and without (what the launchers pick), timed cold
    in shuffled rounds (interleaved_cold), so that their code is cold too, as after a model forward.
    Median (IQR)."""
    from kvcanary_cupy.ops.backends._cuda import write as cuda_write

    timer = cold_timer()
    chosen = cuda_write.has_real_kv
    for name in names:
        case = S.BY_NAME[name]
        state = S.build_state(case, "cuda")
        assert not chosen(state.ctx), f"{name} hashes real-KV sources"
        graphs = {"empty kernel": timer.capture(launch_empty)}
        for label, pick in (("hash code in", lambda ctx: True), ("shipped", chosen)):
            cuda_write.has_real_kv = cuda_step.has_real_kv = pick
            state.__dict__.pop("_canary_steps", None)
            step = state.canary_step(0)
            graphs[f"step, {label}"] = timer.capture(lambda: step.launch(stream=cupy.cuda.get_current_stream()))
            graphs[f"write, {label}"] = timer.capture(lambda: state.write(0))
        cuda_write.has_real_kv = cuda_step.has_real_kv = chosen
        graphs["verify"] = timer.capture(lambda: state.verify(0))
        times = interleaved_cold(timer, graphs, rounds)
        assert state.violations() == 0
        print(f"{name:34s} " + " ".join(f"[{label}] {median_iqr(t)}" for label, t in times.items()), flush=True)


def cuts(names: list[str], timing=timed) -> None:
    """The one-launch step of each case with the work after each cut point left out."""
    for name in names:
        case = S.BY_NAME[name]
        if case.bs > TAIL_MAX_REQUESTS:
            print(f"{name}: bs {case.bs} takes two launches (one launch takes at most {TAIL_MAX_REQUESTS} requests)")
            continue
        state = S.build_state(case, "cuda")
        row = {}
        variants = [(label, dict(cut=line)) for label, line in CUTS] + [(label, dict(patch=patch)) for label, patch in PATCHES]
        for label, variant in variants:
            use_step_variant(**variant, **VARIANTS[0][1])
            state.__dict__.pop("_canary_steps", None)
            step = state.canary_step(0)
            row[label] = timing(lambda: step.launch(stream=cupy.cuda.get_current_stream()))
        use_step_variant(**VARIANTS[0][1])
        assert state.violations() == 0
        print(f"{name:34s} " + " ".join(f"[{k}] {v:6.2f}" for k, v in row.items()), flush=True)


def main() -> None:
    args = sys.argv[1:]
    timing = timed_cold if args[:1] == ["--cold"] else timed
    args = args[1:] if args[:1] == ["--cold"] else args
    if args[:1] == ["--stamps"]:
        return stamps(*(args[1:2] or ["smoke_decode_empty"]))
    if args[:1] == ["--code"]:
        return code_cold(args[1:] or ["smoke_decode_empty", "e2e_decode_tail", "e2e_decode_steady"])
    if args[:1] == ["--cuts"]:
        return cuts(args[1:] or ["smoke_decode_empty", "e2e_decode_tail"], timing)
    names = args or ["smoke_decode_empty", "e2e_decode_tail", "small_extend_batch", "decode_mid_batch", "e2e_decode_steady",
                             "decode_large_batch_short_prefix", "swa_decode_short_prefix", "e2e_decode_steady_hash"]
    print(f"empty kernel {timing(launch_empty):.2f} us")
    for name in names:
        case = S.BY_NAME[name]
        state = S.build_state(case, "cuda")
        row = {"plan": timing(lambda: state.plan(0)), "verify": timing(lambda: state.verify(0)),
               "ops": timing(lambda: state.step_ops(0))}
        row["write"] = timing(lambda: state.write(0))
        for label, defines in VARIANTS:
            use_step_variant(**defines)
            # the one-launch path (the last block writes) and two launches; one launch takes at most
            # TAIL_MAX_REQUESTS requests
            for tail_max in ((TAIL_MAX_REQUESTS, 0) if case.bs <= TAIL_MAX_REQUESTS else (0,)):
                cuda_step.TAIL_MAX_REQUESTS = tail_max
                state.__dict__.pop("_canary_steps", None)
                step = state.canary_step(0)
                row[f"step[{label}] {step.num_launches}L"] = timing(
                    lambda: step.launch(stream=cupy.cuda.get_current_stream()))
        use_step_variant(**VARIANTS[0][1])
        cuda_step.TAIL_MAX_REQUESTS = TAIL_MAX_REQUESTS
        assert state.violations() == 0
        print(f"{name:34s} " + " ".join(f"{k}={v:7.2f}" for k, v in row.items()), flush=True)
    for spec in _loader.SPECS.values():
        for kernel in spec.kernels:
            fn = _loader.get_kernel(spec.name, kernel, 0)
            print(f"  {kernel:28s} regs {fn.num_regs:4d} smem {fn.shared_size_bytes:6d} local {fn.local_size_bytes}")


if __name__ == "__main__":
    main()
