"""iServe's estimates against measured full configurations.

    python -m sglang_morph.iserve profile --out P.json --bits 16            # fingerprints
    python -m sglang_morph.iserve profile --out P.json --bits 8 --append    # one run each
    python -m sglang_morph.iserve profile --out P.json --bits 16 --tp 1 --append \
        --full W16-TP1-PP1,W8-TP1-PP2 ...                                  # full configurations
    python -m benchmark.iserve.estimates --profile P.json --out-dir benchmark/results/iserve

Fits M2 and L2 on the profile's fingerprint records only, then compares every full record
(a ``--full`` configuration served and measured exactly like a fingerprint) with its estimate:
TTFT and TPOT per batch size, and each memory figure summed over the configuration's
processes. The profiling cost is the CPU-seconds of every server process (start-up included):
all fingerprints against the full configurations measured; for configurations not measured it
is projected from the measured ones' mean per process count (labelled as projected).

The selection check: for each intent, the configuration chosen from the estimates (the deploy
tool's own ``candidates`` and ``intents.rank``) against the best by the measured numbers, both
among the configurations measured in full, at each batch size of the workload and its longer
output length. The gap is the chosen one's measured value of the intent's objective over the
measured best's (0% when it is the best); a chosen configuration that the measurements find
infeasible is reported as such. The latency target and the budget are set at the median of the
measured values, so that about half of the configurations meet them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from sglang_morph.iserve import estimate, intents, space
from sglang_morph.iserve.__main__ import candidates, fingerprint_runs, load_profile
from sglang_morph.repo_data import REPO_ROOT as REPO


def shared_layout_records(records: list[dict], layout_bits: int) -> list[dict]:
    """The fingerprint records ``profile --layouts-at layout_bits`` would have measured (only
    that bit-width's TP t and PP 2 runs; TP1/PP1 at every bit-width) and every full record."""
    runs = {(cfg.name, n) for cfg, n in fingerprint_runs(
        tuple(sorted({r["bits"] for r in records}, reverse=True)),
        tuple(sorted({r["tp"] for r in records})),
        tuple(sorted({r["num_layers"] for r in records if r["kind"] == "fingerprint"
                      and r["pp"] == 1})), layout_bits)}
    return [r for r in records if r["kind"] == "full" or (r["config"], r["num_layers"]) in runs]


def cost_breakdown(records: list[dict]) -> list[dict]:
    """Where the profiling CPU-seconds went, per server: start-up (until ready) and the rest
    (warm-up and measured requests); records from before ``start_cpu_s`` have no split."""
    out = []
    for r in records:
        start = r.get("start_cpu_s")
        out.append({"kind": r["kind"], "config": r["config"], "num_layers": r["num_layers"],
                    "cpu_s": round(r["cpu_s"], 1), "wall_s": round(r["wall_s"], 1),
                    "start_cpu_s": None if start is None else round(start, 1),
                    "requests_cpu_s": None if start is None else round(r["cpu_s"] - start, 1)})
    return out


def latency_errors(record: dict, fits: estimate.ModelEstimates) -> list[dict]:
    """A full record's measured TTFT and TPOT per batch against L2's estimates, with the
    relative error of each (the fastest repetition, as ``estimate`` takes it)."""
    cfg = space.Configuration(record["bits"], record["tp"], record["pp"])
    rows = []
    for point in estimate.latency_points([record], record["bits"]):
        ttft, tpot = fits.latency_of(cfg, point.batch)
        rows.append({
            "batch": point.batch, "ttft_measured_s": point.ttft_s, "ttft_estimated_s": ttft,
            "ttft_error": abs(ttft - point.ttft_s) / point.ttft_s,
            "tpot_measured_s": point.tpot_s, "tpot_estimated_s": tpot,
            "tpot_error": abs(tpot - point.tpot_s) / point.tpot_s})
    return rows


def compare(profile_path: str, layouts_at: int | None = None) -> dict:
    profile = load_profile(profile_path)
    if layouts_at is not None:  # the same measurements, fewer fingerprints fitted and costed
        raw = {**profile.raw, "records": shared_layout_records(profile.raw["records"],
                                                               layouts_at)}
        fits = estimate.fit_records([r for r in raw["records"] if r["kind"] == "fingerprint"],
                                    raw["num_layers"], raw["embedding_bytes"])
        profile = dataclasses.replace(profile, raw=raw, estimates=fits)
    raw, fits = profile.raw, profile.estimates
    rows = []
    for r in raw["records"]:
        if r["kind"] != "full":
            continue
        cfg = space.Configuration(r["bits"], r["tp"], r["pp"])
        row = {"config": cfg.name, "cpu_s": r["cpu_s"], "start_s": r["start_s"],
               "load_average": r["load_average"], "latency": [], "memory": {}}
        row["latency"] = latency_errors(r, fits)
        est = fits.memory_of(cfg)
        for figure in estimate.MEMORY_FIGURES:
            values = [p[figure] for p in r["processes"]]
            if any(v is None for v in values):
                continue
            measured = float(sum(values))
            row["memory"][figure] = {"measured_bytes": measured,
                                     "estimated_bytes": est.total_bytes[figure],
                                     "error": abs(est.total_bytes[figure] - measured) / measured}
        accounted = [f for f in estimate.MEMORY_FIGURES if f != "rss_hwm_bytes"]
        if all(f in row["memory"] for f in accounted):  # the accounted memory, whole
            measured = sum(row["memory"][f]["measured_bytes"] for f in accounted)
            row["memory"]["accounted_bytes"] = {
                "measured_bytes": measured, "estimated_bytes": est.accounted_total_bytes,
                "error": abs(est.accounted_total_bytes - measured) / measured}
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
        "intents": intent_check(profile, full),
        "profile": str(profile_path), "sessions": raw.get("sessions"),
        "layouts_at": layouts_at,
        "workload": raw["workload"],
        "rows": rows,
        "mean_error": {"ttft": mean("ttft_error", "latency"), "tpot": mean("tpot_error", "latency"),
                       **{f: mean(f, "memory") for f in (*estimate.MEMORY_FIGURES,
                                                         "accounted_bytes")}},
        "profiling_cpu_s": {
            "fingerprints": fingerprint_cpu_s,
            "fingerprint_servers": sum(1 for r in raw["records"] if r["kind"] == "fingerprint"),
            "full_measured": sum(r["cpu_s"] for r in full),
            "full_measured_configs": sorted(measured_names),
            "all_servable_full_projected": projected,
            "servable_configs": len(servable),
            "ratio_projected_full_over_fingerprints": (projected / fingerprint_cpu_s
                                                       if projected else None),
            "per_server": cost_breakdown(raw["records"])},
    }


