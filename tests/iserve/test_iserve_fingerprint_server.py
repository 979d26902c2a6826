"""A 2-layer fingerprint (``sglang_morph.iserve.fingerprint``) is a real model: SGLang serves it
with the same greedy tokens as transformers on the same truncated checkpoint (float32), and its
restricted engines directory serves the full build's W8/W4 variants of those layers (same
files, same sha256) through ``--morph-engines`` without any rebuild.

One server (float32, ``--enable-morph`` with the fingerprint's engines, controller off); on it
also L2's batch timing (``measure.stream_seconds`` / ``e2e_seconds``: one prefill per batch).
"""

from __future__ import annotations

import json
import re

import pytest
import requests
import torch
from safetensors import safe_open

from conftest import running_server
from sglang_morph.iserve import measure
from sglang_morph.iserve.fingerprint import make_fingerprint
from sglang_morph.engines import hf_variants
from sglang_morph.engines.manifest import EngineManifest, sha256_of_file

PROMPTS = [("The capital of France is", 16), ("def fibonacci(n):\n", 16),
           ("Once upon a time, in a small village by the sea,", 16)]


@pytest.fixture(scope="module")
def fingerprint(default_model_path, engines_awq):
    return make_fingerprint(default_model_path, engines_awq, 2)


def test_fingerprint_is_the_full_models_first_layers(fingerprint, default_model_path,
                                                     engines_awq):
    fingerprint.check_integrity(verify_checksums=True)
    config = json.loads((fingerprint.model_dir / "config.json").read_text())
    full_config = json.loads((default_model_path / "config.json").read_text())
    assert config == {**full_config, "num_hidden_layers": 2}
    with safe_open(str(fingerprint.model_dir / "model.safetensors"), "pt") as fp, \
            safe_open(str(default_model_path / "model.safetensors"), "pt") as full:
        names = set(fp.keys())
        assert names == {n for n in full.keys()
                         if not n.startswith("model.layers.") or n.split(".")[2] in ("0", "1")}
        for name in names:
            assert torch.equal(fp.get_tensor(name), full.get_tensor(name)), name
    # The variants are the full build's files for layers 0 and 1: the same sha256.
    full_manifest = EngineManifest.load(engines_awq)
    manifest = EngineManifest.load(fingerprint.engines_dir)
    assert manifest.num_layers == 2 and manifest.bits_available == (4, 8, 16)
    for layer in range(2):
        for bits in (8, 4):
            info = manifest.variant(layer, bits)
            assert info == full_manifest.variant(layer, bits)
            assert sha256_of_file(fingerprint.engines_dir / info.file) == \
                sha256_of_file(engines_awq / info.file) == info.sha256


def _greedy(url, ids, n_new):
    r = requests.post(f"{url}/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_served_fingerprint_equals_transformers_full_and_w8_w4(fingerprint, tmp_path):
    model = hf_variants.load_model(fingerprint.model_dir)  # float32
    manifest = EngineManifest.load(fingerprint.engines_dir)
    w8 = hf_variants.LayerVariants(model, fingerprint.engines_dir, manifest, 8, progress=False)
    w4 = hf_variants.LayerVariants(model, fingerprint.engines_dir, manifest, 4, progress=False)
    tok = hf_variants.load_tokenizer(fingerprint.model_dir)
    expected = {"full": [], "mixed": []}
    for prompt, n_new in PROMPTS:
        ids = tok(prompt)["input_ids"]
        for key, layers8, layers4 in (("full", [], []), ("mixed", [0], [1])):
            w8.set_quantized(layers8)
            w4.set_quantized(layers4)
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                                     min_new_tokens=n_new)
            expected[key].append((ids, out[0, len(ids):].tolist()))
    del model, w8, w4
    assert expected["full"] != expected["mixed"]  # the variants change this model's output

    args = ["--model-path", str(fingerprint.model_dir), "--dtype", "float32",
            "--enable-morph", "--morph-engines", str(fingerprint.engines_dir),
            "--disable-morph-controller", "--max-total-tokens", "2048"]
    with running_server(args, tmp_path) as server:
        status = requests.get(f"{server.url}/morph/status", timeout=60).json()
        assert [layer["bits"] for layer in status["layers"]] == [16, 16]
        for (ids, want), (prompt, n_new) in zip(expected["full"], PROMPTS):
            assert _greedy(server.url, ids, n_new) == want, prompt
        for layers, bits in (([0], 8), ([1], 4)):
            r = requests.post(f"{server.url}/morph/swap", json={"layers": layers, "bits": bits},
                              timeout=120)
            assert r.status_code == 200, r.text
        status = requests.get(f"{server.url}/morph/status", timeout=60).json()
        assert [layer["bits"] for layer in status["layers"]] == [8, 4]
        for (ids, want), (prompt, n_new) in zip(expected["mixed"], PROMPTS):
            assert _greedy(server.url, ids, n_new) == want, prompt

        # L2's timing sends a batch as one request so that it is prefilled together (the
        # scheduler logs one prefill of all of them), and reads every request's stream.
        log = tmp_path / "server.log"
        seen = len(log.read_text().splitlines())
        ttft, tpot, e2e = measure.stream_seconds(server.url, 4, 32, 12, salt=5)
        assert 0 < ttft < e2e and 0 < tpot < e2e
        assert measure.e2e_seconds(server.url, 3, 32, 4, salt=6) > 0
        prefills = [line for line in log.read_text().splitlines()[seen:]
                    if "Prefill batch" in line]
        assert [re.search(r"#new-seq: (\d+)", line).group(1) for line in prefills] == \
            ["4", "3"], prefills
