"""AMOEBAs' automatic transitions on live replicas: ``--enable-amoebas --dp-size 3
--max-total-tokens 512`` (default model, float32, greedy, CPU).

- A 1,500-token prompt no replica's 512-token pool can hold is served: the replica it reaches
  parks it and proposes a merge; the three replicas merge (their released FFN rows become KV)
  and the prompt runs in the group. Its output equals transformers' greedy output of the same
  prompt (a single model with all the memory it needs).
- Short requests keep being served meanwhile: one streams on each replica across the merge
  and finishes with the output it has on a replica serving alone.
- Once the long request is done and the group's KV is at least half free, the group splits by
  itself; every replica is back at 512 tokens with every FFN byte (the same digest).
- The data-parallel controller places requests by the policy: by free KV, holding what fits
  nowhere until a request finishes.
The same prompt on AMOEBAs without automatic transitions (as on plain data-parallel replicas)
is refused with SGLang's 400 in ``test_amoebas_live.py``.
"""

from __future__ import annotations

import time

import pytest
import requests
import torch

from test_amoebas_live import REPLICAS, generate_on, status
# (corpus_ids and tokenizer are that module's fixtures)
from test_morph_runtime_server import USER, Stream, corpus_ids, prompt_ids, tokenizer  # noqa: F401

LONG_TOKENS, LONG_NEW = 1500, 12
SHORT_NEW = 24


@pytest.fixture(scope="module")
def dp3_small(server_factory):
    return server_factory("--dtype", "float32", "--dp-size", "3", "--enable-amoebas",
                          "--max-total-tokens", "512", "--api-key", "test-api-key")


@pytest.fixture(scope="module")
def long_prompt(corpus_ids):
    return prompt_ids(corpus_ids, seed=60, n_tokens=LONG_TOKENS)


@pytest.fixture(scope="module")
def long_reference(default_model_path, long_prompt) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_path,
                                                 dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([long_prompt]), max_new_tokens=LONG_NEW,
                             do_sample=False)
    return out[0, LONG_TOKENS:].tolist()


def test_a_prompt_no_replica_holds_merges_the_group_and_is_served(
        dp3_small, corpus_ids, long_prompt, long_reference):
    shorts = [prompt_ids(corpus_ids, seed=70 + r, n_tokens=40) for r in REPLICAS]
    alone = [generate_on(dp3_small, ids, r)[0][:SHORT_NEW] for r, ids in zip(REPLICAS, shorts)]
    digests = [b["ffn_sha256"] for b in status(dp3_small, digest=True)["replicas"]]
    streams = [Stream(dp3_small, ids, SHORT_NEW, routed_dp_rank=r)
               for r, ids in zip(REPLICAS, shorts)]
    for stream in streams:
        stream.wait_for(2)
    r = requests.post(f"{dp3_small.url}/generate", headers=USER, timeout=900, json={
        "input_ids": long_prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": LONG_NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == long_reference
    assert [stream.join() for stream in streams] == alone

    merges = [t for b in status(dp3_small)["replicas"] for t in b["transitions"]
              if t["action"] == "merge"]
    assert len(merges) == 3 and {t["trigger"] for t in merges} == {"auto"}
    assert all(t["reason"] == f"a {LONG_TOKENS}-token prompt" for t in merges)
    assert all(t["kv_capacity_tokens"] > LONG_TOKENS + LONG_NEW for t in merges)

    deadline = time.monotonic() + 120
    while status(dp3_small)["units"] != [[0], [1], [2]]:
        assert time.monotonic() < deadline, status(dp3_small)
        time.sleep(0.5)
    after = status(dp3_small, digest=True)["replicas"]
    assert [b["ffn_sha256"] for b in after] == digests
    assert all(b["kv_capacity_tokens"] == 512 for b in after)
    assert all(b["transitions"][-1]["action"] == "split"
               and b["transitions"][-1]["trigger"] == "auto" for b in after)


def place(server, ids, n_new: int) -> tuple[list[int], int]:
    """Greedy output ids of ``ids`` placed by the data-parallel controller, and its replica."""
    r = requests.post(f"{server.url}/generate", headers=USER, timeout=900, json={
        "input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["dp_rank"]


def test_the_controller_places_by_free_kv_and_holds_what_fits_nowhere(dp3_small, corpus_ids):
    """A replica whose pool a running request nearly fills gets no short request (round-robin
    would send it every third); requests no pool has room for wait in the controller and are
    placed once a request finishes."""
    from concurrent.futures import ThreadPoolExecutor

    deadline = time.monotonic() + 120
    while status(dp3_small)["units"] != [[0], [1], [2]]:
        assert time.monotonic() < deadline, status(dp3_small)
        time.sleep(0.5)
    big = [prompt_ids(corpus_ids, seed=80 + k, n_tokens=400) for k in range(4)]  # +40: 440
    short = [prompt_ids(corpus_ids, seed=90 + k, n_tokens=60) for k in range(4)]  # +20: 80
    with ThreadPoolExecutor(8) as pool:
        # The first big request decodes 100 tokens (500 held) so that it is still running
        # while its replica is looked up and the shorts arrive, also on a loaded machine.
        first = pool.submit(place, dp3_small, big[0], 100)
        deadline = time.monotonic() + 120
        while not any(b["kv_used_tokens"] >= 400 for b in status(dp3_small)["replicas"]):
            assert not first.done() and time.monotonic() < deadline, status(dp3_small)
            time.sleep(0.05)
        busy = next(b["replica"] for b in status(dp3_small)["replicas"]
                    if b["kv_used_tokens"] >= 400)
        shorts = [pool.submit(place, dp3_small, ids, 20) for ids in short]
        time.sleep(0.5)  # the shorts reach the controller first
        bigs = [pool.submit(place, dp3_small, ids, 40) for ids in big[1:]]
        placed_shorts = [f.result() for f in shorts]
        placed_bigs = [f.result() for f in (first, *bigs)]
    assert all(len(ids) == 20 for ids, _ in placed_shorts)
    assert busy not in {rank for _, rank in placed_shorts}, (busy, placed_shorts)
    assert [len(ids) for ids, _ in placed_bigs] == [100, 40, 40, 40]
    assert placed_bigs[0][1] == busy
