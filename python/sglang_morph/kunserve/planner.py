"""KunServe's drop plan: which replicas merge into pipeline groups, which layers each keeps.

Every data-parallel replica holds the whole model. Under a KV overload, ``m`` replicas merge
into one group that serves as an ``m``-stage pipeline: member ``j`` keeps a contiguous range of
the decoder layers (``[0, k)`` on the first, ``[k, L)`` on the last for ``m = 2``), drops the
others (a host copy stays, so the restore is local) and turns the freed bytes into KV for the
layers it keeps. Each member's pool then holds the KV of its layers for every request of the
group, so the group holds as many tokens as its tightest member (``group_capacity_tokens``).

The plan is KunServe's greedy: start with every replica its own group; while some group's
predicted KV demand (its members' requests: a request never leaves its replica) exceeds what it
holds, merge that group with one of the smallest others (the one the merge fits best, else
the one with most room; ties by the lowest replica, which keeps plans deterministic). Merging the smallest keeps groups as shallow
as possible: every merge frees about one model's weights whatever groups it joins, and a
shallower pipeline has fewer bubbles and transfers. When even the deepest allowed grouping
cannot hold the demand, there is no drop plan and the caller falls back to KV-centric handling
(queue, retract, swap KV out), which ``KvCentricFallback`` says with the shortfall.

Bytes are exact and in the morph runtime's accounting (``control.budget.MemoryBudget``: weights
+ KV within a per-replica budget): a member's weights are ``splitquant.memory.MemoryModel.
stage_memory`` of the layers it keeps (the embedding only on the first stage, LM head and final
norm on the last, a tied head copied when they differ, the rotary table on every stage), its
KV per token is its kept layers times ``ModelSpec.kv_bytes_per_token_per_layer``, and its KV
capacity is whole pages of what the budget leaves (``MemoryModel.kv_capacity_tokens``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from sglang_morph.elastic.budget import MemoryBudget
from sglang_morph.models.memory import MemoryModel, full_precision_layers
from sglang_morph.models.workload import Workload

_NO_WORKLOAD = Workload(1, 1, 1)  # stage_memory's KV and activation terms are not used here


@dataclasses.dataclass(frozen=True)
class DropPlannerConfig:
    """What the planner plans for. ``budget_bytes`` is one replica's weights + KV budget
    (``--morph-memory-budget`` per replica under DP); ``max_group_size`` caps the pipeline
    depth (default: as many members as layers, one layer each at most).
    ``members_keep_embedding``: every member keeps the embedding, not only the first stage,
    as a live group does where each replica embeds and samples its own requests (a tied LM
    head is that tensor); a pair keeps the same bytes either way, a middle stage holds the
    embedding more."""

    memory: MemoryModel
    budget_bytes: int
    page_size_tokens: int = 1
    max_group_size: int | None = None
    members_keep_embedding: bool = False

    def __post_init__(self) -> None:
        if self.page_size_tokens < 1:
            raise ValueError(f"page_size_tokens must be >= 1, got {self.page_size_tokens}")
        if self.max_group_size is not None and not 1 <= self.max_group_size <= self.num_layers:
            raise ValueError(f"max_group_size must be in 1..{self.num_layers}, got "
                             f"{self.max_group_size}")
        if self.full_replica().kv_capacity_tokens < self.page_size_tokens:
            raise ValueError(f"a budget of {self.budget_bytes} bytes leaves no KV page next to "
                             f"the whole model's {self.full_weight_bytes} bytes of weights")

    @property
    def num_layers(self) -> int:
        return self.memory.model.num_layers

    @property
    def group_size_limit(self) -> int:
        return self.max_group_size or self.num_layers

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.memory.model.kv_bytes_per_token_per_layer()

    @property
    def full_weight_bytes(self) -> int:
        return self.memory.model_weight_bytes(full_precision_layers(self.num_layers))

    def stage_weight_bytes(self, layers: range) -> int:
        first = layers.start == 0 or self.members_keep_embedding
        last = layers.stop == self.num_layers
        bits = full_precision_layers(len(layers))
        return self.memory.stage_memory(layers, bits, _NO_WORKLOAD, first, last).weight_bytes

    def member(self, replica: int, layers: range) -> "MemberLayout":
        """The layout of a replica that keeps ``layers`` (exact bytes, whole KV pages)."""
        weights = self.stage_weight_bytes(layers)
        kv_per_token = len(layers) * self.kv_bytes_per_token_per_layer
        tokens = self.memory.kv_capacity_tokens(self.budget_bytes, weights, len(layers),
                                                self.page_size_tokens)
        return MemberLayout(replica, layers, self.full_weight_bytes - weights,
                            MemoryBudget(self.budget_bytes, weights, tokens * kv_per_token),
                            kv_per_token, tokens)

    def full_replica(self, replica: int = 0) -> "MemberLayout":
        return self.member(replica, range(self.num_layers))


@dataclasses.dataclass(frozen=True)
class MemberLayout:
    """One replica inside a group: the layers it keeps and what its budget holds then.

    Invariants (``check_integrity``): ``budget`` holds the kept weights and
    ``kv_capacity_tokens`` x ``kv_bytes_per_token`` of KV within ``budget.total_bytes``;
    ``freed_bytes`` = the whole model's weights - the kept ones; the capacity is whole pages.
    """

    replica: int
    layers: range
    freed_bytes: int
    budget: MemoryBudget
    kv_bytes_per_token: int
    kv_capacity_tokens: int

    def check_integrity(self, page_size_tokens: int = 1) -> None:
        self.budget.check_integrity()
        if self.budget.kv_bytes != self.kv_capacity_tokens * self.kv_bytes_per_token:
            raise AssertionError(f"replica {self.replica}: KV bytes {self.budget.kv_bytes} != "
                                 f"{self.kv_capacity_tokens} tokens x {self.kv_bytes_per_token}")
        if self.kv_capacity_tokens % page_size_tokens:
            raise AssertionError(f"replica {self.replica}: capacity not whole pages")
        if not self.layers or self.freed_bytes < 0:
            raise AssertionError(f"replica {self.replica}: keeps {self.layers}, frees "
                                 f"{self.freed_bytes} bytes")


def split_layers(num_layers: int, members: int) -> tuple[range, ...]:
    """Contiguous, near-even layer ranges in pipeline order; the earlier stages take the
    remainder (the last stage also runs the LM head)."""
    if not 1 <= members <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {members} members")
    base, extra = divmod(num_layers, members)
    out, start = [], 0
    for j in range(members):
        stop = start + base + (1 if j < extra else 0)
        out.append(range(start, stop))
        start = stop
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """Replicas serving as one pipeline, in stage order (one member: an ordinary replica).

    Invariants (``check_integrity``): the members' layer ranges tile ``[0, L)`` in order; each
    member's layout is exact (``MemberLayout.check_integrity``).
    """

    members: tuple[MemberLayout, ...]

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(m.replica for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the group holds: every member keeps its layers' KV of every token."""
        return min(m.kv_capacity_tokens for m in self.members)

    @property
    def freed_bytes(self) -> int:
        return sum(m.freed_bytes for m in self.members)

    def check_integrity(self, num_layers: int, page_size_tokens: int = 1) -> None:
        start = 0
        for m in self.members:
            m.check_integrity(page_size_tokens)
            if m.layers.start != start:
                raise AssertionError(f"group {self.replicas}: layers do not tile, "
                                     f"{m.layers} after {start}")
            start = m.layers.stop
        if start != num_layers:
            raise AssertionError(f"group {self.replicas}: layers end at {start}, not {num_layers}")


