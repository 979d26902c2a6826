"""The AMOEBAs simulator (``benchmark/amoebas/sim.py``) against a live 4-replica server on the
same requests.

    .venv/bin/python -m benchmark.amoebas.validate [--short-per-s 6] [--pool-tokens 1024]
    .venv/bin/python -m benchmark.amoebas.validate --quick   # harness check: 15 s of load
    .venv/bin/python -m benchmark.amoebas.validate --from-live RAW/live.json  # no server

One ``scripts/serve.sh`` server of the tiny random Llama (8 query / 4 KV heads): ``--dp-size 4
--enable-amoebas --max-total-tokens P --dtype float32`` (automatic transitions), one thread
per rank, ``--stream-interval 8`` (a chunk per token would cost the 2 cores more than the tiny
model's forward) and ``--decode-log-interval 5`` (the calibration reads the scheduler's log).
In order:

1. Calibration, before any replayed request: the simulator's step costs on this machine, as
   the replay will see them (four replicas sharing the cores, each decoding while prompts
   arrive). Decode: ``b`` streamed requests routed to every replica at once, at the batch sizes
   the replay runs (1 to 8); meanwhile each replica gets a one-token request every
   ``inject_period_s`` with a prompt of the replay's sizes. The times come from the schedulers'
   own log, not from the client (streamed chunks reach a client on 2 busy cores in clumps):
   every ``--decode-log-interval`` decode steps a replica logs its batch, KV tokens and output
   tokens per second since its previous line, so an interval between two lines of the same
   batch size took ``steps * batch / throughput`` seconds. Intervals without a prefill give
   the decode step (fitted: KunServe's chunk cost model); an interval with exactly one
   injected prefill, minus its fitted decode steps, gives that prefill's time (the median per
   prompt size is fitted the same way). Time to first token of a prompt on every idle replica
   at once, minus the fitted prefill, is latency outside the replicas (HTTP, tokenizer,
   controller, detokenizer): the simulator adds it to every request's TTFT and E2E, holding no
   replica. One long prompt then merges a pair, which splits once it is served: the replicas'
   records of the two give the fixed merge and split costs and a TP 2 owner's pool. All-reduce
   latency, link and host-copy bandwidth: ``benchmark/results/kunserve/transfer.json`` (gloo).
2. The operating point, from the live server, not the simulator: a closed-loop probe
   (``probe_per_replica`` short requests per replica in flight, the replay's lengths, placed
   by the controller) measures the output tokens per second the server sustains; the replay
   offers ``LOAD_SHARE`` of it (``size_rate``) unless ``--short-per-s``. A server pushed past
   its capacity collapses into queueing and says little about the model; at this load it
   serves what arrives, so throughput, transitions, KV and latencies are compared where the
   server works.
3. The replay (``benchmark/replay/client.py``, open loop, streamed): Poisson short requests
   plus long prompts at fixed times that no TP 1 pool holds and a TP 2 owner pool does, so
   only the pairs merge (a live server merges TP 1 replicas only).
4. The simulator on the same requests (arrival times, prompt lengths, max_new_tokens), with
   the policy the live server builds (``auto.live_policy`` over the live pools) and the live
   replicas' wait of ``min_dwell_s`` after a merge before they split; and on the probe's mix
   overloaded open loop, for its SIMULATED capacity beside the probed one.

Checked against ``--target`` (15%): output tokens per second over the arrival window, and
merges + splits; capacity, completions, KV held, offered load and latencies are reported
beside them. The live run is saved first (``live.json`` in RAW,
``benchmark/results/raw/amoebas_validate``), then analysed; ``--from-live`` analyses a saved
run again without a server. Writes ``benchmark/results/amoebas/validate.json`` and
``validate.md`` (``--quick``: everything under ``benchmark/results/raw/amoebas_validate_quick``,
so a harness check never overwrites a real run's record).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from benchmark.amoebas import sim as S
from benchmark.harness import REPO_ROOT, load_average, run_meta, running_server
from benchmark.replay import metrics as M
from benchmark.replay.client import replay
from benchmark.replay.trace import TraceRequest
from sglang_morph.amoebas.capacity import CapacityModel
from sglang_morph.amoebas.policy import Request
from sglang_morph.kunserve import cost as C

REPLICAS = 4
DTYPE_BYTES = 4  # float32: the CPU serving dtype
STREAM_INTERVAL = 8
DECODE_LOG_INTERVAL_STEPS = 5  # short intervals: a prefill is a large share of one
SERVER_ENV = {"OMP_NUM_THREADS": "1"}  # four ranks of two threads would oversubscribe 2 cores
SGLANG_PROMPT_MARGIN_TOKENS = 6  # SGLang admits a prompt under pool - 1 - 5 tokens
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # random ids: no two prompts share a cached prefix
SIM_SAMPLE_S = 0.25  # as often as the client samples /amoebas/status
LOAD_SHARE = 0.65  # of the probed capacity: the server keeps up, with room for the bursts
LOG_SETTLE_S = 0.5  # for the schedulers' last log lines of a calibration point to land
RESULTS = REPO_ROOT / "benchmark" / "results" / "amoebas"
RAW = REPO_ROOT / "benchmark" / "results" / "raw"
ALONE = [[r] for r in range(REPLICAS)]


@dataclasses.dataclass(frozen=True)
class ValidationWorkload:
    """Short requests arriving as a Poisson process over ``duration_s`` (lengths uniform within
    the bounds, inclusive) plus long prompts at fixed times; the seed fixes every draw."""

    duration_s: float
    short_per_s: float
    short_prompt_tokens: tuple[int, int]
    short_new_tokens: tuple[int, int]
    long_arrivals_s: tuple[float, ...]
    long_prompt_tokens: tuple[int, ...]
    long_new_tokens: int
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.duration_s <= 0 or self.short_per_s <= 0 or self.long_new_tokens < 1
                or len(self.long_arrivals_s) != len(self.long_prompt_tokens)
                or any(not 0 <= t < self.duration_s for t in self.long_arrivals_s)
                or any(not 1 <= lo <= hi for lo, hi in (self.short_prompt_tokens,
                                                         self.short_new_tokens))):
            raise ValueError(f"workload: positive duration and rate, one prompt per long "
                             f"arrival inside the window, 1 <= lo <= hi lengths: {self}")

    def requests(self) -> tuple[list[TraceRequest], frozenset[int]]:
        """Every request by arrival (a long one after a short one at the same time), indexed
        by position, and the indices of the long ones."""
        rng = np.random.default_rng(self.seed)
        tagged, t = [], 0.0
        while (t := t + rng.exponential(1.0 / self.short_per_s)) < self.duration_s:
            p, n = (int(rng.integers(lo, hi + 1)) for lo, hi in (self.short_prompt_tokens,
                                                                  self.short_new_tokens))
            tagged.append((t, False, p, n))
        tagged += [(t, True, p, self.long_new_tokens)
                   for t, p in zip(self.long_arrivals_s, self.long_prompt_tokens)]
        tagged.sort(key=lambda x: (x[0], x[1]))
        reqs = [TraceRequest(k, t, p, n, p, n) for k, (t, _, p, n) in enumerate(tagged)]
        return reqs, frozenset(k for k, x in enumerate(tagged) if x[1])

    def check_lengths(self, capacity: CapacityModel) -> None:
        """Shorts fit a TP 1 pool; a replica alone refuses a long prompt (so it parks it and
        proposes a merge) and a TP 2 owner's pool holds it whole, so only pairs merge."""
        tp1, tp2 = capacity.owner_capacity_tokens(1), capacity.owner_capacity_tokens(2)
        if self.short_prompt_tokens[1] + self.short_new_tokens[1] > tp1:
            raise ValueError(f"short requests must fit a TP 1 pool of {tp1} tokens")
        for p in self.long_prompt_tokens:
            if not (tp1 - SGLANG_PROMPT_MARGIN_TOKENS <= p < tp2 - SGLANG_PROMPT_MARGIN_TOKENS
                    and p + self.long_new_tokens <= tp2):
                raise ValueError(f"long prompt {p} (+{self.long_new_tokens}) must exceed a TP 1 "
                                 f"pool ({tp1}) and fit a TP 2 owner's ({tp2})")


