"""KunServe's automatic control (``--kunserve-auto``) without a server: bad
``--kunserve-auto`` / ``--kunserve-auto-config`` values are a CLI error naming the flag and the
problem and attach nothing; a replica's view and the leader's and followers' steps on
stand-ins (a pair, a group of four). Live, on four replicas (two pairs):
``test_kunserve_pairs_server.py``; a group of four: ``test_kunserve_group4_server.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from sglang_morph.kunserve.live import config as kunserve_config
from sglang_morph.surface import PluginError
from test_kunserve import planner, spec  # noqa: F401  (fixtures)
from test_kunserve_live import configure_kunserve, launch_args

# The live servers' controller (test_kunserve_pairs_server.py): fast enough for a test.
AUTO = {"interval_ms": 100, "drop_persist": 2, "restore_persist": 3, "min_dwell_s": 1.0}


def _replica(waiting: int, running: int, batch_is_full: bool, max_running: int = 8,
             prompt: int = 100, ignore_eos: bool = False):
    """A stand-in for a live replica's scheduler state, as ``local_view`` reads it: 500 free
    tokens of 910, ``running`` requests of 10 prompt tokens with 8 outputs to go, ``waiting``
    prompts of ``prompt`` tokens and 8 outputs, SGLang's new-token ratio 0.7."""
    import types

    req = lambda n: types.SimpleNamespace(  # noqa: E731
        origin_input_ids=[1] * n, output_ids=[], sampling_params=types.SimpleNamespace(
            max_new_tokens=8, ignore_eos=ignore_eos))
    sched = types.SimpleNamespace(
        waiting_queue=[req(prompt)] * waiting, max_running_requests=max_running,
        running_batch=types.SimpleNamespace(batch_is_full=batch_is_full),
        tree_cache=types.SimpleNamespace(evictable_size=lambda: 0),
        new_token_ratio_tracker=types.SimpleNamespace(current=0.7))
    from sglang_morph.kunserve.controller import StepCostMeter

    return types.SimpleNamespace(
        scheduler=sched, epoch=0, subgroup=[0], live_requests=lambda: [req(10)] * running,
        pool=types.SimpleNamespace(size=910),
        allocator=types.SimpleNamespace(available_size=lambda: 500), step_costs=StepCostMeter())


@pytest.mark.parametrize("waiting, running, full, max_running, refused", [
    (1, 2, True, 8, 1),  # SGLang tried and found no KV room: refused
    (0, 2, True, 8, 0),  # nothing waits
    (1, 2, False, 8, 0),  # not tried yet (or room was found)
    (1, 8, True, 8, 0),  # the request-count limit, which a drop does not lift
])
def test_local_view_reports_a_queue_sglang_refused(waiting, running, full, max_running,
                                                   refused):
    from sglang_morph.kunserve.live.auto import local_view, snapshot

    view = local_view(_replica(waiting, running, full, max_running), finishing_steps=8)
    assert view["queue_refused"] == refused
    # Each running request has 10 prompt tokens, no output yet and 8 to go: all finishing.
    assert view["kv_finishing_tokens"] == min(running * 18, 410 + running * 8)
    assert local_view(_replica(waiting, running, full, max_running),
                      finishing_steps=7)["kv_finishing_tokens"] == 0
    assert view["waiting_tokens"] == waiting * 108 and view["kv_used_tokens"] == 410
    assert snapshot(0, view).queue_refused is bool(refused)
    # The queue's waits: 910 tokens less the 410 - running * 10 no running request holds,
    # less the running requests' 18 each, leave 500 - running * 8, which takes every
    # 108-token prompt at once (wait 0) up to four of them.
    assert view["queued_prompt_tokens"] == waiting * 100
    assert view["queue_wait_steps"] == 0 and snapshot(0, view).queue_wait_steps == 0
    assert snapshot(0, view).running_requests == running


