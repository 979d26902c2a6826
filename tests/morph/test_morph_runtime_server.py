"""MorphServe runtime in a live server: in-place layer swaps, KV growth and shrink, control API.

One float32 server (exact greedy equality with transformers holds in float32), manual control
only (``--disable-morph-controller``), a small memory budget so that the KV growth matters, and
SGLang's ``--api-key`` plus ``--admin-api-key``. The controller's end-to-end test under a burst
has its own server at the end.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import requests
import torch

from conftest import DATA_DIR, running_server
from sglang_morph.engines import hf_variants
from sglang_morph.engines.manifest import EngineManifest

API_KEY = "test-api-key"
ADMIN_KEY = "test-admin-key"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# float32 weights are about 540 MB; this leaves a KV pool of ~1,300 tokens (~3,400 with 8 layers
# at W4): small enough that the prompts which fill it prefill quickly on a 2-core CPU.
BUDGET_BYTES = 600_000_000
BUDGET = f"{BUDGET_BYTES // 1_000_000}MB"
SWAPPED = [17, 14, 13, 15, 12, 25, 16, 26]  # the first 8 of the LIS profile order


@pytest.fixture(scope="module")
def server(server_factory, engines_awq, tmp_path_factory):
    log = tmp_path_factory.mktemp("morph_log") / "transitions.jsonl"
    srv = server_factory(
        "--dtype", "float32", "--enable-morph", "--morph-engines", str(engines_awq),
        "--morph-memory-budget", BUDGET, "--disable-morph-controller", "--morph-log", str(log),
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--enable-metrics",
        "--elastic-metrics-auth",
    )
    srv.transitions_log = log
    srv.engines = engines_awq
    return srv


def status(server) -> dict:
    r = requests.get(f"{server.url}/morph/status", headers=USER, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def swap(server, layers, bits, headers=ADMIN) -> requests.Response:
    return requests.post(f"{server.url}/morph/swap", json={"layers": layers, "bits": bits},
                         headers=headers, timeout=600)


def generate_ids(server, ids, n_new) -> list[int]:
    r = requests.post(f"{server.url}/generate", headers=USER, timeout=600, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@contextlib.contextmanager
def paused(server):
    """SGLang's in-place pause (``/pause_generation``) for the block: running requests stay in
    the running batch and produce nothing, the scheduler still takes control requests; they
    go on at the end of the block (``/continue_generation``)."""
    r = requests.post(f"{server.url}/pause_generation", json={"mode": "in_place"},
                      headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    try:
        yield
    finally:
        r = requests.post(f"{server.url}/continue_generation", json={}, headers=ADMIN,
                          timeout=60)
        assert r.status_code == 200, r.text


class Stream:
    """One streamed greedy /generate in a thread; ``ids`` grows as chunks arrive."""

    def __init__(self, server, ids, n_new, **fields):
        """``fields``: more /generate fields (e.g. ``routed_dp_rank``)."""
        self.ids: list[int] = []
        self.error: BaseException | None = None
        self.finish_reason = None
        self._thread = threading.Thread(target=self._run, args=(server, ids, n_new, fields),
                                        daemon=True)
        self._thread.start()

    def _run(self, server, ids, n_new, fields):
        try:
            with requests.post(f"{server.url}/generate", headers=USER, stream=True, timeout=900,
                               json={"input_ids": ids, "stream": True, "sampling_params": {
                                   "temperature": 0, "max_new_tokens": n_new,
                                   "ignore_eos": True}, **fields}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    self.ids = list(chunk["output_ids"])
                    self.finish_reason = chunk["meta_info"].get("finish_reason")
        except BaseException as e:  # reported by join()
            self.error = e

    def wait_for(self, n_tokens: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ids) < n_tokens:
            assert self._thread.is_alive() or len(self.ids) >= n_tokens, self.error
            assert time.monotonic() < deadline, f"stream stuck at {len(self.ids)} tokens"
            time.sleep(0.02)

    def join(self) -> list[int]:
        self._thread.join(timeout=900)
        assert self.error is None, self.error
        return self.ids


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return hf_variants.load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def corpus_ids(tokenizer) -> list[int]:
    return tokenizer((DATA_DIR / "text" / "wikitext2_test.txt").read_text())[
        "input_ids"]


def prompt_ids(corpus_ids, seed: int, n_tokens: int) -> list[int]:
    """``n_tokens`` of WikiText-2 at a per-seed offset: distinct prompts for distinct seeds
    (no shared prefix, so no radix-cache hit between them)."""
    start = seed * 600
    assert start + n_tokens <= len(corpus_ids)
    return corpus_ids[start:start + n_tokens]


def test_status_shape_and_budget(server):
    s = status(server)
    assert s["mode"] == "default" and s["controller"] is False
    assert [layer["bits"] for layer in s["layers"]] == [16] * 30
    assert s["available_bits"] == [4, 8, 16]
    assert s["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 heads, fp32
    assert s["kv_capacity_tokens"] == s["kv_capacity_tokens_at_start"] > 1000
    assert s["weight_bytes"] + s["kv_bytes"] <= s["memory_budget_bytes"] == BUDGET_BYTES
    assert s["free_budget_bytes"] < s["kv_bytes_per_token"]  # the launcher filled the budget
    # Every W8 and W4 variant of all 30 layers staged in host memory at startup, as stored,
    # except that q/k/v and gate/up keep one copy of the AWQ input scale they share.
    manifest = EngineManifest.load(server.engines)
    variants = [manifest.variant(i, b) for i in range(30) for b in (8, 4)]
    shared_scales = sum(3 * manifest.model["hidden_size"] * 2 for v in variants if v.awq)
    assert s["staged_variants_host_bytes"] == sum(v.device_bytes for v in variants) - shared_scales
    assert s["pinned_layers"] == [] and not any(layer["pinned"] for layer in s["layers"])
    assert s["failed_transitions_total"] == s["refused_transitions_total"] == 0


def test_bad_requests_get_4xx_and_change_nothing(server):
    before = status(server)
    cases = [
        ({"layers": [30], "bits": 4}, "unknown layers [30]"),
        ({"layers": [-1], "bits": 4}, "unknown layers [-1]"),
        ({"layers": [1, 1], "bits": 4}, "repeat"),
        ({"layers": [1], "bits": 3}, "no 3-bit variant"),
        ({"layers": [], "bits": 4}, "non-empty list"),
        ({"layers": [1], "bits": "4"}, "'bits' must be an integer"),
        ({"layers": [1], "bits": 4, "extra": 1}, "unknown fields"),
        ({"layers": [1], "bits": 4, "pin": "no"}, "'pin' must be true or false"),
    ]
    for body, needle in cases:
        r = requests.post(f"{server.url}/morph/swap", json=body, headers=ADMIN, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"], (body, r.text)
    r = requests.post(f"{server.url}/morph/swap", data="{not json", timeout=60,
                      headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 400
    r = requests.post(f"{server.url}/morph/mode", json={"mode": "fastest"}, headers=ADMIN,
                      timeout=60)
    assert r.status_code == 400 and "fastest" in r.json()["error"]
    after = status(server)
    for key in ("layers", "kv_capacity_tokens", "transitions_total", "mode"):
        assert after[key] == before[key], key


def test_control_endpoints_obey_api_and_admin_keys(server):
    before = status(server)
    assert requests.get(f"{server.url}/morph/status", timeout=60).status_code == 401
    for headers in ({}, USER, {"Authorization": "Bearer wrong"}):
        assert swap(server, [0], 4, headers=headers).status_code == 401
        r = requests.post(f"{server.url}/morph/mode", json={"mode": "performance"},
                          headers=headers, timeout=60)
        assert r.status_code == 401
    after = status(server)
    assert after["layers"] == before["layers"] and after["mode"] == before["mode"]
    r = requests.post(f"{server.url}/morph/mode", json={"mode": "performance"}, headers=ADMIN,
                      timeout=60)
    assert r.status_code == 200 and r.json()["mode"] == "performance"
    r = requests.post(f"{server.url}/morph/mode", json={"mode": "default"}, headers=ADMIN,
                      timeout=60)
    assert r.json()["mode"] == "default"


def test_control_routes_refuse_what_a_web_page_could_send(server):
    """A page in a browser may POST text/plain without a preflight, with its own Origin."""
    before = status(server)
    body = json.dumps({"layers": [3], "bits": 4})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**ADMIN, **({"Content-Type": content_type} if content_type else {})}
        r = requests.post(f"{server.url}/morph/swap", data=body, headers=headers, timeout=60)
        assert r.status_code == 415 and "application/json" in r.json()["error"], r.text
    r = requests.post(f"{server.url}/morph/swap", data=body, timeout=60, headers={
        **ADMIN, "Content-Type": "application/json", "Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["error"], r.text
    # An error never repeats a huge body whole.
    r = requests.post(f"{server.url}/morph/swap", json={"layers": list(range(100_000)),
                                                        "bits": 4}, headers=ADMIN, timeout=60)
    assert r.status_code == 400 and "unknown layers [30, 31" in r.json()["error"], r.text[:200]
    assert len(r.content) < 2_000
    after = status(server)
    assert after["layers"] == before["layers"]
    assert after["transitions_total"] == before["transitions_total"]


def test_a_restore_of_a_full_precision_layer_changes_nothing(server):
    before = status(server)
    layer = next(x["index"] for x in before["layers"] if x["bits"] == 16 and not x["pinned"])
    assert swap(server, [layer], 16).status_code == 200
    after = status(server)
    assert after["layers"] == before["layers"] and after["pinned_layers"] == before[
        "pinned_layers"]


def test_metrics_need_the_api_key(server):
    assert requests.get(f"{server.url}/metrics", timeout=60).status_code == 401
    r = requests.get(f"{server.url}/metrics", headers=USER, timeout=60)
    assert r.status_code == 200 and "sglang_morph_kv_capacity_tokens" in r.text


def test_swap_grows_kv_by_freed_bytes_and_restore_returns_exactly(server, corpus_ids):
    prompts = [prompt_ids(corpus_ids, seed, 40) for seed in range(4)]
    before_outputs = [generate_ids(server, ids, 32) for ids in prompts]
    start = status(server)
    page = 1

    r = swap(server, SWAPPED, 4)
    assert r.status_code == 200, r.text
    s = r.json()
    t = s["transitions"][-1]
    assert t["action"] == "swap" and t["layers"] == SWAPPED and t["to_bits"] == 4
    assert t["freed_bytes"] > 8 * 10_000_000  # ~12 MB per float32 layer
    grown = s["kv_capacity_tokens"] - start["kv_capacity_tokens"]
    expected = (t["freed_bytes"] + start["free_budget_bytes"]) // s["kv_bytes_per_token"]
    assert expected - page < grown <= expected
    assert [layer["bits"] for layer in s["layers"]] == [4 if i in SWAPPED else 16
                                                        for i in range(30)]
    assert s["weight_bytes"] + s["kv_bytes"] <= s["memory_budget_bytes"]
    # Quantized layers change greedy outputs somewhere, or the swap did nothing.
    swapped_outputs = [generate_ids(server, ids, 32) for ids in prompts]
    assert swapped_outputs != before_outputs

    r = swap(server, SWAPPED, 16)
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["transitions"][-1]["action"] == "restore"
    assert s["kv_capacity_tokens"] == start["kv_capacity_tokens"]
    assert s["weight_bytes"] == start["weight_bytes"] and s["kv_bytes"] == start["kv_bytes"]
    assert [layer["bits"] for layer in s["layers"]] == [16] * 30
    assert [generate_ids(server, ids, 32) for ids in prompts] == before_outputs

    lines = server.transitions_log.read_text().splitlines()
    logged = [json.loads(line) for line in lines[-2:]]
    assert [x["action"] for x in logged] == ["swap", "restore"]
    assert logged[0]["layers"] == SWAPPED

    # The elastic core lists the same two transitions with the mechanism's capacities.
    r = requests.get(f"{server.url}/elastic/status", headers=USER, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["mechanisms"] == ["morph"]
    (replica,) = r.json()["replicas"]
    morph = replica["mechanisms"]["morph"]
    assert morph["state"]["kv_capacity_tokens"] == start["kv_capacity_tokens"]
    recent = morph["transitions"]["recent"][-2:]
    assert [(x["action"], x["outcome"]) for x in recent] == [("swap", "applied"),
                                                              ("restore", "applied")]
    assert recent[0]["detail"]["layers"] == SWAPPED and recent[0]["detail"]["to_bits"] == 4
    assert recent[0]["capacity_after_tokens"] == start["kv_capacity_tokens"] + grown
    assert recent[1]["capacity_after_tokens"] == start["kv_capacity_tokens"]


def test_long_prompt_is_admitted_only_while_the_pool_is_grown(server, corpus_ids,
                                                            default_model_path, engines_awq):
    """SGLang refuses a prompt longer than the KV capacity (HTTP 400); after a swap grew the
    pool, the same prompt is served (its tokens equal transformers with the same W4 layers),
    and after the restore it is refused again."""
    start = status(server)["kv_capacity_tokens"]
    ids = prompt_ids(corpus_ids, 50, start + 600)

    def ask() -> requests.Response:
        return requests.post(f"{server.url}/generate", headers=USER, timeout=600, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                  "ignore_eos": True}})

    r = ask()
    assert r.status_code == 400, r.text
    assert f"exceeds the maximum allowed length ({start - 6} tokens)" in r.text
    assert swap(server, SWAPPED, 4).status_code == 200
    assert status(server)["kv_capacity_tokens"] - 6 > len(ids)
    r = ask()
    assert r.status_code == 200, r.text
    expected = transformers_schedule(default_model_path, engines_awq, ids, 8, quantized_until=8)
    assert r.json()["output_ids"] == expected
    assert swap(server, SWAPPED, 16).status_code == 200
    assert status(server)["kv_capacity_tokens"] == start
    r = ask()
    assert r.status_code == 400 and f"({start - 6} tokens)" in r.text, r.text


def test_long_stream_keeps_going_across_swap_and_restore(server, corpus_ids):
    ids = prompt_ids(corpus_ids, 100, 64)
    n_new = 160  # 20 tokens before the swap, 60 between swap and restore, 80 of margin after
    reference = generate_ids(server, ids, n_new)  # this server, never swapped at this point
    stream = Stream(server, ids, n_new)
    stream.wait_for(20)
    tokens_before_swap = list(stream.ids)
    assert swap(server, SWAPPED, 4).status_code == 200
    stream.wait_for(len(tokens_before_swap) + 60)
    assert swap(server, SWAPPED, 16).status_code == 200
    out = stream.join()
    assert len(out) == n_new and stream.finish_reason["type"] == "length"
    assert out[: len(tokens_before_swap)] == reference[: len(tokens_before_swap)]
    assert [layer["bits"] for layer in status(server)["layers"]] == [16] * 30


def transformers_schedule(model_path, engines, ids, n_new, quantized_until: int,
                          quantized_from: int = 0) -> list[int]:
    """Greedy tokens from transformers (float32) when ``SWAPPED`` are W4 for the forwards that
    produce tokens ``quantized_from..quantized_until-1`` and full precision for the others, with
    one KV cache throughout: what a state-preserving swap and restore at those tokens must
    produce."""
    model = hf_variants.load_model(model_path)
    w4 = hf_variants.LayerVariants(model, engines, EngineManifest.load(engines), 4,
                                   progress=False)
    out: list[int] = []
    past = None
    x = torch.tensor([ids])
    with torch.inference_mode():
        for t in range(n_new):
            w4.set_quantized(SWAPPED if quantized_from <= t < quantized_until else ())
            res = model(input_ids=x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


def test_restore_moves_live_kv_without_corrupting_it(server, corpus_ids, engines_awq,
                                                     default_model_path):
    """The stream's KV sits above the start capacity (the low slots hold cached prompts) when
    the restore shrinks the pool: the restore evicts the cache and moves the live KV down, and
    the request's tokens equal transformers with the same precision schedule."""
    requests.post(f"{server.url}/flush_cache", headers=ADMIN, timeout=60)
    start = status(server)
    assert swap(server, SWAPPED, 4).status_code == 200
    # Cached prompts fill every slot below the start capacity (a flushed allocator hands out
    # the lowest free slots first), so the stream's KV lands above it.
    for seed in range(200, 200 + start["kv_capacity_tokens"] // 300 + 1):
        generate_ids(server, prompt_ids(corpus_ids, seed, 299), 1)
    ids = prompt_ids(corpus_ids, 1, 300)
    n_new = 40
    stream = Stream(server, ids, n_new)
    stream.wait_for(8)
    with paused(server):
        time.sleep(2.0)  # the tokens of the last step reach the client
        k = len(stream.ids)
        r = swap(server, SWAPPED, 16)
    assert r.status_code == 200, r.text
    t = r.json()["transitions"][-1]
    assert t["action"] == "restore" and t["kv_moved_tokens"] > 0 and t["kv_evicted_tokens"] > 0
    assert r.json()["kv_capacity_tokens"] == start["kv_capacity_tokens"]
    out = stream.join()
    expected = transformers_schedule(default_model_path, engines_awq, ids, n_new, k)
    assert out == expected, (k, out, expected)


def test_restore_refused_while_live_kv_exceeds_the_smaller_pool(server, corpus_ids):
    """When live requests need more KV than the pool would have after the restore, the restore
    is refused with 409 and changes nothing; it succeeds once they finish."""
    start = status(server)
    assert swap(server, SWAPPED, 4).status_code == 200
    grown = status(server)["kv_capacity_tokens"]
    n_prompt = (start["kv_capacity_tokens"] + 600) // 2
    streams = [Stream(server, prompt_ids(corpus_ids, 300 + i, n_prompt), 30) for i in range(2)]
    for s in streams:
        s.wait_for(2)
    with paused(server):
        r = swap(server, SWAPPED, 16)
        assert r.status_code == 409, r.text
        after = status(server)
        assert after["kv_capacity_tokens"] == grown
        refused = after["transitions"][-1]
        assert refused["action"] == "refused" and "give back" in refused["error"]
        assert refused["kv_capacity_tokens_after"] == grown
        assert [x["bits"] for x in after["layers"]] == [4 if i in SWAPPED else 16
                                                        for i in range(30)]
    for s in streams:
        assert len(s.join()) == 30
    r = swap(server, SWAPPED, 16)
    assert r.status_code == 200 and r.json()["kv_capacity_tokens"] == start["kv_capacity_tokens"]


def test_controller_swaps_under_a_burst_and_restores_after(engines_awq, corpus_ids, tmp_path):
    """A small budget and a burst of concurrent requests: the default-mode controller swaps
    layers and grows KV during the burst, and restores every layer once load is gone."""
    log = tmp_path / "transitions.jsonl"
    args = ["--enable-morph", "--morph-engines", str(engines_awq), "--morph-memory-budget",
            "290MB", "--morph-log", str(log), "--enable-metrics"]
    with running_server(args, tmp_path) as srv:
        start = requests.get(f"{srv.url}/morph/status", timeout=60).json()
        assert start["controller"] is True and start["quantized_layers"] == 0
        def one(seed):
            requests.post(f"{srv.url}/generate", timeout=900, json={
                "input_ids": prompt_ids(corpus_ids, seed, 200),
                "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}})

        # 6 requests need 1.5x the pool: enough for the controller to swap (a few layers to
        # W8), few enough that its restores, 3 layers per 10 s quiet window, end within a minute.
        threads = [threading.Thread(target=one, args=(400 + i,)) for i in range(6)]
        burst_tokens = 6 * 232
        assert burst_tokens > 1.5 * start["kv_capacity_tokens"]
        for th in threads:
            th.start()
        peak_layers = 0
        # A status answer waits for the scheduler's step in progress: the burst's prefill of
        # 5 x 200 tokens takes tens of seconds on a loaded 2-core CPU.
        while any(th.is_alive() for th in threads):
            peak_layers = max(peak_layers,
                              requests.get(f"{srv.url}/morph/status", timeout=600).json()[
                                  "quantized_layers"])
            time.sleep(0.5)
        deadline = time.monotonic() + 180  # restores come a quiet window apart
        while time.monotonic() < deadline:
            s = requests.get(f"{srv.url}/morph/status", timeout=600).json()
            if s["quantized_layers"] == 0:
                break
            time.sleep(1.0)
        assert s["quantized_layers"] == 0, s["transitions"]
        assert s["kv_capacity_tokens"] == start["kv_capacity_tokens"]
        metrics = requests.get(f"{srv.url}/metrics", timeout=60).text
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    actions = [x["action"] for x in logged]
    assert "swap" in actions and actions[-1] == "restore", actions
    assert all(x["source"] == "controller" for x in logged)
    assert max(x["kv_capacity_tokens_after"] for x in logged) > start["kv_capacity_tokens"]
    assert peak_layers > 0 or len(logged) >= 2
    assert "sglang_morph_kv_capacity_tokens" in metrics
    assert "sglang_morph_transitions_total" in metrics


def test_fuzzed_bodies_get_no_5xx_and_change_nothing(server):
    """Two hundred seeded random JSON bodies on the generation and control routes: every
    answer is below 500, the server stays healthy, and the morph state is what it was (a
    fuzzed swap that happens to be valid is undone before comparing)."""
    from hypothesis import strategies as st

    from tests.http_fuzz import JSON, SMALL, bodies, fuzz

    # Near-valid values too, so that some requests get through to the model.
    text = st.text(max_size=20) | JSON
    ids = st.lists(st.integers(-2, 49_200), max_size=6) | JSON
    messages = st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant"]) | JSON,
        "content": text}), max_size=3) | JSON
    model = st.just("default") | JSON
    fields = {
        "/generate": {"text": text, "input_ids": ids, "stream": JSON,
                      "sampling_params": st.fixed_dictionaries(
                          {"max_new_tokens": SMALL}, optional={"temperature": JSON,
                                                               "stop": JSON}),
                      "return_logprob": JSON, "rid": JSON},
        "/v1/completions": {"model": model, "prompt": text | ids, "max_tokens": SMALL,
                            "n": SMALL, "stream": JSON, "logprobs": JSON},
        "/v1/chat/completions": {"model": model, "messages": messages,
                                 "max_tokens": SMALL, "tools": JSON},
        "/morph/swap": {"layers": ids, "bits": st.sampled_from([4, 8, 16]) | JSON,
                        "pin": JSON, "replica": JSON},
        "/morph/mode": {"mode": st.sampled_from(["accuracy", "default", "performance"])
                        | JSON, "replica": JSON},
    }
    # Generation routes always carry a small length (their default decodes 128 tokens);
    # control routes also get bodies of any JSON shape.
    cases = bodies(fields, {"/generate": ("sampling_params",), "/v1/completions":
                            ("max_tokens",), "/v1/chat/completions": ("max_tokens",)},
                   any_shape=("/morph/swap", "/morph/mode"))
    before = status(server)
    answers = fuzz(server.url, cases,
                   lambda route: ADMIN if route.startswith("/morph") else USER, 200)
    assert len(answers) >= 200 and any(code == 200 for _, code in answers)
    was = {q["index"]: q["bits"] for q in before["layers"]}
    moved = [q["index"] for q in status(server)["layers"] if q["bits"] != was[q["index"]]]
    for bits in sorted({was[i] for i in moved}, reverse=True):  # a valid fuzzed swap: undo it
        swap(server, [i for i in moved if was[i] == bits], bits)
    requests.post(f"{server.url}/morph/mode", json={"mode": before["mode"]}, headers=ADMIN,
                  timeout=60)
    after = status(server)
    assert [q["bits"] for q in after["layers"]] == [q["bits"] for q in before["layers"]]
    assert after["kv_capacity_tokens"] == before["kv_capacity_tokens"]
    assert after["mode"] == before["mode"]
