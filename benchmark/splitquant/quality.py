"""What quantizing layers really costs, measured offline: per-token NLL and KL to full precision.

The planner's indicators (``sglang_morph.splitquant.indicator``) predict the quality loss of a
(layer, bit-width) from weights and calibration statistics. This benchmark measures it on the
float32 model with the built variants' dequantized weights (``engines.hf_variants``, the same
effective weights the CPU kernels are tested against):

- ``sensitivity``: every layer alone at every quantized bit-width (and every layer at each
  bit-width together), on windows of a split: the mean per-token KL(full precision || quantized)
  and the mean NLL increase, with a standard error over windows. On the TRAIN split (default)
  this is calibration data; on the test split it is a diagnosis only.
- ``compare``: every indicator of an omega file (``splitquant indicator``) against the measured KL:
  rank correlation, how W8 compares with W4, compute cost.
- ``plans``: given precision maps (``layer:bits`` lists or plan JSONs), the per-token NLL of each
  on the same windows, the perplexity, and for every pair the paired NLL difference with its
  standard error over windows (the windows are the independent units; tokens inside a window are
  not independent).

    .venv/bin/python -m benchmark.splitquant.quality sensitivity --split train --windows 8 \
        --out benchmark/results/splitquant/sensitivity_train.json
    .venv/bin/python -m benchmark.splitquant.quality plans --split test --windows 32 \
        --plan uniform=0-29:8 --plan sq=17:4,18:8 --out plans_offline.json
    .venv/bin/python -m benchmark.splitquant.quality compare [--omega omega.json]

Float32 and offline: the numbers through the server (bf16, SGLang's kernels) come from
``benchmark.splitquant.pp``; these are for the diagnosis and the indicators' calibration.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from sglang_morph.splitquant.measured import SPLITS, QualityProbe, make_windows, window_mean_se


def parse_map(text: str, num_layers: int) -> dict[int, int]:
    """``17:4,18:8`` or ``0-29:8`` (unlisted layers full precision) or a plan JSON path."""
    path = Path(text)
    if path.suffix == ".json" and path.is_file():
        raw = json.loads(path.read_text())
        bits = raw.get("plan", raw).get("layer_bits", raw.get("layer_bits"))
        return {l: int(b) for l, b in enumerate(bits)}
    out = {l: 16 for l in range(num_layers)}
    for item in filter(None, text.split(",")):
        span, _, b = item.partition(":")
        lo, _, hi = span.partition("-")
        for l in range(int(lo), int(hi or lo) + 1):
            out[l] = int(b)
    return out


def cmd_sensitivity(args, probe: QualityProbe) -> dict:
    rows = []
    configs = [(f"{l}:{b}", {l: b}) for b in (8, 4) for l in range(probe.num_layers)]
    configs += [(f"all:{b}", {l: b for l in range(probe.num_layers)}) for b in (8, 4)]
    for name, layer_bits in configs:
        started = time.perf_counter()
        m = probe.measure(layer_bits)
        kl, kl_se = window_mean_se(m["kl"])
        dnll, dnll_se = window_mean_se(m["nll"] - probe.fp_nll)
        rows.append({"config": name, "kl": kl, "kl_se": kl_se, "delta_nll": dnll,
                     "delta_nll_se": dnll_se, "seconds": time.perf_counter() - started})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows}


def cmd_plans(args, probe: QualityProbe) -> dict:
    names, per_token = [], {}
    out = {"plans": {}, "paired": {}}
    for item in [("full precision", "")] + [tuple(p.split("=", 1)) for p in args.plan]:
        name, text = item
        layer_bits = parse_map(text, probe.num_layers)
        m = probe.measure(layer_bits)
        nll, nll_se = window_mean_se(m["nll"])
        kl, kl_se = window_mean_se(m["kl"])
        names.append(name)
        per_token[name] = m["nll"]
        out["plans"][name] = {"layer_bits": [layer_bits.get(l, 16)
                                             for l in range(probe.num_layers)],
                              "perplexity": math.exp(nll), "mean_nll": nll, "mean_nll_se": nll_se,
                              "kl": kl, "kl_se": kl_se}
        print(name, json.dumps({k: v for k, v in out["plans"][name].items()
                                if k != "layer_bits"}), file=sys.stderr, flush=True)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            d, se = window_mean_se(per_token[a] - per_token[b])
            out["paired"][f"{a} - {b}"] = {"delta_nll": d, "se": se, "z": d / se if se else None}
    return out


def compare_indicators(omega_path: Path, reference: str = "measured-kl") -> list[dict]:
    """Each indicator of an omega file against ``reference``: Spearman rank correlation over
    every quantized (layer, bit-width), within each bit-width, and the all-W8 / all-W4 totals'
    ratio (how much cheaper the indicator thinks W8 is than W4), with its compute cost."""
    from scipy.stats import spearmanr

    raw = json.loads(Path(omega_path).read_text())
    by_name = {r["name"]: r for r in raw["indicators"]}
    ref = np.array(by_name[reference]["omega"])
    bits = by_name[reference]["bits"]
    q = [k for k, b in enumerate(bits) if b != 16]
    rows = []
    for name, r in by_name.items():
        o = np.array(r["omega"])
        row = {"indicator": name, "compute_s": r["compute_s"],
               "spearman_all": float(spearmanr(o[:, q].ravel(), ref[:, q].ravel())[0])}
        for k in q:
            row[f"spearman_w{bits[k]}"] = float(spearmanr(o[:, k], ref[:, k])[0])
        w8, w4 = bits.index(8), bits.index(4)
        row["w8_over_w4_total"] = float(o[:, w8].sum() / o[:, w4].sum())
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.splitquant.quality",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("sensitivity", "plans"):
        p = sub.add_parser(name)
        p.add_argument("--split", choices=tuple(SPLITS), default="train")
        p.add_argument("--windows", type=int, default=8)
        p.add_argument("--window-tokens", type=int, default=512)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", required=True)
        if name == "plans":
            p.add_argument("--plan", action="append", default=[],
                           help="NAME=MAP (MAP: 17:4,18:8 or 0-29:8 or a plan JSON)")
    p = sub.add_parser("compare", help="indicators of an omega file against measured KL")
    p.add_argument("--omega", default="benchmark/results/splitquant/omega.json")
    args = parser.parse_args(argv)
    if args.command == "compare":
        for row in compare_indicators(Path(args.omega)):
            print(json.dumps(row))
        return
    from sglang_morph.models import default_model_path
    from sglang_morph.cli import default_engines

    from benchmark.harness import git_state, load_average, machine_info

    model_dir = default_model_path()
    engines = default_engines(model_dir)
    meta = {"git": git_state(), "machine": machine_info(), "load_average_before": load_average(),
            "command": "python -m benchmark.splitquant.quality " + " ".join(sys.argv[1:]),
            "split": args.split, "windows": args.windows, "window_tokens": args.window_tokens,
            "seed": args.seed, "engines": engines.name, "dtype": "float32 (offline)"}
    started = time.perf_counter()
    windows = make_windows(model_dir, args.split, args.windows, args.window_tokens, args.seed)
    probe = QualityProbe(model_dir, engines, windows)
    result = {"sensitivity": cmd_sensitivity, "plans": cmd_plans}[args.command](args, probe)
    meta.update({"seconds": time.perf_counter() - started, "load_average_after": load_average()})
    Path(args.out).write_text(json.dumps({**meta, **result}, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
