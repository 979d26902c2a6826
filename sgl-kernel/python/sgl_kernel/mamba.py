"""Linear-attention (GDN / KDA) kernels: imported by SGLang, not provided.

``sglang.srt.layers.attention.linear`` imports these under ``is_cpu()``. Those
backends are only built for hybrid linear-attention models (Qwen3-Next,
Qwen3.5, Kimi-Linear, ...), which this package does not target. They also read
``torch.ops.sgl_kernel.fused_gdn_gating_cpu`` and
``fused_sigmoid_gating_delta_rule_update_cpu`` at import, which are
deliberately not registered, so such a model fails at backend construction.
"""

from __future__ import annotations

from sgl_kernel._unsupported import not_implemented

_REASON = (
    "hybrid linear-attention (GDN/KDA) models are not supported by this "
    "pure-torch CPU kernel package; it targets dense attention models"
)

causal_conv1d_fn_cpu = not_implemented("causal_conv1d_fn_cpu", _REASON)
causal_conv1d_update_cpu = not_implemented("causal_conv1d_update_cpu", _REASON)
chunk_gated_delta_rule_cpu = not_implemented("chunk_gated_delta_rule_cpu", _REASON)

__all__ = [
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
]
