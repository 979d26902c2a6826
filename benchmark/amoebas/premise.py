"""AMOEBAs' premise on this machine: short-request throughput of three replicas at TP 1 vs the
same replicas merged into one TP 3 group.

One ``--dp-size 3 --enable-amoebas --amoebas-manual`` server (float32, the default model).
Each round measures both layouts side by side: the replicas alone, then merged
(``POST /amoebas/merge``), then split back. A measurement sends ``PER_REPLICA`` greedy short
requests to every replica at once (``routed_dp_rank``; prompt ``PROMPT_TOKENS``, exactly
``NEW_TOKENS`` new tokens) and reports output tokens per second of the whole batch and each
request's end-to-end latency.

    .venv/bin/python -m benchmark.amoebas.premise [--rounds 3] [--out benchmark/results/amoebas]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.harness import load_average, run_meta, running_server

SERVER_ARGS = ("--dp-size", "3", "--dtype", "float32", "--max-total-tokens", "1024",
               "--enable-amoebas", "--amoebas-manual")
REPLICAS = (0, 1, 2)
PER_REPLICA, PROMPT_TOKENS, NEW_TOKENS = 4, 48, 32


def prompt(seed: int) -> list[int]:
    """Deterministic token ids (a timing run: the length matters, not the text)."""
    return [(seed * 97 + i * 31) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def measure(url: str, round_no: int) -> dict:
    jobs = [(r, prompt(1000 * round_no + 10 * r + i)) for r in REPLICAS for i in range(PER_REPLICA)]

    def one(job) -> float:
        replica, ids = job
        started = time.perf_counter()
        resp = httpx.post(f"{url}/generate", timeout=900, json={
            "input_ids": ids, "routed_dp_rank": replica, "sampling_params": {
                "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
        resp.raise_for_status()
        assert len(resp.json()["output_ids"]) == NEW_TOKENS
        return time.perf_counter() - started

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        e2e = list(pool.map(one, jobs))
    wall = time.perf_counter() - started
    return {"output_tokens_per_s": len(jobs) * NEW_TOKENS / wall, "wall_s": wall,
            "e2e_s": sorted(e2e)}


def transition(url: str, route: str, body: dict) -> float:
    started = time.perf_counter()
    resp = httpx.post(f"{url}/amoebas/{route}", json=body, timeout=900)
    resp.raise_for_status()
    return time.perf_counter() - started


def summary(runs: list[dict]) -> dict:
    rates = [r["output_tokens_per_s"] for r in runs]
    e2e = sorted(x for r in runs for x in r["e2e_s"])
    return {"output_tokens_per_s_median": statistics.median(rates),
            "output_tokens_per_s_min": min(rates), "output_tokens_per_s_max": max(rates),
            "e2e_s_p50": statistics.median(e2e), "e2e_s_p95": e2e[int(0.95 * (len(e2e) - 1))],
            "e2e_s_p99": e2e[int(0.99 * (len(e2e) - 1))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/amoebas"))
    args = parser.parse_args(argv)
    load_before = load_average()
    alone, merged, transitions = [], [], []
    with tempfile.TemporaryDirectory() as tmp, \
            running_server(SERVER_ARGS, Path(tmp) / "server.log") as server:
        measure(server.url, -1)  # warm-up (not reported)
        for k in range(args.rounds):
            alone.append(measure(server.url, k))
            merge_s = transition(server.url, "merge", {"replicas": list(REPLICAS)})
            merged.append(measure(server.url, k))
            split_s = transition(server.url, "split", {"group": list(REPLICAS)})
            transitions.append({"merge_s": merge_s, "split_s": split_s})
            print(f"round {k}: alone {alone[-1]['output_tokens_per_s']:.1f} tok/s, merged "
                  f"{merged[-1]['output_tokens_per_s']:.1f} tok/s", flush=True)
    ratios = [m["output_tokens_per_s"] / a["output_tokens_per_s"] for a, m in zip(alone, merged)]
    result = {
        "meta": run_meta("python -m benchmark.amoebas.premise " + " ".join(argv or []),
                         load_before, server_args=list(SERVER_ARGS),
                         per_replica=PER_REPLICA, prompt_tokens=PROMPT_TOKENS,
                         new_tokens=NEW_TOKENS),
        "alone": summary(alone), "merged": summary(merged),
        "merged_over_alone_median": statistics.median(ratios),
        "merged_over_alone_min": min(ratios), "merged_over_alone_max": max(ratios),
        "transitions_s": transitions, "runs": {"alone": alone, "merged": merged}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "premise.json").write_text(json.dumps(result, indent=1))
    meta = result["meta"]
    lines = [
        "# AMOEBAs' premise: short requests on 3 x TP 1 vs one TP 3 group",
        "",
        f"`{meta['command']}` at commit {meta['git']['commit'][:7]} (dirty: "
        f"{meta['git']['dirty']}), {meta['machine']['cpu_model']}, {meta['machine']['cpu_cores']} cores; load before {load_before}.",
        "",
        f"Measured, {args.rounds} rounds, both layouts side by side in each round; "
        f"{PER_REPLICA} requests per replica at once, {PROMPT_TOKENS}-token prompts, "
        f"{NEW_TOKENS} new tokens each; server `{' '.join(SERVER_ARGS)}`.",
        "",
        "| layout | output tok/s median (min-max) | E2E P50 / P95 / P99 s |",
        "|---|---|---|",
    ]
    for name in ("alone", "merged"):
        s = result[name]
        lines.append(f"| {'3 x TP 1' if name == 'alone' else 'TP 3 group'} | "
                     f"{s['output_tokens_per_s_median']:.1f} ({s['output_tokens_per_s_min']:.1f}"
                     f"-{s['output_tokens_per_s_max']:.1f}) | {s['e2e_s_p50']:.2f} / "
                     f"{s['e2e_s_p95']:.2f} / {s['e2e_s_p99']:.2f} |")
    lines += ["", f"TP 3 / 3 x TP 1 throughput: median {result['merged_over_alone_median']:.3f} "
                  f"(min {result['merged_over_alone_min']:.3f}, max "
                  f"{result['merged_over_alone_max']:.3f}). Merge / split wall time per round "
                  f"(idle replicas): " + ", ".join(f"{t['merge_s']:.2f} / {t['split_s']:.2f} s"
                                                   for t in transitions) + "."]
    (args.out / "premise.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
