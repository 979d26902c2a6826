"""Where a live KunServe transition's time goes: each replica's steps of a drop and a restore.

One ``--dp-size G --enable-kunserve`` server (the replay's configuration: float32, one thread
per replica, 910-token pools; G = 2, a pair, by default). Each round: ``--streams`` greedy
requests per replica run (a prompt of ``PROMPT_TOKENS`` tokens, ``NEW_TOKENS`` new ones,
ignore_eos); once every replica runs its requests the operator drops the group, then restores
it while they still run, and every request must come back with all its tokens. Each
replica's transitions log gives ``step_seconds``: the vote (the wait for the slowest member
to reach the transition), each phase (``the KV move``, ``the layer drop``; the restore's
``the KV move back``) and the wait for the others' outcome of it (``... exchange``), and the
restore's ``last step`` (the pool shrinks back). A transition pauses the group for its
slowest member's steps after the vote (the record's ``duration_s``).

    .venv/bin/python -m benchmark.kunserve.transition_steps [--group-size G] [--rounds N] \
        [--streams S] [--out DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.harness import load_average, run_meta, running_server, spread, write_results
from benchmark.kunserve.pipeline import server_args

PROMPT_TOKENS = 128
NEW_TOKENS = 256  # outlive both transitions even when a replica admits its requests late
SETTLE_S = 1.0  # merged before the restore: a few pipelined steps run in between


def prompt(seed: int) -> list[int]:
    """Deterministic token ids (a timing run: the text does not matter, its length does)."""
    return [(seed * 89 + i * 37) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def generate(url: str, replica: int, seed: int) -> int:
    r = httpx.post(f"{url}/generate", timeout=900, json={
        "input_ids": prompt(seed), "routed_dp_rank": replica, "sampling_params": {
            "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["meta_info"]["completion_tokens"]


def status(url: str) -> dict:
    r = httpx.get(f"{url}/kunserve/status", timeout=600)
    r.raise_for_status()
    return r.json()


def post(url: str, action: str) -> None:
    r = httpx.post(f"{url}/kunserve/{action}", timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{action}: {r.status_code} {r.text}")


def one_round(url: str, replicas: int, streams: int, seed: int) -> list[dict]:
    """A drop and a restore while ``streams`` requests per replica run: each replica's records
    of both."""
    jobs = [(r, seed + 100 * r + i) for r in range(replicas) for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(generate, url, *job) for job in jobs]
        deadline = time.monotonic() + 600
        while (running := [rep["load"]["running_reqs"]
                           for rep in status(url)["replicas"]]) != [streams] * replicas:
            if time.monotonic() > deadline or any(f.done() for f in futures):
                done = [f.exception() or f.result() for f in futures if f.done()]
                raise RuntimeError(f"the requests did not all run at once (running per "
                                   f"replica: {running}; finished: {done}); lower --streams")
            time.sleep(0.05)
        post(url, "drop")
        time.sleep(SETTLE_S)
        post(url, "restore")
        tokens = [f.result() for f in futures]
    if tokens != [NEW_TOKENS] * len(jobs):
        raise RuntimeError(f"a request lost tokens across the transitions: {tokens}")
    return [{"replica": rep["replica"], "drop": rep["transitions"][-2],
             "restore": rep["transitions"][-1]} for rep in status(url)["replicas"]]


def summarize(rounds: list[list[dict]]) -> dict:
    """Per action and step: the median, min and max of every replica's seconds over the rounds;
    ``pause_s``: per round, the slowest replica's ``duration_s`` (the group's pause)."""
    out = {}
    for action in ("drop", "restore"):
        records = [rep[action] for one in rounds for rep in one]
        steps = list(records[0]["step_seconds"])
        out[action] = {
            "steps_s": {step: spread([r["step_seconds"][step] for r in records])
                        for step in steps},
            "pause_s": spread([max(rep[action]["duration_s"] for rep in one)
                                for one in rounds]),
            "kv_moved_bytes": spread([r["kv_moved_bytes"] for r in records]),
            "requests_in_flight": spread([r["requests_in_flight"] for r in records])}
    return out


def markdown(result: dict) -> str:
    meta, settings = result["meta"], result["settings"]
    lines = [
        "# KunServe transitions: where a drop's and a restore's time goes", "",
        f"commit {meta['git']['commit']} (dirty: {meta['git']['dirty']}), "
        f"{meta['machine'].get('cpu_model')}, {meta['machine'].get('cpu_cores')} cores, load "
        f"{meta['load_before']} -> {meta['load_after']}; `{meta['command']}`; server "
        f"`{' '.join(settings['server_args'])}`, one thread per replica; "
        f"{settings['streams_per_replica']} requests per replica of {PROMPT_TOKENS} prompt + "
        f"{NEW_TOKENS} new tokens running at each transition; {settings['rounds']} rounds.", "",
        "Milliseconds, median (min-max) over rounds x replicas; the pause is per round, the "
        "slowest replica's time after the vote (the group serves nothing meanwhile).", ""]
    for action, s in result["summary"].items():
        lines += [f"## {action}", "", "| step | ms |", "|---|---:|"]
        for step, v in s["steps_s"].items():
            lines.append(f"| {step} | {_cell(v, 1000.0, 1)} |")
        lines += [f"| **pause** | **{_cell(s['pause_s'], 1000.0, 1)}** |", "",
                  f"KV moved per replica: {_cell(s['kv_moved_bytes'], 1e-6, 2)} MB; requests "
                  f"in flight per replica: {_cell(s['requests_in_flight'], 1.0, 0)}.", ""]
    return "\n".join(lines)


def _cell(v: dict, scale: float, digits: int) -> str:
    return (f"{v['median'] * scale:.{digits}f} ({v['min'] * scale:.{digits}f}-"
            f"{v['max'] * scale:.{digits}f})")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.transition_steps",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    ap.add_argument("--group-size", type=int, default=2,
                    help="replicas in the group, all of the server's (default 2: a pair; "
                    "the server is the pipeline benchmark's)")
    ap.add_argument("--rounds", type=int, default=5, help="drop-restore rounds (default 5)")
    ap.add_argument("--streams", type=int, default=2,
                    help="requests per replica running at each transition (default 2)")
    args = ap.parse_args()
    if args.group_size < 2 or args.rounds < 1 or args.streams < 1:
        ap.error("--group-size must be at least 2, --rounds and --streams at least 1")
    launch = server_args(args.group_size)
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        with running_server(launch, Path(tmp) / "server.log", {"OMP_NUM_THREADS": "1"}) as srv:
            rounds = [one_round(srv.url, args.group_size, args.streams, 1000 * k)
                      for k in range(args.rounds)]
    result = {
        "summary": summarize(rounds), "rounds": rounds,
        "settings": {"server_args": list(launch), "prompt_tokens": PROMPT_TOKENS,
                     "new_tokens": NEW_TOKENS, "streams_per_replica": args.streams,
                     "rounds": args.rounds, "settle_s": SETTLE_S},
        "meta": run_meta("python -m benchmark.kunserve.transition_steps "
                         + " ".join(sys.argv[1:]), load_before)}
    write_results(args.out, "transition_steps", result, markdown(result))


if __name__ == "__main__":
    main()
