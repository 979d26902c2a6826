"""W4A16 at Llama-3-8B shapes, side by side: our kernels, GemLite, torchao's int4, bf16 cuBLAS.

    python -m benchmark.gpu.w4_side_by_side   # on the device machine; results: w4_side_by_side.json

For each fused linear of Llama-3-8B (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672,
down 14336 -> 4096), random weights quantized to our W4 format (group 128, asymmetric), at
decode (1, 8, 16 tokens) and prefill (512, 2048 tokens), every implementation is:

- checked: relative Frobenius error against ``x.float() @ W_eff.T`` in fp32 (fresh random
  activations); for the backends that read our layout also bit-exactness of the dequantized
  weight, through the kernel itself: one-hot activations (row i selects input column c_i)
  make output row i the weight column c_i, which must equal ``formats.dequantize(...)``
  rounded once to bf16 in every bit;
- timed as served: calls captured in one CUDA graph over enough copies of the weight that
  together they are 4x the L2 cache (every call streams its weight from HBM, as successive
  layers do), median of 5 replays; decode as a share of the device-to-device copy bandwidth
  measured in the same run (bytes the implementation must move: its weight tensors, the
  activations and the output), prefill in TFLOP/s; speed against bf16 cuBLAS on the same
  weight dequantized.

Implementations: ``bf16_cublas`` (``F.linear`` on the dequantized bf16 weight); ``previous``
(the W4 kernel served before, ``benchmark.gpu.w4_previous``); our backends on the served layout
(``triton``: the nibble-plane GEMM, ``dequant_cublas``); ``served``: ``morph_kernels.linear``
after ``warmup``, i.e. the backend the server picks for the bucket; ``gemlite_module``:
GemLite's own ``GemLiteLinear`` packed from the same integers (its packer must give our layout
bit for bit, recorded as ``gemlite_packer_equals_our_layout``);
``tinygemm``: ``torch.ops.aten._weight_int4pack_mm``, the kernel of torchao's int4 weight-only
tile layout; ``torchao``: torchao's ``Int4WeightOnlyConfig`` applied to an ``nn.Linear`` (its
own quantization of the same weight). A second pass with an AWQ input scale (as our variants
are served) times our backends only: the libraries have no input scale.

On GPUs GemLite ships no tuned configurations for (an H200), its H100 ones are loaded so no
autotuning runs in the measurement; ``--gemlite-config`` overrides.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import morph_kernels
import torch
import torch.nn.functional as F
from morph_kernels import triton_gpu
from sglang_morph.engines import formats

from benchmark.gpu import w4_previous
from benchmark.gpu.common import (device_info, measured_copy_bytes_per_s, out_dir,
                                  spec_hbm_bytes_per_s, table, write_results)
from benchmark.gpu.kernels import (LLAMA3_8B_LINEARS, copies_for_cold_l2, graph_ms,
                                   make_stored)

# "cpu" (with TRITON_INTERPRET=1) runs the whole script under Triton's interpreter on tiny
# shapes, every timing a single eager call: the check that it runs at all, without a GPU
# (tests/benchmark/test_w4_side_by_side.py). Its numbers mean nothing.
DEVICE = os.environ.get("W4_BENCH_DEVICE", "cuda")
LINEARS = LLAMA3_8B_LINEARS if DEVICE == "cuda" else {"qkv_proj": (256, 96),
                                                       "down_proj": (384, 64)}
DECODE_TOKENS = (1, 8, 16)
PREFILL_TOKENS = (512, 2048) if DEVICE == "cuda" else (40,)

GROUP_SIZE = 128
OURS = triton_gpu.W4_BACKENDS
# tinygemm's int4 packing has the even column in the high nibble; its zero is a bf16 offset
# with w = (q - 8) * scale + zero.
TINYGEMM_MIDPOINT = 8
TINYGEMM_INNER_K_TILES = 8


if DEVICE != "cuda":
    def _one_call_ms(fn, quantiles=None):
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return [ms] * len(quantiles) if quantiles else ms

    triton_gpu.graph_time_ms = _one_call_ms  # the autotuner's and the backend choice's timer


def prepare(stored: dict, k: int, n: int) -> morph_kernels.PreparedWeight:
    if DEVICE == "cuda":
        return morph_kernels.prepare(4, stored, device="cuda", act_dtype=torch.bfloat16)
    tensors = triton_gpu.prepare_tensors(4, stored, torch.bfloat16)
    return morph_kernels.PreparedWeight(4, n, k, GROUP_SIZE, tensors, torch.bfloat16)


def served(x: torch.Tensor, w: morph_kernels.PreparedWeight) -> torch.Tensor:
    # morph_kernels.linear's CUDA path is triton_gpu.linear; on CPU it would take the CPU ops.
    return morph_kernels.linear(x, w) if DEVICE == "cuda" else triton_gpu.linear(x, w)


def timed_ms(calls: list) -> float:
    if DEVICE == "cuda":
        return graph_ms(calls)
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e3 / len(calls)


def copies_for(nbytes: int) -> int:
    return copies_for_cold_l2(nbytes) if DEVICE == "cuda" else 2


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return math.inf
    return (torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)).item()


def one_hot_exact(call, w_bf16: torch.Tensor, gen: torch.Generator) -> bool:
    """Output row i for x = e_{c_i} is column c_i of the weight: every bit must match."""
    n, k = w_bf16.shape
    cols = torch.randint(0, k, (16,), generator=gen, device=DEVICE)
    x = torch.zeros(16, k, dtype=torch.bfloat16, device=DEVICE)
    x[torch.arange(16, device=DEVICE), cols] = 1.0
    return bool(torch.equal(call(x), w_bf16[:, cols].t()))


def tinygemm_weight(stored: dict) -> tuple[torch.Tensor, torch.Tensor]:
    q = stored["qweight"]
    swapped = ((q & 0x0F) << 4) | (q >> 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(),
                                                        TINYGEMM_INNER_K_TILES)
    scales = stored["scales"].float()
    zeros = (TINYGEMM_MIDPOINT - stored["zeros"].float()) * scales
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(torch.bfloat16)


def torchao_linear(w_bf16: torch.Tensor):
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    n, k = w_bf16.shape
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        lin.weight.copy_(w_bf16)
    quantize_(lin, Int4WeightOnlyConfig(group_size=GROUP_SIZE,
                                        int4_packing_format="tile_packed_to_4d"))
    return lin


def gemlite_module(stored: dict, k: int, n: int):
    import gemlite

    mod = gemlite.GemLiteLinear(4, group_size=GROUP_SIZE, in_features=k, out_features=n,
                                input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
    mod.pack(formats.unpack_w4(stored["qweight"]), stored["scales"], stored["zeros"],
             fma_mode=False)
    return mod


def gemlite_importable() -> bool:
    try:
        __import__("gemlite")
    except Exception:  # noqa: BLE001 (not installed, or no GPU to import it on)
        return False
    return True


def load_gemlite_config(path: str | None) -> str | None:
    """The config file loaded for GemLite, if one had to be (see the module docstring)."""
    try:
        import gemlite
        from gemlite.core import GemLiteLinearTriton, get_default_cache_config
    except Exception:  # noqa: BLE001 (not installed: no GemLite rows)
        return None
    if path is None:
        if get_default_cache_config() is not None:
            return "its own for this device"
        path = str(Path(gemlite.__file__).parent / "configs" / "h100.json")
    GemLiteLinearTriton.load_config(path)
    return path


def implementations(stored, w, w_bf16, k, n, awq, packer_layout,
                    ours_only=False) -> dict[str, tuple]:
    """name -> (call(x, copy), copies, weight bytes, checked for bit-exact weights).
    ``packer_layout[0]`` is set to whether GemLite's packer gives our tensors bit for bit."""
    impls = {}

    def prepared_copies(count):
        return [w] + [morph_kernels.PreparedWeight(
            w.bits, w.out_features, w.in_features, w.group_size,
            {key: (v.clone() if key == "qweight_t" else v) for key, v in w.tensors.items()},
            w.act_dtype) for _ in range(count - 1)]

    ours = prepared_copies(copies_for(w.device_bytes))
    impls["bf16_cublas"] = (lambda x, c: F.linear(x, c),
                            [w_bf16] + [w_bf16.clone() for _ in range(
                                copies_for(w_bf16.numel() * 2) - 1)],
                            w_bf16.numel() * 2, False)
    for backend in OURS:
        impls[backend] = (lambda x, c, b=backend: triton_gpu.linear(x, c, backend=b), ours,
                          w.device_bytes, True)
    impls["served"] = (served, ours, w.device_bytes, True)
    if awq or ours_only:
        return impls
    prev = w4_previous.prepare(stored, torch.bfloat16)
    prev_bytes = formats.device_bytes(prev)
    impls["previous"] = (lambda x, c: w4_previous.linear(x, c, GROUP_SIZE),
                         [prev] + [{key: (v.clone() if key == "qweight" else v)
                                    for key, v in prev.items()}
                                   for _ in range(copies_for(prev_bytes) - 1)],
                         prev_bytes, True)
    def library(label, build):
        try:
            impls[label] = build()
        except Exception as exc:  # noqa: BLE001 (recorded: a library that cannot run here)
            impls[label] = (f"{type(exc).__name__}: {exc}"[:400], [], 0, False)

    def gemlite_modules():
        mods = [gemlite_module(stored, k, n) for _ in range(copies_for(w.device_bytes))]
        packer_layout[0] = (torch.equal(mods[0].W_q, w.tensors["qweight_t"])
                            and torch.equal(mods[0].scales, w.tensors["scales_t"])
                            and torch.equal(mods[0].zeros, w.tensors["zeros_t"]))
        return (lambda x, c: c(x), mods, formats.device_bytes(
            {"W_q": mods[0].W_q, "scales": mods[0].scales, "zeros": mods[0].zeros}), True)

    def tinygemm():
        packed, sz = tinygemm_weight(stored)
        nbytes = formats.device_bytes({"packed": packed, "scales_and_zeros": sz})
        return (lambda x, c: torch.ops.aten._weight_int4pack_mm(x, c[0], GROUP_SIZE, c[1]),
                [(packed, sz)] + [(packed.clone(), sz) for _ in range(copies_for(nbytes) - 1)],
                nbytes, False)

    def torchao():
        first = torchao_linear(w_bf16)
        names, _ = first.weight.__tensor_flatten__()
        nbytes = formats.device_bytes({a: getattr(first.weight, a) for a in names})
        return (lambda x, c: c(x), [first] + [
            torchao_linear(w_bf16) for _ in range(copies_for(nbytes) - 1)], nbytes, False)

    if gemlite_importable():
        library("gemlite_module", gemlite_modules)
    library("tinygemm", tinygemm)
    library("torchao", torchao)
    return impls


