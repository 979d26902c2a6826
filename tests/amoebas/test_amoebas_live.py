"""AMOEBAs on live SGLang data-parallel replicas: ``--enable-amoebas --dp-size 3``.

Launch checks (no server): what AMOEBAs cannot serve is refused with one line naming the flag
and attaches nothing; a group degree that does not divide the heads is refused.

One DP 3 server of the default model (float32, greedy, CPU; 9 query / 3 KV heads, so the
groups are the three replicas alone or one group of three). The reference is the same
replicas' outputs before any merge (an untransformed DP server), checked on every replica:

- ``/amoebas/status``: three units of one replica, every head and FFN row, the one group the
  server allows;
- bad input (not JSON, unknown fields, a group the server does not allow, a split of a group
  that does not exist, no key, a user key) gets 4xx with a message and changes nothing;
- a merge that fails on one member (an injected fault in its KV write, after the others wrote
  theirs) answers 500 and leaves every member as it was; three requests streaming on each replica
  meanwhile finishes with the reference output;
- merge, while three requests stream on each replica: every replica keeps one KV head (its
  requests' other heads move to the members that keep them, live rows only) and a third of
  the FFN rows, releases the other
  two thirds in place (its RSS falls by at least 95% of those bytes) and gains exactly the KV
  tokens they hold, and its batches run on all three; outputs on each replica, one at a time
  and all at once (the members' batches of a step run as one forward, led by replica 0),
  equal the reference token for token, chosen-token logprobs within 1e-4 nats; a second
  merge is refused (409);
- a split that fails on one member's FFN gather leaves the group merged and unchanged;
- split, while three requests stream on each replica: every replica serves alone again with its
  startup capacity, every FFN byte back (the same digest; its RSS rises again by at least 95%
  of the released bytes) and the reference outputs; the transitions log says what happened.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import types

import pytest
import requests

from sglang_morph.amoebas import config as amoebas_config
from sglang_morph.amoebas.mechanism import MECHANISM as AMOEBAS
from sglang_morph.amoebas.replica import FAULT_REPLICA_ENV
from sglang_morph.plugin import configure
from sglang_morph.surface import PluginError
# (corpus_ids and tokenizer are that module's fixtures)
from test_morph_runtime_server import (  # noqa: F401
    ADMIN,
    USER,
    Stream,
    corpus_ids,
    prompt_ids,
    tokenizer,
)

N_NEW = 24
PROMPT_LENGTHS = (16, 60, 130)
LOGPROB_TOLERANCE = 1e-4
REPLICAS = (0, 1, 2)


# ---- launch checks (no server) ----

def launch_args(model_dir, **overrides):
    base = dict(dp_size=3, tp_size=1, pp_size=1, device="cpu", attention_backend="torch_native",
                speculative_algorithm=None, model_path=str(model_dir))
    return types.SimpleNamespace(**{**base, **overrides})


def cli(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"enable_amoebas": True, "amoebas_degrees": None,
                                 "amoebas_link_port": None, **flags})


@pytest.mark.parametrize("overrides, flags, enabled_before, message", [
    (dict(dp_size=1), {}, (), "--enable-amoebas needs --dp-size of at least 2 (got 1)"),
    ({}, {}, ("morph",), "--enable-amoebas and --enable-morph together are not supported"),
    ({}, {}, ("kunserve",), "--enable-amoebas and --enable-kunserve together"),
    (dict(tp_size=3), {}, (), "--tp-size"),
    (dict(device="cuda"), {}, (), "--device cpu"),
    (dict(attention_backend="triton"), {}, (), "--attention-backend torch_native"),
    ({}, dict(amoebas_degrees="2"), (),
     "--amoebas-degrees 2: a group of 2 cannot split the model's 9 query / 3 KV heads evenly"),
    (dict(dp_size=2), {}, (), "no group of --dp-size 2 replicas can split the model's 9 query"),
    ({}, dict(amoebas_degrees="3,x"), (), "--amoebas-degrees must be comma-separated integers"),
    ({}, dict(amoebas_step_wait_ms=-1.0), (), "--amoebas-step-wait-ms must be in [0, 1000]"),
    ({}, dict(amoebas_merged_forward="both"), (), "--amoebas-merged-forward must be one of"),
])
def test_launch_refuses_what_it_cannot_serve(default_model_path, overrides, flags,
                                             enabled_before, message):
    server_args = launch_args(default_model_path, **overrides)
    with pytest.raises(PluginError, match="sglang-morph: error: ") as e:
        configure(AMOEBAS, server_args, cli(**flags), frozenset(enabled_before))
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert not hasattr(server_args, amoebas_config.SERVER_ARGS_ATTR)  # nothing attached


def test_degrees_follow_the_heads_and_the_replicas(default_model_path):
    server_args = launch_args(default_model_path)
    assert configure(AMOEBAS, server_args, cli(amoebas_link_port=4000), frozenset())
    cfg = amoebas_config.get(server_args)
    assert cfg.degrees == (1, 3) and cfg.blocks() == ((0, 1, 2),)
    assert (cfg.merged_forward, cfg.step_wait_ms) == ("batched", 50.0)
    assert cfg.block_port((0, 1, 2)) == 4000
    # The tiny model's 8 query / 4 KV heads on 4 replicas: 1, 2 and 4, aligned groups.
    assert amoebas_config.allowed_degrees(8, 4, 4) == (1, 2, 4)
    tiny = amoebas_config.AmoebasConfig(True, 4, (1, 2, 4), 5000)
    assert tiny.blocks() == ((0, 1), (2, 3), (0, 1, 2, 3))
    assert [tiny.block_port(b) for b in tiny.blocks()] == [5000, 5001, 5002]


def test_without_the_flag_nothing_changes(default_model_path):
    server_args = launch_args(default_model_path, dp_size=1)
    assert not configure(AMOEBAS, server_args, cli(enable_amoebas=False), frozenset())
    assert not amoebas_config.get(server_args).enabled
    with pytest.raises(PluginError, match="--amoebas-degrees needs --enable-amoebas"):
        configure(AMOEBAS, server_args, cli(enable_amoebas=False, amoebas_degrees="3"),
                  frozenset())
    with pytest.raises(PluginError, match="--amoebas-step-wait-ms needs --enable-amoebas"):
        configure(AMOEBAS, server_args, cli(enable_amoebas=False, amoebas_step_wait_ms=5.0),
                  frozenset())


# ---- the live server ----

@pytest.fixture(scope="module")
def dp3(server_factory):
    # Replica 1 fails the first merge's KV write and the first split's FFN gather (test-only
    # fault points), after the other members completed theirs.
    return server_factory(
        "--dtype", "float32", "--dp-size", "3", "--enable-amoebas", "--amoebas-manual",
        "--max-total-tokens", "1024", "--api-key", "test-api-key", "--admin-api-key",
        "test-admin-key", env={"SGLANG_MORPH_FAULT": "kv_write,ffn_gather",
                               FAULT_REPLICA_ENV: "1"})


def status(server, digest: bool = False) -> dict:
    r = requests.get(f"{server.url}/amoebas/status", headers=USER, timeout=60,
                     params={"digest": 1} if digest else None)
    assert r.status_code == 200, r.text
    return r.json()


def post(server, route: str, body, headers=ADMIN) -> requests.Response:
    if isinstance(body, str):  # a raw body, still declared JSON (control routes take no other)
        headers, kwargs = {**headers, "Content-Type": "application/json"}, {"data": body}
    else:
        kwargs = {"json": body}
    return requests.post(f"{server.url}/amoebas/{route}", headers=headers, timeout=600, **kwargs)


def generate_on(server, ids, replica: int) -> tuple[list[int], list[float]]:
    """Greedy output ids and chosen-token logprobs of ``ids`` on one replica."""
    r = requests.post(f"{server.url}/generate", headers=USER, timeout=600, json={
        "input_ids": ids, "routed_dp_rank": replica, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["dp_rank"] == replica
    return body["output_ids"], [lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return [prompt_ids(corpus_ids, seed=40 + i, n_tokens=n)
            for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def reference(dp3, prompts):
    """Each prompt's output on the replicas serving alone (equal on all three)."""
    outs = [generate_on(dp3, ids, 0) for ids in prompts]
    for r in REPLICAS[1:]:
        assert [generate_on(dp3, ids, r)[0] for ids in prompts] == [o[0] for o in outs]
    return outs


