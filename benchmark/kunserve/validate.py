"""KunServe's SimPy simulation (``benchmark/kunserve/sim.py``) against the live two-replica
replay it claims to model, before any simulated cluster figure is quoted.

    .venv/bin/python -m benchmark.kunserve.validate ROUND [ROUND ...] [--out DIR]

Each ROUND is the output directory of one ``python -m benchmark.replay --dp2 --configs
dp2,kunserve`` run (its ``replay_dp2.json``). The simulation is configured as that replay: the
same requests at the same offsets (prompt and output tokens as sent), two replicas with the
live KV pool per replica (the planner's budget is set so its pool equals the live one), the
live controller's defaults polled at its interval, and float32 costs. Its step costs come from
one of these calibrations, side by side:

- ``idle``: what the simulated clusters use (``benchmark/results/kunserve``: the chunk cost
  model measured on an idle server, gloo and host copy bandwidths, transitions from them);
- ``replay``: the cost model fitted on the plain DP 2 arm's own forwards during the replay
  (``benchmark/replay/forwards.py``: one thread per replica, both replicas and the client on
  the cores), plus its schedulers' median step gap in every forward; transitions modelled;
- ``replay+transitions``: the same, with the drops and restores taking the live KunServe
  arm's median durations;
- ``replay+transitions+merged``: the same, with the merged pair's stages slowed by what the
  KunServe arm's merged decode forwards took over its unmerged ones (median over the rounds).
- ``replay+transitions+merged prefill``: ``replay+transitions+merged`` with each merged
  prefill taking what the KunServe arm's merged prefill forwards took over its unmerged fit
  (median over the rounds), as one batch through the stages instead of the paper's
  overlapping micro-batches (``sim.Calibration.merged_prefill_factor``).
- ``replay+transitions, per-replica queues``: ``replay+transitions`` with the merged pair
  scheduled as the live one is, each replica admitting and batching its own requests within
  its half of the pair's KV, both feeding the pair's pipeline (the other rows: one queue and
  one batch for the pair, the paper's design); ``replay+transitions+merged prefill,
  per-replica queues``: the same with the measured merged prefill (the decode step is left
  to the shared stages, which already make the two replicas' decodes wait for each other).

Every calibration beyond ``idle`` also charges each request the plain arm's front-end time
(``front_end_s``), and the plain arm's tokens go out as SGLang's overlap scheduler hands them
on (``sim.ClusterSim.overlap_schedule``; KunServe turns that scheduler off).
``replay`` takes only the plain DP 2 arm's forwards and latencies: the KunServe arm's (its
merged pipeline, its controller's timing) are predicted; the two richer rows take the
KunServe arm's transition times and merged step, so they say how much each of those explains.
The check (the one asked before 4-16 replica figures are quoted): P50 and P99 TTFT and P50
TPOT, median over the rounds, within ``TOLERANCE`` of the live medians, in both arms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmark.harness import load_average, run_meta, spread, write_results
from benchmark.kunserve import sim as KS
from benchmark.kunserve.rounds import distribution, merged_windows
from benchmark.replay.forwards import in_windows, read_log, timings_of
from sglang_morph.kunserve.controller import ControllerConfig
from sglang_morph.kunserve.cost import ForwardTiming, PhaseCosts
from sglang_morph.kunserve.planner import DropPlannerConfig, split_layers
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import ModelSpec

ARMS = ("dp2", "kunserve")
PREFILL_ONLY = "replay+transitions, merged prefill only"
# What each calibration beyond ``idle`` takes from the KunServe arm, on top of the plain arm's
# forwards: (its transition times, its merged decode step, its merged prefill).
CALIBRATIONS = {"idle": None, "replay": (False, False, False),
                "replay+transitions": (True, False, False),
                "replay+transitions+merged": (True, True, False),
                "replay+transitions+merged prefill": (True, True, True),
                PREFILL_ONLY: (True, False, True)}
PER_REPLICA = "replay+transitions, per-replica queues"
PER_REPLICA_PREFILL = "replay+transitions+merged prefill, per-replica queues"
PER_REPLICA_DECODE = "replay+transitions+merged, per-replica queues"
# Each row: its name, its calibration, and how the simulated pair schedules while merged
# (``sim.MERGED_QUEUES``): one queue for the pair, or each replica its own, as live.
ROWS = tuple((c, c, "pair") for c in CALIBRATIONS if c != PREFILL_ONLY) + (
    (PER_REPLICA, "replay+transitions", "member"),
    (PER_REPLICA_DECODE, "replay+transitions+merged", "member"),
    (PER_REPLICA_PREFILL, PREFILL_ONLY, "member"))
# The row that models the live pair as it runs (each member its own queue, the merged decode
# step as the KunServe arm measured it): what a simulated cluster quoted from a replay and
# the levers run as. Its calibration and merged queues:
VALIDATED_ROW = PER_REPLICA_DECODE
VALIDATED = next((cal, queues) for name, cal, queues in ROWS if name == VALIDATED_ROW)
CHECKED = ("ttft_s_p50", "ttft_s_p99", "tpot_s_p50")
SHOWN = ("ttft_s_p50", "ttft_s_p95", "ttft_s_p99", "tpot_s_p50", "tpot_s_p95", "e2e_s_p50",
         "e2e_s_p95")
TOLERANCE = 0.15
PROMPT_QUEUE_S = 0.01  # a request SGLang admitted at once (its queue time in the replay)
DEFAULT_INTERVAL_S = 0.25  # the live controller's interval_ms default
DTYPE_BYTES = 4  # the replay serves float32


@dataclasses.dataclass(frozen=True)
class LiveRound:
    """One replay's inputs and outcomes, as the simulation needs them."""

    path: Path
    requests: tuple[KS.Request, ...]
    kv_tokens_per_replica: int
    merged_kv_tokens_per_replica: int | None  # the live pool after a drop (None: no drop)
    forwards: dict[str, Any]  # the dp2 arm's fitted costs and step gaps
    drops_s: tuple[float, ...]
    restores_s: tuple[float, ...]
    controller: ControllerConfig
    interval_s: float
    live: dict[str, dict[str, Any]]  # per arm: the distribution (benchmark.kunserve.rounds)
    commit: str
    dp2_records: tuple[dict[str, Any], ...]  # the plain arm's requests as the replay recorded
    # KunServe's merged decode / prefill forwards over its own unmerged fit (None: no log, no
    # drop, or a log fitted before the prefill ratio was)
    merged_decode_ratio: float | None
    merged_prefill_ratio: float | None
    # The live admission cap while merged, as the simulated pair's (each replica's
    # --kunserve-merged-max-running times two: the simulation queues a merged pair as one);
    # None: no cap
    merged_running_cap: int | None = None
    # The dp2 arm's forwards, as ``benchmark.replay.forwards`` reads its log (empty: no log)
    dp2_timings: tuple[ForwardTiming, ...] = ()
    # The KunServe arm's decode forwards while merged (empty: no log or no drop)
    merged_decode_timings: tuple[ForwardTiming, ...] = ()
    # Per arm: whether its servers ran SGLang's overlap scheduler (``sim.ClusterSim``)
    overlap_schedule: dict[str, bool] = dataclasses.field(default_factory=dict)


