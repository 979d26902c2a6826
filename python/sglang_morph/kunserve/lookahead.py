"""Micro-batches for a merged group's pipeline, and the pipeline's bubbles.

A group of ``S`` members runs its batch as ``K`` micro-batches through ``S`` stages; stage ``j``
of a micro-batch takes the micro-batch's whole-model cost times the share of layers the stage
holds (plus an activation transfer to the next stage). When micro-batches cost different
amounts, the cheap ones wait on the expensive ones and stages idle: the pipeline bubble.

- ``by_request_count``: the batch cut into ``K`` runs of (nearly) equal request counts, in
  order, no request split (what a pipeline does without a cost model, e.g. SGLang's
  ``--pp-max-micro-batch-size``).
- ``by_lookahead``: KunServe's lookahead: with the chunk cost model, every micro-batch gets
  the same cost. Requests are placed in order; a prefill that would overshoot the target is cut
  where the micro-batch reaches it (the cost of a chunk is quadratic in its tokens, solved
  exactly) and its rest goes first into the next micro-batch, behind the part already placed
  (its cached tokens grow by the first part, which the cost model accounts for). Decode steps
  (one token) are never cut. Within a micro-batch, chunk order does not matter.

``pipeline_schedule`` runs micro-batches through the stages (a stage works on one micro-batch
at a time, in order; a request's next iteration waits for its previous one to leave the last
stage) and returns the makespan; ``bubble_share`` is the idle share of the stages' time,
``1 - busy / (S x makespan)``. ``serve_batch_bubbles`` serves a whole batch (one prefill
iteration, then decode iterations) that way, once per splitter, re-splitting every iteration.
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


def by_request_count(items: Sequence[BatchItem], k: int) -> tuple[MicroBatch, ...]:
    if k < 1:
        raise ValueError(f"need at least one micro-batch, got {k}")
    base, extra = divmod(len(items), k)
    out, start = [], 0
    for j in range(k):
        stop = start + base + (1 if j < extra else 0)
        out.append(tuple(items[start:stop]))
        start = stop
    return tuple(mb for mb in out if mb)


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
    prefill makes its parts cheaper than the whole, by ``alpha * c1 * c2``: the second part's
    attention no longer counts the first as new tokens, so ``total / k`` overshoots.)

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
    lo, hi = 0.0, total / k
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


SPLITTERS = ("by_request_count", "lookahead")


def split(name: str, items: Sequence[BatchItem], k: int, costs: PhaseCosts) -> tuple[MicroBatch, ...]:
    if name == "by_request_count":
        return by_request_count(items, k)
    if name == "lookahead":
        return by_lookahead(items, k, costs)
    raise ValueError(f"unknown splitter {name!r}; choose from {SPLITTERS}")


def serve_batch_bubbles(costs: PhaseCosts, prompts: Sequence[tuple[str, int, int]],
                        layer_shares: Sequence[float], micro_batches: int | None = None,
                        transfer_s: float = 0.0,
                        join_every: int | None = None) -> dict[str, PipelineRun]:
    """Serve a batch to completion through the pipeline, once per splitter.

    ``prompts``: (rid, prompt tokens, output tokens), in arrival order. With ``join_every``
    None every prompt is prefilled in iteration 0; with ``n``, request ``i`` joins at iteration
    ``i * n`` and its prefill runs in one forward with the others' decode steps (SGLang's
    mixed chunk), which is where micro-batches of equal request counts differ most in cost.
    A prefill yields the request's first token; each later iteration decodes one token of
    every request that still has tokens to produce. Every iteration is re-split into
    ``micro_batches`` (default: one per stage, the fewest that keep every stage busy).
    """
    k = micro_batches or len(layer_shares)
    out = {}
    for name in SPLITTERS:
        staged: list[StagedMicroBatch] = []
        join = {rid: (0 if join_every is None else i * join_every)
                for i, (rid, _, _) in enumerate(prompts)}
        prompt = {rid: p for rid, p, _ in prompts}
        left = {rid: o for rid, _, o in prompts}
        produced = {rid: 0 for rid, _, _ in prompts}
        iteration = 0
        while left:
            items = [BatchItem(rid, 0, prompt[rid]) if produced[rid] == 0
                     else BatchItem(rid, prompt[rid] + produced[rid] - 1, 1)
                     for rid in left if join[rid] <= iteration]
            if items:
                staged += stage_micro_batches(costs, iteration, split(name, items, k, costs),
                                              layer_shares)
            for item in items:
                produced[item.rid] += 1
                if produced[item.rid] == left[item.rid]:
                    del left[item.rid]
            iteration += 1
        out[name] = pipeline_schedule(staged, transfer_s)
    return out
