"""``--kunserve-auto``: the KunServe controller drives each live group's drop and restore.

Each group of replicas (a pair ``2i``, ``2i + 1`` by default, or ``--kunserve-group-size``
consecutive ones; below "member 0" is the group's first, its *leader*, the others its
*followers*) has its own leader, controller and mailbox: under SGLang's data-parallel dispatch
a request stays on its replica, so a group's demand is its own members' and the groups decide
independently, each leader running the drop planner over its group's replicas. The links fix
the replicas a replica may merge with: a pair merges whole; in a larger group the planner's
greedy merges an overloaded member with as few others of the group as hold its demand (two
members, then three, ...), and disjoint merges of one group may stand at once.

Design (leader and followers on the elastic core's ``ElasticLoop``, no new process): every
``interval_ms`` each follower publishes its view (KV capacity and use, the remaining outputs of
its running requests, its queue; at once, and a shared counter bumped, when its queue is
blocked: it does not fit next to the live KV, seen before SGLang tries to admit it, or SGLang
refused it for lack of KV; the leader checks the counter every few milliseconds between its
batches) to the leader through the link's mailbox (keys in the link's TCPStore: written and
read without either side waiting; gloo's recv cannot be polled). The leader builds the
``ClusterView`` of the group from its own view and each follower's latest, runs
``KunServeController.decide`` and, for a drop or a restore, writes a *proposal* (the direction,
the replicas that change and the controller's reason) and enters the transition; every
follower reads proposals between its batches (every loop of its scheduler, at most every
``_FOLLOW_POLL_S``) and enters the same transition, as a member of the changing replicas or
standing by. A drop that merges two disjoint sets of members is two proposals, in order.
The transition is the operator's (``KunServeReplica.transition``): the vote, the two phases
and their undo, the refusals (a restore waits while a replica holds more than a whole replica
can), the log. So an automatic transition completes on every member or changes
nothing, exactly as a POST.

Why a leader and not both deciding from an exchanged view: an exchange would be a rendezvous
every interval, each replica waiting up to a whole batch of the other's (a long prefill is
seconds here). With a leader the replicas wait for each other only in a transition, and only
one controller keeps hysteresis state.

Ordering with operator POSTs: every member enters exactly one transition per proposal and
one per POST (the data-parallel controller sends a POST to every replica), and every
transition begins with the vote on the link's control group, so the votes line up in order
even when a proposal and a POST cross (a replica answering a POST may vote with another
answering a proposal). The members' state is always the same (a transition happens on all or
none), so a crossed vote either asks the same thing of all, or one of them refuses ("already
merged", "not merged") and the group changes nothing.

A follower's view older than the last transition (its count of the link's transitions differs
from the leader's) is not used: it describes the layout before. Each view says which replicas
its replica serves with now, so the leader's view of the group holds the merges standing.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from sglang_morph.elastic.contract import Outcome, Transition
from sglang_morph.kunserve.controller import (
    ArrivalMeter,
    ClusterView,
    Drop,
    KunServeController,
    KvCentric,
    ReplicaSnapshot,
    queue_waits,
)
from sglang_morph.kunserve.live.config import AutoControlConfig
from sglang_morph.kunserve.planner import LiveRequest, make_group

logger = logging.getLogger("sglang_morph.kunserve")

# The follower reads the proposal counter at most this often (one store round trip on
# 127.0.0.1); the leader waits in the vote meanwhile.
_FOLLOW_POLL_S = 0.01
_COUNT_KEY, _BLOCKED_KEY = "proposals", "views_blocked"


def _view_key(rank: int) -> str:
    return f"view{rank}"


def local_view(replica: Any, finishing_steps: int = 0,
               arrivals: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    """This replica's part of the cluster view, between two batches (scheduler thread).

    ``kv_used_tokens``: KV held by requests and locked cache (not free, not evictable);
    ``kv_growth_tokens``: output tokens its running requests may still add (their
    ``max_new_tokens`` minus what they produced); ``waiting_tokens``: prompt + ``max_new_tokens``
    of its queued requests; ``queue_refused`` (0/1): SGLang's admission refuses the queue for
    lack of KV room: its last prefill attempt did (``batch_is_full`` with requests waiting and
    fewer running than its limit; it stays set until a request finishes or memory is freed),
    or its next one will (``admission_refuses``, so that a prompt is seen refused in the step
    it arrives in, not a batch later); ``kv_finishing_tokens``:
    held and still to grow of the running requests with at most ``finishing_steps`` outputs
    left; ``queued_prompt_tokens`` and ``queue_wait_steps``: the queue's prompt tokens, and
    its requests' waits for admission here, in decode steps, summed (``controller.
    queue_waits`` on every request's prompt + ``max_new_tokens``, the running requests'
    outputs to go and the queued ones' ``max_new_tokens``; None where one never fits: the view
    is JSON, and /kunserve/status shows it), and the
    last one's (``queue_drain_steps``); ``arrivals_per_step`` and
    ``arrival_prompt_tokens_per_step``: ``arrivals`` (``AutoControl``'s ``ArrivalMeter``;
    zero without one); ``prefill_tokens_per_step``: the replica's ``step_costs`` (None until
    measured). Also the count of the link's transitions (``epoch``), which dates the
    view, and the replicas it serves with now (``group``)."""
    s = replica.scheduler
    running = replica.live_requests()
    left = [max(0, _max_new(r) - len(r.output_ids)) for r in running]
    held = [len(r.origin_input_ids) + len(r.output_ids) for r in running]
    growth = sum(left)
    finishing = sum(h + n for h, n in zip(held, left) if n <= finishing_steps)
    queued = [(len(r.origin_input_ids) + _max_new(r), _max_new(r)) for r in s.waiting_queue]
    waiting = sum(tokens for tokens, _ in queued)
    capacity = int(replica.pool.size)
    free = int(replica.allocator.available_size()) + int(s.tree_cache.evictable_size())
    used = capacity - free
    cap = merged_cap(replica)
    refused = queue_refused(s, len(running), cap) or (
        _admits_more(s, len(running), cap) and admission_refuses(s, running, free))
    waits = queue_waits(
        capacity - max(0, used - sum(held)),
        [(len(r.origin_input_ids) + _max_new(r), n) for r, n in zip(running, left)], queued)
    wait, drain = float(sum(waits)), waits[-1] if waits else 0.0
    return {"epoch": replica.epoch, "group": list(replica.subgroup),
            "kv_capacity_tokens": capacity,
            "kv_used_tokens": max(0, used), "kv_growth_tokens": int(growth),
            "waiting_tokens": int(waiting), "running_reqs": len(running),
            "waiting_reqs": len(s.waiting_queue), "queue_refused": int(refused),
            # Requests count their whole length, the allocator shared prefixes once: capped
            # at what the running requests hold and add (the snapshot's invariant).
            "kv_finishing_tokens": min(int(finishing), max(0, used) + int(growth)),
            "queued_prompt_tokens": sum(len(r.origin_input_ids) for r in s.waiting_queue),
            "queue_wait_steps": None if math.isinf(wait) else wait,
            "queue_drain_steps": None if math.isinf(drain) else drain,
            "arrivals_per_step": arrivals[0], "arrival_prompt_tokens_per_step": arrivals[1],
            "prefill_tokens_per_step": replica.step_costs.prefill_tokens_per_step()}


def _max_new(req: Any) -> int:
    return int(req.sampling_params.max_new_tokens or 0)


def _admits_more(scheduler: Any, running: int, cap: int | None) -> bool:
    """Fewer requests run than SGLang's limit (``--max-running-requests``, or ``cap`` when
    admission control holds the merged replica below it): a queue held by the count is not
    held for KV."""
    limit = int(getattr(scheduler, "max_running_requests", 1 << 30))
    return running < (limit if cap is None else min(limit, cap))


def queue_refused(scheduler: Any, running: int, cap: int | None = None) -> bool:
    """SGLang's last prefill attempt found no KV room for the waiting queue (``batch_is_full``
    with requests waiting and fewer than its limit running, ``_admits_more``). O(1): read
    every step."""
    return (bool(scheduler.waiting_queue)
            and bool(getattr(scheduler.running_batch, "batch_is_full", False))
            and _admits_more(scheduler, running, cap))


def admission_refuses(scheduler: Any, running: list, free_tokens: int) -> bool:
    """SGLang's next prefill attempt will refuse the head of the waiting queue for lack of KV,
    by its prefill budget's rule (``sglang.srt.mem_cache.prefill_budget``): a request is
    admitted while its prompt and outputs (each request's ``max_new_tokens`` clipped at
    ``CLIP_MAX_NEW_TOKENS``) stay under the free and evictable tokens less what the running
    requests may still write (their remaining outputs, scaled by the scheduler's new-token
    ratio, or whole for a request that ignores EOS). Page rounding and prefix-cache hits are
    left out, so a prompt whose prefix is cached may be predicted refused: the controller
    still drops only where the replica's demand is over its pool."""
    if not scheduler.waiting_queue:
        return False
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    ratio = float(scheduler.new_token_ratio_tracker.current)
    reserved = sum(min(max(0, _max_new(r) - len(r.output_ids)), CLIP_MAX_NEW_TOKENS)
                   * (1.0 if r.sampling_params.ignore_eos else ratio) for r in running)
    head = scheduler.waiting_queue[0]
    needs = len(head.origin_input_ids) + min(_max_new(head), CLIP_MAX_NEW_TOKENS)
    return needs >= free_tokens - reserved


