"""iServe vs max-TP, max-PP and AlpaServe-like on a SIMULATED 8-device cluster (SimPy).

Every latency and SLO number this writes is SIMULATED: no cluster runs. What is real: the
estimates (``sglang_morph.iserve``: M2 memory and L2 latency fitted on the fingerprints of a
``--profile``, through ``load_profile``/``candidates``/``ModelEstimates.latency_of``, unchanged),
iServe's choice (the deploy tool's own ``select``: intent ranking and placement, run as its CLI
runs it), the configuration space and what of it is servable here (``space``), and the arrival
times and lengths of the Azure LLM inference traces (2023, code and conversation; ``data/traces``).

**The cluster.** Devices are machines like the one the fingerprints were profiled on (2 CPU
cores each; the estimates hold for a configuration that has a whole such machine to itself), with
a stated memory. A replica is one configuration served by one ``scripts/serve.sh`` on one device,
all its TP ranks and PP stages there (the deploy tool plans no replica across machines:
``--enable-morph`` refuses SGLang's multi-node launch), so a device holds at most one replica, and
a configuration gets a replica on every device whose memory holds its estimated RSS high-water
mark (M2, all processes summed: what ``select`` places by). Two clusters by default:
``uniform`` (8 x 2 cores, 24 GiB: this machine eight times) and ``mixed`` (8 x 2 cores: 2 x 24 GiB,
2 x 8 GiB, 4 x 3 GiB), where the larger configurations fit fewer devices.

**A replica** runs SGLang-like continuous batching: requests queue first come, first served; a
request is admitted while the running batch is below ``--max-running-requests`` (the ``--batch``
that ``select`` puts in the serve command) and its prompt + output fit the replica's KV pool (the
profile's ``--max-total-tokens`` per rank; reserved whole, so nothing is retracted); admitted
requests are prefilled together (their first token), otherwise every running request decodes one
token. Times come from L2, the paper's equations with the batch terms
(``T = f0 + f1 B + L (g0 + g1 B)`` per phase): a decode step of ``B`` requests takes TPOT(B), and a
prefill of ``N`` prompt tokens takes TTFT at batch ``N / P``, ``P`` the profile's prompt length (the
profile timed ``B`` prompts of ``P`` tokens each; L2 has no prompt-length term, so prefill cost is
taken as linear in tokens; below ``P`` tokens a prefill costs what ``P`` does). Assumed, not
measured: decode time does not grow with context length; TTFT's fixed part (HTTP, tokenizing,
scheduling) occupies the replica; a PP replica runs one batch at a time through its stages
(SGLang's micro-batch overlap is not modelled: the profile measured latency, not pipelined
throughput). A router sends each arrival to the replica with the fewest outstanding tokens.

**The systems**, each one configuration on as many devices as hold it:

- ``iserve``: ``python -m sglang_morph.iserve select`` with the intent (default ``latency-target``
  with the TTFT/TPOT SLO below, ``--max-perplexity 30`` so no precision worse than 16 bits is
  chosen) and ``--batch``/``--output`` of the workload; its chosen configuration and first device,
  then the same placement policy (``placement.Cluster.choose``) over the devices left. If no
  configuration meets the intent, ``min-latency`` (what a user would ask next; recorded).
- ``max-tp``: the largest TP the space serves here, PP 1; ``max-pp``: the deepest pipeline, TP 1;
  both at ``--baseline-bits`` (16: the model as published, like the paper's baselines).
- ``alpaserve``: AlpaServe's idea (Li et al., OSDI 2023): choose the model-parallel configuration
  by simulating the workload on each candidate and keeping the best SLO attainment. Here: every
  servable TP x PP at ``--baseline-bits``, each on as many devices as hold it, simulated on the
  trace's window just before the evaluated one (its history) at the same rate; the highest
  attainment wins (ties: lower P99 TTFT, then fewer processes). Departures from the paper: one
  model, so no statistical multiplexing of several models over shared groups (its main gain); one
  configuration on every device instead of a partition of the cluster into groups of different
  configurations (here a group is a device: no replica spans devices); the history window stands in
  for AlpaServe's fitted Gamma arrival process; no quantization (as in the paper); planned per rate.
- ``alpaserve-any-bits``: the same search over iServe's whole space within its accuracy limit
  (W8 included): not a baseline from the literature but a reference for iServe's static choice,
  the configuration that simulating the workload would pick (iServe chooses once, from the
  estimates at one batch size, before any traffic).

**Workload.** Per trace, ``--requests`` consecutive requests from its start are the planning window
and the next ``--requests`` the evaluated one; arrival times are scaled to each request rate (the
trace's burstiness kept). Prompt lengths x ``--prompt-scale`` (0.25: Azure's 1-2k-token prompts on
the 128-token profile of a 135M model on CPU), capped at 512, outputs capped at 256. Rates are
multiples (``--loads``) of R, the estimated throughput of the cluster with 8 replicas of the
fastest servable configuration (each replica serving full batches of the window's mean request).
SLO: TTFT <= S x the fastest configuration's unloaded TTFT of the window's median prompt, and
mean TPOT <= S x the fastest unloaded TPOT, for each SLO scale S of ``--slo-scales`` (as
AlpaServe's evaluation varies it; iServe's latency target is the same SLO), unless given in
seconds.

    .venv/bin/python -m benchmark.iserve.sim --profile benchmark/results/iserve/grid_19605d6/profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import simpy

from benchmark.harness import git_state, load_average
from benchmark.replay.metrics import Slo
from benchmark.replay.trace import TraceWindow, load_window
from sglang_morph.iserve import __main__ as deploy_cli
from sglang_morph.iserve import intents, placement, space
from sglang_morph.repo_data import REPO_ROOT as REPO
from sglang_morph.repo_data import TRACES_DIR

RESULTS = Path("benchmark/results/iserve")
INPUT_PATHS = ("benchmark/iserve/sim.py", "benchmark/replay", "python/sglang_morph/iserve")
SYSTEMS = ("iserve", "max-tp", "max-pp", "alpaserve", "alpaserve-any-bits")
GIB = 2**30
CLUSTERS = {
    "uniform": tuple(placement.Device(f"d{i}", 24 * GIB, 2) for i in range(8)),
    "mixed": tuple(placement.Device(f"d{i}", m * GIB, 2)
                   for i, m in enumerate((24, 24, 8, 8, 3, 3, 3, 3))),
}
TRACES = {"azure_code": "azure_llm_2023_code.csv", "azure_conv": "azure_llm_2023_conv.csv"}


# ---- service times from the estimates -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServiceTimes:
    """One configuration's iteration times, from L2 (``latency_of``) at integer batch sizes.

    Invariant: ``ttft_s[b - 1]`` and ``tpot_s[b - 1]`` are L2's TTFT and TPOT at batch ``b``,
    positive and finite."""

    cfg: space.Configuration
    profile_prompt_tokens: int
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]

    def check_integrity(self) -> None:
        values = self.ttft_s + self.tpot_s
        if not self.ttft_s or len(self.ttft_s) != len(self.tpot_s) or \
                not all(v > 0 and math.isfinite(v) for v in values):
            raise ValueError(f"{self.cfg.name}: L2 gives non-positive or non-finite times "
                             f"(TTFT {self.ttft_s[:2]}, TPOT {self.tpot_s[:2]} ...)")

    @classmethod
    def from_estimates(cls, estimates, cfg: space.Configuration, profile_prompt_tokens: int,
                       max_batch: int) -> "ServiceTimes":
        times = [estimates.latency_of(cfg, b) for b in range(1, max_batch + 1)]
        out = cls(cfg, profile_prompt_tokens, tuple(float(t[0]) for t in times),
                  tuple(float(t[1]) for t in times))
        out.check_integrity()
        return out

    def prefill_s(self, prompt_tokens: int) -> float:
        """``prompt_tokens`` prefilled in one forward: TTFT at batch tokens / P."""
        batch = max(1.0, prompt_tokens / self.profile_prompt_tokens)
        if batch > len(self.ttft_s):
            raise ValueError(f"{self.cfg.name}: a prefill of {prompt_tokens} tokens is past the "
                             f"table ({len(self.ttft_s)} x {self.profile_prompt_tokens})")
        return float(np.interp(batch, np.arange(1, len(self.ttft_s) + 1), self.ttft_s))

    def decode_s(self, batch: int) -> float:
        return self.tpot_s[batch - 1]


# ---- the simulation -----------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    rid: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    token_times_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def done(self) -> bool:
        return len(self.token_times_s) >= self.output_tokens

    @property
    def outstanding_tokens(self) -> int:
        return (0 if self.token_times_s else self.prompt_tokens) + \
            self.output_tokens - len(self.token_times_s)


class Replica:
    """One configuration on one device: continuous batching (see the module docstring)."""

    def __init__(self, env: simpy.Environment, service: ServiceTimes, kv_tokens: int,
                 max_running: int, finished: list[Request]):
        self.env, self.service = env, service
        self.kv_tokens, self.max_running = kv_tokens, max_running
        self.finished = finished
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.busy_s = 0.0
        self.wakeup = env.event()
        env.process(self.run())

    @property
    def outstanding_tokens(self) -> int:
        return sum(r.outstanding_tokens for r in self.waiting + self.running)

    def add(self, request: Request) -> None:
        if request.reserved_tokens > self.kv_tokens:
            raise ValueError(f"request {request.rid}: {request.reserved_tokens} tokens never fit "
                             f"a {self.kv_tokens}-token KV pool")
        self.waiting.append(request)
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def _admit(self) -> list[Request]:
        reserved = sum(r.reserved_tokens for r in self.running)
        admitted: list[Request] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running and \
                reserved + self.waiting[0].reserved_tokens <= self.kv_tokens:
            admitted.append(self.waiting.pop(0))
            reserved += admitted[-1].reserved_tokens
        return admitted

    def run(self):
        env = self.env
        while True:
            if not self.waiting and not self.running:
                self.wakeup = env.event()
                yield self.wakeup
                continue
            admitted = self._admit()
            if admitted:  # prefill first, as SGLang's scheduler does
                seconds = self.service.prefill_s(sum(r.prompt_tokens for r in admitted))
                batch = admitted
            else:
                seconds = self.service.decode_s(len(self.running))
                batch = self.running
            yield env.timeout(seconds)
            self.busy_s += seconds
            for r in batch:
                r.token_times_s.append(env.now)
            self.running = [r for r in self.running + admitted if not r.done]
            self.finished += [r for r in batch if r.done]


def simulate(requests: Sequence[Request], service: ServiceTimes, replicas: int, kv_tokens: int,
             max_running: int) -> list[Request]:
    """Serve ``requests`` (fresh copies) on ``replicas`` replicas of ``service``; every request
    finishes (the simulation runs until the last one does)."""
    if replicas < 1 or max_running < 1:
        raise ValueError(f"need at least one replica and one running request, got {replicas}, "
                         f"{max_running}")
    env = simpy.Environment()
    finished: list[Request] = []
    units = [Replica(env, service, kv_tokens, max_running, finished) for _ in range(replicas)]
    reqs = sorted((dataclasses.replace(r, token_times_s=[]) for r in requests),
                  key=lambda r: (r.arrival_s, r.rid))

    def arrivals():
        for r in reqs:
            if r.arrival_s > env.now:  # requests of the same instant reach the router together
                yield env.timeout(r.arrival_s - env.now)
            min(enumerate(units), key=lambda iu: (iu[1].outstanding_tokens, iu[0]))[1].add(r)

    env.process(arrivals())
    env.run()
    if len(finished) != len(reqs) or len({r.rid for r in finished}) != len(reqs):
        raise RuntimeError(f"{service.cfg.name} x{replicas}: {len(finished)} of {len(reqs)} "
                           f"requests finished")
    return finished


def latency_stats(finished: Sequence[Request], slo: Slo) -> dict:
    ttft = np.array([r.token_times_s[0] - r.arrival_s for r in finished])
    tpot = {r.rid: (r.token_times_s[-1] - r.token_times_s[0]) / (r.output_tokens - 1)
            for r in finished if r.output_tokens > 1}
    met = [slo.met(r.token_times_s[0] - r.arrival_s, tpot.get(r.rid)) for r in finished]
    tpots = np.array(list(tpot.values()))
    return {"requests": len(finished),
            "p50_ttft_s": float(np.percentile(ttft, 50)),
            "p99_ttft_s": float(np.percentile(ttft, 99)),
            "p50_tpot_s": float(np.percentile(tpots, 50)) if len(tpots) else None,
            "p99_tpot_s": float(np.percentile(tpots, 99)) if len(tpots) else None,
            "slo_attainment": float(np.mean(met))}


# ---- the workload -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests of a trace at its own pace (arrivals from 0); ``at_rate`` rescales time."""

    trace: str
    requests: tuple[Request, ...]

    @property
    def natural_rate_rps(self) -> float:
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        return (len(self.requests) - 1) / span

    def at_rate(self, rate_rps: float) -> list[Request]:
        scale = self.natural_rate_rps / rate_rps
        return [dataclasses.replace(r, arrival_s=r.arrival_s * scale, token_times_s=[])
                for r in self.requests]

    @property
    def median_prompt_tokens(self) -> float:
        return float(np.median([r.prompt_tokens for r in self.requests]))

    @property
    def median_output_tokens(self) -> int:
        return int(np.median([r.output_tokens for r in self.requests]))

    def mean_request(self) -> tuple[float, float]:
        return (float(np.mean([r.prompt_tokens for r in self.requests])),
                float(np.mean([r.output_tokens for r in self.requests])))


