#!/usr/bin/env bash
# How far SGLang 0.5.23 + the sglang-morph plugin get on the device machine (no registry there).
#
# The device has PyTorch, Triton and transformers but no SGLang. What fits the 64 MiB a call may
# carry: the sglang wheel (39 MB, --no-deps) and the small pure-Python packages its launch path
# imports, in .whl/ (see benchmark/gpu/README.md for the list and the command that fetches them).
# What does not fit: the CUDA sglang-kernel wheel (373 MB) and the torch 2.14.1 it is built for.
# So this runs, step by step, until the first failure, and logs each step's outcome:
#   1. install the carried wheels into a private site dir
#   2. import sglang, its HTTP server module, and the plugin's entry point
#   3. launch_server --enable-morph on a tiny random Llama (with our CPU sgl_kernel standing in
#      for the CUDA one, which is the piece that is missing) and ask it for a completion.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-/tmp/sglang_probe}"
LOG="$OUT/sglang_probe.log"
SITE=/tmp/sglang-site
mkdir -p "$OUT"
: >"$LOG"
step() { echo "== $*" | tee -a "$LOG"; }
run() { "$@" >>"$LOG" 2>&1; local rc=$?; echo "   -> exit $rc" | tee -a "$LOG"; return $rc; }

step "device python and torch"
run python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, torch.cuda.get_device_name(0))"

step "install carried wheels (--no-deps) into $SITE"
run python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$ROOT"/.whl/*.whl || exit 0
export PYTHONPATH="$SITE:$ROOT/python:$ROOT/sgl-kernel/morph-kernels/python"

step "import sglang"
run python3 -c "import sglang; print('sglang', sglang.__version__)" || exit 0
step "import sglang.srt.entrypoints.http_server (the launch path)"
run python3 -c "import sglang.srt.entrypoints.http_server" 
step "import sgl_kernel (SGLang's CUDA kernels; not carried: 373 MB wheel)"
run python3 -c "import sgl_kernel"
step "import the plugin and its hooks' targets"
run python3 -c "import sglang_morph.plugin as p; p.load(); print('plugin loaded')"

step "with our CPU sgl_kernel standing in: import sgl_kernel"
export PYTHONPATH="$PYTHONPATH:$ROOT/sgl-kernel/python"
run python3 -c "import sgl_kernel; print(sgl_kernel.__file__)"

step "build a tiny random Llama (2 layers) with the default model's tokenizer"
run python3 - <<'PY'
import json, shutil, torch, transformers
from pathlib import Path
src = Path("/tmp/probe_tokenizer") if Path("/tmp/probe_tokenizer").exists() else None
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained("/tmp/tiny-llama")
import os
tok_dir = os.environ.get("PROBE_TOKENIZER_DIR")
for f in Path(tok_dir).iterdir():
    shutil.copy(f, "/tmp/tiny-llama/")
print(sorted(p.name for p in Path("/tmp/tiny-llama").iterdir()))
PY

step "launch_server --enable-morph (180 s at most)"
python3 -m sglang.launch_server --model-path /tmp/tiny-llama --host 127.0.0.1 --port 30123 \
  --enable-morph --mem-fraction-static 0.2 >"$OUT/sglang_server.log" 2>&1 &
PID=$!
ok=0
for _ in $(seq 180); do
  if ! kill -0 $PID 2>/dev/null; then break; fi
  if curl -sf http://127.0.0.1:30123/health >/dev/null 2>&1; then ok=1; break; fi
  sleep 1
done
if [[ $ok == 1 ]]; then
  step "server healthy; /generate and /morph/status"
  run curl -s http://127.0.0.1:30123/generate -H 'Content-Type: application/json' \
    -d '{"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}'
  run curl -s http://127.0.0.1:30123/morph/status
else
  step "server did not become healthy; last lines of its log:"
  tail -40 "$OUT/sglang_server.log" | tee -a "$LOG"
fi
kill $PID 2>/dev/null; sleep 2; kill -9 $PID 2>/dev/null
pkill -f sglang.launch_server 2>/dev/null
exit 0
