"""What freeing and refilling FFN weight shards in place costs, against the copy base variant.

Measured per layer, on stores of the default model's FFN shapes (random weights; the costs do
not depend on the values):

- in place (``MappedFfnWeights``): ``keep_shard`` (the release, ``madvise(MADV_DONTNEED)``)
  and ``restore`` (the gather's write of the peers' shards, received beforehand as gloo would
  deliver them) times, and the process's resident memory before and after;
- the AMOEBAs paper's base variant (``CopiedFfnWeights``): the same two steps by copy, with the
  extra memory each holds at its peak;
- padding: the formula's overhead per layer at the OS page and at the GPU's 2 MiB granule, for
  the default model, the tiny model and odd intermediate sizes, and the bytes the store's
  mapping really has beyond the unpadded weights;
- the FFN forward at TP 1: SGLang's ``LlamaMLP`` as loaded against one whose weights are views
  of the store (gate/up rows, down row major while the store is whole), alternated, many
  repetitions, median and 10th-90th percentile, with the largest output difference and
  whether outputs are bitwise equal.

    .venv/bin/python -m benchmark.amoebas.weights_cost [--layers 30] [--repeats 200] \\
        [--out benchmark/results/amoebas]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmark.harness import load_average, run_meta
from sglang_morph.amoebas.pages import PAGE_BYTES, padding_overhead, process_rss_bytes
from sglang_morph.amoebas.weights import CopiedFfnWeights, MappedFfnWeights

GPU_GRANULE_BYTES = 2 << 20
PADDING_CASES = (  # (name, intermediate, hidden, degrees)
    ("SmolLM2-135M", 1536, 576, (1, 3)),
    ("tiny Llama", 512, 256, (1, 2, 4)),
    ("odd, degrees 1/2/4", 500, 256, (1, 2, 4)),
    ("odd, degrees 1/3", 1000, 256, (1, 3)),
)


def spread(seconds: list[float]) -> dict:
    q = (statistics.quantiles(seconds, n=10, method="inclusive") if len(seconds) > 1
         else [seconds[0]] * 9)
    return {"median_s": statistics.median(seconds), "p10_s": q[0], "p90_s": q[-1],
            "n": len(seconds)}


def random_layer(intermediate: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * intermediate, hidden, generator=g) * 0.02,
            torch.randn(hidden, intermediate, generator=g) * 0.02)


def measure_transitions(variant, args) -> dict:
    """keep_shard then restore on every layer, ``args.transition_repeats`` times."""
    stores = [variant.from_tensors(*random_layer(args.intermediate, args.hidden, i),
                                   args.degrees) for i in range(args.layers)]
    layout, rank, degree = stores[0].layout, args.rank, max(args.degrees)
    peers = [r for r in range(degree) if r != rank]
    payloads = [{layout.shard_rows(r, degree): w.payload(r, degree).contiguous().clone()
                 for r in peers} for w in stores]
    release_s, restore_s, rss_drop, rss_back, transitions = [], [], [], [], {}
    for _ in range(args.transition_repeats):
        rss = process_rss_bytes()
        for w in stores:
            t0 = time.perf_counter()
            transitions["keep_shard"] = w.keep_shard(rank, degree)
            release_s.append(time.perf_counter() - t0)
        rss_kept = process_rss_bytes()
        for w, p in zip(stores, payloads):
            t0 = time.perf_counter()
            transitions["restore"] = w.restore(p)
            restore_s.append(time.perf_counter() - t0)
        rss_drop.append(rss - rss_kept)
        rss_back.append(process_rss_bytes() - rss_kept)
        for w in stores:
            w.check_integrity()
    freed_bytes = transitions["keep_shard"].freed_bytes * args.layers
    return {
        "variant": variant.__name__, "rank": rank, "degree": degree,
        "keep_shard_per_layer": spread(release_s), "restore_per_layer": spread(restore_s),
        "freed_bytes_per_layer": transitions["keep_shard"].freed_bytes,
        "restored_bytes_per_layer": transitions["restore"].restored_bytes,
        "peak_extra_bytes_keep_shard": transitions["keep_shard"].peak_extra_bytes,
        "peak_extra_bytes_restore": transitions["restore"].peak_extra_bytes,
        "rss_drop_over_freed": [d / freed_bytes for d in rss_drop],
        "rss_back_over_freed": [b / freed_bytes for b in rss_back],
        "mapping_bytes_per_layer": layout.mapping_bytes,
    }


def measure_padding(args) -> list[dict]:
    rows = []
    for name, intermediate, hidden, degrees in PADDING_CASES:
        for page_bytes in (PAGE_BYTES, GPU_GRANULE_BYTES):
            o = padding_overhead(intermediate, hidden, 4, degrees, page_bytes)
            row = {"case": name, "intermediate": intermediate, "hidden": hidden,
                   "degrees": list(degrees), "page_bytes": page_bytes,
                   "padded_intermediate": o.padded_intermediate,
                   "overhead_bytes_per_layer": o.overhead_bytes_per_layer,
                   "overhead_fraction": o.overhead_fraction, "measured_overhead_bytes": None}
            if page_bytes == PAGE_BYTES:  # a store is built at the OS page only
                store = MappedFfnWeights.from_tensors(*random_layer(intermediate, hidden, 0),
                                                      degrees)
                row["measured_overhead_bytes"] = (store.mapping.nbytes
                                                  - 3 * intermediate * hidden * 4)
            rows.append(row)
    return rows


def measure_forward(args) -> list[dict]:
    """SGLang's LlamaMLP as loaded vs with its weights installed in a store, alternated."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.models.llama import LlamaMLP
    from sglang.srt.runtime_context import get_parallel

    rows = []
    with get_parallel().override(tp_size=1, tp_rank=0, tp_group=None), torch.no_grad():
        plain, installed = (LlamaMLP(args.hidden, args.intermediate, "silu") for _ in "ab")
        gate_up, down = random_layer(args.intermediate, args.hidden, 0)
        for mlp in (plain, installed):
            mlp.gate_up_proj.weight.data.copy_(gate_up)
            mlp.down_proj.weight.data.copy_(down)
        store = MappedFfnWeights.from_module(installed, args.degrees)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens))
            a, b = plain(x), installed(x)
            times = {"plain": [], "installed": []}
            for i in range(args.warmup + args.repeats):
                order = ("plain", "installed") if i % 2 == 0 else ("installed", "plain")
                for name in order:
                    mlp = plain if name == "plain" else installed
                    t0 = time.perf_counter()
                    mlp(x)
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
            p, q = spread(times["plain"]), spread(times["installed"])
            rows.append({
                "tokens": tokens, "plain": p, "installed": q,
                "installed_over_plain": q["median_s"] / p["median_s"],
                "paired_ratio_median": statistics.median(
                    s / t for s, t in zip(times["installed"], times["plain"])),
                "bitwise_equal": bool(torch.equal(a, b)),
                "max_abs_diff": (a - b).abs().max().item(),
                "max_abs_diff_over_max_abs": ((a - b).abs().max() / a.abs().max()).item()})
        store.check_integrity()
    return rows


