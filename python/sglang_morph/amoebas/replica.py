"""One data-parallel replica's side of AMOEBAs (``--enable-amoebas --dp-size N``), in its
scheduler process.

SGLang cannot move a request between schedulers, so a replica keeps its scheduler, its
requests and its slot numbers whether it serves alone or in a group. In a group of degree d it
is member ``i`` of the group's link and keeps query/KV heads and FFN rows ``[i*X/d,
(i+1)*X/d)`` (``forward.Shard``). Each batch of any member (its *owner*) runs on every member
at once (``forward.forward``): the owner's scheduler thread sends the batch to the others and
runs its share; on each other member a service thread (one per possible caller,
``groups.member``) runs that member's share; the partial sums meet in all-reduces on the
owner's call group. SGLang's logits and sampling stay with the owner.

KV: a member keeps its heads' KV of its own requests in its own pool and, for each other
member q, its heads' KV of q's requests at q's slot numbers (q's *mirror*). With SGLang's
token-first buffers ([slots, KV heads, dim] per layer) the mirror of q is the column range of
q's heads in this member's own buffers: the heads this member no longer keeps for its own
requests hold its heads of q's requests instead, so a group needs no memory beyond the pools
the replicas started with.

Concurrency: one compute lock per process (``groups.member``) for all its links. The
scheduler thread holds it through ``ModelRunner.forward``; a service thread takes it to run a
caller's share; both release it while they wait in an all-reduce or for an answer, so the
members' batches interleave layer by layer and never deadlock.

Transitions (``POST /amoebas/merge`` and ``/amoebas/split``): every replica's scheduler gets
the request between batches; the members of the named group run it as a voted transition over
their link (``groups.transition``), the others answer with their status.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
import time
from typing import Any

import torch

from sglang_morph.amoebas.config import AmoebasConfig
from sglang_morph.amoebas.forward import Batch, Shard, forward, layer_shards
from sglang_morph.elastic.contract import Outcome
from sglang_morph.elastic.control import ControlOutput, replica_index
from sglang_morph.groups.link import GroupLink
from sglang_morph.groups.member import GroupMember
from sglang_morph.groups.transition import Phase, VotedTransition

logger = logging.getLogger("sglang_morph.amoebas")

_OK, _BAD, _REFUSED, _FAILED = 200, 400, 409, 500
# A member that stops answering inside a merged forward would hold the others in their
# all-reduce forever; past this they raise and their scheduler stops with the error.
_ALL_REDUCE_TIMEOUT = datetime.timedelta(minutes=5)
_RECENT_TRANSITIONS = 20


class AmoebasReplica:
    """Invariants (``check_integrity``): alone (``unit == (replica,)``), no shard and no
    mirrors; in a group, ``unit`` is one of the configured blocks holding this replica,
    ``shard`` is this member's, there is one mirror per other member and each view has the
    pool's rows and ``num_kv_heads / degree`` heads; every service thread is alive."""

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
        self.intermediate_size = int(hf.intermediate_size)
        self.head_dim = int(self.pool.k_buffer[0].shape[-1])
        if tuple(self.pool.k_buffer[0].shape[1:]) != (self.num_kv_heads, self.head_dim):
            raise NotImplementedError(f"KV buffers of shape {tuple(self.pool.k_buffer[0].shape)}"
                                      f" for {self.num_kv_heads} KV heads")
        self.replica = replica_index()
        self.lock = threading.Lock()
        self.members: dict[tuple[int, ...], GroupMember] = {}
        for block in cfg.blocks():
            if self.replica in block:
                link = GroupLink(f"amoebas-{'-'.join(map(str, block))}", block.index(self.replica),
                                 len(block), cfg.block_port(block), replicas=block)
                self.members[block] = GroupMember(scheduler, link, "amoebas",
                                                  lambda: int(self.pool.size),
                                                  compute_lock=self.lock)
        self.unit: tuple[int, ...] = (self.replica,)
        self.shard: Shard | None = None
        self._layers: list | None = None  # forward.LayerShard per layer while merged
        self._own: tuple[list, list] | None = None
        self.mirrors: dict[int, tuple[list, list]] = {}  # owner replica -> (K, V) per layer
        self.transitions: list[dict[str, Any]] = []
        self.batches_merged = self.batches_served_for_others = 0
        runner.amoebas = self
        self.model.amoebas = self
        for block, member in self.members.items():
            member.start_services(functools.partial(self._run_for, block))

    # ---- state ----

    @property
    def merged(self) -> bool:
        return len(self.unit) > 1

    @property
    def member(self) -> GroupMember:
        return self.members[self.unit]

    def used_tokens(self) -> int:
        return int(self.pool.size) - int(self.allocator.available_size()) - int(
            self.scheduler.tree_cache.evictable_size())

    def status(self) -> dict[str, Any]:
        shard = self.shard
        return {
            "replica": self.replica,
            "group": list(self.unit),
            "degree": len(self.unit),
            "kv_heads": [shard.kv_heads.start, shard.kv_heads.stop] if shard
            else [0, self.num_kv_heads],
            "ffn_rows": [shard.ffn_rows.start, shard.ffn_rows.stop] if shard
            else [0, self.intermediate_size],
            "kv_capacity_tokens": int(self.pool.size),
            "kv_used_tokens": self.used_tokens(),
            "mirror_kv_capacity_tokens": {str(r): int(k[0].shape[0]) - 1
                                          for r, (k, _) in self.mirrors.items()},
            "batches_merged": self.batches_merged,
            "batches_served_for_others": self.batches_served_for_others,
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
        if not self.merged:
            assert self.shard is None and not self.mirrors and self._own is None, (
                f"replica {self.replica} serves alone but keeps a shard or mirrors")
            return
        assert self.unit in self.members, f"replica {self.replica} is in unknown group {self.unit}"
        d, rows = len(self.unit), self.pool.k_buffer[0].shape[0]
        assert self.shard is not None and self.shard.degree == d
        assert sorted(self.mirrors) == [r for r in self.unit if r != self.replica], (
            f"mirrors {sorted(self.mirrors)} for group {self.unit}")
        for k, v in (self._own, *self.mirrors.values()):
            for buf in (*k, *v):
                assert tuple(buf.shape) == (rows, self.num_kv_heads // d, self.head_dim), (
                    f"a KV view of shape {tuple(buf.shape)} in a group of {d}")

    # ---- control requests (scheduler thread, between batches) ----

    def handle_control(self, req: Any) -> ControlOutput:
        from sglang_morph.amoebas.messages import AmoebasMergeReq, AmoebasSplitReq

        code, body = _OK, None
        if isinstance(req, AmoebasMergeReq):
            code, body = self._transition(tuple(req.replicas), merge=True)
        elif isinstance(req, AmoebasSplitReq):
            code, body = self._transition(tuple(req.group), merge=False)
        return ControlOutput(rid=req.rid, status_code=code,
                             body=self.status() if body is None else body, replica=self.replica)

    def _transition(self, block: tuple[int, ...], merge: bool) -> tuple[int, dict | None]:
        action = "merge" if merge else "split"
        if block not in self.cfg.blocks():
            return _BAD, {"error": f"{list(block)} is not a group this server allows "
                                   f"(allowed: {[list(b) for b in self.cfg.blocks()]})",
                          "replica": self.replica}
        if self.replica not in block:
            return _OK, None  # another group's transition: this replica answers its status
        member = self.members[block]
        if merge:
            phases = (Phase("the KV re-shard", self._drop_cached_kv, lambda: None),
                      Phase("the switch to the group", functools.partial(self._join, block),
                            self._leave))
        else:
            phases = (Phase("the KV re-shard back", self._drop_cached_kv, lambda: None),
                      Phase("the switch back", self._leave, functools.partial(self._join, block)))
        record = member.group_transitions.run(
            VotedTransition(action, "operator", self._refusal(block, merge), phases),
            applied=lambda seconds: self._applied(action, block, seconds))
        if record.outcome is Outcome.APPLIED:
            return _OK, None
        code = _REFUSED if record.outcome is Outcome.REFUSED else _FAILED
        return code, {"error": record.error, "replica": self.replica}

    def _refusal(self, block: tuple[int, ...], merge: bool) -> str | None:
        if merge and self.merged:
            return f"replica {self.replica} already serves in group {list(self.unit)}"
        if not merge and self.unit != block:
            return f"replica {self.replica} is not in group {list(block)}"
        if not self.scheduler.is_fully_idle():
            return (f"replica {self.replica} has requests in flight; this build re-shards no "
                    f"live KV yet: retry when idle")
        return None

    def _drop_cached_kv(self) -> None:
        """The radix cache's rows would mix with the other heads' mirrors: flushed (idle)."""
        if not self.scheduler.flush_cache(empty_cache=False):
            raise RuntimeError(f"replica {self.replica} got requests during the vote")

    def _applied(self, action: str, block: tuple[int, ...], seconds: float) -> dict[str, Any]:
        self.check_integrity()
        self.transitions.append({"action": action, "group": list(block),
                                 "at_unix_s": round(time.time(), 3),
                                 "duration_s": round(seconds, 4),
                                 "kv_capacity_tokens": int(self.pool.size)})
        logger.info("sglang-morph: AMOEBAs %s on replica %d: %s", action, self.replica,
                    self.transitions[-1])
        return self.transitions[-1]

    # ---- joining and leaving a group (the views; no memory moves) ----

    def _join(self, block: tuple[int, ...]) -> None:
        d, i = len(block), block.index(self.replica)
        shard = Shard(i, d, self.num_q_heads, self.num_kv_heads, self.intermediate_size)
        layers = layer_shards(self.model, shard, self.head_dim)

        def heads(rank: int) -> tuple[list, list]:
            span = Shard(rank, d, self.num_q_heads, self.num_kv_heads,
                         self.intermediate_size).kv_heads
            return ([k[:, span.start:span.stop] for k in self.pool.k_buffer],
                    [v[:, span.start:span.stop] for v in self.pool.v_buffer])

        self.shard, self._layers, self._own = shard, layers, heads(i)
        # Member q's mirror sits in the heads this replica no longer keeps for itself: q's.
        self.mirrors = {r: heads(block.index(r)) for r in block if r != self.replica}
        self.unit = block

    def _leave(self) -> None:
        self.unit, self.shard, self._layers, self._own = (self.replica,), None, None, None
        self.mirrors = {}

    # ---- the merged forward ----

    def forward_merged(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: Any, input_embeds: Any = None,
                       pp_proxy_tensors: Any = None) -> torch.Tensor:
        """``LlamaModel.forward`` of this replica's batch in its group (scheduler thread,
        compute lock held): the batch goes to every other member, this member runs its share,
        then each member's answer says it finished."""
        if input_embeds is not None or pp_proxy_tensors is not None:
            raise NotImplementedError("a merged group runs token batches on one stage")
        member = self.member
        batch = Batch.from_forward_batch(forward_batch,
                                         self.scheduler.req_to_token_pool.req_to_token,
                                         input_ids, positions)
        for other in member.link.others:
            member.call(other, batch.tensors())
        hidden = forward(self.model, self._layers, self.shard, self.head_dim, batch, *self._own,
                         self._all_reduce(member.link.calls[member.link.rank]), final_norm=True)
        for other in member.link.others:
            member.answer(other)
        self.batches_merged += 1
        return hidden

    def _run_for(self, block: tuple[int, ...], caller: int, tensors: dict[str, torch.Tensor],
                 ints: dict[str, int]) -> dict[str, torch.Tensor]:
        """Member ``caller``'s batch: this member's share (service thread, compute lock
        held)."""
        if self.unit != block:
            raise RuntimeError(f"a batch of group {list(block)} reached replica {self.replica} "
                               f"serving in {list(self.unit)}")
        owner = block[caller]
        forward(self.model, self._layers, self.shard, self.head_dim,
                Batch.from_tensors(tensors), *self.mirrors[owner],
                self._all_reduce(self.members[block].link.calls[caller]), final_norm=False)
        self.batches_served_for_others += 1
        return {}

    def _all_reduce(self, pg: Any):
        def all_reduce(t: torch.Tensor) -> None:
            work = pg.allreduce([t])
            self.lock.release()  # another member's share may run here meanwhile
            try:
                work.wait(_ALL_REDUCE_TIMEOUT)
            finally:
                self.lock.acquire()
        return all_reduce