REQUESTS = 1000  # device-hours: the time to serve this many requests in batches


def _measured_candidate(record: dict, batch: int, output_tokens: int,
                        quality: dict[int, float]) -> intents.Candidate | None:
    """A full record's measured numbers in the form the intents rank (RSS high-water mark,
    the deploy tool's default memory figure)."""
    cfg = space.Configuration(record["bits"], record["tp"], record["pp"])
    point = next((p for p in estimate.latency_points([record], record["bits"])
                  if p.batch == batch), None)
    if point is None:
        return None
    rss = [p["rss_hwm_bytes"] for p in record["processes"]]
    return intents.Candidate.of(cfg, point.ttft_s, point.tpot_s, float(sum(rss)),
                                float(max(rss)), quality.get(cfg.bits), batch, output_tokens,
                                REQUESTS)


def _objective(c: intents.Candidate, spec: intents.IntentSpec) -> float:
    return intents.INTENTS[spec.name](c, spec)[0]


def intent_check(profile, full: list[dict]) -> list[dict]:
    quality = intents.perplexity_by_bits()
    output_tokens = max(profile.raw["workload"]["output_tokens"])
    rows = []
    for batch in profile.raw["workload"]["batches"]:
        measured = {c.cfg.name: c for c in (_measured_candidate(r, batch, output_tokens, quality)
                                            for r in full) if c is not None}
        if len(measured) < 2:
            continue
        estimated = [c for c in candidates(profile, batch, output_tokens, REQUESTS, "rss",
                                           quality)[0] if c.cfg.name in measured]
        values = list(measured.values())
        median = {k: statistics.median(getattr(c, k) for c in values)
                  for k in ("ttft_s", "tpot_s", "memory_bytes")}
        specs = [intents.IntentSpec("min-latency")]
        specs += [intents.IntentSpec("min-cost", cost=cost) for cost in intents.COSTS]
        specs += [intents.IntentSpec("latency-target", ttft_slo_s=median["ttft_s"],
                                     tpot_slo_s=median["tpot_s"]),
                  intents.IntentSpec("cost-budget", max_memory_bytes=median["memory_bytes"]),
                  intents.IntentSpec("min-latency", max_perplexity=30.0)]
        for spec in specs:
            chosen = next((c for c, why in intents.rank(estimated, spec) if why is None), None)
            best = next((c for c, why in intents.rank(values, spec) if why is None), None)
            row = {"batch": batch, "intent": spec.name, "cost": spec.cost,
                   "limits": {k: v for k, v in dataclasses.asdict(spec).items()
                              if k not in ("name", "cost") and v is not None},
                   "chosen": chosen.cfg.name if chosen else None,
                   "measured_best": best.cfg.name if best else None}
            if chosen and best:
                got = measured[chosen.cfg.name]
                row["chosen_infeasible_measured"] = intents.infeasibility(got, spec)
                row["gap"] = _objective(got, spec) / _objective(best, spec) - 1
            rows.append(row)
    return rows


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
    lines += ["", "| batch | intent | limits | chosen (estimates) | measured best | gap | "
              "chosen feasible when measured |", "|---:|---|---|---|---|---:|---|"]
    for x in result["intents"]:
        intent = x["intent"] + (f" ({x['cost']})" if x["intent"] in ("min-cost", "latency-target")
                                else "")
        limits = ", ".join(f"{k} {v:.4g}" for k, v in x["limits"].items()) or "-"
        gap = f"{x['gap']:.1%}" if "gap" in x else "-"
        feasible = ("-" if "gap" not in x else
                    "yes" if x["chosen_infeasible_measured"] is None
                    else f"no: {x['chosen_infeasible_measured']}")
        lines.append(f"| {x['batch']} | {intent} | {limits} | {x['chosen']} | "
                     f"{x['measured_best']} | {gap} | {feasible} |")
    cost = {k: v for k, v in result["profiling_cpu_s"].items() if k != "per_server"}
    lines += ["", "Mean errors: " + ", ".join(
        f"{k} {v:.1%}" for k, v in result["mean_error"].items() if v is not None), "",
        "Profiling CPU-seconds: " + json.dumps(cost), "",
        "| server | layers | CPU-s | start-up CPU-s | requests CPU-s | wall s |",
        "|---|---:|---:|---:|---:|---:|"]
    for x in result["profiling_cpu_s"]["per_server"]:
        lines.append(f"| {x['kind']} {x['config']} | {x['num_layers']} | {x['cpu_s']} | "
                     f"{x['start_cpu_s'] if x['start_cpu_s'] is not None else '-'} | "
                     f"{x['requests_cpu_s'] if x['requests_cpu_s'] is not None else '-'} | "
                     f"{x['wall_s']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.iserve.estimates",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out-dir", default=str(REPO / "benchmark/results/iserve"))
    parser.add_argument("--layouts-at", type=int, metavar="BITS",
                        help="also fit and cost only the fingerprints `profile --layouts-at "
                        "BITS` runs (written to estimates_vs_measured_layouts_at_BITS.*)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    variants = [(None, "estimates_vs_measured")]
    if args.layouts_at is not None:
        variants.append((args.layouts_at, f"estimates_vs_measured_layouts_at_{args.layouts_at}"))
    for layouts_at, name in variants:
        result = compare(args.profile, layouts_at)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(markdown(result))
        print(f"## {name}\n\n{markdown(result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
