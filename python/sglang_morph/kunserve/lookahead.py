"""Micro-batches for a merged group's pipeline, and the pipeline's bubbles.

A group of ``S`` members runs its work as micro-batches through ``S`` stages; stage ``j`` of a
micro-batch takes the micro-batch's whole-model cost times the share of layers the stage holds
(plus an activation transfer to the next stage). A request's next step (its next token) can
only enter stage 0 once its previous step has left the last stage. When micro-batches cost
different amounts, or too few requests are back to fill one, stages idle: the pipeline bubble.
``bubble_share`` is the idle share of the stages' time, ``1 - busy / (S x makespan)``.

- ``serve_pipeline`` serves a stream of requests to completion, forming a micro-batch whenever
  stage 0 is free, under one of two policies (``POLICIES``, described there): ``slots``, no
  cost model (SGLang's pipeline parallelism), and ``lookahead``, KunServe's (micro-batches of
  a target cost from the requests that are back, prefills cut by the chunk cost model).
- ``by_lookahead`` cuts one iteration's items into ``K`` micro-batches of equal cost (the
  cluster simulation's pipeline, ``benchmark/kunserve/sim.py``): requests are placed in order;
  a prefill that would overshoot the target is cut where the micro-batch reaches it (solved from
  the cost model) and its rest goes first into the next micro-batch, behind the part already
  placed (its cached tokens grow by the first part, which the cost model accounts for). Decode
  steps (one token) are never cut. Within a micro-batch, chunk order does not matter.
- ``PipelineState`` / ``pipeline_schedule`` place micro-batches on the stages in order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from sglang_morph.kunserve.cost import Chunk, ChunkCostModel, PhaseCosts


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One request's work in the next forward: ``new_tokens`` behind ``cached_tokens``."""

    rid: str
    cached_tokens: int
    new_tokens: int

    def chunk(self) -> Chunk:
        return Chunk(self.cached_tokens, self.new_tokens)


MicroBatch = tuple[BatchItem, ...]


def micro_batch_seconds(costs: PhaseCosts, mb: MicroBatch) -> float:
    return costs.seconds([item.chunk() for item in mb]) if mb else 0.0


def _tokens_for_cost(model: ChunkCostModel, cached: int, seconds: float) -> int:
    """Most tokens ``c`` whose chunk behind ``cached`` costs at most ``seconds`` (at least 1):
    ``alpha(p*c + c^2 + c) + beta*c + delta*p^2 + epsilon*p``, the last two paid by any ``c``."""
    a, b = model.alpha_s, model.alpha_s * (cached + 1) + model.beta_s
    seconds -= model.delta_s * cached * cached + model.epsilon_s * cached
    if seconds <= 0:
        return 1
    if a == 0:
        return max(1, int(seconds / b)) if b > 0 else 1
    return max(1, int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)))


def by_lookahead(items: Sequence[BatchItem], k: int, costs: PhaseCosts,
                 iterations: int = 40) -> tuple[MicroBatch, ...]:
    """``k`` micro-batches of (nearly) equal cost; prefills may be cut into chunks.

    The first ``k - 1`` micro-batches are filled to a per-micro-batch cost and the last takes
    the rest; the cost is found by bisection so that the rest costs the same. (Cutting a
    prefill changes its cost: KunServe's model makes the parts cheaper by ``alpha * c1 * c2``,
    the padded prefix of torch_native dearer by ``delta * c1^2 + epsilon * c1``; so the target
    is not ``total / k``.)

    Invariant: every request's new tokens are placed exactly once, the chunks of one request
    are contiguous and in order (a later chunk's cached tokens = the earlier chunks' end), and
    there are at most ``k`` micro-batches.
    """
    if k < 1:
        raise ValueError(f"need at least one micro-batch, got {k}")
    if not items:
        return ()
    model = costs.model([item.chunk() for item in items])
    total = sum(model.chunk_seconds(item.chunk()) for item in items)
    # The balanced target lies below the whole (every micro-batch holds part of it); not
    # always below total / k: on a backend that pads a chunk's prefix, cutting adds work.
    lo, hi = 0.0, total
    best = _fill(items, k, model, hi)
    for _ in range(iterations if k > 1 else 0):
        mid = (lo + hi) / 2
        mbs = _fill(items, k, model, mid)
        last = sum(model.chunk_seconds(item.chunk()) for item in mbs[-1])
        if len(mbs) == k and last > mid:
            lo = mid  # the rest is heavier than the others: fill them more
        else:
            hi, best = mid, mbs
    return best


