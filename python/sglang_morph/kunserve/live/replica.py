"""One data-parallel replica's side of a live KunServe group (``--enable-kunserve --dp-size N``,
N even: by default replicas ``2i`` and ``2i + 1`` form pair ``i``, each pair with its own link,
drops and restores; below, "replica 0" and "replica 1" are a pair's first and second member;
larger groups at the end of this docstring).

Design (symmetric group): SGLang has no way to move a request between schedulers, so each
replica keeps its scheduler, its requests and its own KV slot numbers. After a drop, replica 0
keeps decoder layers ``[0, k)`` and replica 1 ``[k, L)`` (``planner.split_layers``); each
forward of either replica runs the front range on replica 0 and the back range on replica 1,
so a batch is served by the pipeline of the two. Where a replica's own batch needs the peer's
layers it sends the batch (hidden states, positions, slot numbers, lengths) over the gloo link
and waits; the peer's *service thread* runs its kept layers on it and sends back the hidden
states (the front range returns the PP hand-off tensors, the back range the final-normed
output). Sampling stays with the replica that owns the request.

KV: replica ``r``'s own pool keeps only the layers it holds, at its own slot numbers; the
peer's KV for those layers lives in a *mirror* pool on ``r`` at the peer's slot numbers, so no
slot is ever allocated across processes (the peer's allocator decides, the mirror follows).
Bytes: replica ``r`` holds its kept weights + (own tokens + peer tokens) x kept layers of KV,
which is the planner's member layout (``planner.make_group``) with the group's capacity split
evenly: each replica's pool gets half the group's tokens, in whole pages. The dropped weights
stay in a host copy (this is a CPU server: the same memory, released from the budget; on a GPU
they would be copied out), so the restore is local.

Concurrency (the group member's, ``groups/member.py``): the layers run under one lock per
process (``compute_lock``): the scheduler thread holds it through ``ModelRunner.forward``
except while it waits for the peer, and the service thread takes it to run a peer batch;
waiting never holds it, so two replicas calling each other at once cannot deadlock. The back
member (replica 1) sends its batch to the front's layers before its forward takes the lock
(``send_ahead``), so that the front runs it while replica 1's core still runs the front's
previous batch: the two replicas' steps overlap as a two-stage pipeline of two micro-batches
instead of running in series.

Groups of more than two (``--kunserve-group-size G``, replicas ``G*i`` to ``G*i + G - 1`` on
one link): a drop merges any two or more of the link's members (the whole link unless the
request names fewer), and disjoint merges of one link may stand at once (``[0, 1]`` and
``[2, 3]``). In a merged group of ``m``, its ``j``-th member keeps the ``j``-th of the planner's
``m`` layer ranges and a mirror per other member; a forward of three or more runs the ranges
in stage order, this replica's own here and each other's by that member's service thread
(``_forward_stages``), without send-ahead, a prefill long enough to cut as a wavefront of
micro-batches through the stages (``_stages_micro``); a merged pair runs as above. A KV move
walks the group's pairs of members in one order, exchanging with each the KV of its layers.
Every member of the link enters every transition of the link, in one order (the votes and
phase outcomes travel on the link's control group); those outside the merging group stand
by.

Transitions (drop, restore): both schedulers handle the same request between two batches (the
data-parallel controller sends it to each) and run it as a voted transition of the group
(``groups/transition.py``): they vote, then (1) move KV between the replicas (a drop gives the
peer our KV of the layers we drop, into its mirror; a restore takes it back from the peer's
mirror), one layer's K and V per message, only the rows their allocators have handed out
(requests' and the radix cache's), and (2) change their own pool and weights; after
each phase they exchange outcomes and both undo the phases so far when either failed, so a
transition happens on both replicas or on neither (a restore's final shrink is local, checked
in the vote, and not undone). Requests in flight keep running across both: their KV (and the
radix cache's) moves with the layers, nothing is recomputed. A restore shrinks the pool with
the morph resizer, which moves live KV below the new boundary in every layer; it is refused
(409) while a replica holds more tokens than a whole replica can. Unlike KunServe's
overlapped exchange (an activation transfer before each KV chunk while serving continues),
both replicas pause for the whole move (measured in the transitions log, ``duration_s``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import types
from typing import Any

import torch

from sglang_morph.faults import FaultInjector
from sglang_morph.elastic.kv_resizer import (
    KVResizer,
    allocated_rows,
    held_kv_tokens,
    set_pool_buffers,
)
from sglang_morph.kunserve.live.attention import new_rows_backend
from sglang_morph.kunserve.live.config import groups as groups_of_launch
from sglang_morph.kunserve.live.forward_timings import batch_chunks
from sglang_morph.kunserve.live.link import PeerLink
from sglang_morph.kunserve.controller import StepCostMeter
from sglang_morph.kunserve.cost import Chunk, OnlineChunkCost, balanced_bounds
from sglang_morph.kunserve.planner import (
    DropPlannerConfig,
    MemberLayout,
    ReplicaGroup,
    make_group,
)
from sglang_morph.elastic.contract import Outcome, Transition
from sglang_morph.elastic.control import replica_index
from sglang_morph.groups.member import GroupMember, MemberMetrics
from sglang_morph.groups.transition import GroupTransitions, LastStep, Phase, VotedTransition

logger = logging.getLogger("sglang_morph.kunserve")

_OK, _BAD, _REFUSED, _FAILED = 200, 400, 409, 500
# Tests only: the replica whose KV resizes the morph fault points (SGLANG_MORPH_FAULT) fail, so
# that one replica of the pair fails a transition the other completed.
FAULT_REPLICA_ENV = "SGLANG_KUNSERVE_FAULT_REPLICA"


class KunServeReplica(GroupMember):
    """``rank``: this replica's place in its pair (0: the front member, 1: the back);
    ``replica``: its data-parallel index.

    Invariants (``check_integrity``): whole, the replica holds every layer's weights and a
    pool of all ``L`` layers with ``kv_capacity_tokens_whole`` tokens, and no mirror; merged,
    it holds the weights of ``member.layers`` only, a pool of exactly those layers with
    ``kv_capacity_tokens_merged`` tokens, and a mirror pool of the same layers sized to the
    peer's capacity; the KV of both plus the kept weights fit the planner's budget; the
    service thread answering the peer is alive; with ``merged_chunked_prefill``, the
    scheduler's chunking is that chunk, mixed, while merged and as launched while whole."""

    def __init__(self, scheduler: Any, cfg: Any):
        """``cfg``: the launch's ``KunServeLiveConfig`` (its link port, automatic control,
        micro-batches and what changes in the scheduler while merged)."""
        from sglang_morph.models.memory import MemoryModel
        from sglang_morph.models.spec import ModelSpec

        runner = scheduler.tp_worker.model_runner
        model = runner.model
        hf_config = runner.model_config.hf_config
        if not hasattr(model, "model") or not hasattr(model.model, "layers"):
            raise NotImplementedError(f"{type(model).__name__} is not a Llama-style model")
        if not getattr(hf_config, "tie_word_embeddings", False):
            # The front member samples its own requests with the LM head, which the planner
            # counts on the back member only; a tied head is the embedding both keep.
            raise NotImplementedError("KunServe live needs tied word embeddings")
        self.scheduler, self.runner, self.model = scheduler, runner, model.model
        replica = replica_index()
        # Groups are consecutive replicas, in stage order: the first is the front member (and,
        # in a pair, the leader).
        size = cfg.group_size
        self.rank = replica % size
        members = tuple(range(replica - self.rank, replica - self.rank + size))
        self.groups = groups_of_launch(scheduler.server_args)
        self.allocator = scheduler.token_to_kv_pool_allocator
        self.pool = self.allocator.get_kvcache()
        self.page_size = self.allocator.page_size
        self.num_layers = len(self.model.layers)
        spec = ModelSpec.from_hf_config(hf_config.to_dict(), dtype_bytes=runner.dtype.itemsize)
        kv_per_layer = (self.pool.k_buffer[0][0].numel() * self.pool.k_buffer[0].element_size()
                        + self.pool.v_buffer[0][0].numel() * self.pool.v_buffer[0].element_size())
        if kv_per_layer != spec.kv_bytes_per_token_per_layer():
            raise NotImplementedError(f"KV bytes per token and layer {kv_per_layer} differ "
                                      f"from the model's {spec.kv_bytes_per_token_per_layer()}")
        self.kv_capacity_tokens_whole = self.pool.size
        memory = MemoryModel.from_spec(spec, bits=(16,))
        weights = memory.model_weight_bytes((16,) * self.num_layers)
        # The replica's budget is what SGLang gave it at startup: the whole model and its pool.
        self.planner = DropPlannerConfig(
            memory, weights + self.pool.size * self.num_layers * kv_per_layer,
            page_size_tokens=self.page_size, max_group_size=size,
            # Each replica embeds and samples its own requests (the tied head), whatever its
            # stage.
            members_keep_embedding=True)
        if self.planner.full_replica().kv_capacity_tokens != self.pool.size:
            raise NotImplementedError("the planner's whole-replica capacity "
                                      f"{self.planner.full_replica().kv_capacity_tokens} is not "
                                      f"the pool's {self.pool.size} tokens")
        self._link_replicas = members
        # Members whose cut prefill is running through this replica's layers (service
        # threads add and remove them; the scheduler thread waits on the condition before
        # its forwards while merged: a merged prefill goes first).
        self._prefilling_peers: set[int] = set()
        self._peer_prefill_done = threading.Condition()
        self._whole_link = tuple(range(size))
        self.group: ReplicaGroup
        self.member: MemberLayout
        self.active: tuple[int, ...] = ()
        self._use_layout(self._whole_link)
        self.merged = False
        # Applied transitions of the link, this replica's own and those it stood by for
        # (the automatic control dates views by it).
        self.epoch = 0
        # Merged: every other member's KV of our kept layers, at that member's slot numbers
        # (member rank -> _Mirror); whole: none.
        self.mirrors: dict[int, _Mirror] = {}
        # Whole, the tokens the pool still has to give back after a restore whose shrink
        # failed (retried between batches, ``on_step``); 0 otherwise.
        self.shrink_pending_tokens = 0
        self.shrink_retries = 0
        self._shrink_retry_at_s = 0.0
        self._host_weights: dict[int, torch.Tensor] = {}  # id(param) -> data while dropped
        self.dropped_weight_bytes = 0
        self.transitions: list[dict[str, Any]] = []
        self.last_transition: Transition | None = None  # the last one, as the core recorded it
        # What a transition in progress keeps to undo itself or to report.
        self._whole_layers = self._merged_layers = self._merged_mirror = None
        self._moved_bytes = self._in_flight = 0
        # ``(_batch_key, its micro-batches or [])`` of a batch the back member sent ahead of
        # its forward (send_ahead), until forward_merged takes the answer.
        self._early: tuple | None = None
        self.batches_sent_ahead = 0
        self.batches_held = 0  # own forwards held back for another member's cut prefill
        self.micro_batches = cfg.micro_batches  # --kunserve-micro-batches
        self.merged_priority = cfg.merged_priority  # --kunserve-merged-priority
        # --kunserve-micro-batch-cuts cost: this replica's own micro-batches, timed stage by
        # stage, fit the chunk cost model its later prefills are cut by.
        self.cut_costs = OnlineChunkCost() if cfg.micro_batch_cuts == "cost" else None
        # Its whole forwards' prefill tokens per decode step: what the controller's pay rule
        # weighs with when set to "measured", shown in /kunserve/status's load either way.
        self.step_costs = StepCostMeter()
        # --kunserve-merged-max-running: admission control while merged (None: SGLang's own
        # cap only). Whole, the replica admits up to SGLang's per-batch request cap as launched.
        self.merged_max_running = cfg.merged_max_running
        self._whole_max_running = whole = _running_cap()
        if self.merged_max_running is not None and not 1 <= self.merged_max_running <= whole:
            from sglang_morph.kunserve.live.config import KunServeConfigError

            raise KunServeConfigError(
                f"--kunserve-merged-max-running must be in [1, {whole}] (the "
                f"replica's running-request cap), got {self.merged_max_running}")
        # --kunserve-merged-chunked-prefill: SGLang's mixed chunked prefill while merged (None:
        # the scheduler's chunking as launched, in both states).
        self.merged_chunked_prefill = cfg.merged_chunked_prefill
        # --kunserve-merged-prefill-gap-steps: admission pacing while merged (None: off). The
        # own decode steps since this replica's last prefill (merged forwards only), the cap
        # pacing holds now (None: not holding) and the steps it held a prefill back.
        self.merged_prefill_gap_steps = cfg.merged_prefill_gap_steps
        self.decodes_since_prefill = 0
        self.paced_cap: int | None = None
        self.prefills_paced = 0
        self._whole_chunking = (scheduler.chunked_prefill_size, scheduler.is_mixed_chunk)
        self.batches_mixed = 0  # own merged batches that carried a prefill and decodes
        self.batches_micro = 0  # own extend batches run as a pipeline of micro-batches
        # The micro-batches' own layers attend over this replica's pools, new rows only.
        self._micro_backend = new_rows_backend(runner.device, scheduler.req_to_token_pool,
                                               self.pool)
        self.faults = FaultInjector()
        if os.environ.get(FAULT_REPLICA_ENV) == str(replica):
            self.faults.arm_from_env()
        self._metrics = _Metrics(replica) if MemberMetrics.enabled(scheduler) else None
        self._publish_metrics()
        super().__init__(scheduler, PeerLink(self.rank, cfg.group_port(replica // size),
                                             replicas=members),
                         "kunserve", lambda: int(self.pool.size))
        # A transition of other members of the link: this replica votes and waits with them
        # (every member enters every transition of its link, in one order), changes nothing
        # and records nothing.
        self._standing_by = GroupTransitions(self.link.all_gather, self.rank, members,
                                             "kunserve", None, lambda: int(self.pool.size))
        self.auto = None  # --kunserve-auto: the controller's side (auto.py)
        if cfg.auto is not None:
            from sglang_morph.kunserve.live.auto import AutoControl

            self.auto = AutoControl(self, cfg.auto)
        runner.kunserve = self
        self.model.kunserve = self
        self.start_services(self._run_for_peer)

    # ---- what this replica keeps ----

    def _use_layout(self, ranks: tuple[int, ...]) -> None:
        """The layout of a drop of the link's members ``ranks`` (in stage order, this replica
        among them): the planner's group of those replicas, this member's stage of it and its
        share of the group's tokens (its own requests), whole pages. Whole, a replica keeps
        the layout of its whole link's drop."""
        self.active = tuple(ranks)
        with self._peer_prefill_done:  # a new layout: no member's prefill is in flight
            self._prefilling_peers.clear()
            self._peer_prefill_done.notify_all()
        self.group = make_group(self.planner, [self._link_replicas[r] for r in ranks])
        self.member = self.group.members[self.active.index(self.rank)]
        share = self.group.capacity_tokens // len(ranks)
        self.kv_capacity_tokens_merged = share // self.page_size * self.page_size

    def _layout_of(self, rank: int) -> MemberLayout:
        """Member ``rank``'s stage in the current group."""
        return self.group.members[self.active.index(rank)]

    @property
    def subgroup(self) -> list[int]:
        """The replicas this one serves with now (itself alone while whole)."""
        # (by the link's members, not ``self.replica``: metrics publish before the link is up)
        return [self._link_replicas[r] for r in (self.active if self.merged else (self.rank,))]

    @property
    def _peer(self) -> int:
        """The other member of a merged pair."""
        if len(self.active) != 2:
            raise RuntimeError(f"a group of {len(self.active)} has no single peer")
        return self.active[1 - self.active.index(self.rank)]

    @property
    def front(self) -> bool:
        return self.member.layers.start == 0

    @property
    def dropped_layers(self) -> list[int]:
        """The decoder layers the peer holds in a merged group, in order."""
        return [i for i in range(self.num_layers) if i not in self.member.layers]

    @property
    def last(self) -> bool:
        return self.member.layers.stop == self.num_layers

    @property
    def mirror_tokens(self) -> int:
        """The mirrors' capacity, all other members' together (0 whole)."""
        return sum(int(m.pool.size) for m in self.mirrors.values())

    @property
    def mirror_pool_bytes(self) -> int:
        """The mirrors' buffers, padding pages included (0 whole)."""
        return sum(int(sum(m.pool.get_kv_size_bytes())) for m in self.mirrors.values())

    def _dropped_modules(self) -> list[torch.nn.Module]:
        out = [self.model.layers[i] for i in self.dropped_layers]
        if not self.last:
            out.append(self.model.norm)  # the last member normalizes the group's output
        return out

    # ---- status ----

    def status(self) -> dict[str, Any]:
        from sglang_morph.kunserve.live.auto import local_view

        layers = self.member.layers if self.merged else range(self.num_layers)
        own = int(self.pool.size)
        used = held_kv_tokens(self.scheduler)
        peer = self.mirror_tokens
        pool_bytes = int(sum(self.pool.get_kv_size_bytes())) + self.mirror_pool_bytes
        kv_bytes_per_token = len(layers) * self.planner.kv_bytes_per_token_per_layer
        return {
            **self.group_status(self.subgroup),
            "layers": [layers.start, layers.stop],
            "num_layers": self.num_layers,
            "kv_capacity_tokens": own,
            "kv_used_tokens": used,
            "peer_kv_capacity_tokens": peer,
            "kv_capacity_tokens_whole": int(self.kv_capacity_tokens_whole),
            "kv_capacity_tokens_merged": int(self.kv_capacity_tokens_merged),
            # A restore's pool shrink still to do (it failed and is retried between batches)
            "kv_shrink_pending_tokens": self.shrink_pending_tokens,
            "kv_shrink_retries": self.shrink_retries,
            # The budget's KV (tokens x bytes, as the planner and MemoryBudget count it) and the
            # pools' bytes, which also hold SGLang's padding page per layer.
            "kv_bytes": (own + peer) * kv_bytes_per_token,
            "kv_pool_bytes": pool_bytes,
            "budget_bytes": int(self.planner.budget_bytes),
            "weight_bytes": int(self.member.budget.weight_bytes if self.merged
                                else self.planner.full_weight_bytes),
            "planned_freed_bytes": int(self.member.freed_bytes),
            "dropped_weight_bytes": self.dropped_weight_bytes,
            # Batches of this (back) member that went to the front's layers before its forward
            # took the compute lock (send_ahead); the front member's stay 0.
            "batches_sent_ahead": self.batches_sent_ahead,
            "batches_held": self.batches_held,
            "batches_micro": self.batches_micro,
            # The cost model micro-batches are cut by (None: equal tokens), and how many
            # micro-batch stage timings it has seen.
            "micro_batch_cost": (dataclasses.asdict(self.cut_costs.model)
                                 if self.cut_costs is not None and self.cut_costs.model
                                 else None),
            "micro_batch_timings": self.cut_costs.observed if self.cut_costs else 0,
            # Requests SGLang lets this replica run at once now, and the cap while merged.
            "max_running_requests": _running_cap(),
            "merged_max_running_requests": self.merged_max_running,
            # Admission pacing while merged: the decode steps between two prefills, and the
            # steps a prefill waited for them.
            "merged_prefill_gap_steps": self.merged_prefill_gap_steps,
            "prefills_paced": self.prefills_paced,
            # The prefill chunk in tokens now (None: unchunked) and whether decodes ride in
            # its steps; the chunk set while merged; merged batches that mixed the two.
            "chunked_prefill_size": self.scheduler.chunked_prefill_size,
            "mixed_chunk": bool(self.scheduler.is_mixed_chunk),
            "merged_chunked_prefill_tokens": self.merged_chunked_prefill,
            "merged_priority": self.merged_priority,
            "batches_mixed": self.batches_mixed,
            # What the automatic control sees of this replica (also without it): held KV,
            # the remaining outputs of its running requests, its queue.
            "load": {k: v for k, v in (
                local_view(self, self.auto.cfg.controller.finishing_steps, self.auto.arrivals)
                if self.auto is not None else local_view(self)).items()
                if k not in ("epoch", "group")},
            "auto": self.auto.status() if self.auto is not None else {"enabled": False},
            "transitions": list(self.transitions),
        }

    def _publish_metrics(self, action: str | None = None) -> None:
        if self._metrics is None:
            return
        m = self._metrics
        m.group_size.set(len(self.subgroup))
        m.layers_held.set(len(self.member.layers) if self.merged else self.num_layers)
        m.kv_capacity_tokens.set(self.pool.size)
        m.peer_kv_capacity_tokens.set(self.mirror_tokens)
        if action is not None:
            m.transitions(action).inc()

    def check_integrity(self) -> None:
        layers = self.member.layers if self.merged else range(self.num_layers)
        assert (self.pool.start_layer, self.pool.layer_num) == (layers.start, len(layers)), (
            f"pool layers from {self.pool.start_layer}, {self.pool.layer_num} of them; "
            f"expected {layers}")
        want = (self.kv_capacity_tokens_merged if self.merged
                else self.kv_capacity_tokens_whole + self.shrink_pending_tokens)
        assert self.pool.size == want, f"pool {self.pool.size} tokens, expected {want}"
        assert not (self.merged and self.shrink_pending_tokens), "a shrink pending while merged"
        want_mirrors = set(self.active) - {self.rank} if self.merged else set()
        assert set(self.mirrors) == want_mirrors, (
            f"mirrors for members {sorted(self.mirrors)}, expected {sorted(want_mirrors)}")
        if self.merged_chunked_prefill is not None:
            chunking = (self.scheduler.chunked_prefill_size, self.scheduler.is_mixed_chunk)
            want_chunking = ((self.merged_chunked_prefill, True) if self.merged
                             else self._whole_chunking)
            assert chunking == want_chunking, f"chunking {chunking}, expected {want_chunking}"
        KVResizer(self.scheduler).check_integrity()
        super().check_integrity()
        if self.merged:
            kv = sum(self.pool.get_kv_size_bytes()) + self.mirror_pool_bytes
            rows_kv = (self.pool.size + self.mirror_tokens) * self.member.kv_bytes_per_token
            # Each pool carries one padding page per layer beyond its tokens.
            padding = len(self.active) * self.page_size * self.member.kv_bytes_per_token
            assert kv <= rows_kv + padding and rows_kv <= self.member.budget.kv_bytes, (
                f"KV {kv} bytes for {rows_kv} of tokens, budget's KV {self.member.budget.kv_bytes}")

    # ---- control requests (scheduler thread) ----

    def handle_control(self, req: Any) -> Any:
        from sglang_morph.kunserve.live.messages import KunServeDropReq, KunServeRestoreReq
        from sglang_morph.elastic.control import ControlOutput

        code, body = _OK, None
        if isinstance(req, (KunServeDropReq, KunServeRestoreReq)):
            error = self._group_error(req.group)
            if error is not None:
                code, body = _BAD, {"error": error, "replica": self.replica}
            elif req.group is None or set(req.group) <= set(self._link_replicas):
                # Every member of the link enters: the named ones change, the others stand by.
                code, body = self.transition(merge=isinstance(req, KunServeDropReq),
                                             group=req.group)
            # else: another link's transition; this one answers its status
        return ControlOutput(rid=req.rid, status_code=code,
                             body=self.status() if body is None else body, replica=self.replica)

    def _group_error(self, group: list[int] | None) -> str | None:
        """Why a transition request cannot name ``group`` (None: it names a pair of this
        launch, or two or more replicas of one of its groups, or nothing on a launch of one
        group). Every replica finds the same."""
        size = self.link.size
        groups = [list(range(size * i, size * i + size)) for i in range(self.groups)]
        noun = "pair" if size == 2 else "group"
        if group is None:
            return None if self.groups == 1 else (
                f"name the {noun} to change, e.g. {{\"group\": {groups[0]}}}: the {noun}s are "
                f"{groups}")
        if size == 2:
            if len(group) != 2:
                return f"'group' must name a pair of replicas, got {list(group)}"
            if list(group) not in groups:
                return f"no pair {list(group)}: the pairs are {groups}"
            return None
        if not 2 <= len(group) <= size or len(set(group)) != len(group):
            return (f"'group' must name 2 to {size} distinct replicas of one group, got "
                    f"{list(group)}")
        if not any(set(group) <= set(g) for g in groups):
            return f"no group holds {list(group)}: the groups are {groups}"
        return None

    def transition(self, merge: bool, trigger: str = "operator", reason: str | None = None,
                   group: list[int] | tuple[int, ...] | None = None
                   ) -> tuple[int, dict[str, Any]]:
        """Every member of the link, in their schedulers' handlers of the same request (a
        POST, or the automatic control's proposal: ``trigger`` "auto" and the controller's
        ``reason``, both logged), between batches: a voted transition of the link
        (``groups/transition.py``). ``group``: the replicas that drop or restore together (in
        order, at least two of the link; None: the whole link); the link's other members
        stand by (they vote, change nothing and record nothing), so that every member enters
        every transition of its link in one order. The group's members record it in the
        elastic core's log whatever its outcome.
        A drop's phases are the KV move (undone by discarding what it built) and the local
        drop; a restore's is the KV move back, then each replica shrinks its pool alone."""
        ranks = (self._whole_link if group is None
                 else tuple(self._link_replicas.index(r) for r in group))
        if self.rank not in ranks:
            return self._stand_by(merge, trigger, reason)
        action = "drop" if merge else "restore"
        refusal = self._refusal(merge, ranks)
        if merge and refusal is None:
            self._use_layout(ranks)
        if merge:
            phases = (Phase("the KV move", self._merge_move_kv, self._discard_mirror),
                      Phase("the layer drop", self._merge_local, self._unmerge_local))
            last = None
        else:
            phases = (Phase("the KV move back", self._split_move_kv, self._unsplit),)
            # Checked by _refusal: nothing the peer could need to undo. A shrink that fails
            # anyway is deferred (_split_local), so the step itself does not fail.
            last = LastStep(self._split_local,
                            "every layer is back but the pool kept its merged size")
        self._in_flight = len(self.live_requests())
        before = int(self.pool.size)
        record = self.group_transitions.run(
            VotedTransition(action, reason or trigger, refusal, phases, last,
                            detail={"trigger": trigger,
                                    "group": [self._link_replicas[r] for r in ranks]},
                            exclusive=self.compute_lock),
            applied=lambda seconds: self._applied(action, trigger, reason, before, seconds))
        if not self.merged:  # refused, undone or restored: whole, as the link's drop plans it
            self._use_layout(self._whole_link)
        return self._answer_for(record)

    def _stand_by(self, merge: bool, trigger: str, reason: str | None
                  ) -> tuple[int, dict[str, Any]]:
        """The transition of other members of the link, from this one: its vote (none), each
        phase's outcome exchange (nothing to do here), the outcome."""
        def nothing() -> None:
            pass

        names = (("the KV move", "the layer drop") if merge else ("the KV move back",))
        record = self._standing_by.run(VotedTransition(
            "drop" if merge else "restore", reason or trigger, None,
            tuple(Phase(name, nothing, nothing) for name in names),
            exclusive=self.compute_lock))
        return self._answer_for(record)

    def _answer_for(self, record: Transition) -> tuple[int, dict[str, Any]]:
        self.last_transition = record
        if record.outcome is Outcome.APPLIED:
            self.epoch += 1
            return _OK, self.status()
        code = _REFUSED if record.outcome is Outcome.REFUSED else _FAILED
        return code, {"error": record.error, "replica": self.replica}

    def _applied(self, action: str, trigger: str, reason: str | None, before: int,
                 seconds: float) -> dict[str, Any]:
        """After a transition applied on both replicas: this replica's record of it."""
        self.check_integrity()
        merge = action == "drop"
        self.transitions.append({
            "action": action, "trigger": trigger, "reason": reason,
            "group": [self._link_replicas[r] for r in self.active],
            "at_unix_s": round(time.time(), 3),
            "duration_s": round(seconds, 4),
            "layers": [self.member.layers.start, self.member.layers.stop] if merge
            else [0, self.num_layers],
            "kv_capacity_tokens": [before, int(self.pool.size)],
            "kv_shrink_pending_tokens": self.shrink_pending_tokens,
            "kv_moved_bytes": self._moved_bytes,
            "requests_in_flight": self._in_flight,
            "dropped_weight_bytes": self.dropped_weight_bytes,
            # Where this replica's time went: the vote, each phase and the waits for the
            # others' (groups/transition.py).
            "step_seconds": {k: round(v, 4)
                             for k, v in self.group_transitions.step_seconds.items()}})
        logger.info("sglang-morph: KunServe %s on replica %d: %s", action, self.replica,
                    self.transitions[-1])
        self._publish_metrics(action)
        return self.transitions[-1]

    def elastic_state(self) -> dict[str, Any]:
        """What ``/elastic/status`` shows of this replica (``/kunserve/status`` has the rest)."""
        layers = self.member.layers if self.merged else range(self.num_layers)
        return {"group": self.subgroup,
                "layers": [layers.start, layers.stop], "kv_capacity_tokens": int(self.pool.size),
                "peer_kv_capacity_tokens": self.mirror_tokens, "auto": self.auto is not None}

    def _refusal(self, merge: bool, ranks: tuple[int, ...]) -> str | None:
        """This member's vote on a drop or restore of the link's members ``ranks``."""
        if merge and self.shrink_pending_tokens:
            return (f"replica {self.replica} has not given back {self.shrink_pending_tokens} "
                    f"KV tokens of its last restore yet (its pool shrink is retried between "
                    f"batches)")
        if merge == self.merged:
            others = [r for r in self.subgroup if r != self.replica]
            return (f"replica {self.replica} is already merged with "
                    + (f"replica {others[0]}" if len(others) == 1 else f"replicas {others}")
                    if merge else f"replica {self.replica} is not merged")
        if not merge and ranks != self.active:
            return (f"replica {self.replica} is merged with replicas {self.subgroup}, not "
                    f"{[self._link_replicas[r] for r in ranks]}")
        if not merge:
            resizer = KVResizer(self.scheduler)
            if not resizer.can_shrink(self.pool.size - self.kv_capacity_tokens_whole):
                return (f"replica {self.replica} holds {resizer.held_tokens} KV tokens in flight, "
                        f"more than a whole replica's {self.kv_capacity_tokens_whole}: the "
                        f"restore waits until fewer are held")
        return None

    def _in_turn(self, other: int, send, recv) -> None:
        """Of two members, the earlier stage sends first, so two large sends never wait on
        each other."""
        for step in ((send, recv) if self.rank < other else (recv, send)):
            step()

    def _others_in_turn(self) -> list[int]:
        """The other members in the order this member exchanges with them: every member walks
        the group's pairs of members in one order ((0, 1), (0, 2), ..., (1, 2), ...), taking
        those it is in, so the earliest pair not yet done always has both members ready (no
        member waits on one that waits on it)."""
        return [b if a == self.rank else a
                for a, b in itertools.combinations(self.active, 2)
                if self.rank in (a, b)]

    def _rows_with(self, other: int, ours: torch.Tensor) -> torch.Tensor:
        """Member ``other``'s allocated rows for ours: the KV rows either pool must carry,
        exchanged first so that a KV move sends only those."""
        theirs = []

        def send() -> None:
            self.link.send_to(self.link.control, other, {"rows": ours})

        def recv() -> None:
            got, _ = self.link.recv_from(self.link.control, other)
            theirs.append(got["rows"].long())

        self._in_turn(other, send, recv)
        return theirs[0]

    def _exchange_layers(self, other: int, send_k: list, send_v: list,
                         send_rows: torch.Tensor, recv_k: list, recv_v: list,
                         recv_rows: torch.Tensor) -> int:
        """Send rows ``send_rows`` of our K/V buffers of some layers to member ``other`` and
        receive its into rows ``recv_rows`` of ``recv_*``, one layer (K and V) per message:
        only allocated rows move (at a restore the mirrors are mostly free). Returns the bytes
        sent and received."""
        moved = 0

        def send() -> None:
            nonlocal moved
            for k, v in zip(send_k, send_v):
                rows_k, rows_v = k.index_select(0, send_rows), v.index_select(0, send_rows)
                self.link.send_to(self.link.control, other, {"k": rows_k, "v": rows_v})
                moved += sum(t.numel() * t.element_size() for t in (rows_k, rows_v))

        def recv() -> None:
            nonlocal moved
            for k, v in zip(recv_k, recv_v):
                got, _ = self.link.recv_from(self.link.control, other)
                k.index_copy_(0, recv_rows, got["k"])
                v.index_copy_(0, recv_rows, got["v"])
                moved += sum(t.numel() * t.element_size() for t in got.values())

        self._in_turn(other, send, recv)
        return moved

    # drop: phase 1 gives every other member our KV of its kept layers (layers we drop) and
    # takes its KV of our kept layers into its mirror here; phase 2 cuts our pool to the kept
    # layers, grows it and moves the dropped weights to the host copy.

    def _merge_move_kv(self) -> None:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        kept, pool = self.member.layers, self.pool
        mirrors = {}
        ours, self._moved_bytes = allocated_rows(self.scheduler), 0
        rows = self.kv_capacity_tokens_merged + self.page_size
        for other in self._others_in_turn():
            # Built at one page, then given unzeroed buffers of the merged size: only the
            # rows the KV move writes and the forwards write later are ever read (as in the
            # resizer's grow), and SGLang's zeroed buffers would touch every page of the
            # mirror while the group waits.
            mirror = MHATokenToKVPool(
                size=self.page_size, page_size=self.page_size,
                dtype=pool.dtype, head_num=pool.head_num, head_dim=pool.head_dim,
                layer_num=len(kept), device=pool.device, enable_memory_saver=False,
                v_head_dim=pool.v_head_dim, start_layer=kept.start, end_layer=kept.stop,
                enable_alt_stream=False)
            mirror.size = self.kv_capacity_tokens_merged
            set_pool_buffers(mirror, *([like.new_empty((rows, *like.shape[1:])) for _ in kept]
                                       for like in (pool.k_buffer[0], pool.v_buffer[0])))
            theirs = self._rows_with(other, ours)
            layers = self._layout_of(other).layers
            self._moved_bytes += self._exchange_layers(
                other, [pool.k_buffer[i] for i in layers], [pool.v_buffer[i] for i in layers],
                ours, mirror.k_buffer, mirror.v_buffer, theirs)
            mirrors[other] = _Mirror.over(mirror, self.runner.device)
        self.mirrors = mirrors

    def _discard_mirror(self) -> None:
        self.mirrors = {}

    def _merge_local(self) -> None:
        kept, pool = self.member.layers, self.pool
        self._whole_layers = _pool_layers(pool)
        _set_pool_layers(pool, kept, pool.k_buffer[kept.start:kept.stop],
                         pool.v_buffer[kept.start:kept.stop])
        try:
            KVResizer(self.scheduler, self.faults).grow(self.kv_capacity_tokens_merged - pool.size)
        except BaseException:
            _restore_pool_layers(pool, self._whole_layers)
            raise
        self._hold_weights()
        self.merged = True
        self._admit()

    def _unmerge_local(self) -> None:
        """Undo ``_merge_local``, completed (the peer failed its part) or not (a failed grow
        put the pool's layers back itself): no batch ran since, so the pages above the whole
        capacity are free and the dropped layers' buffers are as they were."""
        if self.pool.layer_num != self.num_layers:  # cut to the kept layers
            KVResizer(self.scheduler, self.faults).shrink(
                self.pool.size - self.kv_capacity_tokens_whole)
            kept = self.member.layers
            k_all, v_all = list(self._whole_layers[0]), list(self._whole_layers[1])
            k_all[kept.start:kept.stop] = self.pool.k_buffer
            v_all[kept.start:kept.stop] = self.pool.v_buffer
            _set_pool_layers(self.pool, range(self.num_layers), k_all, v_all)
        self._give_weights_back()
        self.merged = False
        self._admit()

    # restore: phase 1 takes our KV of the dropped layers back from the other members' mirrors
    # (and gives each its own from ours), puts every layer back in our pool at the merged size
    # and the weights back; phase 2 shrinks the pool to the whole capacity, moving live KV
    # below the boundary in every layer (the morph resizer).

    def _split_move_kv(self) -> None:
        self._merged_mirror = None
        pool, kept = self.pool, self.member.layers
        rows, shape = pool.k_buffer[0].shape[0], pool.k_buffer[0].shape[1:]
        # Only our allocated rows come back, so the buffers are not zeroed: a free row is
        # written before anything reads it (SGLang leaves freed rows stale too), and zeroing
        # the whole merged size cost more than the move itself (0.37 s of a 1.0-s restore).
        fused = {i: torch.empty((2, rows, *shape), dtype=pool.k_buffer[0].dtype,
                                device=pool.k_buffer[0].device) for i in self.dropped_layers}
        ours, self._moved_bytes = allocated_rows(self.scheduler), 0
        for other in self._others_in_turn():
            theirs = self._rows_with(other, ours)
            mirror = self.mirrors[other].pool
            layers = self._layout_of(other).layers
            self._moved_bytes += self._exchange_layers(
                other, mirror.k_buffer, mirror.v_buffer, theirs,
                [fused[i][0] for i in layers], [fused[i][1] for i in layers], ours)
        self._merged_layers = _pool_layers(pool)
        k_all, v_all = [None] * self.num_layers, [None] * self.num_layers
        for i, f in fused.items():
            k_all[i], v_all[i] = f[0], f[1]
        for i in kept:
            k_all[i], v_all[i] = pool.k_buffer[i - kept.start], pool.v_buffer[i - kept.start]
        _set_pool_layers(pool, range(self.num_layers), k_all, v_all)
        self._give_weights_back()
        self._merged_mirror, self.mirrors = self.mirrors, {}
        self.merged = False
        self._admit()

    def _unsplit(self) -> None:
        """Undo ``_split_move_kv``, completed (the peer failed its part) or not: the merged
        layout again, with the mirror as it was (no batch ran since)."""
        if self.pool.layer_num == self.num_layers:  # every layer was put back
            _restore_pool_layers(self.pool, self._merged_layers)
        self._hold_weights()
        if self._merged_mirror is not None:
            self.mirrors, self._merged_mirror = self._merged_mirror, None
        self.merged = True
        self._admit()

    def _admit(self) -> None:
        """After ``merged`` changed, the scheduling the state asks for; whole, SGLang's as
        launched. Neither touches a running request.

        - ``merged_max_running``: while merged SGLang admits at most that many requests here
          (its per-batch request cap, set through the scheduler's internal-state update, the
          handler of SGLang's ``/set_internal_state``). A merged pair's decode step costs in
          proportion to its batch on this CPU, so the cap bounds every request's TPOT at the
          price of the queued ones' TTFT.
        - ``merged_chunked_prefill``: while merged a prefill runs in chunks of at most that
          many tokens, each step also carrying the replica's running decodes (SGLang's mixed
          chunked prefill: the scheduler's ``chunked_prefill_size`` and ``is_mixed_chunk``,
          which its next prefill reads; no update request covers them). Merged, a prefill of
          either replica occupies both cores, so an unchunked one stalls both replicas'
          decodes for its whole length. A request half-way through its chunks goes on with
          the size now set."""
        # The first prefill after a drop is the one the drop is for: it does not wait.
        self.decodes_since_prefill = self.merged_prefill_gap_steps or 0
        if self.merged_max_running is not None or self.paced_cap is not None:
            self.paced_cap = None
            self._set_running_cap(self._base_running_cap())
        if self.merged_chunked_prefill is not None:
            s = self.scheduler
            s.chunked_prefill_size, s.is_mixed_chunk = (
                (self.merged_chunked_prefill, True) if self.merged else self._whole_chunking)

    def _base_running_cap(self) -> int:
        """SGLang's running-request cap in the current state, without pacing."""
        if self.merged and self.merged_max_running is not None:
            return self.merged_max_running
        return self._whole_max_running

    def _set_running_cap(self, cap: int) -> None:
        """SGLang's per-batch request cap, through the scheduler's internal-state update (the
        handler of its ``/set_internal_state``)."""
        from sglang.srt.managers.io_struct import SetInternalStateReq

        out = self.scheduler.set_internal_state(
            SetInternalStateReq(server_args={"pp_max_micro_batch_size": cap}))
        if not out.updated:  # within [1, the launch's cap]: checked at launch and by _pace
            raise RuntimeError(f"SGLang refused the running-request cap {cap}")

    def count_merged_forward(self, forward_batch: Any) -> None:
        """An own forward while merged (runner hook): what admission pacing counts."""
        mode = forward_batch.forward_mode
        if mode.is_decode():
            self.decodes_since_prefill += 1
        elif mode.is_extend():
            self.decodes_since_prefill = 0

    def _pace(self) -> None:
        """Admission pacing while merged (``on_step``, before SGLang picks the next batch):
        while this replica's running requests have decoded fewer than
        ``merged_prefill_gap_steps`` steps since its last prefill, SGLang's running-request
        cap is held at their count, so it admits nothing and decodes them; then the cap goes
        back and the queue's next prefill may start. Merged, every prefill of a replica stops
        its running requests for the length of the prefill through both members' stages."""
        if self.merged_prefill_gap_steps is None or not self.merged:
            return
        running = len(self.live_requests())
        hold = (bool(self.scheduler.waiting_queue) and running > 0
                and self.decodes_since_prefill < self.merged_prefill_gap_steps)
        cap = min(running, self._base_running_cap()) if hold else None
        if hold:
            self.prefills_paced += 1
        if cap == self.paced_cap:
            return
        self._set_running_cap(cap if cap is not None else self._base_running_cap())
        if cap is None:
            # SGLang keeps a refused admission's flag until a request ends or memory frees.
            self.scheduler.running_batch.batch_is_full = False
        self.paced_cap = cap

    def _split_local(self) -> None:
        """The restore's last step, once every member has every layer back: this pool gives
        the merged size's extra tokens back. A shrink that fails (the vote checked it can
        succeed, so only a fault gets here) changes nothing in the pool and is retried between
        batches (``on_step``): the restore stands on every member, so their layouts and the
        epoch that dates their views stay alike, and the pool is larger than a whole
        replica's until the retry succeeds."""
        self._merged_mirror = None
        self.shrink_pending_tokens = self.pool.size - self.kv_capacity_tokens_whole
        self._give_back()

    # A restore's failed pool shrink is tried again this long after the last attempt.
    SHRINK_RETRY_S = 1.0

    def _give_back(self) -> bool:
        """Shrink the pool by ``shrink_pending_tokens`` (in a transition, or holding the compute
        lock). False when it failed: the pool is unchanged and the next attempt is due
        ``SHRINK_RETRY_S`` later."""
        try:
            KVResizer(self.scheduler, self.faults).shrink(self.shrink_pending_tokens)
        except Exception:
            logger.warning("sglang-morph: KunServe replica %d: the pool shrink of %d tokens "
                           "after a restore failed (%d retries so far); retried between "
                           "batches", self.replica, self.shrink_pending_tokens,
                           self.shrink_retries, exc_info=True)
            self._shrink_retry_at_s = time.monotonic() + self.SHRINK_RETRY_S
            return False
        self.shrink_pending_tokens = 0
        return True

    def on_step(self) -> None:
        """Before every ``get_next_batch_to_run`` (scheduler thread, between batches): a
        restore's deferred pool shrink when it is due, admission pacing while merged, then
        the automatic control."""
        if self.shrink_pending_tokens and time.monotonic() >= self._shrink_retry_at_s:
            try:
                self._retry_shrink()
            except Exception:  # serving goes on; the status shows the shrink still pending
                logger.exception("sglang-morph: KunServe replica %d: the deferred pool shrink",
                                 self.replica)
        try:
            self._pace()
        except Exception:  # serving goes on, unpaced until the next step's attempt
            logger.exception("sglang-morph: KunServe replica %d: admission pacing",
                             self.replica)
        if self.auto is not None:
            self.auto.on_step()

    def _retry_shrink(self) -> None:
        self.shrink_retries += 1
        with self.compute_lock:
            tokens = self.shrink_pending_tokens
            if not self._give_back():
                return
        logger.info("sglang-morph: KunServe replica %d gave back the %d KV tokens of its last "
                    "restore (retry %d)", self.replica, tokens, self.shrink_retries)
        self.check_integrity()
        self._publish_metrics()

    # Both directions skip what is already where they put it, so that an undo after a move
    # that stopped partway completes it.

    def _hold_weights(self) -> None:
        for module in self._dropped_modules():
            for p in module.parameters():
                if id(p) not in self._host_weights:
                    self._host_weights[id(p)] = p.data
                    p.data = p.data.new_empty(0)
        self.dropped_weight_bytes = sum(t.numel() * t.element_size()
                                        for t in self._host_weights.values())

    def _give_weights_back(self) -> None:
        for module in self._dropped_modules():
            for p in module.parameters():
                if id(p) in self._host_weights:
                    p.data = self._host_weights.pop(id(p))
        self.dropped_weight_bytes = 0

    # ---- forward (scheduler thread, inside ModelRunner.forward, holding compute_lock) ----

    def forward_merged(self, input_ids, positions, forward_batch, input_embeds=None,
                       pp_proxy_tensors=None):
        """LlamaModel.forward of a merged replica: the kept layers here, the others on the
        peer. Returns what LlamaModel.forward returns (final-normed hidden states)."""
        if len(self.active) > 2:
            parts = (self._micro_batches(forward_batch, positions, input_ids)
                     if input_embeds is None else [])
            if parts:
                self.batches_micro += 1
                return self._stages_micro(parts)
            return self._forward_stages(input_ids, positions, forward_batch, input_embeds)
        model = self.model
        # The back member's batch may have gone ahead (send_ahead), cut or not: its cut is
        # reused; otherwise it is cut here.
        ahead = None if self.front else self._take_ahead(forward_batch, positions, input_ids)
        parts = ahead if ahead is not None else (
            self._micro_batches(forward_batch, positions, input_ids)
            if input_embeds is None else [])
        if _carries_decodes(forward_batch):
            self.batches_mixed += 1
        if parts:
            self.batches_micro += 1
            return (self._front_micro(parts) if self.front
                    else self._back_micro(parts, sent_first=ahead is not None))
        if self.front:
            hidden = model.embed_tokens(input_ids) if input_embeds is None else input_embeds
            handoff = self._own_stage(forward_batch, positions, {"hidden_states": hidden})
            self._send_call(forward_batch, positions, input_ids, handoff)
            return self._answer()["hidden_states"]
        if ahead is None:
            hidden = model.embed_tokens(input_ids) if input_embeds is None else input_embeds
            self._send_call(forward_batch, positions, input_ids, {"hidden_states": hidden})
        return self._own_stage(forward_batch, positions, self._answer())["hidden_states"]

    def _forward_stages(self, input_ids, positions, fb, input_embeds=None):
        """A merged replica's forward in a group of more than two: the batch goes through the
        members' layer ranges in stage order, each other member's run by its service thread
        (this replica waits for each answer with the compute lock released), its own here;
        the last stage answers final-normed hidden states. The batch runs uncut and nothing
        is sent ahead: each stage waits for the one before it (a prefill long enough to cut
        runs as ``_stages_micro``)."""
        hidden = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds
        handoff = {"hidden_states": hidden}
        for stage in self.active:
            if stage == self.rank:
                handoff = self._own_stage(fb, positions, handoff)
            else:
                self._send_call(fb, positions, input_ids, handoff, member=stage)
                handoff = self.answer(stage)
        return handoff["hidden_states"]  # the last stage's: final-normed

    def _stages_micro(self, parts: list) -> torch.Tensor:
        """A merged replica's own extend batch in a group of more than two, cut into
        micro-batches that flow through the stages as a wavefront: at tick ``t`` stage ``i``
        runs micro-batch ``t - i``, so up to one micro-batch per stage runs at once (a
        4-stage merge of a prefill in 4 runs 7 ticks of a quarter-stage each instead of 4
        stages of the whole batch in turn). Each tick sends every other member its
        micro-batch, runs this member's own (its forward context: its pool, new rows only),
        then takes the answers in stage order. A member is sent a micro-batch only after its
        answer to the one before was taken, so its service thread is waiting for the batch
        (a gloo send waits for the receiver) and no send waits on a member that waits on
        this one. Per stage the micro-batches run in order, so a later range of a request
        sees the earlier one's KV in that stage's pool or mirror."""
        stages, model = list(self.active), self.model
        handoff: list[dict[str, torch.Tensor] | None] = [None] * len(parts)
        for tick in range(len(stages) + len(parts) - 1):
            here = [(stage, tick - i) for i, stage in enumerate(stages)
                    if 0 <= tick - i < len(parts)]
            for stage, j in here:
                if stage == stages[0]:  # entering the first stage: embedded here
                    handoff[j] = {"hidden_states": model.embed_tokens(parts[j][2])}
                if stage != self.rank:
                    self._send_call(*parts[j], handoff[j], micro=len(parts) - j,
                                    member=stage)
            for stage, j in here:
                if stage == self.rank:
                    sub, positions, _ = parts[j]
                    start = time.perf_counter()
                    with self._micro_context():
                        handoff[j] = self._own_stage(sub, positions, handoff[j])
                    self._time_stage(sub, time.perf_counter() - start)
            for stage, j in here:
                if stage != self.rank:
                    handoff[j] = self.answer(stage)
        return torch.cat([h["hidden_states"] for h in handoff])  # the last stage's

    def _own_stage(self, fb, positions, handoff: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
        """This member's kept layers on a batch at its stage, in the forward context the
        caller set (this replica's pool, or a mirror): the first stage starts the residual
        stream from ``handoff["hidden_states"]`` (the embedded batch), a later one takes the
        PP hand-off (hidden states and residual; other entries of ``handoff`` are ignored).
        Returns the hand-off for the next stage, or, from the last stage,
        ``{"hidden_states": ...}`` final-normed."""
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        model, kept = self.model, self.member.layers
        if self.front:
            residual_batch.start(fb)
            hidden = handoff["hidden_states"]
        else:
            hidden = model.layers[kept.start].attn_boundary.from_pp(PPProxyTensors(
                {k: handoff[k] for k in ("hidden_states", "residual") if k in handoff}), fb)
        for i in kept:
            hidden = model.layers[i](positions, hidden, fb)
        if self.last:
            return {"hidden_states": residual_batch.final_norm(hidden, fb, model.norm)}
        return dict(residual_batch.to_pp(hidden, fb).tensors)

    def send_ahead(self, forward_batch) -> None:
        """Before ``ModelRunner.forward`` takes the compute lock (scheduler thread): the back
        member sends its batch to the front's layers at once. Its forward would otherwise wait
        for the lock while this replica's service thread runs the peer's batch, and only then
        ask the peer, whose core idles meanwhile: a trace of decode at batch 1 showed
        the two steps in series, ~35 ms of each ~85 ms step idle on each core. Only the
        embedding runs here (a read of its weights; SGLang's forward context is not touched);
        ``forward_merged`` takes the answer and checks it was this batch's."""
        fb = forward_batch
        mode = fb.forward_mode
        if (self.front or not self.merged or self._early is not None or len(self.active) > 2
                or not (mode.is_extend() or mode.is_decode())
                or getattr(fb, "input_embeds", None) is not None):
            return  # the ordinary path (forward_merged sends, or refuses the mode)
        parts = self._micro_batches(fb, fb.positions, fb.input_ids)
        sub, positions, input_ids = parts[0] if parts else (fb, fb.positions, fb.input_ids)
        with torch.no_grad():
            hidden = self.model.embed_tokens(input_ids)
        self._send_call(sub, positions, input_ids, {"hidden_states": hidden}, micro=len(parts))
        self._early = (self._batch_key(fb, fb.positions, fb.input_ids), parts)
        self.batches_sent_ahead += 1

    # A merged replica's forward waits at most this long for another member's cut prefill
    # (a bound: a prefill that failed half-way is cleared by its member's next batch, or by
    # the next transition's layout).
    HOLD_FOR_PREFILL_S = 2.0

    def hold_for_peer_prefill(self) -> None:
        """Before a forward (scheduler thread, without the compute lock): while merged and
        another member's cut prefill runs through this replica's layers, wait until its last
        micro-batch has come. Merged, a prefill's micro-batches use both cores; a decode step
        of this replica started between them needs both cores too, and stretched the prefill
        of a blocked prompt (the one a drop is for) by about a quarter in the replay. So a
        merged prefill goes first; this replica's requests wait for it instead. With
        ``--kunserve-merged-priority decode`` they do not wait."""
        if not self.merged or self.merged_priority == "decode":
            return
        with self._peer_prefill_done:
            if self._prefilling_peers:
                self.batches_held += 1
                self._peer_prefill_done.wait_for(lambda: not self._prefilling_peers,
                                                 timeout=self.HOLD_FOR_PREFILL_S)

    def record_whole_forward(self, forward_batch: Any, seconds: float) -> None:
        """A forward of this replica whole, for ``step_costs``: a decode step or a prefill (a
        batch that mixes the two, or of another mode, is neither)."""
        mode, _, new = batch_chunks(forward_batch)
        if mode == "decode":
            self.step_costs.record(True, len(new), seconds)
        elif mode == "extend":
            self.step_costs.record(False, sum(new), seconds)

    def _take_ahead(self, fb, positions, input_ids) -> list | None:
        """The micro-batches of the batch ``send_ahead`` sent (``[]``: sent uncut), or None when
        nothing went ahead. A batch other than this forward's is refused once its answer is
        read (the link stays in step)."""
        early, self._early = self._early, None
        if early is None:
            return None
        key, parts = early
        now = self._batch_key(fb, positions, input_ids)
        if key != now:
            self._answer()  # keep the link in step, then refuse: the peer ran another batch
            fields = ("mode", "positions", "input_ids", "out_cache_loc", "seq_lens")
            raise RuntimeError(
                f"replica {self.replica}: the batch sent ahead of the forward is not the batch "
                f"the forward runs (differing: "
                f"{', '.join(f for f, a, b in zip(fields, key, now) if a != b)}; "
                f"{[(a, b) for a, b in zip(key, now) if a != b]})"[:2000])
        return parts

    # A long prefill runs as a pipeline of micro-batches (KunServe's micro-batching, within one
    # forward): while the back member runs micro-batch j's layers, the front runs j + 1's, so
    # one replica's prefill keeps both cores busy instead of one core idling through each half.
    # Measured (a fresh 384-token prompt, the other replica idle): TTFT 1.03 s uncut,
    # 0.71 s in four (whole replica: 0.97 s); with SGLang's square extend attention four cuts
    # only reached 0.85-0.94 s, hence the new-rows attention (attention.py).
    # Micro-batches are contiguous token ranges of the batch; a request cut between two keeps
    # its order (the later range sees the earlier one's KV as prefix, in both members' pools).
    MICRO_MIN_TOKENS = 64  # smaller ranges cost more in fixed per-call work than they overlap

    def _micro_batches(self, fb, positions, input_ids) -> list:
        """``[(sub_batch, positions, input_ids)]`` of a plain extend batch of at least
        ``2 * MICRO_MIN_TOKENS`` tokens, cut into up to ``micro_batches`` ranges of at least
        ``MICRO_MIN_TOKENS``: of equal cost under the replica's fitted chunk cost model
        (``cut_costs``), else of equal tokens; ``[]`` otherwise."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if _model_mode(fb.forward_mode) != ForwardMode.EXTEND or self.micro_batches < 2:
            return []
        total = int(input_ids.numel())
        k = min(self.micro_batches, total // self.MICRO_MIN_TOKENS)
        if k < 2:
            return []
        prefix, extend = fb.extend_prefix_lens.tolist(), fb.extend_seq_lens.tolist()
        if sum(extend) != total:
            return []
        bounds = [total * j // k for j in range(k + 1)]
        model = self.cut_costs.model if self.cut_costs is not None else None
        if model is not None:
            bounds = balanced_bounds([Chunk(p, e) for p, e in zip(prefix, extend)], k, model,
                                     self.MICRO_MIN_TOKENS)
        starts = list(itertools.accumulate(extend, initial=0))
        parts = []
        for a, b in zip(bounds, bounds[1:]):
            rows, pre, new = [], [], []
            for i, (p, e, s0) in enumerate(zip(prefix, extend, starts)):
                lo, hi = max(a, s0), min(b, s0 + e)
                if lo < hi:
                    rows.append(i)
                    pre.append(p + lo - s0)
                    new.append(hi - lo)
            sub = _layers_batch(
                ForwardMode.EXTEND, input_ids[a:b], fb.req_pool_indices[rows],
                torch.tensor([p + n for p, n in zip(pre, new)], dtype=fb.seq_lens.dtype),
                fb.out_cache_loc[a:b], positions[a:b],
                torch.tensor(pre, dtype=fb.extend_prefix_lens.dtype),
                torch.tensor(new, dtype=fb.extend_seq_lens.dtype))
            parts.append((sub, positions[a:b], input_ids[a:b]))
        return parts

    def _front_micro(self, parts: list) -> torch.Tensor:
        """The front member's own batch: micro-batch j + 1's kept layers run here while the
        peer runs j's; j's answer is taken before j + 1 is sent (a gloo send waits for the
        receiver, who is answering j: sending first would deadlock)."""
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

        model, outs = self.model, []
        for j, (sub, positions, input_ids) in enumerate(parts):
            start = time.perf_counter()
            with self._micro_context():
                hidden = model.embed_tokens(input_ids)
                residual_batch.start(sub)
                for i in self.member.layers:
                    hidden = model.layers[i](positions, hidden, sub)
                handoff = residual_batch.to_pp(hidden, sub)
            self._time_stage(sub, time.perf_counter() - start)
            if j:
                outs.append(self._answer()["hidden_states"])
            self._send_call(sub, positions, input_ids, handoff.tensors,
                            micro=len(parts) - j)
        outs.append(self._answer()["hidden_states"])
        return torch.cat(outs)

    def _back_micro(self, parts: list, sent_first: bool) -> torch.Tensor:
        """The back member's own batch: the peer runs micro-batch j + 1's front layers while
        this replica runs j's back layers (the first one went ahead when ``sent_first``)."""
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

        model, kept, outs = self.model, self.member.layers, []
        if not sent_first:
            sub, pos, ids = parts[0]
            self._send_call(sub, pos, ids, {"hidden_states": model.embed_tokens(ids)},
                            micro=len(parts))
        for j, (sub, pos, ids) in enumerate(parts):
            out = self._answer()
            if j + 1 < len(parts):
                nsub, npos, nids = parts[j + 1]
                self._send_call(nsub, npos, nids, {"hidden_states": model.embed_tokens(nids)},
                                micro=len(parts) - j - 1)
            start = time.perf_counter()
            with self._micro_context():
                hidden = model.layers[kept.start].attn_boundary.from_pp(PPProxyTensors(out),
                                                                        sub)
                for i in kept:
                    hidden = model.layers[i](pos, hidden, sub)
                outs.append(residual_batch.final_norm(hidden, sub, model.norm))
            self._time_stage(sub, time.perf_counter() - start)
        return torch.cat(outs)

    def _time_stage(self, sub, seconds: float) -> None:
        """One micro-batch's own stage (this replica's layers, under the compute lock, no link
        wait), a timing for the cuts' cost model. The sub-batch's lengths are host tensors
        (``_micro_batches`` builds them): reading them waits on no device."""
        if self.cut_costs is not None:
            self.cut_costs.observe(
                [Chunk(int(p), int(n)) for p, n in zip(sub.extend_prefix_lens.tolist(),
                                                         sub.extend_seq_lens.tolist())],
                seconds)

    def _micro_context(self):
        """The forward context of a micro-batch's own layers; entered and left while this
        thread holds the compute lock (never across ``_answer``), so the service thread's
        contexts stay nested in the scheduler's."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        return forward_context(ForwardContext(attn_backend=self._micro_backend))

    @staticmethod
    def _batch_key(fb, positions, input_ids) -> tuple:
        """What the peer's layers compute from (the runner may hand the model another
        ForwardBatch object holding the same batch, so the values are compared)."""
        return (int(_model_mode(fb.forward_mode)), tuple(positions.tolist()),
                tuple(input_ids.tolist()),
                tuple(fb.out_cache_loc.tolist()), tuple(fb.seq_lens.tolist()))

    def settle_ahead(self) -> None:
        """After ``ModelRunner.forward``: a batch sent ahead whose forward raised before it
        took the answer; the answer is read and dropped so that the link stays in step."""
        if self._early is not None:
            self._early = None
            self.link.recv_from(self.link.calls[self.rank], self._peer)

    def _send_call(self, fb, positions, input_ids, tensors: dict[str, torch.Tensor],
                   micro: int = 0, member: int | None = None) -> None:
        """Our batch (its rows of req_to_token with it) to ``member``'s layers (the peer of a
        pair when None). ``micro``: 0 for a batch run uncut, else how many micro-batches of
        the cut batch are left, this one included (1: the last)."""
        mode = fb.forward_mode
        if not (mode.is_extend() or mode.is_decode()):
            raise NotImplementedError(f"KunServe forwards extend and decode batches, not {mode}")
        seq_lens = fb.seq_lens.to(torch.int64)
        rows = self.scheduler.req_to_token_pool.req_to_token[
            fb.req_pool_indices.long(), :int(seq_lens.max())]
        bundle = dict(tensors, positions=positions, input_ids=input_ids,
                      out_cache_loc=fb.out_cache_loc, seq_lens=seq_lens, req_to_token=rows)
        if mode.is_extend():
            bundle["extend_prefix_lens"] = fb.extend_prefix_lens.to(torch.int64)
            bundle["extend_seq_lens"] = fb.extend_seq_lens.to(torch.int64)
        self.call(self._peer if member is None else member, bundle,
                  mode=int(_model_mode(mode)), micro=int(micro))

    def _answer(self) -> dict[str, torch.Tensor]:
        """The peer's answer to our last call; the compute lock is released while waiting."""
        return self.answer(self._peer)

    # ---- the peer's batches (service thread, under the compute lock, without grad) ----

    def _run_for_peer(self, caller: int, t: dict[str, torch.Tensor],
                      ints: dict[str, int]) -> dict[str, Any]:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        mirror = self.mirrors.get(caller)
        if not self.merged or mirror is None:
            raise RuntimeError(f"replica {self.link.replicas[caller]}'s batch arrived while "
                               f"this replica is whole")
        mode_value, left = ints["mode"], int(ints.get("micro", 0))
        micro = left > 0
        with self._peer_prefill_done:
            # The caller's cut prefill runs through our layers until its last micro-batch;
            # an uncut batch (or the last) means none of its is in flight after this one.
            if left > 1:
                self._prefilling_peers.add(caller)
            elif caller in self._prefilling_peers:
                self._prefilling_peers.discard(caller)
                self._peer_prefill_done.notify_all()
        # The peer's rows of req_to_token come with the batch: request i reads row i.
        fb = _layers_batch(ForwardMode(mode_value), t["input_ids"],
                           torch.arange(t["seq_lens"].numel(), dtype=torch.int64),
                           t["seq_lens"], t["out_cache_loc"], t["positions"],
                           t.get("extend_prefix_lens"), t.get("extend_seq_lens"))
        mirror.rows.req_to_token = t["req_to_token"]
        # A micro-batch attends over its new rows only; a batch run uncut runs exactly as it
        # would on a whole replica (SGLang's attention).
        backend = mirror.micro_backend if micro else mirror.backend
        with forward_context(ForwardContext(attn_backend=backend)):
            return self._own_stage(fb, t["positions"], t)


