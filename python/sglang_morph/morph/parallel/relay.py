"""One controller decides for every rank of a model: TP rank 0 or pipeline stage 0.

Under tensor and pipeline parallelism every rank holds a replica of one schedule and must apply
the same transition at the same point of it; a controller per rank would decide from its own
clock and samples. So only the process that receives from the TokenizerManager (TP rank 0,
pipeline stage 0) decides. Its action (``MorphActionReq``) joins that process's local inputs
for the next step: the plugin's AFTER hook on ``Scheduler._poll_timeout_aborts``, which SGLang
calls only there (``ingest_requests``, at pp_rank 0 and attn_tp_rank 0) for its own decisions
that every rank must apply alike (timeout aborts). SGLang then hands those inputs to every rank
as it hands them ``/morph`` requests: under TP the broadcast of each step's inputs, under PP
the forward of each step's inputs to the next stage, which dispatches them in the same loop
iteration before scheduling. Each rank's dispatcher applies the action at that point. The
deciding process decides nothing more until its action came back through its own dispatcher.
"""

from __future__ import annotations

import uuid
from typing import Any


class ActionRelay:
    """Invariant: at most one action is between ``send`` and ``received`` at a time, and only
    the leading process (``leads``) ever sends."""

    def __init__(self, leads: bool):
        self.leads = leads
        self._outbox: list[Any] = []  # sent, not yet out with the step's inputs
        self._in_flight = False  # out, not yet back through the dispatcher

    @classmethod
    def of(cls, runtime: Any) -> "ActionRelay | None":
        """The relay of a TP or PP runtime (None on one rank: the controller applies its own
        actions at once)."""
        ranks = runtime.tensor or runtime.pipeline
        return cls(leads=ranks.rank == 0) if ranks is not None else None

    def decides(self) -> bool:
        """Whether this process's controller decides now: the leader's, once its last action
        came back."""
        return self.leads and not self._in_flight

    def send(self, action: Any) -> None:
        """Hand ``action`` to every rank with the next step's inputs."""
        from sglang_morph.morph.messages import MorphActionReq

        if not self.decides():
            raise RuntimeError("only the leading rank sends, one action at a time")
        self._outbox.append(MorphActionReq(
            rid=f"morph-action-{uuid.uuid4().hex}", layers=list(action.layers),
            bits=action.bits, reason=action.reason))
        self._in_flight = True

    def outgoing(self) -> list[Any]:
        """Each step, on the leader: what joins the inputs SGLang hands every rank."""
        out, self._outbox = self._outbox, []
        return out

    def received(self) -> None:
        """The dispatcher of this process handled the action (every rank handles it at the
        same point of the schedule)."""
        self._in_flight = False
