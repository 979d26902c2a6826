"""KVResizer on real SGLang 0.5.23 memory objects, built standalone on CPU.

The pool, allocator, req-to-token pool, UnifiedRadixCache (Rust and Python tree cores) and the
scheduler components that keep a capacity copy are SGLang's own classes; only the scheduler and
the model runner are stand-ins holding them. Requests are driven the way SGLang drives them:
match the prefix in the tree, allocate the rest, checkpoint the prompt into the tree and lock it,
keep decode tokens private in the request's row. The reference for "not corrupted" is the K/V
read through each holder (request rows, tree paths) before a resize.
"""

from __future__ import annotations

import dataclasses
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.managers.scheduler_components.kv_events_publisher import (
    SchedulerKvEventsPublisher,
)
from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer
from sglang.srt.managers.scheduler_components.pool_stats_observer import (
    SchedulerPoolStatsObserver,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
from sglang_morph.faults import FaultInjector, InjectedFault
from sglang_morph.elastic.kv_resizer import KVResizer, KVResizeRefused, allocated_rows

LAYERS, KV_HEADS, HEAD_DIM = 3, 3, 8
CAPACITY_PAGES = 16
CONTEXT_LEN = 256
SHAPES = [(1, "rust"), (4, "rust"), (1, "python"), (4, "python")]


def _with_nones(cls, **given):
    """A real scheduler component; the fields a capacity change never touches are None."""
    required = {f.name: None for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return cls(**{**required, **given})


def make_scheduler(page_size: int = 1, core: str = "rust", capacity_pages: int = CAPACITY_PAGES):
    capacity = capacity_pages * page_size
    pool = MHATokenToKVPool(size=capacity, page_size=page_size, dtype=torch.bfloat16,
                            head_num=KV_HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False)
    generator = torch.Generator().manual_seed(0)
    for buf in (*pool.k_buffer, *pool.v_buffer):  # every slot of every layer distinct
        buf.copy_(torch.randn(buf.shape, generator=generator))
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(capacity, dtype=torch.bfloat16, device="cpu",
                                           kvcache=pool, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(capacity, page_size=page_size,
                                                dtype=torch.bfloat16, device="cpu",
                                                kvcache=pool, need_sort=False)
    req_to_token_pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu",
                                       enable_memory_saver=False)
    tree = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
        page_size=page_size, tree_components=(ComponentType.FULL,), tree_core_backend=core))
    observer = SchedulerPoolStatsObserver(
        tree_cache=tree, token_to_kv_pool_allocator=allocator,
        req_to_token_pool=req_to_token_pool, session_controller=None, hisparse_coordinator=None,
        is_hybrid_swa=False, is_hybrid_ssm=False, enable_hisparse=False,
        full_tokens_per_layer=None, swa_tokens_per_layer=None, max_total_num_tokens=capacity)
    model_runner = SimpleNamespace(max_total_num_tokens=capacity,
                                   memory_pool_config=MemoryPoolConfig(capacity))
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=allocator, req_to_token_pool=req_to_token_pool,
        tree_cache=tree, max_total_num_tokens=capacity,
        tp_worker=SimpleNamespace(model_runner=model_runner),
        pool_stats_observer=observer,
        load_inquirer=_with_nones(SchedulerLoadInquirer, max_total_num_tokens=capacity,
                                  pool_stats_observer=observer),
        invariant_checker=_with_nones(SchedulerInvariantChecker, max_total_num_tokens=capacity,
                                      pool_stats_observer=observer),
        kv_events_publisher=SchedulerKvEventsPublisher(
            kv_events_config=None, tree_cache=tree, send_metrics_from_scheduler=None,
            max_running_requests=8, max_total_num_tokens=capacity, get_stats=None),
        running_batch=SimpleNamespace(reqs=[], out_cache_loc=None), last_batch=None,
        chunked_req=None, enable_overlap=False, draft_worker=None, emitted_capacities=[],
        # SGLang derives these from the capacity (TpModelWorker.get_worker_info).
        model_config=SimpleNamespace(context_len=CONTEXT_LEN),
        max_req_len=min(CONTEXT_LEN, capacity) - 1, max_req_input_len=min(CONTEXT_LEN, capacity) - 6,
        beam_coordinator=SimpleNamespace(max_req_len=min(CONTEXT_LEN, capacity) - 1))
    scheduler.emit_metrics_constants = (
        lambda: scheduler.emitted_capacities.append(scheduler.max_total_num_tokens))
    # SGLang's Scheduler.collect_inflight_reqs at pp_size 1: the running and the last batch.
    scheduler.collect_inflight_reqs = lambda: {
        req for batch in (scheduler.running_batch, scheduler.last_batch) if batch is not None
        for req in batch.reqs}
    return scheduler


