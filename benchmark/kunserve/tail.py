"""Where KunServe's tail goes, request by request, against plain DP 2 in the same rounds.

    python -m benchmark.kunserve.tail DIR_1 DIR_2 DIR_3 --out OUT [--point NAME]

Each ``DIR_k`` is one replay round (``python -m benchmark.replay --dp2 --configs
dp2,kunserve``), read from its ``raw/`` files: the streamed chunks' arrival times of every
request and each arm's forward log. Per round, the requests that decide KunServe's P99 TTFT and
E2E P95 (its slowest ones, ``TAIL_REQUESTS`` of each), and for each, in both arms:

- TTFT, and whether a merged window (drop begun to restore done) was open when it arrived;
- its decode (first to last token) split into *stalls* (token intervals over ``STALL_S``: the
  replica ran something else, a prefill mostly, or paused for a transition) and the steady
  intervals, with their median;
- the decode forwards its arm ran while it decoded: median requests a forward and median
  seconds (both replicas' forwards; a merged replica's forward is one micro-batch of its own
  requests through every stage).

Then, over every round's tail requests, KunServe's E2E excess over plain DP 2 summed by
part: TTFT, stalls and steady decode. Writes ``OUT/tail.json`` and ``OUT/tail.md``; nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmark.harness import load_average, run_meta, write_results
from benchmark.kunserve.rounds import ARMS, merged_windows
from benchmark.replay.forwards import in_windows, read_log

TAIL_REQUESTS = 3  # of 45 requests: those at and above the P95 (P99 is the top two)
# A token interval this long is a stall, not a decode step: the longest merged decode step
# seen at the replay's load is 0.13 s, a 32-token prefill 0.15 s.
STALL_S = 0.25


def token_intervals_s(chunks: Sequence[Sequence[float]]) -> list[float]:
    """Each streamed token's interval after the one before (a chunk of several tokens spreads
    its interval over them), from ``[[unix_s, tokens_so_far], ...]``."""
    out: list[float] = []
    for (t0, n0), (t1, n1) in zip(chunks, chunks[1:]):
        k = int(n1) - int(n0)
        if k > 0:
            out += [(t1 - t0) / k] * k
    return out


def decode_forwards(forwards: Sequence[dict[str, Any]], begin_s: float, end_s: float
                    ) -> dict[str, float | None]:
    """Over the forwards started in [begin_s, end_s]: median requests a decode forward and
    median seconds, and the seconds of the prefill forwards (both replicas': a merged pair's
    prefill holds both stages, a whole replica's only its own)."""
    inside = [f for f in forwards if f["new"] and in_windows(f, [(begin_s, end_s)])]
    decodes = [f for f in inside if f["mode"] == "decode"]
    return {"forwards": len(decodes),
            "batch_median": (statistics.median(len(f["new"]) for f in decodes)
                             if decodes else None),
            "seconds_median": (statistics.median(f["seconds"] for f in decodes)
                               if decodes else None),
            "prefill_s": sum(f["seconds"] for f in inside if f["mode"] != "decode")}


def request_view(rec: dict[str, Any], forwards: Sequence[dict[str, Any]],
                 windows: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """One request in one arm: TTFT, the decode's stalls and steady intervals, the forwards."""
    chunks = rec["chunks"]
    gaps = token_intervals_s(chunks)
    stalls = [g for g in gaps if g > STALL_S]
    steady = [g for g in gaps if g <= STALL_S]
    arrived = rec["scheduled_unix_s"]
    return {"ttft_s": rec["ttft_s"], "e2e_s": rec["e2e_s"], "output_tokens": chunks[-1][1],
            "arrived_merged": any(a <= arrived <= b for a, b in windows),
            "decode_s": chunks[-1][0] - chunks[0][0],
            "stalls": len(stalls), "stall_s": sum(stalls), "steady_s": sum(steady),
            "steady_median_s": statistics.median(steady) if steady else None,
            **decode_forwards(forwards, chunks[0][0], chunks[-1][0])}


def one_round(run: Path) -> dict[str, Any]:
    full = json.loads((run / "raw" / "replay_dp2_full.json").read_text())
    arms = full["dp2"]["configs"]
    forwards = {a: read_log(run / "raw" / f"{a}_forwards.jsonl") for a in ARMS}
    windows = {"dp2": [], "kunserve": merged_windows(arms["kunserve"])}
    records = {a: {r["index"]: r for r in arms[a]["records"]
                   if r["e2e_s"] is not None and r.get("chunks")} for a in ARMS}
    common = sorted(set(records["dp2"]) & set(records["kunserve"]))
    start = arms["kunserve"]["start_unix_s"]
    out: dict[str, Any] = {"run": str(run), "requests": len(common),
                           "merged_windows_s": [[round(a - start, 2), round(b - start, 2)]
                                                for a, b in windows["kunserve"]]}
    for metric in ("ttft_s", "e2e_s"):
        slowest = sorted(common, key=lambda i: records["kunserve"][i][metric])[-TAIL_REQUESTS:]
        out[metric] = [{"index": i, "prompt_tokens": records["kunserve"][i]["prompt_tokens"],
                        "arrival_s": round(records["kunserve"][i]["scheduled_unix_s"] - start, 2),
                        **{a: request_view(records[a][i], forwards[a], windows[a])
                           for a in ARMS}}
                       for i in reversed(slowest)]
    return out


def excess(rounds: Sequence[dict[str, Any]]) -> dict[str, float]:
    """KunServe minus plain DP 2 over every round's E2E tail requests, by part (seconds,
    summed); ``e2e`` is the sum of the others."""
    parts = {"ttft": "ttft_s", "stalls": "stall_s", "steady": "steady_s"}
    out = {p: sum(r["kunserve"][k] - r["dp2"][k] for rnd in rounds for r in rnd["e2e_s"])
           for p, k in parts.items()}
    out["e2e"] = sum(r["kunserve"]["e2e_s"] - r["dp2"]["e2e_s"]
                     for rnd in rounds for r in rnd["e2e_s"])
    return out


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _row(r: dict[str, Any]) -> str:
    cells = []
    for a in ARMS:
        v = r[a]
        cells.append(f"{v['ttft_s']:.2f}{' (merged)' if v['arrived_merged'] else ''} | "
                     f"{v['e2e_s']:.2f} | {v['decode_s']:.2f}: {v['stalls']} stalls "
                     f"{v['stall_s']:.2f} s, steady {v['steady_s']:.2f} s at "
                     f"{_num(v['steady_median_s'], 3)} | {_num(v['batch_median'], 1)} @ "
                     f"{_num(v['seconds_median'], 3)} s; prefills {v['prefill_s']:.2f} s")
    return (f"| #{r['index']} ({r['prompt_tokens']} + {r['kunserve']['output_tokens']} tokens, "
            f"at {r['arrival_s']:.1f} s) | " + " | ".join(cells) + " |")


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    head = ("| request (prompt + output, arrival) | DP 2 TTFT | DP 2 E2E | DP 2 decode | "
            "DP 2 decode forwards | KunServe TTFT | KunServe E2E | KunServe decode | "
            "KunServe decode forwards |")
    rows = [f"# Where KunServe's tail goes ({report['point']})", "",
            f"commit {meta['git']['commit']}{' (dirty)' if meta['git']['dirty'] else ''}; "
            f"{meta['machine'].get('cpu_model')}, {meta['machine'].get('cpu_cores')} cores", "",
            f"Command: `{meta['command']}`", "",
            f"Per round, KunServe's {TAIL_REQUESTS} slowest requests by TTFT (they decide its "
            f"P99) and by E2E (its P95), the same requests in plain DP 2. Seconds. *decode*: "
            f"first to last token, as stalls (token intervals over {STALL_S} s) and steady "
            f"intervals (sum, at their median). *decode forwards*: the arm's decode forwards "
            f"while the request decoded, median requests @ median seconds (a merged "
            f"replica's forward is one micro-batch through every stage), and the seconds of "
            f"both replicas' prefill forwards meanwhile (a merged pair's prefill holds both "
            f"stages; a whole replica's stalls only its own requests). *(merged)*: a merged "
            f"window was open when it arrived.", ""]
    for k, rnd in enumerate(report["rounds"], 1):
        rows += [f"## Round {k} ({rnd['run']}): merged windows {rnd['merged_windows_s']} s "
                 f"after the replay's start", ""]
        for metric, title in (("ttft_s", "slowest TTFT"), ("e2e_s", "slowest E2E")):
            rows += [f"{title}:", "", head, "|---" * 9 + "|"]
            rows += [_row(r) for r in rnd[metric]]
            rows.append("")
    ex = report["excess_s"]
    rows += ["## KunServe's E2E excess over plain DP 2, summed over every round's slowest-E2E "
             "requests", "",
             f"{ex['e2e']:+.2f} s in all: TTFT {ex['ttft']:+.2f} s, stalls {ex['stalls']:+.2f} s, "
             f"steady decode {ex['steady']:+.2f} s.", ""]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.tail",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="replay output directories")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--point", default="default operating point")
    args = ap.parse_args(argv)
    load_before = load_average()
    for d in args.runs:
        for name in ("replay_dp2_full.json", *(f"{a}_forwards.jsonl" for a in ARMS)):
            if not (d / "raw" / name).is_file():
                ap.error(f"{d / 'raw' / name} does not exist (a `python -m benchmark.replay "
                         f"--dp2 --configs dp2,kunserve` output)")
    rounds = [one_round(d) for d in args.runs]
    report = {"point": args.point, "rounds": rounds, "excess_s": excess(rounds),
              "meta": run_meta(" ".join(["python -m benchmark.kunserve.tail", *map(
                  str, argv if argv is not None else sys.argv[1:])]), load_before)}
    write_results(args.out, "tail", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
