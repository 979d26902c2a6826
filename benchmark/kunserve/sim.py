"""KunServe vs plain data parallelism on a SIMULATED cluster of 2-16 replicas (SimPy).

Every number this writes is SIMULATED: no cluster runs. What is real: the drop planner and the
controller (``sglang_morph.kunserve``, the objects the live system will use, unchanged), the
model's exact per-layer bytes (``splitquant.model``/``splitquant.memory``, the default model
SmolLM2-135M),
the arrival traces (``data/traces``), and the calibration, measured on this machine: the chunk
cost model (``benchmark/kunserve/costs.py``: forward times by phase), the gloo transfer time and
the host copy bandwidth (``benchmark/kunserve/transfer.py``).

Each replica is one device with the same weights + KV budget. A serving unit is a replica or a
merged group; it runs SGLang-like continuous batching: admit queued requests first come, first
served while their prompt + output fits the unit's KV (reserved whole, so nothing is ever
retracted), prefill the admitted ones in one forward, otherwise decode one token of every
running request. A single replica runs a forward in the cost model's time; a group runs each
iteration as lookahead micro-batches (one per stage) through its pipeline
(``lookahead.PipelineState``: stages overlap across iterations, hidden states cross a gloo link
between stages). The router sends each arrival to the next replica in turn (SGLang's
data-parallel default; ``least_outstanding``: the unit with the fewest outstanding tokens per
member), the same router for both systems.

The controller sees the cluster every ``--monitor-s`` and may drop (merge replicas; the
members stop for the transition: their live KV of the layers they drop crosses the gloo link,
and each member's KV pool is rebuilt at host copy bandwidth) or restore (weights come back from
the host copy at host copy bandwidth, requests' KV of the layers their home lacked crosses the
link, the pool is rebuilt). Assumed, not measured: the transitions move nothing else and pause
the members' serving for their whole duration (the live design overlaps them); the LM head and
the embedding add no stage time; a group's stages cost the model's time times their share of
layers.

Calibrated on a live replay (``--replay``, ``benchmark/kunserve/validate.py``), the cluster runs
as the row that check validates: costs fitted on the plain arm's forwards (with the fit's error
per decode batch size), the live transition times and merged decode step, each merged member
keeping its own queue (``merged_queues="member"``), and plain DP's tokens handed on as SGLang's
overlap scheduler does (``overlap_schedule``; KunServe turns it off).

    .venv/bin/python -m benchmark.kunserve.sim [--out benchmark/results/kunserve] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import simpy

from benchmark.harness import spread
from benchmark.replay.trace import TraceWindow, load_window
from sglang_morph.kunserve.controller import (
    ArrivalMeter,
    ClusterView,
    ControllerConfig,
    Drop,
    KunServeController,
    ReplicaSnapshot,
    Restore,
    StepCostMeter,
    queue_waits,
)
from sglang_morph.kunserve.cost import Chunk, ForwardTiming, PhaseCosts
from sglang_morph.kunserve.lookahead import (
    BatchItem,
    PipelineState,
    by_lookahead,
    stage_micro_batches,
)
from sglang_morph.kunserve.planner import DropPlannerConfig, LiveRequest, ReplicaGroup
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import ModelSpec
from sglang_morph.repo_data import TRACES_DIR

RESULTS = Path("benchmark/results/kunserve")
MAX_PREFILL_TOKENS = 8192  # one prefill forward at most (SGLang's --max-prefill-tokens)
ROUTERS = ("round_robin", "least_outstanding")
# A merged group's scheduling: "pair", one queue and one batch for the group (the paper's
# design); "member", each member keeps its own queue, KV share and batches and feeds the
# group's pipeline beside the others (the live pair: each replica keeps its SGLang scheduler).
MERGED_QUEUES = ("pair", "member")
LENGTH_KEYS = ("prompt_scale", "output_scale", "min_prompt_tokens", "max_prompt_tokens",
               "min_output_tokens", "max_output_tokens")


@dataclasses.dataclass(frozen=True)
class Calibration:
    costs: PhaseCosts
    gloo_latency_s: float
    gloo_bandwidth_bytes_per_s: float
    host_copy_bandwidth_bytes_per_s: float
    hidden_bytes_per_token: int
    # Measured whole transitions (a live run's drop / restore): when given they replace the
    # link + copy model, which leaves out the pool's allocation and the members' hand-over
    drop_s: float | None = None
    restore_s: float | None = None
    # What a request spends outside the schedulers before its first token (HTTP, tokenizer,
    # IPC, detokenizer): charged as a later arrival at the router, so no TPOT changes
    front_end_s: float = 0.0
    # A merged pair's decode stage time over what the cost model gives it (1.0: the
    # model's); a live pair's decode forwards took 1.36-1.38x a whole replica's here (gloo
    # hops, the compute lock and the GIL shared with the peer's service thread).
    merged_step_factor: float = 1.0
    # A merged pair's prefill forward over a whole replica's (None: the paper's pipeline, the
    # prefill cut by lookahead into micro-batches that overlap across the stages). Given, a
    # merged prefill runs as one batch through the stages, its stage times scaled so that
    # they add up to this factor times the whole replica's: the live pair cuts its prefills
    # too, yet each took 1.07-1.33x a whole replica's (median per round), the peer's core
    # being busy with its own decodes rather than free for the next micro-batch.
    merged_prefill_factor: float | None = None

    def link_s(self, nbytes: float) -> float:
        return self.gloo_latency_s + nbytes / self.gloo_bandwidth_bytes_per_s

    def copy_s(self, nbytes: float) -> float:
        return nbytes / self.host_copy_bandwidth_bytes_per_s

    @classmethod
    def load(cls, results: Path, spec: ModelSpec) -> "Calibration":
        transfer = json.loads((results / "transfer.json").read_text())
        return cls(PhaseCosts.load(results / "costs.json"), transfer["gloo_latency_s"],
                   transfer["gloo_bandwidth_bytes_per_s"],
                   transfer["host_copy_bandwidth_bytes_per_s"],
                   spec.hidden_size * spec.dtype_bytes)


@dataclasses.dataclass(frozen=True)
class BatchCorrectedCosts(PhaseCosts):
    """A fitted cost model with the decode fit's measured error at each batch size added back.

    On this CPU a decode step does not grow linearly with its requests: a replay's plain
    replicas took 53 ms at 1 request, 82-89 ms at 2, 105-117 ms at 3 and 87-90 ms at 4, where
    the linear fit gives 54, 67-89, 81-100 and 91-99 ms; the fit's error at the batch sizes
    a light load runs most is what the simulated TPOT missed by. ``decode_error_s[b - 1]``
    is the median of (measured - fitted) over the forwards of ``b`` requests (0 where too few
    were measured); larger batches take the fit alone."""

    decode_error_s: tuple[float, ...] = ()

    def seconds(self, chunks: Sequence[Chunk]) -> float:
        fitted = super().seconds(chunks)
        if chunks and len(chunks) <= len(self.decode_error_s) and all(
                ch.phase == "decode" for ch in chunks):
            return max(0.0, fitted + self.decode_error_s[len(chunks) - 1])
        return fitted


def decode_errors_s(costs: PhaseCosts, timings: Sequence[ForwardTiming],
                    min_forwards: int = 8) -> tuple[float, ...]:
    """Per decode batch size ``b`` (1 up to the largest measured), the median of the measured
    seconds minus ``costs``' over ``timings``' decode forwards of ``b`` requests; 0 for a
    size with fewer than ``min_forwards``."""
    by_size: dict[int, list[float]] = {}
    for t in timings:
        if all(ch.phase == "decode" for ch in t.chunks):
            by_size.setdefault(len(t.chunks), []).append(t.seconds - costs.seconds(t.chunks))
    if not by_size:
        return ()
    return tuple(float(np.median(by_size[b])) if len(by_size.get(b, ())) >= min_forwards
                 else 0.0 for b in range(1, max(by_size) + 1))


@dataclasses.dataclass
class Request:
    rid: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    generated: int = 0
    token_times_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def held_kv_tokens(self) -> int:
        """The KV written so far, what the live view reads from SGLang's allocator: a decode
        step writes the KV of the token it reads, so the newest token's is not written yet."""
        return self.prompt_tokens + max(0, self.generated - 1)

    @property
    def done(self) -> bool:
        return self.generated >= self.output_tokens