def _fill(items: Sequence[BatchItem], k: int, model: ChunkCostModel,
          target: float) -> tuple[MicroBatch, ...]:
    """Micro-batches 1..k-1 filled to ``target`` seconds (gamma aside), the last the rest."""
    out: list[list[BatchItem]] = [[]]
    filled = 0.0
    queue = list(items)
    while queue:
        item = queue.pop(0)
        cost = model.chunk_seconds(item.chunk())
        if len(out) == k or filled + cost <= target or (not out[-1] and item.new_tokens == 1):
            out[-1].append(item)
            filled += cost
        elif item.new_tokens > 1:
            room = target - filled
            c = min(_tokens_for_cost(model, item.cached_tokens, room), item.new_tokens - 1)
            # An empty micro-batch takes at least one token so the loop always advances.
            if room > 0 or not out[-1]:
                out[-1].append(dataclasses.replace(item, new_tokens=c))
                queue.insert(0, BatchItem(item.rid, item.cached_tokens + c, item.new_tokens - c))
            else:
                queue.insert(0, item)
            out.append([])
            filled = 0.0
        else:
            # A decode step does not fit what is left: it opens the next micro-batch unless
            # leaving it here overshoots less than moving it leaves short.
            if target - filled > filled + cost - target:
                out[-1].append(item)
                filled += cost
            else:
                queue.insert(0, item)
            out.append([])
            filled = 0.0
    return tuple(tuple(mb) for mb in out if mb)


@dataclasses.dataclass(frozen=True)
class StagedMicroBatch:
    """A micro-batch ready for the pipeline: its iteration, requests and per-stage seconds."""

    iteration: int
    rids: frozenset[str]
    stage_seconds: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    makespan_s: float
    busy_s: float  # summed over stages
    stages: int

    @property
    def bubble_share(self) -> float:
        return 1.0 - self.busy_s / (self.stages * self.makespan_s) if self.makespan_s else 0.0


class PipelineState:
    """The stages of one pipeline over time, fed micro-batches in order (``submit``).

    A stage works on one micro-batch at a time, in order; a micro-batch enters stage ``j+1``
    ``transfer_s`` after it left stage ``j`` (the hidden states travel; the link, not a stage,
    is busy). A request's chunk of iteration ``t`` enters stage 0 only once its chunk of an
    earlier iteration has left the last stage and come back (its next token depends on it);
    chunks of one request within one iteration only follow each other stage by stage.
    """

    def __init__(self, stages: int, transfer_s: float = 0.0, start_s: float = 0.0):
        if stages < 1 or transfer_s < 0:
            raise ValueError(f"need stages >= 1 and transfer_s >= 0, got {stages}, {transfer_s}")
        self.stages = stages
        self.transfer_s = transfer_s
        self.done = [start_s] * stages  # when each stage finished its previous micro-batch
        self.back: dict[str, tuple[int, float]] = {}  # rid -> (iteration, output back at)
        self.busy_s = 0.0

    def submit(self, mb: StagedMicroBatch, not_before_s: float = 0.0) -> float:
        """Schedule ``mb`` (no earlier than ``not_before_s``); returns when it is back."""
        if len(mb.stage_seconds) != self.stages:
            raise ValueError("every micro-batch needs one time per stage")
        if any(t < 0 for t in mb.stage_seconds):
            raise ValueError("negative stage time")
        ready = not_before_s
        for rid in mb.rids:
            iteration, at = self.back.get(rid, (mb.iteration, 0.0))
            if iteration < mb.iteration:
                ready = max(ready, at)
        for j, seconds in enumerate(mb.stage_seconds):
            start = max(self.done[j], ready)
            self.done[j] = start + seconds
            ready = self.done[j] + self.transfer_s
        # The last hop is the sampled tokens' way back to the first stage.
        for rid in mb.rids:
            self.back[rid] = (mb.iteration, ready)
        self.busy_s += sum(mb.stage_seconds)
        return ready


