"""iServe's estimates against measured full configurations (issue 14).

    python -m sglang_morph.deploy profile --out P.json --bits 16            # fingerprints
    python -m sglang_morph.deploy profile --out P.json --bits 8 --append    # ... per session
    python -m sglang_morph.deploy profile --out P.json --bits 16 --tp 1 --append \
        --full W16-TP1-PP1,W8-TP1-PP2 ...                                  # full configurations
    python -m benchmark.iserve --profile P.json --out-dir benchmark/results/iserve

Fits M2 and L2 on the profile's fingerprint records only, then compares every full record
(a ``--full`` configuration served and measured exactly like a fingerprint) with its estimate:
TTFT and TPOT per batch size, and each memory figure summed over the configuration's
processes. The profiling cost is the CPU-seconds of every server process (start-up included):
all fingerprints against the full configurations measured; for configurations not measured it
is projected from the measured ones' mean per process count (labelled as projected).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from sglang_morph.deploy import estimate, space
from sglang_morph.deploy.__main__ import load_profile

REPO = Path(__file__).resolve().parents[1]


def compare(profile_path: str) -> dict:
    profile = load_profile(profile_path)
    raw, fits = profile.raw, profile.estimates
    rows = []
    for r in raw["records"]:
        if r["kind"] != "full":
            continue
        cfg = space.Configuration(r["bits"], r["tp"], r["pp"])
        row = {"config": cfg.name, "cpu_s": r["cpu_s"], "start_s": r["start_s"],
               "load_average": r["load_average"], "latency": [], "memory": {}}
        for point in estimate.latency_points([r], r["bits"]):
            ttft, tpot = fits.latency_of(cfg, point.batch)
            row["latency"].append({
                "batch": point.batch, "ttft_measured_s": point.ttft_s, "ttft_estimated_s": ttft,
                "ttft_error": abs(ttft - point.ttft_s) / point.ttft_s,
                "tpot_measured_s": point.tpot_s, "tpot_estimated_s": tpot,
                "tpot_error": abs(tpot - point.tpot_s) / point.tpot_s})
        est = fits.memory_of(cfg)
        for figure in estimate.MEMORY_FIGURES:
            values = [p[figure] for p in r["processes"]]
            if any(v is None for v in values):
                continue
            measured = float(sum(values))
            row["memory"][figure] = {"measured_bytes": measured,
                                     "estimated_bytes": est.total_bytes[figure],
                                     "error": abs(est.total_bytes[figure] - measured) / measured}
        rows.append(row)

    def mean(key, group):
        values = [x[key] for r in rows for x in r[group]] if group == "latency" else \
            [r["memory"][key]["error"] for r in rows if key in r["memory"]]
        return statistics.mean(values) if values else None

    fingerprint_cpu_s = sum(r["cpu_s"] for r in raw["records"] if r["kind"] == "fingerprint")
    full = [r for r in raw["records"] if r["kind"] == "full"]
    servable = [c for c in space.space() if space.exclusion_reason(c, profile.hf_config) is None]
    per_process = statistics.mean(r["cpu_s"] / (r["tp"] * r["pp"]) for r in full) if full \
        else None
    measured_names = {r["config"] for r in full}
    projected = sum(r["cpu_s"] for r in full) + sum(
        per_process * c.processes for c in servable if c.name not in measured_names) \
        if full else None
    return {
        "profile": str(profile_path), "sessions": raw.get("sessions"),
        "workload": raw["workload"],
        "rows": rows,
        "mean_error": {"ttft": mean("ttft_error", "latency"), "tpot": mean("tpot_error", "latency"),
                       **{f: mean(f, "memory") for f in estimate.MEMORY_FIGURES}},
        "profiling_cpu_s": {
            "fingerprints": fingerprint_cpu_s,
            "fingerprint_servers": sum(1 for r in raw["records"] if r["kind"] == "fingerprint"),
            "full_measured": sum(r["cpu_s"] for r in full),
            "full_measured_configs": sorted(measured_names),
            "all_servable_full_projected": projected,
            "servable_configs": len(servable),
            "ratio_projected_full_over_fingerprints": (projected / fingerprint_cpu_s
                                                       if projected else None)},
    }


def markdown(result: dict) -> str:
    lines = ["| config | batch | TTFT meas. s | TTFT est. s | err | TPOT meas. s | TPOT est. s | "
             "err |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        for x in r["latency"]:
            lines.append(f"| {r['config']} | {x['batch']} | {x['ttft_measured_s']:.3f} | "
                         f"{x['ttft_estimated_s']:.3f} | {x['ttft_error']:.1%} | "
                         f"{x['tpot_measured_s']:.4f} | {x['tpot_estimated_s']:.4f} | "
                         f"{x['tpot_error']:.1%} |")
    lines += ["", "| config | figure | measured MB | estimated MB | err |",
              "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        for figure, m in r["memory"].items():
            lines.append(f"| {r['config']} | {figure} | {m['measured_bytes'] / 1e6:.1f} | "
                         f"{m['estimated_bytes'] / 1e6:.1f} | {m['error']:.1%} |")
    lines += ["", "Mean errors: " + ", ".join(
        f"{k} {v:.1%}" for k, v in result["mean_error"].items() if v is not None), "",
        "Profiling CPU-seconds: " + json.dumps(result["profiling_cpu_s"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out-dir", default=str(REPO / "benchmark/results/iserve"))
    args = parser.parse_args(argv)
    result = compare(args.profile)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimates_vs_measured.json").write_text(json.dumps(result, indent=1))
    (out / "estimates_vs_measured.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
