"""``python -m benchmark.amoebas``: AMOEBAs' scheduler against merge-on-demand baselines on
SIMULATED clusters (``benchmark/amoebas/sim.py``), over seeds, loads and all-reduce costs;
writes ``sim.json`` (every run, the first seed's per-unit timelines) and ``sim.md``.

    .venv/bin/python -m benchmark.amoebas [--scenario paper tiny4] [--seeds 5]
        [--load 1 2] [--allreduce-scale 1 0.1] [--costs costs.json] [--quick]

Scenarios: ``paper`` is the AMOEBAs paper's workload shape on 8 replicas of the default model
(short prompts at ~27% of a TP 1 pool, 60 a minute; long prompts no TP 1 pool holds, 1 a
minute); ``paper_tiny8`` the same shape on 8 replicas of the tiny model (degrees 1, 2, 4),
where long prompts can be larger than a TP 2 group holds, as in the paper (the default model's
heads allow no TP 2), so each needs four replicas; ``tiny4`` the 4-replica tiny-model
configuration a live run checks (long prompts of every size a TP 2 or TP 4 group holds, 2 a
minute: TP 1 -> 2 -> 4).
``--load`` multiplies both arrival rates. Every number is SIMULATED.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmark.amoebas.sim import ASSUMED, StepCosts, Workload, metrics, simulate
from sglang_morph.amoebas.capacity import CapacityModel
from sglang_morph.amoebas.policy import AmoebasPolicy, MergeOnDemand, Policy
from sglang_morph.models.spec import ModelSpec

RESULTS = Path("benchmark/results/amoebas")


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: str  # "default" (SmolLM2-135M: degrees 1, 3) or "tiny" (degrees 1, 2, 4)
    replicas: int
    kv_capacity_tokens_tp1: int
    short_per_min: float
    long_per_min: float
    long_above_degree: int = 0  # long prompts exceed this degree's pool (0: second-largest)


SCENARIOS = {
    # A 4096-token pool keeps the long prompts (more than a TP 1 pool, at most a TP 3 group's
    # owner pool) inside the default model's 8192-token context.
    "paper": Scenario("default", 8, 4096, 60.0, 1.0),
    # Long prompts from just over a TP 1 pool to a TP 4 group's: TP 2 and TP 4 groups, and
    # two TP 2 groups merging into one TP 4.
    "tiny4": Scenario("tiny", 4, 2048, 30.0, 2.0, long_above_degree=1),
    # The paper's rates and long prompts above a TP 2 group's pool: only TP 4 groups hold
    # them, out of 8 replicas.
    "paper_tiny8": Scenario("tiny", 8, 2048, 60.0, 1.0, long_above_degree=2),
}


def model_spec(name: str) -> ModelSpec:
    from sglang_morph.models import default_model_path
    from sglang_morph.models.tiny import tiny_model_path

    path = default_model_path() if name == "default" else tiny_model_path()
    return ModelSpec.from_model_dir(path, dtype_bytes=4)  # float32: the CPU serving dtype


def policies(capacity: CapacityModel, split_free_fraction: float = 0.5) -> list[Policy]:
    return [AmoebasPolicy(capacity, split_free_fraction),
            AmoebasPolicy(capacity, split_free_fraction, prefer_merged=False,
                          name="amoebas_no_prefer_merged"),
            *(MergeOnDemand(capacity, placement, reuse)
              for reuse in (True, False) for placement in ("round_robin", "least_loaded"))]


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_grid_point(scenario: Scenario, spec: ModelSpec, costs: StepCosts, workload: Workload,
                   seeds: Sequence[int], split_free_fraction: float, timelines: bool) -> dict:
    """Every policy on every seed's requests; ``timelines``: keep the first seed's per-unit
    timeline of each policy."""
    capacity = CapacityModel.from_kv_pool(spec, scenario.replicas,
                                          scenario.kv_capacity_tokens_tp1)
    runs: dict[str, list[dict]] = {}
    unit_timelines: dict[str, list] = {}
    offered = []
    for seed in seeds:
        reqs = workload.requests(capacity, seed)
        offered.append(sum(r.kv_tokens for r in reqs) / workload.duration_s)
        for policy in policies(capacity, split_free_fraction):
            sim = simulate(reqs, capacity, costs, policy, workload.duration_s)
            runs.setdefault(policy.name, []).append({"seed": seed, **metrics(
                sim, workload.duration_s)})
            if timelines and seed == seeds[0]:
                unit_timelines[policy.name] = sim.timeline
    replica_s = workload.duration_s * scenario.replicas
    summary = {}
    for name, rs in runs.items():
        gain = [a["completed_tokens_per_s"] / r["completed_tokens_per_s"] - 1
                for a, r in zip(runs["amoebas"], rs)]
        share = {kind: _median([sum(v for k, v in r["replica_s"].items()
                                    if k.startswith(kind)) / replica_s for r in rs])
                 for kind in ("decode", "prefill", "merge", "split")}
        share["idle"] = 1.0 - sum(share.values())
        summary[name] = {
            **{f"median_{k}": _median([r[k] for r in rs]) for k in (
                "completed_tokens_per_s", "requests_per_s", "output_tokens_per_s", "merges",
                "splits", "completed_long", "completed_long_tokens_per_s", "waiting_at_end",
                "p50_ttft_s", "p99_ttft_s", "p50_e2e_s")},
            "median_decode_tokens_per_replica_s": {
                d: _median([r["decode_tokens_per_replica_s"].get(d) for r in rs])
                for d in sorted({d for r in rs for d in r["decode_tokens_per_replica_s"]})},
            "min_completed_tokens_per_s": min(r["completed_tokens_per_s"] for r in rs),
            "max_completed_tokens_per_s": max(r["completed_tokens_per_s"] for r in rs),
            "amoebas_gain_median": statistics.median(gain), "amoebas_gain_min": min(gain),
            "amoebas_gain_max": max(gain), "replica_time_share": share}
    return {"scenario": dataclasses.asdict(scenario), "workload": dataclasses.asdict(workload),
            "split_free_fraction": split_free_fraction,
            "offered_tokens_per_s_median": statistics.median(offered),
            "arrived_long_median": _median([r["arrived_long"] for r in runs["amoebas"]]),
            "capacity": {"allowed_degrees": capacity.allowed_degrees,
                         "owner_capacity_tokens": {d: capacity.owner_capacity_tokens(d)
                                                   for d in capacity.allowed_degrees},
                         "freed_bytes": {d: capacity.freed_bytes(d)
                                         for d in capacity.allowed_degrees}},
            "summary": summary, "runs": runs, "timelines_first_seed": unit_timelines}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.amoebas",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), nargs="+", default=["paper"])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--load", type=float, nargs="+", default=[1.0],
                    help="multiply both arrival rates by each factor")
    ap.add_argument("--allreduce-scale", type=float, nargs="+", default=[1.0],
                    help="multiply the all-reduce latency by each factor")
    ap.add_argument("--costs", type=Path, help="step costs JSON (the form sim.json records); "
                                               "default: measured on this machine")
    ap.add_argument("--split-free-fraction", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="2 seeds of 120 s (a smoke test)")
    args = ap.parse_args()
    seeds = list(range(2 if args.quick else args.seeds))
    duration = 120.0 if args.quick else args.duration_s
    from benchmark.harness import load_average, run_meta

    started, load = time.monotonic(), load_average()
    rows = []
    for name in args.scenario:
        sc = SCENARIOS[name]
        spec = model_spec(sc.model)
        base = (StepCosts.from_json(json.loads(args.costs.read_text()), spec.num_layers)
                if args.costs else StepCosts.measured(spec.num_layers))
        for factor in args.load:
            workload = Workload(duration, sc.short_per_min * factor, sc.long_per_min * factor,
                                long_above_degree=sc.long_above_degree)
            for scale in args.allreduce_scale:
                costs = dataclasses.replace(
                    base, allreduce_s_per_layer=scale * base.allreduce_s_per_layer)
                # Timelines of the scenario's first grid point only: every point's would make
                # the results file MBs of unit shapes.
                row = run_grid_point(sc, spec, costs, workload, seeds, args.split_free_fraction,
                                     timelines=factor == args.load[0]
                                     and scale == args.allreduce_scale[0])
                row.update(name=name, load=factor, allreduce_scale=scale,
                           costs=costs.to_json())
                rows.append(row)
                print(f"{name} load x{factor} all-reduce x{scale}: " + ", ".join(
                    f"{p} {v['median_completed_tokens_per_s']:.0f} tok/s "
                    f"({v['amoebas_gain_median']:+.1%})" for p, v in row["summary"].items()),
                    flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = run_meta("python -m benchmark.amoebas " + " ".join(sys.argv[1:]), load,
                    short_commit=commit, SIMULATED=True, seconds=time.monotonic() - started,
                    assumed=ASSUMED)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    (args.out / "sim.md").write_text(report(meta, rows))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def report(meta: dict, rows: list[dict]) -> str:
    m = meta["machine"]
    lines = ["# AMOEBAs' scheduler vs merge-on-demand baselines: SIMULATED", "",
             f"**SIMULATED** (SimPy; no cluster ran, every number below comes from the "
             f"simulator). `{meta['command']}` at commit {meta['short_commit']} (dirty: "
             f"{meta['git']['dirty']}), {m['cpu_model']}, {m['cpu_cores']} cores; "
             f"{meta['seconds']:.0f} s of simulation.", "",
             "Throughput = prompt + output tokens of the requests completed within the window, "
             "per second. Offered = the same over every request that arrived. Gain = AMOEBAs' "
             "throughput over the policy's, per seed (median, min..max). `_per_long`: the "
             "baseline read as \"every long prompt merges its own group\". Gain bound: the "
             "offered over the policy's throughput, the most any policy could gain over it "
             "(none completes more than arrives). Replica time: share of replica-seconds in "
             "decode / prefill / merge + split stalls / idle (medians over seeds). Long tok/s: "
             "the long prompts' share of the throughput. Waiting: requests not yet admitted when "
             "the window ends (an overloaded cluster's backlog). Decode tok per replica-s: "
             "tokens a replica-second of decoding produced at each degree (a group of d counts "
             "d replica-seconds a second): merged time pays for throughput only where a "
             "degree's figure beats TP 1's.", ""]
    for row in rows:
        sc, wl, cap = row["scenario"], row["workload"], row["capacity"]
        costs = row["costs"]
        lines += [
            f"## {row['name']}, load x{row['load']:g}, all-reduce x{row['allreduce_scale']:g} "
            f"(SIMULATED)", "",
            f"{sc['replicas']} replicas of the {sc['model']} model; owner pools by degree "
            f"{cap['owner_capacity_tokens']} tokens; shorts {wl['short_per_min']:g}/min at "
            f"{wl['short_pool_fraction']:.0%} of a TP 1 pool, longs {wl['long_per_min']:g}/min "
            f"(median {row['arrived_long_median']:g} per run); {wl['short_new_tokens']} / "
            f"{wl['long_new_tokens']} new tokens; {wl['duration_s']:g} s; "
            f"{len(row['runs']['amoebas'])} seeds; all-reduce "
            f"{costs['allreduce_s_per_layer'] * 1e3:.2f} ms per layer. Offered "
            f"{row['offered_tokens_per_s_median']:.0f} tok/s.", "",
            "| policy | tok/s median (min-max) | req/s | AMOEBAs gain | gain bound | merges / "
            "splits | longs done | long tok/s | waiting | P50 / P99 TTFT s | replica time "
            "decode / prefill / transitions / idle | decode tok per replica-s by degree |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in row["summary"].items():
            share = s["replica_time_share"]
            bound = row["offered_tokens_per_s_median"] / s["median_completed_tokens_per_s"] - 1
            ttft = (f"{s['median_p50_ttft_s']:.1f} / {s['median_p99_ttft_s']:.1f}"
                    if s["median_p50_ttft_s"] is not None else "-")
            lines.append(
                f"| {name} | {s['median_completed_tokens_per_s']:.0f} "
                f"({s['min_completed_tokens_per_s']:.0f}-{s['max_completed_tokens_per_s']:.0f})"
                f" | {s['median_requests_per_s']:.3f} | {s['amoebas_gain_median']:+.1%} "
                f"({s['amoebas_gain_min']:+.1%}..{s['amoebas_gain_max']:+.1%}) | "
                f"{bound:+.0%} | {s['median_merges']:g} / {s['median_splits']:g} | "
                f"{s['median_completed_long']:g} | {s['median_completed_long_tokens_per_s']:.0f} | "
                f"{s['median_waiting_at_end']:g} | {ttft} | {_pct(share['decode'])} / "
                f"{_pct(share['prefill'])} / {_pct(share['merge'] + share['split'])} / "
                f"{_pct(share['idle'])} | " + ", ".join(
                    f"{d}: {v:.1f}" for d, v in s["median_decode_tokens_per_replica_s"].items())
                + " |")
        lines.append("")
    lines += ["Inputs measured elsewhere: " + rows[0]["costs"]["source"] + ".", "",
              "Assumed:", *[f"- {k}: {v}" for k, v in meta["assumed"].items()], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
