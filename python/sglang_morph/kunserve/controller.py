"""When to drop and when to restore, from a global view of the data-parallel replicas.

Pure policy (plain dataclasses in, typed actions out; no SGLang, no clock of its own), so the
live monitor, the tests and the cluster simulator drive the same object:

    ClusterView (every replica's KV and queue) -> KunServeController.decide -> Drop | Restore | None

- **Drop** when the predicted KV demand of some replica (less what its requests about to
  finish hold, ``finishing_steps``) exceeds its own pool for ``drop_persist`` consecutive
  views (a replica's queue cannot use another's free KV): a single spike that the pool
  absorbs is not worth a transition. Where the overload is a queue
  the replica's pool cannot take in now (live KV + queued tokens over the pool), not only the
  forecast growth of running requests, the first such view suffices. The plan is
  ``planner.plan_drop`` on the replicas not in a group yet; when no plan holds the demand the
  controller says so once (``KvCentric``) and the serving engine keeps queueing/retracting as
  it does without KunServe.
- **Restore** a group when, for ``restore_persist`` consecutive views, its KV usage is under
  ``restore_usage`` (the paper's 50%) and its predicted demand fits the restored (smaller)
  pools with room to spare (``restore_headroom``; where requests are owned by a member, each
  member's own demand must fit its own pool), and ``planner.plan_restore`` homes every
  live request on one member, so the shrunk pools hold all live KV and no request is lost.
  The headroom and the persistence are the hysteresis: right after a restore the demand must
  grow again by the headroom before a drop, and the other way round.
- ``min_dwell_s`` between transitions of the same replicas: a drop moves KV and a restore
  moves weights back; flapping would pay both for nothing.
- **Only a drop that pays** (``pays_prefill_tokens_per_step``, off by default): a drop for a
  queue serves it now, and a merged pair runs each of its prefills through every member's
  stage, so each stops every running request of the pair. With the option set, a drop for
  queues happens only when the queued requests' predicted waits on whole replicas (decode
  steps until the ends of the requests before them make room, ``queue_waits``), summed,
  exceed that stall: the pair's running requests times the queued prompts' tokens over the
  tokens a replica prefills in the time of a decode step, plus the merge's own cost to each
  (``pays_merge_steps``). The requests expected to arrive while the queue drains (at the
  replica's recent arrival rate) count on both sides. The rate may be ``"measured"``: each
  replica's own, from its latest whole forwards (``StepCostMeter``), so the rule carries over
  to a device where prefill and decode cost other than on the CPU it was tuned on.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import statistics
from collections.abc import Mapping, Sequence

from sglang_morph.kunserve.planner import (
    DropPlan,
    DropPlannerConfig,
    KvCentricFallback,
    LiveRequest,
    ReplicaDemand,
    ReplicaGroup,
    RestorePlan,
    RestoreRefused,
    plan_drop,
    plan_restore,
)


@dataclasses.dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica (or, inside a group, one member) as the monitor sees it now.

    ``kv_used_tokens``: live KV of its running requests; ``kv_growth_tokens``: what those
    requests are still expected to add (remaining output tokens); ``waiting_tokens``: prompt +
    expected output of its queued requests. ``live`` lists the running requests (a group's
    members list the same requests: each holds every request's KV for its layers; the
    group's view takes them once). ``queue_refused``: the serving engine's admission finds
    no KV room for the queue (SGLang's prefill budget: at its last attempt, or by its rule at
    the next), whatever the token counts say.
    ``kv_finishing_tokens``: the KV held and still to grow of the running requests that finish
    within ``ControllerConfig.finishing_steps`` decode steps (part of the counts above): room
    that comes back sooner than a drop would make it.
    ``running_requests``, ``queued_prompt_tokens``: how many requests run, and the prompt
    tokens of the queue; ``queue_wait_steps``: the queued requests' waits for admission on
    this replica unmerged, in decode steps, summed (``queue_waits``; ``inf`` when one
    never fits); ``queue_drain_steps``: the last one's (when the queue would be in).
    ``arrivals_per_step``, ``arrival_prompt_tokens_per_step``: the requests, and their prompt
    tokens, that reached this replica per forward step over the last ``ARRIVAL_WINDOW_S``.
    ``prefill_tokens_per_step``: the prompt tokens this replica prefills in the time of one
    of its decode steps, measured on its latest whole forwards (``StepCostMeter``); None
    before it has run both kinds.
    """

    replica: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    kv_growth_tokens: int = 0
    waiting_tokens: int = 0
    live: tuple[LiveRequest, ...] = ()
    queue_refused: bool = False
    kv_finishing_tokens: int = 0
    running_requests: int = 0
    queued_prompt_tokens: int = 0
    queue_wait_steps: float = 0.0
    queue_drain_steps: float = 0.0
    arrivals_per_step: float = 0.0
    arrival_prompt_tokens_per_step: float = 0.0
    prefill_tokens_per_step: float | None = None

    def __post_init__(self) -> None:
        if min(self.kv_capacity_tokens, self.kv_used_tokens, self.kv_growth_tokens,
               self.waiting_tokens, self.kv_finishing_tokens, self.running_requests,
               self.queued_prompt_tokens, self.queue_wait_steps, self.queue_drain_steps,
               self.arrivals_per_step, self.arrival_prompt_tokens_per_step) < 0:
            raise ValueError(f"replica {self.replica}: negative token count in {self}")
        rate = self.prefill_tokens_per_step
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"replica {self.replica}: prefill_tokens_per_step must be "
                             f"positive, got {rate!r}")
        if self.kv_finishing_tokens > self.kv_used_tokens + self.kv_growth_tokens:
            raise ValueError(f"replica {self.replica}: finishing requests hold more than the "
                             f"running ones in {self}")

    @property
    def demand_tokens(self) -> int:
        return self.kv_used_tokens + self.kv_growth_tokens + self.waiting_tokens

    @property
    def queue_blocked(self) -> bool:
        """A queue this replica cannot take in now: it does not fit next to the live KV, or
        the engine already refused it for lack of KV room (SGLang reserves room for the
        running requests' next tokens, so it refuses a prompt the used tokens alone would
        fit). No forecast, unlike the running requests' growth (``max_new_tokens`` bounds it
        from above): the controller drops on the first such view."""
        return bool(self.waiting_tokens) and (
            self.queue_refused or self.kv_used_tokens + self.waiting_tokens
            > self.kv_capacity_tokens)

    @property
    def lasting_demand_tokens(self) -> int:
        """The demand once the requests about to finish have left: what a drop is for."""
        return self.demand_tokens - self.kv_finishing_tokens


