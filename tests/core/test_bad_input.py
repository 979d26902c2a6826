"""Bad input keeps SGLang's behaviour: a 4xx with a message, and the server stays up. Token
ids outside the vocabulary, on which SGLang's scheduler would crash the server, get a 400 from
the plugin's guard (``sglang_morph.server.guard``) on every entry point that takes ids."""

from __future__ import annotations

import json

import pytest
import requests


@pytest.mark.parametrize(
    "path,payload,needle",
    [
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        # The default model's context is 8192 tokens.
        ("/generate", {"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 4}},
         "context length"),
        ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {"model": "default", "messages": "not a list"}, "messages"),
    ],
)
def test_bad_request_is_4xx_with_message(default_server, path, payload, needle):
    r = requests.post(f"{default_server.url}{path}", json=payload, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert needle in r.text


def test_server_still_serves_after_bad_input(default_server):
    requests.post(
        f"{default_server.url}/generate",
        json={"input_ids": [1] * 9000, "sampling_params": {"max_new_tokens": 4}},
        timeout=60,
    )
    r = requests.post(
        f"{default_server.url}/generate",
        json={"text": "The capital of France is",
              "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
        timeout=120,
    )
    assert r.status_code == 200 and "Paris" in r.json()["text"]


VOCAB = 49152  # the default model's


@pytest.mark.parametrize(
    "path,payload",
    [
        ("/generate", {"input_ids": [1000000000], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_ids": [1, 2, VOCAB], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_ids": [5, -1], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_ids": [[1, 2], [3, 99999999]],
                       "sampling_params": {"max_new_tokens": 2}}),  # a batch
        ("/generate", {"input_ids": [1000000000], "stream": True,
                       "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"model": "default", "prompt": [99999999], "max_tokens": 2}),
        ("/v1/completions", {"model": "default", "prompt": [[1, 2], [VOCAB + 7]],
                             "max_tokens": 2}),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(default_server, path, payload):
    r = requests.post(f"{default_server.url}{path}", json=payload, timeout=60)
    if r.status_code == 200 and payload.get("stream"):
        # SGLang streams its 400 as the first event of a 200 stream.
        error = json.loads(r.text.split("\n")[0].removeprefix("data: "))["error"]
        assert error["code"] == 400 and "outside the model's vocabulary" in error["message"]
    else:
        assert r.status_code == 400, (r.status_code, r.text)
        assert f"outside the model's vocabulary [0, {VOCAB})" in r.text, r.text
    health = requests.get(f"{default_server.url}/health", timeout=60)
    assert health.status_code == 200
    ok = requests.post(f"{default_server.url}/generate", timeout=120, json={
        "input_ids": [1, 2, VOCAB - 1], "sampling_params": {"temperature": 0,
                                                            "max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2, ok.text
