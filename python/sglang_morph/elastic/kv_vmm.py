"""KV buffers whose device addresses never change while their capacity grows and shrinks (CUDA).

A CUDA graph records raw device pointers. Growing a KV pool by allocating bigger buffers and
copying the old rows (what ``kv_resizer`` does on CPU) moves every buffer, so each captured
graph would read and write freed memory. With the CUDA driver's virtual-memory API the address
range is reserved once, for the most rows a buffer can ever hold, and physical memory is mapped
under its first ``capacity_rows`` rows only: growing maps more granules at the end of each
buffer, shrinking unmaps them and gives the memory back to the device. The buffers' pointers,
hence every captured graph, stay valid across both.

SGLang 0.5.23 has VMM-backed KV buffers too (``mem_cache/kv_vmm_backing.py``), but they only
grow (its post-capture sizing backs a reserved range once, monotonically). A restore must give
KV memory back to the weights, so this arena maps one physical allocation per granule (2 MiB on
current GPUs) and can unmap any suffix exactly.

Only needs ``cuda.bindings`` (cuda-python, installed with PyPI's torch) and torch; imported only
on CUDA.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch


class VmmError(RuntimeError):
    """A CUDA driver call of the arena failed; the message names it and its error code."""


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result: tuple, what: str) -> Any:
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise VmmError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclasses.dataclass(frozen=True)
class VmmBufferSpec:
    """One KV buffer: rows of ``row_shape`` elements of ``dtype`` (e.g. one token's K of one
    layer: ``(kv_heads, head_dim)``)."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize


class _CudaArray:
    """A device pointer torch can wrap without copying (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
        }


class VmmKVArena:
    """KV buffers over one reserved virtual-address range, mapped up to ``capacity_rows``.

    ``buffers[i]`` is buffer ``i`` over its whole reservation, ``[max_rows, *row_shape]``: the
    tensor a pool hands to its kernels (and a CUDA graph captures), created once, so its
    pointer and its size (which bounds-checked ops such as ``index_put`` compare indices with)
    never change. ``tensors[i]`` is its first ``capacity_rows`` rows, the mapped part.

    Invariants (``check_integrity``): buffer ``i`` starts at ``base + offsets[i]`` for the
    arena's whole life; exactly the granules under its first ``capacity_rows`` rows are
    mapped, one physical allocation each, readable and writable by the device;
    ``mapped_bytes`` is their total. Rows past ``capacity_rows`` are unmapped: a kernel that
    touches them faults, so the pool above must never hand them out. A ``grow`` or ``shrink``
    that fails leaves the arena as it was.
    """

    def __init__(self, specs: list[VmmBufferSpec], max_rows: int, capacity_rows: int,
                 device: torch.device | str | int):
        if not specs or max_rows <= 0 or not 0 <= capacity_rows <= max_rows:
            raise ValueError(f"VmmKVArena: need buffers and 0 <= capacity_rows {capacity_rows} "
                             f"<= max_rows {max_rows} (> 0)")
        driver = _driver()
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"VmmKVArena needs a CUDA device, got {dev}")
        self.device = torch.device("cuda", dev.index if dev.index is not None
                                   else torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)  # the primary context is current for the driver calls
        self.specs = list(specs)
        self.max_rows = max_rows
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.device.index
        self.granule_bytes = int(_check(driver.cuMemGetAllocationGranularity(
            self._prop,
            driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        self._access = driver.CUmemAccessDesc()
        self._access.location = self._prop.location
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        spans = [self._granules(max_rows * s.row_bytes) * self.granule_bytes for s in specs]
        self.offsets = [sum(spans[:i]) for i in range(len(spans))]
        self.reserved_bytes = sum(spans)
        self.base = int(_check(driver.cuMemAddressReserve(self.reserved_bytes, self.granule_bytes,
                                                          0, 0), "cuMemAddressReserve"))
        # Per buffer, the physical handle of each mapped granule, in address order.
        self._handles: list[list[Any]] = [[] for _ in specs]
        self.capacity_rows = 0
        self.buffers = [
            torch.as_tensor(_CudaArray(self.base + off, max_rows * s.row_bytes),
                            device=self.device).view(s.dtype).view(max_rows, *s.row_shape)
            for off, s in zip(self.offsets, specs)]
        self.tensors: list[torch.Tensor] = []
        try:
            self.grow(capacity_rows)
        except BaseException:
            self.close()
            raise

    def _granules(self, nbytes: int) -> int:
        return -(-nbytes // self.granule_bytes)

    @property
    def mapped_bytes(self) -> int:
        return sum(len(h) for h in self._handles) * self.granule_bytes

    def mapped_bytes_for(self, capacity_rows: int) -> int:
        """Device bytes the arena maps at ``capacity_rows`` (what a budget must grant)."""
        return sum(self._granules(capacity_rows * s.row_bytes) for s in self.specs) \
            * self.granule_bytes

    def _views(self) -> list[torch.Tensor]:
        return [buf[: self.capacity_rows] for buf in self.buffers]

    def grow(self, capacity_rows: int) -> int:
        """Map granules up to ``capacity_rows`` rows; returns the bytes newly mapped."""
        if not self.capacity_rows <= capacity_rows <= self.max_rows:
            raise ValueError(f"grow: {capacity_rows} rows outside [{self.capacity_rows}, "
                             f"{self.max_rows}]")
        driver = _driver()
        added: list[tuple[int, Any]] = []  # (buffer, handle) mapped by this call
        try:
            for i, spec in enumerate(self.specs):
                for g in range(len(self._handles[i]),
                               self._granules(capacity_rows * spec.row_bytes)):
                    handle = _check(driver.cuMemCreate(self.granule_bytes, self._prop, 0),
                                    "cuMemCreate")
                    ptr = self.base + self.offsets[i] + g * self.granule_bytes
                    try:
                        _check(driver.cuMemMap(ptr, self.granule_bytes, 0, handle, 0),
                               "cuMemMap")
                    except BaseException:
                        driver.cuMemRelease(handle)
                        raise
                    self._handles[i].append(handle)
                    added.append((i, handle))
                    _check(driver.cuMemSetAccess(ptr, self.granule_bytes, [self._access], 1),
                           "cuMemSetAccess")
        except BaseException:
            for i, _handle in reversed(added):
                self._unmap_last(i)
            raise
        self.capacity_rows = capacity_rows
        self.tensors = self._views()
        return len(added) * self.granule_bytes

    def shrink(self, capacity_rows: int) -> int:
        """Unmap the granules past ``capacity_rows`` rows and give them back to the device;
        returns the bytes released. The caller has moved every live row below the boundary
        and synchronized the device (nothing in flight may touch the rows)."""
        if not 0 <= capacity_rows <= self.capacity_rows:
            raise ValueError(f"shrink: {capacity_rows} rows outside [0, {self.capacity_rows}]")
        torch.cuda.synchronize(self.device)
        released = 0
        for i, spec in enumerate(self.specs):
            keep = self._granules(capacity_rows * spec.row_bytes)
            while len(self._handles[i]) > keep:
                self._unmap_last(i)
                released += self.granule_bytes
        self.capacity_rows = capacity_rows
        self.tensors = self._views()
        return released

    def _unmap_last(self, i: int) -> None:
        driver = _driver()
        handle = self._handles[i].pop()
        ptr = self.base + self.offsets[i] + len(self._handles[i]) * self.granule_bytes
        _check(driver.cuMemUnmap(ptr, self.granule_bytes), "cuMemUnmap")
        _check(driver.cuMemRelease(handle), "cuMemRelease")

    def check_integrity(self) -> None:
        for i, (spec, tensor) in enumerate(zip(self.specs, self.tensors)):
            if tensor.data_ptr() != self.base + self.offsets[i] or \
                    self.buffers[i].data_ptr() != tensor.data_ptr():
                raise AssertionError(f"buffer {spec.name} moved")
            if tuple(tensor.shape) != (self.capacity_rows, *spec.row_shape):
                raise AssertionError(f"buffer {spec.name} has shape {tuple(tensor.shape)}")
            if len(self._handles[i]) != self._granules(self.capacity_rows * spec.row_bytes):
                raise AssertionError(f"buffer {spec.name}: {len(self._handles[i])} granules "
                                     f"mapped for {self.capacity_rows} rows")
        if self.mapped_bytes != self.mapped_bytes_for(self.capacity_rows):
            raise AssertionError("mapped bytes drifted")

    def close(self) -> None:
        """Unmap everything and free the address range (tensors must no longer be used)."""
        if self.base is None:
            return
        torch.cuda.synchronize(self.device)
        for i in range(len(self._handles)):
            while self._handles[i]:
                self._unmap_last(i)
        self.tensors, self.buffers = [], []
        _check(_driver().cuMemAddressFree(self.base, self.reserved_bytes), "cuMemAddressFree")
        self.base = None