def make_group(cfg: DropPlannerConfig, replicas: Sequence[int]) -> ReplicaGroup:
    ranges = split_layers(cfg.num_layers, len(replicas))
    return ReplicaGroup(tuple(cfg.member(r, layers) for r, layers in zip(replicas, ranges)))


@dataclasses.dataclass(frozen=True)
class ReplicaDemand:
    """One replica's part of the global view the planner plans from."""

    replica: int
    kv_used_tokens: int  # live KV now (running requests)
    kv_demand_tokens: int  # predicted: live + growth of running requests + queued prompts

    def __post_init__(self) -> None:
        if self.kv_used_tokens < 0 or self.kv_demand_tokens < self.kv_used_tokens:
            raise ValueError(f"replica {self.replica}: need 0 <= used <= demand tokens, got "
                             f"{self.kv_used_tokens}, {self.kv_demand_tokens}")


@dataclasses.dataclass(frozen=True)
class DropPlan:
    """Typed action: merge replicas into ``groups`` (every replica in exactly one group).

    ``merges`` is the greedy's order (each entry: the two groups' replicas it joined);
    ``kv_migration_bytes[replica]`` is the live KV the replica sends away for the layers it
    drops (each request's KV of a layer lives with the member that keeps that layer).
    Invariants (``check_integrity``): groups partition the replicas; each group is exact and
    holds the live KV of its members (no request can be lost by the drop).
    """

    groups: tuple[ReplicaGroup, ...]
    merges: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    demand_tokens: int
    capacity_tokens_before: int
    kv_migration_bytes: dict[int, int]

    @property
    def capacity_tokens(self) -> int:
        return sum(g.capacity_tokens for g in self.groups)

    @property
    def freed_bytes(self) -> int:
        return sum(g.freed_bytes for g in self.groups)

    def group_of(self, replica: int) -> ReplicaGroup:
        return next(g for g in self.groups if replica in g.replicas)

    def check_integrity(self, cfg: DropPlannerConfig, view: Sequence[ReplicaDemand]) -> None:
        replicas = sorted(r for g in self.groups for r in g.replicas)
        if replicas != sorted(d.replica for d in view):
            raise AssertionError(f"groups {[g.replicas for g in self.groups]} do not partition "
                                 f"the replicas {sorted(d.replica for d in view)}")
        used = {d.replica: d.kv_used_tokens for d in view}
        for g in self.groups:
            g.check_integrity(cfg.num_layers, cfg.page_size_tokens)
            live = sum(used[r] for r in g.replicas)
            if live > g.capacity_tokens:
                raise AssertionError(f"group {g.replicas} holds {g.capacity_tokens} tokens, "
                                     f"its members have {live} live")


