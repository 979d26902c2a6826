"""KunServe on live SGLang data-parallel replicas: ``--enable-kunserve --dp-size 2``.

One DP 2 server (float32, greedy, CPU): the reference outputs are the same replicas' outputs
before the drop (an undropped server) and are checked on both replicas.

- ``/kunserve/status``: both replicas whole, every layer, the startup capacity;
- bad input (a body with fields, not JSON, a restore of a whole group, no key, a user key) gets
  4xx with a message and changes nothing;
- a drop that fails on replica 1 (an injected fault in its KV grow) after replica 0 completed
  its part: 500, replica 0 undoes its part, both are exactly as before and serve the same
  outputs;
- a drop while a request streams on each replica: replica 0 keeps layers [0, 15) and replica 1
  [15, 30), each frees exactly the bytes of the layers it dropped (derived here from the
  model's shapes, equal to the planner's), its pool grows to half the group's capacity and
  holds the peer's KV for its layers; the streams finish with the undropped outputs (their KV
  of the dropped layers moved to the peer); new requests on either replica, one at a time and
  concurrently on both (both replicas calling each other at once, and hitting the radix cache
  filled after the drop), equal the undropped outputs token for token;
- a restore while a replica holds more KV than a whole replica can is refused (409) and
  changes nothing; the request (longer than a whole replica's pool) finishes;
- a restore while a request streams on each replica gives both replicas every layer and their
  exact startup capacity back; the streams and later requests equal the undropped outputs;
  the transitions log and the Prometheus series say what happened. Replica 1's pool shrink
  fails there (an injected fault): the restore stands on both replicas (one layout, one
  epoch), replica 1's pool keeps its merged size, says so, refuses a drop meanwhile and
  gives the tokens back at a retry between batches, while its request streams on.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import time
import types

import pytest
import requests

from sglang_morph.kunserve.live import config as kunserve_config
from sglang_morph.kunserve.live.replica import FAULT_REPLICA_ENV
from sglang_morph.kunserve.live.mechanism import MECHANISM as KUNSERVE
from sglang_morph.plugin import configure
from sglang_morph.surface import PluginError
# (corpus_ids and tokenizer are that module's fixtures)
from test_morph_runtime_server import (  # noqa: F401
    ADMIN,
    USER,
    Stream,
    corpus_ids,
    paused,
    prompt_ids,
    tokenizer,
)

N_NEW = 40  # each prompt's reference output (a stream a transition lands in: STREAM_NEW)
WHOLE_TOKENS = 1024
PROMPT_LENGTHS = (16, 48, 120, 200)
LONG_TOKENS = 640  # with N_NEW, within a whole replica's pool
# A stream a transition lands in: in a loaded suite a drop once began only after 36 tokens of
# a 40-token stream had gone, so the stream had finished and tested nothing.
STREAM_NEW = 120


# ---- launch checks (no server) ----

def launch_args(**overrides):
    base = dict(dp_size=2, tp_size=1, pp_size=1, device="cpu", attention_backend="torch_native",
                disable_radix_cache=False, speculative_algorithm=None)
    return types.SimpleNamespace(**{**base, **overrides})


def configure_kunserve(server_args, args, morph_enabled: bool) -> bool:
    """The launcher's configuration of KunServe, after morph's when that is enabled."""
    return configure(KUNSERVE, server_args, args, frozenset({"morph"} if morph_enabled else ()))


@pytest.mark.parametrize("overrides, morph, message", [
    (dict(dp_size=1), False, "--enable-kunserve needs an even --dp-size of at least 2 (got 1)"),
    (dict(dp_size=3), False, "--enable-kunserve needs an even --dp-size of at least 2 (got 3)"),
    (dict(tp_size=3), False, "--tp-size"),
    ({}, True, "--enable-kunserve and --enable-morph together"),
    (dict(device="cuda"), False, "--device cpu"),
    (dict(attention_backend="triton"), False, "--attention-backend torch_native"),
])
def test_launch_refuses_what_is_not_built(overrides, morph, message):
    server_args = launch_args(**overrides)
    with pytest.raises(PluginError, match="sglang-morph: error: ") as e:
        configure_kunserve(server_args, argparse.Namespace(enable_kunserve=True), morph)
    assert message in str(e.value)
    assert not hasattr(server_args, kunserve_config.SERVER_ARGS_ATTR)  # nothing attached


@pytest.mark.parametrize("field, value, message", [
    ("kunserve_micro_batches", 0, "--kunserve-micro-batches must be an integer in [1, 16], got 0"),
    ("kunserve_micro_batches", 17, "got 17"),
    ("kunserve_merged_max_running", 0,
     "--kunserve-merged-max-running must be an integer >= 1, got 0"),
    ("kunserve_merged_max_running", True, "got True"),
    ("kunserve_merged_chunked_prefill", 8,
     "--kunserve-merged-chunked-prefill must be an integer >= 16, got 8"),
    ("kunserve_merged_chunked_prefill", 64.0, "got 64.0"),
])
def test_values_out_of_range_are_refused(field, value, message):
    server_args = launch_args()
    with pytest.raises(PluginError, match="sglang-morph: error: ") as e:
        configure_kunserve(server_args, argparse.Namespace(enable_kunserve=True,
                                                           **{field: value}), False)
    assert message in str(e.value)
    assert not hasattr(server_args, kunserve_config.SERVER_ARGS_ATTR)


def test_micro_batches_need_the_flag_and_default_to_four():
    server_args = launch_args()
    with pytest.raises(PluginError, match="--kunserve-micro-batches needs --enable-kunserve"):
        configure_kunserve(server_args, argparse.Namespace(kunserve_micro_batches=2), False)
    assert not hasattr(server_args, kunserve_config.SERVER_ARGS_ATTR)
    from_cli = kunserve_config.KunServeLiveConfig.from_cli_namespace
    assert from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=1)
                    ).micro_batches == 4
    assert from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=1,
                                       kunserve_micro_batches=1)).micro_batches == 1


def test_each_group_gets_its_own_link_port():
    import socket

    from_cli = kunserve_config.KunServeLiveConfig.from_cli_namespace
    cfg = from_cli(argparse.Namespace(enable_kunserve=True), dp_size=6)
    assert cfg.group_size == 2
    assert [cfg.group_port(i) for i in range(3)] == [cfg.link_port + i for i in range(3)]
    for i in range(3):  # all free now, for the pairs' stores to bind later
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", cfg.group_port(i)))
    assert from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=4000),
                    dp_size=4).group_port(1) == 4001
    server_args = launch_args(dp_size=6)
    kunserve_config.attach(server_args, cfg)
    assert kunserve_config.groups(server_args) == 3
    four = from_cli(argparse.Namespace(enable_kunserve=True, kunserve_group_size=4,
                                       kunserve_link_port=4000), dp_size=8)
    server_args = launch_args(dp_size=8)
    kunserve_config.attach(server_args, four)
    assert (four.group_size, kunserve_config.groups(server_args)) == (4, 2)
    auto_four = from_cli(argparse.Namespace(enable_kunserve=True, kunserve_group_size=4,
                                            kunserve_auto=True, kunserve_link_port=4000),
                         dp_size=4)
    assert (auto_four.group_size, auto_four.auto) == (4, kunserve_config.AutoControlConfig())


@pytest.mark.parametrize("flags, dp_size, message", [
    (dict(kunserve_group_size=4), 6, "--kunserve-group-size 4 needs a --dp-size that is a "
                                     "multiple of it (got 6)"),
    (dict(kunserve_group_size=1), 4, "--kunserve-group-size must be an integer in [2, 8], "
                                     "got 1"),
    (dict(kunserve_group_size=16), 16, "--kunserve-group-size must be an integer in [2, 8]"),
])
def test_a_group_size_the_launch_cannot_serve_is_refused(flags, dp_size, message):
    server_args = launch_args(dp_size=dp_size)
    with pytest.raises(PluginError, match=re.escape(message)):
        configure_kunserve(server_args, argparse.Namespace(enable_kunserve=True,
                                                           kunserve_link_port=4000, **flags),
                           False)
    assert not hasattr(server_args, kunserve_config.SERVER_ARGS_ATTR)


def test_the_group_size_needs_the_flag():
    server_args = launch_args(dp_size=4)
    with pytest.raises(PluginError, match="--kunserve-group-size needs --enable-kunserve"):
        configure_kunserve(server_args, argparse.Namespace(kunserve_group_size=4), False)


def test_without_the_flag_nothing_changes():
    server_args = launch_args(dp_size=1)
    configure_kunserve(server_args, argparse.Namespace(), False)
    assert not kunserve_config.get(server_args).enabled


def test_a_drop_waits_for_a_deferred_shrink():
    """A replica whose last restore's pool shrink is still pending votes against a drop,
    naming what it has not given back; without one its vote is the usual."""
    from sglang_morph.kunserve.live.replica import KunServeReplica

    replica = types.SimpleNamespace(replica=1, merged=False, shrink_pending_tokens=1024,
                                    subgroup=[1])
    assert KunServeReplica._refusal(replica, True, (0, 1)) == (
        "replica 1 has not given back 1024 KV tokens of its last restore yet (its pool shrink "
        "is retried between batches)")
    replica.shrink_pending_tokens, replica.merged = 0, True
    assert "already merged" in KunServeReplica._refusal(replica, True, (0, 1))


# ---- the live server ----

@pytest.fixture(scope="module")
def dp2(server_factory):
    # Replica 1's first KV grow fails (a test-only fault point): the first drop fails there
    # after replica 0 completed its part. Its first shrink fails too: the first restore's.
    return server_factory(
        "--dtype", "float32", "--dp-size", "2", "--enable-kunserve", "--max-total-tokens",
        str(WHOLE_TOKENS), "--enable-metrics", "--api-key", "test-api-key", "--admin-api-key",
        "test-admin-key", env={"SGLANG_MORPH_FAULT": "grow,shrink", FAULT_REPLICA_ENV: "1"})


def status(server) -> dict:
    r = requests.get(f"{server.url}/kunserve/status", headers=USER, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def post(server, route: str, headers=ADMIN, **kwargs) -> requests.Response:
    return requests.post(f"{server.url}/kunserve/{route}", headers=headers, timeout=600,
                         **kwargs)


def generate_on(server, ids, replica: int, n_new: int = N_NEW) -> list[int]:
    """Greedy ``n_new`` tokens of ``ids`` on one replica (SGLang's routed_dp_rank)."""
    r = requests.post(f"{server.url}/generate", headers=USER, timeout=600, json={
        "input_ids": ids, "routed_dp_rank": replica, "sampling_params": {
            "temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["dp_rank"] == replica
    return r.json()["output_ids"]


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return [prompt_ids(corpus_ids, seed=20 + i, n_tokens=n)
            for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def undropped(dp2, prompts):
    """Each prompt's greedy output on the whole replicas (equal on both: one thread each)."""
    outs = [generate_on(dp2, ids, 0) for ids in prompts]
    assert [generate_on(dp2, ids, 1) for ids in prompts] == outs
    return outs


@pytest.fixture(scope="module")
def long_undropped(dp2, corpus_ids, undropped):
    """A 640-token prompt (cut into four micro-batches while merged) and its greedy output on
    whole replica 0."""
    assert status(dp2)["groups"] == [[0], [1]]
    ids = prompt_ids(corpus_ids, seed=60, n_tokens=LONG_TOKENS)
    return ids, generate_on(dp2, ids, 0)


@pytest.fixture(scope="module")
def streamed_undropped(dp2, prompts, undropped):
    """Prompts 0-2's greedy outputs of ``STREAM_NEW`` tokens on whole replica 0 (their first
    ``N_NEW`` are ``undropped``'s)."""
    assert status(dp2)["groups"] == [[0], [1]]
    outs = {i: generate_on(dp2, prompts[i], 0, n_new=STREAM_NEW) for i in range(3)}
    assert all(out[:N_NEW] == undropped[i] for i, out in outs.items())
    return outs


def all_outputs(server, prompts) -> tuple[list, list]:
    """(one at a time on replica 0 then 1, all at once on both replicas)."""
    one_by_one = [[generate_on(server, ids, r) for ids in prompts] for r in (0, 1)]
    jobs = [(ids, r) for r in (0, 1) for ids in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: generate_on(server, *job), jobs))
    return one_by_one, [together[:len(prompts)], together[len(prompts):]]


def while_in_flight(server, start, on_replicas, transition) -> tuple[requests.Response, list]:
    """``transition()`` (a POST) while the streams ``start()`` begins are in flight on replicas
    ``on_replicas`` (a stream each); the transition's response and the streams' outputs.

    The streams are paused in place (``paused``: the requests stay in the running batch, the
    scheduler still takes control requests) once they have tokens, so that
    the transition finds them in flight however loaded the machine is; a status read behind
    the pause, on the same channel, says whether each still is. Streams that finished before
    the pause reached their schedulers (a loaded suite's lag) run again."""
    for _ in range(3):
        streams = start()
        for stream in streams:
            stream.wait_for(3)
        with paused(server):
            running = [rep["load"]["running_reqs"] for rep in status(server)["replicas"]]
            r = transition() if all(running[i] for i in on_replicas) else None
        outs = [stream.join() for stream in streams]
        if r is not None:
            return r, outs
    pytest.fail(f"the streams finished before every pause; running at the last: {running}")


def transition_while_streaming(server, route: str, prompts, streamed, on_replicas) -> dict:
    """``route`` while prompt ``on_replicas[r]`` streams ``STREAM_NEW`` tokens on replica
    ``r`` (``while_in_flight``); the streams finish with their undropped outputs
    (``streamed``). The transition's answer."""
    r, outs = while_in_flight(
        server, lambda: [Stream(server, prompts[i], STREAM_NEW, routed_dp_rank=r)
                         for r, i in enumerate(on_replicas)],
        range(len(on_replicas)), lambda: post(server, route))
    assert outs == [streamed[i] for i in on_replicas]
    assert r.status_code == 200, r.text
    return r.json()


def dropped_layer_bytes(model_dir, layers: range, with_final_norm: bool) -> int:
    """Bytes of float32 decoder layers, from the model's shapes (q, k, v, o, gate, up, down and
    two norms), plus the final norm."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h
    return 4 * (len(layers) * per_layer + (h if with_final_norm else 0))


def kv_bytes_per_layer_token(model_dir) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_key_value_heads"] * head_dim * 4  # K and V, float32


def test_status_at_start(dp2, undropped):
    s = status(dp2)
    assert s["groups"] == [[0], [1]]
    for i, rep in enumerate(s["replicas"]):
        assert rep["replica"] == i and rep["group"] == [i]
        assert rep["layers"] == [0, 30] and rep["dropped_weight_bytes"] == 0
        assert rep["kv_capacity_tokens"] == rep["kv_capacity_tokens_whole"] == WHOLE_TOKENS
        assert rep["peer_kv_capacity_tokens"] == 0 and rep["transitions"] == []


def test_bad_input_changes_nothing(dp2):
    before = status(dp2)
    cases = [
        (post(dp2, "drop", json={"replicas": [0, 1]}), 400, "unknown fields ['replicas']"),
        (post(dp2, "drop", json={"group": [0, 1, 2]}), 400, "'group' must name a pair"),
        (post(dp2, "drop", json={"group": [1, 2]}), 400, "no pair [1, 2]: the pairs are "
                                                         "[[0, 1]]"),
        (post(dp2, "drop", data=b"not json",
              headers={**ADMIN, "Content-Type": "application/json"}), 400, "JSON object"),
        (post(dp2, "drop", data=b'{"group": [0, 1]}'), 415, "application/json"),
        (post(dp2, "drop", json=[0, 1]), 400, "JSON object"),
        (post(dp2, "restore"), 409, "replica 0 is not merged"),
    ]
    for r, code, message in cases:
        assert r.status_code == code, r.text
        assert message in r.json()["error"], r.text
    assert post(dp2, "drop", headers={}).status_code == 401
    assert post(dp2, "drop", headers=USER).status_code == 401  # the admin key only
    assert requests.get(f"{dp2.url}/kunserve/status", timeout=60).status_code == 401
    assert status(dp2) == before


def test_a_drop_one_replica_fails_changes_nothing(dp2, prompts, undropped):
    before = status(dp2)
    r = post(dp2, "drop")
    assert r.status_code == 500, r.text
    errors = [rep["error"] for rep in r.json()["replicas"]]
    assert errors[0].startswith("drop failed, nothing changed: replica 1 failed")
    assert "InjectedFault" in errors[1] and "nothing changed" in errors[1]
    assert status(dp2) == before  # replica 0 undid its completed part
    assert [generate_on(dp2, prompts[0], r) for r in (0, 1)] == [undropped[0]] * 2


def test_drop_with_requests_in_flight_serves_undropped_outputs(dp2, prompts, undropped,
                                                               streamed_undropped,
                                                               long_undropped,
                                                               default_model_path):
    s = transition_while_streaming(dp2, "drop", prompts, streamed_undropped, (2, 1))
    assert s["groups"] == [[0, 1]]
    front, back = s["replicas"]
    assert (front["layers"], back["layers"]) == ([0, 15], [15, 30])
    assert front["dropped_weight_bytes"] == front["planned_freed_bytes"] == dropped_layer_bytes(
        default_model_path, range(15, 30), with_final_norm=True)
    assert back["dropped_weight_bytes"] == back["planned_freed_bytes"] == dropped_layer_bytes(
        default_model_path, range(0, 15), with_final_norm=False)
    for rep, peer in ((front, back), (back, front)):
        assert rep["group"] == [0, 1]
        assert rep["kv_capacity_tokens"] == rep["kv_capacity_tokens_merged"] > 2 * WHOLE_TOKENS
        assert rep["peer_kv_capacity_tokens"] == peer["kv_capacity_tokens"]
        assert rep["weight_bytes"] + rep["kv_bytes"] <= rep["budget_bytes"]
        layer_token = kv_bytes_per_layer_token(default_model_path)
        assert rep["kv_bytes"] == (rep["kv_capacity_tokens"] + rep["peer_kv_capacity_tokens"]
                                   ) * 15 * layer_token
        assert rep["kv_pool_bytes"] == rep["kv_bytes"] + 2 * 15 * layer_token  # padding pages
        (t,) = rep["transitions"]
        assert t["action"] == "drop" and t["kv_capacity_tokens"] == [
            WHOLE_TOKENS, rep["kv_capacity_tokens"]]
        assert t["requests_in_flight"] == 1 and t["kv_moved_bytes"] > 0
        steps = t["step_seconds"]
        assert list(steps) == ["vote", "the KV move", "the KV move exchange", "the layer drop",
                               "the layer drop exchange"]
        assert sum(steps.values()) - steps["vote"] <= t["duration_s"] + 1e-3
    # The second round reuses the first's prefixes from the radix cache.
    one_by_one, together = all_outputs(dp2, prompts)
    assert one_by_one == [undropped, undropped]
    assert together == [undropped, undropped]
    # The back member sent its batches to the front's layers ahead of its forwards.
    front, back = status(dp2)["replicas"]
    assert front["batches_sent_ahead"] == 0 < back["batches_sent_ahead"]
    # A whole prefill cut into micro-batches (200 tokens: three of 66-67, one request cut
    # twice), on each replica: the radix cache, which holds every prompt, is flushed first.
    micro = [rep["batches_micro"] for rep in (front, back)]
    r = requests.post(f"{dp2.url}/flush_cache", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert [generate_on(dp2, prompts[3], r) for r in (0, 1)] == [undropped[3]] * 2
    assert [rep["batches_micro"] for rep in status(dp2)["replicas"]] == [m + 1 for m in micro]
    # A cut prefill goes first: while replica 0's (four micro-batches of 160 tokens) runs
    # through replica 1's layers, replica 1 holds its own decode steps back (the one in
    # flight when it began runs between its micro-batches; later ones wait), and both
    # outputs stay exact.
    r = requests.post(f"{dp2.url}/flush_cache", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    held = [rep["batches_held"] for rep in status(dp2)["replicas"]]
    stream = Stream(dp2, prompts[1], N_NEW, routed_dp_rank=1)
    stream.wait_for(3)
    long_ids, long_out = long_undropped
    assert generate_on(dp2, long_ids, 0) == long_out
    assert stream.join() == undropped[1]
    now = [rep["batches_held"] for rep in status(dp2)["replicas"]]
    assert now[0] == held[0] and now[1] > held[1], (held, now)
    r = post(dp2, "drop")
    assert r.status_code == 409 and "already merged" in r.json()["error"]


def test_restore_refused_while_more_is_held_than_a_whole_replica_holds(dp2, corpus_ids):
    before = status(dp2)
    # Longer than a whole replica's pool: only the merged group can serve it.
    stream = Stream(dp2, prompt_ids(corpus_ids, seed=30, n_tokens=WHOLE_TOKENS + 64), 8,
                    routed_dp_rank=0)
    stream.wait_for(1)
    r = post(dp2, "restore")
    assert r.status_code == 409, r.text
    assert "more than a whole replica's 1024" in r.json()["error"]
    assert len(stream.join()) == 8
    after = status(dp2)
    for b, a in zip(before["replicas"], after["replicas"]):
        assert (a["group"], a["layers"], a["kv_capacity_tokens"], a["transitions"]) == (
            b["group"], b["layers"], b["kv_capacity_tokens"], b["transitions"])


def test_restore_with_requests_in_flight_gives_whole_replicas_back(dp2, prompts, undropped,
                                                                   streamed_undropped,
                                                                   default_model_path):
    s = transition_while_streaming(dp2, "restore", prompts, streamed_undropped, (0, 2))
    assert s["groups"] == [[0], [1]]
    # Replica 1's shrink failed: the restore stands on both, its pool at the merged size
    first, second = s["replicas"]
    merged = second["kv_capacity_tokens_merged"]
    assert first["kv_shrink_pending_tokens"] == 0
    assert second["kv_capacity_tokens"] == merged
    assert second["kv_shrink_pending_tokens"] == merged - WHOLE_TOKENS
    assert second["transitions"][1]["kv_capacity_tokens"] == [merged, merged]
    assert second["transitions"][1]["kv_shrink_pending_tokens"] == merged - WHOLE_TOKENS
    # ... and gives them back at a retry between batches, a second later (the streams above
    # ran on meanwhile and finished with their undropped outputs)
    deadline = time.monotonic() + 60
    while status(dp2)["replicas"][1]["kv_shrink_pending_tokens"] and time.monotonic() < deadline:
        time.sleep(0.2)
    s = status(dp2)
    assert s["replicas"][1]["kv_shrink_pending_tokens"] == 0
    assert s["replicas"][1]["kv_shrink_retries"] >= 1
    layer_token = kv_bytes_per_layer_token(default_model_path)
    for rep in s["replicas"]:
        assert rep["layers"] == [0, 30] and rep["dropped_weight_bytes"] == 0
        assert rep["kv_capacity_tokens"] == WHOLE_TOKENS and rep["peer_kv_capacity_tokens"] == 0
        assert [t["action"] for t in rep["transitions"]] == ["drop", "restore"]
        assert rep["transitions"][1]["kv_capacity_tokens"] == [
            rep["kv_capacity_tokens_merged"],
            WHOLE_TOKENS if rep["replica"] == 0 else rep["kv_capacity_tokens_merged"]]
        assert rep["transitions"][1]["requests_in_flight"] == 1
        # Only allocated rows came back: far less than the mirrors' whole rows (both ways).
        whole_mirrors = 2 * (rep["kv_capacity_tokens_merged"] + 1) * 15 * layer_token
        assert 0 < rep["transitions"][1]["kv_moved_bytes"] < whole_mirrors / 4
        assert list(rep["transitions"][1]["step_seconds"]) == [
            "vote", "the KV move back", "the KV move back exchange", "last step"]
    assert [generate_on(dp2, ids, r) for r in (0, 1) for ids in prompts] == undropped * 2
    metrics = requests.get(f"{dp2.url}/metrics", headers=USER, timeout=60).text
    for replica in ("0", "1"):
        assert f'sglang_morph_kunserve_group_size{{replica="{replica}"}} 1.0' in metrics
        assert f'sglang_morph_kunserve_layers_held{{replica="{replica}"}} 30.0' in metrics
        assert (f'sglang_morph_kunserve_transitions_total{{action="restore",replica="{replica}"}}'
                f' 1.0') in metrics
        # The elastic core's family counts the same transitions (the failed drop too).
        assert (f'sglang_morph_elastic_transitions_total{{action="restore",mechanism="kunserve",'
                f'outcome="applied",replica="{replica}"}} 1.0') in metrics
    elastic = requests.get(f"{dp2.url}/elastic/status", headers=USER, timeout=60).json()
    assert elastic["mechanisms"] == ["kunserve"]
    assert [r["replica"] for r in elastic["replicas"]] == [0, 1]
    for rep in elastic["replicas"]:
        kunserve = rep["mechanisms"]["kunserve"]
        assert kunserve["state"]["group"] == [rep["replica"]]
        assert kunserve["state"]["kv_capacity_tokens"] == WHOLE_TOKENS
        applied = [t["action"] for t in kunserve["transitions"]["recent"]
                   if t["outcome"] == "applied"]
        assert applied == ["drop", "restore"]
        assert kunserve["transitions"]["totals"]["failed"] >= 1


def test_fuzzed_control_bodies_get_no_5xx(dp2):
    """Seeded random JSON bodies on the control routes (last: a fuzzed drop that happens to be
    valid merges the pair, which is restored before comparing)."""
    from hypothesis import strategies as st

    from tests.http_fuzz import JSON, bodies, fuzz

    fields = {"/kunserve/drop": {"group": st.lists(st.integers(-1, 2), max_size=3) | JSON},
              "/kunserve/restore": {"group": JSON}}
    before = status(dp2)
    fuzz(dp2.url, bodies(fields, any_shape=tuple(fields)), lambda route: ADMIN, 60)
    if status(dp2)["groups"] != before["groups"]:
        assert post(dp2, "restore").status_code == 200
    after = status(dp2)
    assert after["groups"] == before["groups"]
    assert [r["kv_capacity_tokens"] for r in after["replicas"]] == [
        r["kv_capacity_tokens"] for r in before["replicas"]]
