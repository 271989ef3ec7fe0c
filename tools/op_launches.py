"""Launches one op on benchmark cases' state a few times, for a profiler to pick the launches.

    ncu -k regex:kvc_write_decode --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python tools/op_launches.py write e2e_decode_steady_hash

OP is plan, verify, write, scatter or step; each case's state is built as the benchmarks build it
(benchmarks/_shapes.py) and the op runs on copy 0 ``--times`` times (default 3), synchronised after
each launch, so that ``--launch-skip`` counts the compile-and-warm launches out.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import cupy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _shapes as S  # noqa: E402
from ab_probe import launcher  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=("plan", "verify", "write", "scatter", "step"))
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--times", type=int, default=3)
    args = parser.parse_args()
    for name in args.cases:
        case = S.BY_NAME[name]
        state = S.build_state(case, "cuda")
        launch = launcher(args.op, state)
        for _ in range(args.times):
            launch()
            cupy.cuda.Device().synchronize()
        print(f"{name}: {args.op} launched {args.times} times", flush=True)


if __name__ == "__main__":
    main()
