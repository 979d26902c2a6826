"""GPU path: Triton W8A16 and W4A16 GEMMs (fp16/bf16 activations, fp32 accumulation).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile; the K loop loads the quantized
weight tile, dequantizes it in registers and feeds ``tl.dot`` (one fp32 accumulator).

- W8 feeds ``q`` itself (int8 is exact in fp16/bf16) and applies the per-output-channel scale
  once, to the accumulator: no weight rounding at all.
- W4 feeds ``(q - zero) * scale`` rounded to the activation dtype (one rounding per weight,
  like a bf16 checkpoint, the same bits as ``formats.dequantize(stored).to(dtype)``).

Layouts (``PreparedWeight.tensors``), the same bytes as the stored format:

- W8: ``qweight`` int8 ``[out, in]``, ``scales`` bf16 ``[out]`` (both as stored).
- W4: ``qweight_t`` int32 ``[in // 8, out]``: the stored bytes read as little-endian words and
  transposed, so word ``(j, n)`` holds input columns ``8j .. 8j + 7`` of output ``n``, column
  ``8j + p`` in nibble ``p`` (GemLite's 32-bit packing). ``scales_t`` bf16 and ``zeros_t``
  uint8 ``[in // g, out]``. Optionally ``input_scale_inv`` ``[in]`` in the activation dtype:
  the activation is multiplied by it in fp32 and rounded once to the activation dtype.

The W4 GEMM loads ``BLOCK_K / 8`` word rows per K step and runs one dot per nibble plane ``p``
against the activation columns ``8j + p`` (split out of one contiguous activation load in
registers), so no nibbles are interleaved in registers. A nibble becomes a float without an
int -> float conversion (the 2^23 magic below). With ``SWAP`` the dot is transposed so the
weight is the MMA's first operand, which Hopper's wgmma takes from registers: the weight tile
goes global -> shared (cp.async, pipelined) -> registers, is dequantized there in the MMA's
operand layout, and never returns to shared memory.

W4 has a second backend on the same tensors (``W4_BACKENDS``): the weight dequantized for
cuBLAS (prefill). ``warmup`` times both per bucket and weight shape and ``linear`` runs the
faster.

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

import os
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


def _config(block_m, block_n, block_k, warps, stages, split_k=1, **extra):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                          "SPLIT_K": split_k, **extra}, num_warps=warps, num_stages=stages)


# Small on purpose: every entry is compiled and timed once per bucket and weight shape.
_W8_CONFIGS = [
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
# W4: BLOCK_K is 128 or 256 (16 or 32 words per nibble plane, the dot's K >= 16) whatever the
# group size. SWAP puts the weight in the MMA's register operand (decode: the tokens are its
# N = 16); prefill tiles try both.
_W4_TILES = [
    _config(16, 64, 128, 4, 4, SWAP=True),
    _config(16, 64, 128, 4, 4, split_k=2, SWAP=True),
    _config(16, 64, 128, 4, 4, split_k=4, SWAP=True),
    _config(16, 64, 128, 4, 4, split_k=8, SWAP=True),
    _config(16, 64, 128, 4, 6, split_k=2, SWAP=True),
    _config(16, 128, 128, 4, 4, split_k=4, SWAP=True),
    _config(32, 128, 128, 4, 4, SWAP=True),
    _config(64, 128, 128, 4, 4, SWAP=True),
]
# Each tile with the nibbles converted one at a time through fp32 (any dtype, any GPU, and
# Triton's interpreter) and two at a time in bf16x2 inline PTX (PAIRS: bf16 only); prefill
# tiles, where the conversion is not the bottleneck, in fp32 only.
_W4_CONFIGS = [
    triton.Config({**c.kwargs, "PAIRS": pairs}, num_warps=c.num_warps, num_stages=c.num_stages)
    for c in _W4_TILES for pairs in (False, True)
] + [
    _config(128, 128, 128, 8, 3, SWAP=True),
    _config(128, 128, 128, 8, 3, SWAP=False),
    _config(128, 256, 128, 8, 3, SWAP=False),
]
_MIN_SPLIT_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in _W8_CONFIGS + _W4_CONFIGS
                         if c.kwargs["SPLIT_K"] > 1)


def m_bucket(tokens: int) -> int:
    return min(triton.next_power_of_2(tokens), MAX_M_BUCKET)


def configs_for(bits: int) -> list[triton.Config]:
    return _W8_CONFIGS if bits == 8 else _W4_CONFIGS


def candidate_configs(bucket: int, group_size: int | None,
                      act_dtype: torch.dtype = torch.bfloat16) -> list[triton.Config]:
    """The configurations timed for one bucket (``group_size`` None: W8, else W4): no tile
    taller than the bucket needs, split-K only for decode, the bf16x2 conversion only for bf16
    activations on a GPU (Triton's interpreter runs no inline assembly)."""
    pairs_ok = act_dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"
    return [
        config for config in configs_for(8 if group_size is None else 4)
        if config.kwargs["BLOCK_M"] <= max(MIN_BLOCK_M, bucket)
        and (config.kwargs["SPLIT_K"] == 1 or bucket <= SPLIT_K_MAX_TOKENS)
        and (pairs_ok or not config.kwargs.get("PAIRS"))
    ]


def _prune(configs, named_args, **kwargs) -> list[triton.Config]:
    return candidate_configs(named_args["M_BUCKET"], kwargs.get("GROUP_SIZE"),
                             named_args["x_ptr"].dtype)


# Timing for the autotuner and the W4 backend choice: calls captured in a CUDA graph, each
# after a write of an L2-sized buffer, minus a graph of the writes alone. A decode linear runs
# 10-60 us, about what launching it from Python costs, so event timing around Python calls
# (Triton's do_bench) measures the launcher; and successive layers read their weights from HBM,
# so each call starts with a cold L2.
_GRAPH_CALLS = 8
_GRAPH_REPLAYS = 3


def graph_time_ms(fn, quantiles=None):
    """Median milliseconds of one cold-L2 call of ``fn`` (see above); ``quantiles`` gives the
    list the autotuner asks for (every entry the median)."""
    fn()  # compiles and allocates outside the capture
    device = torch.cuda.current_device()
    flush = torch.empty(torch.cuda.get_device_properties(device).L2_cache_size,
                        dtype=torch.int8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = []
    for with_calls in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(_GRAPH_CALLS):
                flush.zero_()
                if with_calls:
                    fn()
        graphs.append(graph)
    spans = []
    for graph in graphs:
        times = []
        for _ in range(_GRAPH_REPLAYS):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        spans.append(sorted(times)[len(times) // 2])
    ms = max(spans[0] - spans[1], 1e-6) / _GRAPH_CALLS
    return [ms] * len(quantiles) if quantiles else ms


def _bench(kernel_call, quantiles):
    return graph_time_ms(kernel_call, quantiles)


_AUTOTUNE = dict(
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


# 2^23 as fp32 bits: OR-ing a nibble q (0..15) into the low mantissa bits gives the float
# 2^23 + q exactly, so q - zero costs one OR and one subtraction instead of an int -> float
# conversion, which GPUs run at a fraction of their fp32 rate.
_MAGIC_F32 = tl.constexpr(0x4B000000)
_MAGIC_VALUE = tl.constexpr(8388608.0)


@triton.jit
def _dequant_plane(words, p: tl.constexpr, zeros, scales, dtype: tl.constexpr):
    """Nibble ``p`` of every int32 word as ``(q - zero) * scale``, rounded once to ``dtype``.

    ``q - zero`` is exact (small integers in fp32) and so is the product (4 + 8 significant
    bits), so the one rounding is the one ``formats.dequantize(...).to(dtype)`` does."""
    q = (words >> (4 * p)) & 0xF
    v = (q | _MAGIC_F32).to(tl.float32, bitcast=True)
    return ((v - (_MAGIC_VALUE + zeros)) * scales).to(dtype)


# Two nibbles per instruction (bf16 only): OR-ing nibbles 0 and 4 of a word into 0x4300 (128 in
# bf16) gives the bf16 pair (128 + q0, 128 + q4) in one lop3; one fma.rn.bf16x2 with 1.0
# subtracts (128 + zero) exactly and one with the scale rounds (q - zero) * scale once, so the
# weights are bit-identical to the fp32 path's. fma (not sub/mul.bf16x2): valid from sm_80.
_BF16_PAIR_ASM = tl.constexpr("""{
    .reg .b32 t, one, nzero;
    mov.b32 one, 0x3F803F80;
    mov.b32 nzero, 0x80008000;
    lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xea;
    fma.rn.bf16x2 t, t, one, $3;
    fma.rn.bf16x2 t, t, $4, nzero;
    mov.b32 {$0, $1}, t;
}""")


@triton.jit
def _dequant_pair(words, p: tl.constexpr, neg_bias2, scale2):
    """Nibble planes ``p`` and ``p + 4`` as bf16 (see ``_BF16_PAIR_ASM``); ``neg_bias2`` and
    ``scale2`` are int32 bf16 pairs of ``-(128 + zero)`` and the scale."""
    return tl.inline_asm_elementwise(_BF16_PAIR_ASM, "=h,=h,r,r,r",
                                     [words >> (4 * p), neg_bias2, scale2],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _mma(acc, w, x_p, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.dot(w, tl.trans(x_p), acc)
    else:
        acc = tl.dot(x_p, w, acc)
    return acc


@triton.jit
def _x_planes(x, BLOCK_M: tl.constexpr, WORDS: tl.constexpr):
    """The columns ``8j + p`` of an ``[BLOCK_M, 8 * WORDS]`` tile, as eight ``[BLOCK_M, WORDS]``
    tiles in ``p`` order: register splits of one contiguous load (``k = 8j + 4a + 2b + c``)."""
    x = tl.reshape(x, (BLOCK_M, WORDS, 2, 2, 2))
    c0, c1 = tl.split(x)
    c0b0, c0b1 = tl.split(c0)
    c1b0, c1b1 = tl.split(c1)
    p0, p4 = tl.split(c0b0)
    p2, p6 = tl.split(c0b1)
    p1, p5 = tl.split(c1b0)
    p3, p7 = tl.split(c1b1)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _plane_dot(acc, words, p: tl.constexpr, x_p, zeros, scales, SWAP: tl.constexpr):
    """``acc += x_p @ plane_p``, or with ``SWAP`` its transpose ``plane_p^T @ x_p^T``: the
    weight is then the MMA's first operand, which Hopper's wgmma reads from registers, so the
    dequantized weights never go through shared memory."""
    return _mma(acc, _dequant_plane(words, p, zeros, scales, x_p.dtype), x_p, SWAP)


@triton.jit
def _to_meta(v, BITS: tl.constexpr):
    if BITS:  # the value's bits as int32 (bf16 scales: their 16 bits; uint8 zeros: the value)
        if v.dtype.primitive_bitwidth == 16:
            v = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            v = v.to(tl.int32)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def _group_meta(ptr, k0, offs_j, offs_n, mask_j, mask_n, N, GROUP_SIZE: tl.constexpr,
                BLOCK_K: tl.constexpr, SWAP: tl.constexpr, BITS: tl.constexpr = False):
    """This K step's scales or zeros (``[in/g, out]``) in fp32 (``BITS``: as int32 bits),
    shaped to broadcast over the word tile: one ``BLOCK_N`` vector when the step lies in one
    group, else one per word row."""
    if GROUP_SIZE >= BLOCK_K:
        v = _to_meta(tl.load(ptr + (k0 // GROUP_SIZE) * N + offs_n, mask=mask_n, other=0), BITS)
        if SWAP:
            meta = v[:, None]
        else:
            meta = v[None, :]
    else:
        groups = (k0 + 8 * offs_j) // GROUP_SIZE
        if SWAP:
            meta = _to_meta(tl.load(ptr + groups[None, :] * N + offs_n[:, None],
                                    mask=mask_n[:, None] & mask_j[None, :], other=0), BITS)
        else:
            meta = _to_meta(tl.load(ptr + groups[:, None] * N + offs_n[None, :],
                                    mask=mask_j[:, None] & mask_n[None, :], other=0), BITS)
    return meta


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _w4a16_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, M_BUCKET,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr, PAIRS: tl.constexpr = False,
):
    # Word (j, n) of q holds input columns 8j..8j+7 of output n, column 8j + p in nibble p.
    # Each K step loads BLOCK_K/8 word rows once and runs one dot per nibble plane p, against
    # the activation columns 8j + p: no nibble interleaving in registers.
    WORDS: tl.constexpr = BLOCK_K // 8
    tl.static_assert(WORDS >= 16, "each nibble plane feeds a dot with K >= 16")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, WORDS)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + (k_start + offs_k)[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        # K is a multiple of the group size (>= 32), not of BLOCK_K: the last step may be short.
        mask_k = offs_k < k_end - k0
        mask_j = offs_j < (k_end - k0) // 8
        rows = (k0 // 8 + offs_j).to(tl.int64)
        if SWAP:
            words = tl.load(q_ptr + rows[None, :] * N + offs_n[:, None],
                            mask=mask_n[:, None] & mask_j[None, :], other=0)
        else:
            words = tl.load(q_ptr + rows[:, None] * N + offs_n[None, :],
                            mask=mask_j[:, None] & mask_n[None, :], other=0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if inv_ptr is not None:
            inv = tl.load(inv_ptr + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * inv[None, :]).to(x_ptr.dtype.element_ty)
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x, BLOCK_M, WORDS)
        if PAIRS:
            zeros = _group_meta(z_ptr, k0, offs_j, offs_n, mask_j, mask_n, N, GROUP_SIZE,
                                BLOCK_K, SWAP, True)
            scales = _group_meta(s_ptr, k0, offs_j, offs_n, mask_j, mask_n, N, GROUP_SIZE,
                                 BLOCK_K, SWAP, True)
            neg_bias2 = (0xC300 | zeros) * 0x10001  # bf16 -(128 + zero), twice
            scale2 = scales * 0x10001
            w0, w4 = _dequant_pair(words, 0, neg_bias2, scale2)
            acc = _mma(_mma(acc, w0, x0, SWAP), w4, x4, SWAP)
            w1, w5 = _dequant_pair(words, 1, neg_bias2, scale2)
            acc = _mma(_mma(acc, w1, x1, SWAP), w5, x5, SWAP)
            w2, w6 = _dequant_pair(words, 2, neg_bias2, scale2)
            acc = _mma(_mma(acc, w2, x2, SWAP), w6, x6, SWAP)
            w3, w7 = _dequant_pair(words, 3, neg_bias2, scale2)
            acc = _mma(_mma(acc, w3, x3, SWAP), w7, x7, SWAP)
        else:
            zeros = _group_meta(z_ptr, k0, offs_j, offs_n, mask_j, mask_n, N, GROUP_SIZE,
                                BLOCK_K, SWAP)
            scales = _group_meta(s_ptr, k0, offs_j, offs_n, mask_j, mask_n, N, GROUP_SIZE,
                                 BLOCK_K, SWAP)
            acc = _plane_dot(acc, words, 0, x0, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 1, x1, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 2, x2, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 3, x3, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 4, x4, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 5, x5, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 6, x6, zeros, scales, SWAP)
            acc = _plane_dot(acc, words, 7, x7, zeros, scales, SWAP)
        x_ptrs += BLOCK_K
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    _store_output(out, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N, SPLIT_K)


@triton.jit
def _w4_dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, n0, n_cols,
                       GROUP_SIZE: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr):
    """``W_eff^T`` columns ``[n0, n0 + n_cols)`` (without the input scale) into ``w_ptr``
    ``[K, n_cols]``, each weight rounded once to its dtype as the GEMM kernel rounds it."""
    offs_j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_j < K // 8)[:, None] & (offs_c < n_cols)[None, :]
    cols = n0 + offs_c
    words = tl.load(q_ptr + offs_j.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
    meta = ((offs_j * 8) // GROUP_SIZE)[:, None] * N + cols[None, :]
    zeros = tl.load(z_ptr + meta, mask=mask, other=0).to(tl.float32)
    scales = tl.load(s_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    out = w_ptr + (offs_j.to(tl.int64) * 8)[:, None] * n_cols + offs_c[None, :]
    for p in tl.static_range(8):
        tl.store(out + p * n_cols, _dequant_plane(words, p, zeros, scales, w_ptr.dtype.element_ty),
                 mask=mask)

_w8a16_tuned = triton.autotune(configs=_W8_CONFIGS, **_AUTOTUNE)(_w8a16_kernel)
_w4a16_tuned = triton.autotune(configs=_W4_CONFIGS, **_AUTOTUNE)(_w4a16_kernel)


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
    # The stored bytes read as little-endian int32 hold columns 8j..8j+7 of a row, column
    # 8j + p in nibble p: transposed, the [in/8, out] layout GemLite's 32-bit packing uses.
    tensors = {
        "qweight_t": stored["qweight"].contiguous().view(torch.int32).t().contiguous(),
        "scales_t": stored["scales"].t().contiguous(),
        "zeros_t": stored["zeros"].t().contiguous(),
    }
    if "input_scale" in stored:
        tensors["input_scale_inv"] = (1.0 / stored["input_scale"].float()).to(act_dtype)
    return tensors


def _launch(x2d: torch.Tensor, w: PreparedWeight, config: triton.Config | None) -> torch.Tensor:
    """The Triton GEMM (autotuned when ``config`` is None)."""
    tokens = x2d.shape[0]
    y = torch.empty((tokens, w.out_features), dtype=x2d.dtype, device=x2d.device)
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
        weight_args = (t["qweight_t"], t["scales_t"], t["zeros_t"], t.get("input_scale_inv"))
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
    return y


# ---- W4 backends ----------------------------------------------------------------------------
#
# Both W4 backends read the same prepared tensors (no second copy of the weight):
# - "triton": the GEMM above;
# - "dequant_cublas": the weight dequantized to the activation dtype in column chunks of at
#   most DEQUANT_CHUNK_BYTES, then cuBLAS (prefill: a bf16 GEMM at the tensor cores' rate).
# ``warmup`` times both per token-count bucket and weight shape (``graph_time_ms``), checks the
# second against the first, and ``linear`` then runs the faster; unwarmed buckets run
# "triton". GemLite's kernels read this very layout too (benchmark/gpu/w4_side_by_side.py
# checks its packer gives it bit for bit) but are not a backend: measured on an H200 they were
# slower than "triton" at 8 and 16 tokens, and at 1 token (where they were faster) their error
# against the fp32 reference was 1.9e-2 to 3.5e-2, against 2.2e-3 for this GEMM.

W4_BACKENDS = ("triton", "dequant_cublas")
# Transient bf16 workspace of the dequantize path; wider weights are done in column chunks.
DEQUANT_CHUNK_BYTES = 64 << 20
# "dequant_cublas" is used only if its output is this close (relative Frobenius norm) to the
# Triton GEMM's on random activations: both differ from the fp32 reference by about 3e-3.
AGREEMENT_TOLERANCE = 2e-2

# key -> (the chosen backend, the median milliseconds of every candidate timed)
_w4_chosen: dict[tuple, tuple[str, dict[str, float]]] = {}


def _w4_key(w: PreparedWeight, tokens: int) -> tuple:
    return (w.device, w.out_features, w.in_features, w.group_size, w.act_dtype,
            "input_scale_inv" in w.tensors, m_bucket(tokens))


def _scaled_input(x2d: torch.Tensor, w: PreparedWeight) -> torch.Tensor:
    """``x * input_scale_inv`` rounded once to x's dtype, as the GEMM does per tile (torch's
    bf16/fp16 multiply computes in fp32 and rounds once: one pass, no fp32 copies of x)."""
    inv = w.tensors.get("input_scale_inv")
    return x2d if inv is None else x2d * inv


def _linear_dequant_cublas(x2d: torch.Tensor, w: PreparedWeight) -> torch.Tensor:
    t = w.tensors
    x = _scaled_input(x2d, w)
    k, n = w.in_features, w.out_features
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    chunk = max(128, DEQUANT_CHUNK_BYTES // (k * x.element_size()) // 128 * 128)
    buffer = torch.empty(k * min(chunk, n), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, chunk):
        cols = min(chunk, n - n0)
        w_t = buffer[: k * cols].view(k, cols)
        grid = (triton.cdiv(k // 8, 16), triton.cdiv(cols, 128))
        _w4_dequant_kernel[grid](t["qweight_t"], t["scales_t"], t["zeros_t"], w_t, n, k, n0, cols,
                                 GROUP_SIZE=w.group_size, BLOCK_J=16, BLOCK_N=128, num_warps=4)
        # Into the column slice of y (row stride n).
        torch.mm(x, w_t, out=y[:, n0:n0 + cols])
    return y


def _run_w4(backend: str, x2d: torch.Tensor, w: PreparedWeight) -> torch.Tensor:
    if backend == "triton":
        return _launch(x2d, w, None)
    if backend == "dequant_cublas":
        return _linear_dequant_cublas(x2d, w)
    raise ValueError(f"unknown W4 backend {backend!r}; expected one of {W4_BACKENDS}")


def choose_w4_backend(w: PreparedWeight, tokens: int) -> str:
    """Time every available backend at ``tokens`` (cold L2, median) and keep the fastest whose
    output agrees with the Triton GEMM's; the choice holds for the whole bucket and every
    weight of this shape."""
    key = _w4_key(w, tokens)
    if key in _w4_chosen:
        return _w4_chosen[key][0]
    x = torch.randn(tokens, w.in_features, device=w.device).to(w.act_dtype)
    reference = _run_w4("triton", x, w).float()
    timings = {}
    for backend in W4_BACKENDS:
        try:
            y = _run_w4(backend, x, w).float()
        except Exception:  # a backend that cannot run this shape is not a candidate
            continue
        error = torch.linalg.vector_norm(y - reference) / torch.linalg.vector_norm(reference)
        if not torch.isfinite(y).all() or error > AGREEMENT_TOLERANCE:
            continue
        timings[backend] = graph_time_ms(lambda b=backend: _run_w4(b, x, w))
    _w4_chosen[key] = (min(timings, key=timings.get), timings)
    return _w4_chosen[key][0]


def w4_choices() -> dict[tuple, tuple[str, dict[str, float]]]:
    """What ``warmup`` chose per (device, out, in, group, dtype, input scale, bucket), with the
    median milliseconds of every candidate it timed."""
    return dict(_w4_chosen)


def chosen_w4_backend(w: PreparedWeight, tokens: int) -> str | None:
    """The backend ``warmup`` chose for ``tokens``'s bucket (None: the bucket was not warmed)."""
    chosen = _w4_chosen.get(_w4_key(w, tokens))
    return chosen[0] if chosen else None


def linear(
    x2d: torch.Tensor,
    w: PreparedWeight,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``x2d @ W_eff.T + bias``. ``config`` runs that one configuration of the Triton GEMM
    without autotuning (tests; Triton's interpreter cannot time candidates); ``backend``
    forces a W4 backend; otherwise W4 runs the backend ``warmup`` chose for the bucket."""
    tokens = x2d.shape[0]
    if tokens == 0:
        return torch.empty((0, w.out_features), dtype=x2d.dtype, device=x2d.device)
    x2d = x2d.contiguous()
    if w.bits == 4 and config is None:
        backend = backend or chosen_w4_backend(w, tokens) or "triton"
        y = _run_w4(backend, x2d, w)
    else:
        y = _launch(x2d, w, config)
    # Added outside the kernels so a weight has one compiled variant, which warmup covers
    # whether or not the layer has a bias.
    if bias is not None:
        y += bias
    return y


def warmup(w: PreparedWeight, max_tokens: int) -> None:
    """Tune and compile every bucket up to ``max_tokens``'s, each with its smallest token count
    (the kernels do not specialize on it, so that covers the whole bucket in the least memory);
    for W4 also choose the bucket's backend."""
    last = m_bucket(max_tokens)
    bucket = 1
    while bucket <= last:
        tokens = bucket // 2 + 1
        if w.bits == 4:
            linear(torch.zeros(tokens, w.in_features, dtype=w.act_dtype, device=w.device), w,
                   backend=choose_w4_backend(w, tokens))
        else:
            linear(torch.zeros(tokens, w.in_features, dtype=w.act_dtype, device=w.device), w)
        bucket *= 2
    if w.device.type == "cuda":  # CPU tensors: Triton's interpreter (tests)
        torch.cuda.synchronize(w.device)
