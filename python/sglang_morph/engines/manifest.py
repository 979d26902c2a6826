"""The manifest of a built engines directory: which variants exist, their exact device bytes.

Layout of an engines directory (built by ``python -m sglang_morph.morph.build_engines``)::

    manifest.json
    layer_000.w8.safetensors      # tensors "<linear>.<tensor>", e.g. "self_attn.q_proj.qweight"
    layer_000.w4.safetensors
    ...

Linears use the HF module names of a Llama-style decoder layer (``LINEAR_NAMES``); the SGLang
installer maps them onto SGLang's fused ``qkv_proj`` and ``gate_up_proj``. Full precision is not
stored: it is the model's own checkpoint. ``device_bytes`` of a variant is the sum of its stored
tensors' bytes (they are installed as stored); for bits 16 it is the full-precision bytes of the
same linears in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Model config keys that must match between the manifest and the served model.
MODEL_IDENTITY_KEYS = (
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def variant_file_name(layer_index: int, bits: int) -> str:
    return f"layer_{layer_index:03d}.w{bits}.safetensors"


def sha256_of_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def read_variant(engines_dir: Path, info: "VariantInfo") -> dict[str, dict[str, Any]]:
    """A built variant's tensors per linear name (the inverse of the ``<linear>.<tensor>`` names).

    Raises ValueError when the file lacks one of ``LINEAR_NAMES``.
    """
    from safetensors.torch import load_file

    return split_variant_tensors(load_file(str(Path(engines_dir) / info.file)), info.file)


def read_verified_variant(engines_dir: Path, info: "VariantInfo") -> dict[str, dict[str, Any]]:
    """Like ``read_variant``, from bytes whose sha256 was checked against the manifest: the
    tensors are parsed from the very bytes that were hashed, so a file replaced between the
    check and the read cannot slip through. ValueError naming the file on a mismatch."""
    from safetensors.torch import load

    data = (Path(engines_dir) / info.file).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ValueError(f"{info.file}: sha256 {digest} does not match the manifest's "
                         f"{info.sha256}; rebuild the engines")
    return split_variant_tensors(load(data), info.file)


def split_variant_tensors(flat: dict[str, Any], file_name: str) -> dict[str, dict[str, Any]]:
    """``{"<linear>.<tensor>": t}`` -> ``{linear: {tensor: t}}`` for every one of LINEAR_NAMES."""
    out: dict[str, dict[str, Any]] = {name: {} for name in LINEAR_NAMES}
    for key, tensor in flat.items():
        linear, tensor_name = key.rsplit(".", 1)
        if linear not in out:
            raise ValueError(f"{file_name}: unexpected tensor {key!r}")
        out[linear][tensor_name] = tensor
    missing = [name for name, tensors in out.items() if not tensors]
    if missing:
        raise ValueError(f"{file_name} has no tensors for {', '.join(missing)}")
    return out


def model_identity(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The subset of an HF ``config.json`` that says which model a manifest was built for."""
    return {k: hf_config.get(k) for k in MODEL_IDENTITY_KEYS}


@dataclasses.dataclass(frozen=True)
class VariantInfo:
    bits: int
    format: str  # "fp" for bits 16, else a formats.FORMATS name
    device_bytes: int
    file: str | None = None  # None for full precision
    sha256: str | None = None
    group_sizes: dict[str, int] | None = None  # W4 only: linear name -> group size
    awq: bool = False


@dataclasses.dataclass(frozen=True)
class EngineManifest:
    """Invariant: every layer ``0..num_hidden_layers-1`` has a bits-16 entry and the same set of

    quantized bit-widths; every quantized variant names an existing file with its checksum.
    """

    model: dict[str, Any]  # model_identity(...) plus "path" and "weights_sha256"
    calibration: dict[str, Any]
    recipe: dict[str, Any]
    layers: tuple[dict[int, VariantInfo], ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bits_available(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers[0])) if self.layers else ()

    def variant(self, layer_index: int, bits: int) -> VariantInfo:
        if not 0 <= layer_index < self.num_layers:
            raise ValueError(f"layer {layer_index} out of range 0..{self.num_layers - 1}")
        if bits not in self.layers[layer_index]:
            raise ValueError(
                f"no {bits}-bit variant of layer {layer_index}; built: {self.bits_available}"
            )
        return self.layers[layer_index][bits]

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "model": self.model,
            "calibration": self.calibration,
            "recipe": self.recipe,
            "layers": [
                {str(bits): dataclasses.asdict(v) for bits, v in sorted(layer.items())}
                for layer in self.layers
            ],
        }

    def save(self, engines_dir: Path) -> Path:
        path = Path(engines_dir) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        return path

    @classmethod
    def load(cls, engines_dir: Path) -> "EngineManifest":
        engines_dir = Path(engines_dir)
        path = engines_dir / MANIFEST_FILE
        if not engines_dir.is_dir():
            raise FileNotFoundError(f"engines directory {engines_dir} does not exist")
        if not path.is_file():
            raise FileNotFoundError(
                f"{engines_dir} has no {MANIFEST_FILE}; build it with "
                f"python -m sglang_morph.morph.build_engines --model-path M --out {engines_dir}"
            )
        raw = json.loads(path.read_text())
        if raw.get("manifest_version") != MANIFEST_VERSION:
            raise ValueError(
                f"{path}: manifest_version {raw.get('manifest_version')} is not "
                f"{MANIFEST_VERSION}; rebuild the engines"
            )
        layers = tuple(
            {int(bits): VariantInfo(**v) for bits, v in layer.items()} for layer in raw["layers"]
        )
        manifest = cls(raw["model"], raw["calibration"], raw["recipe"], layers)
        manifest.check_integrity(engines_dir)
        return manifest

    def check_integrity(self, engines_dir: Path, verify_checksums: bool = False) -> None:
        """Raise ValueError when the invariant does not hold (checksums only when asked)."""
        if not self.layers:
            raise ValueError("manifest lists no layers")
        if self.model.get("num_hidden_layers") != self.num_layers:
            raise ValueError(
                f"manifest lists {self.num_layers} layers for a model with "
                f"{self.model.get('num_hidden_layers')}"
            )
        expected_bits = set(self.layers[0])
        for i, layer in enumerate(self.layers):
            if 16 not in layer or set(layer) != expected_bits:
                raise ValueError(f"layer {i} has variants {sorted(layer)}, expected "
                                 f"{sorted(expected_bits)} including 16")
            for bits, v in layer.items():
                if bits == 16:
                    continue
                if v.file is None or not (Path(engines_dir) / v.file).is_file():
                    raise ValueError(f"layer {i} {bits}-bit variant file {v.file} is missing")
                if verify_checksums and sha256_of_file(Path(engines_dir) / v.file) != v.sha256:
                    raise ValueError(f"layer {i} {bits}-bit variant {v.file}: sha256 differs "
                                     f"from the manifest's (corrupted or replaced); rebuild "
                                     f"the engines")

    def check_matches_model(self, hf_config: dict[str, Any]) -> None:
        """Raise ValueError naming the first difference when built for another model."""
        served = model_identity(hf_config)
        for key in MODEL_IDENTITY_KEYS:
            if self.model.get(key) != served[key]:
                raise ValueError(
                    f"engines were built for a model with {key}={self.model.get(key)!r}, the "
                    f"served model has {key}={served[key]!r} (built from {self.model.get('path')})"
                )
