"""VmmKVArena on a real GPU: stable addresses across grow/shrink, exact mapped bytes, memory
given back to the device, and a CUDA graph that stays valid across growth.

Skipped without CUDA (run on the device machine: ``pytest tests/kernels/test_kv_vmm_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; run on the device machine")

ROW_SHAPE = (4, 64)  # 512 bytes per bf16 row


def _arena(max_rows=1 << 16, capacity_rows=5000, buffers=3):
    from sglang_morph.elastic.kv_vmm import VmmBufferSpec, VmmKVArena

    specs = [VmmBufferSpec(f"b{i}", ROW_SHAPE, torch.bfloat16) for i in range(buffers)]
    return VmmKVArena(specs, max_rows, capacity_rows, "cuda")


def test_grow_and_shrink_keep_addresses_and_data_and_map_exact_granules():
    arena = _arena()
    try:
        g = arena.granule_bytes
        rows_per_granule = g // 512
        ptrs = [b.data_ptr() for b in arena.buffers]
        assert arena.mapped_bytes == 3 * g * -(-5000 // rows_per_granule)
        data = [torch.randn(t.shape, device="cuda").to(torch.bfloat16) for t in arena.tensors]
        for t, d in zip(arena.tensors, data):
            t.copy_(d)
        arena.grow(3 * rows_per_granule + 7)
        arena.check_integrity()
        assert [t.data_ptr() for t in arena.tensors] == ptrs
        assert all(torch.equal(t[:5000], d) for t, d in zip(arena.tensors, data))
        arena.tensors[0][-1].fill_(1.0)  # the last grown row is mapped and writable
        assert arena.mapped_bytes == 3 * 4 * g
        released = arena.shrink(5000)
        assert released == 3 * g * (4 - -(-5000 // rows_per_granule))
        arena.check_integrity()
        assert all(torch.equal(t, d) for t, d in zip(arena.tensors, data))
    finally:
        arena.close()


def test_shrink_gives_memory_back_to_the_device():
    arena = _arena(max_rows=1 << 20, capacity_rows=0, buffers=2)
    try:
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        arena.grow(1 << 19)  # 2 x 256 MiB
        torch.cuda.synchronize()
        assert free0 - torch.cuda.mem_get_info()[0] >= arena.mapped_bytes == 2 * 256 << 20
        arena.shrink(0)
        assert arena.mapped_bytes == 0
        assert torch.cuda.mem_get_info()[0] >= free0 - arena.granule_bytes
    finally:
        arena.close()


def test_captured_graph_replays_correctly_after_growth_and_shrink():
    arena = _arena(capacity_rows=1000)
    try:
        out_loc = torch.zeros(8, dtype=torch.int64, device="cuda")
        read_loc = torch.zeros(64, dtype=torch.int64, device="cuda")
        new_rows = torch.zeros(8, *ROW_SHAPE, dtype=torch.bfloat16, device="cuda")
        result = torch.zeros(len(arena.buffers), device="cuda")

        def step():
            sums = []
            for buf in arena.buffers:  # whole-reservation views: pointer and size are fixed
                buf.index_copy_(0, out_loc, new_rows)
                sums.append(buf.index_select(0, read_loc).float().sum())
            result.copy_(torch.stack(sums))

        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()

        def check(lo, hi):
            out_loc.copy_(torch.randperm(hi - lo, device="cuda")[:8] + lo)
            read_loc.copy_(torch.randperm(hi - lo, device="cuda")[:64] + lo)
            new_rows.normal_()
            graph.replay()
            torch.cuda.synchronize()
            expected = torch.stack([t.index_select(0, read_loc).float().sum()
                                    for t in arena.tensors])
            assert torch.equal(result, expected)
            assert all(torch.equal(t.index_select(0, out_loc), new_rows) for t in arena.tensors)

        check(0, 1000)
        arena.grow(40_000)
        for t in arena.tensors:
            t[1000:].normal_()
        check(1000, 40_000)
        arena.shrink(1000)
        check(0, 1000)
    finally:
        arena.close()


def test_bad_sizes_are_refused_and_change_nothing():
    arena = _arena()
    try:
        before = arena.mapped_bytes
        with pytest.raises(ValueError, match="outside"):
            arena.grow(arena.max_rows + 1)
        with pytest.raises(ValueError, match="outside"):
            arena.shrink(arena.capacity_rows + 1)
        assert arena.mapped_bytes == before and arena.capacity_rows == 5000
        arena.check_integrity()
    finally:
        arena.close()