@dataclasses.dataclass(frozen=True)
class KvCentricFallback:
    """No drop plan holds the demand: handle the overload by KV (queue, retract, swap out)."""

    reason: str
    demand_tokens: int
    best_capacity_tokens: int  # what the deepest grouping found holds in total
    # That grouping, when it merges anything: the caller may apply it and handle only the
    # rest of the overload by KV (``ControllerConfig.partial_drop``).
    deepest: DropPlan | None = None
    # Demand its over-demand groups cannot hold (> 0; the total may still fit: see plan_drop).
    shortfall_tokens: int = 0


def _next_merge(groups: list[tuple[int, ...]], need: dict[tuple[int, ...], int],
                held: Callable[[int], int], limit: int) -> tuple[int, int] | None:
    """Indices (a, b) of the next merge, or None when no over-demand group can merge.

    ``need[g]``: group ``g``'s predicted demand; ``held(size)``: the KV tokens a group of
    ``size`` members holds. ``a``: the smallest over-demand group (ties: the largest shortfall,
    then the lowest replica); ``b``: one of the smallest groups ``a`` may merge with (within
    ``limit`` members): of those whose union with ``a`` holds both demands, the one leaving the
    least room (best fit: two overloaded replicas merge together before an idle one is spent),
    else the one with most room."""
    def room(*gs: tuple[int, ...]) -> int:  # what the union of ``gs`` holds beyond its demand
        return held(sum(map(len, gs))) - sum(need[g] for g in gs)

    over = [i for i, g in enumerate(groups) if room(g) < 0]
    for a in sorted(over, key=lambda i: (len(groups[i]), room(groups[i]), min(groups[i]))):
        partners = [b for b in range(len(groups))
                    if b != a and len(groups[a]) + len(groups[b]) <= limit]
        if not partners:
            continue
        smallest = min(len(groups[b]) for b in partners)
        partners = [b for b in partners if len(groups[b]) == smallest]
        holding = [b for b in partners if room(groups[a], groups[b]) >= 0]
        if holding:
            return a, min(holding, key=lambda b: (room(groups[a], groups[b]), min(groups[b])))
        return a, max(partners, key=lambda b: (room(groups[a], groups[b]), -min(groups[b])))
    return None


