"""Layer Importance Score profile: terms against a direct implementation, greedy choice, CLI.

Runs on a 4-layer truncation of the default model (its first 4 decoder layers, real weights)
with round-to-nearest engines written here in the manifest layout (``write_rtn_engines``, a
fixture helper: the real builder calibrates with AWQ) and a few calibration tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmark.morph.layer_order import build_tables, layer_sets_needed, orders_for
from sglang_morph.engines import formats
from sglang_morph.engines.hf_variants import (
    LayerRunner,
    LayerVariants,
    PerplexityEvaluator,
    load_model,
    load_tokenizer,
    open_engines,
    sampled_windows,
)
from sglang_morph.engines.manifest import (
    LINEAR_NAMES,
    EngineManifest,
    VariantInfo,
    model_identity,
    sha256_of_file,
    variant_file_name,
)
from sglang_morph.morph.swap_order import front_to_back, load_swap_order
from sglang_morph.models import default_model_path
from sglang_morph.morph.profile_layers import TRAIN_TEXT_PATH, LisWeights, greedy_profile, main

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_LAYERS = 4
# Group 64: a W4 grid that does not line up with the default model's GGUF Q4_1 blocks (see
# DESIGN.md), so round-to-nearest has a real cost and the scores differ between layers.
RTN_W4_GROUP_SIZE = 64


def write_truncated_model(source_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """A copy of ``source_dir`` keeping only its first ``num_layers`` decoder layers."""
    out_dir.mkdir(parents=True)
    for path in source_dir.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "config.json"):
            shutil.copy(path, out_dir / path.name)
    config = json.loads((source_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    kept = {
        name: tensor for name, tensor in load_file(source_dir / "model.safetensors").items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    save_file(kept, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def write_rtn_engines(model_dir: Path, out_dir: Path, bits: tuple[int, ...] = (4,),
                      w4_group_size: int = RTN_W4_GROUP_SIZE) -> Path:
    """An engines directory of plain round-to-nearest variants (``formats.quantize``, no
    calibration) in the manifest layout, for tests and until the real builder's output exists."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    state = load_file(model_dir / "model.safetensors")
    layers = []
    for index in range(config["num_hidden_layers"]):
        weights = {name: state[f"model.layers.{index}.{name}.weight"] for name in LINEAR_NAMES}
        fp_bytes = sum(w.numel() * w.element_size() for w in weights.values())
        variants = {16: VariantInfo(16, "fp", fp_bytes)}
        for b in bits:
            fmt = formats.get_format(b)
            tensors, group_sizes = {}, {}
            for name, weight in weights.items():
                quantized = fmt.quantize(weight.float(), group_size=w4_group_size)
                tensors.update({f"{name}.{k}": v for k, v in quantized.items()})
                if b == 4:
                    group_sizes[name] = formats.w4_group_size_of(quantized)
            file = variant_file_name(index, b)
            save_file(tensors, out_dir / file)
            variants[b] = VariantInfo(
                b, fmt.name, formats.device_bytes(tensors), file, sha256_of_file(out_dir / file),
                group_sizes or None,
            )
        layers.append(variants)
    EngineManifest(
        model={**model_identity(config), "path": str(model_dir),
               "weights_sha256": sha256_of_file(model_dir / "model.safetensors")},
        calibration={"method": "none: round-to-nearest test engines"},
        recipe={"w4_group_size": w4_group_size},
        layers=tuple(layers),
    ).save(out_dir)
    return out_dir


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These models are tiny: with 2 threads on a busy 2-core machine, OpenMP synchronisation
    was seen to make a 4-layer forward 10x slower than with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_truncated_model(default_model_path(), tmp_path_factory.mktemp("tiny") / "model",
                                 TINY_LAYERS)


@pytest.fixture(scope="module")
def tiny_engines_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return write_rtn_engines(tiny_model_dir, tmp_path_factory.mktemp("tiny") / "engines")


@pytest.fixture(scope="module")
def calibration_ids(tiny_model_dir) -> torch.Tensor:
    tokenizer = load_tokenizer(tiny_model_dir)
    text = TRAIN_TEXT_PATH.read_text()[:20_000]
    return sampled_windows(tokenizer(text, add_special_tokens=False)["input_ids"], 3, 48, seed=0)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).mean().item()


