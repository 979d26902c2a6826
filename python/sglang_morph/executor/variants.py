"""Installing per-layer precision variants on a served SGLang model (Llama family, TP 1).

SGLang's linear layers call ``self.quant_method.apply(self, x, bias)`` on every forward, so a
layer changes precision between two batches by getting a new ``quant_method`` whose kernel reads
the variant's tensors. The built variants use HF linear names; SGLang fuses q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` (output rows concatenated in that order), so the
variant tensors are concatenated the same way. AWQ gives the linears that share an input one
shared ``input_scale``, which is what lets them be fused.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import morph_kernels
import torch

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.engines.manifest import EngineManifest, read_variant

logger = logging.getLogger("sglang_morph")

# SGLang fused linear (attribute path in a decoder layer) -> the HF linears it concatenates.
FUSED_LINEARS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# Tensors concatenated along the output dimension when fusing; input_scale must be shared.
_PER_OUTPUT_ROW = ("qweight", "scales", "zeros")


class MorphQuantLinearMethod:
    """An SGLang linear method that runs a weight-only quantized kernel on prepared tensors."""

    def __init__(self, prepared: Any):
        self.prepared = prepared

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return morph_kernels.linear(x, self.prepared, bias)


def fuse_stored(stored_by_linear: dict[str, dict[str, torch.Tensor]], parts: tuple[str, ...]):
    """Concatenate the stored variant tensors of ``parts`` into one fused linear's tensors."""
    first = stored_by_linear[parts[0]]
    fused = {
        name: torch.cat([stored_by_linear[p][name] for p in parts], dim=0)
        for name in first
        if name in _PER_OUTPUT_ROW
    }
    if "input_scale" in first:
        for p in parts[1:]:
            if not torch.equal(stored_by_linear[p]["input_scale"], first["input_scale"]):
                raise ValueError(
                    f"{p} and {parts[0]} have different AWQ input scales; they share an input in "
                    f"SGLang's fused linear, so the engines must be rebuilt with shared scales"
                )
        fused["input_scale"] = first["input_scale"]
    return fused


def load_layer_variant(engines_dir: Path, manifest: EngineManifest, layer_index: int, bits: int):
    """The stored tensors of one layer's variant, grouped per SGLang fused linear."""
    by_linear = read_variant(engines_dir, manifest.variant(layer_index, bits))
    return {fused: fuse_stored(by_linear, parts) for fused, parts in FUSED_LINEARS.items()}


def _submodule(layer: torch.nn.Module, path: str) -> torch.nn.Module:
    module = layer
    for part in path.split("."):
        module = getattr(module, part)
    return module


@dataclasses.dataclass(frozen=True)
class LayerTransition:
    layer_index: int
    from_bits: int
    to_bits: int
    device_bytes_before: int
    device_bytes_after: int
    duration_s: float


@dataclasses.dataclass
class _FullPrecision:
    """What a layer's linears had before a variant was installed: enough to restore exactly."""

    weights: dict[str, torch.Tensor]  # host copies of the full-precision weights
    quant_methods: dict[str, Any]
    dual_gemm_modes: dict[str, Any]


