"""A SplitQuant plan served for real with pipeline parallelism on this CPU: predicted vs measured.

Plans the default model (bf16) on two CPU stages with unequal memory (``DEVICES``), where the
plan needs quantized layers, and serves it with the plan's ``serve.sh`` command: PP 2,
``SGLANG_PP_LAYER_PARTITION``, ``--morph-precision-map`` and ``--morph-stage-budgets``
(each stage's weights + KV). For the plan and for the Uniform baseline on the same two devices
(even split, one bit-width that fits both), it

- sends the plan's batch at once (random prompt ids, ``ignore_eos``) twice and compares the
  wall time and throughput with the plan's prediction (the fitted CPU cost model);
- reads every stage's ``weight_bytes``, ``kv_bytes`` and KV capacity from ``/morph/status``
  and compares them with the plan's memory model;
- measures WikiText-2 perplexity through the server (``benchmark.perplexity``).

Uniform with the same total memory split evenly (which fits full precision here) is served too,
for reference, and labelled so.

    .venv/bin/python -m benchmark.splitquant_pp [--out benchmark/results/splitquant/pp2.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.harness import git_state, load_average, machine_info, running_server
from benchmark.perplexity import server_perplexity

DEVICES = "cpu:230MB,cpu:160MB"
EVEN_DEVICES = "cpu:195MB,cpu:195MB"  # the same total memory, split evenly
WORKLOAD = ["--batch", "8", "--prompt", "128", "--output", "32"]
PERPLEXITY_TOKENS, PERPLEXITY_WINDOW = 3072, 512


def plan(devices: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-m", "sglang_morph.plan", "plan", "--devices",
                              devices, *WORKLOAD, "--baselines", "--out", f"{d}/plan.json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        return json.loads(Path(f"{d}/plan.json").read_text())


def run_batch(url: str, batch: int, prompt: int, output: int, seed: int) -> float:
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(batch)]

    def one(ids):
        r = httpx.post(f"{url}/generate", timeout=600, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": output,
                                                  "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        tokens = list(pool.map(one, prompts))
    assert all(t == output for t in tokens), tokens
    return time.perf_counter() - started


def serve(p: dict, engines: str, kv_bytes_per_token_per_layer: int, log_dir: Path) -> dict:
    """Serve plan ``p`` with its serve.sh command; measure time, memory and perplexity."""
    from sglang_morph.plan.__main__ import serve_command

    argv, env = serve_command(p, kv_bytes_per_token_per_layer, Path(engines))
    w = p["workload"]
    row = {"stage_layers": p["stage_layers"], "layer_bits": p["layer_bits"], "workload": w,
           "quality_omega": p["quality_omega"], "command": " ".join(
               [f"{k}={v}" for k, v in env.items()] + argv),
           "load_average_before": load_average()}
    with running_server(argv[1:], log_dir / "server.log", env) as server:
        run_batch(server.url, 2, 16, 4, seed=1)  # warm-up
        measured = [run_batch(server.url, w["batch_requests"], w["prompt_tokens"],
                              w["output_tokens"], seed=s) for s in range(2)]
        status = (httpx.get(f"{server.url}/morph/status", timeout=60).json()
                  if "--enable-morph" in argv else None)
        ppl = server_perplexity(server.url, max_tokens=PERPLEXITY_TOKENS,
                                window_tokens=PERPLEXITY_WINDOW)
    tokens = w["batch_requests"] * w["output_tokens"]
    row.update({
        "predicted_total_s": p["predicted"]["total_s"],
        "predicted_throughput_tok_s": p["predicted"]["throughput_tok_s"],
        "measured_total_s": measured,
        "measured_throughput_tok_s": [tokens / t for t in measured],
        "perplexity": ppl.perplexity, "perplexity_scored_tokens": ppl.scored_tokens,
        "load_average_after": load_average(),
        "stages": [],
    })
    for j, predicted in enumerate(p["stage_memory"]):
        stage = {"predicted_weight_bytes": predicted["weight_bytes"],
                 "predicted_kv_bytes": predicted["kv_bytes"],
                 "predicted_budget_bytes": predicted["budget_bytes"]}
        if status is not None:
            s = status["stages"][j] if len(p["stage_layers"]) > 1 else status
            stage.update({key: s[key] for key in ("weight_bytes", "kv_bytes", "kv_capacity_tokens",
                                                  "memory_budget_bytes", "kv_bytes_per_token")})
        row["stages"].append(stage)
    print(json.dumps({k: v for k, v in row.items() if k != "layer_bits"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmark/results/splitquant/pp2.json")
    args = parser.parse_args()
    from sglang_morph.plan.model import ModelSpec
    from sglang_morph.plan.__main__ import _default_engines, _default_model_dir

    model_dir = _default_model_dir()
    engines = str(_default_engines(model_dir))
    kv_per_layer = ModelSpec.from_model_dir(model_dir).kv_bytes_per_token_per_layer()
    result = plan(DEVICES)
    even = plan(EVEN_DEVICES)["baselines"]["uniform"]
    runs = {"splitquant": result["plan"], "uniform (same devices)": result["baselines"]["uniform"],
            "uniform (same total memory, split evenly)": even}
    logs = Path(tempfile.mkdtemp())
    rows = {name: serve(p, engines, kv_per_layer, logs / str(i))
            for i, (name, p) in enumerate(runs.items())}
    Path(args.out).write_text(json.dumps({
        "git": git_state(), "machine": machine_info(), "devices": DEVICES,
        "even_devices": EVEN_DEVICES, "workload": WORKLOAD,
        "command": "python -m benchmark.splitquant_pp " + " ".join(sys.argv[1:]),
        "runs": rows}, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
