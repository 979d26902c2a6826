"""Per-step prefill and decode time of multi-rank SGLang on this CPU (TP, PP, DP).

    python -m benchmark.parallel.timings [--configs tp1,tp3,pp2,pp3,dp2] [--prompt-tokens 128]
        [--decode-tokens 32] [--repetitions 3] [--dtype bfloat16]
        [--out benchmark/results/parallel/parallel.json]
    python -m benchmark.parallel.timings --transitions [--configs tp1,tp3] [--swap-layers 8]
        [--out benchmark/results/parallel/transitions.json]

One server at a time (``scripts/serve.sh`` with the config's flags, default model, the
``SGLANG_CPU_OMP_THREADS_BIND`` serve.sh chooses), stopped before the next starts. Per config
and repetition, with SGLang's radix cache flushed before every request (no prompt token is
served from cache):

- prefill: one ``/generate`` of P fresh WikiText-2 prompt tokens and ``max_new_tokens=1``;
  wall time from sending to the answer (HTTP and tokenizer included, as a user sees it).
- decode, batch 1 and 2: one streamed ``/generate`` of B prompts and D new tokens each
  (``ignore_eos``); per-step time = the median gap between a sequence's successive tokens
  (under DP 2 the two sequences go to the two replicas).

With ``--transitions`` it measures layer swaps instead, per config (``tp1``, ``tp3``, ``pp2``):
a morph server (controller off, no memory budget: weights plus the 8192-token pool), the first
``--swap-layers`` layers of the LIS order to W4 and back, ``--repetitions`` times, idle between
requests. Per transition: the server's ``duration_s`` (TP rank 0's or, under PP, the last
stage's own apply) and the ``POST /morph/swap`` round trip as the operator sees it (every rank
or stage applied, and their outcomes compared, before the answer); KV capacity before, swapped
and restored, and whether greedy output after the restore equals the output before.

Reported: the median over repetitions (all runs in the JSON), and each config relative to
``tp1`` (= PP 1 = DP 1). On 2 cores several ranks share the cores, so parallelism is expected
to be slower here: what the numbers show is the cost of the collectives and the extra
processes, not a speed-up. The load average is recorded at start and end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmark.harness import (REPO_ROOT, build_engines, git_state, load_average,
                               machine_info, running_server)
from benchmark.morph.transition import SWAP_ORDER, greedy
from sglang_morph.models import default_model_path
from sglang_morph.repo_data import WIKITEXT2_TEST

CONFIGS: dict[str, tuple[str, ...]] = {
    "tp1": (),
    "tp3": ("--tp-size", "3"),
    "pp2": ("--pp-size", "2"),
    "pp3": ("--pp-size", "3"),
    "dp2": ("--dp-size", "2"),
}
MORPH_CONFIGS = ("tp1", "tp3", "pp2")  # DP swaps are one replica's: tp1's, per replica
OUT_DEFAULT = REPO_ROOT / "benchmark" / "results" / "parallel" / "parallel.json"
TRANSITIONS_OUT_DEFAULT = OUT_DEFAULT.with_name("transitions.json")
RAW_DIR = REPO_ROOT / "benchmark" / "results" / "raw"
FLUSH_TIMEOUT_S = 30.0


class Prompts:
    """Consecutive, non-overlapping windows of WikiText-2 test token ids: every request of a
    run gets fresh ones."""

    def __init__(self, prompt_tokens: int):
        tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
        self.ids = tokenizer(WIKITEXT2_TEST.read_text())["input_ids"]
        self.prompt_tokens = prompt_tokens
        self.next_window = 0

    def take(self) -> list[int]:
        start = self.next_window * self.prompt_tokens
        if start + self.prompt_tokens > len(self.ids):
            raise ValueError("WikiText-2 test ran out of fresh prompt windows")
        self.next_window += 1
        return self.ids[start:start + self.prompt_tokens]


def _flush(client: httpx.Client, url: str) -> None:
    client.post(f"{url}/flush_cache", params={"timeout": FLUSH_TIMEOUT_S}).raise_for_status()


def prefill_s(client: httpx.Client, url: str, ids: list[int]) -> float:
    _flush(client, url)
    t0 = time.perf_counter()
    r = client.post(f"{url}/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
    r.raise_for_status()
    return time.perf_counter() - t0


def decode_step_s(client: httpx.Client, url: str, prompts: Prompts, batch: int,
                  new_tokens: int) -> float:
    """Median time per decode step, over the steps of ``batch`` sequences streamed by one
    ``/generate`` call (one call, so the scheduler sees them together; SGLang's tokenizer
    manager still dispatches them one by one, round robin over DP replicas). A step's time is
    the gap between two chunks of a sequence divided by the tokens the later one added; the
    first token (prefill) and a step that waited for another sequence's prefill do not move
    the median."""
    _flush(client, url)
    payload = {"input_ids": [prompts.take() for _ in range(batch)], "stream": True,
               "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                   "ignore_eos": True}}
    last: dict[int, tuple[float, int]] = {}
    steps: list[float] = []
    with client.stream("POST", f"{url}/generate", json=payload) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[5:])
            index, tokens = chunk.get("index", 0), chunk["meta_info"]["completion_tokens"]
            if index in last and tokens > last[index][1]:
                steps.append((now - last[index][0]) / (tokens - last[index][1]))
            last[index] = (now, tokens)
    produced = sorted(tokens for _, tokens in last.values())
    if produced != [new_tokens] * batch:
        raise RuntimeError(f"expected {batch} x {new_tokens} tokens, the stream carried "
                           f"{produced}")
    return statistics.median(steps)


def measure(name: str, args: argparse.Namespace, prompts: Prompts) -> dict:
    flags = ["--dtype", args.dtype, "--max-total-tokens", "8192", *CONFIGS[name]]
    runs: dict[str, list[float]] = {"prefill_s": [], "decode_step_s_b1": [],
                                    "decode_step_s_b2": []}
    with running_server(flags, RAW_DIR / f"parallel_{name}_server.log") as server, \
            httpx.Client(timeout=600) as client:
        # Untimed warm-up: first-call setup of each shape.
        prefill_s(client, server.url, prompts.take())
        decode_step_s(client, server.url, prompts, 2, 4)
        for _ in range(args.repetitions):
            runs["prefill_s"].append(prefill_s(client, server.url, prompts.take()))
            runs["decode_step_s_b1"].append(
                decode_step_s(client, server.url, prompts, 1, args.decode_tokens))
            runs["decode_step_s_b2"].append(
                decode_step_s(client, server.url, prompts, 2, args.decode_tokens))
    return {"flags": flags, "runs": runs,
            "median": {k: statistics.median(v) for k, v in runs.items()}}


def _timed_swap(client: httpx.Client, url: str, layers: list[int], bits: int) -> dict:
    t0 = time.perf_counter()
    r = client.post(f"{url}/morph/swap", json={"layers": layers, "bits": bits})
    wall_s = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"swap {layers} -> {bits} bits: {r.status_code} {r.text}")
    body = r.json()
    return {"round_trip_s": wall_s, "server_s": body["transitions"][-1]["duration_s"],
            "action": body["transitions"][-1]["action"],
            "kv_capacity_tokens": body["kv_capacity_tokens"]}


def measure_transitions(name: str, args: argparse.Namespace, engines: Path,
                        layers: list[int]) -> dict:
    flags = ["--dtype", args.dtype, "--max-total-tokens", "8192", *CONFIGS[name],
             "--enable-morph", "--morph-engines", str(engines), "--disable-morph-controller"]
    rounds = []
    with running_server(flags, RAW_DIR / f"parallel_{name}_morph_server.log") as server, \
            httpx.Client(timeout=600) as client:
        start = client.get(f"{server.url}/morph/status").json()["kv_capacity_tokens"]
        reference = greedy(server.url, 16)
        # Untimed warm-up: the first swap pays first-call setup of the W4 kernels' shapes.
        _timed_swap(client, server.url, layers, 4)
        _timed_swap(client, server.url, layers, 16)
        for _ in range(args.repetitions):
            swap = _timed_swap(client, server.url, layers, 4)
            time.sleep(1.0)
            restore = _timed_swap(client, server.url, layers, 16)
            if (swap["action"], restore["action"]) != ("swap", "restore"):
                raise RuntimeError(f"{name}: expected a swap and a restore, got "
                                   f"{swap['action']}, {restore['action']}")
            rounds.append({"swap": swap, "restore": restore,
                           "greedy_after_restore_equals_before":
                               greedy(server.url, 16) == reference})
    median = {f"{kind}_{clock}": statistics.median(r[kind][clock] for r in rounds)
              for kind in ("swap", "restore") for clock in ("server_s", "round_trip_s")}
    return {"flags": flags, "kv_capacity_tokens_at_start": start,
            "kv_capacity_tokens_swapped": rounds[-1]["swap"]["kv_capacity_tokens"],
            "kv_capacity_tokens_restored": rounds[-1]["restore"]["kv_capacity_tokens"],
            "rounds": rounds, "median": median}


def render_transitions_markdown(result: dict) -> str:
    rows = result["results"]
    base = rows.get("tp1", {}).get("median")
    lines = ["| config | swap s (server) | swap s (round trip) | x tp1 | restore s (server) | "
             "restore s (round trip) | x tp1 | KV tokens start / swapped / restored | "
             "greedy equal after restore |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, row in rows.items():
        m = row["median"]
        ratio = {k: (f"{m[k] / base[k]:.2f}" if base else "-")
                 for k in ("swap_round_trip_s", "restore_round_trip_s")}
        same = all(r["greedy_after_restore_equals_before"] for r in row["rounds"])
        lines.append(
            f"| {name} | {m['swap_server_s']:.3f} | {m['swap_round_trip_s']:.3f} | "
            f"{ratio['swap_round_trip_s']} | {m['restore_server_s']:.3f} | "
            f"{m['restore_round_trip_s']:.3f} | {ratio['restore_round_trip_s']} | "
            f"{row['kv_capacity_tokens_at_start']} / {row['kv_capacity_tokens_swapped']} / "
            f"{row['kv_capacity_tokens_restored']} | {'yes' if same else 'NO'} |")
    s = result["settings"]
    return _with_header(f"{s['swap_layers']} layers of the LIS order to W4 and back, "
                        f"{s['dtype']}, idle server", result, lines)


def _with_header(what: str, result: dict, lines: list[str]) -> str:
    """The table under one line saying what ran, on which commit, at which load."""
    header = (f"{what}, median of {result['settings']['repetitions']}; commit "
              f"{result['git']['commit']}{' (dirty tree)' if result['git']['dirty'] else ''}; "
              f"load average {result['load_average_start']} at start, "
              f"{result['load_average_end']} at end.")
    return header + "\n\n" + "\n".join(lines) + "\n"


def render_markdown(result: dict) -> str:
    rows = result["results"]
    base = rows.get("tp1", {}).get("median")
    lines = [
        "| config | prefill s (P tokens) | x tp1 | decode step s, B=1 | x tp1 | "
        "decode step s, B=2 | x tp1 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        cells = [name]
        for key in ("prefill_s", "decode_step_s_b1", "decode_step_s_b2"):
            value = row["median"][key]
            cells += [f"{value:.4f}", f"{value / base[key]:.2f}" if base else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    s = result["settings"]
    return _with_header(f"P = {s['prompt_tokens']} prompt tokens, D = {s['decode_tokens']} new "
                        f"tokens, {s['dtype']}", result, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.parallel.timings",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--transitions", action="store_true",
                        help="measure layer swaps and restores (configs tp1, tp3, pp2)")
    parser.add_argument("--swap-layers", type=int, default=8)
    parser.add_argument("--engines", type=Path, help="engines dir (default: build/reuse 8,4)")
    args = parser.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    allowed = MORPH_CONFIGS if args.transitions else tuple(CONFIGS)
    if args.transitions and args.configs == parser.get_default("configs"):
        names = list(MORPH_CONFIGS)
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(allowed)}")
    if args.prompt_tokens < 1 or args.decode_tokens < 2 or args.repetitions < 1:
        parser.error("need --prompt-tokens >= 1, --decode-tokens >= 2, --repetitions >= 1")
    order = json.loads(SWAP_ORDER.read_text())["order"]
    if not 1 <= args.swap_layers <= len(order):
        parser.error(f"--swap-layers must be in 1..{len(order)}")

    result = {
        "command": " ".join(["python -m benchmark.parallel.timings", *(argv or sys.argv[1:])]),
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_state(), "machine": machine_info(),
        "load_average_start": load_average(),
        "settings": {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "repetitions": args.repetitions, "dtype": args.dtype},
        "results": {},
    }
    if args.transitions:
        engines = args.engines or build_engines("--bits", "8,4")
        layers = order[: args.swap_layers]
        result["settings"] = {"swap_layers": args.swap_layers, "layers": layers,
                              "repetitions": args.repetitions, "dtype": args.dtype,
                              "engines": str(engines)}
    else:
        prompts = Prompts(args.prompt_tokens)
    for name in names:
        print(f"[parallel] {name} ...", file=sys.stderr, flush=True)
        result["results"][name] = (measure_transitions(name, args, engines, layers)
                                   if args.transitions else measure(name, args, prompts))
    result["load_average_end"] = load_average()
    out = args.out or (TRANSITIONS_OUT_DEFAULT if args.transitions else OUT_DEFAULT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = (render_transitions_markdown if args.transitions else render_markdown)(result)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
