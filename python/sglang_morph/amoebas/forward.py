"""The tensor-parallel forward of a merged group, run by the plugin (SGLang's ``tp_size`` stays 1).

A batch of member ``o`` (its *owner*) runs on every member of the group at once: each member
computes its query/KV heads and its FFN shard, writes its heads' K/V rows into the pool it keeps
for ``o``'s requests (its own pool when it is ``o``, else its mirror of ``o``) at ``o``'s slot
numbers, and the two partial sums of a layer (attention output projection, FFN down projection)
are all-reduced over the group. Embedding, norms and residuals are replicated: every member
computes them from the same all-reduced values, so every member holds the same hidden states.
The owner alone applies the final norm; SGLang's logits processor and sampler run on it as on a
replica of its own.

Sharding (member ``rank`` of ``degree``; ``Shard``): query heads ``[rank*Hq/d, (rank+1)*Hq/d)``,
KV heads ``[rank*Hkv/d, (rank+1)*Hkv/d)`` (the query heads of a KV head stay with it, so grouped
attention is local), FFN intermediate rows ``[rank*I/d, (rank+1)*I/d)`` of gate, up and down's
input. The weights are views of the model's own parameters (no copy): row ranges of the fused
QKV and gate/up matrices, column ranges of the output and down projections.

Attention is computed here, over the pool views passed in (``groups.attention``), not by
SGLang's backend: that backend reads the scheduler's own pools through a process-wide forward
context, while a member runs its own batch and the other members' batches on two threads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from sglang_morph.groups.attention import extend_new_rows

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the group, in place


@dataclasses.dataclass(frozen=True)
class Shard:
    """What member ``rank`` of a group of ``degree`` computes. Invariant: ``degree`` divides
    the query heads, the KV heads and the FFN intermediate size."""

    rank: int
    degree: int
    num_q_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % self.degree:
                raise ValueError(f"degree {self.degree} does not divide {name} "
                                 f"{getattr(self, name)}")
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"rank {self.rank} is not in a group of {self.degree}")

    def _range(self, total: int) -> range:
        per = total // self.degree
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def q_heads(self) -> range:
        return self._range(self.num_q_heads)

    @property
    def kv_heads(self) -> range:
        return self._range(self.num_kv_heads)

    @property
    def ffn_rows(self) -> range:
        return self._range(self.intermediate_size)


@dataclasses.dataclass(frozen=True)
class LayerShard:
    """One decoder layer's weight views for a member (no copies)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def layer_shards(model: Any, shard: Shard, head_dim: int,
                 ffn: Sequence[Any] | None = None) -> list[LayerShard]:
    """Views of ``model.layers``' weights (SGLang's Llama layout at tp_size 1: fused QKV rows
    q|k|v, fused gate/up rows gate|up) for ``shard``; with ``ffn`` (one
    ``weights.FfnWeights`` per layer, holding at least the shard) the FFN rows are views of
    those stores instead (gate, up and down^T rows, padded to ``shard.intermediate_size``).
    Raises NotImplementedError for a layer this forward does not compute (biases)."""
    check_layers(model)
    q_rows = _rows(shard.q_heads, head_dim)
    kv_rows = _rows(shard.kv_heads, head_dim)
    q_size, kv_size = shard.num_q_heads * head_dim, shard.num_kv_heads * head_dim
    rows = shard.ffn_rows
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if ffn is not None:
            gate, up, down_t = ffn[i].rows(rows.start, rows.stop)
            down = down_t.t()
        else:
            gate_up = mlp.gate_up_proj.weight
            gate = gate_up[rows.start:rows.stop]
            up = gate_up[shard.intermediate_size + rows.start:
                         shard.intermediate_size + rows.stop]
            down = mlp.down_proj.weight[:, rows.start:rows.stop]
        qkv = attn.qkv_proj.weight
        out.append(LayerShard(
            q=qkv[q_rows.start:q_rows.stop],
            k=qkv[q_size + kv_rows.start:q_size + kv_rows.stop],
            v=qkv[q_size + kv_size + kv_rows.start:q_size + kv_size + kv_rows.stop],
            o=attn.o_proj.weight[:, q_rows.start:q_rows.stop], gate=gate, up=up, down=down))
    return out


