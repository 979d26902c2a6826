"""Attention of a batch's new rows over KV read at its requests' slots: what a member runs for
another member's batch over a mirror pool, where SGLang's attention backends (which read the
scheduler's own pools through a process-wide forward context) cannot be used.

A request's query is its new rows only, against the prefix + new keys, with the causal mask
shifted by the prefix (a plain ``is_causal`` when there is none); a decode step is a request
with one new row. Equal to SGLang's torch_native rows up to float rounding
(``tests/kunserve/test_kunserve_attention.py``).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def extend_new_rows(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, req_to_token: torch.Tensor,
                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    prefix_lens: torch.Tensor, new_lens: torch.Tensor,
                    scaling: float | None, enable_gqa: bool) -> torch.Tensor:
    """Causal attention of each request's new rows (``query``/``output``: [tokens, heads, dim],
    requests one after another) over its whole sequence's keys, read from the caches at the
    request's slots (``req_to_token[req_pool_indices[i], :seq_lens[i]]``)."""
    start = 0
    for i, (kv_len, prefix, new) in enumerate(zip(seq_lens.tolist(), prefix_lens.tolist(),
                                                  new_lens.tolist())):
        if prefix + new != kv_len:
            raise ValueError(f"request {i}: prefix {prefix} + new {new} != sequence {kv_len}")
        slots = req_to_token[req_pool_indices[i], :kv_len]
        q = query[start:start + new].movedim(0, 1).contiguous()  # [heads, new, dim]
        k = k_cache[slots].movedim(0, 1)
        v = v_cache[slots].movedim(0, 1)
        if not q.dtype == k.dtype == v.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        # Row r (absolute position prefix + r) sees keys 0..prefix + r.
        mask = (torch.ones(new, kv_len, dtype=torch.bool, device=q.device).tril(prefix)
                if prefix else None)
        out = scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                           is_causal=mask is None, scale=scaling,
                                           enable_gqa=enable_gqa)[0]
        output[start:start + new] = out.movedim(0, 1)
        start += new
    return output
