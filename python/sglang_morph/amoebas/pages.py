"""Anonymous memory whose pages go back to the OS while the address range stays mapped.

The AMOEBAs paper frees the weight shards a merged member no longer needs with the CUDA
driver's ``cuMemUnmap`` over 2 MiB granules, keeping the virtual range reserved so every
pointer into it (and every captured graph) stays valid. On the CPU the same thing is an
anonymous private mapping and ``madvise(MADV_DONTNEED)``: the kernel drops the pages, the
process's resident memory falls at once, the addresses stay mapped, a read of a dropped page
sees zeros and a write faults in a fresh zeroed page.

Transparent huge pages are turned off for each mapping (``MADV_NOHUGEPAGE``). With them on, a
release that covers part of a 2 MiB huge page only splits it: the memory stays allocated
until the kernel's deferred split runs under pressure, so the release granularity would not
be the page size the layout was padded for, and freed bytes would not be free.

Releasing a shard needs its bytes to start and end on pages: ``padded_intermediate`` is the
paper's Eq. 2, the smallest FFN intermediate size for which every allowed degree's shards do
(``padding_overhead`` says what the zero rows cost).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from collections.abc import Iterable

import torch

PAGE_BYTES = mmap.PAGESIZE

# /proc/self/pagemap: one 64-bit entry per virtual page; bit 63 says the page is in RAM.
_PAGEMAP_ENTRY_BYTES = 8
_PRESENT_BIT = 1 << 63


def padding_multiple(hidden: int, dtype_bytes: int, degrees: Iterable[int],
                     page_bytes: int = PAGE_BYTES) -> int:
    """What ``I_pad`` must be a multiple of: for each degree ``d`` (1 always included), a
    shard of ``k = I_pad/d`` rows ends on a page iff ``k`` is a multiple of
    ``page_bytes / gcd(page_bytes, hidden*dtype_bytes)``."""
    if min(hidden, dtype_bytes, page_bytes) < 1:
        raise ValueError(f"sizes must be >= 1: hidden={hidden}, dtype_bytes={dtype_bytes}, "
                         f"page_bytes={page_bytes}")
    degrees = {1, *degrees}
    if min(degrees) < 1:
        raise ValueError(f"degrees must be >= 1, got {sorted(degrees)}")
    rows_per_page_unit = page_bytes // math.gcd(page_bytes, hidden * dtype_bytes)
    return math.lcm(*(d * rows_per_page_unit for d in degrees))


def padded_intermediate(intermediate: int, hidden: int, dtype_bytes: int,
                        degrees: Iterable[int], page_bytes: int = PAGE_BYTES) -> int:
    """The paper's Eq. 2: the smallest ``I_pad >= intermediate`` that every allowed degree
    divides, with each shard's byte boundary ``(I_pad/d) * hidden * dtype_bytes`` on a page."""
    if intermediate < 1:
        raise ValueError(f"intermediate must be >= 1, got {intermediate}")
    multiple = padding_multiple(hidden, dtype_bytes, degrees, page_bytes)
    return -(-intermediate // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class PaddingOverhead:
    """What padding costs one MLP: ``I_pad - I`` zero rows in each of gate, up and down^T
    (``overhead_fraction`` is of the unpadded FFN weights)."""

    intermediate: int
    padded_intermediate: int
    overhead_bytes_per_layer: int
    overhead_fraction: float


def padding_overhead(intermediate: int, hidden: int, dtype_bytes: int, degrees: Iterable[int],
                     page_bytes: int = PAGE_BYTES) -> PaddingOverhead:
    padded = padded_intermediate(intermediate, hidden, dtype_bytes, degrees, page_bytes)
    return PaddingOverhead(intermediate, padded,
                           3 * (padded - intermediate) * hidden * dtype_bytes,
                           (padded - intermediate) / intermediate)


class AnonymousMapping:
    """``nbytes`` of private anonymous memory at one fixed, page-aligned address.

    Invariants: ``address`` and ``nbytes`` never change while the object lives; ``nbytes`` is
    a whole number of pages; every tensor from ``tensor`` views this memory (no copy), so it
    keeps the mapping alive and sees every release and every write.
    """

    def __init__(self, nbytes: int):
        if nbytes <= 0 or nbytes % PAGE_BYTES:
            raise ValueError(f"a mapping is a positive whole number of {PAGE_BYTES}-byte pages,"
                             f" got {nbytes} bytes")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._map.madvise(mmap.MADV_NOHUGEPAGE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self._bytes.data_ptr()
        if self.address % PAGE_BYTES:
            raise AssertionError(f"mmap returned an address {self.address:#x} off a page")

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole mapping as a flat tensor of ``dtype`` (a view: writes land in the pages)."""
        return self._bytes.view(dtype)

    def _check_range(self, start_byte: int, stop_byte: int) -> None:
        if not 0 <= start_byte <= stop_byte <= self.nbytes:
            raise ValueError(f"byte range [{start_byte}, {stop_byte}) is outside the "
                             f"{self.nbytes}-byte mapping")
        if start_byte % PAGE_BYTES or stop_byte % PAGE_BYTES:
            raise ValueError(f"byte range [{start_byte}, {stop_byte}) does not start and end "
                             f"on {PAGE_BYTES}-byte pages")

    def release(self, start_byte: int, stop_byte: int) -> int:
        """Give the pages of ``[start_byte, stop_byte)`` back to the OS; returns the range's
        length. The range stays mapped: it reads as zeros until it is written again."""
        self._check_range(start_byte, stop_byte)
        if stop_byte > start_byte:
            self._map.madvise(mmap.MADV_DONTNEED, start_byte, stop_byte - start_byte)
        return stop_byte - start_byte

    def resident_bytes(self, start_byte: int = 0, stop_byte: int | None = None) -> int:
        """Bytes of ``[start_byte, stop_byte)`` whose pages are mapped in RAM right now, read
        from ``/proc/self/pagemap``. A released page that was only read since maps the shared
        zero page, which the kernel reports present although it costs no memory."""
        stop_byte = self.nbytes if stop_byte is None else stop_byte
        self._check_range(start_byte, stop_byte)
        pages = (stop_byte - start_byte) // PAGE_BYTES
        if pages == 0:
            return 0
        first_page = (self.address + start_byte) // PAGE_BYTES
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first_page * _PAGEMAP_ENTRY_BYTES)
            raw = pagemap.read(pages * _PAGEMAP_ENTRY_BYTES)
        entries = struct.unpack(f"{pages}Q", raw)
        return sum(1 for entry in entries if entry & _PRESENT_BIT) * PAGE_BYTES


def _proc_kib(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no {field!r} line")


def process_rss_bytes() -> int:
    """The process's resident set (``VmRSS`` of ``/proc/self/status``)."""
    return _proc_kib("/proc/self/status", "VmRSS:")


def process_anonymous_bytes() -> int:
    """The process's resident anonymous memory (``Anonymous`` of
    ``/proc/self/smaps_rollup``): heap and anonymous mappings, no file-backed pages, so the
    libraries paged in while a test runs do not blur it."""
    return _proc_kib("/proc/self/smaps_rollup", "Anonymous:")