@functools.lru_cache(maxsize=None)
def trace_windows(csv: str, count: int, prompt_scale: float) -> tuple[Workload, Workload]:
    """(planning, evaluated): requests [0, count) and [count, 2 count) of the trace."""
    reqs = load_window(TraceWindow(TRACES_DIR / csv, duration_s=1e9, prompt_scale=prompt_scale,
                                   max_prompt_tokens=512, max_output_tokens=256))
    if len(reqs) < 2 * count:
        raise ValueError(f"{csv}: {len(reqs)} requests, fewer than 2 x {count}")
    out = []
    for part in (reqs[:count], reqs[count: 2 * count]):
        t0 = part[0].arrival_s
        out.append(Workload(csv, tuple(Request(k, r.arrival_s - t0, r.prompt_tokens,
                                               r.output_tokens) for k, r in enumerate(part))))
    return out[0], out[1]


# ---- deployments --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deployment:
    system: str
    cfg: space.Configuration | None  # None: no configuration of the system fits a device
    devices: tuple[str, ...]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Setting:
    """Everything a system's choice depends on besides the rate."""

    profile_path: str
    profile: deploy_cli.Profile
    rows: dict[str, intents.Candidate]  # servable configurations' estimates (select's table)
    devices: tuple[placement.Device, ...]
    max_running: int
    output_tokens: int  # the workload's median output (select's --output)
    slo: Slo
    intent: str
    max_perplexity: float | None
    placement_policy: str
    baseline_bits: int
    _services: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_tokens(self) -> int:
        return int(self.profile.raw["workload"]["kv_tokens"])

    @property
    def prompt_tokens(self) -> int:
        return int(self.profile.raw["workload"]["prompt_tokens"])

    def service(self, cfg: space.Configuration, max_prefill_tokens: int) -> ServiceTimes:
        table = max(self.max_running, math.ceil(max_prefill_tokens / self.prompt_tokens))
        key = (cfg, table)
        if key not in self._services:
            self._services[key] = ServiceTimes.from_estimates(self.profile.estimates, cfg,
                                                              self.prompt_tokens, table)
        return self._services[key]


