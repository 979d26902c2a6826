"""AMOEBAs' premise, and what its layouts cost at TP 1, on this machine: short requests on
three replicas alone vs the same replicas merged into one TP 3 group (its members' batches
run as one forward a step, or each owner's batch as its own forward), and vs plain SGLang's
three replicas.

Three servers at once, float32, the default model, ``--dp-size 3 --max-total-tokens 1024
--sleep-on-idle``, one thread per rank (the live replay's environment): plain SGLang, the same
with ``--enable-amoebas --amoebas-manual``, whose replicas hold their KV head by head and
their FFN weights as views of the in-place store, and that with ``--amoebas-merged-forward
per-owner``. Each round measures, one after the other: plain SGLang, AMOEBAs' replicas alone,
then the group merged (``POST /amoebas/merge``; batched, then per owner), each split back
after. A measurement streams ``PER_REPLICA`` greedy requests to every replica at
once (``routed_dp_rank``; prompt ``PROMPT_TOKENS``, exactly ``NEW_TOKENS`` new tokens) and
reports output tokens per second of the whole batch and each request's TTFT, TPOT (the
decode step it saw, ``(E2E - TTFT) / (new tokens - 1)``) and E2E.

    .venv/bin/python -m benchmark.amoebas.premise [--rounds 3] [--out benchmark/results/amoebas]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.amoebas.replay import SERVER_ENV
from benchmark.amoebas.validate import streams_at_once
from benchmark.harness import load_average, run_meta, running_server, spread, write_results
from benchmark.replay.metrics import percentiles

PLAIN_ARGS = ("--dp-size", "3", "--dtype", "float32", "--max-total-tokens", "1024",
              "--sleep-on-idle")
AMOEBAS_ARGS = PLAIN_ARGS + ("--enable-amoebas", "--amoebas-manual")
PER_OWNER_ARGS = AMOEBAS_ARGS + ("--amoebas-merged-forward", "per-owner")
REPLICAS = (0, 1, 2)
PER_REPLICA, PROMPT_TOKENS, NEW_TOKENS = 4, 48, 32
LAYOUTS = {"plain": "3 x TP 1, plain SGLang", "alone": "3 x TP 1, AMOEBAs' layouts",
           "merged": "TP 3 group, batched steps", "per_owner": "TP 3 group, per owner"}


def prompt(seed: int) -> list[int]:
    """Deterministic token ids (a timing run: the length matters, not the text)."""
    return [(seed * 97 + i * 31) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def request_times(chunks: list[tuple[float, int]]) -> dict[str, float]:
    """TTFT, TPOT and E2E of one streamed request from its (seconds since sent, tokens so far)
    chunks; it must have produced exactly ``NEW_TOKENS``."""
    if not chunks or chunks[-1][1] != NEW_TOKENS:
        raise RuntimeError(f"a request ended with {chunks[-1][1] if chunks else 0} of "
                           f"{NEW_TOKENS} tokens")
    ttft_s, e2e_s = chunks[0][0], chunks[-1][0]
    return {"ttft_s": ttft_s, "tpot_s": (e2e_s - ttft_s) / (NEW_TOKENS - 1), "e2e_s": e2e_s}


def measure(url: str, round_no: int) -> dict:
    jobs = [(prompt(1000 * round_no + 10 * r + i), NEW_TOKENS, r)
            for r in REPLICAS for i in range(PER_REPLICA)]
    started = time.perf_counter()
    times = [request_times(c) for c in streams_at_once(url, jobs)]
    wall_s = time.perf_counter() - started
    return {"output_tokens_per_s": len(jobs) * NEW_TOKENS / wall_s, "wall_s": wall_s,
            "requests": times}


def transition(url: str, route: str, body: dict) -> float:
    started = time.perf_counter()
    resp = httpx.post(f"{url}/amoebas/{route}", json=body, timeout=900)
    resp.raise_for_status()
    return time.perf_counter() - started


def measure_merged(url: str, round_no: int) -> tuple[dict, dict]:
    """``measure`` with the replicas merged into one group, split back after; and the merge's
    and the split's wall time."""
    merge_s = transition(url, "merge", {"replicas": list(REPLICAS)})
    run = measure(url, round_no)
    split_s = transition(url, "split", {"group": list(REPLICAS)})
    return run, {"merge_s": merge_s, "split_s": split_s}


def summary(runs: list[dict]) -> dict:
    rates = [r["output_tokens_per_s"] for r in runs]
    out = {"output_tokens_per_s_median": statistics.median(rates),
           "output_tokens_per_s_min": min(rates), "output_tokens_per_s_max": max(rates)}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        out[key] = percentiles([t[key] for r in runs for t in r["requests"]])
    return out


def ratios(over: list[dict], under: list[dict]) -> dict:
    """Per round, ``over`` / ``under`` of the batch's throughput and of its median TPOT;
    median, min and max over the rounds."""
    def tpot_p50(run: dict) -> float:
        return statistics.median(t["tpot_s"] for t in run["requests"])

    return {"throughput": spread([a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                  for a, b in zip(over, under)]),
            "tpot_p50": spread([tpot_p50(a) / tpot_p50(b) for a, b in zip(over, under)])}


