"""Time the CPU kernels against a bf16 ``F.linear`` at the default model's decode shapes.

    .venv/bin/python sgl-kernel/morph-kernels/benchmarks/bench_cpu.py [--repeats 5]

Prints one row per (shape, tokens): the median over ``--repeats`` rounds of
``torch.utils.benchmark``'s per-call median, in microseconds. Weights are random; only their
shapes matter for time. The weights sit in cache at these sizes (<= 1.8 MB), so the numbers
are compute, not memory, costs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb
from sglang_morph.engines import formats

import morph_kernels

# SmolLM2-135M (the default model): hidden 576, intermediate 1536.
SHAPES_IN_OUT = ((576, 1536), (1536, 576))
TOKENS = (1, 8, 32)
MIN_RUN_TIME_S = 0.2


def median_us(fn, repeats: int) -> float:
    timer = tb.Timer(stmt="fn()", globals={"fn": fn})
    return statistics.median(
        timer.blocked_autorange(min_run_time=MIN_RUN_TIME_S).median * 1e6 for _ in range(repeats)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    act = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, activations {act}")
    print(f"{'in->out':>10} {'tokens':>6} {'bf16 us':>9} {'W8 us':>9} {'W4 us':>9} {'W4+is us':>9}")
    for in_features, out_features in SHAPES_IN_OUT:
        weight = torch.randn(out_features, in_features)
        dense = weight.to(act)
        w8 = morph_kernels.prepare(
            8, formats.get_format(8).quantize(weight), device="cpu", act_dtype=act
        )
        w4 = morph_kernels.prepare(
            4, formats.get_format(4).quantize(weight), device="cpu", act_dtype=act
        )
        w4_is = morph_kernels.prepare(
            4,
            formats.get_format(4).quantize(weight, input_scale=torch.rand(in_features) + 0.5),
            device="cpu",
            act_dtype=act,
        )
        for tokens in TOKENS:
            x = torch.randn(tokens, in_features, dtype=act)
            times = [
                median_us(lambda: F.linear(x, dense), args.repeats),
                median_us(lambda: morph_kernels.linear(x, w8), args.repeats),
                median_us(lambda: morph_kernels.linear(x, w4), args.repeats),
                median_us(lambda: morph_kernels.linear(x, w4_is), args.repeats),
            ]
            cells = " ".join(f"{t:9.1f}" for t in times)
            print(f"{f'{in_features}->{out_features}':>10} {tokens:>6} {cells}")


if __name__ == "__main__":
    main()