def test_local_view_predicts_the_queues_wait_from_the_running_requests_ends():
    """Two running requests (10 prompt tokens, 8 outputs to go) hold 20 of the 410 used
    tokens, so 520 tokens are theirs and the queue's, less their 18-token reservations: 484.
    The queue's head (100 + 8) fits now; the next (372 + 8) needs 488, room a running
    request gives back at its end, 8 steps from now."""
    import types

    from sglang_morph.kunserve.live.auto import local_view, snapshot

    replica = _replica(1, 2, True, prompt=100)
    long_one = types.SimpleNamespace(origin_input_ids=[1] * 372, output_ids=[],
                                     sampling_params=types.SimpleNamespace(
                                         max_new_tokens=8, ignore_eos=False))
    replica.scheduler.waiting_queue = replica.scheduler.waiting_queue + [long_one]
    view = local_view(replica)
    assert view["queued_prompt_tokens"] == 472
    assert view["queue_wait_steps"] == 0 + 8
    assert snapshot(0, view).queue_wait_steps == 8.0
    assert view["queue_drain_steps"] == 8 and snapshot(0, view).queue_drain_steps == 8.0
    # The arrival rates are the caller's (AutoControl's meter), passed through.
    view = local_view(replica, arrivals=(0.25, 30.0))
    assert (snapshot(0, view).arrivals_per_step,
            snapshot(0, view).arrival_prompt_tokens_per_step) == (0.25, 30.0)
    # The replica's measured prefill tokens per decode step: none before its forwards, then
    # what its meter gives, passed to the controller's snapshot
    assert view["prefill_tokens_per_step"] is None
    assert snapshot(0, view).prefill_tokens_per_step is None
    replica.step_costs.record(True, 2, 0.1)
    replica.step_costs.record(False, 350, 1.0)
    view = local_view(replica)
    assert view["prefill_tokens_per_step"] == pytest.approx(35.0)
    assert snapshot(0, json.loads(json.dumps(view))).prefill_tokens_per_step == pytest.approx(35.0)
    # A third like it waits for the second's room: the running requests and the queue's head
    # end at 8, the second at 16.
    replica.scheduler.waiting_queue = replica.scheduler.waiting_queue + [long_one]
    assert local_view(replica)["queue_drain_steps"] == 16
    # A prompt over the 520 tokens a whole replica has for requests never fits: no wait to
    # give, and the view stays strict JSON (/kunserve/status shows the views a decision saw);
    # the controller reads inf.
    replica.scheduler.waiting_queue = replica.scheduler.waiting_queue + [
        types.SimpleNamespace(origin_input_ids=[1] * 520, output_ids=[],
                              sampling_params=types.SimpleNamespace(max_new_tokens=8,
                                                                    ignore_eos=False))]
    view = local_view(replica)
    assert view["queue_wait_steps"] is None and view["queue_drain_steps"] is None
    parsed = snapshot(0, json.loads(json.dumps(view, allow_nan=False)))
    assert parsed.queue_wait_steps == parsed.queue_drain_steps == math.inf


def test_local_view_sees_the_refusal_sglang_s_next_attempt_makes():
    """Before SGLang has tried the queue (its batch not full), the view says refused when the
    head's prompt and outputs do not fit the free tokens less the running requests' remaining
    outputs, scaled by SGLang's new-token ratio unless they ignore EOS: 480 + 8 tokens fit
    500 - 2 x 8 x 0.7 but not 500 - 2 x 8."""
    from sglang_morph.kunserve.live.auto import admission_refuses, local_view

    assert local_view(_replica(1, 2, False, prompt=480))["queue_refused"] == 0
    assert local_view(_replica(1, 2, False, prompt=480, ignore_eos=True))["queue_refused"] == 1
    assert local_view(_replica(1, 2, False, prompt=490))["queue_refused"] == 1
    assert local_view(_replica(1, 8, False, prompt=490))["queue_refused"] == 0  # the count
    idle = _replica(0, 2, False)
    assert admission_refuses(idle.scheduler, idle.live_requests(), 0) is False  # no queue


