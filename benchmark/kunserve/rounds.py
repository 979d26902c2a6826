"""KunServe against plain DP 2 over several rounds of the two-replica replay: the whole
distribution, for all requests and for those a merged window touched, median and spread.

    python -m benchmark.replay --dp2 --configs dp2,kunserve --out DIR_k      (k = 1, 2, 3, ...)
    python -m benchmark.kunserve.rounds DIR_1 DIR_2 DIR_3 --out OUT [--point NAME]

Each ``DIR_k`` holds one replay's ``replay_dp2.json`` (both arms on the same requests, one
after the other). Per round and arm: TTFT P50 / P95 / P99, TPOT P50 / P95 and E2E P50 / P95
over every completed request, and over the requests whose life (arrival to last token) overlaps
one of KunServe's merged windows in that round (drop begun to restore done), the same requests
in both arms. Per round, KunServe against plain DP 2: P99 TTFT ratio, P50 TPOT and E2E P95
change, output agreement. Then the median and the min-max of each over the rounds. Writes
``OUT/rounds.json``, ``OUT/rounds.md`` and ``OUT/rounds_cdf.png`` (every round's requests
pooled, per arm, all and merged-touched); nothing is asserted (the targets are reported).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmark.harness import load_average, run_meta, spread, write_results
from benchmark.replay.client import STALL_S
from benchmark.replay.report import pyplot

ARMS = ("dp2", "kunserve")
# (metric, percentile) per column of the tables
COLUMNS = (("ttft_s", 50), ("ttft_s", 95), ("ttft_s", 99), ("tpot_s", 50), ("tpot_s", 95),
           ("e2e_s", 50), ("e2e_s", 95))
GOALS = {"p99_ttft_ratio": ">= 5", "p50_tpot_change": "<= +0.30", "e2e_p95_change": "<= 0",
         "exact_match": "1.0"}


def merged_windows(arm: dict[str, Any]) -> list[tuple[float, float]]:
    """KunServe's merged windows (unix seconds) from each pair's first replica's transitions:
    from the start of a drop to the end of the restore after it (the end of the replay when
    none came). With several pairs, every pair's windows, by start."""
    windows = []
    transitions = arm.get("kunserve_transitions", [])
    for leader in sorted({t["replica"] for t in transitions if t["replica"] % 2 == 0}):
        begun = None
        for t in sorted((t for t in transitions if t["replica"] == leader),
                        key=lambda t: t["at_unix_s"]):
            if t["action"] == "drop" and begun is None:
                begun = t["at_unix_s"] - t["duration_s"]
            elif t["action"] == "restore" and begun is not None:
                windows.append((begun, t["at_unix_s"]))
                begun = None
        if begun is not None:
            windows.append((begun, float("inf")))
    return sorted(windows)


