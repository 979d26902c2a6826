"""Bad input keeps SGLang's behaviour: a 4xx with a message, and the server stays up."""

from __future__ import annotations

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
