"""Pressure signals: what one scheduler step tells the controller, smoothed over time.

The scheduler hook builds a ``PressureSnapshot`` from counters it already has (O(1), no
scanning of requests) and hands it to ``PressureMonitor.observe``, which derives ratios, deltas
and EWMAs into a ``PressureSignals`` for the controller. Nothing here knows about SGLang.
"""

from __future__ import annotations

import dataclasses
import math


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        # NaN slips through a plain `< 0` test and would poison every EWMA after it.
        if value < 0 or math.isnan(value):
            raise ValueError(f"{owner}: {name} must be >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PressureSnapshot:
    """Raw counters of one scheduler step.

    Invariants (checked): every number >= 0 and ``kv_used_tokens <= kv_capacity_tokens``.
    ``kv_used_tokens`` counts tokens held by live requests only: evictable prefix-cache pages
    are free capacity for this purpose, since the scheduler reclaims them on demand.
    """

    time_s: float  # monotonic clock, not wall time: only differences matter
    kv_capacity_tokens: int
    kv_used_tokens: int
    num_waiting_reqs: int
    num_running_reqs: int
    head_wait_s: float  # age of the oldest waiting request; 0.0 when none wait
    retractions_total: int  # cumulative retracted (preempted) requests since start
    # KV the running requests may still claim for their remaining output (the scheduler's own
    # admission reservation) and what the oldest waiting request needs to be admitted. They
    # tell a queue that waits for KV from one that waits for compute.
    kv_reserved_tokens: int = 0
    head_need_tokens: int = 0
    waiting_need_tokens: int = 0  # the same need summed over every waiting request
    # Scheduler loop iterations since start (each runs at most one batch): with the time
    # between two snapshots they give the length of one step, which turns "decode steps until
    # a running request finishes" into seconds.
    scheduler_steps_total: int = 0
    # One (decode steps until it finishes, KV tokens its finish releases = held + reserved) per
    # running request: when the KV a waiting request lacks comes back, if nothing is done.
    running_kv_release: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # Every number is a count, a time or a clock reading: none may be negative or NaN.
        numbers = {k: v for k, v in dataclasses.asdict(self).items() if k != "running_kv_release"}
        _check_non_negative("PressureSnapshot", **numbers)
        for steps, tokens in self.running_kv_release:
            _check_non_negative("PressureSnapshot.running_kv_release", steps=steps, tokens=tokens)
        if self.kv_used_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"PressureSnapshot: kv_used_tokens {self.kv_used_tokens} exceeds "
                f"kv_capacity_tokens {self.kv_capacity_tokens}; the KV accounting is broken"
            )


@dataclasses.dataclass(frozen=True)
class PressureSignals:
    """Derived view of one step, as the controller consumes it.

    Invariants: ``0 <= kv_usage <= 1`` (0 when capacity is 0), ``retractions_delta >= 0``,
    EWMAs equal the raw value on the first observation; latency EWMAs are None until the first
    finished request reports one.
    """

    time_s: float
    kv_usage: float
    kv_usage_ewma: float
    num_waiting_reqs: int
    head_wait_s: float
    queue_delay_ewma_s: float
    retractions_delta: int  # retractions since the previous observation
    num_running_reqs: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    ttft_ewma_s: float | None
    tpot_ewma_s: float | None
    kv_reserved_tokens: int = 0
    head_need_tokens: int = 0
    waiting_need_tokens: int = 0
    # Time since the previous observation. Under load that is one scheduler iteration, the
    # least a request not admitted now will wait before the scheduler looks again.
    sample_gap_s: float = 0.0
    # Length of one busy scheduler step (EWMA over observations with running requests); 0.0
    # until the first such observation.
    step_s: float = 0.0
    running_kv_release: tuple[tuple[int, int], ...] = ()  # as in the snapshot, fewest steps first

    def kv_deficit_tokens(self, max_usage: float = 1.0) -> int:
        """KV tokens missing to admit every waiting request next to the running ones (held +
        reserved + all waiting needs) with the pool at most ``max_usage`` full; 0 when nothing
        waits."""
        if self.num_waiting_reqs == 0:
            return 0
        demand = self.kv_used_tokens + self.kv_reserved_tokens + self.waiting_need_tokens
        return max(0, math.ceil(demand / max_usage) - self.kv_capacity_tokens)

    @property
    def head_blocked_by_kv(self) -> bool:
        """The oldest waiting request cannot be admitted because KV is short: held + reserved
        + its need exceed the capacity (the scheduler's own admission test, in tokens)."""
        return self.num_waiting_reqs > 0 and (
            self.kv_used_tokens + self.kv_reserved_tokens + self.head_need_tokens
            > self.kv_capacity_tokens)

    def head_kv_wait_s(self) -> float:
        """How much longer the oldest waiting request will wait for KV if nothing changes: the
        running requests release their KV (held + reserved) as they finish, the nearest first;
        it is admitted once the released tokens cover what it lacks. That many decode steps
        times ``step_s``; at least one step while it is blocked (the scheduler looks again only
        then); 0.0 when it is not blocked by KV or no step length is known yet; ``inf`` when
        even every running request's finish does not make room (it needs more than the
        pool)."""
        if not self.head_blocked_by_kv:
            return 0.0
        lacking = (self.kv_used_tokens + self.kv_reserved_tokens + self.head_need_tokens
                   - self.kv_capacity_tokens)
        released = 0
        for steps, tokens in self.running_kv_release:
            released += tokens
            if released >= lacking:
                return max(1, steps) * self.step_s
        return math.inf


