"""iServe's fingerprints inside one server, scored against full configurations launched
several times.

    # fingerprints: one launch per layout, depths set at runtime, bit-widths swapped in
    python -m sglang_morph.iserve profile --in-server --out P.json --layers 8,16 \
        --timing stream --output 64 --batches 1,4 --layouts-at 16
    # ground truth: every servable full configuration, 3 rounds, interleaved
    FINGERPRINTS=0 ROUNDS=3 benchmark/iserve/grid.sh TRUTH
    python -m benchmark.iserve.in_server score --profile P.json \
        --memory-from M.json --truth TRUTH/round1 TRUTH/round2 TRUTH/round3 --out DIR
    # per-layer cost against depth, one launch (the systematic part of L2's error)
    python -m benchmark.iserve.in_server sweep --out DIR --depths 2,4,8,12,16,20,24,28,30

``score``: L2 is fitted on the profile's fingerprint records only; each full configuration's
truth is the mean over the rounds of each round's fastest repetition (the number ``estimate``
takes from one launch), with its spread (min-max and the coefficient of variation over the
rounds). Errors are reported against the mean and, for comparison, against each round alone.
The profiling cost is the CPU-seconds of every server process, start-up included, of the
fingerprint launches, against those of launching every full configuration once (each round's
total; both measured). M2 is not measured inside one server (a launch holds every layer, so its
memory does not change with the depth set): ``--memory-from`` takes the memory records of a
profile of truncated fingerprints, and their CPU-seconds are reported apart. The intents are
checked as ``benchmark.iserve.estimates`` checks them, against the truth's means.

``sweep``: TTFT and TPOT of one launch (TP1/PP1) at every depth given, one bit-width after the
other, and the residuals of the line through all of them: a depth-dependent cost per layer
shows as a curve.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmark.iserve.estimates import intent_check, latency_errors, shared_layout_records
from sglang_morph.iserve import estimate, space
from sglang_morph.iserve.__main__ import Profile, add_record, git_commit
from sglang_morph.iserve.measure import Workload, measure_in_server
from sglang_morph.models import default_model_path


def _cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


def truth_records(round_profiles: list[dict]) -> tuple[list[dict], list[dict]]:
    """One record per full configuration measured in every round, whose TTFT and TPOT per
    batch are the mean over the rounds of each round's fastest repetition (``estimate``'s
    number) and whose memory figures are the rounds' means; and the spread of each."""
    by_config: dict[str, list[dict]] = {}
    for profile in round_profiles:
        for r in profile["records"]:
            if r["kind"] == "full":
                by_config.setdefault(r["config"], []).append(r)
    records, spread = [], []
    for name, rounds in sorted(by_config.items()):
        if len(rounds) != len(round_profiles):
            continue  # not measured in every round: no mean to score against
        mean = copy.deepcopy(rounds[0])
        per_round = [{p.batch: p for p in estimate.latency_points([r], r["bits"])}
                     for r in rounds]
        for j, point in enumerate(mean["latency"]):
            batch = point["batch"]
            ttfts = [pr[batch].ttft_s for pr in per_round]
            tpots = [pr[batch].tpot_s for pr in per_round]
            # The mean as the only repetition: latency_points takes its minimum.
            point["ttft_s"], point["tpot_s"] = [statistics.mean(ttfts)], [statistics.mean(tpots)]
            point["e2e_s"] = [statistics.mean(min(r["latency"][j]["e2e_s"]) for r in rounds)]
            spread.append({"config": name, "batch": batch, "ttft_s": ttfts, "tpot_s": tpots,
                           "ttft_cv": _cv(ttfts), "tpot_cv": _cv(tpots)})
        for i, process in enumerate(mean["processes"]):
            for key, value in process.items():
                if key not in ("pp_rank", "tp_rank") and value is not None:
                    process[key] = statistics.mean(r["processes"][i][key] for r in rounds)
        mean["cpu_s"] = statistics.mean(r["cpu_s"] for r in rounds)
        records.append(mean)
    return records, spread


def truth_cv_mean(spread: list[dict]) -> dict[str, float]:
    """The truth's coefficient of variation over the rounds (``truth_records``' spread), mean
    over configurations and batches."""
    return {phase: statistics.mean(s[f"{phase}_cv"] for s in spread)
            for phase in ("ttft", "tpot")}


