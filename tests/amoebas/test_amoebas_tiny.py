"""AMOEBAs on four replicas of the tiny random Llama (8 query / 4 KV heads): groups of 2 and 4.

One ``--dp-size 4 --enable-amoebas --amoebas-manual`` server (float32, greedy). The reference
is each prompt's output on the replicas serving alone. Every replica is a member of two links
(its pair's and the group of four), so this checks that the groups' links, service threads and
votes keep apart:
- ``[0, 1]`` and ``[2, 3]`` merge into two TP 2 groups (each member keeps 2 of the 4 KV heads
  and half the FFN rows) while a request streams on every replica; both groups then serve
  every replica's requests at once with the reference outputs; ``[0, 1, 2, 3]`` is refused
  while they are merged (409); both split back, with the reference outputs;
- the four merge into one TP 4 group (one KV head each) and split back, requests in flight.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

from sglang_morph.models.tiny import tiny_model_path
from test_morph_runtime_server import USER, Stream

REPLICAS = (0, 1, 2, 3)
N_NEW = 16


@pytest.fixture(scope="module")
def dp4(server_factory):
    return server_factory("--model-path", str(tiny_model_path()), "--dtype", "float32",
                          "--dp-size", "4", "--enable-amoebas", "--amoebas-manual",
                          "--max-total-tokens", "512")


def prompt(seed: int, n: int = 24) -> list[int]:
    return [(seed * 131 + i * 17) % 500 + 3 for i in range(n)]


def generate_on(server, ids, replica: int) -> list[int]:
    r = requests.post(f"{server.url}/generate", timeout=600, json={
        "input_ids": ids, "routed_dp_rank": replica,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def post(server, route: str, body) -> requests.Response:
    return requests.post(f"{server.url}/amoebas/{route}", json=body, timeout=600)


def units(server) -> list:
    r = requests.get(f"{server.url}/amoebas/status", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(dp4):
    return {r: generate_on(dp4, prompt(r), r) for r in REPLICAS}


def all_at_once(server) -> dict:
    with concurrent.futures.ThreadPoolExecutor(len(REPLICAS)) as pool:
        outs = pool.map(lambda r: generate_on(server, prompt(r), r), REPLICAS)
    return dict(zip(REPLICAS, outs))


def across(server, steps, reference) -> list[requests.Response]:
    """Each (route, body) of ``steps`` while a request streams on every replica; the streams
    finish with their reference outputs."""
    streams = {r: Stream(server, prompt(r), N_NEW, routed_dp_rank=r) for r in REPLICAS}
    for stream in streams.values():
        stream.wait_for(2)
    answers = [post(server, route, body) for route, body in steps]
    assert {r: s.join() for r, s in streams.items()} == reference
    return answers


def test_pairs_and_the_group_of_four(dp4, reference):
    assert units(dp4)["units"] == [[0], [1], [2], [3]]
    assert units(dp4)["replicas"][0]["groups_allowed"] == [[0, 1], [2, 3], [0, 1, 2, 3]]

    answers = across(dp4, [("merge", {"replicas": [0, 1]}), ("merge", {"replicas": [2, 3]})],
                     reference)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    s = units(dp4)
    assert s["units"] == [[0, 1], [2, 3]]
    assert [b["kv_heads"] for b in s["replicas"]] == [[0, 2], [2, 4], [0, 2], [2, 4]]
    assert [b["ffn_rows"] for b in s["replicas"]] == [[0, 256], [256, 512]] * 2
    assert all_at_once(dp4) == reference
    refused = post(dp4, "merge", {"replicas": [0, 1, 2, 3]})
    assert refused.status_code == 409 and "already serves in group" in refused.text

    answers = across(dp4, [("split", {"group": [0, 1]}), ("split", {"group": [2, 3]})],
                     reference)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert units(dp4)["units"] == [[0], [1], [2], [3]]
    assert all_at_once(dp4) == reference

    (merge,) = across(dp4, [("merge", {"replicas": [0, 1, 2, 3]})], reference)
    assert merge.status_code == 200, merge.text
    s = merge.json()
    assert s["units"] == [[0, 1, 2, 3]]
    assert [b["kv_heads"] for b in s["replicas"]] == [[i, i + 1] for i in REPLICAS]
    assert all_at_once(dp4) == reference
    (split,) = across(dp4, [("split", {"group": [0, 1, 2, 3]})], reference)
    assert split.status_code == 200, split.text
    assert all_at_once(dp4) == reference
