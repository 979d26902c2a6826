"""Re-sharding the live KV rows of a merging or splitting group by KV head, all members or none.

Merge to degree ``d`` (the group's size): member ``r`` keeps KV heads ``H_r = [r*K/d,
(r+1)*K/d)`` of its tokens in its own pool and, for every other member ``q``, holds a *mirror*
pool (``kv_layout.MirrorPool``): heads ``H_r`` of ``q``'s tokens at ``q``'s slot numbers; each
pair exchanges exactly those rows of its live slots. Split is the reverse, the pool back at
the TP 1 capacity: live slots above it move, whole pages, into free pages below it
(``ReshardStats.moved_src/moved_dst``: the caller rewrites SGLang's holders of those slots),
or the split is refused on every member (``KVReshardRefused``, 409) before anything changes.

The variant is the placement (``kv_layout``): ``head_centric`` (strided views of a
``HeadArena``: kept heads stay, the other heads' ranges become the mirrors, only live rows are
copied) or ``token_first``, the AMOEBAs paper's base variant on SGLang's plain buffers (the
kept heads of the whole pool are copied into new buffers; peak = old + new).

Transactional: ``groups.transition`` phases ``kv_prepare``, ``kv_exchange``, ``kv_install``
with undo, outcomes all-gathered; a commit (``LastStep``) releases the old layout. An in-place
write first saves the rows it overwrites (an undo log kept until the commit). A failure
anywhere leaves every member's pools bitwise as before. The exchange visits the pairs ``(a,
b), a < b`` in one global order (``a`` sends first): metadata (state, rows, live slots), then
the rows, one pair staged at a time. A member that failed keeps the pattern (it sends an abort
instead of rows) and raises after its last pair, so no peer waits forever; a transport that
itself fails (a dead peer) leaves the peers waiting for the transport's timeout.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Mapping

import torch

from sglang_morph.amoebas.kv_layout import (
    KVLayoutConfig,
    MemberKV,
    MirrorPool,
    PoolSnapshot,
    install_buffers,
)
from sglang_morph.elastic.contract import ElasticError, Outcome
from sglang_morph.faults import FaultInjector
from sglang_morph.groups.transition import GroupTransitions, LastStep, Phase, VotedTransition

logger = logging.getLogger("sglang_morph.amoebas")

# Fault points, in the order a transition reaches them (``sglang_morph.faults``).
FAULT_STEPS = ("kv_prepare", "kv_stage", "kv_write", "kv_install")


class KVReshardRefused(ElasticError):
    """Refused by some member's vote before anything changed (HTTP 409)."""

    def __init__(self, message: str):
        super().__init__(message, 409)


class KVReshardFailed(ElasticError):
    """Failed on some member and undone on every member (HTTP 500)."""

    def __init__(self, message: str):
        super().__init__(message, 500)


@dataclasses.dataclass(frozen=True)
class Transport:
    """How a member reaches the others: ``send(dst, tensors)`` / ``recv(src) -> tensors``
    (whole bundles, in order, per pair) and ``gather(value)`` (every member's JSON value by
    rank). ``replicas[rank]`` names each member in records (default: the ranks)."""

    rank: int
    size: int
    send: Callable[[int, dict], None]
    recv: Callable[[int], dict]
    gather: Callable[[Any], list]
    replicas: tuple[int, ...] = ()

    @classmethod
    def over_link(cls, link: Any) -> "Transport":
        """A replica group's ``GroupLink``: bundles and votes on its ``control`` group."""
        return cls(link.rank, link.size, lambda dst, t: link.send_to(link.control, dst, t),
                   lambda src: link.recv_from(link.control, src)[0], link.all_gather,
                   tuple(link.replicas))


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    """One applied merge or split on one member. Rows are token slots, each ``K/d`` heads of
    K and V in every layer; ``peak_extra_bytes``: the most memory held at once beyond the
    layout before and after (new buffers, undo log, staged and received rows)."""

    variant: str
    action: str
    degree: int
    live_tokens: int
    sent_rows: int
    received_rows: int
    sent_bytes: int
    received_bytes: int
    new_buffer_bytes: int
    undo_bytes: int
    peak_extra_bytes: int
    released_bytes: int
    phase_s: Mapping[str, float]
    moved_src: torch.Tensor
    moved_dst: torch.Tensor
    live_after: torch.Tensor  # the live slots after the transition, in the order given


