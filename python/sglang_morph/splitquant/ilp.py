"""The SplitQuant ILP for one (device order, eta, xi), solved with HiGHS (scipy.optimize.milp).

Variables: ``x[g, j, k]`` binary (layer group g on stage j at bits[k]); ``Tp``, ``Td`` (the
largest stage prefill / decode time) and ``R`` (decode time) continuous.

    minimize   sum x[g,j,k] (prefill[j,g,k] + theta * omega[g,k]) + (m_p - 1) Tp + R
    subject to sum_{j,k} x[g,j,k] = 1                                   every group
               sum_{j'<=j,k} x[g,j',k] >= sum_{j'<=j,k} x[g+1,j',k]     contiguous stages
               sum_{g,k} x[g,j,k] >= 1                                  no empty stage
               sum_{g,k} memory[g,k] x[g,j,k] <= capacity[j]            memory per device
               sum_{g,k} prefill[j,g,k] x[g,j,k] + fixed_p[j] <= Tp     every stage
               sum_{g,k} decode[j,g,k] x[g,j,k] + fixed_d[j] <= Td      every stage
               m_d Td <= R,   sum x decode + sum fixed_d <= R
               sum omega x <= max_omega                                 when a bound is set

which is ``problem.StageTables.objective`` exactly (the constant ``sum fixed_p`` is added
back). ``quality_only`` drops the time terms: minimize ``sum omega`` under the same memory
and stage constraints (the adabits baseline and the heuristic's start).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from sglang_morph.splitquant.problem import StageTables


@dataclasses.dataclass(frozen=True)
class Solution:
    stage_groups: tuple[int, ...]
    bit_index: tuple[int, ...]
    objective: float
    solve_s: float
    status: str


class _Rows:
    """Sparse constraint rows ``lower <= A x <= upper`` built one row at a time."""

    def __init__(self, n_vars: int):
        self.n_vars = n_vars
        self.rows, self.cols, self.vals, self.lower, self.upper = [], [], [], [], []

    def add(self, cols, vals, lower=-np.inf, upper=np.inf) -> None:
        r = len(self.lower)
        cols = np.asarray(cols).ravel()
        self.rows.append(np.full(cols.size, r))
        self.cols.append(cols)
        vals = np.asarray(vals, dtype=np.float64)
        self.vals.append(vals.ravel() if vals.size == cols.size
                         else np.broadcast_to(vals, cols.shape))
        self.lower.append(lower)
        self.upper.append(upper)

    def constraint(self) -> LinearConstraint:
        a = coo_array((np.concatenate(self.vals), (np.concatenate(self.rows),
                                                   np.concatenate(self.cols))),
                      shape=(len(self.lower), self.n_vars)).tocsr()
        return LinearConstraint(a, np.array(self.lower), np.array(self.upper))


def solve(tables: StageTables, quality_only: bool = False, time_limit_s: float = 60.0,
          mip_rel_gap: float = 1e-6,
          fixed_stage_groups: Sequence[int] | None = None,
          relaxed: bool = False) -> Solution | None:
    """The optimal plan for ``tables`` (None when no plan fits); ``fixed_stage_groups``
    pins the partition (groups per stage) and leaves only the bit-widths to choose.
    ``relaxed`` solves the LP relaxation instead: its ``objective`` is a lower bound on the
    ILP's (the outer loop skips (order, eta, xi) whose bound cannot beat its best plan)."""
    t = tables
    G, D, K = t.n_groups, t.n_stages, len(t.problem.bits)
    n_x = G * D * K
    n_vars = n_x + 3
    tp, td, r = n_x, n_x + 1, n_x + 2
    idx = np.arange(n_x).reshape(G, D, K)
    w = t.workload
    theta = t.problem.theta_s
    c = np.zeros(n_vars)
    if quality_only:
        c[:n_x] = np.broadcast_to(t.omega[:, None, :], (G, D, K)).ravel()
    else:
        c[:n_x] = (t.prefill_s.transpose(1, 0, 2) + theta * t.omega[:, None, :]).ravel()
        c[tp] = w.prefill_micro_batches - 1
        c[r] = 1.0
    rows = _Rows(n_vars)
    for g in range(G):
        rows.add(idx[g], 1.0, 1.0, 1.0)
    for g in range(G - 1):
        for j in range(D - 1):
            rows.add(np.concatenate([idx[g, :j + 1].ravel(), idx[g + 1, :j + 1].ravel()]),
                     np.concatenate([np.ones((j + 1) * K), -np.ones((j + 1) * K)]), lower=0.0)
    for j in range(D):
        rows.add(idx[:, j], 1.0, lower=1.0)
        rows.add(idx[:, j], t.memory_bytes, upper=t.capacity_bytes[j])
    if not quality_only:
        for j in range(D):
            rows.add(np.append(idx[:, j].ravel(), tp),
                     np.append(t.prefill_s[j].ravel(), -1.0), upper=-t.prefill_fixed_s[j])
            rows.add(np.append(idx[:, j].ravel(), td),
                     np.append(t.decode_s[j].ravel(), -1.0), upper=-t.decode_fixed_s[j])
        rows.add([td, r], [w.decode_micro_batches, -1.0], upper=0.0)
        rows.add(np.append(idx.transpose(1, 0, 2).ravel(), r),
                 np.append(t.decode_s.ravel(), -1.0), upper=-t.decode_fixed_s.sum())
    if t.problem.max_omega is not None:
        rows.add(idx, np.broadcast_to(t.omega[:, None, :], (G, D, K)),
                 upper=t.problem.max_omega)
    integrality = np.zeros(n_vars)
    integrality[:n_x] = 0 if relaxed else 1
    upper = np.ones(n_vars)
    upper[n_x:] = np.inf
    if fixed_stage_groups is not None:
        stage_of = np.repeat(np.arange(D), fixed_stage_groups)
        off_stage = np.ones((G, D, K), dtype=bool)
        off_stage[np.arange(G), stage_of, :] = False
        upper[:n_x][off_stage.ravel()] = 0
    started = time.perf_counter()
    result = milp(c, constraints=[rows.constraint()], integrality=integrality,
                  bounds=Bounds(np.zeros(n_vars), upper),
                  options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap,
                           "disp": False})
    elapsed = time.perf_counter() - started
    if result.x is None:
        return None
    if relaxed:
        constant = 0.0 if quality_only else float(t.prefill_fixed_s.sum())
        return Solution((), (), float(result.fun) + constant, elapsed, "LP relaxation")
    x = np.rint(result.x[:n_x]).reshape(G, D, K)
    stage_of = x.sum(axis=2).argmax(axis=1)
    bit_index = tuple(int(k) for k in x.sum(axis=1).argmax(axis=1))
    stage_groups = tuple(int(n) for n in np.bincount(stage_of, minlength=D))
    objective = (t.quality(bit_index) if quality_only
                 else t.objective(stage_groups, bit_index))
    status = "optimal" if result.status == 0 else f"stopped ({result.message})"
    return Solution(stage_groups, bit_index, objective, elapsed, status)
