"""Decode TPOT of a live KunServe pair, whole vs dropped (the pipeline's own cost).

One ``--dp-size 2 --enable-kunserve`` server (float32, one core per replica, the replay's
910-token pools), with SGLang's forwards timed (``SGLANG_MORPH_FORWARD_TIMINGS``). For each
layout (whole replicas; then after ``POST /kunserve/drop``, the pair as a two-stage pipeline)
and each batch size ``b``, ``b`` greedy requests per replica run at once (``routed_dp_rank``),
twice: 1 new token (the TTFT) and ``1 + DECODE_TOKENS`` (ignore_eos); a request's TPOT is
the difference over ``DECODE_TOKENS``. The replay measures TPOT under a trace, where a drop
also admits more requests; this isolates what the pipeline costs a step at the same batch.

    .venv/bin/python -m benchmark.kunserve.pipeline [--out benchmark/results/kunserve]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.harness import load_average, run_meta, running_server

SERVER_ARGS = ("--dp-size", "2", "--dtype", "float32", "--max-total-tokens", "910",
               "--enable-kunserve")
PROMPT_TOKENS = 48
DECODE_TOKENS = 96
BATCHES = (1, 2, 3, 4)


def prompt(seed: int) -> list[int]:
    """Deterministic token ids (a timing run: the text does not matter, its length does)."""
    return [(seed * 97 + i * 31) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def generate(url: str, replica: int, seed: int, new_tokens: int) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": prompt(seed), "routed_dp_rank": replica, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    r.raise_for_status()
    if r.json()["meta_info"]["completion_tokens"] != new_tokens:
        raise RuntimeError(f"asked {new_tokens} tokens, got {r.json()['meta_info']}")
    return time.perf_counter() - start


def at_once(url: str, batch: int, new_tokens: int) -> list[float]:
    """``batch`` requests per replica, all sent together; seconds each (replica 0's first)."""
    jobs = [(r, 1000 * r + i) for r in (0, 1) for i in range(batch)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: generate(url, *job, new_tokens), jobs))


def decode_forwards(path: Path, since_line: int) -> dict[int, list[float]]:
    """Seconds of each decode forward per process, from line ``since_line`` of the timings."""
    out = collections.defaultdict(list)
    for line in path.read_text().splitlines()[since_line:]:
        rec = json.loads(line)
        if rec["mode"] == "decode":
            out[rec["pid"]].append(rec["seconds"])
    return out


def measure(url: str, timings: Path, layout: str) -> list[dict]:
    rows = []
    for batch in BATCHES:
        at_once(url, batch, 4)  # warm-up (and the prompts' prefixes cached alike)
        first = len(timings.read_text().splitlines()) if timings.exists() else 0
        short = at_once(url, batch, 1)
        long = at_once(url, batch, 1 + DECODE_TOKENS)
        tpot = [(lo - sh) / DECODE_TOKENS for lo, sh in zip(long, short)]
        forwards = decode_forwards(timings, first)
        rows.append({
            "layout": layout, "batch_per_replica": batch,
            "tpot_s": tpot, "tpot_median_s": statistics.median(tpot),
            "ttft_s": short,
            "decode_forward_median_s": statistics.median(
                [s for per_pid in forwards.values() for s in per_pid]) if forwards else None})
        print(json.dumps({k: rows[-1][k] for k in ("layout", "batch_per_replica",
                                                     "tpot_median_s")}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.pipeline",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "forwards.jsonl"
        env = {"OMP_NUM_THREADS": "1", "SGLANG_MORPH_FORWARD_TIMINGS": str(timings)}
        with running_server(SERVER_ARGS, Path(tmp) / "server.log", env) as server:
            rows = measure(server.url, timings, "whole")
            r = httpx.post(f"{server.url}/kunserve/drop", timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"drop refused: {r.status_code} {r.text}")
            rows += measure(server.url, timings, "dropped")
            status = httpx.get(f"{server.url}/kunserve/status", timeout=60).json()
    whole = {r["batch_per_replica"]: r["tpot_median_s"] for r in rows if r["layout"] == "whole"}
    ratios = {b: r["tpot_median_s"] / whole[b] for r in rows if r["layout"] == "dropped"
              for b in [r["batch_per_replica"]]}
    result = {
        "rows": rows, "tpot_dropped_over_whole": {str(b): v for b, v in ratios.items()},
        "batches_sent_ahead": [rep.get("batches_sent_ahead") for rep in status["replicas"]],
        "settings": {"server_args": list(SERVER_ARGS), "prompt_tokens": PROMPT_TOKENS,
                     "decode_tokens": DECODE_TOKENS, "omp_threads_per_replica": 1},
        "meta": run_meta("python -m benchmark.kunserve.pipeline", load_before),
    }
    (args.out / "pipeline.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# KunServe pair: decode TPOT whole vs dropped", "",
        f"commit {result['meta']['git']['commit']}, {result['meta']['machine'].get('cpu_model')}"
        f", load {load_before} -> {result['meta']['load_after']}; `{result['meta']['command']}`",
        "", "| batch per replica | TPOT whole ms | TPOT dropped ms | dropped / whole | "
        "decode forward whole ms | dropped ms |", "|---:|---:|---:|---:|---:|---:|"]
    by = {(r["layout"], r["batch_per_replica"]): r for r in rows}
    for b in BATCHES:
        w, d = by[("whole", b)], by[("dropped", b)]
        lines.append(f"| {b} | {1000 * w['tpot_median_s']:.1f} | {1000 * d['tpot_median_s']:.1f}"
                     f" | {ratios[b]:.2f} | {1000 * (w['decode_forward_median_s'] or 0):.1f} | "
                     f"{1000 * (d['decode_forward_median_s'] or 0):.1f} |")
    (args.out / "pipeline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
