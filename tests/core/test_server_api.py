"""The README's serve command (scripts/serve.sh) serves SGLang's HTTP and OpenAI APIs on CPU."""

from __future__ import annotations

import json

import requests

GREEDY = {"temperature": 0, "max_new_tokens": 16}


def test_health_and_model_info(default_server, default_model_path):
    assert requests.get(f"{default_server.url}/health", timeout=30).status_code == 200
    info = requests.get(f"{default_server.url}/get_model_info", timeout=30).json()
    assert info["model_path"] == str(default_model_path)
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]


def test_v1_models(default_server, default_model_path):
    models = requests.get(f"{default_server.url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [str(default_model_path)]
    assert models["data"][0]["max_model_len"] == 8192


def test_generate_plain_knows_paris(default_server):
    r = requests.post(
        f"{default_server.url}/generate",
        json={"text": "The capital of France is", "sampling_params": GREEDY},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) <= 16


def test_generate_stream_is_cumulative_and_matches_plain(default_server):
    payload = {"text": "Once upon a time", "sampling_params": GREEDY}
    plain = requests.post(f"{default_server.url}/generate", json=payload, timeout=120).json()
    chunks = []
    with requests.post(
        f"{default_server.url}/generate", json={**payload, "stream": True}, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                assert line.startswith(b"data: ")
                chunks.append(line[len(b"data: "):])
    assert chunks[-1] == b"[DONE]"
    texts = [json.loads(c)["text"] for c in chunks[:-1]]
    assert len(texts) > 1
    # Each chunk carries the whole text so far.
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == plain["text"]


def test_v1_completions(default_server):
    r = requests.post(
        f"{default_server.url}/v1/completions",
        json={"model": "default", "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert "Paris" in body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] <= 8


def test_v1_chat_completions_uses_chat_template(default_server):
    r = requests.post(
        f"{default_server.url}/v1/chat/completions",
        json={"model": "default", "temperature": 0, "max_tokens": 24,
              "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "Paris" in body["choices"][0]["message"]["content"]
    # The template (system prompt + roles) makes the prompt far longer than the question.
    assert body["usage"]["prompt_tokens"] > 20