def _ewma(previous: float | None, sample: float, alpha: float) -> float:
    # Seeding with the first sample, rather than 0, keeps the first seconds after start from
    # reading as artificially calm.
    return sample if previous is None else alpha * sample + (1.0 - alpha) * previous


class PressureMonitor:
    """Turns a stream of snapshots (and finished-request latencies) into ``PressureSignals``.

    Invariants: snapshot times never go backwards and ``retractions_total`` never decreases
    (either means two sources are mixed up, so ``observe`` refuses it rather than guessing).
    ``ewma_alpha`` in (0, 1] is the weight of the newest sample.
    """

    def __init__(self, ewma_alpha: float = 0.3) -> None:
        if not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"PressureMonitor: ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        self.ewma_alpha = ewma_alpha
        self._last: PressureSnapshot | None = None
        self._kv_usage_ewma: float | None = None
        self._queue_delay_ewma_s: float | None = None
        self._ttft_ewma_s: float | None = None
        self._tpot_ewma_s: float | None = None
        self._step_ewma_s: float | None = None

    def observe(self, snapshot: PressureSnapshot) -> PressureSignals:
        last = self._last
        if last is not None:
            if snapshot.time_s < last.time_s:
                raise ValueError(
                    f"PressureMonitor: time went backwards ({last.time_s} -> {snapshot.time_s}); "
                    f"use a monotonic clock"
                )
            for counter in ("retractions_total", "scheduler_steps_total"):
                if getattr(snapshot, counter) < getattr(last, counter):
                    raise ValueError(f"PressureMonitor: {counter} decreased "
                                     f"({getattr(last, counter)} -> {getattr(snapshot, counter)})")
        # The first snapshot has no predecessor: retractions before monitoring began are not news.
        retractions_delta = (
            0 if last is None else snapshot.retractions_total - last.retractions_total
        )
        cap = snapshot.kv_capacity_tokens
        kv_usage = snapshot.kv_used_tokens / cap if cap > 0 else 0.0
        a = self.ewma_alpha
        self._kv_usage_ewma = _ewma(self._kv_usage_ewma, kv_usage, a)
        self._queue_delay_ewma_s = _ewma(self._queue_delay_ewma_s, snapshot.head_wait_s, a)
        if last is not None and snapshot.num_running_reqs and last.num_running_reqs:
            # Both ends busy: the loop ran batches in between, so the gap per iteration is the
            # step length (idle iterations, a second apart with --sleep-on-idle, stay out).
            steps = snapshot.scheduler_steps_total - last.scheduler_steps_total
            if steps > 0:
                self._step_ewma_s = _ewma(self._step_ewma_s,
                                          (snapshot.time_s - last.time_s) / steps, a)
        self._last = snapshot
        return PressureSignals(
            time_s=snapshot.time_s,
            kv_usage=kv_usage,
            kv_usage_ewma=self._kv_usage_ewma,
            num_waiting_reqs=snapshot.num_waiting_reqs,
            head_wait_s=snapshot.head_wait_s,
            queue_delay_ewma_s=self._queue_delay_ewma_s,
            retractions_delta=retractions_delta,
            num_running_reqs=snapshot.num_running_reqs,
            kv_capacity_tokens=cap,
            kv_used_tokens=snapshot.kv_used_tokens,
            ttft_ewma_s=self._ttft_ewma_s,
            tpot_ewma_s=self._tpot_ewma_s,
            kv_reserved_tokens=snapshot.kv_reserved_tokens,
            head_need_tokens=snapshot.head_need_tokens,
            waiting_need_tokens=snapshot.waiting_need_tokens,
            sample_gap_s=0.0 if last is None else snapshot.time_s - last.time_s,
            step_s=self._step_ewma_s or 0.0,
            running_kv_release=tuple(sorted(snapshot.running_kv_release)),
        )

    def record_request_latency(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """Feed one finished request's latencies; None skips that metric (e.g. a 1-token reply
        has no TPOT). The EWMAs show up in the next ``observe`` result."""
        if ttft_s is not None:
            _check_non_negative("record_request_latency", ttft_s=ttft_s)
            self._ttft_ewma_s = _ewma(self._ttft_ewma_s, ttft_s, self.ewma_alpha)
        if tpot_s is not None:
            _check_non_negative("record_request_latency", tpot_s=tpot_s)
            self._tpot_ewma_s = _ewma(self._tpot_ewma_s, tpot_s, self.ewma_alpha)