# The arrival rates a view reports (``ReplicaSnapshot.arrivals_per_step``) are over this much
# of the past: a burst's arrivals on the replay's traces come over a few seconds, and a longer
# window would still count a burst that is over.
ARRIVAL_WINDOW_S = 5.0

# The step costs a view reports (``ReplicaSnapshot.prefill_tokens_per_step``) are over this
# many of the replica's latest whole forwards of each kind: a few seconds of decode here, and
# the last bursts' prefills.
STEP_COST_WINDOW = 32
# ``ControllerConfig.pays_prefill_tokens_per_step``'s value for "each replica's own, measured"
MEASURED = "measured"


class StepCostMeter:
    """The prompt tokens one replica prefills in the time of one of its decode steps, from its
    own whole (unmerged) forwards: the median of its latest decode steps' seconds times its
    latest prefills' tokens over their seconds. Summed over the prefills, so a prefill's fixed
    cost weighs as it does in the stall it puts on running requests. Decode steps are timed
    at the batch sizes the replica actually runs, which is what the stall is counted in.

    Invariant: at most ``window`` forwards of each kind are kept; the rate is None until
    there is one of each.
    """

    def __init__(self, window: int = STEP_COST_WINDOW):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self._decode_s: collections.deque[float] = collections.deque(maxlen=window)
        self._prefills: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def record(self, decode: bool, new_tokens: int, seconds: float) -> None:
        """One whole forward: a decode step, or a prefill of ``new_tokens`` prompt tokens
        (without the cached ones). A forward that took no time is not a measurement."""
        if not seconds > 0 or (not decode and new_tokens < 1):
            return
        if decode:
            self._decode_s.append(seconds)
        else:
            self._prefills.append((new_tokens, seconds))

    def prefill_tokens_per_step(self) -> float | None:
        if not self._decode_s or not self._prefills:
            return None
        tokens = sum(n for n, _ in self._prefills)
        seconds = sum(s for _, s in self._prefills)
        return statistics.median(self._decode_s) * tokens / seconds