def check_layers(model: Any) -> None:
    """Raises NotImplementedError for a layer this forward does not compute (biases)."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if getattr(linear, "bias", None) is not None:
                raise NotImplementedError(f"{type(linear).__name__} with a bias")


def _rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


@dataclasses.dataclass(frozen=True)
class Batch:
    """What every member needs of the owner's batch. ``req_to_token[i, :seq_lens[i]]`` are
    request ``i``'s slots (the owner's numbers); its ``new_lens[i]`` new tokens are the last
    ones, ``prefix_lens[i]`` before them (a decode step: one new token)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    new_lens: torch.Tensor
    req_to_token: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "Batch":
        return cls(**{f.name: t[f.name] for f in dataclasses.fields(cls)})

    @classmethod
    def from_forward_batch(cls, fb: Any, req_to_token: torch.Tensor, input_ids: torch.Tensor,
                           positions: torch.Tensor) -> "Batch":
        """The owner's batch (extend or decode), its ``req_to_token`` rows cut to the longest
        sequence."""
        mode = fb.forward_mode
        seq_lens = fb.seq_lens.to(torch.int64)
        if mode.is_extend():
            prefix = fb.extend_prefix_lens.to(torch.int64)
            new = fb.extend_seq_lens.to(torch.int64)
        elif mode.is_decode():
            prefix, new = seq_lens - 1, torch.ones_like(seq_lens)
        else:
            raise NotImplementedError(f"a merged group runs extend and decode batches, not {mode}")
        rows = req_to_token[fb.req_pool_indices.long(), :int(seq_lens.max())].to(torch.int64)
        return cls(input_ids, positions, fb.out_cache_loc.to(torch.int64), seq_lens, prefix, new,
                   rows)


@dataclasses.dataclass(frozen=True)
class Part:
    """One owner's batch in a merged forward, with this member's KV views for that owner
    (``k_buffers[l]``/``v_buffers[l]``: [slots, this member's KV heads, head_dim] at the
    owner's slot numbers)."""

    batch: Batch
    k_buffers: Sequence[torch.Tensor]
    v_buffers: Sequence[torch.Tensor]

    @property
    def tokens(self) -> int:
        return self.batch.input_ids.numel()


def forward(model: Any, shards: Sequence[LayerShard], shard: Shard, head_dim: int,
            parts: Sequence[Part], all_reduce: AllReduce, final_norm: bool) -> torch.Tensor:
    """``LlamaModel.forward`` of the owners' batches ``parts`` as one batch on one member: its
    heads and FFN rows over every part's tokens at once (one GEMM and one all-reduce per
    projection, whatever the number of owners), attention part by part over that owner's KV
    views. Returns the hidden states of every part's tokens, in order: final-normed when
    ``final_norm`` (an owner's), else the last layer's output."""
    hq, hkv = len(shard.q_heads), len(shard.kv_heads)
    tokens = sum(p.tokens for p in parts)
    starts = [sum(p.tokens for p in parts[:i]) for i in range(len(parts))]
    pool_rows = [torch.arange(p.batch.seq_lens.numel(), dtype=torch.int64) for p in parts]
    cat = (lambda ts: ts[0]) if len(parts) == 1 else torch.cat
    input_ids = cat([p.batch.input_ids for p in parts])
    positions = cat([p.batch.positions for p in parts])
    hidden, residual = model.embed_tokens(input_ids), None
    for l, (layer, w) in enumerate(zip(model.layers, shards, strict=True)):
        if residual is None:
            residual, x = hidden, layer.input_layernorm(hidden)
        else:
            x, residual = layer.input_layernorm(hidden, residual)
        q, k = layer.self_attn.rotary_emb(positions, F.linear(x, w.q), F.linear(x, w.k))
        k = k.view(tokens, hkv, head_dim)
        v = F.linear(x, w.v).view(tokens, hkv, head_dim)
        q = q.view(tokens, hq, head_dim)
        attn = torch.empty_like(q)
        for p, start, rows in zip(parts, starts, pool_rows):
            k_buf, v_buf, b, end = p.k_buffers[l], p.v_buffers[l], p.batch, start + p.tokens
            k_buf[b.out_cache_loc] = k[start:end].to(k_buf.dtype)
            v_buf[b.out_cache_loc] = v[start:end].to(v_buf.dtype)
            extend_new_rows(q[start:end], attn[start:end], k_buf, v_buf, b.req_to_token, rows,
                            b.seq_lens, b.prefix_lens, b.new_lens, layer.self_attn.scaling,
                            hq != hkv)
        out = F.linear(attn.view(tokens, hq * head_dim), w.o)
        all_reduce(out)
        x, residual = layer.post_attention_layernorm(out, residual)
        out = F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)
        all_reduce(out)
        hidden = out
    if not final_norm:
        return hidden
    hidden, _ = model.norm(hidden, residual)
    return hidden