@pytest.mark.parametrize("merged", [False, True])
def test_the_runner_hook_times_a_whole_replicas_forwards_only(merged):
    """``around_runner_forward`` hands a whole replica's forward and its time to
    ``record_whole_forward``, whose decode steps and prefills ``step_costs`` weighs; a merged
    replica's forwards (its share of the layers) are not a whole replica's and are left out,
    as is a batch that mixes prefill and decode."""
    import threading
    import time
    import types

    from sglang_morph.kunserve.controller import StepCostMeter
    from sglang_morph.kunserve.live.hooks import around_runner_forward
    from sglang_morph.kunserve.live.replica import KunServeReplica

    def batch(mode: str, new: list[int]):
        return types.SimpleNamespace(
            forward_mode=types.SimpleNamespace(is_decode=lambda: mode == "decode",
                                               is_extend=lambda: mode != "decode",
                                               name=mode.upper()),
            seq_lens_cpu=types.SimpleNamespace(tolist=lambda: [10] * len(new)),
            extend_prefix_lens_cpu=[0] * len(new), extend_seq_lens_cpu=new)

    replica = types.SimpleNamespace(
        merged=merged, compute_lock=threading.Lock(), step_costs=StepCostMeter(),
        hold_for_peer_prefill=lambda: None, send_ahead=lambda fb: None,
        settle_ahead=lambda: None)
    replica.record_whole_forward = lambda fb, s: KunServeReplica.record_whole_forward(
        replica, fb, s)
    # Merged, the hook counts the decode steps since the last prefill (admission pacing)
    replica.decodes_since_prefill = 5
    replica.count_merged_forward = lambda fb: KunServeReplica.count_merged_forward(replica, fb)
    runner = types.SimpleNamespace(kunserve=replica)

    def forward(runner, fb, seconds):
        time.sleep(seconds)
        return fb

    counted = []
    for fb, seconds in ((batch("decode", [1, 1]), 0.05), (batch("extend", [300, 100]), 0.2),
                        (batch("decode", [1, 1]), 0.05), (batch("mixed", [200, 1]), 0.5)):
        assert around_runner_forward(forward, runner, fb, seconds) is fb
        counted.append(replica.decodes_since_prefill)
    rate = replica.step_costs.prefill_tokens_per_step()
    if merged:
        assert rate is None
        assert counted == [6, 0, 1, 0]
    else:
        # 0.05 s a decode step, 400 tokens in 0.2 s: 100 tokens a step (a sleep overshoots by
        # a few milliseconds; the mixed batch's 0.5 s would read 40)
        assert 70 < rate < 130
        assert counted == [5] * 4  # whole: nothing paces


def test_a_queue_the_merged_cap_holds_is_not_a_kv_refusal():
    from sglang_morph.kunserve.live.auto import local_view

    capped = _replica(1, 2, True)
    capped.merged_max_running = 2
    capped.merged = True  # two running: SGLang's batch is full by the cap, not for KV
    assert local_view(capped)["queue_refused"] == 0
    capped.merged = False  # whole, the cap does not apply: a full batch under 8 is KV
    assert local_view(capped)["queue_refused"] == 1
    capped.merged, capped.merged_max_running = True, 3  # under the cap: KV again
    assert local_view(capped)["queue_refused"] == 1
    # Admission pacing holds the cap at the two running: not KV either, with or without
    # the merged cap, and not once it is put back
    capped.paced_cap = 2
    assert local_view(capped)["queue_refused"] == 0
    capped.merged_max_running = None
    assert local_view(capped)["queue_refused"] == 0
    capped.paced_cap = None
    assert local_view(capped)["queue_refused"] == 1