@dataclasses.dataclass
class _Mirror:
    """Another member's KV of this replica's kept layers (``pool``, at that member's slot
    numbers) and the attention over it: ``backend`` SGLang's (batches run uncut),
    ``micro_backend`` the new rows only (micro-batches, attention.py); ``rows`` carries the
    req_to_token rows of the batch being run, which arrive with it."""

    pool: Any
    rows: types.SimpleNamespace
    backend: Any
    micro_backend: Any

    @classmethod
    def over(cls, pool: Any, device: Any) -> "_Mirror":
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        rows = types.SimpleNamespace(req_to_token=None)
        return cls(pool, rows, TorchNativeAttnBackend(types.SimpleNamespace(
            device=device, req_to_token_pool=rows, token_to_kv_pool=pool)),
            new_rows_backend(device, rows, pool))


class _Metrics(MemberMetrics):
    """KunServe's series of one replica (``sglang_morph_kunserve_*``, labelled with it)."""

    def __init__(self, replica: int):
        super().__init__("kunserve", replica)
        self.layers_held = self.gauge("layers_held",
                                      "Decoder layers whose weights this replica holds")
        self.kv_capacity_tokens = self.gauge("kv_capacity_tokens",
                                             "Own KV pool capacity in tokens")
        self.peer_kv_capacity_tokens = self.gauge("peer_kv_capacity_tokens",
                                                  "Mirror pool capacity for the peer's tokens")
        self.transitions = self.counter("transitions", "KunServe transitions", "action")


