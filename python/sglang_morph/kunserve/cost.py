"""KunServe's chunk cost model: how long one forward of a batch of request chunks takes.

A request that already holds ``p`` tokens of KV and runs ``c`` new tokens through the model
(a prefill chunk behind a cached prefix; a decode step is ``c = 1``) costs, in KunServe's
model, ``alpha * (p*c + c^2 + c) + beta * c``: the attention of the ``c`` new tokens reads the
``p`` cached ones and each other (``p*c + c^2``), and every token goes through the linears
(``c``). One forward of a batch adds one fixed ``gamma`` (weights read once, launch and
scheduling overhead), so a batch of chunks costs

    gamma + sum_i [alpha * (p_i*c_i + c_i^2 + c_i) + beta * c_i].

Some attention backends do more: SGLang's ``torch_native`` backend (the CPU path here) runs
a prefill chunk's attention over the whole sequence, cached prefix included: per request and
layer it gathers the ``p + c`` cached and new K/V rows, pads the query to ``p + c`` rows and
runs a causal attention of ``p + c`` rows, keeping the last ``c``. The padded rows add work in
``p^2`` (their attention) and in ``p`` (gathering, padding, copying rows), which KunServe's
model, written for kernels that attend with the new rows only, has no terms for.
``delta_s * sum(p^2) + epsilon_s * sum(p)`` covers them; ``delta_s = epsilon_s = 0`` is
KunServe's model exactly (``KUNSERVE_TERMS``), ``TORCH_NATIVE_TERMS`` fits all five.

Prefill and decode are fitted apart (``PhaseCosts``): a decode step is bound by reading the
weights and the KV, a prefill chunk by arithmetic, so one ``(alpha, beta, gamma)`` for both
would fit neither. Fitting is least squares on relative error with non-negative coefficients
(``scipy.optimize.nnls``, as ``splitquant/cost.py``): times span orders of magnitude, and a negative
coefficient would make a longer chunk cheaper, which a micro-batch balancer must never believe.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PHASES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's share of a forward: ``new_tokens`` run behind ``cached_tokens`` of KV."""

    cached_tokens: int  # p
    new_tokens: int  # c

    def __post_init__(self) -> None:
        if self.cached_tokens < 0 or self.new_tokens < 1:
            raise ValueError(f"a chunk needs cached_tokens >= 0 and new_tokens >= 1, got "
                             f"p={self.cached_tokens}, c={self.new_tokens}")

    @property
    def phase(self) -> str:
        return "decode" if self.new_tokens == 1 and self.cached_tokens > 0 else "prefill"


TERMS = ("alpha_s", "beta_s", "gamma_s", "delta_s", "epsilon_s")
KUNSERVE_TERMS = TERMS[:3]  # KunServe's model as the paper writes it
TORCH_NATIVE_TERMS = TERMS  # plus the padded prefix of torch_native's extend (p^2 and p)


def batch_features(chunks: Sequence[Chunk]) -> np.ndarray:
    """``[sum(p*c + c^2 + c), sum(c), 1, sum(p^2), sum(p)]``: the multipliers of alpha, beta,
    gamma, delta, epsilon (``TERMS``) for one forward."""
    if not chunks:
        raise ValueError("a forward needs at least one chunk")
    p = np.array([ch.cached_tokens for ch in chunks], dtype=np.float64)
    c = np.array([ch.new_tokens for ch in chunks], dtype=np.float64)
    return np.array([float(np.sum(p * c + c * c + c)), float(np.sum(c)), 1.0,
                     float(np.sum(p * p)), float(np.sum(p))])


@dataclasses.dataclass(frozen=True)
class ChunkCostModel:
    """``seconds(chunks) = alpha_s * sum(p*c + c^2 + c) + beta_s * sum(c) + gamma_s
    + delta_s * sum(p^2) + epsilon_s * sum(p)`` (``delta_s = epsilon_s = 0``: KunServe's model).

    Invariant (``check_integrity``): every coefficient finite and >= 0, so the cost never
    decreases when a chunk grows or joins the batch (what balancing relies on).
    """

    alpha_s: float
    beta_s: float
    gamma_s: float
    delta_s: float = 0.0  # per squared cached token (torch_native's padded query)
    epsilon_s: float = 0.0  # per cached token (torch_native's gathered and padded rows)

    def __post_init__(self) -> None:
        self.check_integrity()

    def check_integrity(self) -> None:
        for name in TERMS:
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"chunk cost model: {name} must be finite and >= 0, got {value}")

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in TERMS])

    def seconds(self, chunks: Sequence[Chunk]) -> float:
        # Plain Python: the balancer and the simulator call this millions of times on a few
        # chunks, where building numpy arrays costs more than the arithmetic.
        if not chunks:
            raise ValueError("a forward needs at least one chunk")
        attention = tokens = prefix_sq = prefix = 0
        for ch in chunks:
            p, c = ch.cached_tokens, ch.new_tokens
            attention += p * c + c * c + c
            tokens += c
            prefix_sq += p * p
            prefix += p
        return (self.alpha_s * attention + self.beta_s * tokens + self.gamma_s
                + self.delta_s * prefix_sq + self.epsilon_s * prefix)

    def chunk_seconds(self, chunk: Chunk) -> float:
        """One chunk's share without the per-forward ``gamma`` (what a balancer adds up)."""
        return self.seconds([chunk]) - self.gamma_s


