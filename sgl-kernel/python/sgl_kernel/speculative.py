"""KV-slot bookkeeping and speculative-decoding ops of SGLang's CPU engine.

Each op reproduces the contract of its Triton twin in SGLang
(``sglang.kernels.ops.speculative.*``, ``sglang.srt.mem_cache.allocation``):
same argument order, same outputs mutated in place, nothing returned unless the
twin returns something. Index arguments may be int32 or int64 independently of
each other, because SGLang mixes them (e.g. int64 request indices with int32
sequence lengths).

Work is vectorised over tokens; only tree walks loop, and then over tree depth
or sibling count (bounded by ``draft_token_num``), never over tokens.
"""

from __future__ import annotations

from typing import Optional

import torch

from sgl_kernel._checks import (
    require_contiguous,
    require_dtype,
    require_index,
    require_ndim,
    require_numel,
    require_range,
)
from sgl_kernel._unsupported import not_implemented

# TreeMaskMode values of sglang.kernels.ops.speculative.spec_tree.
_FULL_MASK = 0
_QLEN_ONLY = 1
_QLEN_ONLY_BITPACKING = 2


def _ragged_positions(
    starts: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand per-segment ranges [starts[i], starts[i] + lengths[i]) into flat arrays.

    Returns ``(segment, position)``, both int64 of length ``sum(lengths)``:
    element ``e`` belongs to segment ``segment[e]`` and sits at
    ``position[e]``. Segments appear in order, so element ``e`` is also the
    ``e``-th entry of a buffer holding all segments back to back.
    Requires ``lengths >= 0``.
    """
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    segment_first_element = torch.cumsum(lengths, 0) - lengths
    position = (
        torch.arange(total) - segment_first_element[segment] + starts.to(torch.int64)[segment]
    )
    return segment, position


def _check_req_to_token(req_to_token: torch.Tensor, pool_len: int) -> None:
    require_index("req_to_token", req_to_token)
    require_ndim("req_to_token", req_to_token, 2)
    if req_to_token.shape[1] != pool_len:
        raise ValueError(
            f"pool_len ({pool_len}) must equal req_to_token.shape[1] ({req_to_token.shape[1]})"
        )


def _request_rows(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
    """Validated int64 rows of req_to_token, one per request in the batch."""
    require_index("req_pool_indices", req_pool_indices)
    require_ndim("req_pool_indices", req_pool_indices, 1)
    rows = req_pool_indices.to(torch.int64)
    require_range("req_pool_indices", rows, 0, req_to_token.shape[0])
    return rows


def _token_ranges(
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    pool_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated int64 ``(starts, lengths)`` of the per-request column ranges."""
    for name, offsets in (("start_offset", start_offset), ("end_offset", end_offset)):
        require_index(name, offsets)
        require_numel(name, offsets, batch_size)
    starts = start_offset.reshape(-1).to(torch.int64)
    ends = end_offset.reshape(-1).to(torch.int64)
    require_range("start_offset", starts, 0, pool_len + 1)
    require_range("end_offset", ends, 0, pool_len + 1)
    lengths = ends - starts
    if bool((lengths < 0).any()):
        raise ValueError("end_offset must be >= start_offset for every request")
    return starts, lengths


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Scatter freshly allocated KV slots into the request-to-token table.

    For request ``i`` with ``n_i = end_offset[i] - start_offset[i]``::

        req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
            out_cache_loc[p_i : p_i + n_i],   p_i = n_0 + ... + n_{i-1}

    i.e. ``out_cache_loc`` holds every request's slots back to back. Writes
    ``req_to_token`` in place (values cast to its dtype); returns None.
    ``pool_len`` must equal ``req_to_token.shape[1]``.
    """
    _check_req_to_token(req_to_token, pool_len)
    rows = _request_rows(req_pool_indices, req_to_token)
    starts, lengths = _token_ranges(start_offset, end_offset, rows.numel(), pool_len)
    require_index("out_cache_loc", out_cache_loc)
    num_slots = int(lengths.sum())
    if out_cache_loc.numel() < num_slots:
        raise ValueError(
            f"out_cache_loc has {out_cache_loc.numel()} elements but the ranges "
            f"need {num_slots}"
        )
    if num_slots == 0:
        return
    segment, column = _ragged_positions(starts, lengths)
    req_to_token[rows[segment], column] = out_cache_loc.reshape(-1)[:num_slots].to(
        req_to_token.dtype
    )


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's KV slots ``[start_offset[i], end_offset[i])`` back to back.

    The inverse of :func:`assign_req_to_token_pool_cpu`: writes
    ``out_cache_loc[p_i : p_i + n_i] = req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]]`` in place. ``out_cache_loc`` (1-D) may be
    longer than ``sum(n_i)``; its tail is left untouched, because callers size
    it for the worst case.
    """
    _check_req_to_token(req_to_token, pool_len)
    rows = _request_rows(req_pool_indices, req_to_token)
    starts, lengths = _token_ranges(start_offset, end_offset, rows.numel(), pool_len)
    require_index("out_cache_loc", out_cache_loc)
    require_ndim("out_cache_loc", out_cache_loc, 1)
    num_slots = int(lengths.sum())
    if out_cache_loc.numel() < num_slots:
        raise ValueError(
            f"out_cache_loc has {out_cache_loc.numel()} elements but the ranges "
            f"need {num_slots}"
        )
    if num_slots == 0:
        return
    segment, column = _ragged_positions(starts, lengths)
    out_cache_loc[:num_slots] = req_to_token[rows[segment], column].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Read back the draft KV slots the allocator reserved after each prefix.

    With ``w = topk * num_steps``, request ``i`` owns
    ``out_cache_loc[i*w : (i+1)*w] = req_to_token[req_pool_indices[i],
    seq_lens[i] : seq_lens[i] + w]``. ``out_cache_loc`` has exactly
    ``batch * w`` elements and is written in place.
    """
    _check_req_to_token(req_to_token, pool_len)
    rows = _request_rows(req_pool_indices, req_to_token)
    batch_size = rows.numel()
    if topk < 0 or num_steps < 0:
        raise ValueError(f"topk ({topk}) and num_steps ({num_steps}) must be >= 0")
    slots_per_req = topk * num_steps
    require_index("seq_lens", seq_lens)
    require_numel("seq_lens", seq_lens, batch_size)
    require_index("out_cache_loc", out_cache_loc)
    require_numel("out_cache_loc", out_cache_loc, batch_size * slots_per_req)
    if batch_size * slots_per_req == 0:
        return
    first_column = seq_lens.reshape(-1).to(torch.int64)
    require_range("seq_lens", first_column, 0, pool_len - slots_per_req + 1)
    columns = first_column[:, None] + torch.arange(slots_per_req)
    out_cache_loc.copy_(req_to_token[rows[:, None], columns].reshape(out_cache_loc.shape))


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Pick each request's last accepted token as its bonus token.

    ``bonus_tokens[i] = accept_tokens.flatten()[i * accept_stride +
    accept_lens[i] - 1]``; ``accept_tokens`` holds ``accept_stride`` tokens per
    request and ``accept_lens`` counts the bonus token, so
    ``1 <= accept_lens[i] <= accept_stride``. Writes ``bonus_tokens`` in place.
    """
    require_index("accept_lens", accept_lens)
    batch_size = accept_lens.numel()
    require_numel("accept_tokens", accept_tokens, batch_size * accept_stride)
    require_numel("bonus_tokens", bonus_tokens, batch_size)
    if batch_size == 0:
        return
    lens = accept_lens.reshape(-1).to(torch.int64)
    require_range("accept_lens", lens, 1, accept_stride + 1)
    flat_index = torch.arange(batch_size) * accept_stride + lens - 1
    bonus = accept_tokens.reshape(-1)[flat_index]
    bonus_tokens.copy_(bonus.reshape(bonus_tokens.shape))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the KV slots of accepted draft tokens, dropping rejected ones.

    Walking ``accept_index`` in flat order, every entry ``a != -1`` appends
    ``out_cache_loc[a]`` to ``accept_out_cache_loc`` (1-D, written in place).
    Entries past the number of accepted tokens are left untouched.
    """
    require_index("accept_index", accept_index)
    require_index("out_cache_loc", out_cache_loc)
    require_ndim("accept_out_cache_loc", accept_out_cache_loc, 1)
    flat_index = accept_index.reshape(-1).to(torch.int64)
    require_range("accept_index", flat_index, -1, out_cache_loc.numel())
    accepted = flat_index[flat_index != -1]
    if accept_out_cache_loc.numel() < accepted.numel():
        raise ValueError(
            f"accept_out_cache_loc has {accept_out_cache_loc.numel()} elements "
            f"but {accepted.numel()} tokens were accepted"
        )
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc.reshape(-1)[accepted].to(
        accept_out_cache_loc.dtype
    )


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: Optional[torch.Tensor] = None,
) -> None:
    """Advance each request's draft window by one token, in place.

    Request ``i`` owns ``input_ids[s : s + n]`` with ``s = extend_start_loc[i]``
    and ``n = extend_seq_lens[i]``. Its tokens shift left by one and, when
    ``n > 0``, ``topk_index[i]`` is written at ``select_index[i]`` if given,
    else at ``s + n - 1``. Requests' windows must not overlap.
    """
    require_ndim("input_ids", input_ids, 1)
    require_index("extend_seq_lens", extend_seq_lens)
    batch_size = extend_seq_lens.numel()
    require_index("extend_start_loc", extend_start_loc)
    require_numel("extend_start_loc", extend_start_loc, batch_size)
    require_numel("topk_index", topk_index, batch_size)
    if batch_size == 0:
        return
    starts = extend_start_loc.reshape(-1).to(torch.int64)
    lens = extend_seq_lens.reshape(-1).to(torch.int64)
    require_range("extend_seq_lens", lens, 0, input_ids.numel() + 1)
    if bool(((starts < 0) | (starts + lens > input_ids.numel())).any()):
        raise ValueError(
            "extend_start_loc + extend_seq_lens must stay within input_ids "
            f"(length {input_ids.numel()})"
        )
    _, shifted = _ragged_positions(starts, (lens - 1).clamp(min=0))
    # The gather materialises before the scatter, so this is a memmove.
    input_ids[shifted] = input_ids[shifted + 1]

    has_tokens = lens > 0
    if select_index is None:
        new_token_pos = starts + lens - 1
    else:
        require_index("select_index", select_index)
        require_numel("select_index", select_index, batch_size)
        new_token_pos = select_index.reshape(-1).to(torch.int64)
        require_range("select_index", new_token_pos[has_tokens], 0, input_ids.numel())
    new_tokens = topk_index.reshape(-1)[has_tokens].to(input_ids.dtype)
    input_ids[new_token_pos[has_tokens]] = new_tokens


def _parent_nodes(
    parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int
) -> torch.Tensor:
    """Parent node of every draft-tree node, shape ``(batch, draft_token_num)``.

    Node 0 is the root (verified token); node ``i >= 1`` is the draft token
    ``selected_index[:, i - 1]``, whose parent is the root when
    ``selected_index // topk == 0`` and otherwise the node whose selected
    token equals ``parent_list[:, selected_index // topk]``. The root and any
    node whose parent is not among the selected tokens (a malformed tree,
    which the CUDA/Triton kernels skip as well) get -1.
    """
    selected = selected_index.to(torch.int64)
    batch_size, num_children = selected.shape
    root_parent = torch.full((batch_size, 1), -1, dtype=torch.int64)
    if num_children == 0:
        return root_parent
    parent_slot = torch.div(selected, topk, rounding_mode="floor")
    is_root_child = parent_slot == 0
    parent_width = parent_list.shape[1]
    require_range("selected_index // topk", parent_slot[~is_root_child], 1, max(parent_width, 1))
    if parent_width == 0:
        parent_token = torch.zeros_like(selected)
    else:
        parent_token = parent_list.to(torch.int64).gather(
            1, parent_slot.clamp(max=parent_width - 1)
        )
    # matches[b, child, j]: selected token j is the parent of child.
    matches = selected[:, None, :] == parent_token[:, :, None]
    found = matches.any(dim=-1)
    # argmax over booleans returns the first match, like the kernels' scan.
    first_match = matches.to(torch.uint8).argmax(dim=-1)
    child_parent = torch.where(
        is_root_child,
        torch.zeros_like(selected),
        torch.where(found, first_match + 1, torch.full_like(selected, -1)),
    )
    return torch.cat([root_parent, child_parent], dim=1)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the EAGLE draft tree consumed by target verification (all outputs in place).

    With ``n = draft_token_num`` and node numbering as in :func:`_parent_nodes`:

    * ``retrive_index[b, i] = b * n + i`` (flat token index).
    * ``retrive_next_token[b, p]`` = smallest child of ``p``;
      ``retrive_next_sibling[b, i]`` = smallest later node with the same
      parent. Entries with no child / sibling are left as the caller
      pre-filled them (SGLang fills -1).
    * Row ``i`` of the tree mask attends to the root, to ``i`` and to its
      ancestors, walking at most ``depth`` steps; ``positions[b*n + i] =
      verified_seq_len[b] + (number of non-root nodes marked)``.

    ``tree_mask`` is flat bool. QLEN_ONLY (1): ``batch * n * n`` entries, fully
    written. FULL_MASK (0): each request has ``n`` rows of ``seq_len + n``
    columns; only the last ``n`` columns of each row are written, the caller
    pre-fills the ``seq_len`` prefix columns. QLEN_ONLY_BITPACKING (2) has no
    CPU producer and is not implemented.
    """
    mode = int(tree_mask_mode)
    if mode == _QLEN_ONLY_BITPACKING:
        raise NotImplementedError(
            "sgl_kernel CPU (sglang-morph): build_tree_kernel_efficient_cpu is not "
            "implemented for tree_mask_mode QLEN_ONLY_BITPACKING (2)"
        )
    if mode not in (_FULL_MASK, _QLEN_ONLY):
        raise ValueError(f"tree_mask_mode must be 0, 1 or 2, got {tree_mask_mode}")
    if topk < 1 or depth < 0 or draft_token_num < 1:
        raise ValueError(
            f"need topk >= 1, depth >= 0, draft_token_num >= 1; got topk={topk}, "
            f"depth={depth}, draft_token_num={draft_token_num}"
        )
    n = draft_token_num
    require_index("parent_list", parent_list)
    require_ndim("parent_list", parent_list, 2)
    batch_size = parent_list.shape[0]
    require_index("selected_index", selected_index)
    require_ndim("selected_index", selected_index, 2)
    if tuple(selected_index.shape) != (batch_size, n - 1):
        raise ValueError(
            f"selected_index must have shape ({batch_size}, {n - 1}), "
            f"got {tuple(selected_index.shape)}"
        )
    require_index("verified_seq_len", verified_seq_len)
    require_numel("verified_seq_len", verified_seq_len, batch_size)
    require_dtype("tree_mask", tree_mask, torch.bool)
    for name, out in (
        ("positions", positions),
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        require_index(name, out)
        require_numel(name, out, batch_size * n)
    require_contiguous("retrive_next_token", retrive_next_token)
    require_contiguous("retrive_next_sibling", retrive_next_sibling)
    seq_lens = verified_seq_len.reshape(-1).to(torch.int64)
    if bool((seq_lens < 0).any()):
        raise ValueError("verified_seq_len must be non-negative")
    if mode == _QLEN_ONLY:
        require_numel("tree_mask", tree_mask, batch_size * n * n)
    else:
        require_numel("tree_mask", tree_mask, (int(seq_lens.sum()) + batch_size * n) * n)
        require_contiguous("tree_mask", tree_mask)
    if batch_size == 0:
        return

    parents = _parent_nodes(parent_list, selected_index, topk)
    node = torch.arange(n)
    batch_row = torch.arange(batch_size)[:, None]

    retrive_index.copy_((batch_row * n + node).reshape(retrive_index.shape))

    # children[b, p, c]: node c hangs under node p.
    children = parents[:, None, :] == node[:, None]
    has_child = children.any(dim=-1)
    first_child = torch.where(children, node, n).min(dim=-1).values
    retrive_next_token.view(batch_size, n)[has_child] = first_child[has_child].to(
        retrive_next_token.dtype
    )
    # later_siblings[b, i, k]: k > i shares i's (valid) parent.
    later_siblings = (
        (parents[:, :, None] == parents[:, None, :])
        & (parents[:, :, None] >= 0)
        & (node[None, :] > node[:, None])
    )
    has_sibling = later_siblings.any(dim=-1)
    next_sibling = torch.where(later_siblings, node, n).min(dim=-1).values
    retrive_next_sibling.view(batch_size, n)[has_sibling] = next_sibling[has_sibling].to(
        retrive_next_sibling.dtype
    )

    # Walk every row to the root at once; the walk is bounded by depth.
    tree = torch.zeros(batch_size, n, n, dtype=torch.bool)
    tree[:, :, 0] = True
    walk_node = node.expand(batch_size, n).clone()
    walking = (node > 0).expand(batch_size, n).clone()
    num_marked = torch.zeros(batch_size, n, dtype=torch.int64)
    row_batch = batch_row.expand(batch_size, n)
    row_node = node.expand(batch_size, n)
    for _ in range(depth):
        if not bool(walking.any()):
            break
        tree[row_batch[walking], row_node[walking], walk_node[walking]] = True
        num_marked += walking
        parent = parents.gather(1, walk_node)
        # Stop on reaching a root child (parent 0) or an orphan (parent -1).
        walking &= parent > 0
        walk_node = torch.where(walking, parent, walk_node)
    positions.copy_((seq_lens[:, None] + num_marked).reshape(positions.shape))

    if mode == _QLEN_ONLY:
        tree_mask.copy_(tree.reshape(tree_mask.shape))
        return
    row_width = seq_lens + n
    request_offset = torch.cumsum(row_width * n, 0) - row_width * n
    row_start = request_offset[:, None] + row_width[:, None] * node + seq_lens[:, None]
    flat_index = row_start[:, :, None] + node
    tree_mask.view(-1)[flat_index] = tree


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: accept the longest root path matching the target.

    Shapes: ``candidates``, ``retrive_*``, ``target_predict`` are
    ``(batch, n)``; ``predicts`` has ``batch * n`` elements (flat token index);
    ``accept_index`` is ``(batch, num_spec_step)``; ``accept_token_num`` has
    ``batch`` elements. Per request, starting at the root, each level scans the
    current node's children (first child, then siblings) for one whose draft
    token equals the target's prediction at the last accepted token; on a
    match ``predicts[last] = that token``, its flat index is appended to
    ``accept_index`` and the walk descends, otherwise it stops. Finally
    ``predicts[last] = target_predict[last]`` (the bonus token) and
    ``accept_token_num`` = accepted drafts (bonus excluded). Unaccepted
    ``accept_index`` slots keep the caller's pre-fill (-1). All in place.
    """
    require_index("candidates", candidates)
    require_ndim("candidates", candidates, 2)
    batch_size, n = candidates.shape
    for name, tensor in (
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
        ("target_predict", target_predict),
    ):
        require_index(name, tensor)
        if tuple(tensor.shape) != (batch_size, n):
            raise ValueError(
                f"{name} must have shape ({batch_size}, {n}) like candidates, "
                f"got {tuple(tensor.shape)}"
            )
    require_index("predicts", predicts)
    require_numel("predicts", predicts, batch_size * n)
    require_contiguous("predicts", predicts)
    require_index("accept_index", accept_index)
    require_ndim("accept_index", accept_index, 2)
    if accept_index.shape[0] != batch_size:
        raise ValueError(f"accept_index must have {batch_size} rows, got {accept_index.shape[0]}")
    require_index("accept_token_num", accept_token_num)
    require_numel("accept_token_num", accept_token_num, batch_size)
    num_spec_step = accept_index.shape[1]
    if batch_size == 0 or num_spec_step == 0:
        return
    token_index = retrive_index.to(torch.int64)
    next_token = retrive_next_token.to(torch.int64)
    next_sibling = retrive_next_sibling.to(torch.int64)
    require_range("retrive_index", token_index, 0, batch_size * n)
    require_range("retrive_next_token", next_token, -1, n)
    require_range("retrive_next_sibling", next_sibling, -1, n)
    draft_tokens = candidates.to(torch.int64)
    target_flat = target_predict.reshape(-1).to(torch.int64)
    predicts_flat = predicts.view(-1)

    rows = torch.arange(batch_size)
    last_accepted = token_index[:, 0].clone()
    accept_index[:, 0] = last_accepted.to(accept_index.dtype)
    num_accepted = torch.zeros(batch_size, dtype=torch.int64)
    node = torch.zeros(batch_size, dtype=torch.int64)
    descending = torch.ones(batch_size, dtype=torch.bool)
    for _ in range(1, num_spec_step):
        # Finished rows may hold node -1; their clamped lookup is discarded.
        node = torch.where(descending, next_token[rows, node.clamp(min=0)], node)
        target = target_flat[last_accepted]
        searching = descending & (node != -1)
        matched = torch.zeros(batch_size, dtype=torch.bool)
        # A node has at most n - 1 siblings, which bounds the scan.
        for _ in range(n):
            if not bool(searching.any()):
                break
            safe_node = node.clamp(min=0)
            hit = searching & (draft_tokens[rows, safe_node] == target)
            hit_rows = rows[hit]
            hit_index = token_index[hit_rows, safe_node[hit]]
            predicts_flat[last_accepted[hit]] = target[hit].to(predicts.dtype)
            num_accepted[hit] += 1
            accept_index[hit_rows, num_accepted[hit]] = hit_index.to(accept_index.dtype)
            last_accepted[hit] = hit_index
            matched |= hit
            searching &= ~hit
            node = torch.where(searching, next_sibling[rows, safe_node], node)
            searching &= node != -1
        descending &= matched
        if not bool(descending.any()):
            break
    accept_token_num.copy_(num_accepted.reshape(accept_token_num.shape))
    predicts_flat[last_accepted] = target_flat[last_accepted].to(predicts.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Recover tree linkage from a QLEN-layout tree mask (NGRAM speculative path).

    ``tree_mask`` is flat bool ``(batch, n, n)``: ``mask[b, i, j]`` marks node
    ``j`` as visible from node ``i``; only ``j < i`` (strict ancestors) counts.
    With ``parent(i)`` = the largest strict ancestor (-1 if none), writes in
    place, every entry:

    * ``positions[b*n + i] = verified_seq_len[b] + #ancestors(i)``
    * ``retrive_index[b, i] = b * n + i``
    * ``retrive_next_token[b, i]`` = smallest ``k > i`` with ``i`` an ancestor
      of ``k``, else -1
    * ``retrive_next_sibling[b, i]`` = smallest ``k > i`` with
      ``parent(k) == parent(i) >= 0``, else -1
    """
    n = draft_token_num
    require_dtype("tree_mask", tree_mask, torch.bool)
    require_numel("tree_mask", tree_mask, batch_size * n * n)
    require_index("verified_seq_len", verified_seq_len)
    require_numel("verified_seq_len", verified_seq_len, batch_size)
    for name, out in (
        ("positions", positions),
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        require_index(name, out)
        require_numel(name, out, batch_size * n)
    if batch_size == 0 or n == 0:
        return
    node = torch.arange(n)
    no_node = torch.full((), -1, dtype=torch.int64)
    ancestors = tree_mask.reshape(batch_size, n, n) & (node[None, :] < node[:, None])
    num_ancestors = ancestors.sum(dim=-1)
    parent = torch.where(ancestors, node, no_node).max(dim=-1).values
    # descendants[b, i, k]: i is an ancestor of k.
    descendants = ancestors.transpose(1, 2)
    first_child = torch.where(descendants, node, n).min(dim=-1).values
    later_siblings = (
        (parent[:, :, None] == parent[:, None, :])
        & (parent[:, :, None] >= 0)
        & (node[None, :] > node[:, None])
    )
    next_sibling = torch.where(later_siblings, node, n).min(dim=-1).values

    seq_lens = verified_seq_len.reshape(-1).to(torch.int64)
    positions.copy_((seq_lens[:, None] + num_ancestors).reshape(positions.shape))
    flat_token = torch.arange(batch_size)[:, None] * n + node
    retrive_index.copy_(flat_token.reshape(retrive_index.shape))
    retrive_next_token.copy_(
        torch.where(first_child < n, first_child, no_node).reshape(retrive_next_token.shape)
    )
    retrive_next_sibling.copy_(
        torch.where(next_sibling < n, next_sibling, no_node).reshape(retrive_next_sibling.shape)
    )


build_draft_decode_metadata_cpu = not_implemented(
    "build_draft_decode_metadata_cpu",
    "it is only used by SGLang's Intel AMX attention backend, which needs the "
    "native AMX kernels this pure-torch package deliberately does not provide",
)

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "reconstruct_indices_from_tree_mask",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]
