"""What the benchmarks and the tests share: SGLang servers, built engines, run records.

- ``ServerProcess`` / ``start_server`` / ``running_server``: one ``scripts/serve.sh`` server
  (``sglang_morph.server.process``).
- ``build_engines(*flags)``: ``python -m sglang_morph.morph.build_engines`` into its default cache
  directory, which it reuses when model, recipe and calibration text are unchanged.
- ``git_state()``, ``machine_info()``, ``load_average()``: what every results file records.
- ``behind_the_client(server)``: a load generator on the server's machine keeps its cores.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

from sglang_morph.server.process import (  # noqa: F401  (the benchmarks' and tests' servers)
    ServerProcess,
    free_port,
    running_server,
    start_server,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# How much lower than the load generator a server under test runs (nice). A replay client
# sharing two cores with the servers was measured runnable but not scheduled for up to 1.3 s
# at a time (its own ``/proc`` schedstat: 99% of its stalls waiting for a core), sending late
# and reading chunks late; production clients do not share the server's cores.
SERVER_NICE = 5


def behind_the_client(server: ServerProcess, nice: int = SERVER_NICE) -> None:
    """Run every thread of ``server``'s processes (its process group) ``nice`` lower, and its
    session's scheduling group too where the kernel groups sessions (autogroup), so that a
    client on the same cores is scheduled as soon as it is runnable. Raising a nice value
    needs no privilege; nothing else about the server changes."""
    os.setpriority(os.PRIO_PGRP, server.proc.pid, nice)
    try:  # with autogroup, sessions compete as groups: the server's session is its own
        Path(f"/proc/{server.proc.pid}/autogroup").write_text(str(nice))
    except OSError:
        pass  # no autogroup (or the leader has exited): the threads' nice is what counts


def build_engines(*flags: str, timeout_s: float = 1800.0) -> Path:
    """Engines for the default model in the builder's default cache directory (reused when
    model, recipe and calibration are unchanged); returns that directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_morph.morph.build_engines", *flags],
        capture_output=True, text=True, timeout=timeout_s,
        # One thread: the search's many small matmuls lose more to thread hand-offs than they
        # gain on 2 cores, and idle servers still hold a little CPU.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"build_engines {' '.join(flags)} failed with {proc.returncode}:\n"
                           f"{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def git_state() -> dict:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=all").stdout.splitlines()
    return {
        "commit": head.stdout.strip() if head.returncode == 0 else None,  # None: no commit yet
        # Results (what runs write under benchmark/results, new or rewritten) are not code.
        "dirty": any(not line[3:].startswith("benchmark/results/")
                     for line in changed if line.strip()),
    }


def machine_info() -> dict:
    import torch  # only for its thread count; keeps this module light for the tests

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu_model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            name: importlib.metadata.version(name)
            for name in ("torch", "sglang", "transformers", "sglang-morph")
        },
    }


def run_meta(command: str, load_before: list[float], **extra) -> dict:
    """What a results file records of its run: the command, commit, machine, load before and
    after, and ``uptime``'s line (``extra`` fields go in beside them)."""
    return {"command": command, "git": git_state(), "machine": machine_info(), **extra,
            "load_before": load_before, "load_after": load_average(),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def spread(values) -> dict:
    """Median, min and max of the values that are not None, and how many there were (None
    each when there are none): the spread of a figure over rounds."""
    import statistics

    got = [v for v in values if v is not None]
    return {"median": statistics.median(got) if got else None, "min": min(got, default=None),
            "max": max(got, default=None), "n": len(got)}


def arm_rounds(name: str, doc: str | None, arms: list[str], run_arm, summarize, markdown,
               settings: dict) -> None:
    """``python -m benchmark.kunserve.<name> [--rounds N] [--out DIR]``: N rounds (at least
    1), each running every arm once (``run_arm(arm, seed0)``, one server each) in an order
    that rotates round by round, so that a drift of the machine's speed falls on every arm;
    then ``<name>.json`` and ``<name>.md`` (``summarize(runs)``, ``markdown(result)``) in
    DIR."""
    import argparse
    import json

    command = f"python -m benchmark.kunserve.{name}"
    ap = argparse.ArgumentParser(prog=command, description=(doc or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(f"benchmark/results/kunserve/{name}"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    load_before = load_average()
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
            runs.append({**run_arm(arm, seed0=1000 * len(runs)), "round": rnd + 1})
            print(json.dumps({"round": rnd + 1, "arm": arm}), flush=True)
    result = {"runs": runs, "summary": summarize(runs),
              "settings": {**settings, "rounds": args.rounds},
              "meta": run_meta(f"{command} --rounds {args.rounds}", load_before)}
    write_results(args.out, name, result, markdown(result))


def write_results(out_dir: Path, name: str, report: dict, markdown_text: str) -> None:
    """``<name>.json`` (the whole report) and ``<name>.md`` in ``out_dir``; the markdown is
    printed too."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{name}.md").write_text(markdown_text)
    print(markdown_text)


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages: other work on the machine skews timings."""
    return list(os.getloadavg())
