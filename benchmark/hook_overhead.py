"""Idle overhead of the morph per-step hook, as a share of the scheduler loop's time.

Starts a morph server WITHOUT ``--sleep-on-idle`` (so the idle scheduler spins through its loop
as fast as it can and every iteration calls the hook), waits, and reads the hook's own time
counters from ``/morph/status`` over an idle window: overhead = hook seconds / wall seconds
(the spinning loop is the whole of that wall time).

    .venv/bin/python -m benchmark.hook_overhead [--window-s 20]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import requests

from benchmark._server import ServerLaunch, running_server
from benchmark.engines_quality import build_engines
from benchmark.throughput import git_state, machine_info

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--engines", default=None, help="engines dir (default: build/reuse AWQ 8,4)")
    args = ap.parse_args()
    engines = args.engines or str(build_engines("--bits", "8,4"))
    os.environ["SGLANG_MORPH_SLEEP_ON_IDLE"] = "0"  # serve.sh: keep SGLang's busy idle loop
    launch = ServerLaunch(("--enable-morph", "--morph-engines", engines),
                          RESULTS / "raw" / "hook_overhead.server.log")
    with running_server(launch) as url:
        time.sleep(5.0)
        a = requests.get(f"{url}/morph/status", timeout=60).json()
        t0 = time.monotonic()
        time.sleep(args.window_s)
        b = requests.get(f"{url}/morph/status", timeout=60).json()
        wall_s = time.monotonic() - t0
    calls = b["hook_calls_total"] - a["hook_calls_total"]
    hook_s = b["hook_seconds_total"] - a["hook_seconds_total"]
    result = {
        **git_state(),
        "machine": machine_info(),
        "window_s": wall_s,
        "loop_iterations": calls,
        "loop_iteration_us": 1e6 * wall_s / max(calls, 1),
        "hook_us_per_call": 1e6 * hook_s / max(calls, 1),
        "idle_overhead_percent": 100.0 * hook_s / wall_s,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hook_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
