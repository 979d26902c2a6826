"""Exhaustive search over every contiguous partition and every bit vector: the reference the
ILP is tested against (small models only: ``K^G x C(G-1, D-1)`` plans)."""

from __future__ import annotations

import itertools

import numpy as np

from sglang_morph.splitquant.ilp import Solution
from sglang_morph.splitquant.problem import StageTables

MAX_PLANS = 5_000_000


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def solve(tables: StageTables, quality_only: bool = False) -> Solution | None:
    t = tables
    G, D, K = t.n_groups, t.n_stages, len(t.problem.bits)
    n_bit_vectors = K ** G
    if n_bit_vectors * max(1, len(list(compositions(G, D)))) > MAX_PLANS:
        raise ValueError(f"{G} groups x {D} stages x {K} bit-widths is too large to enumerate")
    bits = np.array(list(itertools.product(range(K), repeat=G)))  # [N, G]
    g = np.arange(G)
    omega = t.omega[g, bits].sum(axis=1)
    memory = t.memory_bytes[g, bits]  # [N, G]
    w = t.workload
    best = None
    for stage_groups in compositions(G, D):
        stage_of = np.repeat(np.arange(D), stage_groups)
        onehot = np.eye(D)[stage_of]  # [G, D]
        fits = np.all(memory @ onehot <= t.capacity_bytes, axis=1)
        if t.problem.max_omega is not None:
            fits &= omega <= t.problem.max_omega * (1 + 1e-9)
        if not fits.any():
            continue
        if quality_only:
            value = np.where(fits, omega, np.inf)
        else:
            pre = t.prefill_s[stage_of, g, bits] @ onehot + t.prefill_fixed_s  # [N, D]
            dec = t.decode_s[stage_of, g, bits] @ onehot + t.decode_fixed_s
            prefill = pre.sum(axis=1) + (w.prefill_micro_batches - 1) * pre.max(axis=1)
            decode = np.maximum(w.decode_micro_batches * dec.max(axis=1), dec.sum(axis=1))
            value = np.where(fits, prefill + decode + t.problem.theta_s * omega, np.inf)
        i = int(value.argmin())
        if best is None or value[i] < best[0]:
            best = (float(value[i]), stage_groups, tuple(int(k) for k in bits[i]))
    if best is None:
        return None
    return Solution(best[1], best[2], best[0], 0.0, "optimal (exhaustive)")
