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

    view = local_view(_replica(waiting, running, full, max_running))
    assert view["queue_refused"] == refused
    assert view["waiting_tokens"] == waiting * 108 and view["kv_used_tokens"] == 410
    assert snapshot(0, view).queue_refused is bool(refused)

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
