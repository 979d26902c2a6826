"""Why the W4 decode kernel sits at ~30% of the memory roofline: three variants of it, timed.

    python -m benchmark.gpu.w4_variants      # on the device machine; results: w4_variants.{json,md}

The W4A16 kernel served until the nibble-plane GEMM (``benchmark.gpu.w4_previous``; "served"
below) moves half the bytes of W8 but takes about as long at decode. Each variant changes one suspect, at Llama-3-8B decode shapes (1 and
16 tokens, W4 group 128 with an AWQ input scale, random weights), each timed over its best
configuration in a grid (BLOCK_N x BLOCK_K x split-K x stages) inside CUDA graphs with a cold
L2, as ``benchmark.gpu.kernels`` times the served kernel:

- ``factored``: zero point and scale applied per group after the dot
  (``acc += (dot(x, q) - sum(x) * z) * s``): per weight only unpack + convert (suspect: the
  per-weight dequantization arithmetic).
- ``halves``: weights repacked so byte j of each 64-column block holds columns j and j + 32:
  the two nibbles are contiguous K halves, two dots on contiguous x halves, no interleave in
  registers (suspect: the nibble interleave).
- ``tiledBNxBK``: the served arithmetic over weights retiled so each program's
  (BLOCK_N x BLOCK_K/2)-byte tile is one contiguous block (suspect: short strided row loads,
  32-64 bytes per row and step).

Not used by the server; kept as the measurement behind the W4 roofline note in docs/gpu.md.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from morph_kernels import triton_gpu
from morph_kernels.triton_gpu import _k_range, _store_output
from sglang_morph.engines import formats

from benchmark.gpu import w4_previous
from benchmark.gpu.kernels import LLAMA3_8B_LINEARS, copies_for_cold_l2, graph_ms, make_stored
from benchmark.gpu.common import (device_info, measured_copy_bytes_per_s, table,
                                  write_results)

PACK = 64


@triton.jit(do_not_specialize=["M"])
def _factored(x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K,
              GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + (k_start + offs_k)[None, :]
    q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * (K // 2) + (k_start // 2 + offs_kb)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        inv = tl.load(inv_ptr + k0 + offs_k).to(tl.float32)
        x = (x.to(tl.float32) * inv[None, :]).to(tl.bfloat16)
        packed = tl.load(q_ptrs, mask=mask_n[:, None], other=0)
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        part = tl.dot(x, tl.trans(q.to(tl.bfloat16)))
        group = k0 // GROUP_SIZE
        zeros = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        scales = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        xsum = tl.sum(x.to(tl.float32), axis=1)
        acc += (part - xsum[:, None] * zeros[None, :]) * scales[None, :]
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
    _store_output(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _halves(x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K,
            GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # BLOCK_K == PACK: byte j of a block = column j (low) and j + BLOCK_K/2 (high).
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + (k_start + offs_h)[None, :]
    q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * (K // 2) + (k_start // 2 + offs_h)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x_lo = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_ptrs + HALF, mask=mask_m[:, None], other=0.0)
        inv_lo = tl.load(inv_ptr + k0 + offs_h).to(tl.float32)
        inv_hi = tl.load(inv_ptr + k0 + HALF + offs_h).to(tl.float32)
        x_lo = (x_lo.to(tl.float32) * inv_lo[None, :]).to(tl.bfloat16)
        x_hi = (x_hi.to(tl.float32) * inv_hi[None, :]).to(tl.bfloat16)
        packed = tl.load(q_ptrs, mask=mask_n[:, None], other=0)
        part = tl.dot(x_lo, tl.trans((packed & 0xF).to(tl.bfloat16)))
        part = tl.dot(x_hi, tl.trans((packed >> 4).to(tl.bfloat16)), part)
        group = k0 // GROUP_SIZE
        zeros = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        scales = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        xsum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        acc += (part - xsum[:, None] * zeros[None, :]) * scales[None, :]
        x_ptrs += BLOCK_K
        q_ptrs += HALF
    _store_output(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _tiled(x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K,
           GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # Served math; weights retiled at prepare time: each (BLOCK_N x BLOCK_K/2) byte tile is
    # contiguous (tiles ordered [n tile][k step]), so a step loads one contiguous block.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start, k_end = _k_range(K, BLOCK_K, SPLIT_K)
    TILE: tl.constexpr = BLOCK_N * (BLOCK_K // 2)
    steps = K // BLOCK_K
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * K + (k_start + offs_k)[None, :]
    q_ptrs = (q_ptr + (pid_n.to(tl.int64) * steps + k_start // BLOCK_K) * TILE
              + tl.arange(0, BLOCK_N)[:, None] * (BLOCK_K // 2) + offs_kb[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        inv = tl.load(inv_ptr + k0 + offs_k).to(tl.float32)
        x = (x.to(tl.float32) * inv[None, :]).to(tl.bfloat16)
        packed = tl.load(q_ptrs)
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        group = k0 // GROUP_SIZE
        zeros = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0)
        scales = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.int32) - zeros.to(tl.int32)[:, None]).to(tl.float32) * scales[:, None]
        acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
        x_ptrs += BLOCK_K
        q_ptrs += TILE
    _store_output(acc, y_ptr, ws_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N, SPLIT_K)


def retile(qweight, bn, bk):
    n, kb = qweight.shape
    t = qweight.view(n // bn, bn, kb // (bk // 2), bk // 2).permute(0, 2, 1, 3)
    return t.contiguous().view(n, kb)


def repack_halves(qweight: torch.Tensor) -> torch.Tensor:
    q = formats.unpack_w4(qweight)  # [N, K] 0..15
    n, k = q.shape
    blocks = q.view(n, k // PACK, PACK)
    lo, hi = blocks[..., : PACK // 2], blocks[..., PACK // 2:]
    return (lo | (hi << 4)).reshape(n, k // 2).contiguous()


def call(kernel, x, t, q, n, k, cfg, ws, locks):
    bm, bn, bk, sk, warps, stages = cfg
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(n, bn), sk)
    kernel[grid](x, q, t["scales_t"], t["zeros_t"], t["input_scale_inv"], y, ws, locks,
                 x.shape[0], n, k, GROUP_SIZE=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 SPLIT_K=sk, num_warps=warps, num_stages=stages)
    return y


CONFIGS = [(16, bn, bk, split, 4, stages) for bk in (64, 128) for bn in (32, 64, 128)
           for split in (1, 2, 4, 8) for stages in (3, 4)]  # (M, N, K, split-K, warps, stages)
TILES = ((32, 64), (64, 64), (128, 64), (32, 128), (64, 128), (128, 128))


def best_of(kernel, x, t, qlist, n, k, ws, locks, ref, configs) -> dict:
    """The fastest configuration that compiles, with its relative error against ``ref``."""
    best = {"ms": math.inf}
    for cfg in configs:
        try:
            y = call(kernel, x, t, qlist[0], n, k, cfg, ws, locks).float()
            ms = graph_ms([lambda q=q, cfg=cfg: call(kernel, x, t, q, n, k, cfg, ws, locks)
                           for q in qlist])
        except Exception as exc:  # noqa: BLE001 (a configuration the compiler rejects)
            print("skipped", kernel.fn.__name__, cfg, repr(exc)[:120], flush=True)
            continue
        if ms < best["ms"]:
            error = torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)
            best = {"ms": ms, "config": cfg, "rel_error": error.item()}
    return best


def run() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bps = measured_copy_bytes_per_s()
    locks = triton_gpu._split_k_locks(torch.device("cuda"))
    rows = []
    for name, (k, n) in LLAMA3_8B_LINEARS.items():
        stored = make_stored(4, 128, True, k, n, gen)
        t = w4_previous.prepare(stored, torch.bfloat16)
        weight_bytes = formats.device_bytes(t)
        copies = copies_for_cold_l2(weight_bytes)

        def with_copies(q):
            return [q] + [q.clone() for _ in range(copies - 1)]

        layouts = {"factored": (_factored, with_copies(t["qweight"]), CONFIGS),
                   "halves": (_halves, with_copies(repack_halves(t["qweight"])),
                              [c for c in CONFIGS if c[2] == PACK])}
        for bn, bk in TILES:
            layouts[f"tiled{bn}x{bk}"] = (_tiled, with_copies(retile(t["qweight"], bn, bk)),
                                          [c for c in CONFIGS if (c[1], c[2]) == (bn, bk)])
        ref_w = formats.get_format(4).dequantize(stored).float()
        served_copies = [t] + [{key: (v.clone() if key == "qweight" else v) for key, v in t.items()}
                               for _ in range(copies - 1)]
        for tokens in (1, 16):
            x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = F.linear(x.float(), ref_w)
            ws = torch.empty((8, tokens, n), dtype=torch.float32, device="cuda")
            w4_previous.linear(x, t, 128)  # autotunes the served kernel for this bucket
            moved = weight_bytes + 2 * tokens * (k + n)
            served_ms = graph_ms([lambda c=c: w4_previous.linear(x, c, 128) for c in served_copies])
            row = {"linear": name, "in": k, "out": n, "tokens": tokens, "bytes_moved": moved,
                   "served_ms": served_ms,
                   "served_roofline_fraction": moved / (served_ms * 1e-3) / copy_bps,
                   "variants": {}}
            for label, (kernel, qlist, configs) in layouts.items():
                best = best_of(kernel, x, t, qlist, n, k, ws, locks, ref, configs)
                best["roofline_fraction"] = moved / (best["ms"] * 1e-3) / copy_bps
                row["variants"][label] = best
            rows.append(row)
            print(name, tokens, f"served {served_ms * 1e3:.1f} us",
                  {lb: round(v["ms"] * 1e3, 1) for lb, v in row["variants"].items()}, flush=True)
    return {"device": device_info(), "copy_bytes_per_s": copy_bps, "rows": rows}


def markdown(result: dict) -> str:
    d = result["device"]
    labels = list(result["rows"][0]["variants"])
    lines = [f"# W4A16 decode kernel variants (why W4 is at ~30% of the roofline)\n\n"
             f"{d['gpu']}, torch {d['torch']}, Triton {d['triton']}, commit {d['commit']}; "
             f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s. Microseconds per "
             f"call (roofline share), best configuration of each variant; see "
             f"`benchmark/gpu/w4_variants.py` for what each variant changes.\n\n"]
    lines.append(table(
        ["linear", "tokens", "served", *labels],
        [[r["linear"], r["tokens"],
          f"{r['served_ms'] * 1e3:.1f} ({r['served_roofline_fraction']:.0%})",
          *(f"{r['variants'][lb]['ms'] * 1e3:.1f} ({r['variants'][lb]['roofline_fraction']:.0%})"
            for lb in labels)] for r in result["rows"]]))
    return "".join(lines)


def main() -> None:
    result = run()
    write_results("w4_variants", result, markdown(result))


if __name__ == "__main__":
    main()
