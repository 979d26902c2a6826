"""``python -m sglang_morph.splitquant`` end to end: the cost model fitted from this machine's
measurements, the variance indicator against the real output error, the CLI's plan and errors,
and a single-stage plan served by SGLang whose /morph/status matches the memory model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from sglang_morph.morph.config import PrecisionMap
from sglang_morph.splitquant import cost, indicator
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "benchmark/results/splitquant/cpu_profile.json"


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_morph.splitquant", *args],
                          capture_output=True, text=True, timeout=300)


def test_cost_model_fitted_here_predicts_held_out_points_within_6_percent():
    raw = json.loads(PROFILE.read_text())
    points = [cost.Measurement(**p) for p in raw["points"]]
    held_out = [cost.Measurement(**p) for p in raw["held_out_points"]]
    assert {(p.phase, p.bits) for p in points} >= {(ph, b) for ph in ("prefill", "decode")
                                                   for b in (16, 8, 4)}
    model = cost.fit("cpu", points)
    errors = cost.relative_errors(model, held_out)
    assert errors.mean() < 0.06, errors
    # what the CLI stored is this fit
    stored = cost.LatencyModel.from_json(raw["latency_model"])
    assert np.allclose(cost.relative_errors(stored, held_out), errors)


def test_fit_recovers_known_coefficients():
    truth = {("prefill", 8): (1e-4, 2e-5, 3e-6, 4e-6, 1e-9), ("decode", 8): (2e-4, 1e-5, 3e-8, 1e-7),
             ("head", 16): (5e-4, 2e-5)}
    model = cost.LatencyModel("truth", truth)
    points = [cost.Measurement("prefill", 8, v, s, float(model.seconds("prefill", 8, v, s)))
              for v in (1, 2, 4) for s in (16, 64, 256)]
    points += [cost.Measurement("decode", 8, v, c, float(model.seconds("decode", 8, v, c)))
               for v in (1, 4, 16) for c in (32, 256, 1024)]
    points += [cost.Measurement("head", 16, v, 0, float(model.seconds("head", 16, v, 0)))
               for v in (1, 8)]
    fitted = cost.fit("fit", points)
    assert cost.relative_errors(fitted, points).max() < 1e-6


def test_variance_indicator_ranks_layers_like_the_real_output_error(default_model_path,
                                                                    engines_awq):
    from sglang_morph.engines import awq, formats
    from sglang_morph.engines.manifest import EngineManifest, read_variant
    from safetensors import safe_open

    stats, _ = indicator.calibration_stats(default_model_path, samples=2,
                                            tokens_per_sample=128)
    result = indicator.compute("variance", engines_awq, stats, (16, 8, 4))
    assert np.all(result.omega[:, 0] == 0)
    assert np.all(result.omega[:, 2] > result.omega[:, 1]) and np.all(result.omega[:, 1] > 0)
    # Theorem 1 predicts the output error trace(dW G dW^T) of each layer's W4 variant
    manifest = EngineManifest.load(engines_awq)
    weights = {}
    for path in default_model_path.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            weights.update({k: f.get_tensor(k) for k in f.keys() if ".layers." in k})
    real = []
    for layer in range(manifest.num_layers):
        variant = read_variant(engines_awq, manifest.variant(layer, 4))
        real.append(sum(
            awq.output_error(weights[f"model.layers.{layer}.{name}.weight"],
                             formats.get_format(4).dequantize(t),
                             stats[layer][indicator._group_of(name)])
            for name, t in variant.items()))
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    spearman = np.corrcoef(rank(result.omega[:, 2]), rank(np.array(real)))[0, 1]
    assert spearman > 0.7, spearman
    random = indicator.compute("random", engines_awq, stats, (16, 8, 4))
    assert np.all(random.omega[:, 2] >= random.omega[:, 1])


@pytest.mark.parametrize("args,message", [
    (["--devices", "P100"], "unknown GPU 'P100'"),
    (["--devices", "cpu"], "needs its memory"),
    (["--devices", "cpu:lots"], "bad memory size 'lots'"),
    (["--devices", "T4", "--model", "gpt-9"], "unknown --model 'gpt-9'"),
    (["--devices", "cpu:10MB,cpu:10MB"], "no plan fits"),
    (["--devices", "T4,T4", "--model", "opt-13b", "--batch", "0"], "batch_requests must be"),
    (["--devices", "T4", "--model", "opt-13b", "--max-omega", "2"], "--max-omega"),
    (["--devices", "cpu:1GB", "--cpu-profile", "/nonexistent.json"], "does not exist"),
])
def test_cli_errors_name_the_problem(args, message, capsys):
    from sglang_morph.splitquant.__main__ import main

    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_cli_plans_two_cpu_stages_with_a_serve_command(tmp_path):
    out = plan_cli("plan", "--devices", "cpu:150MB,cpu:100MB", "--batch", "8", "--out",
                   str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    p = plan["plan"]
    assert sum(p["stage_layers"]) == 30 and len(p["layer_bits"]) == 30
    for stage, capacity in zip(p["stage_memory"], plan["device_memory_bytes"]):
        assert stage["weight_bytes"] + stage["kv_bytes"] + stage["activation_bytes"] <= capacity
    serve = plan["serve"]
    assert serve["env"]["SGLANG_PP_LAYER_PARTITION"] == ",".join(map(str, p["stage_layers"]))
    argv = serve["argv"]
    assert argv[argv.index("--pp-size") + 1] == "2"
    spec = argv[argv.index("--morph-precision-map") + 1]
    assert list(PrecisionMap.parse(spec).resolve(30)) == p["layer_bits"]
    assert plan["max_omega"] is not None and p["quality_omega"] <= plan["max_omega"] * (1 + 1e-9)


def test_single_stage_plan_served_memory_equals_the_model(tmp_path, default_model_path,
                                                          engines_awq):
    """The plan's weights (CPU layout) are /morph/status's weight_bytes to the byte, and its
    KV capacity is what the budget leaves, within one page."""
    from conftest import running_server

    # the morph runtime loads full precision first: its budget must hold the bf16 weights
    # (269 MB) plus some KV; a 16 x 576-token batch (212 MB of KV) forces quantization
    out = plan_cli("plan", "--devices", "cpu:380MB", "--batch", "16", "--prompt", "512",
                   "--output", "64", "--engines", str(engines_awq), "--out",
                   str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    bits = plan["plan"]["layer_bits"]
    assert 16 in bits and len(set(bits)) > 1  # a mixed map, not a uniform one
    argv = plan["serve"]["argv"][1:]
    budget = int(argv[argv.index("--morph-memory-budget") + 1])
    with running_server([*argv, "--dtype", "bfloat16"], tmp_path / "log") as server:
        status = requests.get(f"{server.url}/morph/status", timeout=60).json()
    assert [layer["bits"] for layer in status["layers"]] == bits
    spec = ModelSpec.from_model_dir(default_model_path)
    memory = MemoryModel.from_spec(spec, layout="cpu")
    stage = plan["plan"]["stage_memory"][0]
    predicted_weights = memory.stage_memory(range(30), bits, _workload(plan), True,
                                            True).weight_bytes
    assert stage["weight_bytes"] == predicted_weights
    assert status["weight_bytes"] == predicted_weights
    page = 1
    expected_tokens = memory.kv_capacity_tokens(budget, predicted_weights, 30, page)
    assert abs(status["kv_capacity_tokens"] - expected_tokens) <= page
    assert status["kv_capacity_tokens"] >= plan["plan"]["workload"]["batch_requests"] * (512 + 64)


def _workload(plan):
    from sglang_morph.models.workload import Workload

    return Workload(**plan["plan"]["workload"])
