"""The transitions of every mechanism on one scheduler: kept, logged, exported.

One ``TransitionRecorder`` per scheduler process (``recorder(scheduler)``); every mechanism
records through it, so ``/elastic/status`` lists them together, ``--elastic-log`` holds one
JSONL stream and Prometheus has one family:

    sglang_morph_elastic_transitions_total{mechanism, replica, action, outcome}
    sglang_morph_elastic_transition_seconds_total{mechanism, replica}
    sglang_morph_elastic_kv_capacity_tokens{mechanism, replica}
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any

from sglang_morph.elastic.contract import Outcome, Transition

logger = logging.getLogger("sglang_morph")

RECENT_TRANSITIONS = 32


class TransitionRecorder:
    """Invariant: ``recent(m)`` holds the last ``RECENT_TRANSITIONS`` transitions of mechanism
    ``m`` in the order they were recorded, and ``totals[m, outcome]`` counts all of them."""

    def __init__(self, replica: int, log_path: str | None = None, metrics: bool = False):
        self.replica = replica
        self._recent: dict[str, collections.deque[Transition]] = {}
        self.totals: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()  # service threads (a group's link) record too
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self._metrics = _Metrics(replica) if metrics else None

    def record(self, t: Transition) -> Transition:
        """Keep, log and count ``t``; recording the same transition object again is a no-op
        (a mechanism may record as it applies, and its loop records what apply returned)."""
        with self._lock:
            recent = self._recent.setdefault(t.mechanism,
                                             collections.deque(maxlen=RECENT_TRANSITIONS))
            if recent and recent[-1] is t:
                return t
            recent.append(t)
            self.totals[t.mechanism, t.outcome.value] += 1
            if self._log is not None:
                self._log.write(json.dumps(t.to_json()) + "\n")
        if self._metrics is not None:
            self._metrics.observe(t)
        return t

    def recent(self, mechanism: str) -> list[Transition]:
        with self._lock:
            return list(self._recent.get(mechanism, ()))

    def summary(self, mechanism: str) -> dict[str, Any]:
        with self._lock:
            totals = {o.value: self.totals[mechanism, o.value] for o in Outcome}
        return {"totals": totals, "recent": [t.to_json() for t in self.recent(mechanism)]}


def recorder(scheduler: Any) -> TransitionRecorder:
    """The scheduler's recorder, made on first use (every mechanism of the process shares it)."""
    existing = scheduler.__dict__.get("elastic_recorder")
    if existing is not None:
        return existing
    from sglang_morph.elastic.registry import elastic_config
    from sglang_morph.elastic.control import replica_index

    cfg = elastic_config(getattr(scheduler, "server_args", None))
    reporter = getattr(scheduler, "metrics_reporter", None)
    made = TransitionRecorder(replica_index(), cfg.log_path,
                              metrics=bool(getattr(reporter, "enable_metrics", False)))
    scheduler.elastic_recorder = made
    return made


class _Metrics:
    """Series of the scheduler process (SGLang's multiprocess registry serves them on /metrics
    with --enable-metrics); every series carries the mechanism and the replica."""

    def __init__(self, replica: int):
        from prometheus_client import Counter, Gauge

        self._replica = str(replica)
        self._transitions = Counter(
            "sglang_morph_elastic_transitions", "Transitions of the live mechanisms",
            ("mechanism", "replica", "action", "outcome"))
        self._seconds = Counter(
            "sglang_morph_elastic_transition_seconds", "Time spent in transitions",
            ("mechanism", "replica"))
        self._capacity = Gauge(
            "sglang_morph_elastic_kv_capacity_tokens",
            "KV capacity after the mechanism's last transition", ("mechanism", "replica"),
            multiprocess_mode="mostrecent")

    def observe(self, t: Transition) -> None:
        r = self._replica
        self._transitions.labels(mechanism=t.mechanism, replica=r, action=t.action,
                                 outcome=t.outcome.value).inc()
        self._seconds.labels(mechanism=t.mechanism, replica=r).inc(t.duration_s)
        self._capacity.labels(mechanism=t.mechanism, replica=r).set(t.capacity_after_tokens)