def pipeline_schedule(micro_batches: Sequence[StagedMicroBatch],
                      transfer_s: float = 0.0) -> PipelineRun:
    """Run ``micro_batches`` in order through a fresh ``PipelineState``; the makespan ends
    when the last stage finishes its last micro-batch."""
    if not micro_batches:
        return PipelineRun(0.0, 0.0, 0)
    state = PipelineState(len(micro_batches[0].stage_seconds), transfer_s)
    for mb in micro_batches:
        state.submit(mb)
    return PipelineRun(state.done[-1], state.busy_s, state.stages)


def stage_micro_batches(costs: PhaseCosts, iteration: int, micro_batches: Sequence[MicroBatch],
                        layer_shares: Sequence[float]) -> list[StagedMicroBatch]:
    """Each micro-batch's whole-model cost split over the stages by their share of layers."""
    if not math.isclose(sum(layer_shares), 1.0):
        raise ValueError(f"layer shares must add up to 1, got {sum(layer_shares)}")
    return [StagedMicroBatch(iteration, frozenset(item.rid for item in mb),
                             tuple(micro_batch_seconds(costs, mb) * share
                                   for share in layer_shares))
            for mb in micro_batches]


# ---- serving a stream of requests through the pipeline, micro-batch by micro-batch ----------
#
# A pipeline scheduler forms the next micro-batch whenever stage 0 is free, from the requests
# whose previous step has come back. ``serve_pipeline`` does that for two policies, on the same
# requests, the same cost model and the same stages; the bubble share is the stages' idle share
# from the first arrival to the last stage's last micro-batch (``PipelineRun``).
#
# - ``slots`` (no cost model; SGLang's pipeline parallelism, ``scheduler_pp_mixin``): one
#   micro-batch slot per stage; a request joins the slot with the fewest live requests when it
#   is admitted and stays there; the slots take turns, and a slot's next micro-batch is every
#   member's next step (a whole prefill, or a decode step) once the slot's previous
#   micro-batch has come back.
# - ``lookahead`` (KunServe's, with the cost model): whenever stage 0 is free, the next
#   micro-batch is formed from the requests that are back (a prefill's next chunk is ready as
#   soon as its previous chunk has gone in: the stages keep the chunks in order), earliest
#   first (among those back at once, the shortest rest first, so that a burst's first
#   micro-batch, which the next stage waits for, is small), up to a target cost: one round of work of every live request (a decode step each,
#   each prefill whole) over the number of stages, so that a round fills the stages, and
#   at most ``max_micro_batch_s``, so that a burst of prefills enters in pieces instead of
#   leaving the next stage idle for a whole batch of prompts. A prefill that overshoots is cut
#   where the micro-batch reaches the target (solved from the cost model; the rest is ready
#   for the next micro-batch); with ``cut_prefills=False`` the micro-batch closes before it
#   instead (a prompt is never cut: no padded prefix to re-read, one more ``gamma``). Looking ahead at what comes back: when requests that would
#   still fit the target come back sooner than a micro-batch's fixed cost (``gamma``), stage 0
#   waits for them instead of splitting the round into more, smaller micro-batches (each pays
#   ``gamma`` again on every stage).


