"""KV by head: each KV head's rows in their own address range, seen by SGLang's pool through
strided views (the CPU analogue of the AMOEBAs paper's [Block, Header, K/V, Token] layout).

The AMOEBAs paper (runtime tensor-parallel transformation, DAC '26) re-shards the running
requests' KV by KV head when replicas merge. In SGLang's token-first buffers (``[rows, heads,
head_dim]``) keeping some heads means copying the whole pool; with each head's rows in a range
of their own, kept heads stay and only the rows that change hands move.

``HeadArena``: per layer one anonymous private mapping, K then V, each KV head a *head range*
of ``max_rows`` rows (whole OS pages), reserved once: pages are backed when first written and
given back with ``madvise(MADV_DONTNEED)`` (then read as zeros); no view's address changes. A
view of heads ``first .. first+count-1`` has shape ``[rows, count, head_dim]``, strides
``(head_dim, max_rows * head_dim, 1)``: growing a pool is a new view, no row moves.

What SGLang 0.5.23's ``MHATokenToKVPool`` does with such views (CPU, unquantized, NHD):
  - ``set_kv_buffer`` writes ``k_cache[loc] = k`` (the non-AMX CPU path): correct;
  - ``get_key_buffer`` / ``get_value_buffer`` / ``get_kv_buffer`` return the view; the
    torch_native backend reads ``k_cache[slots]``: correct;
  - ``get_cpu_copy`` / ``load_cpu_copy`` index by slot: correct;
  - ``move_kv_cache`` is correct on its native path (``SGLANG_NATIVE_MOVE_KV_CACHE=1``:
    indexing); its default tiled copy treats ``stride(0)`` bytes as a whole slot, so
    ``check_pool_supported`` refuses a pool where it is configured (SGLang configures it only
    for speculative decoding; without it the default path asserts, for plain pools too);
  - ``get_kv_size_bytes`` and ``mem_usage`` count ``rows * heads * head_dim`` elements: the
    logical KV bytes, which is what the memory model states (not the reserved address space);
  - ``get_contiguous_buf_infos`` (PD disaggregation) reports each buffer as one contiguous
    span from its first element, which a strided view is not: PD transfer is unsupported (it
    needs a GPU transfer engine anyway);
  - the AMX ``store_cache_cpu`` kernel writes dense rows: ``check_pool_supported`` refuses
    when SGLang would use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from sglang_morph.amoebas.pages import PAGE_BYTES as _PAGE_BYTES
from sglang_morph.amoebas.pages import AnonymousMapping
from sglang_morph.elastic.kv_resizer import set_pool_buffers

K_KIND, V_KIND = 0, 1


@dataclasses.dataclass(frozen=True)
class KVLayoutConfig:
    """One member's KV geometry. Units: ``*_capacity_tokens`` are usable slots (a multiple of
    ``page_size``); a pool of ``c`` tokens has ``c + page_size`` rows (slot 0's page is
    SGLang's padding page). ``tp1_capacity_tokens``: what the replica's pool holds at TP 1
    (a split compacts below it); ``max_capacity_tokens``: the most any pool, own or mirror,
    may grow to (the address space reserved per head)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    tp1_capacity_tokens: int
    max_capacity_tokens: int

    def __post_init__(self) -> None:
        sizes = (self.layers, self.kv_heads, self.head_dim, self.page_size)
        tp1, most, ps = self.tp1_capacity_tokens, self.max_capacity_tokens, self.page_size
        if min(sizes) < 1 or not 0 < tp1 <= most or tp1 % ps or most % ps:
            raise ValueError(f"bad KV layout: (layers, heads, head_dim, page) {sizes}, TP 1 "
                             f"{tp1} and max {most} tokens (positive multiples of the page)")

    @classmethod
    def of_pool(cls, pool: Any, max_capacity_tokens: int) -> "KVLayoutConfig":
        """The geometry of an SGLang MHA pool at its current (TP 1) size."""
        return cls(layers=pool.layer_num, kv_heads=pool.head_num, head_dim=pool.head_dim,
                   dtype=pool.store_dtype, page_size=pool.page_size,
                   tp1_capacity_tokens=pool.size, max_capacity_tokens=max_capacity_tokens)

    @property
    def head_row_bytes(self) -> int:
        """One slot of one head: ``head_dim`` elements."""
        return self.head_dim * self.dtype.itemsize

    @property
    def tp1_rows(self) -> int:
        return self.tp1_capacity_tokens + self.page_size

    @property
    def max_rows(self) -> int:
        """Rows reserved per head range: ``max_capacity_tokens + page_size``, rounded up so a
        range is whole OS pages (every range then starts on a page boundary)."""
        rows = self.max_capacity_tokens + self.page_size
        per_page = _PAGE_BYTES // math.gcd(_PAGE_BYTES, self.head_row_bytes)
        return -(-rows // per_page) * per_page

    @property
    def head_range_bytes(self) -> int:
        return self.max_rows * self.head_row_bytes

    def heads_per_member(self, degree: int) -> int:
        if degree < 1 or self.kv_heads % degree:
            raise ValueError(f"degree {degree} does not divide the {self.kv_heads} KV heads")
        return self.kv_heads // degree

    def heads_of(self, rank: int, degree: int) -> range:
        """KV heads member ``rank`` keeps at ``degree``: ``[r*K/d, (r+1)*K/d)``."""
        h = self.heads_per_member(degree)
        if not 0 <= rank < degree:
            raise ValueError(f"rank {rank} is not a member of a degree-{degree} group")
        return range(rank * h, (rank + 1) * h)

    def kv_bytes_per_token(self, degree: int) -> int:
        """KV bytes one member holds per token of one pool (own or mirror), all layers:
        ``layers * 2 * (K/d) * head_dim * dtype_bytes``."""
        return self.layers * 2 * self.heads_per_member(degree) * self.head_row_bytes


class HeadArena:
    """The reserved head ranges of one member, all layers.

    Invariants: layer ``l`` is one ``pages.AnonymousMapping`` (transparent huge pages off, so a
    release frees whole small pages) of ``2 * kv_heads * head_range_bytes``; range
    ``kind * kv_heads + h`` (kind 0 = K, 1 = V) holds head ``h``'s rows, row ``s`` at byte
    ``s * head_row_bytes`` of it; mappings are never unmapped or moved while the arena lives
    (views keep it alive), so a view's ``data_ptr`` identifies its range."""

    def __init__(self, config: KVLayoutConfig):
        self.config = config
        layer_bytes = 2 * config.kv_heads * config.head_range_bytes
        self._maps = [AnonymousMapping(layer_bytes) for _ in range(config.layers)]
        self._flat = [m.tensor(config.dtype) for m in self._maps]
        self._range_elems = config.max_rows * config.head_dim

    def view(self, layer: int, kind: int, first: int, count: int, rows: int) -> torch.Tensor:
        """Heads ``first .. first+count-1`` of ``kind`` (K or V) of ``layer``, slots
        ``0 .. rows-1``: shape ``[rows, count, head_dim]``, strides
        ``(head_dim, max_rows * head_dim, 1)``."""
        cfg = self.config
        if not (0 <= first and first + count <= cfg.kv_heads and 0 <= rows <= cfg.max_rows):
            raise ValueError(f"heads {first}+{count} rows {rows} outside the arena "
                             f"({cfg.kv_heads} heads, {cfg.max_rows} rows)")
        return self._flat[layer].as_strided(
            (rows, count, cfg.head_dim), (cfg.head_dim, self._range_elems, 1),
            (kind * cfg.kv_heads + first) * self._range_elems)

    def views(self, first: int, count: int, rows: int) -> tuple[list, list]:
        """Per-layer K views and V views of the same heads and rows."""
        layers = range(self.config.layers)
        return ([self.view(l, K_KIND, first, count, rows) for l in layers],
                [self.view(l, V_KIND, first, count, rows) for l in layers])

    def range_of(self, layer: int, t: torch.Tensor) -> int | None:
        """The range index (``kind * kv_heads + head``) where view ``t`` starts, or None when
        it does not start at a range of ``layer``."""
        offset = t.data_ptr() - self._flat[layer].data_ptr()
        index, rest = divmod(offset, self.config.head_range_bytes)
        return None if offset < 0 or rest or index >= 2 * self.config.kv_heads else index

    def release(self, first: int, count: int, from_row: int = 0, to_row: int | None = None,
                keep_slots: torch.Tensor | None = None) -> int:
        """Give back the pages of heads ``first .. first+count-1`` (K and V, every layer) that
        lie wholly within rows ``[from_row, to_row)`` and hold none of ``keep_slots``; returns
        the bytes of address range released (pages never backed cost nothing)."""
        cfg = self.config
        to_row = cfg.max_rows if to_row is None else to_row
        rb = cfg.head_row_bytes
        lo, hi = -(-from_row * rb // _PAGE_BYTES), to_row * rb // _PAGE_BYTES
        if hi <= lo:
            return 0
        free = torch.ones(hi - lo, dtype=torch.bool)
        if keep_slots is not None and keep_slots.numel():
            slots = keep_slots.long()
            first_page, last_page = slots * rb // _PAGE_BYTES, ((slots + 1) * rb - 1) // _PAGE_BYTES
            for k in range(int((last_page - first_page).max()) + 1):
                pages = torch.minimum(first_page + k, last_page) - lo
                free[pages[(pages >= 0) & (pages < hi - lo)]] = False
        runs, released = _runs(free), 0
        for m in self._maps:
            for kind in (K_KIND, V_KIND):
                for head in range(first, first + count):
                    start = (kind * cfg.kv_heads + head) * cfg.head_range_bytes
                    for a, b in runs:
                        released += m.release(start + (lo + a) * _PAGE_BYTES,
                                              start + (lo + b) * _PAGE_BYTES)
        return released

    def resident_bytes(self) -> int:
        """Bytes of the arena in RAM now (``AnonymousMapping.resident_bytes``)."""
        return sum(m.resident_bytes() for m in self._maps)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[a, b)`` index runs where ``mask`` is True."""
    padded = torch.cat((torch.zeros(1, dtype=torch.int8), mask.to(torch.int8),
                        torch.zeros(1, dtype=torch.int8)))
    edges = torch.nonzero(padded[1:] - padded[:-1]).flatten().tolist()
    return list(zip(edges[::2], edges[1::2]))


class MirrorPool:
    """What member ``r`` of a merged group holds of member ``owner``'s requests: r's own KV
    heads (``heads``, global indices) of ``owner``'s tokens, at ``owner``'s slot numbers.
    The part of a KV pool's interface that attention uses (``layer.layer_id`` picks the
    layer, as SGLang's backends call it). Invariant: ``k_buffer[l]`` and ``v_buffer[l]`` have
    ``size + page_size`` rows of ``len(heads)`` heads."""

    def __init__(self, owner: int, heads: range, size: int, page_size: int,
                 k_buffer: list, v_buffer: list):
        self.owner, self.heads, self.size, self.page_size = owner, heads, size, page_size
        self.k_buffer, self.v_buffer = list(k_buffer), list(v_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer: Any, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor) -> None:
        self.k_buffer[layer.layer_id][loc] = cache_k.to(self.k_buffer[0].dtype)
        self.v_buffer[layer.layer_id][loc] = cache_v.to(self.v_buffer[0].dtype)

    def get_kv_size_bytes(self) -> tuple[int, int]:
        return tuple(sum(t.numel() * t.element_size() for t in bufs)
                     for bufs in (self.k_buffer, self.v_buffer))


# ---- SGLang's pool ----


def check_pool_supported(pool: Any) -> None:
    """NotImplementedError naming what a head-sharded layout cannot serve in ``pool``."""
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:
        raise NotImplementedError(f"KV by head supports MHATokenToKVPool, not "
                                  f"{type(pool).__name__}")
    reasons = [reason for broken, reason in (
        (pool.kv_cache_layout != "nhd", f"layout {pool.kv_cache_layout!r}"),
        (pool.is_quantized_kv_cache or pool.store_dtype != pool.dtype, "a quantized KV cache"),
        (pool.post_capture_active, "post-capture VMM backing"),
        (pool.v_head_dim != pool.head_dim, f"V head dim {pool.v_head_dim} != {pool.head_dim}"),
        (pool._kv_copy_config is not None, "the tiled KV copy (speculative decoding)"),
        (memory_pool._is_cpu and memory_pool._cpu_has_amx_support, "the AMX store kernel"),
        (torch.device(pool.device).type != "cpu", f"device {pool.device}")) if broken]
    if reasons:
        raise NotImplementedError("KV by head does not support " + ", ".join(reasons))


def install_buffers(pool: Any, k_buffers: list, v_buffers: list, size_tokens: int) -> None:
    """Give the pool per-layer buffers of ``size_tokens + page_size`` rows and as many heads
    as they have, and the head count everything SGLang derives from it."""
    heads = k_buffers[0].shape[1]
    pool.head_num = heads
    pool.row_dim = pool.v_row_dim = heads * pool.head_dim
    pool.size = size_tokens
    set_pool_buffers(pool, k_buffers, v_buffers)


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    """A pool's buffers and the fields derived from them, to put back on an undo."""

    k_buffers: tuple
    v_buffers: tuple
    size: int

    @classmethod
    def of(cls, pool: Any) -> "PoolSnapshot":
        return cls(tuple(pool.k_buffer), tuple(pool.v_buffer), pool.size)

    def restore(self, pool: Any) -> None:
        install_buffers(pool, list(self.k_buffers), list(self.v_buffers), self.size)


# ---- where a variant puts a pool's buffers ----


class HeadPlacement:
    """The head-centric variant: a pool of ``count`` heads starting at head range ``first``
    is the arena's strided views of those ranges, so placing it keeps whatever the ranges
    hold (``in_place``), and releasing gives pages back."""

    variant = "head_centric"
    in_place = True

    def __init__(self, config: KVLayoutConfig):
        self.config = config
        self.arena = HeadArena(config)

    def place(self, first: int, count: int, rows: int) -> tuple[list, list]:
        return self.arena.views(first, count, rows)

    def release(self, first: int, count: int, from_row: int = 0,
                keep_slots: torch.Tensor | None = None) -> int:
        return self.arena.release(first, count, from_row=from_row, keep_slots=keep_slots)

    def check(self, placed: list[tuple[Any, int]]) -> None:
        """``placed``: (pool, first head range) pairs. Every view has the arena's strides and
        starts at its range, K and V alike; no two pools share a range; a merged member's
        pools cover every range."""
        cfg = self.config
        stride = (cfg.head_dim, cfg.max_rows * cfg.head_dim, 1)
        for layer in range(cfg.layers):
            covered: list[int] = []
            for pool, first in placed:
                for kind, buf in ((K_KIND, pool.k_buffer[layer]), (V_KIND, pool.v_buffer[layer])):
                    assert buf.stride() == stride, f"layer {layer}: strides {buf.stride()}"
                    start = self.arena.range_of(layer, buf)
                    assert start == kind * cfg.kv_heads + first, (
                        f"layer {layer}: a view starts at range {start}, not "
                        f"{kind * cfg.kv_heads + first} (None: outside the layer's ranges)")
                    covered += range(start, start + buf.shape[1])
            assert len(covered) == len(set(covered)), f"layer {layer}: ranges shared {covered}"
            assert len(placed) == 1 or sorted(covered) == list(range(2 * cfg.kv_heads)), covered


class TokenPlacement:
    """The AMOEBAs paper's base variant: SGLang's token-first ``[rows, heads, head_dim]``
    buffers; placing a pool allocates new zeroed buffers (the caller copies what it keeps;
    the old ones are freed when dropped), nothing is released in place."""

    variant = "token_first"
    in_place = False

    def __init__(self, config: KVLayoutConfig):
        self.config = config

    def place(self, first: int, count: int, rows: int) -> tuple[list, list]:
        shape = (rows, count, self.config.head_dim)
        return tuple([torch.zeros(shape, dtype=self.config.dtype)
                      for _ in range(self.config.layers)] for _ in range(2))

    def release(self, first: int, count: int, from_row: int = 0,
                keep_slots: torch.Tensor | None = None) -> int:
        return 0

    def check(self, placed: list[tuple[Any, int]]) -> None:
        for pool, _ in placed:
            assert all(b.is_contiguous() for b in (*pool.k_buffer, *pool.v_buffer)), (
                "a token-first buffer is not contiguous")


PLACEMENTS = {p.variant: p for p in (HeadPlacement, TokenPlacement)}


class MemberKV:
    """One member's KV: SGLang's pool (its own tokens) and, when merged, a mirror pool per
    other member; ``variant`` picks the placement (``PLACEMENTS``). A head-centric member
    copies ``live_slots`` (every row when None) of the pool into its arena and installs views.

    Invariants (``check_integrity``): at degree ``d`` with group rank ``r`` the pool holds heads
    ``H_r`` (``pool.head_num == K/d``) of ``pool.size + page_size`` rows; when merged,
    ``mirrors`` has one pool per other member ``q`` (heads ``H_r`` of ``q``'s ``size +
    page_size`` rows), none at TP 1; every pool's KV bytes are its rows times
    ``config.kv_bytes_per_token(d)``; the placement's invariants hold; no transition is in
    flight (``in_flight``). Use from one thread (the member's scheduler thread)."""

    def __init__(self, pool: Any, config: KVLayoutConfig, variant: str = "head_centric",
                 live_slots: torch.Tensor | None = None):
        check_pool_supported(pool)
        got = (pool.layer_num, pool.head_num, pool.head_dim, pool.store_dtype, pool.page_size)
        want = (config.layers, config.kv_heads, config.head_dim, config.dtype, config.page_size)
        if got != want or pool.size > config.max_capacity_tokens:
            raise ValueError(f"pool (layers, heads, head_dim, dtype, page) {got} and size "
                             f"{pool.size} do not fit the layout {want}")
        self.pool, self.config = pool, config
        self.placement = PLACEMENTS[variant](config)
        self.rank, self.degree = 0, 1
        self.mirrors: dict[int, MirrorPool] = {}
        self.in_flight: str | None = None  # the transition changing the pools now, if any
        if self.placement.in_place:
            k, v = self.placement.place(0, config.kv_heads, pool.size + config.page_size)
            rows = slice(None) if live_slots is None else self._checked_slots(live_slots)
            for new, old in zip((*k, *v), (*pool.k_buffer, *pool.v_buffer)):
                new[rows] = old[rows]
            install_buffers(pool, k, v, pool.size)

    @property
    def variant(self) -> str:
        return self.placement.variant

    @property
    def own_heads(self) -> range:
        return self.config.heads_of(self.rank, self.degree)

    def resize(self, capacity_tokens: int, owner: int | None = None) -> int:
        """Set the token capacity of the own pool (``owner`` None) or of member ``owner``'s
        mirror, keeping the rows below both sizes; head-centric rows never move (a new view)
        and a shrink releases the whole pages above. Returns the bytes released. The caller
        has moved any live row above a shrunk boundary first."""
        cfg = self.config
        assert self.in_flight is None, f"resize during a {self.in_flight}"
        if capacity_tokens % cfg.page_size or not 0 < capacity_tokens <= cfg.max_capacity_tokens:
            raise ValueError(f"capacity {capacity_tokens} is not a multiple of page "
                             f"{cfg.page_size} in (0, {cfg.max_capacity_tokens}]")
        heads = self.own_heads if owner is None else cfg.heads_of(owner, self.degree)
        old = self.pool if owner is None else self.mirrors[owner]
        rows = capacity_tokens + cfg.page_size
        k, v = self.placement.place(heads.start, len(heads), rows)
        if not self.placement.in_place:
            n = min(rows, old.size + cfg.page_size)
            for new, buf in zip((*k, *v), (*old.k_buffer, *old.v_buffer)):
                new[:n] = buf[:n]
        if owner is None:
            install_buffers(self.pool, k, v, capacity_tokens)
        else:
            old.size, old.k_buffer, old.v_buffer = capacity_tokens, k, v
        return self.placement.release(heads.start, len(heads), from_row=rows)

    def _checked_slots(self, live_slots: torch.Tensor) -> torch.Tensor:
        live = torch.as_tensor(live_slots).long().flatten()
        rows = self.pool.size + self.config.page_size
        if live.numel() and (int(live.min()) < self.config.page_size or int(live.max()) >= rows):
            raise ValueError(f"live slots must lie in [{self.config.page_size}, {rows})")
        if torch.unique(live).numel() != live.numel():
            raise ValueError("live slots repeat")
        return live

    def check_integrity(self) -> None:
        """AssertionError, with the numbers, when an invariant of the class is broken."""
        cfg, pool, d = self.config, self.pool, self.degree
        assert self.in_flight is None, f"a {self.in_flight} is in flight"
        h, ps = cfg.heads_per_member(d), cfg.page_size
        assert pool.head_num == h and pool.row_dim == h * cfg.head_dim, (
            f"pool head_num {pool.head_num} row_dim {pool.row_dim}, degree {d}: {h} heads")
        others = set(range(d)) - {self.rank}
        assert set(self.mirrors) == others, f"mirrors {sorted(self.mirrors)}, want {others}"
        placed = [(pool, self.own_heads.start)]
        placed += [(m, cfg.heads_of(q, d).start) for q, m in self.mirrors.items()]
        for p, _ in placed:
            assert p.size <= cfg.max_capacity_tokens, f"{p.size} tokens over the layout's max"
            assert len(p.k_buffer) == len(p.v_buffer) == cfg.layers
            shapes = {tuple(b.shape) for b in (*p.k_buffer, *p.v_buffer)}
            assert shapes == {(p.size + ps, h, cfg.head_dim)}, (
                f"buffers {shapes}, want ({p.size + ps}, {h}, {cfg.head_dim})")
            assert sum(p.get_kv_size_bytes()) == (p.size + ps) * cfg.kv_bytes_per_token(d), (
                f"{sum(p.get_kv_size_bytes())} KV bytes for {p.size + ps} rows at degree {d}")
        for q, m in self.mirrors.items():
            assert m.heads == self.own_heads and m.owner == q, (q, m.heads, self.own_heads)
        self.placement.check(placed)