@dataclasses.dataclass(frozen=True)
class ForwardTiming:
    """One measured forward: its chunks and ``seconds`` (server-side), all of one phase."""

    chunks: tuple[Chunk, ...]
    seconds: float

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("a timing needs at least one chunk")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"a timing needs seconds > 0, got {self.seconds}")
        if len({ch.phase for ch in self.chunks}) != 1:
            raise ValueError("a timing mixes prefill and decode chunks; fit them apart")

    @property
    def phase(self) -> str:
        return self.chunks[0].phase


def fit_chunk_cost(timings: Sequence[ForwardTiming],
                   terms: Sequence[str] = KUNSERVE_TERMS) -> ChunkCostModel:
    """Non-negative least squares on relative error over ``timings`` (one phase), fitting the
    coefficients named in ``terms`` (a subset of ``TERMS``); the others stay 0.

    Refuses what cannot determine the coefficients: fewer timings than coefficients, one
    phase mixed with another, or features that do not vary (every point the same size).
    """
    from scipy.optimize import nnls

    timings = list(timings)
    unknown = set(terms) - set(TERMS)
    if unknown or not terms:
        raise ValueError(f"terms must be a non-empty subset of {TERMS}, got {tuple(terms)}")
    columns = [TERMS.index(name) for name in TERMS if name in terms]
    n_coef = len(columns)
    if len(timings) < n_coef:
        raise ValueError(f"fitting {n_coef} coefficients needs at least {n_coef} timings, got "
                         f"{len(timings)}")
    phases = {t.phase for t in timings}
    if len(phases) != 1:
        raise ValueError(f"timings of several phases {sorted(phases)}: fit each phase apart")
    x = np.stack([batch_features(t.chunks) for t in timings])[:, columns]
    y = np.array([t.seconds for t in timings])
    if np.linalg.matrix_rank(x) < 2:
        raise ValueError("the timings' features do not vary: measure several chunk sizes")
    # Column scaling keeps NNLS well conditioned (the attention features reach 1e7).
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(x / y[:, None] / scale, np.ones(len(y)))
    return ChunkCostModel(**{TERMS[j]: float(v) for j, v in zip(columns, solution / scale)})


def relative_errors(model: ChunkCostModel, timings: Iterable[ForwardTiming]) -> np.ndarray:
    timings = list(timings)
    predicted = np.array([model.seconds(t.chunks) for t in timings])
    measured = np.array([t.seconds for t in timings])
    return np.abs(predicted - measured) / measured


@dataclasses.dataclass(frozen=True)
class PhaseCosts:
    """The fitted model of each phase on one machine; a batch of only decode steps
    (``c = 1`` behind a prefix) is costed by ``decode``, anything else by ``prefill``."""

    prefill: ChunkCostModel
    decode: ChunkCostModel
    source: str = ""  # where the timings came from (machine, commit)

    def model(self, chunks: Sequence[Chunk]) -> ChunkCostModel:
        return self.decode if all(ch.phase == "decode" for ch in chunks) else self.prefill

    def seconds(self, chunks: Sequence[Chunk]) -> float:
        return self.model(chunks).seconds(chunks)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source,
                **{phase: dataclasses.asdict(getattr(self, phase)) for phase in PHASES}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "PhaseCosts":
        return cls(ChunkCostModel(**raw["prefill"]), ChunkCostModel(**raw["decode"]),
                   raw.get("source", ""))

    @classmethod
    def load(cls, path: Path) -> "PhaseCosts":
        raw = json.loads(Path(path).read_text())
        return cls.from_json(raw["fit"] if "fit" in raw else raw)


def range_chunks(chunks: Sequence[Chunk], start: int, stop: int) -> tuple[Chunk, ...]:
    """The chunks a contiguous range ``[start, stop)`` of a batch's new tokens runs: ``chunks``
    in batch order, their new tokens laid end to end; a request cut by the range keeps the
    tokens before it as cached prefix."""
    out, at = [], 0
    for ch in chunks:
        lo, hi = max(start, at), min(stop, at + ch.new_tokens)
        if lo < hi:
            out.append(Chunk(ch.cached_tokens + lo - at, hi - lo))
        at += ch.new_tokens
    return tuple(out)


