"""Memory model of a pipeline stage: weights (exact), KV cache, activation peak, static tensors.

``MemoryModel`` answers "how many bytes does stage j hold" for a contiguous range of layers at
given bit-widths and a workload:

- weights: per layer and bit-width, exact bytes (``ModelSpec.layer_linear_bytes`` in the
  serving layout, or the engines manifest's ``device_bytes`` for the stored layout) plus the
  layer's norms; the embedding on the first stage, LM head and final norm on the last, the
  rotary table everywhere (``ModelSpec.stage_static_bytes``);
- KV: ``Workload.kv_tokens`` (every request's prompt + output, rounded up to pages) x KV bytes
  per token of each layer the stage holds;
- activations: the peak transient of one prefill micro-batch inside a layer (the MLP's fused
  gate/up output, the attention scores if the backend materializes them) and, on the last
  stage, the logits of the micro-batch's last tokens. This is an estimate, kept apart from the
  exact terms: SGLang's ``--morph-memory-budget`` accounts weights + KV only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.models.spec import ModelSpec
from sglang_morph.models.workload import Workload

_FP32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class StageMemory:
    weight_bytes: int
    kv_bytes: int
    activation_bytes: int

    @property
    def budget_bytes(self) -> int:
        """What ``--morph-memory-budget`` of this stage must hold: weights + KV."""
        return self.weight_bytes + self.kv_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Invariant: ``layer_bytes[l][bits]`` is the exact linear bytes of layer ``l`` at ``bits``
    for every layer and every bit-width in ``bits_available``."""

    model: ModelSpec
    layer_bytes: tuple[dict[int, int], ...]
    layout: str

    @classmethod
    def from_spec(cls, model: ModelSpec, bits: Sequence[int] = (16, 8, 4),
                  layout: str = "stored") -> "MemoryModel":
        per_bits = {b: model.layer_linear_bytes(b, layout) for b in bits}
        return cls(model, tuple(dict(per_bits) for _ in range(model.num_layers)), layout)

    @classmethod
    def from_manifest(cls, model: ModelSpec, manifest) -> "MemoryModel":
        """Stored bytes as the engines manifest lists them (what GPU kernels hold)."""
        if manifest.num_layers != model.num_layers:
            raise ValueError(f"manifest has {manifest.num_layers} layers, model {model.num_layers}")
        layers = tuple({bits: v.device_bytes for bits, v in layer.items()}
                       for layer in manifest.layers)
        return cls(model, layers, "stored")

    @property
    def bits_available(self) -> tuple[int, ...]:
        return tuple(sorted(self.layer_bytes[0], reverse=True))

    def layer_weight_bytes(self, layer: int, bits: int) -> int:
        if bits not in self.layer_bytes[layer]:
            raise ValueError(f"no {bits}-bit variant of layer {layer}; have {self.bits_available}")
        return self.layer_bytes[layer][bits] + self.model.norm_bytes_per_layer

    def kv_bytes_per_layer(self, workload: Workload) -> int:
        return workload.kv_tokens * self.model.kv_bytes_per_token_per_layer()

    def activation_peak_bytes(self, workload: Workload, last: bool,
                              materialized_scores: bool = True) -> int:
        m = self.model
        tokens = workload.prefill_micro_batch * workload.prompt_tokens
        act = m.dtype_bytes
        # residual, normed input, qkv, attention output, fused gate/up and its activation
        q_kv = (m.num_attention_heads + 2 * m.num_kv_heads) * m.head_dim
        layer_peak = tokens * (3 * m.hidden_size + q_kv + 3 * m.intermediate_size) * act
        if materialized_scores:  # one request's [heads, s, s] scores in fp32 at a time
            layer_peak += m.num_attention_heads * workload.prompt_tokens ** 2 * _FP32_BYTES
        logits = workload.prefill_micro_batch * m.vocab_size * _FP32_BYTES if last else 0
        return layer_peak + logits

    def stage_memory(self, layers: Sequence[int], bits: Sequence[int], workload: Workload,
                     first: bool, last: bool) -> StageMemory:
        if len(layers) != len(bits):
            raise ValueError("one bit-width per layer")
        weights = sum(self.layer_weight_bytes(l, b) for l, b in zip(layers, bits))
        weights += self.model.stage_static_bytes(first, last)
        return StageMemory(weights, len(layers) * self.kv_bytes_per_layer(workload),
                           self.activation_peak_bytes(workload, last))

    def model_weight_bytes(self, bits_per_layer: Sequence[int]) -> int:
        """Weights of the whole model on one stage (no pipeline)."""
        return self.stage_memory(range(len(bits_per_layer)), bits_per_layer,
                                 Workload(1, 1, 1), True, True).weight_bytes

    def kv_capacity_tokens(self, budget_bytes: int, weight_bytes: int, num_layers: int,
                           page_size: int = 1) -> int:
        """KV tokens a budget leaves after ``weight_bytes`` for a stage of ``num_layers``
        layers, whole pages only (how the morph runtime sizes its pool)."""
        per_token = num_layers * self.model.kv_bytes_per_token_per_layer()
        tokens = max(budget_bytes - weight_bytes, 0) // per_token
        return tokens // page_size * page_size


def full_precision_layers(num_layers: int) -> tuple[int, ...]:
    return (FULL_PRECISION_BITS,) * num_layers
