"""AMOEBAs' scheduler vs merge-on-demand baselines on a SIMULATED cluster of replicas (SimPy).

Every number this writes is SIMULATED: no cluster runs. What is real: the policies
(``sglang_morph.amoebas.policy``, the objects the live dispatcher uses, unchanged) and the
capacity model (``sglang_morph.amoebas.capacity``: the model's exact weight and KV bytes). The
step costs (``StepCosts``) are inputs: by default the chunk cost model measured on this machine
through a real SGLang server (``benchmark/results/kunserve/costs.json``) and the gloo and host
copy numbers measured there (``transfer.json``); what is assumed is listed in ``ASSUMED``.

Each replica is one device with one budget (TP 1 weights + its startup KV pool). A unit (a
replica or a merged group) runs continuous batching: each member admits its own queue first
come, first served while the request's prompt + max_new_tokens fits its own pool (reserved
whole, so nothing is retracted); a forward prefills every admitted request of every member
together, otherwise decodes one token of every running request. A group of degree d runs one
forward over its members' batches: the TP 1 cost / d plus ``allreduce_s_per_layer`` per layer.
A merge or a split stalls its members after their current forward for ``merge_s`` / ``split_s``
(fixed part + the KV re-sharded over the link + for a split, the FFN refilled from the host
copy). The dispatcher keeps one queue, first come, first served: a short request the policy
answers ``Queue`` holds the short ones behind it (the long ones behind it may still merge); a
long one waiting for a group's shape holds nothing.

The command line (scenarios, seeds, the results files) is ``python -m benchmark.amoebas``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import simpy

from sglang_morph.amoebas.capacity import CapacityModel
from sglang_morph.amoebas.policy import (
    Dispatch,
    Fleet,
    Merge,
    Policy,
    Queue,
    Refuse,
    Request,
    Split,
    Unit,
    UnitRequest,
)
from sglang_morph.kunserve.cost import ChunkCostModel, PhaseCosts

KUNSERVE_RESULTS = Path("benchmark/results/kunserve")
MAX_PREFILL_TOKENS = 8192  # one prefill forward holds at most this many new tokens, or one prompt
ALLREDUCES_PER_LAYER = 2  # attention output and MLP output
ASSUMED = {
    "tp_compute": "a group of degree d runs the TP 1 forward's time / d (perfect split)",
    "allreduce_s_per_layer": "2 all-reduces per layer, each one measured gloo message latency",
    "merge_fixed_s / split_fixed_s": "KunServe's live drop / restore on this machine (0.14 s / "
                                     "0.28 s, benchmark/results/replay/replay_dp2.md) as proxies",
    "dtype": "costs measured in bfloat16 are used for the float32 default model unchanged",
}


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds of one forward at a degree and of the transitions.

    Invariant: every term >= 0, so a larger batch or a longer context never costs less.
    """

    phases: PhaseCosts  # TP 1 forward times (prefill, decode), KunServe's chunk cost model
    num_layers: int
    allreduce_s_per_layer: float
    merge_fixed_s: float
    split_fixed_s: float
    link_bytes_per_s: float  # the KV re-sharded between members
    host_copy_bytes_per_s: float  # the FFN shards refilled on a split
    source: str = ""

    def __post_init__(self) -> None:
        if min(self.allreduce_s_per_layer, self.merge_fixed_s, self.split_fixed_s) < 0 or min(
                self.link_bytes_per_s, self.host_copy_bytes_per_s, self.num_layers) <= 0:
            raise ValueError(f"step costs must be >= 0 (bandwidths > 0): {self}")

    @classmethod
    def measured(cls, num_layers: int, results: Path = KUNSERVE_RESULTS) -> "StepCosts":
        transfer = json.loads((results / "transfer.json").read_text())
        phases = PhaseCosts.load(results / "costs.json")
        return cls(phases, num_layers, ALLREDUCES_PER_LAYER * transfer["gloo_latency_s"], 0.14,
                   0.28, transfer["gloo_bandwidth_bytes_per_s"],
                   transfer["host_copy_bandwidth_bytes_per_s"],
                   f"measured: {phases.source}; gloo and host copy: {results}/transfer.json")

    @classmethod
    def from_json(cls, raw: dict, num_layers: int) -> "StepCosts":
        return cls(PhaseCosts.from_json(raw["phases"]), num_layers, raw["allreduce_s_per_layer"],
                   raw["merge_fixed_s"], raw["split_fixed_s"], raw["link_bytes_per_s"],
                   raw["host_copy_bytes_per_s"], raw.get("source", "JSON input"))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "phases": self.phases.to_json()}

    def _tp(self, tp1_s: float, degree: int) -> float:
        if degree == 1:
            return tp1_s
        return tp1_s / degree + self.num_layers * self.allreduce_s_per_layer

    def prefill_s(self, prompts: Sequence[int], degree: int) -> float:
        m: ChunkCostModel = self.phases.prefill  # fresh prompts: no cached prefix (p = 0)
        return self._tp(m.gamma_s + sum(m.alpha_s * (c * c + c) + m.beta_s * c
                                        for c in prompts), degree)

    def decode_s(self, contexts: Sequence[int], degree: int) -> float:
        m = self.phases.decode
        return self._tp(m.gamma_s + sum(m.alpha_s * (p + 2) + m.beta_s + m.delta_s * p * p
                                        + m.epsilon_s * p for p in contexts), degree)

    def merge_s(self, moved_bytes: int) -> float:
        return self.merge_fixed_s + moved_bytes / self.link_bytes_per_s

    def split_s(self, moved_bytes: int, refill_bytes: int) -> float:
        return (self.split_fixed_s + moved_bytes / self.link_bytes_per_s
                + refill_bytes / self.host_copy_bytes_per_s)


