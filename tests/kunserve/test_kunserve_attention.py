"""The merged pair's new-rows extend attention (``kunserve/live/attention.py``) against SGLang's
torch_native extend attention (the reference): the same output rows for requests with and
without a prefix, one prompt cut into ranges (a prefill's micro-batches), GQA, float32 and
bfloat16 -- bit for bit where there is no prefix and for the micro-batch ranges, to float
rounding otherwise; what it does not handle goes to SGLang's; inconsistent lengths are
refused."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_morph.groups.attention import extend_new_rows
from sglang_morph.kunserve.live.attention import new_rows_backend

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention
SLOTS = 2048


def caches(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(SLOTS, KV_HEADS, DIM, generator=g).to(dtype)
    # Each request's tokens at scattered slots, as a pool hands them out.
    req_to_token = torch.randperm(SLOTS, generator=g)[:4 * 512].reshape(4, 512).to(torch.int32)
    return k, v, req_to_token


def reference(backend, query, k, v, req_to_token, rows, seq, prefix, new):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    out = torch.empty_like(query)
    return TorchNativeAttnBackend._run_sdpa_forward_extend(
        backend, query, out, k, v, req_to_token, rows, seq, prefix, new,
        scaling=DIM ** -0.5, enable_gqa=True, causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_new", [
    [(0, 384)],  # a whole prefill
    [(0, 96), (96, 96), (192, 96), (288, 96)],  # the same prefill as four micro-batches
    [(0, 16), (50, 1), (191, 120), (7, 33)],  # a batch: radix-cache prefixes, a 1-token extend
])
def test_new_rows_equal_sglang_square_attention_bit_for_bit(dtype, prefix_new):
    k, v, req_to_token = caches(dtype)
    backend = new_rows_backend("cpu", types.SimpleNamespace(req_to_token=req_to_token),
                               types.SimpleNamespace())
    g = torch.Generator().manual_seed(1)
    # One request per (prefix, new) on its own row of req_to_token, except the micro-batch
    # case, where the ranges are the same request (row 0) one after another.
    same_request = prefix_new[0] == (0, 96)
    rows = torch.tensor([0 if same_request else i for i in range(len(prefix_new))])
    prefix = torch.tensor([p for p, _ in prefix_new])
    new = torch.tensor([n for _, n in prefix_new])
    seq = prefix + new
    total = int(new.sum())
    query = torch.randn(total, HEADS, DIM, generator=g).to(dtype)
    want = reference(backend, query, k, v, req_to_token, rows, seq, prefix, new)
    got = backend._run_sdpa_forward_extend(
        query, torch.empty_like(query), k, v, req_to_token, rows, seq, prefix, new,
        scaling=DIM ** -0.5, enable_gqa=True, causal=True)
    if same_request or prefix_new == [(0, 384)]:
        assert torch.equal(got, want)
    else:  # a 1-token extend behind 50 tokens, or 33 behind 7: rounding apart
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if same_request:  # the ranges' rows are the uncut prefill's rows, to rounding (the cut
        whole = reference(backend, query, k, v, req_to_token,  # changes SGLang's rows too)
                          torch.tensor([0]), torch.tensor([384]), torch.tensor([0]),
                          torch.tensor([384]))
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, whole, rtol=tol, atol=tol)


def test_what_it_does_not_handle_goes_to_sglang():
    k, v, req_to_token = caches(torch.float32)
    backend = new_rows_backend("cpu", types.SimpleNamespace(req_to_token=req_to_token),
                               types.SimpleNamespace())
    query = torch.randn(40, HEADS, DIM)
    args = (k, v, req_to_token, torch.tensor([0]), torch.tensor([40]), torch.tensor([0]),
            torch.tensor([40]))
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    # Not causal (an encoder-only layer): SGLang's own computation.

    ref = TorchNativeAttnBackend._run_sdpa_forward_extend(
        backend, query, torch.empty_like(query), *args, scaling=DIM ** -0.5, enable_gqa=True,
        causal=False)
    got = backend._run_sdpa_forward_extend(query, torch.empty_like(query), *args,
                                           scaling=DIM ** -0.5, enable_gqa=True, causal=False)
    assert torch.equal(got, ref)


def test_inconsistent_lengths_are_refused():
    k, v, req_to_token = caches(torch.float32)
    query = torch.randn(10, HEADS, DIM)
    with pytest.raises(ValueError, match="prefix 5 \\+ new 10 != sequence 12"):
        extend_new_rows(query, torch.empty_like(query), k, v, req_to_token, torch.tensor([0]),
                        torch.tensor([12]), torch.tensor([5]), torch.tensor([10]), None, True)
