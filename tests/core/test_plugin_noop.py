"""With the plugin installed but without --enable-morph, the server is plain SGLang."""

from __future__ import annotations

import os
import subprocess

import pytest
import requests

from conftest import REPO_ROOT

pytestmark = pytest.mark.server  # servers, and scripts/serve.sh without the plugin

# SGLANG_PLUGINS is SGLang's allow-list of general plugins: naming none excludes ours.
WITHOUT_PLUGIN = {"SGLANG_PLUGINS": "no-plugin"}
# Values that differ between any two launches of the same command.
VOLATILE_SERVER_INFO_KEYS = {"port", "launch_command", "startup_time", "internal_states",
                             "random_seed", "nccl_port", "dist_init_addr"}
PROMPTS = ["The capital of France is", "List three fruits:", "def add(a, b):"]


def _generate(server, prompt):
    r = requests.post(
        f"{server.url}/generate",
        json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 24},
              "return_logprob": True, "top_logprobs_num": 2},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], body["meta_info"]["output_top_logprobs"]


def test_outputs_and_server_info_equal_plain_sglang(default_server, server_factory):
    plain = server_factory(env=WITHOUT_PLUGIN)
    assert "sglang_morph" not in plain.log_text()
    for prompt in PROMPTS:
        assert _generate(default_server, prompt) == _generate(plain, prompt), prompt
    for endpoint in ("/get_model_info", "/v1/models"):
        a = requests.get(default_server.url + endpoint, timeout=30).json()
        b = requests.get(plain.url + endpoint, timeout=30).json()
        if endpoint == "/v1/models":
            for m in a["data"] + b["data"]:
                m.pop("created")
        assert a == b, endpoint
    info_a = requests.get(default_server.url + "/get_server_info", timeout=30).json()
    info_b = requests.get(plain.url + "/get_server_info", timeout=30).json()
    assert info_a.keys() == info_b.keys()
    differing = {k for k in info_a if info_a[k] != info_b[k]} - VOLATILE_SERVER_INFO_KEYS
    assert not differing, {k: (info_a[k], info_b[k]) for k in differing}


def test_plain_sglang_does_not_know_enable_morph():
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "serve.sh"), "--enable-morph", "--port", "1"],
        env={**os.environ, **WITHOUT_PLUGIN},
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "unrecognized arguments: --enable-morph" in proc.stderr
