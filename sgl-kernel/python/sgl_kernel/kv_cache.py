"""KV-cache slot moves addressed by raw buffer pointers.

SGLang's KV pools hand the copy kernel a table of layer-buffer addresses
(``tensor.data_ptr()``) and row sizes instead of the tensors themselves, so
the buffers are re-borrowed here through ctypes without copying.
"""

from __future__ import annotations

import ctypes

import torch

from sgl_kernel._checks import require_dtype, require_index, require_ndim, require_numel


def _borrow_rows(address: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """View the ``num_rows * row_bytes`` bytes at ``address`` as ``(num_rows, row_bytes)`` uint8.

    The view shares memory with the buffer and does not own it: it must not
    outlive the buffer, which holds for the duration of one copy call.
    """
    raw = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV row ``src_loc[j]`` onto row ``tgt_loc[j]`` in every layer buffer.

    ``data_ptrs[l]`` is the address of buffer ``l`` and ``strides[l]`` its row
    stride in bytes, which is also the number of bytes copied per row (rows
    are dense). Per buffer, every source row is read before any target row is
    written, so overlapping ``src_loc``/``tgt_loc`` behave as one parallel
    copy, like the Triton kernel. The caller guarantees every location is a
    valid row of every buffer (SGLang bounds-checks them in
    ``move_kv_cache``); buffer sizes are not visible from the pointers.
    """
    require_dtype("data_ptrs", data_ptrs, torch.int64, torch.uint64)
    require_ndim("data_ptrs", data_ptrs, 1)
    require_index("strides", strides)
    require_numel("strides", strides, data_ptrs.numel())
    require_index("tgt_loc", tgt_loc)
    require_index("src_loc", src_loc)
    require_numel("src_loc", src_loc, tgt_loc.numel())
    if tgt_loc.numel() == 0 or data_ptrs.numel() == 0:
        return
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    src = src_loc.reshape(-1).to(torch.int64)
    if int(torch.minimum(tgt.min(), src.min())) < 0:
        raise ValueError("tgt_loc and src_loc must be non-negative")
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        if address == 0:
            raise ValueError("data_ptrs must not contain null pointers")
        if row_bytes <= 0:
            raise ValueError(f"strides must be positive, got {row_bytes}")
        rows = _borrow_rows(address, row_bytes, num_rows)
        rows[tgt] = rows[src]
