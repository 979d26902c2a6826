"""Registers, spills and shared memory of every GPU kernel configuration, without a GPU.

    .venv/bin/python sgl-kernel/morph-kernels/benchmarks/ptxas_report.py [--capability 90]

Compiles each autotune candidate (W8, and W4 with group 128 and an input_scale) with
``morph_kernels.triton_aot`` and re-runs Triton's bundled ptxas with ``-v`` on the PTX.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile

from triton import knobs

from morph_kernels import triton_aot, triton_gpu


def ptxas_usage(ptx: str, capability: int) -> str:
    arch = f"sm_{capability}{'a' if capability == 90 else ''}"  # sm_90a: wgmma
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(ptx)
        src.flush()
        log = subprocess.run(
            [knobs.nvidia.ptxas.path, "-v", f"--gpu-name={arch}", src.name, "-o", "/dev/null"],
            capture_output=True, text=True, check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", log).group(1)
    spilled = re.search(r"(\d+) bytes spill stores", log).group(1)
    return f"{registers:>3} regs {spilled:>4} B spilled"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="80: A100, 90: H100/H200")
    args = parser.parse_args()
    print(f"sm_{args.capability}; shared memory per program in KiB")
    for bits in (8, 4):
        for config in triton_gpu.configs_for(bits):
            kernel = triton_aot.compile_kernel(
                bits, config, input_scale=bits == 4, capability=args.capability
            )
            usage = ptxas_usage(kernel.asm["ptx"], args.capability)
            shape = "x".join(str(config.kwargs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            extra = f" split {config.kwargs['SPLIT_K']}" + (
                f" swap {int(config.kwargs['SWAP'])}" if "SWAP" in config.kwargs else "")
            launch = f"warps {config.num_warps} stages {config.num_stages}{extra}"
            print(f"W{bits} {shape:>11} {launch} | {usage}, "
                  f"{kernel.metadata.shared / 1024:5.1f} KiB")

if __name__ == "__main__":
    main()
