#!/usr/bin/env bash
# One GPU session: environment facts, the test suite, the differential fuzz, compute-sanitizer and
# the benchmarks, each writing its log/JSON under $OUT (default ./out). Pick stages as arguments:
#   bash tools/h200_session.sh tests fuzz sanitize bench
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
FUZZ_CASES=${FUZZ_CASES:-10000}
stages=${*:-tests fuzz sanitize}
summary="$OUT/summary.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'numba', numba.__version__, 'numpy', numpy.__version__)"
} > "$summary" 2>&1

for stage in $stages; do
  case $stage in
    tests)
      python3 -m pytest tests -q -p no:cacheprovider -x -rs 2>&1 | tee "$OUT/tests.log" | tail -n 15
      echo "tests: $(tail -n 1 "$OUT/tests.log")" >> "$summary" ;;
    fuzz)
      python3 tools/differential_fuzz.py --cases "$FUZZ_CASES" --json "$OUT/fuzz.json" 2>&1 | tee "$OUT/fuzz.log" | tail -n 6
      tail -n 5 "$OUT/fuzz.log" | sed 's/^/fuzz: /' >> "$summary" ;;
    sanitize)
      for tool in memcheck racecheck initcheck; do
        compute-sanitizer --tool "$tool" --target-processes all \
          python3 tools/differential_fuzz.py --cases "${SANITIZE_CASES:-60}" --max-entries 20000 --large-every 20 \
          > "$OUT/sanitize-$tool.log" 2>&1
        echo "sanitize $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -n 1) (exit $?)" >> "$summary"
      done ;;
    bench)
      python3 -m pytest benchmarks -q -p no:cacheprovider --benchmark-only --benchmark-json "$OUT/bench.json" \
        2>&1 | tee "$OUT/bench.log" | tail -n 40
      python3 benchmarks/report.py "$OUT/bench.json" --png "$OUT/bench.png" > "$OUT/bench.md" 2>&1
      echo "bench: $(tail -n 1 "$OUT/bench.log")" >> "$summary" ;;
  esac
done
echo "==== summary"; cat "$summary"
