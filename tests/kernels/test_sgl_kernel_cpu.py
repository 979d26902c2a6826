"""Tests for the pure-torch CPU ``sgl_kernel`` package (sgl-kernel/).

Every implemented op is compared with an independent reference written as a
plain per-element Python loop that mirrors the sequential semantics of
SGLang's Triton/CUDA twin. The SGLang integration test runs in a fresh
interpreter with ``SGLANG_USE_CPU_ENGINE=1``, because SGLang decides
``is_cpu()`` once per process (lru_cache) at import time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import sgl_kernel
from sgl_kernel import mamba

INDEX_DTYPES = (torch.int32, torch.int64)
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2
MASK_32 = 0xFFFFFFFF


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def randint(gen, low, high, size, dtype=torch.int64):
    return torch.randint(low, high, size, generator=gen, dtype=dtype)


# ---------------------------------------------------------------------------
# Package surface
# ---------------------------------------------------------------------------


def test_version_matches_distribution_metadata():
    assert sgl_kernel.__version__ == "0.1.0"
    assert importlib.metadata.version("sglang-morph-cpu-kernel") == sgl_kernel.__version__


def test_no_amx_ops_registered_so_sglang_uses_torch_fallbacks():
    # SGLang's _is_intel_amx_backend_available() probes exactly this attribute.
    for amx_op in ("convert_weight_packed", "weight_packed_linear", "decode_attention_cpu"):
        assert not hasattr(torch.ops.sgl_kernel, amx_op)
    assert hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu")


def test_optional_submodules_sglang_probes_with_try_import_are_absent():
    # SGLang wraps these imports in try/except ImportError and must take its
    # fallback path; providing them would opt into CUDA-only code.
    for name in ("sgl_kernel.kvcacheio", "sgl_kernel.scalar_type", "sgl_kernel.allreduce"):
        assert importlib.util.find_spec(name) is None


@pytest.mark.parametrize(
    "op, op_name",
    [
        (mamba.causal_conv1d_fn_cpu, "causal_conv1d_fn_cpu"),
        (mamba.causal_conv1d_update_cpu, "causal_conv1d_update_cpu"),
        (mamba.chunk_gated_delta_rule_cpu, "chunk_gated_delta_rule_cpu"),
        (sgl_kernel.build_draft_decode_metadata_cpu, "build_draft_decode_metadata_cpu"),
    ],
)
def test_unsupported_ops_raise_naming_the_op(op, op_name):
    with pytest.raises(
        NotImplementedError,
        match=f"sgl_kernel CPU \\(sglang-morph\\): {op_name} is not implemented",
    ):
        op(torch.zeros(1), torch.zeros(1), key="ignored")


# ---------------------------------------------------------------------------
# KV-slot bookkeeping
# ---------------------------------------------------------------------------


def random_ranges(gen, batch_size, pool_len):
    """Per-request [start, end) column ranges, about a third of them empty."""
    starts = randint(gen, 0, pool_len + 1, (batch_size,))
    lengths = (torch.rand(batch_size, generator=gen) * (pool_len - starts + 1)).long()
    lengths[torch.rand(batch_size, generator=gen) < 0.3] = 0
    return starts, starts + lengths


def ref_assign_req_to_token_pool(req_pool_indices, req_to_token, starts, ends, out_cache_loc):
    expected = req_to_token.clone()
    offset = 0
    for i in range(len(req_pool_indices)):
        for column in range(int(starts[i]), int(ends[i])):
            expected[int(req_pool_indices[i]), column] = int(out_cache_loc[offset])
            offset += 1
    return expected


@pytest.mark.parametrize("batch_size", [0, 1, 5])
@pytest.mark.parametrize("rows_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("offsets_dtype", INDEX_DTYPES)
def test_assign_req_to_token_pool(gen, batch_size, rows_dtype, offsets_dtype):
    num_reqs, pool_len = 8, 24
    req_to_token = randint(gen, 0, 1000, (num_reqs, pool_len), torch.int32)
    req_pool_indices = torch.randperm(num_reqs, generator=gen)[:batch_size].to(rows_dtype)
    starts, ends = random_ranges(gen, batch_size, pool_len)
    num_slots = int((ends - starts).sum())
    # Longer than needed: only the leading num_slots entries are consumed.
    out_cache_loc = randint(gen, 0, 10_000, (num_slots + 3,))
    expected = ref_assign_req_to_token_pool(
        req_pool_indices, req_to_token, starts, ends, out_cache_loc
    )

    result = sgl_kernel.assign_req_to_token_pool_cpu(
        req_pool_indices,
        req_to_token,
        starts.to(offsets_dtype),
        ends.to(offsets_dtype),
        out_cache_loc,
        pool_len,
    )

    assert result is None
    assert torch.equal(req_to_token, expected)


def test_assign_req_to_token_pool_validates_arguments():
    req_to_token = torch.zeros((2, 8), dtype=torch.int32)
    rows = torch.tensor([0, 1])
    loc = torch.arange(8)
    with pytest.raises(ValueError, match="end_offset must be >= start_offset"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            rows, req_to_token, torch.tensor([3, 0]), torch.tensor([2, 1]), loc, 8
        )
    with pytest.raises(ValueError, match="pool_len"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            rows, req_to_token, torch.tensor([0, 0]), torch.tensor([1, 1]), loc, 9
        )
    with pytest.raises(ValueError, match="out_cache_loc"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            rows, req_to_token, torch.tensor([0, 0]), torch.tensor([8, 8]), loc, 8
        )
    with pytest.raises(ValueError, match="req_pool_indices"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            torch.tensor([0, 2]), req_to_token, torch.tensor([0, 0]), torch.tensor([1, 1]), loc, 8
        )
    with pytest.raises(ValueError, match="start_offset"):
        sgl_kernel.assign_req_to_token_pool_cpu(
            rows, req_to_token, torch.tensor([0.0, 0.0]), torch.tensor([1, 1]), loc, 8
        )


@pytest.mark.parametrize("batch_size", [0, 1, 5])
@pytest.mark.parametrize("rows_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("offsets_dtype", INDEX_DTYPES)
def test_assign_extend_cache_locs(gen, batch_size, rows_dtype, offsets_dtype):
    num_reqs, pool_len = 8, 24
    req_to_token = randint(gen, 0, 1000, (num_reqs, pool_len), torch.int32)
    req_pool_indices = torch.randperm(num_reqs, generator=gen)[:batch_size].to(rows_dtype)
    starts, ends = random_ranges(gen, batch_size, pool_len)
    out_cache_loc = torch.full((int((ends - starts).sum()) + 4,), -7, dtype=torch.int64)
    expected = out_cache_loc.clone()
    offset = 0
    for i in range(batch_size):
        for column in range(int(starts[i]), int(ends[i])):
            expected[offset] = int(req_to_token[int(req_pool_indices[i]), column])
            offset += 1

    sgl_kernel.assign_extend_cache_locs_cpu(
        req_pool_indices,
        req_to_token,
        starts.to(offsets_dtype),
        ends.to(offsets_dtype),
        out_cache_loc,
        pool_len,
    )

    assert torch.equal(out_cache_loc, expected)  # includes the untouched tail


@pytest.mark.parametrize("batch_size", [0, 3])
@pytest.mark.parametrize("topk, num_steps", [(1, 3), (2, 2)])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_assign_draft_cache_locs_contiguous(gen, batch_size, topk, num_steps, index_dtype):
    num_reqs, pool_len = 6, 20
    slots_per_req = topk * num_steps
    req_to_token = randint(gen, 0, 1000, (num_reqs, pool_len), torch.int32)
    req_pool_indices = torch.randperm(num_reqs, generator=gen)[:batch_size].to(index_dtype)
    seq_lens = randint(gen, 0, pool_len - slots_per_req + 1, (batch_size,), index_dtype)
    out_cache_loc = torch.empty(batch_size * slots_per_req, dtype=torch.int64)
    expected = torch.tensor(
        [
            int(req_to_token[int(req_pool_indices[i]), int(seq_lens[i]) + j])
            for i in range(batch_size)
            for j in range(slots_per_req)
        ],
        dtype=torch.int64,
    )

    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(
        req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
    )

    assert torch.equal(out_cache_loc, expected)


def test_assign_draft_cache_locs_contiguous_rejects_overrun():
    req_to_token = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        sgl_kernel.assign_draft_cache_locs_contiguous_cpu(
            torch.tensor([0]),
            req_to_token,
            torch.tensor([6]),
            torch.empty(4, dtype=torch.int64),
            8,
            2,
            2,
        )
    with pytest.raises(ValueError, match="out_cache_loc"):
        sgl_kernel.assign_draft_cache_locs_contiguous_cpu(
            torch.tensor([0]),
            req_to_token,
            torch.tensor([0]),
            torch.empty(3, dtype=torch.int64),
            8,
            2,
            2,
        )


def layer_buffers(gen):
    """Layer buffers of different dtypes and row sizes, as a KV pool lays them out."""
    num_rows = 16
    return [
        torch.randn(num_rows, 2, 4, generator=gen).to(torch.bfloat16),
        torch.randn(num_rows, 3, generator=gen),
        randint(gen, -100, 100, (num_rows, 5), torch.int8),
    ]


@pytest.mark.parametrize("num_locs", [0, 1, 6])
@pytest.mark.parametrize("loc_dtype", INDEX_DTYPES)
def test_copy_all_layer_kv_cache(gen, num_locs, loc_dtype):
    buffers = layer_buffers(gen)
    num_rows = buffers[0].shape[0]
    tgt_loc = torch.randperm(num_rows, generator=gen)[:num_locs]
    # Independent permutation: sources and targets overlap.
    src_loc = torch.randperm(num_rows, generator=gen)[:num_locs]
    expected = []
    for buffer in buffers:
        snapshot = buffer.clone()
        moved = buffer.clone()
        for j in range(num_locs):
            moved[int(tgt_loc[j])] = snapshot[int(src_loc[j])]
        expected.append(moved)
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])

    sgl_kernel.copy_all_layer_kv_cache_cpu(
        data_ptrs, strides, tgt_loc.to(loc_dtype), src_loc.to(loc_dtype)
    )

    for buffer, want in zip(buffers, expected):
        assert torch.equal(buffer, want)


def test_copy_all_layer_kv_cache_validates_arguments():
    buffer = torch.zeros(4, 2)
    ptrs = torch.tensor([buffer.data_ptr()], dtype=torch.uint64)
    with pytest.raises(ValueError, match="strides"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(
            ptrs, torch.tensor([8, 8]), torch.tensor([0]), torch.tensor([1])
        )
    with pytest.raises(ValueError, match="src_loc"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(
            ptrs, torch.tensor([8]), torch.tensor([0]), torch.tensor([1, 2])
        )
    with pytest.raises(ValueError, match="data_ptrs"):
        sgl_kernel.copy_all_layer_kv_cache_cpu(
            ptrs.float(), torch.tensor([8]), torch.tensor([0]), torch.tensor([1])
        )


# ---------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [0, 1, 6])
def test_fill_bonus_tokens(gen, batch_size):
    accept_stride = 4
    accept_tokens = randint(gen, 0, 1000, (batch_size, accept_stride), torch.int32)
    accept_lens = randint(gen, 1, accept_stride + 1, (batch_size,), torch.int32)
    bonus_tokens = torch.empty(batch_size, dtype=torch.int32)
    expected = torch.tensor(
        [
            int(accept_tokens.flatten()[i * accept_stride + int(accept_lens[i]) - 1])
            for i in range(batch_size)
        ],
        dtype=torch.int32,
    )

    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride)

    assert torch.equal(bonus_tokens, expected)


def test_fill_bonus_tokens_rejects_empty_acceptance():
    with pytest.raises(ValueError, match="accept_lens"):
        sgl_kernel.fill_bonus_tokens_cpu(
            torch.zeros((2, 3), dtype=torch.int32),
            torch.tensor([1, 0], dtype=torch.int32),
            torch.empty(2, dtype=torch.int32),
            3,
        )


@pytest.mark.parametrize("batch_size", [0, 1, 5])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_fill_accept_out_cache_loc(gen, batch_size, index_dtype):
    num_spec_step, num_draft_tokens = 4, 6
    out_cache_loc = randint(gen, 0, 10_000, (batch_size * num_draft_tokens,))
    accept_index = randint(
        gen, 0, max(batch_size * num_draft_tokens, 1), (batch_size, num_spec_step), index_dtype
    )
    accept_index[torch.rand(accept_index.shape, generator=gen) < 0.4] = -1
    accept_out_cache_loc = torch.full((batch_size * num_spec_step,), -5, dtype=torch.int64)
    expected = accept_out_cache_loc.clone()
    dst = 0
    for src in accept_index.flatten().tolist():
        if src != -1:
            expected[dst] = out_cache_loc[src]
            dst += 1

    sgl_kernel.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc)

    assert torch.equal(accept_out_cache_loc, expected)


def test_fill_accept_out_cache_loc_rejects_out_of_range_index():
    with pytest.raises(ValueError, match="accept_index"):
        sgl_kernel.fill_accept_out_cache_loc_cpu(
            torch.tensor([[0, 4]]), torch.arange(4), torch.empty(2, dtype=torch.int64)
        )


@pytest.mark.parametrize("use_select_index", [False, True])
@pytest.mark.parametrize("lens_dtype", INDEX_DTYPES)
def test_rotate_input_ids(gen, use_select_index, lens_dtype):
    extend_seq_lens = torch.tensor([3, 0, 1, 5, 2], dtype=lens_dtype)
    extend_start_loc = (torch.cumsum(extend_seq_lens.long(), 0) - extend_seq_lens.long()).to(
        torch.int32
    )
    input_ids = randint(gen, 0, 1000, (int(extend_seq_lens.sum()) + 2,))
    topk_index = randint(gen, 1000, 2000, (5, 1))
    select_index = None
    if use_select_index:
        # Each request's new token lands on its first slot instead of its last.
        select_index = extend_start_loc.long()
    expected = input_ids.clone()
    for i in range(5):
        start, length = int(extend_start_loc[i]), int(extend_seq_lens[i])
        for j in range(length - 1):
            expected[start + j] = expected[start + j + 1]
        if length > 0:
            target = int(select_index[i]) if use_select_index else start + length - 1
            expected[target] = int(topk_index[i, 0])

    result = sgl_kernel.rotate_input_ids_cpu(
        input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index
    )

    assert result is None
    assert torch.equal(input_ids, expected)


def test_rotate_input_ids_empty_batch_and_validation():
    input_ids = torch.arange(4)
    empty = torch.empty(0, dtype=torch.int64)
    sgl_kernel.rotate_input_ids_cpu(input_ids, empty, empty, empty)
    assert torch.equal(input_ids, torch.arange(4))
    with pytest.raises(ValueError, match="extend_start_loc"):
        sgl_kernel.rotate_input_ids_cpu(
            input_ids, torch.tensor([2]), torch.tensor([3]), torch.tensor([9])
        )
    with pytest.raises(ValueError, match="topk_index"):
        sgl_kernel.rotate_input_ids_cpu(
            input_ids, torch.tensor([0]), torch.tensor([3]), torch.tensor([9, 9])
        )


def eagle_draft_tree(gen, batch_size, topk, depth, num_draft_tokens):
    """(parent_list, selected_index) exactly as SGLang's organize_draft_results lays them out.

    Step 0 proposes ``topk`` tokens (score indices 0..topk-1); each later step
    expands the ``topk`` best nodes of the previous step into ``topk`` children
    each. Scores are cumulative probabilities, so a selected node's ancestors
    are always selected too.
    """
    parent_rows, selected_rows = [], []
    for _ in range(batch_size):
        scores = torch.rand(topk, generator=gen).sort(descending=True).values.tolist()
        parents = [-1] + list(range(topk))
        expanded = list(range(topk))  # score indices of the nodes expanded next
        for step in range(1, depth):
            first = topk + (step - 1) * topk * topk
            children = []
            for j, parent in enumerate(expanded):
                for c in range(topk):
                    children.append(
                        (
                            scores[parent] * float(torch.rand((), generator=gen)),
                            first + j * topk + c,
                        )
                    )
            for score, _ in children:
                scores.append(score)
            expanded = [index for _, index in sorted(children, reverse=True)[:topk]]
            if step < depth - 1:
                parents.extend(expanded)
        best = torch.tensor(scores).topk(num_draft_tokens - 1).indices.sort().values
        parent_rows.append(parents if depth > 1 else [])
        selected_rows.append(best.tolist())
    return torch.tensor(parent_rows, dtype=torch.int64), torch.tensor(
        selected_rows, dtype=torch.int64
    )


def ref_build_tree(parent_list, selected_index, seq_lens, tree_mask, topk, depth, n, mode):
    """Port of the per-request loops of SGLang's Triton build-tree kernel."""
    batch_size = seq_lens.numel()
    parents, selected, lens = parent_list.tolist(), selected_index.tolist(), seq_lens.tolist()
    mask = tree_mask.tolist()
    positions = [0] * (batch_size * n)
    retrive_index = [[-1] * n for _ in range(batch_size)]
    next_token = [[-1] * n for _ in range(batch_size)]
    next_sibling = [[-1] * n for _ in range(batch_size)]
    prefix = 0
    for b in range(batch_size):

        def find(token):
            for k in range(n - 1):
                if selected[b][k] == token:
                    return k
            return None

        for i in range(n - 1, 0, -1):
            retrive_index[b][i] = b * n + i
            slot = selected[b][i - 1] // topk
            if slot == 0:
                parent = 0
            else:
                k = find(parents[b][slot])
                if k is None:
                    continue
                parent = k + 1
            if next_token[b][parent] == -1:
                next_token[b][parent] = i
            else:
                next_sibling[b][i] = next_token[b][parent]
                next_token[b][parent] = i
        retrive_index[b][0] = b * n
        for tid in range(n):
            if mode == QLEN_ONLY:
                row = b * n * n + tid * n
            else:
                row = n * n * b + n * prefix + (lens[b] + n) * tid + lens[b]
            mask[row] = True
            for j in range(1, n):
                mask[row + j] = False
            position = 0
            if tid > 0:
                cur = tid - 1
                for _ in range(depth):
                    position += 1
                    mask[row + cur + 1] = True
                    slot = selected[b][cur] // topk
                    if slot == 0:
                        break
                    k = find(parents[b][slot])
                    if k is None:
                        break
                    cur = k
            positions[b * n + tid] = lens[b] + position
        prefix += lens[b]
    return mask, positions, retrive_index, next_token, next_sibling


