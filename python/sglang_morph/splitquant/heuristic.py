"""SplitQuant's fast path: the quality-only ILP, then bit-width transfer off the straggler.

1. Start from a plan that maximizes quality under memory alone, ignoring time: the
   quality-only ILP's (``ilp.solve(..., quality_only=True)``) when given, else a greedy one
   (``greedy_start``): on this problem the quality-only ILP costs about as much as the full
   ILP, which would defeat the point of a fast path.
2. Local search on the full objective (``StageTables.objective``), steepest descent over:
   - boundary shifts: the first or last group of a stage moves to the neighbouring stage, at
     any bit-width (a move into a fuller stage may have to go lower to fit);
   - bit changes of one group (e.g. a straggler's layer to a faster bit-width, or a layer
     on an idle stage back up when memory allows);
   - bit transfers: one group of the straggler stage one bit-width down and one group on
     another stage one bit-width up, so the quality given up on the critical path is bought
     back where time is free.
   Every candidate is checked against memory and the quality bound. It stops when no move
   lowers the objective.

Stage sums are updated incrementally, so one candidate costs O(stages) arithmetic.
"""

from __future__ import annotations

import time

import numpy as np

from sglang_morph.splitquant.ilp import Solution
from sglang_morph.splitquant.problem import StageTables

MAX_ITERATIONS = 10_000
SMOOTHING_POWERS = (4.0, 16.0, np.inf)


class _State:
    """A plan and its per-stage sums; candidates are evaluated in one vectorized pass."""

    def __init__(self, t: StageTables, stage_groups, bit_index):
        self.t = t
        self.stage_groups = list(stage_groups)
        self.bits = np.array(bit_index, dtype=np.int64)
        self.recompute()

    def recompute(self) -> None:
        t = self.t
        D, g = t.n_stages, np.arange(t.n_groups)
        self.stage_of = np.repeat(np.arange(D), self.stage_groups)
        self.pre = t.prefill_fixed_s + np.bincount(
            self.stage_of, t.prefill_s[self.stage_of, g, self.bits], D)
        self.dec = t.decode_fixed_s + np.bincount(
            self.stage_of, t.decode_s[self.stage_of, g, self.bits], D)
        self.mem = np.bincount(self.stage_of, t.memory_bytes[g, self.bits], D)
        self.omega = float(t.omega[g, self.bits].sum())

    def value(self, power: float = np.inf) -> float:
        return float(self._values(self.pre[None], self.dec[None], np.array([self.omega]),
                                  power)[0])

    def _values(self, pre, dec, omega, power: float = np.inf) -> np.ndarray:
        """The objective with each stage maximum replaced by the ``power``-norm of the stage
        times (the true objective at ``power`` = inf)."""
        w, t = self.t.workload, self.t
        norm = (np.max if power == np.inf else
                lambda x, axis: np.linalg.norm(x, ord=power, axis=axis))
        prefill = pre.sum(axis=1) + (w.prefill_micro_batches - 1) * norm(pre, axis=1)
        decode = np.maximum(w.decode_micro_batches * norm(dec, axis=1), dec.sum(axis=1))
        return prefill + decode + t.problem.theta_s * omega

    def evaluate(self, moves: np.ndarray, power: float = np.inf) -> np.ndarray:
        """Objective after each candidate; ``moves`` is ``[C, M, 3]`` (group, new stage, new
        bit index) with group -1 for an unused slot; inf where a candidate does not fit."""
        t = self.t
        C = moves.shape[0]
        pre = np.repeat(self.pre[None], C, axis=0)
        dec = np.repeat(self.dec[None], C, axis=0)
        mem = np.repeat(self.mem[None], C, axis=0)
        omega = np.full(C, self.omega)
        rows = np.arange(C)
        for m in range(moves.shape[1]):
            g, j2, k2 = moves[:, m, 0], moves[:, m, 1], moves[:, m, 2]
            used = g >= 0
            r, g, j2, k2 = rows[used], g[used], j2[used], k2[used]
            j, k = self.stage_of[g], self.bits[g]
            for table, out in ((t.prefill_s, pre), (t.decode_s, dec)):
                np.add.at(out, (r, j), -table[j, g, k])
                np.add.at(out, (r, j2), table[j2, g, k2])
            np.add.at(mem, (r, j), -t.memory_bytes[g, k])
            np.add.at(mem, (r, j2), t.memory_bytes[g, k2])
            np.add.at(omega, r, t.omega[g, k2] - t.omega[g, k])
        values = self._values(pre, dec, omega, power)
        bad = np.any(mem > t.capacity_bytes[None], axis=1)
        if t.problem.max_omega is not None:
            bad |= omega > t.problem.max_omega * (1 + 1e-9)
        values[bad] = np.inf
        return values

    def apply(self, changes) -> None:
        for g, j2, k2 in changes:
            if g < 0:
                continue
            if j2 != self.stage_of[g]:
                self.stage_groups[self.stage_of[g]] -= 1
                self.stage_groups[j2] += 1
            self.bits[g] = k2
            self.stage_of = np.repeat(np.arange(self.t.n_stages), self.stage_groups)
        self.recompute()