# The flags that turn SGLang's overlap scheduler off: its own, and KunServe's (the plugin
# turns it off for every transition-capable server)
NO_OVERLAP_FLAGS = ("--disable-overlap-schedule", "--enable-kunserve", "--enable-morph")


def overlap_schedule(arm: dict[str, Any]) -> bool:
    return not set(NO_OVERLAP_FLAGS) & set(arm.get("server_args") or ())


def load_round(path: Path) -> LiveRound:
    report = json.loads((path / "replay_dp2.json").read_text())
    arms = report["dp2"]["configs"]
    missing = [a for a in ARMS if "records" not in arms.get(a, {})]
    if missing:
        raise ValueError(f"{path}: no completed arm {missing} (run the replay with --configs "
                         f"dp2,kunserve)")
    forwards = arms["dp2"].get("forwards") or {}
    if "fit" not in forwards:
        raise ValueError(f"{path}: the dp2 arm has no fitted forwards "
                         f"({forwards.get('error', 'a replay from before forward logging')})")
    dp2 = arms["dp2"]
    # Offsets from the arm's start, as the client scheduled them (both arms send the same).
    requests = tuple(KS.Request(str(r["index"]), r["scheduled_unix_s"] - dp2["start_unix_s"],
                                r["prompt_tokens"], r["max_new_tokens"])
                     for r in sorted(dp2["records"], key=lambda r: r["scheduled_unix_s"]))
    own = [t for t in arms["kunserve"].get("kunserve_transitions", []) if t["replica"] == 0]
    merged = [s["kv_capacity_per_replica"][0] for s in arms["kunserve"]["status_samples"]
              if s.get("group_size", 1) > 1]
    raw_cfg = controller_config(report, arms["kunserve"])
    interval_s = raw_cfg.pop("interval_ms", DEFAULT_INTERVAL_S * 1e3) / 1e3
    return LiveRound(
        path=path, requests=requests,
        kv_tokens_per_replica=report["dp2"]["kv_capacity_tokens_per_replica"],
        merged_kv_tokens_per_replica=max(merged) if merged else None, forwards=forwards,
        drops_s=tuple(t["duration_s"] for t in own if t["action"] == "drop"),
        restores_s=tuple(t["duration_s"] for t in own if t["action"] == "restore"),
        controller=ControllerConfig(**raw_cfg), interval_s=interval_s,
        live={a: distribution(arms[a]) for a in ARMS},
        commit=report["settings"]["git"]["commit"],
        dp2_records=tuple(dp2["records"]),
        merged_decode_ratio=_merged_ratio(arms["kunserve"], "decode"),
        merged_prefill_ratio=_merged_ratio(arms["kunserve"], "prefill"),
        merged_running_cap=(2 * cap if (cap := report["settings"].get(
            "kunserve_merged_max_running")) is not None else None),
        overlap_schedule={a: overlap_schedule(arms[a]) for a in ARMS},
        dp2_timings=_logged(path, forwards),
        merged_decode_timings=tuple(
            t for t in _logged(path, arms["kunserve"].get("forwards") or {},
                               merged_windows(arms["kunserve"])) if t.phase == "decode"))