def load_setting(profile_path: str, devices: Sequence[placement.Device], max_running: int,
                 output_tokens: int, slo: Slo, intent: str = "latency-target",
                 max_perplexity: float | None = 30.0, placement_policy: str = "hybrid",
                 baseline_bits: int = 16) -> Setting:
    profile = deploy_cli.load_profile(profile_path)
    rows, _ = deploy_cli.candidates(profile, max_running, output_tokens, 1000, "rss",
                                    intents.perplexity_by_bits())
    return Setting(profile_path, profile, {c.cfg.name: c for c in rows}, tuple(devices),
                   max_running, output_tokens, slo, intent, max_perplexity, placement_policy,
                   baseline_bits)


def place_replicas(setting: Setting, cfg: space.Configuration, first: str | None = None
                   ) -> tuple[str, ...]:
    """One replica on every device that holds ``cfg`` (``first``, if given, first), in the
    order the placement policy picks them, each device used once."""
    memory = setting.rows[cfg.name].memory_bytes
    free = [d for d in setting.devices if d.name != first]
    chosen = [first] if first else []
    while True:
        device = placement.Cluster(free).choose(setting.placement_policy, memory, cfg.processes) \
            if free else None
        if device is None:
            return tuple(chosen)
        chosen.append(device.name)
        free.remove(device)


