"""Fingerprints inside one server (``--enable-iserve-profiling``, ``iserve/live.py``): after
``POST /iserve/depth {"layers": n}`` the full model served by SGLang gives the greedy tokens
of transformers on the model cut to those layers, at 16 bits and after ``/morph/swap`` to
W8/W4, and ``null`` gives the full model's tokens back. Under pipeline parallelism each stage
runs the first layers of its own range. Bad bodies change nothing.

Two servers of the default model, float32: one with ``--enable-morph`` (the AWQ variants),
one with ``--pp-size 2``.
"""

from __future__ import annotations

import pytest
import requests
import torch

from conftest import running_server
from sglang_morph.engines import hf_variants
from sglang_morph.engines.manifest import EngineManifest
from sglang_morph.iserve.fingerprint import make_fingerprint
from sglang_morph.iserve.space import stage_layers

PROMPTS = [("The capital of France is", 12), ("def fibonacci(n):\n", 12),
           ("Once upon a time, in a small village by the sea,", 12)]


def _generate(model, tok) -> list[tuple[list[int], list[int]]]:
    out = []
    for prompt, n_new in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                                 min_new_tokens=n_new)
        out.append((ids, gen[0, len(ids):].tolist()))
    return out


def _keep_layers(model, kept: list[int]) -> None:
    """transformers' model with only the decoder layers ``kept``, renumbered for its cache."""
    layers = [model.model.layers[i] for i in kept]
    for new, layer in enumerate(layers):
        layer.self_attn.layer_idx = new
    model.model.layers = torch.nn.ModuleList(layers)
    model.config.num_hidden_layers = len(kept)


def _greedy(url: str, ids: list[int], n_new: int) -> list[int]:
    r = requests.post(f"{url}/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _outputs(url: str, expected) -> list[list[int]]:
    return [_greedy(url, ids, len(want)) for ids, want in expected]


def _depth(url: str, layers) -> requests.Response:
    return requests.post(f"{url}/iserve/depth", json={"layers": layers}, timeout=60)


def test_depth_serves_the_first_layers_at_every_precision(default_model_path, engines_awq,
                                                          tmp_path):
    # The reference: the 2-layer fingerprint checkpoint (the model's first two layers, tested
    # equal to them) in transformers, whole and with layer 0 at W8 and layer 1 at W4.
    fp = make_fingerprint(default_model_path, engines_awq, 2)
    tok = hf_variants.load_tokenizer(default_model_path)
    model = hf_variants.load_model(fp.model_dir)
    manifest = EngineManifest.load(fp.engines_dir)
    w8 = hf_variants.LayerVariants(model, fp.engines_dir, manifest, 8, progress=False)
    w4 = hf_variants.LayerVariants(model, fp.engines_dir, manifest, 4, progress=False)
    two = _generate(model, tok)
    w8.set_quantized([0])
    w4.set_quantized([1])
    two_mixed = _generate(model, tok)
    del model, w8, w4
    full = _generate(hf_variants.load_model(default_model_path), tok)
    assert two != two_mixed and [w for _, w in two] != [w for _, w in full]

    args = ["--model-path", str(default_model_path), "--dtype", "float32",
            "--enable-morph", "--morph-engines", str(engines_awq),
            "--disable-morph-controller", "--enable-iserve-profiling",
            "--max-total-tokens", "2048"]
    with running_server(args, tmp_path) as server:
        url = server.url
        assert requests.get(f"{url}/iserve/depth", timeout=60).json()["layers"] == 30
        # The radix cache holds these prompts at 30 layers; the depth change must drop them.
        assert _outputs(url, full) == [w for _, w in full]

        r = _depth(url, 2)
        assert r.status_code == 200, r.text
        assert r.json() == {"layers": 2, "num_layers": 30,
                            "stages": [{"stage": 0, "layers": 2}]}
        assert _outputs(url, two) == [w for _, w in two]

        for layers, bits in (([0], 8), ([1], 4)):
            r = requests.post(f"{url}/morph/swap", json={"layers": layers, "bits": bits},
                              timeout=120)
            assert r.status_code == 200, r.text
        assert _outputs(url, two_mixed) == [w for _, w in two_mixed]
        r = requests.post(f"{url}/morph/swap", json={"layers": [0, 1], "bits": 16}, timeout=120)
        assert r.status_code == 200, r.text

        for body in ({"layers": 0}, {"layers": 31}, {"layers": "2"}, {"layers": True},
                     {"depth": 2}, {"layers": 2, "extra": 1}, [2]):
            r = requests.post(f"{url}/iserve/depth", json=body, timeout=60)
            assert r.status_code == 400, (body, r.text)
            assert "error" in r.json()
        assert requests.get(f"{url}/iserve/depth", timeout=60).json()["layers"] == 2

        r = _depth(url, None)
        assert r.status_code == 200 and r.json()["layers"] == 30, r.text
        assert _outputs(url, full) == [w for _, w in full]
        elastic = requests.get(f"{url}/elastic/status", timeout=60).json()
        assert "iserve" in str(elastic)


@pytest.mark.server
def test_depth_under_pipeline_parallelism_runs_each_stages_first_layers(default_model_path,
                                                                        tmp_path):
    depth = 5
    per_stage = stage_layers(depth, 2)  # SGLang's split of a 5-layer model: (2, 3)
    starts = (0, stage_layers(30, 2)[0])  # where each stage's own range starts: 0 and 15
    kept = [s + i for s, n in zip(starts, per_stage) for i in range(n)]
    assert kept == [0, 1, 15, 16, 17]
    tok = hf_variants.load_tokenizer(default_model_path)
    model = hf_variants.load_model(default_model_path)
    _keep_layers(model, kept)
    expected = _generate(model, tok)
    del model

    args = ["--model-path", str(default_model_path), "--dtype", "float32", "--pp-size", "2",
            "--enable-iserve-profiling", "--max-total-tokens", "2048"]
    with running_server(args, tmp_path) as server:
        r = _depth(server.url, depth)
        assert r.status_code == 200, r.text
        assert r.json()["stages"] == [{"stage": 0, "layers": 2}, {"stage": 1, "layers": 3}]
        assert _outputs(server.url, expected) == [w for _, w in expected]
        assert _depth(server.url, 1).status_code == 400  # a stage needs a layer
        assert requests.get(f"{server.url}/iserve/depth", timeout=60).json()["layers"] == depth


def test_refused_beside_a_mechanism_with_its_own_forward():
    import argparse

    from sglang_morph.config import ConfigError
    from sglang_morph.iserve import live

    for other in ("kunserve", "amoebas"):
        args = argparse.Namespace(enable_iserve_profiling=True)
        with pytest.raises(ConfigError, match=f"--enable-{other}"):
            live.configure(argparse.Namespace(), args, frozenset({other}))
    server_args = argparse.Namespace()
    assert live.configure(server_args, argparse.Namespace(), frozenset({"morph"})) is False
    assert live.MECHANISM.enabled(server_args) is False
    assert live.configure(server_args, args, frozenset({"morph"})) is True
    assert live.MECHANISM.enabled(server_args) is True