def _logged(path: Path, forwards: dict[str, Any],
            windows: Sequence[tuple[float, float]] | None = None) -> tuple[ForwardTiming, ...]:
    """An arm's logged forwards (``windows``: only those inside them); none without a log."""
    log = path / forwards.get("log", "-")
    if not log.is_file():
        return ()
    return tuple(timings_of([f for f in read_log(log)
                             if windows is None or in_windows(f, windows)]))


def controller_config(report: dict[str, Any], arm: dict[str, Any]) -> dict[str, Any]:
    """The controller's settings the KunServe arm ran with: what its leader reported (every
    field, the defaults of the code that ran included), else the replay's
    ``--kunserve-auto-config`` over the defaults of this code."""
    for rep in arm.get("kunserve_auto") or ():
        if rep.get("role") == "leader" and rep.get("config"):
            return dict(rep["config"])
    return json.loads(report["settings"].get("kunserve_auto_config") or "{}")


class Unavailable(ValueError):
    """A calibration the rounds hold no measurement for: its rows are left out, with this."""


def _merged_ratio(arm: dict[str, Any], phase: str) -> float | None:
    return ((arm.get("forwards") or {}).get(f"merged_{phase}_ratio") or {}).get("median")


def planner_for(spec: ModelSpec, kv_tokens_per_replica: int, max_group_size: int = 2
                ) -> DropPlannerConfig:
    """Groups (of two, as live) whose full replica holds exactly the live pool: the budget is
    the memory model's weights plus that many tokens of KV."""
    memory = MemoryModel.from_spec(spec, bits=(16,))
    probe = DropPlannerConfig(memory, 1 << 40, max_group_size=max_group_size)
    budget = (probe.full_weight_bytes
              + kv_tokens_per_replica * probe.full_replica(0).kv_bytes_per_token)
    planner = DropPlannerConfig(memory, budget, max_group_size=max_group_size)
    got = planner.full_replica(0).kv_capacity_tokens
    if got != kv_tokens_per_replica:
        raise AssertionError(f"the planner's pool is {got} tokens, the live one "
                             f"{kv_tokens_per_replica}")
    return planner