def measure_point(impl, x, ref, w_bf16, tokens, k, n, copy_bps, gen) -> dict:
    call, copies, nbytes, check_exact = impl
    if isinstance(call, str):
        return {"error": call}
    row = {}
    try:
        row["rel_error"] = max(relative_error(call(x, copies[0]), ref) for _ in range(2))
        if check_exact and tokens == DECODE_TOKENS[-1] and w_bf16 is not None:
            row["one_hot_exact"] = one_hot_exact(lambda v: call(v, copies[0]), w_bf16, gen)
        ms = timed_ms([lambda c=c: call(x, c) for c in copies])
    except Exception as exc:  # noqa: BLE001 (recorded per implementation)
        return {"error": f"{type(exc).__name__}: {exc}"[:400],
                "trace": traceback.format_exc()[-1500:]}
    moved = nbytes + 2 * tokens * (k + n)
    row.update(ms=ms, weight_bytes=nbytes, bytes_moved=moved,
               roofline_fraction=moved / (ms * 1e-3) / copy_bps,
               tflops=2 * tokens * n * k / (ms * 1e-3) / 1e12)
    return row


def run(args) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dry = {"gpu": "none (dry run on CPU)", "sm_count": 0, "torch": torch.__version__,
           "cuda": None, "triton": None, "commit": None}
    result = {"device": device_info() if DEVICE == "cuda" else dry, "copy_bytes_per_s": args.copy_bytes_per_s,
              "gemlite_config": load_gemlite_config(args.gemlite_config), "versions": {},
              "rows": [], "choices": []}
    result["spec_hbm_bytes_per_s"] = spec_hbm_bytes_per_s(result["device"]["gpu"])
    for lib in ("gemlite", "torchao"):
        try:
            result["versions"][lib] = __import__(lib).__version__
        except Exception as exc:  # noqa: BLE001
            result["versions"][lib] = f"not importable: {type(exc).__name__}: {exc}"[:300]
    copy_bps = result["copy_bytes_per_s"]
    for awq in (False, True):
        for name, (k, n) in LINEARS.items():
            if args.only and name not in args.only:
                continue
            stored = make_stored(4, GROUP_SIZE, awq, k, n, gen, device=DEVICE)
            w = prepare(stored, k, n)
            w_ref = formats.get_format(4).dequantize(stored).float()
            plain = {key: v for key, v in stored.items() if key != "input_scale"}
            w_bf16 = formats.get_format(4).dequantize(plain).to(torch.bfloat16)
            try:  # what morph_kernels.warmup runs on CUDA
                triton_gpu.warmup(w, max(PREFILL_TOKENS))
                warmup_error = None
            except Exception as exc:  # noqa: BLE001 (recorded; the libraries still run)
                warmup_error = f"{type(exc).__name__}: {exc}"[:400]
                print("warmup failed:", warmup_error, flush=True)
            packer_layout = [None]
            impls = implementations(stored, w, w_ref.to(torch.bfloat16), k, n, awq,
                                    packer_layout, args.ours_only)
            for tokens in args.tokens or DECODE_TOKENS + PREFILL_TOKENS:
                x = torch.randn(tokens, k, generator=gen, device=DEVICE).to(torch.bfloat16)
                ref = F.linear(x.float(), w_ref)
                row = {"linear": name, "in": k, "out": n, "tokens": tokens,
                       "input_scale": awq,
                       "served_backend": triton_gpu.chosen_w4_backend(w, tokens),
                       "gemlite_packer_equals_our_layout": packer_layout[0],
                       "warmup_error": warmup_error,
                       "triton_config": None, "impls": {}}
                for label, impl in impls.items():
                    row["impls"][label] = measure_point(
                        impl, x, ref, None if awq else w_bf16, tokens, k, n, copy_bps,
                        gen)
                    if label == "triton":
                        row["triton_config"] = str(triton_gpu._w4a16_tuned.best_config)
                rows_ms = {lb: r.get("ms") for lb, r in row["impls"].items()}
                print(name, "awq" if awq else "plain", tokens,
                      {lb: (round(v * 1e3, 1) if v else None) for lb, v in rows_ms.items()},
                      flush=True)
                result["rows"].append(row)
            for key, (choice, timings) in triton_gpu.w4_choices().items():
                if key[1:3] == (n, k) and key[5] == awq:
                    result["choices"].append({"linear": name, "input_scale": awq,
                                              "bucket": key[6], "choice": choice,
                                              "ms": timings})
            del impls, w, stored
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            # Partial results survive a child that runs out of time.
            Path(args.child_out).write_text(json.dumps(result, indent=1))
    return result