@dataclasses.dataclass(frozen=True)
class CalibrationPlan:
    """What the calibration runs; every replica does each part at once."""

    decode_points: tuple[tuple[int, int, int], ...]  # (requests per replica, prompt, new tokens)
    inject_prompt_tokens: tuple[int, ...]  # one-token prompts prefilled while replicas decode
    inject_period_s: float  # per replica
    ttft_prompt_tokens: tuple[int, ...]  # on idle replicas: the latency outside them
    repeats: int
    probe_per_replica: int  # closed-loop probe: short requests in flight per replica
    probe_warmup_s: float
    probe_s: float

    def inject_sizes(self, point: tuple[int, int, int], pool_tokens: int) -> tuple[int, ...]:
        """The injected prompts that fit beside a point's requests (each reserving its prompt
        and new tokens), so an injection never waits for a decode to finish."""
        b, prompt, new = point
        room = pool_tokens - SGLANG_PROMPT_MARGIN_TOKENS - b * (prompt + new)
        return tuple(n for n in self.inject_prompt_tokens if n + 1 <= room)


@dataclasses.dataclass(frozen=True)
class Settings:
    workload: ValidationWorkload
    calibration: CalibrationPlan
    pool_tokens: int  # P: each replica's --max-total-tokens
    target: float
    drain_timeout_s: float
    split_wait_s: float
    out_dir: Path
    raw_dir: Path


# short_per_s: replaced by the rate sized from the live probe unless --short-per-s. Two long
# prompts (30 s, 31 s) land together: the second joins the first's pair or merges the other
# pair, a choice that depends on timing, where simulator and server may part.
FULL = ValidationWorkload(75.0, 6.0, (32, 192), (32, 128), (10.0, 30.0, 31.0, 52.0),
                          (1200, 1500, 1300, 1650), 48)
QUICK = ValidationWorkload(15.0, 3.0, (32, 128), (16, 48), (5.0,), (1200,), 16)
# Batch sizes as the replay runs them (1 to 8 on a replica); each point decodes long enough for
# a dozen log intervals.
FULL_CAL = CalibrationPlan(((1, 128, 200), (2, 96, 160), (4, 64, 120), (8, 24, 72)),
                           (32, 96, 192, 384, 640), 1.0, (32, 256, 512, 960), 2, 6, 5.0, 30.0)
QUICK_CAL = CalibrationPlan(((1, 96, 120), (4, 48, 80)), (32, 128, 384), 0.8, (32, 256, 768),
                            1, 6, 3.0, 8.0)


# ---- pure parts: progress, metrics, comparison, policy parameters, step costs ---------------


def tokens_by(chunks: Sequence[Sequence[float]], t: float) -> float:
    """Output tokens a streamed request had at time ``t``: none before its first chunk, linear
    between chunks (one every ``STREAM_INTERVAL`` tokens), all after the last."""
    if not chunks or t < chunks[0][0]:
        return 0.0
    for (t0, n0), (t1, n1) in zip(chunks, chunks[1:]):
        if t < t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0)
    return float(chunks[-1][1])


def summarize(outcomes: Sequence[dict], window_s: float, window_tokens: float, merges: int,
              splits: int, kv_held_share: float | None) -> dict[str, Any]:
    """``outcomes``: per request ``long``, ``arrival_s``, ``first_token_s``, ``finish_s`` (None
    when not served whole), ``output_tokens``, ``max_new_tokens``; times from the start."""
    done = [o for o in outcomes if o["finish_s"] is not None]
    makespan = max((o["finish_s"] for o in done), default=0.0)
    out = {"requests": len(outcomes), "completed": len(done),
           "completed_long": sum(o["long"] for o in done),
           "offered_output_tokens_per_s": sum(o["max_new_tokens"] for o in outcomes
                                              if o["arrival_s"] < window_s) / window_s,
           "window_output_tokens_per_s": window_tokens / window_s, "makespan_s": makespan,
           "makespan_output_tokens_per_s": sum(o["output_tokens"] for o in done) / makespan
           if makespan else None,
           "merges": merges, "splits": splits, "transitions": merges + splits,
           "kv_held_share": kv_held_share}
    for kind in ("short", "long"):
        mine = [o for o in done if o["long"] == (kind == "long")]
        for key, since in (("ttft", "first_token_s"), ("e2e", "finish_s")):
            p = M.percentiles([o[since] - o["arrival_s"] for o in mine])
            out.update({f"{kind}_{key}_p50_s": p["p50"], f"{kind}_{key}_p95_s": p["p95"]})
    return out


