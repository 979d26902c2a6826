"""Installing per-layer precision variants on a served SGLang model (Llama family).

SGLang's linear layers call ``self.quant_method.apply(self, x, bias)`` on every forward, so a
layer changes precision between two batches by getting a new ``quant_method`` whose kernel reads
the variant's tensors. The built variants use HF linear names; SGLang fuses q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` (output rows concatenated in that order), so the
variant tensors are concatenated the same way. AWQ gives the linears that share an input one
shared ``input_scale``, which is what lets them be fused.

Two objects, both rebuildable per rank (a tensor- or pipeline-parallel runtime makes one of
each per rank, over that rank's layers):

- ``StagedVariants``: every built variant, read once at startup into host memory (pinned when
  serving on CUDA) and checked against the manifest's sha256. Transitions read only this, never
  the engines directory.
- ``LayerVariantInstaller``: moves layers between precisions in two phases. ``prepare`` builds
  every tensor of every layer of a move (kernel layout, shape checks, host copies of the
  full-precision weights) and changes nothing; ``apply`` then only swaps references, and on any
  failure puts back every reference it already swapped. ``revert`` undoes an applied move, for
  a later step of the same transition that failed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import morph_kernels
import torch

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.engines.manifest import EngineManifest, read_verified_variant
from sglang_morph.faults import FaultInjector

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

Tensors = dict[str, torch.Tensor]


class MorphQuantLinearMethod:
    """An SGLang linear method that runs a weight-only quantized kernel on prepared tensors."""

    def __init__(self, prepared: Any):
        self.prepared = prepared

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return morph_kernels.linear(x, self.prepared, bias)


def fuse_stored(stored_by_linear: dict[str, Tensors], parts: tuple[str, ...]) -> Tensors:
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


def _submodule(layer: torch.nn.Module, path: str) -> torch.nn.Module:
    module = layer
    for part in path.split("."):
        module = getattr(module, part)
    return module


class StagedVariants:
    """Every quantized variant of an engines directory, fused per SGLang linear, in host memory.

    Invariant: each staged variant was parsed from bytes whose sha256 equals the manifest's, and
    is never written to afterwards (``prepare`` copies or re-lays it out). ``host_bytes`` is
    exactly the bytes the staged tensors hold.
    """

    def __init__(self, manifest: EngineManifest, engines_dir: Path, *, pin_memory: bool = False,
                 layers: range | None = None,
                 shard: Callable[[int, dict[str, Tensors]], dict[str, Tensors]] | None = None):
        """``shard(layer, tensors per HF linear)``: a tensor-parallel rank's cut of a whole-layer
        variant (``parallel/tensor.py``), applied after the checksum, before fusing."""
        started = time.perf_counter()
        self.manifest = manifest
        self._variants: dict[tuple[int, int], dict[str, Tensors]] = {}
        # A pipeline stage stages the variants of its own layers only.
        for i in layers if layers is not None else range(manifest.num_layers):
            for bits in manifest.bits_available:
                if bits == FULL_PRECISION_BITS:
                    continue
                by_linear = read_verified_variant(engines_dir, manifest.variant(i, bits))
                if shard is not None:
                    by_linear = shard(i, by_linear)
                fused = {path: fuse_stored(by_linear, parts)
                         for path, parts in FUSED_LINEARS.items()}
                if pin_memory:  # host-to-device copies of pinned memory can run asynchronously
                    fused = {path: {n: t.pin_memory() for n, t in tensors.items()}
                             for path, tensors in fused.items()}
                self._variants[(i, bits)] = fused
        self.host_bytes = sum(t.numel() * t.element_size() for fused in self._variants.values()
                              for tensors in fused.values() for t in tensors.values())
        self.pinned = pin_memory
        # (layer, bits) -> fused linear -> tensor -> shape: equal on every tensor-parallel rank
        self.shard_shapes = {key: {path: {n: tuple(t.shape) for n, t in tensors.items()}
                                   for path, tensors in fused.items()}
                             for key, fused in self._variants.items()}
        logger.info("sglang-morph: staged %d layer variants from %s in host memory%s%s: %d "
                    "bytes, sha256 verified, %.2f s", len(self._variants), engines_dir,
                    " (pinned)" if pin_memory else "",
                    " (this tensor-parallel rank's shards)" if shard else "", self.host_bytes,
                    time.perf_counter() - started)

    def get(self, layer_index: int, bits: int) -> dict[str, Tensors]:
        """The fused stored tensors of one layer's variant; ValueError when none was built."""
        self.manifest.variant(layer_index, bits)  # the manifest's error for a missing variant
        return self._variants[(layer_index, bits)]


