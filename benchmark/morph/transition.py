"""One swap and one restore through ``POST /morph/swap`` on an idle server: what they cost and
what KV capacity they buy, plus the decoder-linear bytes of every precision.

Starts one morph server (controller off, so nothing moves but what this script asks), swaps the
first ``--layers`` layers of the LIS order to ``--bits`` and restores them, ``--repetitions``
times, and records from ``/morph/status`` and the transitions: KV capacity before / after,
freed bytes, moved and evicted KV tokens, durations, and whether greedy output after the restore
equals the output before any swap. The decoder-linear bytes come from the server's startup log
line for all-full-precision layers and from the engines manifest for each variant (stored bytes;
the CPU kernel layout of W4 is a little larger, see the log line of a W4 server).

    .venv/bin/python -m benchmark.morph.transition [--dtype float32] [--budget 650MB]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import httpx

from benchmark.harness import build_engines, git_state, load_average, machine_info, running_server
from sglang_morph.engines.manifest import EngineManifest
from sglang_morph.repo_data import REPO_ROOT

RESULTS = REPO_ROOT / "benchmark" / "results"
SWAP_ORDER = RESULTS / "swap_order.json"
LOG_LINE = re.compile(r"decoder linears (\d+) -> (\d+) bytes")
PROMPT_IDS = list(range(1000, 1064))  # fixed token ids; the output only has to be reproducible


def status(url: str) -> dict:
    r = httpx.get(f"{url}/morph/status", timeout=60)
    r.raise_for_status()
    return r.json()


def swap(url: str, layers: list[int], bits: int) -> dict:
    r = httpx.post(f"{url}/morph/swap", json={"layers": layers, "bits": bits}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"swap {layers} -> {bits} bits: {r.status_code} {r.text}")
    return r.json()


def greedy(url: str, n_new: int = 32) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["output_ids"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.morph.transition",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget", default="650MB", help="--morph-memory-budget")
    ap.add_argument("--layers", type=int, default=8, help="first N layers of the LIS order")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--engines", type=Path, help="engines dir (default: build/reuse AWQ 8,4)")
    ap.add_argument("--out", type=Path, default=RESULTS / "morph_transition.json")
    args = ap.parse_args()
    engines = args.engines or build_engines("--bits", "8,4")
    order = json.loads(SWAP_ORDER.read_text())["order"][: args.layers]
    server_args = ("--enable-morph", "--morph-engines", str(engines), "--dtype", args.dtype,
                   "--morph-memory-budget", args.budget, "--disable-morph-controller")
    load_at_start = load_average()
    log_path = RESULTS / "raw" / "morph_transition.server.log"
    rounds = []
    with running_server(server_args, log_path) as server:
        start = status(server.url)
        reference = greedy(server.url)
        for _ in range(args.repetitions):
            before = status(server.url)["kv_capacity_tokens"]
            swapped = swap(server.url, order, args.bits)
            time.sleep(1.0)
            restored = swap(server.url, order, 16)
            rounds.append({
                "kv_capacity_tokens_before": before,
                "kv_capacity_tokens_swapped": swapped["kv_capacity_tokens"],
                "kv_capacity_tokens_restored": restored["kv_capacity_tokens"],
                "swap": swapped["transitions"][-1],
                "restore": restored["transitions"][-1],
                "greedy_after_restore_equals_before": greedy(server.url) == reference,
            })
        linears = LOG_LINE.search(server.log_text())
    manifest = EngineManifest.load(engines)
    per_layer = {str(bits): manifest.variant(0, bits).device_bytes
                 for bits in sorted({16, *manifest.bits_available})}
    result = {
        "benchmark": "morph_transition",
        "git": git_state(),
        "machine": machine_info(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_average(),
        "settings": {"server_args": list(server_args), "layers": order, "bits": args.bits,
                     "repetitions": args.repetitions, "engines": str(engines)},
        "decoder_linear_bytes_served": int(linears.group(2)) if linears else None,
        "decoder_layer_stored_bytes_by_bits": per_layer,
        "kv_bytes_per_token": start["kv_bytes_per_token"],
        "memory_budget_bytes": start["memory_budget_bytes"],
        "kv_capacity_tokens_at_start": start["kv_capacity_tokens"],
        # Every built variant is read, checked and kept in host memory at startup.
        "staged_variants_host_bytes": start["staged_variants_host_bytes"],
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: result[k] for k in ("decoder_linear_bytes_served", "kv_bytes_per_token",
                                      "kv_capacity_tokens_at_start",
                                      "staged_variants_host_bytes")}
    summary["rounds"] = [
        {"kv": [r["kv_capacity_tokens_before"], r["kv_capacity_tokens_swapped"],
                r["kv_capacity_tokens_restored"]],
         "freed_bytes": r["swap"]["freed_bytes"], "swap_s": r["swap"]["duration_s"],
         "restore_s": r["restore"]["duration_s"],
         "same_output": r["greedy_after_restore_equals_before"]} for r in rounds]
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
