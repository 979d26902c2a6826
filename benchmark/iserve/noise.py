"""How much one server launch differs from the next, and what that does to L2's error.

    python -m benchmark.iserve.noise measure --launches 5 --out DIR \
        --runs W16-TP1-PP1,W16-TP1-PP1@16,W16-TP1-PP1@8,W16-TP3-PP1      (~20 min)
    python -m benchmark.iserve.noise report --noise DIR/noise.json        (rewrites noise.md)
    python -m benchmark.iserve.noise floor --noise DIR/noise.json \
        --profile benchmark/results/iserve/grid_19605d6/profile.json --out F.json   (seconds)

``measure`` serves each run (a full configuration, or ``CONFIG@N`` for the N-layer fingerprint)
``--launches`` times, interleaved (run A, run B, ..., then A again), every launch measured
exactly as ``iserve profile`` measures (``measure.measure_server``, the grid's streamed
workload) and scored as ``estimate`` scores it (the fastest of the repetitions). Per run,
batch and phase: the values across launches, their coefficient of variation and their mean
absolute deviation from their mean (what an exact estimate would be off by, on average,
against one launch), next to the spread of the repetitions within a launch. And L2 launch by
launch (``paired``): where a full PP 1 configuration ran beside two of its fingerprint depths,
the estimate fitted on launch i's fingerprints alone against launch i's full measurement, so
that the error L2 makes is seen without any model of the noise.

``floor`` asks what L2's mean error would be if its model were exactly right: it takes the
profile's own fit as the truth, draws every fingerprint record's and every full
configuration's measurement as the truth times one factor per launch and phase (normal, the
coefficient of variation ``measure`` found for fingerprints and for full configurations), refits
L2 on the drawn fingerprints exactly as ``iserve`` does, and scores the estimates against the
drawn full measurements as ``benchmark.iserve.estimates`` does. Reported per phase: the mean error's
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

from sglang_morph.iserve import estimate, space
from sglang_morph.iserve.measure import Workload, measure_server

PHASES = ("ttft", "tpot")
# The grid's workload (benchmark/iserve/grid.sh): the measurements the error tables score.
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


def paired(runs: dict[str, list[dict]]) -> list[dict]:
    """L2 launch by launch: for every full PP 1 run measured beside two fingerprint depths of
    its configuration, the estimate fitted on launch i's fingerprints alone (``estimate``'s
    TP 1 line, exactly as ``iserve`` fits it) against launch i's full measurement."""
    rows = []
    for name, full in runs.items():
        if full[0]["kind"] != "full" or full[0]["pp"] != 1:
            continue
        depths = sorted(int(k.partition("@")[2]) for k in runs if k.startswith(f"{name}@"))
        if len(depths) < 2:
            continue
        for launch, record in enumerate(full):
            fps = [runs[f"{name}@{n}"][launch] for n in depths
                   if launch < len(runs[f"{name}@{n}"])]
            if len(fps) < 2:
                continue
            fit = estimate.fit_latency(estimate.latency_points(fps, record["bits"]),
                                       record["tp"])
            for point in estimate.latency_points([record], record["bits"]):
                for phase in PHASES:
                    measured = point.ttft_s if phase == "ttft" else point.tpot_s
                    est = fit.seconds(phase, record["num_layers"], point.batch, 1)
                    rows.append({"config": name, "fingerprint_layers": depths,
                                 "launch": launch, "batch": point.batch, "phase": phase,
                                 "estimated_s": est, "measured_s": measured,
                                 "error": est / measured - 1})
    return rows


def report(result: dict) -> str:
    result["spread"] = spread(result["runs"])
    result["paired"] = paired(result["runs"])
    md = spread_markdown(result["spread"])
    if result["paired"]:
        md += ("\nL2 launch by launch (fitted on the launch's own fingerprints, against the "
               "same launch's full configuration):\n\n| config | launch | batch | phase | "
               "estimated ms | measured ms | error |\n|---|---:|---:|---|---:|---:|---:|\n")
        for r in result["paired"]:
            md += (f"| {r['config']} | {r['launch']} | {r['batch']} | {r['phase']} | "
                   f"{r['estimated_s'] * 1000:.1f} | {r['measured_s'] * 1000:.1f} | "
                   f"{r['error']:+.1%} |\n")
        for phase in PHASES:
            errors = [r["error"] for r in result["paired"] if r["phase"] == phase]
            md += (f"\n{phase}: mean |error| {statistics.mean(map(abs, errors)):.1%}, signed "
                   f"mean {statistics.mean(errors):+.1%}, per launch and batch "
                   f"{min(errors):+.1%} to {max(errors):+.1%}")
        md += "\n"
    return md


def cmd_report(args) -> dict:
    path = Path(args.noise)
    result = json.loads(path.read_text())
    md = report(result)
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(md)
    return {"out": str(path.with_suffix(".md")), "paired": result["paired"]}


def cmd_measure(args) -> dict:
    from sglang_morph.iserve.fingerprint import make_fingerprint
    from sglang_morph.models import default_model_path
    from sglang_morph.cli import default_engines

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
    md = report(result)
    (out_dir / "noise.json").write_text(json.dumps(result, indent=1))
    (out_dir / "noise.md").write_text(md)
    return {"out": str(out_dir / "noise.json"), "spread": result["spread"]}