def _key(tokens) -> RadixKey:
    return RadixKey(array("q", tokens))


def _tree_path(s, node) -> torch.Tensor:
    return s.tree_cache.tree_core.collect_full_device_indices(node, s.tree_cache.root_node_handle())


class FakeReq(SimpleNamespace):
    """A request with identity semantics, like SGLang's Req (schedulers keep them in sets)."""
    __eq__ = object.__eq__
    __hash__ = object.__hash__


def start_request(s, tokens: list[int], decode_tokens: int = 0):
    """A request as SGLang leaves it after prefill and checkpoint: its prompt is in the tree,
    locked by the request; ``decode_tokens`` more slots are private to its row."""
    tree, ps = s.tree_cache, s.token_to_kv_pool_allocator.page_size
    match = tree.match_prefix(MatchPrefixParams(key=_key(tokens)))
    admission_lock = tree.lock(match.last_device_node)
    prefix = _tree_path(s, match.last_device_node)
    total = len(tokens) + decode_tokens
    fresh_tokens = -(-(total - match.device_prefix_len) // ps) * ps
    fresh = s.token_to_kv_pool_allocator.alloc(fresh_tokens)
    assert fresh is not None
    row = s.req_to_token_pool.alloc_rows(1)[0]
    s.req_to_token_pool.req_to_token[row, :total] = torch.cat([prefix, fresh])[:total].int()
    prompt_indices = s.req_to_token_pool.req_to_token[row, : len(tokens)].long()
    # prev_prefix_len: the matched prefix is the tree's own, not a duplicate to free.
    inserted = tree.insert(InsertParams(key=_key(tokens), value=prompt_indices,
                                        prev_prefix_len=match.device_prefix_len))
    assert inserted.prefix_len == match.device_prefix_len
    tree.unlock(admission_lock)
    kv = ReqKvInfo(req_pool_idx=row, cache_protected_len=len(tokens),
                   cache_inserted_len=len(tokens), kv_committed_len=total, kv_allocated_len=total)
    return FakeReq(kv=kv, lock=tree.lock(inserted.last_device_node), tokens=tokens,
                   output_ids=list(range(decode_tokens)))


def finish_request(s, req) -> None:
    """Release like SGLang: the prompt stays cached (evictable), the private part is freed."""
    kv = req.kv
    s.tree_cache.unlock(req.lock)
    req.lock = None
    private = s.req_to_token_pool.req_to_token[kv.req_pool_idx,
                                               kv.cache_protected_len:kv.kv_allocated_len]
    s.token_to_kv_pool_allocator.free(private.long())
    s.req_to_token_pool.free_rows([kv.req_pool_idx])
    kv.req_pool_idx, kv.kv_allocated_len = None, 0


def cache_prompt(s, tokens: list[int]) -> None:
    finish_request(s, start_request(s, tokens))


def kv_rows(s, indices: torch.Tensor) -> torch.Tensor:
    pool = s.token_to_kv_pool_allocator.get_kvcache()
    return torch.stack([buf[indices.long()] for buf in (*pool.k_buffer, *pool.v_buffer)])


def request_kv(s, req) -> torch.Tensor:
    """K/V of a request read through its row, and (prompt part) through its tree path, as
    raw bits: a slot allocated for a token not decoded yet holds whatever its buffer held (a
    grown pool's new rows are not zeroed), which may be a NaN pattern, and a move must carry
    it bit for bit."""
    row = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
    path = _tree_path(s, req.lock.node)
    assert torch.equal(path, row[: len(req.tokens)].long())
    kv = kv_rows(s, row)
    return kv.view({2: torch.int16, 4: torch.int32}[kv.element_size()])


def cached_kv(s, tokens) -> torch.Tensor:
    match = s.tree_cache.match_prefix(MatchPrefixParams(key=_key(tokens)))
    return kv_rows(s, _tree_path(s, match.last_device_node))


def capacity_copies(s) -> set[int]:
    pool = s.token_to_kv_pool_allocator.get_kvcache()
    model_runner = s.tp_worker.model_runner
    return {pool.size, s.token_to_kv_pool_allocator.size, s.max_total_num_tokens,
            model_runner.max_total_num_tokens, model_runner.memory_pool_config.max_total_num_tokens,
            s.pool_stats_observer.max_total_num_tokens, s.load_inquirer.max_total_num_tokens,
            s.invariant_checker.max_total_num_tokens, s.kv_events_publisher.max_total_num_tokens,
            s.emitted_capacities[-1],
            # The request-length limits (capacity < CONTEXT_LEN here): a prompt of up to
            # capacity - 6 tokens is admitted, max_new_tokens is clipped at capacity - 1.
            s.max_req_len + 1, s.max_req_input_len + 6, s.beam_coordinator.max_req_len + 1}


def build_scenario(s):
    """16 pages (u tokens each): A cached (1-4), B running on A's first half (5-9), C cached
    (10-12), D running (13-15), page 16 free. B and D are in the running batch."""
    u = s.token_to_kv_pool_allocator.page_size
    a = list(range(1000, 1000 + 4 * u))
    cache_prompt(s, a)
    b = start_request(s, a[: 2 * u] + list(range(2000, 2000 + 4 * u)), decode_tokens=1)
    c = list(range(3000, 3000 + 3 * u))
    cache_prompt(s, c)
    d = start_request(s, list(range(4000, 4000 + 2 * u)), decode_tokens=1)
    s.running_batch.reqs = [b, d]
    # The slots the last decode step wrote, as the batch keeps them.
    s.running_batch.out_cache_loc = torch.stack([
        s.req_to_token_pool.req_to_token[r.kv.req_pool_idx, r.kv.kv_allocated_len - 1].long()
        for r in (b, d)])
    return u, a, b, c, d


def test_grow_adds_whole_pages_keeps_kv_and_updates_every_capacity_copy():
    s = make_scheduler(page_size=4)
    resizer = KVResizer(s)
    pool, allocator = s.token_to_kv_pool_allocator.get_kvcache(), s.token_to_kv_pool_allocator
    assert resizer.kv_bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # bf16 K+V
    req = start_request(s, list(range(100, 108)), decode_tokens=3)
    s.running_batch.reqs = [req]
    before_kv = request_kv(s, req)
    old_rows = [buf.clone() for buf in (*pool.k_buffer, *pool.v_buffer)]
    old_free = allocator.free_pages.clone()

    assert resizer.grow(3).new_capacity_tokens == 64  # less than a page: no-op
    result = resizer.grow(4 * 5 + 3)

    assert (result.old_capacity_tokens, result.new_capacity_tokens) == (64, 84)
    assert (result.moved_tokens, result.evicted_tokens) == (0, 0)
    assert capacity_copies(s) == {84}
    for old, new in zip(old_rows, (*pool.k_buffer, *pool.v_buffer)):
        assert new.shape[0] == 84 + 4
        assert torch.equal(new[: old.shape[0]], old)  # the rows past them are free slots
    assert all(k._base is v._base for k, v in zip(pool.k_buffer, pool.v_buffer))
    assert pool.k_data_ptrs.tolist() == [k.data_ptr() for k in pool.k_buffer]
    assert pool.mem_usage == pytest.approx((84 + 4) * resizer.kv_bytes_per_token / (1 << 30))
    assert torch.equal(allocator.free_pages, torch.cat([old_free, torch.arange(17, 22)]))
    assert torch.equal(request_kv(s, req), before_kv)
    resizer.check_integrity()
    everything = allocator.alloc(allocator.available_size())
    assert everything.max().item() == 84 + 3  # the new top slot is handed out


def test_grow_reopens_admission_that_ran_out_of_kv():
    # SGLang marks the running batch full when an admission attempt runs out of KV and tries
    # again only when a request leaves it; the grown pool must reopen admission at once.
    s = make_scheduler(page_size=4)
    resizer = KVResizer(s)
    s.running_batch.batch_is_full = True
    resizer.grow(3)  # less than a page: nothing grew, nothing reopens
    assert s.running_batch.batch_is_full is True
    resizer.grow(8)
    assert s.running_batch.batch_is_full is False


@pytest.mark.parametrize("page_size,core", SHAPES)
def test_shrink_evicts_cache_then_moves_live_kv_below_the_boundary(page_size, core):
    s = make_scheduler(page_size, core)
    resizer = KVResizer(s)
    pool = s.token_to_kv_pool_allocator.get_kvcache()
    u, a, b, c, d = build_scenario(s)
    resizer.check_integrity()
    reference = {"b": request_kv(s, b), "d": request_kv(s, d),
                 "a_head": cached_kv(s, a[: 2 * u])}
    last_written = kv_rows(s, s.running_batch.out_cache_loc)
    assert resizer.can_shrink(6 * u - (u - 1)) and not resizer.can_shrink(7 * u)

    result = resizer.shrink(6 * u - (u - 1))  # rounds up to 6 pages

    assert (result.old_capacity_tokens, result.new_capacity_tokens) == (16 * u, 10 * u)
    # C sits above the boundary and A's unlocked tail is needed for room: both evicted.
    assert result.evicted_tokens == 5 * u and result.moved_tokens == 3 * u
    assert capacity_copies(s) == {10 * u}
    assert s.pool_stats_observer.get_pool_stats().full_capacity == 10 * u
    resizer.check_integrity()
    s.tree_cache.tree_core.sanity_check([], [])
    rtt = s.req_to_token_pool.req_to_token
    for req in (b, d):
        assert rtt[req.kv.req_pool_idx, : req.kv.kv_allocated_len].max().item() < 11 * u
    assert torch.equal(request_kv(s, b), reference["b"])
    assert torch.equal(request_kv(s, d), reference["d"])
    assert torch.equal(cached_kv(s, a[: 2 * u]), reference["a_head"])
    assert torch.equal(kv_rows(s, s.running_batch.out_cache_loc), last_written)
    assert s.tree_cache.match_prefix(MatchPrefixParams(key=_key(c))).device_prefix_len == 0
    assert all(buf.shape[0] == 11 * u for buf in pool.k_buffer)

    # Serving goes on: the finished requests' pages all come back, nothing leaks.
    for req in (b, d):
        finish_request(s, req)
    s.running_batch.reqs = []
    s.tree_cache.evict(EvictParams(num_tokens=s.tree_cache.evictable_size()))
    free = s.token_to_kv_pool_allocator.get_all_free_pages()
    assert sorted(free.tolist()) == list(range(1, 11))
    resizer.check_integrity()


@pytest.mark.parametrize("page_size,core", [(1, "rust"), (4, "python")])
def test_impossible_shrink_raises_and_changes_nothing(page_size, core):
    s = make_scheduler(page_size, core)
    resizer = KVResizer(s)
    u, *_ = build_scenario(s)
    pool, allocator = s.token_to_kv_pool_allocator.get_kvcache(), s.token_to_kv_pool_allocator
    before = (pool.k_buffer[0].clone(), allocator.free_pages.clone(),
              s.req_to_token_pool.req_to_token.clone(), s.tree_cache.all_values_flatten().clone(),
              s.tree_cache.evictable_size())

    with pytest.raises(KVResizeRefused, match="held by requests"):
        resizer.shrink(7 * u)  # B and D hold 10 pages
    with pytest.raises(KVResizeRefused, match="no usable page"):
        resizer.shrink(16 * u)

    after = (pool.k_buffer[0], allocator.free_pages, s.req_to_token_pool.req_to_token,
             s.tree_cache.all_values_flatten(), s.tree_cache.evictable_size())
    assert all(torch.equal(x, y) for x, y in zip(before[:4], after[:4])) and before[4] == after[4]
    assert s.emitted_capacities == []
    assert resizer.capacity_tokens == s.max_total_num_tokens == 16 * u
    resizer.check_integrity()


def test_shrink_refuses_unseen_locks_and_accepts_the_batch_that_holds_them():
    s = make_scheduler()
    resizer = KVResizer(s)
    build_scenario(s)
    # A batch built but not run yet: its request holds a lock and fresh slots at the top.
    e = start_request(s, [5000], decode_tokens=0)
    built = SimpleNamespace(reqs=[e], out_cache_loc=torch.tensor([16]))
    assert s.req_to_token_pool.req_to_token[e.kv.req_pool_idx, 0].item() == 16
    e_kv = request_kv(s, e)

    with pytest.raises(KVResizeRefused, match="extra_batches"):
        resizer.shrink(5)
    result = resizer.shrink(5, extra_batches=[built])

    assert result.new_capacity_tokens == 11
    assert built.out_cache_loc.item() < 12
    assert built.out_cache_loc.item() == s.req_to_token_pool.req_to_token[e.kv.req_pool_idx, 0]
    assert torch.equal(request_kv(s, e), e_kv)
    resizer.check_integrity(extra_batches=[built])


@pytest.mark.parametrize("page_size,core", [(1, "rust"), (4, "rust"), (4, "python")])
def test_grow_then_shrink_returns_to_the_original_pool(page_size, core):
    s = make_scheduler(page_size, core)
    resizer = KVResizer(s)
    pool = s.token_to_kv_pool_allocator.get_kvcache()
    u = page_size
    low = start_request(s, list(range(100, 100 + 14 * u)))  # fills most of the original pool
    resizer.grow(8 * u)
    high = start_request(s, list(range(200, 200 + 5 * u)), decode_tokens=2)  # reaches above 16
    s.running_batch.reqs = [high]
    finish_request(s, low)
    high_kv = request_kv(s, high)
    assert s.req_to_token_pool.req_to_token[high.kv.req_pool_idx].max().item() > 16 * u

    result = resizer.shrink(8 * u)

    assert result.new_capacity_tokens == 16 * u and result.moved_tokens > 0
    assert capacity_copies(s) == {16 * u}
    assert all(buf.shape[0] == 17 * u for buf in pool.v_buffer)
    assert torch.equal(request_kv(s, high), high_kv)
    resizer.check_integrity()


@pytest.mark.parametrize("page_size,core", [(1, "rust"), (4, "python")])
def test_second_shrink_ignores_stale_rows_of_finished_requests(page_size, core):
    """A finished request's row in req_to_token keeps the indices it had (SGLang does not clear
    it), so after grow + shrink it may point above the current capacity. A later shrink that
    moves a live request must rewrite only what it can and still succeed (this raised an
    IndexError in the controller's second restore of a burst)."""
    s = make_scheduler(page_size, core)
    resizer = KVResizer(s)
    u = page_size
    filler = start_request(s, list(range(100, 100 + 14 * u)))
    resizer.grow(8 * u)
    gone = start_request(s, list(range(200, 200 + 6 * u)), decode_tokens=1)  # reaches 20u+
    rtt = s.req_to_token_pool.req_to_token
    stale_row = gone.kv.req_pool_idx
    assert rtt[stale_row].max().item() > 20 * u
    finish_request(s, gone)
    finish_request(s, filler)
    s.tree_cache.evict(EvictParams(num_tokens=s.tree_cache.evictable_size()))
    assert resizer.shrink(8 * u).new_capacity_tokens == 16 * u
    assert rtt[stale_row].max().item() > 17 * u  # stale, past the shrunk pool
    # A live request on the top pages of the shrunk pool.
    s.token_to_kv_pool_allocator.merge_and_sort_free()
    held = s.token_to_kv_pool_allocator.alloc(11 * u)  # pushes the next request up
    live = start_request(s, list(range(300, 300 + 4 * u)), decode_tokens=1)
    s.running_batch.reqs = [live]
    live_kv = request_kv(s, live)
    assert rtt[live.kv.req_pool_idx, : live.kv.kv_allocated_len].max().item() >= 13 * u

    s.token_to_kv_pool_allocator.free(held)  # room below the boundary
    result = resizer.shrink(4 * u)

    assert result.new_capacity_tokens == 12 * u and result.moved_tokens > 0
    assert torch.equal(request_kv(s, live), live_kv)
    assert rtt[live.kv.req_pool_idx, : live.kv.kv_allocated_len].max().item() < 13 * u
    resizer.check_integrity()


def test_check_integrity_catches_a_corrupted_free_list():
    s = make_scheduler()
    resizer = KVResizer(s)
    _, _, b, _, _ = build_scenario(s)
    allocator = s.token_to_kv_pool_allocator
    good = allocator.free_pages.clone()
    live_slot = s.req_to_token_pool.req_to_token[b.kv.req_pool_idx, 0].long().reshape(1)
    corruptions = {
        "duplicate": torch.cat([good, good[:1]]),
        "outside 1..16": torch.cat([good, torch.tensor([17])]),
        "live pages are free": torch.cat([good, live_slot]),
        "capacity 16": good[:0],  # a leaked page
    }
    for message, free_pages in corruptions.items():
        allocator.free_pages = free_pages
        with pytest.raises(AssertionError, match=message):
            resizer.check_integrity()
    allocator.free_pages = good
    resizer.check_integrity()


def test_unsupported_prefix_cache_is_named():
    s = make_scheduler()
    s.tree_cache = RadixCache(CacheInitParams(
        disable=False, req_to_token_pool=s.req_to_token_pool,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, page_size=1))
    with pytest.raises(NotImplementedError, match="RadixCache"):
        KVResizer(s)


def pool_snapshot(s) -> dict:
    """Everything a failed resize must leave as it was (the free list as a set: its order is
    the allocator's own business)."""
    pool, allocator = s.token_to_kv_pool_allocator.get_kvcache(), s.token_to_kv_pool_allocator
    return {"buffers": [buf.clone() for buf in (*pool.k_buffer, *pool.v_buffer)],
            "ptrs": pool.k_data_ptrs.tolist(), "capacity": capacity_copies(s),
            "free": sorted(allocator.get_all_free_pages().tolist()),
            "emitted": list(s.emitted_capacities)}


def assert_same_pool(before: dict, after: dict) -> None:
    assert after["capacity"] == before["capacity"] and after["emitted"] == before["emitted"]
    assert after["ptrs"] == before["ptrs"] and after["free"] == before["free"]
    assert all(torch.equal(x, y) for x, y in zip(before["buffers"], after["buffers"]))


@pytest.mark.parametrize("page_size", [1, 4])
def test_failed_grow_leaves_the_pool_as_it_was(page_size):
    s = make_scheduler(page_size)
    faults = FaultInjector()
    resizer = KVResizer(s, faults)
    req = start_request(s, list(range(100, 100 + 3 * page_size)), decode_tokens=1)
    s.running_batch.reqs = [req]
    s.emitted_capacities.append(s.max_total_num_tokens)
    before, req_kv = pool_snapshot(s), request_kv(s, req)
    faults.arm("grow")

    with pytest.raises(InjectedFault):
        resizer.grow(5 * page_size)

    assert_same_pool(before, pool_snapshot(s))
    assert torch.equal(request_kv(s, req), req_kv)
    resizer.check_integrity()
    assert resizer.grow(5 * page_size).new_capacity_tokens == 21 * page_size  # disarmed now
    assert capacity_copies(s) == {21 * page_size}
    resizer.check_integrity()


@pytest.mark.parametrize("page_size,core", SHAPES)
def test_failed_shrink_after_moving_live_kv_keeps_the_old_capacity(page_size, core):
    """The fault fires after cache eviction and the move of live KV below the boundary: the
    pool keeps its capacity and every request reads the same KV through its holders (now at
    the moved slots); only evicted cache is gone. A later shrink succeeds."""
    s = make_scheduler(page_size, core)
    faults = FaultInjector()
    resizer = KVResizer(s, faults)
    u, a, b, c, d = build_scenario(s)
    s.emitted_capacities.append(s.max_total_num_tokens)
    reference = {"b": request_kv(s, b), "d": request_kv(s, d)}
    last_written = kv_rows(s, s.running_batch.out_cache_loc)
    held = resizer.held_tokens
    faults.arm("shrink")

    with pytest.raises(InjectedFault):
        resizer.shrink(6 * u)

    assert capacity_copies(s) == {16 * u} and s.emitted_capacities == [16 * u]
    assert all(buf.shape[0] == 17 * u for buf in s.token_to_kv_pool_allocator.get_kvcache().k_buffer)
    assert resizer.held_tokens == held
    assert torch.equal(request_kv(s, b), reference["b"])
    assert torch.equal(request_kv(s, d), reference["d"])
    assert torch.equal(kv_rows(s, s.running_batch.out_cache_loc), last_written)
    resizer.check_integrity()
    s.tree_cache.tree_core.sanity_check([], [])
    # Live KV was moved below the boundary before the fault: it stays there.
    rtt = s.req_to_token_pool.req_to_token
    assert max(rtt[r.kv.req_pool_idx, : r.kv.kv_allocated_len].max().item() for r in (b, d)) < 11 * u

    result = resizer.shrink(6 * u)
    assert result.new_capacity_tokens == 10 * u and capacity_copies(s) == {10 * u}
    assert torch.equal(request_kv(s, b), reference["b"])
    resizer.check_integrity()


@pytest.mark.parametrize("page_size,core", [(1, "rust"), (4, "python")])
def test_allocated_rows_are_every_row_requests_and_the_cache_hold(page_size, core):
    s = make_scheduler(page_size, core)
    u, a, b, c, d = build_scenario(s)
    rtt = s.req_to_token_pool.req_to_token
    held = torch.cat([s.tree_cache.all_values_flatten().long(),
                      *(rtt[r.kv.req_pool_idx, : r.kv.kv_allocated_len].long() for r in (b, d))])
    pages = torch.unique(held // u)
    want = (pages[:, None] * u + torch.arange(u)).flatten()
    got = allocated_rows(s)
    assert torch.equal(got, want)  # pages 1-15 of 16: page 16 is free
    assert got.numel() == 15 * u and got.dtype == torch.int64
    for req in (b, d):
        finish_request(s, req)
    s.tree_cache.evict(EvictParams(num_tokens=s.tree_cache.evictable_size()))
    assert allocated_rows(s).numel() == 0
