"""KunServe's automatic control on live SGLang DP 2 replicas (``--kunserve-auto``).

- bad ``--kunserve-auto`` / ``--kunserve-auto-config`` values are a CLI error naming the flag
  and the problem, and attach nothing;
- one DP 2 server (float32, greedy, CPU, a small pool) with the controller on: a burst on both
  replicas whose predicted KV demand exceeds their pools makes replica 0's controller drop
  (the transitions log says "auto" and the controller's reason) while requests are in flight;
  every request of the burst equals its output on the undropped replicas, served one at a
  time before the burst, token for token; when the burst is over the group restores by
  itself (usage under 50%), the startup layout comes back exactly, and later requests equal
  the undropped outputs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import time

import pytest

from sglang_morph.kunserve.live import config as kunserve_config
from sglang_morph.surface import PluginError
# (corpus_ids and tokenizer are that module's fixtures)
from test_morph_runtime_server import corpus_ids, prompt_ids, tokenizer  # noqa: F401
from test_kunserve import planner, spec  # noqa: F401  (fixtures)
from test_kunserve_live import configure_kunserve, generate_on as generate_on_live, launch_args, status

N_NEW = 16
WHOLE_TOKENS = 256
PROMPT_TOKENS = 104  # + N_NEW: two fit a whole replica's pool, three do not
PER_REPLICA = 3
AUTO = {"interval_ms": 100, "drop_persist": 2, "restore_persist": 3, "min_dwell_s": 1.0}



def _replica(waiting: int, running: int, batch_is_full: bool, max_running: int = 8):
    """A stand-in for a live replica's scheduler state, as ``local_view`` reads it."""
    import types

    req = lambda n: types.SimpleNamespace(  # noqa: E731
        origin_input_ids=[1] * n, output_ids=[], sampling_params=types.SimpleNamespace(
            max_new_tokens=8))
    sched = types.SimpleNamespace(
        waiting_queue=[req(100)] * waiting, max_running_requests=max_running,
        running_batch=types.SimpleNamespace(batch_is_full=batch_is_full),
        tree_cache=types.SimpleNamespace(evictable_size=lambda: 0))
    return types.SimpleNamespace(
        scheduler=sched, transitions=[], live_requests=lambda: [req(10)] * running,
        pool=types.SimpleNamespace(size=910),
        allocator=types.SimpleNamespace(available_size=lambda: 500))


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


class _Pair:
    """Two stand-in replicas of one pair for ``AutoControl``: a real in-memory store as the
    link's mailbox, each replica's view set by the test, and voted transitions reduced to
    their record (the test says which outcome each has)."""

    def __init__(self, planner, cfg):
        import types

        from torch.distributed import HashStore

        from sglang_morph.kunserve.live import auto

        self.outcome = "applied"
        self.entered: list[tuple[int, bool, str]] = []
        mailbox = HashStore()
        self.replicas = [types.SimpleNamespace(
            rank=rank, link=types.SimpleNamespace(mailbox=mailbox), planner=planner,
            scheduler=types.SimpleNamespace(server_args=None, waiting_queue=[],
                                            running_batch=None), merged=False,
            group=types.SimpleNamespace(replicas=(0, 1)), last_transition=None, view=None,
            elastic_state=lambda: {}, check_integrity=lambda: None) for rank in (0, 1)]
        for r in self.replicas:
            r.transition = lambda merge, trigger, reason, r=r: self._transition(r, merge,
                                                                                trigger, reason)
        self.autos = [auto.AutoControl(r, cfg) for r in self.replicas]
        self.now_s = 100.0
        for a in self.autos:
            a.loop.clock = lambda: self.now_s

    def _transition(self, replica, merge: bool, trigger: str, reason: str):
        from sglang_morph.elastic.contract import Outcome, Transition
        from sglang_morph.elastic.record import recorder

        self.entered.append((replica.rank, merge, trigger))
        outcome = Outcome(self.outcome)
        replica.last_transition = recorder(replica.scheduler).record(Transition(
            mechanism="kunserve", replica=replica.rank, action="drop" if merge else "restore",
            reason=reason, outcome=outcome, duration_s=0.0, capacity_before_tokens=0,
            capacity_after_tokens=0))
        return (200 if outcome is Outcome.APPLIED else 409), {}

    def step(self, advance_s: float) -> None:
        self.now_s += advance_s
        for a in reversed(self.autos):  # the follower publishes, then the leader decides
            a.on_step()


