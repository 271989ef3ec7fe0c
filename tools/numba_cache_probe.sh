#!/usr/bin/env bash
# Many processes of the CPU backend on one numba cache, counting the ones that die of a signal.
# Rounds: each starts from a cold numba cache; P pytest workers compile the CPU backend's signatures
# while F differential-fuzz workers start short processes over and over until the pytest ones end.
# Phase "shared": one cache directory for all workers; phase "own": a cache directory per worker.
# usage: OUT=dir bash tools/numba_cache_probe.sh SECONDS_PER_PHASE PYTEST_WORKERS FUZZ_WORKERS [DEVICE [PYTEST_K]]
# (DEVICE cuda: the fuzz compares the GPU with the CPU backend; cpu: the CPU backend with itself;
# PYTEST_FILES: the test files every pytest worker runs, instead of test_write.py or test_verify.py)
set -u
secs=$1; P=$2; F=$3; DEV=${4:-cuda}; K=${5:-cuda or gpu}
export PYTHONPATH=. PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
py=${PY:-python3}
phase() {
  local name=$1 round=0 end=$(( $(date +%s) + secs ))
  mkdir -p "$OUT/$name"
  while [ "$(date +%s)" -lt "$end" ]; do
    round=$((round + 1))
    local base=/tmp/nprobe-$name-$round
    rm -rf "$base"; mkdir -p "$base"
    local pids=()
    for w in $(seq 1 "$P"); do
      ( [ "$name" = own ] && export NUMBA_CACHE_DIR=$base/p$w || export NUMBA_CACHE_DIR=$base/shared
        files=tests/test_verify.py; (( (w + round) % 2 )) && files=tests/test_write.py
        [ -n "${PYTEST_FILES:-}" ] && files=$PYTEST_FILES
        log="$OUT/$name/r$round-p$w.log"
        t0=$(date +%s.%N)
        timeout 120 $py -m pytest -q -x -p no:cacheprovider -k "$K" $files > "$log" 2>&1; rc=$?
        echo "$name $round p$w 0 $rc $t0 $(date +%s.%N) pytest $files" >> "$OUT/runs.txt" ) &
      pids+=($!)
    done
    local fpids=()
    for w in $(seq 1 "$F"); do
      ( [ "$name" = own ] && export NUMBA_CACHE_DIR=$base/f$w || export NUMBA_CACHE_DIR=$base/shared
        k=0
        while :; do
          alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
          [ $alive = 1 ] || break
          k=$((k + 1)); ops="verify"; (( (w + k) % 3 == 0 )) && ops="verify write plan scatter step records"
          log="$OUT/$name/r$round-f$w-$k.log"
          t0=$(date +%s.%N)
          timeout 120 $py tools/differential_fuzz.py --device "$DEV" --seed $((round * 100000 + w * 1000 + k)) --ops $ops --cases 30 > "$log" 2>&1; rc=$?
          echo "$name $round f$w $k $rc $t0 $(date +%s.%N) fuzz $ops" >> "$OUT/runs.txt"
          [ $rc = 0 ] && rm -f "$log"
        done ) &
      fpids+=($!)
    done
    wait "${pids[@]}" "${fpids[@]}"
    rm -rf "$base"  # the round's cold caches: the next round starts from none
  done
}
phase shared
phase own
echo "phase runs died(of a signal: status >= 128, not the timeout's 124) failed(other nonzero)"
for name in shared own; do
  awk -v n=$name '$1==n {runs++; if ($5>=128 && $5!=124) died++; else if ($5!=0) failed++} END {printf "%s %d %d %d\n", n, runs, died, failed}' "$OUT/runs.txt"
done
grep -l "Fatal Python error\|Segmentation fault" -r "$OUT" --include=*.log | head -20
