"""Validating ``--morph-engines`` / ``--morph-precision-map`` against the served model.

Runs twice: in the launcher right after CLI parsing (so a bad directory or map fails before any
process is spawned, with one clear line), and in the scheduler before installing variants.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sglang_morph.config import FULL_PRECISION_BITS, MorphConfig, MorphConfigError
from sglang_morph.engines.manifest import EngineManifest


@dataclasses.dataclass(frozen=True)
class StartupPlan:
    manifest: EngineManifest
    engines_dir: Path
    layer_bits: tuple[int, ...]  # bits per decoder layer at startup


def plan_startup(cfg: MorphConfig, hf_config: dict[str, Any]) -> StartupPlan | None:
    """The startup precision of every layer, or None when no engines are configured.

    Raises MorphConfigError naming the flag and the problem.
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
    return StartupPlan(manifest, engines_dir, layer_bits)


def local_hf_config(model_path: str) -> dict[str, Any] | None:
    """``config.json`` of a local model directory; None for hub ids (checked later, in SGLang)."""
    path = Path(model_path).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None