def calibration(name: str, rnd: LiveRound, spec: ModelSpec, rounds: Sequence[LiveRound],
                results: Path = KS.RESULTS) -> KS.Calibration:
    idle = KS.Calibration.load(results, spec)
    if CALIBRATIONS[name] is None:
        return idle
    transitions, merged_decode, merged_prefill = CALIBRATIONS[name]
    fitted = forward_costs(rnd)
    gap_s = rnd.forwards["step_gap_s"]["median"] or 0.0
    # The schedulers' own work between two forwards is paid once per forward, like gamma.
    costs = dataclasses.replace(
        fitted, prefill=dataclasses.replace(fitted.prefill,
                                            gamma_s=fitted.prefill.gamma_s + gap_s),
        decode=dataclasses.replace(fitted.decode, gamma_s=fitted.decode.gamma_s + gap_s),
        source=f"{rnd.path}: the dp2 arm's forwards + {gap_s * 1e3:.1f} ms step gap"
        + (", + the decode fit's error per batch size" if rnd.dp2_timings else ""))
    cal = dataclasses.replace(idle, costs=costs)
    cal = dataclasses.replace(cal, front_end_s=front_end_s(rnd, cal, spec))
    if transitions:
        # Pooled over the rounds: a round without a drop still gets the live durations.
        drops = [d for r in rounds for d in r.drops_s]
        restores = [d for r in rounds for d in r.restores_s]
        cal = dataclasses.replace(cal, drop_s=statistics.median(drops) if drops else None,
                                  restore_s=statistics.median(restores) if restores else None)
    if merged_decode:
        ratios = [m for r in rounds if (m := merged_decode_ratio(r)) is not None]
        cal = dataclasses.replace(cal, merged_step_factor=statistics.median(ratios) if ratios
                                  else 1.0)
    if merged_prefill:
        ratios = [r.merged_prefill_ratio for r in rounds if r.merged_prefill_ratio is not None]
        if not ratios:
            raise Unavailable("no round has a merged prefill ratio (no drop, or forward logs "
                              "fitted before it was measured: python -m "
                              "benchmark.replay.forwards fits them again)")
        cal = dataclasses.replace(cal, merged_prefill_factor=statistics.median(ratios))
    return cal


def forward_costs(rnd: LiveRound) -> KS.BatchCorrectedCosts:
    """The cost model fitted on the dp2 arm's forwards, with the decode fit's error at each
    batch size the arm ran (``sim.BatchCorrectedCosts``); no step gap."""
    fitted = PhaseCosts.from_json(rnd.forwards["fit"])
    return KS.BatchCorrectedCosts(fitted.prefill, fitted.decode, fitted.source,
                                  KS.decode_errors_s(fitted, rnd.dp2_timings))


def merged_decode_ratio(rnd: LiveRound) -> float | None:
    """The KunServe arm's merged decode forwards over what the simulation's cost model
    (``forward_costs``) gives the same batch on a whole replica, median; from its forward log,
    else the ratio the replay recorded (to its own unmerged fit). A merged forward runs from
    the replica's first layer to the peer's answer, waits for the peer's stage included.

    Against the simulation's model, not the arm's own fit: the merged replicas decode batches
    of 9-16 requests that a whole replica never ran in the replay, and the linear fit of
    batches 1-8 overstates those (measured 0.75-0.95x the fit at BurstGPT 1.5x)."""
    if rnd.merged_decode_timings:
        costs = forward_costs(rnd)
        return statistics.median(t.seconds / costs.seconds(t.chunks)
                                 for t in rnd.merged_decode_timings)
    return rnd.merged_decode_ratio


def front_end_s(rnd: LiveRound, cal: KS.Calibration, spec: ModelSpec) -> float:
    """What the plain arm's requests that SGLang admitted at once (queue under
    ``PROMPT_QUEUE_S``) spent before their first token beyond the simulated schedulers'
    time, median: the HTTP, tokenizer and detokenizer path the simulation has no steps for.
    The same code serves both arms; what differs, SGLang's overlap scheduler (on in the plain
    arm, off with KunServe: on this CPU it hands each token on one forward later, 0.07-0.12 s
    of the plain arm's first tokens), the simulation models (``sim.ClusterSim``)."""
    planner = planner_for(spec, rnd.kv_tokens_per_replica)
    s = KS.simulate(rnd.requests, 2, planner, dataclasses.replace(cal, front_end_s=0.0), False,
                    monitor_s=rnd.interval_s, controller_cfg=rnd.controller,
                    overlap_schedule=rnd.overlap_schedule.get("dp2", False))
    simulated_ttft = {r.rid: r.token_times_s[0] - r.arrival_s for r in s.finished}
    residuals = [r["ttft_s"] - simulated_ttft[str(r["index"])] for r in rnd.dp2_records
                 if r["ttft_s"] is not None and (r.get("queue_time_s") or 0.0) < PROMPT_QUEUE_S]
    return max(0.0, statistics.median(residuals)) if residuals else 0.0


