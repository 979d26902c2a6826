"""Weight-only quantized linear kernels (W8A16, W4A16) for sglang-morph's layer variants.

``prepare`` turns one linear's stored tensors (``sglang_morph.engines.formats``: ``w8`` or
``w4``) into the layout of the kernel that serves them on the target device; ``linear``
computes ``y = x @ W_eff.T + bias`` with ``W_eff = formats.dequantize(stored)``; ``warmup``
runs the kernel at every served token-count bucket so serving never compiles or autotunes.

- CPU: torch's own weight-only ops (``torch._weight_int8pack_mm``,
  ``torch._weight_int4pack_mm_for_cpu``), see ``morph_kernels.cpu``.
- CUDA: Triton GEMMs that dequantize the weight tile in registers, see
  ``morph_kernels.triton_gpu``; Triton is imported only on that path.

See README.md for the layouts, tolerances and measured timings.
"""

from __future__ import annotations

__version__ = "0.1.0"

import dataclasses

import torch
from sglang_morph.engines import formats

from morph_kernels import cpu

# Largest prefill chunk warmed up by default: SGLang's default --chunked-prefill-size on large
# GPUs. Buckets above the Triton path's largest one share its configuration, so a larger
# value costs nothing extra.
DEFAULT_WARMUP_MAX_TOKENS = 8192


@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """One linear's weight in its kernel's layout, on the device that serves it.

    ``act_dtype`` is the activation dtype ``prepare`` was given: the CPU kernels hold their
    scales in it, and ``warmup`` needs it to tune the GPU kernels for the served dtype.
    """

    bits: int
    out_features: int
    in_features: int
    group_size: int | None
    tensors: dict[str, torch.Tensor]
    act_dtype: torch.dtype

    @property
    def device_bytes(self) -> int:
        return formats.device_bytes(self.tensors)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device


def prepare(
    bits: int,
    stored: dict[str, torch.Tensor],
    *,
    device: torch.device | str,
    act_dtype: torch.dtype,
    non_blocking: bool = False,
) -> PreparedWeight:
    """Validate ``stored`` against its format and lay it out for the kernel on ``device``.

    With ``non_blocking`` and ``stored`` in pinned host memory, the copies (and the layout
    work after them) are only queued on the current CUDA stream: a transition can prepare a
    layer on a side stream while the serving stream decodes, and install it once an event
    recorded after ``prepare`` has completed. ``stored`` must stay untouched until then.

    Raises ``ValueError`` for an unknown bit-width, an inconsistent stored tensor (the message
    names it), an unsupported device or an activation dtype the device's kernels do not take.
    """
    fmt = formats.get_format(bits)
    out_features, in_features = _stored_shape(bits, stored)
    fmt.check(stored, out_features, in_features)
    group_size = formats.w4_group_size_of(stored) if bits == 4 else None
    device = torch.device(device)
    if device.type == "cpu":
        backend, where = cpu, "CPU"
    elif device.type == "cuda":
        from morph_kernels import triton_gpu

        backend, where = triton_gpu, "GPU (Triton)"
    else:
        raise ValueError(f"no morph kernel for device {device}; expected cpu or cuda")
    if act_dtype not in backend.ACT_DTYPES:
        raise ValueError(
            f"{where} kernels take activations in {backend.ACT_DTYPES}, got {act_dtype}"
        )
    # Moved first, so the layout work (unpacking, transposes) runs on the target device.
    on_device = {name: t.to(device, non_blocking=non_blocking) for name, t in stored.items()}
    tensors = backend.prepare_tensors(bits, on_device, act_dtype)
    return PreparedWeight(bits, out_features, in_features, group_size, tensors, act_dtype)


def linear(x: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W_eff.T + bias`` over any leading dims of ``x``, in ``x``'s dtype."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {w.in_features}")
    if x.dtype != w.act_dtype:
        raise ValueError(f"x is {x.dtype}, the weight was prepared for {w.act_dtype}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    if bias is not None and tuple(bias.shape) != (w.out_features,):
        raise ValueError(f"bias must be [{w.out_features}], got {tuple(bias.shape)}")
    # SGLang passes 2-D activations: skip the reshapes then (~3.5 us per call on this CPU).
    x2d = x if x.dim() == 2 else x.reshape(-1, w.in_features)
    if x.is_cuda:
        from morph_kernels import triton_gpu

        y = triton_gpu.linear(x2d, w, bias)
    else:
        y = cpu.linear(x2d, w, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.out_features)


def warmup(w: PreparedWeight, max_tokens: int = DEFAULT_WARMUP_MAX_TOKENS) -> None:
    """Run ``w``'s kernel at every token count served up to ``max_tokens`` (decode and prefill).

    On CUDA this compiles and autotunes each token-count bucket now (call it before CUDA-graph
    capture). The CPU ops neither compile nor tune, so one decode-size call suffices there: it
    faults in the prepared tensors and proves they run.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if w.device.type == "cuda":
        from morph_kernels import triton_gpu

        triton_gpu.warmup(w, max_tokens)
    else:
        linear(torch.zeros(1, w.in_features, dtype=w.act_dtype), w)


def _stored_shape(bits: int, stored: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(out_features, in_features)`` implied by ``qweight``; the format's check does the rest."""
    qweight = stored.get("qweight")
    if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
        raise ValueError("tensor 'qweight' must be a 2-D tensor")
    out_features, columns = qweight.shape
    return out_features, columns * 2 if bits == 4 else columns
