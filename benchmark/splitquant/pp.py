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

Quality bound: as in the simulated benchmark, each SplitQuant plan is made with sum omega at most
the Uniform baseline's under the same indicator (``--max-omega``), so a faithful indicator
promises perplexity no higher than Uniform's. ``--indicators`` plans with each named indicator
of the omega file (e.g. ``variance-calibrated,variance,hessian,random``); identical plans are
served once. Perplexity is scored on ``--perplexity-tokens`` WikiText-2 test tokens in windows of
512, and every run is compared with Uniform window by window (paired mean NLL difference and its
standard error over windows). ``--no-timing`` skips the batches (perplexity and memory only: no
quiet machine needed).

    .venv/bin/python -m benchmark.splitquant.pp [--out benchmark/results/splitquant/pp2.json]
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
import numpy as np

from benchmark.harness import git_state, load_average, machine_info, running_server
from benchmark.perplexity import server_perplexity

DEVICES = "cpu:230MB,cpu:160MB"
WORKLOAD = ["--batch", "8", "--prompt", "128", "--output", "32"]
PERPLEXITY_WINDOW = 512


def plan(devices: str, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-m", "sglang_morph.splitquant", "plan", "--devices",
                              devices, *WORKLOAD, "--baselines", *extra, "--out",
                              f"{d}/plan.json"], capture_output=True, text=True)
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


