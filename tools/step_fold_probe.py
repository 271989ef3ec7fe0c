"""The decode step with real-KV sources as one launch (block 0 hashes the new slots' bytes ahead and
writes once the verify blocks are done) against two (the step kernel, then the write kernel).

    python tools/step_fold_probe.py DIR [case ...]
    (DIR from an earlier commit: git archive REV kvcanary_cupy/rawkernels | tar -x -C DIR --strip-components=2)

Three variants of ``kc.CanaryStep`` on each case's state: DIR's step kernel in two launches (block 0
never writes, as before for a context with sources), this tree's kernel in two launches (what its
change of code does to the verify alone) and this tree's one launch. Their outputs (canary, plans,
pool) are compared byte for byte, then they and an empty kernel are timed interleaved, L2 evicted
and code cold (``_probe.interleaved_cold``): median and interquartile range, us. The cases are
e2e_decode_steady_hash, the real-KV steps that keep two launches (their kernel is the same
instance) and decode shapes where block 0's path is long against the verify's (short prefixes, 512 requests,
long reads and many sources).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
import kvcanary_cupy as kc  # noqa: E402
from _probe import cold_timer, interleaved_cold, left_behind, median_iqr, run_variants, use_sources  # noqa: E402
from ab_probe import launcher  # noqa: E402
from kvcanary_cupy.ops.backends._cuda import step as cuda_step  # noqa: E402
from kvcanary_cupy.rawkernels import _loader  # noqa: E402

_A = kc.HashMode.ALL
CASES = (
    S.BY_NAME["e2e_decode_steady_hash"],
    S.Case("bs64_prefix128_4src", 64, 128, sources=S.Sources(4, 64, 32), hash_mode=_A),
    S.Case("bs512_prefix1024_4src", 512, 1024, sources=S.Sources(4, 64, 32), hash_mode=_A),
    S.Case("bs256_ext2_4src", 256, 4096, 2, sources=S.Sources(4, 64, 32), hash_mode=_A),
    # block 0 hashes its entries a thread each, source after source: the longest per-thread hashing
    # against little verify work
    S.Case("bs512_prefix16_1src576", 512, 16, sources=S.Sources(1, 576, 576), hash_mode=_A),
    S.Case("bs512_prefix128_2src256", 512, 128, sources=S.Sources(2, 256, 256), hash_mode=_A),
    S.Case("bs256_prefix64_9src", 256, 64, sources=S.Sources(9, 64, 64), hash_mode=_A),
    S.BY_NAME["small_extend_batch_hash"],
    S.BY_NAME["e2e_prefill_chunk_hash"],
    S.BY_NAME["verify_16m"],
)


def _two_launches(batch_size: int, num_entries: int) -> bool:
    """Block 0 never writes (the earlier rule, for a context with real-KV sources): the write
    kernel follows the step kernel."""
    return False


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    other = pathlib.Path(sys.argv[1]).resolve()
    names = sys.argv[2:]
    shipped_rule = cuda_step.plan_block_write
    timer = cold_timer()

    def variant(directory, rule):
        def setup() -> None:
            use_sources("step", directory)
            cuda_step.plan_block_write = rule
        return setup

    try:
        for case in CASES:
            if names and case.name not in names:
                continue
            state = S.build_state(case, "cuda")
            variants = {
                "DIR, two launches": variant(other, _two_launches),
                "this tree, two launches": variant(_loader.RAWKERNEL_DIR, _two_launches),
                "this tree, one launch": variant(_loader.RAWKERNEL_DIR, shipped_rule),
            }

            graphs, outputs = run_variants(timer, variants, lambda: launcher("step", state),
                                           lambda: left_behind(state))
            times = interleaved_cold(timer, graphs)
            assert state.violations() == 0
            same = len(set(outputs.values())) == 1
            one = cuda_step.plan_block_write(case.bs, case.bs * case.extend)
            print(f"{case.name:28s} block 0 may write: {one}  outputs equal: {same}", flush=True)
            for label, t in times.items():
                print(f"    {label:26s} {median_iqr(t)}", flush=True)
    finally:
        cuda_step.plan_block_write = shipped_rule
        use_sources("step", _loader.RAWKERNEL_DIR)


if __name__ == "__main__":
    main()