@pytest.mark.parametrize("flags, message", [
    (dict(kunserve_auto=True), "--kunserve-auto needs --enable-kunserve"),
    (dict(kunserve_auto=True, kunserve_auto_config="{}"),
     "--kunserve-auto, --kunserve-auto-config need --enable-kunserve"),
    (dict(enable_kunserve=True, kunserve_auto_config="{}"),
     "--kunserve-auto-config needs --kunserve-auto"),
    (dict(enable_kunserve=True, kunserve_auto=True, kunserve_auto_config="{drop"),
     "--kunserve-auto-config is not JSON"),
    (dict(enable_kunserve=True, kunserve_auto=True, kunserve_auto_config="[1]"),
     "--kunserve-auto-config must be a JSON object"),
    (dict(enable_kunserve=True, kunserve_auto=True, kunserve_auto_config='{"drop": 1}'),
     "--kunserve-auto-config: unknown fields ['drop']"),
    (dict(enable_kunserve=True, kunserve_auto=True, kunserve_auto_config='{"drop_persist": 0}'),
     "drop_persist must be an integer >= 1, got 0"),
    (dict(enable_kunserve=True, kunserve_auto=True,
          kunserve_auto_config='{"restore_persist": 2.5}'),
     "restore_persist must be an integer >= 1, got 2.5"),
    (dict(enable_kunserve=True, kunserve_auto=True,
          kunserve_auto_config='{"restore_usage": 1.5}'),
     "restore_usage and restore_headroom must be in (0, 1]"),
    (dict(enable_kunserve=True, kunserve_auto=True, kunserve_auto_config='{"min_dwell_s": -1}'),
     "bad controller config"),
    (dict(enable_kunserve=True, kunserve_auto=True, kunserve_auto_config='{"interval_ms": 0}'),
     "interval_ms must be a number in [1, 60000], got 0"),
    (dict(enable_kunserve=True, kunserve_auto=True,
          kunserve_auto_config='{"partial_drop": "yes"}'),
     "partial_drop must be true or false"),
])
def test_bad_auto_flags_are_a_cli_error(flags, message):
    server_args = launch_args()
    with pytest.raises(PluginError, match="sglang-morph: error: ") as e:
        configure_kunserve(server_args, argparse.Namespace(**flags), False)
    assert message in str(e.value)
    assert not hasattr(server_args, kunserve_config.SERVER_ARGS_ATTR)  # nothing attached


def test_auto_config_defaults_and_overrides():
    from_cli = kunserve_config.KunServeLiveConfig.from_cli_namespace
    cfg = from_cli(argparse.Namespace(enable_kunserve=True, kunserve_auto=True,
                                      kunserve_auto_config=json.dumps(AUTO))).auto
    assert (cfg.interval_ms, cfg.controller.min_dwell_s, cfg.controller.restore_usage) == (
        100, 1.0, 0.5)
    assert cfg.controller.restore_persist == 3
    assert cfg.as_dict() == {**dataclasses.asdict(kunserve_config.AutoControlConfig().controller),
                             **AUTO}
    assert from_cli(argparse.Namespace(enable_kunserve=True, kunserve_auto=True)).auto == (
        kunserve_config.AutoControlConfig())
    assert from_cli(argparse.Namespace(enable_kunserve=True)).auto is None  # operator only


class _Group:
    """Stand-in replicas of one group (a pair by default) for ``AutoControl``: a real
    in-memory store as the link's mailbox, each replica's view set by the test, and voted
    transitions reduced to their record (the test says which outcome each has)."""

    def __init__(self, planner, cfg, size: int = 2):
        import types

        from torch.distributed import HashStore

        from sglang_morph.kunserve.live import auto

        self.outcome = "applied"
        # (rank, merge, trigger, the replicas that change) of every transition entered
        self.entered: list[tuple[int, bool, str, tuple[int, ...]]] = []
        mailbox = HashStore()
        self.replicas = [types.SimpleNamespace(
            rank=rank, link=types.SimpleNamespace(mailbox=mailbox, replicas=tuple(range(size))),
            planner=planner,
            scheduler=types.SimpleNamespace(server_args=None, waiting_queue=[],
                                            running_batch=None, forward_ct=0),
            live_requests=lambda: [], merged=False,
            group=types.SimpleNamespace(replicas=tuple(range(size))), last_transition=None,
            view=None, elastic_state=lambda: {}, check_integrity=lambda: None)
            for rank in range(size)]
        for r in self.replicas:
            r.transition = (lambda merge, trigger, reason, group, r=r:
                            self._transition(r, merge, trigger, reason, group))
        self.autos = [auto.AutoControl(r, cfg) for r in self.replicas]
        self.now_s = 100.0
        for a in self.autos:
            a.loop.clock = lambda: self.now_s

    def _transition(self, replica, merge: bool, trigger: str, reason: str, group):
        from sglang_morph.elastic.contract import Outcome, Transition
        from sglang_morph.elastic.record import recorder

        self.entered.append((replica.rank, merge, trigger, tuple(group)))
        outcome = Outcome(self.outcome)
        replica.last_transition = recorder(replica.scheduler).record(Transition(
            mechanism="kunserve", replica=replica.rank, action="drop" if merge else "restore",
            reason=reason, outcome=outcome, duration_s=0.0, capacity_before_tokens=0,
            capacity_after_tokens=0))
        return (200 if outcome is Outcome.APPLIED else 409), {}

    def step(self, advance_s: float) -> None:
        self.now_s += advance_s
        for a in reversed(self.autos):  # the followers publish, then the leader decides
            a.on_step()


