"""The transformation-aware scheduler: which unit serves a request, which units merge, when a
group splits.

Pure policy (plain frozen dataclasses in, typed decisions out; no SGLang, no torch, no clock):
the live dispatcher, the tests and the SimPy simulator (``benchmark/amoebas/sim.py``) drive the
same objects.

    Fleet (units, members' own pools, their requests) -> policy.dispatch(request)
        -> Dispatch | Merge | Queue | Refuse
    Fleet -> policy.maintenance() -> [Split]

A *unit* is a TP 1 replica or a merged group of ``degree`` members. SGLang cannot move a
request between schedulers, so every request belongs to one member for its whole life and must
fit that member's own pool (``CapacityModel.owner_capacity_tokens(degree)``). A request is
*long* when no TP 1 pool can hold its prompt + ``max_new_tokens``. A merged group with no long
request left is *draining*: it takes no new requests and waits to split.

``AmoebasPolicy``:

- **Dispatch** to the least-loaded member (reserved tokens over its own pool, ties by replica
  id) whose free tokens hold the request now, among serving units; a long request may also go
  to a draining group, which serves again (``prefer_merged``: back-to-back long prompts reuse
  a group instead of splitting it and merging another).
- **Merge**, for a long request nothing holds now: the smallest allowed degree D whose owner
  pool holds it, built from units of one degree d (d divides D, ``D / d`` units; the merge
  factor follows from the allowed degrees: 1 -> 3 for the default model, 1 -> 2, 2 -> 4 or
  1 -> 4 for the tiny one). With ``prefer_merged`` the largest such d is tried first (two TP 2
  groups make a TP 4 before four TP 1 replicas do). The owner is the least-loaded member whose
  pool at D holds the request now; the other units are the least-loaded of degree d (on a
  live server, ``groups``: the units covering the allowed group of D that holds the owner).
  Units of different degrees never merge (a TP 2 group and two TP 1 replicas do not make a
  TP 4).
- **Wait** at a member when no owner has room now: with ``prefer_merged`` in a group already
  merged whose pools hold the request (on the member with the most free tokens, no
  transition), else behind a merge on its least-loaded owner (the order flips without
  ``prefer_merged``). The request is queued at that member, whose free tokens are then
  negative, so nothing else is placed there before it.
- **Queue** when an allowed degree could hold it once running work finishes or transitions
  complete; **Refuse** (what an HTTP 400 says) when even the largest allowed group cannot.
- **Split** a draining group into replicas alone when its free KV is at least
  ``split_free_fraction`` of its pools and every member's own requests fit back into a TP 1
  pool; a group still serving long requests (``split_to_groups``), with that much free, into
  the smallest groups whose pools hold every member's requests (TP 4 -> 2 x TP 2 once its
  long requests each fit a TP 2 pool; on a live server, the aligned groups that tile it).

The baselines (``MergeOnDemand``) merge only when a prompt fits no unit's pool at all, place
requests round-robin or least-loaded without looking at free tokens (the member queues what
does not fit, as SGLang's data-parallel controller does) and split as soon as the long
requests are done. Every decision is deterministic: ties go to the smaller replica id.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Protocol, Union

from sglang_morph.amoebas.capacity import CapacityModel


class UnitState(str, enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # a merged group with no long request: no new requests, splits later
    TRANSITIONING = "transitioning"  # merging or splitting: members stalled


@dataclasses.dataclass(frozen=True)
class Request:
    rid: str
    prompt_tokens: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: prompt and max_new_tokens must be >= 1")

    @property
    def kv_tokens(self) -> int:
        """What admission reserves on the owner's pool: prompt + max_new_tokens."""
        return self.prompt_tokens + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class UnitRequest:
    """A request a member owns: admitted (its tokens are reserved in the member's pool) or
    queued at the member (dispatched, waiting for room or for a transition to end)."""

    rid: str
    member: int
    kv_tokens: int
    long: bool
    admitted: bool = True


