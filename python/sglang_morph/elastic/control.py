"""Control requests between SGLang's HTTP process and the schedulers, for every mechanism.

A route sends a typed request (a msgspec ``BaseReq``) through the TokenizerManager's scheduler
socket; every scheduler that handles it answers with a ``ControlOutput`` (the HTTP status and
the JSON body) on SGLang's control-output channel, which the TokenizerManager's result
dispatcher hands to the ``ControlClient`` here. Under ``--dp-size N`` SGLang's data-parallel
controller sends a message type it does not know to every replica, so each request gets one
answer per replica; a request addressed to one replica is answered ``SKIPPED`` by the others,
which the client drops. Under tensor parallelism TP rank 0 answers for its group.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from sglang_morph.config import is_int

# The status code of a replica's answer to a request addressed to another replica; the HTTP
# side drops these (never sent to a client).
SKIPPED = 204
# A transition of every layer with a KV move takes seconds on CPU; past this a route gives up
# (the scheduler still finishes the transition, and the status routes show it).
CONTROL_TIMEOUT_S = 300.0


class ControlOutput(BaseReq, kw_only=True):
    """A scheduler's answer to a control request."""

    status_code: int
    body: dict[str, Any]
    replica: int = 0  # the data-parallel replica that answers


hook_custom_types(ControlOutput)


def replica_index() -> int:
    """This scheduler's data-parallel replica: SGLang's ``dp_rank`` (0 without a data-parallel
    controller, and in processes SGLang did not spawn, such as unit tests)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        rank = get_parallel().dp_rank
    except (RuntimeError, ValueError):  # never published: not an SGLang scheduler process
        return 0
    return rank or 0


def replica_count(server_args: Any) -> int:
    """How many replicas answer each control request (``--dp-size``)."""
    return max(1, int(getattr(server_args, "dp_size", 1) or 1))


class ControlClient:
    """Pending control requests of one TokenizerManager, keyed by request id: a request is
    done when all ``replicas`` have answered."""

    def __init__(self, tokenizer_manager: Any, replicas: int = 1):
        self.tokenizer_manager = tokenizer_manager
        self.replicas = replicas
        self._pending: dict[str, tuple[asyncio.Future, list[ControlOutput]]] = {}

    async def call(self, req: Any) -> list[ControlOutput]:
        """Send ``req`` (its ``rid`` is set here) and return the answers of the replicas it
        concerned (one on a server without data parallelism), in replica order."""
        req.rid = f"elastic-{uuid.uuid4().hex}"
        future = asyncio.get_running_loop().create_future()
        self._pending[req.rid] = (future, [])
        tm = self.tokenizer_manager
        tm.auto_create_handle_loop()  # the loop that receives scheduler outputs
        try:
            await tm._async_dispatch_to_scheduler(req)
            outs: list[ControlOutput] = await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self._pending.pop(req.rid, None)
        return sorted((o for o in outs if o.status_code != SKIPPED), key=lambda o: o.replica)

    def on_output(self, out: ControlOutput) -> None:
        future, outs = self._pending.get(out.rid, (None, None))
        if future is None or future.done():
            return
        outs.append(out)
        if len(outs) == self.replicas:
            future.set_result(outs)


def attach_to_tokenizer_manager(tokenizer_manager: Any) -> None:
    """Give ``tokenizer_manager`` a control client and route scheduler answers to it (once,
    whatever the number of mechanisms)."""
    from sglang.utils import TypeBasedDispatcher

    if getattr(tokenizer_manager, "elastic_control", None) is not None:
        return
    client = ControlClient(tokenizer_manager,
                           replica_count(getattr(tokenizer_manager, "server_args", None)))
    tokenizer_manager._result_dispatcher += TypeBasedDispatcher([(ControlOutput, client.on_output)])
    tokenizer_manager.elastic_control = client


def control_client() -> ControlClient | None:
    """The TokenizerManager's control client, or None where no control routes were installed."""
    from sglang.srt.entrypoints.http_server import get_global_state

    return getattr(get_global_state().tokenizer_manager, "elastic_control", None)


def not_running(what: str) -> Any:
    """A control route's answer where its mechanism is not running in this server (no control
    client): 503 with ``{"error": "<what> is not running in this server"}``, so a client can
    tell a server without the mechanism from a bad request."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": f"{what} is not running in this server"}, status_code=503)


async def json_object(request: Any) -> dict[str, Any] | None:
    """The request's JSON body if it is an object, else None (not JSON, or not an object)."""
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


async def replica_list(request: Any, field: str, optional: tuple[str, ...] = ()
                       ) -> tuple[list[int] | None, dict, str | None]:
    """``body[field]`` of a group mechanism's transition: a list of at least two distinct
    replica numbers, sorted, and the body; or an error message naming the field.
    ``optional``: other fields allowed."""
    body = await json_object(request)
    if body is None:
        return None, {}, f"the body must be a JSON object with {field!r}"
    unknown = sorted(set(body) - {field, *optional})
    if unknown:
        allowed = ", ".join(repr(f) for f in (field, *optional))
        return None, body, f"unknown fields {unknown}; the fields are {allowed}"
    value = body.get(field)
    if (not isinstance(value, list) or len(value) < 2 or not all(map(is_int, value))
            or len(set(value)) != len(value)):
        return None, body, f"{field!r} must be a list of at least two distinct replica numbers"
    return sorted(value), body, None


async def answer_of_every_replica(req: Any, what: str, units_key: str) -> Any:
    """A group mechanism's route: ``req`` to every replica, one JSON answer. 200 with
    ``{units_key: [sorted groups], "replicas": [each replica's body]}`` (every body has its
    ``group``); the first failing replica's status with ``{"error": ..., "replicas": [...]}``
    when any failed; 503 where ``what`` is not running in this server."""
    from fastapi.responses import JSONResponse

    client = control_client()
    if client is None:
        return not_running(what)
    outs = await client.call(req)
    bodies = [o.body for o in outs]
    failed = [o for o in outs if o.status_code != 200]
    if failed:
        # Replicas refusing for the same reason (a bad group, say) say it once.
        errors = dict.fromkeys(o.body.get("error", "") for o in failed)
        return JSONResponse({"error": " / ".join(errors),
                             "replicas": bodies}, status_code=failed[0].status_code)
    units = sorted({tuple(b["group"]) for b in bodies})
    return JSONResponse({units_key: [list(u) for u in units], "replicas": bodies})