def _fits(fingerprints: list[dict], memory_records: list[dict], raw: dict
          ) -> estimate.ModelEstimates:
    """L2 from the profile's fingerprints, M2 from ``--memory-from``'s (each fitted alone, with
    its own layouts borrowed as ``estimate.fit_records`` borrows them)."""
    latency = estimate.fit_records(fingerprints, raw["num_layers"], raw["embedding_bytes"])
    if not memory_records:
        return latency
    # (with their own latency: which layouts a bit-width borrows follows its fingerprints)
    memory = estimate.fit_records(memory_records, raw["num_layers"], raw["embedding_bytes"])
    unfitted = {b: why for b, why in latency.unfitted.items() if why.startswith("latency")}
    unfitted.update({b: why for b, why in memory.unfitted.items() if why.startswith("memory")})
    return dataclasses.replace(latency, memory=memory.memory, unfitted=unfitted)


def score(profile_path: str, truth_dirs: list[str], memory_from: str | None,
          layouts_at: int | None = None, raw: dict | None = None) -> dict:
    """``raw``: the profile's contents when they differ from the file's (``noise`` scores a
    profile rescaled to another window's speed)."""
    raw = raw if raw is not None else json.loads(Path(profile_path).read_text())
    rounds = [json.loads((Path(d) / "profile.json").read_text()) for d in truth_dirs]
    for r in rounds:
        # The fingerprints may take fewer repetitions or shorter outputs (what they cost is
        # the point); the requests themselves must be the truth's.
        same = ("prompt_tokens", "batches", "kv_tokens", "timing")
        if any(r["workload"].get(k) != raw["workload"].get(k) for k in same):
            raise SystemExit(f"the truth was measured with workload {r['workload']}, the "
                             f"profile with {raw['workload']} (these must agree: {same})")
    fingerprints = [r for r in raw["records"] if r["kind"] == "fingerprint"]
    if layouts_at is not None:  # only what `profile --layouts-at` measures (and costs)
        fingerprints = shared_layout_records(fingerprints, layouts_at)
    memory_records = []
    if memory_from:
        memory_records = [r for r in json.loads(Path(memory_from).read_text())["records"]
                          if r["kind"] == "fingerprint" and r["processes"]]
    fits = _fits(fingerprints, memory_records, raw)
    truth, spread = truth_records(rounds)

    rows = []
    for record in truth:
        row = {"config": record["config"], "latency": latency_errors(record, fits),
               "per_round": []}
        for profile in rounds:
            alone = next(r for r in profile["records"]
                         if r["kind"] == "full" and r["config"] == record["config"])
            row["per_round"].append(latency_errors(alone, fits))
        cfg = space.Configuration(record["bits"], record["tp"], record["pp"])
        if memory_records and all(p["rss_hwm_bytes"] for p in record["processes"]):
            measured = float(sum(p["rss_hwm_bytes"] for p in record["processes"]))
            est = fits.memory_of(cfg).total_bytes["rss_hwm_bytes"]
            row["rss_hwm"] = {"measured_bytes": measured, "estimated_bytes": est,
                              "error": abs(est - measured) / measured}
        rows.append(row)

    def errors(key: str, pick) -> list[float]:
        return [x[key] for row in rows for x in pick(row)]

    def signed(key: str) -> float:
        est, meas = key + "_estimated_s", key + "_measured_s"
        return statistics.mean((x[est] - x[meas]) / x[meas] for row in rows
                               for x in row["latency"])

    per_round_mean = {
        phase: [statistics.mean(x[f"{phase}_error"] for row in rows for x in row["per_round"][i])
                for i in range(len(rounds))] for phase in ("ttft", "tpot")}
    fingerprint_cpu = sum(r["cpu_s"] for r in fingerprints)
    full_cpu = [sum(r["cpu_s"] for r in p["records"] if r["kind"] == "full") for p in rounds]
    hf_config = json.loads((Path(raw["model_dir"]) / "config.json").read_text())
    servable = [c.name for c in space.space() if space.exclusion_reason(c, hf_config) is None]
    measured_all = [sorted({r["config"] for r in p["records"] if r["kind"] == "full"})
                    for p in rounds]
    profile = Profile(Path(profile_path), raw, fits, hf_config)
    return {
        "profile": profile_path, "truth": truth_dirs, "memory_from": memory_from,
        "layouts_at": layouts_at,
        "workload": raw["workload"], "truth_workload": rounds[0]["workload"],
        "sessions": raw.get("sessions"),
        "configs_scored": len(rows), "servable": len(servable),
        "rows": rows, "truth_spread": spread,
        "mean_error": {"ttft": statistics.mean(errors("ttft_error", lambda r: r["latency"])),
                       "tpot": statistics.mean(errors("tpot_error", lambda r: r["latency"])),
                       "rss_hwm": (statistics.mean(r["rss_hwm"]["error"] for r in rows
                                                   if "rss_hwm" in r)
                                   if any("rss_hwm" in r for r in rows) else None)},
        "signed_mean_error": {"ttft": signed("ttft"), "tpot": signed("tpot")},
        "mean_error_per_round": per_round_mean,
        "truth_cv_mean": truth_cv_mean(spread),
        "profiling_cpu_s": {
            "fingerprints_latency": fingerprint_cpu,
            "fingerprint_launches": len({(r["tp"], r["pp"]) for r in fingerprints}),
            "memory_fingerprints": sum(r["cpu_s"] for r in memory_records),
            "full_once_per_round": full_cpu, "full_configs_per_round": measured_all,
            "ratio_full_over_fingerprints_latency": [c / fingerprint_cpu for c in full_cpu]},
        "intents": intent_check(profile, truth) if memory_records else [],
    }