def merged_cap(replica: Any) -> int | None:
    """The running-request cap admission control sets while the replica is merged, or the
    lower one its pacing holds now (None: whole, or no cap): a queue held by either is not
    held for KV."""
    # Pacing holds its cap at or under the merged one (``KunServeReplica._pace``).
    paced = getattr(replica, "paced_cap", None)
    cap = paced if paced is not None else getattr(replica, "merged_max_running", None)
    return cap if getattr(replica, "merged", False) else None


def snapshot(replica: int, view: dict[str, int]) -> ReplicaSnapshot:
    """The controller's ``ReplicaSnapshot`` of one replica's view. Its running requests are one
    live entry owned by it: a request never leaves its scheduler, so a restore homes the
    replica's KV on itself (``plan_restore`` then checks exactly that it fits)."""
    used = view["kv_used_tokens"]
    # None: a queued request never fits
    wait, drain = view.get("queue_wait_steps", 0.0), view.get("queue_drain_steps", 0.0)
    return ReplicaSnapshot(
        replica=replica, kv_capacity_tokens=view["kv_capacity_tokens"], kv_used_tokens=used,
        kv_growth_tokens=view["kv_growth_tokens"], waiting_tokens=view["waiting_tokens"],
        queue_refused=bool(view.get("queue_refused", 0)),
        kv_finishing_tokens=int(view.get("kv_finishing_tokens", 0)),
        running_requests=int(view.get("running_reqs", 0)),
        queued_prompt_tokens=int(view.get("queued_prompt_tokens", 0)),
        queue_wait_steps=math.inf if wait is None else float(wait),
        queue_drain_steps=math.inf if drain is None else float(drain),
        arrivals_per_step=float(view.get("arrivals_per_step", 0.0)),
        arrival_prompt_tokens_per_step=float(view.get("arrival_prompt_tokens_per_step", 0.0)),
        prefill_tokens_per_step=view.get("prefill_tokens_per_step"),
        live=(LiveRequest(f"replica{replica}", used, owner=replica),) if used else ())


