"""KunServe's engine-agnostic pieces: drop planner, chunk cost model, lookahead
micro-batching, controller policy and the cluster simulation. Pure Python, no server."""

from __future__ import annotations

import dataclasses
import math
import random

import networkx as nx
import numpy as np
import pytest

from sglang_morph.kunserve.controller import (
    ArrivalMeter,
    StepCostMeter,
    ClusterView,
    ControllerConfig,
    Drop,
    KunServeController,
    KvCentric,
    ReplicaSnapshot,
    Restore,
    queue_waits,
)
from sglang_morph.kunserve.cost import (
    KUNSERVE_TERMS,
    TORCH_NATIVE_TERMS,
    Chunk,
    ChunkCostModel,
    ForwardTiming,
    OnlineChunkCost,
    PhaseCosts,
    balanced_bounds,
    fit_chunk_cost,
    range_chunks,
    relative_errors,
)
from sglang_morph.kunserve.lookahead import (
    POLICIES,
    BatchItem,
    PipelineRequest,
    StagedMicroBatch,
    by_lookahead,
    micro_batch_seconds,
    pipeline_schedule,
    serve_pipeline,
)
from sglang_morph.kunserve.planner import (
    DropPlan,
    DropPlannerConfig,
    KvCentricFallback,
    LiveRequest,
    ReplicaDemand,
    RestorePlan,
    RestoreRefused,
    make_group,
    plan_drop,
    plan_restore,
    split_layers,
)
from sglang_morph.models.memory import MemoryModel, full_precision_layers
from sglang_morph.models.spec import SIMULATED_MODELS, ModelSpec
from sglang_morph.models.workload import Workload

BUDGET_BYTES = 365_000_000  # SmolLM2-135M whole: ~270 MB of weights + ~4k KV tokens


@pytest.fixture(scope="module")
def spec(default_model_path) -> ModelSpec:
    return ModelSpec.from_model_dir(default_model_path)


@pytest.fixture(scope="module")
def planner(spec) -> DropPlannerConfig:
    return DropPlannerConfig(MemoryModel.from_spec(spec, bits=(16,)), BUDGET_BYTES)


# ---- planner: exact bytes -----------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 7, 15, 29])
def test_two_member_group_frees_exactly_what_the_memory_model_says(spec, planner, k):
    """A keeps [0, k), B keeps [k, L): freed bytes equal models/memory.py's stage bytes, and
    the same bytes derived by hand from the layer shapes (tied head: neither drops it)."""
    memory, layers = planner.memory, spec.num_layers
    whole = memory.model_weight_bytes(full_precision_layers(layers))
    a, b = planner.member(0, range(0, k)), planner.member(1, range(k, layers))
    w = Workload(1, 1, 1)
    assert a.freed_bytes == whole - memory.stage_memory(
        range(0, k), full_precision_layers(k), w, True, False).weight_bytes
    assert b.freed_bytes == whole - memory.stage_memory(
        range(k, layers), full_precision_layers(layers - k), w, False, True).weight_bytes
    layer_bytes = spec.layer_linear_bytes(16) + spec.norm_bytes_per_layer
    assert spec.tie_word_embeddings  # the default model: B keeps a copy of the embedding as head
    assert a.freed_bytes == (layers - k) * layer_bytes + spec.hidden_size * spec.dtype_bytes
    assert b.freed_bytes == k * layer_bytes
    for m in (a, b):
        m.check_integrity()
        per_token = len(m.layers) * spec.kv_bytes_per_token_per_layer()
        assert m.kv_bytes_per_token == per_token
        assert m.kv_capacity_tokens == (BUDGET_BYTES - m.budget.weight_bytes) // per_token
        assert m.budget.kv_bytes == m.kv_capacity_tokens * per_token <= m.budget.total_bytes - m.budget.weight_bytes


def test_a_live_group_counts_the_embedding_on_every_member(spec, planner):
    """Live, every member embeds and samples its own requests: with ``members_keep_embedding``
    a middle stage keeps the embedding (tied head) beside its layers and frees that much less,
    and a pair keeps exactly what it kept without the option."""
    live = dataclasses.replace(planner, members_keep_embedding=True)
    layers = spec.num_layers
    layer_bytes = spec.layer_linear_bytes(16) + spec.norm_bytes_per_layer
    norm = spec.hidden_size * spec.dtype_bytes
    four = make_group(live, (0, 1, 2, 3))
    paper = make_group(planner, (0, 1, 2, 3))
    for m, p in zip(four.members, paper.members):
        dropped = (layers - len(m.layers)) * layer_bytes
        last = m.layers.stop == layers
        assert m.freed_bytes == dropped + (0 if last else norm)
        m.check_integrity()
        middle = m.layers.start > 0 and not last
        assert m.freed_bytes == p.freed_bytes - (spec.embedding_bytes if middle else 0)
    assert make_group(live, (0, 1)) == make_group(planner, (0, 1))


def test_untied_head_and_pages(spec):
    """An untied model: the first member drops the LM head, the last drops the embedding;
    capacities are whole pages."""
    llama = SIMULATED_MODELS["llama-2-13b"]
    cfg = DropPlannerConfig(MemoryModel.from_spec(llama, bits=(16,)), 40 * 10**9,
                            page_size_tokens=16)
    a, b = cfg.member(0, range(0, 20)), cfg.member(1, range(20, 40))
    layer = llama.layer_linear_bytes(16) + llama.norm_bytes_per_layer
    head = llama.embedding_bytes + llama.hidden_size * llama.dtype_bytes
    assert a.freed_bytes == 20 * layer + head
    assert b.freed_bytes == 20 * layer + llama.embedding_bytes
    for m in (a, b):
        m.check_integrity(page_size_tokens=16)
        assert m.kv_capacity_tokens % 16 == 0


def test_split_layers_tiles_in_order():
    for layers in (1, 5, 30, 80):
        for members in range(1, min(layers, 9) + 1):
            ranges = split_layers(layers, members)
            assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
            assert ranges[0].start == 0 and ranges[-1].stop == layers
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_planner_config_rejects_a_budget_without_kv(spec):
    with pytest.raises(ValueError, match="no KV page"):
        DropPlannerConfig(MemoryModel.from_spec(spec, bits=(16,)), 200_000_000)


# ---- planner: greedy vs brute force ------------------------------------------------------


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


@pytest.mark.parametrize("seed", range(12))
def test_greedy_plan_holds_each_groups_demand(planner, seed):
    """Brute force over every partition of up to 6 replicas. A request stays with the replica
    it was sent to, so a partition holds when each group holds its own members' demand: every
    group of the greedy's plan does; where no partition holds, the greedy falls back with the
    shortfall of its deepest grouping; each merge joined an over-demand group with one of the
    smallest groups it could merge with."""
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    limit = rng.choice([2, 3, n])
    cfg = DropPlannerConfig(planner.memory, BUDGET_BYTES, max_group_size=limit)
    full = cfg.full_replica().kv_capacity_tokens
    used = [rng.randint(0, full) for _ in range(n)]
    view = [ReplicaDemand(r, u, u + rng.randint(0, rng.choice([2, 6]) * full))
            for r, u in enumerate(used)]
    wanted = {d.replica: d.kv_demand_tokens for d in view}

    def holds(group):
        return sum(wanted[r] for r in group) <= make_group(cfg, sorted(group)).capacity_tokens

    exists = any(max(map(len, part)) <= limit and all(map(holds, part))
                 for part in _partitions(list(range(n))))
    plan = plan_drop(cfg, view)
    if isinstance(plan, KvCentricFallback):
        assert plan.shortfall_tokens > 0
        deepest = plan.deepest.groups if plan.deepest else [make_group(cfg, (r,)) for r in range(n)]
        assert plan.shortfall_tokens == sum(
            sum(wanted[r] for r in g.replicas) - g.capacity_tokens for g in deepest
            if not holds(g.replicas))
    else:
        assert exists and all(holds(g.replicas) for g in plan.groups)
        assert max(g.size for g in plan.groups) <= limit
    if not exists:
        assert isinstance(plan, KvCentricFallback)
    merges = plan.merges if isinstance(plan, DropPlan) else (
        plan.deepest.merges if plan.deepest else ())
    groups = [(r,) for r in range(n)]
    for a, b in merges:
        assert a in groups and b in groups and not holds(a)  # a: the over-demand group
        assert len(b) == min(len(g) for g in groups if g != a and len(g) + len(a) <= limit)
        groups = [g for g in groups if g not in (a, b)] + [tuple(sorted(a + b))]


