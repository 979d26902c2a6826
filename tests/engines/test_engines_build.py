"""The offline builder of layer engines: formats against a naive reference, manifest and files,
AWQ against round-to-nearest on the calibration objective, and the CLI's errors.

The builds run on a 2-layer cut of the default model (its real first layers, so activations and
AWQ behave as on the full model) with a small calibration set and coarser search grids than the
shipped recipe, once per module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_morph.morph import build_engines
from sglang_morph.engines import awq, formats
from sglang_morph.engines.build import (
    AWQ_REPORT_FILE,
    DEFAULT_RECIPE_FILE,
    BuildRecipe,
    calibration_windows,
    default_out_dir,
    plan_build,
)
from sglang_morph.engines.manifest import LINEAR_NAMES, EngineManifest, read_variant
from sglang_morph.models import default_model_path

SMALL_MODEL_LAYERS = 2
CALIBRATION_ARGS = ["--calibration-samples", "8", "--calibration-tokens-per-sample", "128"]



@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The builds here are small; on a machine shared with other busy processes, torch's OpenMP
    threads stall waiting for each other (a 2-layer build was seen to take 44 s instead of 4 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- formats against a naive, per-element reference --------------------------------------------


def _bf16(x: np.float32) -> np.float32:
    return np.float32(torch.tensor(float(x), dtype=torch.float32).to(torch.bfloat16).item())


def _naive_w8(w: np.ndarray):
    out_features, in_features = w.shape
    q = np.zeros((out_features, in_features), dtype=np.int8)
    scales = np.zeros(out_features, dtype=np.float32)
    for o in range(out_features):
        amax = np.float32(0)
        for i in range(in_features):
            amax = max(amax, abs(w[o, i]))
        scales[o] = _bf16(max(amax / np.float32(127), np.float32(1e-8)))
        for i in range(in_features):
            q[o, i] = min(max(round(float(w[o, i] / scales[o])), -127), 127)
    return q, scales


def _naive_w4(w: np.ndarray, group: int, input_scale: np.ndarray | None):
    out_features, in_features = w.shape
    n_groups = in_features // group
    q = np.zeros((out_features, in_features), dtype=np.int64)
    scales = np.zeros((out_features, n_groups), dtype=np.float32)
    zeros = np.zeros((out_features, n_groups), dtype=np.int64)
    for o in range(out_features):
        for j in range(n_groups):
            values = []
            for i in range(j * group, (j + 1) * group):
                v = w[o, i]
                if input_scale is not None:
                    v = v * _bf16(input_scale[i])
                values.append(np.float32(v))
            lo, hi = min(min(values), np.float32(0)), max(max(values), np.float32(0))
            scale = _bf16(max((hi - lo) / np.float32(15), np.float32(1e-8)))
            zero = min(max(round(float(-lo / scale)), 0), 15)
            scales[o, j], zeros[o, j] = scale, zero
            for k, v in enumerate(values):
                q[o, j * group + k] = min(max(round(float(v / scale)) + zero, 0), 15)
    packed = np.zeros((out_features, in_features // 2), dtype=np.uint8)
    for o in range(out_features):
        for c in range(in_features // 2):
            packed[o, c] = q[o, 2 * c] | (q[o, 2 * c + 1] << 4)  # column 2c low, 2c+1 high
    w_eff = np.zeros((out_features, in_features), dtype=np.float32)
    for o in range(out_features):
        for i in range(in_features):
            j = i // group
            v = np.float32((q[o, i] - zeros[o, j]) * scales[o, j])
            w_eff[o, i] = v / _bf16(input_scale[i]) if input_scale is not None else v
    return packed, scales, zeros, w_eff


def _random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=generator) * 0.05
    w[0, 3] = 0.9  # an outlier, so some groups and rows have a very different range
    w[1] = w[1].abs()  # an all-positive row: zero must still be representable
    return w


def test_w8_matches_naive_reference():
    w = _random_weight(6, 40, seed=1)
    t = formats.get_format(8).quantize(w)
    formats.get_format(8).check(t, 6, 40)
    q, scales = _naive_w8(w.numpy())
    assert np.array_equal(t["qweight"].numpy(), q)
    assert np.array_equal(t["scales"].float().numpy(), scales)
    w_eff = formats.get_format(8).dequantize(t)
    assert torch.equal(w_eff, torch.from_numpy(q.astype(np.float32) * scales[:, None]))


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("with_input_scale", [False, True])
def test_w4_matches_naive_reference(group, with_input_scale):
    w = _random_weight(5, 128, seed=2)
    input_scale = None
    if with_input_scale:
        input_scale = torch.rand(128, generator=torch.Generator().manual_seed(3)) * 4 + 0.25
    fmt = formats.get_format(4)
    t = fmt.quantize(w, group_size=group, input_scale=input_scale)
    fmt.check(t, 5, 128)
    packed, scales, zeros, w_eff = _naive_w4(
        w.numpy(), group, None if input_scale is None else input_scale.numpy()
    )
    assert np.array_equal(t["qweight"].numpy(), packed)
    assert np.array_equal(t["scales"].float().numpy(), scales)
    assert np.array_equal(t["zeros"].numpy(), zeros.astype(np.uint8))
    assert ("input_scale" in t) == with_input_scale
    assert torch.allclose(fmt.dequantize(t), torch.from_numpy(w_eff), rtol=1e-6, atol=0)


def test_w4_nibble_order():
    # One row whose values are exactly the codes 0..15 twice: scale 1, zero 0, q == w.
    w = torch.tensor([list(range(16)) * 2], dtype=torch.float32)
    t = formats.get_format(4).quantize(w, group_size=32)
    assert t["scales"].float().tolist() == [[1.0]] and t["zeros"].tolist() == [[0]]
    assert t["qweight"][0, :3].tolist() == [0x10, 0x32, 0x54]  # column 2j low, 2j + 1 high
    packed = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert formats.unpack_w4(packed).tolist() == [[1, 2, 0, 15]]
    assert torch.equal(formats.get_format(4).dequantize(t), w)


def test_w8_error_is_at_most_half_a_step():
    w = _random_weight(64, 256, seed=4)
    t = formats.get_format(8).quantize(w)
    error = (w - formats.get_format(8).dequantize(t)).abs()
    half_step = t["scales"].float()[:, None] / 2
    assert bool((error <= half_step * (1 + 1e-6)).all())


def test_output_error_matches_direct_computation():
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, generator=generator) * torch.linspace(0.1, 3, 64)
    w = torch.randn(16, 64, generator=generator)
    w_eff = formats.get_format(4).dequantize(formats.get_format(4).quantize(w, group_size=32))
    stats = awq.InputStats(x.abs().mean(0), x.T @ x / x.shape[0], x.shape[0])
    direct = float(((x @ w.T - x @ w_eff.T) ** 2).sum(dim=1).mean())
    assert awq.output_error(w, w_eff, stats) == pytest.approx(direct, rel=1e-4)


# ---- builds on a 2-layer cut of the default model ----------------------------------------------


@pytest.fixture(scope="module")
def test_recipe(tmp_path_factory) -> Path:
    """The shipped recipe with coarser AWQ grids, so that the module's builds stay fast."""
    recipe = BuildRecipe.load(DEFAULT_RECIPE_FILE)
    if not recipe.calibration_file.is_file():
        pytest.skip(f"the calibration text {recipe.calibration_file} is absent")
    raw = {**recipe.to_dict(), "awq_alpha_grid_size": 10, "awq_clip_grid_size": 4}
    path = tmp_path_factory.mktemp("recipe") / "llama-test.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    """The default model's first layers, saved as an HF directory in its own dtype (bf16)."""
    source = default_model_path()
    target = tmp_path_factory.mktemp("small-model") / f"SmolLM2-{SMALL_MODEL_LAYERS}-layers"
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = SMALL_MODEL_LAYERS
    (target / "config.json").write_text(json.dumps(config))
    state = load_file(source / "model.safetensors")
    kept = {k: v for k, v in state.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < SMALL_MODEL_LAYERS}
    save_file(kept, target / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, target / name)
    return target


