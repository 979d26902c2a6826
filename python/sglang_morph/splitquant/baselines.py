"""Baselines the planner is compared with, each on the same cost and memory model:

- ``uniform``: layers split evenly over the stages (SGLang's default PP split: the remainder
  goes to the last stages), one bit-width for every layer: the highest that fits every stage.
- ``pipeedge``: one bit-width (the highest for which some partition fits), the partition
  that minimizes the pipeline time (PipeEdge partitions by compute; here by the same time
  objective, solved exactly with the ILP restricted to that bit-width).
- ``adabits``: the even partition, bit-widths chosen per layer for quality alone (the
  quality-only ILP: least omega that fits memory), as adaptive-bit-width quantization does.

Every baseline searches the same device orders and (eta, xi) grid as the planner and keeps its
best, so differences come from partition and bit-widths only.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from sglang_morph.splitquant import ilp
from sglang_morph.splitquant.problem import PlanningProblem, StageTables
from sglang_morph.splitquant.search import PlanResult, micro_batch_grid, result_of, search

BASELINES = ("uniform", "pipeedge", "adabits")


def even_partition(num_layers: int, n_stages: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, n_stages)
    return tuple(base + (1 if j >= n_stages - extra else 0) for j in range(n_stages))


def _over_grid(problem: PlanningProblem, name: str, inner,
               micro_batches: Sequence[tuple[int, int]] | None) -> PlanResult | None:
    started = time.perf_counter()
    grid = micro_batches or micro_batch_grid(problem.workload.batch_requests,
                                             len(problem.cluster.devices))
    best, candidates = None, 0
    for order in problem.cluster.unique_orders():
        for eta, xi in grid:
            t = StageTables.build(problem, order, problem.workload.with_micro_batches(eta, xi))
            found = inner(t)
            candidates += 1
            if found is not None:
                value = t.objective(*found)
                if best is None or value < best[0]:
                    best = (value, t, found)
    if best is None:
        return None
    _, t, (stage_groups, bit_index) = best
    return result_of(name, t, stage_groups, bit_index, time.perf_counter() - started, candidates)


def uniform(problem: PlanningProblem, micro_batches=None) -> PlanResult | None:
    stages = even_partition(problem.model.num_layers, len(problem.cluster.devices))

    def inner(t: StageTables):
        for k in range(len(problem.bits)):  # highest bit-width first
            bits = (k,) * t.n_groups
            if t.feasible(stages, bits) or _fits_ignoring_quality(t, stages, bits):
                return stages, bits
        return None

    return _over_grid(problem, "uniform", inner, micro_batches)


def _fits_ignoring_quality(t: StageTables, stages, bits) -> bool:
    """Baselines are not bound by the planner's quality constraint: only memory counts."""
    unbounded = dataclasses.replace(t, problem=dataclasses.replace(t.problem, max_omega=None))
    return unbounded.feasible(stages, bits)


def adabits(problem: PlanningProblem, micro_batches=None) -> PlanResult | None:
    stages = even_partition(problem.model.num_layers, len(problem.cluster.devices))
    unbounded = dataclasses.replace(problem, max_omega=None)

    def inner(t: StageTables):
        solution = ilp.solve(t, quality_only=True, fixed_stage_groups=stages)
        return None if solution is None else (solution.stage_groups, solution.bit_index)

    return _over_grid(unbounded, "adabits", inner, micro_batches)


def pipeedge(problem: PlanningProblem, micro_batches=None) -> PlanResult | None:
    for k, bits in enumerate(problem.bits):  # highest first
        single = dataclasses.replace(problem, bits=(bits,), omega=problem.omega[:, k:k + 1],
                                     max_omega=None)
        result = search(single, "ilp", micro_batches=micro_batches)
        if result is not None:
            return dataclasses.replace(result, method="pipeedge")
    return None
