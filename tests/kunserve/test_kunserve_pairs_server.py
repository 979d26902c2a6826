"""KunServe's automatic control on four live SGLang data-parallel replicas (``--dp-size 4
--kunserve-auto``): two pairs, each with its own link, drops and restores, its own leader and
controller.

One server (float32, greedy, CPU, 256-token pools, interval 100 ms, dwell 1 s), against the
same replicas undropped (each prompt served alone first, one at a time, on the replica that
later serves it in a burst):

- a burst on replicas 2 and 3 only: pair [2, 3] drops by itself with requests in flight (the
  log says "auto" and the controller's reason) while pair [0, 1] stays whole and untouched;
  every output equals its undropped one token for token; the pair restores by itself once
  idle, to exactly the startup layout;
- a burst on all four: both pairs drop, each by its own controller, and restore; outputs equal;
- the operator's routes name a pair: a drop without a body, of a group that is not a pair, or
  of three replicas is a 400 and changes nothing; ``{"group": [0, 1]}`` drops that pair only,
  while requests stream on both of its replicas, which finish with their undropped outputs.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import requests

# (corpus_ids and tokenizer are that module's fixtures)
from test_morph_runtime_server import ADMIN, Stream, corpus_ids, prompt_ids, tokenizer  # noqa: F401
from test_kunserve_auto import AUTO as AUTO_DEFAULTS
from test_kunserve_live import generate_on as generate_long, status, while_in_flight

N_NEW = 16
WHOLE_TOKENS = 256
PROMPT_TOKENS = 104  # + N_NEW: two fit a whole replica's pool, three do not
PER_REPLICA = 3
# Long enough that the streams still run when the drop lands (40 had ended by then once, under
# the parallel suite); 104 + 120 tokens fit a whole replica's pool.
STREAM_NEW = 120

# Every running request counts toward the demand: with finishing_steps 8 (16 is the default),
# a burst whose third request reached a replica late (its client thread delayed under the
# parallel suite) found the first two within 8 steps of their end and rightly did not drop.
AUTO = {**AUTO_DEFAULTS, "finishing_steps": 0}

REPLICAS = range(4)
ALONE = [[0], [1], [2], [3]]


@pytest.fixture(scope="module")
def dp4(server_factory):
    return server_factory(
        "--dtype", "float32", "--dp-size", "4", "--enable-kunserve", "--kunserve-auto",
        "--kunserve-auto-config", json.dumps(AUTO), "--max-total-tokens", str(WHOLE_TOKENS),
        "--api-key", "test-api-key", "--admin-api-key", "test-admin-key")


def generate_on(server, ids, replica: int) -> list[int]:
    return generate_long(server, ids, replica, n_new=N_NEW)


def wait_for(server, predicate, timeout_s: float) -> dict:
    """The status once ``predicate`` holds, or the last one after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = status(server)
        if predicate(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return [[prompt_ids(corpus_ids, seed=60 + PER_REPLICA * r + i, n_tokens=PROMPT_TOKENS)
             for i in range(PER_REPLICA)] for r in REPLICAS]


@pytest.fixture(scope="module")
def undropped(dp4, prompts):
    """Each replica's prompts, one at a time on that replica (its demand fits a whole pool)."""
    assert status(dp4)["groups"] == ALONE
    return [[generate_on(dp4, ids, r) for ids in prompts[r]] for r in REPLICAS]


def burst(server, prompts, replicas) -> list[list[list[int]]]:
    """Every prompt of ``replicas`` at once, each on its replica: outputs per replica."""
    jobs = [(ids, r) for r in replicas for ids in prompts[r]]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: generate_on(server, *job), jobs))
    return [outs[i * PER_REPLICA:(i + 1) * PER_REPLICA] for i in range(len(replicas))]


def actions(s: dict) -> list[list[tuple[str, str]]]:
    return [[(t["action"], t["trigger"]) for t in rep["transitions"]] for rep in s["replicas"]]


def test_the_pairs_start_apart_each_with_its_own_leader(dp4, undropped):
    s = status(dp4)
    assert s["groups"] == ALONE
    assert [rep["replica"] for rep in s["replicas"]] == list(REPLICAS)
    assert [rep["auto"]["role"] for rep in s["replicas"]] == ["leader", "follower"] * 2
    assert all(rep["auto"]["views"] > 0 for rep in s["replicas"])
    # The undropped replicas agree with each other (one thread each, float32).
    probe = [5] * 8 + list(range(40, 80))
    outs = [generate_on(dp4, probe, r) for r in REPLICAS]
    assert outs == [outs[0]] * 4 and undropped


