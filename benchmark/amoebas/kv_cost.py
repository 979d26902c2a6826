"""What re-sharding the KV cache by head costs: head-centric layout vs the paper's base variant.

The AMOEBAs paper (runtime tensor-parallel transformation, DAC '26) reports that its
head-centric KV layout cuts the KV transformation's extra memory by 91.6% and its time by 61%
against a token-first base. This benchmark measures the same two variants of
``sglang_morph.amoebas.kv_reshard.KVReshard`` on real SGLang ``MHATokenToKVPool``s (CPU), one
member per thread in one process (``thread_transports``: bundles copied through queues), for a
merge to ``--degree`` members and the split back, at a few live-token counts per member:

- ``peak_extra_bytes``: the most memory a member held at once beyond its layout before and
  after the transition (new buffers, the undo log, the rows of the pair being exchanged), as
  ``KVReshard`` accounts it; the largest over members;
- ``time_s``: wall time of the transition on every member (threads started to all done), the
  best of ``--repetitions``;
- each also per layer and per live token.

Default shapes: the default model's KV (30 layers, 3 KV heads, head_dim 64, float32).
``--quick`` is a smoke test (2 layers, small pools, output under ``results/raw/``).
"""

from __future__ import annotations

import argparse
import json
import queue
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.harness import REPO_ROOT, load_average, run_meta
from sglang_morph.amoebas.kv_layout import KVLayoutConfig
from sglang_morph.amoebas.kv_reshard import KVReshard, Transport

VARIANTS = ("head_centric", "token_first")


def thread_transports(size: int, timeout_s: float = 120.0) -> list[Transport]:
    """Members in threads of one process: bundles copied through queues, values through
    JSON as on the group link. One transport per rank."""
    boxes = {(s, d): queue.Queue() for s in range(size) for d in range(size) if s != d}
    barrier = threading.Barrier(size, timeout=timeout_s)
    values: list = [None] * size

    def member(rank: int) -> Transport:
        def send(dst: int, tensors: dict) -> None:
            boxes[rank, dst].put({k: v.clone() for k, v in tensors.items()})

        def recv(src: int) -> dict:
            return boxes[src, rank].get(timeout=timeout_s)

        def gather(value: Any) -> list:
            values[rank] = json.loads(json.dumps(value))
            barrier.wait()
            out = list(values)
            barrier.wait()  # every member read this round before any writes the next
            return out

        return Transport(rank, size, send, recv, gather)

    return [member(r) for r in range(size)]


def in_threads(calls: list) -> list:
    """Run one call per member in its own thread; their results (or exceptions) by rank."""
    out: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def make_pool(config: KVLayoutConfig):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=config.tp1_capacity_tokens, page_size=config.page_size,
                            dtype=config.dtype, head_num=config.kv_heads,
                            head_dim=config.head_dim, layer_num=config.layers, device="cpu",
                            enable_memory_saver=False)


def measure(config: KVLayoutConfig, degree: int, live_tokens: int, variant: str,
            seed: int = 0) -> dict:
    """One merge and split of ``degree`` members holding ``live_tokens`` each."""
    members = []
    for rank in range(degree):
        g = torch.Generator().manual_seed(seed + rank)
        pool = make_pool(config)
        live = torch.randperm(config.tp1_capacity_tokens, generator=g)[:live_tokens]
        live = live + config.page_size
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf[live] = torch.randn((live_tokens, *buf.shape[1:]), generator=g)
        members.append((KVReshard(pool, config, variant, live_slots=live), live))
    transports = thread_transports(degree)
    result = {}
    for action in ("merge", "split"):
        started = time.perf_counter()
        stats = in_threads([
            (lambda kv=kv, live=live, t=t: kv.merge(live, t) if action == "merge"
             else kv.split(live)) for (kv, live), t in zip(members, transports)])
        elapsed = time.perf_counter() - started
        failed = [s for s in stats if isinstance(s, BaseException)]
        if failed:
            raise failed[0]
        peak = max(s.peak_extra_bytes for s in stats)
        result[action] = {
            "time_s": elapsed, "peak_extra_bytes": peak,
            "peak_extra_bytes_per_layer": peak / config.layers,
            "peak_extra_bytes_per_live_token": peak / max(1, live_tokens),
            "time_s_per_live_token": elapsed / max(1, live_tokens),
            "sent_bytes": max(s.sent_bytes for s in stats),
            "new_buffer_bytes": max(s.new_buffer_bytes for s in stats),
            "undo_bytes": max(s.undo_bytes for s in stats),
            "released_bytes": max(s.released_bytes for s in stats),
            "phase_s": stats[0].phase_s,
        }
    return result


