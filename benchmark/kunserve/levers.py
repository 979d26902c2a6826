"""Where KunServe's replay targets are lost, on the simulation checked against the live replay
(``benchmark/kunserve/validate.py``): the same requests and calibration, with one lever moved
at a time. Every number this writes is SIMULATED.

    .venv/bin/python -m benchmark.kunserve.levers ROUND [ROUND ...] [--out DIR]

Levers: admission control while merged (a merged pair runs at most N requests; the rest
wait), how far from its end a running request counts as about to free its KV (the drop's
``finishing_steps``), a drop only where it pays (``pays_prefill_tokens_per_step``, with the
requests arriving meanwhile or the queue now only), the
controller's restore thresholds, and the costs themselves set to
what a better implementation would pay (transitions free; a merged decode step as cheap as a
whole replica's; both; a merged prefill as a whole replica's or pipelined). Each row gives,
per round and then as the median over the rounds, the targets' ratios of KunServe to plain
DP 2, both simulated with the same calibration:
P99 TTFT (DP 2 / KunServe; goal >= 5), P50 TPOT change (goal <= +30%), E2E P95 change (goal
<= 0) and TPOT P95 change.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmark.harness import load_average, run_meta, spread, write_results
from benchmark.kunserve import validate as V
from benchmark.kunserve.rounds import GOALS, against_dp2

CALIBRATION, QUEUES = V.VALIDATED  # the row within 15% on every replay checked


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str
    merged_running_cap: int | None = None
    controller: dict = dataclasses.field(default_factory=dict)  # ControllerConfig fields
    costs: dict = dataclasses.field(default_factory=dict)  # Calibration fields


LEVERS = (
    Lever("as measured"),
    *(Lever(f"merged pair runs at most {n} requests", merged_running_cap=n)
      for n in (10, 8, 6, 4)),
    # A blocked queue drops unless the running requests about to finish make room: counting
    # requests further from their end as finishing drops only for queues they cannot absorb.
    *(Lever(f"running requests within {n} steps of their end count as finishing",
            controller={"finishing_steps": n}) for n in (16, 32, 64)),
    # A drop for a queue only where the queue's waits on whole replicas outweigh the stall its
    # merged prefills put on the running requests (35: the replay CPU's prompt tokens a
    # replica prefills in the time of a decode step).
    # With the requests expected to arrive while the queue drains, or the queue now only.
    *(Lever(f"drop only when it pays ({n} prompt tokens a decode step)",
            controller={"pays_prefill_tokens_per_step": n}) for n in (35, 70)),
    *(Lever(f"drop only when it pays (35 prompt tokens a decode step, a merge {n} steps)",
            controller={"pays_prefill_tokens_per_step": 35, "pays_merge_steps": n})
      for n in (10, 20)),
    # ... with each replica's own rate, measured on its simulated whole forwards
    Lever("drop only when it pays (the rate measured, a merge 10 steps)",
          controller={"pays_prefill_tokens_per_step": "measured", "pays_merge_steps": 10}),
    *(Lever(f"drop only when the queue now pays ({n} prompt tokens a decode step)",
            controller={"pays_prefill_tokens_per_step": n, "pays_counts_arrivals": False})
      for n in (35, 70)),
    Lever("restore at once (usage 0.95, 1 view, no dwell)",
          controller={"restore_usage": 0.95, "restore_headroom": 1.0, "restore_persist": 1,
                      "min_dwell_s": 0.0}),
    Lever("transitions free", costs={"drop_s": 0.0, "restore_s": 0.0}),
    Lever("merged decode step as a whole replica's", costs={"merged_step_factor": 1.0}),
    Lever("both free", costs={"drop_s": 0.0, "restore_s": 0.0, "merged_step_factor": 1.0}),
    # The merged prefill: as measured live (one batch, slower than a whole replica's), as a
    # whole replica's, or cut into micro-batches that overlap across the stages (the paper's).
    Lever("merged prefill as a whole replica's", costs={"merged_prefill_factor": 1.0}),
    Lever("merged prefill pipelined in micro-batches", costs={"merged_prefill_factor": None}),
)


def run_lever(lever: Lever, rounds: Sequence[V.LiveRound], spec,
              calibration: str = CALIBRATION, merged_queues: str = QUEUES) -> dict[str, Any]:
    per_round = []
    for rnd in rounds:
        planner = V.planner_for(spec, rnd.kv_tokens_per_replica)
        cal = dataclasses.replace(V.calibration(calibration, rnd, spec, rounds), **lever.costs)
        ctl = dataclasses.replace(rnd.controller, **lever.controller)
        arms = {arm: V.simulated(rnd, cal, planner, arm == "kunserve", ctl,
                                 lever.merged_running_cap, merged_queues)[0]
                for arm in V.ARMS}
        per_round.append(against_dp2(arms["dp2"], arms["kunserve"]))
    return {"lever": dataclasses.asdict(lever), "rounds": per_round,
            "median": {k: spread([r[k] for r in per_round]) for k in per_round[0]}}


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    calibration = meta.get("calibration", CALIBRATION)
    queues = meta.get("merged_queues", "pair")
    lines = ["# KunServe's replay targets, lever by lever: SIMULATED", "",
             f"**SIMULATED** on the simulation checked against the live replay "
             f"(`{calibration}` calibration, a merged pair scheduled with "
             f"`merged_queues={queues}`, [validate.md](validate.md)). "
             + V.run_line(meta) + ".", "",
             "KunServe against plain DP 2, both simulated; median over the rounds (min to max). "
             f"Goals: P99 TTFT ratio {GOALS['p99_ttft_ratio']}, P50 TPOT change "
             f"{GOALS['p50_tpot_change']}, E2E P95 change {GOALS['e2e_p95_change']}.", "",
             "| lever | P99 TTFT DP 2 / KunServe | P50 TPOT change | E2E P95 change | "
             "TPOT P95 change |", "|---|---|---|---|---|"]
    for row in report["levers"]:
        m = row["median"]
        lines.append(
            f"| {row['lever']['name']} | {m['p99_ttft_ratio']['median']:.2f}x "
            f"({m['p99_ttft_ratio']['min']:.2f}-{m['p99_ttft_ratio']['max']:.2f}) | "
            + " | ".join(f"{m[k]['median']:+.0%} ({m[k]['min']:+.0%} to {m[k]['max']:+.0%})"
                         for k in ("p50_tpot_change", "e2e_p95_change", "tpot_p95_change"))
            + " |")
    return "\n".join(lines) + "\n"


def _options(ap) -> None:
    ap.add_argument("--calibration", choices=V.CALIBRATIONS, default=CALIBRATION,
                    help=f"the simulation's calibration (default {CALIBRATION})")
    ap.add_argument("--merged-queues", choices=V.KS.MERGED_QUEUES, default=QUEUES,
                    help="how a merged pair schedules: one queue for the pair (the paper's) "
                    f"or one per replica, as live (default {QUEUES})")


def main(argv: Sequence[str] | None = None) -> int:
    started, load = time.monotonic(), load_average()
    args, rounds, spec = V.rounds_cli("python -m benchmark.kunserve.levers",
                                      __doc__.splitlines()[0], argv, extra=_options)
    rows = [run_lever(lever, rounds, spec, args.calibration, args.merged_queues)
            for lever in LEVERS]
    meta = run_meta("python -m benchmark.kunserve.levers " + " ".join(
        sys.argv[1:] if argv is None else argv), load, SIMULATED=True,
        seconds=time.monotonic() - started, rounds=[str(p) for p in args.rounds],
        calibration=args.calibration, merged_queues=args.merged_queues)
    write_results(args.out, "levers", {"meta": meta, "levers": rows},
                  markdown({"meta": meta, "levers": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