# ---- workload -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """Poisson arrivals of short and long prompts (the AMOEBAs paper's shape): a short request
    reserves ``short_pool_fraction`` of a TP 1 pool (+-10%); a long one more than the owner
    pool of degree ``long_above_degree`` holds (0: the second-largest allowed degree) and at
    most the largest group's (and the model's context), uniformly."""

    duration_s: float
    short_per_min: float = 60.0
    long_per_min: float = 1.0
    short_pool_fraction: float = 0.27
    short_new_tokens: int = 256
    long_new_tokens: int = 256
    long_above_degree: int = 0

    def requests(self, capacity: CapacityModel, seed: int) -> list["SimRequest"]:
        rng = np.random.default_rng(seed)
        degrees = capacity.allowed_degrees
        if len(degrees) < 2:
            raise ValueError(f"{capacity.replicas} replicas allow no merge ({degrees})")
        lo = capacity.owner_capacity_tokens(self.long_above_degree or degrees[-2]) + 1
        hi = min(capacity.owner_capacity_tokens(degrees[-1]),
                 capacity.model.max_position_embeddings)
        tp1 = capacity.owner_capacity_tokens(1)
        out = []
        for kind, per_min in (("s", self.short_per_min), ("l", self.long_per_min)):
            t, k = 0.0, 0
            while per_min > 0:
                t += rng.exponential(60.0 / per_min)
                if t >= self.duration_s:
                    break
                if kind == "s":
                    new = self.short_new_tokens
                    kv = int(tp1 * self.short_pool_fraction * rng.uniform(0.9, 1.1))
                else:
                    new = self.long_new_tokens
                    kv = int(rng.integers(lo, hi + 1))
                out.append(SimRequest(Request(f"{kind}{k}", kv - new, new), t,
                                      capacity.is_long(kv)))
                k += 1
        return sorted(out, key=lambda r: (r.arrival_s, r.request.rid))


# ---- the simulated cluster ------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class SimRequest:
    request: Request
    arrival_s: float
    long: bool
    generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    kv_tokens: int = dataclasses.field(init=False)  # prompt + max_new_tokens, reserved whole

    def __post_init__(self) -> None:
        self.kv_tokens = self.request.kv_tokens

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_tokens + self.generated


@dataclasses.dataclass(eq=False)
class SimMember:
    """One replica's scheduler: its own requests, whichever unit it is in.

    Invariant: ``used_tokens`` / ``queued_tokens`` are the reservations of ``running`` /
    ``queue`` (kept as counters: the simulator reads them on every decision)."""

    replica: int
    queue: list[SimRequest] = dataclasses.field(default_factory=list)
    running: list[SimRequest] = dataclasses.field(default_factory=list)
    used_tokens: int = 0
    queued_tokens: int = 0

    def enqueue(self, r: SimRequest) -> None:
        self.queue.append(r)
        self.queued_tokens += r.kv_tokens

    def admit_head(self) -> SimRequest:
        r = self.queue.pop(0)
        self.queued_tokens -= r.kv_tokens
        self.used_tokens += r.kv_tokens
        self.running.append(r)
        return r

    def release_finished(self) -> None:
        self.running = [r for r in self.running if r.finish_s is None]
        self.used_tokens = sum(r.kv_tokens for r in self.running)


class SimUnit:
    def __init__(self, sim: "ClusterSim", members: list[SimMember], transitioning: bool):
        self.sim, self.members = sim, sorted(members, key=lambda m: m.replica)
        self.degree = len(members)
        self.capacity_tokens = sim.capacity.owner_capacity_tokens(self.degree)
        self.transitioning = transitioning
        self.ready = sim.env.event()
        self.retiring = False
        self.exited = sim.env.event()
        self.wakeup = sim.env.event()
        self._view: Unit | None = None  # rebuilt after any change of its requests or state
        for m in self.members:
            sim.unit_by_replica[m.replica] = self
        sim.env.process(self.run())

    def wake(self) -> None:
        self._view = None
        if not self.wakeup.triggered:
            self.wakeup.succeed()

    def retire(self) -> None:
        self.retiring = True
        self.wake()

    def view(self) -> Unit:
        if self._view is None:
            reqs = tuple(UnitRequest(r.request.rid, m.replica, r.kv_tokens, r.long, admitted)
                         for m in self.members for admitted, rs in ((True, m.running),
                                                                    (False, m.queue))
                         for r in rs)
            self._view = Unit(tuple(m.replica for m in self.members), self.degree,
                              (self.capacity_tokens,) * self.degree,
                              tuple(m.used_tokens for m in self.members),
                              tuple(m.queued_tokens for m in self.members),
                              reqs, self.transitioning)
        return self._view

    def _admit(self) -> list[SimRequest]:
        admitted, tokens = [], 0
        for m in self.members:
            while m.queue and m.used_tokens + m.queue[0].kv_tokens <= self.capacity_tokens and (
                    not admitted or tokens + m.queue[0].request.prompt_tokens
                    <= MAX_PREFILL_TOKENS):
                r = m.admit_head()
                tokens += r.request.prompt_tokens
                admitted.append(r)
        if admitted:
            self._view = None
        return admitted

    def run(self):
        env, costs = self.sim.env, self.sim.costs
        if self.transitioning:
            yield self.ready
        while not self.retiring:
            admitted = self._admit()
            running = [r for m in self.members for r in m.running]
            if admitted:
                seconds, stepped = costs.prefill_s([r.request.prompt_tokens for r in admitted],
                                                   self.degree), admitted
            elif running:
                seconds, stepped = costs.decode_s([r.context_tokens - 1 for r in running],
                                                  self.degree), running
            else:
                self.wakeup = env.event()
                yield self.wakeup
                continue
            yield env.timeout(seconds)
            phase = "prefill" if admitted else "decode"
            self.sim.replica_s[f"{phase}_tp{self.degree}"] += seconds * self.degree
            if not admitted:
                self.sim.decode_tokens[self.degree] += len(stepped)
            finished = False
            for r in stepped:
                r.generated += 1
                if r.first_token_s is None:
                    r.first_token_s = env.now
                if r.generated >= r.request.max_new_tokens:
                    r.finish_s = env.now
                    finished = True
            if finished:
                for m in self.members:
                    m.release_finished()
                    # a retiring unit's members already belong to the unit that replaces it
                    self.sim.unit_by_replica[m.replica]._view = None
                self.sim.changed()
        self.exited.succeed()


class ClusterSim:
    """Replicas, the units they form, the dispatcher's queue and the policy's decisions applied.

    Invariants: every replica belongs to exactly one unit of ``units`` (``unit_by_replica``);
    the fleet the policy sees passes ``Fleet.check_integrity`` at every decision; a request is
    in the dispatcher's queue, in one member's queue or running, finished, or refused.
    """

    def __init__(self, requests: Sequence[SimRequest], capacity: CapacityModel,
                 costs: StepCosts, policy: Policy):
        self.env = simpy.Environment()
        self.capacity, self.costs, self.policy = capacity, costs, policy
        self.requests = list(requests)
        self.members = {i: SimMember(i) for i in range(capacity.replicas)}
        self.unit_by_replica: dict[int, SimUnit] = {}
        self.units = [SimUnit(self, [m], False) for m in self.members.values()]
        self.central: list[SimRequest] = []
        self.dispatched = 0
        self.refused: list[SimRequest] = []
        self.applied: list[dict] = []  # every Merge / Split decision the simulation applied
        self.transitions: list[dict] = []
        self.timeline: list[dict] = []
        # replica-seconds by what the replicas did: prefill/decode at each degree, transitions
        self.replica_s: collections.Counter[str] = collections.Counter()
        # tokens decoded by units of each degree: with ``replica_s`` the productivity of a
        # replica-second at each degree, which decides whether merged time pays
        self.decode_tokens: collections.Counter[int] = collections.Counter()
        self._record_shape()
        self.env.process(self.arrivals())

    def fleet(self) -> Fleet:
        return Fleet(tuple(u.view() for u in sorted(self.units, key=lambda u: u.members[0]
                                                    .replica)), self.dispatched)

    def arrivals(self):
        for r in self.requests:
            yield self.env.timeout(max(0.0, r.arrival_s - self.env.now))
            self.central.append(r)
            self.changed()

    def changed(self) -> None:
        """Something finished, arrived or ended a transition: splits first, then the queue."""
        for split in self.policy.maintenance(self.fleet()):
            self._split(split)
        k, shorts_wait = 0, False
        while k < len(self.central):
            r = self.central[k]
            if shorts_wait and not r.long:
                k += 1
                continue
            fleet = self.fleet()
            fleet.check_integrity(self.capacity.allowed_degrees)
            decision = self.policy.dispatch(r.request, fleet)
            if isinstance(decision, Queue):
                shorts_wait = shorts_wait or not r.long
                k += 1
                continue
            self.central.pop(k)
            if isinstance(decision, Refuse):
                self.refused.append(r)
                continue
            if isinstance(decision, Merge):
                self._merge(decision)
            assert isinstance(decision, (Dispatch, Merge))
            self.members[decision.member].enqueue(r)
            self.unit_by_replica[decision.member].wake()
            self.dispatched += 1
        self._record_shape()

    def _record_shape(self) -> None:
        shape = [[[m.replica for m in u.members], u.view().state.value]
                 for u in sorted(self.units, key=lambda u: u.members[0].replica)]
        if not self.timeline or self.timeline[-1]["units"] != shape:
            self.timeline.append({"time_s": round(self.env.now, 3), "units": shape})

    def _kv_bytes(self, member: SimMember) -> int:
        return sum(r.context_tokens for r in member.running) * self.capacity.kv_bytes_per_token

    def _merge(self, merge: Merge) -> None:
        sources = [self.unit_by_replica[members[0]] for members in merge.sources]
        members = [m for u in sources for m in u.members]
        moved = max(self._kv_bytes(m) for m in members) * (merge.degree - sources[0].degree) \
            // merge.degree
        unit = SimUnit(self, members, transitioning=True)
        self.units = [u for u in self.units if u not in sources] + [unit]
        self.applied.append({"decision": "merge", "at_s": self.env.now,
                             "members": list(merge.members), "degree": merge.degree})
        self.env.process(self._transition("merge", sources, [unit],
                                          self.costs.merge_s(moved)))

    def _split(self, split: Split) -> None:
        """Into ``split.into``: each member takes back the KV heads and FFN rows of its
        smaller group's shard."""
        group = self.unit_by_replica[split.members[0]]
        moved = max(self._kv_bytes(m) for m in group.members) * (
            group.degree - split.degree) // group.degree
        refill = (self.capacity.freed_bytes(group.degree)
                  - self.capacity.freed_bytes(split.degree))
        seconds = self.costs.split_s(moved, refill)
        units = [SimUnit(self, [self.members[m] for m in part], transitioning=True)
                 for part in split.into]
        self.units = [u for u in self.units if u is not group] + units
        self.applied.append({"decision": "split", "at_s": self.env.now,
                             "members": list(split.members), "degree": group.degree,
                             "into_degree": split.degree})
        self.env.process(self._transition("split", [group], units, seconds))

    def _transition(self, kind: str, old: list[SimUnit], new: list[SimUnit], seconds: float):
        start = self.env.now
        for u in old:
            u.retire()
        yield simpy.AllOf(self.env, [u.exited for u in old])
        yield self.env.timeout(seconds)
        self.replica_s[kind] += seconds * sum(u.degree for u in new)
        for u in new:
            u.transitioning = False
            u.wake()
            u.ready.succeed()
        self.transitions.append({"kind": kind, "at_s": start, "seconds": self.env.now - start,
                                 "members": sorted(m.replica for u in new for m in u.members)})
        self.changed()


