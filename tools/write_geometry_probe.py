"""The decode write's launch geometry, on a GPU: kvc_write_decode with blocks of N threads
(KVC_WRITE_DECODE_THREADS), and with its stored-slot count added once a block instead of once a warp.

    python tools/write_geometry_probe.py [--threads 32 64 128 256] [case ...]

For each case every variant's outputs (canary, plans, pool) are compared byte for byte with the
shipped kernel's, then each is timed with code warm (the benchmarks' way: one graph replayed back to
back, L2 evicted; three passes of 60) and code cold (the variants and an empty kernel interleaved in
shuffled rounds): median, mean and (cold) interquartile range, us.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
from _probe import cold_timer, install_variant, left_behind, print_warm_and_cold, run_variants, warm_and_cold  # noqa: E402
from kvcanary_cupy.ops.backends._cuda import write as cuda_write  # noqa: E402
from kvcanary_cupy.rawkernels import _loader  # noqa: E402

DEFAULT_CASES = ("decode_large_batch_short_prefix", "e2e_decode_steady", "swa_decode_short_prefix",
                 "smoke_decode_empty", "e2e_decode_steady_hash")

# the warps' stored-slot counts summed in shared memory, one global atomic a block
BLOCK_COUNT_PATCH = (
    ("    const KvcCanary c = {canary, num_slots, slot_stride};\n",
     "    const KvcCanary c = {canary, num_slots, slot_stride};\n"
     "    __shared__ unsigned long long s_block_stored;\n"
     "    if (threadIdx.x == 0) s_block_stored = 0;\n"
     "    __syncthreads();\n"),
    ("    if ((threadIdx.x & 31) == 0 && stored) atomicAdd(slot_run_counter, stored);\n}",
     "    if ((threadIdx.x & 31) == 0 && stored) atomicAdd(&s_block_stored, stored);\n"
     "    __syncthreads();\n"
     "    if (threadIdx.x == 0 && s_block_stored) atomicAdd(slot_run_counter, s_block_stored);\n}"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: the decode cases)")
    parser.add_argument("--threads", type=int, nargs="+", default=[32, 64, 128, 256])
    args = parser.parse_args()
    spec = next(c for c in _loader.compile_specs() if c.name == "write_decode")
    shipped = cuda_write._DECODE_BLOCK

    def options(threads: int) -> tuple[str, ...]:
        return tuple(f"-DKVC_WRITE_DECODE_THREADS={threads}" if o.startswith("-DKVC_WRITE_DECODE_THREADS=")
                     else o for o in spec.options)

    variants = [(f"t{shipped}", shipped, ())] + [(f"t{t}", t, ()) for t in args.threads if t != shipped]
    variants += [(f"t{t}+block count", t, BLOCK_COUNT_PATCH) for t in (shipped, min(args.threads))]
    timer = cold_timer()
    modules = []
    try:
        for name in args.cases or DEFAULT_CASES:
            case = S.BY_NAME[name]
            state = S.build_state(case, "cuda")

            def use(threads: int, patch: tuple) -> None:
                modules.append(install_variant("write_decode", spec.code, options(threads), patch))
                cuda_write._DECODE_BLOCK = threads

            graphs, outputs = run_variants(timer, {label: (lambda t=threads, p=patch: use(t, p))
                                                   for label, threads, patch in variants},
                                           lambda st=state: (lambda: st.write(0)), lambda st=state: left_behind(st))
            cuda_write._DECODE_BLOCK = shipped
            install_variant("write_decode", spec.code, spec.options)
            warm, cold = warm_and_cold(timer, graphs, rounds=80)
            first = variants[0][0]
            same = all(outputs[label] == outputs[first] for label in outputs)
            print(f"== {name}  outputs equal: {same}  violations {state.violations()}", flush=True)
            print_warm_and_cold(warm, cold)
            del state, graphs
    finally:
        cuda_write._DECODE_BLOCK = shipped
        install_variant("write_decode", spec.code, spec.options)


if __name__ == "__main__":
    main()