@dataclasses.dataclass
class _FullPrecision:
    """What a layer's linears had before a variant was installed: enough to restore exactly."""

    weights: dict[str, torch.Tensor]  # host copies of the full-precision weights
    quant_methods: dict[str, Any]
    dual_gemm_mode: Any = None
    has_dual_gemm: bool = False


@dataclasses.dataclass(frozen=True)
class _LinearChange:
    layer_index: int
    path: str
    quant_method: Any
    # The weight to install: an empty tensor when going quantized, the host full-precision copy
    # (copied to the device by ``apply``) when going back, None to leave the weight alone.
    weight: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class PreparedMove:
    """Everything moving ``layers`` to ``bits`` installs, built before anything changed.

    ``device_bytes_before``/``_after`` are the exact bytes the moved layers' linears occupy on
    the device before and after the move (the memory budget moves by their difference).
    """

    layers: tuple[int, ...]
    from_bits: tuple[int, ...]
    bits: int
    changes: tuple[_LinearChange, ...]
    new_full_precision: dict[int, _FullPrecision]
    device_bytes_before: int
    device_bytes_after: int

    @property
    def weight_delta_bytes(self) -> int:
        return self.device_bytes_after - self.device_bytes_before


@dataclasses.dataclass(frozen=True)
class AppliedMove:
    """An applied ``PreparedMove`` and what ``revert`` needs to undo it."""

    move: PreparedMove
    undo: tuple[tuple[Any, str, Any], ...]  # (object, attribute, previous value), in apply order
    previous_bits: dict[int, int]
    previous_full_precision: dict[int, _FullPrecision | None]


def held_layers(model: torch.nn.Module) -> range:
    """The decoder layers this process holds: all of them, or a pipeline stage's
    ``start_layer``..``end_layer - 1`` (SGLang's PPMissingLayer placeholders elsewhere)."""
    inner = model.model
    return range(getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(inner.layers)))


