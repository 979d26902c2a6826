#!/usr/bin/env bash
# Measures issue 14's whole grid in one quiet window: the shared-layout fingerprints
# (profile --layouts-at 16: 10 servers) and then every servable full configuration (14), each
# as its own `deploy profile --append` session so that a crash or the deadline loses one record,
# not the file. Usage: benchmark/iserve_grid.sh OUT_DIR [DEADLINE_UNIX_S]
# Runs the code of $MORPH_SRC (default: this checkout), e.g. a clean worktree of a commit.
# LAYERS=A,B: the two fingerprint depths (default 4,8; PP 2 runs A+1 and B+1);
# REPS: repetitions per point (default 3, the fastest taken); FULL=0: fingerprints only (e.g. other depths against full configurations measured before).
set -u
OUT=${1:?usage: iserve_grid.sh OUT_DIR [DEADLINE_UNIX_S]}
DEADLINE=${2:-0}
SRC=${MORPH_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
PY=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
mkdir -p "$OUT/logs"
LAYERS=${LAYERS:-4,8}; A=${LAYERS%,*}; B=${LAYERS#*,}
COMMON=(--out "$OUT/profile.json" --append --tp 1,3 --layers "$LAYERS" --timing stream --output 64
        --batches 1,4 --repetitions "${REPS:-3}" --log-dir "$OUT/logs")
RUNS=()
for d in "$A" "$B"; do
  RUNS+=("--bits 16 --only W16-TP1-PP1@$d" "--bits 16 --only W16-TP1-PP2@$((d + 1))"
         "--bits 16 --only W16-TP3-PP1@$d")
  for b in 8 4; do RUNS+=("--bits $b --tp 1 --only W$b-TP1-PP1@$d"); done
done
if [ "${FULL:-1}" = 1 ]; then
  for b in 16 8 4; do
    for c in TP1-PP1 TP1-PP2 TP1-PP3 TP3-PP1; do
      RUNS+=("--bits $b --tp 1 --skip-fingerprints --full W$b-$c")
    done
  done
  RUNS+=("--bits 16 --tp 1 --skip-fingerprints --full W16-TP3-PP2"
         "--bits 16 --tp 1 --skip-fingerprints --full W16-TP3-PP3")
fi
for run in "${RUNS[@]}"; do
  if [ "$DEADLINE" != 0 ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
    echo "grid: $(date -u +%T) deadline passed, skip: $run"; continue
  fi
  t0=$(date +%s); echo "grid: $(date -u +%T) start: $run ($(cut -d' ' -f1-3 /proc/loadavg))"
  # shellcheck disable=SC2086
  PYTHONPATH="$SRC/python:$SRC:$SRC/sgl-kernel/morph-kernels/python" \
    "$PY" -m sglang_morph.deploy profile "${COMMON[@]}" $run >> "$OUT/logs/sessions.log" 2>&1
  rc=$?; echo "grid: rc=$rc took $(( $(date +%s) - t0 )) s: $run"
  [ $rc = 0 ] || tail -5 "$OUT/logs/sessions.log"
done
