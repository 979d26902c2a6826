"""Static precision maps served by SGLang: perplexity and speed of FP, W8, W4 (AWQ and RTN).

    python -m benchmark.morph.engines_quality [--engines DIR] [--rtn-engines DIR] [--order FILE]
        [--batch-sizes 1,8] [--prompt-tokens 128] [--decode-tokens 64] [--repetitions 3]
        [--configs fp,w8,...] [--out benchmark/results/engines_quality.json]

For each configuration one server is started through ``scripts/serve.sh`` with
``--enable-morph --morph-engines DIR --morph-precision-map MAP`` (full precision: no morph flags),
then (1) WikiText-2 test perplexity through the server (``benchmark.perplexity``: first 3072
tokens, 512-token windows, input-token logprobs), and (2) prefill/decode tokens/s at each batch
size with ``benchmark.throughput``'s streamed-batch method (fresh prompts, radix cache flushed,
median of the repetitions). Configurations: fp, all-W8, all-W4 AWQ, all-W4 round-to-nearest with
the same groups, and, with ``--order``, the first 8 layers of that swap order at W4 (mixed).
Engines are built with ``python -m sglang_morph.morph.build_engines`` when not given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from benchmark.harness import build_engines, git_state, machine_info, running_server
from benchmark.perplexity import DEFAULT_TEXT, server_perplexity
from benchmark.throughput import (
    prompt_windows,
    run_sglang,
    summarize,
)
from sglang_morph.morph.swap_order import load_swap_order
from sglang_morph.models import default_model_path
from sglang_morph.repo_data import REPO_ROOT

RESULTS = REPO_ROOT / "benchmark" / "results"
LOG_LINE = re.compile(r"decoder linears (\d+) -> (\d+) bytes")
MIXED_LAYERS = 8


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    server_args: tuple[str, ...]


def configs(engines: Path, rtn_engines: Path, order: tuple[int, ...] | None) -> list[Config]:
    def morph(e: Path, spec: str) -> tuple[str, ...]:
        return ("--enable-morph", "--morph-engines", str(e), "--morph-precision-map", spec)

    out = [
        Config("fp", ()),
        Config("w8", morph(engines, "*:8")),
        Config("w4_awq", morph(engines, "*:4")),
        Config("w4_rtn", morph(rtn_engines, "*:4")),
    ]
    if order is not None:
        spec = ",".join(f"{layer}:4" for layer in order[:MIXED_LAYERS])
        out.append(Config(f"mixed_lis{MIXED_LAYERS}_w4", morph(engines, spec)))
    return out


def measure_speed(url: str, token_ids: list[int], batch_sizes, prompt_tokens: int,
                  decode_tokens: int, repetitions: int) -> dict:
    out = {}
    next_window = 0
    with httpx.Client(timeout=600) as client:
        for b in batch_sizes:
            runs = []
            for rep in range(repetitions + 1):  # the first is an untimed warm-up
                prompts = prompt_windows(token_ids, next_window, b, prompt_tokens)
                next_window += b
                run = run_sglang(client, url, prompts, decode_tokens)
                if rep:
                    runs.append(run.timing)
            out[b] = {
                "prefill_tokens_per_s": dataclasses.asdict(
                    summarize([t.prefill_tokens_per_s for t in runs])),
                "decode_tokens_per_s": dataclasses.asdict(
                    summarize([t.decode_tokens_per_s for t in runs])),
            }
    return out


def render_markdown(rows: list[dict], batch_sizes) -> str:
    fp = next(r for r in rows if r["name"] == "fp")
    head = ["config", "perplexity", "decoder linear MB"] + [
        f"decode tok/s B={b} (x FP)" for b in batch_sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], f"{r['perplexity']:.2f}",
                 "-" if r["linear_bytes"] is None else f"{r['linear_bytes'] / 1e6:.1f}"]
        for b in batch_sizes:
            d = r["speed"][b]["decode_tokens_per_s"]["median"]
            ratio = d / fp["speed"][b]["decode_tokens_per_s"]["median"]
            cells.append(f"{d:.1f} ({ratio:.2f}x)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.morph.engines_quality",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, help="AWQ W8+W4 engines (default: build)")
    parser.add_argument("--rtn-engines", type=Path, help="RTN W4 engines (default: build)")
    parser.add_argument("--order", type=Path, help="swap_order.json for the mixed config")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--configs", help="comma-separated subset of config names to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "engines_quality.json")
    args = parser.parse_args(argv)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    model_path = default_model_path()
    order = None
    if args.order is not None:
        try:
            order = load_swap_order(args.order, 30)
        except (OSError, ValueError) as e:
            parser.error(f"--order {args.order}: {e}")
    started_s = time.monotonic()
    engines = args.engines or build_engines("--bits", "8,4")
    rtn_engines = args.rtn_engines or build_engines("--bits", "4", "--no-awq")
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    token_ids = tokenizer(DEFAULT_TEXT.read_text()[:400_000], add_special_tokens=False)["input_ids"]
    rows = []
    selected = configs(engines, rtn_engines, order)
    if args.configs:
        wanted = args.configs.split(",")
        unknown = set(wanted) - {c.name for c in selected}
        if unknown or "fp" not in wanted:
            parser.error(f"--configs: unknown {sorted(unknown)} or missing 'fp' (the reference); "
                         f"choose from {[c.name for c in selected]}")
        selected = [c for c in selected if c.name in wanted]
    for cfg in selected:
        log_path = RESULTS / "raw" / f"engines_quality_{cfg.name}.log"
        print(f"[engines_quality] {cfg.name}: {' '.join(cfg.server_args) or '(plain)'}",
              file=sys.stderr)
        with running_server(cfg.server_args, log_path) as server:
            ppl = server_perplexity(server.url)
            speed = measure_speed(server.url, token_ids, batch_sizes, args.prompt_tokens,
                                  args.decode_tokens, args.repetitions)
        m = LOG_LINE.search(log_path.read_text())
        rows.append({"name": cfg.name, "server_args": list(cfg.server_args),
                     "perplexity": ppl.perplexity, "scored_tokens": ppl.scored_tokens,
                     "linear_bytes": int(m.group(2)) if m else None, "speed": speed})
    report = {
        "git": git_state(), "machine": machine_info(), "load_average_at_end": os.getloadavg(),
        "duration_s": time.monotonic() - started_s,
        "settings": {"batch_sizes": batch_sizes, "prompt_tokens": args.prompt_tokens,
                     "decode_tokens": args.decode_tokens, "repetitions": args.repetitions,
                     "engines": str(engines), "rtn_engines": str(rtn_engines),
                     "order": str(args.order) if args.order else None},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    markdown = render_markdown(rows, batch_sizes)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
