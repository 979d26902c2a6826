"""AMOEBAs on four replicas of the tiny random Llama (8 query / 4 KV heads): groups of 2 and 4.

One ``--dp-size 4 --enable-amoebas --amoebas-manual`` server (float32, greedy) per merged
forward: batched (each step of every member's batch one forward, run by the group's leader:
replica 0 for ``[0, 1]`` and the four, replica 2 for ``[2, 3]``) and per owner. The reference
is each prompt's output on the replicas serving alone, three prompts per replica. Every
replica is a member of two links (its pair's and the group of four), so this checks that the
groups' links, service threads and votes keep apart. Across every transition three requests
stream on every replica and finish with the reference outputs:

- 4 x TP 1 -> 2 x TP 2: ``[0, 1]`` and ``[2, 3]`` merge (each member keeps 2 of the 4 KV
  heads and half the FFN rows); both groups serve every replica's requests at once;
- 2 x TP 2 -> TP 4: the two groups merge into one (shard order 0, 2, 1, 3: each member keeps
  one KV head and a quarter of the FFN rows, inside what it kept in its pair, so no FFN row
  moves);
- TP 4 -> 2 x TP 2 -> 4 x TP 1: it splits into the pairs, then the pairs split; every FFN byte
  is back (the same digest as before the first merge);
- 4 x TP 1 -> TP 4 -> 4 x TP 1 directly;
- refused, changing nothing: a merge of the four while only one pair is merged (409), a split
  into a degree the group cannot split into (400).
"""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

from conftest import running_server
from sglang_morph.models.tiny import tiny_model_path
from test_morph_runtime_server import USER, Stream

REPLICAS = (0, 1, 2, 3)
PER_REPLICA = 3  # requests in flight on each replica across each transition
N_NEW = 16
FOUR = [0, 1, 2, 3]


@pytest.fixture(scope="module", params=["batched", "per-owner"])
def dp4(request, tmp_path_factory):
    # One server per merged forward, stopped before the next starts (two of four ranks each
    # would not fit beside the other test process's servers).
    with running_server(("--model-path", str(tiny_model_path()), "--dtype", "float32",
                         "--dp-size", "4", "--enable-amoebas", "--amoebas-manual",
                         "--max-total-tokens", "512", "--amoebas-merged-forward",
                         request.param, "--enable-metrics"),
                        tmp_path_factory.mktemp("server")) as server:
        server.merged_forward = request.param
        yield server


def prompt(seed: int, n: int = 24) -> list[int]:
    return [(seed * 131 + i * 17) % 500 + 3 for i in range(n)]


def jobs() -> list[tuple[int, int]]:
    """(replica, prompt seed) of every request, PER_REPLICA per replica."""
    return [(r, r + len(REPLICAS) * k) for r in REPLICAS for k in range(PER_REPLICA)]