@dataclasses.dataclass(frozen=True)
class Unit:
    """A replica (degree 1) or a merged group; per-member tuples follow ``members`` (sorted)."""

    members: tuple[int, ...]
    degree: int
    kv_capacity_tokens: tuple[int, ...]  # each member's own pool
    kv_used_tokens: tuple[int, ...]  # reserved by its admitted requests
    kv_queued_tokens: tuple[int, ...]  # of its requests not admitted yet
    requests: tuple[UnitRequest, ...] = ()
    transitioning: bool = False

    @property
    def state(self) -> UnitState:
        """Derived, not stored, so the dispatcher and the policy cannot disagree: a merged
        group draining is one whose long requests (running or queued) are all done."""
        if self.transitioning:
            return UnitState.TRANSITIONING
        if self.degree > 1 and not any(r.long for r in self.requests):
            return UnitState.DRAINING
        return UnitState.SERVING

    def load_tokens(self, k: int) -> int:
        return self.kv_used_tokens[k] + self.kv_queued_tokens[k]

    def free_tokens(self, k: int) -> int:
        return self.kv_capacity_tokens[k] - self.load_tokens(k)

    def load_fraction(self, k: int) -> float:
        return self.load_tokens(k) / self.kv_capacity_tokens[k]

    @property
    def unit_load_fraction(self) -> float:
        return (sum(self.kv_used_tokens) + sum(self.kv_queued_tokens)) / sum(
            self.kv_capacity_tokens)

    @property
    def free_fraction(self) -> float:
        """Free share of the members' own pools (the mirrors fill and empty with them)."""
        return 1.0 - sum(self.kv_used_tokens) / sum(self.kv_capacity_tokens)


@dataclasses.dataclass(frozen=True)
class Fleet:
    """Every unit at one instant. ``dispatched_requests`` counts the requests placed so far
    (the round-robin cursor of SGLang's data-parallel controller)."""

    units: tuple[Unit, ...]
    dispatched_requests: int = 0

    @property
    def replicas(self) -> int:
        return sum(u.degree for u in self.units)

    def unit_of(self, replica: int) -> Unit:
        return next(u for u in self.units if replica in u.members)

    def check_integrity(self, allowed_degrees: Sequence[int]) -> None:
        """Members disjoint and sorted, degrees allowed and equal to the member count, each
        member's used and queued tokens the sum of its admitted and queued requests, used
        within its pool."""
        seen: set[int] = set()
        for u in self.units:
            if u.members != tuple(sorted(u.members)) or seen & set(u.members):
                raise ValueError(f"unit {u.members}: members unsorted or in another unit")
            seen |= set(u.members)
            if u.degree != len(u.members) or u.degree not in allowed_degrees:
                raise ValueError(f"unit {u.members}: degree {u.degree} not allowed "
                                 f"{tuple(allowed_degrees)} or not its member count")
            if not (len(u.kv_capacity_tokens) == len(u.kv_used_tokens)
                    == len(u.kv_queued_tokens) == u.degree):
                raise ValueError(f"unit {u.members}: one token count per member")
            for k, m in enumerate(u.members):
                mine = [r for r in u.requests if r.member == m]
                used = sum(r.kv_tokens for r in mine if r.admitted)
                queued = sum(r.kv_tokens for r in mine if not r.admitted)
                if (used, queued) != (u.kv_used_tokens[k], u.kv_queued_tokens[k]):
                    raise ValueError(f"member {m}: used/queued {u.kv_used_tokens[k]}/"
                                     f"{u.kv_queued_tokens[k]}, its requests {used}/{queued}")
                if used > u.kv_capacity_tokens[k]:
                    raise ValueError(f"member {m}: {used} tokens used of "
                                     f"{u.kv_capacity_tokens[k]}")
            if any(r.member not in u.members for r in u.requests):
                raise ValueError(f"unit {u.members}: a request owned outside the unit")


# ---- decisions ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dispatch:
    unit: tuple[int, ...]  # the unit's members
    member: int


@dataclasses.dataclass(frozen=True)
class Merge:
    """Merge ``sources`` (units of one degree) into one group of ``degree``, then place the
    request on ``member``."""

    members: tuple[int, ...]
    degree: int
    member: int
    sources: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Queue:
    reason: str