def _fingerprint_points(raw: dict) -> dict[tuple, tuple[float, float]]:
    """(tp, pp, bits, layers, batch) -> (TTFT s, TPOT s), each the fastest repetition's."""
    out = {}
    for r in raw["records"]:
        if r["kind"] == "fingerprint":
            for p in estimate.latency_points([r], r["bits"]):
                out[(p.tp, p.pp, r["bits"], p.layers, p.batch)] = (p.ttft_s, p.tpot_s)
    return out


def leave_one_out(spread: list[dict]) -> dict[str, float]:
    """Each round's fastest repetition against the mean of the other rounds (``spread`` of
    ``truth_records``), mean relative difference over configurations, batches and rounds: what
    a model exact to the machine's mean speed, but measured in one launch window, would score
    against a truth of the other launches. The floor no one-window profile can beat here."""
    out = {}
    for phase in ("ttft", "tpot"):
        diffs = []
        for s in spread:
            values = s[f"{phase}_s"]
            for k, v in enumerate(values):
                rest = statistics.mean(x for j, x in enumerate(values) if j != k)
                diffs.append(abs(v - rest) / rest)
        out[phase] = statistics.mean(diffs)
    return out


def noise(profile_paths: list[str], reference: str, truth_dirs: list[str],
          memory_from: str | None, layouts_at: int | None = None) -> dict:
    """How much of each profile's error is the machine's speed in its window.

    The drift: at the points a profile shares with ``reference`` (same layout, bit-width,
    depth and batch), the median ratio of its TTFT and TPOT to the reference's. TTFT is the
    like-for-like one (the same prompt whatever the output length); TPOT also moves with the
    output length and the repetitions. Each profile is then scored as measured and rescaled
    by its drift to the reference's window (a computed counterfactual, not a measurement):
    what is left is model error plus the reference window's own offset.
    """
    rounds = [json.loads((Path(d) / "profile.json").read_text()) for d in truth_dirs]
    ref = _fingerprint_points(json.loads(Path(reference).read_text()))
    rows = []
    for path in profile_paths:
        raw = json.loads(Path(path).read_text())
        points = _fingerprint_points(raw)
        shared = sorted(set(points) & set(ref))
        if not shared:
            raise SystemExit(f"{path} shares no fingerprint point with {reference}")
        drift = {phase: float(np.median([points[k][i] / ref[k][i] for k in shared]))
                 for i, phase in enumerate(("ttft", "tpot"))}
        rescaled = copy.deepcopy(raw)
        for r in rescaled["records"]:
            for point in r["latency"] if r["kind"] == "fingerprint" else ():
                for phase in ("ttft", "tpot", "e2e"):
                    key = f"{phase}_s"
                    if key in point:
                        scale = drift["ttft" if phase == "e2e" else phase]
                        point[key] = [v / scale for v in point[key]]
        uptimes = [r["uptime_s_at_start"] for r in raw["records"] if "uptime_s_at_start" in r]
        as_measured = score(path, truth_dirs, memory_from, layouts_at)
        at_reference = score(path, truth_dirs, memory_from, layouts_at, raw=rescaled)
        rows.append({
            "profile": path, "shared_points": len(shared), "drift": drift,
            "uptime_s": [min(uptimes), max(uptimes)] if uptimes else None,
            "workload": {k: raw["workload"].get(k) for k in ("output_tokens", "repetitions")},
            "mean_error": as_measured["mean_error"],
            "signed_mean_error": as_measured["signed_mean_error"],
            "mean_error_at_reference_speed": at_reference["mean_error"],
            "signed_mean_error_at_reference_speed": at_reference["signed_mean_error"],
            "profiling_cpu_s": as_measured["profiling_cpu_s"]["fingerprints_latency"]})
    truth_uptimes = [r["uptime_s_at_start"] for p in rounds for r in p["records"]
                     if r["kind"] == "full" and "uptime_s_at_start" in r]
    spread = truth_records(rounds)[1]
    return {"reference": reference, "truth": truth_dirs, "layouts_at": layouts_at,
            "truth_uptime_s": [min(truth_uptimes), max(truth_uptimes)] if truth_uptimes else None,
            "leave_one_out": leave_one_out(spread),
            "truth_cv_mean": truth_cv_mean(spread),
            "profiles": rows}


