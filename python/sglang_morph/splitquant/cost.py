"""Latency cost models per (device, bit-width, phase), fitted by least squares.

One decoder layer's time on one device (LLM-PQ / SplitQuant's features):

- prefill of a micro-batch of ``v`` prompts of ``s`` tokens: ``1, v, s, v*s, v*s^2`` (the
  linears scale with the tokens ``v*s``, attention with ``v*s^2``);
- one decode step of ``v`` sequences whose context (prompt + tokens so far) is ``t+s``:
  ``1, v, v*(t+s), (t+s)`` (the linears' weights are read once per step and used ``v`` times;
  attention reads every sequence's KV).

The LM head (last stage only) is fitted on ``1, v``: it runs on one token per sequence in both
phases. Coefficients are non-negative (``scipy.optimize.nnls``: no feature may make a layer
faster by being larger, which keeps extrapolation sane) and fitted on relative error (rows
divided by the measured time), because times span four orders of magnitude and the planner
cares about ratios between stages.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PHASES = ("prefill", "decode", "head")
FEATURES = {
    "prefill": ("1", "v", "s", "v*s", "v*s^2"),
    "decode": ("1", "v", "v*(t+s)", "(t+s)"),
    "head": ("1", "v"),
}


def features(phase: str, v: np.ndarray | float, s: np.ndarray | float) -> np.ndarray:
    """``[..., n_features]`` for arrays (or scalars) ``v`` and ``s``; for decode ``s`` is the
    context length ``t+s``, for the head it is ignored."""
    v = np.asarray(v, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    v, s = np.broadcast_arrays(v, s)
    one = np.ones_like(v)
    if phase == "prefill":
        return np.stack([one, v, s, v * s, v * s * s], axis=-1)
    if phase == "decode":
        return np.stack([one, v, v * s, s], axis=-1)
    if phase == "head":
        return np.stack([one, v], axis=-1)
    raise ValueError(f"unknown phase {phase!r}; choose from {PHASES}")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured (or roofline-generated) time: ``seconds`` for one layer (or the head) of
    ``phase`` at ``bits`` with micro-batch ``v`` and prompt/context length ``s``."""

    phase: str
    bits: int
    v: int
    s: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class LatencyModel:
    """Fitted per-layer times of one device. Invariant: ``coefficients[(phase, bits)]`` has
    one non-negative entry per feature of ``phase``; the head is stored under bits 16."""

    device: str
    coefficients: dict[tuple[str, int], tuple[float, ...]]
    source: str = ""  # how the points were obtained (measured here / roofline of a spec)

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted({b for (p, b) in self.coefficients if p != "head"}, reverse=True))

    def seconds(self, phase: str, bits: int, v, s) -> np.ndarray:
        key = (phase, 16 if phase == "head" else bits)
        if key not in self.coefficients:
            raise ValueError(f"{self.device}: no {phase} model for {bits} bits")
        return features(phase, v, s) @ np.asarray(self.coefficients[key])

    def prefill_s(self, bits: int, v: int, s: int) -> float:
        return float(self.seconds("prefill", bits, v, s))

    def decode_s(self, bits: int, v: int, context: int) -> float:
        return float(self.seconds("decode", bits, v, context))

    def decode_total_s(self, bits: int, v: int, prompt_tokens: int, steps: int) -> float:
        """One layer's time over ``steps`` decode steps of one micro-batch, contexts
        ``s+1 .. s+steps`` (closed form: the features are linear in the context)."""
        if steps <= 0:
            return 0.0
        mean_context = prompt_tokens + (steps + 1) / 2
        return steps * float(self.seconds("decode", bits, v, mean_context))

    def head_s(self, v: int) -> float:
        return float(self.seconds("head", 16, v, 0))

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "source": self.source,
                "features": FEATURES,
                "coefficients": [{"phase": p, "bits": b, "values": list(c)}
                                 for (p, b), c in sorted(self.coefficients.items())]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "LatencyModel":
        coefficients = {(c["phase"], int(c["bits"])): tuple(float(x) for x in c["values"])
                        for c in raw["coefficients"]}
        for (phase, _bits), values in coefficients.items():
            if len(values) != len(FEATURES[phase]):
                raise ValueError(f"{phase} model needs {len(FEATURES[phase])} coefficients")
        return cls(raw["device"], coefficients, raw.get("source", ""))


def fit(device: str, points: Iterable[Measurement], source: str = "") -> LatencyModel:
    """Least squares (non-negative, on relative error) per (phase, bits) group of points."""
    from scipy.optimize import nnls

    groups: dict[tuple[str, int], list[Measurement]] = {}
    for m in points:
        groups.setdefault((m.phase, 16 if m.phase == "head" else m.bits), []).append(m)
    coefficients = {}
    for (phase, bits), ms in groups.items():
        x = features(phase, [m.v for m in ms], [m.s for m in ms])
        y = np.array([m.seconds for m in ms])
        if len(ms) < x.shape[1]:
            raise ValueError(f"{device}: {len(ms)} {phase} points at {bits} bits, need at least "
                             f"{x.shape[1]}")
        # Column scaling keeps NNLS well conditioned (features span 1 .. 1e8).
        scale = np.abs(x).max(axis=0)
        solution, _residual = nnls(x / y[:, None] / scale, np.ones(len(ms)))
        coefficients[(phase, bits)] = tuple(float(c) for c in solution / scale)
    return LatencyModel(device, coefficients, source)


def relative_errors(model: LatencyModel, points: Sequence[Measurement]) -> np.ndarray:
    predicted = np.array([float(model.seconds(m.phase, m.bits, m.v, m.s)) for m in points])
    measured = np.array([m.seconds for m in points])
    return np.abs(predicted - measured) / measured


def save_measurements(path: Path, points: Sequence[Measurement], meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(
        {**meta, "points": [dataclasses.asdict(m) for m in points]}, indent=1))


def load_measurements(path: Path) -> tuple[list[Measurement], dict[str, Any]]:
    raw = json.loads(Path(path).read_text())
    points = [Measurement(**p) for p in raw.pop("points")]
    return points, raw