CHECKED = ("window_output_tokens_per_s", "transitions")
REPORTED = ("capacity_output_tokens_per_s", "offered_output_tokens_per_s",
            "makespan_output_tokens_per_s", "completed", "completed_long", "merges", "splits",
            "kv_held_share", "short_ttft_p50_s", "short_ttft_p95_s", "short_e2e_p50_s",
            "short_e2e_p95_s", "long_ttft_p50_s", "long_e2e_p50_s")


def relative_error(simulated: float | None, live: float | None) -> float | None:
    """(SIMULATED - live) / live; 0 when both are 0; None when undefined."""
    if simulated is None or live is None or (live == 0 and simulated != 0):
        return None
    return 0.0 if live == 0 else (simulated - live) / live


def compare(live: dict, simulated: dict, target: float) -> dict[str, Any]:
    """Each checked and reported metric side by side (a reported one either side lacks: None)."""
    rows = {}
    for key in CHECKED + REPORTED:
        err = relative_error(simulated.get(key), live.get(key))
        rows[key] = {"live": live.get(key), "simulated": simulated.get(key),
                     "relative_error": err,
                     "checked": key in CHECKED, "within_target": None if key not in CHECKED
                     else err is not None and abs(err) <= target}
    return {"target": target, "rows": rows,
            "passed": all(rows[k]["within_target"] for k in CHECKED),
            # The load is sized for the server to keep up; one that did not (90%: the requests
            # running at the window's end lag a few percent anyway) ran past its capacity.
            "saturated": live["window_output_tokens_per_s"]
            < 0.9 * live["offered_output_tokens_per_s"]}


def live_params(model_config: dict, status: dict, tp2_pool_tokens: int | None) -> dict:
    """What ``auto.policy_params`` publishes, from ``/amoebas/status``: the pools the replicas
    report (TP 2: the calibration merge's; larger degrees: the capacity model's)."""
    reps = status["replicas"]
    owner = [[1, min(r["kv_capacity_tokens_alone"] for r in reps)]]
    owner += [[2, tp2_pool_tokens]] if tp2_pool_tokens else []
    return {"model": model_config, "dtype_bytes": DTYPE_BYTES, "replicas": len(reps),
            "page_size_tokens": 1,  # SGLang's on CPU
            "groups": reps[0]["groups_allowed"], "owner_tokens": owner}


_LOG_RANK = re.compile(r" DP(\d+)[^\]]*\] (Prefill|Decode) batch, ")
_LOG_DECODE = re.compile(r"#running-req: (\d+), #token: (\d+),.*gen throughput \(token/s\): "
                         r"([0-9.]+)")
_LOG_PREFILL = re.compile(r"#new-seq: (\d+), #new-token: (\d+),")


def log_events(text: str) -> list[dict]:
    """The schedulers' batch lines, in order: ``{"rank", "kind": "decode", "running",
    "kv_tokens", "tokens_per_s"}`` or ``{"rank", "kind": "prefill", "seqs", "new_tokens"}``."""
    out = []
    for line in text.splitlines():
        if not (m := _LOG_RANK.search(line)):
            continue
        rank, kind = int(m.group(1)), m.group(2).lower()
        if kind == "decode" and (d := _LOG_DECODE.search(line)):
            out.append({"rank": rank, "kind": kind, "running": int(d.group(1)),
                        "kv_tokens": int(d.group(2)), "tokens_per_s": float(d.group(3))})
        elif kind == "prefill" and (f := _LOG_PREFILL.search(line)):
            out.append({"rank": rank, "kind": kind, "seqs": int(f.group(1)),
                        "new_tokens": int(f.group(2))})
    return out


def decode_intervals(events: Sequence[dict], steps: int) -> list[dict]:
    """One record per pair of consecutive decode lines of a replica with the same batch: what
    ran between them (``steps`` decode steps of ``batch`` requests, then each prefill logged in
    between) took ``steps * batch / throughput`` seconds, as the scheduler measured it
    (prefills add no output tokens to that count). ``context_tokens``: a request's mean KV
    over the interval. A batch that changed between the lines (a request joined or left) is
    skipped: its token count is not ``steps * batch``."""
    last: dict[int, dict] = {}
    prefills: dict[int, list[dict]] = {}
    out = []
    for e in events:
        r = e["rank"]
        if e["kind"] == "prefill":
            prefills.setdefault(r, []).append(e)
            continue
        prev, between = last.get(r), prefills.pop(r, [])
        last[r] = e
        if prev is None or prev["running"] != e["running"] or e["running"] < 1 \
                or e["tokens_per_s"] <= 0:
            continue
        b = e["running"]
        out.append({"rank": r, "batch": b, "steps": steps,
                    "context_tokens": max(1.0, e["kv_tokens"] / b - steps / 2),
                    "seconds": steps * b / e["tokens_per_s"],
                    "prefill_tokens": [x["new_tokens"] for x in between],
                    "prefill_seqs": sum(x["seqs"] for x in between)})
    return out


def _decode_timing(iv: dict) -> C.ForwardTiming:
    """One decode step of the interval (its mean), at the interval's mean context."""
    return C.ForwardTiming((C.Chunk(round(iv["context_tokens"]), 1),) * iv["batch"],
                           iv["seconds"] / iv["steps"])


def fit_step_costs(intervals: Sequence[dict]) -> tuple[C.ChunkCostModel, C.ChunkCostModel,
                                                        dict]:
    """Decode from the intervals without a prefill; prefill from those with exactly one (a
    one-sequence batch): the interval less its fitted decode steps, the median per prompt size
    (a prefill is a few decode steps long, so one interval's noise is a large share of it)."""
    clean = [_decode_timing(iv) for iv in intervals if not iv["prefill_tokens"]]
    if len({len(t.chunks) for t in clean}) < 2:
        raise ValueError(f"calibration: decode intervals at two batch sizes at least are needed, "
                         f"got {len(clean)} intervals")
    decode = C.fit_chunk_cost(clean, C.KUNSERVE_TERMS)
    by_size: dict[int, list[float]] = {}
    for iv in intervals:
        if len(iv["prefill_tokens"]) == 1 and iv["prefill_seqs"] == 1:
            steps_s = iv["steps"] * decode.seconds(_decode_timing(iv).chunks)
            by_size.setdefault(iv["prefill_tokens"][0], []).append(iv["seconds"] - steps_s)
    medians = {n: statistics.median(xs) for n, xs in sorted(by_size.items())}
    prefill_timings = [C.ForwardTiming((C.Chunk(0, n),), s) for n, s in medians.items() if s > 0]
    if len(prefill_timings) < len(C.KUNSERVE_TERMS):
        raise ValueError(f"calibration: prefill medians at {len(C.KUNSERVE_TERMS)} prompt sizes "
                         f"at least are needed, got {medians}")
    prefill = C.fit_chunk_cost(prefill_timings, C.KUNSERVE_TERMS)
    return prefill, decode, {
        "decode_intervals_fitted": len(clean),
        "prefill_median_s": {str(n): s for n, s in medians.items()},
        "prefill_samples": {str(n): len(xs) for n, xs in sorted(by_size.items())},
        "fit_mean_relative_error": {
            "prefill": float(C.relative_errors(prefill, prefill_timings).mean()),
            "decode": float(C.relative_errors(decode, clean).mean())}}