def _queued(rid: str, prompt_tokens: int = 100):
    """A queued request as the arrival meter reads it (its id and prompt)."""
    import types

    return types.SimpleNamespace(rid=rid, origin_input_ids=[1] * prompt_tokens)


def _views(planner, growth: int) -> dict[str, int]:
    full = planner.full_replica().kv_capacity_tokens
    return {"epoch": 0, "kv_capacity_tokens": full, "kv_used_tokens": full // 2,
            "kv_growth_tokens": growth * full, "waiting_tokens": 0, "running_reqs": 1,
            "waiting_reqs": 0, "queue_refused": 0}


def _calm_group(planner, monkeypatch, interval_ms: float, size: int = 2):
    """A group (a pair by default) whose views (set by the test) show every replica half
    full, nothing growing."""
    from sglang_morph.kunserve.controller import ControllerConfig
    from sglang_morph.kunserve.live import auto

    monkeypatch.setattr(auto, "local_view", lambda replica, *_: dict(replica.view))
    cfg = kunserve_config.AutoControlConfig(
        interval_ms=interval_ms, controller=ControllerConfig(drop_persist=2, min_dwell_s=5.0))
    group = _Group(planner, cfg, size)
    for r in group.replicas:
        r.view = dict(_views(planner, growth=0), group=[r.rank])
    return group, cfg


def test_the_leader_decides_on_the_elastic_loop_and_the_follower_enters_its_proposal(
        planner, monkeypatch):
    from sglang_morph.elastic.record import recorder
    from sglang_morph.kunserve.live import auto

    pair, cfg = _calm_group(planner, monkeypatch, interval_ms=100)
    leader, follower = pair.autos
    pair.step(0.0)
    assert (leader.views, follower.views, leader.proposals) == (1, 1, 0)
    pair.step(0.05)  # within the interval: nobody observes again
    assert (leader.views, follower.views) == (1, 1)

    for r in pair.replicas:  # the running requests' outputs would outgrow both pools
        r.view = dict(_views(planner, growth=1), group=[r.rank])
    pair.step(0.1)
    assert leader.proposals == 0  # over for one view; drop_persist is 2
    pair.step(0.1)
    assert leader.proposals == 1 and leader.last_decision["merge"] is True
    assert "for 2 views" in leader.last_decision["reason"]
    assert pair.entered == [(0, True, "auto", (0, 1))]
    pair.step(0.02)  # the follower polls the proposal between its batches
    assert follower.proposals == 1 and pair.entered == [(0, True, "auto", (0, 1)),
                                                        (1, True, "auto", (0, 1))]
    # The pair's transition recorded itself once; the loop's record of it changed nothing.
    assert recorder(pair.replicas[0].scheduler).totals == {("kunserve", "applied"): 1}

    # A refused automatic transition makes the leader wait before proposing again.
    leader.controller = auto.KunServeController(planner, cfg.controller)
    pair.outcome = "refused"
    pair.step(0.1)
    pair.step(0.1)
    assert leader.proposals == 2 and leader.last_decision["status_code"] == 409
    pair.step(0.1)
    pair.step(0.1)
    assert leader.proposals == 2  # waiting max(1 s, min_dwell_s) after the refusal
    assert recorder(pair.replicas[0].scheduler).totals == {
        ("kunserve", "applied"): 1, ("kunserve", "refused"): 1}

    # A view from before the last transition is not used.
    pair.replicas[1].view = dict(pair.replicas[1].view, epoch=1)
    before = leader.stale_views
    pair.step(0.1)
    assert leader.stale_views == before + 1


