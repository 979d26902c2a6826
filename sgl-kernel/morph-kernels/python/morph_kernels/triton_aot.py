"""Ahead-of-time compilation of the GPU kernels for an NVIDIA architecture, with no GPU present.

Lowers a kernel the way the JIT does for the tensors ``triton_gpu.linear`` passes (16-byte
aligned pointers; ``N`` and ``K`` multiples of 16, as in real models; the token count never
specialized) through Triton's NVIDIA backend and the ptxas bundled with Triton, i.e. all the
way to a cubin. Triton's interpreter checks what the kernels compute; this checks that they
lower (layouts, pipelining, shared memory, register allocation). Used by the tests and by
``benchmarks/ptxas_report.py``.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from morph_kernels import triton_gpu

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# The JIT's alignment specialization ("D": divisible by 16) for aligned pointers and sizes.
_DIVISIBLE_BY_16 = [["tt.divisibility", 16]]


def compile_kernel(
    bits: int,
    config: triton.Config,
    *,
    act_dtype: torch.dtype = torch.bfloat16,
    group_size: int = 128,
    input_scale: bool = False,
    capability: int = 90,
):
    """The compiled kernel (``.asm["ptx"]``, ``.metadata.shared``, ...) for one configuration."""
    act = _TRITON_DTYPES[act_dtype]
    types = {"x_ptr": f"*{act}", "y_ptr": f"*{act}", "s_ptr": "*bf16", "ws_ptr": "*fp32",
             "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32"}
    constexprs = dict(config.kwargs)
    if bits == 8:
        fn = triton_gpu._w8a16_kernel
        types["q_ptr"] = "*i8"
    else:
        fn = triton_gpu._w4a16_kernel
        types.update(q_ptr="*i32", z_ptr="*u8")
        constexprs["GROUP_SIZE"] = group_size
        if input_scale:
            types["inv_ptr"] = f"*{act}"
        else:
            constexprs["inv_ptr"] = None
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {
        (i,): _DIVISIBLE_BY_16
        for i, name in enumerate(fn.arg_names)
        if name in ("N", "K") or (name.endswith("_ptr") and name in types)
    }
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