class LayerVariantInstaller:
    """Sets decoder layers of an SGLang model to a precision from an engines directory.

    Invariant (``check_integrity``): a layer at 16 bits runs its original ``quant_method`` on
    its full-precision weights; a layer at b < 16 bits runs ``MorphQuantLinearMethod`` with
    b-bit prepared tensors on all four fused linears, and its full-precision weights are kept
    in host memory (not on the device) so that the transition back is exact.
    """

    def __init__(self, model: torch.nn.Module, manifest: EngineManifest, engines_dir: Path,
                 act_dtype: torch.dtype):
        self.layers = list(model.model.layers)
        if len(self.layers) != manifest.num_layers:
            raise ValueError(
                f"engines have {manifest.num_layers} layers, the model has {len(self.layers)}"
            )
        for path in FUSED_LINEARS:
            linear = _submodule(self.layers[0], path)
            if getattr(linear, "tp_size", 1) != 1:
                raise ValueError("sglang-morph layer variants support tensor parallel size 1 only")
        self.manifest = manifest
        self.engines_dir = Path(engines_dir)
        self.act_dtype = act_dtype
        self._bits = [FULL_PRECISION_BITS] * len(self.layers)
        self._full_precision: dict[int, _FullPrecision] = {}

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(self._bits)

    def layer_device_bytes(self, layer_index: int) -> int:
        """Exact bytes the layer's four fused linears occupy on the device right now."""
        total = 0
        for path in FUSED_LINEARS:
            linear = _submodule(self.layers[layer_index], path)
            method = linear.quant_method
            if isinstance(method, MorphQuantLinearMethod):
                total += method.prepared.device_bytes
            else:
                total += linear.weight.numel() * linear.weight.element_size()
        return total

    def full_precision_bytes(self, layer_index: int) -> int:
        """Exact bytes the layer's four fused linears occupy at full precision (in the served
        dtype, which may differ from the dtype the engines were built for)."""
        saved = self._full_precision.get(layer_index)
        if saved is None:
            return self.layer_device_bytes(layer_index)
        return sum(w.numel() * w.element_size() for w in saved.weights.values())

    def set_layer_bits(self, layer_index: int, bits: int) -> LayerTransition:
        """Move one layer to ``bits`` (16 restores full precision). Between batches only."""
        started = time.perf_counter()
        from_bits = self._bits[layer_index]
        before = self.layer_device_bytes(layer_index)
        if bits != FULL_PRECISION_BITS:
            self.manifest.variant(layer_index, bits)  # clear error for a missing variant
        if bits == from_bits:
            return LayerTransition(layer_index, from_bits, bits, before, before, 0.0)
        layer = self.layers[layer_index]
        if from_bits != FULL_PRECISION_BITS:
            self._restore_full_precision(layer_index)
        if bits != FULL_PRECISION_BITS:
            stored = load_layer_variant(self.engines_dir, self.manifest, layer_index, bits)
            saved = _FullPrecision({}, {}, {})
            for path, tensors in stored.items():
                linear = _submodule(layer, path)
                device = linear.weight.device
                prepared = morph_kernels.prepare(bits, tensors, device=device,
                                                 act_dtype=self.act_dtype)
                if (prepared.out_features, prepared.in_features) != tuple(linear.weight.shape):
                    raise ValueError(
                        f"layer {layer_index} {path}: variant is {prepared.out_features}x"
                        f"{prepared.in_features}, the model's weight is {tuple(linear.weight.shape)}"
                    )
                saved.weights[path] = linear.weight.data.to("cpu")
                saved.quant_methods[path] = linear.quant_method
                linear.quant_method = MorphQuantLinearMethod(prepared)
                # An empty weight: any code path that bypasses quant_method fails loudly.
                linear.weight.data = torch.empty(0, dtype=linear.weight.dtype, device=device)
            mlp = layer.mlp
            if getattr(mlp, "dual_gemm", None) is not None:
                # CUDA's fused gate_up+SwiGLU GEMM reads gate_up_proj.weight directly.
                saved.dual_gemm_modes["mlp"] = mlp.dual_gemm.mode
                mlp.dual_gemm.mode = None
            self._full_precision[layer_index] = saved
        self._bits[layer_index] = bits
        return LayerTransition(layer_index, from_bits, bits, before,
                               self.layer_device_bytes(layer_index),
                               time.perf_counter() - started)

    def _restore_full_precision(self, layer_index: int) -> None:
        saved = self._full_precision.pop(layer_index)
        layer = self.layers[layer_index]
        for path, weight in saved.weights.items():
            linear = _submodule(layer, path)
            linear.weight.data = weight.to(linear.weight.device)
            linear.quant_method = saved.quant_methods[path]
        if "mlp" in saved.dual_gemm_modes:
            layer.mlp.dual_gemm.mode = saved.dual_gemm_modes["mlp"]
        self._bits[layer_index] = FULL_PRECISION_BITS

    def warmup(self, max_tokens: int) -> int:
        """Run every installed kernel at serving shapes; returns how many were warmed."""
        warmed = 0
        for layer in self.layers:
            for path in FUSED_LINEARS:
                method = _submodule(layer, path).quant_method
                if isinstance(method, MorphQuantLinearMethod):
                    morph_kernels.warmup(method.prepared, max_tokens=max_tokens)
                    warmed += 1
        return warmed

    def check_integrity(self) -> None:
        for i, layer in enumerate(self.layers):
            for path in FUSED_LINEARS:
                linear = _submodule(layer, path)
                quantized = isinstance(linear.quant_method, MorphQuantLinearMethod)
                if quantized != (self._bits[i] != FULL_PRECISION_BITS):
                    raise AssertionError(f"layer {i} {path}: method does not match {self._bits[i]} bits")
                if quantized and linear.quant_method.prepared.bits != self._bits[i]:
                    raise AssertionError(f"layer {i} {path}: prepared bits differ from {self._bits[i]}")
                if not quantized and linear.weight.numel() == 0:
                    raise AssertionError(f"layer {i} {path}: full precision without a weight")