def test_a_burst_on_one_pair_drops_that_pair_only(dp4, prompts, undropped):
    # Three requests on each replica of pair [2, 3] at once: 360 tokens of demand on each
    # 256-token pool. The pair drops and restores once idle (usage under 50%, demand fits),
    # back to exactly the startup layout.
    assert burst(dp4, prompts, (2, 3)) == undropped[2:]
    s = wait_for(dp4, lambda s: all(len(rep["transitions"]) == 2 for rep in s["replicas"][2:]),
                 timeout_s=30)
    assert actions(s) == [[], [], [("drop", "auto"), ("restore", "auto")],
                          [("drop", "auto"), ("restore", "auto")]], json.dumps(s)
    assert s["groups"] == ALONE
    for rep in s["replicas"][2:]:
        drop, restore = rep["transitions"]
        assert drop["reason"].startswith("predicted KV demand") and "over replica" in (
            drop["reason"])
        assert "under 50%" in restore["reason"]
        assert drop["layers"] == ([0, 15] if rep["replica"] == 2 else [15, 30])
        assert drop["kv_capacity_tokens"] == [WHOLE_TOKENS, rep["kv_capacity_tokens_merged"]]
        assert restore["kv_capacity_tokens"] == [rep["kv_capacity_tokens_merged"], WHOLE_TOKENS]
        assert restore["at_unix_s"] - drop["at_unix_s"] >= AUTO["min_dwell_s"]
        assert rep["layers"] == [0, 30] and rep["kv_capacity_tokens"] == WHOLE_TOKENS
        assert rep["dropped_weight_bytes"] == 0 and rep["peer_kv_capacity_tokens"] == 0
        assert rep["auto"]["config"] == {**rep["auto"]["config"], **AUTO}
    # Whether a request was already running when the pair dropped depends on how far SGLang
    # got before the controller's next view (once, under the parallel suite, none was: the
    # drop came on the queue alone); a drop with streams running is the operator test's below.
    # The other pair was never asked: whole layers, whole pools, no proposal.
    for rep in s["replicas"][:2]:
        assert rep["layers"] == [0, 30] and rep["kv_capacity_tokens"] == WHOLE_TOKENS
        assert rep["auto"]["proposals"] == 0
    assert [generate_on(dp4, prompts[r][0], r) for r in REPLICAS] == [
        undropped[r][0] for r in REPLICAS]


def test_a_burst_on_both_pairs_drops_each_by_its_own_controller(dp4, prompts, undropped):
    before = [len(t) for t in actions(status(dp4))]
    assert burst(dp4, prompts, REPLICAS) == undropped
    s = wait_for(dp4, lambda s: s["groups"] == ALONE and all(
        len(a) == n + 2 for a, n in zip(actions(s), before)), timeout_s=40)
    assert [a[n:] for a, n in zip(actions(s), before)] == [
        [("drop", "auto"), ("restore", "auto")]] * 4, json.dumps(s)
    # Each pair's leader proposed its own pair's transitions.
    assert [rep["auto"]["proposals"] for rep in s["replicas"]] == [
        2, 2, before[2] + 2, before[3] + 2]
    assert [generate_on(dp4, prompts[r][1], r) for r in REPLICAS] == [
        undropped[r][1] for r in REPLICAS]


def post(server, route: str, **kwargs) -> requests.Response:
    return requests.post(f"{server.url}/kunserve/{route}", headers=ADMIN, timeout=600, **kwargs)


def test_the_operator_names_a_pair_and_bad_groups_change_nothing(dp4, prompts, undropped):
    s = wait_for(dp4, lambda s: s["groups"] == ALONE, timeout_s=30)
    before = actions(s)
    for kwargs, message in (
            ({}, 'name the pair to change, e.g. {"group": [0, 1]}: the pairs are '
                 '[[0, 1], [2, 3]]'),
            ({"json": {"group": [1, 2]}}, "no pair [1, 2]: the pairs are [[0, 1], [2, 3]]"),
            ({"json": {"group": [0, 1, 2]}},
             "'group' must name a pair of replicas, got [0, 1, 2]")):
        r = post(dp4, "drop", **kwargs)
        assert r.status_code == 400 and r.json()["error"] == message, r.text
    assert actions(status(dp4)) == before

    # A drop of pair [0, 1] while a prompt streams on each of its replicas.
    whole = [generate_long(dp4, prompts[r][2], r, n_new=STREAM_NEW) for r in (0, 1)]
    assert [out[:N_NEW] for out in whole] == [undropped[0][2], undropped[1][2]]
    r, streamed = while_in_flight(
        dp4, lambda: [Stream(dp4, prompts[r][2], STREAM_NEW, routed_dp_rank=r)
                      for r in (0, 1)],
        (0, 1), lambda: post(dp4, "drop", json={"group": [0, 1]}))
    assert r.status_code == 200, r.text
    assert r.json()["groups"] == [[0, 1], [2], [3]]
    assert streamed == whole
    assert [rep["transitions"][-1]["requests_in_flight"]
            for rep in r.json()["replicas"][:2]] == [1, 1]
    # Its controller restores it once idle; pair [2, 3] saw nothing.
    s = wait_for(dp4, lambda s: s["groups"] == ALONE, timeout_s=30)
    assert s["groups"] == ALONE, json.dumps(s)
    after = actions(s)
    assert after[2:] == before[2:]
    assert [a[len(b):] for a, b in zip(after[:2], before[:2])] == [
        [("drop", "operator"), ("restore", "auto")]] * 2