def plan_drop(cfg: DropPlannerConfig, view: Sequence[ReplicaDemand]
              ) -> DropPlan | KvCentricFallback:
    """The greedy plan for ``view`` (every replica independent and whole now).

    Returns a ``DropPlan`` whose every group holds its members' predicted demand (a plan
    without merges when each replica already holds its own), or ``KvCentricFallback`` when the
    greedy finds no allowed grouping that does.

    Per group, not in total: a request stays with the replica (the scheduler) it was sent to,
    so a replica whose queue outgrows its pool is not helped by another replica's free KV,
    only by merging (under SGLang's round-robin DP dispatch one replica may queue while the
    pair holds the total; a replay at 19605d6 queued 2.4 s before an aggregate trigger fired).
    KunServe's greedy merges the two smallest groups; here an over-demand group is always one
    of the two (otherwise the merge would not help it): see ``_next_merge``. Like the paper's,
    the greedy is not exhaustive: it may merge deeper than a best partition would, or fall
    back where one exists (``KvCentricFallback.deepest`` still carries its deepest grouping).
    """
    if not view:
        raise ValueError("no replicas to plan for")
    if len({d.replica for d in view}) != len(view):
        raise ValueError("a replica appears twice in the view")
    wanted = {d.replica: d.kv_demand_tokens for d in view}
    demand = sum(wanted.values())
    groups = [(d.replica,) for d in sorted(view, key=lambda d: d.replica)]
    merges: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    # A group's layout depends on its size only (members' ranges are split_layers').
    held = functools.cache(lambda size: make_group(cfg, range(size)).capacity_tokens)

    def capacity(gs):
        return sum(held(len(g)) for g in gs)

    before = capacity(groups)
    while True:
        need = {g: sum(wanted[r] for r in g) for g in groups}
        short = sum(max(0, need[g] - held(len(g))) for g in groups)
        if not short:
            return _build(cfg, view, groups, merges, demand, before)
        pair = _next_merge(groups, need, held, cfg.group_size_limit)
        if pair is None:
            over = sum(need[g] > held(len(g)) for g in groups)
            return KvCentricFallback(
                f"the deepest grouping found ({len(groups)} groups of at most "
                f"{cfg.group_size_limit}) leaves {over} over demand by {short} KV tokens "
                f"(demand {demand}, capacity {capacity(groups)})",
                demand, capacity(groups),
                _build(cfg, view, groups, merges, demand, before) if merges else None,
                short)
        a, b = pair
        merged = tuple(sorted(groups[a] + groups[b]))
        merges.append((groups[a], groups[b]))
        groups = [g for i, g in enumerate(groups) if i not in (a, b)] + [merged]