def simulated(rnd: LiveRound, cal: KS.Calibration, planner: DropPlannerConfig, kunserve: bool,
              controller: ControllerConfig | None = None,
              merged_running_cap: int | None = None,
              merged_queues: str = "pair") -> tuple[dict[str, Any], KS.ClusterSim]:
    """The round's requests on a simulated pair (its controller and admission cap unless others
    are given)."""
    s = KS.simulate(rnd.requests, 2, planner, cal, kunserve, monitor_s=rnd.interval_s,
                    controller_cfg=controller or rnd.controller,
                    merged_running_cap=merged_running_cap or rnd.merged_running_cap,
                    merged_queues=merged_queues,
                    overlap_schedule=rnd.overlap_schedule.get(
                        "kunserve" if kunserve else "dp2", False))
    return distribution_of(s), s


def distribution_of(s: KS.ClusterSim) -> dict[str, Any]:
    """The simulated requests' distribution, as ``benchmark.kunserve.rounds`` gives a live
    arm's (every request must have finished)."""
    if len(s.finished) != len(s.requests):
        raise RuntimeError(f"{len(s.finished)} of {len(s.requests)} simulated requests "
                           f"finished")
    records = [{"index": r.rid, "ttft_s": r.token_times_s[0] - r.arrival_s,
                "tpot_s": ((r.token_times_s[-1] - r.token_times_s[0])
                           / (len(r.token_times_s) - 1)) if len(r.token_times_s) > 1 else None,
                "e2e_s": r.token_times_s[-1] - r.arrival_s} for r in s.finished]
    return distribution({"records": records})


def validate(rounds: Sequence[LiveRound], spec: ModelSpec) -> dict[str, Any]:
    live = {a: {k: spread([r.live[a][k] for r in rounds]) for k in SHOWN} for a in ARMS}
    out: dict[str, Any] = {"live": live, "calibrations": {}, "left_out": {}}
    for name, cal_name, queues in ROWS:
        per_round, transitions, cals = [], [], []
        try:
            cals = [calibration(cal_name, rnd, spec, rounds) for rnd in rounds]
        except Unavailable as e:
            out["left_out"][name] = str(e)
            continue
        for rnd, cal in zip(rounds, cals):
            planner = planner_for(spec, rnd.kv_tokens_per_replica)
            row = {}
            for arm in ARMS:
                row[arm], s = simulated(rnd, cal, planner, arm == "kunserve",
                                        merged_queues=queues)
                if arm == "kunserve":
                    transitions.append([{k: t[k] for k in ("kind", "at_s", "seconds")}
                                        for t in s.transitions])
            per_round.append(row)
        sim = {a: {k: spread([r[a][k] for r in per_round]) for k in SHOWN} for a in ARMS}
        errors = {a: {k: sim[a][k]["median"] / live[a][k]["median"] - 1 for k in SHOWN}
                  for a in ARMS}
        out["calibrations"][name] = {
            "simulated": sim, "error": errors, "transitions": transitions,
            "within_tolerance": all(abs(errors[a][k]) <= TOLERANCE for a in ARMS
                                    for k in CHECKED),
            "merged_kv_tokens_per_replica": merged_pool_tokens(
                planner_for(spec, rounds[0].kv_tokens_per_replica)),
            "costs": cals[0].costs.to_json(), "front_end_s": [c.front_end_s for c in cals]}
    out["live_merged_kv_tokens_per_replica"] = [r.merged_kv_tokens_per_replica for r in rounds]
    out["live_transitions_s"] = {"drop": [d for r in rounds for d in r.drops_s],
                                 "restore": [d for r in rounds for d in r.restores_s]}
    out["step_gap_s"] = [r.forwards["step_gap_s"] for r in rounds]
    out["fit"] = [r.forwards["phases"] for r in rounds]
    return out


def merged_pool_tokens(planner: DropPlannerConfig) -> int:
    """The pool per member the planner gives a pair that drops half its layers each."""
    return min(planner.member(i, layers).kv_capacity_tokens
               for i, layers in enumerate(split_layers(planner.num_layers, 2)))