def run(args: argparse.Namespace) -> dict:
    config = KVLayoutConfig(layers=args.layers, kv_heads=args.kv_heads,
                            head_dim=args.head_dim, dtype=torch.float32, page_size=1,
                            tp1_capacity_tokens=args.capacity_tokens,
                            max_capacity_tokens=2 * args.capacity_tokens)
    rows = []
    for live in args.live_tokens:
        for variant in VARIANTS:
            reps = [measure(config, args.degree, live, variant, seed=r)
                    for r in range(args.repetitions)]
            best = {a: min((rep[a] for rep in reps), key=lambda m: m["time_s"])
                    for a in ("merge", "split")}
            rows.append({"live_tokens": live, "variant": variant, **best})
            print(f"live {live:6d} {variant:12s} merge {best['merge']['time_s']:.3f} s "
                  f"peak {best['merge']['peak_extra_bytes'] / 2**20:.1f} MiB | split "
                  f"{best['split']['time_s']:.3f} s peak "
                  f"{best['split']['peak_extra_bytes'] / 2**20:.1f} MiB", flush=True)
    return {"config": {"layers": config.layers, "kv_heads": config.kv_heads,
                       "head_dim": config.head_dim, "dtype": "float32",
                       "tp1_capacity_tokens": config.tp1_capacity_tokens,
                       "degree": args.degree, "repetitions": args.repetitions},
            "rows": rows}


def markdown(results: dict, meta: dict) -> str:
    c = results["config"]
    lines = [
        "# KV re-shard cost: head-centric vs token-first (base)", "",
        f"Command: `{meta['command']}`  ",
        f"Commit: {meta['git']['commit']} (dirty: {meta['git']['dirty']})  ",
        f"Machine: {meta['machine']['cpu_model']}, {meta['machine']['cpu_cores']} cores, "
        f"torch threads {meta['machine']['torch_threads']}; load before {meta['load_before']}",
        "",
        f"{c['layers']} layers, {c['kv_heads']} KV heads, head_dim {c['head_dim']}, "
        f"{c['dtype']}, TP 1 pool of {c['tp1_capacity_tokens']} tokens per member, degree "
        f"{c['degree']}, best of {c['repetitions']}. Peak extra = most memory held at once "
        "beyond the layouts (largest member); time = all members, wall clock.", "",
        "| live tokens/member | action | variant | time (s) | peak extra (MiB) | per layer (KiB) "
        "| per live token (B) | vs token-first: memory | time |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["live_tokens"], r["variant"]): r for r in results["rows"]}
    for (live, variant), r in by_key.items():
        for action in ("merge", "split"):
            m, base = r[action], by_key[live, "token_first"][action]
            lines.append(
                f"| {live} | {action} | {variant} | {m['time_s']:.4f} | "
                f"{m['peak_extra_bytes'] / 2**20:.2f} | "
                f"{m['peak_extra_bytes_per_layer'] / 1024:.1f} | "
                f"{m['peak_extra_bytes_per_live_token']:.0f} | "
                f"{_change(m['peak_extra_bytes'], base['peak_extra_bytes'])} | "
                f"{_change(m['time_s'], base['time_s'])} |")
    return "\n".join(lines) + "\n"


def _change(value: float, base: float) -> str:
    return f"{100 * (value - base) / base:+.1f}%" if base else "n/a"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--live-tokens", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--capacity-tokens", type=int, help="TP 1 pool per member")
    p.add_argument("--degree", type=int, default=3)
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repetitions", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, raw output")
    args = p.parse_args(argv)
    quick = {"live_tokens": [16, 64], "capacity_tokens": 128, "layers": 2, "repetitions": 1,
             "out": REPO_ROOT / "benchmark/results/raw/amoebas_kv_cost.json"}
    full = {"live_tokens": [512, 2048, 6144], "capacity_tokens": 8192, "layers": 30,
            "repetitions": 3, "out": REPO_ROOT / "benchmark/results/amoebas/kv_cost.json"}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    load_before = load_average()
    results = run(args)
    command = shlex.join([Path(sys.executable).name, "-m", "benchmark.amoebas.kv_cost",
                          *(argv if argv is not None else sys.argv[1:])])
    meta = run_meta(command, load_before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, **results}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results, meta))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