def run_build_tree(parent_list, selected_index, seq_lens, topk, depth, n, mode, index_dtype):
    batch_size = seq_lens.numel()
    if mode == QLEN_ONLY:
        tree_mask = torch.ones(batch_size * n * n, dtype=torch.bool)
    else:
        # Sentinel prefix columns must survive: the op writes only tree columns.
        tree_mask = torch.ones((int(seq_lens.sum()) + batch_size * n) * n, dtype=torch.bool)
    expected = ref_build_tree(
        parent_list, selected_index, seq_lens, tree_mask, topk, depth, n, mode
    )
    retrieve = torch.full((3, batch_size, n), -1, dtype=index_dtype)
    positions = torch.empty(batch_size * n, dtype=index_dtype)
    sgl_kernel.build_tree_kernel_efficient_cpu(
        parent_list.to(index_dtype),
        selected_index.to(index_dtype),
        seq_lens.to(index_dtype),
        tree_mask,
        positions,
        retrieve[0],
        retrieve[1],
        retrieve[2],
        topk,
        depth,
        n,
        mode,
    )
    got = (
        tree_mask.tolist(),
        positions.tolist(),
        retrieve[0].tolist(),
        retrieve[1].tolist(),
        retrieve[2].tolist(),
    )
    return got, expected, retrieve