def _run_cli(args: list[str], recipe: Path, capsys) -> tuple[int, str, str]:
    try:
        code = build_engines.main(["--recipe", str(recipe), *args])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def builds(small_model, test_recipe, tmp_path_factory) -> dict[str, Path]:
    out_root = tmp_path_factory.mktemp("engines")
    dirs = {"awq": out_root / "awq", "rtn": out_root / "rtn"}
    extra = {"awq": [], "rtn": ["--no-awq", "--bits", "4"]}
    for kind, out in dirs.items():
        code = build_engines.main([
            "--recipe", str(test_recipe), "--model-path", str(small_model), "--out", str(out),
            *CALIBRATION_ARGS, *extra[kind],
        ])
        assert code == 0
    return dirs


def test_cli_prints_the_engines_dir_last_and_keeps_a_matching_build(
    builds, small_model, test_recipe, capsys
):
    manifest_mtime_ns = (builds["awq"] / "manifest.json").stat().st_mtime_ns
    code, out, _ = _run_cli(
        ["--model-path", str(small_model), "--out", str(builds["awq"]), *CALIBRATION_ARGS],
        test_recipe, capsys,
    )
    assert code == 0
    assert out.strip().splitlines()[-1] == str(builds["awq"])
    assert (builds["awq"] / "manifest.json").stat().st_mtime_ns == manifest_mtime_ns  # not rebuilt
    # The build was written beside its final place and renamed: no leftovers.
    siblings = [p.name for p in builds["awq"].parent.iterdir()]
    assert not [name for name in siblings if ".partial-" in name or ".old-" in name]


