"""``python -m sglang_morph.splitquant profile``: this machine's per-layer times at W16/W8/W4.

What is timed is one decoder layer of the served model, forward, the way SGLang's CPU path
runs it: the four fused linears (``F.linear`` on the bf16 weights for 16 bits, as SGLang's
unquantized method; ``morph_kernels.linear`` on the prepared variant for 8/4 bits, exactly what
the morph installer serves), RMSNorm, rotary, SiLU-and-mul, and attention as the
``torch_native`` backend does it: per request, the request's K/V gathered from a token pool by
index and ``scaled_dot_product_attention`` (causal over the prompt in prefill; one query over
the whole context in decode). Weights are the real layer's (checkpoint and built variants).
The LM head (final norm + logits of one token per sequence) is timed for the last stage.

Each point is the fastest of several repetitions after a warm-up (on a shared machine other
processes only ever add time, so the minimum is the estimate of the layer's own time; medians
were measured to scatter by 10-30% here under load 4 on 2 cores), with torch limited to
``--threads`` (one pipeline rank's share of the cores); the load average is recorded before and
after. Points come in two grids: the fitting grid and a held-out
grid between its values, on which the fitted model's error is reported.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.splitquant.cost import Measurement

# (v, s) prefill and (v, context) decode grids; held-out values lie between the fitting ones.
FIT_PREFILL = [(v, s) for v in (1, 2, 4) for s in (16, 32, 64, 128, 256)]
HELD_OUT_PREFILL = [(v, s) for v in (1, 3) for s in (48, 96, 192)]
FIT_DECODE = [(v, c) for v in (1, 2, 4, 8, 16) for c in (32, 128, 256, 512)]
HELD_OUT_DECODE = [(v, c) for v in (3, 6, 12) for c in (64, 384)]
FIT_HEAD = [1, 2, 4, 8, 16]
HELD_OUT_HEAD = [3, 12]


@dataclasses.dataclass
class _Fused:
    bits: int
    weight: torch.Tensor | None = None  # bits 16
    prepared: object | None = None  # morph_kernels.PreparedWeight otherwise

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight)
        import morph_kernels

        return morph_kernels.linear(x, self.prepared)


class LayerBench:
    """One decoder layer (layer ``layer_index`` of the model) at ``bits``, ready to time."""

    def __init__(self, model_dir: Path, engines_dir: Path | None, bits: int, layer_index: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        import json

        from safetensors import safe_open

        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads", self.heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        theta = (config.get("rope_parameters") or {}).get("rope_theta",
                                                          config.get("rope_theta", 10000.0))
        self.dtype = dtype
        prefix = f"model.layers.{layer_index}."
        tensors = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key.startswith(prefix) or key in ("model.embed_tokens.weight",
                                                         "model.norm.weight", "lm_head.weight"):
                        tensors[key.removeprefix(prefix)] = f.get_tensor(key).to(dtype)
        self.input_norm = tensors["input_layernorm.weight"]
        self.post_norm = tensors["post_attention_layernorm.weight"]
        self.final_norm = tensors["model.norm.weight"]
        self.lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        from sglang_morph.engines.variants import FUSED_LINEARS

        if bits == FULL_PRECISION_BITS:
            self.linears = {
                path.split(".")[-1]: _Fused(bits, weight=torch.cat(
                    [tensors[f"{p}.weight"] for p in parts]).contiguous())
                for path, parts in FUSED_LINEARS.items()}
        else:
            import morph_kernels

            from sglang_morph.engines.manifest import EngineManifest, read_variant
            from sglang_morph.engines.variants import fuse_stored

            manifest = EngineManifest.load(engines_dir)
            stored = read_variant(engines_dir, manifest.variant(layer_index, bits))
            self.linears = {
                path.split(".")[-1]: _Fused(bits, prepared=morph_kernels.prepare(
                    bits, fuse_stored(stored, parts), device="cpu", act_dtype=dtype))
                for path, parts in FUSED_LINEARS.items()}
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(8192).float(), inv_freq)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim], neox style (halves), as Llama
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _layer(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = self.linears["qkv_proj"](self._rms(x, self.input_norm))
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self._rope(q.view(-1, self.heads, self.head_dim), positions)
        k = self._rope(k.view(-1, self.kv_heads, self.head_dim), positions)
        attn = attend(q, k, v.view(-1, self.kv_heads, self.head_dim))
        h = x + self.linears["o_proj"](attn.reshape(-1, q_size))
        gate, up = self.linears["gate_up_proj"](self._rms(h, self.post_norm)).chunk(2, dim=-1)
        return h + self.linears["down_proj"](F.silu(gate) * up)

    def prefill_fn(self, v: int, s: int):
        x = torch.randn(v * s, self.hidden, dtype=self.dtype) * 0.1
        positions = torch.arange(s).repeat(v)
        pool_k = torch.zeros(v * s, self.kv_heads, self.head_dim, dtype=self.dtype)
        pool_v = torch.zeros_like(pool_k)
        slots = torch.arange(v * s)

        def attend(q, k, val):
            pool_k[slots] = k  # KV written to the pool, as the backend does
            pool_v[slots] = val
            out = torch.empty_like(q)
            for r in range(v):
                rows = slots[r * s:(r + 1) * s]
                out[r * s:(r + 1) * s] = F.scaled_dot_product_attention(
                    q[r * s:(r + 1) * s].transpose(0, 1), pool_k[rows].transpose(0, 1),
                    pool_v[rows].transpose(0, 1), is_causal=True, enable_gqa=True,
                ).transpose(0, 1)
            return out

        return lambda: self._layer(x, positions, attend)

    def decode_fn(self, v: int, context: int):
        x = torch.randn(v, self.hidden, dtype=self.dtype) * 0.1
        positions = torch.full((v,), context - 1)
        pool_k = torch.randn(v * context, self.kv_heads, self.head_dim, dtype=self.dtype)
        pool_v = torch.randn_like(pool_k)
        rows = [torch.arange(r * context, (r + 1) * context) for r in range(v)]

        def attend(q, k, val):
            last = torch.tensor([r[-1] for r in rows])
            pool_k[last] = k
            pool_v[last] = val
            out = torch.empty_like(q)
            for r in range(v):
                out[r] = F.scaled_dot_product_attention(
                    q[r:r + 1].transpose(0, 1), pool_k[rows[r]].transpose(0, 1),
                    pool_v[rows[r]].transpose(0, 1), enable_gqa=True,
                ).transpose(0, 1)[0]
            return out

        return lambda: self._layer(x, positions, attend)

    def head_fn(self, v: int):
        x = torch.randn(v, self.hidden, dtype=self.dtype) * 0.1
        return lambda: F.linear(self._rms(x, self.final_norm), self.lm_head).float()


def best_seconds(fn, repetitions: int, min_total_s: float = 0.15) -> float:
    """Fastest of ``repetitions`` timed calls (each call repeated until it lasts at least
    ``min_total_s`` / repetitions, so microsecond decode steps are not timer noise)."""
    with torch.inference_mode():
        fn()
        started = time.perf_counter()
        fn()
        one = max(time.perf_counter() - started, 1e-6)
        inner = max(1, int(min_total_s / repetitions / one))
        samples = []
        for _ in range(repetitions):
            started = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - started) / inner)
    return min(samples)


def measure(model_dir: Path, engines_dir: Path, bits: tuple[int, ...] = (16, 8, 4),
            threads: int = 1, repetitions: int = 7, held_out: bool = False,
            progress: bool = True) -> list[Measurement]:
    from tqdm.auto import tqdm

    torch.set_num_threads(threads)
    prefill = HELD_OUT_PREFILL if held_out else FIT_PREFILL
    decode = HELD_OUT_DECODE if held_out else FIT_DECODE
    heads = HELD_OUT_HEAD if held_out else FIT_HEAD
    jobs = []
    for b in bits:
        jobs += [("prefill", b, v, s) for v, s in prefill]
        jobs += [("decode", b, v, c) for v, c in decode]
    jobs += [("head", FULL_PRECISION_BITS, v, 0) for v in heads]
    benches = {b: LayerBench(model_dir, engines_dir, b) for b in bits}
    benches.setdefault(FULL_PRECISION_BITS, LayerBench(model_dir, engines_dir, 16))
    points = []
    for phase, b, v, s in tqdm(jobs, desc="held-out" if held_out else "fitting grid",
                               disable=not progress):
        bench = benches[b]
        fn = (bench.prefill_fn(v, s) if phase == "prefill" else
              bench.decode_fn(v, s) if phase == "decode" else bench.head_fn(v))
        points.append(Measurement(phase, b, v, s, best_seconds(fn, repetitions)))
    return points


def load_average() -> list[float]:
    return list(os.getloadavg())
