"""AMOEBAs' automatic transitions: a prompt no replica can hold merges a group; the group splits
once its long requests are done and its KV is at least half free.

A *board* (one TCPStore of all replicas, on the port after the groups' links) carries
proposals in one global order: a proposal is a numbered key (``proposal/<n>``, numbers from an
atomic counter), and every replica reads every proposal in number order between its batches
(``on_step``, at most every ``_POLL_S``; an idle scheduler wakes at least every second). The
members of the group a proposal names run it as the operator's transition
(``AmoebasReplica.transition``: vote, phases, undo); the others skip it. One global order is
what keeps members of overlapping groups (replica 0 in [0, 1] and in [0, 1, 2, 3]) from
waiting for each other in two different votes.

- **Merge on arrival.** ``Scheduler.handle_generate_request`` is wrapped: a prompt longer than
  this replica's pool admits but within what its smallest group would hold after a merge
  (``capacity_after_merge``) is parked and a merge of that group is proposed; once the
  transition is over (applied or not) the parked requests go through SGLang's own handling
  again, which admits them or answers 400 as it would have.
- **Split when done.** Each member publishes, at least every ``_PUBLISH_S`` (and at once when
  what the controller places by changes), its live long
  requests (those a replica alone could not hold) and its KV use; the group's first member
  hands the group it sees to the scheduler's policy (``policy.AmoebasPolicy.maintenance``,
  the code the simulator drives), which splits a group with no long request left, at least
  ``split_free_fraction`` of its KV free and every member's own requests fitting a replica
  alone into replicas alone, and a group whose long requests all fit a smaller group's pools
  into those groups (TP 4 -> 2 x TP 2); proposals wait ``min_dwell_s`` after a merge and
  after a refused split.
- **What the controller places by.** The published load also carries the tokens requests
  reserve, how many requests the replica received and the last proposal it ran; the policy's
  parameters (``policy_params``: the pool each degree gives, SGLang's longest prompt there)
  are on the board once, so the data-parallel controller (``dispatch.py``) builds the same
  policy.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import Any

import zmq
from sglang.srt.managers.utils import is_health_check_generate_req

from sglang_morph.elastic.kv_resizer import max_request_tokens

logger = logging.getLogger("sglang_morph.amoebas")

_POLL_S = 0.01
_PUBLISH_S = 0.1
# The fields of a replica's load the controller places by (dispatch.py)
_PLACEMENT_FIELDS = ("kv_reserved_tokens", "kv_queued_tokens", "received_requests",
                     "long_requests", "proposals_seen")
_COUNT_KEY = "proposals"
_POLICY_KEY = "policy"
_BOARD_TIMEOUT = datetime.timedelta(minutes=10)


class Board:
    """Proposals and member states shared by every replica (a TCPStore, replica 0 hosts it)."""

    def __init__(self, replica: int | None, replicas: int, port: int, host: str = "127.0.0.1"):
        """``replica`` None: a reader outside the replicas (the data-parallel controller)."""
        from torch.distributed import TCPStore

        if replica is None:  # replica 0 hosts it by the time the controller places requests
            self.store = TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
        else:
            self.store = TCPStore(host, port, replicas, is_master=replica == 0,
                                  timeout=_BOARD_TIMEOUT)

    def propose(self, proposal: dict[str, Any]) -> int:
        number = int(self.store.add(_COUNT_KEY, 1))
        self.store.set(f"proposal/{number}", json.dumps(proposal))
        return number

    def proposals_after(self, seen: int) -> list[tuple[int, dict[str, Any]]]:
        latest = int(self.store.add(_COUNT_KEY, 0))
        return [(n, json.loads(self.store.get(f"proposal/{n}")))
                for n in range(seen + 1, latest + 1)]

    def publish(self, replica: int, state: dict[str, Any]) -> None:
        self.store.set(f"state/{replica}", json.dumps(state))

    def publish_policy(self, params: dict[str, Any]) -> None:
        self.store.set(_POLICY_KEY, json.dumps(params))

    def policy_params(self) -> dict[str, Any] | None:
        if not self.store.check([_POLICY_KEY]):
            return None
        return json.loads(self.store.get(_POLICY_KEY))

    def states(self, replicas: tuple[int, ...]) -> dict[int, dict[str, Any]] | None:
        keys = [f"state/{r}" for r in replicas]
        if not self.store.check(keys):
            return None
        return {r: json.loads(self.store.get(k)) for r, k in zip(replicas, keys)}


class Waker:
    """Wakes the other replicas' idle schedulers when a proposal is posted. With
    ``--sleep-on-idle`` an idle scheduler waits up to a second on its sockets (SGLang's
    ``IdleSleeper``) and would read a proposal only then: a merge for a long prompt would wait
    for its idle members' next wake. Each replica binds a ZeroMQ PULL socket that its sleeper
    also polls; a proposer pushes one empty message to every other replica, and a replica
    drains its socket between batches. Without a sleeper the scheduler never sleeps, and
    nothing is bound."""

    def __init__(self, replica: int, replicas: int, port: int, sleeper: Any | None):
        context = zmq.Context.instance()
        self.pull = None
        if sleeper is not None:
            self.pull = context.socket(zmq.PULL)
            self.pull.bind(self.address(port, replica))
            sleeper.poller.register(self.pull, zmq.POLLIN)
        self.push = []
        for r in range(replicas):
            if r != replica:
                sock = context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 1)  # one pending wake is enough
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.address(port, r))
                self.push.append(sock)

    @staticmethod
    def address(port: int, replica: int) -> str:
        """One per server (the board's port) and replica, in Linux's abstract socket namespace
        (``@``): no file is left behind when a server is killed."""
        return f"ipc://@sglang-morph-amoebas-{port}-{replica}"

    def wake_others(self) -> None:
        for sock in self.push:
            try:
                sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a wake is pending there already
                pass

    def drain(self) -> None:
        """Every scheduler step: a poll that finds nothing costs no exception."""
        while self.pull is not None and self.pull.poll(0):
            self.pull.recv()


def policy_params(replica: Any) -> dict[str, Any]:
    """What the scheduler's policy needs of a replica (every replica has the same: one model,
    one pool size), as the board carries it to the data-parallel controller: the pool each
    degree gives a member's own requests (what a merge grows it to) and the longest prompt
    SGLang admits at that pool."""
    runner = replica.scheduler.tp_worker.model_runner
    ps = replica.allocator.page_size
    owner = {d: (replica.kv_capacity_tokens_whole if d == 1
                 else replica.capacity_after_merge(d) // ps * ps) for d in replica.cfg.degrees}
    return {"model": runner.model_config.hf_config.to_dict(),
            "dtype_bytes": runner.dtype.itemsize, "replicas": replica.cfg.replicas,
            "page_size_tokens": ps, "groups": [list(b) for b in replica.cfg.blocks()],
            "owner_tokens": [[d, n] for d, n in owner.items()],
            "max_prompt_tokens": [[d, max_request_tokens(replica.context_len, n)
                                   - replica.input_len_margin] for d, n in owner.items()]}


def live_policy(params: dict[str, Any]) -> Any:
    """The scheduler's policy over a live replica's numbers (``policy_params``): the same
    object in every replica (splits) and in the data-parallel controller (placement)."""
    from sglang_morph.amoebas.capacity import CapacityModel
    from sglang_morph.amoebas.policy import AmoebasPolicy
    from sglang_morph.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config(params["model"], dtype_bytes=params["dtype_bytes"])
    owner = tuple((int(d), int(n)) for d, n in params["owner_tokens"])
    capacity = CapacityModel.from_kv_pool(spec, params["replicas"], dict(owner)[1],
                                          params["page_size_tokens"],
                                          measured_owner_tokens=owner)
    # A live group forms from replicas alone or from the merged groups that tile it (two
    # TP 2 groups into TP 4); ``groups`` keeps merges to the aligned blocks.
    return AmoebasPolicy(capacity, groups=tuple(tuple(g) for g in params["groups"]))


def _reserved_tokens(req: Any) -> int:
    """Prompt + max_new_tokens of a scheduler's Req or a tokenized request not admitted yet."""
    prompt = getattr(req, "origin_input_ids", None)
    if prompt is None:
        prompt = req.input_ids
    return len(prompt) + int(req.sampling_params.max_new_tokens or 0)


