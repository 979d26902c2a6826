"""CPU path: torch's weight-only int8 / int4 matmul ops.

Layouts (``PreparedWeight.tensors``):

- W8: ``qweight`` int8 ``[out, in16]``, ``scales`` ``[out]`` in the activation dtype
  (``torch._weight_int8pack_mm`` requires scales in ``x``'s dtype). ``in16`` is ``in``
  rounded up to a multiple of 16 with zero columns, and ``x`` is zero-padded to match: torch
  2.14.1's bf16 kernel reads K in blocks of 16 with no tail (measured: garbage for one token
  and a segfault for more when ``in % 16 != 0``). Real models' ``in`` needs no padding.
- W4: ``qweight_int4pack`` uint8 ``[out16, in // 2]``, torch's CPU int4 layout made by
  ``torch._convert_weight_to_int4pack_for_cpu`` from the unpacked 0..15 values;
  ``scales_and_zeros`` ``[in // g, out16, 2]`` in the activation dtype; optionally
  ``input_scale_inv`` ``[in]`` in the activation dtype. ``out16`` is ``out`` rounded up to a
  multiple of 16 (the op packs output channels in blocks of 16); the padded channels are
  all-zero and their outputs are dropped.

Both ops take bf16, fp16 and fp32 activations (checked on torch 2.14.1), but with fp32
activations they are far slower than a float32 ``F.linear`` (measured on this AVX2 CPU, one
thread, 576 -> 1536: W4 2 ms for one token, 33 ms for 16, 277 ms for 128, against 0.1, 0.6 and
3.5 ms dense), so fp32 takes the dequantize path instead:

- fp32 (``DEQUANTIZE_ACT_DTYPES``): W8 ``qweight`` int8 ``[out, in]`` as stored; W4
  ``qweight_planar`` uint8 ``[out, in // 2]``, the nibbles re-packed planar (column ``j`` in
  the low nibble of byte ``j``, column ``j + in // 2`` in the high one, so unpacking is one
  concatenation: 3x faster than interleaving, measured); scales (and W4 zeros) float32 shaped
  to broadcast over the weight (``[out, 1]``; ``[out, in // g, 1]``); optionally
  ``input_scale_inv`` ``[in]`` float32. Each call dequantizes the weight into a float32
  temporary with ``formats.dequantize``'s operations in its order (AWQ's input scale goes on
  ``x``, as on the packed path) and runs ``F.linear``: two or three passes over ``out x in``
  elements per call (``benchmarks/bench_cpu.py --act float32``). The resident bytes stay the
  quantized ones; the temporary lives for one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from sglang_morph.engines import formats

if TYPE_CHECKING:
    from morph_kernels import PreparedWeight

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Served by dequantize + F.linear rather than torch's packed ops (module docstring).
DEQUANTIZE_ACT_DTYPES = (torch.float32,)
# torch's CPU int4 op packs the output channels in blocks of this many.
INT4PACK_OUT_MULTIPLE = 16
# torch's bf16 int8 op reads the input features in blocks of this many (module docstring).
INT8PACK_IN_MULTIPLE = 16
# Zero point of torch's int4 convention: w = (q - 8) * scale + zero.
_TORCH_INT4_MIDPOINT = 8


def prepare_tensors(
    bits: int, stored: dict[str, torch.Tensor], act_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    if act_dtype in DEQUANTIZE_ACT_DTYPES:
        return _prepare_dequantize(bits, stored)
    return packed_tensors(bits, stored, act_dtype)


def packed_tensors(
    bits: int, stored: dict[str, torch.Tensor], act_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The packed ops' layout (what bf16/fp16 use; ``packed_linear`` runs it)."""
    if bits == 8:
        pad_columns = -stored["qweight"].shape[1] % INT8PACK_IN_MULTIPLE
        return {
            "qweight": F.pad(stored["qweight"], (0, pad_columns)).contiguous(),
            "scales": stored["scales"].to(act_dtype).contiguous(),
        }
    q = formats.unpack_w4(stored["qweight"]).to(torch.int32)
    pad_rows = -q.shape[0] % INT4PACK_OUT_MULTIPLE
    scales = stored["scales"].float().t()  # [in // g, out]
    zeros = stored["zeros"].float().t()
    # Ours is (q - z) * s = (q - 8) * s + (8 - z) * s: torch's form with zero = (8 - z) * s,
    # computed in fp32 and rounded once to the activation dtype.
    scales_and_zeros = torch.stack([scales, (_TORCH_INT4_MIDPOINT - zeros) * scales], dim=-1)
    tensors = {
        "qweight_int4pack": torch._convert_weight_to_int4pack_for_cpu(
            F.pad(q, (0, 0, 0, pad_rows)), 1
        ),
        "scales_and_zeros": F.pad(scales_and_zeros, (0, 0, 0, pad_rows)).to(act_dtype).contiguous(),
    }
    if "input_scale" in stored:
        tensors["input_scale_inv"] = (1.0 / stored["input_scale"].float()).to(act_dtype)
    return tensors


def _prepare_dequantize(bits: int, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bits == 8:
        return {
            "qweight": stored["qweight"].contiguous(),
            "scales": stored["scales"].float()[:, None].contiguous(),
        }
    q = formats.unpack_w4(stored["qweight"])
    half = q.shape[1] // 2
    tensors = {
        # Column j's value in the low nibble of byte j, column j + in/2's in the high one:
        # unpacking is then one concatenation (3x faster than interleaving, measured).
        "qweight_planar": (q[:, :half] | (q[:, half:] << 4)).contiguous(),
        "zeros": stored["zeros"].float()[..., None].contiguous(),
        "scales": stored["scales"].float()[..., None].contiguous(),
    }
    if "input_scale" in stored:
        tensors["input_scale_inv"] = 1.0 / stored["input_scale"].float()
    return tensors


def _dequantize_linear(
    x2d: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    t = w.tensors
    if w.bits == 8:
        weight = t["qweight"].to(torch.float32).mul_(t["scales"])
    else:
        input_scale_inv = t.get("input_scale_inv")
        if input_scale_inv is not None:
            x2d = x2d * input_scale_inv
        n_groups = t["scales"].shape[1]
        planar = t["qweight_planar"]
        weight = (
            torch.cat([planar & 0x0F, planar >> 4], dim=1)
            .to(torch.float32)
            .view(w.out_features, n_groups, w.in_features // n_groups)
            .sub_(t["zeros"])
            .mul_(t["scales"])
            .view(w.out_features, w.in_features)
        )
    return F.linear(x2d, weight, bias)


def linear(x2d: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if w.act_dtype in DEQUANTIZE_ACT_DTYPES:
        return _dequantize_linear(x2d, w, bias)
    return packed_linear(x2d, w, bias)


def packed_linear(
    x2d: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """torch's packed ops on ``packed_tensors``' layout (what bf16/fp16 use)."""
    t = w.tensors
    x2d = x2d.contiguous()  # both ops require a contiguous last dim
    if w.bits == 8:
        pad_columns = t["qweight"].shape[1] - w.in_features
        if pad_columns:
            x2d = F.pad(x2d, (0, pad_columns))
        y = torch._weight_int8pack_mm(x2d, t["qweight"], t["scales"])
    else:
        input_scale_inv = t.get("input_scale_inv")
        if input_scale_inv is not None:
            x2d = x2d * input_scale_inv
        y = torch._weight_int4pack_mm_for_cpu(
            x2d, t["qweight_int4pack"], w.group_size, t["scales_and_zeros"]
        )
        if y.shape[1] != w.out_features:
            y = y[:, : w.out_features].contiguous()
    if bias is not None:
        y = y + bias
    return y