def report(result: dict, rounds: int) -> str:
    meta = result["meta"]
    lines = [
        "# AMOEBAs' premise: short requests on 3 x TP 1 vs one TP 3 group, and vs plain SGLang",
        "",
        f"`{meta['command']}` at commit {meta['git']['commit'][:7]} (dirty: "
        f"{meta['git']['dirty']}), {meta['machine']['cpu_model']}, "
        f"{meta['machine']['cpu_cores']} cores; load before {meta['load_before']}, after {meta['load_after']}.",
        "",
        f"Measured, {rounds} rounds, the layouts one after the other in each round, three "
        f"servers up at once (plain `{' '.join(PLAIN_ARGS)}`; AMOEBAs adds "
        f"`{' '.join(AMOEBAS_ARGS[len(PLAIN_ARGS):])}`, and per owner "
        f"`{' '.join(PER_OWNER_ARGS[len(AMOEBAS_ARGS):])}`), environment {SERVER_ENV}; "
        f"{PER_REPLICA} streamed requests per replica at once, {PROMPT_TOKENS}-token prompts, "
        f"{NEW_TOKENS} new tokens each. Percentiles over every request of every round.",
        "",
        "| layout | output tok/s median (min-max) | TTFT P50 / P95 / P99 s | "
        "TPOT P50 / P95 / P99 ms | E2E P50 / P95 / P99 s |",
        "|---|---|---|---|---|",
    ]
    for name, label in LAYOUTS.items():
        s = result[name]
        ttft, tpot, e2e = s["ttft_s"], s["tpot_s"], s["e2e_s"]
        lines.append(
            f"| {label} | {s['output_tokens_per_s_median']:.1f} "
            f"({s['output_tokens_per_s_min']:.1f}-{s['output_tokens_per_s_max']:.1f}) | "
            f"{ttft['p50']:.2f} / {ttft['p95']:.2f} / {ttft['p99']:.2f} | "
            f"{1e3 * tpot['p50']:.0f} / {1e3 * tpot['p95']:.0f} / {1e3 * tpot['p99']:.0f} | "
            f"{e2e['p50']:.2f} / {e2e['p95']:.2f} / {e2e['p99']:.2f} |")

    def ratio_line(what: str, r: dict) -> str:
        return (f"{what}: throughput {r['throughput']['median']:.3f} "
                f"({r['throughput']['min']:.3f}-{r['throughput']['max']:.3f}), median TPOT "
                f"{r['tpot_p50']['median']:.3f} ({r['tpot_p50']['min']:.3f}-"
                f"{r['tpot_p50']['max']:.3f}); per round, median (min-max) over rounds.")

    lines += ["", ratio_line("TP 3 group, batched steps / 3 x TP 1 (AMOEBAs' layouts)",
                             result["merged_over_alone"]),
              "", ratio_line("TP 3 group, per owner / 3 x TP 1 (AMOEBAs' layouts)",
                             result["per_owner_over_alone"]),
              "", ratio_line("TP 3 group, batched steps / per owner",
                             result["merged_over_per_owner"]),
              "", ratio_line("AMOEBAs' layouts / plain SGLang, both 3 x TP 1",
                             result["alone_over_plain"]),
              "", "Merge / split wall time per round (idle replicas, the batched server): "
              + ", ".join(f"{t['merge_s']:.2f} / {t['split_s']:.2f} s"
                          for t in result["transitions_s"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/amoebas"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    load_before = load_average()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    transitions = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        plain = servers.enter_context(running_server(PLAIN_ARGS, Path(tmp) / "plain.log",
                                                     env=SERVER_ENV))
        amoebas = servers.enter_context(running_server(AMOEBAS_ARGS, Path(tmp) / "amoebas.log",
                                                       env=SERVER_ENV))
        per_owner = servers.enter_context(running_server(
            PER_OWNER_ARGS, Path(tmp) / "per_owner.log", env=SERVER_ENV))
        for url in (plain.url, amoebas.url, per_owner.url):
            measure(url, -1)  # warm-up (not reported)
        for k in range(args.rounds):
            runs["plain"].append(measure(plain.url, k))
            runs["alone"].append(measure(amoebas.url, k))
            run, seconds = measure_merged(amoebas.url, k)
            runs["merged"].append(run)
            transitions.append(seconds)
            runs["per_owner"].append(measure_merged(per_owner.url, k)[0])
            rates = [f"{name} {runs[name][-1]['output_tokens_per_s']:.1f}" for name in LAYOUTS]
            print(f"round {k}: {', '.join(rates)} tok/s", flush=True)
    result = {
        "meta": run_meta(" ".join(["python -m benchmark.amoebas.premise", *argv]),
                         load_before, plain_args=list(PLAIN_ARGS),
                         amoebas_args=list(AMOEBAS_ARGS),
                         per_owner_args=list(PER_OWNER_ARGS), server_env=SERVER_ENV,
                         per_replica=PER_REPLICA, prompt_tokens=PROMPT_TOKENS,
                         new_tokens=NEW_TOKENS),
        **{name: summary(r) for name, r in runs.items()},
        "merged_over_alone": ratios(runs["merged"], runs["alone"]),
        "per_owner_over_alone": ratios(runs["per_owner"], runs["alone"]),
        "merged_over_per_owner": ratios(runs["merged"], runs["per_owner"]),
        "alone_over_plain": ratios(runs["alone"], runs["plain"]),
        "transitions_s": transitions, "runs": runs}
    write_results(args.out, "premise", result, report(result, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
