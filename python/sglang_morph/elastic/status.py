"""``GET /elastic/status``: every enabled mechanism, its state and its recent transitions.

Each scheduler keeps an ``ElasticHost`` (``scheduler.elastic``): the mechanisms attached to it,
their per-step entries and state functions. The route sends one ``ElasticStatusReq``; every
scheduler answers with its host's view through the core's ``ControlOutput`` (TP rank 0 and
pipeline stage 0 are the ranks SGLang lets answer the tokenizer, one per data-parallel
replica), and the route returns ``{"mechanisms": [...], "replicas": [...]}``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from sglang_morph.elastic.control import (
    ControlOutput,
    control_client,
    not_running,
    replica_index,
)
from sglang_morph.elastic.record import recorder

logger = logging.getLogger("sglang_morph")


class ElasticStatusReq(BaseReq, kw_only=True):
    """``GET /elastic/status``."""


hook_custom_types(ElasticStatusReq)


@dataclasses.dataclass
class ElasticHost:
    """The mechanisms of one scheduler. Invariant: ``steps`` holds exactly the per-step
    entries of ``states``' mechanisms that have one, in registration order."""

    scheduler: Any
    states: dict[str, Callable[[], dict[str, Any]]] = dataclasses.field(default_factory=dict)
    steps: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def add(self, name: str, step: Callable[[], None] | None,
            state: Callable[[], dict[str, Any]]) -> None:
        if name in self.states:
            raise ValueError(f"mechanism {name!r} attached twice")
        self.states[name] = state
        if step is not None:
            self.steps.append(step)

    def on_step(self) -> None:
        for step in self.steps:
            step()

    def status(self) -> dict[str, Any]:
        rec = recorder(self.scheduler)
        return {"replica": replica_index(),
                "mechanisms": {name: {"state": state(), "transitions": rec.summary(name)}
                               for name, state in self.states.items()}}

    def handle_status(self, req: ElasticStatusReq) -> ControlOutput:
        try:
            code, body = 200, self.status()
        except Exception as e:  # the scheduler must keep serving; the caller gets the reason
            logger.exception("sglang-morph: /elastic/status failed")
            code, body = 500, {"error": f"{type(e).__name__}: {e}"}
        return ControlOutput(rid=req.rid, status_code=code, body=body, replica=replica_index())


def host(scheduler: Any) -> ElasticHost:
    """The scheduler's host, made (and its status request registered) on first use."""
    existing = scheduler.__dict__.get("elastic")
    if existing is not None:
        return existing
    from sglang.utils import TypeBasedDispatcher

    made = ElasticHost(scheduler)
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(ElasticStatusReq, made.handle_status)])
    scheduler.elastic = made
    return made


def add_routes(app: Any) -> None:
    from fastapi.responses import JSONResponse

    async def elastic_status():
        """Every enabled mechanism with its state per replica and its recent transitions.

        Answers: 200 with ``{"mechanisms": [names], "replicas": [{"replica", "mechanisms":
        {name: {"state", "transitions": {"totals", "recent"}}}}]}``; 500 with ``{"error":
        ...}`` when a scheduler could not build its part; 503 when no mechanism is enabled on
        this server ("an elastic mechanism is not running in this server").
        """
        client = control_client()
        if client is None:
            return not_running("an elastic mechanism")
        outs = await client.call(ElasticStatusReq())
        failed = [o for o in outs if o.status_code != 200]
        if failed:
            return JSONResponse(failed[0].body, status_code=failed[0].status_code)
        names = sorted({name for o in outs for name in o.body["mechanisms"]})
        return JSONResponse({"mechanisms": names, "replicas": [o.body for o in outs]})

    app.add_api_route("/elastic/status", elastic_status, methods=["GET"])