def select_iserve(setting: Setting, intent: str | None = None) -> tuple[dict, str]:
    """``python -m sglang_morph.iserve select`` as the CLI runs it: (its JSON, stderr)."""
    intent = intent or setting.intent
    argv = ["select", "--profile", setting.profile_path, "--intent", intent,
            "--batch", str(setting.max_running), "--output", str(setting.output_tokens),
            "--placement", setting.placement_policy]
    if intent == "latency-target":
        argv += ["--ttft-slo-s", repr(setting.slo.ttft_s)]
        if setting.slo.tpot_s is not None:
            argv += ["--tpot-slo-s", repr(setting.slo.tpot_s)]
    if setting.max_perplexity is not None:
        argv += ["--max-perplexity", repr(setting.max_perplexity)]
    for d in setting.devices:
        argv += ["--device", f"{d.name}:{d.memory_bytes}B:{d.cores}:{d.load}"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = deploy_cli.main(argv)
    return (json.loads(out.getvalue()) if code == 0 else {"error": err.getvalue().strip()},
            "python -m sglang_morph.iserve " + shlex.join(argv))


def iserve_deployment(setting: Setting) -> tuple[Deployment, dict]:
    result, command = select_iserve(setting)
    note = ""
    if "error" in result:
        note = f"{setting.intent}: {result['error']}; fell back to min-latency"
        result, command = select_iserve(setting, "min-latency")
        if "error" in result:
            return Deployment("iserve", None, (), f"{note}: {result['error']}"), {}
    (model,) = result["models"]
    cfg = space.Configuration.parse(model["chosen"]["config"])
    return (Deployment("iserve", cfg, place_replicas(setting, cfg, model["device"]), note),
            {"command": command, "chosen": model["chosen"], "device": model["device"],
             "ranking": [{k: r[k] for k in ("config", "ttft_s", "tpot_s", "memory_gb",
                                            "infeasible")} for r in model["ranking"]]})


def baseline_candidates(setting: Setting) -> list[space.Configuration]:
    return sorted(c.cfg for c in setting.rows.values() if c.cfg.bits == setting.baseline_bits)


def any_bits_candidates(setting: Setting) -> list[space.Configuration]:
    """iServe's whole space within its accuracy limit (a reference for iServe, not a baseline)."""
    limit = setting.max_perplexity
    return sorted(c.cfg for c in setting.rows.values() if limit is None or
                  (c.perplexity is not None and c.perplexity <= limit))


def max_tp_deployment(setting: Setting) -> Deployment:
    cands = [c for c in baseline_candidates(setting) if c.pp == 1]
    return _fixed("max-tp", setting, max(cands, key=lambda c: c.tp, default=None))


def max_pp_deployment(setting: Setting) -> Deployment:
    cands = [c for c in baseline_candidates(setting) if c.tp == 1]
    return _fixed("max-pp", setting, max(cands, key=lambda c: c.pp, default=None))


def _fixed(system: str, setting: Setting, cfg: space.Configuration | None) -> Deployment:
    if cfg is None:
        return Deployment(system, None, (), f"no servable {setting.baseline_bits}-bit "
                          f"configuration of this shape in the profile")
    devices = place_replicas(setting, cfg)
    return Deployment(system, cfg, devices, "" if devices else
                      f"{cfg.name} ({setting.rows[cfg.name].memory_bytes / 1e9:.2f} GB) fits "
                      f"no device")


def run_deployment(setting: Setting, dep: Deployment, requests: Sequence[Request]
                   ) -> dict:
    row = {"config": dep.cfg.name if dep.cfg else None, "replicas": len(dep.devices),
           "devices": list(dep.devices), "note": dep.note}
    if not dep.devices:  # serves nothing: every request misses its SLO
        return {**row, "requests": len(requests), "p50_ttft_s": None, "p99_ttft_s": None,
                "p50_tpot_s": None, "p99_tpot_s": None, "slo_attainment": 0.0}
    service = setting.service(dep.cfg, max(r.prompt_tokens for r in requests) *
                              setting.max_running)
    finished = simulate(requests, service, len(dep.devices), setting.kv_tokens,
                        setting.max_running)
    return {**row, **latency_stats(finished, setting.slo)}


def alpaserve_deployment(setting: Setting, history: Sequence[Request],
                         system: str = "alpaserve") -> tuple[Deployment, list]:
    """Every candidate (servable at the baseline bits; ``alpaserve-any-bits``: at any bits
    within iServe's accuracy limit) simulated on ``history``; the best SLO attainment (ties:
    lower P99 TTFT, then fewer processes, then the name)."""
    trials = []
    cands = any_bits_candidates(setting) if system == "alpaserve-any-bits" else \
        baseline_candidates(setting)
    for cfg in cands:
        dep = Deployment(system, cfg, place_replicas(setting, cfg))
        if dep.devices:
            trials.append((dep, run_deployment(setting, dep, history)))
    if not trials:
        return Deployment(system, None, (), "no candidate fits a device"), []
    best, _ = min(trials, key=lambda t: (-t[1]["slo_attainment"], t[1]["p99_ttft_s"],
                                         t[0].cfg.processes, t[0].cfg.name))
    return best, [{"config": d.cfg.name, "replicas": len(d.devices),
                   "slo_attainment": r["slo_attainment"], "p99_ttft_s": r["p99_ttft_s"]}
                  for d, r in trials]


# ---- rates and SLOs -----------------------------------------------------------------------


def capacity_rps(setting: Setting, cfg: space.Configuration, workload: Workload,
                 replicas: int) -> float:
    """Requests per second of ``replicas`` replicas serving full batches of the mean request
    back to back (the KV pool and ``max_running`` bound the batch)."""
    prompt, output = workload.mean_request()
    batch = max(1, min(setting.max_running, int(setting.kv_tokens // (prompt + output))))
    service = setting.service(cfg, math.ceil(prompt * batch))
    seconds = service.prefill_s(math.ceil(prompt * batch)) + \
        (output - 1) * service.decode_s(batch)
    return replicas * batch / seconds


def reference_rate(setting: Setting, workload: Workload) -> tuple[float, str]:
    """R: the most requests per second any servable configuration would give on all devices."""
    n = len(setting.devices)
    rate, name = max((capacity_rps(setting, c.cfg, workload, n), c.cfg.name)
                     for c in setting.rows.values())
    return rate, name


def default_slo(profile: deploy_cli.Profile, rows, workload: Workload, scale: float
                ) -> dict:
    """``scale`` x the fastest servable configuration's unloaded TTFT (the window's median
    prompt) and TPOT (batch 1)."""
    prompt = int(profile.raw["workload"]["prompt_tokens"])
    need = math.ceil(workload.median_prompt_tokens / prompt)
    ttft, tpot = [], []
    for c in rows:
        s = ServiceTimes.from_estimates(profile.estimates, c.cfg, prompt, max(need, 1))
        ttft.append((s.prefill_s(math.ceil(workload.median_prompt_tokens)), c.cfg.name))
        tpot.append((s.decode_s(1), c.cfg.name))
    return {"ttft_s": scale * min(ttft)[0], "tpot_s": scale * min(tpot)[0],
            "fastest_ttft": min(ttft)[1], "fastest_tpot": min(tpot)[1]}


# ---- the experiment -----------------------------------------------------------------------


def run_trace(setting: Setting, trace: str, history: Workload, evaluated: Workload,
              loads: Sequence[float], rates: Sequence[float] | None) -> list[dict]:
    ref, ref_cfg = reference_rate(setting, evaluated)
    iserve, selection = iserve_deployment(setting)
    fixed = {"max-tp": max_tp_deployment(setting), "max-pp": max_pp_deployment(setting)}
    targets = [(r, r / ref) for r in rates] if rates else [(m * ref, m) for m in loads]
    rows = []
    for rate, load in targets:
        reqs = evaluated.at_rate(rate)
        planned = {name: alpaserve_deployment(setting, history.at_rate(rate), name)
                   for name in ("alpaserve", "alpaserve-any-bits")}
        systems = {"iserve": iserve, **fixed, **{n: d for n, (d, _) in planned.items()}}
        row = {"SIMULATED": True, "trace": trace, "rate_rps": rate, "load": load, "reference_rps": ref,
               "reference_config": ref_cfg, "requests": len(reqs),
               "systems": {name: run_deployment(setting, dep, reqs)
                           for name, dep in systems.items()},
               "alpaserve_trials": {n: t for n, (_, t) in planned.items()},
               "iserve_selection": selection}
        rows.append(row)
        print(f"{trace} {rate:.3f} req/s (x{load:.2f}): " + ", ".join(
            f"{n} {s['config']}x{s['replicas']} {s['slo_attainment']:.0%}"
            for n, s in row["systems"].items()), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.iserve.sim",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="the deploy tool's profile JSON")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--cluster", action="append", choices=tuple(CLUSTERS),
                    help="described clusters (default: all)")
    ap.add_argument("--device", action="append",
                    help="NAME:MEMORY[:CORES[:LOAD]], repeated: one cluster 'custom' instead")
    ap.add_argument("--trace", action="append", choices=tuple(TRACES))
    ap.add_argument("--requests", type=int, default=400, help="requests per window")
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument("--loads", default="0.125,0.25,0.5,1", help="rates as multiples of R")
    ap.add_argument("--rates", help="absolute rates in requests/s (instead of --loads)")
    ap.add_argument("--max-running-requests", type=int, default=4,
                    help="per replica; iServe's --batch (4: the largest profiled batch)")
    ap.add_argument("--slo-scales", default="5,20", help="SLO = scale x the fastest "
                    "configuration's unloaded TTFT and TPOT, per scale")
    ap.add_argument("--ttft-slo-s", type=float)
    ap.add_argument("--tpot-slo-s", type=float)
    ap.add_argument("--intent", default="latency-target", choices=tuple(intents.INTENTS))
    ap.add_argument("--max-perplexity", type=float, default=30.0,
                    help="iServe's accuracy limit (0: none)")
    ap.add_argument("--placement", default="hybrid", choices=tuple(placement.POLICIES))
    ap.add_argument("--baseline-bits", type=int, default=16, choices=space.BITS)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",")]
        rates = [float(x) for x in args.rates.split(",")] if args.rates else None
        scales = [float(x) for x in args.slo_scales.split(",")]
    except ValueError:
        ap.error(f"--loads/--rates/--slo-scales: numbers separated by commas, got "
                 f"{args.loads!r}, {args.rates!r}, {args.slo_scales!r}")
    if min(rates or loads) <= 0 or min(scales) <= 0 or args.requests < 2 or \
            args.max_running_requests < 1:
        ap.error("rates, loads, SLO scales, --requests and --max-running-requests must be "
                 "positive")
    if args.ttft_slo_s or args.tpot_slo_s:  # one SLO in seconds: no scales
        scales = [None]
    try:
        clusters = {"custom": tuple(deploy_cli.parse_device(d) for d in args.device)} \
            if args.device else {c: CLUSTERS[c] for c in (args.cluster or CLUSTERS)}
        placement.Cluster(list(next(iter(clusters.values())))).check_integrity()
        profile = deploy_cli.load_profile(args.profile)
    except (deploy_cli.CliError, ValueError) as e:
        ap.error(str(e))
    started = time.monotonic()
    rows, slos = [], {}
    for trace in args.trace or TRACES:
        history, evaluated = trace_windows(TRACES[trace], args.requests, args.prompt_scale)
        base_rows, _ = deploy_cli.candidates(profile, args.max_running_requests,
                                             evaluated.median_output_tokens, 1000, "rss", {})
        for scale in scales:
            slo_info = default_slo(profile, base_rows, evaluated, scale or 1.0)
            slo = Slo(args.ttft_slo_s or slo_info["ttft_s"],
                      args.tpot_slo_s or slo_info["tpot_s"])
            slos[f"{trace} x{scale}"] = {**slo_info, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}
            for name, devices in clusters.items():
                setting = load_setting(args.profile, devices, args.max_running_requests,
                                       evaluated.median_output_tokens, slo, args.intent,
                                       args.max_perplexity or None, args.placement,
                                       args.baseline_bits)
                for row in run_trace(setting, trace, history, evaluated, loads, rates):
                    rows.append({"cluster": name, "slo_scale": scale,
                                 "slo": dataclasses.asdict(slo), **row})
    raw = profile.raw
    meta = {
        "SIMULATED": True,
        "command": "python -m benchmark.iserve.sim " + shlex.join(
            sys.argv[1:] if argv is None else argv),
        "commit": git_state()["commit"],
        # What the simulation runs on: uncommitted changes there (others' files elsewhere in
        # the shared tree do not matter to it).
        "uncommitted": subprocess.run(
            ["git", "status", "--porcelain", "--", *INPUT_PATHS], capture_output=True,
            text=True, cwd=REPO).stdout.split(),
        "load_average": load_average(), "seconds": time.monotonic() - started,
        "profile": {"path": args.profile,
                    "sha256": hashlib.sha256(Path(args.profile).read_bytes()).hexdigest(),
                    "workload": raw["workload"], "model_dir": raw["model_dir"],
                    "sessions_git": [s.get("git") for s in raw.get("sessions", [])],
                    "fingerprint_records": sum(r["kind"] == "fingerprint"
                                               for r in raw["records"])},
        "estimates": {c.cfg.name: {"memory_gb": c.memory_bytes / 1e9,
                                   "ttft_s_batch1": profile.estimates.latency_of(c.cfg, 1)[0],
                                   "tpot_s_batch1": profile.estimates.latency_of(c.cfg, 1)[1]}
                      for c in deploy_cli.candidates(profile, 1, 32, 1000, "rss", {})[0]},
        "clusters": {n: [dataclasses.asdict(d) for d in ds] for n, ds in clusters.items()},
        "traces": {t: {"csv": TRACES[t], "requests_per_window": args.requests,
                       "prompt_scale": args.prompt_scale, "max_prompt_tokens": 512,
                       "max_output_tokens": 256,
                       "evaluated": "requests [N, 2N) of the trace; AlpaServe plans on [0, N)"}
                   for t in (args.trace or TRACES)},
        "slo": slos, "slo_scales": scales, "max_running_requests": args.max_running_requests,
        "intent": args.intent, "max_perplexity": args.max_perplexity or None,
        "placement": args.placement, "baseline_bits": args.baseline_bits,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulated_cluster.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "simulated_cluster.md").write_text(markdown(meta, rows))
    if not args.no_plot:
        plot(args.out / "simulated_cluster.png", rows)
    return 0


def _scale(row: dict) -> str:
    s = row["slo"]
    return f"x{row['slo_scale']:g}" if row["slo_scale"] else \
        f"{s['ttft_s']:g} s / {s['tpot_s']:g} s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(meta: dict, rows: list[dict]) -> str:
    prof = meta["profile"]
    lines = [
        "# iServe vs max-TP, max-PP, AlpaServe-like on a SIMULATED 8-device cluster",
        "", "**Every latency and SLO number below is SIMULATED** (SimPy, `benchmark/iserve/sim.py`"
        "); the inputs are iServe's estimates (M2/L2 from the fingerprints of the profile) and "
        "the Azure LLM 2023 traces. No cluster ran. The tables are only as good as the "
        "profile's estimates: `estimates_vs_measured.md` says how they compare with measured "
        "full configurations.", "",
        f"Command: `{meta['command']}` at commit {meta['commit']}"
        f"{' (uncommitted: ' + ' '.join(meta['uncommitted']) + ')' if meta['uncommitted'] else ''}"
        f"; profile "
        f"`{prof['path']}` (sha256 {prof['sha256'][:12]}, {prof['fingerprint_records']} "
        f"fingerprint records, profiled at commits {', '.join(str(g)[:7] for g in prof['sessions_git'])}); "
        f"{meta['seconds']:.0f} s, load average {meta['load_average'][0]:.1f}.", "",
        "Devices: " + "; ".join(
            f"`{n}` " + ", ".join(f"{d['name']} {d['memory_bytes'] / GIB:.0f} GiB/{d['cores']} "
                                  f"cores" for d in ds) for n, ds in meta["clusters"].items()),
        "",
        f"Per replica: `--max-running-requests {meta['max_running_requests']}`, "
        f"{prof['workload']['kv_tokens']} KV tokens. iServe: `select --intent {meta['intent']}`"
        f" (perplexity limit {meta['max_perplexity']}, placement {meta['placement']}); "
        f"baselines at {meta['baseline_bits']} bits.", "",
        "SLO per trace and scale (from the estimates; see the module docstring): " + "; ".join(
            f"{t}: TTFT <= {s['ttft_s']:.2f} s, TPOT <= {s['tpot_s'] * 1e3:.0f} ms"
            for t, s in meta["slo"].items()), "",
        "Estimates used (M2 RSS all processes, L2 at batch 1, profiled prompt): " + ", ".join(
            f"{n} {e['memory_gb']:.2f} GB / {e['ttft_s_batch1']:.2f} s / "
            f"{e['tpot_s_batch1'] * 1e3:.0f} ms" for n, e in meta["estimates"].items()), "",
        "SLO attainment, SIMULATED (configuration x replicas in the table below):", "",
        "| cluster | trace | SLO scale | rate req/s (x R) | " + " | ".join(
            f"{n} (SIMULATED)" for n in SYSTEMS) + " |",
        "|---|---|---|---|" + "---:|" * len(SYSTEMS)]
    for r in rows:
        lines.append(f"| {r['cluster']} | {r['trace']} | {_scale(r)} | "
                     f"{r['rate_rps']:.3f} (x{r['load']:.3f}) | "
                     + " | ".join(f"{r['systems'][n]['slo_attainment']:.1%}" for n in SYSTEMS)
                     + " |")
    lines += [
        "", "| cluster | trace | SLO scale | rate req/s (x R) | system | config x replicas | "
        "SLO attainment "
        "(SIMULATED) | P50 TTFT s (SIMULATED) | P99 TTFT s (SIMULATED) | P50 TPOT ms "
        "(SIMULATED) |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        for name, s in r["systems"].items():
            lines.append(
                f"| {r['cluster']} | {r['trace']} | {_scale(r)} | {r['rate_rps']:.3f} "
                f"(x{r['load']:.3f}) | {name} | {s['config']} x{s['replicas']} | {s['slo_attainment']:.1%} | "
                f"{_s(s['p50_ttft_s'])} | {_s(s['p99_ttft_s'])} | {_ms(s['p50_tpot_s'])} |")
    lines += ["", "R per trace and cluster: the estimated throughput of the fastest configuration "
              "on every device: " + "; ".join(sorted({
                  f"{r['cluster']}/{r['trace']} {r['reference_rps']:.3f} req/s "
                  f"({r['reference_config']})" for r in rows})), ""]
    lines += ["iServe's choice (`select`, first feasible configuration in the intent's order that "
              "fits a device): " + "; ".join(sorted({
                  f"{r['cluster']}/{r['trace']}/SLO {_scale(r)} "
                  f"{r['systems']['iserve']['config']} ("
                  f"{sum(x['infeasible'] is not None for x in r['iserve_selection']['ranking'])}"
                  f" of {len(r['iserve_selection']['ranking'])} ranked infeasible)"
                  for r in rows if r['iserve_selection']})), ""]
    notes = sorted({f"{r['cluster']}/{n}: {s['note']}" for r in rows
                    for n, s in r["systems"].items() if s["note"]})
    if notes:
        lines += ["Notes: " + "; ".join(notes), ""]
    return "\n".join(lines)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["cluster"], r["trace"]) for r in rows})
    scales = [label for _, label in sorted({(r["slo_scale"] or 0, _scale(r)) for r in rows})]
    fig, axes = plt.subplots(len(scales), len(panels), figsize=(4 * len(panels),
                             3.2 * len(scales)), squeeze=False)
    for ax, (scale, (cluster, trace)) in zip(axes.flat, [(s, p) for s in scales
                                                          for p in panels]):
        rs = [r for r in rows if (r["cluster"], r["trace"], _scale(r)) ==
              (cluster, trace, scale)]
        for name in SYSTEMS:
            # The any-bits reference often equals iServe: dashed on top, so both show.
            style = dict(ls="--", marker="x") if name == "alpaserve-any-bits" else \
                dict(ls="-", marker="o", lw=2.5 if name == "iserve" else 1.5)
            ax.plot([r["rate_rps"] for r in rs],
                    [100 * r["systems"][name]["slo_attainment"] for r in rs], label=name,
                    **style)
        ax.set_title(f"{cluster} / {trace} / SLO {scale}", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-3, 103)
    for ax in axes[:, 0]:
        ax.set_ylabel("SLO attainment % (SIMULATED)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("iServe vs baselines, SIMULATED 8-device cluster (SimPy, iServe's estimates)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