def markdown(result: dict) -> str:
    meta, s = result["meta"], result["settings"]
    ms = lambda v: f"{1000 * v:.3f}"  # noqa: E731
    lines = [
        "# AMOEBAs: FFN weight shards freed in place vs by copy", "",
        f"`{meta['command']}` at commit {meta['git']['commit']} (dirty: {meta['git']['dirty']})"
        f", {meta['machine']['cpu_model']}, {meta['machine']['cpu_cores']} cores, torch "
        f"threads {meta['machine']['torch_threads']}; load {meta['load_before']} -> "
        f"{meta['load_after']}.", "",
        f"{s['layers']} layers of intermediate {s['intermediate']}, hidden {s['hidden']}, "
        f"float32, degrees {s['degrees']}; member {s['rank']} keeps its shard of the largest "
        f"degree.", "",
        "## Transitions, per layer", "",
        "| variant | keep_shard ms (p10-p90) | restore ms (p10-p90) | freed MB | "
        "peak extra MB (keep / restore) | RSS drop / freed | RSS back / freed |",
        "|---|---:|---:|---:|---:|---:|---:|"]
    for t in result["transitions"]:
        k, r = t["keep_shard_per_layer"], t["restore_per_layer"]
        lines.append(
            f"| {t['variant']} | {ms(k['median_s'])} ({ms(k['p10_s'])}-{ms(k['p90_s'])}) | "
            f"{ms(r['median_s'])} ({ms(r['p10_s'])}-{ms(r['p90_s'])}) | "
            f"{t['freed_bytes_per_layer'] / 1e6:.2f} | "
            f"{t['peak_extra_bytes_keep_shard'] / 1e6:.2f} / "
            f"{t['peak_extra_bytes_restore'] / 1e6:.2f} | "
            f"{min(t['rss_drop_over_freed']):.3f} | {min(t['rss_back_over_freed']):.3f} |")
    lines += ["", "RSS ratios: the smallest over the repetitions. The copy variant frees through "
              "the C allocator, which gives a block back to the OS only when glibc's (adaptive) "
              "mmap threshold put it in its own mapping, so its RSS ratios vary between runs; "
              "the in-place variant's release is a page release."]
    lines += ["", "## Padding (Eq. 2), float32", "",
              "| case | I | hidden | degrees | page | I_pad | overhead bytes/layer (formula) | "
              "fraction | measured mapping overhead |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for p in result["padding"]:
        measured = "" if p["measured_overhead_bytes"] is None else p["measured_overhead_bytes"]
        lines.append(f"| {p['case']} | {p['intermediate']} | {p['hidden']} | {p['degrees']} | "
                     f"{p['page_bytes']} | {p['padded_intermediate']} | "
                     f"{p['overhead_bytes_per_layer']} | {p['overhead_fraction']:.4f} | "
                     f"{measured} |")
    lines += ["", "## FFN forward at TP 1: SGLang's LlamaMLP as loaded vs installed", "",
              f"{s['repeats']} alternated repetitions after {s['warmup']} warm-up.", "",
              "| tokens | plain ms (p10-p90) | installed ms (p10-p90) | installed / plain "
              "(medians) | paired ratio median | bitwise equal | max diff / max output |",
              "|---:|---:|---:|---:|---:|---|---:|"]
    for f in result["forward"]:
        p, q = f["plain"], f["installed"]
        lines.append(
            f"| {f['tokens']} | {ms(p['median_s'])} ({ms(p['p10_s'])}-{ms(p['p90_s'])}) | "
            f"{ms(q['median_s'])} ({ms(q['p10_s'])}-{ms(q['p90_s'])}) | "
            f"{f['installed_over_plain']:.3f} | {f['paired_ratio_median']:.3f} | "
            f"{f['bitwise_equal']} | {f['max_abs_diff_over_max_abs']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.amoebas.weights_cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--degrees", type=lambda v: tuple(int(d) for d in v.split(",")),
                    default=(1, 3), help="allowed degrees, comma-separated")
    ap.add_argument("--rank", type=int, default=1, help="the member whose shard is kept")
    ap.add_argument("--transition-repeats", type=int, default=5)
    ap.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")],
                    default=[1, 8, 64, 256], help="forward batch sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=200, help="forward repetitions per size")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/amoebas"))
    args = ap.parse_args(argv)
    if not 0 <= args.rank < max(args.degrees):
        ap.error(f"--rank {args.rank} is not a member of a group of {max(args.degrees)}")
    load_before = load_average()
    result = {
        "transitions": [measure_transitions(v, args) for v in (MappedFfnWeights,
                                                                CopiedFfnWeights)],
        "padding": measure_padding(args),
        "forward": measure_forward(args),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                     if k != "out"},
        "meta": run_meta(" ".join(["python -m benchmark.amoebas.weights_cost",
                                   *(sys.argv[1:] if argv is None else argv)]), load_before),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights_cost.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "weights_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