class DirectScores:
    """LTS/LRS/MDS straight from the definitions with whole-model forwards and hooks; shares
    nothing with the profile's runner, cache or variant switching."""

    def __init__(self, model_dir: Path, ids: torch.Tensor):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True).eval()
        self.ids = ids
        self.layers = self.model.model.layers
        self.fp = [{n: layer.get_submodule(n).weight.detach().clone() for n in LINEAR_NAMES}
                   for layer in self.layers]
        fmt = formats.get_format(4)
        self.q = [{n: fmt.dequantize(fmt.quantize(w, group_size=RTN_W4_GROUP_SIZE))
                   for n, w in layer.items()} for layer in self.fp]

    def configure(self, quantized: set[int]) -> None:
        for index, layer in enumerate(self.layers):
            source = self.q if index in quantized else self.fp
            for name in LINEAR_NAMES:
                layer.get_submodule(name).weight.data.copy_(source[index][name])

    @torch.no_grad()
    def output(self, quantized: set[int]) -> torch.Tensor:
        self.configure(quantized)
        # use_cache=False: a KV cache in the captured kwargs would make a re-run attend twice.
        return self.model.model(self.ids, use_cache=False).last_hidden_state

    @torch.no_grad()
    def lts_lrs(self) -> tuple[list[float], list[float]]:
        calls = {}

        def capture(index):
            def hook(module, args, kwargs, output):
                calls[index] = (args, kwargs, output)
            return hook

        handles = [layer.register_forward_hook(capture(i), with_kwargs=True)
                   for i, layer in enumerate(self.layers)]
        self.output(set())
        for h in handles:
            h.remove()
        lts, lrs = [], []
        for index, layer in enumerate(self.layers):
            args, kwargs, fp_out = calls[index]
            lts.append(_cos(args[0], fp_out))
            self.configure({index})
            lrs.append(_cos(fp_out, layer(*args, **kwargs)))
        return lts, lrs


def test_runner_matches_model_forward(tiny_model_dir, calibration_ids):
    model = load_model(tiny_model_dir)
    runner = LayerRunner(model, calibration_ids)
    with torch.no_grad():
        expected = model.model(calibration_ids).last_hidden_state
    got = runner.final_norm(runner.run(runner.embed(), 0))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def exhaustive_and_pruned(tiny_model_dir, tiny_engines_dir, calibration_ids):
    manifest = open_engines(tiny_engines_dir, tiny_model_dir, 4)
    model = load_model(tiny_model_dir)
    runner = LayerRunner(model, calibration_ids)
    variants = LayerVariants(model, tiny_engines_dir, manifest, 4, progress=False)
    return tuple(greedy_profile(runner, variants, all_scores=all_scores, progress=False)
                 for all_scores in (True, False))


def test_lis_terms_match_direct_implementation(tiny_model_dir, calibration_ids,
                                               exhaustive_and_pruned):
    profile = exhaustive_and_pruned[0]
    direct = DirectScores(tiny_model_dir, calibration_ids)
    lts, lrs = direct.lts_lrs()
    weights = LisWeights()
    # Steps 0 and 1: MDS against the full-precision output, then conditioned on the first choice.
    for step in profile.steps[:2]:
        before = set(profile.order[:step.step])
        base = direct.output(before)
        for layer, got in step.scores.items():
            mds = _cos(base, direct.output(before | {layer}))
            lis = weights.lts * lts[layer] + weights.lrs * lrs[layer] + weights.mds * mds
            for name, want in (("lts", lts[layer]), ("lrs", lrs[layer]), ("mds", mds),
                               ("lis", lis)):
                assert getattr(got, name) == pytest.approx(want, abs=2e-6), (step.step, layer, name)
    # The terms must actually discriminate, or the comparison above proves little.
    assert max(lrs) - min(lrs) > 1e-4
    assert min(s.mds for s in profile.steps[0].scores.values()) < 1 - 1e-5


def test_greedy_picks_argmax_and_pruning_is_exact(exhaustive_and_pruned):
    exhaustive, pruned = exhaustive_and_pruned
    assert pruned.order == exhaustive.order
    assert sorted(exhaustive.order) == list(range(TINY_LAYERS))
    for step in exhaustive.steps:
        lis = {layer: s.lis for layer, s in step.scores.items()}
        assert step.chosen == max(sorted(lis), key=lis.get)
    for step, full in zip(pruned.steps, exhaustive.steps):
        for layer, s in step.scores.items():
            if s.mds is None:
                assert s.lis_upper_bound < step.scores[step.chosen].lis
            else:
                assert s == full.scores[layer]
    assert pruned.layer_forwards < exhaustive.layer_forwards


def test_perplexity_restarts_at_first_quantized_layer(tiny_model_dir, tiny_engines_dir,
                                                       calibration_ids):
    manifest = open_engines(tiny_engines_dir, tiny_model_dir, 4)
    model = load_model(tiny_model_dir)
    variants = LayerVariants(model, tiny_engines_dir, manifest, 4, progress=False)
    evaluator = PerplexityEvaluator(LayerRunner(model, calibration_ids), variants)
    direct = DirectScores(tiny_model_dir, calibration_ids)
    for layers in (set(), {2}, {1, 3}):
        direct.configure(layers)
        with torch.no_grad():
            loss = direct.model(calibration_ids, labels=calibration_ids, use_cache=False).loss
        assert evaluator.perplexity(layers) == pytest.approx(math.exp(loss.item()), rel=1e-5)
    assert variants.quantized_layers == frozenset()