def overlapping(arm: dict[str, Any], windows: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the completed requests whose life overlaps a window."""
    return {r["index"] for r in arm["records"] if r["e2e_s"] is not None and any(
        r["scheduled_unix_s"] < end and r["scheduled_unix_s"] + r["e2e_s"] > begin
        for begin, end in windows)}


def distribution(arm: dict[str, Any], indices: set[int] | None = None) -> dict[str, Any]:
    """The columns' percentiles over the completed requests (of ``indices`` when given)."""
    recs = [r for r in arm["records"] if r["e2e_s"] is not None
            and (indices is None or r["index"] in indices)]
    out: dict[str, Any] = {"requests": len(recs)}
    for metric, p in COLUMNS:
        values = [r[metric] for r in recs if r[metric] is not None]
        out[f"{metric}_p{p}"] = float(np.percentile(values, p)) if values else None
    return out


# A send later than this after its trace time is the replay client's own delay (its process
# shares the two cores with the servers), not the server's.
LATE_SEND_S = 0.1


def client_lateness(arm: dict[str, Any]) -> dict[str, Any]:
    """How late the client sent the arm's requests (sent - scheduled; TTFT counts from the
    schedule), and the P99 TTFT counted from each request's send instead: where the two P99s
    differ, the client's delay, not the server, set the tail."""
    recs = [r for r in arm["records"] if r["ttft_s"] is not None]
    late = [r["sent_unix_s"] - r["scheduled_unix_s"] for r in recs]
    return {"max_s": max(late, default=0.0), "late_sends": sum(x > LATE_SEND_S for x in late),
            "ttft_s_p99_from_send": float(np.percentile(
                [r["ttft_s"] - x for r, x in zip(recs, late)], 99)) if recs else None,
            **loop_stalls(arm)}


def loop_stalls(arm: dict[str, Any]) -> dict[str, Any]:
    """The client's event-loop stalls in the arm (none recorded by replays before the client
    watched its loop): how many, the longest, their total, and how much of it the client
    spent waiting for a CPU (runnable while the cores ran the servers)."""
    stalls = arm.get("client_stalls")
    if stalls is None:
        return {}
    return {"stalls": len(stalls), "stall_max_s": max((x["late_s"] for x in stalls), default=0.0),
            "stall_total_s": sum(x["late_s"] for x in stalls),
            "stall_runqueue_s": sum(x.get("runqueue_s", 0.0) for x in stalls)}


FORWARD_KEYS = ("decode_s_p50", "prefill_s_p50", "step_gap_s_p50")


def own_forwards(arm: dict[str, Any]) -> dict[str, float | None]:
    """The arm's own forwards during the replay, as its servers timed them (KunServe's outside
    its merged windows): the median decode and prefill forward, and the median step gap (a
    scheduler's own work between two forwards). None each where the replay has no timings."""
    f = arm.get("forwards") or {}
    phases = f.get("phases", {})
    return {"decode_s_p50": phases.get("decode", {}).get("median_seconds"),
            "prefill_s_p50": phases.get("prefill", {}).get("median_seconds"),
            "step_gap_s_p50": f.get("step_gap_s", {}).get("median")}


def one_round(report: dict[str, Any]) -> dict[str, Any]:
    arms = report["dp2"]["configs"]
    missing = [a for a in ARMS if "records" not in arms.get(a, {})]
    if missing:
        raise ValueError(f"the replay has no completed arm {missing} (run it with --configs "
                         f"dp2,kunserve)")
    windows = merged_windows(arms["kunserve"])
    touched = overlapping(arms["kunserve"], windows)
    out: dict[str, Any] = {
        "commit": report["settings"]["git"]["commit"],
        "dp_size": report["dp2"].get("dp_size", 2),
        "merged_windows_s": [round(min(end, arms["kunserve"]["end_unix_s"]) - begin, 2)
                             for begin, end in windows],
        "arms": {a: {"all": distribution(arms[a]), "merged": distribution(arms[a], touched)}
                 for a in ARMS},
        "client": {a: client_lateness(arms[a]) for a in ARMS},
        "forwards": {a: own_forwards(arms[a]) for a in ARMS}}
    sent = [out["client"][a]["ttft_s_p99_from_send"] for a in ARMS]
    out["vs_dp2"] = {
        **against_dp2(out["arms"]["dp2"]["all"], out["arms"]["kunserve"]["all"]),
        "p99_ttft_ratio_from_send": sent[0] / sent[1] if sent[1] else None,
        "exact_match": arms["kunserve"].get("quality", {}).get("exact_match_rate")}
    return out


def against_dp2(dp: dict[str, Any], ks: dict[str, Any]) -> dict[str, float | None]:
    """KunServe's latency targets against plain DP 2, from two ``distribution``s."""

    def change(key: str) -> float | None:
        return ks[key] / dp[key] - 1 if ks[key] is not None and dp[key] else None

    return {
        "p99_ttft_ratio": (dp["ttft_s_p99"] / ks["ttft_s_p99"] if ks["ttft_s_p99"] else None),
        "p50_tpot_change": change("tpot_s_p50"), "e2e_p95_change": change("e2e_s_p95"),
        "tpot_p95_change": change("tpot_s_p95")}


def aggregate(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    keys = [f"{m}_p{p}" for m, p in COLUMNS]
    return {
        "rounds": len(rounds),
        "arms": {a: {part: {k: spread([r["arms"][a][part][k] for r in rounds]) for k in
                            ("requests", *keys)} for part in ("all", "merged")} for a in ARMS},
        "vs_dp2": {k: spread([r["vs_dp2"][k] for r in rounds]) for k in rounds[0]["vs_dp2"]},
        "forwards": {a: {k: spread([r.get("forwards", {}).get(a, {}).get(k) for r in rounds])
                         for k in FORWARD_KEYS} for a in ARMS},
        "goals": GOALS}


def _cell(s: dict[str, Any], digits: int, signed: bool = False) -> str:
    if s["median"] is None:
        return "-"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])} to {f.format(s['max'])})"


