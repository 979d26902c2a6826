"""Bad --morph-engines / --morph-precision-map input fails at startup with a clear message,

before any process is spawned, and never falls back silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess

import pytest

from conftest import REPO_ROOT
from sglang_morph.engines.manifest import (
    EngineManifest,
    VariantInfo,
    model_identity,
    variant_file_name,
)
from sglang_morph.surface import PluginError


def write_manifest(engines_dir, hf_config, bits=(8,)):
    """A manifest-consistent directory whose variant files are empty placeholders (with their
    true sha256): the launcher's validation reads the manifest and checksums the files, it does
    not parse the tensors.
    """
    engines_dir.mkdir(parents=True, exist_ok=True)
    layers = []
    for i in range(hf_config["num_hidden_layers"]):
        layer = {16: VariantInfo(16, "fp", 1)}
        for b in bits:
            name = variant_file_name(i, b)
            (engines_dir / name).write_bytes(b"")
            layer[b] = VariantInfo(b, f"w{b}", 1, file=name, sha256=hashlib.sha256(b"").hexdigest())
        layers.append(layer)
    EngineManifest({**model_identity(hf_config), "path": "test"}, {}, {}, tuple(layers)).save(
        engines_dir
    )
    return engines_dir


@pytest.fixture(scope="module")
def parse(default_model_path):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def run(*flags):
        return prepare_server_args(["--model-path", str(default_model_path), "--enable-morph",
                                    *flags])

    return run


@pytest.fixture(scope="module")
def hf_config(default_model_path):
    return json.loads((default_model_path / "config.json").read_text())


def test_missing_engines_dir(parse, tmp_path):
    with pytest.raises(PluginError, match="engines directory .* does not exist"):
        parse("--morph-engines", str(tmp_path / "nope"))


def test_dir_without_manifest(parse, tmp_path):
    with pytest.raises(PluginError, match="has no manifest.json; build it with"):
        parse("--morph-engines", str(tmp_path))


def test_manifest_for_another_model(parse, tmp_path, hf_config):
    other = {**hf_config, "num_hidden_layers": 2, "hidden_size": 64}
    engines = write_manifest(tmp_path / "other", other)
    with pytest.raises(PluginError, match="built for a model with num_hidden_layers=2"):
        parse("--morph-engines", str(engines), "--morph-precision-map", "*:8")


def test_unknown_bit_width(parse, tmp_path, hf_config):
    engines = write_manifest(tmp_path / "e", hf_config)
    with pytest.raises(PluginError, match="unknown bit-width 5"):
        parse("--morph-engines", str(engines), "--morph-precision-map", "0-3:5")


def test_bits_without_built_variant(parse, tmp_path, hf_config):
    engines = write_manifest(tmp_path / "e8", hf_config, bits=(8,))
    with pytest.raises(PluginError, match=r"asks for \[4\]-bit layers"):
        parse("--morph-engines", str(engines), "--morph-precision-map", "0-3:4")


def test_layer_out_of_range(parse, tmp_path, hf_config):
    engines = write_manifest(tmp_path / "e", hf_config)
    with pytest.raises(PluginError, match="layer 31 does not exist"):
        parse("--morph-engines", str(engines), "--morph-precision-map", "31:8")


def test_valid_flags_parse(parse, tmp_path, hf_config):
    from sglang_morph.morph import config as morph_config

    engines = write_manifest(tmp_path / "ok", hf_config)
    cfg = morph_config.get(parse("--morph-engines", str(engines), "--morph-precision-map", "*:8"))
    assert cfg.engines_dir == str(engines) and cfg.precision_map.resolve(30) == (8,) * 30


def test_corrupted_variant_file_is_named(parse, tmp_path, hf_config):
    engines = write_manifest(tmp_path / "e", hf_config)
    (engines / variant_file_name(3, 8)).write_bytes(b"not the built variant")
    with pytest.raises(PluginError, match=r"layer 3 8-bit variant layer_003\.w8\.safetensors: "
                                               r"sha256 differs from the manifest's"):
        parse("--morph-engines", str(engines))


@pytest.mark.parametrize("flags,needle", [
    (["--tp-size", "3", "--dp-size", "2", "--disable-morph-controller"],
     "--tp-size and --dp-size together"),
    (["--tp-size", "3", "--pp-size", "2", "--disable-morph-controller"],
     "--tp-size and --pp-size together"),
    (["--pp-size", "2", "--dp-size", "2"], "--pp-size and --dp-size together"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
    (["--disable-radix-cache"], "--disable-radix-cache"),
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm"),
])
def test_unsupported_configurations_are_refused(parse, flags, needle):
    with pytest.raises(PluginError, match="sglang-morph: error: --enable-morph does not "
                                               "support " + re.escape(needle)):
        parse(*flags)


def test_cuda_graphs_and_torch_compile_are_turned_off_with_one_line(parse, capfd):
    args = parse("--device", "cuda", "--enable-torch-compile")
    assert args.disable_cuda_graph and not args.enable_torch_compile
    assert args.cuda_graph_backend_decode == args.cuda_graph_backend_prefill == "disabled"
    lines = [line for line in capfd.readouterr().err.splitlines() if "turned off" in line]
    assert len(lines) == 1 and "CUDA graphs and torch.compile" in lines[0], lines


@pytest.mark.server
def test_launcher_exits_with_one_clear_line(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "serve.sh"), "--enable-morph",
         "--morph-engines", str(tmp_path / "missing"), "--port", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert proc.returncode != 0
    assert "sglang-morph: error: --morph-engines" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.server
def test_launcher_refuses_an_unsupported_configuration_with_one_line():
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "serve.sh"), "--enable-morph", "--tp-size", "2",
         "--port", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )
    assert proc.returncode != 0
    assert "sglang-morph: error: --enable-morph --tp-size 2 needs num_attention_heads (9)" \
        in proc.stderr
    assert "Traceback" not in proc.stderr