def balanced_bounds(chunks: Sequence[Chunk], k: int, model: ChunkCostModel,
                    min_tokens: int = 1) -> list[int]:
    """Token bounds ``[0, b_1, ..., total]`` that cut a batch's new tokens (``chunks`` in batch
    order) into ``k`` contiguous ranges of about equal cost under ``model``: the most
    expensive range is as cheap as ranges of at least ``min_tokens`` allow. A pipeline of
    micro-batches waits on its slowest one, and ranges of equal tokens are not equal in cost:
    a later range of a prompt attends over the earlier ones' KV.

    Bisection on the most expensive range's cost; for each candidate, ranges are taken greedily
    from the left, each as long as the cost allows (a range's cost grows with its end, every
    coefficient being >= 0). Raises ValueError when ``k`` ranges of ``min_tokens`` do not fit."""
    total = sum(ch.new_tokens for ch in chunks)
    if k < 1 or k * min_tokens > total:
        raise ValueError(f"{k} ranges of at least {min_tokens} tokens do not fit {total} tokens")

    def cost(a: int, b: int) -> float:
        return model.seconds(range_chunks(chunks, a, b))

    def greedy(limit_s: float) -> list[int] | None:
        bounds = [0]
        for left in range(k - 1, 0, -1):  # ``left`` ranges still to place after this one
            a = bounds[-1]
            lo, hi = a + min_tokens, total - left * min_tokens  # this range's end
            if lo > hi or cost(a, lo) > limit_s:
                return None
            while lo < hi:  # the longest end within the limit
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if cost(a, mid) <= limit_s else (lo, mid - 1)
            bounds.append(lo)
        if cost(bounds[-1], total) > limit_s:
            return None
        return bounds + [total]

    # Equal token ranges (each at least min_tokens, since k * min_tokens <= total) bound the
    # answer from above.
    best = [total * j // k for j in range(k + 1)]
    hi_s, lo_s = max(cost(a, b) for a, b in zip(best, best[1:])), 0.0
    for _ in range(BALANCE_ITERATIONS):
        mid_s = (lo_s + hi_s) / 2
        found = greedy(mid_s)
        if found is None:
            lo_s = mid_s
        else:
            best, hi_s = found, mid_s
    return best


class OnlineChunkCost:
    """A chunk cost model fitted as timings arrive (KunServe's terms, ``fit_chunk_cost``) on
    the last ``window`` prefill timings; refitted every ``refit_every`` new ones once there
    are ``min_timings``. ``model`` is None until a fit succeeded (too few timings, or
    features that do not vary yet); a failed refit keeps the last model. Timings of decode
    chunks, or of prefill and decode together, are not kept: micro-batches are cut from
    prefills."""

    def __init__(self, window: int = 128, min_timings: int = 12, refit_every: int = 8):
        if not 3 <= min_timings <= window or refit_every < 1:
            raise ValueError(f"need 3 <= min_timings <= window and refit_every >= 1, got "
                             f"{min_timings}, {window}, {refit_every}")
        import collections

        self.timings: collections.deque[ForwardTiming] = collections.deque(maxlen=window)
        self.min_timings, self.refit_every = min_timings, refit_every
        self.model: ChunkCostModel | None = None
        self.observed = self.fits = 0
        self._since_fit = 0

    def observe(self, chunks: Sequence[Chunk], seconds: float) -> None:
        if not chunks or any(ch.phase != "prefill" for ch in chunks) or not (
                math.isfinite(seconds) and seconds > 0):
            return
        self.timings.append(ForwardTiming(tuple(chunks), seconds))
        self.observed += 1
        self._since_fit += 1
        if len(self.timings) >= self.min_timings and (
                self.model is None or self._since_fit >= self.refit_every):
            try:
                self.model = fit_chunk_cost(self.timings, KUNSERVE_TERMS)
            except ValueError:
                return  # the features do not vary yet: keep what there is
            self.fits += 1
            self._since_fit = 0


# Bisection steps of ``balanced_bounds``: the slowest range to within 2^-16 of the equal
# cuts' slowest (microseconds), below what a forward's timing resolves.
BALANCE_ITERATIONS = 16


def timings_to_json(timings: Sequence[ForwardTiming]) -> list[dict[str, Any]]:
    return [{"chunks": [[ch.cached_tokens, ch.new_tokens] for ch in t.chunks],
             "seconds": t.seconds} for t in timings]


def timings_from_json(raw: Sequence[dict[str, Any]]) -> list[ForwardTiming]:
    return [ForwardTiming(tuple(Chunk(int(p), int(c)) for p, c in t["chunks"]),
                          float(t["seconds"])) for t in raw]
