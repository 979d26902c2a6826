"""Morph flags at the CLI edge: parsing, validation, clear errors (no server needed)."""

from __future__ import annotations

import argparse

import pytest

from sglang_morph.config import MorphConfig, MorphConfigError, PrecisionMap


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


def test_quantized_map_requires_engines():
    with pytest.raises(MorphConfigError, match="requires --morph-engines"):
        MorphConfig.from_cli_namespace(ns(morph_precision_map="0:4"))
    # All-16 needs no engines.
    assert MorphConfig.from_cli_namespace(ns(morph_precision_map="*:16")).precision_map


def test_config_is_frozen():
    cfg = MorphConfig.from_cli_namespace(ns())
    with pytest.raises(Exception):
        cfg.enabled = False
