"""The decode write with real-KV sources in its two forms, on a GPU: kvc_write (a warp a request)
against kvc_write_decode with a group of N lanes a request (KVC_WRITE_DECODE_LANES).

    python tools/write_forms_probe.py [--lanes 4 8] [case ...]

For each case the forms' outputs (canary, plans, pool) are compared byte for byte, then each is timed
with code warm (the benchmarks' way: one graph replayed back to back, L2 evicted; three passes of
60) and code cold (the forms and an empty kernel interleaved in shuffled rounds): median, mean and
(cold) interquartile range, us. The cases are e2e_decode_steady_hash and decode shapes around it: one
request, a large batch of long reads, one PARTIAL source, more sources than lanes, and two tokens a
request (which the launcher leaves to kvc_write).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
import kvcanary_cupy as kc  # noqa: E402
from _probe import cold_timer, install_variant, left_behind, print_warm_and_cold, run_variants, warm_and_cold  # noqa: E402
from kvcanary_cupy.ops.backends._cuda import write as cuda_write  # noqa: E402
from kvcanary_cupy.rawkernels import _loader  # noqa: E402

_A, _P = kc.HashMode.ALL, kc.HashMode.PARTIAL
CASES = (
    S.BY_NAME["e2e_decode_steady_hash"],
    S.Case("bs1_4src", 1, 5120, sources=S.Sources(4, 64, 32), hash_mode=_A),
    S.Case("bs1024_2src128", 1024, 1024, sources=S.Sources(2, 128, 128), hash_mode=_A),
    S.Case("bs256_1src_partial", 256, 4096, sources=S.Sources(1, 64, 64), hash_mode=_P),
    S.Case("bs128_8src", 128, 4096, sources=S.Sources(8, 64, 64), hash_mode=_A),
    S.Case("bs256_ext2_4src", 256, 4096, 2, sources=S.Sources(4, 64, 32), hash_mode=_A),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--lanes", type=int, nargs="+", default=[4, 8], help="group sizes to time")
    args = parser.parse_args()
    spec = next(c for c in _loader.compile_specs() if c.name == "write_decode")

    def options(lanes: int) -> tuple[str, ...]:
        return tuple(f"-DKVC_WRITE_DECODE_LANES={lanes}" if o.startswith("-DKVC_WRITE_DECODE_LANES=") else o
                     for o in spec.options)

    timer = cold_timer()
    shipped_form, shipped_lanes = cuda_write.decode_form, cuda_write._DECODE_LANES
    modules = []
    try:
        for case in CASES:
            if args.cases and case.name not in args.cases:
                continue
            state = S.build_state(case, "cuda")

            def use(lanes) -> None:  # None: the warp-a-request form
                modules.append(install_variant("write_decode", spec.code, options(lanes or shipped_lanes)))
                cuda_write.decode_form = (lambda *_, group=lanes is not None: group)
                cuda_write._DECODE_LANES = lanes or shipped_lanes

            variants = {label: (lambda n=lanes: use(n))
                        for label, lanes in [("warp", None)] + [(f"lanes{n}", n) for n in args.lanes]}
            graphs, outputs = run_variants(timer, variants, lambda st=state: (lambda: st.write(0)),
                                           lambda st=state: left_behind(st))
            cuda_write.decode_form, cuda_write._DECODE_LANES = shipped_form, shipped_lanes
            warm, cold = warm_and_cold(timer, graphs, rounds=80)
            same = [label for label in outputs if outputs[label] == outputs["warp"]]
            print(f"== {case.name}  equal to the warp form: {same}  violations {state.violations()}", flush=True)
            print_warm_and_cold(warm, cold, width=8)
            del state, graphs
    finally:
        cuda_write.decode_form, cuda_write._DECODE_LANES = shipped_form, shipped_lanes


if __name__ == "__main__":
    main()