def fit_costs(cal: dict, num_layers: int, transfer: dict) -> tuple[S.StepCosts, dict]:
    """Step costs from the calibration's log intervals, time-to-first-token points and
    transitions; without a calibration merge or split, KunServe's live drop / restore stand in
    (as in ``sim.ASSUMED``)."""
    prefill, decode, fit = fit_step_costs(cal["decode_intervals"])
    # What a prompt on an idle replica waits beyond its prefill: latency outside the replicas.
    overhead_s = max(0.0, statistics.median(
        x["seconds"] - prefill.seconds([C.Chunk(0, x["prompt_tokens"])])
        for x in cal["prefill_points"]))
    fixed = [[t["duration_s"] for t in cal["transitions"] if t["action"] == a]
             for a in ("merge", "split")]
    costs = S.StepCosts(C.PhaseCosts(prefill, decode, "calibration"), num_layers,
                        S.ALLREDUCES_PER_LAYER * transfer["gloo_latency_s"],
                        statistics.median(fixed[0]) if fixed[0] else 0.14,
                        statistics.median(fixed[1]) if fixed[1] else 0.28,
                        transfer["gloo_bandwidth_bytes_per_s"],
                        transfer["host_copy_bandwidth_bytes_per_s"],
                        "calibrated on the live server before the replay (schedulers' log); "
                        f"all-reduce, link and host copy: {S.KUNSERVE_RESULTS}/transfer.json")
    return costs, {**fit, "request_overhead_s": overhead_s, "transitions_measured": all(fixed)}


def size_rate(w: ValidationWorkload, capacity_tokens_per_s: float, share: float) -> float:
    """Short arrivals per second at which the workload offers ``share`` of the server's
    probed output rate (its long prompts' output included)."""
    long_tokens_per_s = w.long_new_tokens * len(w.long_arrivals_s) / w.duration_s
    mean_short_new = (w.short_new_tokens[0] + w.short_new_tokens[1]) / 2
    rate = (share * capacity_tokens_per_s - long_tokens_per_s) / mean_short_new
    if rate <= 0:
        raise ValueError(f"a probed capacity of {capacity_tokens_per_s:.1f} output tok/s leaves "
                         f"no room for short requests beside the long ones")
    return round(rate, 3)


# ---- the simulator on the same requests -----------------------------------------------------


class DwellAfterMerge:
    """The policy with the live replicas' wait after a merge: ``auto.AutoControl`` proposes no
    split until ``min_dwell_s`` after its group merged. The policy has no clock, so a split
    held back here is tried again (``ClusterSim.changed``) when the dwell ends."""

    def __init__(self, policy: Any, min_dwell_s: float):
        self.policy, self.name, self.min_dwell_s = policy, policy.name, min_dwell_s
        self.sim: S.ClusterSim | None = None  # set once the simulation is built
        self._wakeups: set[float] = set()

    def dispatch(self, request, fleet):
        return self.policy.dispatch(request, fleet)

    def maintenance(self, fleet):
        env, ready = self.sim.env, []
        for split in self.policy.maintenance(fleet):
            due = self.min_dwell_s + max(
                (t["at_s"] + t["seconds"] for t in self.sim.transitions
                 if t["kind"] == "merge" and t["members"] == list(split.members)),
                default=float("-inf"))
            if env.now >= due - 1e-9:
                ready.append(split)
            elif due not in self._wakeups:
                self._wakeups.add(due)
                env.process(self._wake(due - env.now))
        return ready

    def _wake(self, delay_s: float):
        yield self.sim.env.timeout(delay_s)
        self.sim.changed()


def _sample(sim: S.ClusterSim, curve: list[tuple[float, int, float]]):
    """(time, output tokens so far, KV held / pools) every ``SIM_SAMPLE_S`` until every
    request is served or refused."""
    while True:
        held = sum(r.context_tokens for m in sim.members.values() for r in m.running)
        pools = sum(u.capacity_tokens * u.degree for u in sim.units)
        curve.append((sim.env.now, sum(r.generated for r in sim.requests), held / pools))
        refused = set(map(id, sim.refused))
        if all(r.finish_s is not None or id(r) in refused for r in sim.requests):
            return
        yield sim.env.timeout(SIM_SAMPLE_S)


def simulate_same(reqs: Sequence[TraceRequest], capacity: CapacityModel, costs: S.StepCosts,
                  policy: Any, min_dwell_s: float, window_s: float, until_s: float,
                  overhead_s: float = 0.0) -> tuple[dict, list[dict], list[dict]]:
    """Summary, transitions, per-request outcomes; ``overhead_s``: latency outside the
    replicas, added to every first and last token."""
    sim_reqs = [S.SimRequest(Request(str(r.index), r.prompt_tokens, r.output_tokens),
                             r.arrival_s, capacity.is_long(r.prompt_tokens + r.output_tokens))
                for r in reqs]
    wrapped = DwellAfterMerge(policy, min_dwell_s)
    sim = S.ClusterSim(sim_reqs, capacity, costs, wrapped)
    wrapped.sim, curve = sim, []
    sim.env.process(_sample(sim, curve))
    sim.env.run(until=until_s)
    t, tokens, share = (np.array(x) for x in zip(*curve))
    late = {r: [None if x is None else x + overhead_s for x in (r.first_token_s, r.finish_s)]
            for r in sim.requests}
    outcomes = [{"index": int(r.request.rid), "long": r.long, "arrival_s": r.arrival_s,
                 "first_token_s": late[r][0],
                 "finish_s": late[r][1], "output_tokens": r.generated,
                 "max_new_tokens": r.request.max_new_tokens} for r in sim.requests]
    kinds = [x["kind"] for x in sim.transitions]
    summary = summarize(outcomes, window_s, float(np.interp(window_s, t, tokens)),
                        kinds.count("merge"), kinds.count("split"),
                        float(share[t <= window_s].mean()))
    return ({"SIMULATED": True, **summary, "refused": len(sim.refused)}, sim.transitions,
            outcomes)


