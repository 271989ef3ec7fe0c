#!/usr/bin/env bash
# One GPU session: environment facts, the GPU tests, the differential fuzz (one process per op, and
# one of every op over stale shared memory),
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck over the differential fuzz with exact allocations,
# memcheck over a few kc.Canary runs) and the demo on the GPU, the independent parts concurrently.
# Logs land under $OUT (default ./out) and are packed into $OUT/logs-<stages>.tar.gz;
# $OUT/summary.txt is the short record. Stages: tests fuzz sanitize demo canary bench (canary:
# tools/canary_fuzz.py, random correct engines driving kc.Canary, CANARY_SEEDS of them in CANARY_PARTS
# processes). FUZZ_SEED and CANARY_START move the fuzzes to cases no earlier run made (the defaults
# repeat the usual ones); the summary records both. The full run of a results row
# (tests/results/2026-12-05-h200.md), all from seeds no earlier run drew:
#   OUT=out/val FUZZ_CASES=1500 CANARY_SEEDS=400 CANARY_PARTS=4 FUZZ_SEED=<new> CANARY_START=<new> \
#     STAGE_TIMEOUT=540 bash tools/h200_session.sh tests fuzz sanitize demo canary
# (420 s until 0661586, whose slower machine ran the GPU tests past it; beside the other stages they
# took 256 s at 62b64c0)
set -uo pipefail
OUT=${OUT:-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
FUZZ_CASES=${FUZZ_CASES:-10000}
SANITIZE_CASES=${SANITIZE_CASES:-40}
CANARY_SEEDS=${CANARY_SEEDS:-900}
CANARY_PARTS=${CANARY_PARTS:-3}
FUZZ_SEED=${FUZZ_SEED:-1}
CANARY_START=${CANARY_START:-0}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-300}
stages=${*:-tests fuzz sanitize demo}
# the shared conformance cases, where they travelled beside the tree (the GPU tests skip them otherwise)
if [ -z "${KVCANARY_CONFORMANCE:-}" ] && [ -f .conformance/cases.json ]; then
  export KVCANARY_CONFORMANCE=$PWD/.conformance/cases.json
fi
summary="$OUT/summary.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: ${KVCANARY_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "seeds: differential fuzz $FUZZ_SEED (write forms $((FUZZ_SEED + 6)), stale shared memory $((FUZZ_SEED + 7)), sanitizers $((FUZZ_SEED + 1))), canary fuzz from $CANARY_START (under memcheck from $((CANARY_START + 900000)))"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'numba', numba.__version__, 'numpy', numpy.__version__)"
  python3 -c "import sys; sys.path.insert(0, 'tests'); import _conformance as c; n = len(c.load_cases()); print('conformance cases:', f'{n} from {c.CASES_PATH}' if n else 'not present (the GPU tests skip them)')"
} > "$summary" 2>&1
has() { [[ " $stages " == *" $1 "* ]]; }
sanitizers="memcheck racecheck initcheck synccheck"  # each over the fuzz, and in the summary

declare -A stage_pid stage_rc  # each background stage's process by its log's name, then its exit status
started() { stage_pid[$1]=$!; }
if has tests; then
  timeout "$STAGE_TIMEOUT" python3 -m pytest tests -q -p no:cacheprovider -rfs -k "cuda or gpu" > "$LOGS/tests.log" 2>&1 &
  started tests
fi
if has fuzz; then
  for op in verify write plan scatter step records; do
    timeout "$STAGE_TIMEOUT" python3 tools/differential_fuzz.py --ops "$op" --cases "$FUZZ_CASES" --seed "$FUZZ_SEED" --json "$LOGS/fuzz-$op.json" \
      > "$LOGS/fuzz-$op.log" 2>&1 & started "fuzz-$op"
  done
  # the write's three forms on every shape, not only on the shapes the host gives each
  for team in thread one two; do
    timeout "$STAGE_TIMEOUT" python3 tools/differential_fuzz.py --ops write --write-team "$team" --cases $((FUZZ_CASES / 2)) --seed $((FUZZ_SEED + 6)) \
      --json "$LOGS/fuzz-write-$team.json" > "$LOGS/fuzz-write-$team.log" 2>&1 & started "fuzz-write-$team"
  done
  # every op, each kernel launched over shared memory a fill left full of non-zero words: a kernel
  # that reads a shared word before storing it shows, where a fresh card's zeros might hide it
  timeout "$STAGE_TIMEOUT" python3 tools/differential_fuzz.py --stale-shared --cases $((FUZZ_CASES / 5)) --seed $((FUZZ_SEED + 7)) \
    --json "$LOGS/fuzz-stale-shared.json" > "$LOGS/fuzz-stale-shared.log" 2>&1 & started fuzz-stale-shared
fi
if has sanitize; then
  # Every array an allocation of its exact size (CuPy's pool off), with a gap after each where this
  # compute-sanitizer can pad: memcheck then sees a read or store one element past an array.
  sanitizer_options=$(compute-sanitizer --help 2>&1 | grep -q -- --padding && echo "--padding 64")
  # A target that first touches CUDA later than compute-sanitizer's default 10 s (a fresh machine
  # starting every stage at once) is left unchecked, with no summary line; wait longer for it.
  sanitizer_options="$sanitizer_options --launch-timeout 300"
  for tool in $sanitizers; do
    timeout "$STAGE_TIMEOUT" compute-sanitizer --tool "$tool" --target-processes all $sanitizer_options \
      python3 tools/differential_fuzz.py --cases "$SANITIZE_CASES" --max-entries 20000 --large-every 10 --seed $((FUZZ_SEED + 1)) \
      --exact-allocations > "$LOGS/sanitize-$tool.log" 2>&1 & started "sanitize-$tool"
  done
  # the session's own kernels (the SWA group's slot translation, its counts), which only kc.Canary runs
  timeout "$STAGE_TIMEOUT" compute-sanitizer --tool memcheck --target-processes all $sanitizer_options \
    python3 tools/canary_fuzz.py --device cuda --seeds 8 --start $((CANARY_START + 900000)) --forwards 30 \
    --exact-allocations > "$LOGS/sanitize-memcheck-session.log" 2>&1 & started sanitize-memcheck-session
