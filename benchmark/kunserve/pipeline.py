"""Decode TPOT of a live KunServe group, whole vs dropped (the pipeline's own cost).

One ``--dp-size G --enable-kunserve [--kunserve-group-size G]`` server (G = 2, a pair, by
default; float32, one thread per replica, the replay's 910-token pools unless
``--pool-tokens``), with SGLang's forwards
timed (``SGLANG_MORPH_FORWARD_TIMINGS``). For each layout (whole replicas; then after
``POST /kunserve/drop``, the group as a pipeline of G stages) and each batch size ``b``, ``b``
greedy requests per replica run at once (``routed_dp_rank``), twice: 1 new token (the TTFT)
and ``1 + DECODE_TOKENS`` (ignore_eos); a request's TPOT is the difference over
``DECODE_TOKENS``. The replay measures TPOT under a trace, where a drop also admits more
requests; this isolates what the pipeline costs a step at the same batch. ``--runs N``
repeats each layout's batches N times on the same server (whole N times, then dropped N
times).

    .venv/bin/python -m benchmark.kunserve.pipeline [--group-size G] [--runs N] [--out DIR]
        [--prompt-tokens N] [--batches 1,2,3,4] [--pool-tokens N]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.harness import load_average, run_meta, running_server

POOL_TOKENS = 910  # the replay's per-replica pool
PROMPT_TOKENS = 48
DECODE_TOKENS = 96
BATCHES = (1, 2, 3, 4)


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    """Deterministic token ids (a timing run: the text does not matter, its length does)."""
    return [(seed * 97 + i * 31) % 40000 + 100 for i in range(tokens)]


def generate(url: str, replica: int, seed: int, new_tokens: int,
             prompt_tokens: int = PROMPT_TOKENS) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": prompt(seed, prompt_tokens), "routed_dp_rank": replica, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    r.raise_for_status()
    if r.json()["meta_info"]["completion_tokens"] != new_tokens:
        raise RuntimeError(f"asked {new_tokens} tokens, got {r.json()['meta_info']}")
    return time.perf_counter() - start


def server_args(group_size: int, pool_tokens: int = POOL_TOKENS) -> tuple[str, ...]:
    return ("--dp-size", str(group_size), "--dtype", "float32",
            "--max-total-tokens", str(pool_tokens), "--enable-kunserve",
            *(("--kunserve-group-size", str(group_size)) if group_size > 2 else ()))


def at_once(url: str, replicas: int, batch: int, new_tokens: int,
            prompt_tokens: int = PROMPT_TOKENS) -> list[float]:
    """``batch`` requests per replica, all sent together; seconds each (replica 0's first)."""
    jobs = [(r, 1000 * r + i) for r in range(replicas) for i in range(batch)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: generate(url, *job, new_tokens, prompt_tokens), jobs))


def decode_forwards(path: Path, since_line: int) -> dict[int, list[float]]:
    """Seconds of each decode forward per process, from line ``since_line`` of the timings."""
    out = collections.defaultdict(list)
    for line in path.read_text().splitlines()[since_line:]:
        rec = json.loads(line)
        if rec["mode"] == "decode":
            out[rec["pid"]].append(rec["seconds"])
    return out


