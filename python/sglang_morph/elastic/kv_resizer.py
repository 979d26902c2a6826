"""Growing and shrinking the KV cache pool of a running SGLang scheduler, between forward passes.

Scope (SGLang 0.5.23, what a plain CPU or CUDA launch builds): ``MHATokenToKVPool`` (NHD,
unquantized, no post-capture VMM backing) behind ``TokenToKVPoolAllocator`` (page size 1) or
``PagedTokenToKVPoolAllocator``, and a FULL-only ``UnifiedRadixCache`` without HiCache or an
external linker, on either tree core (Rust by default, Python). Anything else raises
``NotImplementedError`` naming the class.

Grow: every layer gets a new buffer with the old rows copied (one layer at a time, so the
transient memory is one layer), the new pages are appended to the allocator's free list
(``allocator.resize()`` would clear the free list), and the capacity copies are updated.

Shrink: unlocked radix-cache entries are evicted (LRU, in doubling rounds) until no unlocked
cache lies above the new boundary and enough pages are free below it; every live page above
the boundary is copied (K and V, all layers, whole pages so in-page offsets hold) into a free
page below it; the holders of KV indices are rewritten with one old->new remap table, which is
the identity below the boundary and therefore idempotent:
  - ``req_to_token_pool.req_to_token`` (the whole table: rows of finished requests are never
    read again, so remapping their stale entries is harmless);
  - the FULL device value of every tree node on the path of a tree lock a request holds
    (``req.lock.node``), rewritten in place in the tensor the tree core hands out, which the
    tree itself holds (Rust and Python cores alike);
  - ``out_cache_loc`` of ``scheduler.running_batch``, ``scheduler.last_batch`` and any
    ``extra_batches``.
A request's matched prefix is read from the tree when its KV is allocated
(``prefix_device_indices``), so waiting requests hold no KV indices. Then the buffers are cut to
the new size (new, smaller tensors, so the memory is released) and the capacity copies updated.
A shrink that cannot keep every request refuses with ``KVResizeRefused`` before changing
anything: when held (non-evictable) tokens exceed the new capacity, or when a tree lock is held
by something this resizer cannot see (a streaming session, a batch built but not yet run).

Call it between batches on the scheduler thread: after ``process_batch_result`` and before
``get_next_batch_to_run`` builds the next batch (e.g. a BEFORE hook on it). A batch already
built but not yet run must be passed as ``extra_batches`` (its ``out_cache_loc`` is where the
next forward writes); otherwise its locks are unseen and shrink refuses.

Both are all-or-nothing: a grow that fails puts the old buffers back; a shrink that fails after
evicting and moving live KV leaves the pool at its old capacity (the moved KV stays where it was
moved, every holder already points there, the pages above the boundary go back to the free
list); only the evicted cache is gone. The old buffers stay referenced until a resize commits,
so a resize holds the old and the new pool for a moment (on GPU, ``kv_vmm.VmmKVArena`` avoids
the copy; it is not wired in yet).

Capacity copies updated on every resize (paths verified in SGLang 0.5.23):
  - ``pool.size``, ``pool.mem_usage``, ``pool._kv_buffer_descs``, the pool's data pointers
    (``pool._init_data_ptrs_and_strides()``), ``allocator.size`` (and ``allocator.num_pages``
    when paged);
  - ``scheduler.tp_worker.model_runner.max_total_num_tokens`` and
    ``...model_runner.memory_pool_config.max_total_num_tokens``;
  - ``scheduler.max_total_num_tokens``;
  - the request-length limits SGLang derives from the capacity in ``TpModelWorker.
    get_worker_info``: ``scheduler.max_req_len = min(context_len, capacity) - 1`` (which
    clips ``max_new_tokens``) and ``scheduler.max_req_input_len`` (the longest prompt admitted;
    longer ones are aborted with HTTP 400), and the beam-search coordinator's ``max_req_len``;
  - ``max_total_num_tokens`` of ``scheduler.pool_stats_observer`` and
    ``scheduler.load_inquirer`` (frozen dataclasses: set in place with ``object.__setattr__``,
    as SGLang's own ``_sync_disaggregation_mode_to_subcomponents`` does, so every holder of
    the observer, e.g. the invariant checker, keeps seeing the same object),
    ``scheduler.invariant_checker`` and ``scheduler.kv_events_publisher``;
  - the ``sglang:max_total_num_tokens`` metrics gauge, through
    ``scheduler.emit_metrics_constants()`` (a no-op without ``--enable-metrics``).
Left alone: ``max_running_requests``, which sized the request table at startup (at most half
the startup capacity; it keeps that value); and the TokenizerManager's copy of
``max_req_input_len`` in the HTTP process, which SGLang reads only for multimodal and
joint-schema models (text prompts are checked against the context length there and against
the scheduler's limit here).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable

import torch

from sglang_morph.faults import FaultInjector

logger = logging.getLogger("sglang_morph")

_GIB = 1 << 30
# Scheduler components that keep their own copy of the capacity (each has that field in 0.5.23).
_CAPACITY_COMPONENTS = (
    "pool_stats_observer",
    "load_inquirer",
    "invariant_checker",
    "kv_events_publisher",
)


@dataclasses.dataclass(frozen=True)
class KVResize:
    old_capacity_tokens: int
    new_capacity_tokens: int
    moved_tokens: int  # live KV slots copied from above the new boundary to below it
    evicted_tokens: int  # radix-cache tokens evicted to make room
    duration_s: float


class KVResizeRefused(RuntimeError):
    """A shrink that would drop or corrupt a request; nothing was changed."""


class KVResizer:
    """Changes the token capacity of a scheduler's KV pool in place, keeping every request.

    Units: ``capacity`` is ``pool.size`` tokens, a multiple of ``page_size``; usable pages are
    1..capacity/page_size (page 0 is SGLang's padding page), so the pool has
    ``capacity + page_size`` rows per layer.
    Invariants (``check_integrity``): every layer buffer has ``capacity + page_size`` rows and
    the allocator's size is ``capacity``; the free list has no duplicates and only pages in
    1..capacity/page_size; no live page (in the radix tree, or in a request's private part of its
    ``req_to_token`` row) is free or out of range; and
    free + cached (evictable + locked) + request-private tokens == capacity.
    """

    def __init__(self, scheduler: Any, faults: FaultInjector | None = None):
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        if scheduler.enable_overlap or scheduler.draft_worker is not None:
            # A forward in flight, or a draft pool sharing the slot indices, would keep using
            # the old indices.
            raise NotImplementedError("KV resize does not support overlap scheduling or "
                                      "speculative decoding")
        allocator = scheduler.token_to_kv_pool_allocator
        pool = allocator.get_kvcache()
        tree = scheduler.tree_cache
        if type(allocator) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
            raise NotImplementedError(f"KV resize does not support {type(allocator).__name__}")
        if type(pool) is not MHATokenToKVPool:
            raise NotImplementedError(f"KV resize does not support {type(pool).__name__}")
        if pool.kv_cache_layout != "nhd" or pool.is_quantized_kv_cache or pool.post_capture_active:
            raise NotImplementedError(
                "KV resize supports the unquantized NHD MHATokenToKVPool without post-capture "
                f"backing (layout {pool.kv_cache_layout!r}, quantized {pool.is_quantized_kv_cache})"
            )
        if type(tree) is not UnifiedRadixCache:
            raise NotImplementedError(f"KV resize does not support {type(tree).__name__}")
        if (tree.tree_components != (ComponentType.FULL,) or tree.cache_controller is not None
                or tree.linker is not None):
            raise NotImplementedError(
                "KV resize supports a FULL-only UnifiedRadixCache without HiCache or a linker"
            )
        self.page_size = allocator.page_size
        if pool.page_size != self.page_size or pool.size % self.page_size:
            raise NotImplementedError(
                f"pool size {pool.size} / page {pool.page_size} vs allocator page {self.page_size}"
            )
        if allocator.size != pool.size or scheduler.max_total_num_tokens != pool.size:
            # DCP / page-interleave widening: logical capacity differs from pool rows.
            raise NotImplementedError(
                f"allocator size {allocator.size} and scheduler capacity "
                f"{scheduler.max_total_num_tokens} differ from the pool's {pool.size} tokens"
            )
        self.context_len = scheduler.model_config.context_len
        if scheduler.max_req_len != self._max_req_len(pool.size):
            # Another derivation (e.g. an auxiliary KV cache with its own capacity): the limits
            # would not follow the pool the way this resizer updates them.
            raise NotImplementedError(
                f"max_req_len {scheduler.max_req_len} is not min(context length "
                f"{self.context_len}, capacity {pool.size}) - 1")
        # What SGLang keeps between the longest request and the longest prompt (5 tokens).
        self.input_len_margin = scheduler.max_req_len - scheduler.max_req_input_len
        self.scheduler = scheduler
        self.allocator = allocator
        self.pool = pool
        self.tree = tree
        self.faults = faults or FaultInjector()
        self._full = ComponentType.FULL
        self.kv_bytes_per_token = sum(
            buf[0].numel() * buf.element_size() for buf in (*pool.k_buffer, *pool.v_buffer)
        )

    @property
    def capacity_tokens(self) -> int:
        return self.pool.size

    @property
    def held_tokens(self) -> int:
        """Tokens held by requests and locked cache: neither free nor evictable."""
        return held_kv_tokens(self.scheduler)

    # ---- grow ----

    def grow(self, add_tokens: int) -> KVResize:
        """Add ``add_tokens`` rounded down to whole pages (0 is a no-op). All or nothing."""
        started = time.perf_counter()
        if add_tokens < 0:
            raise ValueError(f"add_tokens must be >= 0, got {add_tokens}")
        old = self.capacity_tokens
        new = old + add_tokens // self.page_size * self.page_size
        if new != old:
            saved = self._pool_state()
            try:
                self._resize_buffers(new)
                self.faults.check("grow")
                new_pages = torch.arange(old // self.page_size + 1, new // self.page_size + 1,
                                         dtype=torch.int64, device=self.allocator.device)
                free_pages = torch.cat((self.allocator.free_pages, new_pages))
            except BaseException:
                self._restore_pool_state(saved)
                raise
            self.allocator.free_pages = free_pages
            self._publish_capacity(new)
            # Once an admission attempt ran out of KV, SGLang marks the running batch full and
            # tries again only when a request leaves it: without this, requests that the new
            # capacity could admit now wait for the next finish (seconds under load).
            # (Under pipeline parallelism each micro-batch's running batch has its own flag.)
            for batch in (self.scheduler.running_batch,
                          *(getattr(self.scheduler, "running_mbs", None) or [])):
                batch.batch_is_full = False
        return KVResize(old, new, 0, 0, time.perf_counter() - started)

    # ---- shrink ----

    def can_shrink(self, remove_tokens: int, *, extra_batches: Iterable = ()) -> bool:
        return self._shrink_refusal(self._round_up(remove_tokens), list(extra_batches))[0] is None

    def shrink(self, remove_tokens: int, *, extra_batches: Iterable = ()) -> KVResize:
        """Remove ``remove_tokens`` rounded up to whole pages, moving live KV below the boundary.

        Raises ``KVResizeRefused`` (and changes nothing) when that cannot keep every request.
        """
        started = time.perf_counter()
        extra_batches = list(extra_batches)
        remove = self._round_up(remove_tokens)
        old = self.capacity_tokens
        if remove == 0:
            return KVResize(old, old, 0, 0, time.perf_counter() - started)
        refusal, locked_nodes = self._shrink_refusal(remove, extra_batches)
        if refusal is not None:
            raise KVResizeRefused(refusal)
        new = old - remove
        self.allocator.merge_and_sort_free()
        evicted = self._evict_for_boundary(new, locked_nodes)
        # From here on the pool keeps its old capacity until the cut: every page above the new
        # boundary is either free or moved below it (holders rewritten), so on a failure the
        # pages above go back to the free list and the pool is whole at the old size.
        free_before_move = self.allocator.free_pages
        saved = self._pool_state()
        moved = 0
        try:
            moved = self._move_live_below(new, locked_nodes, extra_batches)
            self.faults.check("shrink")
            self._resize_buffers(new)
        except BaseException:
            self._restore_pool_state(saved)
            if self.allocator.free_pages is not free_before_move:  # the move was committed
                above = torch.arange(new // self.page_size + 1, old // self.page_size + 1,
                                     dtype=torch.int64, device=self.allocator.device)
                self.allocator.free_pages = torch.cat((self.allocator.free_pages, above))
            raise
        self._publish_capacity(new)
        return KVResize(old, new, moved, evicted, time.perf_counter() - started)

    def _round_up(self, remove_tokens: int) -> int:
        if remove_tokens < 0:
            raise ValueError(f"remove_tokens must be >= 0, got {remove_tokens}")
        return -(-remove_tokens // self.page_size) * self.page_size

    def _shrink_refusal(self, remove: int, extra_batches: list) -> tuple[str | None, list]:
        """(why a shrink by ``remove`` tokens must be refused or None, locked tree node ids)."""
        new = self.capacity_tokens - remove
        if new < self.page_size:
            return f"shrinking by {remove} tokens leaves no usable page", []
        if self.allocator.free_group is not None:
            return "the allocator is inside a free group; resize between batches", []
        held = self.held_tokens
        if held > new:
            return (f"{held} tokens are held by requests and locked cache, more than the "
                    f"{new}-token capacity asked for"), []
        lock_nodes = [req.lock.node for req in self._requests(extra_batches)
                      if req.lock is not None]
        infos = {info.node_id: info for path in self.tree.tree_core.collect_path_info(lock_nodes)
                 for info in path}
        seen = sum(info.full_value_len or 0 for info in infos.values())
        if seen != self.tree.protected_size():
            return (f"{self.tree.protected_size() - seen} locked cache tokens are held by locks "
                    "no known request holds (a streaming session, or a built batch not passed "
                    "as extra_batches)"), []
        return None, list(infos)

    def _locked_values(self, locked_nodes: list) -> list[torch.Tensor]:
        """The tree's own FULL value tensors of the locked nodes (writable in place)."""
        values = (self.tree.tree_core.get_component_device_value(n, self._full)
                  for n in locked_nodes)
        return [v for v in values if v is not None]

    def _evict_for_boundary(self, new: int, locked_nodes: list) -> int:
        """Evict LRU cache until no unlocked cache lies above ``new`` and the live pages above
        it fit in the free pages below it; returns the evicted tokens."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        ps, first_row_out = self.page_size, new + self.page_size
        new_pages, old_pages = new // ps, self.capacity_tokens // ps

        def tokens_above(values: torch.Tensor) -> int:
            return int((values >= first_row_out).sum())

        locked_above = sum(tokens_above(v) for v in self._locked_values(locked_nodes))
        evicted = request = 0
        while True:
            unlocked_above = tokens_above(self.tree.all_values_flatten()) - locked_above
            free = self.allocator.free_pages
            free_below = int((free <= new_pages).sum())
            live_above_pages = old_pages - new_pages - (free.numel() - free_below)
            shortfall = unlocked_above + ps * max(
                0, live_above_pages - unlocked_above // ps - free_below)
            if shortfall == 0:
                return evicted
            request = max(shortfall, 2 * request)
            got = self.tree.evict(EvictParams(num_tokens=request)).num_tokens_evicted
            self.allocator.merge_and_sort_free()
            if got == 0:
                raise RuntimeError(f"KV shrink: {shortfall} tokens short and nothing evictable")
            evicted += got

    def _move_live_below(self, new: int, locked_nodes: list, extra_batches: list) -> int:
        """Copy every live page above ``new`` into a free page below it, rewrite the holders of
        their indices and drop the pages above it from the free list; returns the moved tokens.

        Everything that can fail (the K/V copies into free pages, the rewritten index tensors,
        the check that no unlocked cache is left above) happens before the commit, which only
        replaces the free list and copies the rewritten indices into the holders in place."""
        ps, first_row_out = self.page_size, new + self.page_size
        new_pages, old_pages = new // ps, self.capacity_tokens // ps
        free = self.allocator.free_pages
        live_above = torch.ones(old_pages - new_pages, dtype=torch.bool, device=free.device)
        live_above[free[free > new_pages] - new_pages - 1] = False
        src_pages = torch.nonzero(live_above).flatten() + new_pages + 1
        free_below = free[free <= new_pages]
        dst_pages = free_below[: src_pages.numel()]
        offsets = torch.arange(ps, device=free.device)
        src = (src_pages[:, None] * ps + offsets).flatten()
        dst = (dst_pages[:, None] * ps + offsets).flatten()
        # The destination pages are free: nothing reads them until the holders are rewritten.
        for k, v in zip(self.pool.k_buffer, self.pool.v_buffer):
            k[dst] = k[src]
            v[dst] = v[src]
        holders, rewritten = self._rewritten_holders(src, dst, locked_nodes, extra_batches)
        locked_above = sum(int((v >= first_row_out).sum()) for v in self._locked_values(locked_nodes))
        left = int((self.tree.all_values_flatten() >= first_row_out).sum()) - locked_above
        if left:
            raise RuntimeError(f"KV shrink: {left} unlocked cached tokens above the boundary")
        self.allocator.free_pages = free_below[src_pages.numel():]
        for holder, value in zip(holders, rewritten):
            if value is not None:
                holder.copy_(value)
        return src.numel()

    def _rewritten_holders(self, src: torch.Tensor, dst: torch.Tensor, locked_nodes: list,
                           extra_batches: list) -> tuple[list, list]:
        """Every holder of KV indices and its value with ``src[i]`` replaced by ``dst[i]``
        (None where it holds none of ``src``); nothing is written yet."""
        # (src may lie above the pool's current rows: a group's re-shard compacted them there)
        rows = max(self.capacity_tokens + self.page_size,
                   int(src.max()) + 1 if src.numel() else 0)
        remap = torch.arange(rows, dtype=torch.int64, device=src.device)
        remap[src] = dst
        holders = [self.scheduler.req_to_token_pool.req_to_token,
                   *self._locked_values(locked_nodes),
                   *(batch.out_cache_loc for batch in self._batches(extra_batches)
                     if isinstance(batch.out_cache_loc, torch.Tensor))]
        moved = torch.zeros(rows, dtype=torch.bool, device=src.device)
        moved[src] = True
        rewritten = [_remapped(h, remap) if moved[h.long().clamp(max=moved.numel() - 1)].any()
                     else None for h in holders]
        return holders, rewritten

    # ---- the slots themselves moved elsewhere (a group's re-shard compacted them) ----

    def locked_nodes(self, extra_batches: Iterable = ()) -> list:
        """The tree nodes the scheduler's requests lock (what ``remap_holders`` rewrites)."""
        refusal, nodes = self._shrink_refusal(0, list(extra_batches))
        if refusal is not None:
            raise KVResizeRefused(refusal)
        return nodes

    def remap_holders(self, src: torch.Tensor, dst: torch.Tensor, locked_nodes: list,
                      extra_batches: Iterable = ()) -> None:
        """Point every holder of the KV indices ``src`` (requests' rows, the locked cache, the
        batches' output locations) at ``dst``, after the rows were moved there by someone
        else. Unlocked cache must hold none of ``src`` (evict it first)."""
        if not src.numel():
            return
        holders, rewritten = self._rewritten_holders(src.long(), dst.long(), locked_nodes,
                                                     list(extra_batches))
        for holder, value in zip(holders, rewritten):
            if value is not None:
                holder.copy_(value)

    def set_capacity(self, capacity_tokens: int, free_pages: torch.Tensor) -> None:
        """Publish a capacity whose buffers someone else installed, with its free list."""
        self.allocator.free_pages = free_pages
        self._publish_capacity(capacity_tokens)
        for batch in (self.scheduler.running_batch,
                      *(getattr(self.scheduler, "running_mbs", None) or [])):
            batch.batch_is_full = False

    # ---- shared ----

    def _batches(self, extra_batches: Iterable = ()) -> list:
        found = [self.scheduler.running_batch, self.scheduler.last_batch, *extra_batches]
        # A pipeline-parallel scheduler keeps one running batch per micro-batch in flight.
        for name in ("running_mbs", "last_mbs", "mbs"):
            found += getattr(self.scheduler, name, None) or []
        unique = {id(b): b for b in found if b is not None}
        return list(unique.values())

    def _requests(self, extra_batches: Iterable = ()) -> list:
        reqs = [req for batch in self._batches(extra_batches) for req in batch.reqs]
        if self.scheduler.chunked_req is not None:
            reqs.append(self.scheduler.chunked_req)
        return list({id(req): req for req in reqs}.values())

    def _pool_state(self) -> tuple:
        pool = self.pool
        return (list(pool.k_buffer), list(pool.v_buffer), pool.size, pool._kv_buffer_descs,
                pool.mem_usage)

    def _restore_pool_state(self, state: tuple) -> None:
        pool = self.pool
        k_buffers, v_buffers, pool.size, pool._kv_buffer_descs, pool.mem_usage = state
        pool.k_buffer[:], pool.v_buffer[:] = k_buffers, v_buffers
        pool._init_data_ptrs_and_strides()

    def _resize_buffers(self, capacity_tokens: int) -> None:
        """Replace every layer's K/V buffers by ones with ``capacity_tokens + page_size`` rows,
        keeping the leading rows. All new buffers are built before the pool's lists change, so
        a failure (out of memory) leaves the pool as it was.

        The rows past the kept ones are not zeroed: they are free slots, and a slot's KV is
        written (the forward's ``set_kv_buffer``) before any attention reads it, as SGLang
        leaves a freed slot's stale KV. Zeroing would touch every new page while the replicas
        wait (a KunServe drop grows the pool by hundreds of MB); untouched, a page costs its
        first write instead."""
        pool, rows = self.pool, capacity_tokens + self.page_size
        keep = min(rows, pool.k_buffer[0].shape[0])
        new_k_buffers, new_v_buffers = [], []
        for k, v in zip(pool.k_buffer, pool.v_buffer):
            if k._base is not None and k._base is v._base:
                # SGLang stores K and V as the halves of one allocation when their shapes match.
                fused = torch.empty((2, rows, *k.shape[1:]), dtype=k.dtype, device=k.device)
                new_k, new_v = fused[0], fused[1]
            else:
                new_k = k.new_empty((rows, *k.shape[1:]))
                new_v = v.new_empty((rows, *v.shape[1:]))
            new_k[:keep] = k[:keep]
            new_v[:keep] = v[:keep]
            new_k_buffers.append(new_k)
            new_v_buffers.append(new_v)
        pool.size = capacity_tokens
        set_pool_buffers(pool, new_k_buffers, new_v_buffers)

    def _max_req_len(self, capacity_tokens: int) -> int:
        return max_request_tokens(self.context_len, capacity_tokens)

    def _publish_capacity(self, capacity_tokens: int) -> None:
        """Set every copy of the capacity (plain assignments, after the pool is resized)."""
        scheduler, allocator = self.scheduler, self.allocator
        allocator.size = capacity_tokens
        if hasattr(allocator, "num_pages"):
            allocator.num_pages = capacity_tokens // self.page_size
        model_runner = scheduler.tp_worker.model_runner
        model_runner.max_total_num_tokens = capacity_tokens
        if model_runner.memory_pool_config is not None:
            model_runner.memory_pool_config.max_total_num_tokens = capacity_tokens
        scheduler.max_total_num_tokens = capacity_tokens
        max_req_len = self._max_req_len(capacity_tokens)
        scheduler.max_req_len = max_req_len
        scheduler.max_req_input_len = max_req_len - self.input_len_margin
        beam_coordinator = getattr(scheduler, "beam_coordinator", None)
        if beam_coordinator is not None:
            beam_coordinator.max_req_len = max_req_len
        for name in _CAPACITY_COMPONENTS:
            object.__setattr__(getattr(scheduler, name), "max_total_num_tokens", capacity_tokens)
        try:
            scheduler.emit_metrics_constants()
        except Exception:  # a gauge that cannot be set is no reason to undo a resize
            logger.exception("sglang-morph: could not publish the KV capacity to /metrics")

    def check_integrity(self, *, extra_batches: Iterable = ()) -> None:
        """Raise AssertionError, with the numbers, when an invariant of the class is broken."""
        ps, capacity = self.page_size, self.capacity_tokens
        pages, rows = capacity // ps, capacity + ps
        shapes = {tuple(b.shape[:1]) for b in (*self.pool.k_buffer, *self.pool.v_buffer)}
        assert shapes == {(rows,)} and self.allocator.size == capacity, (
            f"capacity {capacity}: buffer rows {shapes}, allocator size {self.allocator.size}")
        free = self.allocator.get_all_free_pages()
        duplicates = free.numel() - torch.unique(free).numel()
        assert duplicates == 0, f"free list has {duplicates} duplicate pages"
        bad = free[(free < 1) | (free > pages)]
        assert bad.numel() == 0, f"free list holds pages outside 1..{pages}: {bad[:8].tolist()}"
        kvs = {id(req.kv): req.kv for req in self._requests(extra_batches) if req.kv.holds_kv}
        kvs.update({id(kv): kv for kv in self.tree.session_records().values() if kv.holds_kv})
        rtt = self.scheduler.req_to_token_pool.req_to_token
        private = [rtt[kv.req_pool_idx, kv.cache_protected_len:kv.kv_allocated_len].long()
                   for kv in kvs.values()]
        used = torch.cat([self.tree.all_values_flatten().long(), *private]) // ps
        bad = used[(used < 1) | (used > pages)]
        assert bad.numel() == 0, f"live KV references pages outside 1..{pages}: {bad[:8].tolist()}"
        clash = torch.unique(used[torch.isin(used, free)])
        assert clash.numel() == 0, f"{clash.numel()} live pages are free: {clash[:8].tolist()}"
        free_tokens = self.allocator.available_size()
        evictable, locked = self.tree.evictable_size(), self.tree.protected_size()
        private_tokens = sum(-(-kv.kv_allocated_len // ps) * ps - kv.cache_protected_len
                             for kv in kvs.values())
        total = free_tokens + evictable + locked + private_tokens
        assert total == capacity, (
            f"free {free_tokens} + evictable {evictable} + locked {locked} + request-private "
            f"{private_tokens} = {total} tokens, capacity {capacity}")


def evict_cached_prefixes(tree_cache: Any) -> bool:
    """Evict every prefix the radix cache holds that no request holds (an idle server's whole
    cache), returning its slots to the allocator; False when there was none."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    evictable = int(tree_cache.evictable_size())
    if evictable:
        tree_cache.evict(EvictParams(num_tokens=evictable))
    return evictable > 0


def held_kv_tokens(scheduler: Any) -> int:
    """KV tokens a scheduler's requests and locked cache hold: neither free nor evictable."""
    pool = scheduler.token_to_kv_pool_allocator
    return (int(pool.get_kvcache().size) - int(pool.available_size())
            - int(scheduler.tree_cache.evictable_size()))


def allocated_rows(scheduler: Any) -> torch.Tensor:
    """The rows (token slots) of every page a scheduler's allocator has handed out: the KV of
    its requests and of its radix cache, the only rows a copy of its pool must carry (a free
    row is overwritten before anything reads it). Sorted, int64."""
    allocator = scheduler.token_to_kv_pool_allocator
    ps = allocator.page_size
    in_use = torch.ones(allocator.size // ps + 1, dtype=torch.bool)
    in_use[0] = False  # SGLang's padding page
    in_use[allocator.get_all_free_pages().long()] = False
    pages = in_use.nonzero().flatten()
    return (pages[:, None] * ps + torch.arange(ps)).flatten()


def max_request_tokens(context_len: int, capacity_tokens: int) -> int:
    """The longest request SGLang admits (``max_req_len``) at a pool of ``capacity_tokens``."""
    return min(context_len - 1, capacity_tokens - 1)


def _remapped(indices: torch.Tensor, remap: torch.Tensor) -> torch.Tensor:
    """``remap[indices]``, leaving indices past the remap as they are: ``req_to_token`` keeps
    the stale rows of finished requests, which may point above a capacity shrunk since (nothing
    reads them until the slot is reused and overwritten)."""
    idx = indices.long()
    beyond = idx >= remap.numel()
    out = torch.where(beyond, idx, remap[idx.clamp(max=remap.numel() - 1)])
    return out.to(indices.dtype)


def set_pool_buffers(pool: Any, k_buffers: list, v_buffers: list) -> None:
    """Give an MHA pool new per-layer K/V buffers (one per layer it holds, in order) and
    rebuild what SGLang derives from them: the transfer descriptors, the data pointers and
    strides the kernels read, and the reported memory usage."""
    pool.k_buffer[:] = list(k_buffers)
    pool.v_buffer[:] = list(v_buffers)
    pool._kv_buffer_descs = pool._build_kv_buffer_descs()
    pool._init_data_ptrs_and_strides()
    pool.mem_usage = sum(pool.get_kv_size_bytes()) / _GIB
