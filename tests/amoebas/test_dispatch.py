"""AMOEBAs' placement in the data-parallel controller (``amoebas/dispatch.py``) against a board
written by hand: which replica each request is sent to, what waits, what the policy sees.
No server; the policy is the live one (``auto.live_policy``) over the default model's shapes."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from sglang_morph.amoebas import dispatch as D
from sglang_morph.amoebas.auto import live_policy
from sglang_morph.amoebas.policy import AmoebasPolicy, Merge, Request, UnitState
from tests.amoebas.test_policy import SMOLLM2, singles, tiny_capacity, unit

# What three replicas of the default model with 512-token pools publish (float32, page 1):
# the pool a TP 3 group's owner gets, and SGLang's longest prompt at each pool.
PARAMS = {"model": SMOLLM2, "dtype_bytes": 4, "replicas": 3, "page_size_tokens": 1,
          "groups": [[0, 1, 2]], "owner_tokens": [[1, 512], [3, 5632]],
          "max_prompt_tokens": [[1, 505], [3, 5625]]}


def test_placed_request_matches_what_the_replica_admits():
    assert D.placed_request("a", 100, 50, PARAMS) == Request("a", 100, 50)
    # SGLang caps max_new_tokens at the pool: a prompt a replica admits is never long.
    assert D.placed_request("b", 480, 100, PARAMS).kv_tokens == 512
    assert D.placed_request("c", 100, None, PARAMS).max_new_tokens == 128  # SGLang's default
    # A prompt only a group admits reserves more than a TP 1 pool, even with 1 new token.
    long = D.placed_request("d", 505, 1, PARAMS)
    assert long.kv_tokens == 513 and live_policy(PARAMS).capacity.is_long(long.kv_tokens)
    assert D.placed_request("e", 1500, 32, PARAMS).kv_tokens == 1532
    assert D.placed_request("f", 5625, 1, PARAMS) is None  # no group admits it


def state(group, reserved=0, queued=0, capacity=512, long=0, received=0, seen=0):
    return {"group": list(group), "kv_reserved_tokens": reserved, "kv_queued_tokens": queued,
            "kv_capacity_tokens": capacity, "long_requests": long,
            "received_requests": received, "proposals_seen": seen}


def test_fleet_of_the_board():
    states = {0: state([0], reserved=100), 1: state([1], queued=50), 2: state([2])}
    fleet = D.fleet_of(states, {2: 70}, {}, 4)
    assert [u.members for u in fleet.units] == [(0,), (1,), (2,)]
    assert [u.load_tokens(0) for u in fleet.units] == [100, 50, 70]  # in flight counts
    assert fleet.dispatched_requests == 4
    # A proposal replica 1 has not run yet: it is transitioning, the others are not.
    fleet = D.fleet_of(states, {}, {5: (1, 2)}, 0)
    assert [u.transitioning for u in fleet.units] == [False, True, True]
    # A merged group every member publishes is one unit; its state follows its long requests.
    merged = {r: state([0, 1, 2], capacity=5632, long=int(r == 1), seen=5) for r in range(3)}
    (group,) = D.fleet_of(merged, {}, {5: (0, 1, 2)}, 0).units
    assert group.members == (0, 1, 2) and group.state is UnitState.SERVING
    drained = {r: state([0, 1, 2], capacity=5632, seen=5) for r in range(3)}
    assert D.fleet_of(drained, {}, {}, 0).units[0].state is UnitState.DRAINING
    # Members that do not agree yet (one published the merge, two did not) are transitioning.
    half = {0: state([0, 1, 2]), 1: state([1]), 2: state([2])}
    assert all(u.transitioning and u.degree == 1 for u in D.fleet_of(half, {}, {}, 0).units)


def test_live_policy_merges_only_allowed_groups():
    capacity = tiny_capacity()
    pool2 = capacity.owner_capacity_tokens(2)
    long = Request("long", pool2 - 16, 16)
    # Replica 1 and 2 are the least loaded: the simulator's policy pairs them ...
    used = {0: 900, 1: 0, 2: 100, 3: 900}
    fleet = D.Fleet(tuple(singles(capacity, used)))
    free = AmoebasPolicy(capacity).dispatch(long, fleet)
    assert isinstance(free, Merge) and free.members == (1, 2)
    # ... a live server only forms its aligned groups: replica 1's pair is [0, 1].
    groups = ((0, 1), (2, 3), (0, 1, 2, 3))
    live = AmoebasPolicy(capacity, groups=groups, merge_from_degrees=(1,)).dispatch(long, fleet)
    assert live == Merge((0, 1), 2, 1, ((0,), (1,)))
    # Two TP 2 groups make a TP 4 (a live server too: its groups nest in shard order);
    # ``merge_from_degrees`` can keep merges to replicas alone.
    pool4 = capacity.owner_capacity_tokens(4)
    longer = Request("longer", pool4 - 16, 16)
    pairs = D.Fleet((unit(capacity, (0, 1), [(0, 100, True, True)]),
                     unit(capacity, (2, 3), [(2, 100, True, True)])))
    assert AmoebasPolicy(capacity, groups=groups).dispatch(longer, pairs).members == (0, 1, 2, 3)
    assert isinstance(AmoebasPolicy(capacity, groups=groups, merge_from_degrees=(1,))
                      .dispatch(longer, pairs), D.Queue)


@dataclasses.dataclass
class FakeReq:
    rid: str
    input_ids: list
    max_new_tokens: int | None = 16
    routed_dp_rank: int | None = None

    @property
    def sampling_params(self) -> Any:
        return dataclasses.make_dataclass("S", [("max_new_tokens", Any)])(self.max_new_tokens)


class FakeBoard:
    def __init__(self, states):
        self.states_now, self.proposals = states, []

    def states(self, replicas):
        return {r: self.states_now[r] for r in replicas}

    def proposals_after(self, seen):
        return [(n, p) for n, p in self.proposals if n > seen]


class FakeController:
    def __init__(self):
        self.workers = [f"socket{r}" for r in range(3)]

    def maybe_external_dp_rank_routing(self, req):
        return req.routed_dp_rank is not None


@pytest.fixture
def placed(monkeypatch):
    """A dispatcher over a hand-written board; returns (dispatcher, board, sends)."""
    sends: list[tuple[str, str]] = []
    import sglang.srt.managers.io_struct as io

    monkeypatch.setattr(io, "sock_send", lambda socket, req: sends.append((socket, req.rid)))
    controller = FakeController()
    cfg = dataclasses.make_dataclass("C", [("replicas", int)])(3)
    dispatcher = D.AmoebasDispatcher(controller, cfg)
    board = FakeBoard({r: state([r]) for r in range(3)})
    dispatcher.board, dispatcher.params = board, PARAMS
    dispatcher.policy = live_policy(PARAMS)
    return dispatcher, board, sends


def test_a_burst_spreads_before_the_board_shows_it(placed):
    dispatcher, board, sends = placed
    # Replica 0 already holds most of its pool: nothing short goes there.
    board.states_now[0] = state([0], reserved=450)
    for k in range(4):
        dispatcher.dispatch(FakeReq(f"s{k}", [1] * 84))  # 100 tokens each
    # The board has not changed, but each send counts as queued where it went.
    assert sends == [("socket1", "s0"), ("socket2", "s1"), ("socket1", "s2"),
                     ("socket2", "s3")]
    # Replica 1 publishes that it received both: they count once, as its own queue.
    board.states_now[1] = state([1], queued=200, received=2)
    fleet = dispatcher._fleet(dispatcher._read_board())
    assert fleet.units[1].load_tokens(0) == 200 and fleet.units[2].load_tokens(0) == 200


def test_what_fits_nowhere_waits_in_order_and_goes_when_room_frees(placed):
    dispatcher, board, sends = placed
    for r in range(3):
        board.states_now[r] = state([r], reserved=480)
    dispatcher.dispatch(FakeReq("wait1", [1] * 84))
    dispatcher.dispatch(FakeReq("wait2", [1] * 10, max_new_tokens=4))  # fits, but behind
    assert sends == [] and dispatcher.tick() == D.RETRY_MS
    board.states_now[2] = state([2], reserved=0)
    assert dispatcher.tick() is None
    assert sends == [("socket2", "wait1"), ("socket2", "wait2")]


def test_long_prompt_goes_to_the_owner_and_refusals_to_sglang(placed):
    dispatcher, board, sends = placed
    board.states_now[0] = state([0], reserved=300)
    dispatcher.dispatch(FakeReq("long", [1] * 1500))
    assert sends == [("socket1", "long")]  # the least-loaded owner parks it and merges
    dispatcher.dispatch(FakeReq("huge", [1] * 6000))  # SGLang answers 400 on round-robin
    dispatcher.dispatch(FakeReq("routed", [1] * 10, routed_dp_rank=0))
    assert sends[1:] == [("socket1", "huge")]  # the routed one went SGLang's own way
    assert dispatcher.sent_count == [1, 2, 0]
    # While a proposal names the members, nothing is placed on them.
    board.proposals = [(1, {"group": [0, 1, 2]})]
    dispatcher.dispatch(FakeReq("later", [1] * 10))
    assert len(sends) == 2 and len(dispatcher.queue) == 1
    for r in range(3):
        board.states_now[r] = state([0, 1, 2], capacity=5632, long=int(r == 1), seen=1,
                                    received=dispatcher.sent_count[r])
    dispatcher.tick()
    assert sends[-1] == ("socket0", "later")  # the group serves: its least-loaded member


def test_a_proposal_wakes_an_idle_scheduler_at_once(tmp_path):
    """SGLang's own IdleSleeper (``--sleep-on-idle``) sleeps a second on a silent socket; a
    proposer's wake ends the sleep at once, and a drained wake does not end the next one."""
    import threading
    import time

    import zmq
    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

    from sglang_morph.amoebas.auto import Waker

    silent = zmq.Context.instance().socket(zmq.PULL)
    silent.bind(f"ipc://{tmp_path}/scheduler")  # the scheduler's own socket: nothing arrives
    sleeper = IdleSleeper([silent])
    port = 40000 + os.getpid() % 20000
    sleeping, proposer = Waker(1, 2, port, sleeper), Waker(0, 2, port, None)

    def slept_s() -> float:
        started = time.perf_counter()
        sleeper.maybe_sleep()
        return time.perf_counter() - started

    assert slept_s() > 0.9
    threading.Timer(0.1, proposer.wake_others).start()
    assert slept_s() < 0.6
    sleeping.drain()
    assert slept_s() > 0.9