@pytest.mark.parametrize("mode", [FULL_MASK, QLEN_ONLY])
@pytest.mark.parametrize("topk, depth, n", [(1, 1, 1), (1, 3, 4), (2, 1, 3), (2, 3, 6), (3, 4, 8)])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_build_tree_kernel_efficient_eagle_trees(gen, mode, topk, depth, n, index_dtype):
    batch_size = 3
    parent_list, selected_index = eagle_draft_tree(gen, batch_size, topk, depth, n)
    seq_lens = randint(gen, 0, 6, (batch_size,))

    got, expected, _ = run_build_tree(
        parent_list, selected_index, seq_lens, topk, depth, n, mode, index_dtype
    )

    assert got == expected


@pytest.mark.parametrize("mode", [FULL_MASK, QLEN_ONLY])
def test_build_tree_kernel_efficient_malformed_trees(gen, mode):
    # Arbitrary parent links, including parents that are never selected.
    topk, depth, n, batch_size = 2, 3, 6, 4
    parent_list = randint(gen, 0, 12, (batch_size, topk * (depth - 1) + 1))
    selected_index = randint(gen, 0, topk * parent_list.shape[1], (batch_size, n - 1))
    seq_lens = randint(gen, 0, 4, (batch_size,))

    got, expected, _ = run_build_tree(
        parent_list, selected_index, seq_lens, topk, depth, n, mode, torch.int64
    )

    assert got == expected


