"""Time the CPU kernels against a dense ``F.linear`` at the default model's decode shapes.

    .venv/bin/python sgl-kernel/morph-kernels/benchmarks/bench_cpu.py [--repeats 5]
        [--act bfloat16|float16|float32] [--tokens 1,8,32] [--threads N]

Prints one row per (shape, tokens): the median over ``--repeats`` rounds of
``torch.utils.benchmark``'s per-call median, in microseconds. Weights are random; only their
shapes matter for time. The weights sit in cache at these sizes (<= 1.8 MB), so the numbers
are compute, not memory, costs. For an act dtype that ``morph_kernels`` serves by dequantizing
(fp32), two more columns time torch's packed ops at that dtype, the path it replaced.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb
from sglang_morph.engines import formats

import morph_kernels
from morph_kernels import cpu

# SmolLM2-135M (the default model): hidden 576, intermediate 1536.
SHAPES_IN_OUT = ((576, 1536), (1536, 576))
MIN_RUN_TIME_S = 0.2


def median_us(fn, repeats: int) -> float:
    timer = tb.Timer(stmt="fn()", globals={"fn": fn})
    return statistics.median(
        timer.blocked_autorange(min_run_time=MIN_RUN_TIME_S).median * 1e6 for _ in range(repeats)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--act", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--tokens", default="1,8,32", help="comma-separated token counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    act = getattr(torch, args.act)
    compare_packed = act in cpu.DEQUANTIZE_ACT_DTYPES
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, activations {act}")
    columns = ["dense us", "W8 us", "W4 us", "W4+is us"]
    columns += ["W8 pk us", "W4 pk us"] if compare_packed else []
    print(f"{'in->out':>10} {'tokens':>6} " + " ".join(f"{c:>9}" for c in columns))
    for in_features, out_features in SHAPES_IN_OUT:
        weight = torch.randn(out_features, in_features)
        dense = weight.to(act)
        stored8 = formats.get_format(8).quantize(weight)
        stored4 = formats.get_format(4).quantize(weight)
        w8 = morph_kernels.prepare(8, stored8, device="cpu", act_dtype=act)
        w4 = morph_kernels.prepare(4, stored4, device="cpu", act_dtype=act)
        w4_is = morph_kernels.prepare(
            4,
            formats.get_format(4).quantize(weight, input_scale=torch.rand(in_features) + 0.5),
            device="cpu",
            act_dtype=act,
        )
        # The same weights in the packed ops' layout, at this act dtype (the path replaced).
        packed = [dataclasses.replace(w, tensors=cpu.packed_tensors(w.bits, s, act))
                  for w, s in ((w8, stored8), (w4, stored4))] if compare_packed else []
        for tokens in tokens_list:
            x = torch.randn(tokens, in_features, dtype=act)
            fns = [lambda: F.linear(x, dense)]
            fns += [(lambda w=w: morph_kernels.linear(x, w)) for w in (w8, w4, w4_is)]
            fns += [(lambda w=w: cpu.packed_linear(x, w, None)) for w in packed]
            cells = " ".join(f"{median_us(fn, args.repeats):9.1f}" for fn in fns)
            print(f"{f'{in_features}->{out_features}':>10} {tokens:>6} {cells}")


if __name__ == "__main__":
    main()
