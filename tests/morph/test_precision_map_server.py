"""Layer engines served by SGLang: static precision maps, kernels inside SGLang's linears,

and perplexity through the server (``/generate`` input-token logprobs).
"""

from __future__ import annotations

import pytest
import requests
import torch

from benchmark.perplexity import server_perplexity
from conftest import running_server
from sglang_morph.engines import hf_variants
from sglang_morph.engines.manifest import EngineManifest

MIXED_MAP = "0-9:8,10-19:4"  # 20-29 stay at full precision
W8_MAX_PERPLEXITY_INCREASE = 0.01
GREEDY_PROMPTS = [
    ("The capital of France is", 24),
    ("def fibonacci(n):\n", 32),
    ("Once upon a time, in a small village by the sea,", 32),
    ("The three primary colors are", 20),
]


@pytest.fixture(scope="module")
def fp_perplexity(default_server) -> float:
    return server_perplexity(default_server.url).perplexity


def test_mixed_precision_greedy_equals_transformers_with_the_same_weights(
    engines_awq, default_model_path, tmp_path
):
    """float32 on both sides, so equality is exact: SGLang with W8 layers 0-9 and W4 layers
    10-19 installed through the plugin vs transformers with the same dequantized weights.
    """
    manifest = EngineManifest.load(engines_awq)
    model = hf_variants.load_model(default_model_path)
    w8 = hf_variants.LayerVariants(model, engines_awq, manifest, 8, progress=False)
    w4 = hf_variants.LayerVariants(model, engines_awq, manifest, 4, progress=False)
    w8.set_quantized(range(0, 10))
    w4.set_quantized(range(10, 20))
    tok = hf_variants.load_tokenizer(default_model_path)
    expected = []
    for prompt, n_new in GREEDY_PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False)
        expected.append((ids, out[0, len(ids):].tolist()))
    del model, w8, w4

    args = ["--dtype", "float32", "--enable-morph", "--morph-engines", str(engines_awq),
            "--morph-precision-map", MIXED_MAP]
    with running_server(args, tmp_path) as server:
        assert "sglang-morph: layer precision " + ",".join(
            ["8"] * 10 + ["4"] * 10 + ["16"] * 10) in server.log_text()
        for (ids, want), (prompt, n_new) in zip(expected, GREEDY_PROMPTS):
            r = requests.post(
                f"{server.url}/generate",
                json={"input_ids": ids,
                      "sampling_params": {"temperature": 0, "max_new_tokens": n_new}},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want, prompt


@pytest.fixture(scope="module")
def awq_server(server_factory, engines_awq):
    """The default model with the AWQ variants, the controller off: each test below puts every
    layer at its bit-width with one swap (the variants a startup map installs: the mixed map
    above is the startup path)."""
    return server_factory("--enable-morph", "--morph-engines", str(engines_awq),
                          "--disable-morph-controller")


def every_layer_at(server, bits: int) -> None:
    r = requests.post(f"{server.url}/morph/swap", timeout=600,
                      json={"layers": list(range(30)), "bits": bits})
    assert r.status_code == 200, r.text
    assert [layer["bits"] for layer in r.json()["layers"]] == [bits] * 30


def test_all_w8_perplexity_within_1_percent_of_full_precision(awq_server, fp_perplexity):
    every_layer_at(awq_server, 8)
    w8 = server_perplexity(awq_server.url).perplexity
    assert abs(w8 - fp_perplexity) / fp_perplexity <= W8_MAX_PERPLEXITY_INCREASE, (w8, fp_perplexity)


def test_all_w4_awq_beats_round_to_nearest_with_the_same_groups(awq_server, engines_awq,
                                                                engines_rtn, fp_perplexity,
                                                                tmp_path):
    awq_manifest, rtn_manifest = EngineManifest.load(engines_awq), EngineManifest.load(engines_rtn)
    for i in range(awq_manifest.num_layers):
        assert awq_manifest.variant(i, 4).group_sizes == rtn_manifest.variant(i, 4).group_sizes
    every_layer_at(awq_server, 4)
    ppl = {"awq": server_perplexity(awq_server.url).perplexity}
    args = ["--enable-morph", "--morph-engines", str(engines_rtn), "--morph-precision-map", "*:4"]
    with running_server(args, tmp_path / "rtn") as server:
        ppl["rtn"] = server_perplexity(server.url).perplexity
    assert fp_perplexity < ppl["awq"] < ppl["rtn"], (fp_perplexity, ppl)
