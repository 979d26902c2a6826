"""One data-parallel replica's side of AMOEBAs (``--enable-amoebas --dp-size N``), in its
scheduler process.

SGLang cannot move a request between schedulers, so a replica keeps its scheduler, its
requests and its slot numbers whether it serves alone or in a group. In a group of degree d it
is member ``i`` of the group's link and keeps query/KV heads and FFN rows ``[i*X/d,
(i+1)*X/d)`` (``forward.Shard``). Each batch of any member (its *owner*) runs on every member
at once (``forward.forward``). Batched (the default, ``steps.py``): the owners post their
batches to the group's leader (shard rank 0), whose step thread sends each step of all posted
batches to the other members and runs its share, a service thread (one per possible caller,
``groups.member``) running each other member's share; the partial sums meet in all-reduces on
the leader's call group, and each owner keeps its part's rows. Per owner
(``--amoebas-merged-forward per-owner``): the owner's scheduler thread sends its batch to the
others and runs its share, the others' service threads theirs, on the owner's call group.
SGLang's logits and sampling stay with the owner.

KV: a member keeps its heads' KV of its own requests in its own pool and, for each other
member q, its heads' KV of q's requests at q's slot numbers (q's *mirror*). With SGLang's
token-first buffers ([slots, KV heads, dim] per layer) the mirror of q is the column range of
q's heads in this member's own buffers: the heads this member no longer keeps for its own
requests hold its heads of q's requests instead, so a group needs no memory beyond the pools
the replicas started with.

Concurrency: one compute lock per process (``groups.member``) for all its links. The
scheduler thread holds it through ``ModelRunner.forward`` and releases it while its batch
waits for its step; a service thread or the leader's step thread takes it to run a share;
all release it while they wait in an all-reduce or for an answer, so nothing waits holding
it and members calling each other cannot deadlock.

Transitions (``POST /amoebas/merge`` and ``/amoebas/split``): every replica's scheduler gets
the request between batches; the members of the named group run it as a voted transition over
their link (``groups.transition``), the others answer with their status.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import threading
import time
from typing import Any

import torch

from sglang_morph.amoebas.config import AmoebasConfig
from sglang_morph.amoebas.forward import (
    Batch,
    Part,
    Shard,
    check_layers,
    forward,
    layer_shards,
)
from sglang_morph.amoebas.pages import process_rss_bytes
from sglang_morph.amoebas.steps import Pending, StepQueue, step_from_message, step_message
from sglang_morph.amoebas.kv_layout import KVLayoutConfig
from sglang_morph.amoebas.kv_reshard import KVReshard, Transport
from sglang_morph.amoebas.weights import (
    SECTIONS,
    CopiedFfnWeights,
    MappedFfnWeights,
    keep_shard_layers,
    open_rows_layers,
)
from sglang_morph.elastic.contract import ElasticError, Outcome
from sglang_morph.elastic.kv_resizer import KVResizer, evict_cached_prefixes, held_kv_tokens
from sglang_morph.faults import FaultInjector
from sglang_morph.elastic.control import ControlOutput, replica_index
from sglang_morph.groups.link import GroupLink
from sglang_morph.groups.member import GroupMember, MemberMetrics
from sglang_morph.groups.transition import LastStep, Phase, VotedTransition

logger = logging.getLogger("sglang_morph.amoebas")

_OK, _BAD, _REFUSED, _FAILED = 200, 400, 409, 500
# A member that stops answering inside a merged forward would hold the others in their
# all-reduce forever; past this they raise and their scheduler stops with the error.
_ALL_REDUCE_TIMEOUT = datetime.timedelta(minutes=5)
_RECENT_TRANSITIONS = 20
_LEADER = 0  # the shard rank whose step thread runs a group's batched steps
# Tests only: the replica whose fault points (SGLANG_MORPH_FAULT) are armed, so that one member
# fails a step the others completed.
FAULT_REPLICA_ENV = "SGLANG_AMOEBAS_FAULT_REPLICA"


class AmoebasReplica:
    """Invariants (``check_integrity``): alone (``unit == (replica,)``), no shard and no
    mirrors; in a group, ``unit`` is one of the configured blocks holding this replica,
    ``shard`` is this member's, there is one mirror per other member and each view has the
    pool's rows and ``num_kv_heads / degree`` heads; every service thread and step thread
    is alive."""

    def __init__(self, scheduler: Any, cfg: AmoebasConfig):
        runner = scheduler.tp_worker.model_runner
        model, hf = runner.model, runner.model_config.hf_config
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            raise NotImplementedError(f"{type(model).__name__} is not a Llama-style model")
        self.scheduler, self.cfg, self.model = scheduler, cfg, model.model
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.pool = self.allocator.get_kvcache()
        self.num_q_heads = int(hf.num_attention_heads)
        self.num_kv_heads = int(getattr(hf, "num_key_value_heads", self.num_q_heads))
        self.head_dim = int(self.pool.k_buffer[0].shape[-1])
        if tuple(self.pool.k_buffer[0].shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise NotImplementedError(f"KV buffers of shape {tuple(self.pool.k_buffer[0].shape)}"
                                      f" for {self.num_kv_heads} KV heads")
        # Every KV head of one token in every layer (the group's pools together hold this).
        self.kv_bytes_per_token = sum(b[0].numel() * b.element_size()
                                      for b in (*self.pool.k_buffer, *self.pool.v_buffer))
        weights = CopiedFfnWeights if cfg.variant == "base" else MappedFfnWeights
        try:
            self.ffn = [weights.from_module(layer.mlp, cfg.degrees) for layer in self.model.layers]
        except ElasticError as e:
            raise NotImplementedError(str(e)) from e
        # The FFN rows as stored: padded so every degree's shard boundary is on a page.
        self.intermediate_size = self.ffn[0].layout.padded_intermediate
        self.kv_capacity_tokens_whole = int(self.pool.size)
        self.released_ffn_bytes = 0
        self._rss_drop_bytes = self._rss_rise_bytes = 0  # measured by a merge / a split
        self._ffn_s = 0.0  # the last transition's FFN release (merge) or gather (split)
        self.faults = FaultInjector()
        ps = self.allocator.page_size
        most = max(self.capacity_after_merge(d) for d in cfg.degrees) // ps * ps
        # The pool's rows move into the head-by-head layout here (or stay token-first: the
        # base variant); SGLang's attention reads them through strided views.
        self.kv = KVReshard(self.pool, KVLayoutConfig.of_pool(self.pool, most),
                            "token_first" if cfg.variant == "base" else "head_centric",
                            faults=self.faults)
        self.replica = replica_index()
        self.lock = threading.Lock()
        self.members: dict[tuple[int, ...], GroupMember] = {}
        for block in cfg.blocks():
            if self.replica in block:
                # Link ranks are shard ranks (``AmoebasConfig.shard_order``).
                order = cfg.shard_order(block)
                link = GroupLink(f"amoebas-{'-'.join(map(str, block))}", order.index(self.replica),
                                 len(block), cfg.block_port(block), replicas=order)
                self.members[block] = GroupMember(scheduler, link, "amoebas",
                                                  lambda: int(self.pool.size),
                                                  compute_lock=self.lock)
        self.context_len = int(scheduler.model_config.context_len)
        # What SGLang keeps between the longest request and the longest prompt.
        self.input_len_margin = int(scheduler.max_req_len - scheduler.max_req_input_len)
        self.max_prompt_tokens_alone = int(scheduler.max_req_input_len)
        self.auto = None
        if cfg.auto:
            from sglang_morph.amoebas.auto import AutoControl, Board

            self.auto = AutoControl(self, Board(self.replica, cfg.replicas, cfg.board_port()))
        self.unit: tuple[int, ...] = (self.replica,)
        # The unit's replicas by shard rank (its link's ranks), set with ``unit``: every
        # merged forward looks owners up in it.
        self.order: tuple[int, ...] = self.unit
        self.merged_at = 0.0
        self.shard: Shard | None = None
        self._layers: list | None = None  # forward.LayerShard per layer while merged
        self.transitions: list[dict[str, Any]] = []
        self.batches_merged = self.batches_served_for_others = 0
        # Batched merged forward: the steps of the groups this replica leads, and this
        # replica's batch waiting for its step (scheduler thread sets it before posting).
        self._steps: dict[tuple[int, ...], StepQueue] = {}
        self._step_threads: list[threading.Thread] = []
        self._pending: Pending | None = None
        runner.amoebas = self
        self.model.amoebas = self
        if os.environ.get(FAULT_REPLICA_ENV) == str(self.replica):
            self.faults.arm_from_env()
        self._metrics = _Metrics(self.replica) if MemberMetrics.enabled(scheduler) else None
        self._publish_metrics()
        for block, member in self.members.items():
            member.start_services(functools.partial(self._run_for, block))
            if cfg.merged_forward == "batched" and member.link.rank == _LEADER:
                self._steps[block] = StepQueue(cfg.step_wait_ms / 1000)
                thread = threading.Thread(target=self._lead, args=(block,), daemon=True,
                                          name=f"amoebas-steps-{_block_name(block)}")
                thread.start()
                self._step_threads.append(thread)

    # ---- state ----

    @property
    def merged(self) -> bool:
        return len(self.unit) > 1

    @property
    def member(self) -> GroupMember:
        return self.members[self.unit]

    def capacity_after_merge(self, degree: int) -> int:
        """KV tokens of this replica's pool in a group of ``degree``: its startup pool plus the
        FFN rows it releases, at the bytes per token of every KV head (its own heads and the
        mirrors' share one row)."""
        return self.kv_capacity_tokens_whole + self._released_at(degree) // self.kv_bytes_per_token

    def used_tokens(self) -> int:
        return held_kv_tokens(self.scheduler)

    def kv_views(self, owner: int) -> tuple[list, list]:
        """This member's heads of ``owner``'s requests, per layer, at ``owner``'s slot
        numbers: its own pool for its own requests, else its mirror of ``owner``."""
        if owner == self.replica:
            return self.pool.k_buffer, self.pool.v_buffer
        mirror = self.kv.mirrors[self.order.index(owner)]
        return mirror.k_buffer, mirror.v_buffer

    def ffn_digest(self) -> str:
        """SHA-256 of the FFN rows held, layer by layer (gate, up, down^T)."""
        digest = hashlib.sha256()
        for store in self.ffn:
            digest.update(store.rows(*store.resident_rows).contiguous().view(torch.uint8)
                          .numpy().tobytes())
        return digest.hexdigest()

    def status(self, digest: bool = False) -> dict[str, Any]:
        shard = self.shard
        # The digest and the resident KV bytes read every FFN row and the KV mapping's page
        # table: only on request, so a client polling the status costs the replicas little.
        detail = {"ffn_sha256": self.ffn_digest(),
                  "kv_resident_bytes": self.kv.placement.arena.resident_bytes()
                  if hasattr(self.kv.placement, "arena") else None} if digest else {}
        return {**detail,
            "replica": self.replica,
            "group": list(self.unit),
            "degree": len(self.unit),
            "kv_heads": [shard.kv_heads.start, shard.kv_heads.stop] if shard
            else [0, self.num_kv_heads],
            "ffn_rows": [shard.ffn_rows.start, shard.ffn_rows.stop] if shard
            else [0, self.intermediate_size],
            "kv_capacity_tokens": int(self.pool.size),
            "kv_capacity_tokens_alone": self.kv_capacity_tokens_whole,
            "kv_used_tokens": self.used_tokens(),
            # Each member grows alike, so the mirror of q has q's capacity.
            "mirror_kv_capacity_tokens": {str(self.order[q]): int(m.size)
                                          for q, m in sorted(self.kv.mirrors.items())},
            "kv_variant": self.kv.variant,
            "released_ffn_bytes": self.released_ffn_bytes,
            "batches_merged": self.batches_merged,
            "batches_served_for_others": self.batches_served_for_others,
            "merged_forward": self.cfg.merged_forward,
            # The groups this replica leads: steps run and owners' batches in them
            "steps_led": {_block_name(b): {"steps": q.steps, "batches": q.parts}
                          for b, q in self._steps.items()},
            "groups_allowed": [list(b) for b in self.cfg.blocks()],
            "transitions": self.transitions[-_RECENT_TRANSITIONS:],
        }

    def elastic_state(self) -> dict[str, Any]:
        """What ``/elastic/status`` shows of this replica (``/amoebas/status`` has the rest)."""
        return {"group": list(self.unit), "degree": len(self.unit),
                "kv_capacity_tokens": int(self.pool.size)}

    def check_integrity(self) -> None:
        for member in self.members.values():
            member.check_integrity()
        dead = [t.name for t in self._step_threads if not t.is_alive()]
        assert not dead, f"step threads {dead} of replica {self.replica} have stopped"
        for store in self.ffn:
            store.check_integrity()
        self.kv.check_integrity()
        held = {store.resident_rows for store in self.ffn}
        assert self.order == self.cfg.shard_order(self.unit), (self.order, self.unit)
        if not self.merged:
            assert self.shard is None and self._layers is None, (
                f"replica {self.replica} serves alone but keeps a shard")
            assert held == {(0, self.intermediate_size)}, f"FFN rows held alone: {held}"
            assert self.released_ffn_bytes == 0
            return
        assert self.unit in self.members, f"replica {self.replica} is in unknown group {self.unit}"
        shard = self.shard
        assert shard is not None and shard.degree == len(self.unit)
        rows = shard.ffn_rows
        assert held == {(rows.start, rows.stop)}, f"FFN rows held in a group: {held}"
        for layer, store in zip(self._layers or (), self.ffn):
            gate, _, down_t = store.rows(rows.start, rows.stop)
            assert (layer.gate.data_ptr(), layer.down.data_ptr()) == (
                gate.data_ptr(), down_t.data_ptr()), "the shard's FFN weights left the store"

    # ---- control requests (scheduler thread, between batches) ----

    def handle_control(self, req: Any) -> ControlOutput:
        from sglang_morph.amoebas.messages import (
            AmoebasMergeReq,
            AmoebasSplitReq,
            AmoebasStatusReq,
        )

        code, body = _OK, None
        if isinstance(req, AmoebasStatusReq):
            body = self.status(digest=req.digest)
        elif isinstance(req, AmoebasMergeReq):
            code, body = self.transition(tuple(req.replicas), merge=True)
        elif isinstance(req, AmoebasSplitReq):
            code, body = self.transition(tuple(req.group), merge=False, degree=req.degree)
        return ControlOutput(rid=req.rid, status_code=code,
                             body=self.status() if body is None else body, replica=self.replica)

    def transition(self, block: tuple[int, ...], merge: bool, trigger: str = "operator",
                   reason: str | None = None, degree: int = 1) -> tuple[int, dict | None]:
        """Merge ``block`` into one group, or split that group into groups of ``degree`` (1:
        replicas alone): a voted transition of the block's members, between batches (an
        operator's request or a proposal on the board, ``trigger`` "auto" with its
        ``reason``). A merge takes replicas serving alone, or the groups of the degree below
        that tile the block (two TP 2 groups into TP 4). The HTTP status and the error body
        (None: this replica's status)."""
        action = "merge" if merge else "split"
        if block not in self.cfg.blocks():
            return _BAD, {"error": f"{list(block)} is not a group this server allows "
                                   f"(allowed: {[list(b) for b in self.cfg.blocks()]})",
                          "replica": self.replica}
        if not merge and (degree >= len(block) or (degree > 1 and not
                                                    self.cfg.sub_blocks(block, degree))):
            below = [d for d in self.cfg.degrees if d < len(block)
                     and (d == 1 or self.cfg.sub_blocks(block, d))]
            return _BAD, {"error": f"a group of {len(block)} cannot split into groups of "
                                   f"{degree} (degrees allowed: {below})",
                          "replica": self.replica}
        if self.replica not in block:
            return _OK, None  # another group's transition: this replica answers its status
        member = self.members[block]
        try:
            # Every member states where it serves, so that all plan the same transition.
            units = [tuple(u) for u in member.link.all_gather(list(self.unit))]
            refusal, phases, last = self._plan(block, merge, member, units, degree,
                                               reason or trigger)
        except Exception as e:  # still vote: the other members wait for this one's vote
            logger.exception("sglang-morph: AMOEBAs replica %d cannot plan the %s",
                             self.replica, action)
            refusal, phases, last = f"replica {self.replica} cannot {action}: {e}", (), None
        record = member.group_transitions.run(
            VotedTransition(action, reason or trigger, refusal, phases, last,
                            detail={"trigger": trigger, "variant": self.cfg.variant},
                            exclusive=self.lock),
            applied=lambda seconds: self._applied(action, block, seconds, trigger, reason))
        if record.outcome is Outcome.APPLIED:
            return _OK, None
        code = _REFUSED if record.outcome is Outcome.REFUSED else _FAILED
        return code, {"error": record.error, "replica": self.replica}

    def _plan(self, block: tuple[int, ...], merge: bool, member: GroupMember, units: list,
              degree: int, reason: str) -> tuple[str | None, tuple, LastStep | None]:
        """This member's vote, phases and commit step for the transition (``units``: where
        each member serves now)."""
        refusal = self._refusal(block, merge, units)
        if refusal is not None:  # every member votes; one refusal refuses it everywhere
            return refusal, (), None
        if merge and any(len(u) > 1 for u in units):
            return self._plan_regroup(block, member, tuple(sorted(set(units))), (block,), reason)
        if not merge and degree > 1:
            return self._plan_regroup(block, member, (block,),
                                      self.cfg.sub_blocks(block, degree), reason)
        if merge:
            kv = self.kv.merge_transition(self._held_slots(), Transport.over_link(member.link),
                                          reason=reason)
            phases = (*kv.phases,
                      Phase("the switch to the group", functools.partial(self._join, block),
                            self._leave))
            # The KV commit, then the FFN release, which cannot be undone without the peers.
            return kv.refusal, phases, LastStep(
                functools.partial(self._commit_merge, kv.last),
                "the group serves, but without (all) the KV capacity of the FFN rows it "
                "releases")
        self._evict_cache()  # the re-shard moves what requests hold, not the cache
        resizer = KVResizer(self.scheduler)  # built on the pool as it is now
        kv = self.kv.split_transition(self._held_slots(), reason=reason)
        locked = resizer.locked_nodes() if kv.refusal is None else []
        phases = (*kv.phases,
                  Phase("the FFN gather", self._gather_ffn, self._release_ffn_again),
                  Phase("the switch back", self._leave, functools.partial(self._join, block)))
        return kv.refusal, phases, LastStep(
            functools.partial(self._commit_split, kv.last, resizer, locked),
            "every head and FFN row is back, but the pool's capacity and slots may not be")

    def _refusal(self, block: tuple[int, ...], merge: bool, units: list) -> str | None:
        """The same text on every member of a merge (they decide from the same ``units``)."""
        if not merge:
            return (f"replica {self.replica} is not in group {list(block)}"
                    if self.unit != block else None)
        if all(len(u) == 1 for u in units):
            return None
        if set(units) == {block}:
            return f"replica {self.replica} already serves in group {list(block)}"
        below = self.cfg.degree_chain(len(block))[-2]
        tiles = set(self.cfg.sub_blocks(block, below)) if below > 1 else set()
        if set(units) == tiles:
            return None
        serving = [list(u) if len(u) > 1 else u[0] for u in sorted(set(units))]
        return (f"replicas {list(block)} serve as {serving}: a merge into {list(block)} takes "
                "replicas serving alone" + (f" or the groups {sorted(map(list, tiles))}"
                                            if tiles else ""))

    def _plan_regroup(self, block: tuple[int, ...], member: GroupMember, old: tuple,
                      new: tuple, reason: str) -> tuple[str | None, tuple, LastStep | None]:
        """Groups ``old`` become groups ``new`` (blocks tiling ``block``, whose link carries
        the transition): two groups merge into ``block``, or ``block`` splits into groups.
        No FFN row moves on the merge: each member's new shard lies inside its old one
        (``AmoebasConfig.shard_order``); the split gathers back the rows of its new shard."""
        cfg, ps = self.cfg, self.allocator.page_size
        link_rank = {r: i for i, r in enumerate(cfg.shard_order(block))}

        def ranks(blocks: tuple) -> tuple:
            return tuple(tuple(link_rank[r] for r in cfg.shard_order(b)) for b in blocks)

        transport = Transport.over_link(member.link)
        (now,), (after,) = ([b for b in blocks if self.replica in b] for blocks in (old, new))
        if len(after) > len(now):  # the merge: FFN rows released at the commit
            kv = self.kv.regroup_transition(self._held_slots(), transport, ranks(old),
                                            ranks(new), reason=reason)
            phases = (*kv.phases,
                      Phase("the switch to the group", functools.partial(self._join, after),
                            functools.partial(self._join, now)))
            return kv.refusal, phases, LastStep(
                functools.partial(self._commit_merge, kv.last),
                "the group serves, but without (all) the KV capacity of the FFN rows it "
                "releases")
        self._evict_cache()
        resizer = KVResizer(self.scheduler)
        capacity = self.capacity_after_merge(len(after)) // ps * ps
        kv = self.kv.regroup_transition(self._held_slots(), transport, ranks(old), ranks(new),
                                        Transport.over_link(self.members[after].link),
                                        capacity, reason=reason)
        locked = resizer.locked_nodes() if kv.refusal is None else []
        phases = (*kv.phases,
                  Phase("the FFN gather", functools.partial(self._gather_ffn, new),
                        self._release_ffn_again),
                  Phase("the switch to the smaller group", functools.partial(self._join, after),
                        functools.partial(self._join, now)))
        return kv.refusal, phases, LastStep(
            functools.partial(self._commit_split, kv.last, resizer, locked, capacity),
            "every head and FFN row of the smaller group is back, but the pool's capacity "
            "and slots may not be")

    def _held_slots(self) -> torch.Tensor:
        """Every slot not free: what requests hold and what the radix cache keeps."""
        allocator, ps = self.allocator, self.allocator.page_size
        allocator.merge_and_sort_free()
        used = torch.ones(int(self.pool.size) // ps + 1, dtype=torch.bool)
        used[0] = False  # SGLang's padding page
        used[allocator.free_pages.long()] = False
        pages = torch.nonzero(used).flatten()
        return (pages[:, None] * ps + torch.arange(ps)).flatten()

    def _evict_cache(self) -> None:
        if evict_cached_prefixes(self.scheduler.tree_cache):
            self.allocator.merge_and_sort_free()

    def _applied(self, action: str, block: tuple[int, ...], seconds: float, trigger: str,
                 reason: str | None) -> dict[str, Any]:
        self.check_integrity()
        self.transitions.append({"action": action, "group": list(block), "trigger": trigger,
                                 "reason": reason, "unit": list(self.unit),
                                 "at_unix_s": round(time.time(), 3),
                                 "duration_s": round(seconds, 4),
                                 "kv_capacity_tokens": int(self.pool.size),
                                 "released_ffn_bytes": self.released_ffn_bytes,
                                 "rss_drop_bytes": self._rss_drop_bytes if action == "merge"
                                 else None,
                                 "rss_rise_bytes": self._rss_rise_bytes if action == "split"
                                 else None,
                                 **self._cost_detail()})
        logger.info("sglang-morph: AMOEBAs %s on replica %d: %s", action, self.replica,
                    self.transitions[-1])
        self._publish_metrics(action)
        return self.transitions[-1]

    def _publish_metrics(self, action: str | None = None) -> None:
        if self._metrics is None:
            return
        m = self._metrics
        m.group_size.set(len(self.unit))
        m.kv_capacity_tokens.set(int(self.pool.size))
        m.released_ffn_bytes.set(self.released_ffn_bytes)
        if action is not None:
            m.transitions(action).inc()

    def _count_batches(self, own: int, others: int) -> None:
        self.batches_merged += own
        self.batches_served_for_others += others
        if self._metrics is not None:
            self._metrics.merged_batches("own").inc(own)
            self._metrics.merged_batches("others").inc(others)

    def _cost_detail(self) -> dict[str, Any]:
        """Where the last transition's time went on this member: the KV phases, the rows and
        bytes it exchanged, and the FFN release or gather (the benchmarks' cost breakdown)."""
        stats = self.kv.last_stats
        if stats is None:
            return {}
        return {"live_tokens": stats.live_tokens,
                "kv_phase_s": {k: round(v, 5) for k, v in stats.phase_s.items()},
                "kv_sent_bytes": stats.sent_bytes, "kv_received_bytes": stats.received_bytes,
                "kv_peak_extra_bytes": stats.peak_extra_bytes,
                "ffn_s": round(self._ffn_s, 5)}

    # ---- joining and leaving a group (the views) ----

    def _join(self, block: tuple[int, ...]) -> None:
        order = self.cfg.shard_order(block)
        shard = Shard(order.index(self.replica), len(block), self.num_q_heads,
                      self.num_kv_heads, self.intermediate_size)
        # Refused here, while the switch can still be undone; the shard's weight views are
        # taken at the first merged forward: the FFN stores change their rows (and a whole
        # store its layout of down) at the commit.
        check_layers(self.model)
        self._layers = None
        self.shard, self.unit, self.order = shard, block, order
        self.merged_at = time.monotonic()

    def _leave(self) -> None:
        self.unit, self.shard, self._layers = (self.replica,), None, None
        self.order = self.unit

    # ---- memory: FFN rows released in place become KV capacity, and back ----

    def _commit_merge(self, kv_commit: LastStep) -> None:
        """After every member installed the group: the KV layout's commit, then this member
        keeps its FFN rows only and the freed bytes become KV tokens in its pool and in each
        mirror alike (each member grows by the same count, so a mirror always has its owner's
        rows)."""
        kv_commit.do()
        resizer = KVResizer(self.scheduler)
        rss_before = process_rss_bytes()
        started = time.perf_counter()
        keep_shard_layers(self.ffn, self.shard.rank, self.shard.degree)
        self._ffn_s = time.perf_counter() - started
        self._layers = None
        self.released_ffn_bytes = self._released_at(self.shard.degree)
        # What the process gave back to the OS, measured (RSS), before the KV takes it.
        self._rss_drop_bytes = rss_before - process_rss_bytes()
        ps, old = self.allocator.page_size, int(self.pool.size)
        new = self.capacity_after_merge(self.shard.degree) // ps * ps
        self.kv.resize(new)
        for q in self.kv.mirrors:
            self.kv.resize(new, owner=q)
        added = torch.arange(old // ps + 1, new // ps + 1, dtype=torch.int64)
        resizer.set_capacity(new, torch.cat((self.allocator.free_pages, added)))

    def _commit_split(self, kv_commit: LastStep, resizer: KVResizer, locked: list,
                      capacity: int | None = None) -> None:
        """After every member has its heads and FFN rows back: the KV layout's commit, SGLang's
        holders of the slots the split compacted pointed at their new places, and the pool's
        capacity (the startup one, or a smaller group's) published with the free list of what
        is not held."""
        kv_commit.do()
        stats = self.kv.last_stats
        resizer.remap_holders(stats.moved_src, stats.moved_dst, locked)
        ps = self.allocator.page_size
        capacity = self.kv_capacity_tokens_whole if capacity is None else capacity
        pages = torch.arange(1, capacity // ps + 1, dtype=torch.int64)
        free = pages[~torch.isin(pages, torch.unique(stats.live_after // ps))]
        resizer.set_capacity(capacity, free)
        self.released_ffn_bytes = self._released_at(len(self.unit))

    def _released_at(self, degree: int) -> int:
        """FFN bytes a member of a group of ``degree`` does not hold."""
        store = self.ffn[0].layout
        return len(self.ffn) * store.rows_bytes(
            store.padded_intermediate - store.padded_intermediate // degree)

    def _gather_ffn(self, into: tuple[tuple[int, ...], ...] | None = None) -> None:
        """The FFN rows each member holds after the split (its shard in its block of ``into``,
        the blocks the group splits into; None: every row, each replica alone) come back from
        the members holding them now: one gloo message per layer, section and peer, received
        straight into the pages they are held in (no staging buffer), all in flight at
        once."""
        started, rss_before = time.perf_counter(), process_rss_bytes()
        link, d, rank = self.member.link, self.shard.degree, self.shard.rank
        layout = self.ffn[0].layout
        into = into or tuple((r,) for r in self.unit)
        rows = [layout.shard_rows(j, d) for j in range(d)]

        def needs(replica: int, j: int) -> bool:
            """Whether ``replica`` holds member ``j``'s rows after the split."""
            (block,) = [b for b in into if replica in b]
            keep = layout.shard_rows(self.cfg.shard_order(block).index(replica), len(block))
            return keep[0] <= rows[j][0] and rows[j][1] <= keep[1]

        sources = [j for j in link.others if needs(self.replica, j)]
        readers = [j for j in link.others if needs(self.order[j], rank)]
        opened = open_rows_layers(self.ffn, [[rows[j] for j in sources]] * len(self.ffn))
        try:
            works = []
            for layer, (store, o) in enumerate(zip(self.ffn, opened)):
                mine, place = store.payload(rank, d), dict(zip(o.ranges, o.targets))
                for section in range(SECTIONS):
                    tag = layer * SECTIONS + section
                    works += [link.control.send([mine[section]], j, tag) for j in readers]
                    works += [link.control.recv([place[rows[j]][section]], j, tag)
                              for j in sources]
            for work in works:
                work.wait(_ALL_REDUCE_TIMEOUT)
            self.faults.check("ffn_gather")
        except BaseException:
            for o in opened:
                o.abort()
            raise
        for o in opened:
            o.commit()
        # What the process took back from the OS (RSS) for the rows received.
        self._rss_rise_bytes = process_rss_bytes() - rss_before
        self._layers = None
        self.released_ffn_bytes = self._released_at(
            len(next(b for b in into if self.replica in b)))
        self._ffn_s = time.perf_counter() - started

    def _release_ffn_again(self) -> None:
        """Undo of the gather: back to this member's shard in the group it is in."""
        rows = self.ffn[0].layout.shard_rows(self.shard.rank, self.shard.degree)
        if any(store.resident_rows != rows for store in self.ffn):
            keep_shard_layers(self.ffn, self.shard.rank, self.shard.degree)
            self._layers = None
        self.released_ffn_bytes = self._released_at(self.shard.degree)

    # ---- the merged forward ----

    def forward_merged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: Any, input_embeds: Any = None,
                       pp_proxy_tensors: Any = None) -> torch.Tensor:
        """``LlamaModel.forward`` of this replica's batch in its group (scheduler thread,
        compute lock held): batched, the batch is posted to the group's leader and its rows
        come from this member's share of the step; per owner, the batch goes to every other
        member, this member runs its share, then each member's answer says it finished."""
        if input_embeds is not None or pp_proxy_tensors is not None:
            raise NotImplementedError("a merged group runs token batches on one stage")
        member = self.member
        batch = Batch.from_forward_batch(forward_batch,
                                         self.scheduler.req_to_token_pool.req_to_token,
                                         input_ids, positions)
        if self.cfg.merged_forward == "batched":
            hidden = self._post(member, batch)
        else:
            rank = member.link.rank
            for other in member.link.others:
                member.call(other, batch.tensors())
            hidden = self._run_step(self.unit, rank, [(rank, batch)])
            for other in member.link.others:
                member.answer(other)
        self._count_batches(1, 0)
        return hidden

    def _post(self, member: GroupMember, batch: Batch) -> torch.Tensor:
        """This replica's batch through the group's next step: its final-normed rows."""
        self._pending = pending = Pending()
        try:
            if member.link.rank == _LEADER:
                self._steps[self.unit].post(_LEADER, batch)
            else:
                member.call(_LEADER, batch.tensors(), post=1)
            hidden = pending.wait(self.lock, _ALL_REDUCE_TIMEOUT.total_seconds())
        finally:
            self._pending = None
        if member.link.rank != _LEADER:
            member.answer(_LEADER)  # the leader's receipt of the post, long arrived
        return hidden

    def _lead(self, block: tuple[int, ...]) -> None:
        """The leader's step thread of ``block`` (runs as long as the process): each step of
        the posted batches goes to every other member, then this member runs its share and
        reads every member's answer."""
        member, queue = self.members[block], self._steps[block]
        group = _block_name(block)
        while True:
            step = queue.take()
            if self._metrics is not None:
                self._metrics.steps_led(group).inc()
                self._metrics.step_batches(group).inc(len(step))
            tensors, ints = step_message(step)
            try:
                with self.lock, torch.no_grad():
                    for other in member.link.others:
                        member.call(other, tensors, **ints)
                    failed = []
                    try:
                        self._run_batched_step(block, member.link.rank, step)
                    finally:
                        for other in member.link.others:
                            try:
                                member.answer(other)
                            except RuntimeError as e:
                                failed.append(str(e))
                    if failed:
                        raise RuntimeError("; ".join(failed))
            except Exception:
                logger.exception("sglang-morph: AMOEBAs group %s could not run a step of "
                                 "%d batches", list(block), len(step))

    def _run_step(self, block: tuple[int, ...], caller: int, step: list
                  ) -> torch.Tensor | None:
        """This member's share of ``step`` (its owners' batches, all-reduced on ``caller``'s
        call group; compute lock held): the final-normed rows of this member's own batch when
        it is one of the parts, else None. Per owner, a step is one owner's batch."""
        if self.unit != block:
            raise RuntimeError(f"a step of group {list(block)} reached replica {self.replica} "
                               f"serving in {list(self.unit)}")
        mine = [i for i, (owner, _) in enumerate(step) if owner == self.shard.rank]
        parts = [Part(batch, *self.kv_views(self.order[owner])) for owner, batch in step]
        hidden = forward(self.model, self._shard_layers(), self.shard, self.head_dim, parts,
                         self._all_reduce(self.members[block].link.calls[caller]),
                         final_norm=bool(mine))
        self._count_batches(0, len(step) - len(mine))
        if not mine:
            return None
        start = sum(p.tokens for p in parts[:mine[0]])
        return hidden[start:start + parts[mine[0]].tokens]

    def _run_batched_step(self, block: tuple[int, ...], caller: int, step: list) -> None:
        """``_run_step`` of a batched step: this member's own rows, or why there are none, go
        to its scheduler thread waiting in ``_post``."""
        own = self.shard is not None and any(owner == self.shard.rank for owner, _ in step)
        try:
            rows = self._run_step(block, caller, step)
        except Exception as e:
            if own and self._pending is not None:
                self._pending.fail(f"replica {self.replica} could not run its share of a "
                                   f"merged step: {e}")
            raise
        if rows is not None:
            self._pending.set(rows)

    def _run_for(self, block: tuple[int, ...], caller: int, tensors: dict[str, torch.Tensor],
                 ints: dict[str, int]) -> dict[str, torch.Tensor]:
        """Member ``caller``'s call (service thread, compute lock held): on the leader, an
        owner's batch posted for the next step; a batched step from the leader; or (per
        owner) the caller's batch. Runs this member's share."""
        if ints.get("post"):
            self._steps[block].post(caller, Batch.from_tensors(tensors))
        elif "parts" in ints:
            self._run_batched_step(block, caller, step_from_message(tensors, ints))
        else:
            self._run_step(block, caller, [(caller, Batch.from_tensors(tensors))])
        return {}

    def _shard_layers(self) -> list:
        """``forward.LayerShard`` per layer: views of the model's attention weights and of the
        FFN stores' rows of this member's shard, taken once the stores hold that shard."""
        if self._layers is None:
            self._layers = layer_shards(self.model, self.shard, self.head_dim, ffn=self.ffn)
        return self._layers

    def _all_reduce(self, pg: Any):
        def all_reduce(t: torch.Tensor) -> None:
            work = pg.allreduce([t])
            self.lock.release()  # another member's share may run here meanwhile
            try:
                work.wait(_ALL_REDUCE_TIMEOUT)
            finally:
                self.lock.acquire()
        return all_reduce


def _block_name(block: tuple[int, ...]) -> str:
    """A group's name in the status, the metrics and thread names: ``0-1-2``."""
    return "-".join(map(str, block))


class _Metrics(MemberMetrics):
    """AMOEBAs' series of one replica (``sglang_morph_amoebas_*``, labelled with it)."""

    def __init__(self, replica: int):
        super().__init__("amoebas", replica)
        self.kv_capacity_tokens = self.gauge("kv_capacity_tokens",
                                             "Own KV pool capacity in tokens")
        self.released_ffn_bytes = self.gauge("released_ffn_bytes",
                                             "FFN weight bytes released in place (merged)")
        self.transitions = self.counter("transitions", "AMOEBAs transitions applied", "action")
        self.merged_batches = self.counter(
            "merged_batches", "Batches run in a merged group: this replica's own and the "
            "other members'", "whose")
        self.steps_led = self.counter("steps_led", "Batched merged steps this replica ran "
                                      "as its group's leader", "group")
        self.step_batches = self.counter("step_batches", "Members' batches in the steps this "
                                         "replica led (per step: their mean)", "group")