def test_manifest_loads_and_checksums_verify(builds, small_model):
    manifest = EngineManifest.load(builds["awq"])
    manifest.check_integrity(builds["awq"], verify_checksums=True)
    manifest.check_matches_model(json.loads((small_model / "config.json").read_text()))
    assert manifest.num_layers == SMALL_MODEL_LAYERS
    assert manifest.bits_available == (4, 8, 16)
    assert manifest.calibration["n_samples"] == 8
    assert manifest.calibration["tokens_per_sample"] == 128
    assert "test" not in Path(manifest.calibration["file"]).name
    assert manifest.recipe["awq"] is True and manifest.recipe["w4_group_size"] == "auto"
    assert len(manifest.model["weights_sha256"]) == 64
    assert EngineManifest.load(builds["rtn"]).bits_available == (4, 16)


def test_device_bytes_are_the_stored_tensor_bytes(builds, small_model):
    manifest = EngineManifest.load(builds["awq"])
    config = json.loads((small_model / "config.json").read_text())
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    params = hidden * (2 * hidden + 2 * kv) + 3 * hidden * intermediate
    for i in range(manifest.num_layers):
        assert manifest.variant(i, 16).device_bytes == 2 * params  # bf16 checkpoint
        for bits in (8, 4):
            info = manifest.variant(i, bits)
            stored = load_file(builds["awq"] / info.file)
            assert info.device_bytes == sum(t.numel() * t.element_size() for t in stored.values())
            assert set(stored) == {f"{n}.{t}" for n in LINEAR_NAMES
                                   for t in read_variant(builds["awq"], info)[n]}
            for name, tensors in read_variant(builds["awq"], info).items():
                out_features, in_features = tensors["qweight"].shape[0], (
                    tensors["qweight"].shape[1] * (2 if bits == 4 else 1))
                formats.get_format(bits).check(tensors, out_features, in_features)
        assert manifest.variant(i, 8).device_bytes < manifest.variant(i, 16).device_bytes
        assert manifest.variant(i, 4).device_bytes < manifest.variant(i, 8).device_bytes


def test_w4_group_rule_on_the_default_shapes(builds):
    info = EngineManifest.load(builds["awq"]).variant(0, 4)
    # in_features 576 (hidden) is not a multiple of 128; 1536 (intermediate) is.
    assert info.group_sizes == {n: (128 if n == "mlp.down_proj" else 64) for n in LINEAR_NAMES}
    tensors = read_variant(builds["awq"], info)
    assert all(formats.w4_group_size_of(tensors[n]) == info.group_sizes[n] for n in LINEAR_NAMES)