def _views(planner, growth: int) -> dict[str, int]:
    full = planner.full_replica().kv_capacity_tokens
    return {"epoch": 0, "kv_capacity_tokens": full, "kv_used_tokens": full // 2,
            "kv_growth_tokens": growth * full, "waiting_tokens": 0, "running_reqs": 1,
            "waiting_reqs": 0, "queue_refused": 0}


def _calm_pair(planner, monkeypatch, interval_ms: float):
    """A pair whose views (set by the test) show both replicas half full, nothing growing."""
    from sglang_morph.kunserve.controller import ControllerConfig
    from sglang_morph.kunserve.live import auto

    monkeypatch.setattr(auto, "local_view", lambda replica, *_: dict(replica.view))
    cfg = kunserve_config.AutoControlConfig(
        interval_ms=interval_ms, controller=ControllerConfig(drop_persist=2, min_dwell_s=5.0))
    pair = _Pair(planner, cfg)
    for r in pair.replicas:
        r.view = _views(planner, growth=0)
    return pair, cfg


def test_the_leader_decides_on_the_elastic_loop_and_the_follower_enters_its_proposal(
        planner, monkeypatch):
    from sglang_morph.elastic.record import recorder
    from sglang_morph.kunserve.live import auto

    pair, cfg = _calm_pair(planner, monkeypatch, interval_ms=100)
    leader, follower = pair.autos
    pair.step(0.0)
    assert (leader.views, follower.views, leader.proposals) == (1, 1, 0)
    pair.step(0.05)  # within the interval: nobody observes again
    assert (leader.views, follower.views) == (1, 1)

    for r in pair.replicas:  # the running requests' outputs would outgrow both pools
        r.view = _views(planner, growth=1)
    pair.step(0.1)
    assert leader.proposals == 0  # over for one view; drop_persist is 2
    pair.step(0.1)
    assert leader.proposals == 1 and leader.last_decision["merge"] is True
    assert "for 2 views" in leader.last_decision["reason"]
    assert pair.entered == [(0, True, "auto")]
    pair.step(0.02)  # the follower polls the proposal between its batches
    assert follower.proposals == 1 and pair.entered == [(0, True, "auto"), (1, True, "auto")]
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


def test_a_queue_sglang_refuses_drops_without_waiting_for_the_interval(planner, monkeypatch):
    """The follower's scheduler refuses its queue for lack of KV between two observations: it
    publishes its view at its next step and the leader decides at its own next step, not an
    interval later (the wait that was the slowest request's in the replay)."""
    import types

    pair, _ = _calm_pair(planner, monkeypatch, interval_ms=250)
    leader, follower = pair.autos
    pair.step(0.0)
    pair.step(0.02)
    assert (leader.views, follower.views, leader.proposals) == (1, 1, 0)

    full = planner.full_replica().kv_capacity_tokens
    refused = pair.replicas[1]
    refused.view = dict(refused.view, waiting_tokens=full, waiting_reqs=1, queue_refused=1)
    refused.scheduler.waiting_queue = ["a prompt"]
    refused.scheduler.running_batch = types.SimpleNamespace(batch_is_full=True, reqs=["r"])
    pair.step(0.02)  # 40 ms after the last observation, 210 ms before the next one
    assert (follower.views, leader.views, leader.proposals) == (2, 2, 1)
    assert leader.last_decision["merge"] is True
    assert f"its queue of {full} tokens was refused" in leader.last_decision["reason"]
    assert leader.errors == follower.errors == 0

    # Still refused at the next step: no second early observation (only the rising edge).
    pair.step(0.02)
    assert (follower.views, leader.views) == (2, 2)