def test_build_tree_kernel_efficient_empty_batch_and_modes():
    empty = torch.empty((0, 3), dtype=torch.int64)
    nothing = torch.empty(0, dtype=torch.int64)
    args = (
        empty,
        empty,
        nothing,
        torch.empty(0, dtype=torch.bool),
        nothing,
        nothing,
        nothing,
        nothing,
        2,
        2,
        4,
    )
    sgl_kernel.build_tree_kernel_efficient_cpu(*args, QLEN_ONLY)
    with pytest.raises(NotImplementedError, match="build_tree_kernel_efficient_cpu"):
        sgl_kernel.build_tree_kernel_efficient_cpu(*args, QLEN_ONLY_BITPACKING)
    with pytest.raises(ValueError, match="tree_mask_mode"):
        sgl_kernel.build_tree_kernel_efficient_cpu(*args, 7)


def ref_verify_tree_greedy(
    predicts, accept_index, candidates, retrive_index, next_token, next_sibling, target_predict
):
    """Port of the per-request loop of SGLang's greedy tree verification."""
    predicts, accept_index = predicts.tolist(), accept_index.tolist()
    candidates, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = next_token.tolist(), next_sibling.tolist()
    target = target_predict.flatten().tolist()
    num_accepted = []
    for b in range(len(candidates)):
        last = index[b][0]
        accept_index[b][0] = last
        accepted = 0
        cur = 0
        for _ in range(1, len(accept_index[b])):
            cur = next_token[b][cur]
            while cur != -1:
                if candidates[b][cur] == target[last]:
                    predicts[last] = target[last]
                    accepted += 1
                    accept_index[b][accepted] = index[b][cur]
                    last = index[b][cur]
                    break
                cur = next_sibling[b][cur]
            if cur == -1:
                break
        num_accepted.append(accepted)
        predicts[last] = target[last]
    return predicts, accept_index, num_accepted


