"""FFN weights in place: a merged member keeps its intermediate shard and frees the rest.

A Llama MLP is ``down(silu(gate(x)) * up(x))``. Member ``r`` of a tensor-parallel group of
degree ``d`` needs only rows ``[r*I/d, (r+1)*I/d)`` of ``gate`` and ``up`` and the same input
columns of ``down``; its partial outputs summed over the members are the full output. The
AMOEBAs paper frees the other shards in place (``cuMemUnmap`` of the weight granules, the
address range kept) and maps them back on a split. Here each MLP's weights live in one
anonymous mapping (``pages.AnonymousMapping``) laid out as three sections of
``[I_pad, hidden]`` rows::

    gate | up | down^T

While a member holds a shard, ``down`` is stored transposed, so that a shard of its input
columns is a range of rows like the shards of ``gate`` and ``up``. While it holds every row
(serving alone), the third section holds ``down`` itself, ``[hidden, I_pad]`` row major:
``keep_shard`` turns it into ``down^T`` in place just before the release, and a restore that
makes the store whole turns it back (two copies of one section through one section of
scratch shared by all layers). The padded intermediate size ``I_pad`` (the paper's Eq. 2,
``pages.padded_intermediate``) makes every allowed degree's shard boundaries fall on pages,
so freeing a shard is ``madvise(MADV_DONTNEED)`` of whole pages; the padding rows (columns of
``down``) are zero.

Installed into a module (``from_module``), ``gate_up_proj.weight`` becomes the view
``[2*I_pad, hidden]`` of the first two sections (gate and up are adjacent, as SGLang's merged
projection and ``SiluAndMul``'s split in the middle expect) and ``down_proj.weight`` the view
``[hidden, I_pad]`` of the third. A replica serving alone thus runs SGLang's own operands in
SGLang's own layout: the same kernels and, without padding, the same bits
(``benchmark/amoebas/weights_cost.py`` measures it). With padding the module computes with
``I_pad`` rows, the zero rows adding exact zeros to a longer reduction, whose blocking, hence
rounding, may differ.

The order a live transition must use (all-or-nothing over the layers: ``keep_shard_layers``
and ``restore_layers`` validate every layer before touching any):

- merge: vote; then every phase that can still be undone (KV re-sharding, the sharded
  forward); then, as the commit step, ``keep_shard_layers``. A release cannot be undone
  without the peers' shards, so nothing may fail after it; after validation it has no failure
  mode (``madvise`` of page-aligned ranges inside a live private mapping).
- split: vote; free the KV memory the weights come back into; ``open_rows_layers``, which
  checks the ranges of every layer before opening any; receive the peers' shards
  (``payload``, over gloo) straight into the opened rows; commit every layer, or abort
  every one (in place: the written pages released again) if any receive fails; only then
  switch the forward back to the module. ``restore_layers`` is the same from payloads in
  hand.

``CopiedFfnWeights`` is the paper's base variant ("weight partial swap by copy") behind the
same interface, for comparison: compact shard tensors are allocated and copied, and the full
tensor dropped (peak = full + shard); a split allocates the full tensor again and copies back.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from sglang_morph.amoebas.pages import (
    PAGE_BYTES,
    AnonymousMapping,
    padded_intermediate,
    padding_multiple,
)
from sglang_morph.elastic.contract import ElasticError

SECTIONS = 3  # gate, up, down^T
RowRange = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class FfnLayout:
    """One MLP's padded layout. ``degrees`` is normalised to a sorted tuple containing 1;
    ``page_bytes`` (the release granularity the padding is for) is a multiple of the system
    page so that every shard boundary is also a system page boundary."""

    intermediate: int
    hidden: int
    dtype: torch.dtype
    degrees: tuple[int, ...]
    page_bytes: int = PAGE_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "degrees", tuple(sorted({1, *self.degrees})))
        if self.intermediate < 1:
            raise ValueError(f"intermediate must be >= 1, got {self.intermediate}")
        if self.page_bytes % PAGE_BYTES:
            raise ValueError(f"page_bytes {self.page_bytes} is not a multiple of the system "
                             f"page ({PAGE_BYTES} bytes)")
        padding_multiple(self.hidden, self.dtype_bytes, self.degrees, self.page_bytes)

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property
    def padded_intermediate(self) -> int:
        return padded_intermediate(self.intermediate, self.hidden, self.dtype_bytes,
                                   self.degrees, self.page_bytes)

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.dtype_bytes

    @property
    def section_bytes(self) -> int:
        return self.padded_intermediate * self.row_bytes

    @property
    def section_elements(self) -> int:
        return self.padded_intermediate * self.hidden

    @property
    def mapping_bytes(self) -> int:
        return SECTIONS * self.section_bytes

    def rows_bytes(self, rows: int) -> int:
        """Bytes of ``rows`` rows in all three sections."""
        return SECTIONS * rows * self.row_bytes

    def shard_rows(self, rank: int, degree: int) -> RowRange:
        """Rows ``[start, stop)`` of the padded intermediate that member ``rank`` keeps."""
        if degree not in self.degrees or not 0 <= rank < degree:
            raise ElasticError(f"no shard for rank {rank} of degree {degree} (allowed degrees "
                               f"{self.degrees})", 400)
        rows = self.padded_intermediate // degree
        return rank * rows, (rank + 1) * rows

    def is_shard(self, rows: RowRange) -> bool:
        return any(rows == self.shard_rows(r, d) for d in self.degrees for r in range(d))


@dataclasses.dataclass(frozen=True)
class WeightTransition:
    """One layer's ``keep_shard`` or ``restore``. ``peak_extra_bytes``: memory the transition
    held at once beyond ``max(held before, held after)`` (payloads handed in not counted)."""

    action: str
    rows_before: RowRange
    rows_after: RowRange
    freed_bytes: int
    restored_bytes: int
    peak_extra_bytes: int


class FfnWeights(abc.ABC):
    """One MLP's gate, up and down^T rows, of which ``resident_rows`` are held.

    While every row is held, the third section holds ``down`` itself (``[hidden, I_pad]``, row
    major: the installed module's ``down_proj`` then reads SGLang's own layout, the same
    kernel and the same bits); ``keep_shard`` first turns it into ``down^T`` rows in place
    (through one section of scratch), and a restore that makes the store whole turns it back.

    Invariants (``check_integrity``): ``resident_rows`` is one range whose byte bounds lie on
    pages; a store not whole holds ``down^T``; the padding rows ``[I, I_pad)`` held (padding
    columns of ``down``) are zero; while every row is held, an installed module's two weights
    are views of this store. Subclasses decide how rows are
    dropped (``_drop``) and opened for filling (``_open``, ``_commit``, ``_abort``); all checks
    happen here, before either.
    """

    _drops_in_place = False  # whether ``_drop`` cannot fail (then a merge turns only the kept
    # columns of down into down^T rows)

    def __init__(self, layout: FfnLayout):
        self.layout = layout
        self._resident: RowRange = (0, layout.padded_intermediate)
        self._module: torch.nn.Module | None = None
        self._down_transposed = False  # the third section: down (False) or down^T rows

    @classmethod
    def from_tensors(cls, gate_up: torch.Tensor, down: torch.Tensor, degrees: Iterable[int],
                     page_bytes: int = PAGE_BYTES):
        """A store holding ``gate_up`` ([2*I, hidden], gate rows then up rows) and ``down``
        ([hidden, I]), padded for ``degrees``."""
        if gate_up.dim() != 2 or down.dim() != 2 or gate_up.shape[0] % 2:
            raise ElasticError(f"expected gate_up [2*I, hidden] and down [hidden, I], got "
                               f"{list(gate_up.shape)} and {list(down.shape)}", 400)
        intermediate, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        if down.shape != (hidden, intermediate) or down.dtype != gate_up.dtype:
            raise ElasticError(f"down {list(down.shape)} {down.dtype} does not match gate_up "
                               f"{list(gate_up.shape)} {gate_up.dtype}", 400)
        store = cls(FfnLayout(intermediate, hidden, gate_up.dtype, tuple(degrees), page_bytes))
        held = store._held()
        with torch.no_grad():
            held[0, :intermediate].copy_(gate_up[:intermediate])
            held[1, :intermediate].copy_(gate_up[intermediate:])
            store._down()[:, :intermediate].copy_(down)
        return store

    @classmethod
    def from_module(cls, module: torch.nn.Module, degrees: Iterable[int],
                    page_bytes: int = PAGE_BYTES):
        """Move ``module.gate_up_proj.weight`` and ``module.down_proj.weight`` into a new store
        and make them views of it (the Parameter objects stay, their data changes)."""
        linears = (module.gate_up_proj, module.down_proj)
        for linear in linears:
            # SGLang's AMX path repacks weights into a VNNI block layout at load time; a view
            # of plain rows would be read as packed blocks.
            if getattr(linear, "use_intel_amx_backend", False):
                raise ElasticError(f"{type(linear).__name__} runs SGLang's packed AMX weights; "
                                   "their layout cannot be viewed from a row store", 400)
            if linear.weight.device.type != "cpu" or not linear.weight.is_floating_point():
                raise ElasticError(f"{type(linear).__name__}.weight is "
                                   f"{linear.weight.dtype} on {linear.weight.device}; "
                                   "expected floating point on the CPU", 400)
        store = cls.from_tensors(linears[0].weight.detach(), linears[1].weight.detach(),
                                 degrees, page_bytes)
        store._module = module
        store._point_module()
        return store

    @property
    def resident_rows(self) -> RowRange:
        return self._resident

    @property
    def whole(self) -> bool:
        return self._resident == (0, self.layout.padded_intermediate)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """``[3, stop-start, hidden]`` held rows (gate, up, down^T): a view of the store while
        it holds ``down^T`` (whenever it is not whole), a copy of a whole store."""
        r0, r1 = self._resident
        self._check_held(start, stop)
        held = self._held()[:, start - r0:stop - r0]
        if self._down_transposed:
            return held
        return torch.cat([held[:2], self._down()[:, start:stop].t().unsqueeze(0)])

    def payload(self, rank: int, degree: int) -> torch.Tensor:
        """Member ``rank``'s shard, what it sends a peer that restores (``.contiguous()`` it
        for a gloo send)."""
        return self.rows(*self.layout.shard_rows(rank, degree))

    def module_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up`` ``[2*I_pad, hidden]`` and ``down`` ``[hidden, I_pad]`` over all rows
        (``down`` contiguous unless the store holds ``down^T``)."""
        held = self._held()
        down = held[2].t() if self._down_transposed else self._down()
        return held[:2].reshape(-1, self.layout.hidden), down

    def _down(self) -> torch.Tensor:
        """The third section of a whole store read as ``down`` ``[hidden, I_pad]``."""
        return self._held()[2].view(self.layout.hidden, self.layout.padded_intermediate)

    def _transpose_down(self, scratch: torch.Tensor | None = None,
                        only: RowRange | None = None) -> None:
        """A whole store's third section between ``down`` and ``down^T`` rows, in place, through
        ``scratch`` (at least one section of elements; None: allocated here). ``only``: turn
        just those columns of ``down`` into their ``down^T`` rows, leaving the rest of the
        section undefined (for a release right after). No failure mode once the scratch
        exists: copies within memory the store holds."""
        layout = self.layout
        section = self._held()[2]
        if scratch is None:
            scratch = section.new_empty(section.numel())
        shape = (layout.hidden, layout.padded_intermediate)
        with torch.no_grad():
            if only is not None:
                start, stop = only
                buf = scratch[:layout.hidden * (stop - start)].view(layout.hidden, stop - start)
                buf.copy_(self._down()[:, start:stop])
                section[start:stop].copy_(buf.t())
            else:  # the whole section, one way (down^T rows back to down) or the other
                now = shape[::-1] if self._down_transposed else shape
                buf = scratch[:section.numel()]
                buf.copy_(section.reshape(-1))
                section.view(now[::-1]).copy_(buf.view(now).t())
        self._down_transposed = not self._down_transposed
        if self._module is not None:
            self._point_module()

    def ffn_partial(self, x: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
        """This member's term of the MLP output: ``down[:, shard] @ (silu(gate[shard] x) *
        up[shard] x)``. The terms of all ranks of one degree sum to the MLP's output; at
        degree 1 of an unpadded store it runs the same GEMMs as the installed module (a padded
        one also sums the padding's zero rows)."""
        start, stop = self.layout.shard_rows(rank, degree)
        if self._down_transposed:
            gate, up, down_t = self.rows(start, stop)
            down = down_t.t()
        else:  # a whole store: the module's own operands
            gate, up = self._held()[:2, start:stop]
            down = self._down()[:, start:stop]
        hidden = F.silu(F.linear(x, gate)) * F.linear(x, up)
        return F.linear(hidden, down)

    def check_keep_shard(self, rank: int, degree: int) -> RowRange:
        """The rows ``keep_shard`` would keep; raises (changing nothing) when it would refuse."""
        start, stop = self.layout.shard_rows(rank, degree)
        self._check_held(start, stop)
        return start, stop

    def _check_held(self, start: int, stop: int) -> None:
        r0, r1 = self._resident
        if not r0 <= start <= stop <= r1:
            raise ElasticError(f"rows [{start}, {stop}) are not all held (held [{r0}, {r1}))",
                               409)

    def keep_shard(self, rank: int, degree: int,
                   scratch: torch.Tensor | None = None) -> WeightTransition:
        """Drop every held row outside member ``rank``'s shard. The commit step of a merge:
        the dropped rows come back only from the peers (``restore``). A whole store first
        turns ``down`` into ``down^T`` rows through ``scratch`` (``keep_shard_layers`` gives
        all layers one, allocated before any layer changes)."""
        keep = self.check_keep_shard(rank, degree)
        before = self._resident
        peak_extra_bytes = 0
        if not self._down_transposed and self._drops_in_place:
            # Only the kept columns: the rest of the section is released next, and a release
            # in place cannot fail, so the store is never left half changed.
            self._transpose_down(scratch, keep)
            peak_extra_bytes = self.layout.rows_bytes(keep[1] - keep[0]) // SECTIONS
        elif not self._down_transposed:
            self._transpose_down(scratch)
            peak_extra_bytes = self.layout.section_bytes
        peak_extra_bytes = max(peak_extra_bytes, self._drop(keep))
        return WeightTransition("keep_shard", before, keep,
                                self.layout.rows_bytes((before[1] - before[0])
                                                       - (keep[1] - keep[0])),
                                0, peak_extra_bytes)

    def check_restore(self, rows_by_range: Mapping[RowRange, torch.Tensor]
                      ) -> tuple[RowRange, list[tuple[RowRange, torch.Tensor]]]:
        """The rows held after ``restore`` and its writes in row order; raises (changing
        nothing) unless every payload is a CPU tensor of this dtype shaped
        ``[3, stop-start, hidden]``, and the ranges with the held rows tile one shard (or all
        rows) without overlap."""
        after, ranges = self.check_ranges(rows_by_range)
        for key in ranges:
            payload = rows_by_range[key]
            want = (SECTIONS, key[1] - key[0], self.layout.hidden)
            if (not isinstance(payload, torch.Tensor) or payload.device.type != "cpu"
                    or payload.dtype != self.layout.dtype or tuple(payload.shape) != want):
                got = (f"{type(payload).__name__}" if not isinstance(payload, torch.Tensor)
                       else f"{list(payload.shape)} {payload.dtype} on {payload.device}")
                raise ElasticError(f"payload for rows {key} is {got}; expected {list(want)} "
                                   f"{self.layout.dtype} on cpu", 400)
        return after, [(key, rows_by_range[key]) for key in ranges]

    def check_ranges(self, ranges: Iterable[RowRange]) -> tuple[RowRange, list[RowRange]]:
        """The rows held after filling ``ranges`` and the ranges in row order; raises (changing
        nothing) unless they with the held rows tile one shard (or all rows) without
        overlap."""
        ranges = list(ranges)
        if not ranges:
            raise ElasticError("restore needs at least one row range", 400)
        for key in ranges:
            if (not isinstance(key, tuple) or len(key) != 2
                    or not all(isinstance(v, int) for v in key) or not 0 <= key[0] < key[1]):
                raise ElasticError(f"row range {key!r} is not (start, stop) with "
                                   "0 <= start < stop", 400)
        ranges.sort()
        pieces = sorted([self._resident, *ranges])
        for (_, stop), (start, _) in zip(pieces, pieces[1:]):
            if start != stop:
                raise ElasticError(f"row ranges {pieces} (held rows included) "
                                   f"{'overlap' if start < stop else 'leave a gap'}", 409)
        after = (pieces[0][0], pieces[-1][1])
        if not self.layout.is_shard(after):
            raise ElasticError(f"rows {after} after the restore are no shard of the degrees "
                               f"{self.layout.degrees}", 409)
        return after, ranges

    def restore(self, rows_by_range: Mapping[RowRange, torch.Tensor]) -> WeightTransition:
        """Write the peers' rows back (bit for bit), after ``check_restore``. All or nothing:
        a write that fails leaves the rows held before, and only those."""
        return restore_layers([self], [rows_by_range])[0]

    def open_rows(self, ranges: Iterable[RowRange],
                  scratch: torch.Tensor | None = None) -> "OpenRows":
        """Rows ``ranges`` made writable where they will be held (after ``check_ranges``), for
        the caller to fill, e.g. a receive straight into them, then ``commit`` or ``abort``.
        Until one of the two, the store holds and serves the rows it held before. When the
        store will be whole, the commit turns ``down^T`` back into ``down`` through
        ``scratch`` (None: one section allocated now, so that the commit cannot fail)."""
        after, ranges = self.check_ranges(ranges)
        whole = after == (0, self.layout.padded_intermediate)
        if whole and scratch is None:
            scratch = _scratch([self.layout])
        targets, peak_extra_bytes = self._open(after, ranges)
        if whole:
            peak_extra_bytes = max(peak_extra_bytes, self.layout.section_bytes)
        return OpenRows(self, after, tuple(ranges), tuple(targets), peak_extra_bytes,
                        scratch if whole else None)

    def check_integrity(self) -> None:
        layout, (r0, r1) = self.layout, self._resident
        assert 0 <= r0 <= r1 <= layout.padded_intermediate, f"held rows {self._resident}"
        assert r0 * layout.row_bytes % layout.page_bytes == 0, f"rows from {r0} off a page"
        assert r1 * layout.row_bytes % layout.page_bytes == 0, f"rows to {r1} off a page"
        held = self._held()
        assert tuple(held.shape) == (SECTIONS, r1 - r0, layout.hidden), list(held.shape)
        assert self._down_transposed or self.whole, "a store not whole holds down, not down^T"
        padding = held[:, max(layout.intermediate, r0) - r0:]
        if not self._down_transposed:
            assert not self._down()[:, layout.intermediate:].any(), (
                "padding columns of down hold non-zero values")
            padding = padding[:2]
        assert not padding.any(), "padding rows hold non-zero values"
        if self._module is not None and self.whole:
            gate_up, down = self.module_views()
            for name, param, view in (("gate_up_proj", self._module.gate_up_proj.weight,
                                       gate_up),
                                      ("down_proj", self._module.down_proj.weight, down)):
                assert (param.data_ptr(), param.shape, param.stride()) == (
                    view.data_ptr(), view.shape, view.stride()), f"{name}.weight left the store"

    def _point_module(self) -> None:
        gate_up, down = self.module_views()
        self._module.gate_up_proj.weight.data = gate_up
        self._module.down_proj.weight.data = down

    @abc.abstractmethod
    def _held(self) -> torch.Tensor:
        """``[3, held rows, hidden]``: the rows ``resident_rows`` names."""

    @abc.abstractmethod
    def _drop(self, keep: RowRange) -> int:
        """Hold only ``keep`` (inside the held rows); returns the peak extra bytes."""

    @abc.abstractmethod
    def _open(self, after: RowRange, ranges: list[RowRange]) -> tuple[list[torch.Tensor], int]:
        """Writable ``[3, rows, hidden]`` tensors for ``ranges``, where they will be held once
        ``after`` is (``_commit``); the peak extra bytes. The rows held stay as they are."""

    @abc.abstractmethod
    def _commit(self, opened: "OpenRows") -> None:
        """Hold ``opened.after``; cannot fail."""

    @abc.abstractmethod
    def _abort(self, opened: "OpenRows") -> None:
        """Give back what ``_open`` took; the rows held are as before."""


class MappedFfnWeights(FfnWeights):
    """Rows in one anonymous mapping at a fixed address; dropped rows are released pages.

    The module's views stay valid across ``keep_shard`` (same addresses, as the paper's
    unmapped granules keep captured graphs valid), but rows outside the shard read as zeros:
    a merged member runs ``ffn_partial``, never the module's full forward.
    """

    _drops_in_place = True  # a release of pages: no failure mode

    def __init__(self, layout: FfnLayout):
        super().__init__(layout)
        self.mapping = AnonymousMapping(layout.mapping_bytes)
        self._all = self.mapping.tensor(layout.dtype).view(SECTIONS, layout.padded_intermediate,
                                                            layout.hidden)

    def _held(self) -> torch.Tensor:
        return self._all[:, self._resident[0]:self._resident[1]]

    def _release(self, rows: RowRange) -> None:
        start, stop = (r * self.layout.row_bytes for r in rows)
        for section in range(SECTIONS):
            offset = section * self.layout.section_bytes
            self.mapping.release(offset + start, offset + stop)

    def _drop(self, keep: RowRange) -> int:
        before = self._resident
        # The held range shrinks before the pages go: a release failing part-way leaves a
        # store that holds more than it claims, never less.
        self._resident = keep
        self._release((before[0], keep[0]))
        self._release((keep[1], before[1]))
        return 0

    def _open(self, after: RowRange, ranges: list[RowRange]) -> tuple[list[torch.Tensor], int]:
        # The released pages themselves: written, they come back (the paper's map-back).
        return [self._all[:, start:stop] for start, stop in ranges], 0

    def _commit(self, opened: "OpenRows") -> None:
        self._resident = opened.after

    def _abort(self, opened: "OpenRows") -> None:
        # Released again, rows written or not read as before the restore: zeros costing no
        # memory.
        for rows in opened.ranges:
            self._release(rows)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self._all.data_ptr() == self.mapping.address, "rows left the mapping"


class CopiedFfnWeights(FfnWeights):
    """The paper's base variant: rows in an ordinary tensor; a shard is a compact copy.

    ``keep_shard`` copies the kept rows into a new tensor, then drops the old one (peak: old
    + shard); ``restore`` allocates the new range, copies the held and the given rows in, then
    drops the old (peak: new + old). While not every row is held, an installed module's
    weights are empty tensors, so that the dropped full tensor is really freed.
    """

    def __init__(self, layout: FfnLayout):
        super().__init__(layout)
        self._tensor = torch.zeros(SECTIONS, layout.padded_intermediate, layout.hidden,
                                   dtype=layout.dtype)
        self._new: torch.Tensor | None = None  # an open restore's tensor

    def _held(self) -> torch.Tensor:
        return self._tensor

    def _drop(self, keep: RowRange) -> int:
        r0 = self._resident[0]
        shard = self._tensor[:, keep[0] - r0:keep[1] - r0].clone()
        if self._module is not None:
            self._module.gate_up_proj.weight.data = shard.new_empty(0, self.layout.hidden)
            self._module.down_proj.weight.data = shard.new_empty(self.layout.hidden, 0)
        self._tensor, self._resident = shard, keep
        return shard.nbytes

    def _open(self, after: RowRange, ranges: list[RowRange]) -> tuple[list[torch.Tensor], int]:
        old, (r0, r1) = self._tensor, self._resident
        new = old.new_empty(SECTIONS, after[1] - after[0], self.layout.hidden)
        with torch.no_grad():
            new[:, r0 - after[0]:r1 - after[0]].copy_(old)
        self._new = new
        return [new[:, start - after[0]:stop - after[0]] for start, stop in ranges], old.nbytes

    def _commit(self, opened: "OpenRows") -> None:
        self._tensor, self._resident, self._new = self._new, opened.after, None
        if self._module is not None and self.whole:
            self._point_module()

    def _abort(self, opened: "OpenRows") -> None:
        self._new = None


@dataclasses.dataclass(frozen=True)
class OpenRows:
    """Rows of one store opened for a restore (``FfnWeights.open_rows``): ``targets[i]`` is
    the writable ``[3, rows, hidden]`` place of ``ranges[i]`` (each section a contiguous
    ``[rows, hidden]``, so a gloo receive can write it directly). Exactly one of ``commit``
    and ``abort`` ends it."""

    store: FfnWeights
    after: RowRange
    ranges: tuple[RowRange, ...]
    targets: tuple[torch.Tensor, ...]
    peak_extra_bytes: int
    scratch: torch.Tensor | None = None  # for the layout change of a store made whole

    def commit(self) -> WeightTransition:
        """The store holds ``after``, with whatever the targets were filled with (a whole
        store with ``down`` back in its own layout)."""
        before = self.store.resident_rows
        self.store._commit(self)
        if self.store.whole and self.store._down_transposed:
            self.store._transpose_down(self.scratch)
        restored = self.store.layout.rows_bytes(sum(b - a for a, b in self.ranges))
        return WeightTransition("restore", before, self.after, 0, restored,
                                self.peak_extra_bytes)

    def abort(self) -> None:
        self.store._abort(self)


def _scratch(layouts: Sequence[FfnLayout]) -> torch.Tensor | None:
    """One buffer large enough for a section of each of ``layouts`` (None when there are
    none): what their layout changes of down go through, one after the other."""
    if not layouts:
        return None
    return torch.empty(max(lay.section_elements for lay in layouts), dtype=layouts[0].dtype)


def keep_shard_layers(layers: Sequence[FfnWeights], rank: int, degree: int
                      ) -> list[WeightTransition]:
    """``keep_shard`` on every layer, after checking that none would refuse."""
    for weights in layers:
        weights.check_keep_shard(rank, degree)
    scratch = _scratch([w.layout for w in layers if not w._down_transposed])
    return [weights.keep_shard(rank, degree, scratch) for weights in layers]


def open_rows_layers(layers: Sequence[FfnWeights],
                     ranges_per_layer: Sequence[Iterable[RowRange]]) -> list[OpenRows]:
    """``open_rows`` on every layer, after checking that none would refuse; the caller
    commits or aborts every one."""
    if len(layers) != len(ranges_per_layer):
        raise ElasticError(f"{len(ranges_per_layer)} range sets for {len(layers)} layers", 400)
    ranges_per_layer = [list(r) for r in ranges_per_layer]
    # One scratch for every layer made whole: their commits change the layout one by one.
    scratch = _scratch([w.layout for w, ranges in zip(layers, ranges_per_layer)
                        if w.check_ranges(ranges)[0] == (0, w.layout.padded_intermediate)])
    opened: list[OpenRows] = []
    try:
        for weights, ranges in zip(layers, ranges_per_layer):
            opened.append(weights.open_rows(ranges, scratch))
    except BaseException:
        for o in opened:
            o.abort()
        raise
    return opened


def restore_layers(layers: Sequence[FfnWeights],
                   rows_by_range_per_layer: Sequence[Mapping[RowRange, torch.Tensor]]
                   ) -> list[WeightTransition]:
    """``restore`` on every layer, all or nothing: every payload of every layer is checked
    before any is written, and a write failing leaves every layer with the rows it held."""
    if len(layers) != len(rows_by_range_per_layer):
        raise ElasticError(f"{len(rows_by_range_per_layer)} payload sets for {len(layers)} "
                           "layers", 400)
    writes = [weights.check_restore(rows_by_range)[1]
              for weights, rows_by_range in zip(layers, rows_by_range_per_layer)]
    opened = open_rows_layers(layers, [[key for key, _ in w] for w in writes])
    try:
        with torch.no_grad():
            for o, layer_writes in zip(opened, writes):
                for target, (_, payload) in zip(o.targets, layer_writes):
                    target.copy_(payload)
    except BaseException as e:
        for o in opened:
            o.abort()
        if not isinstance(e, Exception):
            raise
        raise ElasticError(f"restore failed and was undone: {e!r}", 500) from e
    return [o.commit() for o in opened]
