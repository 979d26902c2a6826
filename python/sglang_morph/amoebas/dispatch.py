"""AMOEBAs' transformation-aware placement, in SGLang's data-parallel controller process.

SGLang's controller places every request round-robin, whatever a replica holds. Under
``--enable-amoebas`` (automatic transitions) its dispatch function is this module's
``AmoebasDispatcher.dispatch``: a request is placed by ``policy.AmoebasPolicy.dispatch``, the
code the simulator drives, over the fleet the replicas publish on their board (``auto.Board``):

- ``Dispatch``: sent to that member (the least-loaded one whose own pool has room for the
  prompt + max_new_tokens now; a long prompt may join a group already merged).
- ``Merge``: sent to the owner it names, which parks the prompt and proposes the merge of its
  group (``auto.AutoControl.admit``); the policy only names groups the server allows, formed
  from TP 1 replicas.
- ``Queue``: held here, first come first served, and placed again whenever the controller's
  loop wakes (every ``RETRY_MS`` while something waits). A merged group with no long request
  left takes no new request, so it drains and splits.
- ``Refuse`` (no group could hold the prompt): sent on round-robin, so the replica's SGLang
  answers the 400 it would answer without AMOEBAs.

What the board shows is up to ``auto._PUBLISH_S`` old. A request this controller sent that a
replica has not yet counted (each publishes how many it received) counts as queued there, so a
burst does not land on one member. A member named in a proposal it has not run yet counts as
transitioning: nothing is placed on it. Health checks and requests routed to a rank
(``routed_dp_rank``) keep SGLang's path; until every replica has published, requests go
round-robin.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from sglang_morph.amoebas.policy import (
    Dispatch,
    Fleet,
    Merge,
    Queue,
    Refuse,
    Request,
    Unit,
    UnitRequest,
)

logger = logging.getLogger("sglang_morph.amoebas")

RETRY_MS = 20  # how often queued requests are placed again


def placed_request(rid: str, prompt_tokens: int, max_new_tokens: int | None,
                   params: dict[str, Any]) -> Request | None:
    """The request as the policy sees it, or None when no group admits the prompt.

    Its degree is the smallest whose SGLang admits the prompt (``max_prompt_tokens``, as the
    replica decides to park it); its max_new_tokens is capped at that degree's pool, as SGLang
    caps it. A prompt only a group admits reserves more than a TP 1 pool, so the policy and the
    replica agree that it is long."""
    limits = sorted((int(d), int(n)) for d, n in params["max_prompt_tokens"])
    owner = dict((int(d), int(n)) for d, n in params["owner_tokens"])
    degree = next((d for d, limit in limits if prompt_tokens < limit), None)
    if degree is None:
        return None
    wanted = 128 if max_new_tokens is None else int(max_new_tokens)  # SGLang's default
    tokens = min(prompt_tokens + max(1, wanted), owner[degree])
    if degree > 1:
        tokens = max(tokens, owner[1] + 1)
    return Request(rid, prompt_tokens, max(1, tokens - prompt_tokens))


def fleet_of(states: dict[int, dict[str, Any]], in_flight_tokens: dict[int, int],
             pending: dict[int, tuple[int, ...]], dispatched: int) -> Fleet:
    """The fleet the board shows. ``states``: every replica's published load (``auto.load``);
    ``in_flight_tokens``: sent here, not yet counted by the replica; ``pending``: proposals by
    number. A replica whose group its members do not all publish yet, or that has a proposal
    to run, is a transitioning unit."""
    units, done = [], set()
    claims: dict[int, set[tuple[int, ...]]] = {}  # the groups each replica is said to be in
    for s in states.values():
        for m in s["group"]:
            claims.setdefault(m, set()).add(tuple(s["group"]))
    for r in sorted(states):
        if r in done:
            continue
        group = tuple(states[r]["group"])
        agreed = all(claims.get(m) == {group} for m in group)
        members = group if agreed else (r,)
        done |= set(members)
        busy = not agreed or any(
            n > states[m]["proposals_seen"] and m in names
            for m in members for n, names in pending.items())
        s = [states[m] for m in members]
        units.append(Unit(
            members=members, degree=len(members),
            kv_capacity_tokens=tuple(x["kv_capacity_tokens"] for x in s),
            kv_used_tokens=tuple(x["kv_reserved_tokens"] for x in s),
            kv_queued_tokens=tuple(x["kv_queued_tokens"] + in_flight_tokens.get(m, 0)
                                   for m, x in zip(members, s)),
            # Only whether a group still has long requests matters here (its state).
            requests=tuple(UnitRequest(f"{m}/long{i}", m, 0, long=True)
                           for m, x in zip(members, s) for i in range(x["long_requests"])),
            transitioning=busy))
    return Fleet(tuple(units), dispatched)


class AmoebasDispatcher:
    """The controller's placement (controller thread only). Invariant: every request handed to
    ``dispatch`` is sent to exactly one replica, now or from the queue."""

    def __init__(self, controller: Any, cfg: Any):
        self.controller, self.cfg = controller, cfg
        self.replicas = cfg.replicas
        self.queue: collections.deque = collections.deque()
        self.board = self.params = self.policy = None
        self.sent: dict[int, list[tuple[int, int]]] = {r: [] for r in range(self.replicas)}
        self.sent_count = [0] * self.replicas
        self.proposals: dict[int, tuple[int, ...]] = {}
        self.proposals_read = 0
        self.dispatched = 0
        self.decisions: collections.Counter = collections.Counter()

    @classmethod
    def install(cls, controller: Any, cfg: Any) -> "AmoebasDispatcher":
        """Replace the controller's dispatch function (after its ``init_dispatcher``)."""
        dispatcher = cls(controller, cfg)
        controller.dispatching = dispatcher.dispatch
        controller.sglang_morph_tick = dispatcher.tick
        logger.info("sglang-morph: AMOEBAs places requests in the data-parallel controller")
        return dispatcher

    # ---- entry points (the controller's loop) ----

    def dispatch(self, req: Any) -> None:
        if self.controller.maybe_external_dp_rank_routing(req):
            self._count(req.routed_dp_rank, 0)
            return
        self.queue.append(req)
        self._place_queued()

    def tick(self) -> int | None:
        """Place what waits; the milliseconds until the loop should wake again (None: when a
        request arrives)."""
        if not self.queue:
            return None
        self._place_queued()
        return RETRY_MS if self.queue else None

    # ---- placement ----

    def _place_queued(self) -> None:
        # The board once per pass (its reads are round trips to replica 0's store); within
        # the pass each placement counts as in flight where it went (``_fleet``).
        states = self._read_board()
        while self.queue:
            req = self.queue[0]
            if states is None:  # the board is not complete yet: SGLang's round-robin
                self._send(self.queue.popleft(), self.dispatched % self.replicas, 0)
                continue
            fleet = self._fleet(states)
            request = placed_request(str(req.rid), len(req.input_ids),
                                     req.sampling_params.max_new_tokens, self.params)
            decision = (Refuse("no group admits the prompt") if request is None
                        else self.policy.dispatch(request, fleet))
            self.decisions[type(decision).__name__] += 1
            if isinstance(decision, Queue):
                return  # first come, first served: later requests wait behind this one
            self.queue.popleft()
            if isinstance(decision, (Dispatch, Merge)):
                self._send(req, decision.member, request.kv_tokens)
                if isinstance(decision, Merge):
                    logger.info("sglang-morph: AMOEBAs places a %d-token prompt on replica %d "
                                "to merge %s", request.prompt_tokens, decision.member,
                                list(decision.members))
            else:  # the replica answers SGLang's own 400
                self._send(req, self.dispatched % self.replicas, 0)

    def _send(self, req: Any, replica: int, kv_tokens: int) -> None:
        from sglang.srt.managers.io_struct import sock_send

        sock_send(self.controller.workers[replica], req)
        self._count(replica, kv_tokens)

    def _count(self, replica: int, kv_tokens: int) -> None:
        self.sent_count[replica] += 1
        self.sent[replica].append((self.sent_count[replica], kv_tokens))
        self.dispatched += 1

    def _read_board(self) -> dict[int, dict[str, Any]] | None:
        """Every replica's published load (None until the board is complete); reads the new
        proposals and forgets what the replicas have counted or run."""
        if self.policy is None and not self._connect():
            return None
        states = self.board.states(tuple(range(self.replicas)))
        if states is None:
            return None
        for number, proposal in self.board.proposals_after(self.proposals_read):
            self.proposals[number] = tuple(proposal["group"])
            self.proposals_read = number
        seen = min(s["proposals_seen"] for s in states.values())
        self.proposals = {n: g for n, g in self.proposals.items() if n > seen}
        for r, sent in self.sent.items():
            received = states[r]["received_requests"]
            sent[:] = [(n, t) for n, t in sent if n > received]
        return states

    def _fleet(self, states: dict[int, dict[str, Any]]) -> Fleet:
        """The fleet the board shows plus what was sent here since each replica counted."""
        in_flight = {r: sum(t for _, t in sent) for r, sent in self.sent.items()}
        return fleet_of(states, in_flight, self.proposals, self.dispatched)

    def _connect(self) -> bool:
        """The board and the policy, once replica 0 hosts the board and has published."""
        from sglang_morph.amoebas.auto import Board, live_policy

        if self.board is None:
            try:
                self.board = Board(None, self.replicas, self.cfg.board_port())
            except Exception:  # not up yet: round-robin meanwhile
                logger.debug("sglang-morph: AMOEBAs board not reachable yet", exc_info=True)
                return False
        self.params = self.board.policy_params()
        if self.params is None:
            return False
        self.policy = live_policy(self.params)
        return True
