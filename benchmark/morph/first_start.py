"""``--enable-morph`` alone, from an empty cache: the first start (the variants and the layer
order built), a burst that makes the controller swap layers and grow the KV pool, the restore
once it is quiet, and a second start that reuses the cache.

    .venv/bin/python -m benchmark.morph.first_start [--burst 24] [--quiet-wait-s 120]

The server is the README's first MorphServe example: ``scripts/serve.sh --enable-morph
--max-total-tokens 2048`` (the default model, its default dtype). The morph cache is a new
directory (the converted models are linked in, so only the variants are built); the burst is
``--burst`` requests at once of about 700 tokens of the repo's text each, 32 new tokens;
``/morph/status`` is sampled every 0.5 s from the burst until every layer is back at full
precision and the pool at its start size, or ``--quiet-wait-s`` passed. Results:
``benchmark/results/morph/first_start.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmark.harness import REPO_ROOT, load_average, run_meta, running_server, write_results

ARGS = ("--enable-morph", "--max-total-tokens", "2048")
OUT_DIR = REPO_ROOT / "benchmark" / "results" / "morph"
RAW_DIR = REPO_ROOT / "benchmark" / "results" / "raw" / "morph_first_start"
START_TIMEOUT_S = 1800.0  # the first start builds every variant on two cores
PROMPT_CHARS = 3000  # about 700 tokens of the repo's text
NEW_TOKENS = 32
FULL_PRECISION_BITS = 16


def morph_status(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/morph/status", timeout=60)
    r.raise_for_status()
    return r.json()


def sample(s: dict[str, Any], t0: float) -> dict[str, Any]:
    bits = [layer["bits"] for layer in s["layers"]]
    return {"t_s": round(time.time() - t0, 2), "kv_capacity_tokens": s["kv_capacity_tokens"],
            "kv_used_tokens": s.get("kv_used_tokens"),
            "quantized_layers": sum(b != FULL_PRECISION_BITS for b in bits),
            "bits": {str(b): bits.count(b) for b in sorted(set(bits))}}


def burst(url: str, requests: int) -> list[int]:
    text = (REPO_ROOT / "data" / "text" / "wikitext2_test.txt").read_text()

    def one(i: int) -> int:
        r = httpx.post(f"{url}/generate", timeout=1200, json={
            "text": text[i * PROMPT_CHARS:(i + 1) * PROMPT_CHARS],
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}})
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        return list(pool.map(one, range(requests)))


def first_run(cache: Path, requests: int, quiet_wait_s: float) -> dict[str, Any]:
    env = {"SGLANG_MORPH_CACHE_DIR": str(cache)}
    out: dict[str, Any] = {}
    t0 = time.time()
    with running_server(ARGS, RAW_DIR / "first_server.log", env=env,
                        start_timeout_s=START_TIMEOUT_S) as server:
        out["healthy_after_s"] = time.time() - t0
        s = morph_status(server.url)
        out["at_start"] = {"available_bits": s.get("available_bits"),
                           "controller": s.get("controller"),
                           "kv_capacity_tokens": s["kv_capacity_tokens"]}
        samples: list[dict[str, Any]] = []
        done = threading.Event()
        t_burst = time.time()

        def poll() -> None:
            while not done.is_set():
                samples.append(sample(morph_status(server.url), t_burst))
                time.sleep(0.5)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        codes = burst(server.url, requests)
        out["burst"] = {"requests": requests, "status_codes": sorted(set(codes)),
                        "served_s": time.time() - t_burst}
        start_capacity = out["at_start"]["kv_capacity_tokens"]
        while time.time() - t_burst < out["burst"]["served_s"] + quiet_wait_s:
            last = samples[-1] if samples else None
            if last and last["quantized_layers"] == 0 and \
                    last["kv_capacity_tokens"] == start_capacity and len(samples) > 4:
                break
            time.sleep(0.5)
        done.set()
        poller.join()
        out["samples"] = samples
        out["most_quantized_layers"] = max(x["quantized_layers"] for x in samples)
        out["largest_kv_capacity_tokens"] = max(x["kv_capacity_tokens"] for x in samples)
        restored = [x for x in samples if x["quantized_layers"] == 0
                    and x["kv_capacity_tokens"] == start_capacity
                    and x["t_s"] > out["burst"]["served_s"]]
        out["restored_after_burst_s"] = (restored[0]["t_s"] - out["burst"]["served_s"]
                                         if restored else None)
    out["log_built"] = "built into" in (RAW_DIR / "first_server.log").read_text(errors="replace")
    return out


def second_run(cache: Path) -> dict[str, Any]:
    before = {p: p.stat().st_mtime for p in (cache / "morph").rglob("*") if p.is_file()}
    t0 = time.time()
    with running_server(ARGS, RAW_DIR / "second_server.log",
                        env={"SGLANG_MORPH_CACHE_DIR": str(cache)},
                        start_timeout_s=START_TIMEOUT_S) as server:
        healthy = time.time() - t0
        s = morph_status(server.url)
    after = {p: p.stat().st_mtime for p in (cache / "morph").rglob("*") if p.is_file()}
    return {"healthy_after_s": healthy, "available_bits": s.get("available_bits"),
            "controller": s.get("controller"), "cache_files_unchanged": before == after,
            "log_reused": "reused from" in (RAW_DIR / "second_server.log").read_text(
                errors="replace")}


def markdown(report: dict[str, Any]) -> str:
    meta, first, second = report["meta"], report["first"], report["second"]
    peak = max(first["samples"], key=lambda x: x["quantized_layers"])
    restored = first["restored_after_burst_s"]
    return "\n".join([
        "# `--enable-morph` alone, from an empty cache", "",
        f"Command: `{meta['command']}`; commit {meta['git']['commit']}"
        f"{' (dirty)' if meta['git']['dirty'] else ''}; {meta['machine']['cpu_model']}, "
        f"{meta['machine']['cpu_cores']} cores; load average before "
        f"{[round(x, 2) for x in meta['load_before']]}. One run, measured.", "",
        f"Server: `scripts/serve.sh {' '.join(ARGS)}` (the default model).", "",
        "| | first start (builds) | second start (cache) |", "|---|---:|---:|",
        f"| healthy after | {first['healthy_after_s']:.1f} s | {second['healthy_after_s']:.1f} s |",
        f"| bits available | {first['at_start']['available_bits']} | "
        f"{second['available_bits']} |",
        f"| controller on | {first['at_start']['controller']} | {second['controller']} |",
        f"| variants | built (log: {first['log_built']}) | reused (log: "
        f"{second['log_reused']}; cache files unchanged: {second['cache_files_unchanged']}) |",
        "",
        f"Burst: {first['burst']['requests']} requests at once of about 700 tokens, "
        f"{NEW_TOKENS} new tokens each; HTTP {first['burst']['status_codes']}; all answered "
        f"after {first['burst']['served_s']:.1f} s. The controller quantized up to "
        f"{first['most_quantized_layers']} layers (at {peak['t_s']} s: {peak['bits']}) and grew "
        f"the KV pool from {first['at_start']['kv_capacity_tokens']} to "
        f"{first['largest_kv_capacity_tokens']} tokens; "
        + (f"every layer was back at full precision and the pool at its start size "
           f"{restored:.1f} s after the burst." if restored is not None else
           "the restore was not complete within the wait."), ""])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.morph.first_start",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, default=24, help="requests sent at once")
    ap.add_argument("--quiet-wait-s", type=float, default=120.0,
                    help="how long to wait for the restore after the burst")
    args = ap.parse_args(argv)
    if args.burst < 1 or args.quiet_wait_s <= 0:
        ap.error("--burst must be at least 1 and --quiet-wait-s positive")
    from sglang_morph.models import cache_dir

    RAW_DIR.mkdir(parents=True, exist_ok=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="morph-first-start-") as tmp:
        cache = Path(tmp)
        (cache / "models").mkdir()
        for model in (cache_dir() / "models").iterdir():  # converted models: not rebuilt
            (cache / "models" / model.name).symlink_to(model)
        first = first_run(cache, args.burst, args.quiet_wait_s)
        second = second_run(cache)
    command = "python -m benchmark.morph.first_start " + " ".join(
        sys.argv[1:] if argv is None else argv)
    report = {"meta": run_meta(command.strip(), load_before), "first": first, "second": second}
    write_results(OUT_DIR, "first_start", report, markdown(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