class LayerVariantInstaller:
    """Sets decoder layers of an SGLang model to precisions staged in a ``StagedVariants``.

    Invariant (``check_integrity``): a layer at 16 bits runs its original ``quant_method`` on
    its full-precision weights; a layer at b < 16 bits runs ``MorphQuantLinearMethod`` with
    b-bit prepared tensors on all four fused linears, and its full-precision weights are kept
    in host memory (not on the device) so that the transition back is exact. Between two calls
    every layer is wholly in one of these states: ``apply`` either moves all the layers of a
    move or leaves all of them as they were.
    """

    def __init__(self, model: torch.nn.Module, staged: StagedVariants, act_dtype: torch.dtype,
                 faults: FaultInjector | None = None):
        self.layers = list(model.model.layers)
        manifest = staged.manifest
        if len(self.layers) != manifest.num_layers:
            raise ValueError(
                f"engines have {manifest.num_layers} layers, the model has {len(self.layers)}"
            )
        self.manifest = manifest
        self.staged = staged
        self.act_dtype = act_dtype
        self.faults = faults or FaultInjector()
        self._bits = [FULL_PRECISION_BITS] * len(self.layers)
        self._full_precision: dict[int, _FullPrecision] = {}
        # Under pipeline parallelism the other stages' layers are SGLang's PPMissingLayer
        # placeholders; only the held ones can be moved (the others' bits stay 16 here).
        self.owned = held_layers(model)

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

    def device_bytes_at(self, layer_index: int, bits: int) -> int:
        """Exact bytes the layer's four fused linears would occupy at ``bits`` (what ``prepare``
        counts); changes nothing. A pipeline stage tells the others these at startup."""
        if bits == FULL_PRECISION_BITS:
            return self.full_precision_bytes(layer_index)
        if self._bits[layer_index] == bits:
            return self.layer_device_bytes(layer_index)
        layer = self.layers[layer_index]
        return sum(morph_kernels.prepare(bits, tensors, device=_submodule(layer, path).weight.device,
                                         act_dtype=self.act_dtype).device_bytes
                   for path, tensors in self.staged.get(layer_index, bits).items())

    # ----- two-phase moves -------------------------------------------------------------------

    def prepare(self, layers: list[int] | tuple[int, ...], bits: int) -> PreparedMove:
        """Build everything moving ``layers`` to ``bits`` needs; changes nothing. Layers already
        at ``bits`` are left out of the move. Raises ValueError for a missing variant or a
        variant that does not fit the model; a layer goes up only to full precision."""
        moved = [i for i in layers if self._bits[i] != bits]
        changes: list[_LinearChange] = []
        new_full_precision: dict[int, _FullPrecision] = {}
        before = after = 0
        for i in moved:
            before += self.layer_device_bytes(i)
            if bits == FULL_PRECISION_BITS:
                saved = self._full_precision[i]
                changes += [_LinearChange(i, path, saved.quant_methods[path], saved.weights[path])
                            for path in FUSED_LINEARS]
                after += self.full_precision_bytes(i)
                continue
            if bits > self._bits[i]:
                raise ValueError(f"layer {i} is at {self._bits[i]} bits; a layer goes up only to "
                                 f"full precision ({FULL_PRECISION_BITS} bits)")
            staged = self.staged.get(i, bits)
            saved = self._full_precision.get(i)
            if saved is None:
                saved = new_full_precision[i] = self._save_full_precision(i)
            for path, tensors in staged.items():
                linear = _submodule(self.layers[i], path)
                prepared = morph_kernels.prepare(bits, tensors, device=linear.weight.device,
                                                 act_dtype=self.act_dtype)
                shape = tuple(saved.weights[path].shape)
                if (prepared.out_features, prepared.in_features) != shape:
                    raise ValueError(
                        f"layer {i} {path}: variant is {prepared.out_features}x"
                        f"{prepared.in_features}, the model's weight is {shape}")
                # An empty weight: any code path that bypasses quant_method fails loudly.
                empty = (torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device)
                         if i in new_full_precision else None)
                changes.append(_LinearChange(i, path, MorphQuantLinearMethod(prepared), empty))
                after += prepared.device_bytes
        return PreparedMove(tuple(moved), tuple(self._bits[i] for i in moved), bits,
                            tuple(changes), new_full_precision, before, after)

    def _save_full_precision(self, layer_index: int) -> _FullPrecision:
        layer = self.layers[layer_index]
        saved = _FullPrecision({}, {})
        for path in FUSED_LINEARS:
            linear = _submodule(layer, path)
            saved.weights[path] = linear.weight.data.to("cpu")  # the same tensor on CPU
            saved.quant_methods[path] = linear.quant_method
        dual_gemm = getattr(layer.mlp, "dual_gemm", None)
        if dual_gemm is not None:
            # CUDA's fused gate_up+SwiGLU GEMM reads gate_up_proj.weight directly.
            saved.has_dual_gemm, saved.dual_gemm_mode = True, dual_gemm.mode
        return saved

    def apply(self, move: PreparedMove) -> AppliedMove:
        """Install a prepared move: all its layers, or (on any exception, re-raised) none."""
        undo: list[tuple[Any, str, Any]] = []
        step = "up" if move.bits == FULL_PRECISION_BITS else "down"

        def set_attr(obj: Any, name: str, value: Any) -> None:
            undo.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

        try:
            for k, change in enumerate(move.changes):
                if k == len(move.changes) - 1:
                    self.faults.check(step)
                linear = _submodule(self.layers[change.layer_index], change.path)
                if change.weight is not None:
                    # Back to full precision this is the host-to-device copy (none on CPU).
                    set_attr(linear.weight, "data", change.weight.to(linear.weight.device))
                set_attr(linear, "quant_method", change.quant_method)
            for i in move.layers:
                mlp = self.layers[i].mlp
                if i in move.new_full_precision and move.new_full_precision[i].has_dual_gemm:
                    set_attr(mlp.dual_gemm, "mode", None)
                elif step == "up" and self._full_precision[i].has_dual_gemm:
                    set_attr(mlp.dual_gemm, "mode", self._full_precision[i].dual_gemm_mode)
        except BaseException:
            self._undo(undo)
            raise
        applied = AppliedMove(move, tuple(undo), {i: self._bits[i] for i in move.layers},
                              {i: self._full_precision.get(i) for i in move.layers})
        for i in move.layers:
            self._bits[i] = move.bits
            if step == "up":
                del self._full_precision[i]
            elif i in move.new_full_precision:
                self._full_precision[i] = move.new_full_precision[i]
        return applied

    def revert(self, applied: AppliedMove) -> None:
        """Put the layers of an applied move back exactly as they were before it."""
        self._undo(list(applied.undo))
        for i, bits in applied.previous_bits.items():
            self._bits[i] = bits
            saved = applied.previous_full_precision[i]
            if saved is None:
                self._full_precision.pop(i, None)
            else:
                self._full_precision[i] = saved

    @staticmethod
    def _undo(undo: list[tuple[Any, str, Any]]) -> None:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)

    def set_layers(self, layers: list[int] | tuple[int, ...], bits: int) -> PreparedMove:
        """Prepare and apply in one call (startup, tests); returns the move."""
        move = self.prepare(layers, bits)
        self.apply(move)
        return move

    # ----- checks ----------------------------------------------------------------------------

    def warmup(self, max_tokens: int) -> int:
        """Run every installed kernel at serving shapes; returns how many were warmed."""
        warmed = 0
        for layer in (self.layers[i] for i in self.owned):
            for path in FUSED_LINEARS:
                method = _submodule(layer, path).quant_method
                if isinstance(method, MorphQuantLinearMethod):
                    morph_kernels.warmup(method.prepared, max_tokens=max_tokens)
                    warmed += 1
        return warmed

    def check_integrity(self) -> None:
        for i in self.owned:
            layer = self.layers[i]
            quantized_layer = self._bits[i] != FULL_PRECISION_BITS
            if quantized_layer != (i in self._full_precision):
                raise AssertionError(f"layer {i}: {self._bits[i]} bits, full-precision copy "
                                     f"{'missing' if quantized_layer else 'left behind'}")
            for path in FUSED_LINEARS:
                linear = _submodule(layer, path)
                quantized = isinstance(linear.quant_method, MorphQuantLinearMethod)
                if quantized != quantized_layer:
                    raise AssertionError(f"layer {i} {path}: method does not match {self._bits[i]} bits")
                if quantized and linear.quant_method.prepared.bits != self._bits[i]:
                    raise AssertionError(f"layer {i} {path}: prepared bits differ from {self._bits[i]}")
                if quantized and linear.weight.numel() != 0:
                    raise AssertionError(f"layer {i} {path}: quantized but the full-precision "
                                         f"weight is still on the device")
                if not quantized and linear.weight.numel() == 0:
                    raise AssertionError(f"layer {i} {path}: full precision without a weight")
