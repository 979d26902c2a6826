"""Argument validation shared by the ops.

Every check raises with the offending argument's name, so a bad call from
SGLang points at the argument rather than at an opaque indexing error deep in
torch.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {value.device}")
    return value


def require_dtype(name: str, tensor: torch.Tensor, *dtypes: torch.dtype) -> None:
    require_tensor(name, tensor)
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")


def require_index(name: str, tensor: torch.Tensor) -> None:
    require_dtype(name, tensor, *INDEX_DTYPES)


def require_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    require_tensor(name, tensor)
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")


def require_numel(name: str, tensor: torch.Tensor, numel: int) -> None:
    require_tensor(name, tensor)
    if tensor.numel() != numel:
        raise ValueError(
            f"{name} must have {numel} elements, got {tensor.numel()} "
            f"(shape {tuple(tensor.shape)})"
        )


def require_contiguous(name: str, tensor: torch.Tensor) -> None:
    """For outputs written through a flat view: a copy would drop the writes."""
    require_tensor(name, tensor)
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written in place)")


def require_range(name: str, values: torch.Tensor, low: int, high: int) -> None:
    """Require low <= values < high for every element."""
    if values.numel() == 0:
        return
    lo = int(values.min())
    hi = int(values.max())
    if lo < low or hi >= high:
        raise ValueError(f"{name} values must lie in [{low}, {high}), got range [{lo}, {hi}]")