class ArrivalMeter:
    """The requests that reached one replica, and their prompt tokens, per forward step over
    the last ``window_s``, from what the replica holds at each view (``update``): a request
    is counted the first view it is seen in, queued or running. A request that came and went
    between two views is missed (a view every 250 ms; a request here lasts seconds).

    Per forward step, not per second: the controller weighs a queue's waits in decode steps.
    Invariant: the steps counted are the replica's forwards since the oldest view kept.
    """

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = window_s
        self._seen: set[str] = set()
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        self._views: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, now_s: float, forwards: int,
               prompt_tokens: Mapping[str, int]) -> tuple[float, float]:
        """``forwards``: the replica's forward steps so far; ``prompt_tokens``: its queued and
        running requests' prompt tokens by request id. Returns (requests, prompt tokens)
        arrived per forward step over the window."""
        for rid, tokens in prompt_tokens.items():
            if rid not in self._seen:
                self._arrivals.append((now_s, tokens))
        self._seen = set(prompt_tokens)
        self._views.append((now_s, forwards))
        since = now_s - self.window_s
        while self._arrivals and self._arrivals[0][0] < since:
            self._arrivals.popleft()
        # Keep the newest view at or before the window's start: the steps since then
        while len(self._views) > 1 and self._views[1][0] <= since:
            self._views.popleft()
        steps = max(1, forwards - self._views[0][1])
        return (len(self._arrivals) / steps,
                sum(tokens for _, tokens in self._arrivals) / steps)


