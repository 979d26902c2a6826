"""``/morph/*`` routes in SGLang's HTTP server and the client that forwards them to the scheduler.

The morphing state lives in the scheduler process; a route sends a typed request
(``messages.MorphStatusReq``, ``MorphSwapReq``, ``MorphModeReq``) through the TokenizerManager's
scheduler socket and awaits the ``MorphControlOutput`` that the scheduler sends back on its
control-output channel (dispatched by the TokenizerManager's result dispatcher, the same path
SGLang's own control requests take). The scheduler applies a swap between two batches and
answers with the new status.

Auth: the control routes are ``ADMIN_OPTIONAL`` in SGLang's auth model (``--api-key`` protects
them; with ``--admin-api-key`` set only the admin key opens them); ``GET /morph/status`` is a
normal endpoint (``--api-key`` protects it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_morph.server.messages import (
    MorphControlOutput,
    MorphModeReq,
    MorphStatusReq,
    MorphSwapReq,
)

logger = logging.getLogger("sglang_morph")

# A swap of every layer with a KV move takes seconds on CPU; past this the route gives up (the
# scheduler still finishes the transition, and /morph/status shows it).
CONTROL_TIMEOUT_S = 300.0


class MorphControlClient:
    """Pending control requests of one TokenizerManager, keyed by request id."""

    def __init__(self, tokenizer_manager: Any):
        self.tokenizer_manager = tokenizer_manager
        self._pending: dict[str, asyncio.Future] = {}

    async def call(self, req: MorphStatusReq | MorphSwapReq | MorphModeReq) -> tuple[int, Any]:
        """Send ``req`` (its ``rid`` is set here) and return the scheduler's (status, body)."""
        req.rid = f"morph-{uuid.uuid4().hex}"
        future = asyncio.get_running_loop().create_future()
        self._pending[req.rid] = future
        tm = self.tokenizer_manager
        tm.auto_create_handle_loop()  # the loop that receives scheduler outputs
        try:
            await tm._async_dispatch_to_scheduler(req)
            out: MorphControlOutput = await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        finally:
            self._pending.pop(req.rid, None)
        return out.status_code, out.body

    def on_output(self, out: MorphControlOutput) -> None:
        future = self._pending.get(out.rid)
        if future is not None and not future.done():
            future.set_result(out)


def attach_to_tokenizer_manager(tokenizer_manager: Any) -> None:
    """Give ``tokenizer_manager`` a control client and route scheduler answers to it."""
    from sglang.utils import TypeBasedDispatcher

    client = MorphControlClient(tokenizer_manager)
    tokenizer_manager._result_dispatcher += TypeBasedDispatcher(
        [(MorphControlOutput, client.on_output)]
    )
    tokenizer_manager.morph_control = client


def _bad_request(message: str):
    return JSONResponse({"error": message}, status_code=400)


async def _forward(req: MorphStatusReq | MorphSwapReq | MorphModeReq):
    from sglang.srt.entrypoints.http_server import get_global_state

    client = getattr(get_global_state().tokenizer_manager, "morph_control", None)
    if client is None:
        return JSONResponse({"error": "sglang-morph is not running in this server"},
                              status_code=503)
    status_code, body = await client.call(req)
    return JSONResponse(body, status_code=status_code)


async def _json_object(request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def add_routes(app: Any) -> None:
    """Add the /morph routes to SGLang's FastAPI ``app`` (launcher process, before serving)."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def morph_status():
        """Layer precisions, KV capacity and usage, the memory budget, recent transitions."""
        return await _forward(MorphStatusReq())

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def morph_swap(request: Request):
        """``{"layers": [0, 3], "bits": 4}``; bits 16 restores full precision. The layers stay
        pinned where the operator put them (the controller does not move them) unless
        ``"pin": false``, which hands them back to the controller."""
        body = await _json_object(request)
        if body is None:
            return _bad_request('expected a JSON object like {"layers": [0, 1], "bits": 4}')
        unknown = sorted(set(body) - {"layers", "bits", "pin"})
        if unknown:
            return _bad_request(f"unknown fields {unknown}; expected 'layers', 'bits' and "
                                f"optionally 'pin'")
        layers, bits = body.get("layers"), body.get("bits")
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
            return _bad_request("'layers' must be a non-empty list of layer indices")
        if not isinstance(bits, int) or isinstance(bits, bool):
            return _bad_request("'bits' must be an integer bit-width (16 restores)")
        pin = body.get("pin", True)
        if not isinstance(pin, bool):
            return _bad_request("'pin' must be true or false")
        return await _forward(MorphSwapReq(layers=layers, bits=bits, pin=pin))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def morph_mode(request: Request):
        """``{"mode": "performance"}``: change the controller's policy at runtime."""
        body = await _json_object(request)
        if body is None or not isinstance(body.get("mode"), str) or set(body) != {"mode"}:
            return _bad_request('expected a JSON object like {"mode": "performance"}')
        return await _forward(MorphModeReq(mode=body["mode"]))

    app.add_api_route("/morph/status", morph_status, methods=["GET"])
    app.add_api_route("/morph/swap", morph_swap, methods=["POST"])
    app.add_api_route("/morph/mode", morph_mode, methods=["POST"])
