"""What every GPU benchmark records: device, versions, commit, the measured memory roofline."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
# Published peak HBM bandwidth (bytes/s) of the cards this project is lent, for context only:
# the roofline the results are judged against is the copy bandwidth measured in the same run.
SPEC_HBM_BYTES_PER_S = {"H100 80GB HBM3": 3.35e12, "H200": 4.8e12}


def out_dir() -> Path:
    """Where results go: ``$OUT`` on the device machine, else benchmark/results/gpu."""
    path = Path(os.environ.get("OUT") or REPO_ROOT / "benchmark" / "results" / "gpu")
    path.mkdir(parents=True, exist_ok=True)
    return path


def commit() -> str | None:
    """The commit the run measures: ``MORPH_COMMIT`` (the device's copy of the tree has no .git),
    else ``git rev-parse HEAD``."""
    if os.environ.get("MORPH_COMMIT"):
        return os.environ["MORPH_COMMIT"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True)
    return head.stdout.strip() if head.returncode == 0 else None


def device_info() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "nvidia_smi": smi.stdout.strip(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit(),
    }


def spec_hbm_bytes_per_s(gpu_name: str) -> float | None:
    return next((v for k, v in SPEC_HBM_BYTES_PER_S.items() if k in gpu_name), None)


def measured_copy_bytes_per_s(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written per second (median)."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=500,
                                 return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def write_results(name: str, payload: dict, markdown: str) -> None:
    """JSON always; the Markdown table too unless on the device machine, whose call returns few
    files (``python -m benchmark.gpu.render`` makes it from the JSON here)."""
    out = out_dir()
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    if not os.environ.get("OUT"):
        (out / f"{name}.md").write_text(markdown)
    print(markdown, flush=True)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
