"""Device profiles: GPUs from public specifications through a roofline model, and this machine
from measurements (``splitquant.profile``).

A GPU layer time is a roofline: each part of the layer takes the longer of its FLOPs at the
device's dense FP16/BF16 tensor-core peak and its bytes at the device's memory bandwidth, each
scaled by an efficiency. The efficiencies are not guesses: they are our own kernels' shares of
peak measured on an H100 (README "GPU path", ``benchmark/results/gpu/kernels.md``): decode
(weight streaming) bf16 cuBLAS 65-92%, Triton W8 53-81%, W4 21-32% of the measured 3.02 TB/s
copy bandwidth (x 0.90 to refer them to the 3.35 TB/s specification); prefill bf16 680-820,
W8 340-500, W4 190-245 TFLOP/s of 989. The mid-range is used and assumed to carry over to the
other GPUs (same kernels; an assumption, stated in docs/splitquant.md). Attention, norms and the
per-layer launch overhead are modelled with fixed efficiencies and times (below).

The planner does not use the roofline directly: it fits ``cost.LatencyModel`` (SplitQuant's
features) to roofline points on a grid, as it would to measurements, and the pipeline
simulator runs on the roofline itself, so the plans are judged on a model they were not
fitted to exactly.

Specifications (dense tensor-core FP16/BF16 without sparsity; memory; bandwidth):

- T4: 65 TFLOPS FP16, 16 GB GDDR6, 320 GB/s (NVIDIA T4 datasheet,
  nvidia.com/en-us/data-center/tesla-t4/).
- V100 SXM2 32 GB: 125 TFLOPS, 32 GB HBM2, 900 GB/s (NVIDIA V100 datasheet,
  nvidia.com/en-us/data-center/v100/).
- A100 SXM 40 GB: 312 TFLOPS BF16, 1,555 GB/s; A100 80 GB: 2,039 GB/s (NVIDIA A100 datasheet,
  nvidia.com/en-us/data-center/a100/).
- L4: 121 TFLOPS FP16 (242 with sparsity), 24 GB GDDR6, 300 GB/s (NVIDIA L4 datasheet,
  nvidia.com/en-us/data-center/l4/).
- H100 SXM: 989 TFLOPS BF16, 80 GB HBM3, 3,350 GB/s (NVIDIA H100 datasheet,
  nvidia.com/en-us/data-center/h100/).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from sglang_morph.splitquant.cost import LatencyModel, Measurement, fit
from sglang_morph.models.spec import ModelSpec

GB = 10**9
# Share of peak our kernels reach (H100 measurements above, mid-range), per weight bit-width.
LINEAR_COMPUTE_EFFICIENCY = {16: 0.76, 8: 0.42, 4: 0.22}
LINEAR_MEMORY_EFFICIENCY = {16: 0.70, 8: 0.60, 4: 0.24}
ATTENTION_COMPUTE_EFFICIENCY = 0.5  # FlashAttention-class prefill
STREAM_EFFICIENCY = 0.7  # KV reads, norms, rotary, activations
LAYER_OVERHEAD_S = {"prefill": 30e-6, "decode": 15e-6}  # launches per layer (graphs at decode)
# Usable share of a GPU's memory (CUDA context, allocator fragmentation, workspace).
USABLE_MEMORY_FRACTION = 0.9
# Grids the cost model is fitted on (v, s) and (v, context).
GPU_PREFILL_GRID = [(v, s) for v in (1, 2, 4, 8, 16) for s in (128, 256, 512, 1024)]
GPU_DECODE_GRID = [(v, c) for v in (1, 2, 4, 8, 16, 32, 64) for c in (128, 512, 1024, 2048)]
GPU_HEAD_GRID = [1, 2, 4, 8, 16, 32, 64]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    peak_tflops: float  # dense FP16/BF16 tensor core
    bandwidth_gbs: float

    @property
    def usable_memory_bytes(self) -> int:
        return int(self.memory_bytes * USABLE_MEMORY_FRACTION)


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("T4", 16 * GB, 65.0, 320.0),
        GpuSpec("V100", 32 * GB, 125.0, 900.0),
        GpuSpec("A100-40G", 40 * GB, 312.0, 1555.0),
        GpuSpec("A100-80G", 80 * GB, 312.0, 2039.0),
        GpuSpec("L4", 24 * GB, 121.0, 300.0),
        GpuSpec("H100", 80 * GB, 989.0, 3350.0),
    )
}


def gpu(name: str) -> GpuSpec:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[name]


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Per-layer and LM-head times of ``model`` on ``spec`` (seconds)."""

    spec: GpuSpec
    model: ModelSpec

    def _linear_s(self, bits: int, tokens) -> np.ndarray:
        flops = self.model.layer_flops_per_token() * np.asarray(tokens, dtype=np.float64)
        weight_bytes = self.model.layer_linear_bytes(bits, "stored")
        compute = flops / (self.spec.peak_tflops * 1e12 * LINEAR_COMPUTE_EFFICIENCY[bits])
        memory = weight_bytes / (self.spec.bandwidth_gbs * GB * LINEAR_MEMORY_EFFICIENCY[bits])
        return np.maximum(compute, memory)

    def _stream_s(self, nbytes) -> np.ndarray:
        return np.asarray(nbytes, dtype=np.float64) / (self.spec.bandwidth_gbs * GB
                                                        * STREAM_EFFICIENCY)

    def _elementwise_bytes(self, tokens) -> np.ndarray:
        m = self.model
        # norms, rotary, residuals (hidden-sized) and the gated activation (ffn-sized), r + w
        return np.asarray(tokens) * (12 * m.hidden_size + 6 * m.intermediate_size) * m.dtype_bytes

    def prefill_s(self, bits: int, v, s) -> np.ndarray:
        m = self.model
        v, s = np.asarray(v, dtype=np.float64), np.asarray(s, dtype=np.float64)
        tokens = v * s
        attention_flops = 2.0 * v * s * s * m.num_attention_heads * m.head_dim  # causal half
        attention = attention_flops / (self.spec.peak_tflops * 1e12 * ATTENTION_COMPUTE_EFFICIENCY)
        kv_write = tokens * m.kv_bytes_per_token_per_layer()
        return (self._linear_s(bits, tokens) + attention
                + self._stream_s(self._elementwise_bytes(tokens) + kv_write)
                + LAYER_OVERHEAD_S["prefill"])

    def decode_s(self, bits: int, v, context) -> np.ndarray:
        m = self.model
        v, context = np.asarray(v, dtype=np.float64), np.asarray(context, dtype=np.float64)
        kv_read = v * context * m.kv_bytes_per_token_per_layer()
        return (self._linear_s(bits, v) + self._stream_s(kv_read + self._elementwise_bytes(v))
                + LAYER_OVERHEAD_S["decode"])

    def head_s(self, v) -> np.ndarray:
        m = self.model
        v = np.asarray(v, dtype=np.float64)
        flops = 2.0 * m.vocab_size * m.hidden_size * v
        compute = flops / (self.spec.peak_tflops * 1e12 * LINEAR_COMPUTE_EFFICIENCY[16])
        memory = m.embedding_bytes / (self.spec.bandwidth_gbs * GB * LINEAR_MEMORY_EFFICIENCY[16])
        return np.maximum(compute, memory) + LAYER_OVERHEAD_S["decode"]

    def points(self, bits=(16, 8, 4)) -> list[Measurement]:
        out = []
        for b in bits:
            out += [Measurement("prefill", b, v, s, float(self.prefill_s(b, v, s)))
                    for v, s in GPU_PREFILL_GRID]
            out += [Measurement("decode", b, v, c, float(self.decode_s(b, v, c)))
                    for v, c in GPU_DECODE_GRID]
        out += [Measurement("head", 16, v, 0, float(self.head_s(v))) for v in GPU_HEAD_GRID]
        return out


@functools.lru_cache(maxsize=64)
def gpu_latency_model(name: str, model: ModelSpec) -> LatencyModel:
    """The cost model the planner uses for GPU ``name``: SplitQuant's features fitted to the
    roofline's points."""
    return fit(name, Roofline(gpu(name), model).points(),
               source=f"roofline of the {name} specification (sglang_morph.splitquant.devices)")