def test_fused_linears_share_one_input_scale(builds):
    manifest = EngineManifest.load(builds["awq"])
    for i in range(manifest.num_layers):
        info = manifest.variant(i, 4)
        assert info.awq
        tensors = read_variant(builds["awq"], info)
        for group in awq.INPUT_GROUPS:
            first = tensors[group.linears[0]]["input_scale"]
            for name in group.linears[1:]:
                assert torch.equal(tensors[name]["input_scale"], first), (i, name)
        rtn = read_variant(builds["rtn"], EngineManifest.load(builds["rtn"]).variant(i, 4))
        assert not EngineManifest.load(builds["rtn"]).variant(i, 4).awq
        assert all("input_scale" not in t for t in rtn.values())


def test_awq_output_error_is_below_rtn_on_calibration_activations(builds, small_model, test_recipe):
    """Measured directly on captured activations (not on the builder's second moments)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = BuildRecipe.load(test_recipe)
    recipe = dataclasses.replace(recipe, calibration_samples=8, calibration_tokens_per_sample=128)
    plan = plan_build(small_model, recipe, out_dir=builds["awq"])
    windows = calibration_windows(plan, AutoTokenizer.from_pretrained(small_model))
    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32).eval()
    inputs: dict[tuple[int, str], list[torch.Tensor]] = {}
    handles = [
        layer.get_submodule(group.linears[0]).register_forward_pre_hook(
            lambda _m, args, key=(i, group.name): inputs.setdefault(key, []).append(
                args[0].reshape(-1, args[0].shape[-1]))
        )
        for i, layer in enumerate(model.model.layers) for group in awq.INPUT_GROUPS
    ]
    with torch.inference_mode():
        model.model(input_ids=windows, use_cache=False)
    for handle in handles:
        handle.remove()

    # The builder runs the model block by block; its statistics must be the full forward's.
    for i, stats in enumerate(awq.block_by_block_input_stats(model, windows, batch_sequences=3)):
        for group in awq.INPUT_GROUPS:
            x = torch.cat(inputs[(i, group.name)])
            assert stats[group.name].n_tokens == x.shape[0]
            assert torch.allclose(stats[group.name].mean_abs, x.abs().mean(0), rtol=1e-4, atol=1e-6)
            second_moment = x.T @ x / x.shape[0]
            assert torch.allclose(stats[group.name].second_moment, second_moment,
                                  rtol=1e-3, atol=1e-5 * float(second_moment.abs().max()))

    awq_manifest, rtn_manifest = (EngineManifest.load(builds[k]) for k in ("awq", "rtn"))
    w4 = formats.get_format(4)
    lower = 0
    for i, layer in enumerate(model.model.layers):
        awq_tensors = read_variant(builds["awq"], awq_manifest.variant(i, 4))
        rtn_tensors = read_variant(builds["rtn"], rtn_manifest.variant(i, 4))
        for group in awq.INPUT_GROUPS:
            x = torch.cat(inputs[(i, group.name)])

            def error(tensors) -> float:
                return sum(
                    float(((x @ (layer.get_submodule(n).weight.detach()
                                 - w4.dequantize(tensors[n])).T) ** 2).sum(dim=1).mean())
                    for n in group.linears
                )

            awq_error, rtn_error = error(awq_tensors), error(rtn_tensors)
            assert awq_error <= rtn_error * (1 + 1e-4), (i, group.name, awq_error, rtn_error)
            lower += awq_error < rtn_error * (1 - 1e-3)
    n_groups = SMALL_MODEL_LAYERS * len(awq.INPUT_GROUPS)
    assert lower >= 0.75 * n_groups, f"AWQ beat RTN on only {lower} of {n_groups} groups"

    report = json.loads((builds["awq"] / AWQ_REPORT_FILE).read_text())
    for layer_report in report:
        for group in layer_report["groups"]:
            assert group["output_mse"] <= group["scaled_output_mse"] <= group["rtn_output_mse"]


def test_default_out_dir_is_in_the_cache_and_names_the_recipe(small_model, monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_MORPH_CACHE_DIR", str(tmp_path))
    recipe = BuildRecipe.load(DEFAULT_RECIPE_FILE)
    plan = plan_build(small_model, recipe)
    assert plan.out_dir.parent == tmp_path / "engines"
    assert plan.out_dir.name == f"{small_model.name}-{recipe.short_hash(plan.calibration_sha256)}"
    assert plan.out_dir == default_out_dir(small_model, recipe, plan.calibration_sha256)
    rtn = plan_build(small_model, dataclasses.replace(recipe, awq=False))
    assert rtn.out_dir != plan.out_dir


# ---- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def non_llama_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt2")
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "num_hidden_layers": 2}))
    return path


@pytest.mark.parametrize(
    "make_args,needle",
    [
        (lambda m, tmp: ["--model-path", str(m), "--bits", "5"], "unknown bit-width 5"),
        (lambda m, tmp: ["--model-path", str(m), "--bits", "8,x"], "comma-separated integers"),
        (lambda m, tmp: ["--model-path", str(m), "--bits", "16"], "full precision"),
        (lambda m, tmp: ["--model-path", str(tmp / "nowhere")], "does not exist"),
        (lambda m, tmp: ["--model-path", "NON_LLAMA"], "GPT2LMHeadModel"),
        (lambda m, tmp: ["--model-path", str(m), "--w4-group-size", "128"],
         "divide in_features=576"),
        (lambda m, tmp: ["--model-path", str(m), "--w4-group-size", "48"], "48"),
        (lambda m, tmp: ["--model-path", str(m), "--calibration-file", str(tmp / "none.txt")],
         "calibration file"),
        (lambda m, tmp: ["--model-path", str(m), "--out", str(tmp)], "without manifest.json"),
    ],
    ids=["bits-5", "bits-garbage", "bits-16", "missing-model", "non-llama", "group-128",
         "group-48", "calibration-missing", "out-not-an-engines-dir"],
)
def test_bad_input_is_a_cli_error(
    make_args, needle, small_model, non_llama_model, test_recipe, tmp_path, capsys
):
    (tmp_path / "someone_elses_file").write_text("keep me")
    args = [str(non_llama_model) if a == "NON_LLAMA" else a
            for a in make_args(small_model, tmp_path)]
    code, out, err = _run_cli(args, test_recipe, capsys)
    assert code == 2
    assert needle in err
    assert out == ""
    assert (tmp_path / "someone_elses_file").read_text() == "keep me"


def test_a_broken_recipe_is_a_cli_error(small_model, test_recipe, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads(test_recipe.read_text()), "awq": "yes"}))
    code, _, err = _run_cli(["--model-path", str(small_model)], broken, capsys)
    assert code == 2 and "awq must be true or false" in err
    broken.write_text(json.dumps({"name": "llama"}))
    code, _, err = _run_cli(["--model-path", str(small_model)], broken, capsys)
    assert code == 2 and "differ from the expected" in err


def test_a_different_build_is_not_overwritten_without_force(
    builds, small_model, test_recipe, capsys
):
    before = (builds["rtn"] / "manifest.json").read_text()
    code, _, err = _run_cli(
        ["--model-path", str(small_model), "--out", str(builds["rtn"]), *CALIBRATION_ARGS],
        test_recipe, capsys,
    )
    assert code == 2 and "different build" in err and "--force" in err
    assert (builds["rtn"] / "manifest.json").read_text() == before


def test_cli_exit_code_as_a_process():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_morph.morph.build_engines", "--bits", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "unknown bit-width 5" in result.stderr and result.stdout == ""


def test_rebuilding_gives_identical_files(builds, small_model, test_recipe, tmp_path):
    """Same inputs, same bytes, so a checksum identifies a build. (Shown on round-to-nearest,
    which is quick; AWQ's float sums may also depend on the thread count.)"""
    again = tmp_path / "rtn-again"
    assert build_engines.main([
        "--recipe", str(test_recipe), "--model-path", str(small_model), "--out", str(again),
        "--no-awq", "--bits", "4",
    ]) == 0
    first, second = (EngineManifest.load(d) for d in (builds["rtn"], again))
    assert [layer[4].sha256 for layer in first.layers] == [layer[4].sha256 for layer in second.layers]