def test_the_published_view_carries_the_replicas_arrivals_per_forward_step(planner,
                                                                          monkeypatch):
    """Each replica measures its arrivals at its observations: the requests it holds that it
    had not seen, over the forward steps its scheduler ran meanwhile (``ArrivalMeter``)."""
    from sglang_morph.kunserve.live import auto

    pair, _ = _calm_group(planner, monkeypatch, interval_ms=100)
    monkeypatch.setattr(auto, "local_view", lambda replica, steps, arrivals=(0, 0): dict(
        replica.view, arrivals_per_step=arrivals[0],
        arrival_prompt_tokens_per_step=arrivals[1]))
    leader, follower = pair.autos
    pair.step(0.0)
    sched = pair.replicas[1].scheduler
    sched.waiting_queue = [_queued("a", 100), _queued("b", 300)]
    sched.forward_ct = 8
    pair.step(0.1)
    published = json.loads(pair.replicas[1].link.mailbox.get("view1"))
    assert published["arrivals_per_step"] == 2 / 8
    assert published["arrival_prompt_tokens_per_step"] == 400 / 8
    # Admitted (running now), the same requests are not counted again; a new one is.
    sched.waiting_queue = [_queued("c", 50)]
    pair.replicas[1].live_requests = lambda: [_queued("a", 100), _queued("b", 300)]
    sched.forward_ct = 10
    pair.step(0.1)
    assert follower.arrivals == (3 / 10, 450 / 10)
    assert leader.arrivals == (0.0, 0.0) and leader.errors == follower.errors == 0


def test_a_queue_sglang_refuses_drops_without_waiting_for_the_interval(planner, monkeypatch):
    """The follower's scheduler refuses its queue for lack of KV between two observations: it
    publishes its view at its next step and the leader decides at its own next step, not an
    interval later (the wait that was the slowest request's in the replay)."""
    import types

    pair, _ = _calm_group(planner, monkeypatch, interval_ms=250)
    leader, follower = pair.autos
    pair.step(0.0)
    pair.step(0.02)
    assert (leader.views, follower.views, leader.proposals) == (1, 1, 0)

    full = planner.full_replica().kv_capacity_tokens
    refused = pair.replicas[1]
    refused.view = dict(refused.view, waiting_tokens=full, waiting_reqs=1, queue_refused=1)
    refused.scheduler.waiting_queue = [_queued("a prompt")]
    refused.scheduler.running_batch = types.SimpleNamespace(batch_is_full=True, reqs=["r"])
    pair.step(0.02)  # 40 ms after the last observation, 210 ms before the next one
    assert (follower.views, leader.views, leader.proposals) == (2, 2, 1)
    assert leader.last_decision["merge"] is True
    assert f"its queue of {full} tokens was refused" in leader.last_decision["reason"]
    assert leader.errors == follower.errors == 0

    # Still refused at the next step: no second early observation (only the rising edge).
    pair.step(0.02)
    assert (follower.views, leader.views) == (2, 2)


