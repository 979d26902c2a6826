"""``--enable-morph`` without ``--morph-engines``: the served model's W8/W4 variants and its
Layer Importance Score order, built on first use into the cache and reused afterwards.

One cache entry per model and build: ``<cache>/morph/<model dir>-<model key>-<build key>/`` with
``engines/`` (what ``python -m sglang_morph.morph.build_engines`` writes) and
``swap_order.json`` (what ``python -m sglang_morph.morph.profile_layers`` writes). The model key
hashes the model directory's path, its ``config.json`` and its weight files' names, sizes and
modification times, so a changed or different model never reuses another's variants; the build
key hashes the recipe (calibration text by content) and the profile's settings.

Invariants: an entry directory exists only complete. It is built under a file lock (two
launchers starting at once build it once; the second waits and reuses it) into a temporary
sibling that is renamed into place, and a build that was killed leaves only that sibling, which
the next build removes. The launcher builds before SGLang spawns any scheduler, so tensor-,
pipeline- and data-parallel ranks all read one entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_morph.morph.config import MorphConfigError

if TYPE_CHECKING:  # an annotation only: the builder module imports torch
    from sglang_morph.engines.build import BuildRecipe

ENTRIES_DIR = "morph"
ENGINES_DIR = "engines"
SWAP_ORDER_FILE = "swap_order.json"
MODEL_KEY_CHARS = 12
BUILD_KEY_CHARS = 10


@dataclasses.dataclass(frozen=True)
class AutoBuildSpec:
    """What an entry holds: variants built by ``recipe`` and the LIS order of its
    ``profile_bits`` variants on ``profile_samples`` x ``profile_tokens_per_sample`` tokens of
    the train-split calibration text (the defaults are ``profile_layers``' own)."""

    recipe: BuildRecipe
    profile_bits: int = 4
    profile_samples: int = 8
    profile_tokens_per_sample: int = 128
    profile_seed: int = 0

    def key(self, calibration_sha256: str | None) -> str:
        profile = (self.profile_bits, self.profile_samples, self.profile_tokens_per_sample,
                   self.profile_seed)
        text = f"{self.recipe.short_hash(calibration_sha256)} {profile}"
        return hashlib.sha256(text.encode()).hexdigest()[:BUILD_KEY_CHARS]


def default_spec() -> AutoBuildSpec:
    """The default recipe (``trt_engines/recipes/llama.json``: W8 and AWQ W4) and profile."""
    from sglang_morph.engines.build import DEFAULT_RECIPE_FILE, BuildRecipe

    return AutoBuildSpec(BuildRecipe.load(DEFAULT_RECIPE_FILE))


@dataclasses.dataclass(frozen=True)
class AutoVariants:
    entry_dir: Path
    built: bool  # True when this call built the entry, False when it found it (or waited)

    @property
    def engines_dir(self) -> Path:
        return self.entry_dir / ENGINES_DIR

    @property
    def swap_order_path(self) -> Path:
        return self.entry_dir / SWAP_ORDER_FILE


def model_key(model_dir: Path) -> str:
    """Identifies the model's files without reading the weights (a hash of a multi-GB checkpoint
    would cost every start seconds): path, config, each weight file's name, size and mtime."""
    model_dir = Path(model_dir).resolve()
    digest = hashlib.sha256(str(model_dir).encode() + b"\n")
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"\n{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:MODEL_KEY_CHARS]


def entry_dir(model_dir: Path, spec: AutoBuildSpec, calibration_sha256: str | None) -> Path:
    from sglang_morph.models import cache_dir

    name = f"{Path(model_dir).resolve().name}-{model_key(model_dir)}-{spec.key(calibration_sha256)}"
    return cache_dir() / ENTRIES_DIR / name


def is_complete(entry: Path) -> bool:
    from sglang_morph.engines.manifest import MANIFEST_FILE

    return (entry / ENGINES_DIR / MANIFEST_FILE).is_file() and (entry / SWAP_ORDER_FILE).is_file()


def ensure_variants(model_dir: Path, spec: AutoBuildSpec | None = None) -> AutoVariants:
    """The cache entry of ``model_dir``, built now when there is none (minutes, with progress
    bars on stderr). Raises MorphConfigError (one line) for a model the builder cannot handle or
    a cache it cannot write."""
    from sglang_morph.engines.build import BuildError, plan_build
    from sglang_morph.models import build_once

    model_dir = Path(model_dir).expanduser()
    spec = spec or default_spec()
    try:
        # Every input check (architecture, biases, layer layout, calibration text) before any
        # weights load. The plan's default output directory is only checked, never written:
        # each build gets its own (below).
        plan = plan_build(model_dir, spec.recipe)
        entry = entry_dir(model_dir, spec, plan.calibration_sha256)
    except (BuildError, OSError) as e:
        raise MorphConfigError(f"--enable-morph: cannot build W8/W4 variants of {model_dir}: "
                               f"{e}; give prebuilt ones with --morph-engines DIR") from e
    if is_complete(entry):
        return AutoVariants(entry, built=False)
    built = []

    def build_entry(partial_dir: Path) -> None:
        _build_entry(plan, spec, partial_dir, entry)
        built.append(True)

    def on_wait() -> None:
        print(f"sglang-morph: another process is building {entry}; waiting for it",
              file=sys.stderr, flush=True)

    try:
        build_once(entry, is_complete, build_entry, on_wait=on_wait)
    except BuildError as e:
        raise MorphConfigError(f"--enable-morph: cannot build W8/W4 variants of {model_dir}: "
                               f"{e}; give prebuilt ones with --morph-engines DIR") from e
    except OSError as e:
        raise MorphConfigError(
            f"--enable-morph: cannot write the variants cache {entry.parent}: "
            f"{e.strerror or e}; set SGLANG_MORPH_CACHE_DIR to a writable directory or give "
            f"prebuilt variants with --morph-engines DIR") from e
    return AutoVariants(entry, built=bool(built))


def _build_entry(plan, spec: AutoBuildSpec, partial_dir: Path, entry: Path) -> None:
    """Variants, then the layer order from them, into ``partial_dir`` (renamed to ``entry``
    by the caller once both are written)."""
    from tqdm.auto import tqdm

    from sglang_morph.engines.build import BuildError, build
    from sglang_morph.morph import profile_layers
    from sglang_morph.repo_data import WIKITEXT2_TRAIN_HEAD

    started_s = time.monotonic()
    print(f"sglang-morph: --enable-morph without --morph-engines: building the W8/W4 variants "
          f"and the layer order of {plan.model_path} into {entry} (first use only; later "
          f"starts reuse it)", file=sys.stderr, flush=True)
    engines = partial_dir / ENGINES_DIR
    with tqdm(total=2, desc="sglang-morph: first-use build", unit="stage",
              file=sys.stderr) as stages:
        stages.set_postfix_str("W8/W4 variants")
        # Libraries print while loading; a launcher's stdout is not the place for it.
        with contextlib.redirect_stdout(sys.stderr):
            build(dataclasses.replace(plan, out_dir=engines, force=False))
        (partial_dir / f"{ENGINES_DIR}.lock").unlink(missing_ok=True)
        stages.update()
        stages.set_postfix_str("layer order")
        config = profile_layers.ProfileConfig(
            model_path=plan.model_path, engines_dir=engines, bits=spec.profile_bits,
            calibration_text_path=WIKITEXT2_TRAIN_HEAD, num_samples=spec.profile_samples,
            tokens_per_sample=spec.profile_tokens_per_sample, seed=spec.profile_seed,
            out_json=partial_dir / SWAP_ORDER_FILE)
        try:
            manifest, calibration_ids = profile_layers.prepare(config)
        except (FileNotFoundError, ValueError) as e:
            raise BuildError(f"layer order: {e}") from e
        with contextlib.redirect_stdout(sys.stderr):
            report = profile_layers.run(config, manifest, calibration_ids)
        # The report names where its engines live once the entry is in place.
        report["engines"] = str(entry / ENGINES_DIR)
        config.out_json.write_text(json.dumps(report, indent=1) + "\n")
        stages.update()
    print(f"sglang-morph: built {entry} in {time.monotonic() - started_s:.1f} s",
          file=sys.stderr, flush=True)


__all__ = ["AutoBuildSpec", "AutoVariants", "default_spec", "ensure_variants", "entry_dir",
           "is_complete", "model_key"]
