"""One kernel source against the same source from another tree, on the benchmark cases' own state.

    python tools/ab_probe.py SOURCE DIR [case ...]
    (DIR from an earlier commit: git archive REV kvcanary_cupy/rawkernels | tar -x -C DIR --strip-components=2)

SOURCE is plan, verify, write, write_decode (a decode-shaped write), scatter or step. Each case runs
the op that launches it (for step, ``kc.CanaryStep``) once with the kernels compiled from DIR and
once with this tree's, and compares what both leave behind byte for byte: the canary, copy 0's
plans and the scatter pool. Then the two, and an empty kernel, are timed as the benchmarks time ops
(host head start, L2 evicted), replayed in shuffled rounds (``_probe.interleaved_cold``): drift
falls on both alike and neither finds its code in an instruction cache from its own replay before. Median and interquartile range, us.

The launchers are this tree's: a change that also changed a launcher (a grid, an argument) needs
that launcher's old form for a fair comparison.
"""

from __future__ import annotations

import pathlib
import sys

import cupy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
from _probe import cold_timer, interleaved_cold, left_behind, median_iqr, run_variants, use_sources  # noqa: E402
from kvcanary_cupy.rawkernels import _loader  # noqa: E402

DECODE_CASES = ["smoke_decode_empty", "e2e_decode_tail", "e2e_decode_steady", "decode_large_batch_short_prefix",
                "swa_decode_short_prefix", "e2e_decode_steady_hash"]


def launcher(source: str, state):
    """A no-argument launch of the op that runs ``source``'s kernel on copy 0 of ``state``, built
    now, so that it holds the kernels installed now."""
    if source == "step":
        state.__dict__.pop("_canary_steps", None)
        step = state.canary_step(0)
        return lambda: step.launch(stream=cupy.cuda.get_current_stream())
    op = getattr(state, "write" if source == "write_decode" else source)
    return lambda: op(0)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in _loader.SPECS:
        sys.exit(__doc__)
    source, other = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
    names = sys.argv[3:] or DECODE_CASES
    timer = cold_timer()
    trees = {str(sys.argv[2]): other, "this tree": _loader.RAWKERNEL_DIR}
    for name in names:
        case = S.BY_NAME[name]
        state = S.build_state(case, "cuda")
        variants = {label: (lambda d=directory: use_sources(source, d)) for label, directory in trees.items()}
        graphs, outputs = run_variants(timer, variants, lambda: launcher(source, state), lambda: left_behind(state))
        times = interleaved_cold(timer, graphs)
        assert state.violations() == 0
        same = len(set(outputs.values())) == 1
        print(f"{name:32s} outputs equal: {same} " + " ".join(f"[{label}] {median_iqr(t)}" for label, t in times.items()),
              flush=True)
    use_sources(source, _loader.RAWKERNEL_DIR)


if __name__ == "__main__":
    main()
