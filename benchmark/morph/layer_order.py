"""MorphServe Tables 2 and 3 on the default model: perplexity vs which layers are quantized.

    python -m benchmark.morph.layer_order --engines PATH --order swap_order.json [--bits 4]
        [--model-path M] [--random-seeds 5] [--out benchmark/results/layer_order]

Writes ``<out>.json`` (settings, commit, machine, every evaluation) and ``<out>.md`` (also
printed). Method:

- Perplexity: transformers, float32, on the first ``--eval-windows`` x ``--window-tokens``
  (default 6 x 512 = 3072) tokens of ``wikitext2_test.txt`` (tokenized as one sequence without
  special tokens), cut into non-overlapping 512-token windows, each scored from an empty context;
  PPL = exp(mean next-token NLL over the 6 x 511 predicted tokens). A "quantized" layer has all
  seven linears replaced by the effective weights of its ``--bits`` variant from the engines
  directory (``formats.dequantize``): the same numbers the serving kernels compute with.
- Table 2: PPL after quantizing the first k layers (k = 1, 2, 4, 8, 16, 30) of four orders: the
  LIS profile (``--order``), front-to-back, back-to-front, and random permutations (seeds
  0..``--random-seeds``-1; mean and sample standard deviation over seeds).
- Table 3 (near-additivity): one fixed layer f = the LAST layer of the LIS order (the one the
  profile judges most important, so its increment is the largest and easiest to read). For
  k = 0, 4, 8, 16 with S_k = the first k layers of the LIS order (never containing f): the extra
  PPL of adding f, PPL(S_k + f) - PPL(S_k), compared with f's increment alone (k = 0); and
  whether S_k's own increments add up: PPL(S_k) - PPL(FP) vs the sum over l in S_k of
  PPL({l}) - PPL(FP). If both ratios stay near 1, layer effects are close to independent and a
  per-layer ranking is a good proxy for the greedy, conditioned one.
- Speed: the full-precision hidden state at every layer input is cached once, so an evaluation
  reruns only from the first quantized layer; each distinct layer set is evaluated once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from benchmark.harness import git_state, machine_info
from sglang_morph.engines.hf_variants import (
    LayerRunner,
    LayerVariants,
    PerplexityEvaluator,
    first_windows,
    load_model,
    load_tokenizer,
    open_engines,
    read_token_ids,
)
from sglang_morph.morph.swap_order import front_to_back, load_swap_order
from sglang_morph.repo_data import REPO_ROOT, WIKITEXT2_TEST

TEXT_PATH = WIKITEXT2_TEST
DEFAULT_OUT = REPO_ROOT / "benchmark" / "results" / "layer_order"
TABLE2_KS = (1, 2, 4, 8, 16, 30)
TABLE3_KS = (0, 4, 8, 16)


@dataclass(frozen=True)
class LayerOrderConfig:
    model_path: Path
    engines_dir: Path
    order_path: Path
    bits: int
    text_path: Path
    eval_windows: int
    window_tokens: int
    random_seeds: int
    out_stem: Path  # results go to <out_stem>.json and <out_stem>.md
    table2_ks: tuple[int, ...] = TABLE2_KS
    table3_ks: tuple[int, ...] = TABLE3_KS
    progress: bool = True


def random_order(num_layers: int, seed: int) -> tuple[int, ...]:
    return tuple(random.Random(seed).sample(range(num_layers), num_layers))


def orders_for(lis_order: tuple[int, ...], random_seeds: int) -> dict[str, tuple[int, ...]]:
    num_layers = len(lis_order)
    return {
        "lis": lis_order,
        "front_to_back": front_to_back(num_layers),
        "back_to_front": tuple(reversed(front_to_back(num_layers))),
        **{f"random_seed{s}": random_order(num_layers, s) for s in range(random_seeds)},
    }


def layer_sets_needed(
    orders: dict[str, tuple[int, ...]], table2_ks: Sequence[int], table3_ks: Sequence[int]
) -> list[frozenset[int]]:
    """Every distinct set of quantized layers the two tables read, FP (empty set) first."""
    lis = orders["lis"]
    fixed = lis[-1]
    sets = [frozenset()]
    sets += [frozenset(order[:k]) for order in orders.values() for k in table2_ks]
    for k in table3_ks:
        sets += [frozenset(lis[:k]), frozenset(lis[:k]) | {fixed}]
    sets += [frozenset({layer}) for layer in lis[:max(table3_ks, default=0)]]
    return list(dict.fromkeys(sets))


def build_tables(
    orders: dict[str, tuple[int, ...]], ppl: dict[frozenset[int], float],
    table2_ks: Sequence[int], table3_ks: Sequence[int],
) -> tuple[list[dict], dict]:
    fp = ppl[frozenset()]
    random_names = [name for name in orders if name.startswith("random_seed")]
    table2 = []
    for k in table2_ks:
        row = {"k": k}
        for name in ("lis", "front_to_back", "back_to_front"):
            row[name] = ppl[frozenset(orders[name][:k])]
        randoms = [ppl[frozenset(orders[name][:k])] for name in random_names]
        row["random"] = randoms
        row["random_mean"] = statistics.fmean(randoms)
        row["random_std"] = statistics.stdev(randoms) if len(randoms) > 1 else 0.0
        table2.append(row)

    lis = orders["lis"]
    fixed = lis[-1]
    alone_delta = ppl[frozenset({fixed})] - fp
    rows = []
    for k in table3_ks:
        base = frozenset(lis[:k])
        delta = ppl[base | {fixed}] - ppl[base]
        sum_single_deltas = sum(ppl[frozenset({layer})] - fp for layer in lis[:k])
        rows.append({
            "k": k,
            "base_layers": list(lis[:k]),
            "ppl_base": ppl[base],
            "ppl_base_plus_fixed": ppl[base | {fixed}],
            "delta_fixed": delta,
            "delta_fixed_over_alone": delta / alone_delta if alone_delta else None,
            "delta_base": ppl[base] - fp,
            "sum_single_deltas_base": sum_single_deltas,
            "delta_base_over_sum_single": (
                (ppl[base] - fp) / sum_single_deltas if k and sum_single_deltas else None
            ),
        })
    table3 = {"fixed_layer": fixed, "fixed_layer_rule": "last layer of the LIS order",
              "delta_fixed_alone": alone_delta, "rows": rows}
    return table2, table3


def render_markdown(report: dict) -> str:
    s = report["settings"]
    fp = report["fp_perplexity"]
    machine = report["machine"]
    commit = report["git"]["commit"]
    commit_text = ((commit[:12] if commit else "no commit")
                   + (" (dirty)" if report["git"]["dirty"] else ""))
    lines = [
        f"# Layer order: perplexity vs quantized layers (W{s['bits']})",
        "",
        f"Model `{Path(s['model_path']).name}` (float32, transformers), "
        f"engines `{s['engines_dir']}` "
        f"(recipe {json.dumps(report['engines_recipe'])}), LIS order from `{s['order_path']}`.",
        f"WikiText-2 test, first {s['eval_windows'] * s['window_tokens']} tokens in "
        f"{s['eval_windows']} non-overlapping {s['window_tokens']}-token windows; "
        f"full-precision perplexity **{fp:.3f}**.",
        f"Commit {commit_text}; {machine['cpu_model']}, {machine['cpu_cores']} cores, "
        f"{machine['torch_threads']} torch threads; {report['evaluations_count']} evaluations "
        f"in {report['duration_s']:.0f} s.",
        "",
        "## Table 2: perplexity after quantizing the first k layers of each order",
        "",
        f"LIS order: {report['orders']['lis']}",
        "",
        "| k | LIS | front-to-back | back-to-front | "
        f"random (mean ± std, {s['random_seeds']} seeds) |",
        "|---:|---:|---:|---:|---:|",
        f"| 0 (FP) | {fp:.2f} | {fp:.2f} | {fp:.2f} | {fp:.2f} |",
    ]
    for row in report["table2"]:
        lines.append(
            f"| {row['k']} | {row['lis']:.2f} | {row['front_to_back']:.2f} | "
            f"{row['back_to_front']:.2f} | {row['random_mean']:.2f} ± {row['random_std']:.2f} |"
        )
    t3 = report["table3"]
    lines += [
        "",
        f"## Table 3: near-additivity, fixed layer {t3['fixed_layer']} ({t3['fixed_layer_rule']})",
        "",
        "S_k = first k layers of the LIS order. Δf = PPL(S_k + f) − PPL(S_k); "
        "ΔS = PPL(S_k) − PPL(FP); Σ singles = sum over l in S_k of PPL({l}) − PPL(FP).",
        "",
        "| k | PPL(S_k) | PPL(S_k + f) | Δf | Δf / Δf alone | ΔS | Σ singles | ΔS / Σ singles |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    for row in t3["rows"]:
        lines.append(
            f"| {row['k']} | {row['ppl_base']:.3f} | {row['ppl_base_plus_fixed']:.3f} | "
            f"{row['delta_fixed']:+.3f} | {ratio(row['delta_fixed_over_alone'])} | "
            f"{row['delta_base']:+.3f} | {row['sum_single_deltas_base']:+.3f} | "
            f"{ratio(row['delta_base_over_sum_single'])} |"
        )
    return "\n".join(lines) + "\n"


def run(config: LayerOrderConfig) -> dict:
    started_s = time.monotonic()
    created_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_average_at_start = os.getloadavg()
    manifest = open_engines(config.engines_dir, config.model_path, config.bits)
    lis_order = load_swap_order(config.order_path, manifest.num_layers)
    eval_ids = first_windows(read_token_ids(load_tokenizer(config.model_path), config.text_path),
                             config.eval_windows, config.window_tokens)
    num_layers = manifest.num_layers
    table2_ks = tuple(k for k in config.table2_ks if k <= num_layers)
    table3_ks = tuple(k for k in config.table3_ks if k < num_layers)
    orders = orders_for(lis_order, config.random_seeds)
    sets = layer_sets_needed(orders, table2_ks, table3_ks)

    model = load_model(config.model_path)
    variants = LayerVariants(model, config.engines_dir, manifest, config.bits, config.progress)
    evaluator = PerplexityEvaluator(LayerRunner(model, eval_ids), variants)
    ppl = {}
    for layers in tqdm(sets, desc="Perplexity", unit="eval", disable=not config.progress):
        ppl[layers] = evaluator.perplexity(layers)
    table2, table3 = build_tables(orders, ppl, table2_ks, table3_ks)

    report = {
        "benchmark": "layer_order",
        "created_utc": created_utc,
        "duration_s": time.monotonic() - started_s,
        "git": git_state(),
        "machine": machine_info(),
        "load_average_at_start": list(load_average_at_start),
        "load_average_at_end": list(os.getloadavg()),
        "settings": {
            "model_path": str(config.model_path),
            "engines_dir": str(config.engines_dir),
            "order_path": str(config.order_path),
            "bits": config.bits,
            "text_path": str(config.text_path),
            "eval_windows": config.eval_windows,
            "window_tokens": config.window_tokens,
            "predicted_tokens": evaluator.evaluated_tokens,
            "random_seeds": config.random_seeds,
            "table2_ks": list(table2_ks),
            "table3_ks": list(table3_ks),
            "dtype": "float32",
        },
        "engines_recipe": manifest.recipe,
        "orders": {name: list(order) for name, order in orders.items()},
        "fp_perplexity": ppl[frozenset()],
        "table2": table2,
        "table3": table3,
        "evaluations_count": len(sets),
        "evaluations": [{"quantized_layers": sorted(s), "perplexity": ppl[s]} for s in sets],
    }
    out_json = config.out_stem.with_suffix(".json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(report)
    config.out_stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.morph.layer_order",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path,
                        help="HF model directory (default: the embedded default model)")
    parser.add_argument("--engines", type=Path, required=True, help="built engines directory")
    parser.add_argument("--order", type=Path, required=True,
                        help="profile JSON from python -m sglang_morph.morph.profile_layers")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--eval-windows", type=int, default=6, help="default 6")
    parser.add_argument("--window-tokens", type=int, default=512, help="default 512")
    parser.add_argument("--random-seeds", type=int, default=5, help="random orders (default 5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output path without suffix; .json and .md are written "
                             "(default benchmark/results/layer_order)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.model_path is None:
        from sglang_morph.models import default_model_path

        args.model_path = default_model_path()
    if args.random_seeds < 1 or args.eval_windows < 1 or args.window_tokens < 2:
        parser.error("--random-seeds and --eval-windows must be >= 1, --window-tokens >= 2")
    config = LayerOrderConfig(
        model_path=args.model_path.resolve(),
        engines_dir=args.engines.resolve(),
        order_path=args.order.resolve(),
        bits=args.bits,
        text_path=TEXT_PATH,
        eval_windows=args.eval_windows,
        window_tokens=args.window_tokens,
        random_seeds=args.random_seeds,
        out_stem=args.out.resolve(),
        progress=not args.no_progress,
    )
    try:
        manifest = open_engines(config.engines_dir, config.model_path, config.bits)
        load_swap_order(config.order_path, manifest.num_layers)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