def _build(cfg: DropPlannerConfig, view: Sequence[ReplicaDemand], groups, merges,
           demand: int, before: int) -> DropPlan:
    built = tuple(make_group(cfg, g) for g in sorted(groups))
    used = {d.replica: d.kv_used_tokens for d in view}
    migration = {}
    for g in built:
        for m in g.members:
            dropped_layers = cfg.num_layers - len(m.layers)
            migration[m.replica] = used[m.replica] * dropped_layers * cfg.kv_bytes_per_token_per_layer
    plan = DropPlan(built, tuple(merges), demand, before, migration)
    plan.check_integrity(cfg, view)
    return plan


@dataclasses.dataclass(frozen=True)
class LiveRequest:
    """A request holding KV in a group: ``kv_tokens`` on every member (for its layers).
    ``owner``: the member whose scheduler holds the request and must keep it (None: any)."""

    rid: str
    kv_tokens: int
    owner: int | None = None


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Typed action: every member of ``group`` gets its whole model back and serves alone.

    ``home[rid]`` is the member each live request stays on; that member receives the request's
    KV of the layers it did not keep (``kv_inbound_bytes``) and its pool shrinks to the whole
    model's ``kv_capacity_tokens``. Invariant (``check_integrity``): each member's homed
    requests fit its restored pool, and every live request has a home (none is lost).
    """

    group: ReplicaGroup
    restored: tuple[MemberLayout, ...]
    home: dict[str, int]
    kv_inbound_bytes: dict[int, int]

    def check_integrity(self, live: Sequence[LiveRequest]) -> None:
        if set(self.home) != {r.rid for r in live}:
            raise AssertionError("a live request has no home after the restore")
        load = {m.replica: 0 for m in self.restored}
        for r in live:
            load[self.home[r.rid]] += r.kv_tokens
        for m in self.restored:
            m.check_integrity()
            if load[m.replica] > m.kv_capacity_tokens:
                raise AssertionError(f"replica {m.replica}: {load[m.replica]} live tokens over "
                                     f"its restored {m.kv_capacity_tokens}")


@dataclasses.dataclass(frozen=True)
class RestoreRefused:
    reason: str


def plan_restore(cfg: DropPlannerConfig, group: ReplicaGroup,
                 live: Sequence[LiveRequest]) -> RestorePlan | RestoreRefused:
    """Home every live request on one member so each restored (smaller) pool holds its own.

    A request with an ``owner`` stays there; the others go largest first, each to the member
    with the most room left (a request's KV cannot be split across replicas once they are
    independent). Refuses, changing nothing, when the requests do not pack into the restored
    pools.
    """
    if len({r.rid for r in live}) != len(live):
        raise ValueError("duplicate request ids in the live set")
    restored = tuple(cfg.full_replica(m.replica) for m in group.members)
    room = {m.replica: m.kv_capacity_tokens for m in restored}
    if any(r.owner is not None and r.owner not in room for r in live):
        raise ValueError(f"a live request's owner is not a member of {group.replicas}")
    home: dict[str, int] = {}
    # Owned requests first (they have no choice), then the largest of the rest.
    for r in sorted(live, key=lambda r: (r.owner is None, -r.kv_tokens, r.rid)):
        replica = r.owner if r.owner is not None else max(room, key=lambda k: (room[k], -k))
        if room[replica] < r.kv_tokens:
            total = sum(x.kv_tokens for x in live)
            return RestoreRefused(
                f"group {group.replicas}: {len(live)} live requests ({total} KV tokens) do not "
                f"fit the restored pools of {restored[0].kv_capacity_tokens} tokens each")
        room[replica] -= r.kv_tokens
        home[r.rid] = replica
    by_layers = {m.replica: m.layers for m in group.members}
    inbound = {m.replica: 0 for m in restored}
    for r in live:
        missing = cfg.num_layers - len(by_layers[home[r.rid]])
        inbound[home[r.rid]] += r.kv_tokens * missing * cfg.kv_bytes_per_token_per_layer
    plan = RestorePlan(group, restored, home, inbound)
    plan.check_integrity(live)
    return plan
