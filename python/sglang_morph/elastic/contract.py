"""What every live mechanism shares: typed transitions, one error type, the controller and
mechanism protocols. Plain Python (no SGLang, no torch): controllers and simulators use it."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Generic, Mapping, Protocol, TypeVar, runtime_checkable

Observation = TypeVar("Observation", contravariant=True)
Action = TypeVar("Action", covariant=True)


class Outcome(str, enum.Enum):
    """How a transition ended. Invariant: only APPLIED changed anything."""

    APPLIED = "applied"
    REFUSED = "refused"  # checked before any change (409): nothing changed
    FAILED = "failed"  # started, failed, undone (500): nothing changed


class ElasticError(ValueError):
    """A control request or transition that cannot be applied; ``status_code`` is its HTTP
    status (400 bad request, 409 refused in this state, 500 failed and undone)."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


@dataclasses.dataclass(frozen=True)
class Transition:
    """One record of the transitions log, whatever the mechanism.

    ``capacity_*_tokens`` is the replica's KV capacity around the transition (equal when it
    did not apply); ``detail`` holds the mechanism's own fields (layers, bits, bytes moved).
    """

    mechanism: str
    replica: int
    action: str
    reason: str
    outcome: Outcome
    duration_s: float
    capacity_before_tokens: int
    capacity_after_tokens: int
    time_unix_s: float = dataclasses.field(default_factory=time.time)
    error: str = ""
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["outcome"] = self.outcome.value
        out["detail"] = dict(self.detail)
        return out


@runtime_checkable
class Controller(Protocol, Generic[Observation, Action]):
    """Decides from an observation; told what happened. Pure: no SGLang object reaches it."""

    def decide(self, observation: Observation) -> Action | None: ...

    def applied(self, transition: Transition) -> None: ...


class ElasticMechanism(Protocol):
    """The scheduler side of a live mechanism on one replica.

    Invariants: ``apply`` runs between two batches on the scheduler thread and either changes
    the server completely and returns an APPLIED transition, or raises ``ElasticError`` having
    changed nothing, or returns None having forwarded the action to the ranks that apply it
    (coordination: the leader of several ranks decides for all); ``check_integrity`` raises AssertionError when the mechanism's state and
    SGLang's objects disagree (e.g. free + used + cached KV pages != total).
    """

    name: str

    def observe(self) -> Any: ...

    def apply(self, action: Any) -> Transition | None: ...

    def is_leader(self) -> bool: ...

    def state(self) -> dict[str, Any]: ...

    def check_integrity(self) -> None: ...