@dataclasses.dataclass(frozen=True)
class PipelineRequest:
    rid: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.arrival_s < 0:
            raise ValueError(f"request {self.rid}: needs prompt_tokens >= 1, output_tokens >= 1 "
                             f"and arrival_s >= 0")


@dataclasses.dataclass
class _Live:
    req: PipelineRequest
    slot: int = -1
    prefilled: int = 0
    produced: int = 0
    ready_at: float = 0.0

    @property
    def finished(self) -> bool:
        return self.produced >= self.req.output_tokens

    def next_item(self, max_new: int | None = None) -> BatchItem:
        if self.prefilled < self.req.prompt_tokens:
            left = self.req.prompt_tokens - self.prefilled
            return BatchItem(self.req.rid, self.prefilled, min(left, max_new or left))
        return BatchItem(self.req.rid, self.req.prompt_tokens + self.produced - 1, 1)


POLICIES = ("slots", "lookahead")


@dataclasses.dataclass(frozen=True)
class ScheduledMicroBatch:
    """A micro-batch as served: when it entered stage 0 and when its tokens were back."""

    enter_s: float
    back_s: float
    items: MicroBatch


def serve_pipeline(costs: PhaseCosts, requests: Sequence[PipelineRequest],
                   layer_shares: Sequence[float], policy: str, transfer_s: float = 0.0,
                   max_running: int | None = None,
                   max_micro_batch_s: float = math.inf, cut_prefills: bool = True,
                   ) -> tuple[PipelineRun, list[ScheduledMicroBatch]]:
    """Serve ``requests`` to completion through ``len(layer_shares)`` stages under ``policy``.

    ``max_running``: at most that many requests live at once (KV-bound), admitted first come,
    first served when one finishes (its last token back); None admits each at its arrival.
    Returns the run and the micro-batches in the order they entered stage 0.

    Invariant: every request's prompt tokens run exactly once, in order, then one decode step
    per output token after the first (which the prefill yields), each only after the previous
    step came back from the last stage.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if max_running is not None and max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    if not math.isclose(sum(layer_shares), 1.0):
        raise ValueError(f"layer shares must add up to 1, got {sum(layer_shares)}")
    if len({r.rid for r in requests}) != len(requests):
        raise ValueError("request ids must be unique")
    stages = len(layer_shares)
    start = min((r.arrival_s for r in requests), default=0.0)
    state = PipelineState(stages, transfer_s, start)
    waiting = sorted(requests, key=lambda r: r.arrival_s)
    live: list[_Live] = []
    leaving: list[float] = []  # when finished requests' last steps come back (KV freed)
    order: list[ScheduledMicroBatch] = []
    next_slot = 0
    now = start

    def room() -> bool:
        return max_running is None or len(live) + sum(t > now for t in leaving) < max_running

    while waiting or live:
        now = max(now, state.done[0])
        # Admission, first come first served, within max_running.
        while waiting and waiting[0].arrival_s <= now and room():
            entry = _Live(waiting.pop(0), ready_at=now)
            counts = [sum(1 for x in live if x.slot == s) for s in range(stages)]
            entry.slot = counts.index(min(counts))
            live.append(entry)
        if policy == "slots":
            mb, next_slot = _form_slot(live, now, stages, next_slot)
        else:
            mb = _form_lookahead(costs, live, now, stages, max_micro_batch_s, cut_prefills)
        if not mb:
            # Nothing ready: stage 0 waits for the earliest return, arrival or freed room.
            events = [x.ready_at for x in live] + [t for t in leaving if waiting]
            if waiting:
                events.append(waiting[0].arrival_s)
            later = [t for t in events if t > now]
            if not later:
                raise AssertionError("pipeline stalled with work left")  # unreachable
            now = min(later)
            continue
        seconds = micro_batch_seconds(costs, mb)
        enter = max(now, state.done[0])
        # Dependencies are this loop's (only ready requests are placed), so no rids here.
        back = state.submit(StagedMicroBatch(0, frozenset(),
                                             tuple(seconds * s for s in layer_shares)), now)
        order.append(ScheduledMicroBatch(enter, back, mb))
        by_rid = {x.req.rid: x for x in live}
        for item in mb:
            entry = by_rid[item.rid]
            if entry.prefilled < entry.req.prompt_tokens:
                entry.prefilled += item.new_tokens
                if entry.prefilled == entry.req.prompt_tokens:
                    entry.produced, entry.ready_at = 1, back
                else:  # the next chunk may follow in the next micro-batch
                    entry.ready_at = now
            else:
                entry.produced += 1
                entry.ready_at = back
            if entry.finished:
                leaving.append(back)
        live = [x for x in live if not x.finished]
        leaving = [t for t in leaving if t > now]
    return PipelineRun(state.done[-1] - start, state.busy_s, stages), order


def _form_slot(live: list[_Live], now: float, stages: int,
               next_slot: int) -> tuple[MicroBatch, int]:
    """The next slot in turn with live members, once all of them are back."""
    for k in range(stages):
        slot = (next_slot + k) % stages
        members = [x for x in live if x.slot == slot]
        if not members:
            continue
        if any(x.ready_at > now for x in members):
            return (), next_slot  # its previous micro-batch is not back: stage 0 waits
        return tuple(x.next_item() for x in members), (slot + 1) % stages
    return (), next_slot


def _form_lookahead(costs: PhaseCosts, live: list[_Live], now: float, stages: int,
                    max_micro_batch_s: float, cut_prefills: bool = True) -> MicroBatch:
    # Earliest back first; among requests back at once the shortest rest first, so a burst's
    # first micro-batch (which the next stage waits for) is small.
    ready = sorted((x for x in live if x.ready_at <= now),
                   key=lambda x: (x.ready_at, x.next_item().new_tokens))
    if not ready:
        return ()
    # A round: every live request's step, a prefill counted whole (not only its rest, or the
    # target would shrink with each piece and cut the tail of a prompt ever finer).
    round_items = [BatchItem(x.req.rid, 0, x.req.prompt_tokens)
                   if x.prefilled < x.req.prompt_tokens else x.next_item() for x in live]
    model = costs.model([i.chunk() for i in round_items])
    target = min(max_micro_batch_s,
                 sum(model.chunk_seconds(i.chunk()) for i in round_items) / stages)
    ready_s = sum(model.chunk_seconds(x.next_item().chunk()) for x in ready)
    soon = [x for x in live if now < x.ready_at < now + model.gamma_s]
    if soon and ready_s + sum(model.chunk_seconds(x.next_item().chunk())
                              for x in soon) <= target * 1.05:
        # Requests that would still fit this micro-batch come back sooner than a micro-batch
        # of their own would cost in overhead: wait for them rather than split the round
        # into more micro-batches than stages.
        return ()
    out: list[BatchItem] = []
    filled = 0.0
    for x in ready:
        item = x.next_item()
        cost = model.chunk_seconds(item.chunk())
        if filled + cost <= target:
            out.append(item)
            filled += cost
            continue
        if item.new_tokens > 1 and not cut_prefills:
            if not out:
                out.append(item)  # whole, even over the target
        elif item.new_tokens > 1:
            # A prefill that overshoots is cut where the micro-batch reaches the target (an
            # empty micro-batch takes at least one token, so the loop always advances).
            c = min(_tokens_for_cost(model, item.cached_tokens, target - filled),
                    item.new_tokens)
            cut = x.next_item(max_new=c)
            if not out or filled + model.chunk_seconds(cut.chunk()) <= target:
                out.append(cut)
        elif not out or target - filled > filled + cost - target:
            out.append(item)  # a decode step: where it overshoots less than it leaves short
        break
    return tuple(out)