@pytest.mark.parametrize("topk, depth, n", [(1, 3, 4), (2, 3, 6), (3, 4, 8)])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("vocab_size", [2, 4])
def test_verify_tree_greedy(gen, topk, depth, n, index_dtype, vocab_size):
    batch_size = 5
    parent_list, selected_index = eagle_draft_tree(gen, batch_size, topk, depth, n)
    _, _, retrieve = run_build_tree(
        parent_list,
        selected_index,
        torch.full((batch_size,), 3),
        topk,
        depth,
        n,
        QLEN_ONLY,
        index_dtype,
    )
    # A tiny vocabulary makes long accepted paths likely.
    candidates = randint(gen, 0, vocab_size, (batch_size, n), index_dtype)
    target_predict = randint(gen, 0, vocab_size, (batch_size, n), index_dtype)
    predicts = torch.zeros(batch_size * n, dtype=torch.int32)
    accept_index = torch.full((batch_size, depth + 1), -1, dtype=torch.int32)
    accept_token_num = torch.empty(batch_size, dtype=torch.int32)
    expected = ref_verify_tree_greedy(
        predicts, accept_index, candidates, retrieve[0], retrieve[1], retrieve[2], target_predict
    )

    result = sgl_kernel.verify_tree_greedy_cpu(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrive_index=retrieve[0],
        retrive_next_token=retrieve[1],
        retrive_next_sibling=retrieve[2],
        target_predict=target_predict,
    )

    assert result is None
    assert (predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()) == expected


