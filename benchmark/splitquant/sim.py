"""SplitQuant on simulated heterogeneous GPU clusters (no GPU is used: every number is SIMULATED).

For each of 10 clusters (the paper's kinds of mixes: T4/V100/A100 and L4/H100, 2 to 6 GPUs,
OPT and Llama-2 models sized so that full precision is tight or does not fit), the planner and
the baselines (Uniform, PipeEdge-like, adabits) plan an offline batch on the fitted cost model
(``splitquant.devices.gpu_latency_model``); every plan is then *simulated* on the roofline model
itself (``splitquant.devices.Roofline``, not the fitted one) with the same pipeline formulas, which
gives the throughput in the table. The quality bound: SplitQuant's sum of omega may not exceed
Uniform's (so it never trades more quality than the baseline it is compared with).

    .venv/bin/python -m benchmark.splitquant.sim [--out benchmark/results/splitquant]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from sglang_morph.splitquant import baselines
from sglang_morph.splitquant.devices import GPUS, Roofline, gpu_latency_model
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import SIMULATED_MODELS
from sglang_morph.splitquant.problem import Cluster, Device, PlanningProblem
from sglang_morph.splitquant.search import PlanResult, normalized_omega, search
from sglang_morph.models.workload import Workload

BITS = (16, 8, 4)
# (name, model, GPUs); heterogeneity = fastest / slowest device's bandwidth.
CLUSTERS = [
    ("c1", "opt-13b", ("T4", "T4", "V100")),
    ("c2", "opt-13b", ("T4", "T4", "T4", "V100")),
    ("c3", "llama-2-13b", ("T4", "L4")),
    ("c4", "opt-30b", ("T4", "T4", "V100", "A100-40G")),
    ("c5", "opt-30b", ("V100", "V100", "A100-40G")),
    ("c6", "opt-30b", ("T4", "V100", "A100-40G")),
    ("c7", "opt-66b", ("V100", "V100", "A100-40G", "A100-40G")),
    ("c8", "opt-66b", ("V100", "V100", "A100-80G", "A100-80G")),
    ("c9", "llama-2-70b", ("L4", "L4", "H100")),
    ("c10", "llama-2-70b", ("T4", "T4", "V100", "A100-80G")),
]
WORKLOAD = Workload(batch_requests=32, prompt_tokens=512, output_tokens=100)
MICRO_BATCHES = [(1, 8), (2, 16), (4, 32), (4, 8)]


def heterogeneity(gpus) -> float:
    bw = [GPUS[g].bandwidth_gbs for g in gpus]
    return max(bw) / min(bw)


def simulate(result: PlanResult, problem: PlanningProblem) -> dict:
    """The plan's batch time on the roofline (not the fitted model), same pipeline formulas."""
    w, a, m = result.workload, result.assignment, problem.model
    link = problem.cluster
    act = m.hidden_size * m.dtype_bytes
    pre, dec = [], []
    for j, ((start, end), name) in enumerate(zip(a.boundaries, result.devices)):
        roof = Roofline(GPUS[name], m)
        bits = a.bits[start:end]
        p = sum(float(roof.prefill_s(b, w.prefill_micro_batch, w.prompt_tokens)) for b in bits)
        contexts = w.prompt_tokens + np.arange(1, w.decode_steps + 1)
        d = sum(float(roof.decode_s(b, w.decode_micro_batch, contexts).sum()) for b in bits)
        if j == len(a.stage_layers) - 1:
            p += float(roof.head_s(w.prefill_micro_batch))
            d += w.decode_steps * float(roof.head_s(w.decode_micro_batch))
        else:
            p += link.link_latency_s + w.prefill_micro_batch * w.prompt_tokens * act / (
                link.link_gbs * 1e9)
            d += w.decode_steps * (link.link_latency_s + w.decode_micro_batch * act
                                   / (link.link_gbs * 1e9))
        pre.append(p)
        dec.append(d)
    pre, dec = np.array(pre), np.array(dec)
    total = (pre.sum() + (w.prefill_micro_batches - 1) * pre.max()
             + max(w.decode_micro_batches * dec.max(), dec.sum()))
    return {"total_s": float(total), "throughput_tok_s": w.generated_tokens / float(total)}


