"""Triton W8A16/W4A16 kernels at Llama-3-8B shapes: correctness and speed against bf16 cuBLAS.

    python -m benchmark.gpu.kernels            # on the device machine (needs CUDA + Triton)

For each decoder linear of Llama-3-8B (hidden 4096, intermediate 14336, fused qkv 6144 and
gate_up 28672 outputs), random weights quantized with our formats (W8 per channel; W4 group 128
with an AWQ input scale, as served), and token counts from decode (1, 8, 16) to prefill (512,
2048):

- error of ``morph_kernels.linear`` against ``x.float() @ dequantize(W).T`` (relative Frobenius
  norm; fresh random inputs per check; the output is poisoned with NaN first, so an unwritten
  element fails),
- time per call as served: calls captured in a CUDA graph (no launch gaps; SGLang decodes
  in CUDA graphs) over enough copies of the weight, one after the other, that together they
  are 4x the L2 cache (every call streams its weight from HBM, as successive layers do);
  median of 5 replays. For the autotuned kernel, the best configuration without split-K and
  with it (decode), and ``F.linear`` on the bf16 weight (cuBLAS),
- decode: bytes moved (quantized weight + activations + output) per second against the
  device-to-device copy bandwidth measured in the same run (the memory roofline);
  prefill: TFLOP/s.
"""

from __future__ import annotations

import argparse
import math

import morph_kernels
import torch
import torch.nn.functional as F
from morph_kernels import triton_gpu
from sglang_morph.engines import formats

from benchmark.gpu.common import (device_info, measured_copy_bytes_per_s, spec_hbm_bytes_per_s,
                                  table, write_results)

# in_features, out_features
LLAMA3_8B_LINEARS = {
    "qkv_proj": (4096, 6144),
    "o_proj": (4096, 4096),
    "gate_up_proj": (4096, 28672),
    "down_proj": (14336, 4096),
}
DECODE_TOKENS = (1, 8, 16)
PREFILL_TOKENS = (512, 2048)
VARIANTS = {"w8": (8, None, False), "w4_g128_awq": (4, 128, True)}


def make_stored(bits, group_size, input_scale, in_features, out_features, gen, device="cuda"):
    weight = torch.randn(out_features, in_features, generator=gen, device=device) * 0.02
    if bits == 8:
        return formats.get_format(8).quantize(weight)
    scale = (torch.rand(in_features, generator=gen, device=device) * 1.5 + 0.5 if input_scale
             else None)
    return formats.get_format(4).quantize(weight, group_size=group_size, input_scale=scale)


def copies_for_cold_l2(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(64, math.ceil(4 * l2 / nbytes)))


def graph_ms(calls: list) -> float:
    """Median time per call of ``calls`` (closures) replayed in one CUDA graph."""
    for call in calls:
        call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]


def weight_copies(w, n: int) -> list:
    return [w] + [morph_kernels.PreparedWeight(w.bits, w.out_features, w.in_features,
                                               w.group_size,
                                               {k: v.clone() for k, v in w.tensors.items()},
                                               w.act_dtype) for _ in range(n - 1)]


def relative_error(w, stored, bits, tokens, gen) -> float:
    x = torch.randn(tokens, w.in_features, generator=gen, device="cuda").to(torch.bfloat16)
    ref = F.linear(x.float(), formats.get_format(bits).dequantize(stored).float())
    y = morph_kernels.linear(x, w).float()
    if not torch.isfinite(y).all():
        return math.inf
    return (torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)).item()


