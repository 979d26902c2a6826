"""The W4 GPU results of one commit as Markdown: side by side at decode, the served path over
repeated runs (median and spread), and the W4 targets.

    python -m benchmark.gpu.w4_report DIR [--out DIR/w4.md]

``DIR`` holds the device's ``w4_side_by_side.json`` files: ``w4_side_by_side_decode.json``
(every implementation, from ``--tokens 1 8 16``) and ``w4_ours_r*.json`` (our backends only,
``--ours-only``, one file per run of the same command).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmark.gpu.common import table

LIBRARIES = ["bf16_cublas", "previous", "triton", "served", "gemlite_module", "tinygemm",
             "torchao"]
# The W4 targets: decode share of the copy bandwidth and speed-up over bf16 cuBLAS on the
# large linears, prefill speed relative to bf16 cuBLAS.
LARGE = ("gate_up_proj", "down_proj")
TARGET_ROOFLINE = 0.70
TARGET_DECODE_SPEEDUP = 2.5
TARGET_PREFILL_RATIO = 0.8
DECODE_MAX_TOKENS = 16


def _key(row: dict) -> tuple:
    return row["linear"], row["input_scale"], row["tokens"]


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def side_by_side(result: dict) -> str:
    present = [lb for lb in LIBRARIES if any(lb in r["impls"] for r in result["rows"])]
    rows = []
    for r in result["rows"]:
        if r["input_scale"]:
            continue
        bf16 = r["impls"]["bf16_cublas"].get("ms")
        cells = []
        for lb in present:
            v = r["impls"].get(lb, {})
            if "ms" not in v:
                cells.append("error" if "error" in v else "")
                continue
            cell = f"{v['ms'] * 1e3:.1f} ({v['roofline_fraction']:.0%}"
            cell += ")" if lb == "bf16_cublas" else f", {bf16 / v['ms']:.2f}x)"
            cell += f" {v['rel_error']:.1e}" + (", exact" if v.get("one_hot_exact") else "")
            cells.append(cell)
        rows.append([r["linear"], r["tokens"]] + cells)
    return table(["linear", "tokens"] + present, rows)


def served_runs(runs: list[dict]) -> tuple[str, dict]:
    """The served path and bf16 cuBLAS per point over the runs; also the figures the targets
    are judged on (medians)."""
    linears = list(dict.fromkeys(r["linear"] for r in runs[0]["rows"]))  # as run
    points = sorted({_key(r) for run in runs for r in run["rows"]},
                    key=lambda k: (k[1], linears.index(k[0]), k[2]))
    rows, medians = [], {}
    for key in points:
        found = [next(r for r in run["rows"] if _key(r) == key) for run in runs]
        bf16 = [r["impls"]["bf16_cublas"]["ms"] * 1e3 for r in found]
        served = [r["impls"]["served"]["ms"] * 1e3 for r in found]
        triton = [r["impls"]["triton"]["ms"] * 1e3 for r in found]
        dequant = [r["impls"]["dequant_cublas"]["ms"] * 1e3 for r in found]
        ratio = [b / s for b, s in zip(bf16, served)]
        decode = key[2] <= DECODE_MAX_TOKENS
        share = [r["impls"]["served"]["roofline_fraction"] for r in found]
        tflops = [r["impls"]["served"]["tflops"] for r in found]
        backends = sorted({r["served_backend"] for r in found})
        errors = [r["impls"]["served"]["rel_error"] for r in found]
        medians[key] = {"ratio": statistics.median(ratio), "share": statistics.median(share)}
        rows.append([key[0], "AWQ" if key[1] else "plain", key[2], "/".join(backends),
                     spread(served), spread(bf16), spread(ratio, "{:.2f}") + "x",
                     spread([s * 100 for s in share], "{:.0f}") + "%" if decode
                     else spread(tflops, "{:.0f}") + " TF",
                     spread(triton), spread(dequant), f"{max(errors):.1e}"])
    header = ["linear", "weights", "tokens", "served backend", "served us", "bf16 cuBLAS us",
              "bf16 / served", "copy-bandwidth share (decode) or TFLOP/s", "triton us",
              "dequant_cublas us", "max rel. error"]
    return table(header, rows), medians


def targets(medians: dict) -> str:
    rows = []
    for linear in LARGE:
        dec = [v for k, v in medians.items() if k[0] == linear and not k[1]
               and k[2] <= DECODE_MAX_TOKENS]
        pre = {k[2]: v for k, v in medians.items() if k[0] == linear and not k[1]
               and k[2] >= 512}
        if not dec:
            continue
        share = min(v["share"] for v in dec), max(v["share"] for v in dec)
        speed = min(v["ratio"] for v in dec), max(v["ratio"] for v in dec)
        rows.append([linear, f"{share[0]:.0%}-{share[1]:.0%} (target {TARGET_ROOFLINE:.0%})",
                     f"{speed[0]:.2f}-{speed[1]:.2f}x (target {TARGET_DECODE_SPEEDUP}x)",
                     ", ".join(f"{t}: {v['ratio']:.2f}x" for t, v in sorted(pre.items()))
                     + f" (target {TARGET_PREFILL_RATIO}x)"])
    return table(["linear (plain W4)", "decode share of copy bandwidth",
                  "decode speed-up over bf16", "prefill speed / bf16"], rows)


def packer_equal(result: dict) -> bool:
    return all(r["gemlite_packer_equals_our_layout"] for r in result["rows"]
               if not r["input_scale"])


def markdown(directory: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(directory.glob("w4_ours_r*.json"))]
    decode = directory / "w4_side_by_side_decode.json"
    first = runs[0] if runs else json.loads(decode.read_text())
    d = first["device"]
    copies = ", ".join(f"{r['copy_bytes_per_s'] / 1e12:.2f}" for r in runs)
    out = ["# W4A16 on the GPU: side by side and served\n\n",
           f"{d['gpu']} ({d['sm_count']} SMs), torch {d['torch']} (CUDA {d['cuda']}), Triton "
           f"{d['triton']}, commit {d['commit']}. Every time is per call inside a CUDA graph over "
           "weight copies totalling 4x the L2 cache (weights streamed from HBM), median of 5 "
           "replays; decode share = (weight + activation + output bytes) / time / the "
           "device-to-device copy bandwidth measured in the same run "
           f"({copies} TB/s).\n"]
    if decode.exists():
        result = json.loads(decode.read_text())
        out += ["\n## Decode, side by side (plain W4 g128)\n\n",
                "`python -m benchmark.gpu.w4_side_by_side --tokens 1 8 16` (GemLite "
                f"{result['versions'].get('gemlite')} with its H100 configurations, torchao "
                f"{result['versions'].get('torchao')}). Each cell: us (share of the copy "
                "bandwidth, speed-up over bf16 cuBLAS), the relative error against the fp32 "
                "reference and, at 16 tokens, `exact` where one-hot activations returned every "
                "weight bit for bit (checked for the implementations that read our layout). "
                "GemLite's packer gave our layout bit for bit: "
                f"{packer_equal(result)}.\n\n", side_by_side(result)]
    if runs:
        served, medians = served_runs(runs)
        out += [f"\n## The served path, {len(runs)} runs (median and min-max)\n\n",
                "`python -m benchmark.gpu.w4_side_by_side --ours-only --tokens 1 8 16 64 512 "
                "2048`, run "
                f"{len(runs)} times. `served` is `morph_kernels.linear` after `warmup` (the "
                "backend it chose for the bucket); AWQ rows have an input scale, as our "
                "variants are served.\n\n", served,
                "\n## Against the W4 targets (plain W4, medians)\n\n", targets(medians)]
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = markdown(args.directory)
    (args.out or args.directory / "w4.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
