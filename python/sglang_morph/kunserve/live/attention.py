"""Extend attention over the new rows only, for the merged pair's micro-batches and peer batches.

SGLang's torch_native backend runs an extend request's attention as a square: a query of the
whole sequence (prefix rows left uninitialised), causal, then keeps the new rows. A prefill cut
into micro-batches (``replica.KunServeReplica._micro_batches``) would pay that square once per
micro-batch: a 384-token prompt in four ranges of 96 did 1.9x the attention work of the uncut
prefill, and its last two ranges' front layers took ~240 ms against ~130 ms for the first two
(a trace of a fresh 384-token prompt). Here a request's query is its new rows only, against
the prefix + new keys, with the causal mask shifted by the prefix (a plain ``is_causal`` when
there is none).

Equal to the square's rows up to float rounding, not always bit for bit
(``tests/kunserve/test_kunserve_attention.py``: identical with no prefix and for 96-token ranges
of a 384-token prompt; a 1-token extend behind 50 tokens differs by 3e-7 in float32). Cutting a
prefill changes its rounding anyway (SGLang's own square attention of the third of four ranges
differs from the uncut prefill's rows by 4e-7), so the replica uses this backend for
micro-batches only: a batch it does not cut runs with SGLang's attention, exactly as on a
whole replica.
"""

from __future__ import annotations

import types
from typing import Any

from sglang_morph.groups.attention import extend_new_rows


def new_rows_backend(device: Any, req_to_token_pool: Any, token_to_kv_pool: Any):
    """A torch_native attention backend over these pools whose extend attention computes the
    new rows only (decode is SGLang's)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class NewRowsAttnBackend(TorchNativeAttnBackend):
        def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token,
                                     req_pool_indices, seq_lens, extend_prefix_lens,
                                     extend_seq_lens, encoder_lens=None, scaling=None,
                                     enable_gqa=False, causal=False, is_cross_attn=False,
                                     sliding_window_size=None):
            if (encoder_lens is not None or is_cross_attn or not causal
                    or (sliding_window_size is not None and sliding_window_size > -1)):
                return super()._run_sdpa_forward_extend(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa,
                    causal, is_cross_attn, sliding_window_size)
            return extend_new_rows(query, output, k_cache, v_cache, req_to_token,
                                   req_pool_indices, seq_lens, extend_prefix_lens,
                                   extend_seq_lens, scaling, enable_gqa)

    return NewRowsAttnBackend(types.SimpleNamespace(
        device=device, req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool))