def _stall_sentence(per_round: Sequence[dict[str, Any]]) -> str:
    """The client's loop stalls over the rounds (empty when the rounds did not record them)."""
    arms = [r["client"][a] for r in per_round for a in ARMS if "stalls" in r["client"][a]]
    if not arms:
        return ""
    total = sum(c["stall_total_s"] for c in arms)
    waited = sum(c["stall_runqueue_s"] for c in arms)
    return (f" The client's event loop stalled over {STALL_S} s "
            f"{sum(c['stalls'] for c in arms)} times in all arms and rounds, "
            f"{total:.1f} s in all (longest {max(c['stall_max_s'] for c in arms):.2f} s); "
            f"{waited / total if total else 0:.0%} of that time it was runnable, waiting for "
            f"a core.")


def markdown(report: dict[str, Any]) -> str:
    meta, agg = report["meta"], report["aggregate"]
    dp = f"DP {report['per_round'][0].get('dp_size', 2)}"
    rows = [f"# KunServe vs plain {dp}, {agg['rounds']} replay rounds ({report['point']})", "",
            f"commit {meta['git']['commit']}{' (dirty)' if meta['git']['dirty'] else ''} "
            f"(the rounds' own commits: {sorted({r['commit'] for r in report['per_round']})}); "
            f"{meta['machine'].get('cpu_model')}, {meta['machine'].get('cpu_cores')} cores; "
            f"load before {meta['load_before']}", "",
            f"Command: `{meta['command']}`; rounds: {report['sources']}", "",
            "Median over the rounds, (min to max) in brackets; seconds. *merged*: the requests "
            "whose life overlaps one of KunServe's merged windows in that round (the same "
            "requests in both arms).", "",
            "| arm | requests | TTFT p50 | TTFT p95 | TTFT p99 | TPOT p50 | TPOT p95 | E2E p50 "
            "| E2E p95 |", "|---|---:|---|---|---|---|---|---|---|"]
    for part in ("all", "merged"):
        for a in ARMS:
            s = agg["arms"][a][part]
            cells = [_cell(s[f"{m}_p{p}"], 3 if m == "tpot_s" else 2) for m, p in COLUMNS]
            rows.append(f"| {a} ({part}) | {_cell(s['requests'], 0)} | " + " | ".join(cells)
                        + " |")
    v = agg["vs_dp2"]
    rows += ["", f"KunServe against plain {dp} (per round, then median and min to max):", "",
             f"- P99 TTFT ratio ({dp} / KunServe): {_cell(v['p99_ttft_ratio'], 2)} "
             f"(goal {GOALS['p99_ttft_ratio']})",
             f"- P50 TPOT change: {_cell(v['p50_tpot_change'], 3, True)} "
             f"(goal {GOALS['p50_tpot_change']})",
             f"- E2E P95 change: {_cell(v['e2e_p95_change'], 3, True)} "
             f"(goal {GOALS['e2e_p95_change']})",
             f"- TPOT P95 change: {_cell(v['tpot_p95_change'], 3, True)}",
             f"- exact match: {_cell(v['exact_match'], 3)} (goal {GOALS['exact_match']})",
             f"- P99 TTFT ratio counted from each request's send instead of its trace time: "
             f"{_cell(v['p99_ttft_ratio_from_send'], 2)}. The replay client sent late "
             f"(over {LATE_SEND_S} s after the trace time; its process shares the cores with "
             f"the servers), per round, {dp} / KunServe: "
             + ", ".join(f"{r['client']['dp2']['late_sends']} / "
                         f"{r['client']['kunserve']['late_sends']}"
                         for r in report["per_round"])
             + " requests, at most "
             + f"{max(r['client'][a]['max_s'] for r in report['per_round'] for a in ARMS):.2f} s."
             + _stall_sentence(report["per_round"]),
             "",
             "",
             "Each arm's own forwards, as its servers timed them (KunServe's outside its merged "
             "windows; the step gap is a scheduler's own work between two forwards), median "
             "over the rounds (min to max), seconds:", "",
             "| arm | decode forward p50 | prefill forward p50 | step gap p50 |",
             "|---|---|---|---|",
             *(f"| {a} | " + " | ".join(_cell(agg["forwards"][a][k], 4) for k in FORWARD_KEYS)
               + " |" for a in ARMS),
             "",
             "CDFs, every round's requests pooled: [rounds_cdf.png](rounds_cdf.png)", "",
             "Per round:", ""]
    for k, r in enumerate(report["per_round"], 1):
        vs = r["vs_dp2"]
        rows.append(f"- round {k} ({report['sources'][k - 1]}): P99 TTFT "
                    f"{r['arms']['dp2']['all']['ttft_s_p99']:.2f} -> "
                    f"{r['arms']['kunserve']['all']['ttft_s_p99']:.2f} s "
                    f"({vs['p99_ttft_ratio']:.2f}x), P50 TPOT {vs['p50_tpot_change']:+.1%}, "
                    f"E2E P95 {vs['e2e_p95_change']:+.1%}; merged windows "
                    f"{r['merged_windows_s']} s, {r['arms']['kunserve']['merged']['requests']} "
                    f"requests touched")
    return "\n".join(rows) + "\n"


