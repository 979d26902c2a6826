#!/usr/bin/env bash
# Start SGLang with the sglang-morph plugin: `scripts/serve.sh [sglang launch_server args]`.
# Defaults (each only when the caller did not pass the flag): the embedded default model,
# 127.0.0.1:30000, and on a machine without an NVIDIA GPU the CPU engine with torch-native
# attention. Everything else passes through to `python -m sglang.launch_server` unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" >&2
PY="$ROOT/.venv/bin/python"

has_flag() {
  local flag="$1"; shift
  local a
  for a in "$@"; do
    [[ "$a" == "$flag" || "$a" == "$flag="* ]] && return 0
  done
  return 1
}

args=("$@")
has_flag --model-path "$@" || has_flag --model "$@" \
  || args+=(--model-path "$("$PY" -m sglang_morph.models path)")
has_flag --host "$@" || args+=(--host 127.0.0.1)
has_flag --port "$@" || args+=(--port 30000)
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  export SGLANG_USE_CPU_ENGINE=1
  has_flag --device "$@" || args+=(--device cpu)
  has_flag --attention-backend "$@" || args+=(--attention-backend torch_native)
  # SGLang sizes the KV pool from free host RAM on CPU (about 14 GiB here, 37 s to allocate);
  # 65536 tokens is 1.4 GiB for the default model and plenty for a 2-core machine.
  # --morph-memory-budget (or --morph-stage-budgets) sizes the pool itself.
  has_flag --max-total-tokens "$@" || has_flag --mem-fraction-static "$@" \
    || has_flag --morph-memory-budget "$@" || has_flag --morph-stage-budgets "$@" \
    || args+=(--max-total-tokens 65536)
  # Without it the idle scheduler busy-polls and keeps a whole core at 100%
  # (SGLANG_MORPH_SLEEP_ON_IDLE=0 keeps SGLang's busy loop, e.g. to measure per-step overhead).
  has_flag --sleep-on-idle "$@" || [[ "${SGLANG_MORPH_SLEEP_ON_IDLE:-1}" == 0 ]] \
    || args+=(--sleep-on-idle)
  # SGLang refuses to start tensor-parallel ranks whose free device memory differs by more
  # than 10% (another process on "their" GPU). On CPU every rank reads the same host memory
  # a moment apart, so any other process allocating in between trips it: warn instead.
  export SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK="${SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK:-false}"
  # Several ranks (--tp-size/--pp-size/--dp-size) need a core list each; SGLang would give
  # each rank a NUMA node and refuse more ranks than nodes. Ranks may share cores.
  if [[ -z "${SGLANG_CPU_OMP_THREADS_BIND:-}" ]]; then
    bind="$("$PY" -m sglang_morph.parallel.binding "$@")"
    if [[ -n "$bind" ]]; then
      export SGLANG_CPU_OMP_THREADS_BIND="$bind"
      echo "serve.sh: SGLANG_CPU_OMP_THREADS_BIND=$bind (one core list per rank)" >&2
    fi
  fi
fi

exec "$PY" -m sglang.launch_server "${args[@]}"