def _cell(r: dict | None, bf16_ms: float | None, decode: bool) -> str:
    if not r:
        return ""
    if "error" in r:
        return "error"
    main = f"{r['roofline_fraction']:.0%}" if decode else f"{r['tflops']:.0f} TF"
    ratio = f" {bf16_ms / r['ms']:.2f}x" if bf16_ms else ""
    return f"{r['ms'] * 1e3:.1f} us ({main},{ratio})"


def markdown(result: dict) -> str:
    d = result["device"]
    copy = result["copy_bytes_per_s"]
    labels = ["bf16_cublas", "previous", "triton", "dequant_cublas", "served", "gemlite",
              "gemlite_module", "tinygemm", "torchao"]
    out = ["# W4A16 at Llama-3-8B shapes, side by side\n\n",
           f"{d['gpu']} ({d['sm_count']} SMs), torch {d['torch']} (CUDA {d['cuda']}), Triton "
           f"{d['triton']}, GemLite {result['versions'].get('gemlite')}, torchao "
           f"{result['versions'].get('torchao')}, commit {d['commit']}. GemLite configs: "
           f"{result['gemlite_config']}. Copy bandwidth measured in the same run: "
           f"{copy / 1e12:.2f} TB/s (read + write).\n\n",
           "Each cell: time per call in a CUDA graph over weight copies totalling 4x L2, median "
           "of 5 replays (share of the copy bandwidth at decode, TFLOP/s at prefill; speed-up "
           "over bf16 cuBLAS). `served` is `morph_kernels.linear` after `warmup`.\n"]
    for awq in (False, True):
        rows = [r for r in result["rows"] if r["input_scale"] == awq]
        if not rows:
            continue
        present = [lb for lb in labels if any(lb in r["impls"] for r in rows)]
        out.append(f"\n## {'With an AWQ input scale (as served)' if awq else 'Plain W4 g128'}\n\n")
        body = []
        for r in rows:
            bf16 = r["impls"].get("bf16_cublas", {}).get("ms")
            decode = r["tokens"] <= DECODE_TOKENS[-1]
            body.append([r["linear"], r["tokens"], r.get("served_backend") or ""]
                        + [_cell(r["impls"].get(lb), None if lb == "bf16_cublas" else bf16,
                                 decode) for lb in present])
        out.append(table(["linear", "tokens", "served backend"] + present, body))
        errs = []
        for r in rows:
            errs.append([r["linear"], r["tokens"]] + [
                (f"{r['impls'][lb]['rel_error']:.1e}" if "rel_error" in r["impls"].get(lb, {})
                 else r["impls"].get(lb, {}).get("error", "")[:60])
                + (" exact" if r["impls"].get(lb, {}).get("one_hot_exact") else
                   (" NOT exact" if r["impls"].get(lb, {}).get("one_hot_exact") is False else ""))
                for lb in present])
        out.append("\nRelative error against the fp32 reference (and one-hot bit-exactness of "
                   "the dequantized weight where checked):\n\n")
        out.append(table(["linear", "tokens"] + present, errs))
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemlite-config", help="GemLite autotune cache file to load")
    ap.add_argument("--ours-only", action="store_true",
                    help="skip the libraries (GemLite, tinygemm, torchao) and the previous kernel")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default: 1 8 16 512 2048)")
    ap.add_argument("--only", nargs="*", default=list(LINEARS),
                    help="linears to run (default: all four)")
    ap.add_argument("--timeout-s", type=float, default=240,
                    help="per linear; each runs in its own process")
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--copy-bytes-per-s", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_out:
        run(args)
        return
    # One process per linear: a library that breaks the CUDA context (a failed graph capture)
    # costs that linear's rows, not the run. Compiled kernels and Triton's autotune results
    # are cached on disk, so later processes reuse them.
    copy_bps = measured_copy_bytes_per_s() if DEVICE == "cuda" else 1e9
    merged = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            part = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "benchmark.gpu.w4_side_by_side", "--only", name,
                   "--child-out", str(part), "--copy-bytes-per-s", str(copy_bps)]
            if args.gemlite_config:
                cmd += ["--gemlite-config", args.gemlite_config]
            if args.ours_only:
                cmd += ["--ours-only"]
            if args.tokens:
                cmd += ["--tokens", *map(str, args.tokens)]
            try:
                proc = subprocess.run(cmd, timeout=args.timeout_s)
                status = f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {args.timeout_s:.0f} s"
            print(f"== {name}: {status}", flush=True)
            if not part.exists():
                continue
            result = json.loads(part.read_text())
            if merged is None:
                merged = result
            else:
                merged["rows"] += result["rows"]
                merged["choices"] += result["choices"]
            merged.setdefault("processes", {})[name] = status
            (out_dir() / "w4_side_by_side.json").write_text(json.dumps(merged, indent=1) + "\n")
    if merged is None:
        raise SystemExit("no linear produced results")
    write_results("w4_side_by_side", merged, markdown(merged))


if __name__ == "__main__":
    main()