def pooled(reports: Sequence[dict[str, Any]], arm: str, metric: str, merged: bool
           ) -> list[float]:
    """``metric`` of every completed request of ``arm`` over the rounds (only those a merged
    window of their round touched, when ``merged``)."""
    values = []
    for report in reports:
        arms = report["dp2"]["configs"]
        touched = (overlapping(arms["kunserve"], merged_windows(arms["kunserve"])) if merged
                   else None)
        values += [r[metric] for r in arms[arm]["records"] if r[metric] is not None
                   and (touched is None or r["index"] in touched)]
    return values


def plot_cdfs(reports: Sequence[dict[str, Any]], path: Path) -> None:
    """TTFT, TPOT and E2E CDFs of both arms, every round's requests pooled: all requests
    (solid) and those a merged window touched (dashed)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
        for arm, color in zip(ARMS, ("tab:blue", "tab:orange")):
            for merged, style in ((False, "-"), (True, "--")):
                v = np.sort(pooled(reports, arm, metric, merged))
                if len(v):
                    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=color,
                            ls=style, label=f"{arm} ({'merged' if merged else 'all'})")
        ax.set_xlabel(metric.replace("_s", " s").upper().replace(" S", " s"))
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"KunServe vs plain DP {reports[0]['dp2'].get('dp_size', 2)}, "
                 f"{len(reports)} rounds pooled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.rounds",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="replay output directories")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--point", default="default operating point",
                    help="what the rounds measured (the table's title)")
    args = ap.parse_args(argv)
    load_before = load_average()
    reports = []
    for d in args.runs:
        path = d / "replay_dp2.json"
        if not path.is_file():
            ap.error(f"{path} does not exist (a `python -m benchmark.replay --dp2` output)")
        reports.append(json.loads(path.read_text()))
    try:
        per_round = [one_round(r) for r in reports]
    except ValueError as e:
        ap.error(str(e))
    report = {"point": args.point, "sources": [str(d) for d in args.runs],
              "meta": run_meta(" ".join(["python -m benchmark.kunserve.rounds", *map(
                  str, argv if argv is not None else sys.argv[1:])]), load_before),
              "per_round": per_round, "aggregate": aggregate(per_round)}
    write_results(args.out, "rounds", report, markdown(report))
    plot_cdfs(reports, args.out / "rounds_cdf.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
