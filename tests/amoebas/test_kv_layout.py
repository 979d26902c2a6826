"""KV by head (``sglang_morph.amoebas.kv_layout`` / ``kv_reshard``) on real SGLang 0.5.23 pools.

Every pool is SGLang's own ``MHATokenToKVPool`` built in-process on CPU (float32, small). The
references are the plain pool (same writes, same reads), a plain torch attention over it, and
each member's pools before a transition (every head of every live token, bitwise).

- strided head views serve SGLang's pool like its own buffers (writes, reads, attention,
  CPU copies, the native KV move, sizes);
- a merge (3 members / 3 heads / degree 3; 4 members / 4 heads / degree 2 and 4) leaves every
  head of every live token on exactly the member that keeps that head (own pool or mirror),
  tensor-parallel attention over them equals the full attention, and the split brings every
  pool back bitwise; both variants;
- a split compacts a grown pool below the TP 1 capacity or is refused (409) changing nothing;
- a fault at each step on each member leaves every member bitwise as before;
- growth never moves a row; released pages are given back to the OS;
- one merge and split over the real ``GroupLink`` between three processes.
"""

from __future__ import annotations

import io
import math
import mmap
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from benchmark.amoebas.kv_cost import in_threads, thread_transports
from sglang_morph import faults as faults_module
from sglang_morph.amoebas.kv_layout import KVLayoutConfig, check_pool_supported
from sglang_morph.amoebas.pages import process_rss_bytes
from sglang_morph.amoebas.kv_reshard import (
    FAULT_STEPS,
    KVReshard,
    KVReshardFailed,
    KVReshardRefused,
    Transport,
)
from sglang_morph.faults import FaultInjector

VARIANTS = ("head_centric", "token_first")
LAYERS, HEAD_DIM = 3, 8


def make_pool(heads: int, capacity: int, seed: int, page_size: int = 1,
              layers: int = LAYERS, head_dim: int = HEAD_DIM) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(size=capacity, page_size=page_size, dtype=torch.float32,
                            head_num=heads, head_dim=head_dim, layer_num=layers, device="cpu",
                            enable_memory_saver=False)
    g = torch.Generator().manual_seed(seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):  # every row of every layer distinct
        buf.copy_(torch.randn(buf.shape, generator=g))
    return pool


def live_slots(capacity: int, seed: int, count: int, page_size: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randperm(capacity, generator=g)[:count] + page_size


def config_of(pool, max_capacity: int | None = None) -> KVLayoutConfig:
    return KVLayoutConfig.of_pool(pool, max_capacity or 2 * pool.size)


def token_rows(pools_and_heads: list, slots: torch.Tensor) -> torch.Tensor:
    """[layers, 2, len(slots), heads, dim]: the heads of ``slots`` gathered from (pool, first
    head) pairs in head order."""
    rows = torch.zeros((LAYERS, 2, slots.numel(), 0, HEAD_DIM))
    for pool, _ in sorted(pools_and_heads, key=lambda ph: ph[1]):
        part = torch.stack([torch.stack((k[slots], v[slots]))
                            for k, v in zip(pool.k_buffer, pool.v_buffer)])
        rows = torch.cat((rows, part), dim=3)
    return rows


def holders(kvs: list[KVReshard], m: int) -> list:
    """(pool, first global head) holding member ``m``'s tokens, across the group."""
    return [(kv.pool if kv.rank == m else kv.mirrors[m], kv.own_heads.start) for kv in kvs]


def snapshot(kv: KVReshard) -> dict:
    """Every buffer (contents, address, strides) of a member's pool and mirrors."""
    out = {"size": kv.pool.size, "rank": kv.rank, "degree": kv.degree,
           "head_num": kv.pool.head_num}
    for name, p in [("own", kv.pool), *((f"mirror{q}", m) for q, m in kv.mirrors.items())]:
        out[name] = [(b.clone(), b.data_ptr(), b.stride()) for b in (*p.k_buffer, *p.v_buffer)]
    return out


def assert_same(kv: KVReshard, before: dict) -> None:
    after = snapshot(kv)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, list):
            for (b, ptr, stride), (a, aptr, astride) in zip(value, after[key]):
                assert (aptr, astride) == (ptr, stride) and torch.equal(a, b), key
        else:
            assert after[key] == value, key
    kv.check_integrity()


