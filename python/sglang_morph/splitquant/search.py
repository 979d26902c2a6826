"""The outer loop: device orders x micro-batch sizes (eta, xi), an inner solver for each, and
the plan that comes out (its predicted times, throughput, memory per stage and quality).

Inner solvers (``SOLVERS``): ``ilp`` (``splitquant.ilp``, exact) and ``heuristic``
(``splitquant.heuristic``, bit-width transfer from a greedy quality-first start).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sglang_morph.splitquant import heuristic, ilp
from sglang_morph.models.memory import StageMemory
from sglang_morph.splitquant.problem import Assignment, PlanningProblem, StageTables
from sglang_morph.models.workload import Workload

SOLVERS = ("ilp", "heuristic")
PREFILL_MICRO_BATCHES = (1, 2, 4, 8)
# Relative optimality gap the ILPs are solved to (and the bound pruning allows).
ILP_GAP = 1e-4


def micro_batch_grid(batch_requests: int, n_stages: int) -> list[tuple[int, int]]:
    """(eta, xi) candidates: eta from ``PREFILL_MICRO_BATCHES``; xi so that there are about
    as many decode micro-batches as stages (the bottleneck stage never idles), half that size,
    or the whole batch at once."""
    etas = sorted({min(e, batch_requests) for e in PREFILL_MICRO_BATCHES})
    xis = sorted({math.ceil(batch_requests / n_stages),
                  max(1, math.ceil(batch_requests / (2 * n_stages))), batch_requests})
    return [(e, x) for e in etas for x in xis]


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A plan and what the cost model predicts for it."""

    method: str
    assignment: Assignment
    devices: tuple[str, ...]  # per stage
    workload: Workload
    prefill_s: float
    decode_s: float
    objective: float
    quality: float  # sum of omega over layers (the indicator's units)
    stage_memory: tuple[StageMemory, ...]
    stage_prefill_s: tuple[float, ...]
    stage_decode_s: tuple[float, ...]
    solve_s: float
    candidates: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def throughput_tok_s(self) -> float:
        """Generated tokens per second over the whole batch (prefill included)."""
        return self.workload.generated_tokens / self.total_s

    def to_json(self) -> dict[str, Any]:
        a = self.assignment
        return {
            "method": self.method,
            "devices": list(self.devices),
            "stage_layers": list(a.stage_layers),
            "layer_bits": list(a.bits),
            "workload": dataclasses.asdict(self.workload),
            "predicted": {
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "total_s": self.total_s, "throughput_tok_s": self.throughput_tok_s,
                "stage_prefill_s": list(self.stage_prefill_s),
                "stage_decode_s": list(self.stage_decode_s),
            },
            "objective": self.objective,
            "quality_omega": self.quality,
            "stage_memory": [dict(dataclasses.asdict(m), budget_bytes=m.budget_bytes)
                             for m in self.stage_memory],
            "solve_s": self.solve_s,
            "candidates": self.candidates,
        }


def result_of(method: str, t: StageTables, stage_groups: Sequence[int],
              bit_index: Sequence[int], solve_s: float, candidates: int) -> PlanResult:
    p = t.problem
    a = t.to_assignment(stage_groups, bit_index)
    prefill, decode = t.times(stage_groups, bit_index)
    pre, dec = t.stage_times(stage_groups, bit_index)
    memory = []
    for j, (start, end) in enumerate(a.boundaries):
        memory.append(p.memory.stage_memory(range(start, end), a.bits[start:end], t.workload,
                                            first=j == 0, last=j == t.n_stages - 1))
    quality = float(sum(p.omega[l, p.bits.index(b)] for l, b in enumerate(a.bits)))
    return PlanResult(method, a, tuple(p.cluster.devices[i].name for i in t.order), t.workload,
                      prefill, decode, prefill + decode + p.theta_s * quality, quality,
                      tuple(memory), tuple(float(x) for x in pre), tuple(float(x) for x in dec),
                      solve_s, candidates)


def search(problem: PlanningProblem, method: str = "ilp", group_size: int = 1,
           micro_batches: Sequence[tuple[int, int]] | None = None,
           orders: Sequence[Sequence[int]] | None = None,
           time_limit_s: float = 60.0) -> PlanResult | None:
    """The best plan over device orders and (eta, xi); None when nothing fits."""
    if method not in SOLVERS:
        raise ValueError(f"unknown solver {method!r}; choose from {SOLVERS}")
    started = time.perf_counter()
    n_stages = len(problem.cluster.devices)
    grid = list(micro_batches or micro_batch_grid(problem.workload.batch_requests, n_stages))
    orders = [tuple(o) for o in (orders or problem.cluster.unique_orders())]
    best: tuple[float, StageTables, tuple, tuple] | None = None
    candidates = 0
    if method == "ilp":
        best, candidates = _search_ilp(problem, orders, grid, group_size, time_limit_s, started)
    for order in orders if method == "heuristic" else ():
        for eta, xi in grid:
            t = StageTables.build(problem, order, problem.workload.with_micro_batches(eta, xi),
                                  group_size)
            solution = heuristic.solve(t)
            candidates += 1
            if solution is not None and (best is None or solution.objective < best[0]):
                best = (solution.objective, t, solution.stage_groups, solution.bit_index)
    if best is None:
        return None
    _, t, stage_groups, bit_index = best
    return result_of(method, t, stage_groups, bit_index, time.perf_counter() - started,
                     candidates)


def _search_ilp(problem, orders, grid, group_size, time_limit_s, started):
    """Every (order, eta, xi)'s LP relaxation first; then ILPs in order of their bounds,
    skipping those whose bound cannot beat the best plan found (exact: the bound is a bound)."""
    bounded = []
    for order in orders:
        for eta, xi in grid:
            t = StageTables.build(problem, order, problem.workload.with_micro_batches(eta, xi),
                                  group_size)
            relaxation = ilp.solve(t, relaxed=True)
            if relaxation is not None:
                bounded.append((relaxation.objective, len(bounded), t))
    bounded.sort(key=lambda item: item[:2])
    best, solved = None, 0
    for bound, _, t in bounded:
        if best is not None and bound >= best[0] * (1 - ILP_GAP):
            break
        remaining = max(1.0, time_limit_s - (time.perf_counter() - started))
        solution = ilp.solve(t, time_limit_s=remaining, mip_rel_gap=ILP_GAP)
        solved += 1
        if solution is not None and (best is None or solution.objective < best[0]):
            best = (solution.objective, t, solution.stage_groups, solution.bit_index)
    return best, solved


def reference_time_s(problem: PlanningProblem) -> float:
    """The whole batch on the fastest device alone at full precision, without pipelining and
    ignoring memory: the time scale ``theta`` is relative to."""
    w = problem.workload
    L = problem.model.num_layers
    times = []
    for d in problem.cluster.devices:
        lat = d.latency
        times.append(w.batch_requests * L * (lat.prefill_s(16, 1, w.prompt_tokens)
                                             + lat.decode_total_s(16, 1, w.prompt_tokens,
                                                                  w.decode_steps)))
    return float(min(times))


def normalized_omega(omega: np.ndarray) -> np.ndarray:
    """omega divided by its all-lowest-bit total: 1.0 = every layer at the lowest bit-width."""
    total = omega[:, -1].sum()
    return omega / total if total > 0 else omega
