"""GPU path: Triton W8A16 and W4A16 GEMMs (fp16/bf16 activations, fp32 accumulation).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile; the K loop loads the quantized
weight tile, dequantizes it in registers and feeds ``tl.dot`` (one fp32 accumulator).

- W8 feeds ``q`` itself (int8 is exact in fp16/bf16) and applies the per-output-channel scale
  once, to the accumulator: no weight rounding at all.
- W4 feeds ``(q - zero) * scale`` rounded to the activation dtype (one rounding per weight,
  like a bf16 checkpoint). Scaling the fp32 partial product per K step instead would be exact,
  but needs a second ``[BLOCK_M, BLOCK_N]`` accumulator: measured with ptxas for sm_90, the
  128x256 prefill tile then spills 328 B of registers and 64x128 needs 230 registers vs 179.

Layouts (``PreparedWeight.tensors``), the same bytes as the stored format:

- W8: ``qweight`` int8 ``[out, in]``, ``scales`` bf16 ``[out]`` (both as stored).
- W4: ``qweight`` uint8 ``[out, in // 2]`` as stored (column ``2j`` in the low nibble): a
  ``[BLOCK_N, BLOCK_K // 2]`` byte tile is a contiguous row segment per output channel, and
  ``tl.join`` + ``tl.reshape`` interleaves the two nibbles back into K order in registers.
  ``scales_t`` bf16 and ``zeros_t`` uint8 ``[in // g, out]``: transposed from the stored
  ``[out, in // g]`` so one K step reads each group's ``BLOCK_N`` values contiguously.
  Optionally ``input_scale_inv`` ``[in]`` in the activation dtype: the kernel multiplies the
  activation tile by it in fp32 and rounds once to the activation dtype.

A W4 tile never straddles a quantization group (``BLOCK_K`` divides the group size), so each
K step loads one contiguous ``BLOCK_N`` vector of scales and one of zeros.

Decode (at most ``SPLIT_K_MAX_TOKENS`` tokens) may split K across ``SPLIT_K`` programs per
output tile: a decode launch otherwise has one program per ``BLOCK_N`` outputs (4096 / 32 = 128
for an H100's 132 SMs), each streaming all of K with too few loads in flight to reach HBM
bandwidth. Each split writes its fp32 partial tile to a workspace and bumps the tile's counter;
the split that arrives last sums the partials in split order (so the result does not depend on
which one finishes last), writes the output and resets the counter to zero for the next launch.
One launch, no memset, nothing to reset between CUDA-graph replays. Invariant: at most one
launch of these kernels runs at a time per device (the counters are shared), which holds for
SGLang's single forward stream.

Autotuning is keyed on the token-count bucket (next power of two, capped), not the token
count, and the kernels do not specialize on the token count, so ``warmup`` over the buckets
leaves nothing to compile or tune while serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
import triton.testing

if TYPE_CHECKING:
    from morph_kernels import PreparedWeight

ACT_DTYPES = (torch.bfloat16, torch.float16)
# tl.dot needs at least 16 rows; smaller token counts run one masked 16-row tile.
MIN_BLOCK_M = 16
# Token counts above this share one configuration: tiles are already at their largest.
MAX_M_BUCKET = 1024

# Token counts up to this may split K (decode); larger ones have enough output tiles.
SPLIT_K_MAX_TOKENS = 16
SPLIT_K_MAX = 8
# Split-K tile counters per device (one per output tile of a decode launch).
_LOCK_SLOTS = 4096


def _config(block_m, block_n, block_k, warps, stages, split_k=1):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                          "SPLIT_K": split_k}, num_warps=warps, num_stages=stages)


# Small on purpose: every entry is compiled and timed once per bucket and weight shape.
_CONFIGS = [
    # Decode (<= 16 tokens): weight-streaming bound; trade N width against K depth, and split K
    # so that enough programs (and loads) are in flight to saturate HBM.
    _config(16, 32, 128, 4, 4),
    _config(16, 64, 128, 4, 4),
    _config(16, 128, 64, 4, 4),
    _config(16, 32, 128, 4, 4, split_k=2),
    _config(16, 32, 128, 4, 4, split_k=4),
    _config(16, 64, 128, 4, 4, split_k=4),
    _config(16, 32, 64, 4, 4, split_k=8),
    _config(16, 64, 64, 4, 4, split_k=8),
    # Small batches.
    _config(32, 64, 64, 4, 4),
    _config(64, 64, 64, 4, 4),
    # Prefill: compute bound, large tiles.
    _config(64, 128, 64, 4, 4),
    _config(128, 128, 64, 8, 3),
    _config(128, 256, 32, 8, 3),
]
_MIN_SPLIT_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in _CONFIGS if c.kwargs["SPLIT_K"] > 1)


def m_bucket(tokens: int) -> int:
    return min(triton.next_power_of_2(tokens), MAX_M_BUCKET)


def candidate_configs(bucket: int, group_size: int | None) -> list[triton.Config]:
    """The configurations timed for one bucket: no tile taller than the bucket needs, and for
    W4 ``BLOCK_K`` clamped to the group size (the kernel needs one group per K step)."""
    out: list[triton.Config] = []
    for config in _CONFIGS:
        if config.kwargs["BLOCK_M"] > max(MIN_BLOCK_M, bucket):
            continue
        if config.kwargs["SPLIT_K"] > 1 and bucket > SPLIT_K_MAX_TOKENS:
            continue
        if group_size is not None and config.kwargs["BLOCK_K"] > group_size:
            config = triton.Config(
                {**config.kwargs, "BLOCK_K": group_size},
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
        if config not in out:
            out.append(config)
    return out


def _prune(configs, named_args, **kwargs) -> list[triton.Config]:
    return candidate_configs(named_args["M_BUCKET"], kwargs.get("GROUP_SIZE"))


def _bench(kernel_call, quantiles):
    # Shorter than Triton's default 25 ms warmup + 100 ms of repetitions: warmup pays it
    # buckets x candidates x weight shapes times (11 x up to 13 x 4 per bit-width, Llama-3-8B).
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


_AUTOTUNE = dict(
    configs=_CONFIGS,
    # Key names a kernel lacks are skipped (GROUP_SIZE: W4 only); Triton adds the tensor dtypes.
    key=["M_BUCKET", "N", "K", "GROUP_SIZE"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
    # Timings are kept on disk (Triton's cache dir), so a restarted server skips the tuning.
    cache_results=True,
)


@triton.jit
def _store_output(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
                  SPLIT_K: tl.constexpr):
    """Write the ``[BLOCK_M, BLOCK_N]`` tile; with ``SPLIT_K > 1`` only the last split to
    arrive does, from every split's partial (see the module docstring)."""
    mask = mask_m[:, None] & mask_n[None, :]
    tile = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        pid_k = tl.program_id(2)
        plane = M.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * plane + tile, acc, mask=mask)
        # Every thread's partial is written before one thread publishes it (release, gpu scope).
        tl.debug_barrier()
        lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                # .cg: read L2, never a stale L1 line of another SM's partial.
                total += tl.load(ws_ptr + split * plane + tile, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + tile, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's ``[k_start, k_end)``: whole ``BLOCK_K`` steps, the last split may be
    shorter or empty (an empty split still takes part in the reduction)."""
    per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = tl.program_id(2) * per_split
    k_end = tl.minimum(k_start + per_split, K)
    return k_start, k_end


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _w8a16_kernel(
    x_ptr, q_ptr, s_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + (k_start + offs_k)[None, :]
    q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * K + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k0  # any in_features: the last K step may be partial
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        q = tl.load(q_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
        # int8 is exact in fp16/bf16. Through fp32: exact either way, and Triton's interpreter
        # (used by the CPU tests) miscompiles a direct int -> bf16 cast.
        w = q.to(tl.float32).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
    # The per-channel scale distributes over the K sum, so partials may be scaled separately.
    scales = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _store_output(acc * scales[None, :], y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n,
                  M, N, SPLIT_K)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _w4a16_kernel(
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


_w8a16_tuned = triton.autotune(**_AUTOTUNE)(_w8a16_kernel)
_w4a16_tuned = triton.autotune(**_AUTOTUNE)(_w4a16_kernel)


_locks_by_device: dict[torch.device, torch.Tensor] = {}


def _split_k_locks(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters (zero between launches). Created by the first
    ``prepare_tensors`` on the device, never during a CUDA-graph capture."""
    locks = _locks_by_device.get(device)
    if locks is None:
        locks = _locks_by_device[device] = torch.zeros(_LOCK_SLOTS, dtype=torch.int32,
                                                       device=device)
    return locks


def prepare_tensors(
    bits: int, stored: dict[str, torch.Tensor], act_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    out_features = stored["qweight"].shape[0]
    if triton.cdiv(out_features, _MIN_SPLIT_BLOCK_N) > _LOCK_SLOTS:
        raise ValueError(f"{out_features} output features exceed the split-K counters "
                         f"({_LOCK_SLOTS} tiles of {_MIN_SPLIT_BLOCK_N})")
    _split_k_locks(stored["qweight"].device)
    if bits == 8:
        return {"qweight": stored["qweight"].contiguous(), "scales": stored["scales"].contiguous()}
    tensors = {
        "qweight": stored["qweight"].contiguous(),
        "scales_t": stored["scales"].t().contiguous(),
        "zeros_t": stored["zeros"].t().contiguous(),
    }
    if "input_scale" in stored:
        tensors["input_scale_inv"] = (1.0 / stored["input_scale"].float()).to(act_dtype)
    return tensors


def linear(
    x2d: torch.Tensor,
    w: PreparedWeight,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """``x2d @ W_eff.T + bias``. ``config`` runs that one configuration without autotuning
    (tests; Triton's interpreter cannot time candidates); ``None`` autotunes."""
    tokens = x2d.shape[0]
    y = torch.empty((tokens, w.out_features), dtype=x2d.dtype, device=x2d.device)
    if tokens == 0:
        return y
    x2d = x2d.contiguous()
    t = w.tensors
    locks = _split_k_locks(x2d.device)
    if tokens <= SPLIT_K_MAX_TOKENS:
        # Sized for the largest split; the caching allocator makes it cheap and a split only
        # touches its own plane's valid rows.
        workspace = torch.empty((SPLIT_K_MAX, tokens, w.out_features), dtype=torch.float32,
                                device=x2d.device)
    else:
        workspace = locks.new_empty(1, dtype=torch.float32)  # never read: SPLIT_K is 1
    if w.bits == 8:
        tuned, plain = _w8a16_tuned, _w8a16_kernel
        weight_args = (t["qweight"], t["scales"])
        constexprs = {}
    else:
        tuned, plain = _w4a16_tuned, _w4a16_kernel
        weight_args = (t["qweight"], t["scales_t"], t["zeros_t"], t.get("input_scale_inv"))
        constexprs = {"GROUP_SIZE": w.group_size}
    args = (x2d, *weight_args, y, workspace, locks, tokens, w.out_features, w.in_features,
            m_bucket(tokens))

    def grid(meta):
        return (triton.cdiv(tokens, meta["BLOCK_M"]), triton.cdiv(w.out_features, meta["BLOCK_N"]),
                meta["SPLIT_K"])

    if config is None:
        tuned[grid](*args, **constexprs)
    else:
        plain[grid](*args, **constexprs, **config.all_kwargs())
    # Added outside the kernel so a weight has one compiled variant, which warmup covers
    # whether or not the layer has a bias.
    if bias is not None:
        y += bias
    return y


def warmup(w: PreparedWeight, max_tokens: int) -> None:
    """Tune and compile every bucket up to ``max_tokens``'s, each with its smallest token count
    (the kernels do not specialize on it, so that covers the whole bucket in the least memory)."""
    last = m_bucket(max_tokens)
    bucket = 1
    while bucket <= last:
        tokens = bucket // 2 + 1
        x = torch.zeros(tokens, w.in_features, dtype=w.act_dtype, device=w.device)
        linear(x, w)
        bucket *= 2
    torch.cuda.synchronize(w.device)
