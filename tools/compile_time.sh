#!/bin/bash
# The first compile of every canary source on this machine: every source in turn, then in threads of
# their own (what kc.compile_kernels does), twice each, each with an empty CuPy cache; then a load from
# a filled cache. Needs a GPU: bash tools/compile_time.sh
export PYTHONPATH=.
for form in sequential threads sequential threads; do
  dir=$(mktemp -d)
  CUPY_CACHE_DIR=$dir python3 - "$form" <<'PY'
import sys, time
import cupy
cupy.cuda.Device(0).compute_capability
from kvcanary_cupy.rawkernels import _loader
t = time.perf_counter()
if sys.argv[1] == "sequential":
    for spec in _loader._SPECS:
        _loader._module(spec.name, 0)
else:
    _loader.load_all(0)
print(f"{sys.argv[1]:10s} first compile of every source: {time.perf_counter() - t:.2f} s")
PY
  rm -rf $dir
done
dir=$(mktemp -d); CUPY_CACHE_DIR=$dir python3 -m kvcanary_cupy compile >/dev/null; CUPY_CACHE_DIR=$dir python3 -c "
import time; t=time.perf_counter(); import kvcanary_cupy as kc; kc.compile_kernels(device='cuda'); print(f'cached     load of every source: {time.perf_counter()-t:.2f} s (import included)')"