def group(members: int, heads: int, variant: str, capacity: int = 48, live: int = 20,
          page_size: int = 1, faults=None) -> tuple[list[KVReshard], list[torch.Tensor]]:
    kvs, lives = [], []
    for r in range(members):
        pool = make_pool(heads, capacity, seed=r, page_size=page_size)
        kvs.append(KVReshard(pool, config_of(pool), variant,
                             faults=faults[r] if faults else None))
        lives.append(live_slots(capacity, r, live, page_size))
    return kvs, lives


def merge_all(kvs, lives, transports):
    return in_threads([lambda kv=kv, live=live, t=t: kv.merge(live, t)
                       for kv, live, t in zip(kvs, lives, transports)])


def split_all(kvs, lives):
    return in_threads([lambda kv=kv, live=live: kv.split(live) for kv, live in zip(kvs, lives)])


def assert_applied(results: list) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per KV head: softmax(q k^T / sqrt(d)) v for the query heads of its group.
    q [q_heads, dim], k/v [tokens, kv_heads, dim] -> [q_heads, dim]."""
    group_size = q.shape[0] // k.shape[1]
    out = []
    for h in range(k.shape[1]):
        qh = q[h * group_size:(h + 1) * group_size]
        w = torch.softmax(qh @ k[:, h].T / math.sqrt(q.shape[1]), dim=-1)
        out.append(w @ v[:, h])
    return torch.cat(out)


# ---- SGLang's pool on strided head views ----


def test_head_views_serve_sglang_pool_like_its_own_buffers():
    plain, viewed = make_pool(4, 40, seed=1), make_pool(4, 40, seed=1)
    kv = KVReshard(viewed, config_of(viewed))
    cfg = kv.config
    for k in viewed.k_buffer:
        assert k.stride() == (HEAD_DIM, cfg.max_rows * HEAD_DIM, 1) and not k.is_contiguous()
    kv.check_integrity()
    g = torch.Generator().manual_seed(7)
    loc = torch.randperm(40, generator=g)[:13] + 1
    for layer in range(LAYERS):
        k_new, v_new = torch.randn(2, 13, 4, HEAD_DIM, generator=g)
        for pool in (plain, viewed):
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k_new.clone(), v_new.clone())
    slots = torch.cat((loc[:5], torch.tensor([2, 3, 40])))
    q = torch.randn(8, HEAD_DIM, generator=g)
    for layer in range(LAYERS):
        for get in ("get_key_buffer", "get_value_buffer"):
            assert torch.equal(getattr(viewed, get)(layer), getattr(plain, get)(layer))
        ref = attention(q, plain.get_key_buffer(layer)[slots], plain.get_value_buffer(layer)[slots])
        got = attention(q, viewed.get_key_buffer(layer)[slots],
                        viewed.get_value_buffer(layer)[slots])
        assert torch.equal(got, ref)
    # CPU offload copies and the native KV move index by slot; sizes are the logical bytes.
    copies = [p.get_cpu_copy(slots) for p in (plain, viewed)]
    assert all(torch.equal(a, b) for la, lb in zip(*copies) for ca, cb in zip(la, lb)
               for a, b in zip(ca, cb))
    for p in (plain, viewed):
        p.load_cpu_copy(copies[0], slots.flip(0))
        # The tiled move is configured only with speculative decoding, for either pool.
        with pytest.raises(AssertionError, match="KV copy not initialized"):
            p.move_kv_cache(torch.tensor([4]), torch.tensor([9]))
        p.use_native_move_kv_cache = True
        p.move_kv_cache(torch.tensor([4, 5]), torch.tensor([9, 30]))
    assert all(torch.equal(a, b) for a, b in zip((*plain.k_buffer, *plain.v_buffer),
                                                 (*viewed.k_buffer, *viewed.v_buffer)))
    assert viewed.get_kv_size_bytes() == plain.get_kv_size_bytes()
    assert sum(viewed.get_kv_size_bytes()) == (40 + 1) * cfg.kv_bytes_per_token(1)
    assert viewed.mem_usage == pytest.approx(plain.mem_usage)
    assert [d.shape for d in viewed._kv_buffer_descs] == [d.shape for d in plain._kv_buffer_descs]
    assert viewed.get_contiguous_buf_infos()[0] == [b.data_ptr() for b in
                                                    (*viewed.k_buffer, *viewed.v_buffer)]


def test_pools_it_cannot_serve_are_refused():
    pool = MHATokenToKVPool(size=8, page_size=1, dtype=torch.float32, head_num=2, head_dim=8,
                            layer_num=1, device="cpu", enable_memory_saver=False, v_head_dim=4)
    with pytest.raises(NotImplementedError, match="V head dim 4 != 8"):
        check_pool_supported(pool)
    pool = make_pool(2, 8, seed=0)
    pool._kv_copy_config = {"bytes_per_tile": 128}  # what speculative decoding configures
    with pytest.raises(NotImplementedError, match="tiled KV copy"):
        KVReshard(pool, config_of(pool))


# ---- merge and split ----


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("members, heads, degree", [(3, 3, 3), (4, 4, 2), (4, 4, 4)])
def test_merge_places_every_head_once_and_split_restores_every_pool(members, heads, degree,
                                                                    variant):
    kvs, lives = group(members, heads, variant)
    before = [token_rows([(kv.pool, 0)], live) for kv, live in zip(kvs, lives)]
    ptrs = [[b.data_ptr() for b in kv.pool.k_buffer] for kv in kvs]
    groups = [list(range(g, g + degree)) for g in range(0, members, degree)]
    transports = [t for _ in groups for t in thread_transports(degree)]
    results = merge_all(kvs, lives, transports)
    assert_applied(results)
    for g in groups:
        for m in g:
            kv = kvs[m]
            kv.check_integrity()
            assert kv.degree == degree and kv.pool.head_num == heads // degree
            held = holders([kvs[r] for r in g], m - g[0])
            assert torch.equal(token_rows(held, lives[m]), before[m]), m
    live_count = lives[0].numel()
    for kv in kvs:  # only live rows travelled; new buffers only in the base variant
        stats = kv.last_stats
        assert stats.sent_rows == stats.received_rows == live_count * (degree - 1)
        if variant == "head_centric":
            assert stats.new_buffer_bytes == 0 and stats.undo_bytes == stats.received_bytes
        else:
            assert stats.undo_bytes == 0 and stats.new_buffer_bytes == sum(
                sum(p.get_kv_size_bytes()) for p in (kv.pool, *kv.mirrors.values()))
    if variant == "head_centric":  # the kept heads did not move
        for kv, p in zip(kvs, ptrs):
            assert kv.pool.k_buffer[0].data_ptr() == p[0] + kv.own_heads.start * \
                kv.config.head_range_bytes
    # Tensor-parallel attention of member m's request over the heads each member holds.
    if members == degree:
        q = torch.randn(2 * heads, HEAD_DIM, generator=torch.Generator().manual_seed(3))
        for m, live in enumerate(lives):
            slots = live[:7]
            ref = attention(q, before[m][0, 0][:7], before[m][0, 1][:7])
            parts = [attention(q[2 * kv.own_heads.start:2 * kv.own_heads.stop],
                               p.k_buffer[0][slots], p.v_buffer[0][slots])
                     for p, kv in zip((h[0] for h in holders(kvs, m)), kvs)]
            assert torch.equal(torch.cat(parts), ref)
    results = split_all(kvs, lives)
    assert_applied(results)
    for kv, live, rows, p in zip(kvs, lives, before, ptrs):
        kv.check_integrity()
        assert (kv.degree, kv.pool.head_num, kv.mirrors) == (1, heads, {})
        assert kv.last_stats.moved_src.numel() == 0
        assert torch.equal(token_rows([(kv.pool, 0)], live), rows)
        if variant == "head_centric":
            assert [b.data_ptr() for b in kv.pool.k_buffer] == p


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_split_compacts_a_grown_pool_below_the_tp1_capacity(variant):
    capacity, page = 64, 4
    kvs, lives = group(3, 3, variant, capacity=capacity, live=8, page_size=page)
    assert_applied(merge_all(kvs, lives, thread_transports(3)))
    # The merged group grows every pool to twice the TP 1 capacity; requests write KV above.
    for kv in kvs:
        kv.resize(2 * capacity)
        for q in kv.mirrors:
            kv.resize(2 * capacity, owner=q)
    g = torch.Generator().manual_seed(5)
    for m in range(3):
        extra = torch.arange(capacity + page, capacity + page + 6)  # two pages above
        lives[m] = torch.cat((lives[m], extra))
        for p, _ in holders(kvs, m):  # SGLang's pool, or a mirror: each its head
            for layer in range(LAYERS):
                k, v = torch.randn(2, 6, 1, HEAD_DIM, generator=g)
                p.set_kv_buffer(SimpleNamespace(layer_id=layer), extra, k, v)
    before = [token_rows(holders(kvs, m), lives[m]) for m in range(3)]
    results = split_all(kvs, lives)
    assert_applied(results)
    for kv, live, rows in zip(kvs, lives, before):
        kv.check_integrity()
        src, dst = kv.last_stats.moved_src, kv.last_stats.moved_dst
        assert sorted(src.tolist()) == list(range(capacity + page, capacity + page + 6))
        assert int(dst.max()) < capacity + page and not torch.isin(dst, live).any()
        assert torch.equal(dst % page, src % page)  # whole pages, offsets kept
        new_live = live.clone()
        new_live[torch.isin(live, src)] = dst
        assert kv.pool.size == capacity
        assert torch.equal(token_rows([(kv.pool, 0)], new_live), rows)


@pytest.mark.parametrize("step", ("kv_prepare", "kv_install"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_failed_compacting_split_changes_nothing(variant, step, kv_fault_steps):
    injectors = [FaultInjector() for _ in range(3)]
    kvs, lives = group(3, 3, variant, capacity=32, live=6, faults=injectors)
    assert_applied(merge_all(kvs, lives, thread_transports(3)))
    for kv in kvs:
        kv.resize(64)
        for q in kv.mirrors:
            kv.resize(64, owner=q)
    lives = [torch.cat((live, torch.arange(40, 44))) for live in lives]  # above: to move
    before = [snapshot(kv) for kv in kvs]
    injectors[2].arm(step)
    results = split_all(kvs, lives)
    for kv, snap, result in zip(kvs, before, results):
        assert isinstance(result, KVReshardFailed)
        assert_same(kv, snap)
    assert_applied(split_all(kvs, lives))
    assert all(kv.last_stats.moved_src.numel() == 4 for kv in kvs)


def test_integrity_catches_views_that_share_or_leave_their_ranges():
    kvs, lives = group(3, 3, "head_centric")
    assert_applied(merge_all(kvs, lives, thread_transports(3)))
    kv = kvs[0]
    kv.check_integrity()
    kv.mirrors[1].k_buffer[0] = kv.pool.k_buffer[0]  # a mirror over the own heads' range
    with pytest.raises(AssertionError, match="starts at range 0, not 1"):
        kv.check_integrity()
    kv.mirrors[1].k_buffer[0] = kv.mirrors[1].k_buffer[1]  # another layer's range
    with pytest.raises(AssertionError, match="starts at range None"):
        kv.check_integrity()
    kv.mirrors[1].k_buffer[0] = torch.zeros(kv.mirrors[1].k_buffer[1].shape)
    with pytest.raises(AssertionError, match="strides"):
        kv.check_integrity()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_split_whose_live_rows_cannot_fit_is_refused_everywhere(variant):
    kvs, lives = group(3, 3, variant, capacity=16, live=12)
    assert_applied(merge_all(kvs, lives, thread_transports(3)))
    for kv in kvs:
        kv.resize(32)
    lives[1] = torch.cat((lives[1], torch.arange(17, 27)))  # 22 live slots, 16 below
    before = [snapshot(kv) for kv in kvs]
    results = split_all(kvs, lives)
    for r, (kv, snap) in enumerate(zip(kvs, before)):
        assert isinstance(results[r], KVReshardRefused) and results[r].status_code == 409
        assert "live KV pages lie above the TP 1 capacity of 16 tokens" in str(results[r])
        assert_same(kv, snap)


@pytest.fixture
def kv_fault_steps():
    """The KV steps are armable through ``sglang_morph.faults`` (``SGLANG_MORPH_FAULT``)."""
    assert set(FAULT_STEPS) <= set(faults_module.STEPS)


@pytest.mark.parametrize("failing", range(3))
@pytest.mark.parametrize("step", FAULT_STEPS)
@pytest.mark.parametrize("action", ("merge", "split"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_fault_at_any_step_on_any_member_changes_nothing(variant, action, step, failing,
                                                           kv_fault_steps):
    injectors = [FaultInjector() for _ in range(3)]
    kvs, lives = group(3, 3, variant, faults=injectors)
    transports = thread_transports(3)
    if action == "split":
        assert_applied(merge_all(kvs, lives, transports))
    before = [snapshot(kv) for kv in kvs]
    injectors[failing].arm(step)
    results = (merge_all(kvs, lives, transports) if action == "merge"
               else split_all(kvs, lives))
    assert injectors[failing].armed == {step: 0}  # it fired
    for r, (kv, snap) in enumerate(zip(kvs, before)):
        assert isinstance(results[r], KVReshardFailed) and results[r].status_code == 500
        assert f"replica {failing} failed in" in str(results[r])
        assert_same(kv, snap)
    # The group is whole: the same transition then succeeds.
    results = (merge_all(kvs, lives, transports) if action == "merge"
               else split_all(kvs, lives))
    assert_applied(results)


# ---- address space: growth, release ----


def test_growing_a_pool_never_moves_a_row_and_shrinking_releases_its_pages():
    pool = make_pool(2, 1024, seed=4, head_dim=64)
    kv = KVReshard(pool, config_of(pool, max_capacity=8192))
    rows_before = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
    addresses = [[b[i].data_ptr() for i in (0, 1, 512, 1024)] for b in pool.k_buffer]
    kv.resize(6144)
    assert pool.size == 6144 and pool.k_buffer[0].shape == (6145, 2, 64)
    assert [[b[i].data_ptr() for i in (0, 1, 512, 1024)] for b in pool.k_buffer] == addresses
    for old, new in zip(rows_before, (*pool.k_buffer, *pool.v_buffer)):
        assert torch.equal(new[:1025], old)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf[1025:] = 1.0  # the new rows are written: their pages get backed
    kv.check_integrity()
    backed = kv.placement.arena.resident_bytes()
    released = kv.resize(2048)
    page_rows = mmap.PAGESIZE // (64 * 4)
    expected = LAYERS * 2 * 2 * ((6145 - 2049) // page_rows) * mmap.PAGESIZE  # backed pages
    assert released >= expected
    assert backed - kv.placement.arena.resident_bytes() >= expected
    kv.resize(6144)  # released rows read as zeros when the pool grows again
    assert float(pool.k_buffer[0][4096:].abs().sum()) == 0.0
    assert torch.equal(pool.k_buffer[0][:1025], rows_before[0])


def test_a_merge_releases_the_mirror_pages_no_live_row_uses():
    # Two members, 2 heads of 64 floats, one layer, 4096 tokens each with every row written.
    kvs, lives = [], []
    for r in range(2):
        pool = make_pool(2, 4096, seed=r, layers=1, head_dim=64)
        kvs.append(KVReshard(pool, config_of(pool, max_capacity=4096)))
        lives.append(torch.arange(1, 101) + 1000 * r)  # 100 live slots: 7 or 8 pages
    arenas = [kv.placement.arena for kv in kvs]
    range_bytes = kvs[0].config.head_range_bytes
    assert all(a.resident_bytes() >= 4 * range_bytes for a in arenas)
    assert_applied(merge_all(kvs, lives, thread_transports(2)))
    rows_per_page = mmap.PAGESIZE // (64 * 4)
    for r, (kv, arena) in enumerate(zip(kvs, arenas)):
        other = lives[1 - r]
        pages = len(set((other // rows_per_page).tolist()))  # the mirror's live pages
        assert kv.last_stats.released_bytes >= 2 * (range_bytes - (pages + 1) * mmap.PAGESIZE)
        # Own heads stay whole; the mirror keeps only its owner's live pages.
        assert arena.resident_bytes() <= 2 * range_bytes + 2 * (pages + 1) * mmap.PAGESIZE
        assert torch.equal(kv.mirrors[1 - r].k_buffer[0][other],
                           make_pool(2, 4096, seed=1 - r, layers=1, head_dim=64)
                           .k_buffer[0][other][:, r:r + 1])


def test_released_pages_are_given_back_to_the_os():
    # A 256 MiB layout (2 layers, 4 heads of 64 floats, 65536 tokens), every row written.
    pool = make_pool(4, 65536, seed=0, layers=2, head_dim=64)
    kv = KVReshard(pool, config_of(pool, max_capacity=65536))
    arena = kv.placement.arena
    layout_bytes = 2 * 2 * 4 * kv.config.head_range_bytes
    assert arena.resident_bytes() >= 0.99 * layout_bytes
    rss = process_rss_bytes()
    released = kv.resize(16384)
    assert released >= 0.74 * layout_bytes
    assert arena.resident_bytes() <= 0.26 * layout_bytes
    assert rss - process_rss_bytes() >= 0.7 * layout_bytes  # the process gave it back
    kv.check_integrity()


# ---- three processes over the real GroupLink ----


def _link_member(rank: int, port: int, out) -> None:
    from sglang_morph.groups.link import GroupLink

    link = GroupLink("kvtest", rank, 3, port)
    report = []
    for variant in VARIANTS:
        pool = make_pool(3, 24, seed=rank)
        plain = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
        live = live_slots(24, rank, 10)
        kv = KVReshard(pool, config_of(pool), variant)
        kv.merge(live, Transport.over_link(link))
        kv.check_integrity()
        # What this member must hold: its own head of every member's live tokens.
        held = []
        for m in range(3):
            p = kv.pool if m == rank else kv.mirrors[m]
            ref = make_pool(3, 24, seed=m)
            slots = live_slots(24, m, 10)
            held.append(all(torch.equal(b[slots], r[slots][:, rank:rank + 1]) for b, r in
                            zip((*p.k_buffer, *p.v_buffer), (*ref.k_buffer, *ref.v_buffer))))
        kv.split(live)
        kv.check_integrity()
        restored = all(torch.equal(b[live], r[live])
                       for b, r in zip((*pool.k_buffer, *pool.v_buffer), plain))
        report.append((variant, held, restored, kv.last_stats.received_rows))
    buf = io.BytesIO()
    torch.save(report, buf)
    out.put((rank, buf.getvalue()))


def test_three_processes_merge_and_split_over_the_group_link():
    from sglang_morph.server.ports import free_late_bind_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_late_bind_port()
    procs = [ctx.Process(target=_link_member, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        reports = dict(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    for rank, data in reports.items():
        for variant, held, restored, received in torch.load(io.BytesIO(data)):
            assert held == [True, True, True], (rank, variant)
            assert restored, (rank, variant)
            assert received == 20  # its head of the other two members' 10 live tokens each


def test_degree_and_slot_validation():
    pool = make_pool(3, 16, seed=0)
    kv = KVReshard(pool, config_of(pool))
    t = thread_transports(2)[0]
    assert "cannot share 3 KV heads" in kv.merge_transition(torch.tensor([1, 2]), t).refusal
    with pytest.raises(ValueError, match="repeat"):
        kv.merge_transition(torch.tensor([1, 1]), t)
    with pytest.raises(KVReshardRefused, match="not in a merged group"):
        kv.split(torch.tensor([1]))


# ---- regroup: two groups of 2 become one group of 4 and back ----

# Replicas 0..3 as the group of four orders them (shard order 0, 2, 1, 3: each member's heads
# at degree 4 lie inside its heads at degree 2): rank in the group of four -> replica.
ORDER4 = (0, 2, 1, 3)
PAIRS = ((0, 2), (1, 3))  # the pairs [0, 1] and [2, 3] in those ranks, each in shard order


def pairs_then_four(variant: str, faults=None, capacity: int = 48, page_size: int = 1,
                    live: int = 20):
    """Four members merged as two pairs; returned in the group of four's rank order."""
    kvs, lives = group(4, 4, variant, capacity=capacity, live=live, page_size=page_size,
                       faults=faults)
    for pair in ((0, 1), (2, 3)):
        assert_applied(merge_all([kvs[r] for r in pair], [lives[r] for r in pair],
                                 thread_transports(2)))
    return [kvs[r] for r in ORDER4], [lives[r] for r in ORDER4]


