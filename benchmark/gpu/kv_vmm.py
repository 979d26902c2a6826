"""KV growth on a GPU without moving pages or recapturing CUDA graphs (``VmmKVArena``).

    python -m benchmark.gpu.kv_vmm             # on the device machine

A Llama-3-8B-shaped KV pool (32 layers x K and V, 8 KV heads of 128, bf16: 128 KiB per token)
lives in a ``VmmKVArena``. A CUDA graph is captured of a decode-like step that, per layer,
writes the new token's K/V at ``out_cache_loc`` and reads the K/V of ``read_loc`` slots back
(gather + reduction), as an attention backend's kernels do. Then a "swap": one bf16 decoder
layer's weights (436 MB) are freed and given back to the device, its W4 variant is allocated,
and the KV arena grows into the difference. The graph is replayed with slots in the grown
region and compared with the same step run eagerly, and the rows written before the growth are
checked unchanged. Then the "restore" (shrink, bf16 weights back) and one more replay.

Recorded: device free memory at every stage (``cudaMemGetInfo``), grow/shrink durations, the
graph's results against eager, and for contrast the time to grow by reallocating every buffer
and copying the old rows (what a pool without stable addresses must do, and why it needs a
recapture).
"""

from __future__ import annotations

import time

import torch
from sglang_morph.elastic.kv_vmm import VmmBufferSpec, VmmKVArena