def simulate(requests: Sequence[SimRequest], capacity: CapacityModel, costs: StepCosts,
             policy: Policy, until_s: float | None) -> ClusterSim:
    """``until_s`` None: run until every request is done or refused."""
    sim = ClusterSim([dataclasses.replace(r, generated=0, first_token_s=None, finish_s=None)
                      for r in requests], capacity, costs, policy)
    sim.env.run(until=until_s)
    return sim


def metrics(sim: ClusterSim, window_s: float) -> dict:
    done = [r for r in sim.requests if r.finish_s is not None and r.finish_s <= window_s]
    ttft = [r.first_token_s - r.arrival_s for r in done]
    e2e = [r.finish_s - r.arrival_s for r in done]
    longs = [r for r in done if r.long]
    waiting = sum(len(m.queue) for m in sim.members.values()) + len(sim.central)

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else None

    return {
        "arrived": sum(r.arrival_s <= window_s for r in sim.requests), "completed": len(done),
        "refused": len(sim.refused),
        "completed_long": len(longs), "arrived_long": sum(r.long for r in sim.requests),
        "completed_tokens_per_s": sum(r.kv_tokens for r in done) / window_s,
        "completed_long_tokens_per_s": sum(r.kv_tokens for r in longs) / window_s,
        "waiting_at_end": waiting,
        "decode_tokens_per_replica_s": {
            d: n / sim.replica_s[f"decode_tp{d}"] for d, n in sorted(sim.decode_tokens.items())
            if sim.replica_s[f"decode_tp{d}"] > 0},
        "output_tokens_per_s": sum(r.generated for r in sim.requests) / window_s,
        "requests_per_s": len(done) / window_s,
        "p50_ttft_s": pct(ttft, 50), "p99_ttft_s": pct(ttft, 99),
        "p50_e2e_s": pct(e2e, 50), "p99_e2e_s": pct(e2e, 99),
        "merges": sum(t["kind"] == "merge" for t in sim.transitions),
        "splits": sum(t["kind"] == "split" for t in sim.transitions),
        "transition_s": sum(t["seconds"] for t in sim.transitions),
        "replica_s": dict(sim.replica_s),
    }