def serve(p: dict, engines: str, kv_bytes_per_token_per_layer: int, log_dir: Path,
          perplexity_tokens: int, timing: bool = True) -> dict:
    """Serve plan ``p`` with its serve.sh command; measure time, memory and perplexity."""
    from sglang_morph.splitquant.__main__ import serve_command

    argv, env = serve_command(p, kv_bytes_per_token_per_layer, Path(engines))
    w = p["workload"]
    row = {"stage_layers": p["stage_layers"], "layer_bits": p["layer_bits"], "workload": w,
           "quality_omega": p["quality_omega"], "command": " ".join(
               [f"{k}={v}" for k, v in env.items()] + argv),
           "load_average_before": load_average()}
    with running_server(argv[1:], log_dir / "server.log", env) as server:
        run_batch(server.url, 2, 16, 4, seed=1)  # warm-up
        measured = [run_batch(server.url, w["batch_requests"], w["prompt_tokens"],
                              w["output_tokens"], seed=s) for s in range(2)] if timing else []
        status = (httpx.get(f"{server.url}/morph/status", timeout=60).json()
                  if "--enable-morph" in argv else None)
        ppl = server_perplexity(server.url, max_tokens=perplexity_tokens,
                                window_tokens=PERPLEXITY_WINDOW)
    tokens = w["batch_requests"] * w["output_tokens"]
    row.update({
        "predicted_total_s": p["predicted"]["total_s"],
        "predicted_throughput_tok_s": p["predicted"]["throughput_tok_s"],
        "measured_total_s": measured,
        "measured_throughput_tok_s": [tokens / t for t in measured],
        "perplexity": ppl.perplexity, "perplexity_scored_tokens": ppl.scored_tokens,
        "window_nll": list(ppl.window_nll),
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
    print(json.dumps({k: v for k, v in row.items() if k not in ("layer_bits", "window_nll")}),
          flush=True)
    return row


def paired_vs(rows: dict, reference: str) -> None:
    """Each run's mean NLL minus ``reference``'s on the same windows, with the standard error of
    that mean over windows (the windows are the independent samples)."""
    ref = np.array(rows[reference]["window_nll"])
    for row in rows.values():
        d = np.array(row["window_nll"]) - ref
        row[f"paired_nll_minus_{reference.split()[0]}"] = {
            "mean": float(d.mean()), "se": float(d.std(ddof=1) / np.sqrt(len(d))),
            "windows": len(d)}


def bits_summary(layer_bits: list[int]) -> str:
    """``17:W4, 18:W8, rest W16`` (all W8 -> ``all W8``)."""
    if len(set(layer_bits)) == 1:
        return f"all W{layer_bits[0]}"
    quantized = [f"{l}:W{b}" for l, b in enumerate(layer_bits) if b != 16]
    return ", ".join(quantized) + ", rest W16" if quantized else "all W16"


def markdown_table(result: dict) -> str:
    """One row per run: plan, sum omega under its indicator, predicted and measured time,
    perplexity and the paired NLL difference from Uniform (mean +- standard error)."""
    lines = ["| run | stages | bits | sum omega (its indicator) | predicted s | measured s | "
             "perplexity | NLL - Uniform's (nats, +- SE over windows) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["runs"].items():
        paired = r["paired_nll_minus_uniform"]
        measured = ", ".join(f"{t:.2f}" for t in r["measured_total_s"]) or "not timed"
        lines.append(
            f"| {name} | {'+'.join(map(str, r['stage_layers']))} | {bits_summary(r['layer_bits'])}"
            f" | {r['quality_omega']:.4f} | {r['predicted_total_s']:.2f} | {measured} | "
            f"{r['perplexity']:.3f} | {paired['mean']:+.4f} +- {paired['se']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.splitquant.pp")
    parser.add_argument("--out", default="benchmark/results/splitquant/pp2.json")
    parser.add_argument("--omega", help="indicator file (default: the planner's)")
    parser.add_argument("--indicators", default="measured-kl",
                        help="comma-separated indicators of the omega file to plan with")
    parser.add_argument("--perplexity-tokens", type=int, default=16384)
    parser.add_argument("--no-timing", action="store_true",
                        help="skip the timed batches (perplexity and memory only)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the full-precision reference (even split of the same total)")
    parser.add_argument("--devices", default=DEVICES,
                        help=f"the two stages' devices, NAME:MEMORY (default {DEVICES})")
    args = parser.parse_args()
    from sglang_morph.models import default_model_path
    from sglang_morph.cli import default_engines, parse_size
    from sglang_morph.models.spec import ModelSpec

    devices = args.devices
    total_bytes = sum(parse_size(d.split(":", 1)[1]) for d in devices.split(","))
    even_devices = f"cpu:{total_bytes // 2}B,cpu:{total_bytes // 2}B"  # the same total, split

    model_dir = default_model_path()
    engines = str(default_engines(model_dir))
    kv_per_layer = ModelSpec.from_model_dir(model_dir).kv_bytes_per_token_per_layer()
    omega_args = ["--omega", args.omega] if args.omega else []
    runs, plans = {}, {}
    for name in args.indicators.split(","):
        first = plan(devices, *omega_args, "--indicator", name)
        runs.setdefault("uniform (same devices)", first["baselines"]["uniform"])
        bound = first["baselines"]["uniform"]["quality_omega"]
        bounded = plan(devices, *omega_args, "--indicator", name, "--max-omega",
                       repr(max(bound, 1e-12)))
        plans[name] = {"unbounded": first["plan"], "bounded_by_uniform": bounded["plan"],
                       "uniform_quality_omega": bound}
        runs[f"splitquant ({name})"] = bounded["plan"]
    if not args.no_reference:
        runs["uniform (same total memory, split evenly)"] = plan(
            even_devices, *omega_args)["baselines"]["uniform"]
    logs = Path(tempfile.mkdtemp())
    rows, served = {}, {}
    for i, (name, p) in enumerate(runs.items()):
        key = (tuple(p["stage_layers"]), tuple(p["layer_bits"]))
        if key in served:  # an identical plan: served once
            rows[name] = {**rows[served[key]], "same_plan_as": served[key]}
            continue
        served[key] = name
        rows[name] = serve(p, engines, kv_per_layer, logs / str(i), args.perplexity_tokens,
                           timing=not args.no_timing)
    paired_vs(rows, "uniform (same devices)")
    result = {"git": git_state(), "machine": machine_info(), "devices": devices,
              "even_devices": even_devices, "workload": WORKLOAD,
              "command": "python -m benchmark.splitquant.pp " + " ".join(sys.argv[1:]),
              "plans": plans, "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown_table(result))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