def assert_like_reference(got, reference):
    ids, logprobs = got
    assert ids == reference[0]
    worst = max(abs(a - b) for a, b in zip(logprobs, reference[1]))
    assert worst <= LOGPROB_TOLERANCE, f"chosen-token logprobs differ by up to {worst}"


def every_output(server, prompts) -> list:
    """Each prompt on each replica, one at a time and then all at once."""
    one_by_one = [generate_on(server, ids, r) for r in REPLICAS for ids in prompts]
    jobs = [(ids, r) for r in REPLICAS for ids in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: generate_on(server, *job), jobs))
    return one_by_one + together


def test_status_before_any_merge(dp3):
    s = status(dp3)
    assert s["units"] == [[0], [1], [2]]
    for r, body in enumerate(s["replicas"]):
        assert body["replica"] == r and body["degree"] == 1
        assert body["kv_heads"] == [0, 3] and body["ffn_rows"] == [0, 1536]
        assert body["kv_capacity_tokens"] == 1024 and body["mirror_kv_capacity_tokens"] == {}
        assert body["groups_allowed"] == [[0, 1, 2]]


@pytest.mark.parametrize("route, body, headers, code, message", [
    ("merge", "not json", ADMIN, 400, "must be a JSON object"),
    ("merge", {"replicas": [0, 1, 2], "now": True}, ADMIN, 400, "unknown fields ['now']"),
    ("merge", {"replicas": [0]}, ADMIN, 400, "at least two distinct replica numbers"),
    ("merge", {"replicas": [0, 1]}, ADMIN, 400, "[0, 1] is not a group this server allows"),
    ("split", {"group": [0, 1, 2]}, ADMIN, 409, "replica 0 is not in group [0, 1, 2]"),
    ("split", {"group": [0, 1, 2], "degree": 2}, ADMIN, 400, "cannot split into groups of 2"),
    ("split", {"group": [0, 1, 2], "degree": "1"}, ADMIN, 400, "'degree' must be a positive"),
    ("merge", {"replicas": [0, 1, 2]}, {}, 401, ""),
    ("merge", {"replicas": [0, 1, 2]}, USER, 401, ""),
])
def test_bad_requests_get_4xx_and_change_nothing(dp3, route, body, headers, code, message):
    before = status(dp3)
    r = post(dp3, route, body, headers)
    assert r.status_code == code, r.text
    assert message in r.text
    after = status(dp3)
    assert after["units"] == before["units"] == [[0], [1], [2]]
    assert [b["transitions"] for b in after["replicas"]] == [
        b["transitions"] for b in before["replicas"]]


