"""Fingerprints: the served model truncated to its first ``n`` decoder layers.

A fingerprint is a real checkpoint SGLang serves like any other: the full model's safetensors
with the tensors of layers ``n..`` left out and ``num_hidden_layers`` set to ``n`` in
``config.json`` (tokenizer, chat template and generation config copied as they are). Its layers
are the full model's first ``n`` layers, bit for bit, so per-layer costs measured on it are the
full model's.

Next to it lives an engines directory restricted to those layers: the full build's manifest with
``layers[:n]`` and the model identity of the fingerprint, and the very variant files of the full
build, hard-linked (copied where the cache is on another file system). ``--enable-morph
--morph-engines <it> --morph-precision-map '*:8'`` then serves a W8 (or W4) fingerprint without
building anything, and the variants are the ones the full model would serve (same sha256).
Hard links, not symlinks: a rebuild of the full engines replaces its files by renaming, so a
fingerprint keeps the variants its manifest's checksums describe.

Layout (``<cache>/fingerprints/<model>-<engines>-<n>l/``), written into a partial directory and
renamed into place (a ``fingerprint.json`` inside marks a complete one)::

    model/    config.json (num_hidden_layers = n), model.safetensors, tokenizer files
    engines/  manifest.json, layer_000.w8.safetensors -> hard link, ...
    fingerprint.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from sglang_morph.engines.manifest import MANIFEST_FILE, EngineManifest, sha256_of_file
from sglang_morph.models import build_once, cache_dir

WEIGHTS_FILE = "model.safetensors"
MARKER_FILE = "fingerprint.json"
# The tensors of decoder layer i in an HF Llama-style checkpoint.
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A truncated checkpoint and its restricted engines directory.

    Invariant: ``model_dir/config.json`` says ``num_layers`` layers, the checkpoint holds exactly
    the tensors of layers ``0..num_layers-1`` plus the non-layer tensors, and (when
    ``engines_dir`` is set) its manifest lists ``num_layers`` layers whose variant files have the
    full build's checksums.
    """

    num_layers: int
    model_dir: Path
    engines_dir: Path | None
    source_model_dir: Path
    source_engines_dir: Path | None

    def check_integrity(self, verify_checksums: bool = False) -> None:
        config = json.loads((self.model_dir / "config.json").read_text())
        if config["num_hidden_layers"] != self.num_layers:
            raise ValueError(f"{self.model_dir}: config says {config['num_hidden_layers']} "
                             f"layers, the fingerprint {self.num_layers}")
        held = sorted(layer_indices(_tensor_names(self.model_dir)))
        if held != list(range(self.num_layers)):
            raise ValueError(f"{self.model_dir}: checkpoint holds layers {held}")
        if self.engines_dir is None:
            return
        manifest = EngineManifest.load(self.engines_dir)
        manifest.check_matches_model(config)
        manifest.check_integrity(self.engines_dir, verify_checksums=verify_checksums)
        if self.source_engines_dir is not None:
            full = EngineManifest.load(self.source_engines_dir)
            for i, layer in enumerate(manifest.layers):
                if layer != full.layers[i]:
                    raise ValueError(f"layer {i}'s variants differ from {self.source_engines_dir}")


def layer_indices(names) -> set[int]:
    return {int(m.group(1)) for n in names if (m := _LAYER_TENSOR.match(n))}


def _tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.extend(f.keys())
    return names


def fingerprint_root(model_dir: Path, engines_dir: Path | None, num_layers: int) -> Path:
    # Named after both sources: a fingerprint of another model or another engines build is
    # another directory, never a stale one.
    tag = hashlib.sha256(f"{Path(model_dir).resolve()}|"
                         f"{Path(engines_dir).resolve() if engines_dir else ''}".encode()
                         ).hexdigest()[:8]
    # An engines directory is named after its model already.
    name = Path(engines_dir).name if engines_dir else Path(model_dir).name
    return cache_dir() / "fingerprints" / f"{name}-{tag}-{num_layers}l"


def make_fingerprint(model_dir: Path, engines_dir: Path | None, num_layers: int) -> Fingerprint:
    """The fingerprint of ``model_dir``'s first ``num_layers`` layers, built on first use
    (``models.build_once``: atomic, locked)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers < total:
        raise ValueError(f"a fingerprint keeps 1..{total - 1} of the model's {total} layers, "
                         f"not {num_layers}")
    if engines_dir is not None:
        manifest = EngineManifest.load(Path(engines_dir))
        manifest.check_matches_model(config)
    root = fingerprint_root(model_dir, engines_dir, num_layers)
    fp = Fingerprint(num_layers, root / "model",
                     root / "engines" if engines_dir is not None else None,
                     model_dir, Path(engines_dir) if engines_dir is not None else None)

    def build(partial: Path) -> None:
        (partial / "model").mkdir()
        _write_model(model_dir, config, num_layers, partial / "model")
        if engines_dir is not None:
            _write_engines(Path(engines_dir), partial / "engines", partial / "model",
                           num_layers)
        (partial / MARKER_FILE).write_text(json.dumps(
            {"num_layers": num_layers, "source_model_dir": str(model_dir),
             "source_engines_dir": str(engines_dir) if engines_dir else None}, indent=1))

    build_once(root, lambda d: (d / MARKER_FILE).is_file(), build)
    fp.check_integrity()
    return fp


def _write_model(model_dir: Path, config: dict[str, Any], num_layers: int, out: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                m = _LAYER_TENSOR.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    for item in model_dir.iterdir():
        # Everything but the weights (and a sharded checkpoint's index, which would name the
        # left-out tensors): tokenizer, chat template, generation config.
        if item.is_file() and not item.name.endswith(".safetensors") \
                and item.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers},
                                                indent=2) + "\n")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def _write_engines(engines_dir: Path, out: Path, fp_model_dir: Path, num_layers: int) -> None:
    full = EngineManifest.load(engines_dir)
    # Check the files we link now: a damaged full build must not become a fingerprint.
    full.check_integrity(engines_dir, verify_checksums=True)
    out.mkdir()
    layers = full.layers[:num_layers]
    for layer in layers:
        for info in layer.values():
            if info.file is not None:
                _link_or_copy(engines_dir / info.file, out / info.file)
    model = {**full.model, "num_hidden_layers": num_layers, "path": str(fp_model_dir),
             "weights_sha256": sha256_of_file(fp_model_dir / WEIGHTS_FILE)}
    EngineManifest(model, full.calibration, full.recipe, layers).save(out)
    # Kept for the reader: which build these variants came from.
    (out / "fingerprint_of.json").write_text(json.dumps(
        {"engines_dir": str(engines_dir), "layers": list(range(num_layers)),
         "manifest": MANIFEST_FILE}, indent=1))