def spread_markdown(rows: list[dict]) -> str:
    lines = ["| run | batch | phase | per launch (fastest repetition) | CV | mean abs. dev. | "
             "range | CV within a launch |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        values = ", ".join(f"{v * 1000:.1f}" for v in r["values_s"])
        lines.append(f"| {r['run']} | {r['batch']} | {r['phase']} | {values} ms | "
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


def _hf_config(raw: dict) -> dict:
    path = Path(raw["model_dir"]) / "config.json"
    if not path.is_file():  # profiled elsewhere: the profiles kept here are the default model's
        from sglang_morph.models import default_model_path

        path = default_model_path() / "config.json"
    return json.loads(path.read_text())


INTENT_GAP = 0.05  # iServe's target: the chosen configuration within 5% of the measured best


def mean_errors(raw: dict, fp_cv: dict[str, float], full_cv: dict[str, float], trials: int,
                rng) -> dict[str, list[float]]:
    """Per trial: L2's mean error per phase (over the profile's full configurations and
    batches), the profile's own fit being the truth (see the module docstring), and how many
    of ``benchmark.iserve.estimates``'s intent choices land within ``INTENT_GAP`` of the drawn
    measurements' best (``intents_within``, of ``intents``)."""
    from benchmark.iserve.estimates import intent_check, latency_errors
    from sglang_morph.iserve.__main__ import Profile

    fps = [r for r in raw["records"] if r["kind"] == "fingerprint"]
    full = [r for r in raw["records"] if r["kind"] == "full"]
    if not fps or not full:
        raise ValueError("the profile needs fingerprint and full records")
    hf_config = _hf_config(raw)

    def fit(records):
        return estimate.fit_records(records, raw["num_layers"], raw["embedding_bytes"])

    truth = fit(fps)

    def fingerprint_truth(r, batch, phase):
        return truth.latency[r["bits"]][r["tp"]].seconds(phase, r["num_layers"], batch, r["pp"])

    def full_truth(r, batch, phase):
        cfg = space.Configuration(r["bits"], r["tp"], r["pp"])
        return truth.latency_of(cfg, batch)[PHASES.index(phase)]

    out: dict[str, list[float]] = {p: [] for p in (*PHASES, "intents_within", "intents")}
    for _ in range(trials):
        drawn_fps = _draw(fps, fingerprint_truth, fp_cv, rng)
        drawn = fit(drawn_fps)
        drawn_full = _draw(full, full_truth, full_cv, rng)
        rows = [x for r in drawn_full for x in latency_errors(r, drawn)]
        for phase in PHASES:
            out[phase].append(statistics.mean(x[f"{phase}_error"] for x in rows))
        # A profile of the drawn records (on no disk: nothing reads its path).
        profile = Profile(Path("drawn.json"),
                          {**raw, "records": drawn_fps + drawn_full}, drawn, hf_config)
        choices = intent_check(profile, drawn_full)
        out["intents"].append(len(choices))
        out["intents_within"].append(sum(
            1 for x in choices if "gap" in x and x["gap"] <= INTENT_GAP
            and x["chosen_infeasible_measured"] is None))
    return out


def _summary(values: list[float]) -> dict[str, float]:
    v = np.asarray(values, np.float64)
    return {"median": float(np.median(v)), "mean": float(v.mean()),
            "p5": float(np.percentile(v, 5)), "p95": float(np.percentile(v, 95))}


def cmd_floor(args) -> dict:
    noise = json.loads(Path(args.noise).read_text())
    raw = json.loads(Path(args.profile).read_text())
    cv = launch_cv(noise)
    rng = np.random.default_rng(args.seed)
    fp_cv = {p: cv[("fingerprint", p)] for p in PHASES}
    full_cv = {p: cv[("full", p)] for p in PHASES}
    zero = {p: 0.0 for p in PHASES}
    out = {"profile": args.profile, "noise": args.noise, "trials": args.trials,
           "seed": args.seed, "launch_cv": {f"{k}/{p}": v for (k, p), v in cv.items()},
           "cases": {}}
    for case, (a, b) in {"both": (fp_cv, full_cv), "references_only": (zero, full_cv),
                         "fingerprints_only": (fp_cv, zero)}.items():
        got = mean_errors(raw, a, b, args.trials, rng)
        out["cases"][case] = {
            **{phase: {**_summary(got[phase]),
                       "share_under_5pct": float(np.mean(np.asarray(got[phase]) < 0.05))}
               for phase in PHASES},
            "intents": int(max(got["intents"])),
            "intents_within": _summary(got["intents_within"])}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.iserve.noise",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--runs", default="W16-TP1-PP1,W16-TP1-PP1@16,W16-TP1-PP1@8,W16-TP3-PP1")
    m.add_argument("--launches", type=int, default=5)
    m.add_argument("--out", required=True)
    r = sub.add_parser("report", help="rewrite NOISE.md (spread, L2 launch by launch)")
    r.add_argument("--noise", required=True)
    f = sub.add_parser("floor")
    f.add_argument("--noise", required=True)
    f.add_argument("--profile", required=True)
    f.add_argument("--trials", type=int, default=300)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out")
    args = parser.parse_args(argv)
    result = {"measure": cmd_measure, "report": cmd_report, "floor": cmd_floor}[args.cmd](args)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
