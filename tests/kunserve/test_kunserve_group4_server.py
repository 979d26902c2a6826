"""KunServe groups of more than two on live SGLang data-parallel replicas (``--dp-size 4
--kunserve-group-size 4 --kunserve-auto``): the four replicas drop together to a pipeline of
four stages and restore; two or three of them merge while the others serve whole; two pairs
of the group merge at once; operator-driven and automatically.

One server (float32, greedy, CPU, 256-token pools), against the same replicas undropped (each
prompt served alone first on the replica that serves it later). Its controller never restores
by itself (``restore_persist``), so that the operator's drop stays until the operator's
restore:

- a group that is not two or more replicas of the launch's group (one replica, five, a
  replica outside it) is a 400 naming the problem and changes nothing;
- the drop lands while a prompt streams on two of the replicas: each replica keeps one
  consecutive quarter of the layers (together every layer, in replica order) and the
  embedding (it embeds and samples its own requests), drops exactly the bytes the planner
  planned, its pool grows and it mirrors the three others' KV of its layers; the streams
  finish with their undropped outputs; a second drop is refused (409) naming the others;
- merged, a prompt on every replica at once gives its undropped output token for token (each
  batch runs through the four members' layers in order); prompts long enough to cut, on a
  middle and on the last replica at once, run as micro-batches through the four stages and
  give their undropped outputs;
- the restore (no body: the launch's one group) puts back the startup layout exactly, and the
  outputs are still the undropped ones;
- pair [2, 3] drops while a prompt streams on replica 3 and replicas 0 and 1 stay whole (their
  layers, pools and logs untouched); pair [0, 1] drops beside it; merged so, a prompt on every
  replica gives its undropped output; a drop across the pairs and a restore of the whole
  group are refused (409) and change nothing; each pair restores by name;
- a burst that one replica's pool cannot admit merges it with one other replica by itself (the
  leader's controller on every member's view: a pair holds the demand; the pair's logs say
  "auto" and name the overloaded replica, the other two replicas stood by and logged nothing);
  the burst's outputs equal the replica's whole ones.
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest
import requests

# (corpus_ids and tokenizer are that module's fixtures)
from test_morph_runtime_server import (  # noqa: F401
    ADMIN, Stream, corpus_ids, prompt_ids, tokenizer)
from test_kunserve_auto import AUTO as AUTO_DEFAULTS
from test_kunserve_live import generate_on, post, status, while_in_flight

N_NEW = 24
WHOLE_TOKENS = 256
PROMPT_TOKENS = 104
LONG_TOKENS = 200  # cut while merged: at least 2 x 64 tokens (with 24 new, within 256)
LONG_ON = (1, 3)  # a middle stage and the last: stages run before and after theirs
GROUP = [0, 1, 2, 3]
ALONE = [[0], [1], [2], [3]]
STREAMED = (1, 3)  # the replicas with a request in flight at the drop
BURSTED, BURST = 2, 3  # three prompts at once on replica 2: 384 tokens of demand on 256
# Every running request counts toward the demand (a late third request must still drop: see
# test_kunserve_pairs_server.py); no automatic restore (a million calm views in a row).
AUTO = {**AUTO_DEFAULTS, "finishing_steps": 0, "restore_persist": 10**6}


@pytest.fixture(scope="module")
def dp4(server_factory):
    return server_factory(
        "--dtype", "float32", "--dp-size", "4", "--enable-kunserve", "--kunserve-group-size",
        "4", "--kunserve-auto", "--kunserve-auto-config", json.dumps(AUTO),
        "--max-total-tokens", str(WHOLE_TOKENS), "--api-key", "test-api-key",
        "--admin-api-key", "test-admin-key")


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return [[prompt_ids(corpus_ids, seed=90 + 2 * r + i, n_tokens=PROMPT_TOKENS)
             for i in range(2)] for r in GROUP]


@pytest.fixture(scope="module")
def undropped(dp4, prompts):
    assert status(dp4)["groups"] == ALONE
    return [[generate_on(dp4, ids, r, n_new=N_NEW) for ids in prompts[r]] for r in GROUP]


@pytest.fixture(scope="module")
def long_undropped(dp4, corpus_ids, undropped):
    prompts = {r: prompt_ids(corpus_ids, seed=120 + r, n_tokens=LONG_TOKENS) for r in LONG_ON}
    assert status(dp4)["groups"] == ALONE
    return {r: (ids, generate_on(dp4, ids, r, n_new=N_NEW)) for r, ids in prompts.items()}


def on_every_replica(server, prompts, i: int) -> list[list[int]]:
    """Prompt ``i`` of every replica at once, each on its replica."""
    with concurrent.futures.ThreadPoolExecutor(len(GROUP)) as pool:
        return list(pool.map(lambda r: generate_on(server, prompts[r][i], r, n_new=N_NEW),
                             GROUP))


def test_a_group_of_four_drops_to_four_stages_and_restores(dp4, prompts, undropped,
                                                          long_undropped):
    before = status(dp4)
    num_layers = before["replicas"][0]["num_layers"]
    assert before["groups"] == ALONE
    assert all(rep["layers"] == [0, num_layers] for rep in before["replicas"])
    for body, message in (
            ({"group": [1]}, "'group' must be a list of at least two distinct replica numbers"),
            ({"group": [0, 1, 2, 3, 4]},
             "'group' must name 2 to 4 distinct replicas of one group, got [0, 1, 2, 3, 4]"),
            ({"group": [0, 1, 2, 4]},
             "no group holds [0, 1, 2, 4]: the groups are [[0, 1, 2, 3]]")):
        r = post(dp4, "drop", json=body)
        assert r.status_code == 400 and r.json()["error"] == message, r.text
    after = status(dp4)
    assert after["groups"] == ALONE
    assert [rep["transitions"] for rep in after["replicas"]] == [[]] * 4

    r, streamed = while_in_flight(
        dp4, lambda: [Stream(dp4, prompts[r][0], N_NEW, routed_dp_rank=r) for r in STREAMED],
        STREAMED, lambda: post(dp4, "drop", json={"group": GROUP}))
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["groups"] == [GROUP]
    layers = [rep["layers"] for rep in s["replicas"]]
    # Four consecutive stages, in replica order, that hold every layer between them.
    assert layers[0][0] == 0 and layers[-1][1] == num_layers, layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(layers, layers[1:])), layers
    for rep in s["replicas"]:
        merged = rep["kv_capacity_tokens_merged"]
        assert rep["kv_capacity_tokens"] == merged > WHOLE_TOKENS
        assert rep["peer_kv_capacity_tokens"] == 3 * merged  # a mirror per other member
        assert rep["dropped_weight_bytes"] == rep["planned_freed_bytes"] > 0
        drop = rep["transitions"][-1]
        assert (drop["action"], drop["layers"]) == ("drop", rep["layers"])
        assert drop["kv_capacity_tokens"] == [WHOLE_TOKENS, merged]
    assert [s["replicas"][r]["transitions"][-1]["requests_in_flight"] for r in STREAMED] == [
        1] * len(STREAMED)
    assert streamed == [undropped[r][0] for r in STREAMED]

    assert on_every_replica(dp4, prompts, 1) == [undropped[r][1] for r in GROUP]
    # The radix cache holds the long prompts from their undropped run: flushed, so that
    # each is prefilled whole again.
    r = requests.post(f"{dp4.url}/flush_cache", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    micro_before = [rep["batches_micro"] for rep in status(dp4)["replicas"]]
    with concurrent.futures.ThreadPoolExecutor(len(LONG_ON)) as pool:
        long_outputs = list(pool.map(
            lambda r: generate_on(dp4, long_undropped[r][0], r, n_new=N_NEW), LONG_ON))
    assert long_outputs == [long_undropped[r][1] for r in LONG_ON]
    micro_after = [rep["batches_micro"] for rep in status(dp4)["replicas"]]
    assert [b - a for a, b in zip(micro_before, micro_after)] == [
        int(r in LONG_ON) for r in GROUP], (micro_before, micro_after)
    r = post(dp4, "drop", json={"group": GROUP})
    assert r.status_code == 409 and "is already merged with replicas [" in r.json()["error"], (
        r.text)

    r = post(dp4, "restore")
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["groups"] == ALONE, json.dumps(s)
    for rep in s["replicas"]:
        assert rep["layers"] == [0, num_layers]
        assert rep["kv_capacity_tokens"] == WHOLE_TOKENS
        assert rep["peer_kv_capacity_tokens"] == rep["dropped_weight_bytes"] == 0
        assert [t["action"] for t in rep["transitions"]] == ["drop", "restore"]
    assert on_every_replica(dp4, prompts, 0) == [undropped[r][0] for r in GROUP]


def test_two_pairs_of_the_group_merge_apart_and_at_once(dp4, prompts, undropped):
    before = status(dp4)
    assert before["groups"] == ALONE
    logged = [len(rep["transitions"]) for rep in before["replicas"]]
    stream = Stream(dp4, prompts[3][0], N_NEW, routed_dp_rank=3)
    stream.wait_for(3)
    r = post(dp4, "drop", json={"group": [2, 3]})
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["groups"] == [[0], [1], [2, 3]]
    num_layers = s["replicas"][0]["num_layers"]
    for rep, was in zip(s["replicas"][:2], before["replicas"][:2]):  # untouched
        assert rep["layers"] == [0, num_layers]
        assert rep["kv_capacity_tokens"] == WHOLE_TOKENS and rep["peer_kv_capacity_tokens"] == 0
        assert rep["transitions"] == was["transitions"]
    two, three = s["replicas"][2:]
    assert two["layers"][0] == 0 and two["layers"][1] == three["layers"][0]
    assert three["layers"][1] == num_layers
    for rep in (two, three):
        merged = rep["kv_capacity_tokens_merged"]
        # A pair's share of its tokens, more than a whole replica's.
        assert rep["kv_capacity_tokens"] == rep["peer_kv_capacity_tokens"] == merged
        assert WHOLE_TOKENS < merged
        assert rep["transitions"][-1]["group"] == [2, 3]
        assert rep["dropped_weight_bytes"] == rep["planned_freed_bytes"] > 0
    assert stream.join() == undropped[3][0]

    r = post(dp4, "drop", json={"group": [0, 1]})
    assert r.status_code == 200 and r.json()["groups"] == [[0, 1], [2, 3]], r.text
    assert on_every_replica(dp4, prompts, 1) == [undropped[r][1] for r in GROUP]
    for path, body, message in (
            ("drop", {"group": [1, 2]}, "is already merged with replica"),
            ("restore", None, "is merged with replicas [0, 1], not [0, 1, 2, 3]")):
        r = post(dp4, path, json=body) if body else post(dp4, path)
        assert r.status_code == 409 and message in r.json()["error"], r.text
    assert status(dp4)["groups"] == [[0, 1], [2, 3]]

    r = post(dp4, "restore", json={"group": [2, 3]})
    assert r.status_code == 200 and r.json()["groups"] == [[0, 1], [2], [3]], r.text
    r = post(dp4, "restore", json={"group": [0, 1]})
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["groups"] == ALONE
    for rep, n in zip(s["replicas"], logged):
        assert rep["layers"] == [0, num_layers] and rep["kv_capacity_tokens"] == WHOLE_TOKENS
        assert [t["action"] for t in rep["transitions"][n:]] == ["drop", "restore"]
    assert on_every_replica(dp4, prompts, 0) == [undropped[r][0] for r in GROUP]


def test_a_queue_one_replica_cannot_admit_merges_it_with_one_other_by_itself(dp4, corpus_ids):
    s = status(dp4)
    assert s["groups"] == ALONE
    logged = [len(rep["transitions"]) for rep in s["replicas"]]
    assert [rep["auto"]["role"] for rep in s["replicas"]] == ["leader"] + ["follower"] * 3
    assert all(rep["auto"]["views"] > 0 for rep in s["replicas"])
    burst = [prompt_ids(corpus_ids, seed=120 + i, n_tokens=PROMPT_TOKENS) for i in range(BURST)]
    whole = [generate_on(dp4, ids, BURSTED, n_new=N_NEW) for ids in burst]  # one at a time
    assert status(dp4)["groups"] == ALONE  # each alone fits the pool: no drop

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        outs = list(pool.map(lambda ids: generate_on(dp4, ids, BURSTED, n_new=N_NEW), burst))
    assert outs == whole
    s = status(dp4)
    pair = next(g for g in s["groups"] if len(g) > 1)
    assert BURSTED in pair and len(pair) == 2, json.dumps(s)
    assert sorted(s["groups"]) == sorted([pair] + [[r] for r in GROUP if r not in pair])
    for rep, was in zip(s["replicas"], logged):
        if rep["replica"] not in pair:  # stood by: unchanged, nothing logged
            assert len(rep["transitions"]) == was and rep["kv_capacity_tokens"] == WHOLE_TOKENS
            continue
        drop = rep["transitions"][-1]
        assert (drop["action"], drop["trigger"], drop["group"]) == ("drop", "auto", pair), drop
        assert f"over replica {BURSTED}'s capacity" in drop["reason"], drop
        assert rep["kv_capacity_tokens"] == rep["kv_capacity_tokens_merged"] > WHOLE_TOKENS
    assert s["replicas"][0]["auto"]["proposals"] == 1
    assert [rep["auto"]["errors"] for rep in s["replicas"]] == [0] * 4  # every view was read

    r = post(dp4, "restore", json={"group": pair})
    assert r.status_code == 200 and r.json()["groups"] == ALONE, r.text
