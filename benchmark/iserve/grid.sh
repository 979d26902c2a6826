#!/usr/bin/env bash
# Measures iServe's whole grid in one quiet window: the shared-layout fingerprints
# (profile --layouts-at 16: 10 servers) and then every servable full configuration (14), each
# as its own `iserve profile --append` run so that a crash or the deadline loses one record,
# not the file. Usage: benchmark/iserve/grid.sh OUT_DIR [DEADLINE_UNIX_S]
# Runs the code of $MORPH_SRC (default: this checkout), e.g. a clean worktree of a commit.
# LAYERS=A,B: the two fingerprint depths (default 4,8; PP 2 runs A+1 and B+1);
# REPS: repetitions per point (default 3, the fastest taken); FULL=0: fingerprints only (e.g.
# other depths against full configurations measured before); FINGERPRINTS=0: full
# configurations only; ROUNDS=k: the whole list k times over, round r into OUT/round<r>/ (the
# ground truth: each configuration launched k times, interleaved with the others).
set -u
OUT=${1:?usage: grid.sh OUT_DIR [DEADLINE_UNIX_S]}
DEADLINE=${2:-0}
SRC=${MORPH_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
PY=$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python
mkdir -p "$OUT/logs"
LAYERS=${LAYERS:-4,8}
COMMON=(--out "$OUT/profile.json" --append --tp 1,3 --layers "$LAYERS" --timing stream --output 64
        --batches 1,4 --repetitions "${REPS:-3}" --log-dir "$OUT/logs")
# The runs are deploy's own: the fingerprints `profile --layouts-at 16` runs at LAYERS
# (`fingerprint_runs`) and, with FULL=1, every configuration `space.exclusion_reason` serves for
# the default model, fewest processes first (a deadline cuts the 6- and 9-process ones).
mapfile -t RUNS < <(PYTHONPATH="$SRC/python:$SRC" "$PY" - "$LAYERS" "${FULL:-1}" \
                    "${FINGERPRINTS:-1}" <<'PY'
import json
import sys

from sglang_morph.iserve import space
from sglang_morph.iserve.__main__ import fingerprint_runs
from sglang_morph.models import default_model_path

layers = tuple(int(n) for n in sys.argv[1].split(","))
for cfg, n in fingerprint_runs(space.BITS, space.TP_SIZES, layers, layout_bits=16):
    if sys.argv[3] == "1":
        print(f"--bits {cfg.bits} --only {cfg.name}@{n}")
if sys.argv[2] == "1":
    hf_config = json.loads((default_model_path() / "config.json").read_text())
    servable = [c for c in space.space() if space.exclusion_reason(c, hf_config) is None]
    for cfg in sorted(servable, key=lambda c: c.processes):
        print(f"--bits {cfg.bits} --skip-fingerprints --full {cfg.name}")
PY
)
[ ${#RUNS[@]} -gt 0 ] || { echo "grid: no runs (LAYERS=$LAYERS?)" >&2; exit 2; }
ROUNDS=${ROUNDS:-1}
for round in $(seq 1 "$ROUNDS"); do
  DIR=$OUT
  [ "$ROUNDS" = 1 ] || DIR=$OUT/round$round
  mkdir -p "$DIR/logs"
  for run in "${RUNS[@]}"; do
    if [ "$DEADLINE" != 0 ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
      echo "grid: $(date -u +%T) deadline passed, skip: $run"; continue
    fi
    t0=$(date +%s)
    echo "grid: $(date -u +%T) round $round start: $run ($(cut -d' ' -f1-3 /proc/loadavg))"
    # shellcheck disable=SC2086
    PYTHONPATH="$SRC/python:$SRC:$SRC/sgl-kernel/morph-kernels/python" \
      "$PY" -m sglang_morph.iserve profile "${COMMON[@]/#$OUT/$DIR}" $run \
      >> "$DIR/logs/sessions.log" 2>&1
    rc=$?; echo "grid: rc=$rc took $(( $(date +%s) - t0 )) s: $run"
    [ $rc = 0 ] || tail -5 "$DIR/logs/sessions.log"
  done
done