def run_line(meta: dict[str, Any]) -> str:
    """The command, commit and machine of a study of rounds, and the rounds it read."""
    return (f"`{meta['command']}` at commit {meta['git']['commit'][:7]} (dirty: "
            f"{meta['git']['dirty']}), {meta['machine']['cpu_model']}, "
            f"{meta['machine']['cpu_cores']} cores; rounds: {', '.join(meta['rounds'])}")


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = ["# KunServe's simulation against the live two-replica replay", "",
             run_line(meta) + " (replays at "
             f"{', '.join(sorted(set(c[:7] for c in meta['round_commits'])))}).", "",
             "Live: the replays' medians over the rounds (min to max). SIMULATED: the same "
             "requests on a SimPy pair, one run per round and calibration, median over the "
             "rounds. Error: simulated median over live median - 1. The check: P50 / P99 "
             f"TTFT and P50 TPOT within {TOLERANCE:.0%} in both arms.", "",
             "| calibration | arm | " + " | ".join(SHOWN) + " | check |",
             "|---|---|" + "---|" * len(SHOWN) + "---|"]
    v = report["validation"]
    for arm in ARMS:
        cells = [f"{v['live'][arm][k]['median']:.3f} ({v['live'][arm][k]['min']:.3f}-"
                 f"{v['live'][arm][k]['max']:.3f})" for k in SHOWN]
        lines.append(f"| live | {arm} | " + " | ".join(cells) + " | |")
    for name, c in v["calibrations"].items():
        for arm in ARMS:
            cells = [f"{c['simulated'][arm][k]['median']:.3f} ({c['error'][arm][k]:+.0%})"
                     for k in SHOWN]
            ok = all(abs(c["error"][arm][k]) <= TOLERANCE for k in CHECKED)
            lines.append(f"| {name} (SIMULATED) | {arm} | " + " | ".join(cells)
                         + f" | {'within' if ok else 'outside'} |")
    lines += [f"| {name} | | left out: {why} |" for name, why in v.get("left_out", {}).items()]
    lines += ["", "Calibrations: " + "; ".join(
        f"`{n}`: {c['costs']['source'] or 'the simulated clusters default'}"
        for n, c in v["calibrations"].items()) + ".", "",
        f"Live transitions (replica 0, seconds): drops {v['live_transitions_s']['drop']}, "
        f"restores {v['live_transitions_s']['restore']}. Simulated drops and restores per "
        "round (at s, lasting s): " + "; ".join(
            f"`{n}` " + " / ".join(", ".join(f"{t['kind']} {t['at_s']:.1f}+{t['seconds']:.2f}"
                                             for t in ts) or "none"
                                   for ts in c["transitions"])
            for n, c in v["calibrations"].items()) + ".", "",
        "KV after a drop: live, each replica's own pool "
        f"{v['live_merged_kv_tokens_per_replica']} tokens (its mirror of the peer's requests "
        "as large again); the planner's pair holds "
        f"{v['calibrations']['idle']['merged_kv_tokens_per_replica']} tokens of requests.", "",
        "Cost fits on the dp2 arm's forwards (per round): " + "; ".join(
            f"prefill {f['prefill']['forwards']} forwards, mean error "
            f"{f['prefill']['mean_error']:.1%}, decode {f['decode']['forwards']}, "
            f"{f['decode']['mean_error']:.1%}" for f in v["fit"]) + "; step gaps (median) "
        + ", ".join(f"{g['median'] * 1e3:.1f} ms" for g in v["step_gap_s"]) + ".", ""]
    return "\n".join(lines)


def rounds_cli(prog: str, description: str, argv: Sequence[str] | None, extra=None
               ) -> tuple[argparse.Namespace, list[LiveRound], ModelSpec]:
    """The command line of a study of replay rounds: the rounds (a CLI error names a round
    that cannot be read) and the float32 default model's spec; ``extra(parser)`` adds the
    study's own options."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("rounds", nargs="+", type=Path,
                    help="output directories of `benchmark.replay --dp2 --configs dp2,kunserve`")
    ap.add_argument("--out", type=Path, default=KS.RESULTS)
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    from sglang_morph.models import default_model_path

    try:
        rounds = [load_round(p) for p in args.rounds]
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    return args, rounds, ModelSpec.from_model_dir(default_model_path(),
                                                  dtype_bytes=DTYPE_BYTES)


def main(argv: Sequence[str] | None = None) -> int:
    started, load = time.monotonic(), load_average()
    args, rounds, spec = rounds_cli("python -m benchmark.kunserve.validate",
                                    __doc__.splitlines()[0], argv)
    validation = validate(rounds, spec)
    meta = run_meta("python -m benchmark.kunserve.validate " + " ".join(
        sys.argv[1:] if argv is None else argv), load, SIMULATED="the simulated rows",
        seconds=time.monotonic() - started, rounds=[str(p) for p in args.rounds],
        round_commits=[r.commit for r in rounds])
    report = {"meta": meta, "validation": validation}
    write_results(args.out, "validate", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
