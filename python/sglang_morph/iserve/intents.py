"""Intents: how the user ranks configurations, and which ones they rule out.

Every candidate is a row of estimates (``Candidate``); an intent is a key to sort by plus a
feasibility test, in a small registry:

- ``min-latency``: the request's end-to-end time ``TTFT + (output - 1) TPOT``;
- ``min-cost``: by ``--cost memory-x-latency`` (GB x s, the default), ``memory`` (GB) or
  ``device-hours`` (processes x the time to serve ``--requests`` requests in batches);
- ``latency-target``: feasible when TTFT and TPOT meet ``--ttft-slo-s`` / ``--tpot-slo-s``;
  among those, the cheapest;
- ``cost-budget``: feasible when memory and device-hours are within ``--max-memory`` /
  ``--max-device-hours``; among those, the fastest.

An **accuracy limit** (``--max-perplexity``) applies to any intent: a configuration is feasible
only if its bit-width's perplexity is within the limit. This is an extension the iServe paper
lacks (it compares configurations of one precision); the perplexities are our precision
variants' measured WikiText-2 perplexities through the server
(``benchmark/results/engines_quality.json``).

Memory is the estimated RSS high-water mark summed over the configuration's processes (what the
machine must have) unless ``memory_figure`` says ``accounted`` (weights + KV + activations).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from sglang_morph.repo_data import REPO_ROOT as REPO
from sglang_morph.iserve.space import Configuration

GB = 1e9
QUALITY_FILE = REPO / "benchmark" / "results" / "engines_quality.json"
# engines_quality.json's configuration per bit-width: the served precision variants.
_QUALITY_CONFIG = {16: "fp", 8: "w8", 4: "w4_awq"}
COSTS = ("memory-x-latency", "memory", "device-hours")


def perplexity_by_bits(path: Path = QUALITY_FILE) -> dict[int, float]:
    raw = json.loads(Path(path).read_text())
    by_name = {r["name"]: r for r in raw["rows"]}
    return {bits: float(by_name[name]["perplexity"]) for bits, name in _QUALITY_CONFIG.items()
            if name in by_name}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One servable configuration's estimates for the intent's workload."""

    cfg: Configuration
    ttft_s: float
    tpot_s: float
    memory_bytes: float  # the chosen memory figure, all processes
    peak_process_bytes: float
    device_hours: float
    perplexity: float | None
    e2e_s: float

    @classmethod
    def of(cls, cfg: Configuration, ttft_s: float, tpot_s: float, memory_bytes: float,
           peak_process_bytes: float, perplexity: float | None, batch: int,
           output_tokens: int, requests: int) -> "Candidate":
        """A row from TTFT and TPOT (estimated or measured): the end-to-end time of a request
        of ``output_tokens``, and the device-hours of ``requests`` served in batches."""
        e2e = ttft_s + (output_tokens - 1) * tpot_s
        hours = cfg.processes * math.ceil(requests / batch) * e2e / 3600
        return cls(cfg, ttft_s, tpot_s, memory_bytes, peak_process_bytes, hours, perplexity, e2e)

    def cost(self, kind: str) -> float:
        if kind == "memory-x-latency":
            return self.memory_bytes / GB * self.e2e_s
        if kind == "memory":
            return self.memory_bytes / GB
        if kind == "device-hours":
            return self.device_hours
        raise ValueError(f"unknown cost {kind!r}; choose from {COSTS}")


@dataclasses.dataclass(frozen=True)
class IntentSpec:
    """The intent and its limits; None means no limit. Invariant: the limits an intent needs
    are set (``check_integrity``)."""

    name: str
    cost: str = "memory-x-latency"
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    max_memory_bytes: float | None = None
    max_device_hours: float | None = None
    max_perplexity: float | None = None

    def check_integrity(self) -> None:
        if self.name not in INTENTS:
            raise ValueError(f"unknown intent {self.name!r}; choose from {', '.join(INTENTS)}")
        if self.cost not in COSTS:
            raise ValueError(f"unknown cost {self.cost!r}; choose from {', '.join(COSTS)}")
        for field in ("ttft_slo_s", "tpot_slo_s", "max_memory_bytes", "max_device_hours",
                      "max_perplexity"):
            value = getattr(self, field)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{field} must be a positive number, got {value}")
        if self.name == "latency-target" and self.ttft_slo_s is None and self.tpot_slo_s is None:
            raise ValueError("intent latency-target needs --ttft-slo-s and/or --tpot-slo-s")
        if self.name == "cost-budget" and self.max_memory_bytes is None \
                and self.max_device_hours is None:
            raise ValueError("intent cost-budget needs --max-memory and/or --max-device-hours")


def infeasibility(c: Candidate, spec: IntentSpec) -> str | None:
    """Why ``c`` does not meet the intent's limits, or None."""
    if spec.ttft_slo_s is not None and c.ttft_s > spec.ttft_slo_s:
        return f"TTFT {c.ttft_s:.3f} s > {spec.ttft_slo_s} s"
    if spec.tpot_slo_s is not None and c.tpot_s > spec.tpot_slo_s:
        return f"TPOT {c.tpot_s:.4f} s > {spec.tpot_slo_s} s"
    if spec.max_memory_bytes is not None and c.memory_bytes > spec.max_memory_bytes:
        return f"memory {c.memory_bytes / GB:.2f} GB > {spec.max_memory_bytes / GB:.2f} GB"
    if spec.max_device_hours is not None and c.device_hours > spec.max_device_hours:
        return f"{c.device_hours:.4f} device-hours > {spec.max_device_hours}"
    if spec.max_perplexity is not None:
        if c.perplexity is None:
            return f"no measured perplexity for {c.cfg.bits} bits"
        if c.perplexity > spec.max_perplexity:
            return f"perplexity {c.perplexity:.2f} > {spec.max_perplexity} (extension)"
    return None


# Sort key per intent (smaller first); the name breaks ties so the order is deterministic.
INTENTS: dict[str, Callable[[Candidate, IntentSpec], tuple]] = {
    "min-latency": lambda c, s: (c.e2e_s, c.cost(s.cost)),
    "min-cost": lambda c, s: (c.cost(s.cost), c.e2e_s),
    "latency-target": lambda c, s: (c.cost(s.cost), c.e2e_s),
    "cost-budget": lambda c, s: (c.e2e_s, c.cost(s.cost)),
}


def rank(candidates: Sequence[Candidate], spec: IntentSpec
         ) -> list[tuple[Candidate, str | None]]:
    """Candidates in the intent's order, each with why it is infeasible (None: feasible)."""
    spec.check_integrity()
    key = INTENTS[spec.name]
    ordered = sorted(candidates, key=lambda c: (*key(c, spec), c.cfg.name))
    return [(c, infeasibility(c, spec)) for c in ordered]
