"""Pipeline bubble share of a merged pair (2 stages) with and without lookahead micro-batching,
on batches drawn from the arrival traces, costed by the chunk cost model measured on this
machine (``benchmark/results/kunserve/costs.json``).

Each batch is ``--batch`` consecutive requests of a trace (prompt and output lengths as in the
trace, capped like the replay benchmark). It is served to completion through the pipeline
(``lookahead.serve_batch_bubbles``, every iteration cut into 2 micro-batches), in two
scenarios: all requests at once (one prefill iteration, then decodes) and staggered (one
request joins every 4 iterations, its prefill mixed with the running decodes); by request
count (no cost model) and by lookahead (equal cost, prefills cut by the cost model). Each hop
between stages costs the measured gloo latency (``transfer.json``). The bubble share is the
stages' idle share of the makespan; the numbers are computed from the measured cost model
(the pipeline itself is not run).

    .venv/bin/python -m benchmark.kunserve_lookahead [--out benchmark/results/kunserve]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np

from benchmark.replay.trace import read_trace
from sglang_morph.kunserve.cost import PhaseCosts
from sglang_morph.kunserve.lookahead import serve_batch_bubbles
from sglang_morph.repo_data import TRACES_DIR

TRACES = {"azure_conv": "azure_llm_2023_conv.csv", "azure_code": "azure_llm_2023_code.csv",
          "burstgpt": "burstgpt_first400.csv"}
# all at once: the batch arrives together (one prefill iteration, then decodes); staggered:
# one request joins every 4 iterations, its prefill mixed with the running decodes.
SCENARIOS = {"all at once": None, "staggered": 4}
MAX_PROMPT_TOKENS = 2048
MAX_OUTPUT_TOKENS = 128


def batches(path: Path, size: int, count: int):
    df = read_trace(path)
    for k in range(min(count, len(df) // size)):
        rows = df.iloc[k * size: (k + 1) * size]
        yield [(f"r{i}", int(min(p, MAX_PROMPT_TOKENS)), int(min(o, MAX_OUTPUT_TOKENS)))
               for i, (p, o) in enumerate(zip(rows.prompt_tokens, rows.output_tokens))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=40, help="batches per trace")
    args = ap.parse_args()
    costs = PhaseCosts.load(args.out / "costs.json")
    transfer = json.loads((args.out / "transfer.json").read_text())
    link_s = transfer["gloo_latency_s"]
    rows = {}
    for name, csv in TRACES.items():
        for scenario, join_every in SCENARIOS.items():
            shares = {"by_request_count": [], "lookahead": []}
            for prompts in batches(TRACES_DIR / csv, args.batch, args.batches):
                for splitter, run in serve_batch_bubbles(costs, prompts, [0.5, 0.5],
                                                         transfer_s=link_s,
                                                         join_every=join_every).items():
                    shares[splitter].append(run.bubble_share)
            row = {k: {"mean": float(np.mean(v)), "median": float(np.median(v)),
                       "batches": len(v)} for k, v in shares.items()}
            row["ratio"] = row["lookahead"]["mean"] / row["by_request_count"]["mean"]
            rows[f"{name} / {scenario}"] = row
            print(name, scenario, json.dumps(row), flush=True)
    meta = {"command": f"python -m benchmark.kunserve_lookahead --batch {args.batch} "
                       f"--batches {args.batches}",
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "costs": costs.source, "link_s": link_s, "stages": 2, "micro_batches": 2}
    (args.out / "lookahead.json").write_text(json.dumps({"meta": meta, "traces": rows}, indent=1))
    lines = ["# Lookahead micro-batching: pipeline bubble share of a merged pair", "",
             f"`{meta['command']}` at commit {meta['commit']}; costs measured on this machine "
             f"({meta['costs']}); 2 stages (15 + 15 layers), 2 micro-batches per iteration, "
             f"each hop between stages costs the measured gloo latency ({link_s * 1e3:.2f} ms). "
             "Computed from the measured cost model (the pipeline itself is not run).", "",
             "| trace / arrivals | batches | bubble share by request count | with lookahead | ratio |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['lookahead']['batches']} | "
                     f"{r['by_request_count']['mean']:.1%} | {r['lookahead']['mean']:.1%} | "
                     f"{r['ratio']:.2f} |")
    (args.out / "lookahead.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
