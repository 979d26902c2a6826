"""The merged group's tensor-parallel forward (``amoebas/forward.py``) against transformers.

A random Llama (8 query / 4 KV heads, transformers' ``LlamaModel``, float32) is the reference.
The same weights in SGLang's tp_size-1 layout (fused QKV and gate/up; norms with SGLang's
calling convention, ``norm(x)`` and ``norm(x, residual) -> (normed, x + residual)``, and the
rotary embedding computing transformers' own) run through ``forward`` on every member of a group of 1, 2 and 4 (threads,
an in-memory all-reduce), the FFN rows read from the model's weights or, in place, from each
member's page store that holds its shard only: a prefill of two requests with different prompt lengths and then
decode steps, each member keeping its heads' KV in its own pool at the owner's slot numbers.
The owner's final-normed hidden states equal transformers' last hidden states of the same
positions, and every member's KV pool holds exactly its heads' rows of the reference's keys.
With two owners (each request another member's, in its own KV views on every member) both
batches run as one forward (one all-reduce per projection) with the same result.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from sglang_morph.amoebas.forward import Batch, Part, Shard, forward, layer_shards
from sglang_morph.amoebas.weights import MappedFfnWeights, keep_shard_layers

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 8, 4, 32, 384, 3
PROMPTS = ([5, 17, 3, 99, 42], [7, 7, 1, 250, 11, 64, 30, 2])
DECODE_TOKENS = ([8, 9, 10], [120, 121, 122])
SLOTS = 64


@pytest.fixture(scope="module")
def reference():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_hidden_layers=LAYERS, num_attention_heads=Q_HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                         max_position_embeddings=256, initializer_range=0.08)
    model = LlamaModel(config).eval()
    return config, model


class SGLangNorm:
    """transformers' RMSNorm behind SGLang's calling convention (the residual add fused)."""

    def __init__(self, norm):
        self.norm = norm

    def __call__(self, x, residual=None):
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x


def hf_rope(hf):
    """``rotary_emb(positions, q, k)`` on flat [tokens, heads * dim] rows, with transformers'
    cos/sin and rotation (neox style, as Llama)."""
    from transformers.models.llama.modeling_llama import rotate_half

    def rope(positions, q, k):
        cos, sin = hf.rotary_emb(q, positions[None])
        cos, sin = cos[0][:, None], sin[0][:, None]  # [tokens, 1, dim]

        def rotate(x):
            x = x.view(x.shape[0], -1, HEAD_DIM)
            return (x * cos + rotate_half(x) * sin).flatten(1)
        return rotate(q), rotate(k)
    return rope


def sglang_layout(config, hf) -> types.SimpleNamespace:
    """The reference's weights as SGLang's Llama holds them at tp_size 1."""

    def linear(weight):
        return types.SimpleNamespace(weight=weight.detach(), bias=None)

    rope = hf_rope(hf)
    layers = []
    for layer in hf.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(types.SimpleNamespace(
            input_layernorm=SGLangNorm(layer.input_layernorm),
            post_attention_layernorm=SGLangNorm(layer.post_attention_layernorm),
            self_attn=types.SimpleNamespace(
                qkv_proj=linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                o_proj=linear(a.o_proj.weight), rotary_emb=rope, scaling=HEAD_DIM ** -0.5),
            mlp=types.SimpleNamespace(
                gate_up_proj=linear(torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                down_proj=linear(m.down_proj.weight))))
    return types.SimpleNamespace(embed_tokens=hf.embed_tokens, layers=layers,
                                 norm=SGLangNorm(hf.norm))


class ThreadAllReduce:
    """Sums each member's tensor in rank order and gives every member the same sum."""

    def __init__(self, degree: int):
        self.degree, self.parts = degree, [None] * degree
        self.barrier = threading.Barrier(degree)

    def member(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            t.copy_(total)
        return all_reduce


def run_group(model, degree: int, in_place: bool = False, owners: int = 1
              ) -> tuple[list[torch.Tensor], list]:
    """Every step of the two requests on a group of ``degree``; the owners' hidden states of
    every step (both requests' rows, in order) and each member's K pools per owner
    (``pools[member][owner]``). ``owners`` 1: member 0 owns both requests (one batch);
    2: request i is owner i's, the two batches run as one forward. ``in_place``: each
    member's FFN rows come from its own page store holding its shard only (the rest
    released)."""
    shards = [Shard(r, degree, Q_HEADS, KV_HEADS, FFN) for r in range(degree)]
    if in_place:
        stores = [[MappedFfnWeights.from_tensors(layer.mlp.gate_up_proj.weight,
                                                 layer.mlp.down_proj.weight, (1, 2, 4))
                   for layer in model.layers] for _ in range(degree)]
        for r, own in enumerate(stores):
            keep_shard_layers(own, r, degree)
        views = [layer_shards(model, s, HEAD_DIM, ffn=own) for s, own in zip(shards, stores)]
    else:
        views = [layer_shards(model, s, HEAD_DIM) for s in shards]
    pools = [[([torch.zeros(SLOTS, KV_HEADS // degree, HEAD_DIM) for _ in range(LAYERS)],
               [torch.zeros(SLOTS, KV_HEADS // degree, HEAD_DIM) for _ in range(LAYERS)])
              for _ in range(owners)] for _ in range(degree)]
    # Request i's tokens sit at slots 1 + 32 * i onwards (the owner's numbers).
    req_to_token = torch.stack([torch.arange(1 + 32 * i, 33 + 32 * i) for i in range(2)])
    steps = [[PROMPTS[0], PROMPTS[1]], *[[[a], [b]] for a, b in zip(*DECODE_TOKENS)]]
    outputs, done = [], [0, 0]
    for step in steps:
        new = torch.tensor([len(t) for t in step])
        prefix = torch.tensor(done)
        seq = prefix + new
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(done, new.tolist())])
        loc = torch.cat([req_to_token[i, p:p + n] for i, (p, n)
                         in enumerate(zip(done, new.tolist()))])
        if owners == 1:
            batches = [Batch(torch.tensor([t for s in step for t in s]), positions, loc, seq,
                             prefix, new, req_to_token)]
        else:  # request i alone, its table row 0, in owner i's slots
            cut = [0, len(step[0]), len(step[0]) + len(step[1])]
            batches = [Batch(torch.tensor(step[i]), positions[cut[i]:cut[i + 1]],
                             loc[cut[i]:cut[i + 1]], seq[i:i + 1], prefix[i:i + 1],
                             new[i:i + 1], req_to_token[i:i + 1]) for i in range(2)]
        reducer, results = ThreadAllReduce(degree), [None] * degree

        def member(r: int) -> None:
            parts = [Part(b, *pools[r][o]) for o, b in enumerate(batches)]
            with torch.no_grad():
                results[r] = forward(model, views[r], shards[r], HEAD_DIM, parts,
                                     reducer.member(r), final_norm=r == 0)

        threads = [threading.Thread(target=member, args=(r,)) for r in range(degree)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outputs.append(results[0])
        done = seq.tolist()
    return outputs, pools


@pytest.mark.parametrize("degree, in_place, owners", [
    (1, False, 1), (2, False, 1), (4, False, 1), (2, True, 1), (4, True, 1), (2, False, 2),
    (4, True, 2)])
def test_group_forward_equals_transformers(reference, degree, in_place, owners):
    config, hf = reference
    model = sglang_layout(config, hf)
    outputs, pools = run_group(model, degree, in_place, owners)
    for i in range(2):
        ids = torch.tensor([PROMPTS[i] + DECODE_TOKENS[i]])
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True)
        expected = ref.last_hidden_state[0]
        n_prompt = len(PROMPTS[i])
        # Prefill rows of request i, then its row of each decode step.
        start = sum(len(p) for p in PROMPTS[:i])
        got = torch.cat([outputs[0][start:start + n_prompt],
                         *[o[i:i + 1] for o in outputs[1:]]])
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    # Member r's pool holds KV heads [r * 4/d, (r+1) * 4/d) of every token, at its slot.
    with torch.no_grad():
        keys = _reference_keys(hf, 0)
    heads = KV_HEADS // degree
    for r, member_pools in enumerate(pools):
        for i in range(2):
            k_bufs = member_pools[i % owners][0]  # owner i's views when each owns a request
            n = len(PROMPTS[i]) + len(DECODE_TOKENS[i])
            got = k_bufs[0][1 + 32 * i:1 + 32 * i + n]
            torch.testing.assert_close(got, keys[i][:, r * heads:(r + 1) * heads], rtol=0,
                                       atol=2e-5)


def _reference_keys(hf, layer: int) -> list[torch.Tensor]:
    """Layer ``layer``'s rotated keys of each request, [tokens, KV heads, dim], from
    transformers' cache."""
    from transformers import DynamicCache

    out = []
    for i in range(2):
        cache = DynamicCache()
        hf(torch.tensor([PROMPTS[i] + DECODE_TOKENS[i]]), past_key_values=cache, use_cache=True)
        keys = cache.layers[layer].keys if hasattr(cache, "layers") else cache.key_cache[layer]
        out.append(keys[0].transpose(0, 1))
    return out


def test_shard_refuses_a_degree_that_does_not_divide_the_heads():
    with pytest.raises(ValueError, match="degree 3 does not divide num_q_heads 8"):
        Shard(0, 3, 8, 4, 384)
