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

Both ops take bf16, fp16 and fp32 activations (checked on torch 2.14.1), so no case falls
back to dequantize-then-matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from sglang_morph.engines import formats

if TYPE_CHECKING:
    from morph_kernels import PreparedWeight

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch's CPU int4 op packs the output channels in blocks of this many.
INT4PACK_OUT_MULTIPLE = 16
# torch's bf16 int8 op reads the input features in blocks of this many (module docstring).
INT8PACK_IN_MULTIPLE = 16
# Zero point of torch's int4 convention: w = (q - 8) * scale + zero.
_TORCH_INT4_MIDPOINT = 8


def prepare_tensors(
    bits: int, stored: dict[str, torch.Tensor], act_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
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


def linear(x2d: torch.Tensor, w: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
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