@dataclasses.dataclass
class _Txn:
    """The work of one merge or split in flight on one member (until commit or undo)."""

    action: str
    transport: Transport
    live: torch.Tensor  # own live slots before the transition
    new_live: torch.Tensor  # the same slots after it, same order (split's compaction)
    moved: tuple  # (slots moved from, slots moved to) by the split's compaction
    pool_before: PoolSnapshot | None = None
    mirrors_before: dict = dataclasses.field(default_factory=dict)
    new_own: tuple | None = None  # the own pool's next (k_buffers, v_buffers)
    mirror_targets: dict = dataclasses.field(default_factory=dict)  # q -> (rows, k, v)
    peer_slots: dict = dataclasses.field(default_factory=dict)
    undo: dict = dataclasses.field(default_factory=dict)  # phase -> [(buffer, slots, saved)]
    counts: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("sent_rows", "received_rows", "sent_bytes", "received_bytes", "new_buffer_bytes",
         "undo_bytes"), 0))
    held_bytes: int = 0
    peak_bytes: int = 0
    phase_s: dict = dataclasses.field(default_factory=dict)
    state_before: tuple | None = None  # (rank, degree, transport) to put back on an undo
    regroup: "_RegroupPlan | None" = None

    def hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class KVReshard(MemberKV):
    """A member's pools (``kv_layout.MemberKV``) that merge into a group and split back,
    re-sharding their live rows by head with the other members (the module's docstring).
    ``last_stats``: the last applied transition's ``ReshardStats``."""

    def __init__(self, pool: Any, config: KVLayoutConfig, variant: str = "head_centric",
                 faults: FaultInjector | None = None, live_slots: torch.Tensor | None = None):
        super().__init__(pool, config, variant, live_slots)
        self.faults = faults or FaultInjector()
        self.transport: Transport | None = None
        self.last_stats: ReshardStats | None = None

    # ---- the transitions ----

    def merge(self, live_slots: torch.Tensor, transport: Transport) -> ReshardStats:
        """Merge with the other members of ``transport`` (every member calls it at once);
        ``live_slots``: this member's slots whose KV must survive. Raises
        ``KVReshardRefused`` / ``KVReshardFailed`` having changed nothing."""
        return self._run(self.merge_transition(live_slots, transport), transport)

    def split(self, live_slots: torch.Tensor) -> ReshardStats:
        """Split the group back to TP 1 (every member at once); see ``merge``."""
        t = self.split_transition(live_slots)
        return self._run(t, self.transport)

    def merge_transition(self, live_slots: torch.Tensor, transport: Transport,
                         reason: str = "merge") -> VotedTransition:
        """The merge as a voted transition (phases and commit) to run on every member."""
        live = self._checked_slots(live_slots)
        refusal = None
        if self.degree != 1:
            refusal = f"already merged at degree {self.degree}"
        elif transport.size < 2 or self.config.kv_heads % transport.size:
            refusal = (f"a group of {transport.size} cannot share {self.config.kv_heads} KV "
                       "heads evenly")
        txn = _Txn("merge", transport, live, live, (live[:0], live[:0]))
        return self._transition(txn, reason, refusal, self._merge_prepare,
                                self._pairwise(self._merge_outgoing, self._merge_write),
                                self._merge_install)

    def split_transition(self, live_slots: torch.Tensor, reason: str = "split") -> VotedTransition:
        """The split as a voted transition; refused when the live slots cannot fit below the
        TP 1 capacity."""
        live = self._checked_slots(live_slots)
        if self.transport is None:
            raise KVReshardRefused("this member is not in a merged group")
        plan = self._compaction(live)
        refusal = plan if isinstance(plan, str) else None
        moved = (live[:0], live[:0]) if refusal else plan
        new_live = live.clone()
        new_live[torch.isin(live, moved[0])] = moved[1]
        txn = _Txn("split", self.transport, live, new_live, moved)
        return self._transition(txn, reason, refusal, self._split_prepare,
                                self._pairwise(self._split_outgoing, self._split_write),
                                self._split_install)

    def _run(self, t: VotedTransition, transport: Transport) -> ReshardStats:
        replicas = transport.replicas or tuple(range(transport.size))
        record = GroupTransitions(transport.gather, transport.rank, replicas, "amoebas", None,
                                  lambda: self.pool.size).run(t)
        if record.outcome is Outcome.REFUSED:
            raise KVReshardRefused(record.error)
        if record.outcome is Outcome.FAILED:
            raise KVReshardFailed(record.error)
        return self.last_stats

    def _transition(self, txn: _Txn, reason: str, refusal: str | None, prepare, exchange,
                    install) -> VotedTransition:
        def timed(name: str, fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                started = time.perf_counter()
                try:
                    fn()
                finally:
                    txn.phase_s[name] = time.perf_counter() - started
            return run

        def begin() -> None:
            self.in_flight = txn.action
            txn.state_before = (self.rank, self.degree, self.transport)
            txn.pool_before = PoolSnapshot.of(self.pool)
            txn.mirrors_before = dict(self.mirrors)
            prepare(txn)
            self.faults.check("kv_prepare")

        def unprepare() -> None:
            self._replay(txn, "kv_prepare")
            txn.new_own = None
            self.in_flight = None

        def unexchange() -> None:
            self._replay(txn, "kv_exchange")
            txn.mirror_targets.clear()

        def uninstall() -> None:
            txn.pool_before.restore(self.pool)
            self.mirrors = dict(txn.mirrors_before)
            self.rank, self.degree, self.transport = txn.state_before

        phases = (
            Phase("kv_prepare", timed("kv_prepare", begin), unprepare),
            Phase("kv_exchange", timed("kv_exchange", lambda: exchange(txn)), unexchange),
            Phase("kv_install", timed("kv_install", lambda: install(txn)), uninstall),
        )
        return VotedTransition(
            action=f"kv_{txn.action}", reason=reason, refusal=refusal, phases=phases,
            last=LastStep(lambda: self._commit(txn), "the KV is re-sharded; the old layout's "
                          "memory may not all be released"),
            detail={"variant": self.variant, "degree": txn.transport.size})

    # ---- the exchange ----

    def _pairwise(self, outgoing, write) -> Callable[[_Txn], None]:
        return lambda txn: self._exchange(txn, outgoing, write)

    def _exchange(self, txn: _Txn, outgoing, write) -> None:
        t, error = txn.transport, None
        rows_now = self.pool.size + self.config.page_size
        for a, b in itertools.combinations(range(t.size), 2):
            if t.rank not in (a, b):
                continue
            peer, first = (b, True) if t.rank == a else (a, False)
            meta = _swap(t, peer, first, {"state": torch.tensor([error is None, rows_now]),
                                          "slots": txn.live})
            peer_ok, peer_rows = (int(x) for x in meta["state"])
            peer_slots = meta["slots"].long()
            rows = None
            if error is None and peer_ok:
                try:
                    rows = outgoing(txn, peer, peer_slots)
                    self.faults.check("kv_stage")
                except Exception as e:  # noqa: BLE001 - kept: the pattern goes on, raised below
                    error, rows = e, None
            if rows is not None:
                txn.hold(_nbytes(rows))
            got = _swap(t, peer, first, {"state": torch.tensor([rows is not None, 0]),
                                         **({"rows": rows} if rows is not None else {})})
            if rows is not None:
                txn.held_bytes -= _nbytes(rows)
                txn.counts["sent_rows"] += rows.shape[2]
                txn.counts["sent_bytes"] += _nbytes(rows)
            if error is None and int(got["state"][0]):
                received = got["rows"]
                txn.hold(_nbytes(received))
                txn.counts["received_rows"] += received.shape[2]
                txn.counts["received_bytes"] += _nbytes(received)
                try:
                    write(txn, peer, peer_rows, peer_slots, received)
                except Exception as e:  # noqa: BLE001 - as above
                    error = e
                txn.held_bytes -= _nbytes(received)
        if error is not None:
            raise error

    def _gather(self, k_bufs: list, v_bufs: list, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` of every layer: ``[layers, 2, len(slots), heads, head_dim]``."""
        out = torch.empty((len(k_bufs), 2, slots.numel(), *k_bufs[0].shape[1:]),
                          dtype=self.config.dtype)
        for l, (k, v) in enumerate(zip(k_bufs, v_bufs)):
            torch.index_select(k, 0, slots, out=out[l, 0])
            torch.index_select(v, 0, slots, out=out[l, 1])
        return out

    def _write(self, txn: _Txn, phase: str, target: tuple, slots: torch.Tensor,
               rows: torch.Tensor) -> None:
        """``target`` (per-layer K and V buffers) at ``slots`` := ``rows``; in place, the rows
        overwritten are saved first."""
        k_bufs, v_bufs = target
        for l, (k, v) in enumerate(zip(k_bufs, v_bufs)):
            if l == len(k_bufs) // 2:
                self.faults.check("kv_write")
            for kind, buf in ((0, k), (1, v)):
                if self.placement.in_place:
                    saved = buf[slots]
                    txn.undo.setdefault(phase, []).append((buf, slots, saved))
                    txn.hold(_nbytes(saved))
                    txn.counts["undo_bytes"] += _nbytes(saved)
                buf[slots] = rows[l, kind]

    def _replay(self, txn: _Txn, phase: str) -> None:
        for buf, slots, saved in reversed(txn.undo.pop(phase, [])):
            buf[slots] = saved
            txn.held_bytes -= _nbytes(saved)

    def _place(self, txn: _Txn, first: int, count: int, rows: int) -> tuple[list, list]:
        k, v = self.placement.place(first, count, rows)
        if not self.placement.in_place:
            nbytes = sum(_nbytes(b) for b in (*k, *v))
            txn.hold(nbytes)
            txn.counts["new_buffer_bytes"] += nbytes
        return k, v

    # ---- merge ----

    def _merge_prepare(self, txn: _Txn) -> None:
        mine = self.config.heads_of(txn.transport.rank, txn.transport.size)
        k, v = self._place(txn, mine.start, len(mine), self.pool.size + self.config.page_size)
        if not self.placement.in_place:  # the base variant's migration of the kept heads
            for new, old in zip((*k, *v), (*self.pool.k_buffer, *self.pool.v_buffer)):
                new.copy_(old[:, mine.start:mine.stop])
        txn.new_own = (k, v)

    def _merge_outgoing(self, txn: _Txn, q: int, q_slots: torch.Tensor) -> torch.Tensor:
        hq = self.config.heads_of(q, txn.transport.size)
        return self._gather([b[:, hq.start:hq.stop] for b in self.pool.k_buffer],
                            [b[:, hq.start:hq.stop] for b in self.pool.v_buffer], txn.live)

    def _merge_write(self, txn: _Txn, q: int, q_rows: int, q_slots: torch.Tensor,
                     rows: torch.Tensor) -> None:
        if q_rows > self.config.max_rows or (q_slots.numel() and int(q_slots.max()) >= q_rows):
            raise ValueError(f"member {q}'s {q_rows} rows or slots exceed the layout "
                             f"({self.config.max_rows} rows)")
        hq = self.config.heads_of(q, txn.transport.size)
        k, v = self._place(txn, hq.start, len(hq), q_rows)
        txn.mirror_targets[q] = (q_rows, k, v)
        txn.peer_slots[q] = q_slots
        self._write(txn, "kv_exchange", (k, v), q_slots, rows)

    def _merge_install(self, txn: _Txn) -> None:
        t, ps = txn.transport, self.config.page_size
        install_buffers(self.pool, *txn.new_own, self.pool.size)
        self.faults.check("kv_install")
        mine = self.config.heads_of(t.rank, t.size)
        self.mirrors = {q: MirrorPool(q, mine, rows - ps, ps, k, v)
                        for q, (rows, k, v) in txn.mirror_targets.items()}
        self.rank, self.degree, self.transport = t.rank, t.size, t

    # ---- split ----

    def _compaction(self, live: torch.Tensor, capacity_tokens: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor] | str:
        """(slots moved from, slots moved to) bringing every slot of ``live`` below
        ``capacity_tokens`` (default: the TP 1 capacity), whole pages into pages holding none
        of them (in-page offsets kept); or why they do not fit."""
        tp1, ps = capacity_tokens or self.config.tp1_capacity_tokens, self.config.page_size
        last_page = tp1 // ps
        pages = live // ps
        moved = pages > last_page
        above = torch.unique(pages[moved])
        candidates = torch.arange(1, last_page + 1, dtype=live.dtype)
        free_below = candidates[~torch.isin(candidates, pages[~moved])]
        if above.numel() > free_below.numel():
            what = "the TP 1 capacity" if capacity_tokens is None else "a capacity"
            return (f"{above.numel()} live KV pages lie above {what} of "
                    f"{tp1} tokens and only {free_below.numel()} pages "
                    "below it are free")
        src = live[moved]
        return src, free_below[torch.searchsorted(above, pages[moved])] * ps + src % ps

    def _split_prepare(self, txn: _Txn) -> None:
        cfg, mine = self.config, self.own_heads
        k, v = self._place(txn, 0, cfg.kv_heads, cfg.tp1_rows)
        kept = ([b[:, mine.start:mine.stop] for b in k], [b[:, mine.start:mine.stop] for b in v])
        if not self.placement.in_place:  # the base variant copies the kept heads whole
            n = min(cfg.tp1_rows, self.pool.size + cfg.page_size)
            for new, old in zip((*kept[0], *kept[1]), (*self.pool.k_buffer, *self.pool.v_buffer)):
                new[:n] = old[:n]
        src, dst = txn.moved
        if src.numel():
            self._write(txn, "kv_prepare", kept, dst,
                        self._gather(self.pool.k_buffer, self.pool.v_buffer, src))
        txn.new_own = (k, v)

    def _split_outgoing(self, txn: _Txn, q: int, q_slots: torch.Tensor) -> torch.Tensor:
        mirror = self.mirrors[q]
        if q_slots.numel() and int(q_slots.max()) >= mirror.size + self.config.page_size:
            raise ValueError(f"member {q}'s live slots exceed its mirror's {mirror.size} tokens")
        return self._gather(mirror.k_buffer, mirror.v_buffer, q_slots)

    def _split_write(self, txn: _Txn, q: int, q_rows: int, q_slots: torch.Tensor,
                     rows: torch.Tensor) -> None:
        hq = self.config.heads_of(q, txn.transport.size)
        k, v = txn.new_own
        self._write(txn, "kv_exchange", ([b[:, hq.start:hq.stop] for b in k],
                                         [b[:, hq.start:hq.stop] for b in v]), txn.new_live, rows)

    def _split_install(self, txn: _Txn) -> None:
        install_buffers(self.pool, *txn.new_own, self.config.tp1_capacity_tokens)
        self.faults.check("kv_install")
        self.mirrors = {}
        self.rank, self.degree, self.transport = 0, 1, None

    # ---- regroup: groups of one degree become groups of another ----

    def regroup(self, live_slots: torch.Tensor, transport: Transport,
                old_groups: tuple, new_groups: tuple, new_transport: Transport | None = None,
                capacity_tokens: int | None = None) -> ReshardStats:
        """Run ``regroup_transition`` on every member at once (see there)."""
        return self._run(self.regroup_transition(live_slots, transport, old_groups, new_groups,
                                                 new_transport, capacity_tokens), transport)

    def regroup_transition(self, live_slots: torch.Tensor, transport: Transport,
                           old_groups: tuple, new_groups: tuple,
                           new_transport: Transport | None = None,
                           capacity_tokens: int | None = None,
                           reason: str = "regroup") -> VotedTransition:
        """Merged groups become groups of another degree, e.g. two TP 2 groups one TP 4
        group and back. ``transport`` spans every member concerned; ``old_groups`` and
        ``new_groups`` partition its ranks, each group listed in shard order (member ``i``
        of a group of ``d`` keeps heads ``[i*K/d, (i+1)*K/d)``). ``new_transport``: this
        member's link in its new group (default ``transport``). ``capacity_tokens``: the
        capacity every pool shrinks to (a split to a smaller degree; live slots above it are
        compacted below it as a split to TP 1 does, or the transition is refused); None keeps
        the pools' rows (a merge; the caller grows them after).

        Physical head range ``p`` of a member of a group ``g`` holds the tokens of member
        ``g[p // (K/d)]`` (own pool or mirror) and head ``rank*K/d + p % (K/d)`` of them. Each
        head of each owner's tokens lies on exactly one member before and after, so every
        range of the new layout has one source: itself (kept in place, or moved when its
        owner's slots are compacted), another range of the same member, or one peer. With
        groups nested in shard order (``AmoebasConfig.shard_order``) a member trades half of
        its ranges with one counterpart and keeps the rest where they are."""
        live = self._checked_slots(live_slots)
        me, new_transport = transport.rank, new_transport or transport
        old_g, new_g = _group_of(old_groups, me), _group_of(new_groups, me)
        refusal = None
        if self.degree == 1 or (self.rank, self.degree) != (old_g.index(me), len(old_g)):
            refusal = (f"this member serves at degree {self.degree} (rank {self.rank}), not as "
                       f"member {old_g.index(me)} of a group of {len(old_g)}")
        elif self.config.kv_heads % len(new_g):
            refusal = (f"a group of {len(new_g)} cannot share {self.config.kv_heads} KV heads "
                       "evenly")
        if (new_transport.rank, new_transport.size) != (new_g.index(me), len(new_g)):
            raise ValueError(f"the new link's rank {new_transport.rank} of "
                             f"{new_transport.size} is not this member's place in {new_g}")
        moved, new_live = (live[:0], live[:0]), live
        if refusal is None and capacity_tokens is not None:
            plan = self._compaction(live, capacity_tokens)
            if isinstance(plan, str):
                refusal = plan
            else:
                moved, new_live = plan, live.clone()
                new_live[torch.isin(live, plan[0])] = plan[1]
        txn = _Txn("regroup", transport, live, new_live, moved)
        txn.regroup = _RegroupPlan.of(transport.size, self.config.kv_heads, tuple(old_groups),
                                      tuple(new_groups), new_transport, capacity_tokens)
        return self._transition(txn, reason, refusal, self._regroup_prepare,
                                self._regroup_exchange, self._regroup_install)

    def _cell(self, bufs: dict, degree: int, head: int) -> tuple[list, list]:
        """Per-layer K and V views ``[rows, 1, head_dim]`` of physical head range ``head``
        in ``bufs`` (a group rank -> its pool's (k_buffers, v_buffers)) at ``degree``."""
        per = self.config.heads_per_member(degree)
        k, v = bufs[head // per]
        col = head % per
        return [b[:, col:col + 1] for b in k], [b[:, col:col + 1] for b in v]

    def _old_ranges(self) -> dict:
        return {self.rank: (self.pool.k_buffer, self.pool.v_buffer),
                **{q: (m.k_buffer, m.v_buffer) for q, m in self.mirrors.items()}}

    def _regroup_prepare(self, txn: _Txn) -> None:
        plan, cfg = txn.regroup, self.config
        rows = (self.pool.size if plan.capacity_tokens is None else plan.capacity_tokens)
        mine = cfg.heads_of(plan.new_rank(txn.transport.rank), plan.new_degree(txn.transport.rank))
        txn.new_own = self._place(txn, mine.start, len(mine), rows + cfg.page_size)

    def _regroup_exchange(self, txn: _Txn) -> None:
        """Metadata between every pair (each owner's live slots before and after, its rows);
        then every move staged before any write (a range may be read by one peer and written
        by another); then the rows between the pairs that trade, and the moves inside this
        member. A member that failed keeps the pattern and raises at the end."""
        t, plan, cfg, error = txn.transport, txn.regroup, self.config, None
        me, ps = t.rank, cfg.page_size
        owners = {me: (txn.live, txn.new_live, self.pool.size + ps)}
        for a, b in itertools.combinations(range(t.size), 2):
            if me not in (a, b):
                continue
            peer = b if me == a else a
            got = _swap(t, peer, me == a, {"rows": torch.tensor([self.pool.size + ps]),
                                           "live": txn.live, "new_live": txn.new_live})
            owners[peer] = (got["live"].long(), got["new_live"].long(), int(got["rows"][0]))
        staged: dict[int, torch.Tensor] = {}
        local: list = []
        try:
            self._regroup_place(txn, owners)
            old = self._old_ranges()
            for dst, moves in plan.sends(me).items():
                parts = [self._gather(*self._cell(old, self.degree, src),
                                      owners[owner][0]) for src, _, owner in moves]
                staged[dst] = torch.cat(parts, dim=2)
                txn.hold(_nbytes(staged[dst]))
            for src, dst, owner in plan.receives(me).get(me, []):
                live, new_live, _ = owners[owner]
                if (src == dst and self.placement.in_place
                        and torch.equal(live, new_live)):
                    continue  # kept where it is
                rows = self._gather(*self._cell(old, self.degree, src), live)
                txn.hold(_nbytes(rows))
                local.append((dst, owner, rows))
            self.faults.check("kv_stage")
        except Exception as e:  # noqa: BLE001 - kept: the pattern goes on, raised below
            error, staged = e, {}
        new = self._new_ranges(txn)
        for a, b in itertools.combinations(range(t.size), 2):
            if me not in (a, b) or not plan.trade(a, b):
                continue
            peer = b if me == a else a
            rows = staged.get(peer)
            message = {"state": torch.tensor([error is None, 0])}
            if error is None and rows is not None:
                message["rows"] = rows
                txn.counts["sent_rows"] += rows.shape[2]
                txn.counts["sent_bytes"] += _nbytes(rows)
            got = _swap(t, peer, me == a, message)
            if error is None and "rows" in got:
                received = got["rows"]
                txn.hold(_nbytes(received))
                txn.counts["received_rows"] += received.shape[2]
                txn.counts["received_bytes"] += _nbytes(received)
                try:
                    first = 0
                    for _, dst, owner in plan.receives(me).get(peer, []):
                        new_live = owners[owner][1]
                        self._write(txn, "kv_exchange", self._cell(new, plan.new_degree(me), dst),
                                    new_live, received[:, :, first:first + new_live.numel()])
                        first += new_live.numel()
                except Exception as e:  # noqa: BLE001 - as above
                    error = e
        if error is None:
            for dst, owner, rows in local:
                self._write(txn, "kv_exchange", self._cell(new, plan.new_degree(me), dst),
                            owners[owner][1], rows)
        if error is not None:
            raise error

    def _regroup_place(self, txn: _Txn, owners: dict) -> None:
        """The new group's mirrors: each at its owner's rows (a merge) or at the capacity."""
        plan, cfg = txn.regroup, self.config
        rank, degree = plan.new_place(txn.transport.rank)
        mine = cfg.heads_of(rank, degree)
        for q, member in enumerate(plan.new_group(txn.transport.rank)):
            if q == rank:
                continue
            live, new_live, rows = owners[member]
            if plan.capacity_tokens is not None:
                rows = plan.capacity_tokens + cfg.page_size
            if rows > cfg.max_rows or (new_live.numel() and int(new_live.max()) >= rows):
                raise ValueError(f"member {member}'s {rows} rows or slots exceed the layout "
                                 f"({cfg.max_rows} rows)")
            k, v = self._place(txn, cfg.heads_of(q, degree).start, len(mine), rows)
            txn.mirror_targets[q] = (rows, k, v)
            txn.peer_slots[q] = new_live

    def _new_ranges(self, txn: _Txn) -> dict:
        rank, _ = txn.regroup.new_place(txn.transport.rank)
        out = {q: (k, v) for q, (_, k, v) in txn.mirror_targets.items()}
        if txn.new_own is not None:
            out[rank] = txn.new_own
        return out

    def _regroup_install(self, txn: _Txn) -> None:
        plan, ps = txn.regroup, self.config.page_size
        rank, degree = plan.new_place(txn.transport.rank)
        size = self.pool.size if plan.capacity_tokens is None else plan.capacity_tokens
        install_buffers(self.pool, *txn.new_own, size)
        self.faults.check("kv_install")
        mine = self.config.heads_of(rank, degree)
        self.mirrors = {q: MirrorPool(q, mine, rows - ps, ps, k, v)
                        for q, (rows, k, v) in txn.mirror_targets.items()}
        self.rank, self.degree, self.transport = rank, degree, plan.new_transport

    # ---- commit ----

    def _commit(self, txn: _Txn) -> None:
        cfg = self.config
        try:
            if not self.placement.in_place:  # the old buffers are freed with the transaction
                old = [*txn.pool_before.k_buffers, *txn.pool_before.v_buffers]
                old += [b for m in txn.mirrors_before.values() for b in (*m.k_buffer, *m.v_buffer)]
                released = sum(_nbytes(b) for b in old)
            elif txn.action == "split":
                released = self.placement.release(0, cfg.kv_heads, from_row=cfg.tp1_rows)
            elif txn.action == "regroup":  # a shrink gives back the pages above the capacity
                capacity = txn.regroup.capacity_tokens
                released = 0 if capacity is None else self.placement.release(
                    0, cfg.kv_heads, from_row=capacity + cfg.page_size)
            else:  # a mirror range's pages without its owner's live rows hold only stale rows
                h = cfg.heads_per_member(self.degree)
                released = sum(self.placement.release(cfg.heads_of(q, self.degree).start, h,
                                                      keep_slots=txn.peer_slots[q])
                               for q in self.mirrors)
        except OSError:  # the layout is applied either way; the pages stay backed
            logger.exception("sglang-morph: amoebas KV %s: releasing the old layout failed",
                             txn.action)
            released = 0
        self.last_stats = ReshardStats(
            variant=self.variant, action=txn.action,
            degree=self.degree if txn.action == "regroup" else txn.transport.size,
            live_tokens=int(txn.live.numel()), **txn.counts, peak_extra_bytes=txn.peak_bytes,
            released_bytes=released, phase_s=dict(txn.phase_s), moved_src=txn.moved[0],
            moved_dst=txn.moved[1], live_after=txn.new_live)
        txn.pool_before, txn.mirrors_before, txn.new_own = None, {}, None
        txn.mirror_targets, txn.undo = {}, {}
        self.in_flight = None


def _swap(t: Transport, peer: int, first: bool, message: dict) -> dict:
    """Send ``message`` to ``peer`` and receive its message; ``first`` sends first."""
    if first:
        t.send(peer, message)
        return t.recv(peer)
    got = t.recv(peer)
    t.send(peer, message)
    return got


def _group_of(groups: tuple, member: int) -> tuple[int, ...]:
    found = [tuple(g) for g in groups if member in g]
    if len(found) != 1:
        raise ValueError(f"member {member} is in {len(found)} of the groups {groups}")
    return found[0]


@dataclasses.dataclass(frozen=True)
class _RegroupPlan:
    """Where each physical head range of each member comes from in a regroup.
    ``moves[(src, dst)]``: ``(source range, target range, owner)`` triples, in target range
    order, for the rows member ``src`` holds that member ``dst`` holds after (``src == dst``:
    kept or moved inside one member)."""

    old_groups: tuple
    new_groups: tuple
    new_transport: Transport
    capacity_tokens: int | None
    moves: Mapping[tuple[int, int], tuple]

    @classmethod
    def of(cls, members: int, kv_heads: int, old_groups: tuple, new_groups: tuple,
           new_transport: Transport, capacity_tokens: int | None) -> "_RegroupPlan":
        for groups in (old_groups, new_groups):
            if sorted(m for g in groups for m in g) != list(range(members)):
                raise ValueError(f"groups {groups} do not partition {members} members")
        where = {content: cell for cell, content in _contents(old_groups, kv_heads).items()}
        moves: dict = {}
        for (dst, head), content in sorted(_contents(new_groups, kv_heads).items()):
            src, src_head = where[content]
            moves.setdefault((src, dst), []).append((src_head, head, content[0]))
        return cls(old_groups, new_groups, new_transport, capacity_tokens,
                   {k: tuple(v) for k, v in moves.items()})

    def new_group(self, member: int) -> tuple[int, ...]:
        return _group_of(self.new_groups, member)

    def new_place(self, member: int) -> tuple[int, int]:
        """(rank, degree) of ``member`` in its new group."""
        g = self.new_group(member)
        return g.index(member), len(g)

    def new_degree(self, member: int) -> int:
        return self.new_place(member)[1]

    def new_rank(self, member: int) -> int:
        return self.new_place(member)[0]

    def sends(self, member: int) -> dict[int, tuple]:
        """Peer -> the moves ``member`` sends it."""
        return {dst: m for (src, dst), m in self.moves.items() if src == member != dst}

    def receives(self, member: int) -> dict[int, tuple]:
        """Source member (``member`` itself for its own moves) -> the moves it receives."""
        return {src: m for (src, dst), m in self.moves.items() if dst == member}

    def trade(self, a: int, b: int) -> bool:
        return (a, b) in self.moves or (b, a) in self.moves


def _contents(groups: tuple, kv_heads: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(member, physical head range) -> (owner, KV head) of the rows it holds."""
    out = {}
    for g in groups:
        per = kv_heads // len(g)
        for rank, member in enumerate(g):
            for p in range(kv_heads):
                out[member, p] = (g[p // per], rank * per + p % per)
    return out