def _candidates(s: _State) -> np.ndarray:
    t = s.t
    D, K, G = t.n_stages, len(t.problem.bits), t.n_groups
    starts = np.concatenate([[0], np.cumsum(s.stage_groups)]).tolist()
    none = (-1, 0, 0)
    out = []
    # boundary shifts (a stage keeps at least one group), at any bit-width, alone or with one
    # group of the receiving stage one bit-width down (to make room)
    for j in range(D - 1):
        shifts = []
        if s.stage_groups[j] > 1:
            shifts.append((starts[j + 1] - 1, j + 1))
        if s.stage_groups[j + 1] > 1:
            shifts.append((starts[j + 1], j))
        for g, j2 in shifts:
            for k in range(K):
                out.append([(g, j2, k), none])
                for h in range(starts[j2], starts[j2 + 1]):
                    if h != g and s.bits[h] + 1 < K:
                        out.append([(g, j2, k), (h, j2, s.bits[h] + 1)])
    # single bit changes
    for g in range(G):
        for k in range(K):
            if k != s.bits[g]:
                out.append([(g, s.stage_of[g], k), none])
    # bit transfers off the straggler (bits are ordered high to low: k + 1 is lower)
    w = t.workload
    load = np.maximum((w.prefill_micro_batches - 1) * s.pre, 0) + w.decode_micro_batches * s.dec
    straggler = int(load.argmax())
    down = [g for g in range(starts[straggler], starts[straggler + 1]) if s.bits[g] + 1 < K]
    up = [g for g in range(G) if s.stage_of[g] != straggler and s.bits[g] > 0]
    for a in down:
        for b in up:
            out.append([(a, straggler, s.bits[a] + 1), (b, s.stage_of[b], s.bits[b] - 1)])
    return np.array(out, dtype=np.int64).reshape(-1, 2, 3)


def improve(t: StageTables, stage_groups, bit_index) -> tuple[tuple[int, ...], tuple[int, ...],
                                                            float]:
    """Steepest descent from a feasible plan; returns the local optimum and its objective.

    The stage maxima are first smoothed into p-norms (``SMOOTHING_POWERS``), then exact: with
    a plain max, identical devices with equal loads make every single move uphill (lowering
    one of two tied stragglers does not lower the maximum)."""
    s = _State(t, stage_groups, bit_index)
    for power in SMOOTHING_POWERS:
        current = s.value(power)
        for _ in range(MAX_ITERATIONS):
            moves = _candidates(s)
            if len(moves) == 0:
                break
            values = s.evaluate(moves, power)
            i = int(values.argmin())
            if not values[i] < current - 1e-12 * abs(current):
                break
            s.apply(moves[i].tolist())
            current = float(values[i])
    return tuple(s.stage_groups), tuple(int(k) for k in s.bits), s.value()


def greedy_start(t: StageTables) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A quality-first plan without a solver: groups split over the stages in proportion to
    their capacity, every group at the highest bit-width, then on each stage over its capacity
    the group whose next bit-width down costs the least omega per byte saved goes down, until
    it fits. None when even the lowest bit-widths do not fit (or break the quality bound)."""
    D, G, K = t.n_stages, t.n_groups, len(t.problem.bits)
    capacity = np.maximum(t.capacity_bytes, 0)
    share = np.cumsum(capacity) / max(capacity.sum(), 1.0)
    ends = np.clip(np.rint(share * G).astype(int), 1, G)
    for j in range(D):  # every stage keeps at least one group
        ends[j] = min(max(ends[j], (ends[j - 1] if j else 0) + 1), G - (D - 1 - j))
    stage_groups = np.diff(np.concatenate([[0], ends])).tolist()
    bits = np.zeros(G, dtype=np.int64)
    g_all = np.arange(G)
    for j, (a, e) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        while t.memory_bytes[g_all[a:e], bits[a:e]].sum() > t.capacity_bytes[j]:
            lower = [g for g in range(a, e) if bits[g] + 1 < K]
            if not lower:
                return None
            saved = np.array([t.memory_bytes[g, bits[g]] - t.memory_bytes[g, bits[g] + 1]
                              for g in lower])
            lost = np.array([t.omega[g, bits[g] + 1] - t.omega[g, bits[g]] for g in lower])
            bits[lower[int(np.argmin(lost / np.maximum(saved, 1.0)))]] += 1
    if not t.feasible(stage_groups, bits):
        return None
    return tuple(stage_groups), tuple(int(k) for k in bits)


def solve(t: StageTables, start: Solution | None = None) -> Solution | None:
    """Heuristic plan for ``t`` from ``start`` (e.g. the quality-only ILP's plan, if it fits
    ``t``'s memory), else from ``greedy_start``."""
    started = time.perf_counter()
    if start is not None and t.feasible(start.stage_groups, start.bit_index):
        initial = (start.stage_groups, start.bit_index)
    else:
        initial = greedy_start(t)
        if initial is None:
            return None
    stage_groups, bits, value = improve(t, *initial)
    return Solution(stage_groups, bits, value, time.perf_counter() - started, "heuristic")