fi
if has demo; then
  timeout "$STAGE_TIMEOUT" python3 -m kvcanary_cupy demo --device cuda --no-progress --json "$LOGS/demo-cuda.json" > "$LOGS/demo-cuda.log" 2>&1 &
  started demo-cuda
fi
if has canary; then
  # several processes: the fuzz's own work is host-side Python
  for ((part = 0; part < CANARY_PARTS; part++)); do
    timeout "$STAGE_TIMEOUT" python3 tools/canary_fuzz.py --device cuda --seeds $((CANARY_SEEDS / CANARY_PARTS)) \
      --start $((CANARY_START + part * CANARY_SEEDS / CANARY_PARTS)) --forwards 60 --json "$LOGS/canary-fuzz-$part.json" \
      > "$LOGS/canary-fuzz-$part.log" 2>&1 & started "canary-fuzz-$part"
  done
fi
for name in "${!stage_pid[@]}"; do wait "${stage_pid[$name]}"; stage_rc[$name]=$?; done
# what a stage's summary line adds when the stage did not end by itself
cut_short() { [ "${stage_rc[$1]:-0}" = 124 ] && echo " (cut short by STAGE_TIMEOUT, $STAGE_TIMEOUT s)"; }
# a sanitizer log's summary line; without one the sanitizer never ran its target (it failed to
# attach, say), and the log's first error says why
sanitizer_verdict() {
  local verdict
  verdict=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$1" | tail -n 1)
  [ -n "$verdict" ] || verdict="no summary: $( (grep -m 1 -E 'Error' "$1" || tail -n 1 "$1") | sed 's/^=* *//')"
  echo "$verdict"
}
# a differential fuzz log's table of several ops, as "op mismatches/cases ..."
fuzz_rows() { grep -E '^(verify|write|plan|scatter|step|records) +[0-9]' "$1" | awk '{printf "%s %s/%s ", $1, $3, $2}'; }
if has tests; then
  echo "gpu tests: $(tail -n 1 "$LOGS/tests.log")$(cut_short tests)" >> "$summary"
  # each failed test once more, alone on the card now that the other stages are done: one that
  # passes alone failed with the load of the others (a race of its own, or a want of memory)
  mapfile -t failed < <(grep -E '^FAILED ' "$LOGS/tests.log" | sed -E 's/^FAILED //; s/ - .*$//')
  if [ "${#failed[@]}" -gt 0 ]; then
    timeout "$STAGE_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rf "${failed[@]}" > "$LOGS/tests-again.log" 2>&1
    echo "gpu tests that failed, run again alone: $(tail -n 1 "$LOGS/tests-again.log")" >> "$summary"
  fi
fi
if has canary; then
  for ((part = 0; part < CANARY_PARTS; part++)); do echo "canary fuzz $part: $(tail -n 1 "$LOGS/canary-fuzz-$part.log")$(cut_short "canary-fuzz-$part")" >> "$summary"; done
fi
if has fuzz; then
  for op in verify write plan scatter step records write-thread write-one write-two; do echo "fuzz $op: $(tail -n 1 "$LOGS/fuzz-$op.log")$(cut_short "fuzz-$op")" >> "$summary"; done
  echo "fuzz over stale shared memory: $(fuzz_rows "$LOGS/fuzz-stale-shared.log")$(cut_short fuzz-stale-shared)" >> "$summary"
fi
if has sanitize; then
  for tool in $sanitizers; do
    echo "sanitize $tool: $(sanitizer_verdict "$LOGS/sanitize-$tool.log")$(cut_short "sanitize-$tool"); fuzz mismatches: $(fuzz_rows "$LOGS/sanitize-$tool.log")" >> "$summary"
  done
  echo "sanitize memcheck, session fuzz: $(sanitizer_verdict "$LOGS/sanitize-memcheck-session.log"); $(grep -E 'seeds x' "$LOGS/sanitize-memcheck-session.log" | tail -n 1)$(cut_short sanitize-memcheck-session)" >> "$summary"
fi
if has demo; then sed 's/^/demo: /' "$LOGS/demo-cuda.log" >> "$summary"; cut_short demo-cuda | sed 's/^ /demo: /' >> "$summary"; fi
if has bench; then
  python3 -m pytest benchmarks -q -p no:cacheprovider --benchmark-only -k "not bench_cpu" \
    --benchmark-json "$OUT/bench.json" > "$LOGS/bench.log" 2>&1
  python3 benchmarks/report.py "$OUT/bench.json" --png "$OUT/bench.png" --markdown "$OUT/bench.md" >> "$LOGS/bench.log" 2>&1
  echo "bench: $(grep -E 'passed|failed' "$LOGS/bench.log" | tail -n 1)" >> "$summary"
fi
# one archive per stage set, so a later bench run in the same $OUT keeps the tests' logs
tar -czf "$OUT/logs-${stages// /-}.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
echo "==== summary"; cat "$summary"
