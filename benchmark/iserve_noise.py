"""How much one server launch differs from the next, and what that does to L2's error (issue 14).

    python -m benchmark.iserve_noise measure --launches 5 --out DIR \
        --runs W16-TP1-PP1,W16-TP1-PP1@16,W16-TP1-PP1@8,W16-TP3-PP1      (~20 min)
    python -m benchmark.iserve_noise floor --noise DIR/noise.json \
        --profile benchmark/results/iserve/grid_19605d6/profile.json      (seconds)

``measure`` serves each run (a full configuration, or ``CONFIG@N`` for the N-layer fingerprint)
``--launches`` times, interleaved (run A, run B, ..., then A again), every launch measured
exactly as ``deploy profile`` measures (``measure.measure_server``, the grid's streamed
workload) and scored as ``estimate`` scores it (the fastest of the repetitions). Per run,
batch and phase: the values across launches, their coefficient of variation and their mean
absolute deviation from their mean (what an exact estimate would be off by, on average,
against one launch), next to the spread of the repetitions within a launch.

``floor`` asks what L2's mean error would be if its model were exactly right: it takes the
profile's own fit as the truth, draws every fingerprint record's and every full
configuration's measurement as the truth times one factor per launch and phase (normal, the
coefficient of variation ``measure`` found for fingerprints and for full configurations), refits
L2 on the drawn fingerprints exactly as ``deploy`` does, and scores the estimates against the
drawn full measurements as ``benchmark.iserve`` does. Reported per phase: the mean error's
median and 5-95% range over the trials, with noise on both sides, on the references only (an
exact estimate against one launch) and on the fingerprints only (what the extrapolation does to
their noise).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from sglang_morph.deploy import estimate, space
from sglang_morph.deploy.measure import Workload, measure_server

REPO = Path(__file__).resolve().parents[1]
PHASES = ("ttft", "tpot")
# The grid's workload (benchmark/iserve_grid.sh): the measurements the error tables score.
GRID_WORKLOAD = Workload(prompt_tokens=128, output_tokens=(64,), batches=(1, 4), repetitions=3,
                         kv_tokens=4096, timing="stream")


def parse_run(text: str, num_layers: int) -> tuple[space.Configuration, int, str]:
    name, _, depth = text.strip().partition("@")
    try:
        cfg = space.Configuration.parse(name)
        layers = int(depth) if depth else num_layers
    except ValueError:
        raise SystemExit(f"error: run {text!r}: expected e.g. W16-TP1-PP1 or W16-TP1-PP1@16")
    if not 1 <= layers <= num_layers:
        raise SystemExit(f"error: run {text!r}: depth must be 1..{num_layers}")
    return cfg, layers, "full" if layers == num_layers else "fingerprint"


def launch_values(record: dict) -> dict:
    """``{(batch, phase): (fastest repetition, [repetitions])}`` of one measured launch."""
    out = {}
    for point in record["latency"]:
        for phase in PHASES:
            reps = point[f"{phase}_s"]
            out[(point["batch"], phase)] = (min(reps), reps)
    return out


def spread(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for run, records in runs.items():
        per_launch = [launch_values(r) for r in records]
        for key in sorted(per_launch[0]):
            values = [v[key][0] for v in per_launch]
            mean = statistics.mean(values)
            within = [statistics.pstdev(v[key][1]) / statistics.mean(v[key][1])
                      for v in per_launch]
            rows.append({
                "run": run, "kind": records[0]["kind"], "batch": key[0], "phase": key[1],
                "values_s": values, "mean_s": mean,
                "cv": statistics.stdev(values) / mean if len(values) > 1 else None,
                "mean_abs_dev": statistics.mean(abs(v - mean) for v in values) / mean,
                "range": (max(values) - min(values)) / mean,
                "within_launch_cv": statistics.mean(within)})
    return rows


def cmd_measure(args) -> dict:
    from sglang_morph.deploy.fingerprint import make_fingerprint
    from sglang_morph.models import default_model_path
    from sglang_morph.plan.__main__ import default_engines

    model_dir = default_model_path()
    engines = default_engines(model_dir)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    runs = [parse_run(r, num_layers) for r in args.runs.split(",") if r.strip()]
    if not runs or args.launches < 2:
        raise SystemExit("error: need at least one run and --launches >= 2")
    out_dir = Path(args.out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    result = {"workload": dataclasses.asdict(GRID_WORKLOAD),
              "launches": args.launches, "started_unix_s": time.time(),
              "load_average_at_start": list(os.getloadavg()), "runs": {}}
    for launch in range(args.launches):
        for cfg, layers, kind in runs:
            name = cfg.name if kind == "full" else f"{cfg.name}@{layers}"
            if kind == "fingerprint":
                fp = make_fingerprint(model_dir, engines, layers)
                served, served_engines = fp.model_dir, fp.engines_dir
            else:
                served, served_engines = model_dir, engines
            print(f"noise: launch {launch + 1}/{args.launches} {name}", file=sys.stderr,
                  flush=True)
            record = measure_server(cfg, served, served_engines, layers, GRID_WORKLOAD,
                                    out_dir / "logs" / f"{name}-{launch}.log", kind)
            record["launch"], record["ended_unix_s"] = launch, time.time()
            result["runs"].setdefault(name, []).append(record)
            (out_dir / "noise.json").write_text(json.dumps(result, indent=1))
    result["ended_unix_s"] = time.time()
    result["spread"] = spread(result["runs"])
    (out_dir / "noise.json").write_text(json.dumps(result, indent=1))
    (out_dir / "noise.md").write_text(spread_markdown(result["spread"]))
    return {"out": str(out_dir / "noise.json"), "spread": result["spread"]}


def spread_markdown(rows: list[dict]) -> str:
    lines = ["| run | batch | phase | per launch (fastest repetition) | CV | mean abs. dev. | "
             "range | CV within a launch |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        unit, scale = ("ms", 1000)
        values = ", ".join(f"{v * scale:.1f}" for v in r["values_s"])
        lines.append(f"| {r['run']} | {r['batch']} | {r['phase']} | {values} {unit} | "
                     f"{r['cv']:.1%} | {r['mean_abs_dev']:.1%} | {r['range']:.1%} | "
                     f"{r['within_launch_cv']:.1%} |")
    return "\n".join(lines) + "\n"


# ---- the floor ----------------------------------------------------------------------------


def launch_cv(noise: dict) -> dict[tuple[str, str], float]:
    """Pooled coefficient of variation per (kind, phase): the root mean square of the runs'."""
    pooled: dict[tuple[str, str], list[float]] = {}
    for r in noise["spread"]:
        pooled.setdefault((r["kind"], r["phase"]), []).append(r["cv"])
    return {k: float(np.sqrt(np.mean(np.square(v)))) for k, v in pooled.items()}