def test_verify_tree_greedy_accepts_a_fully_matching_chain():
    n = 4  # chain root -> 1 -> 2 -> 3
    retrive_index = torch.arange(n)[None]
    next_token = torch.tensor([[1, 2, 3, -1]])
    next_sibling = torch.full((1, n), -1)
    candidates = torch.tensor([[9, 5, 6, 7]])
    target_predict = torch.tensor([[5, 6, 7, 8]])
    predicts = torch.zeros(n, dtype=torch.int32)
    accept_index = torch.full((1, n), -1, dtype=torch.int32)
    accept_token_num = torch.empty(1, dtype=torch.int32)

    sgl_kernel.verify_tree_greedy_cpu(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        next_token,
        next_sibling,
        target_predict,
    )

    assert predicts.tolist() == [5, 6, 7, 8]
    assert accept_index.tolist() == [[0, 1, 2, 3]]
    assert accept_token_num.tolist() == [3]


def test_verify_tree_greedy_validates_shapes():
    two_by_three = torch.zeros((2, 3), dtype=torch.int64)
    with pytest.raises(ValueError, match="target_predict"):
        sgl_kernel.verify_tree_greedy_cpu(
            torch.zeros(6, dtype=torch.int32),
            torch.full((2, 2), -1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
            two_by_three,
            two_by_three,
            two_by_three,
            two_by_three,
            torch.zeros((2, 4), dtype=torch.int64),
        )


def ref_reconstruct(tree_mask, seq_lens, batch_size, n):
    """Port of the per-node loops of the compiled reconstruct_indices_from_tree_mask."""
    mask = tree_mask.tolist()
    positions, index, next_token, next_sibling = [], [], [], []
    for b in range(batch_size):
        base = b * n * n
        for tid in range(n):
            depth, parent = 0, -1
            for i in range(tid - 1, -1, -1):
                if mask[base + tid * n + i]:
                    depth += 1
                    if parent == -1:
                        parent = i
            positions.append(depth + int(seq_lens[b]))
            index.append(b * n + tid)
            child = next((i for i in range(tid + 1, n) if mask[base + i * n + tid]), -1)
            next_token.append(child)
            sibling = -1
            if parent != -1:
                for i in range(tid + 1, n):
                    row = base + i * n
                    if mask[row + parent] and not any(mask[row + parent + 1 : row + i]):
                        sibling = i
                        break
            next_sibling.append(sibling)
    return positions, index, next_token, next_sibling


def random_tree_masks(gen, batch_size, n):
    """Well-formed NGRAM trees: each row marks the node itself and its ancestors."""
    mask = torch.zeros(batch_size, n, n, dtype=torch.bool)
    for b in range(batch_size):
        parent = [-1] + [int(randint(gen, 0, i, ())) for i in range(1, n)]
        for i in range(n):
            node = i
            while node != -1:
                mask[b, i, node] = True
                node = parent[node]
    return mask.flatten()


@pytest.mark.parametrize("well_formed", [True, False])
@pytest.mark.parametrize("batch_size, n", [(0, 4), (1, 1), (3, 6)])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_reconstruct_indices_from_tree_mask(gen, well_formed, batch_size, n, index_dtype):
    if well_formed:
        tree_mask = random_tree_masks(gen, batch_size, n)
    else:
        tree_mask = torch.rand(batch_size * n * n, generator=gen) < 0.5
    seq_lens = randint(gen, 0, 50, (batch_size,), index_dtype)
    positions = torch.empty(batch_size * n, dtype=index_dtype)
    retrieve = torch.empty((3, batch_size, n), dtype=index_dtype)

    sgl_kernel.speculative.reconstruct_indices_from_tree_mask(
        tree_mask, seq_lens, positions, retrieve[0], retrieve[1], retrieve[2], batch_size, n
    )

    got = (
        positions.tolist(),
        retrieve[0].flatten().tolist(),
        retrieve[1].flatten().tolist(),
        retrieve[2].flatten().tolist(),
    )
    assert got == ref_reconstruct(tree_mask, seq_lens, batch_size, n)


# ---------------------------------------------------------------------------
# Seeded-sampling hash
# ---------------------------------------------------------------------------


def ref_murmur3_32(key: bytes) -> int:
    """Textbook MurmurHash3_x86_32 with seed 0, for keys whose length is a multiple of 4."""
    h = 0
    for offset in range(0, len(key), 4):
        k = int.from_bytes(key[offset : offset + 4], "little")
        k = (k * 0xCC9E2D51) & MASK_32
        k = ((k << 15) | (k >> 17)) & MASK_32
        k = (k * 0x1B873593) & MASK_32
        h ^= k
        h = ((h << 13) | (h >> 19)) & MASK_32
        h = (h * 5 + 0xE6546B64) & MASK_32
    h ^= len(key)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK_32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK_32
    return h ^ (h >> 16)


def test_reference_murmur3_matches_published_vector():
    assert ref_murmur3_32(b"test") == 0xBA6BD213


@pytest.mark.parametrize("seed_dtype", [torch.uint64, torch.int64])
def test_murmur_hash32_cpu(seed_dtype):
    seeds = [0, 1, 42, 2**32 + 7, 2**63 + 12345, 2**64 - 1]
    if seed_dtype == torch.int64:
        seeds = [s - 2**64 if s >= 2**63 else s for s in seeds]
    seed = torch.tensor(seeds, dtype=seed_dtype)
    positions = torch.tensor([0, 5, 2**31 + 3, 7, 2**33 + 1, 100])
    col_indices = torch.tensor([0, 1, 2, 31_999, 2**32 - 1, 2**32 + 9])
    expected = [
        [
            ref_murmur3_32(struct.pack("<QII", s % 2**64, int(p) & MASK_32, int(c) & MASK_32))
            for c in col_indices.tolist()
        ]
        for s, p in zip(seeds, positions.tolist())
    ]

    hashed = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed, positions, col_indices)

    assert hashed.dtype == torch.uint32
    assert hashed.shape == (len(seeds), col_indices.numel())
    assert hashed.to(torch.int64).tolist() == expected


