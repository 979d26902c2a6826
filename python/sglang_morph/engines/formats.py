"""Weight-only quantization formats of the per-layer precision variants ("layer engines").

A format turns one linear's full-precision weight ``[out_features, in_features]`` into the
tensors that are stored on disk *and installed on the device as they are*, so the bytes a
variant occupies are ``device_bytes(tensors)`` exactly. ``dequantize`` gives the effective
weight ``W_eff`` with ``y = x @ W_eff.T``: it is the reference every kernel is tested against.

Stored tensors (names are the keys of the returned dict):

- ``w8``: ``qweight`` int8 ``[out, in]`` (symmetric, -127..127), ``scales`` bf16 ``[out]``;
  ``W_eff = qweight * scales[:, None]``.
- ``w4``: ``qweight`` uint8 ``[out, in // 2]`` (column ``2j`` in the low nibble, ``2j + 1`` in
  the high nibble), ``scales`` bf16 ``[out, in // g]``, ``zeros`` uint8 ``[out, in // g]``
  (0..15), optionally ``input_scale`` bf16 ``[in]`` (AWQ: the weight was quantized as
  ``W * input_scale`` and the activation is divided by it);
  ``W_eff = ((q - zeros) * scales) / input_scale[None, :]`` with ``q``, ``zeros``, ``scales``
  broadcast over groups of ``g`` consecutive input columns.

Scales are bf16 because that is the activation dtype the default model is served in and what
the CPU int4/int8 kernels take; they are computed in float32 first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from sglang_morph.config import FULL_PRECISION_BITS

Tensors = dict[str, torch.Tensor]
SCALE_DTYPE = torch.bfloat16
# Group sizes the W4 kernels support, largest (cheapest in scale bytes) first.
W4_GROUP_SIZES = (128, 64, 32)


def device_bytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def w4_group_size(in_features: int, preferred: int | None = None) -> int:
    """Group 128 where it divides ``in_features``, else the largest of 64 or 32 that does.

    ``preferred`` (from a recipe) overrides the choice when it divides ``in_features``.
    """
    if preferred is not None:
        if preferred not in W4_GROUP_SIZES or in_features % preferred:
            raise ValueError(
                f"W4 group size {preferred} must be one of {W4_GROUP_SIZES} and divide "
                f"in_features={in_features}"
            )
        return preferred
    for g in W4_GROUP_SIZES:
        if in_features % g == 0:
            return g
    raise ValueError(f"no W4 group size in {W4_GROUP_SIZES} divides in_features={in_features}")


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One weight-only format. Invariant: ``dequantize(quantize(w))`` has ``w``'s shape and

    ``check(quantize(w), *w.shape)`` passes.
    """

    name: str
    bits: int
    quantize: Callable[..., Tensors]
    dequantize: Callable[[Tensors], torch.Tensor]
    check: Callable[[Tensors, int, int], None]


# ---- W8: per-output-channel symmetric int8 ---------------------------------------------------


def _quantize_w8(weight: torch.Tensor, **_unused) -> Tensors:
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(SCALE_DTYPE)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q.contiguous(), "scales": scales.contiguous()}


def _dequantize_w8(t: Tensors) -> torch.Tensor:
    return t["qweight"].float() * t["scales"].float()[:, None]


def _check_w8(t: Tensors, out_features: int, in_features: int) -> None:
    _expect(t, "qweight", torch.int8, (out_features, in_features))
    _expect(t, "scales", SCALE_DTYPE, (out_features,))
    _no_extra(t, {"qweight", "scales"})


# ---- W4: group-wise asymmetric int4, two values per byte --------------------------------------


