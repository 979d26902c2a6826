"""The W4A16 kernel served before the nibble-plane GEMM, kept as the side-by-side baseline.

Its layout is the stored one (``qweight`` uint8 ``[out, in/2]``, low nibble = even column);
each K step loads a ``[BLOCK_N, BLOCK_K/2]`` byte tile, interleaves the two nibbles back into K
order in registers (``tl.join`` + ``tl.reshape``), converts every nibble int -> float and feeds
``tl.dot``. ``BLOCK_K`` never exceeds the group size. It reached 21-32% of an H100's copy
bandwidth at decode (``benchmark/results/gpu/kernels.md``). Not used by the server.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from morph_kernels import triton_gpu
from morph_kernels.triton_gpu import (MIN_BLOCK_M, SPLIT_K_MAX, SPLIT_K_MAX_TOKENS, _k_range,
                                      _split_k_locks, _store_output, m_bucket)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _previous_w4a16_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, M_BUCKET,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    tl.static_assert(GROUP_SIZE % BLOCK_K == 0, "a K step must stay inside one group")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # K is a multiple of GROUP_SIZE, hence of BLOCK_K, and so is every split: no K masks.
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + (k_start + offs_k)[None, :]
    q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * (K // 2) + (k_start // 2 + offs_kb)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        if inv_ptr is not None:
            inv = tl.load(inv_ptr + k0 + offs_k).to(tl.float32)
            x = (x.to(tl.float32) * inv[None, :]).to(x_ptr.dtype.element_ty)
        packed = tl.load(q_ptrs, mask=mask_n[:, None], other=0)
        # Byte j holds column 2j (low nibble) and 2j + 1 (high): join + reshape restores K order.
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        group = k0 // GROUP_SIZE
        zeros = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0)
        scales = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # Through fp32 (see the W8 kernel); rounded once, after the scale.
        w = (q.to(tl.int32) - zeros.to(tl.int32)[:, None]).to(tl.float32) * scales[:, None]
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
    _store_output(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N, SPLIT_K)


def candidate_configs(bucket: int, group_size: int) -> list[triton.Config]:
    """The W8 tiles with ``BLOCK_K`` clamped to the group size (one group per K step)."""
    out: list[triton.Config] = []
    for config in triton_gpu._W8_CONFIGS:
        if config.kwargs["BLOCK_M"] > max(MIN_BLOCK_M, bucket):
            continue
        if config.kwargs["SPLIT_K"] > 1 and bucket > SPLIT_K_MAX_TOKENS:
            continue
        kwargs = {**config.kwargs, "BLOCK_K": min(config.kwargs["BLOCK_K"], group_size)}
        config = triton.Config(kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
        if config not in out:
            out.append(config)
    return out


_tuned = triton.autotune(
    configs=triton_gpu._W8_CONFIGS,
    key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": lambda configs, named_args, **kw: candidate_configs(
        named_args["M_BUCKET"], kw["GROUP_SIZE"])},
    do_bench=lambda call, quantiles: triton.testing.do_bench(call, warmup=5, rep=20,
                                                             quantiles=quantiles),
)(_previous_w4a16_kernel)


def prepare(stored: dict[str, torch.Tensor], act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Its layout from the stored tensors (on their device)."""
    _split_k_locks(stored["qweight"].device)
    tensors = {"qweight": stored["qweight"].contiguous(),
               "scales_t": stored["scales"].t().contiguous(),
               "zeros_t": stored["zeros"].t().contiguous()}
    if "input_scale" in stored:
        tensors["input_scale_inv"] = (1.0 / stored["input_scale"].float()).to(act_dtype)
    return tensors


def linear(x2d: torch.Tensor, t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """``x2d @ W_eff.T`` with the previous kernel, autotuned per token-count bucket."""
    tokens, k = x2d.shape
    n = t["qweight"].shape[0]
    y = torch.empty((tokens, n), dtype=x2d.dtype, device=x2d.device)
    locks = _split_k_locks(x2d.device)
    workspace = torch.empty((SPLIT_K_MAX, tokens, n) if tokens <= SPLIT_K_MAX_TOKENS else (1,),
                            dtype=torch.float32, device=x2d.device)

    def grid(meta):
        return (triton.cdiv(tokens, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]),
                meta["SPLIT_K"])

    _tuned[grid](x2d, t["qweight"], t["scales_t"], t["zeros_t"], t.get("input_scale_inv"), y,
                 workspace, locks, tokens, n, k, m_bucket(tokens), GROUP_SIZE=group_size)
    return y