def test_overloaded_replicas_merge_together_and_idle_ones_stay_whole(planner):
    """Round-robin DP puts the queue on some replicas: the total fits the four pools, yet two
    replicas cannot admit theirs. Those two merge with each other (best fit), the idle ones
    keep serving whole; one overloaded replica alone takes one partner only."""
    full = planner.full_replica().kv_capacity_tokens
    pair = make_group(planner, (0, 1)).capacity_tokens
    assert 2 * (full + full // 4) <= pair
    busy = [ReplicaDemand(0, 0, full + full // 4), ReplicaDemand(1, 0, full + full // 4),
            ReplicaDemand(2, 0, 10), ReplicaDemand(3, 0, 10)]
    assert sum(d.kv_demand_tokens for d in busy) < 4 * full  # an aggregate check sees no need
    plan = plan_drop(planner, busy)
    assert [g.replicas for g in plan.groups] == [(0, 1), (2,), (3,)]
    one = plan_drop(planner, [ReplicaDemand(0, 0, 10), ReplicaDemand(1, 0, 2 * full),
                              ReplicaDemand(2, 0, full // 2)])
    assert one.merges == (((1,), (2,)),)  # best fit: the busier of the two that hold it
    assert sorted(g.replicas for g in one.groups) == [(0,), (1, 2)]


def test_merge_order_two_smallest_first(planner):
    full = planner.full_replica().kv_capacity_tokens
    view = [ReplicaDemand(r, 0, 2 * full) for r in range(4)]
    plan = plan_drop(planner, view)
    assert plan.merges == (((0,), (1,)), ((2,), (3,)))
    assert [g.replicas for g in plan.groups] == [(0, 1), (2, 3)]
    assert plan.freed_bytes == sum(m.freed_bytes for g in plan.groups for m in g.members)
    # Live KV of the dropped layers leaves each member: used x dropped layers x per layer.
    no_live = plan_drop(planner, [ReplicaDemand(r, 100, 2 * full) for r in range(4)])
    per_layer = planner.kv_bytes_per_token_per_layer
    assert no_live.kv_migration_bytes == {r: 100 * 15 * per_layer for r in range(4)}


def test_no_drop_needed_and_no_plan_fallbacks(planner):
    full = planner.full_replica().kv_capacity_tokens
    calm = plan_drop(planner, [ReplicaDemand(r, 10, full) for r in range(3)])
    assert isinstance(calm, DropPlan) and not calm.merges
    assert all(g.size == 1 for g in calm.groups)
    huge = plan_drop(DropPlannerConfig(planner.memory, BUDGET_BYTES, max_group_size=2),
                     [ReplicaDemand(r, 0, 100 * full) for r in range(4)])
    assert isinstance(huge, KvCentricFallback)
    assert huge.deepest is not None and all(g.size == 2 for g in huge.deepest.groups)
    assert huge.best_capacity_tokens == huge.deepest.capacity_tokens < huge.demand_tokens
    alone = plan_drop(DropPlannerConfig(planner.memory, BUDGET_BYTES, max_group_size=1),
                      [ReplicaDemand(r, 0, 2 * full) for r in range(2)])
    assert isinstance(alone, KvCentricFallback) and alone.deepest is None
    with pytest.raises(ValueError):
        plan_drop(planner, [ReplicaDemand(0, 1, 2), ReplicaDemand(0, 1, 2)])
    with pytest.raises(ValueError):
        ReplicaDemand(0, 5, 4)


def test_restore_homes_every_request_or_refuses(planner):
    group = make_group(planner, (0, 1))
    full = planner.full_replica().kv_capacity_tokens
    live = [LiveRequest(f"r{i}", full // 3) for i in range(5)]
    plan = plan_restore(planner, group, live)
    assert isinstance(plan, RestorePlan)
    assert set(plan.home) == {r.rid for r in live}
    for m in plan.restored:
        assert sum(r.kv_tokens for r in live if plan.home[r.rid] == m.replica) <= m.kv_capacity_tokens
        assert m.layers == range(planner.num_layers)
    too_many = [LiveRequest(f"r{i}", full // 3 + 1) for i in range(6)]
    assert isinstance(plan_restore(planner, group, too_many), RestoreRefused)
    # Fits in total but not per replica: a request's KV cannot be split.
    halves = [LiveRequest("a", full // 2 + 1), LiveRequest("b", full // 2 + 1),
              LiveRequest("c", full // 2 + 1)]
    assert isinstance(plan_restore(planner, group, halves), RestoreRefused)
    # Owned requests stay with their owner, even where packing freely would fit.
    owned = [LiveRequest("a", full // 2, owner=1), LiveRequest("b", full // 2, owner=1),
             LiveRequest("c", full // 2)]
    plan = plan_restore(planner, group, owned)
    assert plan.home == {"a": 1, "b": 1, "c": 0}
    assert plan.kv_inbound_bytes[1] == 2 * (full // 2) * 15 * planner.kv_bytes_per_token_per_layer
    crowded = owned + [LiveRequest("d", 2, owner=1)]
    assert isinstance(plan_restore(planner, group, crowded), RestoreRefused)
    with pytest.raises(ValueError, match="owner"):
        plan_restore(planner, group, [LiveRequest("x", 1, owner=7)])


# ---- cost model ----------------------------------------------------------------------------


def _synthetic(model: ChunkCostModel, rng, noise: float, n: int = 60, decode: bool = False):
    out = []
    for _ in range(n):
        b = rng.choice([1, 2, 4])
        if decode:
            chunks = tuple(Chunk(rng.randint(16, 4000), 1) for _ in range(b))
        else:
            chunks = tuple(Chunk(rng.choice([0, 64, 512, 2048]), rng.choice([16, 128, 1024]))
                           for _ in range(b))
        seconds = model.seconds(chunks) * (1 + rng.uniform(-noise, noise))
        out.append(ForwardTiming(chunks, seconds))
    return out


@pytest.mark.parametrize("decode", [False, True])
def test_fit_recovers_known_coefficients(decode):
    truth = ChunkCostModel(3e-9, 4e-5, 0.012) if not decode else ChunkCostModel(2e-7, 1e-3, 0.03)
    rng = random.Random(1)
    exact = fit_chunk_cost(_synthetic(truth, rng, 0.0, decode=decode))
    assert np.allclose(exact.coefficients, truth.coefficients, rtol=1e-6)
    noisy_points = _synthetic(truth, rng, 0.02, decode=decode)
    noisy = fit_chunk_cost(noisy_points)
    assert np.allclose(noisy.coefficients, truth.coefficients, rtol=0.15)
    assert relative_errors(noisy, noisy_points).mean() < 0.02
    # With p^2 and p terms (a backend that pads the query over the prefix, as torch_native),
    # the 5-term fit recovers them and KunServe's 3 terms, which cannot, fit worse.
    backend = ChunkCostModel(3e-9, 4e-5, 0.012, 2e-7, 3e-5)
    points = _synthetic(backend, rng, 0.0)
    assert np.allclose(fit_chunk_cost(points, TORCH_NATIVE_TERMS).coefficients,
                       backend.coefficients, rtol=1e-6)
    assert (relative_errors(fit_chunk_cost(points), points).mean()
            > relative_errors(fit_chunk_cost(points, TORCH_NATIVE_TERMS), points).mean() + 0.05)
    # A term left out stays exactly 0.
    assert fit_chunk_cost(points, KUNSERVE_TERMS + ("delta_s",)).epsilon_s == 0.0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 3"):
        fit_chunk_cost([ForwardTiming((Chunk(0, 16),), 0.1)] * 2)
    with pytest.raises(ValueError, match="subset"):
        fit_chunk_cost([ForwardTiming((Chunk(0, 16),), 0.1)] * 5, ("alpha_s", "zeta_s"))
    with pytest.raises(ValueError, match="do not vary"):
        fit_chunk_cost([ForwardTiming((Chunk(0, 16),), 0.1)] * 5)
    with pytest.raises(ValueError, match="phases"):
        fit_chunk_cost([ForwardTiming((Chunk(0, 16),), 0.1), ForwardTiming((Chunk(5, 1),), 0.1),
                        ForwardTiming((Chunk(0, 64),), 0.2)])
    with pytest.raises(ValueError, match="seconds > 0"):
        ForwardTiming((Chunk(0, 16),), 0.0)
    with pytest.raises(ValueError, match="seconds > 0"):
        ForwardTiming((Chunk(0, 16),), float("nan"))
    with pytest.raises(ValueError, match="mixes"):
        ForwardTiming((Chunk(0, 16), Chunk(10, 1)), 0.1)
    with pytest.raises(ValueError):
        Chunk(-1, 4)
    with pytest.raises(ValueError):
        Chunk(0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        ChunkCostModel(-1e-9, 0.0, 0.0)


def test_range_chunks_keep_each_requests_earlier_tokens_as_prefix():
    batch = [Chunk(10, 5), Chunk(0, 3), Chunk(7, 4)]  # new tokens laid end to end: 12
    assert range_chunks(batch, 0, 12) == tuple(batch)
    assert range_chunks(batch, 3, 9) == (Chunk(13, 2), Chunk(0, 3), Chunk(7, 1))
    assert range_chunks(batch, 5, 8) == (Chunk(0, 3),)
    assert range_chunks(batch, 4, 4) == ()
    # the ranges of any cut add up to the batch's new tokens, request by request
    cut = [range_chunks(batch, a, b) for a, b in ((0, 4), (4, 9), (9, 12))]
    assert sum(ch.new_tokens for part in cut for ch in part) == 12


def _brute_force_bounds(chunks, k, model, min_tokens):
    """Every cut of the batch into k ranges of at least min_tokens: the least slowest range."""
    import itertools

    total = sum(ch.new_tokens for ch in chunks)
    best = math.inf
    for inner in itertools.combinations(range(min_tokens, total - min_tokens + 1), k - 1):
        bounds = (0, *inner, total)
        if min(b - a for a, b in zip(bounds, bounds[1:])) < min_tokens:
            continue
        best = min(best, max(model.seconds(range_chunks(chunks, a, b))
                             for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_bounds_find_the_least_slowest_range(seed):
    rng = random.Random(seed)
    model = ChunkCostModel(rng.uniform(1e-7, 2e-6), rng.uniform(1e-5, 2e-4), rng.uniform(0, 0.02))
    chunks = [Chunk(rng.choice([0, rng.randrange(1, 64)]), rng.randrange(1, 16))
              for _ in range(rng.randrange(1, 4))]
    total = sum(ch.new_tokens for ch in chunks)
    k = rng.randrange(1, min(4, total) + 1)
    min_tokens = rng.randrange(1, total // k + 1)
    bounds = balanced_bounds(chunks, k, model, min_tokens)
    assert bounds[0] == 0 and bounds[-1] == total and len(bounds) == k + 1
    assert all(b - a >= min_tokens for a, b in zip(bounds, bounds[1:]))
    slowest = max(model.seconds(range_chunks(chunks, a, b)) for a, b in zip(bounds, bounds[1:]))
    optimum = _brute_force_bounds(chunks, k, model, min_tokens)
    assert optimum <= slowest <= optimum * (1 + 1e-3)


def test_balanced_bounds_cut_a_prompt_shorter_where_it_attends_over_more():
    model = ChunkCostModel(8e-7, 2e-4, 0.01)
    prompt = [Chunk(0, 384)]
    bounds = balanced_bounds(prompt, 4, model, 64)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    costs = [model.seconds(range_chunks(prompt, a, b)) for a, b in zip(bounds, bounds[1:])]
    equal = [model.seconds(range_chunks(prompt, 96 * j, 96 * (j + 1))) for j in range(4)]
    assert max(costs) < max(equal) and max(costs) - min(costs) < 0.02 * max(costs)
    # without attention cost, equal cost is equal tokens
    assert balanced_bounds(prompt, 4, ChunkCostModel(0.0, 2e-4, 0.01), 64) == [0, 96, 192, 288,
                                                                                384]
    with pytest.raises(ValueError, match="do not fit"):
        balanced_bounds(prompt, 4, model, 100)


def test_online_cost_fits_stage_timings_as_they_arrive():
    truth = ChunkCostModel(6e-7, 1.5e-4, 0.004)
    online = OnlineChunkCost(window=64, min_timings=12, refit_every=8)
    rng = random.Random(3)
    online.observe([Chunk(40, 1)], 0.01)  # a decode row: not kept
    online.observe([Chunk(0, 64), Chunk(40, 1)], 0.02)  # prefill and decode together: neither
    for i in range(11):
        online.observe([Chunk(0, 64)], truth.seconds([Chunk(0, 64)]))
    assert online.model is None  # 11 timings, and all the same size
    for i in range(40):
        chunk = [Chunk(rng.randrange(0, 300), rng.randrange(16, 200))]
        online.observe(chunk, truth.seconds(chunk))
    assert online.observed == 51 and len(online.timings) == 51 and online.fits >= 4
    assert np.allclose(online.model.coefficients, truth.coefficients, rtol=1e-6)
    with pytest.raises(ValueError):
        OnlineChunkCost(window=8, min_timings=12)


class _Mode:
    """Stands in for SGLang's ForwardMode (importing SGLang would cost this pure module ~10 s);
    the three members and methods the timing hook reads."""

    def __init__(self, name: str):
        self.name = name

    def is_decode(self) -> bool:
        return self.name == "DECODE"

    def is_extend(self) -> bool:
        return self.name in ("EXTEND", "MIXED")


def test_forward_timings_log_the_chunks_sglang_ran(tmp_path, monkeypatch):
    import json
    import time
    from types import SimpleNamespace

    import torch

    from sglang_morph.kunserve.live import forward_timings

    monkeypatch.delenv(forward_timings.ENV, raising=False)
    assert forward_timings.hooks() == ()  # nothing hooked unless asked for
    path = tmp_path / "t.jsonl"
    monkeypatch.setenv(forward_timings.ENV, str(path))
    (hook,) = forward_timings.hooks()
    assert (hook.target, hook.kind) == (forward_timings.HOOK_RUNNER_FORWARD, "AROUND")
    runner = SimpleNamespace(is_draft_worker=False, device="cpu")
    calls = []

    def forward(runner_, batch, *args, **kwargs):
        calls.append((batch, args, kwargs))
        time.sleep(0.02)
        return "logits"

    extend = SimpleNamespace(forward_mode=_Mode("EXTEND"), extend_prefix_lens_cpu=[0, 512],
                             extend_seq_lens_cpu=[64, 16])
    decode = SimpleNamespace(forward_mode=_Mode("DECODE"), seq_lens_cpu=torch.tensor([10, 300]))
    idle = SimpleNamespace(forward_mode=_Mode("IDLE"))
    assert hook.fn(forward, runner, extend, 1, flag=True) == "logits"
    assert calls[0][1:] == ((1,), {"flag": True})  # SGLang's arguments passed through
    hook.fn(forward, runner, decode)
    hook.fn(forward, runner, idle)
    hook.fn(forward, SimpleNamespace(is_draft_worker=True, device="cpu"), extend)  # not logged
    after = time.time()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # Each line's start, in order, one forward's time apart at least (a scheduler's gaps).
    starts = [r["t"] for r in lines]
    assert starts == sorted(starts) and starts[-1] + lines[-1]["seconds"] <= after
    assert starts[1] - starts[0] >= lines[0]["seconds"]
    assert [(r["mode"], r["cached"], r["new"]) for r in lines] == [
        ("extend", [0, 512], [64, 16]), ("decode", [9, 299], [1, 1]), ("idle", [], [])]
    assert all(0.02 <= r["seconds"] < 1.0 for r in lines)


def test_phase_costs_round_trip(tmp_path):
    costs = PhaseCosts(ChunkCostModel(1e-9, 1e-4, 0.01), ChunkCostModel(1e-7, 1e-3, 0.02), "x")
    assert PhaseCosts.from_json(costs.to_json()) == costs
    assert costs.seconds([Chunk(100, 1), Chunk(5, 1)]) == costs.decode.seconds(
        [Chunk(100, 1), Chunk(5, 1)])
    assert costs.seconds([Chunk(0, 8)]) == costs.prefill.seconds([Chunk(0, 8)])


# ---- lookahead ------------------------------------------------------------------------------

COSTS = PhaseCosts(ChunkCostModel(2e-8, 1e-4, 5e-3), ChunkCostModel(1e-7, 2e-4, 2e-2))
# A backend that pads a chunk's prefix (torch_native): cutting a prefill adds work.
PADDED = PhaseCosts(ChunkCostModel(2e-8, 1e-4, 5e-3, 2e-8, 2e-5), COSTS.decode)
COSTS_KUNSERVE = COSTS


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("costs", [COSTS, PADDED], ids=["kunserve", "padded"])
def test_lookahead_places_every_token_once_in_order_and_balances(seed, costs):
    COSTS = costs  # noqa: N806 (the body reads the module's name)
    costs_model = costs
    rng = random.Random(seed)
    items = [BatchItem(f"r{i}", 0, rng.randint(16, 2000)) for i in range(rng.randint(2, 12))]
    for k in (2, 3, 4):
        mbs = by_lookahead(items, k, COSTS)
        assert len(mbs) <= k
        seen: dict[str, int] = {}
        for mb in mbs:
            for it in mb:
                assert it.cached_tokens == seen.get(it.rid, 0)  # chunks contiguous, in order
                seen[it.rid] = it.cached_tokens + it.new_tokens
        assert seen == {it.rid: it.new_tokens for it in items}
        costs = [micro_batch_seconds(COSTS, mb) for mb in mbs]
        total = sum(micro_batch_seconds(COSTS, (it,)) - COSTS.prefill.gamma_s for it in items)
        if total > 20 * k * COSTS.prefill.gamma_s:  # a batch big enough to cut k ways
            assert len(mbs) == k
            # On a padded backend a cut's cost jumps when it moves onto a request boundary
            # (no prefix to pad), so an exact balance may not exist: placement only.
            if costs_model is COSTS_KUNSERVE:
                assert max(costs) / min(costs) < 1.05


def _reference_makespan(mbs: list[StagedMicroBatch], transfer_s: float) -> float:
    """Longest path through the dependency graph (networkx), independent of PipelineState."""
    g = nx.DiGraph()
    stages = len(mbs[0].stage_seconds)
    for i, mb in enumerate(mbs):
        for j, t in enumerate(mb.stage_seconds):
            g.add_edge(("s", i, j), ("e", i, j), weight=t)
            if j:
                g.add_edge(("e", i, j - 1), ("s", i, j), weight=transfer_s)
            if i:
                g.add_edge(("e", i - 1, j), ("s", i, j), weight=0.0)
        for prev in range(i):
            if mbs[prev].iteration < mb.iteration and mbs[prev].rids & mb.rids:
                g.add_edge(("e", prev, stages - 1), ("s", i, 0), weight=transfer_s)
    return nx.dag_longest_path_length(g, weight="weight")


@pytest.mark.parametrize("seed", range(5))
def test_pipeline_schedule_matches_a_longest_path_reference(seed):
    rng = random.Random(seed)
    mbs = []
    for it in range(4):
        for k in range(rng.randint(1, 3)):
            rids = frozenset(rng.sample(["a", "b", "c", "d"], rng.randint(1, 3)))
            mbs.append(StagedMicroBatch(it, rids, tuple(rng.uniform(0.01, 0.1) for _ in range(2))))
    transfer = rng.choice([0.0, 0.005])
    run = pipeline_schedule(mbs, transfer)
    assert run.makespan_s == pytest.approx(_reference_makespan(mbs, transfer))
    busy = sum(sum(mb.stage_seconds) for mb in mbs)
    assert run.bubble_share == pytest.approx(1 - busy / (2 * run.makespan_s))


def test_bubble_share_closed_form():
    # K equal micro-batches of t on S stages, one iteration: bubble (S-1)/(K+S-1).
    mbs = [StagedMicroBatch(0, frozenset({str(i)}), (0.1, 0.1, 0.1)) for i in range(4)]
    assert pipeline_schedule(mbs).bubble_share == pytest.approx(2 / 6)


def _random_requests(rng, n, spread_s):
    return [PipelineRequest(f"r{i}", rng.randint(1, 1500), rng.randint(1, 30),
                            rng.uniform(0, spread_s)) for i in range(n)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", POLICIES)
def test_serve_pipeline_runs_every_step_once_in_order_after_the_previous_came_back(seed, policy):
    rng = random.Random(seed)
    requests = _random_requests(rng, rng.randint(1, 12), rng.choice([0.0, 2.0]))
    max_running = rng.choice([None, 3])
    costs = rng.choice([COSTS, PADDED])
    cap = rng.choice([math.inf, 0.05])
    cut = rng.choice([True, False])
    transfer = 0.002
    run, order = serve_pipeline(costs, requests, [0.4, 0.6], policy, transfer, max_running, cap,
                                cut)
    by_rid = {r.rid: r for r in requests}
    steps: dict[str, list] = {r.rid: [] for r in requests}
    for mb in order:
        assert len({it.rid for it in mb.items}) == len(mb.items)  # one step per request
        assert mb.back_s > mb.enter_s
        for it in mb.items:
            steps[it.rid].append((it, mb.enter_s, mb.back_s))
    for rid, done in steps.items():
        r = by_rid[rid]
        prefill = [d for d in done if d[0].cached_tokens < r.prompt_tokens]
        decode = done[len(prefill):]
        assert done[0][1] >= r.arrival_s
        position = 0
        for it, _, _ in prefill:  # the prompt's chunks, contiguous, in order, once each
            assert it.cached_tokens == position
            position += it.new_tokens
        assert position == r.prompt_tokens
        if policy == "slots" or not cut:
            assert len(prefill) == 1  # a prompt is never cut
        assert [(it.cached_tokens, it.new_tokens) for it, _, _ in decode] == [
            (r.prompt_tokens + k - 1, 1) for k in range(1, r.output_tokens)]
        # Every decode step enters stage 0 after the previous step's token came back.
        for (_, _, back), (_, enter, _) in zip(done[len(prefill) - 1:], decode):
            assert enter >= back - 1e-12
    assert run.busy_s == pytest.approx(sum(micro_batch_seconds(costs, mb.items) for mb in order))
    assert run.makespan_s == pytest.approx(max(mb.back_s for mb in order) - transfer
                                           - min(r.arrival_s for r in requests))
    if max_running is not None:
        # At most max_running requests between their first step and their last token back.
        spans = [(min(e for _, e, _ in d), max(b for _, _, b in d)) for d in steps.values()]
        for start, _ in spans:
            assert sum(a <= start < b for a, b in spans) <= max_running


def test_lookahead_fills_the_bubbles_of_slots_and_cutting_has_a_price():
    # A long prompt next to short ones: its slot's micro-batches are far heavier, the other
    # slot's requests come back early and stage 0 waits; the lookahead balances the rounds.
    requests = [PipelineRequest("long", 3000, 40)] + [
        PipelineRequest(f"s{i}", 100, 40) for i in range(5)]
    slots, _ = serve_pipeline(COSTS, requests, [0.5, 0.5], "slots")
    ahead, _ = serve_pipeline(COSTS, requests, [0.5, 0.5], "lookahead")
    assert ahead.bubble_share < 0.75 * slots.bubble_share
    assert ahead.makespan_s < slots.makespan_s
    # On a padded-prefix backend, small pieces of a prefill re-read their prefix: fewer
    # bubbles, more work (why the benchmark reports the makespan next to the bubble share).
    whole, _ = serve_pipeline(PADDED, requests, [0.5, 0.5], "lookahead")
    pieces, _ = serve_pipeline(PADDED, requests, [0.5, 0.5], "lookahead", max_micro_batch_s=0.02)
    assert pieces.busy_s > 1.2 * whole.busy_s


def test_serve_pipeline_rejects_bad_input():
    one = [PipelineRequest("a", 10, 2)]
    with pytest.raises(ValueError, match="unknown policy"):
        serve_pipeline(COSTS, one, [0.5, 0.5], "fastest")
    with pytest.raises(ValueError, match="max_running"):
        serve_pipeline(COSTS, one, [0.5, 0.5], "slots", max_running=0)
    with pytest.raises(ValueError, match="unique"):
        serve_pipeline(COSTS, one * 2, [0.5, 0.5], "slots")
    with pytest.raises(ValueError, match="add up to 1"):
        serve_pipeline(COSTS, one, [0.5, 0.6], "slots")
    with pytest.raises(ValueError, match="output_tokens"):
        PipelineRequest("a", 10, 0)


# ---- controller ----------------------------------------------------------------------------


def _view(t, planner, used, waiting, groups=(), live=None, growth=None):
    full = planner.full_replica().kv_capacity_tokens
    snaps = []
    grouped = {r: g for g in groups for r in g.replicas}
    for r, (u, w) in enumerate(zip(used, waiting)):
        cap = grouped[r].capacity_tokens if r in grouped else full
        reqs = tuple(live[r]) if live else ()
        snaps.append(ReplicaSnapshot(r, cap, u, growth[r] if growth else 0, w, reqs))
    return ClusterView(t, tuple(snaps), tuple(groups))


def test_controller_drops_after_persisting_overload_only(planner):
    """A forecast overload (the running requests' remaining outputs would outgrow the pools)
    must persist for drop_persist views; a calm view in between restarts the count."""
    full = planner.full_replica().kv_capacity_tokens
    growing = dict(used=[full // 2] * 2, waiting=[0, 0], growth=[full, full])
    ctl = KunServeController(planner, ControllerConfig(drop_persist=2, min_dwell_s=0))
    assert ctl.decide(_view(0, planner, [full // 2] * 2, [0, 0])) is None
    assert ctl.decide(_view(1, planner, **growing)) is None  # first view over
    action = ctl.decide(_view(2, planner, **growing))
    assert isinstance(action, Drop) and "for 2 views" in action.reason
    assert [g.replicas for g in action.plan.groups] == [(0, 1)]
    ctl = KunServeController(planner, ControllerConfig(drop_persist=2, min_dwell_s=0))
    ctl.decide(_view(0, planner, **growing))
    ctl.decide(_view(1, planner, [10] * 2, [0, 0]))
    assert ctl.decide(_view(2, planner, **growing)) is None


def test_a_group_of_fours_controller_merges_as_few_members_as_hold_the_demand(planner):
    """Four replicas of one live group: one overloaded member merges with one other (the
    dwell then holds those two only); with that pair standing, another overloaded member
    merges with the one free replica left; a demand no pair holds merges three."""
    full = planner.full_replica().kv_capacity_tokens
    cfg = ControllerConfig(drop_persist=1, min_dwell_s=5)
    ctl = KunServeController(planner, cfg)
    action = ctl.decide(_view(0, planner, [full // 2] * 4, [full, 0, 0, 0]))
    assert [g.replicas for g in action.plan.groups] == [(0, 1), (2,), (3,)]
    assert "over replica 0's capacity" in action.reason
    ctl.applied(action, 0.0)
    assert ctl._dwelt([1], 4.0) is False and ctl._dwelt([2, 3], 0.0) is True

    pair = make_group(planner, (0, 1))
    view = _view(1, planner, [full // 2, full // 2, full // 2, full // 2], [0, 0, full, 0],
                 groups=(pair,))
    action = ctl.decide(view)
    assert [g.replicas for g in action.plan.groups] == [(2, 3)]

    # Replica 0 alone wants more than any pair holds: the greedy merges on to three.
    deep = pair.capacity_tokens + full
    action = KunServeController(planner, cfg).decide(
        _view(0, planner, [full // 2] * 4, [deep, 0, 0, 0]))
    merged = [g.replicas for g in action.plan.groups if g.size > 1]
    assert len(merged) == 1 and len(merged[0]) == 3 and 0 in merged[0], merged
    assert action.plan.group_of(0).capacity_tokens >= deep


def test_controller_drops_at_once_for_a_queue_the_pool_cannot_take(planner):
    """A queue that does not fit the replica's free KV now is no forecast: the first view
    drops, whatever drop_persist; a queue that fits waits for the persistence."""
    full = planner.full_replica().kv_capacity_tokens
    ctl = KunServeController(planner, ControllerConfig(drop_persist=3, min_dwell_s=0))
    action = ctl.decide(_view(0, planner, [full // 2, 0], [full // 2 + 1, 0]))
    assert isinstance(action, Drop) and "does not fit" in action.reason
    fits = KunServeController(planner, ControllerConfig(drop_persist=3, min_dwell_s=0))
    # queued 10 tokens fit next to full // 2 live; the growth makes the forecast over
    view = _view(0, planner, [full // 2, 0], [10, 0], growth=[full, 0])
    assert [fits.decide(view) for _ in range(2)] == [None, None]
    assert isinstance(fits.decide(view), Drop)


def test_controller_drops_at_once_for_a_queue_the_engine_refused(planner):
    """SGLang reserves room for the running requests' next tokens, so it can refuse a queue
    that the used tokens alone would fit: the engine's refusal is no forecast either. Without
    it (or without demand over the pool) the same view waits for drop_persist."""
    full = planner.full_replica().kv_capacity_tokens

    def view(refused: bool, growth: int = full):
        snaps = (ReplicaSnapshot(0, full, full // 2, growth, 100, queue_refused=refused),
                 ReplicaSnapshot(1, full, 0))
        return ClusterView(0, snaps)

    ctl = KunServeController(planner, ControllerConfig(drop_persist=3, min_dwell_s=0))
    action = ctl.decide(view(True))
    assert isinstance(action, Drop) and "its queue of 100 tokens was refused" in action.reason
    waits = KunServeController(planner, ControllerConfig(drop_persist=3, min_dwell_s=0))
    assert [waits.decide(view(False)) for _ in range(2)] == [None, None]
    assert "for 3 views" in waits.decide(view(False)).reason
    # A refusal while the forecast fits the pool (the engine's reservation is a guess): no drop.
    calm = KunServeController(planner, ControllerConfig(drop_persist=1, min_dwell_s=0))
    assert calm.decide(view(True, growth=0)) is None


def test_controller_waits_for_requests_about_to_finish_instead_of_dropping(planner):
    """A refused queue whose room comes back within finishing_steps decode steps (the KV of
    running requests at their end, ``kv_finishing_tokens``) is no overload: no drop, at once
    or after drop_persist views. Once the room is not coming back soon, the same view drops."""
    full = planner.full_replica().kv_capacity_tokens

    def view(finishing: int):
        snaps = (ReplicaSnapshot(0, full, full - 40, 40, 100, queue_refused=True,
                                 kv_finishing_tokens=finishing), ReplicaSnapshot(1, full, 0))
        return ClusterView(0, snaps)

    ctl = KunServeController(planner, ControllerConfig(drop_persist=2, min_dwell_s=0))
    assert view(200).replica(0).lasting_demand_tokens == full - 40 + 40 + 100 - 200
    assert [ctl.decide(view(200)) for _ in range(3)] == [None] * 3
    # What finishes soon is too little for the queue: the refusal drops at once.
    action = ctl.decide(view(60))
    assert isinstance(action, Drop) and "was refused" in action.reason
    with pytest.raises(ValueError, match="finishing requests hold more"):
        ReplicaSnapshot(0, full, 10, 5, 0, kv_finishing_tokens=16)
    with pytest.raises(ValueError, match="finishing_steps must be an integer >= 0"):
        ControllerConfig(finishing_steps=-1)


def test_queue_waits_by_hand():
    """A 100-token room: running requests reserving 30 (ends in 5 steps), 40 (12) and 20 (3),
    so 10 tokens are free now. Queued 25 (4 outputs): admitted when the 20 ends (3 steps; 30
    free), it ends at 7; then queued 30 (6 outputs) needs 30 with 5 free: the 30 ends (5; 35
    free), it ends at 11; then 40 (8 outputs) with 5 free: the queued 25 ends (7; 30), then
    the queued 30 (11; 60), before the running 40 (12); then 6 fits the 20 left, but not
    before the request ahead of it: 11 as well."""
    running = [(30, 5), (40, 12), (20, 3)]
    queued = [(25, 4), (30, 6), (40, 8), (6, 2)]
    assert queue_waits(100, running, queued) == [3, 5, 11, 11]
    assert sum(queue_waits(100, running, queued[:1])) == 3
    assert sum(queue_waits(100, running, queued)) == 3 + 5 + 11 + 11
    assert queue_waits(100, running, [(10, 1)]) == [0]  # fits now
    # Over the whole room: it never fits a whole replica, nor does anything behind it.
    assert queue_waits(100, running, [(25, 4), (101, 1), (6, 2)]) == [3, math.inf, math.inf]
    assert sum(queue_waits(100, running, [(101, 1)])) == math.inf
    assert queue_waits(100, [], []) == []
    # A queue longer than the pool drains as its own requests end: finite waits.
    assert queue_waits(100, [], [(60, 10)] * 3) == [0, 10, 20]


def test_arrival_meter_counts_each_request_once_per_forward_step():
    """A request is an arrival the first view it is seen in (queued or running); the rate is
    over the replica's forward steps since the window's start, and older arrivals leave it."""
    meter = ArrivalMeter(window_s=5.0)
    assert meter.update(0.0, 0, {}) == (0.0, 0.0)
    assert meter.update(1.0, 10, {"a": 100, "b": 300}) == (2 / 10, 400 / 10)
    # "a" admitted and still held, "b" finished, "c" new: one more arrival over 20 steps.
    assert meter.update(2.0, 20, {"a": 100, "c": 60}) == (3 / 20, 460 / 20)
    # At 6.5 s the window starts at 1.5 s: "a" and "b" (seen at 1.0 s) have left it; the
    # steps count from the view at 1.0 s, the newest at or before its start.
    assert meter.update(6.5, 50, {"c": 60}) == (1 / 40, 60 / 40)
    # No forward since the last view: the steps are still the window's 40.
    assert meter.update(6.6, 50, {"c": 60, "d": 10})[0] == 2 / 40
    with pytest.raises(ValueError, match="window_s must be positive"):
        ArrivalMeter(window_s=0)


def test_step_cost_meter_gives_prefill_tokens_per_decode_step():
    """The median of the latest decode steps' seconds times the latest prefills' tokens over
    their seconds; None until both kinds were seen; older forwards leave the window."""
    meter = StepCostMeter(window=3)
    assert meter.prefill_tokens_per_step() is None
    meter.record(False, 384, 1.1)
    assert meter.prefill_tokens_per_step() is None  # no decode step yet
    for seconds in (0.12, 0.08, 0.10):
        meter.record(True, 3, seconds)
    meter.record(False, 100, 0.3)
    assert meter.prefill_tokens_per_step() == pytest.approx(0.10 * 484 / 1.4)
    # Nothing recorded for a forward that took no time or prefilled nothing
    meter.record(True, 3, 0.0)
    meter.record(False, 0, 0.5)
    assert meter.prefill_tokens_per_step() == pytest.approx(0.10 * 484 / 1.4)
    # Three more decode steps and two more prefills push the first ones out
    for seconds in (0.2, 0.2, 0.3):
        meter.record(True, 4, seconds)
    meter.record(False, 200, 0.5)
    meter.record(False, 300, 0.7)
    assert meter.prefill_tokens_per_step() == pytest.approx(0.2 * 600 / 1.5)
    for bad in (0, 1.5, None):
        with pytest.raises(ValueError, match="window must be an integer"):
            StepCostMeter(window=bad)


def test_the_pay_rule_can_weigh_with_the_replicas_measured_rate(planner):
    """``pays_prefill_tokens_per_step: "measured"``: the replicas' own rates (their mean) in
    place of the constant; while none is measured the drop goes ahead, as without the rule."""
    full = planner.full_replica().kv_capacity_tokens

    def view(wait: float, rates: tuple):
        snaps = (ReplicaSnapshot(0, full, full // 2, full, 350 + 64, queue_refused=True,
                                 running_requests=3, queued_prompt_tokens=350,
                                 queue_wait_steps=wait, prefill_tokens_per_step=rates[0]),
                 ReplicaSnapshot(1, full, 0, running_requests=2,
                                 prefill_tokens_per_step=rates[1]))
        return ClusterView(0, snaps)

    def ctl():
        return KunServeController(planner, ControllerConfig(
            drop_persist=1, min_dwell_s=0, pays_prefill_tokens_per_step="measured",
            pays_counts_arrivals=False))

    # Measured at 35 on both: as the constant 35 (5 x 350 / 35 = 50 steps of stall)
    assert ctl().decide(view(40, (35.0, 35.0))) is None
    action = ctl().decide(view(60, (35.0, 35.0)))
    assert isinstance(action, Drop) and action.reason.endswith(
        "stall the running requests 50 at 35.0 prompt tokens a decode step, measured")
    # The mean of 35 and 70 (52.5): 33 steps of stall, so a 40-step wait pays
    assert isinstance(ctl().decide(view(40, (35.0, 70.0))), Drop)
    # Only one measured: its own rate
    assert ctl().decide(view(40, (None, 35.0))) is None
    # None measured yet: the drop goes ahead
    assert isinstance(ctl().decide(view(40, (None, None))), Drop)
    assert ControllerConfig(pays_prefill_tokens_per_step="measured")
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="prefill_tokens_per_step must be positive"):
            ReplicaSnapshot(0, full, 0, prefill_tokens_per_step=bad)


def test_controller_drops_for_a_queue_only_when_it_pays(planner):
    """With pays_prefill_tokens_per_step, a refused queue drops only when its waits on whole
    replicas (decode steps, summed) exceed its merged prefills' stall on every running
    request of the pair: running x queued prompt tokens / the rate. Without the option, or
    for an overload of the running requests' own growth, it drops as before."""
    full = planner.full_replica().kv_capacity_tokens

    def view(wait: float, running: int = 3, queued: int = 1, prompt: int = 350):
        snaps = (ReplicaSnapshot(0, full, full // 2, full, queued * (prompt + 64),
                                 queue_refused=True, running_requests=running,
                                 queued_prompt_tokens=queued * prompt, queue_wait_steps=wait),
                 ReplicaSnapshot(1, full, 0, running_requests=2))
        return ClusterView(0, snaps)

    def ctl(rate=35):
        return KunServeController(planner, ControllerConfig(
            drop_persist=1, min_dwell_s=0, pays_prefill_tokens_per_step=rate))

    # 5 running x 350 / 35 = 50 steps of stall: a queue that waits 40 steps does not pay,
    # one that waits 60 does; a request that never fits whole always does.
    assert ctl().decide(view(40)) is None
    action = ctl().decide(view(60))
    assert isinstance(action, Drop) and "it pays: the queue would wait 60 decode steps" in (
        action.reason) and "stall the running requests 50" in action.reason
    assert isinstance(ctl().decide(view(math.inf)), Drop)
    # A cheaper prefill (70 tokens a step) halves the stall: 40 steps of waiting pay.
    assert isinstance(ctl(70).decide(view(40)), Drop)
    # A merge that costs each of the 5 running requests 3 steps of its own: 65 steps, more
    # than the 60 the queue waits.
    assert KunServeController(planner, ControllerConfig(
        drop_persist=1, min_dwell_s=0, pays_prefill_tokens_per_step=35,
        pays_merge_steps=3)).decide(view(60)) is None
    with pytest.raises(ValueError, match="bad controller config"):
        ControllerConfig(pays_merge_steps=-1)
    # Off (the default): the same short wait drops.
    assert isinstance(KunServeController(planner, ControllerConfig(
        drop_persist=1, min_dwell_s=0)).decide(view(40)), Drop)
    # No queue, the running requests' growth over the pool: a drop, whatever it stalls.
    growth = ClusterView(0, (ReplicaSnapshot(0, full, full // 2, full, running_requests=9),
                             ReplicaSnapshot(1, full, 0)))
    assert isinstance(KunServeController(planner, ControllerConfig(
        drop_persist=1, min_dwell_s=0, pays_prefill_tokens_per_step=35)).decide(growth), Drop)
    for bad in (0, -1.0, True, "35", "Measured", math.inf):
        with pytest.raises(ValueError, match="pays_prefill_tokens_per_step must be a positive"):
            ControllerConfig(pays_prefill_tokens_per_step=bad)
    with pytest.raises(ValueError, match="negative"):
        ReplicaSnapshot(0, full, 0, queue_wait_steps=-1)


def test_the_pay_rule_counts_the_requests_arriving_while_the_queue_drains(planner):
    """One queued 350-token prompt waits 40 steps whole (drained in 40); 5 requests run in
    the pair, 35 prompt tokens a step: 50 steps of stall, so the queue alone does not pay.
    Arriving at 0.2 requests a step, 8 more come in those 40 steps and wait 0.2 x 40^2 / 2 =
    160 steps in all: with short prompts (20 tokens a step, 800 tokens: 114 steps of stall)
    the drop pays (200 > 164); with the queue's 350-token prompts (70 a step: 400 steps of
    stall) it does not (200 < 450). ``pays_counts_arrivals`` off: the queue alone."""
    full = planner.full_replica().kv_capacity_tokens

    def view(arrival_prompt_tokens_per_step: float, drain: float = 40):
        snaps = (ReplicaSnapshot(0, full, full // 2, full, 350 + 64, queue_refused=True,
                                 running_requests=3, queued_prompt_tokens=350,
                                 queue_wait_steps=40 if drain < math.inf else drain,
                                 queue_drain_steps=drain,
                                 arrivals_per_step=0.2,
                                 arrival_prompt_tokens_per_step=arrival_prompt_tokens_per_step),
                 ReplicaSnapshot(1, full, 0, running_requests=2))
        return ClusterView(0, snaps)

    def ctl(**kw):
        return KunServeController(planner, ControllerConfig(
            drop_persist=1, min_dwell_s=0, pays_prefill_tokens_per_step=35, **kw))

    action = ctl().decide(view(20))
    assert isinstance(action, Drop) and (
        "wait 200 decode steps whole (with 800 prompt tokens arriving meanwhile), the merge "
        "and its prefills stall the running requests 164") in action.reason
    assert ctl().decide(view(70)) is None
    assert ctl(pays_counts_arrivals=False).decide(view(20)) is None
    # A queued request that never fits whole: the drop pays whatever arrives.
    assert isinstance(ctl().decide(view(70, drain=math.inf)), Drop)
    with pytest.raises(ValueError, match="pays_counts_arrivals must be true or false"):
        ControllerConfig(pays_counts_arrivals=1)


def test_controller_drops_when_one_replica_cannot_admit_its_queue(planner):
    """Replica 0's queue is over its own pool while replica 1 is idle: the pair's total fits,
    but a request never moves between replicas, so only a drop lets replica 0 admit it."""
    full = planner.full_replica().kv_capacity_tokens
    ctl = KunServeController(planner, ControllerConfig(drop_persist=2, min_dwell_s=0))
    view = _view(0, planner, [full // 2, 0], [full // 2 + 100, 0])
    assert sum(r.demand_tokens for r in view.replicas) < 2 * full
    action = ctl.decide(view)  # a blocked queue: the first view drops
    assert isinstance(action, Drop) and [g.replicas for g in action.plan.groups] == [(0, 1)]
    assert f"over replica 0's capacity {full}" in action.reason
    # Exactly full is held: no drop, however long.
    ctl = KunServeController(planner, ControllerConfig(drop_persist=1, min_dwell_s=0))
    assert ctl.decide(_view(0, planner, [full // 2, full], [full - full // 2, 0])) is None


def test_controller_restores_owned_requests_only_when_each_member_fits_its_own(planner):
    """The live pair's requests stay with their replica: a restore where the total fits the
    two restored pools but replica 0's own demand does not fit its pool would queue at once
    (and drop again). It waits until each member's own demand fits (with the headroom)."""
    full = planner.full_replica().kv_capacity_tokens
    group = make_group(planner, (0, 1))
    cfg = ControllerConfig(restore_persist=1, min_dwell_s=0, restore_headroom=0.8)

    def view(own0, own1, waiting0):
        live = [LiveRequest("replica0", own0, owner=0), LiveRequest("replica1", own1, owner=1)]
        return _view(0, planner, [own0, own1], [waiting0, 0], [group], {0: live, 1: live})

    lopsided = view(full // 2, 10, full // 2)  # replica 0: full, replica 1: 10 tokens
    assert full + 10 <= 0.8 * 2 * full  # the total would fit the restored pair
    assert KunServeController(planner, cfg).decide(lopsided) is None
    action = KunServeController(planner, cfg).decide(view(full // 2, 10, full // 4))
    assert isinstance(action, Restore) and action.plan.home == {"replica0": 0, "replica1": 1}


def test_controller_reports_kv_centric_once(planner):
    full = planner.full_replica().kv_capacity_tokens
    cfg = DropPlannerConfig(planner.memory, BUDGET_BYTES, max_group_size=1)
    ctl = KunServeController(cfg, ControllerConfig(drop_persist=1, min_dwell_s=0))
    first = ctl.decide(_view(0, cfg, [full] * 2, [full, full]))
    assert isinstance(first, KvCentric) and first.fallback.shortfall_tokens > 0
    assert ctl.decide(_view(1, cfg, [full] * 2, [full, full])) is None


def test_controller_restores_below_half_usage_when_live_kv_fits(planner):
    full = planner.full_replica().kv_capacity_tokens
    group = make_group(planner, (0, 1))
    live = [LiveRequest(f"r{i}", full // 4) for i in range(4)]  # fits: 2 per member
    views = [_view(t, planner, [full] * 2, [0, 0], [group], {0: live, 1: live}) for t in range(5)]
    ctl = KunServeController(planner, ControllerConfig(restore_persist=3, min_dwell_s=0))
    assert [ctl.decide(v) for v in views[:2]] == [None, None]
    action = ctl.decide(views[2])
    assert isinstance(action, Restore)
    assert action.plan.group.replicas == (0, 1)
    assert set(action.plan.home) == {r.rid for r in live}


def test_controller_never_restores_when_live_kv_would_not_fit(planner):
    """Under 50% of the group's pool, but more live KV than the restored pools can take (or
    not packable per replica): the controller waits, whatever the persistence."""
    full = planner.full_replica().kv_capacity_tokens
    group = make_group(planner, (0, 1))
    live = [LiveRequest(f"r{i}", full // 2 + 1) for i in range(3)]  # 3 halves, 2 pools
    assert sum(r.kv_tokens for r in live) < 0.5 * group.capacity_tokens  # usage is "low"
    ctl = KunServeController(planner, ControllerConfig(restore_persist=1, min_dwell_s=0,
                                                       restore_headroom=1.0))
    for t in range(6):
        assert ctl.decide(_view(t, planner, [0, 0], [0, 0], [group], {0: live, 1: live})) is None
    over = [LiveRequest(f"q{i}", 2 * full // 7 + 1) for i in range(7)]  # > 2 pools in total
    assert 2 * full < sum(r.kv_tokens for r in over) < 0.5 * group.capacity_tokens
    for t in range(6):
        assert ctl.decide(_view(t, planner, [0, 0], [0, 0], [group], {0: over, 1: over})) is None


def test_controller_dwell_time_between_transitions(planner):
    full = planner.full_replica().kv_capacity_tokens
    ctl = KunServeController(planner, ControllerConfig(drop_persist=1, restore_persist=1,
                                                       min_dwell_s=10))
    drop = ctl.decide(_view(0, planner, [full] * 2, [full, full]))
    assert isinstance(drop, Drop)
    ctl.applied(drop, 0.0)
    group = drop.plan.groups[0]
    live = {0: [LiveRequest("a", 5)], 1: [LiveRequest("a", 5)]}
    assert ctl.decide(_view(5, planner, [5, 5], [0, 0], [group], live)) is None
    assert isinstance(ctl.decide(_view(11, planner, [5, 5], [0, 0], [group], live)), Restore)


# ---- simulation ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_setup(spec, planner):
    from benchmark.kunserve.sim import Calibration, Request

    cal = Calibration(PhaseCosts(ChunkCostModel(3e-8, 2e-4, 0.02),
                                 ChunkCostModel(5e-7, 2e-3, 0.03), "test"),
                      1e-4, 2e9, 5e9, spec.hidden_size * spec.dtype_bytes)
    rng = random.Random(7)
    # A burst at t=0..2 s far over two replicas' KV, then a trickle.
    reqs = [Request(f"b{i}", rng.uniform(0, 2), rng.randint(200, 900), rng.randint(20, 120))
            for i in range(40)]
    reqs += [Request(f"t{i}", 30 + 2 * i, 100, 20) for i in range(10)]
    cfg = DropPlannerConfig(planner.memory, BUDGET_BYTES, max_group_size=2)
    return cal, sorted(reqs, key=lambda r: r.arrival_s), cfg


@pytest.mark.parametrize("kunserve,merged_queues",
                         [(False, "pair"), (True, "pair"), (True, "member")])
def test_simulation_conserves_requests_and_is_deterministic(sim_setup, kunserve, merged_queues):
    from benchmark.kunserve.sim import Drop as _  # noqa: F401  (the sim imports the controller)
    from benchmark.kunserve.sim import latency_stats, simulate

    cal, reqs, cfg = sim_setup
    ctl_cfg = ControllerConfig(min_dwell_s=1.0)
    sim = simulate(reqs, 2, cfg, cal, kunserve, monitor_s=0.5, controller_cfg=ctl_cfg,
                   merged_queues=merged_queues)
    assert sorted(r.rid for r in sim.finished) == sorted(r.rid for r in reqs)
    for r in sim.finished:
        assert r.generated == r.output_tokens == len(r.token_times_s)
        assert r.token_times_s == sorted(r.token_times_s)
        assert r.token_times_s[0] > r.arrival_s
    again = simulate(reqs, 2, cfg, cal, kunserve, monitor_s=0.5, controller_cfg=ctl_cfg,
                     merged_queues=merged_queues)
    assert latency_stats(again.finished) == latency_stats(sim.finished)
    assert again.transitions == sim.transitions
    kinds = [t["kind"] for t in sim.transitions]
    if kunserve:
        assert kinds[:2] == ["drop", "restore"]  # the burst merges the pair, the lull splits it
    else:
        assert kinds == []


def test_per_replica_queues_keep_requests_home_and_share_the_pipeline(sim_setup, monkeypatch):
    """With ``merged_queues="member"`` a merged pair is two schedulers: each admits and batches
    only the requests routed to its replica, within half the pair's KV, and both feed one
    pipeline, so their micro-batches queue for the same stages."""
    from benchmark.kunserve import sim as KS

    cal, reqs, cfg = sim_setup
    routed, batches, pipelines = {}, [], set()
    route, forward = KS.ClusterSim.route, KS.Unit._forward

    def recording_route(self, request, replica=None):
        if replica is None:
            routed[request.rid] = self.dispatched % self.replicas
        return route(self, request, replica)

    def recording_forward(unit, items):
        out = forward(unit, items)
        if unit.group.size > 1:
            batches.append((unit.replicas, [i.rid for i in items],
                            sum(r.reserved_tokens for r in unit.running), unit.capacity_tokens,
                            unit.group.capacity_tokens // unit.group.size))
            pipelines.add(id(unit.pipeline))
        return out

    monkeypatch.setattr(KS.ClusterSim, "route", recording_route)
    monkeypatch.setattr(KS.Unit, "_forward", recording_forward)
    sim = KS.simulate(reqs, 2, cfg, cal, True, monitor_s=0.5,
                      controller_cfg=ControllerConfig(min_dwell_s=1.0), merged_queues="member")
    assert len(sim.finished) == len(reqs)
    assert {b[0] for b in batches} == {(0,), (1,)}, "both members scheduled their own batches"
    for replicas, rids, reserved, capacity, half in batches:
        assert all(routed[rid] == replicas[0] for rid in rids)
        assert capacity == half and reserved <= capacity
    drops = sum(t["kind"] == "drop" for t in sim.transitions)
    assert 1 <= len(pipelines) <= drops, "one pipeline per merged pair, shared by its members"
    with pytest.raises(ValueError, match="merged_queues"):
        KS.simulate(reqs, 2, cfg, cal, True, merged_queues="replica")


@pytest.mark.parametrize("replicas", [2, 4, 16])
def test_each_simulated_replica_gets_its_own_slice_of_the_trace(replicas):
    from benchmark.kunserve.sim import TRACES, trace_requests
    from benchmark.replay.trace import TraceWindow, load_window
    from sglang_morph.repo_data import TRACES_DIR

    csv, window = TRACES["azure_code"]
    reqs = trace_requests(TRACES_DIR / csv, replicas, window)
    slices = {}
    for r in reqs:
        slices.setdefault(r.rid.split("-")[0], []).append(r)
    assert sorted(slices, key=int) == [str(k) for k in range(replicas)]
    # Disjoint: no request of the window is in two slices.
    assert len({r.rid.split("-")[1] for r in reqs}) == len(reqs)
    # Each slice is one thinned copy's rate: as many requests as the single replica's window.
    single = load_window(TraceWindow(TRACES_DIR / csv, **window))
    assert all(abs(len(s) - len(single)) <= 1 for s in slices.values())
    # More replicas than the thinning: time compressed so each still sees that rate.
    csv, window = TRACES["burstgpt"]
    dense = trace_requests(TRACES_DIR / csv, replicas, window)
    alone = load_window(TraceWindow(TRACES_DIR / csv, **window))
    per_replica = len(dense) / replicas
    span = max(r.arrival_s for r in dense)
    assert per_replica / span == pytest.approx(len(alone) / max(r.arrival_s for r in alone),
                                               rel=0.1)


def test_simulated_admission_cap_holds_while_merged(sim_setup, monkeypatch):
    """A merged pair admits nothing that would run more than the cap (it keeps what its
    members held at the drop)."""
    from benchmark.kunserve import sim as KS

    cal, reqs, cfg = sim_setup
    admitted = []  # (running before, admitted) of each merged admission
    admit = KS.Unit._admit

    def recording(unit):
        out = admit(unit)
        if unit.group.size > 1 and out:
            admitted.append((len(unit.running), len(out)))
        return out

    monkeypatch.setattr(KS.Unit, "_admit", recording)
    ctl = ControllerConfig(min_dwell_s=1.0)
    free = KS.simulate(reqs, 2, cfg, cal, True, monitor_s=0.5, controller_cfg=ctl)
    assert max(a + b for a, b in admitted) > 3, "uncapped, the pair runs more than 3"
    admitted.clear()
    capped = KS.simulate(reqs, 2, cfg, cal, True, monitor_s=0.5, controller_cfg=ctl,
                         merged_running_cap=3)
    assert admitted and max(a + b for a, b in admitted) <= 3
    assert len(capped.finished) == len(free.finished) == len(reqs)
    with pytest.raises(ValueError, match="merged_running_cap"):
        KS.simulate(reqs, 2, cfg, cal, True, merged_running_cap=0)


def test_overlap_schedule_hands_each_token_on_after_the_next_forward(sim_setup):
    """SGLang's overlap scheduler on a CPU: a forward's tokens reach the client when the next
    forward has run, and a replica's last tokens before it idles as they come. The reference
    is the same simulation without it, whose token times are the forwards' ends."""
    from benchmark.kunserve.sim import Request, simulate

    cal, _, cfg = sim_setup
    # Two requests on replica 0 (the other to replica 1 in turn), the second joining late.
    reqs = [Request("a", 0.0, 50, 4), Request("x", 0.0, 50, 2), Request("b", 0.05, 30, 3)]
    plain = {r.rid: r.token_times_s
             for r in simulate(reqs, 2, cfg, cal, False, monitor_s=0.5).finished}
    lagged = {r.rid: r.token_times_s
              for r in simulate(reqs, 2, cfg, cal, False, monitor_s=0.5,
                                overlap_schedule=True).finished}
    # Replica 0's forwards end at these times, in order; each token goes out at the end of
    # the forward after its own, the last forward's at its own end.
    ends = sorted(set(plain["a"]) | set(plain["b"]))
    handed = {t: ends[min(i + 1, len(ends) - 1)] for i, t in enumerate(ends)}
    for rid in ("a", "b"):
        assert lagged[rid] == pytest.approx([handed[t] for t in plain[rid]])
    assert lagged["a"][0] > plain["a"][0]
    # Replica 1 ran "x" alone: its last token went out as it came, the first one step later.
    assert lagged["x"] == pytest.approx([plain["x"][1], plain["x"][1]])
    # A merged group runs without it: KunServe turns the overlap scheduler off.
    ks = simulate(reqs, 2, cfg, cal, True, monitor_s=0.5, overlap_schedule=True)
    assert all(u.unsent == [] for u in ks.units if u.group.size > 1)


def test_decode_costs_take_the_fits_measured_error_at_each_batch_size():
    from benchmark.kunserve.sim import BatchCorrectedCosts, decode_errors_s

    fit = PhaseCosts(ChunkCostModel(1e-6, 1e-3, 0.05), ChunkCostModel(5e-6, 4e-3, 0.05))

    def decode(b):
        return tuple(Chunk(100 + i, 1) for i in range(b))

    timings = ([ForwardTiming(decode(1), fit.seconds(decode(1)) + 0.002)] * 8
               + [ForwardTiming(decode(3), fit.seconds(decode(3)) + 0.03 + 0.001 * i)
                  for i in range(9)]
               + [ForwardTiming(decode(4), fit.seconds(decode(4)) - 0.01)] * 3  # too few
               + [ForwardTiming((Chunk(0, 64),), 1.0)] * 8)  # a prefill: not decode's
    errors = decode_errors_s(fit, timings)
    assert errors == pytest.approx((0.002, 0.0, 0.034, 0.0))
    costs = BatchCorrectedCosts(fit.prefill, fit.decode, "", errors)
    assert costs.seconds(decode(3)) == pytest.approx(fit.seconds(decode(3)) + 0.034)
    assert costs.seconds(decode(6)) == pytest.approx(fit.seconds(decode(6)))
    assert costs.seconds((Chunk(0, 64),)) == pytest.approx(fit.seconds((Chunk(0, 64),)))
    assert decode_errors_s(fit, []) == ()


def test_per_replica_queues_decode_one_micro_batch_and_own_their_requests(sim_setup,
                                                                          monkeypatch):
    """As live: a merged member's decode step is one micro-batch through the stages (the other
    member's step fills the pipeline beside it), and the controller sees each member's
    requests as its own, at the KV SGLang's allocator holds (a decode writes the KV of the
    token it reads: prompt + generated - 1), so a restore waits until each member's own fit
    its own restored pool."""
    from benchmark.kunserve import sim as KS
    from sglang_morph.kunserve.lookahead import PipelineState

    cal, reqs, cfg = sim_setup
    submits, views = [], []
    forward, submit, view = KS.Unit._forward, PipelineState.submit, KS.ClusterSim.view

    def recording_forward(unit, items):
        before = len(submits)
        out = forward(unit, items)
        if unit.group.size > 1 and all(i.new_tokens == 1 for i in items):
            assert len(submits) - before == 1, "one micro-batch per member decode step"
        return out

    def recording_submit(state, mb, not_before_s=0.0):
        submits.append(mb)
        return submit(state, mb, not_before_s)

    def recording_view(sim):
        v = view(sim)
        views.append((v, {r.rid: (r.prompt_tokens, r.generated) for u in sim.units
                          for r in u.running}))
        return v

    monkeypatch.setattr(KS.Unit, "_forward", recording_forward)
    monkeypatch.setattr(PipelineState, "submit", recording_submit)
    monkeypatch.setattr(KS.ClusterSim, "view", recording_view)
    sim = KS.simulate(reqs, 2, cfg, cal, True, monitor_s=0.5,
                      controller_cfg=ControllerConfig(min_dwell_s=1.0), merged_queues="member")
    assert len(sim.finished) == len(reqs) and submits
    grouped = [v for v, _ in views if v.groups]
    assert grouped, "the pair merged"
    for v, lengths in views:
        for snap in v.replicas:
            for req in snap.live:
                prompt, generated = lengths[req.rid]
                assert req.owner == snap.replica
                assert req.kv_tokens == prompt + max(0, generated - 1)
    # Every restore found each member's own requests within the headroom of a whole pool.
    full = cfg.full_replica().kv_capacity_tokens
    restores = [t["at_s"] for t in sim.transitions if t["kind"] == "restore"]
    for at in restores:
        v = max((v for v, _ in views if v.groups and v.time_s <= at), key=lambda v: v.time_s)
        for snap in v.replicas:
            own = sum(r.kv_tokens for r in snap.live) + snap.kv_growth_tokens
            assert own + snap.waiting_tokens <= ControllerConfig().restore_headroom * full
