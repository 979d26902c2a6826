"""What sampling an arm's status route during a replay costs its server, in CPU.

    python -m benchmark.replay.status_cost [--seconds 20] [--rounds 3]
        [--out benchmark/results/replay/status_cost]

The DP-2 replay (``benchmark.replay --dp2``) samples ``GET /kunserve/status`` every
``STATUS_POLL_INTERVAL_S`` during the KunServe arm, for its timeline, and nothing during plain
DP 2's. A status request goes through the HTTP server and the tokenizer manager to every
replica's scheduler, which answers it between two batches; on a 2-core machine the CPU it
takes is CPU the replicas' forwards do not get. This starts the KunServe arm's server as the
replay does (the same flags, pool, threads and nice), idle, and measures the CPU seconds of
its whole process tree over ``--seconds`` of wall time, alternately without requests and with
the replay's sampling; the difference over the requests sent is the CPU of one sample. Also
the requests' latency. Reported: per round and the median over the rounds, and the share of
the machine's cores the replay's sampling rate takes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmark.harness import behind_the_client, load_average, run_meta, running_server
from benchmark.harness import spread, write_results
from benchmark.replay.client import STATUS_POLL_INTERVAL_S
from benchmark.replay.dp2 import REPLICA_BUDGET, SERVER_ENV, STATUS, kv_tokens_for, server_args

ARM = "kunserve"


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants."""
    total = 0.0
    root = psutil.Process(pid)
    for p in (root, *root.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def window(pid: int, url: str | None, seconds: float) -> dict[str, Any]:
    """CPU seconds of the tree over ``seconds``; with ``url``, sampling it meanwhile every
    ``STATUS_POLL_INTERVAL_S`` as the replay does (the latency of each request too)."""
    latencies: list[float] = []
    cpu0, start = tree_cpu_s(pid), time.monotonic()
    with httpx.Client(timeout=60) as client:
        while (now := time.monotonic()) < start + seconds:
            if url is None:
                time.sleep(min(STATUS_POLL_INTERVAL_S, start + seconds - now))
                continue
            sent = time.monotonic()
            client.get(url).raise_for_status()
            latencies.append(time.monotonic() - sent)
            time.sleep(max(0.0, STATUS_POLL_INTERVAL_S - (time.monotonic() - sent)))
    return {"cpu_s": tree_cpu_s(pid) - cpu0, "wall_s": time.monotonic() - start,
            "requests": len(latencies), "latencies_s": latencies}


def measure(seconds: float, rounds: int, log: Path) -> list[dict[str, Any]]:
    budget = REPLICA_BUDGET
    args = server_args(ARM, budget, kv_tokens_for(budget), None, log.with_suffix(".jsonl"),
                       Path("unused"))
    runs = []
    with running_server(args, log, env=SERVER_ENV) as server:
        behind_the_client(server)
        url = f"{server.url}{STATUS[ARM]}"
        httpx.get(url, timeout=60).raise_for_status()  # the route's first call is not timed
        for rnd in range(rounds):
            # Alternate the order round by round: a drift falls on both windows
            order = ("idle", "sampled") if rnd % 2 == 0 else ("sampled", "idle")
            got = {name: window(server.proc.pid, url if name == "sampled" else None, seconds)
                   for name in order}
            idle, sampled = got["idle"], got["sampled"]
            extra_cpu_s = (sampled["cpu_s"] / sampled["wall_s"]
                           - idle["cpu_s"] / idle["wall_s"]) * sampled["wall_s"]
            runs.append({
                "round": rnd + 1, "order": list(order),
                "idle_cpu_s": idle["cpu_s"], "idle_wall_s": idle["wall_s"],
                "sampled_cpu_s": sampled["cpu_s"], "sampled_wall_s": sampled["wall_s"],
                "requests": sampled["requests"],
                "cpu_s_per_request": extra_cpu_s / sampled["requests"],
                "cores_at_replay_rate": extra_cpu_s / sampled["wall_s"],
                "latency_s_p50": statistics.median(sampled["latencies_s"]),
                "latency_s_max": max(sampled["latencies_s"])})
    return runs


def markdown(report: dict[str, Any]) -> str:
    s, meta = report["summary"], report["meta"]
    machine, git = meta["machine"], meta["git"]
    lines = [
        "# What the replay's status sampling costs the KunServe arm's server",
        "",
        f"`{meta['command']}`; commit {(git.get('commit') or '?')[:12]}"
        f"{' (dirty)' if git.get('dirty') else ''}; {machine.get('cpu_model', '')}, "
        f"{machine.get('cpu_cores', '?')} cores; load before {meta['load_before']}.",
        "",
        f"The KunServe arm's server as the DP-2 replay starts it, idle; `GET {STATUS[ARM]}` every "
        f"{STATUS_POLL_INTERVAL_S} s (the replay's sampling) against no requests, "
        f"{report['settings']['seconds']:g} s each, order alternating by round. Median over "
        "the rounds (min to max).",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for key, label, fmt in (
            ("cpu_s_per_request", "CPU seconds per status request (all server processes)",
             "{:.4f}"),
            ("cores_at_replay_rate", "cores taken at the replay's sampling rate", "{:.3f}"),
            ("latency_s_p50", "request latency P50, s", "{:.4f}"),
            ("latency_s_max", "request latency max, s", "{:.4f}")):
        v = s[key]
        lines.append(f"| {label} | {fmt.format(v['median'])} ({fmt.format(v['min'])} to "
                     f"{fmt.format(v['max'])}) |")
    lines += ["", "Per round: " + "; ".join(
        f"round {r['round']}: {r['requests']} requests, {r['sampled_cpu_s']:.2f} CPU s sampled "
        f"vs {r['idle_cpu_s']:.2f} idle" for r in report["runs"]), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.replay.status_cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="wall time of each window (default 20)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/replay/status_cost"))
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 1:
        ap.error("--seconds must be positive and --rounds at least 1")
    load_before = load_average()
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    runs = measure(args.seconds, args.rounds, args.out / "raw" / "server.log")
    keys = ("cpu_s_per_request", "cores_at_replay_rate", "latency_s_p50", "latency_s_max")
    report = {"runs": runs, "summary": {k: spread([r[k] for r in runs]) for k in keys},
              "settings": {"seconds": args.seconds, "rounds": args.rounds,
                           "interval_s": STATUS_POLL_INTERVAL_S, "budget": REPLICA_BUDGET},
              "meta": run_meta("python -m benchmark.replay.status_cost " + " ".join(
                  argv if argv is not None else sys.argv[1:]), load_before)}
    write_results(args.out, "status_cost", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