def test_a_prompt_no_replica_holds_is_refused_without_automatic_transitions(dp3, corpus_ids):
    """As on plain data-parallel replicas (``--amoebas-manual`` never merges by itself)."""
    r = requests.post(f"{dp3.url}/generate", headers=USER, timeout=600, json={
        "input_ids": prompt_ids(corpus_ids, seed=60, n_tokens=1500),
        "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert r.status_code == 400 and "exceeds the maximum allowed length" in r.text, r.text
    assert status(dp3)["units"] == [[0], [1], [2]]


def model_bytes(model_dir) -> tuple[int, int]:
    """(FFN bytes a member of a group of 3 releases, KV bytes per token of every head and
    layer), float32, from the model's shapes."""
    cfg = json.loads((model_dir / "config.json").read_text())
    layers, hidden, inter = (cfg["num_hidden_layers"], cfg["hidden_size"],
                             cfg["intermediate_size"])
    head_dim = hidden // cfg["num_attention_heads"]
    ffn_bytes = layers * 3 * inter * hidden * 4
    return ffn_bytes * 2 // 3, layers * 2 * cfg["num_key_value_heads"] * head_dim * 4


def streams_across(server, route: str, body, prompts, reference) -> requests.Response:
    """``route`` while every prompt streams on every replica (three requests per replica, each
    a few tokens in); the streams finish with their reference outputs. The transition's
    answer."""
    jobs = [(r, i) for r in REPLICAS for i in range(len(prompts))]
    streams = [Stream(server, prompts[i], N_NEW, routed_dp_rank=r) for r, i in jobs]
    for stream in streams:
        stream.wait_for(3)
    r = post(server, route, body)
    assert [stream.join() for stream in streams] == [reference[i][0] for _, i in jobs]
    return r


def snapshot(server) -> list:
    """What a failed transition must leave as it was: each replica's group, capacity, FFN
    bytes (digest) and transitions applied."""
    return [(b["group"], b["kv_capacity_tokens"], b["released_ffn_bytes"], b["ffn_sha256"],
             [t["action"] for t in b["transitions"]]) for b in status(server, digest=True)["replicas"]]


def test_merge_and_split_keep_every_output(dp3, prompts, reference, default_model_path):
    released, kv_bytes_per_token = model_bytes(default_model_path)
    before = snapshot(dp3)
    # The first merge fails on replica 1 after the others wrote their rows: undone on all.
    r = streams_across(dp3, "merge", {"replicas": [0, 1, 2]}, prompts, reference)
    assert r.status_code == 500 and "undone" in r.text and "kv_write" in r.text, r.text
    assert snapshot(dp3) == before

    r = streams_across(dp3, "merge", {"replicas": [0, 1, 2]}, prompts, reference)
    assert r.status_code == 200, r.text
    merged = r.json()
    assert merged["units"] == [[0, 1, 2]]
    capacity = 1024 + released // kv_bytes_per_token
    for i, body in enumerate(merged["replicas"]):
        assert body["degree"] == 3 and body["group"] == [0, 1, 2]
        assert body["kv_heads"] == [i, i + 1] and body["ffn_rows"] == [512 * i, 512 * (i + 1)]
        # The FFN rows it no longer keeps are released in place and the bytes are KV tokens,
        # exactly as the model's shapes say; the process really gave them back.
        assert body["released_ffn_bytes"] == released
        assert body["kv_capacity_tokens"] == capacity
        assert body["mirror_kv_capacity_tokens"] == {str(q): capacity for q in REPLICAS
                                                     if q != i}
        assert body["transitions"][-1]["rss_drop_bytes"] >= 0.95 * released
    for got, ref in zip(every_output(dp3, prompts), reference * len(REPLICAS) * 2):
        assert_like_reference(got, ref)
    s = status(dp3)
    assert all(b["batches_merged"] > 0 and b["batches_served_for_others"] > 0
               for b in s["replicas"])
    led = s["replicas"][0]["steps_led"]["0-1-2"]
    assert led["batches"] > led["steps"] > 0, led  # some steps ran several owners' batches
    again = post(dp3, "merge", {"replicas": [0, 1, 2]})
    assert again.status_code == 409 and "already serves in group [0, 1, 2]" in again.text

    # The first split fails on replica 1's FFN gather: every member stays merged, unchanged.
    merged_state = snapshot(dp3)
    r = streams_across(dp3, "split", {"group": [0, 1, 2]}, prompts, reference)
    assert r.status_code == 500 and "ffn_gather" in r.text, r.text
    assert snapshot(dp3) == merged_state

    r = streams_across(dp3, "split", {"group": [0, 1, 2]}, prompts, reference)
    assert r.status_code == 200, r.text
    assert r.json()["units"] == [[0], [1], [2]]
    after = snapshot(dp3)
    assert [a[:4] for a in after] == [b[:4] for b in before]  # every FFN byte back, bit for bit
    for body in status(dp3)["replicas"]:  # and the memory: the process took the pages back
        assert body["transitions"][-1]["rss_rise_bytes"] >= 0.95 * released
    for got, ref in zip(every_output(dp3, prompts), reference * len(REPLICAS) * 2):
        assert_like_reference(got, ref)
    for body in status(dp3)["replicas"]:
        assert [t["action"] for t in body["transitions"]] == ["merge", "split"]
        assert all(t["group"] == [0, 1, 2] for t in body["transitions"])


def test_elastic_status_lists_amoebas(dp3):
    r = requests.get(f"{dp3.url}/elastic/status", headers=USER, timeout=60)
    assert r.status_code == 200, r.text
    text = json.dumps(r.json())
    assert "amoebas" in text


def test_fuzzed_control_bodies_get_no_5xx(dp3):
    """Seeded random JSON bodies on the control routes (after the fault tests: a fuzzed merge
    that happens to be valid merges the replicas, which are split before comparing)."""
    from tests.http_fuzz import REPLICA_LISTS, SMALL, bodies, fuzz

    fields = {"/amoebas/merge": {"replicas": REPLICA_LISTS},
              "/amoebas/split": {"group": REPLICA_LISTS, "degree": SMALL}}
    before = status(dp3)
    fuzz(dp3.url, bodies(fields, any_shape=tuple(fields)), lambda route: ADMIN, 60)
    for unit in status(dp3)["units"]:
        if len(unit) > 1:
            assert post(dp3, "split", {"group": unit}).status_code == 200
    after = status(dp3)
    assert after["units"] == before["units"]
    assert [b["kv_capacity_tokens"] for b in after["replicas"]] == [
        b["kv_capacity_tokens"] for b in before["replicas"]]