class SharedPipeline:
    """The stages of one merged group, which its members' schedulers feed in turn."""

    def __init__(self) -> None:
        self.state: PipelineState | None = None


class Unit:
    """A scheduler: a replica, or a merged group as one pipeline, with its queue and batch.

    ``member`` set: one member of a merged group with the requests routed to that replica, its
    own share of the group's KV and its own batches, feeding the group's pipeline (``shared``)
    beside the other members' schedulers, as the live pair runs (each replica keeps its
    SGLang scheduler). Unset: the group is one scheduler with one queue (the paper's design).
    """

    def __init__(self, sim: "ClusterSim", group: ReplicaGroup, member: int | None = None,
                 shared: SharedPipeline | None = None):
        self.sim = sim
        self.group = group
        self.member = member
        self.shared = shared or SharedPipeline()
        self.capacity_tokens = (group.capacity_tokens if member is None
                                else group.capacity_tokens // group.size)
        self.layer_shares = [len(m.layers) / sim.planner.num_layers for m in group.members]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.wakeup = sim.env.event()
        self.retiring: simpy.Event | None = None  # set: hand over at the next boundary
        self.iteration = 0
        # The last forward's requests whose tokens SGLang's overlap scheduler has not handed
        # on yet (``ClusterSim.overlap_schedule``)
        self.unsent: list[Request] = []
        self.process = sim.env.process(self.run())

    @property
    def pipeline(self) -> PipelineState | None:
        return self.shared.state

    @property
    def replicas(self) -> tuple[int, ...]:
        if self.member is not None:
            return (self.group.members[self.member].replica,)
        return self.group.replicas

    @property
    def outstanding_tokens(self) -> int:
        return sum(r.reserved_tokens - r.generated for r in self.waiting + self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def _admit(self) -> list[Request]:
        reserved = sum(r.reserved_tokens for r in self.running)
        admitted, prefill_tokens = [], 0
        cap = self.sim.merged_running_cap if self.group.size > 1 else None
        if cap is not None and self.member is not None:
            cap = max(1, cap // self.group.size)  # the cap is the group's
        while self.waiting:
            r = self.waiting[0]
            if (reserved + r.reserved_tokens > self.capacity_tokens
                    or (admitted and prefill_tokens + r.prompt_tokens > MAX_PREFILL_TOKENS)
                    or (cap is not None and len(self.running) + len(admitted) >= cap)):
                break
            self.waiting.pop(0)
            admitted.append(r)
            reserved += r.reserved_tokens
            prefill_tokens += r.prompt_tokens
        return admitted

    def _forward(self, items: list[BatchItem]):
        """Run one iteration; returns when each request's token comes back (by rid)."""
        env, cal = self.sim.env, self.sim.cal
        if self.group.size == 1:
            seconds = cal.costs.seconds([i.chunk() for i in items])
            return {i.rid: env.now + seconds for i in items}, env.now + seconds
        if self.pipeline is None:
            transfer = cal.link_s(0)  # latency only; the size is added per micro-batch below
            self.shared.state = PipelineState(self.group.size, transfer, env.now)
        out = {}
        decode = all(i.new_tokens == 1 for i in items)
        if not decode and cal.merged_prefill_factor is not None:
            mbs, factor = [tuple(items)], cal.merged_prefill_factor
        elif decode and self.member is not None:
            # A member's decode step is one micro-batch, as live: the other members' steps are
            # what fills the pipeline beside it (cut in more, each would pay gamma again).
            mbs, factor = [tuple(items)], cal.merged_step_factor
        else:
            mbs = by_lookahead(items, self.group.size, cal.costs)
            factor = cal.merged_step_factor if decode else 1.0
        for staged, mb in zip(stage_micro_batches(cal.costs, self.iteration, mbs,
                                                  self.layer_shares), mbs):
            tokens = sum(i.new_tokens for i in mb)
            # The hidden states' bytes on the link, charged to the stages' times.
            link = tokens * cal.hidden_bytes_per_token / cal.gloo_bandwidth_bytes_per_s
            staged = dataclasses.replace(staged, stage_seconds=tuple(
                s * factor + link for s in staged.stage_seconds))
            back = self.pipeline.submit(staged, env.now)
            for i in mb:
                out[i.rid] = max(out.get(i.rid, 0.0), back)
        # The next iteration can be formed once stage 0 is free.
        return out, self.pipeline.done[0]

    def run(self):
        env = self.sim.env
        while True:
            if self.retiring is not None:
                yield env.timeout(max(0.0, max(self.pipeline.done) - env.now)
                                  if self.pipeline else 0.0)
                self.retiring.succeed()
                return
            if not self.waiting and not self.running:
                self.unsent = []  # no forward follows: the last tokens went out as they came
                self.wakeup = env.event()
                yield self.wakeup
                continue
            admitted = self._admit()
            by_rid = {r.rid: r for r in self.running + admitted}
            if admitted:
                items = [BatchItem(r.rid, 0, r.prompt_tokens) for r in admitted]
            elif self.running:
                items = [BatchItem(r.rid, r.kv_tokens - 1, 1) for r in self.running]
            else:  # the head of the queue does not fit an empty unit: cannot happen by sizing
                raise RuntimeError(f"unit {self.replicas}: request {self.waiting[0].rid} "
                                   f"({self.waiting[0].reserved_tokens} tokens) never fits "
                                   f"{self.capacity_tokens}")
            back, next_at = self._forward(items)
            if self.group.size == 1:  # a whole replica's forward, as the live one measures
                self.sim.step_costs[self.replicas[0]].record(
                    not admitted, sum(i.new_tokens for i in items), next_at - env.now)
            self.iteration += 1
            for replica in self.replicas:
                self.sim.forwards[replica] += 1
            self.running += admitted
            for r in self.unsent:  # the previous batch's tokens go out once this one has run
                r.token_times_s[-1] = max(r.token_times_s[-1], next_at)
            for rid, at in back.items():
                r = by_rid[rid]
                r.generated += 1
                r.token_times_s.append(at)
            if self.sim.overlap_schedule and self.group.size == 1:
                self.unsent = [by_rid[rid] for rid in back]
            finished = [r for r in self.running if r.done]
            self.running = [r for r in self.running if not r.done]
            self.sim.finished += finished
            yield env.timeout(max(next_at - env.now, 0.0))


class ClusterSim:
    def __init__(self, requests: Sequence[Request], replicas: int, planner: DropPlannerConfig,
                 cal: Calibration, kunserve: bool, monitor_s: float,
                 controller_cfg: ControllerConfig, router: str = "round_robin",
                 merged_running_cap: int | None = None, merged_queues: str = "pair",
                 overlap_schedule: bool = False):
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        if merged_queues not in MERGED_QUEUES:
            raise ValueError(f"merged_queues must be one of {MERGED_QUEUES}, "
                             f"got {merged_queues!r}")
        self.merged_queues = merged_queues
        # SGLang's overlap scheduler (its default; KunServe and morph turn it off): a batch's
        # tokens are handed on only after the next batch has been launched, and on a CPU
        # launching runs that batch's forward, so each token but a replica's last before it
        # idles reaches the client one forward later. Single replicas only: a merged group
        # runs without it.
        self.overlap_schedule = overlap_schedule
        if merged_running_cap is not None and merged_running_cap < 1:
            raise ValueError(f"merged_running_cap must be >= 1, got {merged_running_cap}")
        # Admission control while merged (a policy studied in simulation): a merged group
        # runs at most this many requests, the rest wait in its queue
        self.merged_running_cap = merged_running_cap
        self.env = simpy.Environment()
        self.router, self.replicas, self.dispatched = router, replicas, 0
        self.planner = planner
        self.cal = cal
        self.requests = list(requests)
        self.finished: list[Request] = []
        self.units = [Unit(self, ReplicaGroup((planner.full_replica(i),)))
                      for i in range(replicas)]
        self.held: list[tuple[Request, int | None]] = []  # with the replica each waits for
        self.transitions: list[dict] = []
        self.timeline: list[dict] = []
        self.controller = KunServeController(planner, controller_cfg) if kunserve else None
        # Each replica's forward steps, and its arrival rates as the live view measures them
        self.forwards = [0] * replicas
        self.meters = [ArrivalMeter() for _ in range(replicas)]
        self.step_costs = [StepCostMeter() for _ in range(replicas)]
        self.finishing_steps = controller_cfg.finishing_steps
        self.monitor_s = monitor_s
        self.env.process(self.arrivals())
        self.env.process(self.monitor())

    def route(self, request: Request, replica: int | None = None) -> None:
        """``round_robin`` (SGLang's data-parallel controller by default): the next replica
        in turn, whatever unit it is in; a request for a replica in a transition waits for
        that replica. ``least_outstanding``: the unit with the fewest outstanding tokens per
        member; held only while every replica is in a transition."""
        if self.router == "round_robin":
            if replica is None:
                replica, self.dispatched = self.dispatched % self.replicas, self.dispatched + 1
            unit = next((u for u in self.units if replica in u.replicas), None)
        else:
            unit = min(self.units, key=lambda u: (u.outstanding_tokens / len(u.replicas),
                                                  u.replicas[0]), default=None)
        if unit is None:
            self.held.append((request, replica))
            return
        unit.add(request)

    def release_held(self) -> None:
        held, self.held = self.held, []
        for r, replica in held:
            self.route(r, replica)

    def arrivals(self):
        for r in self.requests:
            yield self.env.timeout(max(0.0, r.arrival_s + self.cal.front_end_s - self.env.now))
            self.route(r)

    def view(self) -> ClusterView:
        snapshots = []
        for u in self.units:
            # Per-member queues (the live pair): a request stays with its replica's scheduler,
            # so a restore must fit each member's own requests in its own pool, as the live
            # controller asks of its replicas (and a live replica refuses otherwise).
            owner = u.replicas[0] if self.merged_queues == "member" else None
            live = tuple(LiveRequest(r.rid, r.held_kv_tokens, owner=owner) for r in u.running)
            used = sum(r.held_kv_tokens for r in u.running)
            growth = sum(r.output_tokens - r.generated for r in u.running)
            waiting = sum(r.reserved_tokens for r in u.waiting)
            # What the live replicas report too: the queue's head does not fit (SGLang's
            # prefill adder refused it), and the requests about to finish
            reserved = sum(r.reserved_tokens for r in u.running)
            refused = bool(u.waiting) and (
                reserved + u.waiting[0].reserved_tokens > u.capacity_tokens)
            finishing = sum(r.reserved_tokens for r in u.running
                            if r.output_tokens - r.generated <= self.finishing_steps)
            members = (u.group.members if u.member is None
                       else (u.group.members[u.member],))
            # The queue's waits on this unit as it is (the controller asks it of whole
            # replicas): its pool holds nothing but the running requests here.
            waits = queue_waits(
                u.capacity_tokens,
                [(r.reserved_tokens, r.output_tokens - r.generated) for r in u.running],
                [(r.reserved_tokens, r.output_tokens) for r in u.waiting])
            held = {r.rid: r.prompt_tokens for r in u.waiting + u.running}
            for k, m in enumerate(members):
                # A pair's one queue is its first member's, as its waiting tokens are
                arrivals, arrival_tokens = self.meters[m.replica].update(
                    self.env.now, self.forwards[m.replica], held if k == 0 else {})
                snapshots.append(ReplicaSnapshot(
                    m.replica, u.capacity_tokens, used, growth, waiting if k == 0 else 0, live,
                    queue_refused=refused and k == 0,
                    kv_finishing_tokens=min(finishing, used + growth),
                    running_requests=len(u.running) if k == 0 else 0,
                    queued_prompt_tokens=(sum(r.prompt_tokens for r in u.waiting)
                                          if k == 0 else 0),
                    queue_wait_steps=float(sum(waits)) if k == 0 else 0.0,
                    queue_drain_steps=waits[-1] if waits and k == 0 else 0.0,
                    arrivals_per_step=arrivals, arrival_prompt_tokens_per_step=arrival_tokens,
                    prefill_tokens_per_step=self.step_costs[m.replica].prefill_tokens_per_step()))
        groups = tuple(dict.fromkeys(u.group for u in self.units if u.group.size > 1))
        return ClusterView(self.env.now, tuple(sorted(snapshots, key=lambda s: s.replica)),
                           groups)

    def monitor(self):
        while len(self.finished) < len(self.requests):
            sample = {"groups": [list(u.replicas) for u in self.units],
                      "capacity_tokens": sum(u.capacity_tokens for u in self.units),
                      "queued": sum(len(u.waiting) for u in self.units)}
            # A step function: a sample only where something changed (a sample every
            # monitor_s made the results file MBs of repeats on the long BurstGPT window).
            if not self.timeline or {k: self.timeline[-1][k] for k in sample} != sample:
                self.timeline.append({"time_s": self.env.now, **sample})
            if self.controller is not None:
                action = self.controller.decide(self.view())
                if isinstance(action, Drop):
                    yield from self.apply_drop(action)
                elif isinstance(action, Restore):
                    yield from self.apply_restore(action)
            yield self.env.timeout(self.monitor_s)
        if self.timeline:  # the step function runs to the end of the simulation
            self.timeline.append({**self.timeline[-1], "time_s": self.env.now})

    def _retire(self, replicas: set[int]):
        units = [u for u in self.units if set(u.replicas) & replicas]
        events = []
        for u in units:
            u.retiring = self.env.event()
            events.append(u.retiring)
            if not u.wakeup.triggered:
                u.wakeup.succeed()
        yield simpy.AllOf(self.env, events)
        self.units = [u for u in self.units if u not in units]
        return units

    def apply_drop(self, action: Drop):
        plan, start = action.plan, self.env.now
        merged = [g for g in plan.groups if g.size > 1]
        replicas = {r for g in merged for r in g.replicas}
        old = yield from self._retire(replicas)
        for g in merged:
            members = [u for u in old if set(u.replicas) <= set(g.replicas)]
            migrate = max(plan.kv_migration_bytes[r] for r in g.replicas)
            rebuild = max(m.budget.kv_bytes for m in g.members)
            yield self.env.timeout(self.cal.drop_s if self.cal.drop_s is not None
                                   else self.cal.link_s(migrate) + self.cal.copy_s(rebuild))
            if self.merged_queues == "pair":
                unit = Unit(self, g)
                unit.running = [r for u in members for r in u.running]
                unit.waiting = sorted((r for u in members for r in u.waiting),
                                      key=lambda r: r.arrival_s)
                new_units = [unit]
            else:  # each member keeps its own requests and scheduler
                shared = SharedPipeline()
                new_units = [Unit(self, g, k, shared) for k in range(g.size)]
                for unit in new_units:
                    home = [u for u in members if u.replicas == unit.replicas]
                    unit.running = [r for u in home for r in u.running]
                    unit.waiting = [r for u in home for r in u.waiting]
            for unit in new_units:
                self.units.append(unit)
                if unit.waiting or unit.running:
                    unit.wakeup.succeed()
        self.release_held()
        self.controller.applied(action, self.env.now)
        self.transitions.append({"kind": "drop", "at_s": start, "seconds": self.env.now - start,
                                 "groups": [list(g.replicas) for g in merged],
                                 "reason": action.reason})

    def apply_restore(self, action: Restore):
        plan, start = action.plan, self.env.now
        old_units = yield from self._retire(set(plan.group.replicas))
        inbound = max(plan.kv_inbound_bytes.values())
        yield self.env.timeout(self.cal.restore_s if self.cal.restore_s is not None
                               else self.cal.link_s(inbound) + self.cal.copy_s(
                                   max(m.freed_bytes for m in plan.group.members)
                                   + max(m.budget.kv_bytes for m in plan.restored)))
        units = {m.replica: Unit(self, ReplicaGroup((m,))) for m in plan.restored}
        for old in old_units:
            for r in old.running:
                units[plan.home[r.rid]].running.append(r)
            if old.member is not None:  # its queue stays on its replica
                units[old.replicas[0]].waiting += old.waiting
                continue
            for k, r in enumerate(old.waiting):
                units[plan.group.replicas[k % plan.group.size]].waiting.append(r)
        for u in units.values():
            self.units.append(u)
            if u.waiting or u.running:
                u.wakeup.succeed()
        self.release_held()
        self.controller.applied(action, self.env.now)
        self.transitions.append({"kind": "restore", "at_s": start,
                                 "seconds": self.env.now - start,
                                 "groups": [list(plan.group.replicas)], "reason": action.reason})

    def run(self, limit_s: float) -> None:
        self.env.run(until=limit_s)


STATS = ("p99_ttft_s", "p50_ttft_s", "p50_tpot_s", "p95_tpot_s", "p95_e2e_s")


def latency_stats(requests: Sequence[Request]) -> dict:
    ttft = np.array([r.token_times_s[0] - r.arrival_s for r in requests])
    tpot = np.array([(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                     for r in requests if len(r.token_times_s) > 1])
    e2e = np.array([r.token_times_s[-1] - r.arrival_s for r in requests])
    return {"requests": len(requests), "p99_ttft_s": float(np.percentile(ttft, 99)),
            "p50_ttft_s": float(np.percentile(ttft, 50)),
            "p50_tpot_s": float(np.percentile(tpot, 50)) if len(tpot) else None,
            "p95_tpot_s": float(np.percentile(tpot, 95)) if len(tpot) else None,
            "p95_e2e_s": float(np.percentile(e2e, 95))}


def trace_requests(path: Path, replicas: int, window: dict) -> list[Request]:
    """Each replica its own slice of the trace window: the window's requests are dealt in
    turn, request ``i`` to slice ``i mod step`` with ``step = max(keep_every, replicas)``, and
    replica ``k`` gets slice ``k``. With ``step = keep_every`` (the window's thinning) each
    replica sees one thinned copy's rate, as a single replica of the live replay does, and no
    two replicas see the same request; with more replicas than that the window's time is
    compressed by ``keep_every / replicas`` to keep each replica's rate (BurstGPT's 400
    requests: a shorter run)."""
    keep = int(window.get("keep_every", 1))
    step = max(keep, replicas)
    scale = float(window.get("time_scale", 1.0)) * keep / step
    w = TraceWindow(path, **{**window, "keep_every": 1, "time_scale": scale})
    out = [Request(f"{r.index % step}-{r.index}", r.arrival_s, r.prompt_tokens,
                   r.output_tokens) for r in load_window(w) if r.index % step < replicas]
    return sorted(out, key=lambda r: (r.arrival_s, r.rid))


def simulate(requests: Sequence[Request], replicas: int, planner: DropPlannerConfig,
             cal: Calibration, kunserve: bool, monitor_s: float = 0.5,
             controller_cfg: ControllerConfig = ControllerConfig(),
             limit_s: float = 36000.0, router: str = "round_robin",
             merged_running_cap: int | None = None, merged_queues: str = "pair",
             overlap_schedule: bool = False) -> ClusterSim:
    sim = ClusterSim([dataclasses.replace(r, token_times_s=[], generated=0) for r in requests],
                     replicas, planner, cal, kunserve, monitor_s, controller_cfg, router,
                     merged_running_cap, merged_queues, overlap_schedule)
    sim.run(limit_s)
    return sim


# Windows and thinning that load one simulated replica of this machine at roughly the rate
# it serves (~0.2-0.3 requests/s), so that the traces' bursts overflow its KV; every replica
# gets its own slice of the window (``trace_requests``: the cluster's rate grows with its
# size).
TRACES = {
    "azure_conv": ("azure_llm_2023_conv.csv",
                   dict(start_s=0.0, duration_s=600.0, keep_every=40, max_prompt_tokens=1024,
                        max_output_tokens=256)),
    "azure_code": ("azure_llm_2023_code.csv",
                   dict(start_s=0.0, duration_s=600.0, keep_every=20, max_prompt_tokens=1024,
                        max_output_tokens=256)),
    "burstgpt": ("burstgpt_first400.csv",
                 dict(start_s=0.0, duration_s=37300.0, time_scale=0.3, max_prompt_tokens=1024,
                      max_output_tokens=256)),
}


def matched_thinning(path: Path, window: dict, tokens_per_s: float) -> int:
    """The ``keep_every`` that makes the window offer about ``tokens_per_s`` (prompt +
    output tokens a second) to one replica."""
    w = TraceWindow(path, **{**window, "keep_every": 1})
    every = sum(r.prompt_tokens + r.output_tokens for r in load_window(w))
    return max(1, round(every / w.replay_duration_s / tokens_per_s))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.sim",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--calibration", type=Path, default=RESULTS)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--budget-bytes", type=int, default=365_000_000)
    ap.add_argument("--max-group-size", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 and 4 replicas, one trace")
    ap.add_argument("--replay", type=Path, nargs="+",
                    help="rounds of a live two-replica replay at one operating point "
                         "(`benchmark.replay --dp2 --configs dp2,kunserve`): each round's "
                         "calibration (the plain arm's forwards and step gap; KunServe's "
                         "transition durations and merged decode step, pooled over the rounds), "
                         "its float32 pool and its controller settings, as "
                         "`benchmark.kunserve.validate` checks them; one simulation per round, "
                         "the table gives the median and range over them; replaces "
                         "--calibration and --budget-bytes")
    args = ap.parse_args()
    from sglang_morph.models import default_model_path

    monitor_s, controller_cfg = 0.5, ControllerConfig()
    if args.replay:
        from benchmark.kunserve import validate

        rounds = [validate.load_round(p) for p in args.replay]
        rnd = rounds[0]
        if len({(r.kv_tokens_per_replica,
                 tuple((q.prompt_tokens, q.output_tokens) for q in r.requests))
                for r in rounds}) > 1:
            ap.error("--replay: the rounds must be of one operating point (the same requests "
                     "and pool)")
        spec = ModelSpec.from_model_dir(default_model_path(), dtype_bytes=validate.DTYPE_BYTES)
        planner = validate.planner_for(spec, rnd.kv_tokens_per_replica, args.max_group_size)
        # The row the check validates (``validate.VALIDATED``): the plain arm's tokens handed
        # on by SGLang's overlap scheduler, the merged members keeping their own queues (as
        # live).
        name, queues = validate.VALIDATED
        cals = [validate.calibration(name, r, spec, rounds, args.calibration) for r in rounds]
        overlap = rnd.overlap_schedule
        monitor_s, controller_cfg = rnd.interval_s, rnd.controller
        args.budget_bytes = planner.budget_bytes
    else:
        spec = ModelSpec.from_model_dir(default_model_path())
        planner = DropPlannerConfig(MemoryModel.from_spec(spec, bits=(16,)), args.budget_bytes,
                                    max_group_size=args.max_group_size)
        cals = [Calibration.load(args.calibration, spec)]
        overlap, queues = {}, "pair"
    replicas_list = [2, 4] if args.quick else args.replicas
    traces = dict(list(TRACES.items())[:1]) if args.quick else TRACES
    started = time.monotonic()
    rows = []
    lengths, per_replica_tokens_per_s, keep_every = {}, None, {}
    if args.replay:
        # The replay's prompt and output lengths (scales and caps) and its offered tokens per
        # second per replica: each simulated replica gets the kind of load the check against
        # that replay validated, with each trace's own burstiness.
        trace = json.loads((rnd.path / "replay_dp2.json").read_text())["settings"]["trace"]
        lengths = {k: trace[k] for k in LENGTH_KEYS}
        per_replica_tokens_per_s = sum(r.reserved_tokens for r in rnd.requests) / (
            trace["duration_s"] * trace["time_scale"]) / 2
    for name, (csv, window) in traces.items():
        window = {**window, **lengths}
        if per_replica_tokens_per_s:
            window["keep_every"] = matched_thinning(TRACES_DIR / csv, window,
                                                    per_replica_tokens_per_s)
        keep_every[name] = window.get("keep_every", 1)
        for n in replicas_list:
            reqs = trace_requests(TRACES_DIR / csv, n, window)
            runs = []
            for k, cal in enumerate(cals):
                run = {}
                for system, arm in (("dp", "dp2"), ("kunserve", "kunserve")):
                    sim = simulate(reqs, n, planner, cal, arm == "kunserve", monitor_s,
                                   controller_cfg, merged_queues=queues,
                                   overlap_schedule=overlap.get(arm, False))
                    if len(sim.finished) != len(reqs):
                        raise RuntimeError(f"{name} x{n} {system}: {len(sim.finished)} of "
                                           f"{len(reqs)} requests finished")
                    # Timelines only for the smallest cluster and the first calibration: they
                    # are what the plot shows, and every one would make the file tens of MB.
                    run[system] = {**latency_stats(sim.finished), "transitions": sim.transitions,
                                   "timeline": sim.timeline if n == min(replicas_list) and k == 0
                                   else []}
                runs.append(run)
            row = {"trace": name, "replicas": n, "requests": len(reqs), "runs": runs,
                   **{system: {**{key: float(np.median([r[system][key] for r in runs]))
                                  for key in STATS},
                               "transitions": runs[0][system]["transitions"],
                               "timeline": runs[0][system]["timeline"]}
                      for system in ("dp", "kunserve")}}
            rows.append(row)
            print(f"{name} x{n}: DP P99 TTFT {row['dp']['p99_ttft_s']:.2f} s, KunServe "
                  f"{row['kunserve']['p99_ttft_s']:.2f} s; P50 TPOT {row['dp']['p50_tpot_s']:.4f}"
                  f" vs {row['kunserve']['p50_tpot_s']:.4f} s", flush=True)
    meta = {"command": " ".join(["python -m benchmark.kunserve.sim", *sys.argv[1:]]),
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "budget_bytes": args.budget_bytes, "max_group_size": args.max_group_size,
            "calibration": "; ".join(c.costs.source for c in cals),
            "calibrations": len(cals),
            "replay": [str(p) for p in args.replay] if args.replay else None,
            "transitions_s": {"drop": cals[0].drop_s, "restore": cals[0].restore_s},
            "merged_step_factor": cals[0].merged_step_factor,
            "merged_prefill_factor": cals[0].merged_prefill_factor, "keep_every": keep_every,
            "merged_queues": queues, "overlap_schedule": overlap,
            "front_end_s": [c.front_end_s for c in cals],
            "monitor_s": monitor_s, "seconds": time.monotonic() - started,
            "SIMULATED": True}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulated_clusters.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    write_table(args.out / "simulated_clusters.md", rows, meta)
    plot(args.out / "simulated_clusters.png", rows)


def write_table(path: Path, rows, meta) -> None:
    lines = ["# KunServe vs plain DP on SIMULATED clusters (SimPy; calibrated on this machine)", "",
             f"SIMULATED. `{meta['command']}` at commit {meta['commit']}, SmolLM2-135M, "
             f"{meta['budget_bytes']} bytes (weights + KV) per replica, groups of at most "
             f"{meta['max_group_size']}; calibration: {meta['calibration']}"
             + (f"; transitions {meta['transitions_s']}, merged decode step x"
                f"{meta.get('merged_step_factor', 1.0):.2f}, thinning per trace "
                f"{meta.get('keep_every')} (the replay's offered tokens/s per replica)"
                + (f", merged members' queues: {meta['merged_queues']}, front end "
                   f"{meta['front_end_s']} s, SGLang's overlap scheduler per arm "
                   f"{meta['overlap_schedule']}" if "merged_queues" in meta else "")
                if meta.get("replay") else "") + ".", "",
             "| trace | replicas | requests | DP P99 TTFT (s) | KunServe P99 TTFT (s) | "
             "TTFT x lower (DP / KunServe) | DP P50 TPOT (ms) | KunServe P50 TPOT (ms) | TPOT change | TPOT "
             "P95 change | E2E P95 change | groups merged | groups restored |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dp, ks = r["dp"], r["kunserve"]
        runs = r.get("runs") or [{"dp": dp, "kunserve": ks}]

        def cell(f, fmt: str, runs=runs) -> str:
            return _spread_cell([f(run) for run in runs], fmt)

        lines.append(
            f"| {r['trace']} | {r['replicas']} | {r['requests']} | {dp['p99_ttft_s']:.2f} | "
            f"{ks['p99_ttft_s']:.2f} | "
            + cell(lambda run: run["dp"]["p99_ttft_s"] / max(run["kunserve"]["p99_ttft_s"],
                                                             1e-9), ".1f") + " | "
            f"{dp['p50_tpot_s'] * 1e3:.1f} | {ks['p50_tpot_s'] * 1e3:.1f} | "
            + " | ".join(cell(lambda run, k=k: run["kunserve"][k] / run["dp"][k] - 1, "+.0%")
                         for k in ("p50_tpot_s", "p95_tpot_s", "p95_e2e_s"))
            + " | " + " | ".join(cell(lambda run, kind=kind: _transitions(run, kind), ".0f")
                                 for kind in ("drop", "restore")) + " |")
    path.write_text("\n".join(lines) + "\n")


def _spread_cell(values: Sequence[float], fmt: str) -> str:
    """One value as is; several as their median (min to max), ``benchmark.harness.spread``."""
    if len(values) == 1:
        return format(values[0], fmt)
    s = spread(values)
    return f"{format(s['median'], fmt)} ({format(s['min'], fmt)} to {format(s['max'], fmt)})"


def _transitions(run: dict, kind: str) -> int:
    """A KunServe run's groups merged (``drop``) or restores (``restore``)."""
    return sum(len(t["groups"]) if kind == "drop" else 1
               for t in run["kunserve"]["transitions"] if t["kind"] == kind)


def plot(path: Path, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for trace in traces:
        rs = [r for r in rows if r["trace"] == trace]
        n = [r["replicas"] for r in rs]
        axes[0].plot(n, [r["dp"]["p99_ttft_s"] for r in rs], "o--", label=f"{trace} DP")
        axes[0].plot(n, [r["kunserve"]["p99_ttft_s"] for r in rs], "s-",
                     label=f"{trace} KunServe")
        axes[1].plot(n, [r["dp"]["p50_tpot_s"] * 1e3 for r in rs], "o--", label=f"{trace} DP")
        axes[1].plot(n, [r["kunserve"]["p50_tpot_s"] * 1e3 for r in rs], "s-",
                     label=f"{trace} KunServe")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("P99 TTFT (s, SIMULATED)")
    axes[1].set_ylabel("P50 TPOT (ms, SIMULATED)")
    for ax in axes:
        ax.set_xlabel("replicas")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    fig.suptitle("KunServe vs plain DP, SIMULATED (SimPy, calibrated on this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    # Capacity and queue over time of the smallest cluster, per trace.
    timed = [r for r in rows if r["kunserve"]["timeline"]]
    fig, axes = plt.subplots(len(timed), 1, figsize=(11, 2.6 * len(timed)), squeeze=False)
    for ax, r in zip(axes[:, 0], timed):
        for system, style in (("dp", "--"), ("kunserve", "-")):
            tl = r[system]["timeline"]
            t = [p["time_s"] for p in tl]
            ax.step(t, [p["capacity_tokens"] for p in tl], style, where="post",
                    label=f"{system} KV capacity")
            ax.step(t, [p["queued"] * 1000 for p in tl], style, where="post", alpha=0.5,
                    label=f"{system} queued requests x1000")
        ax.set_title(f"{r['trace']}, {r['replicas']} replicas (SIMULATED)", fontsize=8)
        ax.set_ylabel("tokens")
        ax.legend(fontsize=6)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path.with_name("simulated_timeline.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
