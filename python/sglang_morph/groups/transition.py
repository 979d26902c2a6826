"""Voted transitions of a replica group: a change that happens on every member or on none.

Every member's scheduler thread enters the same transition at the same point (the same
control request, or a leader's proposal) and runs ``GroupTransitions.run``:

1. **vote**: each member states its refusal (None agrees); the votes are all-gathered, and
   one refusal anywhere refuses the transition on every member, before anything changed;
2. **phases**, in order: each member runs the phase's ``do``, then the members all-gather
   their outcomes. When any member failed, every member undoes this phase (completed, or
   partial on the member that failed) and every earlier one, newest first, and the
   transition FAILED having changed nothing;
3. **last step** (optional): a step each member runs alone after every member completed every
   phase (e.g. a local resize already checked in the vote); it is neither exchanged nor
   undone, so its failure leaves the phases applied and says so in the error;
4. **record**: one ``elastic.contract.Transition`` (APPLIED, REFUSED or FAILED, with the error
   text and ``detail["step_seconds"]``: where this member's time went) in the scheduler's
   ``TransitionRecorder``, returned to the caller.

``step_seconds`` (also ``GroupTransitions.step_seconds`` once ``run`` returns) names, in
order: ``vote`` (this member's vote until every member's is in: the wait for the slowest
member to reach the transition), each phase that ran (its ``do`` on this member) followed by
``<phase> exchange`` (the wait for every member's outcome: the slowest member's ``do``), then
``undo`` or ``last step`` when they ran. A transition's cost on the group is the sum of the
slowest member's.

Invariants: every member reaches the same outcome for the vote and for each phase (they
decide from the same all-gathered values); a phase's ``undo`` reverts whatever its ``do``
changed, whether ``do`` completed or raised partway; no batch runs between a phase and its
undo (the scheduler thread is inside ``run``). The votes travel on the link's ``control``
group (``GroupLink.all_gather``); tests pass any all-gather.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from sglang_morph.elastic.contract import Outcome, Transition
from sglang_morph.elastic.record import TransitionRecorder

logger = logging.getLogger("sglang_morph.groups")

# An error text travels in a vote (``link._VOTE_BYTES``); tracebacks stay in the member's log.
_ERROR_CHARS = 1000


@dataclasses.dataclass(frozen=True)
class Phase:
    """One step run on every member. ``do`` completes or raises; ``undo`` reverts what ``do``
    changed, also after a ``do`` that raised partway (nothing, if it changed nothing)."""

    name: str
    do: Callable[[], None]
    undo: Callable[[], None]


@dataclasses.dataclass(frozen=True)
class LastStep:
    """A step each member runs alone once every member completed every phase; not undone.
    ``if_failed`` says what stays applied when it raises."""

    do: Callable[[], None]
    if_failed: str


@dataclasses.dataclass(frozen=True)
class VotedTransition:
    """What every member of the group runs: ``refusal`` is this member's vote (None agrees);
    ``detail`` goes into the record whatever the outcome."""

    action: str
    reason: str
    refusal: str | None
    phases: tuple[Phase, ...]
    last: LastStep | None = None
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Held from the end of the vote to the end of the transition (the member's compute lock):
    # once every member voted none is inside a forward, but a member that finishes first
    # serves again and may call the others' service threads while they still undo or commit.
    exclusive: Any = None


class GroupTransitions:
    """One member's runner of voted transitions (its scheduler thread only).

    ``gather(value)`` returns every member's value by rank (``GroupLink.all_gather``);
    ``replicas[r]`` names member ``r`` in error texts and records; ``capacity_tokens()`` is this
    member's KV capacity, recorded before and after."""

    def __init__(self, gather: Callable[[Any], list[Any]], rank: int, replicas: Sequence[int],
                 mechanism: str, recorder: TransitionRecorder | None,
                 capacity_tokens: Callable[[], int]):
        self.gather, self.rank, self.replicas = gather, rank, tuple(replicas)
        self.mechanism, self.recorder, self.capacity_tokens = mechanism, recorder, capacity_tokens
        self.step_seconds: dict[str, float] = {}  # the last transition's (see the module doc)

    @property
    def replica(self) -> int:
        return self.replicas[self.rank]

    def run(self, t: VotedTransition,
            applied: Callable[[float], Mapping[str, Any]] | None = None) -> Transition:
        """Vote, run the phases, record. ``applied(seconds)`` runs once the transition applied
        (``seconds``: from the end of the vote, so the wait for the other members is not
        counted) and returns the record's detail; what it raises propagates unrecorded."""
        started = time.perf_counter()
        before = int(self.capacity_tokens())
        self.step_seconds = {}
        outcome, error, voted_at = self._run(t)
        detail = {**t.detail, "step_seconds": {k: round(v, 6)
                                               for k, v in self.step_seconds.items()}}
        if outcome is Outcome.APPLIED and applied is not None:
            detail.update(applied(time.perf_counter() - voted_at))
        record = Transition(
            mechanism=self.mechanism, replica=self.replica, action=t.action, reason=t.reason,
            outcome=outcome, duration_s=time.perf_counter() - started,
            capacity_before_tokens=before, capacity_after_tokens=int(self.capacity_tokens()),
            error=error, detail=detail)
        return self.recorder.record(record) if self.recorder is not None else record

    def _run(self, t: VotedTransition) -> tuple[Outcome, str, float]:
        """The outcome, its error text ("" when applied) and when the vote ended."""
        with self._timed("vote"):
            votes = self.gather(t.refusal)
        voted_at = time.perf_counter()
        if any(v is not None for v in votes):
            return Outcome.REFUSED, self._refused_text(t.action, votes), voted_at
        with t.exclusive if t.exclusive is not None else contextlib.nullcontext():
            return self._run_phases(t, voted_at)

    def _run_phases(self, t: VotedTransition, voted_at: float) -> tuple[Outcome, str, float]:
        for k, phase in enumerate(t.phases):
            with self._timed(phase.name):
                error = self._attempt(phase)
            with self._timed(f"{phase.name} exchange"):
                outcomes = self.gather(error)
            failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
            if failed:
                with self._timed("undo"):
                    undo_errors = self._undo(t.phases[:k + 1])
                return Outcome.FAILED, self._failed_text(t.action, phase, failed,
                                                         undo_errors), voted_at
        if t.last is not None:
            try:
                with self._timed("last step"):
                    t.last.do()
            except Exception as e:
                logger.exception("sglang-morph: %s %s: the last step failed on replica %d",
                                 self.mechanism, t.action, self.replica)
                return Outcome.FAILED, f"{t.action}: {t.last.if_failed}: {_text(e)}", voted_at
        return Outcome.APPLIED, "", voted_at

    @contextlib.contextmanager
    def _timed(self, step: str):
        """``step_seconds[step]``: the wall seconds of the block (also when it raises)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.step_seconds[step] = time.perf_counter() - began

    def _attempt(self, phase: Phase) -> str | None:
        try:
            phase.do()
        except Exception as e:
            logger.exception("sglang-morph: %s phase %s failed on replica %d", self.mechanism,
                             phase.name, self.replica)
            return _text(e)[:_ERROR_CHARS]
        return None

    def _undo(self, phases: Sequence[Phase]) -> list[str]:
        """Undo ``phases`` newest first; an undo that raises is logged and the others still
        run. The errors of those that raised."""
        errors = []
        for phase in reversed(phases):
            try:
                phase.undo()
            except Exception as e:
                logger.exception("sglang-morph: %s could not undo phase %s on replica %d",
                                 self.mechanism, phase.name, self.replica)
                errors.append(f"undo of {phase.name}: {_text(e)}")
        return errors

    def _refused_text(self, action: str, votes: list[Any]) -> str:
        """This member's own reason when it refused, else the first other member's."""
        own = votes[self.rank]
        if own is not None:
            return own
        r, reason = next((r, v) for r, v in enumerate(votes) if v is not None)
        return f"replica {self.replicas[r]} refused the {action}: {reason}"

    def _failed_text(self, action: str, phase: Phase, failed: list[tuple[int, str]],
                     undo_errors: list[str]) -> str:
        """This member's own failure when it failed, else the first other member's."""
        r, error = next(((r, e) for r, e in failed if r == self.rank), failed[0])
        text = f"replica {self.replicas[r]} failed in {phase.name}: {error}"
        if r != self.rank:
            text += f"; undone on replica {self.replica}"
        if undo_errors:
            return (f"{action} failed and could not be undone on replica {self.replica} "
                    f"({'; '.join(undo_errors)}): {text}")
        return f"{action} failed, nothing changed: {text}"


def _text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
