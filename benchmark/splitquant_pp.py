"""A SplitQuant plan served for real with pipeline parallelism on this CPU: predicted vs measured.

Plans the default model on two CPU stages with unequal memory (``plan --bits 16``: a PP plan
with quantized layers cannot be served yet, see README), starts the plan's ``serve.sh`` command
(PP 2, ``SGLANG_PP_LAYER_PARTITION``), sends the plan's batch at once (random prompt ids,
``ignore_eos``) and compares the wall time with the plan's prediction; the same for Uniform
(the even split, given the same total memory split evenly: its split does not fit 180 MB).

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

from benchmark.harness import running_server

DEVICES = "cpu:250MB,cpu:180MB"
EVEN_DEVICES = "cpu:215MB,cpu:215MB"
WORKLOAD = ["--batch", "8", "--prompt", "128", "--output", "32"]


def plan(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-m", "sglang_morph.plan", "plan", "--devices",
                              DEVICES, "--bits", "16", *WORKLOAD, "--baselines", "--out",
                              f"{d}/plan.json", *extra], capture_output=True, text=True)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmark/results/splitquant/pp2.json")
    args = parser.parse_args()
    result = plan([])
    # Uniform's even split does not fit the 180 MB stage; it gets the same total memory evenly
    even = plan(["--devices", EVEN_DEVICES])["baselines"]["uniform"]
    runs = {"splitquant": result["plan"], "uniform (same total memory, even)": even}
    rows = {}
    for name, p in runs.items():
        w = p["workload"]
        stages = p["stage_layers"]
        env = {"SGLANG_PP_LAYER_PARTITION": ",".join(map(str, stages))}
        argv = ["--pp-size", str(len(stages)), "--max-running-requests",
                str(w["batch_requests"]), "--pp-max-micro-batch-size",
                str(w["decode_micro_batch"])]
        load_before = os.getloadavg()
        with running_server(argv, Path(tempfile.mkdtemp()) / "server.log", env) as server:
            run_batch(server.url, 2, 16, 4, seed=1)  # warm-up
            measured = [run_batch(server.url, w["batch_requests"], w["prompt_tokens"],
                                  w["output_tokens"], seed=s) for s in range(2)]
        rows[name] = {"stage_layers": stages, "workload": w,
                      "predicted_total_s": p["predicted"]["total_s"],
                      "measured_total_s": measured, "load_average_before": load_before,
                      "load_average_after": os.getloadavg()}
        print(name, rows[name], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    Path(args.out).write_text(json.dumps({"commit": commit, "devices": DEVICES,
                                          "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