@dataclasses.dataclass(frozen=True)
class Refuse:
    reason: str  # what an HTTP 400 says


@dataclasses.dataclass(frozen=True)
class Split:
    """Split the group into the groups ``into`` (each of ``degree`` members; degree 1: replicas
    alone); each member keeps its own requests."""

    members: tuple[int, ...]
    reason: str
    degree: int = 1
    into: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.into:
            object.__setattr__(self, "into", tuple((m,) for m in self.members))
        if (sorted(m for g in self.into for m in g) != sorted(self.members)
                or any(len(g) != self.degree for g in self.into)):
            raise ValueError(f"split of {self.members}: {self.into} are not groups of "
                             f"{self.degree} that tile it")


Decision = Union[Dispatch, Merge, Queue, Refuse]


class Policy(Protocol):
    name: str

    def dispatch(self, request: Request, fleet: Fleet) -> Decision: ...

    def maintenance(self, fleet: Fleet) -> list[Split]: ...


# ---- shared rules ---------------------------------------------------------------------------


def refusal(capacity: CapacityModel, request: Request) -> Refuse | None:
    if capacity.degree_for(request.kv_tokens) is not None:
        return None
    d = capacity.max_degree
    return Refuse(f"request {request.rid}: prompt {request.prompt_tokens} + max_new_tokens "
                  f"{request.max_new_tokens} tokens exceed the largest group's pool "
                  f"({capacity.owner_capacity_tokens(d)} tokens per owner at degree {d}, "
                  f"allowed degrees {capacity.allowed_degrees})")


def _fits(capacity: CapacityModel, unit: Unit, degree: int) -> bool:
    """Every member's own requests (admitted and queued) fit its pool at ``degree``."""
    pool = capacity.owner_capacity_tokens(degree)
    return all(unit.load_tokens(k) <= pool for k in range(unit.degree))


def _split_to_replicas(capacity: CapacityModel, unit: Unit, free_fraction: float
                       ) -> Split | None:
    if (unit.state is UnitState.DRAINING and unit.free_fraction >= free_fraction
            and _fits(capacity, unit, 1)):
        return Split(unit.members, f"no long request left, {unit.free_fraction:.0%} of its KV "
                                   f"free, every member's requests fit a TP 1 pool")
    return None


def _sub_groups(unit: Unit, degree: int, groups: tuple[tuple[int, ...], ...]
                ) -> tuple[tuple[int, ...], ...] | None:
    """The groups of ``degree`` a unit splits into: the allowed groups that tile it (a live
    server's aligned blocks), or, with no ``groups`` given, its members in order."""
    if not groups:
        m = unit.members
        return tuple(m[i:i + degree] for i in range(0, len(m), degree))
    inside = tuple(tuple(sorted(g)) for g in groups
                   if len(g) == degree and set(g) <= set(unit.members))
    return inside if sum(map(len, inside)) == unit.degree else None


def _queue_or_refuse(capacity: CapacityModel, request: Request, why: str) -> Queue | Refuse:
    return refusal(capacity, request) or Queue(f"request {request.rid} "
                                               f"({request.kv_tokens} tokens): {why}")


