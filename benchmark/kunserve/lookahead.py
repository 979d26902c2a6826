"""Pipeline bubble share of a merged pair (2 stages) with and without lookahead micro-batching,
on requests drawn from the arrival traces, costed by the chunk cost model measured on this
machine (``benchmark/results/kunserve/costs.json``). Computed from the cost model; the
pipeline itself is not run.

Each run serves the same requests (consecutive rows of a trace; prompt and output lengths as in
the trace, capped like the replay benchmark) to completion through the same two stages
(``lookahead.serve_pipeline``), once per policy: ``slots`` (no cost model: a micro-batch slot
per stage, requests stay in their slot, SGLang's pipeline parallelism) and ``lookahead``
(KunServe's: every micro-batch formed when stage 0 is free from the requests that are back,
to a target cost, prefills cut by the cost model). Scenarios: ``all at once`` (8 requests
arrive together), ``staggered`` (one of 8 arrives every 4 decode steps of the batch), ``queued``
(32 requests arrive together, at most 8 run at once: the KV-bound overload KunServe drops
layers for; a request is admitted when one finishes). Each hop between stages costs the
measured gloo latency (``transfer.json``). The bubble share is the stages' idle share from the
first arrival to the last micro-batch's end; the makespan ratio says what the lookahead's
schedule costs in total time (a cut prefill re-reads its prefix on torch_native: more work
can hide bubbles without serving faster).

Two cost models: the one measured here (torch_native: a chunk behind a prefix pays ``delta
p^2 + epsilon p`` for the padded prefix) and the same fit without those two terms, i.e. a
kernel that attends with the new rows only (what KunServe's model assumes, e.g. FlashAttention
on a GPU): a COUNTERFACTUAL, not measured. The lookahead's micro-batch cap
(``--caps``, seconds; ``inf`` = one round of work over the stages) trades bubbles for
cut-prefill work; ``:whole`` closes micro-batches at prompt boundaries instead (a prompt is
never cut; a burst enters in more micro-batches, shortest prompts first, each paying the
per-forward ``gamma`` but no padded prefix). Every variant is reported.

    .venv/bin/python -m benchmark.kunserve.lookahead [--out benchmark/results/kunserve]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmark.replay.trace import read_trace
from sglang_morph.kunserve.cost import Chunk, PhaseCosts
from sglang_morph.kunserve.lookahead import POLICIES, PipelineRequest, serve_pipeline
from sglang_morph.repo_data import TRACES_DIR

TRACES = {"azure_conv": "azure_llm_2023_conv.csv", "azure_code": "azure_llm_2023_code.csv",
          "burstgpt": "burstgpt_first400.csv"}
# name -> (requests per run, at most running, arrival gap in decode steps of the batch)
SCENARIOS = {"all at once": (8, None, 0), "staggered": (8, None, 4), "queued": (32, 8, 0)}
MAX_PROMPT_TOKENS = 2048
MAX_OUTPUT_TOKENS = 128
LAYER_SHARES = (0.5, 0.5)


def runs(path: Path, size: int, count: int):
    df = read_trace(path)
    for k in range(min(count, len(df) // size)):
        rows = df.iloc[k * size: (k + 1) * size]
        yield [(f"r{i}", int(min(p, MAX_PROMPT_TOKENS)), int(min(o, MAX_OUTPUT_TOKENS)))
               for i, (p, o) in enumerate(zip(rows.prompt_tokens, rows.output_tokens))]


def without_padding(costs: PhaseCosts) -> PhaseCosts:
    return PhaseCosts(dataclasses.replace(costs.prefill, delta_s=0.0, epsilon_s=0.0),
                      costs.decode, f"{costs.source}, without delta and epsilon")


def variant_name(variant: tuple[float, bool]) -> str:
    cap, cut = variant
    return (("no cap" if math.isinf(cap) else f"cap {cap:g} s")
            + ("" if cut else ", whole prompts"))


def measure(costs: PhaseCosts, link_s: float, runs_per: int,
            caps: list[tuple[float, bool]]) -> dict:
    rows = {}
    for name, csv in TRACES.items():
        for scenario, (size, max_running, gap_steps) in SCENARIOS.items():
            share = {p: {c: [] for c in caps} for p in POLICIES}
            makespan = {p: {c: [] for c in caps} for p in POLICIES}
            count = runs_per if size == 8 else max(1, runs_per // 4)
            for prompts in runs(TRACES_DIR / csv, size, count):
                mean_prompt = int(np.mean([p for _, p, _ in prompts]))
                gap_s = gap_steps * costs.decode.seconds([Chunk(mean_prompt, 1)] * size)
                requests = [PipelineRequest(rid, p, o, i * gap_s)
                            for i, (rid, p, o) in enumerate(prompts)]
                for policy in POLICIES:
                    # The slot policy has no cap: one result serves every column.
                    for cap in caps if policy == "lookahead" else caps[:1]:
                        run, _ = serve_pipeline(costs, requests, LAYER_SHARES, policy, link_s,
                                                max_running, *cap)
                        for c in (caps if policy == "slots" else [cap]):
                            share[policy][c].append(run.bubble_share)
                            makespan[policy][c].append(run.makespan_s)
            row = {"runs": len(share["slots"][caps[0]]), "requests_per_run": size,
                   "max_running": max_running, "arrival_gap_decode_steps": gap_steps,
                   "slots": {"bubble_share": float(np.mean(share["slots"][caps[0]])),
                             "makespan_s": float(np.mean(makespan["slots"][caps[0]]))},
                   "lookahead": {}}
            for cap in caps:
                la_share = float(np.mean(share["lookahead"][cap]))
                ratio_makespan = float(np.mean(np.array(makespan["lookahead"][cap])
                                               / np.array(makespan["slots"][cap])))
                row["lookahead"][variant_name(cap)] = {
                    "bubble_share": la_share,
                    "bubble_ratio": la_share / row["slots"]["bubble_share"],
                    "makespan_s": float(np.mean(makespan["lookahead"][cap])),
                    "makespan_ratio": ratio_makespan}
            rows[f"{name} / {scenario}"] = row
            print(name, scenario, json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.lookahead",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    ap.add_argument("--runs", type=int, default=40,
                    help="runs of 8 requests per trace and scenario (queued: a quarter)")
    ap.add_argument("--caps", default="inf,2,1,0.5,0.5:whole",
                    help="lookahead variants, comma-separated: a micro-batch cap in seconds "
                         "(inf: none), ':whole' to close micro-batches at prompt boundaries "
                         "instead of cutting a prompt")
    args = ap.parse_args()
    try:
        caps = [(float(c.split(":")[0]), not c.endswith(":whole")) for c in args.caps.split(",")]
    except ValueError:
        ap.error(f"--caps: not seconds: {args.caps!r}")
    if any(not (cap > 0) for cap, _ in caps) or any(
            ":" in c and not c.endswith(":whole") for c in args.caps.split(",")):
        ap.error("--caps: positive seconds (or inf), each optionally ':whole', comma-separated")
    started = time.time()
    costs = PhaseCosts.load(args.out / "costs.json")
    link_s = json.loads((args.out / "transfer.json").read_text())["gloo_latency_s"]
    models = {"measured (torch_native)": costs,
              "COUNTERFACTUAL: no padded prefix": without_padding(costs)}
    results = {model: measure(c, link_s, args.runs, caps) for model, c in models.items()}
    meta = {"command": f"python -m benchmark.kunserve.lookahead --runs {args.runs} "
                       f"--caps {args.caps}",
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "costs": costs.source, "link_s": link_s, "stages": len(LAYER_SHARES),
            "seconds": time.time() - started}
    (args.out / "lookahead.json").write_text(json.dumps({"meta": meta, "models": results},
                                                        indent=1))
    lines = ["# Lookahead micro-batching: pipeline bubble share of a merged pair", "",
             f"`{meta['command']}` at commit {meta['commit']} ({meta['seconds']:.0f} s, "
             f"computed, no server); costs: {meta['costs']}; 2 stages (15 + 15 layers), each "
             f"hop {link_s * 1e3:.2f} ms (measured gloo latency). Computed from the cost model "
             "(the pipeline itself is not run). `slots`: a micro-batch slot per stage, no cost "
             "model (SGLang's pipeline parallelism); `lookahead`: micro-batches formed when "
             "stage 0 is free from the requests that are back, to a target cost (one round of "
             "work over the stages, at most the cap), prefills cut by the cost model. Bubble "
             "share: idle stage-time / (stages x makespan), same requests and horizon; "
             "makespan ratio: lookahead / slots, mean over runs.", ""]
    cap_names = [variant_name(c) for c in caps]
    for model, rows in results.items():
        lines += [f"## Cost model: {model}", "",
                  "| trace / scenario | runs | slots bubble | "
                  + " | ".join(f"lookahead {n}: bubble (ratio, makespan ratio)"
                               for n in cap_names) + " |",
                  "|---|---|---|" + "---|" * len(caps)]
        for name, r in rows.items():
            cells = [f"{v['bubble_share']:.1%} ({v['bubble_ratio']:.2f}, "
                     f"{v['makespan_ratio']:.2f})" for v in r["lookahead"].values()]
            lines.append(f"| {name} | {r['runs']} | {r['slots']['bubble_share']:.1%} | "
                         + " | ".join(cells) + " |")
        for cap_name in cap_names:
            entries = [r["lookahead"][cap_name] for r in rows.values()]
            halved = sum(e["bubble_ratio"] <= 0.5 for e in entries)
            free = sum(e["bubble_ratio"] <= 0.5 and e["makespan_ratio"] <= 1.0 for e in entries)
            lines.append(f"\nlookahead {cap_name}: bubble share halved in {halved} of "
                         f"{len(entries)} scenarios, {free} of them without a longer makespan; "
                         f"bubble ratios {min(e['bubble_ratio'] for e in entries):.2f}-"
                         f"{max(e['bubble_ratio'] for e in entries):.2f}, makespan ratios "
                         f"{min(e['makespan_ratio'] for e in entries):.2f}-"
                         f"{max(e['makespan_ratio'] for e in entries):.2f}.")
        lines.append("")
    (args.out / "lookahead.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