def _model_mode(mode: Any) -> Any:
    """The mode the model runs a batch in: SGLang's runner runs a MIXED batch (a prefill
    chunk with decode rows, ``--kunserve-merged-chunked-prefill``) as EXTEND, so the back
    member's batch sent ahead (read before the runner) and its forward (inside) must
    agree on EXTEND."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return ForwardMode.EXTEND if mode == ForwardMode.MIXED else mode


def _carries_decodes(fb: Any) -> bool:
    """An extend batch that prefills and decodes in one step (SGLang's mixed chunked prefill;
    the runner sees the batch as EXTEND, so the mode does not tell): its rows are of both
    phases as the cost model tells them apart (``Chunk.phase``: a decode row is one new
    token after a cached prefix)."""
    lens = fb.extend_seq_lens_cpu if fb.forward_mode.is_extend() else None
    return bool(lens) and {Chunk(int(p), int(n)).phase for p, n in zip(
        fb.extend_prefix_lens_cpu, lens)} == {"prefill", "decode"}


def _running_cap() -> int:
    """How many requests SGLang lets this replica's scheduler run at once now (its per-batch
    request cap; without PP, ``--max-running-requests`` unless updated)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().pp_max_micro_batch_size)


def _layers_batch(mode: Any, input_ids: torch.Tensor, req_pool_indices: torch.Tensor,
                  seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, positions: torch.Tensor,
                  prefix_lens: torch.Tensor | None = None,
                  extend_lens: torch.Tensor | None = None) -> Any:
    """A ForwardBatch with what the decoder layers read (attention on torch_native): a peer's
    batch or a micro-batch; an extend batch also gets its prefix and new lengths."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    fb = ForwardBatch(
        forward_mode=mode, batch_size=seq_lens.numel(), input_ids=input_ids,
        req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
        seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=seq_lens, positions=positions)
    if mode.is_extend():
        fb.extend_prefix_lens, fb.extend_seq_lens = prefix_lens, extend_lens
        fb.extend_prefix_lens_cpu = prefix_lens.tolist()
        fb.extend_seq_lens_cpu = extend_lens.tolist()
        fb.extend_num_tokens = int(extend_lens.sum())
    return fb


def _pool_layers(pool: Any) -> tuple:
    return (list(pool.k_buffer), list(pool.v_buffer), pool.start_layer, pool.end_layer,
            pool.layer_num)


def _restore_pool_layers(pool: Any, saved: tuple) -> None:
    k, v, start, end, num = saved
    _set_pool_layers(pool, range(start, start + num), k, v)
    pool.end_layer = end


def _set_pool_layers(pool: Any, layers: range, k_buffers: list, v_buffers: list) -> None:
    """The pool holds ``layers`` (their buffers given in order); SGLang indexes a pool's
    buffers by ``layer_id - start_layer``, as it does for a pipeline stage's pool (whose
    ``end_layer`` the model runner sets exclusive)."""
    pool.start_layer, pool.end_layer, pool.layer_num = layers.start, layers.stop, len(layers)
    set_pool_buffers(pool, k_buffers, v_buffers)
