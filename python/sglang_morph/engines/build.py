"""Offline builder of the per-layer precision variants ("layer engines") of a Llama-family model.

For every decoder layer and every quantized bit-width of the recipe it writes one safetensors
file with the seven linears in that format (``formats``), and a ``manifest.json`` listing each
variant's exact device bytes and checksum (``manifest``). W8 needs no calibration; W4 uses the
AWQ search (``awq``) on calibration text from the *train* split, or plain round-to-nearest when
the recipe turns AWQ off. Layers are built in order while the calibration hidden states move
through the full-precision model block by block, so one layer's statistics are alive at a time.

The build is written into a sibling temporary directory and renamed into place, so an engines
directory either holds a complete build or does not exist. Bad input raises ``BuildError`` before
any weights are loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from filelock import FileLock
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from sglang_morph.engines import awq, formats
from sglang_morph.engines.manifest import (
    LINEAR_NAMES,
    MANIFEST_FILE,
    EngineManifest,
    VariantInfo,
    model_identity,
    sha256_of_file,
    variant_file_name,
)
from sglang_morph.models import cache_dir
from sglang_morph.repo_data import REPO_ROOT

logger = logging.getLogger(__name__)

DEFAULT_RECIPE_FILE = REPO_ROOT / "trt_engines" / "recipes" / "llama.json"
RECIPE_HASH_CHARS = 10
# Calibration sequences per layer call: bounds the attention activations' memory.
CALIBRATION_BATCH_SEQUENCES = 4
AWQ_REPORT_FILE = "awq_search.json"
# safetensors dtype names -> bytes per element, for the full-precision bytes of the checkpoint.
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


class BuildError(ValueError):
    """The build's input is unusable; the message names the problem (the CLI exits with 2)."""