def _quantize_w4(
    weight: torch.Tensor,
    *,
    group_size: int | None = None,
    input_scale: torch.Tensor | None = None,
) -> Tensors:
    out_features, in_features = weight.shape
    g = w4_group_size(in_features, group_size)
    w = weight.detach().float()
    if input_scale is not None:
        # Rounded to its stored dtype first, so quantization sees exactly what the kernel divides.
        input_scale = input_scale.to(SCALE_DTYPE)
        w = w * input_scale.float()[None, :]
    groups = w.view(out_features, in_features // g, g)
    w_min = groups.amin(dim=-1).clamp(max=0.0)  # keep 0 representable: zero-padding stays exact
    w_max = groups.amax(dim=-1).clamp(min=0.0)
    scales = ((w_max - w_min) / 15.0).clamp(min=1e-8).to(SCALE_DTYPE)
    zeros = torch.round(-w_min / scales.float()).clamp(0, 15)
    q = torch.round(groups / scales.float()[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).to(torch.uint8).view(out_features, in_features)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    out = {
        "qweight": packed.contiguous(),
        "scales": scales.contiguous(),
        "zeros": zeros.to(torch.uint8).contiguous(),
    }
    if input_scale is not None:
        out["input_scale"] = input_scale.contiguous()
    return out


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """``[out, in // 2]`` uint8 -> ``[out, in]`` uint8 values 0..15."""
    low = qweight & 0x0F
    high = qweight >> 4
    return torch.stack([low, high], dim=-1).view(qweight.shape[0], qweight.shape[1] * 2)


def _dequantize_w4(t: Tensors) -> torch.Tensor:
    q = unpack_w4(t["qweight"]).float()
    out_features, in_features = q.shape
    n_groups = t["scales"].shape[1]
    g = in_features // n_groups
    groups = q.view(out_features, n_groups, g)
    w = (groups - t["zeros"].float()[..., None]) * t["scales"].float()[..., None]
    w = w.view(out_features, in_features)
    if "input_scale" in t:
        w = w / t["input_scale"].float()[None, :]
    return w


def _check_w4(t: Tensors, out_features: int, in_features: int) -> None:
    if in_features % 2:
        raise ValueError(f"W4 needs an even in_features, got {in_features}")
    _expect(t, "qweight", torch.uint8, (out_features, in_features // 2))
    scales = t.get("scales")
    if scales is None or scales.dim() != 2 or scales.shape[0] != out_features:
        raise ValueError(f"W4 scales must be [{out_features}, in_features // group]")
    n_groups = scales.shape[1]
    if n_groups == 0 or in_features % n_groups or (in_features // n_groups) not in W4_GROUP_SIZES:
        raise ValueError(f"W4 scales imply a group size not in {W4_GROUP_SIZES}")
    _expect(t, "scales", SCALE_DTYPE, (out_features, n_groups))
    _expect(t, "zeros", torch.uint8, (out_features, n_groups))
    if "input_scale" in t:
        _expect(t, "input_scale", SCALE_DTYPE, (in_features,))
    _no_extra(t, {"qweight", "scales", "zeros", "input_scale"})


def w4_group_size_of(t: Tensors) -> int:
    return t["qweight"].shape[1] * 2 // t["scales"].shape[1]


# ---- registry --------------------------------------------------------------------------------


def _expect(t: Tensors, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if name not in t:
        raise ValueError(f"missing tensor {name!r}")
    if t[name].dtype != dtype or tuple(t[name].shape) != tuple(shape):
        raise ValueError(
            f"tensor {name!r} is {t[name].dtype} {tuple(t[name].shape)}, expected {dtype} {shape}"
        )


def _no_extra(t: Tensors, allowed: set[str]) -> None:
    extra = set(t) - allowed
    if extra:
        raise ValueError(f"unexpected tensors {sorted(extra)}")


FORMATS: dict[int, QuantFormat] = {
    8: QuantFormat("w8", 8, _quantize_w8, _dequantize_w8, _check_w8),
    4: QuantFormat("w4", 4, _quantize_w4, _dequantize_w4, _check_w4),
}


def get_format(bits: int) -> QuantFormat:
    """The format for ``bits``; a clear error for a bit-width without one."""
    if bits not in FORMATS:
        raise ValueError(
            f"unknown bit-width {bits}: built variants exist for {sorted(FORMATS)} "
            f"({FULL_PRECISION_BITS} means full precision)"
        )
    return FORMATS[bits]