def queue_waits(room_tokens: int, running: Sequence[tuple[int, int]],
                queued: Sequence[tuple[int, int]]) -> list[float]:
    """The decode steps each queued request waits for admission on one unmerged replica, in
    queue order. A request holds its reservation (prompt + output tokens) from its admission
    to its end: the running ones' (``running``: (reserved tokens, decode steps to their
    end)) come back at their ends, a queued one's (``queued``: (reserved tokens, decode steps
    it runs)) once it has run. The replica admits in queue order (SGLang's first come, first
    served) whenever the head's reservation fits ``room_tokens`` (its pool less what no
    running request holds) less those held. ``inf`` from the first queued request whose
    reservation exceeds ``room_tokens``: it never fits a whole replica."""
    if not queued:  # the views are built every step; most have no queue
        return []
    ends = [(steps, tokens) for tokens, steps in running]
    heapq.heapify(ends)
    free = room_tokens - sum(tokens for tokens, _ in running)
    now, waits = 0, []
    for tokens, steps in queued:
        if tokens > room_tokens:
            return waits + [math.inf] * (len(queued) - len(waits))
        while free < tokens and ends:
            end, back = heapq.heappop(ends)
            now, free = max(now, end), free + back
        free -= tokens
        heapq.heappush(ends, (now + steps, tokens))
        waits.append(float(now))
    return waits


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """Every replica at one instant, and the groups currently merged (empty: all independent).

    Invariant (``check_integrity``): the groups' replicas are distinct replicas of the view.
    """

    time_s: float
    replicas: tuple[ReplicaSnapshot, ...]
    groups: tuple[ReplicaGroup, ...] = ()

    def check_integrity(self) -> None:
        ids = [r.replica for r in self.replicas]
        grouped = [r for g in self.groups for r in g.replicas]
        if len(set(ids)) != len(ids) or len(set(grouped)) != len(grouped):
            raise ValueError("a replica appears twice in the view")
        if not set(grouped) <= set(ids):
            raise ValueError(f"groups name replicas {sorted(set(grouped) - set(ids))} not in view")

    def replica(self, index: int) -> ReplicaSnapshot:
        return next(r for r in self.replicas if r.replica == index)


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    # consecutive views with demand over capacity before a drop (1 when a queue is blocked)
    drop_persist: int = 2
    restore_usage: float = 0.5  # a group restores below this KV usage (of its capacity)
    restore_headroom: float = 0.8  # ... and when its demand fits this share of the restored pools
    restore_persist: int = 3
    min_dwell_s: float = 5.0
    # When no plan holds the whole demand, apply the deepest allowed grouping anyway (it still
    # holds more than the replicas alone) and leave the rest to KV-centric handling.
    partial_drop: bool = True
    # A running request this close to its end frees its KV before a drop would pay off: its
    # tokens do not count as overload. 16 steps (1-2 s of decode here): at the default replay
    # point the first burst then waits for the requests about to finish instead of merging
    # the pair, and P50 TPOT went from +38% to +5% of plain DP 2's with KunServe's P99 TTFT
    # unchanged (1.64 -> 1.67 s); at 8 that drop happened, at 24 the queued prompts waited
    # long enough to raise the P99 to 2.0 s.
    finishing_steps: int = 16
    # Drop for a queue only when it pays (None: whenever the demand asks): the queued
    # requests' summed waits on whole replicas, in decode steps, must exceed the stall the
    # merged pair's prefill of them puts on its running requests, each prompt costing
    # (its tokens / this) decode steps to every one of them. The value is the prompt tokens a
    # replica prefills in the time of one of its decode steps: about 35 on the replay's CPU
    # (a 384-token prefill 1.1 s, a decode step of 2-3 requests 0.09-0.11 s). ``"measured"``:
    # each replica's own (``ReplicaSnapshot.prefill_tokens_per_step``, the pair's mean); a
    # drop pays while none is measured yet, as without the rule.
    pays_prefill_tokens_per_step: float | str | None = None
    # ... counting, on both sides, the requests expected to arrive while the queue drains on
    # whole replicas (``queue_drain_steps`` at the recent ``arrivals_per_step``): each waits
    # behind the queue, and each is prefilled by the merged pair. False: the queue now only.
    # On the replay's CPU the arrivals weigh against a drop more often than for it (an
    # arriving prompt stalls the pair's running requests for more steps than it waits), and
    # a drop still happens where the queue's waits are long.
    pays_counts_arrivals: bool = True
    # ... and a merge's own cost to each running request of the pair, in decode steps, beyond
    # the prefills: the transitions' pauses and its slower decode steps over the shortest
    # merged window (here a drop and a restore pause 0.07 + 0.11 s, about 2 steps; merged
    # decode steps take 1.2-1.4x a whole replica's, over min_dwell_s 5 s of 0.1 s steps,
    # 10-20 steps).
    pays_merge_steps: float = 0.0

    def __post_init__(self) -> None:
        # Types first: the values also come from operators' JSON (--kunserve-auto-config).
        for name, least in (("drop_persist", 1), ("restore_persist", 1),
                            ("finishing_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        for name in ("restore_usage", "restore_headroom", "min_dwell_s", "pays_merge_steps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        rate = self.pays_prefill_tokens_per_step
        if rate is not None and rate != MEASURED and not (isinstance(rate, (int, float))
                                                          and not isinstance(rate, bool)
                                                          and math.isfinite(rate) and rate > 0):
            raise ValueError(f"pays_prefill_tokens_per_step must be a positive number, "
                             f"\"{MEASURED}\" or null, got {rate!r}")
        for name in ("partial_drop", "pays_counts_arrivals"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.min_dwell_s < 0 or self.pays_merge_steps < 0:
            raise ValueError(f"bad controller config {self}")
        if not 0 < self.restore_usage <= 1 or not 0 < self.restore_headroom <= 1:
            raise ValueError("restore_usage and restore_headroom must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Drop:
    plan: DropPlan
    reason: str


@dataclasses.dataclass(frozen=True)
class Restore:
    plan: RestorePlan
    reason: str


@dataclasses.dataclass(frozen=True)
class KvCentric:
    fallback: KvCentricFallback


Action = Drop | Restore | KvCentric


class KunServeController:
    """Decides one action per view (or none). The only state is the hysteresis: how many
    views in a row asked for a drop / a group's restore, when each replica last changed, and
    whether the current shortfall was already reported as KV-centric."""

    def __init__(self, planner: DropPlannerConfig, cfg: ControllerConfig = ControllerConfig()):
        self.planner = planner
        self.cfg = cfg
        self._over_views = 0
        self._calm_views: dict[tuple[int, ...], int] = {}
        self._changed_at: dict[int, float] = {}
        self._reported_fallback = False

    def _dwelt(self, replicas: Sequence[int], now_s: float) -> bool:
        return all(now_s - self._changed_at.get(r, -float("inf")) >= self.cfg.min_dwell_s
                   for r in replicas)

    def decide(self, view: ClusterView) -> Action | None:
        view.check_integrity()
        restore = self._restore(view)
        if restore is not None:
            return restore
        return self._drop(view)

    def applied(self, action: Action, now_s: float) -> None:
        """The executor applied ``action`` at ``now_s`` (a refused one is not reported)."""
        if isinstance(action, Drop):
            replicas = [r for g in action.plan.groups if g.size > 1 for r in g.replicas]
            self._over_views = 0
        elif isinstance(action, Restore):
            replicas = list(action.plan.group.replicas)
            self._calm_views.pop(action.plan.group.replicas, None)
        else:
            return
        for r in replicas:
            self._changed_at[r] = now_s

    # ---- drop -------------------------------------------------------------------------------

    def _drop(self, view: ClusterView) -> Action | None:
        grouped = {r for g in view.groups for r in g.replicas}
        free = [r for r in view.replicas if r.replica not in grouped]
        # Each replica alone: its queue cannot use another replica's free KV. Requests about
        # to finish give their room back sooner than a drop would make it (a queue SGLang
        # refused while they finish is admitted steps later).
        over = [r for r in free if r.lasting_demand_tokens > r.kv_capacity_tokens]
        if len(free) < 2 or not over:
            self._over_views = 0
            self._reported_fallback = False
            return None
        self._over_views += 1
        # A blocked queue need not persist (the replay's 384-token prompts waited ~0.5 s for
        # the second view).
        blocked = [r for r in over if r.queue_blocked]
        if self._over_views < self.cfg.drop_persist and not blocked:
            return None
        if not self._dwelt([r.replica for r in free], view.time_s):
            return None
        pays = self._pays(over, free)
        if pays is False:
            return None
        plan = plan_drop(self.planner, [ReplicaDemand(r.replica, r.kv_used_tokens,
                                                      r.demand_tokens) for r in free])
        if isinstance(plan, KvCentricFallback):
            if self.cfg.partial_drop and plan.deepest is not None:
                return Drop(plan.deepest, f"partial: {plan.reason}; the rest is handled by KV")
            if self._reported_fallback:
                return None
            self._reported_fallback = True
            return KvCentric(plan)
        self._reported_fallback = False
        if not plan.merges:  # the planner's exact capacities hold it after all
            return None
        worst = max(over, key=lambda r: r.demand_tokens - r.kv_capacity_tokens)
        why = (f"for {self._over_views} views" if worst not in blocked
               else f"its queue of {worst.waiting_tokens} tokens was refused" if
               worst.queue_refused else f"its queue of {worst.waiting_tokens} tokens does not fit")
        return Drop(plan, f"predicted KV demand {worst.demand_tokens} tokens over replica "
                          f"{worst.replica}'s capacity {worst.kv_capacity_tokens}, {why}"
                          + (f"; {pays}" if isinstance(pays, str) else ""))

    def _pays(self, over: Sequence[ReplicaSnapshot], free: Sequence[ReplicaSnapshot]
              ) -> bool | str:
        """With ``pays_prefill_tokens_per_step``: False when the drop's queues would wait less
        on whole replicas than the merged prefills of them would stall the running requests,
        else why it pays; True without the option, or for an overload with no queue (the
        running requests' own growth: SGLang would retract some).

        With ``pays_counts_arrivals`` the requests arriving while a queue drains (over its
        ``queue_drain_steps``, H) count too: arriving at a steady rate, they wait behind the
        queue at least H / 2 each on average (``arrivals_per_step`` x H^2 / 2 in all), and the
        merged pair would prefill their prompts (``arrival_prompt_tokens_per_step`` x H)."""
        rate = self.cfg.pays_prefill_tokens_per_step
        queues = [r for r in over if r.waiting_tokens]
        if rate is None or not queues:
            return True
        measured = ""
        if rate == MEASURED:
            rates = [r.prefill_tokens_per_step for r in free
                     if r.prefill_tokens_per_step is not None]
            if not rates:
                return True  # nothing to weigh the drop with yet: as without the rule
            rate = statistics.fmean(rates)
            measured = f" at {rate:.1f} prompt tokens a decode step, measured"
        wait = sum(r.queue_wait_steps for r in queues)
        prompts = sum(r.queued_prompt_tokens for r in queues)
        arriving = ""
        horizons = [r.queue_drain_steps for r in queues]
        if not all(map(math.isfinite, (wait, *horizons))):
            wait = math.inf  # a queued request never fits whole: only a drop serves it
        elif self.cfg.pays_counts_arrivals:
            wait += sum(r.arrivals_per_step * h * h / 2 for r, h in zip(queues, horizons))
            coming = sum(r.arrival_prompt_tokens_per_step * h for r, h in zip(queues, horizons))
            prompts += coming
            arriving = f" (with {coming:.0f} prompt tokens arriving meanwhile)"
        stall = sum(r.running_requests for r in free) * (
            prompts / rate + self.cfg.pays_merge_steps)
        if wait <= stall:
            return False
        return (f"it pays: the queue would wait {wait:g} decode steps whole{arriving}, the "
                f"merge and its prefills stall the running requests {stall:.0f}{measured}")

    # ---- restore ----------------------------------------------------------------------------

    def _restore(self, view: ClusterView) -> Restore | None:
        seen = set()
        for group in view.groups:
            key = group.replicas
            seen.add(key)
            members = [view.replica(r) for r in group.replicas]
            live = {req.rid: req for m in members for req in m.live}
            used = sum(req.kv_tokens for req in live.values())
            full_tokens = self.planner.full_replica().kv_capacity_tokens
            restored_tokens = group.size * full_tokens
            if all(req.owner is not None for req in live.values()):
                # Requests that stay with their replica (the live pair): after the restore each
                # member serves its own alone, so each must fit its own restored pool (with
                # the headroom), or the restore is followed by a queue and the next drop.
                own = [sum(q.kv_tokens for q in live.values() if q.owner == m.replica)
                       + m.kv_growth_tokens + m.waiting_tokens for m in members]
                demand = sum(own)
                members_fit = max(own) <= self.cfg.restore_headroom * full_tokens
            else:
                # Every member holds every request's KV (for its layers): count them once.
                demand = used + max(m.kv_growth_tokens for m in members) + sum(
                    m.waiting_tokens for m in members)
                members_fit = True
            calm = (used < self.cfg.restore_usage * group.capacity_tokens and members_fit
                    and demand <= self.cfg.restore_headroom * restored_tokens)
            self._calm_views[key] = self._calm_views.get(key, 0) + 1 if calm else 0
            if self._calm_views[key] < self.cfg.restore_persist:
                continue
            if not self._dwelt(group.replicas, view.time_s):
                continue
            plan = plan_restore(self.planner, group, list(live.values()))
            if isinstance(plan, RestoreRefused):
                continue  # the live KV does not pack into the restored pools yet: wait
            return Restore(plan, f"group {key}: KV usage {used}/{group.capacity_tokens} under "
                                 f"{self.cfg.restore_usage:.0%}, demand {demand} fits the "
                                 f"restored {restored_tokens} tokens")
        for key in set(self._calm_views) - seen:
            del self._calm_views[key]
        return None
