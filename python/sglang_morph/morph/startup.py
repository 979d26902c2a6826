"""Validating ``--morph-engines`` / ``--morph-precision-map`` against the served model.

Runs twice: in the launcher right after CLI parsing (so a bad directory or map fails before any
process is spawned, with one clear line), and in the scheduler before installing variants.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.morph.config import MorphConfig, MorphConfigError
from sglang_morph.engines.manifest import EngineManifest


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    manifest: EngineManifest
    engines_dir: Path
    layer_bits: tuple[int, ...]  # bits per decoder layer at startup


def plan_startup(cfg: MorphConfig, hf_config: dict[str, Any],
                 verify_checksums: bool = False) -> StartupPlan | None:
    """The startup precision of every layer, or None when no engines are configured.

    Raises MorphConfigError naming the flag and the problem; with ``verify_checksums``, also
    when a variant file's sha256 differs from the manifest's (read last: it reads every file).
    """
    if cfg.engines_dir is None:
        return None
    engines_dir = Path(cfg.engines_dir).expanduser()
    try:
        manifest = EngineManifest.load(engines_dir)
        manifest.check_matches_model(hf_config)
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise MorphConfigError(f"--morph-engines {cfg.engines_dir}: {e}") from e
    num_layers = hf_config["num_hidden_layers"]
    layer_bits = (
        cfg.precision_map.resolve(num_layers)
        if cfg.precision_map is not None
        else (FULL_PRECISION_BITS,) * num_layers
    )
    missing = sorted({b for b in layer_bits if b not in manifest.bits_available})
    if missing:
        raise MorphConfigError(
            f"--morph-precision-map asks for {missing}-bit layers, but {cfg.engines_dir} has "
            f"variants for {[b for b in manifest.bits_available if b != FULL_PRECISION_BITS]} bits"
        )
    if verify_checksums:
        try:
            manifest.check_integrity(engines_dir, verify_checksums=True)
        except (OSError, ValueError) as e:
            raise MorphConfigError(f"--morph-engines {cfg.engines_dir}: {e}") from e
    return StartupPlan(manifest, engines_dir, layer_bits)


def local_hf_config(model_path: str) -> dict[str, Any] | None:
    """``config.json`` of a local model directory; None for hub ids (checked later, in SGLang)."""
    path = Path(model_path).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def _dtype_bytes(name: str, what: str) -> int:
    name = str(name).removeprefix("torch.")
    if name.startswith("fp8") or name.startswith("float8"):
        return 1
    if name not in _DTYPE_BYTES:
        raise MorphConfigError(f"--morph-memory-budget: cannot size {what} of dtype {name!r}")
    return _DTYPE_BYTES[name]


def checkpoint_weight_bytes(model_dir: Path, hf_config: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes the model's weights take when served in a ``dtype_bytes`` dtype, read from the
    safetensors headers (no tensor is loaded). A tied LM head is counted once."""
    import struct

    total = 0
    tied = bool(hf_config.get("tie_word_embeddings", False))
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise MorphConfigError(f"--morph-memory-budget: no *.safetensors in {model_dir}")
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__" or (tied and name == "lm_head.weight"):
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            total += numel * dtype_bytes
    return total


@dataclasses.dataclass(frozen=True)
class KVSizing:
    budget_bytes: int
    weight_bytes: int  # full precision, from the checkpoint
    kv_bytes_per_token: int
    kv_capacity_tokens: int


def size_kv_for_budget(budget_bytes: int, model_dir: Path, hf_config: dict[str, Any],
                       dtype: str, kv_cache_dtype: str) -> KVSizing:
    """KV capacity at start = (budget - full-precision weights) / KV bytes per token."""
    model_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    weight_dtype_bytes = _dtype_bytes(model_dtype if dtype == "auto" else dtype, "weights")
    kv_dtype_bytes = (weight_dtype_bytes if kv_cache_dtype in ("auto", None)
                      else _dtype_bytes(kv_cache_dtype, "the KV cache"))
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    kv_per_token = (2 * hf_config["num_hidden_layers"] * hf_config.get("num_key_value_heads", heads)
                    * head_dim * kv_dtype_bytes)
    weights = checkpoint_weight_bytes(model_dir, hf_config, weight_dtype_bytes)
    tokens = (budget_bytes - weights) // kv_per_token
    if tokens < 256:
        raise MorphConfigError(
            f"--morph-memory-budget {budget_bytes} bytes is too small: full-precision weights "
            f"take {weights} bytes, leaving room for {max(tokens, 0)} KV tokens "
            f"({kv_per_token} bytes each); give at least {weights + 256 * kv_per_token} bytes"
        )
    return KVSizing(budget_bytes, weights, kv_per_token, tokens)