def test_murmur_hash32_cpu_shape_only_kernel_and_validation():
    # The fake kernel torch.compile traces with also serves the meta device.
    meta = torch.ops.sgl_kernel.murmur_hash32_cpu.default(
        torch.zeros(3, dtype=torch.int64, device="meta"),
        torch.zeros(3, dtype=torch.int64, device="meta"),
        torch.arange(7, device="meta"),
    )
    assert meta.shape == (3, 7) and meta.dtype == torch.uint32
    with pytest.raises(ValueError, match="positions"):
        torch.ops.sgl_kernel.murmur_hash32_cpu.default(
            torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.arange(4)
        )
    with pytest.raises(ValueError, match="col_indices"):
        torch.ops.sgl_kernel.murmur_hash32_cpu.default(
            torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(2)
        )


# ---------------------------------------------------------------------------
# SGLang integration
# ---------------------------------------------------------------------------

SGLANG_CPU_PATH_SCRIPT = textwrap.dedent("""
    import os

    import torch

    import sgl_kernel
    from sglang.srt.utils.common import cpu_has_amx_support, is_cpu

    # Every SGLang module that imports from sgl_kernel on the CPU path.
    import sglang.kernels.ops.kvcache.cache_move as cache_move
    import sglang.kernels.ops.sampling.murmur_hash as murmur_hash
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.kernels.ops.speculative.eagle as eagle
    import sglang.kernels.ops.speculative.multi_layer_eagle as multi_layer_eagle
    import sglang.kernels.ops.speculative.reconstruct_tree as reconstruct_tree
    import sglang.kernels.ops.speculative.spec_tree as spec_tree
    import sglang.srt.layers.attention.linear.kda_backend as kda_backend
    import sglang.srt.mem_cache.allocation as allocation
    import sglang.srt.speculative.eagle_utils as eagle_utils

    # The GDN backend also reads GDN torch ops that are deliberately left
    # unregistered (hybrid linear-attention models are unsupported).
    try:
        import sglang.srt.layers.attention.linear.gdn_backend
    except AttributeError as error:
        assert "sgl_kernel" in str(error), error
    else:
        raise AssertionError("gdn_backend imported without the GDN torch ops")

    assert is_cpu(), "SGLANG_USE_CPU_ENGINE=1 must select the CPU engine"
    assert not cpu_has_amx_support(), "the AMX backend must stay disabled"
    assert allocation.assign_req_to_token_pool_cpu is sgl_kernel.assign_req_to_token_pool_cpu
    assert cache_move.copy_all_layer_kv_cache_cpu is sgl_kernel.copy_all_layer_kv_cache_cpu
    assert eagle.fill_bonus_tokens_cpu is sgl_kernel.fill_bonus_tokens_cpu
    assert multi_layer_eagle.rotate_input_ids_cpu is sgl_kernel.rotate_input_ids_cpu
    assert spec_tree.sgl_verify_tree_greedy_cpu is sgl_kernel.verify_tree_greedy_cpu
    assert cache_locs.assign_extend_cache_locs_cpu is sgl_kernel.assign_extend_cache_locs_cpu
    assert (
        reconstruct_tree.reconstruct_indices_from_tree_mask
        is sgl_kernel.reconstruct_indices_from_tree_mask
    )
    assert kda_backend.causal_conv1d_update is sgl_kernel.mamba.causal_conv1d_update_cpu

    # Drive each op through SGLang's own wrapper, as the scheduler does.
    req_to_token = torch.zeros((4, 16), dtype=torch.int32)
    allocation.assign_req_to_token_pool_func(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([3, 1]),
        torch.tensor([7, 8, 9]), 2,
    )
    assert req_to_token[2, 1:3].tolist() == [7, 8] and int(req_to_token[0, 0]) == 9

    locs = cache_locs.assign_extend_cache_locs_func(
        torch.tensor([2]), req_to_token, torch.tensor([1]), torch.tensor([3]), 1, 2, "cpu"
    )
    assert locs.tolist() == [7, 8]
    draft_locs = torch.empty(2, dtype=torch.int64)
    cache_locs.assign_draft_cache_locs_contiguous_func(
        torch.tensor([2]), req_to_token, torch.tensor([1]), draft_locs, 1, 2
    )
    assert draft_locs.tolist() == [7, 8]
    front = torch.zeros(2, dtype=torch.int64)
    cache_locs.fill_front_out_cache_loc_func(
        torch.tensor([1, 1]), torch.tensor([10, 11, 12, 13]), front
    )
    assert front.tolist() == [10, 12]

    kv = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    ptrs = torch.tensor([kv.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([kv.stride(0) * kv.element_size()])
    cache_move.copy_all_layer_kv_cache_func(
        ptrs, strides, torch.tensor([0, 5]), torch.tensor([5, 0]), 2, 2, {}
    )
    assert kv[0].tolist() == [10.0, 11.0] and kv[5].tolist() == [0.0, 1.0]

    bonus = torch.empty(2, dtype=torch.int32)
    eagle.fill_bonus_tokens_func(
        torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
        torch.tensor([2, 3], dtype=torch.int32), bonus, 3, 2,
    )
    assert bonus.tolist() == [2, 6]
    accepted = torch.zeros(4, dtype=torch.int64)
    eagle.fill_accept_out_cache_loc_func(
        torch.tensor([[0, -1], [3, 2]], dtype=torch.int32),
        torch.tensor([40, 41, 42, 43]),
        accepted,
        4,
    )
    assert accepted.tolist() == [40, 43, 42, 0]

    ids = torch.tensor([1, 2, 3, 4, 5])
    multi_layer_eagle.rotate_input_ids(
        ids, torch.tensor([0, 3]), torch.tensor([3, 2]), torch.tensor([8, 9])
    )
    assert ids.tolist() == [2, 3, 8, 5, 9]

    # A topk=2, 2-step EAGLE tree (root, two children, one grandchild), built
    # and verified through SGLang's CPU entry points.
    bs, topk, steps, n = 1, 2, 2, 4
    tree = eagle_utils.build_tree_kernel_efficient(
        bonus_tokens=torch.tensor([100]),
        parent_list=torch.tensor([[-1, 0, 1]]),
        top_scores_index=torch.tensor([[0, 1, 2]]),
        draft_tokens=torch.tensor([[11, 12, 13]]),
        seq_lens=torch.tensor([5]),
        seq_lens_sum=5,
        topk=topk,
        spec_steps=steps,
        num_verify_tokens=n,
        tree_mask_mode=eagle_utils.default_tree_mask_mode(),
    )
    tree_mask, positions, retrieve_index, next_token, next_sibling, draft_tokens = tree
    assert positions.tolist() == [5, 6, 6, 7]
    assert next_token.tolist() == [[1, 3, -1, -1]] and next_sibling.tolist() == [[-1, 2, -1, -1]]
    predict = torch.zeros(n, dtype=torch.int32)
    accept_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
    num_accepted = torch.empty(bs, dtype=torch.int32)
    predict, accept_index, num_accepted = spec_tree.verify_tree_greedy_func(
        predict, accept_index, num_accepted, draft_tokens.reshape(bs, n),
        retrieve_index, next_token, next_sibling,
        target_predict=torch.tensor([[11, 13, 0, 77]]),
    )
    assert accept_index.tolist() == [[0, 1, 3]] and num_accepted.tolist() == [2]
    assert predict.tolist() == [11, 13, 0, 77]

    ngram_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).flatten()
    ngram = torch.empty((4, 3), dtype=torch.int64)
    reconstruct_tree.reconstruct_indices_from_tree_mask_func(
        ngram_mask, torch.tensor([7]), ngram[0], ngram[1:2], ngram[2:3], ngram[3:4], 1, 3
    )
    assert ngram.tolist() == [[7, 8, 8], [0, 1, 2], [1, -1, -1], [-1, 2, -1]]

    hashed = murmur_hash.murmur_hash32(
        torch.tensor([3], dtype=torch.uint64), torch.tensor([4]), torch.arange(3)
    )
    assert hashed.shape == (1, 3) and hashed.dtype == torch.uint32
    print("SGLANG_CPU_PATH_OK", flush=True)
    # Skip interpreter teardown of SGLang's import graph (seconds, nothing to flush).
    os._exit(0)
    """)


def test_sglang_cpu_path_imports_and_calls_sgl_kernel():
    # pytest.importorskip would import sglang here (~7 s) only to be thrown
    # away: the check must run in a fresh SGLANG_USE_CPU_ENGINE=1 process.
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    completed = subprocess.run(
        [sys.executable, "-c", SGLANG_CPU_PATH_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "SGLANG_CPU_PATH_OK" in completed.stdout