def test_layer_order_tables_on_additive_perplexities():
    single_delta = {0: 0.5, 1: 0.1, 2: 0.2, 3: 0.3, 4: 0.05}
    orders = orders_for((1, 4, 2, 3, 0), random_seeds=3)
    sets = layer_sets_needed(orders, (1, 2, 5), (0, 2))
    ppl = {s: 10 + sum(single_delta[layer] for layer in s) for s in sets}
    table2, table3 = build_tables(orders, ppl, (1, 2, 5), (0, 2))
    assert [row["lis"] for row in table2] == pytest.approx([10.1, 10.15, 11.15])
    assert table2[0]["front_to_back"] == pytest.approx(10.5)
    assert table2[0]["back_to_front"] == pytest.approx(10.05)
    assert table2[-1]["random_std"] == pytest.approx(0.0, abs=1e-12)
    assert table3["fixed_layer"] == 0 and table3["delta_fixed_alone"] == pytest.approx(0.5)
    k2 = table3["rows"][1]
    assert k2["base_layers"] == [1, 4]
    assert k2["delta_fixed_over_alone"] == pytest.approx(1.0)
    assert k2["delta_base_over_sum_single"] == pytest.approx(1.0)


def run_cli(tmp_path: Path, *args: str) -> tuple[int, Path]:
    out = tmp_path / "order.json"
    try:
        code = main([*args, "--out", str(out), "--no-progress"])
    except SystemExit as e:
        code = e.code
    return code, out


def test_cli_writes_greedy_permutation(tiny_model_dir, tiny_engines_dir, tmp_path):
    out = tmp_path / "order.json"
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_morph.morph.profile_layers", "--model-path", str(tiny_model_dir),
         "--engines", str(tiny_engines_dir), "--samples", "2", "--tokens-per-sample", "32",
         "--no-progress", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["bits"] == 4 and report["calibration"]["num_samples"] == 2
    assert sorted(report["order"]) == list(range(TINY_LAYERS))
    assert load_swap_order(out, TINY_LAYERS) == tuple(report["order"])
    for k, step in enumerate(report["steps"]):
        candidates = {int(layer): s for layer, s in step["scores"].items()}
        assert set(candidates) == set(range(TINY_LAYERS)) - set(report["order"][:k])
        assert step["chosen"] == report["order"][k]
        chosen_lis = candidates[step["chosen"]]["lis"]
        for s in candidates.values():  # pruned candidates (lis null) could not have won
            assert (s["lis"] if s["lis"] is not None else s["lis_upper_bound"]) <= chosen_lis


def test_cli_bad_input_exits_2(tiny_model_dir, tiny_engines_dir, tmp_path, capsys):
    other_model = write_truncated_model(tiny_model_dir, tmp_path / "two_layers", 2)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    cases = [
        (["--engines", str(tmp_path / "nope")], "does not exist"),
        (["--engines", str(empty_dir)], "has no manifest.json"),
        (["--model-path", str(other_model), "--engines", str(tiny_engines_dir)],
         "num_hidden_layers=4"),
        (["--engines", str(tiny_engines_dir), "--bits", "8"], "no 8-bit variants"),
        (["--engines", str(tiny_engines_dir), "--bits", "16"], "full precision"),
    ]
    for args, message in cases:
        if "--model-path" not in args:
            args = ["--model-path", str(tiny_model_dir), *args]
        code, out = run_cli(tmp_path, *args)
        assert code == 2, args
        assert message in capsys.readouterr().err, args
        assert not out.exists()


def _write_order(tmp_path: Path, content) -> Path:
    path = tmp_path / "order.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ([0, 1, 2], "no \"order\""),
    ({"steps": []}, "no \"order\""),
    ({"order": "0123"}, "must be a list"),
    ({"order": [0, 1, 2]}, "3 entries"),
    ({"order": [0, 1, 2, 2]}, "not a permutation"),
    ({"order": [0, 1, 2, 4]}, "outside 0..3"),
    ({"order": [0, 1, 2, -1]}, "outside 0..3"),
    ({"order": [0, 1, 2, 3.0]}, "integers"),
    ({"order": [True, 0, 2, 3]}, "integers"),
])
def test_swap_order_rejects_bad_files(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        load_swap_order(_write_order(tmp_path, content), 4)


def test_swap_order_accepts_permutation_and_defaults(tmp_path):
    assert load_swap_order(_write_order(tmp_path, {"order": [3, 0, 2, 1]}), 4) == (3, 0, 2, 1)
    assert front_to_back(4) == (0, 1, 2, 3)
    with pytest.raises(FileNotFoundError):
        load_swap_order(tmp_path / "missing.json", 4)


def test_calibration_windows_are_distinct_and_seeded():
    tokens = list(range(1000))
    a = sampled_windows(tokens, 5, 100, seed=0)
    assert a.shape == (5, 100)
    assert torch.equal(a, sampled_windows(tokens, 5, 100, seed=0))
    assert not torch.equal(a, sampled_windows(tokens, 5, 100, seed=1))
    assert len({int(row[0]) for row in a}) == 5 and all(int(row[0]) % 100 == 0 for row in a)