def noise_markdown(result: dict) -> str:
    pct = "{:.1%}".format
    loo, cv = result["leave_one_out"], result["truth_cv_mean"]
    lines = [
        f"Reference window: `{result['reference']}`; truth: "
        + ", ".join(f"`{d}`" for d in result["truth"])
        + (" (machine uptime {:.0f}-{:.0f} s)".format(*result["truth_uptime_s"])
           if result["truth_uptime_s"] else ""), "",
        f"**Noise in the truth.** Each round against the mean of the other two (a model exact "
        f"to the machine's mean speed but measured in one window would score this): TTFT "
        f"{pct(loo['ttft'])}, TPOT {pct(loo['tpot'])}; the rounds' coefficient of variation: "
        f"TTFT {pct(cv['ttft'])}, TPOT {pct(cv['tpot'])}."
        + (f" Profiles fitted and costed on what `--layouts-at {result['layouts_at']}` "
           f"measures." if result["layouts_at"] is not None else ""), "",
        "| profile | uptime s | outputs x repetitions | points shared | drift TTFT / TPOT | "
        "error TTFT / TPOT (signed) | at the reference's speed (computed) | latency CPU-s |",
        "|---|---|---|---:|---|---|---|---:|"]
    for r in result["profiles"]:
        up = "{:.0f}-{:.0f}".format(*r["uptime_s"]) if r["uptime_s"] else "-"
        w = r["workload"]
        m, sg = r["mean_error"], r["signed_mean_error"]
        mr, sr = r["mean_error_at_reference_speed"], r["signed_mean_error_at_reference_speed"]
        lines.append(
            f"| `{Path(r['profile']).parent.name}` | {up} | {w['output_tokens']} x "
            f"{w['repetitions']} | {r['shared_points']} | {r['drift']['ttft']:.3f} / "
            f"{r['drift']['tpot']:.3f} | {pct(m['ttft'])} / {pct(m['tpot'])} ({sg['ttft']:+.1%}"
            f" / {sg['tpot']:+.1%}) | {pct(mr['ttft'])} / {pct(mr['tpot'])} ({sr['ttft']:+.1%} /"
            f" {sr['tpot']:+.1%}) | {r['profiling_cpu_s']:.0f} |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    pct = "{:.1%}".format
    lines = [f"Fingerprint profile: `{result['profile']}`; truth: "
             f"{', '.join(f'`{d}`' for d in result['truth'])} (mean of the rounds)", "",
             "| config | batch | TTFT truth s (rounds) | TTFT est. s | err | TPOT truth ms "
             "(rounds) | TPOT est. ms | err |", "|---|---:|---|---:|---:|---|---:|---:|"]
    spread = {(s["config"], s["batch"]): s for s in result["truth_spread"]}
    for row in result["rows"]:
        for x in row["latency"]:
            s = spread[(row["config"], x["batch"])]
            lines.append(
                f"| {row['config']} | {x['batch']} | {x['ttft_measured_s']:.3f} "
                f"({min(s['ttft_s']):.3f}-{max(s['ttft_s']):.3f}) | {x['ttft_estimated_s']:.3f}"
                f" | {pct(x['ttft_error'])} | {x['tpot_measured_s'] * 1e3:.1f} "
                f"({min(s['tpot_s']) * 1e3:.1f}-{max(s['tpot_s']) * 1e3:.1f}) | "
                f"{x['tpot_estimated_s'] * 1e3:.1f} | {pct(x['tpot_error'])} |")
    m, sg, cv = result["mean_error"], result["signed_mean_error"], result["truth_cv_mean"]
    cost = result["profiling_cpu_s"]
    lines += [
        "", f"Mean error against the truth's mean: TTFT {pct(m['ttft'])}, TPOT {pct(m['tpot'])}"
        + (f", RSS high-water mark {pct(m['rss_hwm'])}" if m["rss_hwm"] is not None else "")
        + f"; signed mean TTFT {sg['ttft']:+.1%}, TPOT {sg['tpot']:+.1%}.",
        "Against each round alone: TTFT " + ", ".join(map(pct, result["mean_error_per_round"]
                                                        ["ttft"]))
        + "; TPOT " + ", ".join(map(pct, result["mean_error_per_round"]["tpot"])) + ".",
        f"The truth's own spread (coefficient of variation over the rounds, mean over "
        f"configurations and batches): TTFT {pct(cv['ttft'])}, TPOT {pct(cv['tpot'])}.", "",
        f"Profiling CPU-seconds: fingerprints (latency) {cost['fingerprints_latency']:.0f} in "
        f"{cost['fingerprint_launches']} launches; every full configuration once: "
        + ", ".join(f"{c:.0f}" for c in cost["full_once_per_round"]) + " (per round), i.e. "
        + ", ".join(f"{r:.1f}x" for r in cost["ratio_full_over_fingerprints_latency"])
        + (f"; memory from truncated fingerprints {cost['memory_fingerprints']:.0f} more."
           if cost["memory_fingerprints"] else "."), "",
        "| batch | intent | chosen (estimates) | best (truth) | gap |",
        "|---:|---|---|---|---:|"]
    for x in result["intents"]:
        intent = x["intent"] + (f" ({x['cost']})" if x["intent"] == "min-cost" else "")
        lines.append(f"| {x['batch']} | {intent} | {x['chosen']} | {x['measured_best']} | "
                     f"{pct(x['gap']) if 'gap' in x else '-'} |")
    return "\n".join(lines) + "\n"


def sweep(depths: list[int], bits: list[int], out_dir: Path, workload: Workload) -> dict:
    model = default_model_path()
    engines = None
    if any(b != 16 for b in bits):
        from sglang_morph.morph import auto_build

        engines = auto_build.ensure_variants(model).engines_dir
    started = time.time()
    records = measure_in_server(1, 1, model, engines, [(b, depths) for b in bits], workload,
                                out_dir / "sweep-server.log")
    rows = []
    for b in bits:
        points = estimate.latency_points([r for r in records if r["bits"] == b], b)
        for batch in sorted({p.batch for p in points}):
            at = sorted((p for p in points if p.batch == batch), key=lambda p: p.layers)
            x = np.array([p.layers for p in at], dtype=float)
            for phase in ("ttft", "tpot"):
                y = np.array([getattr(p, f"{phase}_s") for p in at])
                slope, intercept = np.polyfit(x, y, 1)
                per_layer = np.diff(y) / np.diff(x)
                rows.append({"bits": b, "batch": batch, "phase": phase,
                             "layers": x.astype(int).tolist(), "seconds": y.tolist(),
                             "line": [intercept, slope],
                             "residual": (y - (intercept + slope * x)).tolist(),
                             "per_layer_between_depths_s": per_layer.tolist()})
    return {"started_unix_s": started, "workload": workload.__dict__, "records": records,
            "rows": rows}


def sweep_markdown(result: dict) -> str:
    lines = ["| bits | batch | phase | depth: seconds | per layer between depths, ms | "
             "line: fixed + per layer | largest residual |", "|---:|---:|---|---|---|---|---:|"]
    for r in result["rows"]:
        at = ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in zip(r["layers"], r["seconds"]))
        per = ", ".join(f"{v * 1e3:.2f}" for v in r["per_layer_between_depths_s"])
        fixed, slope = r["line"]
        worst = max(r["residual"], key=abs)
        lines.append(f"| {r['bits']} | {r['batch']} | {r['phase']} | {at} (ms) | {per} | "
                     f"{fixed * 1e3:.1f} + {slope * 1e3:.2f} L ms | {worst * 1e3:+.1f} ms |")
    return "\n".join(lines) + "\n"