def measure(url: str, timings: Path, layout: str, replicas: int, run: int,
            batches: tuple[int, ...] = BATCHES, prompt_tokens: int = PROMPT_TOKENS) -> list[dict]:
    rows = []
    for batch in batches:
        # warm-up (and the prompts' prefixes cached alike)
        at_once(url, replicas, batch, 4, prompt_tokens)
        first = len(timings.read_text().splitlines()) if timings.exists() else 0
        short = at_once(url, replicas, batch, 1, prompt_tokens)
        long = at_once(url, replicas, batch, 1 + DECODE_TOKENS, prompt_tokens)
        tpot = [(lo - sh) / DECODE_TOKENS for lo, sh in zip(long, short)]
        forwards = decode_forwards(timings, first)
        rows.append({
            "layout": layout, "run": run, "batch_per_replica": batch,
            "tpot_s": tpot, "tpot_median_s": statistics.median(tpot),
            "ttft_s": short,
            "decode_forward_median_s": statistics.median(
                [s for per_pid in forwards.values() for s in per_pid]) if forwards else None})
        print(json.dumps({k: rows[-1][k] for k in ("layout", "run", "batch_per_replica",
                                                     "tpot_median_s")}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.pipeline",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    ap.add_argument("--group-size", type=int, default=2,
                    help="replicas in the group, all of the server's (default 2: a pair)")
    ap.add_argument("--runs", type=int, default=1, help="repeats of each layout's batches")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help=f"each request's prompt (default {PROMPT_TOKENS})")
    ap.add_argument("--batches", type=lambda text: tuple(int(b) for b in text.split(",")),
                    default=BATCHES, help="requests per replica, comma-separated "
                    f"(default {','.join(map(str, BATCHES))})")
    ap.add_argument("--pool-tokens", type=int, default=POOL_TOKENS,
                    help=f"each replica's KV pool, --max-total-tokens (default {POOL_TOKENS}, "
                    "the replay's)")
    args = ap.parse_args()
    if args.group_size < 2 or args.runs < 1:
        ap.error("--group-size must be at least 2 and --runs at least 1")
    if args.prompt_tokens < 1 or not args.batches or min(args.batches) < 1:
        ap.error("--prompt-tokens and every batch in --batches must be at least 1")
    need = max(args.batches) * (args.prompt_tokens + 1 + DECODE_TOKENS)
    if need > args.pool_tokens:
        ap.error(f"--batches {max(args.batches)} of {args.prompt_tokens} + {1 + DECODE_TOKENS} "
                 f"tokens need {need} tokens of KV a replica; --pool-tokens is "
                 f"{args.pool_tokens}")
    batches = args.batches
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    launch = server_args(args.group_size, args.pool_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "forwards.jsonl"
        env = {"OMP_NUM_THREADS": "1", "SGLANG_MORPH_FORWARD_TIMINGS": str(timings)}
        with running_server(launch, Path(tmp) / "server.log", env) as server:
            rows = [row for run in range(args.runs)
                    for row in measure(server.url, timings, "whole", args.group_size, run,
                                           batches, args.prompt_tokens)]
            r = httpx.post(f"{server.url}/kunserve/drop", timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"drop refused: {r.status_code} {r.text}")
            rows += [row for run in range(args.runs)
                     for row in measure(server.url, timings, "dropped", args.group_size, run,
                                            batches, args.prompt_tokens)]
            status = httpx.get(f"{server.url}/kunserve/status", timeout=60).json()
    by = {(r["layout"], r["run"], r["batch_per_replica"]): r for r in rows}
    # Per run: dropped over whole of the same run's batch (whole run i against dropped run i).
    ratios = {b: [by[("dropped", i, b)]["tpot_median_s"] / by[("whole", i, b)]["tpot_median_s"]
                  for i in range(args.runs)] for b in batches}
    result = {
        "rows": rows, "tpot_dropped_over_whole": {str(b): v for b, v in ratios.items()},
        "batches_sent_ahead": [rep.get("batches_sent_ahead") for rep in status["replicas"]],
        "layers": [rep["layers"] for rep in status["replicas"]],
        "settings": {"server_args": list(launch), "prompt_tokens": args.prompt_tokens,
                     "decode_tokens": DECODE_TOKENS, "omp_threads_per_replica": 1,
                     "runs": args.runs},
        "meta": run_meta("python -m benchmark.kunserve.pipeline "
                         + " ".join(sys.argv[1:]), load_before),
    }
    (args.out / "pipeline.json").write_text(json.dumps(result, indent=1))
    what = "pair" if args.group_size == 2 else f"group of {args.group_size}"
    lines = [
        f"# KunServe {what}: decode TPOT whole vs dropped", "",
        f"commit {result['meta']['git']['commit']} (dirty: {result['meta']['git']['dirty']}), "
        f"{result['meta']['machine'].get('cpu_model')}, "
        f"{result['meta']['machine'].get('cpu_cores')} cores, load {load_before} -> "
        f"{result['meta']['load_after']}; `{result['meta']['command']}`; server "
        f"`{' '.join(launch)}`; stages {result['layers']}.", "",
        f"Median over {args.runs} run(s) (min-max); a run's figure is the median over its "
        f"requests. The ratio is per run (dropped run i over whole run i).", "",
        "| batch per replica | TPOT whole ms | TPOT dropped ms | dropped / whole | "
        "decode forward whole ms | dropped ms |", "|---:|---:|---:|---:|---:|---:|"]

    def cell(values: list[float], scale: float = 1000.0, digits: int = 1) -> str:
        values = [v * scale for v in values]
        text = f"{statistics.median(values):.{digits}f}"
        return text if len(values) == 1 else (
            f"{text} ({min(values):.{digits}f}-{max(values):.{digits}f})")

    for b in batches:
        runs = range(args.runs)
        lines.append(
            f"| {b} | {cell([by[('whole', i, b)]['tpot_median_s'] for i in runs])} | "
            f"{cell([by[('dropped', i, b)]['tpot_median_s'] for i in runs])} | "
            f"{cell(ratios[b], 1.0, 2)} | "
            f"{cell([by[('whole', i, b)]['decode_forward_median_s'] or 0 for i in runs])} | "
            f"{cell([by[('dropped', i, b)]['decode_forward_median_s'] or 0 for i in runs])} |")
    (args.out / "pipeline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
