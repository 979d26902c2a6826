"""What the planner knows about a model: layer shapes and the exact bytes of every variant.

A ``ModelSpec`` is built from an HF ``config.json`` (the served model) or from the published
shapes of a larger model (the simulated clusters). Bytes come from the shapes through the same
rules as ``sglang_morph.engines.formats`` (stored layout) and ``morph_kernels.cpu`` (the CPU
kernels' layout, which pads and re-types some tensors), so they hold for any model size; for a
built engines directory the tests check them against the manifest and the prepared tensors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.engines import formats

# Weight layouts: "stored" = the engines' tensors as stored (what the GPU kernels hold);
# "cpu" = morph_kernels.cpu's layout (bf16/fp16: int4 packs padded to 16 output rows; fp32:
# unpadded; scales in the activation dtype, one input scale per fused linear).
LAYOUTS = ("stored", "cpu")
# SGLang's fused linears of a Llama layer and the HF linears each concatenates.
LLAMA_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_CPU_INT4_OUT_MULTIPLE = 16  # morph_kernels.cpu.INT4PACK_OUT_MULTIPLE
_CPU_INT8_IN_MULTIPLE = 16  # morph_kernels.cpu.INT8PACK_IN_MULTIPLE
_FP32_BYTES = 4
_BF16_BYTES = 2  # formats.SCALE_DTYPE
_UINT8_BYTES = 1
# SGLang's SGLANG_ROPE_CACHE_SAFETY_MARGIN and SGLANG_ROPE_CACHE_ALIGN defaults (environ.py)
_ROPE_MARGIN = 256
_ROPE_ALIGN = 128


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Linear:
    name: str
    out_features: int
    in_features: int


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer with identical layers (Llama-style unless ``gated_mlp`` is off).

    Invariant: every layer has the same linears; ``dtype_bytes`` is the served weight and KV
    dtype (2 for bf16/fp16, 4 for float32).
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype_bytes: int = 2
    gated_mlp: bool = True
    awq_input_scale: bool = True  # W4 variants carry AWQ's per-input-channel scale
    w4_group_size: int | None = None  # None: formats.w4_group_size's rule per linear

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.hidden_size < 1 or self.dtype_bytes not in (2, 4):
            raise ValueError(f"{self.name}: bad model spec {self}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "model", dtype_bytes: int = 2,
                       awq_input_scale: bool = True) -> "ModelSpec":
        heads = config["num_attention_heads"]
        return cls(
            name=name,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            dtype_bytes=dtype_bytes,
            awq_input_scale=awq_input_scale,
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path, dtype_bytes: int = 2) -> "ModelSpec":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_hf_config(config, name=Path(model_dir).name, dtype_bytes=dtype_bytes)

    # ---- shapes -----------------------------------------------------------------------------

    @property
    def linears(self) -> tuple[Linear, ...]:
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = (Linear("q_proj", q, h), Linear("k_proj", kv, h), Linear("v_proj", kv, h),
                     Linear("o_proj", h, q))
        if self.gated_mlp:
            mlp = (Linear("gate_proj", f, h), Linear("up_proj", f, h), Linear("down_proj", h, f))
        else:
            mlp = (Linear("fc1", f, h), Linear("fc2", h, f))
        return attention + mlp

    @property
    def fused_linears(self) -> tuple[tuple[Linear, ...], ...]:
        """Linears grouped as the serving engine fuses them (those sharing one input)."""
        by_name = {linear.name: linear for linear in self.linears}
        if not self.gated_mlp:
            return tuple((linear,) for linear in self.linears)
        return tuple(tuple(by_name[p] for p in parts) for parts in LLAMA_FUSED.values())

    @property
    def linear_params_per_layer(self) -> int:
        return sum(linear.out_features * linear.in_features for linear in self.linears)

    def group_size(self, linear: Linear) -> int:
        return formats.w4_group_size(linear.in_features, self.w4_group_size)

    # ---- bytes ------------------------------------------------------------------------------

    def layer_linear_bytes(self, bits: int, layout: str = "stored") -> int:
        """Exact bytes of one decoder layer's linears at ``bits`` in ``layout``."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
        if bits == FULL_PRECISION_BITS:
            return self.linear_params_per_layer * self.dtype_bytes
        formats.get_format(bits)  # a clear error for a bit-width without a format
        if layout == "stored":
            return sum(self._stored_bytes(linear, bits) for linear in self.linears)
        return sum(self._cpu_bytes(fused, bits) for fused in self.fused_linears)

    def _stored_bytes(self, linear: Linear, bits: int) -> int:
        out, inp = linear.out_features, linear.in_features
        if bits == 8:  # int8 [out, in] + bf16 scales [out]
            return out * inp + out * _BF16_BYTES
        groups = inp // self.group_size(linear)
        # packed nibbles, bf16 scales + uint8 zeros per (row, group), bf16 AWQ input scale
        return (out * inp // 2 + out * groups * (_BF16_BYTES + _UINT8_BYTES)
                + (inp * _BF16_BYTES if self.awq_input_scale else 0))

    def _cpu_bytes(self, fused: tuple[Linear, ...], bits: int) -> int:
        out = sum(linear.out_features for linear in fused)
        inp = fused[0].in_features
        act = self.dtype_bytes
        # fp32 activations use the dequantize layout, which pads nothing
        # (morph_kernels.cpu.DEQUANTIZE_ACT_DTYPES); the packed ops' layout pads.
        packed = act != _FP32_BYTES
        if bits == 8:  # int8 [out, in16 (packed) or in] + scales [out] in the activation dtype
            return out * (_round_up(inp, _CPU_INT8_IN_MULTIPLE) if packed else inp) + out * act
        out16 = _round_up(out, _CPU_INT4_OUT_MULTIPLE) if packed else out
        groups = inp // self.group_size(fused[0])
        # int4 [out16 (packed) or out, in/2]; scales and zeros [in/g, out16 or out, 2];
        # 1/input_scale [in]
        return (out16 * inp // 2 + groups * out16 * 2 * act
                + (inp * act if self.awq_input_scale else 0))

    @property
    def norm_bytes_per_layer(self) -> int:
        """The two RMSNorm weights of a layer (never quantized)."""
        return 2 * self.hidden_size * self.dtype_bytes

    @property
    def embedding_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def rotary_cache_bytes(self) -> int:
        """SGLang's cos/sin table (one per model, shared by all layers), ``[rows, head_dim]`` in
        the model dtype on CPU (``rotary_embedding/base.py``). ``ModelRunner`` pre-expands it
        past the context length (``reserve_rope_cache_for_long_sequences``: context + a
        256-position margin, aligned to 128, then ``_ensure_cos_sin_cache_length``'s own
        alignment), so 8192 positions hold 8448 rows."""
        rows = self.max_position_embeddings
        reserve = _round_up(rows + _ROPE_MARGIN, _ROPE_ALIGN)
        if reserve - 1 >= rows:
            rows = (reserve - 1 + _ROPE_ALIGN) // _ROPE_ALIGN * _ROPE_ALIGN
        return rows * self.head_dim * self.dtype_bytes

    def stage_static_bytes(self, first: bool, last: bool) -> int:
        """Bytes a pipeline stage holds besides its decoder layers: the embedding on the first
        stage, LM head and final norm on the last (a tied head is the embedding's tensor when
        one stage holds both, a copy otherwise), and the rotary table on every stage."""
        total = self.rotary_cache_bytes
        if first:
            total += self.embedding_bytes
        if last:
            total += self.hidden_size * self.dtype_bytes  # final norm
            if not (self.tie_word_embeddings and first):
                total += self.embedding_bytes
        return total

    def kv_bytes_per_token_per_layer(self, kv_dtype_bytes: int | None = None) -> int:
        return 2 * self.num_kv_heads * self.head_dim * (kv_dtype_bytes or self.dtype_bytes)

    def layer_flops_per_token(self) -> int:
        """Multiply-adds x 2 of one layer's linears for one token (attention scores excluded)."""
        return 2 * self.linear_params_per_layer


# Published shapes of the models the simulated clusters serve (HF config.json of each).
# OPT uses a plain (fc1/fc2) MLP and full multi-head attention.
SIMULATED_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("opt-13b", 40, 5120, 20480, 40, 40, 128, 50272, False, 2048, gated_mlp=False),
        ModelSpec("opt-30b", 48, 7168, 28672, 56, 56, 128, 50272, False, 2048, gated_mlp=False),
        ModelSpec("opt-66b", 64, 9216, 36864, 72, 72, 128, 50272, False, 2048, gated_mlp=False),
        ModelSpec("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000, False, 4096),
        ModelSpec("llama-2-70b", 80, 8192, 28672, 64, 8, 128, 32000, False, 4096),
    )
}