class AutoControl:
    """One replica's side of the automatic control, run by the elastic core's ``ElasticLoop``
    every ``interval_ms``: a follower's observation publishes its view; the leader's builds
    the ``ClusterView`` of the group, decides, and applies by proposing (see the module
    docstring). Invariant: each follower has entered one transition for each proposal the
    leader wrote before its last poll, in order."""

    def __init__(self, replica: Any, cfg: AutoControlConfig):
        from sglang_morph.elastic.loop import ElasticLoop
        from sglang_morph.elastic.record import recorder

        self.replica, self.cfg = replica, cfg
        self.leader = replica.rank == 0
        self.mailbox = replica.link.mailbox
        self.controller = (KunServeController(replica.planner, cfg.controller)
                           if self.leader else None)
        self._next_poll_s = 0.0
        self._retry_at_s = 0.0
        self._views: list[dict[str, int]] = []  # the members' views the last decision saw
        self._proposed: Any = None  # the controller's action the last proposal carried
        self.proposals = 0  # written (leader) or entered (follower)
        self.views = 0  # views decided on (leader) or published (follower)
        self.stale_views = 0
        self.kv_centric = 0
        self.last_decision: dict[str, Any] | None = None
        self.errors = 0
        # A blocked queue (``ReplicaSnapshot.queue_blocked``) is seen at once (``on_step``):
        # this replica's, and, on the leader, a follower's through a counter each bumps when
        # its published view turns blocked.
        self._blocked = self._published_blocked = False
        # This replica's recent arrivals per forward step, measured at each observation
        self.meter = ArrivalMeter()
        self.arrivals = (0.0, 0.0)
        self._followers_blocked = 0
        self.loop = ElasticLoop(_AsMechanism(self), _Decider(self), recorder(replica.scheduler),
                                cfg.interval_ms / 1000)

    def status(self) -> dict[str, Any]:
        return {"enabled": True, "role": "leader" if self.leader else "follower",
                "config": self.cfg.as_dict(),
                "views": self.views, "stale_views": self.stale_views,
                "proposals": self.proposals, "kv_centric": self.kv_centric,
                "last_decision": self.last_decision, "errors": self.errors}

    def on_step(self) -> None:
        """Before every ``get_next_batch_to_run`` (scheduler thread, between batches)."""
        try:
            now = self.loop.clock()
            blocked = self._blocked_now()
            if blocked and not self._blocked:
                # A queue this replica cannot take in: the controller drops at once on such a
                # view, so it must not wait for the interval (the follower's view, then the
                # leader's next observation).
                self.loop.observe_now()
            self._blocked = blocked
            if now >= self._next_poll_s:
                self._next_poll_s = now + _FOLLOW_POLL_S
                if not self.leader:
                    self._follow()
                elif (blocked := self.mailbox.add(_BLOCKED_KEY, 0)) != self._followers_blocked:
                    self._followers_blocked = blocked
                    self.loop.observe_now()  # a follower's queue is blocked
            self.loop.on_step()
        except Exception:  # a broken mailbox must not stop serving; the POST routes remain
            self.errors += 1
            logger.exception("sglang-morph: KunServe automatic control failed on replica %d",
                             self.replica.replica)

    def _blocked_now(self) -> bool:
        """This replica's queue is blocked now. Checked before SGLang tries to admit it
        (``on_step`` runs before every ``get_next_batch_to_run``), so a prompt that cannot fit
        next to the live KV drops the group in the very step it arrived in, and SGLang admits
        it into the merged pool then; before, its refusal was seen only a batch later (0.1-0.3
        s here). Only a queue costs the check (its view)."""
        if not self.replica.scheduler.waiting_queue:
            return False
        view = local_view(self.replica, self.cfg.controller.finishing_steps)
        return snapshot(self.replica.rank, view).queue_blocked

    def _follow(self) -> None:
        written = self.mailbox.add(_COUNT_KEY, 0)
        while self.proposals < written:
            self.proposals += 1
            proposal = json.loads(self.mailbox.get(f"proposal{self.proposals}"))
            code, _ = self.replica.transition(proposal["merge"], trigger="auto",
                                              reason=proposal["reason"],
                                              group=proposal["group"])
            self.last_decision = {"proposal": self.proposals, "merge": proposal["merge"],
                                  "group": proposal["group"], "reason": proposal["reason"],
                                  "status_code": code}

    def observe(self) -> ClusterView | None:
        """A follower publishes its view (and decides nothing: None). The leader's view of
        the group, or None while a follower has published none or only one from before the
        last transition."""
        s = self.replica.scheduler
        self.arrivals = self.meter.update(
            self.loop.clock(), int(s.forward_ct),
            {r.rid: len(r.origin_input_ids)
             for r in (*s.waiting_queue, *self.replica.live_requests())})
        own = local_view(self.replica, self.cfg.controller.finishing_steps, self.arrivals)
        if not self.leader:
            self.mailbox.set(_view_key(self.replica.rank), json.dumps(own))
            blocked = snapshot(self.replica.rank, own).queue_blocked
            if blocked and not self._published_blocked:
                self.mailbox.add(_BLOCKED_KEY, 1)  # after the view: the leader reads it next
            self._published_blocked = blocked
            self.views += 1
            return None
        replicas = self.replica.link.replicas
        keys = [_view_key(rank) for rank in range(1, len(replicas))]
        if not self.mailbox.check(keys):
            return None  # a follower has not published yet
        views = [own] + [json.loads(self.mailbox.get(key)) for key in keys]
        if any(view["epoch"] != own["epoch"] for view in views):
            self.stale_views += 1
            return None
        self.views += 1
        self._views = views
        merged = sorted({tuple(view["group"]) for view in views if len(view["group"]) > 1})
        return ClusterView(self.loop.clock(),
                           tuple(snapshot(r, view) for r, view in zip(replicas, views)),
                           tuple(make_group(self.replica.planner, g) for g in merged))

    def decide(self, view: ClusterView | None) -> Any:
        """The controller's drop or restore for the group, or None (nothing to do, a
        KV-centric fallback, or the wait after a refused or failed automatic transition)."""
        if view is None:
            return None
        action = self.controller.decide(view)
        if action is None:
            return None
        if isinstance(action, KvCentric):
            self.kv_centric += 1
            self.last_decision = {"action": "kv_centric", "reason": action.fallback.reason,
                                  "views": self._views}
            return None
        if self.loop.clock() < self._retry_at_s:
            return None  # the last automatic transition was refused or failed: wait
        return action

    def propose(self, action: Any) -> None:
        """The leader writes a proposal per merge of a drop (or the restore's one), each
        followed by the link's transition it proposes (each follower enters it at its next
        poll), and stops at the first that does not apply. The transitions record themselves
        on the members that change (and the leader may only stand by), so the loop has none
        to record: None."""
        merge = isinstance(action, Drop)
        groups = ([g.replicas for g in action.plan.groups if g.size > 1] if merge
                  else [action.plan.group.replicas])
        outcome = Outcome.APPLIED
        for group in groups:
            self.proposals += 1
            # The proposal before the count: a follower never sees a count without its key.
            self.mailbox.set(f"proposal{self.proposals}", json.dumps(
                {"merge": merge, "group": list(group), "reason": action.reason}))
            self.mailbox.add(_COUNT_KEY, 1)
            code, _ = self.replica.transition(merge, trigger="auto", reason=action.reason,
                                              group=list(group))
            self.last_decision = {"proposal": self.proposals, "merge": merge,
                                  "group": list(group), "reason": action.reason,
                                  "status_code": code, "views": self._views}
            outcome = self.replica.last_transition.outcome
            if outcome is not Outcome.APPLIED:
                break
        self._proposed = action
        self.applied(outcome)

    def applied(self, outcome: Outcome) -> None:
        """The controller keeps its hysteresis from an applied action; after a refused (e.g. a
        restore while too much KV is held) or failed one, the leader waits."""
        if outcome is Outcome.APPLIED:
            self.controller.applied(self._proposed, self.loop.clock())
        else:
            self._retry_at_s = self.loop.clock() + max(1.0, self.cfg.controller.min_dwell_s)


class _AsMechanism:
    """The automatic control under the elastic core's ``ElasticMechanism`` names. A transition
    is the group's voted one: it records itself on every member and checks the replica's
    integrity once applied (``KunServeReplica._applied``)."""

    name = "kunserve"

    def __init__(self, auto: AutoControl):
        self.auto = auto
        self.observe = auto.observe
        self.apply = auto.propose
        self.state = auto.replica.elastic_state

    def is_leader(self) -> bool:
        return self.auto.leader

    def check_integrity(self) -> None:
        """Nothing left to check: an applied transition checked the replica before it returned,
        and a refused or failed one changed nothing (or reports its failed last step)."""


class _Decider:
    """The elastic core's ``Controller`` over ``KunServeController`` (the leader's). The
    leader's ``propose`` reports its outcomes to the controller itself (``applied``)."""

    def __init__(self, auto: AutoControl):
        self.decide = auto.decide

    def applied(self, transition: Transition) -> None:
        """Not called: ``propose`` returns no transition for the loop to record."""