def run(args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    info = device_info()
    copy_bps = measured_copy_bytes_per_s()
    rows = []
    for variant, (bits, group_size, input_scale) in VARIANTS.items():
        for name, (k, n) in LLAMA3_8B_LINEARS.items():
            stored = make_stored(bits, group_size, input_scale, k, n, gen)
            w = morph_kernels.prepare(bits, stored, device="cuda", act_dtype=torch.bfloat16)
            w_bf16 = formats.get_format(bits).dequantize(stored).to(torch.bfloat16)
            tuned = triton_gpu._w8a16_tuned if bits == 8 else triton_gpu._w4a16_tuned
            ws = weight_copies(w, copies_for_cold_l2(w.device_bytes))
            ws_bf16 = [w_bf16] + [w_bf16.clone() for _ in range(
                copies_for_cold_l2(w_bf16.numel() * 2) - 1)]
            for tokens in DECODE_TOKENS + PREFILL_TOKENS:
                x = torch.randn(tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
                morph_kernels.linear(x, w)  # autotunes this bucket
                chosen = tuned.best_config.kwargs
                errors = [relative_error(w, stored, bits, tokens, gen) for _ in range(2)]
                t_ms = graph_ms([lambda c=c: morph_kernels.linear(x, c) for c in ws])
                t_bf16_ms = graph_ms([lambda c=c: F.linear(x, c) for c in ws_bf16])
                row = {
                    "variant": variant, "linear": name, "in": k, "out": n, "tokens": tokens,
                    "config": chosen, "max_rel_error": max(errors),
                    "ms": t_ms, "bf16_cublas_ms": t_bf16_ms,
                    "speedup_vs_bf16": t_bf16_ms / t_ms,
                    "weight_bytes": w.device_bytes,
                }
                moved = w.device_bytes + 2 * tokens * (k + n)
                row["bytes_moved"] = moved
                row["bytes_per_s"] = moved / (t_ms * 1e-3)
                row["roofline_fraction"] = row["bytes_per_s"] / copy_bps
                row["bf16_roofline_fraction"] = (2 * n * k + 2 * tokens * (k + n)) / (
                    t_bf16_ms * 1e-3) / copy_bps
                row["tflops"] = 2 * tokens * n * k / (t_ms * 1e-3) / 1e12
                row["bf16_tflops"] = 2 * tokens * n * k / (t_bf16_ms * 1e-3) / 1e12
                if tokens in DECODE_TOKENS and not args.skip_configs:
                    per_config = {}
                    for config in triton_gpu.candidate_configs(triton_gpu.m_bucket(tokens),
                                                               group_size):
                        per_config[str(config.kwargs)] = graph_ms(
                            [lambda c=c, cfg=config: triton_gpu.linear(x, c, None, cfg)
                             for c in ws])
                    no_split = {c: t for c, t in per_config.items() if "'SPLIT_K': 1}" in c}
                    split = {c: t for c, t in per_config.items() if c not in no_split}
                    row["best_no_split_ms"] = min(no_split.values())
                    row["best_split_ms"] = min(split.values()) if split else None
                    row["per_config_ms"] = per_config
                rows.append(row)
                print(f"{variant} {name} {tokens:5d} tok: {t_ms * 1e3:8.1f} us "
                      f"(bf16 {t_bf16_ms * 1e3:8.1f} us) err {max(errors):.1e} "
                      f"roofline {row['roofline_fraction']:.0%} {chosen}", flush=True)
            del w, w_bf16, stored, ws, ws_bf16
            torch.cuda.empty_cache()
    return {"device": info, "copy_bytes_per_s": copy_bps,
            "spec_hbm_bytes_per_s": spec_hbm_bytes_per_s(info["gpu"]), "rows": rows}


def markdown(result: dict) -> str:
    d = result["device"]
    copy = result["copy_bytes_per_s"]
    out = [f"# Triton W8A16 / W4A16 kernels at Llama-3-8B shapes\n",
           f"{d['gpu']} ({d['sm_count']} SMs), torch {d['torch']} (CUDA {d['cuda']}), Triton "
           f"{d['triton']}, commit {d['commit']}. Roofline: device-to-device copy measured in the "
           f"same run, {copy / 1e12:.2f} TB/s (read + write)"
           + (f"; spec {result['spec_hbm_bytes_per_s'] / 1e12:.2f} TB/s" if
              result["spec_hbm_bytes_per_s"] else "") + ".\n",
           "\n## Decode (weight-streaming bound)\n",
           "Time per call inside a CUDA graph, over weight copies totalling 4x the L2 cache "
           "(every call reads its weight from HBM); median of 5 replays. Roofline share = "
           "(quantized weight + activation + output bytes) / time / copy bandwidth.\n\n"]
    dec = [r for r in result["rows"] if r["tokens"] in DECODE_TOKENS]
    out.append(table(
        ["variant", "linear", "tokens", "us", "roofline", "no split-K us", "split-K us",
         "bf16 cuBLAS us", "bf16 roofline", "x bf16", "rel. error", "config (M,N,K,split)"],
        [[r["variant"], r["linear"], r["tokens"], f"{r['ms'] * 1e3:.1f}",
          f"{r['roofline_fraction']:.0%}",
          f"{r['best_no_split_ms'] * 1e3:.1f}" if "best_no_split_ms" in r else "",
          f"{r['best_split_ms'] * 1e3:.1f}" if r.get("best_split_ms") else "",
          f"{r['bf16_cublas_ms'] * 1e3:.1f}", f"{r['bf16_roofline_fraction']:.0%}",
          f"{r['speedup_vs_bf16']:.2f}", f"{r['max_rel_error']:.1e}",
          ",".join(str(r["config"][k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K"))]
         for r in dec]))
    out.append("\n## Prefill (compute bound)\n\n")
    pre = [r for r in result["rows"] if r["tokens"] in PREFILL_TOKENS]
    out.append(table(
        ["variant", "linear", "tokens", "us", "TFLOP/s", "bf16 cuBLAS us", "bf16 TFLOP/s",
         "x bf16", "rel. error"],
        [[r["variant"], r["linear"], r["tokens"], f"{r['ms'] * 1e3:.1f}", f"{r['tflops']:.0f}",
          f"{r['bf16_cublas_ms'] * 1e3:.1f}", f"{r['bf16_tflops']:.0f}",
          f"{r['speedup_vs_bf16']:.2f}", f"{r['max_rel_error']:.1e}"] for r in pre]))
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-configs", action="store_true",
                    help="do not time every decode configuration (faster)")
    args = ap.parse_args()
    result = run(args)
    write_results("kernels", result, markdown(result))


if __name__ == "__main__":
    main()