def generate_on(server, ids, replica: int) -> list[int]:
    r = requests.post(f"{server.url}/generate", timeout=600, json={
        "input_ids": ids, "routed_dp_rank": replica,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def post(server, route: str, body) -> requests.Response:
    return requests.post(f"{server.url}/amoebas/{route}", json=body, timeout=600)


def units(server, digest: bool = False) -> dict:
    r = requests.get(f"{server.url}/amoebas/status", params={"digest": int(digest)}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(dp4):
    return {job: generate_on(dp4, prompt(job[1]), job[0]) for job in jobs()}


def all_at_once(server) -> dict:
    with concurrent.futures.ThreadPoolExecutor(len(jobs())) as pool:
        outs = pool.map(lambda job: generate_on(server, prompt(job[1]), job[0]), jobs())
    return dict(zip(jobs(), outs))


def across(server, steps, reference) -> list[requests.Response]:
    """Each (route, body) of ``steps`` while PER_REPLICA requests stream on every replica;
    the streams finish with their reference outputs."""
    streams = {job: Stream(server, prompt(job[1]), N_NEW, routed_dp_rank=job[0])
               for job in jobs()}
    for stream in streams.values():
        stream.wait_for(2)
    answers = [post(server, route, body) for route, body in steps]
    assert {job: s.join() for job, s in streams.items()} == reference
    return answers


def steps_led(server) -> dict:
    """Each leader's steps and the owners' batches they ran, by group."""
    return {g: n for b in units(server)["replicas"] for g, n in b["steps_led"].items()}


def assert_batched(server, before: dict, groups: list[str]) -> None:
    """Batched: the steps of ``groups`` since ``before`` carried several owners' batches at a
    time (all at once, the members' steps fall into line); per owner: no steps."""
    after = steps_led(server)
    if server.merged_forward == "per-owner":
        assert after == {}
        return
    for g in groups:
        steps = after[g]["steps"] - before[g]["steps"]
        batches = after[g]["batches"] - before[g]["batches"]
        assert steps > 0 and batches >= 1.5 * steps, (g, before[g], after[g])


def shards(status: dict) -> list:
    return [(b["group"], b["kv_heads"], b["ffn_rows"]) for b in status["replicas"]]


PAIRS_SHARDS = [([0, 1], [0, 2], [0, 256]), ([0, 1], [2, 4], [256, 512]),
                ([2, 3], [0, 2], [0, 256]), ([2, 3], [2, 4], [256, 512])]
# Shard order 0, 2, 1, 3: replica 1 keeps head 2 and rows 256-384, inside its pair's half.
FOUR_SHARDS = [(FOUR, [0, 1], [0, 128]), (FOUR, [2, 3], [256, 384]),
               (FOUR, [1, 2], [128, 256]), (FOUR, [3, 4], [384, 512])]


def test_pairs_then_the_group_of_four_and_back(dp4, reference):
    start = units(dp4, digest=True)
    assert start["units"] == [[0], [1], [2], [3]]
    assert start["replicas"][0]["groups_allowed"] == [[0, 1], [2, 3], FOUR]

    answers = across(dp4, [("merge", {"replicas": [0, 1]})], reference)
    assert answers[0].status_code == 200, answers[0].text
    # Only one pair merged: the four cannot merge yet, and nothing changes.
    before = units(dp4)
    refused = post(dp4, "merge", {"replicas": FOUR})
    assert refused.status_code == 409 and "serve as" in refused.text, refused.text
    assert shards(units(dp4)) == shards(before)
    answers = across(dp4, [("merge", {"replicas": [2, 3]})], reference)
    assert answers[0].status_code == 200, answers[0].text
    s = units(dp4)
    assert s["units"] == [[0, 1], [2, 3]] and shards(s) == PAIRS_SHARDS
    led = steps_led(dp4)
    assert all_at_once(dp4) == reference
    assert_batched(dp4, led, ["0-1", "2-3"])
    bad = post(dp4, "split", {"group": [0, 1], "degree": 2})
    assert bad.status_code == 400 and "cannot split into groups of 2" in bad.text, bad.text

    (merge,) = across(dp4, [("merge", {"replicas": FOUR})], reference)
    assert merge.status_code == 200, merge.text
    s = merge.json()
    assert s["units"] == [FOUR] and shards(s) == FOUR_SHARDS
    pair_capacity = before["replicas"][0]["kv_capacity_tokens"]
    assert all(b["kv_capacity_tokens"] > pair_capacity for b in s["replicas"])
    led = steps_led(dp4)
    assert all_at_once(dp4) == reference
    assert_batched(dp4, led, ["0-1-2-3"])

    (split,) = across(dp4, [("split", {"group": FOUR, "degree": 2})], reference)
    assert split.status_code == 200, split.text
    s = split.json()
    assert s["units"] == [[0, 1], [2, 3]] and shards(s) == PAIRS_SHARDS
    assert all(b["kv_capacity_tokens"] == pair_capacity for b in s["replicas"])
    assert all_at_once(dp4) == reference

    answers = across(dp4, [("split", {"group": [0, 1]}), ("split", {"group": [2, 3]})],
                     reference)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    end = units(dp4, digest=True)
    assert end["units"] == [[0], [1], [2], [3]]
    for b, b0 in zip(end["replicas"], start["replicas"]):
        assert b["ffn_sha256"] == b0["ffn_sha256"]  # every FFN byte back
        assert b["kv_capacity_tokens"] == b0["kv_capacity_tokens"]
        assert b["released_ffn_bytes"] == 0
    assert [t["action"] for t in end["replicas"][1]["transitions"]] == [
        "merge", "merge", "split", "split"]
    assert all_at_once(dp4) == reference


def metrics(server) -> dict[tuple[str, frozenset], float]:
    """Every ``sglang_morph_amoebas_*`` sample of ``/metrics``: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=60).text
    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for family in text_string_to_metric_families(text)
            for smp in family.samples if smp.name.startswith("sglang_morph_amoebas_")}


def test_four_replicas_merge_at_once_and_split_back(dp4, reference):
    (merge,) = across(dp4, [("merge", {"replicas": FOUR})], reference)
    assert merge.status_code == 200, merge.text
    s = merge.json()
    assert s["units"] == [FOUR] and shards(s) == FOUR_SHARDS
    assert all_at_once(dp4) == reference
    # Prometheus says what the status says: each replica's group and pool, the transitions,
    # the batches it ran in the group and (batched) the steps the group's leader ran.
    m, s = metrics(dp4), units(dp4)
    for b in s["replicas"]:
        r = ("replica", str(b["replica"]))
        assert m[("sglang_morph_amoebas_group_size", frozenset({r}))] == 4
        assert m[("sglang_morph_amoebas_kv_capacity_tokens", frozenset({r}))] == (
            b["kv_capacity_tokens"])
        assert m[("sglang_morph_amoebas_released_ffn_bytes", frozenset({r}))] == (
            b["released_ffn_bytes"]) > 0
        assert m[("sglang_morph_amoebas_transitions_total",
                  frozenset({r, ("action", "merge")}))] >= 1
        assert m[("sglang_morph_amoebas_merged_batches_total",
                  frozenset({r, ("whose", "own")}))] >= b["batches_merged"] > 0
    led = {g: (m.get(("sglang_morph_amoebas_steps_led_total",
                      frozenset({("replica", "0"), ("group", g)}))),
               m.get(("sglang_morph_amoebas_step_batches_total",
                      frozenset({("replica", "0"), ("group", g)}))))
           for g in ("0-1-2-3",)}
    if dp4.merged_forward == "batched":
        steps, batches = led["0-1-2-3"]
        assert steps == s["replicas"][0]["steps_led"]["0-1-2-3"]["steps"] > 0
        assert batches == s["replicas"][0]["steps_led"]["0-1-2-3"]["batches"] > steps
    else:
        assert led["0-1-2-3"] == (None, None)
    (split,) = across(dp4, [("split", {"group": FOUR})], reference)
    assert split.status_code == 200, split.text
    assert split.json()["units"] == [[0], [1], [2], [3]]
    assert all_at_once(dp4) == reference
