"""Morph flags at the CLI edge: parsing, validation, clear errors (no server needed)."""

from __future__ import annotations

import argparse

import pytest

from sglang_morph.morph.config import MORPH_MODES, MorphConfig, MorphConfigError, PrecisionMap, parse_bytes


def ns(**kw):
    base = {"enable_morph": True, "morph_engines": None, "morph_precision_map": None}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("0-7:4,8-29:16", (4,) * 8 + (16,) * 22),
        ("*:8", (8,) * 30),
        ("*:8,3:4,28-29:16", (8, 8, 8, 4) + (8,) * 24 + (16, 16)),
        ("5:4", (16,) * 5 + (4,) + (16,) * 24),
    ],
)
def test_precision_map_resolves(spec, expected):
    assert PrecisionMap.parse(spec).resolve(30) == expected


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("0-7:5", "unknown bit-width 5"),
        ("0-7", "cannot parse"),
        ("a-b:4", "cannot parse"),
        ("7-3:4", "empty range"),
        ("", "cannot parse"),
    ],
)
def test_precision_map_syntax_errors(spec, needle):
    with pytest.raises(MorphConfigError, match=needle):
        PrecisionMap.parse(spec)


def test_precision_map_layer_out_of_range():
    with pytest.raises(MorphConfigError, match="layer 30 does not exist; the model has 30"):
        PrecisionMap.parse("28-30:4").resolve(30)


def test_morph_flags_require_enable_morph():
    with pytest.raises(MorphConfigError, match="--morph-engines requires --enable-morph"):
        MorphConfig.from_cli_namespace(ns(enable_morph=False, morph_engines="/x"))


def test_quantized_map_without_engines_leaves_them_to_the_launcher():
    """Without --morph-engines the launcher builds (or finds) the variants in the cache."""
    cfg = MorphConfig.from_cli_namespace(ns(morph_precision_map="0:4"))
    assert cfg.precision_map.resolve(2) == (4, 16) and cfg.engines_dir is None


def test_config_is_frozen():
    cfg = MorphConfig.from_cli_namespace(ns())
    with pytest.raises(Exception):
        cfg.enabled = False


def test_runtime_flags_parse_and_require_enable_morph():
    cfg = MorphConfig.from_cli_namespace(ns(
        morph_mode="performance", morph_swap_order="/x.json", morph_memory_budget="1.5GiB",
        morph_log="/tmp/t.jsonl", disable_morph_controller=True))
    assert (cfg.mode, cfg.swap_order_path, cfg.memory_budget_bytes, cfg.log_path,
            cfg.controller_enabled) == ("performance", "/x.json", 1610612736, "/tmp/t.jsonl", False)
    assert MorphConfig.from_cli_namespace(ns()).mode == "default"
    for kw, flag in (({"morph_mode": "accuracy"}, "--morph-mode"),
                     ({"morph_memory_budget": "1GB"}, "--morph-memory-budget"),
                     ({"disable_morph_controller": True}, "--disable-morph-controller")):
        with pytest.raises(MorphConfigError, match=f"{flag} requires --enable-morph"):
            MorphConfig.from_cli_namespace(ns(enable_morph=False, **kw))


@pytest.mark.parametrize("text,expected", [("1073741824", 2**30), ("800MB", 800 * 10**6),
                                           ("1.5GiB", 3 * 2**29), ("64 kib", 65536)])
def test_memory_budget_units(text, expected):
    assert parse_bytes(text, "--morph-memory-budget") == expected


@pytest.mark.parametrize("text", ["", "12XB", "-5", "0", "GiB"])
def test_memory_budget_errors_name_the_flag(text):
    with pytest.raises(MorphConfigError, match="--morph-memory-budget"):
        parse_bytes(text, "--morph-memory-budget")


def test_cli_modes_match_the_policy_registry():
    from sglang_morph.morph.control.policy import MODES

    assert set(MODES) == set(MORPH_MODES)


def test_budget_sizing_from_the_checkpoint(default_model_path):
    import json

    from sglang_morph.morph.startup import size_kv_for_budget

    hf = json.loads((default_model_path / "config.json").read_text())
    weights = 134_515_008 * 2  # SmolLM2-135M parameters (tied LM head), bf16
    sizing = size_kv_for_budget(weights + 1000 * 23040 + 5, default_model_path, hf, "auto", "auto")
    assert (sizing.weight_bytes, sizing.kv_bytes_per_token, sizing.kv_capacity_tokens) == (
        weights, 23040, 1000)
    fp32 = size_kv_for_budget(2 * weights + 1000 * 46080, default_model_path, hf, "float32",
                              "auto")
    assert (fp32.weight_bytes, fp32.kv_capacity_tokens) == (2 * weights, 1000)
    with pytest.raises(MorphConfigError, match="too small"):
        size_kv_for_budget(weights, default_model_path, hf, "auto", "auto")
