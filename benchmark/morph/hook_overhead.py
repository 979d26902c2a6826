"""Cost of the morph per-step hook, idle and under load, as a share of the scheduler's time.

Starts one morph server (controller on, default mode) WITHOUT ``--sleep-on-idle``, so the
scheduler loop never sleeps and every iteration calls the hook, and reads the hook's own time
counters (``hook_calls_total``, ``hook_seconds_total`` in ``/morph/status``) around two windows:

- idle: nothing to serve; the loop spins as fast as it can, so hook seconds / wall seconds is
  the hook's share of an idle loop (an O(1) rate check on almost every call);
- loaded: ``--concurrency`` closed-loop clients keep sending greedy requests (``ignore_eos``)
  to a scheduler that runs at most ``--max-running-requests`` of them, so a queue waits the
  whole window and every sample (at most one per 20 ms) walks the waiting and running
  requests. The loop is busy with forward passes the whole window, so hook seconds / wall
  seconds is the share of serving time the hook takes.

No transition may happen inside a window (the pool is large: nothing is under pressure); the
results say how many did.

    .venv/bin/python -m benchmark.morph.hook_overhead [--window-s 30] [--concurrency 24]
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmark.harness import build_engines, git_state, load_average, machine_info, running_server
from sglang_morph.repo_data import REPO_ROOT

RESULTS = REPO_ROOT / "benchmark" / "results"


def status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/morph/status", timeout=60).json()


def window(url: str, seconds: float) -> dict[str, Any]:
    a = status(url)
    t0 = time.monotonic()
    time.sleep(seconds)
    b = status(url)
    wall_s = time.monotonic() - t0
    calls = b["hook_calls_total"] - a["hook_calls_total"]
    hook_s = b["hook_seconds_total"] - a["hook_seconds_total"]
    return {
        "window_s": wall_s,
        "loop_iterations": calls,
        "loop_iteration_us": 1e6 * wall_s / max(calls, 1),
        "hook_us_per_call": 1e6 * hook_s / max(calls, 1),
        "hook_seconds": hook_s,
        "overhead_percent": 100.0 * hook_s / wall_s,
        "transitions_in_window": b["transitions_total"] - a["transitions_total"],
        "waiting_at_end": (b["signals"] or {}).get("num_waiting_reqs"),
        "running_at_end": (b["signals"] or {}).get("num_running_reqs"),
    }


class Load:
    """Closed-loop clients: each sends a request, waits for it, sends the next, until stopped."""

    def __init__(self, url: str, concurrency: int, prompt_tokens: int, output_tokens: int):
        self.url, self.prompt_tokens, self.output_tokens = url, prompt_tokens, output_tokens
        self.stop = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(seed,), daemon=True)
                         for seed in range(concurrency)]

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                # Random ids: no two prompts share a cached prefix, so every one is prefilled.
                ids = [rng.randrange(100, 20_000) for _ in range(self.prompt_tokens)]
                r = client.post(f"{self.url}/generate", json={
                    "input_ids": ids, "sampling_params": {
                        "temperature": 0, "max_new_tokens": self.output_tokens,
                        "ignore_eos": True}})
                with self._lock:
                    if r.status_code == 200:
                        self.completed += 1
                    else:
                        self.errors.append(f"{r.status_code}: {r.text[:200]}")

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.morph.hook_overhead",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="load before the loaded window starts (the queue fills)")
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--max-running-requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--engines", default=None, help="engines dir (default: build/reuse AWQ 8,4)")
    ap.add_argument("--out", type=Path, default=RESULTS / "hook_overhead.json")
    args = ap.parse_args()
    engines = args.engines or str(build_engines("--bits", "8,4"))
    server_args = ("--enable-morph", "--morph-engines", engines, "--morph-mode", "default",
                   "--max-running-requests", str(args.max_running_requests))
    load_at_start = load_average()
    # serve.sh: keep SGLang's busy idle loop, so every loop iteration calls the hook.
    with running_server(server_args, RESULTS / "raw" / "hook_overhead.server.log",
                        env={"SGLANG_MORPH_SLEEP_ON_IDLE": "0"}) as server:
        time.sleep(5.0)
        idle = window(server.url, args.window_s)
        with Load(server.url, args.concurrency, args.prompt_tokens, args.output_tokens) as load:
            time.sleep(args.warmup_s)
            completed_before = load.completed
            loaded = window(server.url, args.window_s)
            loaded["requests_completed"] = load.completed - completed_before
        if load.errors:
            raise RuntimeError(f"{len(load.errors)} requests failed, e.g. {load.errors[0]}")
    result = {
        "benchmark": "hook_overhead",
        "git": git_state(),
        "machine": machine_info(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_average(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"server_args": list(server_args)},
        "idle": idle,
        "loaded": loaded,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"idle": idle, "loaded": loaded}, indent=1))


if __name__ == "__main__":
    main()