def _fingerprint_truth(fits: estimate.ModelEstimates, record: dict, batch: int,
                       phase: str) -> float:
    return fits.latency[record["bits"]][record["tp"]].seconds(
        phase, record["num_layers"], batch, record["pp"])


def _draw(records: list[dict], truth, cv: dict[str, float], rng) -> list[dict]:
    """Copies of ``records`` whose every repetition is the truth times one factor per record
    (launch) and phase, shared by its batch sizes (a slow launch is slow at both)."""
    out = []
    for r in records:
        r = copy.deepcopy(r)
        factor = {phase: max(0.05, 1 + cv[phase] * rng.standard_normal()) for phase in PHASES}
        for point in r["latency"]:
            for phase in PHASES:
                value = truth(r, point["batch"], phase) * factor[phase]
                point[f"{phase}_s"] = [value] * len(point[f"{phase}_s"])
        out.append(r)
    return out


def cmd_floor(args) -> dict:
    noise = json.loads(Path(args.noise).read_text())
    profile = json.loads(Path(args.profile).read_text())
    cv = launch_cv(noise)
    records = profile["records"]
    fps = [r for r in records if r["kind"] == "fingerprint"]
    full = [r for r in records if r["kind"] == "full"]
    if not fps or not full:
        raise SystemExit(f"error: {args.profile} needs fingerprint and full records")
    fit = lambda rs: estimate.fit_records(rs, profile["num_layers"], profile["embedding_bytes"])
    truth_fits = fit(fps)

    def full_truth(r, batch, phase):
        t = truth_fits.latency_of(space.Configuration(r["bits"], r["tp"], r["pp"]), batch)
        return t[PHASES.index(phase)]

    rng = np.random.default_rng(args.seed)
    zero = {p: 0.0 for p in PHASES}
    cases = {"both": ({p: cv[("fingerprint", p)] for p in PHASES},
                      {p: cv[("full", p)] for p in PHASES}),
             "references_only": (zero, {p: cv[("full", p)] for p in PHASES}),
             "fingerprints_only": ({p: cv[("fingerprint", p)] for p in PHASES}, zero)}
    out = {"profile": args.profile, "noise": args.noise, "trials": args.trials,
           "launch_cv": {f"{k}/{p}": v for (k, p), v in cv.items()}, "cases": {}}
    for case, (fp_cv, full_cv) in cases.items():
        errors = {p: [] for p in PHASES}
        for _ in range(args.trials):
            drawn_fits = fit(_draw(fps, lambda r, b, p: _fingerprint_truth(truth_fits, r, b, p),
                                   fp_cv, rng))
            trial = {p: [] for p in PHASES}
            for r in _draw(full, full_truth, full_cv, rng):
                cfg = space.Configuration(r["bits"], r["tp"], r["pp"])
                for point in estimate.latency_points([r], r["bits"]):
                    est = drawn_fits.latency_of(cfg, point.batch)
                    for i, phase in enumerate(PHASES):
                        measured = point.ttft_s if phase == "ttft" else point.tpot_s
                        trial[phase].append(abs(est[i] - measured) / measured)
            for phase in PHASES:
                errors[phase].append(statistics.mean(trial[phase]))
        out["cases"][case] = {phase: {"median": float(np.median(v)),
                                      "p5": float(np.percentile(v, 5)),
                                      "p95": float(np.percentile(v, 95)),
                                      "share_under_5pct": float(np.mean(np.array(v) < 0.05))}
                              for phase, v in errors.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--runs", default="W16-TP1-PP1,W16-TP1-PP1@16,W16-TP1-PP1@8,W16-TP3-PP1")
    m.add_argument("--launches", type=int, default=5)
    m.add_argument("--out", required=True)
    f = sub.add_parser("floor")
    f.add_argument("--noise", required=True)
    f.add_argument("--profile", required=True)
    f.add_argument("--trials", type=int, default=300)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out")
    args = parser.parse_args(argv)
    result = cmd_measure(args) if args.cmd == "measure" else cmd_floor(args)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