class AutoControl:
    """One replica's side of the automatic transitions (scheduler thread)."""

    def __init__(self, replica: Any, board: Board, min_dwell_s: float = 2.0):
        params = policy_params(replica)
        self.replica, self.board, self.policy = replica, board, live_policy(params)
        board.publish_policy(params)  # for the data-parallel controller's dispatch
        self.received_requests = 0  # generate requests this replica was sent (not re-entries)
        self.waker = Waker(replica.replica, replica.cfg.replicas, replica.cfg.board_port(),
                           getattr(replica.scheduler, "idle_sleeper", None))
        self.min_dwell_s = min_dwell_s
        self.parked: list[Any] = []  # requests waiting for a proposed merge
        self._tried: set[str] = set()  # rids parked once: never parked again
        self._seen = 0
        self._next_poll = self._next_publish = 0.0
        self._published: tuple | None = None  # the placement fields last published
        self._split_proposed_for: tuple[int, ...] | None = None
        self._split_retry_at = 0.0
        self.merges_proposed = self.splits_proposed = 0

    # ---- arrival of a request (wraps SGLang's handler) ----

    def admit(self, original: Any, scheduler: Any, recv_req: Any) -> Any:
        n = len(getattr(recv_req, "input_ids", None) or ())
        rid = getattr(recv_req, "rid", None)
        if rid not in self._tried and not is_health_check_generate_req(recv_req):
            self.received_requests += 1  # what the controller placed here (dispatch.py)
        if n < scheduler.max_req_input_len or rid in self._tried:
            return original(scheduler, recv_req)
        group = self.group_for_prompt(n)
        if group is None:
            return original(scheduler, recv_req)  # no group holds it: SGLang answers 400
        self._tried.add(rid)
        self.parked.append(recv_req)
        self.board.propose({"action": "merge", "group": list(group), "by":
                            self.replica.replica, "reason": f"a {n}-token prompt"})
        self.waker.wake_others()
        self.merges_proposed += 1
        logger.info("sglang-morph: AMOEBAs replica %d parks a %d-token prompt and proposes "
                    "merging %s", self.replica.replica, n, list(group))
        return None

    def group_for_prompt(self, prompt_tokens: int) -> tuple[int, ...] | None:
        """The smallest group holding this replica whose pool would admit the prompt (as
        SGLang admits: under the capacity and the context length, less its margin)."""
        r = self.replica
        for block in sorted(r.members, key=len):
            longest = max_request_tokens(r.context_len, r.capacity_after_merge(len(block)))
            if prompt_tokens < longest - r.input_len_margin:
                return block
        return None

    def load(self) -> dict[str, Any]:
        """What the board shows of this replica: its group, KV use and capacity, and its
        requests a replica alone could not hold (running or waiting)."""
        r = self.replica
        member = next(iter(r.members.values()))
        running, waiting = member.live_requests(), list(r.scheduler.waiting_queue)
        return {"group": list(r.unit), "kv_used_tokens": r.used_tokens(),
                "kv_capacity_tokens": int(r.pool.size),
                "kv_capacity_tokens_alone": r.kv_capacity_tokens_whole,
                "long_requests": sum(len(q.origin_input_ids) >= r.max_prompt_tokens_alone
                                     for q in (*running, *waiting)),
                # What the controller's policy places by: tokens admission reserves (prompt
                # + max_new_tokens) of the running requests, and of the waiting and parked
                "kv_reserved_tokens": sum(map(_reserved_tokens, running)),
                "kv_queued_tokens": sum(map(_reserved_tokens, (*waiting, *self.parked))),
                "received_requests": self.received_requests,
                "proposals_seen": self._seen}

    # ---- between batches ----

    def on_step(self) -> None:
        self.waker.drain()
        now = time.monotonic()
        load = self.load()
        # What placement reads is published as soon as it changes: a replica that just went
        # idle sleeps until a request wakes it (up to a second), and the controller sends it
        # none while the board still shows it full.
        placed = tuple(load[k] for k in _PLACEMENT_FIELDS)
        if now >= self._next_publish or placed != self._published:
            self.board.publish(self.replica.replica, load)
            self._published = placed
        if now >= self._next_publish:
            self._next_publish = now + _PUBLISH_S
            self._maybe_propose_split(now)
        if now < self._next_poll:
            return
        self._next_poll = now + _POLL_S
        for number, proposal in self.board.proposals_after(self._seen):
            self._seen = number
            group = tuple(proposal["group"])
            if self.replica.replica in group:
                self.replica.transition(group, merge=proposal["action"] == "merge",
                                        trigger="auto", reason=proposal["reason"],
                                        degree=int(proposal.get("degree", 1)))
            if group == self._split_proposed_for and proposal["action"] == "split":
                # Applied or refused (e.g. a member holds more than it could alone): the next
                # proposal waits a dwell.
                self._split_proposed_for = None
                self._split_retry_at = time.monotonic() + self.min_dwell_s
        if self.parked:
            parked, self.parked = self.parked, []
            for recv_req in parked:
                self.replica.scheduler.handle_generate_request(recv_req)

    def _maybe_propose_split(self, now: float) -> None:
        """The group's first member asks the scheduler's policy (``policy.py``, the code the
        simulator drives) whether the group it sees on the board is ready to split."""
        from sglang_morph.amoebas.dispatch import fleet_of

        r = self.replica
        if (not r.merged or r.unit[0] != r.replica or self._split_proposed_for == r.unit
                or now - r.merged_at < self.min_dwell_s or now < self._split_retry_at):
            return
        states = self.board.states(r.unit)
        if states is None or any(tuple(s["group"]) != r.unit for s in states.values()):
            return  # a member has not published since the merge
        # The group as the controller sees it (its requests' reserved tokens, admitted and
        # waiting): a split that fits only the tokens held now would leave a request that
        # grows to its max_new_tokens without room.
        splits = self.policy.maintenance(fleet_of(states, {}, {}, 0))
        if not splits:
            return
        (split,) = splits
        self._split_proposed_for = r.unit
        self.splits_proposed += 1
        self.board.propose({"action": "split", "group": list(r.unit), "by": r.replica,
                            "degree": split.degree, "reason": split.reason})
        self.waker.wake_others()
