#!/usr/bin/env bash
# Every GPU measurement, in one device call (the device keeps nothing between calls):
#   bash benchmark/gpu/run_all.sh [tests] [w4] [kernels] [kv_vmm] [transition] [probe] [w4_variants]
#   (default: all but w4_variants, the old W4 kernel's roofline investigation)
# Results: $OUT/{w4_side_by_side,kernels,transition,kv_vmm,w4_variants}.json and $OUT/run.log
# (plus the probe's two logs);
# here, `python -m benchmark.gpu.render DIR` turns the JSON into benchmark/results/gpu/*.md.
# Set MORPH_COMMIT to the commit being measured (the device's copy of the tree has no .git);
# TESTS_K / TESTS_TIMEOUT_S narrow the tests step (pytest -k; seconds); W4_TIMEOUT_S and
# W4_LINEAR_TIMEOUT_S bound the w4 step and each of its per-linear processes (seconds); W4_ARGS
# adds arguments to it (e.g. --ours-only --tokens 1 16 512).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export OUT="${OUT:-/tmp/gpu_out}" PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/python:$ROOT/sgl-kernel/morph-kernels/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
LOG="$OUT/run.log"
steps=("$@"); [[ ${#steps[@]} == 0 ]] && steps=(w4 tests kernels kv_vmm transition probe)
{ echo "commit ${MORPH_COMMIT:-unknown}"; nvidia-smi; } >>"$LOG" 2>&1
for s in "${steps[@]}"; do
  echo "===== $s ($(date +%T))" | tee -a "$LOG"
  case $s in
    tests) timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider --noconftest \
             -rs --durations=15 tests/kernels/test_kv_vmm_gpu.py tests/kernels/test_morph_kernels.py \
             -k "${TESTS_K:-gpu or Gpu or vmm}" ;;
    w4) timeout "${W4_TIMEOUT_S:-480}" python3 -m benchmark.gpu.w4_side_by_side \
          --timeout-s "${W4_LINEAR_TIMEOUT_S:-240}" --only o_proj gate_up_proj down_proj qkv_proj \
          ${W4_ARGS:-} ;;
    kernels) timeout 400 python3 -m benchmark.gpu.kernels ;;
    w4_variants) timeout 400 python3 -m benchmark.gpu.w4_variants ;;
    kv_vmm) timeout 120 python3 -m benchmark.gpu.kv_vmm ;;
    transition) timeout 300 python3 -m benchmark.gpu.transition ;;
    probe) mkdir -p /tmp/probe_tok && cp .gpu_carry/tokenizer/* /tmp/probe_tok/ \
             && gunzip -f /tmp/probe_tok/tokenizer.json.gz \
             && PROBE_TOKENIZER_DIR=/tmp/probe_tok timeout 400 bash benchmark/gpu/sglang_probe.sh ;;
    *) echo "unknown step $s" ;;
  esac 2>&1 | tee -a "$LOG"
  echo "===== $s exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$LOG"
done