def run_cluster(name: str, model_name: str, gpus) -> dict:
    model = SIMULATED_MODELS[model_name]
    memory = MemoryModel.from_spec(model, BITS)
    devices = tuple(Device(g, GPUS[g].usable_memory_bytes, gpu_latency_model(g, model))
                    for g in gpus)
    omega = np.zeros((model.num_layers, 3))
    omega[:, 1], omega[:, 2] = (1 / 127) ** 2, (1 / 15) ** 2
    problem = PlanningProblem(model, memory, Cluster(name, devices), WORKLOAD, BITS,
                              normalized_omega(omega))
    uniform = baselines.uniform(problem, MICRO_BATCHES)
    if uniform is None:
        return {"cluster": name, "model": model_name, "gpus": list(gpus), "fits": False}
    bounded = dataclasses.replace(problem, max_omega=max(uniform.quality, 1e-12))
    group = 1
    row = {"cluster": name, "model": model_name, "gpus": list(gpus),
           "heterogeneity": heterogeneity(gpus), "layer_group": group,
           "quality_bound": bounded.max_omega, "plans": {}}
    plans = {"uniform": uniform,
             "pipeedge": baselines.pipeedge(problem, MICRO_BATCHES),
             "adabits": baselines.adabits(problem, MICRO_BATCHES)}
    for method in ("ilp", "heuristic"):
        plans[f"splitquant-{method}"] = search(bounded, method, group_size=group,
                                               micro_batches=MICRO_BATCHES, time_limit_s=60)
    for key, r in plans.items():
        if r is None:
            row["plans"][key] = None
            continue
        row["plans"][key] = {
            "predicted_throughput_tok_s": r.throughput_tok_s,
            "simulated": simulate(r, problem), "quality_omega": r.quality,
            "stage_layers": list(r.assignment.stage_layers),
            "bits": {str(b): r.assignment.bits.count(b) for b in BITS},
            "devices": list(r.devices), "solve_s": r.solve_s,
            "micro_batches": [r.workload.prefill_micro_batch, r.workload.decode_micro_batch]}
    base = row["plans"]["uniform"]["simulated"]["throughput_tok_s"]
    for key, p in row["plans"].items():
        if p is not None:
            p["speedup_vs_uniform"] = p["simulated"]["throughput_tok_s"] / base
    sq = row["plans"]["splitquant-ilp"]
    row["quality_met"] = sq is not None and sq["quality_omega"] <= row["quality_bound"] * (1 + 1e-9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.splitquant.sim")
    parser.add_argument("--out", default="benchmark/results/splitquant")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    for name, model, gpus in CLUSTERS:
        rows.append(run_cluster(name, model, gpus))
        print(name, json.dumps({k: (v["speedup_vs_uniform"] if v else None)
                                for k, v in rows[-1].get("plans", {}).items()}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"SIMULATED": "every throughput here is simulated on a roofline model of public GPU "
                         "specifications; no GPU ran", "commit": commit,
            "machine": platform.node(), "load_average": list(os.getloadavg()),
            "workload": dataclasses.asdict(WORKLOAD), "micro_batches": MICRO_BATCHES,
            "seconds": time.time() - started}
    (out / "simulated_clusters.json").write_text(json.dumps({**meta, "clusters": rows}, indent=1))
    write_table(out / "simulated_clusters.md", rows, meta)
    plot(out / "simulated_clusters.png", rows)


def write_table(path: Path, rows, meta) -> None:
    keys = ["pipeedge", "adabits", "splitquant-heuristic", "splitquant-ilp"]
    lines = ["# SplitQuant on simulated clusters (SIMULATED: roofline of public specs, no GPU)",
             "", f"Commit {meta['commit']}, workload {meta['workload']}, "
             f"`python -m benchmark.splitquant.sim`, {meta['seconds']:.0f} s.", "",
             "| cluster | model | GPUs | het. | Uniform tok/s | "
             + " | ".join(f"{k} x" for k in keys) + " | SQ bits 16/8/4 | SQ stages | quality met |",
             "|" + "---|" * (7 + len(keys))]
    for r in rows:
        if not r.get("plans"):
            continue
        p = r["plans"]
        sq = p["splitquant-ilp"]
        lines.append(
            f"| {r['cluster']} | {r['model']} | {'+'.join(r['gpus'])} | {r['heterogeneity']:.1f} "
            f"| {p['uniform']['simulated']['throughput_tok_s']:.0f} | "
            + " | ".join(f"{p[k]['speedup_vs_uniform']:.2f}" if p[k] else "-" for k in keys)
            + f" | {sq['bits']['16']}/{sq['bits']['8']}/{sq['bits']['4']} | "
              f"{'/'.join(map(str, sq['stage_layers']))} on {'/'.join(sq['devices'])} "
              f"| {r['quality_met']} |")
    speed = [r["plans"]["splitquant-ilp"]["speedup_vs_uniform"] for r in rows if r.get("plans")]
    lines += ["", f"SplitQuant (ILP) over Uniform: mean {np.mean(speed):.2f}x, "
              f"max {np.max(speed):.2f}x, min {np.min(speed):.2f}x."]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["uniform", "pipeedge", "adabits", "splitquant-heuristic", "splitquant-ilp"]
    rows = [r for r in rows if r.get("plans")]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4))
    for i, k in enumerate(keys):
        ys = [r["plans"][k]["speedup_vs_uniform"] if r["plans"][k] else 0 for r in rows]
        ax.bar(x + (i - 2) * 0.16, ys, 0.16, label=k)
    ax.set_xticks(x, [f"{r['cluster']}\n{r['model']}\n{'+'.join(r['gpus'])}" for r in rows],
                  fontsize=6)
    ax.set_ylabel("throughput / Uniform")
    ax.set_title("SplitQuant vs baselines on SIMULATED clusters (roofline, no GPU)")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
