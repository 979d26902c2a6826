"""Measure what KunServe's transitions and pipeline move, on this machine (for the simulation).

- gloo send/recv between two processes (``torch.distributed``, loopback): the seconds to send
  a hidden-state tensor of ``n`` tokens x hidden size (the activation between pipeline stages)
  and KV chunks, fitted as ``latency + bytes / bandwidth``;
- host memory copy bandwidth (``torch.Tensor.copy_`` of a large buffer): what putting dropped
  weights back from their host copy and rebuilding a KV pool cost.

    .venv/bin/python -m benchmark.kunserve.transfer [--out benchmark/results/kunserve]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmark.harness import free_port, load_average, run_meta

SIZES_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)
REPEATS = 9
COPY_BYTES = 256 << 20


def _peer(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    results = {}
    for size in SIZES_BYTES:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        runs = []
        for _ in range(REPEATS + 1):  # one warm-up round trip per size
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            runs.append((time.perf_counter() - t0) / 2)  # one way
        results[size] = statistics.median(runs[1:])
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_gloo() -> dict[int, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return results


def fit_wire(one_way_s: dict[int, float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s): the least-squares line ``latency + bytes / bandwidth``
    through the one-way times (a negative intercept counts as no latency)."""
    sizes = np.array(sorted(one_way_s), dtype=np.float64)
    seconds = np.array([one_way_s[int(s)] for s in sizes])
    slope, intercept = np.polyfit(sizes, seconds, 1)
    return float(max(intercept, 0.0)), float(1 / slope)


def measure_copy() -> float:
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        runs.append(time.perf_counter() - t0)
    return COPY_BYTES / statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.transfer",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    gloo = measure_gloo()
    latency_s, bandwidth = fit_wire(gloo)
    copy_bw = measure_copy()
    result = {
        "gloo_one_way_s": {str(k): v for k, v in sorted(gloo.items())},
        "gloo_latency_s": latency_s,
        "gloo_bandwidth_bytes_per_s": bandwidth,
        "host_copy_bandwidth_bytes_per_s": copy_bw,
        "meta": run_meta("python -m benchmark.kunserve.transfer", load_before),
    }
    (args.out / "transfer.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=1))


if __name__ == "__main__":
    main()