# ---- the live server ------------------------------------------------------------------------


# One connection pool for every calibration and probe request: a client (and its TLS context)
# per request costs enough CPU on 2 busy cores that a burst of requests "at once" reached the
# server over seconds, one replica's batch never complete.
_CLIENT = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def stream_chunks(url: str, ids: list[int], new_tokens: int,
            rank: int | None) -> list[tuple[float, int]]:
    """(seconds since sent, tokens so far) per chunk of one request, routed to replica ``rank``
    (None: placed by the controller, as a replayed request is)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    if rank is not None:
        body["routed_dp_rank"] = rank
    t0, chunks = time.perf_counter(), []
    with _CLIENT.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                if n > (chunks[-1][1] if chunks else 0):
                    chunks.append((time.perf_counter() - t0, n))
    return chunks


def streams_at_once(url: str, jobs: list[tuple[list[int], int, int | None]]
             ) -> list[list[tuple[float, int]]]:
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: stream_chunks(url, *job), jobs))


def status(url: str) -> dict:
    return httpx.get(f"{url}/amoebas/status", timeout=60).raise_for_status().json()


def wait_alone(url: str, wait_s: float) -> dict:
    """``/amoebas/status`` once every replica serves alone again, or after ``wait_s``."""
    deadline = time.time() + wait_s
    while (s := status(url))["units"] != ALONE and time.time() < deadline:
        time.sleep(0.25)
    return s


def transitions_since(s: dict, since_unix_s: float) -> list[dict]:
    """Merges and splits applied since ``since_unix_s``, each once (its group's first member's
    record; a replica keeps its last 20)."""
    return sorted((t for rep in s["replicas"] for t in rep["transitions"]
                   if rep["replica"] == t["group"][0] and t["at_unix_s"] >= since_unix_s),
                  key=lambda t: t["at_unix_s"])


def _log_since(log_path: Path, offset: int) -> tuple[str, int]:
    """The server log's text from byte ``offset`` on, and the offset of its end."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        data = f.read()
    return data.decode(errors="replace"), offset + len(data)


def _decode_point(url: str, point: tuple[int, int, int], sizes: Sequence[int],
                  period_s: float, ids) -> None:
    """``b`` streamed requests on every replica at once; while they run, each replica gets a
    one-token prompt every ``period_s`` (``sizes`` in turn, staggered across replicas so the
    cores see one prefill at a time where they can)."""
    b, prompt, new = point
    with concurrent.futures.ThreadPoolExecutor(1 + REPLICAS) as pool:
        done = pool.submit(streams_at_once, url, [(ids(prompt), new, r) for r in range(REPLICAS)
                                                  for _ in range(b)])

        def inject(rank: int) -> None:
            time.sleep(period_s * (1 + rank / REPLICAS))  # after the point's own prefills
            k = rank
            while not done.done():
                stream_chunks(url, ids(sizes[k % len(sizes)]), 1, rank)
                k += 1
                time.sleep(period_s)
        for f in [pool.submit(inject, r) for r in range(REPLICAS) if sizes]:
            f.result()
        done.result()