def regroup_all(kvs, lives, transports, old, new, new_transports=None, capacity=None):
    new_transports = new_transports or transports
    return in_threads([lambda kv=kv, live=live, t=t, n=n: kv.regroup(live, t, old, new, n,
                                                                     capacity)
                       for kv, live, t, n in zip(kvs, lives, transports, new_transports)])


def pair_transports() -> list:
    """Each member's link in its pair after a split of the four, by rank in the four."""
    first, second = thread_transports(2), thread_transports(2)
    return [first[0], second[0], first[1], second[1]]


def holders_in(kvs, groups, owner: int) -> list:
    """(pool, first head) pairs holding ``owner``'s tokens (ranks as in ``kvs``)."""
    (g,) = [g for g in groups if owner in g]
    return holders([kvs[m] for m in g], g.index(owner))


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_pairs_regroup_into_four_and_back_bitwise(variant):
    kvs, lives = pairs_then_four(variant)
    before = [token_rows(holders_in(kvs, PAIRS, m), lives[m]) for m in range(4)]
    snaps = [snapshot(kv) for kv in kvs]
    four = thread_transports(4)
    assert_applied(regroup_all(kvs, lives, four, PAIRS, (tuple(range(4)),)))
    for m, kv in enumerate(kvs):
        kv.check_integrity()
        assert (kv.rank, kv.degree, kv.pool.head_num) == (m, 4, 1)
        assert torch.equal(token_rows(holders_in(kvs, ((0, 1, 2, 3),), m), lives[m]), before[m])
        stats = kv.last_stats
        # Each member trades two of its four ranges with its counterpart (0 <-> 1, 2 <-> 3).
        assert stats.sent_rows == stats.received_rows == 2 * lives[0].numel()
    if variant == "head_centric":  # the range a member keeps did not move
        for kv, snap in zip(kvs, snaps):
            assert kv.pool.k_buffer[0].data_ptr() == snap["own"][0][1] + (
                kv.rank % 2) * kv.config.head_range_bytes
    # Tensor-parallel attention over the four members equals the whole attention.
    q = torch.randn(8, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    for m in range(4):
        slots = lives[m][:7]
        whole = before[m][0, :, :7]
        ref = attention(q, whole[0], whole[1])
        parts = [attention(q[2 * kv.own_heads.start:2 * kv.own_heads.stop],
                           p.k_buffer[0][slots], p.v_buffer[0][slots])
                 for (p, _), kv in zip(holders_in(kvs, ((0, 1, 2, 3),), m), kvs)]
        assert torch.equal(torch.cat(parts), ref)
    capacity = kvs[0].pool.size
    assert_applied(regroup_all(kvs, lives, four, (tuple(range(4)),), PAIRS, pair_transports(),
                               capacity))
    for kv, snap in zip(kvs, snaps):
        kv.check_integrity()
        if variant == "head_centric":  # every pool at its old addresses (live rows below)
            after = snapshot(kv)
            assert after.keys() == snap.keys()
            assert all([(p, st) for _, p, st in after[key]] == [(p, st) for _, p, st in value]
                       for key, value in snap.items() if isinstance(value, list))
    for m in range(4):
        assert torch.equal(token_rows(holders_in(kvs, PAIRS, m), lives[m]), before[m])
    # And the pairs split back to replicas alone over their own links.
    results = in_threads([lambda kv=kv, live=live: kv.split(live)
                          for kv, live in zip(kvs, lives)])
    assert_applied(results)
    for kv, live, rows in zip(kvs, lives, before):
        assert kv.degree == 1 and torch.equal(token_rows([(kv.pool, 0)], live), rows)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_regroup_to_pairs_compacts_below_the_pairs_capacity_or_is_refused(variant):
    capacity, page = 32, 4
    kvs, lives = pairs_then_four(variant, capacity=capacity, page_size=page, live=5)
    four = thread_transports(4)
    assert_applied(regroup_all(kvs, lives, four, PAIRS, (tuple(range(4)),)))
    for kv in kvs:  # the group of four grows every pool; requests write above the pairs' size
        kv.resize(2 * capacity)
        for q in kv.mirrors:
            kv.resize(2 * capacity, owner=q)
    g = torch.Generator().manual_seed(5)
    for m in range(4):
        extra = torch.arange(capacity + page, capacity + page + 6)
        lives[m] = torch.cat((lives[m], extra))
        for p, _ in holders_in(kvs, ((0, 1, 2, 3),), m):
            for layer in range(LAYERS):
                k, v = torch.randn(2, 6, 1, HEAD_DIM, generator=g)
                p.set_kv_buffer(SimpleNamespace(layer_id=layer), extra, k, v)
    before = [token_rows(holders_in(kvs, ((0, 1, 2, 3),), m), lives[m]) for m in range(4)]
    snaps = [snapshot(kv) for kv in kvs]
    # Too small a capacity for the live pages: refused on every member, nothing changed.
    results = regroup_all(kvs, lives, four, (tuple(range(4)),), PAIRS, pair_transports(), 8)
    for r, (kv, snap) in enumerate(zip(kvs, snaps)):
        assert isinstance(results[r], KVReshardRefused), results[r]
        assert_same(kv, snap)
    results = regroup_all(kvs, lives, four, (tuple(range(4)),), PAIRS, pair_transports(),
                          capacity)
    assert_applied(results)
    for m, kv in enumerate(kvs):
        kv.check_integrity()
        src, dst = kv.last_stats.moved_src, kv.last_stats.moved_dst
        assert sorted(src.tolist()) == list(range(capacity + page, capacity + page + 6))
        assert int(dst.max()) < capacity + page and torch.equal(dst % page, src % page)
        assert kv.pool.size == capacity and all(p.size == capacity for p in kv.mirrors.values())
    for m in range(4):
        new_live = kvs[m].last_stats.live_after
        assert torch.equal(token_rows(holders_in(kvs, PAIRS, m), new_live), before[m])


@pytest.mark.parametrize("failing", range(4))
@pytest.mark.parametrize("step", FAULT_STEPS)
@pytest.mark.parametrize("direction", ("four", "pairs"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_fault_in_a_regroup_on_any_member_changes_nothing(variant, direction, step, failing,
                                                           kv_fault_steps):
    injectors = [FaultInjector() for _ in range(4)]
    kvs, lives = pairs_then_four(variant, faults=[injectors[r] for r in (0, 2, 1, 3)])
    injectors = [injectors[r] for r in ORDER4]
    four, whole = thread_transports(4), (tuple(range(4)),)
    old, new, news, capacity = PAIRS, whole, None, None
    if direction == "pairs":
        assert_applied(regroup_all(kvs, lives, four, PAIRS, whole))
        old, new, news, capacity = whole, PAIRS, pair_transports(), kvs[0].pool.size
    before = [snapshot(kv) for kv in kvs]
    injectors[failing].arm(step)
    results = regroup_all(kvs, lives, four, old, new, news, capacity)
    assert injectors[failing].armed == {step: 0}
    for r, (kv, snap) in enumerate(zip(kvs, before)):
        assert isinstance(results[r], KVReshardFailed), results[r]
        assert_same(kv, snap)
    assert_applied(regroup_all(kvs, lives, four, old, new, news or None, capacity))
