"""``/kunserve/*`` routes in SGLang's HTTP server. Both replicas answer every request through
the morph routes' control client (``morph/http.py``), which waits for both.

Auth as ``/morph``: ``GET /kunserve/status`` is a normal endpoint (``--api-key``), the
transitions are ``ADMIN_OPTIONAL`` (``--admin-api-key`` when set)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_morph.kunserve.live.messages import (
    KunServeDropReq,
    KunServeRestoreReq,
    KunServeStatusReq,
)
from sglang_morph.morph.http import control_client, json_object


async def _forward(req: Any) -> JSONResponse:
    client = control_client()
    if client is None:
        return JSONResponse({"error": "KunServe is not running in this server"}, status_code=503)
    outs = await client.call(req)
    bodies = [o.body for o in outs]
    failed = [o for o in outs if o.status_code != 200]
    if failed:
        return JSONResponse({"error": " / ".join(o.body.get("error", "") for o in failed),
                             "replicas": bodies}, status_code=failed[0].status_code)
    groups = sorted({tuple(b["group"]) for b in bodies})
    return JSONResponse({"groups": [list(g) for g in groups], "replicas": bodies})


async def _empty_body(request: Request) -> str | None:
    """The transitions take no parameters: no body, or an empty JSON object. A message when
    the body is anything else."""
    if not (await request.body()).strip():
        return None
    body = await json_object(request)
    if body is None:
        return "the body must be empty or a JSON object"
    if body:
        return (f"unknown fields {sorted(body)}: the group is replicas 0 and 1, split as the "
                f"drop planner says, and takes no parameters")
    return None


def add_routes(app: Any) -> None:
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def kunserve_status():
        """Groups, layers held per replica, KV capacity per replica, transitions."""
        return await _forward(KunServeStatusReq())

    def transition(req_type: type):
        @auth_level(AuthLevel.ADMIN_OPTIONAL)
        async def route(request: Request):
            error = await _empty_body(request)
            if error is not None:
                return JSONResponse({"error": error}, status_code=400)
            return await _forward(req_type())
        return route

    app.add_api_route("/kunserve/status", kunserve_status, methods=["GET"])
    app.add_api_route("/kunserve/drop", transition(KunServeDropReq), methods=["POST"])
    app.add_api_route("/kunserve/restore", transition(KunServeRestoreReq), methods=["POST"])