def calibrate(url: str, log_path: Path, plan: CalibrationPlan, pool_tokens: int,
              rng) -> dict[str, Any]:
    """The log intervals and time-to-first-token points ``fit_costs`` fits, and one merge and
    split of a pair."""
    def ids(n: int) -> list[int]:
        return rng.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist()

    intervals, ttft = [], []
    _, offset = _log_since(log_path, 0)
    for k, point in enumerate(plan.decode_points):
        sizes = plan.inject_sizes(point, pool_tokens)
        for _ in range(plan.repeats):
            _decode_point(url, point, sizes, plan.inject_period_s, ids)
            time.sleep(LOG_SETTLE_S)
            text, offset = _log_since(log_path, offset)
            # A replica's first line in the slice opens no interval, so none spans the idle
            # gap between points; a prefill of another size is the point's own request.
            intervals += [{**iv, "point": k}
                          for iv in decode_intervals(log_events(text), DECODE_LOG_INTERVAL_STEPS)
                          if iv["batch"] == point[0] and set(iv["prefill_tokens"]) <= set(sizes)]
    for n in plan.ttft_prompt_tokens:
        runs = [c[0][0] for _ in range(plan.repeats)
                for c in streams_at_once(url, [(ids(n), 1, r) for r in range(REPLICAS)])]
        ttft.append({"prompt_tokens": n, "seconds": statistics.median(runs), "runs": runs})
    since = time.time()  # one long prompt through the controller: a pair merges and splits
    httpx.post(f"{url}/generate", timeout=600, json={"input_ids": ids(pool_tokens + 64),
               "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
               ).raise_for_status()
    return {"decode_log_interval_steps": DECODE_LOG_INTERVAL_STEPS,
            "decode_intervals": intervals, "prefill_points": ttft,
            "transitions": transitions_since(wait_alone(url, 60.0), since)}


def probe(url: str, w: ValidationWorkload, plan: CalibrationPlan, rng) -> dict[str, Any]:
    """The output tokens per second the server sustains on the replay's short requests:
    ``probe_per_replica`` of them per replica in flight (each worker sends its next when one
    finishes), placed by the controller, counted over ``probe_s`` after ``probe_warmup_s``."""
    workers = REPLICAS * plan.probe_per_replica
    seeds = rng.integers(0, 2**31, workers)
    begin = time.perf_counter() + plan.probe_warmup_s
    end = begin + plan.probe_s

    def worker(seed: int) -> list[list[tuple[float, int]]]:
        r, out = np.random.default_rng(seed), []
        while time.perf_counter() < end:
            p, n = (int(r.integers(lo, hi + 1)) for lo, hi in (w.short_prompt_tokens,
                                                                w.short_new_tokens))
            sent = time.perf_counter()
            out.append([(sent + t, k) for t, k in stream_chunks(
                url, r.integers(VOCAB_LOW, VOCAB_HIGH, p).tolist(), n, None)])
        return out
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        streams = [c for cs in pool.map(worker, seeds) for c in cs]
    tokens = sum(tokens_by(c, end) - tokens_by(c, begin) for c in streams)
    return {"in_flight": workers, "window_s": plan.probe_s, "requests": len(streams),
            "output_tokens_per_s": tokens / plan.probe_s}


def _kv_sample(s: dict) -> dict:
    reps = sorted(s.get("replicas", []), key=lambda r: r["replica"])
    return {"units": s.get("units"), "kv_used_tokens": [r["kv_used_tokens"] for r in reps],
            "kv_capacity_tokens": [r["kv_capacity_tokens"] for r in reps]}


def live_run(st: Settings, model_path: Path, sized: bool) -> dict[str, Any]:
    """Everything the server showed, as JSON. ``sized``: the short arrival rate is
    ``LOAD_SHARE`` of the probed capacity (``size_rate``), chosen before any replayed
    request."""
    rng = np.random.default_rng(st.workload.seed + 1)
    args = ("--model-path", str(model_path), "--dtype", "float32", "--dp-size", str(REPLICAS),
            "--enable-amoebas", "--max-total-tokens", str(st.pool_tokens),
            "--stream-interval", str(STREAM_INTERVAL),
            "--decode-log-interval", str(DECODE_LOG_INTERVAL_STEPS))
    out: dict[str, Any] = {
        "pool_tokens": st.pool_tokens, "calibration_plan": dataclasses.asdict(st.calibration),
        "load_before": load_average(), "rate_sized": sized,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "server_args": list(args), "server_env": SERVER_ENV}
    t0 = time.time()
    with running_server(args, st.raw_dir / "server.log", env=SERVER_ENV) as server:
        out.update(startup_s=time.time() - t0, status_at_start=status(server.url))
        streams_at_once(server.url, [(rng.integers(VOCAB_LOW, VOCAB_HIGH, 16).tolist(), 4, r)
                              for r in range(REPLICAS)])  # each process's first forward
        out["calibration"] = calibrate(server.url, server.log_path, st.calibration,
                                       st.pool_tokens, rng)
        httpx.post(f"{server.url}/flush_cache", timeout=60)
        w = st.workload
        out["probe"] = probe(server.url, w, st.calibration, rng)
        if sized:
            w = dataclasses.replace(w, short_per_s=size_rate(
                w, out["probe"]["output_tokens_per_s"], LOAD_SHARE))
        reqs, _ = w.requests()
        prompts = [rng.integers(VOCAB_LOW, VOCAB_HIGH, r.prompt_tokens).tolist() for r in reqs]
        httpx.post(f"{server.url}/flush_cache", timeout=60)
        res = replay(server.url, reqs, prompts, st.drain_timeout_s, label="amoebas dp4 tiny",
                     status_path="/amoebas/status", sample=_kv_sample)
        final = wait_alone(server.url, st.split_wait_s)
    return {**out, "workload": dataclasses.asdict(w), "start_unix_s": res.start_unix_s,
            "status_samples": res.status_samples,
            "records": [{k: v for k, v in r.to_json().items() if k != "output_ids"}
                        for r in res.records],
            "final_units": final["units"],
            "transitions": transitions_since(final, res.start_unix_s)}


def live_summary(live: dict, longs: frozenset[int], window_s: float) -> tuple[dict, list]:
    start, recs = live["start_unix_s"], live["records"]
    outcomes = [{"index": r["index"], "long": r["index"] in longs,
                 "arrival_s": r["scheduled_unix_s"] - start,
                 "first_token_s": r["chunks"][0][0] - start if r["chunks"] else None,
                 "finish_s": r["chunks"][-1][0] - start if r["error"] is None and r["chunks"]
                 and r["chunks"][-1][1] >= r["max_new_tokens"] else None,
                 "output_tokens": r["chunks"][-1][1] if r["chunks"] else 0,
                 "max_new_tokens": r["max_new_tokens"]} for r in recs]
    shares = [sum(s["kv_used_tokens"]) / sum(s["kv_capacity_tokens"])
              for s in live["status_samples"] if s["t"] - start <= window_s]
    actions = [t["action"] for t in live["transitions"]]
    window_tokens = sum(tokens_by(r["chunks"], start + window_s) for r in recs)
    return {**summarize(outcomes, window_s, window_tokens, actions.count("merge"),
                        actions.count("split"), statistics.mean(shares) if shares else None),
            "failed": sum(r["error"] is not None or not r["chunks"] for r in recs),
            "split_back": live["final_units"] == ALONE}, outcomes


# ---- the analysis and the report ------------------------------------------------------------


def sim_inputs(status_at_start: dict, cal: dict) -> tuple:
    """The live policy's parameters, the policy, the step costs and their fit, the dwell."""
    import inspect

    from sglang_morph.amoebas.auto import AutoControl, live_policy
    from sglang_morph.models.tiny import tiny_model_path

    merges = [t for t in cal["transitions"] if t["action"] == "merge"]
    params = live_params(json.loads((tiny_model_path() / "config.json").read_text()),
                         status_at_start, merges[0]["kv_capacity_tokens"] if merges else None)
    policy = live_policy(params)
    transfer = json.loads((REPO_ROOT / S.KUNSERVE_RESULTS / "transfer.json").read_text())
    costs, fit = fit_costs(cal, policy.capacity.model.num_layers, transfer)
    dwell_s = inspect.signature(AutoControl.__init__).parameters["min_dwell_s"].default
    return params, policy, costs, fit, dwell_s


def simulated_capacity(w: ValidationWorkload, policy: Any, costs: S.StepCosts, dwell_s: float,
                       overhead_s: float, seconds: float, start_per_s: float) -> dict:
    """The simulator's output rate on the probe's mix (the short requests alone) offered open
    loop for ``seconds``: from ``start_per_s``, doubled until the simulator serves under 90% of
    what is offered, where its window throughput is its capacity (``saturated`` False: it kept
    up even at the last rate tried, so the capacity is at least that)."""
    shorts = dataclasses.replace(w, duration_s=seconds, long_arrivals_s=(),
                                 long_prompt_tokens=())
    rate, s = start_per_s, {}
    for _ in range(8):
        s, _, _ = simulate_same(dataclasses.replace(shorts, short_per_s=rate).requests()[0],
                                policy.capacity, costs, policy, dwell_s, seconds, seconds + 1.0,
                                overhead_s)
        if s["window_output_tokens_per_s"] < 0.9 * s["offered_output_tokens_per_s"]:
            return {"short_per_s": rate, "output_tokens_per_s": s["window_output_tokens_per_s"],
                    "saturated": True}
        rate *= 2
    return {"short_per_s": rate / 2, "output_tokens_per_s": s["window_output_tokens_per_s"],
            "saturated": False}


def analyse(st: Settings, live: dict) -> dict[str, Any]:
    """The simulator on the live run's requests with the calibrated costs, and the report."""
    reqs, longs = st.workload.requests()
    cal = live["calibration"]
    params, policy, costs, fit, dwell_s = sim_inputs(live["status_at_start"], cal)
    simulated, sim_transitions, sim_out = simulate_same(
        reqs, policy.capacity, costs, policy, dwell_s, st.workload.duration_s,
        max(r.arrival_s for r in reqs) + st.drain_timeout_s, fit["request_overhead_s"])
    measured, live_out = live_summary(live, longs, st.workload.duration_s)
    plan, probed = st.calibration, live["probe"]
    mean_short_new = sum(st.workload.short_new_tokens) / 2
    capacity = simulated_capacity(
        st.workload, policy, costs, dwell_s, fit["request_overhead_s"],
        plan.probe_warmup_s + plan.probe_s, 1.5 * probed["output_tokens_per_s"] / mean_short_new)
    measured["capacity_output_tokens_per_s"] = probed["output_tokens_per_s"]
    simulated["capacity_output_tokens_per_s"] = capacity["output_tokens_per_s"]
    sim_by = {o["index"]: o for o in sim_out}

    def latency(o: dict, since: str) -> float | None:
        return None if o[since] is None else o[since] - o["arrival_s"]
    return {"meta": run_meta(live["command"], live["load_before"], date=live["date"]),
            "settings": {"workload": live["workload"], "pool_tokens": st.pool_tokens,
                         "calibration": live["calibration_plan"], "min_dwell_s": dwell_s,
                         **{k: live[k] for k in ("server_args", "server_env", "startup_s",
                                                 "rate_sized")},
                         "owner_tokens": {d: policy.capacity.owner_capacity_tokens(d)
                                          for d in policy.capacity.allowed_degrees},
                         "policy_params": {k: v for k, v in params.items() if k != "model"}},
            "calibration": {**cal, **fit, "costs": costs.to_json()},
            "probe": {"live": probed, "SIMULATED": capacity, "load_share": LOAD_SHARE},
            "live": {**measured, "transitions_list": live["transitions"]},
            "simulated": {**simulated, "transitions_list": sim_transitions},
            "comparison": compare(measured, simulated, st.target),
            "start_unix_s": live["start_unix_s"],
            "per_request": [{"index": r.index, "long": r.index in longs,
                             "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                             "max_new_tokens": r.output_tokens,
                             **{f"{who}_{key}_s": latency(o, since)
                                for who, o in (("live", lo), ("sim", sim_by[r.index]))
                                for key, since in (("ttft", "first_token_s"),
                                                   ("e2e", "finish_s"))}}
                            for r, lo in zip(reqs, sorted(live_out, key=lambda o: o["index"]))]}


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown(r: dict[str, Any]) -> str:
    meta, st, cal, cmp_, live = (r[k] for k in ("meta", "settings", "calibration", "comparison",
                                                "live"))
    m, git, w, costs, pr = (meta["machine"], meta["git"], st["workload"], cal["costs"],
                            r["probe"])
    fits, err = costs["phases"], cal["fit_mean_relative_error"]
    by_batch: dict[int, dict] = {}
    for iv in cal["decode_intervals"]:
        if not iv["prefill_tokens"]:
            by_batch.setdefault(iv["batch"], []).append(iv["seconds"] / iv["steps"])
    by_batch = {b: {"ms": statistics.median(xs) * 1e3, "n": len(xs)}
                for b, xs in by_batch.items()}
    lines = [
        "# AMOEBAs simulator vs a live 4-replica tiny-model server", "",
        f"Command: `{meta['command']}`; commit {git['commit']}{' (dirty)' if git['dirty'] else ''}"
        f"; {meta['date']}; {m['cpu_model']}, {m['cpu_cores']} cores, versions {m['versions']}; "
        f"load average before {meta['load_before']}, after {meta['load_after']}.", "",
        f"Server: `{' '.join(st['server_args'][2:])}` (tiny model), env {st['server_env']}; owner "
        f"pools by degree {st['owner_tokens']} tokens.", "",
        f"Operating point: a closed-loop probe ({pr['live']['in_flight']} short requests in "
        f"flight, the replay's lengths, {pr['live']['window_s']:g} s) measured "
        f"{pr['live']['output_tokens_per_s']:.1f} output tok/s live (SIMULATED on the same mix "
        f"open loop: {pr['SIMULATED']['output_tokens_per_s']:.1f}"
        + ("" if pr["SIMULATED"]["saturated"] else ", or more: it kept up at every rate tried")
        + ").", "",
        f"Workload (seed {w['seed']}): {live['requests']} requests; shorts {w['short_per_s']:g}/s"
        + (f" (sized to offer {pr['load_share']:.0%} of the probed capacity)" if st["rate_sized"]
           else " (--short-per-s)")
        + f" for {w['duration_s']:g} s, prompts {w['short_prompt_tokens']}, new tokens "
        f"{w['short_new_tokens']}; long prompts of {w['long_prompt_tokens']} tokens at "
        f"{w['long_arrivals_s']} s (+{w['long_new_tokens']}). Offered "
        f"{live['offered_output_tokens_per_s']:.1f} output tok/s; the server produced "
        f"{live['window_output_tokens_per_s']:.1f} in that window ("
        f"{live['window_output_tokens_per_s'] / live['offered_output_tokens_per_s']:.0%}: "
        + ("it fell behind: the load ran past its capacity" if cmp_["saturated"] else
           "it kept up") + "); KV held "
        f"{_fmt(live['kv_held_share'])} of the pools on average.", "",
        "Calibration (before the replay, every replica at once; times from the schedulers' log, "
        f"{cal['decode_log_interval_steps']} decode steps a line): decode step "
        + ", ".join(f"b={b} {x['ms']:.1f} ms ({x['n']} intervals)"
                    for b, x in sorted(by_batch.items()))
        + "; prefill injected while decoding (median) "
        + ", ".join(f"{n} tok {v * 1e3:.1f} ms ({cal['prefill_samples'][n]})"
                    for n, v in cal["prefill_median_s"].items())
        + "; time to first token on idle replicas "
        + ", ".join(f"{x['prompt_tokens']} tok {x['seconds'] * 1e3:.0f} ms"
                    for x in cal["prefill_points"])
        + f". Fitted (mean error prefill {err['prefill']:.0%}, decode {err['decode']:.0%}): "
        f"prefill {fits['prefill']['gamma_s'] * 1e3:.1f} ms + {fits['prefill']['beta_s'] * 1e6:.0f}"
        f" us a token + {fits['prefill']['alpha_s'] * 1e9:.1f} ns a token squared, decode "
        f"{fits['decode']['gamma_s'] * 1e3:.1f} ms + {fits['decode']['beta_s'] * 1e6:.0f} us a "
        f"request + {fits['decode']['alpha_s'] * 1e9:.1f} ns a context token; latency outside "
        f"the replicas {cal['request_overhead_s'] * 1e3:.0f} ms a request. Merge "
        f"{costs['merge_fixed_s']:.3f} s, split {costs['split_fixed_s']:.3f} s (" + (
            "one calibration merge and split" if cal["transitions_measured"] else
            "ASSUMED: no calibration transition recorded") + "); all-reduce "
        f"{costs['allreduce_s_per_layer'] * 1e3:.2f} ms a layer (transfer.json).", "",
        f"| metric | live | SIMULATED | (sim - live) / live | within {cmp_['target']:.0%} |",
        "|---|---:|---:|---:|---|"]
    for key, row in cmp_["rows"].items():
        e, ok = row["relative_error"], row["within_target"]
        lines.append(f"| {key}{' (checked)' if row['checked'] else ''} | {_fmt(row['live'])} | "
                     f"{_fmt(row['simulated'])} | {'-' if e is None else f'{e:+.1%}'} | "
                     f"{'-' if ok is None else 'yes' if ok else '**no**'} |")
    lines += [
        "", f"Result: {'PASS' if cmp_['passed'] else 'FAIL'}. Live: {live['failed']} requests "
        f"failed; every group split back at the end: {live['split_back']}.", "",
        "Live transitions (at their end): " + (", ".join(
            f"{t['action']} {t['group']} {t['at_unix_s'] - r['start_unix_s']:.1f} s "
            f"({t['duration_s']:.3f} s)" for t in live["transitions_list"]) or "none") + ".",
        "SIMULATED transitions (at their end): " + (", ".join(
            f"{t['kind']} {t['members']} {t['at_s'] + t['seconds']:.1f} s ({t['seconds']:.3f} s)"
            for t in r["simulated"]["transitions_list"]) or "none") + ".", "",
        "Not modelled by the simulator: replicas sharing 2 cores (calibrated with all four "
        "decoding; fewer step faster), SGLang's admission (it reserves part of max_new_tokens, "
        "the simulator all of it), SGLang's chunked prefill, a merged group's wait for its "
        "members' batches before a step (up to --amoebas-step-wait-ms), the board's 0.1 s "
        "staleness, and the controller holding every "
        "request behind a queued one (the simulator lets a long prompt pass a queued short one).",
        ""]
    return "\n".join(lines)


def _tuples(x: Any) -> Any:
    return tuple(map(_tuples, x)) if isinstance(x, list) else x


def settings(a: argparse.Namespace, live: dict | None) -> Settings:
    """From the command line, or (``live``) the saved run's workload, pool and plan."""
    if live:
        quick, pool = live["quick"], live["pool_tokens"]
        w = ValidationWorkload(**{k: _tuples(v) for k, v in live["workload"].items()})
        plan = CalibrationPlan(**{k: _tuples(v) for k, v in live["calibration_plan"].items()})
    else:
        quick, pool = a.quick, a.pool_tokens
        w, plan = (QUICK, QUICK_CAL) if quick else (FULL, FULL_CAL)
        w = dataclasses.replace(w, seed=a.seed, short_per_s=a.short_per_s or w.short_per_s,
                                duration_s=a.duration_s or w.duration_s)
    raw = RAW / ("amoebas_validate_quick" if quick else "amoebas_validate")
    return Settings(w, plan, pool, a.target, 60.0 if quick else 120.0, 30.0,
                    a.out or (raw if quick else RESULTS), raw)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="harness check: 15 s of load, 1 long")
    p.add_argument("--pool-tokens", type=int, default=1024, help="P: each replica's KV pool")
    p.add_argument("--short-per-s", type=float, help="short arrivals per second (default: "
                   f"{LOAD_SHARE:.0%} of the probed capacity, size_rate)")
    p.add_argument("--duration-s", type=float, help="seconds of short arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.15)
    p.add_argument("--from-live", type=Path, help="analyse a saved live.json again (no server)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    command = "python -m benchmark.amoebas.validate " + " ".join(
        sys.argv[1:] if argv is None else argv)
    live = json.loads(a.from_live.read_text()) if a.from_live else None
    st = settings(a, live)
    if live is None:
        from sglang_morph.models.spec import ModelSpec
        from sglang_morph.models.tiny import tiny_model_path

        spec = ModelSpec.from_model_dir(tiny_model_path(), dtype_bytes=DTYPE_BYTES)
        st.workload.check_lengths(CapacityModel.from_kv_pool(spec, REPLICAS, st.pool_tokens))
        st.raw_dir.mkdir(parents=True, exist_ok=True)
        live = {**live_run(st, tiny_model_path(), sized=a.short_per_s is None),
                "command": command, "quick": a.quick}
        (st.raw_dir / "live.json").write_text(json.dumps(live))  # before anything can fail
        st = settings(a, live)
    report = {**analyse(st, live), "analysed_by": command}
    st.out_dir.mkdir(parents=True, exist_ok=True)
    (st.out_dir / "validate.json").write_text(json.dumps(report, indent=1))
    (st.out_dir / "validate.md").write_text(markdown(report))
    print(markdown(report), flush=True)
    return 0 if report["comparison"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