def test_a_queue_that_cannot_fit_drops_before_sglang_tries_it(planner, monkeypatch):
    """A prompt whose tokens do not fit next to the follower's live KV: the follower's next
    step sees it before SGLang's admission has refused anything, publishes, and the leader
    drops at its own next step. A queue that fits changes nothing."""
    import types

    pair, _ = _calm_group(planner, monkeypatch, interval_ms=250)
    leader, follower = pair.autos
    pair.step(0.0)
    pair.step(0.02)
    full = planner.full_replica().kv_capacity_tokens
    waiting = pair.replicas[1]
    waiting.scheduler.waiting_queue = [_queued("a prompt")]
    waiting.scheduler.running_batch = types.SimpleNamespace(batch_is_full=False, reqs=["r"])
    waiting.view = dict(waiting.view, waiting_tokens=full // 4, waiting_reqs=1)  # it fits
    pair.step(0.02)
    assert (follower.views, leader.views, leader.proposals) == (1, 1, 0)

    waiting.view = dict(waiting.view, waiting_tokens=full, waiting_reqs=1)
    pair.step(0.02)
    assert (follower.views, leader.views, leader.proposals) == (2, 2, 1)
    assert f"its queue of {full} tokens does not fit" in leader.last_decision["reason"]


def test_a_group_of_four_decides_on_every_members_view(planner, monkeypatch):
    """The leader decides on the views of all three followers: none while one has not
    published or published from before the last transition; a queue refused on the last
    member merges it with one other member (a pair holds the demand), and every follower
    enters the proposal, as a member of the pair or standing by."""
    group, _ = _calm_group(planner, monkeypatch, interval_ms=250, size=4)
    leader, *followers = group.autos
    followers[0].on_step()  # one follower publishes, the two others have not yet
    leader.on_step()
    assert (leader.views, leader.proposals, followers[0].views) == (0, 0, 1)
    group.step(0.3)
    assert leader.views == 1 and [f.views for f in followers] == [2, 1, 1]
    assert len(leader._views) == 4

    _refuse(planner, group.replicas[3], waiting_tokens=planner.full_replica().kv_capacity_tokens)
    group.step(0.02)
    assert leader.proposals == 1 and leader.last_decision["merge"] is True
    assert "over replica 3's capacity" in leader.last_decision["reason"]
    merged = tuple(leader.last_decision["group"])
    assert len(merged) == 2 and 3 in merged, merged
    assert group.entered == [(0, True, "auto", merged)]
    group.step(0.02)  # the followers poll the proposal between their batches
    assert sorted(e[0] for e in group.entered) == [0, 1, 2, 3]
    assert all(e[1:] == (True, "auto", merged) for e in group.entered)
    assert leader.errors == 0 and all(f.errors == 0 for f in followers)

    group.replicas[2].view = dict(group.replicas[2].view, epoch=1)  # one follower behind
    before = leader.stale_views
    group.step(0.3)
    assert leader.stale_views == before + 1


def _refuse(planner, replica, waiting_tokens: int) -> None:
    """SGLang refuses ``replica``'s queue of ``waiting_tokens`` for lack of KV from now on."""
    import types

    replica.view = dict(replica.view, waiting_tokens=waiting_tokens, waiting_reqs=1,
                        queue_refused=1)
    replica.scheduler.waiting_queue = [_queued("a prompt")]
    replica.scheduler.running_batch = types.SimpleNamespace(batch_is_full=True, reqs=["r"])


def test_a_group_of_four_merges_two_pairs_as_two_proposals_and_sees_merges_standing(
        planner, monkeypatch):
    """Two overloaded members of four, each held by a pair but not both by one: the leader
    proposes the two disjoint merges one after the other and every follower enters both in
    that order; the next view holds the merges standing (from each member's ``group``), so
    nothing more drops; a refused transition stops the proposals that follow it."""
    from sglang_morph.kunserve.controller import Drop
    from sglang_morph.kunserve.planner import make_group

    group, _ = _calm_group(planner, monkeypatch, interval_ms=250, size=4)
    leader, *followers = group.autos
    group.step(0.3)
    full = planner.full_replica().kv_capacity_tokens
    # Half a pool held and this queued: with a calm member (half a pool) a pair holds it,
    # the two overloaded members together do not.
    queued = make_group(planner, (0, 1)).capacity_tokens - full
    for r in (0, 2):
        _refuse(planner, group.replicas[r], waiting_tokens=queued)
    group.step(0.3)
    group.step(0.02)
    assert leader.proposals == 2 and all(f.proposals == 2 for f in followers)
    first = [e[3] for e in group.entered if e[0] == 0]
    assert len(first) == 2 and not set(first[0]) & set(first[1]), first
    for rank in (1, 2, 3):  # every follower entered the same two, in the same order
        assert [e[3] for e in group.entered if e[0] == rank] == first

    # The members now report their merges and fresh views: the controller sees both groups.
    for r in group.replicas:
        merged = next(g for g in first if r.rank in g)
        r.view = dict(_views(planner, growth=0), epoch=2, group=list(merged))
    for f in followers:
        f.observe()
    view = leader.observe()
    assert sorted(g.replicas for g in view.groups) == sorted(first)
    assert leader.decide(view) is None

    # A refused first merge: the second is not proposed.
    stopped, _ = _calm_group(planner, monkeypatch, interval_ms=250, size=4)
    stopped.outcome = "refused"
    stopped.step(0.3)
    for r in (0, 2):
        _refuse(planner, stopped.replicas[r], waiting_tokens=queued)
    stopped.step(0.3)
    assert stopped.autos[0].proposals == 1
    assert stopped.autos[0].last_decision["status_code"] == 409
    assert isinstance(stopped.autos[0]._proposed, Drop)
