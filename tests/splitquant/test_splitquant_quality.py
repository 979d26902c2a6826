"""The planner's measured quality indicators (``splitquant.measured``,
``splitquant.indicator``) against a direct reference: transformers' own model with the
variants' dequantized weights loaded in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sglang_morph.engines.hf_variants import effective_weights, load_model
from sglang_morph.engines.manifest import EngineManifest
from sglang_morph.splitquant import indicator
from sglang_morph.splitquant.measured import QualityProbe, window_mean_se

BITS = (16, 8, 4)


@pytest.fixture(scope="module")
def windows(default_model_path):
    return indicator.calibration_windows(default_model_path, samples=2, tokens_per_sample=48)


@pytest.fixture(scope="module")
def probe(default_model_path, engines_awq, windows):
    return QualityProbe(default_model_path, engines_awq, windows, (8, 4))


def _reference_log_probs(model_path, engines, layer_bits, input_ids):
    """The plain transformers forward, full precision and then with the variants' effective
    weights copied in."""
    model = load_model(model_path)
    manifest = EngineManifest.load(engines)
    with torch.no_grad():
        fp = F.log_softmax(model(input_ids).logits[:, :-1].float(), dim=-1)
        for layer, bits in layer_bits.items():
            for name, w in effective_weights(engines, manifest, layer, bits).items():
                model.model.layers[layer].get_submodule(name).weight.copy_(w)
        return fp, F.log_softmax(model(input_ids).logits[:, :-1].float(), dim=-1)


def test_probe_equals_transformers_with_the_dequantized_weights(probe, default_model_path,
                                                                engines_awq, windows):
    layer_bits = {3: 4, 7: 8, 20: 4}
    fp, q = _reference_log_probs(default_model_path, engines_awq, layer_bits, windows)
    targets = windows[:, 1:, None]
    ref_nll = -q.gather(-1, targets)[..., 0].double().numpy()
    ref_kl = (fp.exp() * (fp - q)).sum(-1).double().numpy()
    m = probe.measure(layer_bits)
    assert np.allclose(m["nll"], ref_nll, atol=2e-4)
    assert np.allclose(m["kl"], ref_kl, atol=2e-5)
    assert np.allclose(probe.fp_nll, -fp.gather(-1, targets)[..., 0].double().numpy(),
                       atol=2e-4)
    # full precision: no quantized layer, nothing changes
    none = probe.measure({l: 16 for l in range(probe.num_layers)})
    assert np.array_equal(none["nll"], probe.fp_nll) and not none["kl"].any()
    # the probe restores full precision after each map
    assert np.allclose(probe.measure({})["nll"], probe.fp_nll)
    mean, se = window_mean_se(m["kl"])
    assert mean == pytest.approx(float(ref_kl.mean())) and se > 0


def test_measured_and_calibrated_indicators(probe, default_model_path, engines_awq, windows):
    stats, _ = indicator.calibration_stats(default_model_path, samples=2, tokens_per_sample=48)
    variance = indicator.compute("variance", engines_awq, stats, BITS)
    kl, nll, calibrated = indicator.compute_measured(
        ("measured-kl", "measured-nll", "variance-calibrated"), engines_awq, default_model_path,
        windows, BITS, variance=variance, probe=probe)
    assert nll.name == "measured-nll" and np.all(nll.omega >= 0)
    m = probe.measure({5: 4})
    assert nll.omega[5, 2] == pytest.approx(max(0.0, float((m["nll"] - probe.fp_nll).mean())))
    assert kl.name == "measured-kl" and calibrated.name == "variance-calibrated"
    assert np.all(kl.omega[:, 0] == 0) and np.all(kl.omega[:, 1:] > 0)
    # W4 moves the output distribution more than W8 on (nearly) every layer
    assert np.mean(kl.omega[:, 2] > kl.omega[:, 1]) >= 0.9
    # calibrated: each format's total is the KL of all layers at that format, measured directly;
    # the layers' shares within a format stay the variance indicator's
    for k, b in enumerate(BITS[1:], start=1):
        all_layers = probe.measure({l: b for l in range(probe.num_layers)})["kl"].mean()
        assert calibrated.omega[:, k].sum() == pytest.approx(all_layers, rel=1e-6)
        assert np.allclose(calibrated.omega[:, k] / calibrated.omega[:, k].sum(),
                           variance.omega[:, k] / variance.omega[:, k].sum())
    with pytest.raises(ValueError, match="unknown measured"):
        indicator.compute_measured(("oracle",), engines_awq, default_model_path, windows, BITS)