# ---- AMOEBAs --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AmoebasPolicy:
    """Transformation-aware dispatch, merge and split (see the module docstring).

    Invariant: a short request is placed only where its owner's pool has room now, so it
    never waits at a member (it waits in the dispatcher's queue instead). A long request waits
    at a member only when no pool has room for it now: then its owner's free tokens are
    negative, so nothing else is placed there until it is admitted.
    """

    capacity: CapacityModel
    split_free_fraction: float = 0.5
    prefer_merged: bool = True
    name: str = "amoebas"
    # The groups a merge may form (a live server's aligned blocks, ``AmoebasConfig.blocks``);
    # empty: any units of one degree (the simulator's clusters)
    groups: tuple[tuple[int, ...], ...] = ()
    # The degrees units may merge from (empty: any)
    merge_from_degrees: tuple[int, ...] = ()
    # A group still serving long requests splits into smaller groups once they hold them
    split_to_groups: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.split_free_fraction <= 1.0:
            raise ValueError(f"split_free_fraction must be in [0, 1], got "
                             f"{self.split_free_fraction}")

    def dispatch(self, request: Request, fleet: Fleet) -> Decision:
        refused = refusal(self.capacity, request)
        if refused:
            return refused
        long = self.capacity.is_long(request.kv_tokens)
        takes = {UnitState.SERVING} | ({UnitState.DRAINING} if long and self.prefer_merged
                                       else set())
        fits = [(u.load_fraction(k), m, u) for u in fleet.units if u.state in takes
                for k, m in enumerate(u.members) if u.free_tokens(k) >= request.kv_tokens]
        if fits:
            _, member, unit = min(fits, key=lambda f: (f[0], f[1]))
            return Dispatch(unit.members, member)
        if not long:
            return _queue_or_refuse(self.capacity, request, "no owner pool has room now")
        # A long request nothing holds now: a merge whose owner has room; else wait without a
        # transition in a group already merged (prefer_merged) or behind a merge, on the
        # member nearest to room.
        waits = [self._wait_in_group(request, fleet, takes),
                 self._merge(request, fleet, room_now=False)]
        for decision in (self._merge(request, fleet, room_now=True),
                         *(waits if self.prefer_merged else waits[::-1])):
            if decision:
                return decision
        return _queue_or_refuse(self.capacity, request, "no group can hold it and no units "
                                "can merge now")

    def _wait_in_group(self, request: Request, fleet: Fleet, takes: set[UnitState]
                       ) -> Dispatch | None:
        holds = [(-u.free_tokens(k), m, u) for u in fleet.units if u.state in takes
                 for k, m in enumerate(u.members) if u.kv_capacity_tokens[k] >= request.kv_tokens]
        if not holds:
            return None
        _, member, unit = min(holds, key=lambda h: (h[0], h[1]))
        return Dispatch(unit.members, member)

    def _merge(self, request: Request, fleet: Fleet, room_now: bool) -> Merge | None:
        """Units of one degree into the smallest degree that holds the request; the owner is
        the least-loaded member (with room at that degree now, when ``room_now``)."""
        target = self.capacity.degree_for(request.kv_tokens)
        pool = self.capacity.owner_capacity_tokens(target)
        sources = [d for d in self.capacity.allowed_degrees if d < target and target % d == 0
                   and (not self.merge_from_degrees or d in self.merge_from_degrees)]
        for d in sorted(sources, reverse=self.prefer_merged):
            units = [u for u in fleet.units if u.degree == d and u.state is not
                     UnitState.TRANSITIONING]
            owners = [(u.load_tokens(k), m, u) for u in units for k, m in enumerate(u.members)
                      if not room_now or pool - u.load_tokens(k) >= request.kv_tokens]
            if len(units) < target // d or not owners:
                continue
            for _, owner, home in sorted(owners, key=lambda o: (o[0], o[1])):
                chosen = self._sources(units, home, target // d, target)
                if chosen:
                    return Merge(tuple(sorted(m for u in chosen for m in u.members)), target,
                                 owner, tuple(sorted(u.members for u in chosen)))
        return None

    def _sources(self, units: list[Unit], home: Unit, count: int, target: int
                 ) -> list[Unit] | None:
        """``home`` and the least-loaded other units that merge with it: with ``groups``,
        exactly the units covering the allowed group of ``target`` that holds ``home``."""
        if not self.groups:
            others = sorted((u for u in units if u is not home),
                            key=lambda u: (u.unit_load_fraction, u.members[0]))
            return [home, *others[:count - 1]]
        group = next((set(g) for g in self.groups
                      if len(g) == target and set(home.members) <= set(g)), None)
        if group is None:
            return None
        covering = [u for u in units if set(u.members) <= group]
        if sum(u.degree for u in covering) != target:
            return None  # a unit of another degree (or transitioning) sits in the group
        return covering

    def maintenance(self, fleet: Fleet) -> list[Split]:
        splits = (self._split(u) for u in fleet.units if u.degree > 1 and not u.transitioning)
        return [s for s in splits if s is not None]

    def _split(self, unit: Unit) -> Split | None:
        """Into replicas alone once no long request is left; else, with ``split_to_groups``,
        into the smallest groups whose pools still hold every member's requests (a TP 4 group
        whose long requests each fit a TP 2 pool becomes two TP 2 groups)."""
        alone = _split_to_replicas(self.capacity, unit, self.split_free_fraction)
        if alone or not self.split_to_groups or unit.free_fraction < self.split_free_fraction:
            return alone
        for d in self.capacity.allowed_degrees:
            if 1 < d < unit.degree and unit.degree % d == 0 and _fits(self.capacity, unit, d):
                into = _sub_groups(unit, d, self.groups)
                if into:
                    return Split(unit.members, f"{unit.free_fraction:.0%} of its KV free, "
                                 f"every member's requests fit a TP {d} pool", d, into)
        return None


# ---- baselines ------------------------------------------------------------------------------


PLACEMENTS = ("round_robin", "least_loaded")


@dataclasses.dataclass(frozen=True)
class MergeOnDemand:
    """Baseline: round-robin or least-loaded placement, merge only when a prompt fits no unit's
    pool, split as soon as the long requests are done.

    Placement ignores free tokens: a request goes to a serving member whose pool can hold it
    at all, and waits in that member's queue (first come, first served) for room. A merge takes
    TP 1 replicas only (round-robin: the next ones from the cursor; least-loaded: the least
    loaded), into the smallest allowed degree that holds the prompt. With ``reuse_groups``
    off, "fits no replica" means no TP 1 replica: every long prompt merges its own group and
    never joins another's.
    """

    capacity: CapacityModel
    placement: str = "round_robin"
    reuse_groups: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not self.name:
            suffix = "" if self.reuse_groups else "_per_long"
            object.__setattr__(self, "name", f"{self.placement}_merge_on_demand{suffix}")

    def _order(self, fleet: Fleet, entries: list[tuple[float, int, Unit]]
               ) -> list[tuple[float, int, Unit]]:
        """Members in placement order: from the round-robin cursor, or by load."""
        if self.placement == "least_loaded":
            return sorted(entries, key=lambda e: (e[0], e[1]))
        cursor = fleet.dispatched_requests % fleet.replicas
        return sorted(entries, key=lambda e: ((e[1] - cursor) % fleet.replicas, e[1]))

    def dispatch(self, request: Request, fleet: Fleet) -> Decision:
        refused = refusal(self.capacity, request)
        if refused:
            return refused
        long = self.capacity.is_long(request.kv_tokens)
        joins = self.reuse_groups or not long
        holds = [(u.load_fraction(k), m, u) for u in fleet.units
                 if u.state is UnitState.SERVING and joins for k, m in enumerate(u.members)
                 if u.kv_capacity_tokens[k] >= request.kv_tokens]
        if holds:
            _, member, unit = self._order(fleet, holds)[0]
            return Dispatch(unit.members, member)
        if long and not (joins and any(u.state is not UnitState.DRAINING and max(
                u.kv_capacity_tokens) >= request.kv_tokens for u in fleet.units)):
            target = self.capacity.degree_for(request.kv_tokens)
            singles = [(u.load_fraction(0), u.members[0], u) for u in fleet.units
                       if u.degree == 1 and u.state is UnitState.SERVING]
            if len(singles) >= target:
                chosen = self._order(fleet, singles)[:target]
                return Merge(tuple(sorted(m for _, m, _ in chosen)), target, chosen[0][1],
                             tuple(sorted(u.members for _, _, u in chosen)))
        return _queue_or_refuse(self.capacity, request, "no serving unit's pool can hold it "
                                "and not enough TP 1 replicas to merge")

    def maintenance(self, fleet: Fleet) -> list[Split]:
        splits = (_split_to_replicas(self.capacity, u, 0.0) for u in fleet.units)
        return [s for s in splits if s is not None]