from benchmark.gpu.common import device_info, table, write_results

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
LAYER_BF16_BYTES = 2 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096)
LAYER_W4_BYTES = 113_770_496  # Llama-3-8B layer at W4 g128 + AWQ input scales (formats.py)
START_TOKENS = 16_384
MAX_TOKENS = 262_144


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class DecodeLikeStep:
    """Per layer: write K/V at ``out_loc``, gather K/V at ``read_loc`` and reduce (fp32)."""

    def __init__(self, arena: VmmKVArena, batch: int, reads: int):
        self.arena = arena
        self.out_loc = torch.zeros(batch, dtype=torch.int64, device="cuda")
        self.read_loc = torch.zeros(reads, dtype=torch.int64, device="cuda")
        self.new_kv = torch.zeros(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.result = torch.zeros(2 * LAYERS, device="cuda")

    def run(self) -> torch.Tensor:
        sums = []
        # The whole-reservation buffers: pointer and size never change, so the captured kernels
        # (and index_copy_'s bounds check) stay valid whatever the capacity.
        for i, buf in enumerate(self.arena.buffers):
            buf.index_copy_(0, self.out_loc, self.new_kv * (i + 1))
            sums.append(buf.index_select(0, self.read_loc).float().square().sum())
        self.result.copy_(torch.stack(sums))
        return self.result

    def set_slots(self, out_loc: torch.Tensor, read_loc: torch.Tensor, gen) -> None:
        self.out_loc.copy_(out_loc)
        self.read_loc.copy_(read_loc)
        self.new_kv.copy_(torch.randn(self.new_kv.shape, generator=gen, device="cuda"))


def slots(lo: int, hi: int, n: int, gen) -> torch.Tensor:
    """``n`` distinct slots in ``[lo, hi)`` (``index_copy_`` needs distinct targets)."""
    return torch.randperm(hi - lo, generator=gen, device="cuda")[:n] + lo


def reads(lo: int, hi: int, n: int, gen) -> torch.Tensor:
    return torch.randint(lo, hi, (n,), generator=gen, device="cuda")


def run() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = [VmmBufferSpec(f"{kv}{layer}", (KV_HEADS, HEAD_DIM), torch.bfloat16)
             for kv in ("k", "v") for layer in range(LAYERS)]
    token_bytes = sum(s.row_bytes for s in specs)
    stages = {"start": free_bytes()}
    weights = torch.empty(LAYER_BF16_BYTES, dtype=torch.uint8, device="cuda")
    stages["bf16 layer allocated"] = free_bytes()
    t0 = time.perf_counter()
    arena = VmmKVArena(specs, MAX_TOKENS, START_TOKENS, "cuda")
    create_ms = 1e3 * (time.perf_counter() - t0)
    stages["KV arena at start"] = free_bytes()
    for buf in arena.tensors:
        buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda"))
    ptrs = [t.data_ptr() for t in arena.buffers]

    step = DecodeLikeStep(arena, batch=64, reads=4096)
    step.set_slots(slots(0, START_TOKENS, 64, gen), reads(0, START_TOKENS, 4096, gen), gen)
    step.run()  # eager once before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    checks = {}

    def replay_matches_eager(name: str, lo: int, hi: int) -> None:
        step.set_slots(slots(lo, hi, 64, gen), reads(lo, hi, 4096, gen), gen)
        before = [t.clone() for t in arena.tensors]
        graph.replay()
        replayed = step.result.clone()
        for t, b in zip(arena.tensors, before):  # undo the graph's writes, then run eagerly
            t.copy_(b)
        eager = step.run().clone()
        checks[name] = bool(torch.equal(replayed, eager))

    replay_matches_eager("replay before growth (slots < start capacity)", 0, START_TOKENS)
    old_rows_checksum = torch.stack([t[:START_TOKENS].float().sum() for t in arena.tensors])
    torch.cuda.empty_cache()
    stages["serving, before the swap"] = free_bytes()

    # Swap: the bf16 layer goes, its W4 variant comes, the KV takes the difference: as many
    # tokens as the freed bytes cover in whole granules (each buffer maps whole granules).
    del weights
    torch.cuda.empty_cache()  # the caching allocator returns the freed segment to the device
    stages["bf16 layer freed"] = free_bytes()
    w4 = torch.empty(LAYER_W4_BYTES, dtype=torch.uint8, device="cuda")
    stages["W4 variant allocated"] = free_bytes()
    kv_budget = arena.mapped_bytes + LAYER_BF16_BYTES - LAYER_W4_BYTES
    grown_tokens = START_TOKENS
    while arena.mapped_bytes_for(grown_tokens + 1) <= kv_budget:
        grown_tokens += 1
    t0 = time.perf_counter()
    mapped = arena.grow(grown_tokens)
    grow_ms = 1e3 * (time.perf_counter() - t0)
    stages["KV grown"] = free_bytes()
    arena.check_integrity()
    checks["buffer addresses unchanged after growth"] = [t.data_ptr() for t in arena.tensors] == ptrs
    for buf in arena.tensors:
        buf[START_TOKENS:].copy_(torch.randn(buf[START_TOKENS:].shape, generator=gen,
                                             device="cuda"))
    checks["rows written before growth unchanged"] = bool(torch.equal(
        old_rows_checksum, torch.stack([t[:START_TOKENS].float().sum() for t in arena.tensors])))
    replay_matches_eager("replay after growth, slots in the grown region", START_TOKENS,
                         grown_tokens)
    replay_matches_eager("replay after growth, slots anywhere", 0, grown_tokens)

    # Restore: KV gives the memory back first, then the bf16 weights return.
    t0 = time.perf_counter()
    released = arena.shrink(START_TOKENS)
    shrink_ms = 1e3 * (time.perf_counter() - t0)
    del w4
    torch.cuda.empty_cache()
    stages["KV shrunk, W4 freed"] = free_bytes()
    weights = torch.empty(LAYER_BF16_BYTES, dtype=torch.uint8, device="cuda")
    stages["bf16 layer back (restored)"] = free_bytes()
    arena.check_integrity()
    replay_matches_eager("replay after the restore (shrink)", 0, START_TOKENS)

    # Contrast: growing without stable addresses (new buffers + copy of the old rows).
    t0 = time.perf_counter()
    moved = [torch.empty((grown_tokens, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
             for _ in specs]
    for new, old in zip(moved, arena.tensors):
        new[:START_TOKENS].copy_(old)
    torch.cuda.synchronize()
    realloc_ms = 1e3 * (time.perf_counter() - t0)
    del moved, weights
    arena.close()
    return {
        "device": device_info(), "token_bytes": token_bytes, "granule_bytes": arena.granule_bytes,
        "start_tokens": START_TOKENS, "grown_tokens": grown_tokens, "max_tokens": MAX_TOKENS,
        "layer_bf16_bytes": LAYER_BF16_BYTES, "layer_w4_bytes": LAYER_W4_BYTES,
        "arena_create_ms": create_ms, "grow_ms": grow_ms, "grow_mapped_bytes": mapped,
        "shrink_ms": shrink_ms, "shrink_released_bytes": released,
        "realloc_and_copy_ms": realloc_ms, "free_bytes_by_stage": stages, "checks": checks,
    }


def markdown(r: dict) -> str:
    d = r["device"]
    start = r["free_bytes_by_stage"]["serving, before the swap"]
    return "".join([
        f"# KV growth with stable addresses (VmmKVArena) on {d['gpu']}\n\n",
        f"torch {d['torch']} (CUDA {d['cuda']}), commit {d['commit']}. Llama-3-8B KV layout: "
        f"{r['token_bytes'] // 1024} KiB per token over 64 buffers, granule "
        f"{r['granule_bytes'] >> 20} MiB, address range reserved for {r['max_tokens']:,} tokens. "
        f"A bf16 layer ({r['layer_bf16_bytes'] / 1e6:.1f} MB) is swapped for its W4 variant "
        f"({r['layer_w4_bytes'] / 1e6:.1f} MB) and the KV grows from {r['start_tokens']:,} to "
        f"{r['grown_tokens']:,} tokens.\n\n",
        "Device memory (`cudaMemGetInfo`) at each stage, relative to the serving state before "
        "the swap; the KV grows by as many tokens as the freed bytes cover in whole granules "
        "(each of the 64 buffers maps whole granules).\n\n",
        table(["stage", "device free GB", "change vs before the swap MB"],
              [[k, f"{v / 1e9:.3f}", f"{(v - start) / 1e6:+.1f}"]
               for k, v in r["free_bytes_by_stage"].items()]),
        "\n", table(["check", "result"], [[k, "pass" if v else "FAIL"]
                                          for k, v in r["checks"].items()]),
        "\n", table(["operation", "ms", "MB"],
                    [["create arena (reserve + map start)", f"{r['arena_create_ms']:.1f}", ""],
                     ["grow (map granules)", f"{r['grow_ms']:.2f}",
                      f"{r['grow_mapped_bytes'] / 1e6:.1f}"],
                     ["shrink (unmap + release)", f"{r['shrink_ms']:.2f}",
                      f"{r['shrink_released_bytes'] / 1e6:.1f}"],
                     ["contrast: new buffers + copy old rows", f"{r['realloc_and_copy_ms']:.2f}",
                      ""]]),
    ])


def main() -> None:
    result = run()
    write_results("kv_vmm", result, markdown(result))
    if not all(result["checks"].values()):
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
