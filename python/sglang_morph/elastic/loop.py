"""``ElasticLoop``: the observe -> decide -> apply -> record loop of one mechanism on one
scheduler, called from the per-step hook (``Scheduler.get_next_batch_to_run``, thousands of
times a second while idle: everything before the interval check is O(1))."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from sglang_morph.elastic.contract import (
    Controller,
    ElasticError,
    ElasticMechanism,
    Outcome,
    Transition,
)
from sglang_morph.elastic.record import TransitionRecorder

logger = logging.getLogger("sglang_morph")


class ElasticLoop:
    """Runs ``mechanism`` under ``controller`` every ``interval_s`` at most.

    Invariants: only the leader (``mechanism.is_leader()``) decides; a transition is recorded
    whatever its outcome; ``check_integrity`` runs after every transition, so a mechanism that
    broke its invariant stops the scheduler at the step that broke it rather than later.
    """

    def __init__(self, mechanism: ElasticMechanism, controller: Controller,
                 recorder: TransitionRecorder, interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.mechanism = mechanism
        self.controller = controller
        self.recorder = recorder
        self.interval_s = interval_s
        self.clock = clock
        self._next_s = 0.0
        self.last_observation: Any = None

    def observe_now(self) -> None:
        """The next ``on_step`` observes (and the leader decides) without waiting for the
        interval: for an event the mechanism sees between two observations (a queue the
        engine just refused) that should not wait up to an interval."""
        self._next_s = 0.0

    def on_step(self) -> None:
        now = self.clock()
        if now < self._next_s:
            return
        self._next_s = now + self.interval_s
        self.last_observation = observation = self.mechanism.observe()
        if not self.mechanism.is_leader():
            return
        action = self.controller.decide(observation)
        if action is not None:
            self.run(action, reason=str(getattr(action, "reason", "")))

    def run(self, action: Any, reason: str) -> Transition | None:
        """Apply ``action`` now (the controller's, or an operator's) and record the outcome.

        None when the mechanism forwarded the action instead of applying it here (the leader
        of several ranks sends it to all of them, and each records what it applied)."""
        started = time.perf_counter()
        try:
            transition = self.mechanism.apply(action)
            if transition is None:
                return None
        except ElasticError as e:
            # Refused or failed changed nothing (the contract), so the capacity now is the
            # capacity before; only this path needs it.
            capacity = int(self.mechanism.state().get("kv_capacity_tokens", 0))
            outcome = Outcome.REFUSED if e.status_code < 500 else Outcome.FAILED
            transition = Transition(
                mechanism=self.mechanism.name, replica=self.recorder.replica,
                action=type(action).__name__, reason=reason, outcome=outcome,
                duration_s=time.perf_counter() - started, capacity_before_tokens=capacity,
                capacity_after_tokens=capacity, error=str(e))
            logger.warning("sglang-morph: %s %s %s: %s", self.mechanism.name,
                           transition.action, outcome.value, e)
        self.recorder.record(transition)
        self.controller.applied(transition)
        self.mechanism.check_integrity()
        return transition