def add_layout(profile_path: Path, tp: int, pp: int, depths: list[int], log_dir: Path) -> int:
    """One more in-server launch (16 bits) appended to a profile, with its workload: e.g. TP 3
    x PP 2, which ``profile --in-server`` does not run."""
    raw = json.loads(profile_path.read_text())
    w = raw["workload"]
    workload = Workload(w["prompt_tokens"], tuple(w["output_tokens"]), tuple(w["batches"]),
                        w["repetitions"], w["kv_tokens"], w["timing"])
    log_dir.mkdir(parents=True, exist_ok=True)
    records = measure_in_server(tp, pp, Path(raw["model_dir"]), None, [(16, depths)], workload,
                                log_dir / f"in-server-TP{tp}-PP{pp}.log")
    git = git_commit()
    for record in records:
        add_record(raw, record, git)
    profile_path.write_text(json.dumps(raw, indent=1))
    return len(records)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.iserve.in_server",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("score")
    p.add_argument("--profile", required=True)
    p.add_argument("--truth", nargs="+", required=True, help="round directories (profile.json)")
    p.add_argument("--memory-from", help="a profile of truncated fingerprints for M2")
    p.add_argument("--layouts-at", type=int, metavar="BITS",
                   help="fit and cost only the records `profile --layouts-at BITS` measures")
    p.add_argument("--out", required=True)
    p = sub.add_parser("noise", help="each profile's drift against a reference profile, and "
                       "its error as measured and at the reference's speed")
    p.add_argument("--profiles", nargs="+", required=True)
    p.add_argument("--reference", required=True, help="the profile whose window is the yardstick")
    p.add_argument("--truth", nargs="+", required=True, help="round directories (profile.json)")
    p.add_argument("--memory-from", help="a profile of truncated fingerprints for M2")
    p.add_argument("--layouts-at", type=int, metavar="BITS",
                   help="fit and cost only the records `profile --layouts-at BITS` measures")
    p.add_argument("--out", required=True)
    p = sub.add_parser("sweep")
    p.add_argument("--depths", default="2,4,8,12,16,20,24,28,30")
    p.add_argument("--bits", default="16")
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--out", required=True)
    p = sub.add_parser("add-layout", help="append one more 16-bit in-server launch")
    p.add_argument("--profile", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--layers", required=True, help="depths, e.g. 9,17")
    p.add_argument("--out", required=True, help="log directory")
    args = parser.parse_args(argv)
    if args.command == "add-layout":
        n = add_layout(Path(args.profile), args.tp, args.pp,
                       [int(x) for x in args.layers.split(",")], Path(args.out))
        print(f"{n} records added to {args.profile}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "score":
        result = score(args.profile, args.truth, args.memory_from, args.layouts_at)
        name = "in_server_vs_truth" + (f"_layouts_at_{args.layouts_at}"
                                       if args.layouts_at is not None else "")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        text = markdown(result)
        (out / f"{name}.md").write_text(text)
    elif args.command == "noise":
        import sys

        from benchmark.harness import git_state

        result = noise(args.profiles, args.reference, args.truth, args.memory_from,
                       args.layouts_at)
        # Computed from stored measurements: what ran, and where, is in those directories.
        result["computed"] = {"command": "python -m benchmark.iserve.in_server "
                              + " ".join(sys.argv[1:]), "git": git_state()}
        name = "noise" + (f"_layouts_at_{args.layouts_at}" if args.layouts_at is not None
                          else "")
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        text = (f"# Launch-window noise in the in-server profiles\n\nComputed from stored "
                f"measurements (no server launched) at commit {result['computed']['git']['commit']}"
                f": `{result['computed']['command']}`. The profiles' and the truth's machine "
                f"and times: their directories' README.\n\n" + noise_markdown(result))
        (out / f"{name}.md").write_text(text)
    else:
        workload = Workload(output_tokens=(args.output,), repetitions=args.repetitions,
                            timing="stream")
        result = sweep([int(d) for d in args.depths.split(",")],
                       [int(b) for b in args.bits.split(",")], out, workload)
        (out / "sweep.json").write_text(json.dumps(result, indent=1))
        text = sweep_markdown(result)
        (out / "sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