# ---- the live server ----

@pytest.fixture(scope="module")
def auto_dp2(server_factory):
    return server_factory(
        "--dtype", "float32", "--dp-size", "2", "--enable-kunserve", "--kunserve-auto",
        "--kunserve-auto-config", json.dumps(AUTO), "--max-total-tokens", str(WHOLE_TOKENS),
        "--api-key", "test-api-key")


def generate_on(server, ids, replica: int) -> list[int]:
    return generate_on_live(server, ids, replica, n_new=N_NEW)


def wait_for(server, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = status(server)
        if predicate(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def test_a_burst_drops_automatically_and_the_group_restores_when_it_ends(auto_dp2, corpus_ids):
    prompts = [[prompt_ids(corpus_ids, seed=40 + PER_REPLICA * r + i, n_tokens=PROMPT_TOKENS)
                for i in range(PER_REPLICA)] for r in (0, 1)]
    # The undropped outputs: one request at a time (its demand fits a whole replica).
    undropped = [[generate_on(auto_dp2, ids, r) for ids in prompts[r]] for r in (0, 1)]
    s = status(auto_dp2)
    assert s["groups"] == [[0], [1]]
    assert all(rep["transitions"] == [] for rep in s["replicas"])
    leader, follower = (rep["auto"] for rep in s["replicas"])
    assert (leader["role"], follower["role"]) == ("leader", "follower")
    assert leader["config"] == follower["config"] == {
        **leader["config"], **AUTO} and leader["views"] > 0 and follower["views"] > 0

    # The burst: three requests per replica at once, 360 tokens of demand on 256-token pools.
    jobs = [(ids, r) for r in (0, 1) for ids in prompts[r]]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: generate_on(auto_dp2, *job), jobs))
    assert [outs[:PER_REPLICA], outs[PER_REPLICA:]] == undropped

    # Idle now: the controller restores the group (usage under 50%, demand fits).
    s = wait_for(auto_dp2, lambda s: s["groups"] == [[0], [1]] and all(
        len(rep["transitions"]) == 2 for rep in s["replicas"]), timeout_s=30)
    assert s["groups"] == [[0], [1]], json.dumps(s)
    for rep in s["replicas"]:
        drop, restore = rep["transitions"]
        assert (drop["action"], drop["trigger"], restore["action"], restore["trigger"]) == (
            "drop", "auto", "restore", "auto")
        assert drop["reason"].startswith("predicted KV demand") and "over replica" in (
            drop["reason"])
        assert "under 50%" in restore["reason"]
        assert drop["kv_capacity_tokens"] == [WHOLE_TOKENS, rep["kv_capacity_tokens_merged"]]
        assert restore["kv_capacity_tokens"] == [rep["kv_capacity_tokens_merged"], WHOLE_TOKENS]
        assert restore["at_unix_s"] - drop["at_unix_s"] >= AUTO["min_dwell_s"]
        assert rep["layers"] == [0, 30] and rep["kv_capacity_tokens"] == WHOLE_TOKENS
        assert rep["dropped_weight_bytes"] == 0 and rep["peer_kv_capacity_tokens"] == 0
    # The drop came while the burst ran: requests in flight on the replicas.
    assert sum(rep["transitions"][0]["requests_in_flight"] for rep in s["replicas"]) >= 1
    assert s["replicas"][0]["auto"]["proposals"] == s["replicas"][1]["auto"]["proposals"] == 2
    # Whole again: the same outputs.
    assert [generate_on(auto_dp2, prompts[r][0], r) for r in (0, 1)] == [
        undropped[0][0], undropped[1][0]]