@dataclasses.dataclass(frozen=True)
class BuildRecipe:
    """How variants are built for one model family (``trt_engines/recipes/*.json``).

    ``w4_group_size`` None is the rule of ``formats.w4_group_size`` (128 where it divides a
    linear's in_features, else 64, else 32), applied per linear; an int forces that group size
    on every linear and must divide all of them.
    """

    name: str
    architectures: tuple[str, ...]  # HF config "architectures" this recipe knows how to walk
    bits: tuple[int, ...]  # quantized bit-widths to build; full precision (16) always exists
    w4_group_size: int | None
    awq: bool
    awq_alpha_grid_size: int
    awq_clip_grid_size: int  # clip ratios 1, 0.95, ... (1 = no clipping search)
    calibration_file: Path  # absolute; recipe files give it relative to the recipe file
    calibration_samples: int
    calibration_tokens_per_sample: int
    seed: int  # picks the calibration windows

    def __post_init__(self) -> None:
        if not self.bits or len(set(self.bits)) != len(self.bits):
            raise BuildError(f"bits must be a non-empty list without repeats, got {self.bits}")
        for bits in self.bits:
            if bits == formats.FULL_PRECISION_BITS:
                raise BuildError(
                    f"bits {bits} is full precision, which is the checkpoint itself and always "
                    f"available; build only quantized bit-widths {sorted(formats.FORMATS)}"
                )
            try:
                formats.get_format(bits)
            except ValueError as error:
                raise BuildError(str(error)) from None
        if self.w4_group_size is not None and self.w4_group_size not in formats.W4_GROUP_SIZES:
            raise BuildError(
                f"W4 group size {self.w4_group_size} is not one of {formats.W4_GROUP_SIZES}"
            )
        for field in (
            "awq_alpha_grid_size", "calibration_samples", "calibration_tokens_per_sample"
        ):
            if getattr(self, field) < 1:
                raise BuildError(f"{field} must be at least 1, got {getattr(self, field)}")
        try:
            awq.clip_ratio_grid(self.awq_clip_grid_size)
        except ValueError as error:
            raise BuildError(f"awq_clip_grid_size: {error}") from None

    @property
    def needs_calibration(self) -> bool:
        return self.awq and 4 in self.bits

    @classmethod
    def load(cls, path: Path) -> "BuildRecipe":
        path = Path(path)
        if not path.is_file():
            raise BuildError(f"recipe file {path} does not exist")
        try:
            raw = json.loads(path.read_text())
        except ValueError as error:
            raise BuildError(f"recipe file {path} is not valid JSON: {error}") from None
        expected = {f.name for f in dataclasses.fields(cls)}
        if set(raw) != expected:
            raise BuildError(
                f"recipe file {path}: fields {sorted(raw)} differ from the expected "
                f"{sorted(expected)}"
            )
        if not isinstance(raw["awq"], bool):
            raise BuildError(f"recipe file {path}: awq must be true or false, got {raw['awq']!r}")
        try:
            return cls(
                name=str(raw["name"]),
                architectures=tuple(raw["architectures"]),
                bits=tuple(int(b) for b in raw["bits"]),
                w4_group_size=parse_group_size(raw["w4_group_size"]),
                awq=raw["awq"],
                awq_alpha_grid_size=int(raw["awq_alpha_grid_size"]),
                awq_clip_grid_size=int(raw["awq_clip_grid_size"]),
                calibration_file=(path.parent / raw["calibration_file"]).resolve(),
                calibration_samples=int(raw["calibration_samples"]),
                calibration_tokens_per_sample=int(raw["calibration_tokens_per_sample"]),
                seed=int(raw["seed"]),
            )
        except BuildError:
            raise
        except (TypeError, ValueError) as error:
            raise BuildError(f"recipe file {path}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``w4_group_size`` "auto" stands for the per-linear rule."""
        out = dataclasses.asdict(self)
        out["architectures"] = list(self.architectures)
        out["bits"] = list(self.bits)
        out["w4_group_size"] = "auto" if self.w4_group_size is None else self.w4_group_size
        out["calibration_file"] = str(self.calibration_file)
        return out

    def short_hash(self, calibration_sha256: str | None) -> str:
        """Names the default output directory. The calibration text enters by content, not by

        path, so the same recipe names the same directory in every checkout.
        """
        key = self.to_dict()
        key["calibration_file"] = calibration_sha256
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return digest[:RECIPE_HASH_CHARS]


def parse_group_size(value: Any) -> int | None:
    if value in ("auto", None):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BuildError(
            f"W4 group size must be 'auto' or one of {formats.W4_GROUP_SIZES}, got {value!r}"
        ) from None


@dataclasses.dataclass(frozen=True)
class CheckpointLinear:
    """One linear weight as the checkpoint stores it."""

    shape: tuple[int, int]  # [out_features, in_features]
    dtype: str  # safetensors dtype name, e.g. "BF16"

    @property
    def bytes(self) -> int:
        return self.shape[0] * self.shape[1] * SAFETENSORS_DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """A validated build: every input checked, nothing loaded yet but headers and configs."""

    model_path: Path
    hf_config: dict[str, Any]
    weight_files: tuple[Path, ...]
    linears: tuple[dict[str, CheckpointLinear], ...]  # per layer, LINEAR_NAMES -> checkpoint info
    w4_group_sizes: dict[str, int]  # linear name -> group size (every layer has the same shapes)
    recipe: BuildRecipe
    calibration_sha256: str | None  # None when the recipe needs no calibration
    out_dir: Path
    force: bool

    @property
    def num_layers(self) -> int:
        return len(self.linears)


def default_out_dir(model_path: Path, recipe: BuildRecipe, calibration_sha256: str | None) -> Path:
    name = f"{Path(model_path).name}-{recipe.short_hash(calibration_sha256)}"
    return cache_dir() / "engines" / name


def plan_build(
    model_path: Path, recipe: BuildRecipe, out_dir: Path | None = None, force: bool = False
) -> BuildPlan:
    """Check every input (model, recipe against it, calibration file, output directory)."""
    model_path = Path(model_path).expanduser()
    if not model_path.is_dir():
        raise BuildError(f"model path {model_path} does not exist or is not a directory")
    config_path = model_path / "config.json"
    if not config_path.is_file():
        raise BuildError(
            f"model path {model_path} has no config.json; expected an HF model directory"
        )
    hf_config = json.loads(config_path.read_text())
    if not isinstance(hf_config.get("num_hidden_layers"), int):
        raise BuildError(f"{config_path} has no num_hidden_layers")
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(recipe.architectures):
        raise BuildError(
            f"{model_path} is a {architectures or hf_config.get('model_type')} model; recipe "
            f"{recipe.name!r} builds {list(recipe.architectures)} (a Llama-family decoder)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf_config.get(flag):
            raise BuildError(f"{model_path} has {flag}=true; the W8/W4 formats carry no bias")
    weight_files = tuple(sorted(model_path.glob("*.safetensors")))
    if not weight_files:
        raise BuildError(f"model path {model_path} has no *.safetensors weights")
    linears = _checkpoint_linears(weight_files, hf_config["num_hidden_layers"])
    w4_group_sizes = {}
    if 4 in recipe.bits:
        for name, linear in linears[0].items():
            try:
                w4_group_sizes[name] = formats.w4_group_size(linear.shape[1], recipe.w4_group_size)
            except ValueError as error:
                raise BuildError(f"{name}: {error}") from None
    calibration_sha256 = None
    if recipe.needs_calibration:
        if not recipe.calibration_file.is_file():
            raise BuildError(f"calibration file {recipe.calibration_file} does not exist")
        calibration_sha256 = sha256_of_file(recipe.calibration_file)
    if out_dir is None:
        out_dir = default_out_dir(model_path, recipe, calibration_sha256)
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).is_file():
        # Even --force does not delete a directory that is not an engines build.
        raise BuildError(f"output {out_dir} is a non-empty directory without {MANIFEST_FILE}")
    return BuildPlan(
        model_path=model_path.absolute(),
        hf_config=hf_config,
        weight_files=weight_files,
        linears=linears,
        w4_group_sizes=w4_group_sizes,
        recipe=recipe,
        calibration_sha256=calibration_sha256,
        out_dir=out_dir,
        force=force,
    )


def _checkpoint_linears(
    weight_files: tuple[Path, ...], num_layers: int
) -> tuple[dict[str, CheckpointLinear], ...]:
    found: dict[str, CheckpointLinear] = {}
    for path in weight_files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight"):
                    tensor = f.get_slice(key)
                    found[key] = CheckpointLinear(tuple(tensor.get_shape()), tensor.get_dtype())
    layers = []
    for i in range(num_layers):
        layer = {}
        for name in LINEAR_NAMES:
            key = f"model.layers.{i}.{name}.weight"
            if key not in found:
                raise BuildError(f"the checkpoint has no {key}; not a Llama-style layout")
            if found[key].dtype not in SAFETENSORS_DTYPE_BYTES:
                raise BuildError(f"{key} is stored as {found[key].dtype}, not a float dtype")
            layer[name] = found[key]
        layers.append(layer)
    if any({n: l.shape for n, l in layer.items()} != {n: l.shape for n, l in layers[0].items()}
           for layer in layers):
        raise BuildError("decoder layers differ in linear shapes; expected a uniform Llama stack")
    return tuple(layers)


# ---- the build ---------------------------------------------------------------------------------


def build(plan: BuildPlan) -> Path:
    """Build (or find already built) the engines of ``plan``; returns the engines directory."""
    plan.out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{plan.out_dir}.lock"):
        model_info = _model_info(plan)
        calibration_info = _calibration_info(plan)
        if (plan.out_dir / MANIFEST_FILE).is_file() and not plan.force:
            differences = _differences_from_existing(plan, model_info, calibration_info)
            if not differences:
                logger.info("%s already holds this build; nothing to do", plan.out_dir)
                return plan.out_dir
            raise BuildError(
                f"{plan.out_dir} holds a different build ({differences}); pass --force to "
                f"replace it or choose another --out"
            )
        # Only the lock holder writes partial directories, so any found now were left by a
        # build that was killed.
        for stale in plan.out_dir.parent.glob(f".{plan.out_dir.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        partial_dir = plan.out_dir.parent / f".{plan.out_dir.name}.partial-{os.getpid()}"
        partial_dir.mkdir()
        try:
            _build_into(plan, partial_dir, model_info, calibration_info)
            _replace_dir(partial_dir, plan.out_dir)
        except BaseException:
            shutil.rmtree(partial_dir, ignore_errors=True)
            raise
    return plan.out_dir


def _replace_dir(new_dir: Path, target: Path) -> None:
    if not target.exists():
        os.rename(new_dir, target)
        return
    # Two renames: the old build stays whole until the new one is in place.
    old_dir = target.parent / f".{target.name}.old-{os.getpid()}"
    os.rename(target, old_dir)
    os.rename(new_dir, target)
    shutil.rmtree(old_dir, ignore_errors=True)


def _model_info(plan: BuildPlan) -> dict[str, Any]:
    if len(plan.weight_files) == 1:
        weights_sha256 = sha256_of_file(plan.weight_files[0])
    else:
        # Sharded checkpoints: one digest over the shards' names and digests.
        weights_sha256 = hashlib.sha256(
            "".join(f"{p.name} {sha256_of_file(p)}\n" for p in plan.weight_files).encode()
        ).hexdigest()
    return {
        **model_identity(plan.hf_config),
        "path": str(plan.model_path),
        "weights_sha256": weights_sha256,
    }


def _calibration_info(plan: BuildPlan) -> dict[str, Any]:
    recipe = plan.recipe
    if not recipe.needs_calibration:
        return {}
    return {
        "file": str(recipe.calibration_file),
        "sha256": plan.calibration_sha256,
        "n_samples": recipe.calibration_samples,
        "tokens_per_sample": recipe.calibration_tokens_per_sample,
        "seed": recipe.seed,
    }


def _build_identity(model: dict, calibration: dict, recipe: dict) -> dict[str, dict]:
    """What makes two builds the same; paths are left out, contents enter by checksum."""
    return {
        "model": {k: v for k, v in model.items() if k != "path"},
        "calibration": {k: v for k, v in calibration.items() if k != "file"},
        "recipe": {k: v for k, v in recipe.items() if k != "calibration_file"},
    }


def _differences_from_existing(plan: BuildPlan, model_info: dict, calibration_info: dict) -> str:
    """Empty when ``plan.out_dir`` already holds this very build, intact; else what differs."""
    try:
        existing = EngineManifest.load(plan.out_dir)
        existing.check_integrity(plan.out_dir, verify_checksums=True)
    except (OSError, ValueError, TypeError, KeyError) as error:
        return f"unreadable or damaged: {error}"
    ours = _build_identity(model_info, calibration_info, plan.recipe.to_dict())
    theirs = _build_identity(existing.model, existing.calibration, existing.recipe)
    differing = [
        f"{part}.{key}: {theirs[part].get(key)!r} there, {ours[part].get(key)!r} here"
        for part in ours
        for key in sorted(set(ours[part]) | set(theirs[part]))
        if ours[part].get(key) != theirs[part].get(key)
    ]
    return "; ".join(differing)


def calibration_windows(plan: BuildPlan, tokenizer) -> torch.Tensor:
    """``[samples, tokens_per_sample]`` token ids: non-overlapping windows of the calibration

    text, drawn at random (seeded) so that they span the whole file, not only its start.
    """
    recipe = plan.recipe
    text = recipe.calibration_file.read_text()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    length = recipe.calibration_tokens_per_sample
    n_windows = ids.numel() // length
    if n_windows < recipe.calibration_samples:
        raise BuildError(
            f"calibration file {recipe.calibration_file} has {ids.numel()} tokens, fewer than "
            f"{recipe.calibration_samples} samples x {length} tokens"
        )
    windows = ids[: n_windows * length].view(n_windows, length)
    generator = torch.Generator().manual_seed(recipe.seed)
    chosen = torch.randperm(n_windows, generator=generator)[: recipe.calibration_samples]
    return windows[chosen.sort().values]


def _build_into(plan: BuildPlan, out_dir: Path, model_info: dict, calibration_info: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started_s = time.monotonic()
    recipe = plan.recipe
    # Libraries print to stdout while loading; the CLI's stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        # float32: the search compares errors far below bf16 resolution.
        model = AutoModelForCausalLM.from_pretrained(
            plan.model_path, dtype=torch.float32, local_files_only=True
        ).eval()
    layers = list(model.model.layers)

    layer_stats: Iterator[dict[str, awq.InputStats] | None] = itertools.repeat(None)
    if recipe.needs_calibration:
        tokenizer = AutoTokenizer.from_pretrained(plan.model_path, local_files_only=True)
        windows = calibration_windows(plan, tokenizer)
        logger.info("Calibration: %d x %d tokens", *windows.shape)
        layer_stats = awq.block_by_block_input_stats(model, windows, CALIBRATION_BATCH_SEQUENCES)

    layer_variants: list[dict[int, VariantInfo]] = []
    awq_report: list[dict[str, Any]] = []
    progress = tqdm(layers, desc="Building layers", unit="layer", file=sys.stderr)
    for i, (layer, stats) in enumerate(zip(progress, layer_stats)):
        weights = {name: layer.get_submodule(name).weight.detach() for name in LINEAR_NAMES}
        variants = {
            formats.FULL_PRECISION_BITS: VariantInfo(
                bits=formats.FULL_PRECISION_BITS,
                format="fp",
                device_bytes=sum(linear.bytes for linear in plan.linears[i].values()),
            )
        }
        for bits in recipe.bits:
            if bits == 4:
                tensors, layer_report = _quantize_layer_w4(plan, weights, stats)
                if layer_report:
                    awq_report.append({"layer": i, "groups": layer_report})
            else:
                fmt = formats.get_format(bits)
                tensors = {name: fmt.quantize(w) for name, w in weights.items()}
            variants[bits] = _write_variant(out_dir, i, bits, tensors, plan)
        layer_variants.append(variants)

    manifest = EngineManifest(
        model=model_info,
        calibration=calibration_info,
        recipe=recipe.to_dict(),
        layers=tuple(layer_variants),
    )
    manifest.save(out_dir)
    manifest.check_integrity(out_dir, verify_checksums=True)
    if awq_report:
        (out_dir / AWQ_REPORT_FILE).write_text(json.dumps(awq_report, indent=1))
    logger.info("Built %d layers x %s bits in %.1f s", len(layers), list(recipe.bits),
                time.monotonic() - started_s)


def _quantize_layer_w4(
    plan: BuildPlan,
    weights: dict[str, torch.Tensor],
    layer_stats: dict[str, awq.InputStats] | None,
) -> tuple[dict[str, formats.Tensors], list[dict[str, Any]]]:
    """W4 tensors of one layer, and per group the AWQ search's outcome (empty without AWQ)."""
    w4 = formats.get_format(4)
    if layer_stats is None:
        rtn = {name: w4.quantize(w, group_size=plan.w4_group_sizes[name])
               for name, w in weights.items()}
        return rtn, []
    tensors: dict[str, formats.Tensors] = {}
    report = []
    for group in awq.INPUT_GROUPS:
        result = awq.search_group(
            {name: weights[name] for name in group.linears},
            layer_stats[group.name],
            plan.w4_group_sizes,
            plan.recipe.awq_alpha_grid_size,
            plan.recipe.awq_clip_grid_size,
        )
        tensors.update(result.quantized)
        report.append({
            "group": group.name,
            "alpha": result.alpha,
            "clipped_linears": list(result.clipped_linears),
            "output_mse": result.output_mse,
            "scaled_output_mse": result.scaled_output_mse,
            "rtn_output_mse": result.rtn_output_mse,
        })
    return tensors, report


def _write_variant(
    out_dir: Path, layer_index: int, bits: int, tensors: dict[str, formats.Tensors], plan: BuildPlan
) -> VariantInfo:
    fmt = formats.get_format(bits)
    flat = {}
    for name in LINEAR_NAMES:
        out_features, in_features = plan.linears[layer_index][name].shape
        fmt.check(tensors[name], out_features, in_features)
        for tensor_name, tensor in tensors[name].items():
            # clone: linears of a group share one input_scale tensor, and safetensors refuses
            # to save tensors that share memory.
            flat[f"{name}.{tensor_name}"] = tensor.clone().contiguous()
    file_name = variant_file_name(layer_index, bits)
    path = out_dir / file_name
    # One metadata key only: safetensors writes several in hash order, which differs between
    # runs and would make identical builds differ in checksum.
    save_file(flat, path, metadata={"format": fmt.name})
    is_awq = any(name.endswith(".input_scale") for name in flat)
    return VariantInfo(
        bits=bits,
        format=fmt.name,
        device_bytes=formats.device_bytes(flat),
        file=file_name,
        sha256=sha256_of_file(path),
        group_sizes=dict(plan.w4_group_sizes) if bits == 4 else None,
        awq=is_awq,
    )
