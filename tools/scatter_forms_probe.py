"""scatter_req_token_ids in its CUDA forms for short rows, on a GPU: kDecode and the general form,
forced through the launcher whatever the batch's shape.

    python tools/scatter_forms_probe.py [case ...]

For each case the forms' outputs (the scatter pool) are compared byte for byte, then each is timed
with code warm (the benchmarks' way: one graph replayed back to back, L2 evicted; three passes of 60)
and code cold (the forms and an empty kernel interleaved in shuffled rounds): median, mean and (cold)
interquartile range, us.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
from _probe import cold_timer, print_warm_and_cold, run_variants, warm_and_cold  # noqa: E402
from kvcanary_cupy.ops.backends._cuda import scatter as cuda_scatter  # noqa: E402

DEFAULT_CASES = ("smoke_decode_empty", "decode_mid_batch", "e2e_decode_steady", "decode_large_batch_short_prefix",
                 "verify_16m")
# label -> decode_form, as the launcher would get it
FORMS = {"decode": True, "general": False}


def main() -> None:
    names = sys.argv[1:] or DEFAULT_CASES
    timer = cold_timer()
    shipped = cuda_scatter.decode_form
    try:
        for name in names:
            case = S.BY_NAME[name]
            state = S.build_state(case, "cuda")

            def force(decode: bool) -> None:
                cuda_scatter.decode_form = lambda *_: decode

            def launch_of(st=state):
                st.expected_pool.fill(-7)  # a pool both forms overwrite from the same start
                return lambda: st.scatter(0)

            graphs, outputs = run_variants(timer, {label: (lambda d=decode: force(d)) for label, decode in FORMS.items()},
                                           launch_of, lambda st=state: st.expected_pool.get().tobytes())
            cuda_scatter.decode_form = shipped
            warm, cold = warm_and_cold(timer, graphs, rounds=100)
            print(f"== {name} ({case.describe()})  outputs equal: {len(set(outputs.values())) == 1}", flush=True)
            print_warm_and_cold(warm, cold)
            del state, graphs
    finally:
        cuda_scatter.decode_form = shipped


if __name__ == "__main__":
    main()
