"""``/kunserve/*`` routes in SGLang's HTTP server. Both replicas answer every request through
the elastic core's control client (``elastic/control.py``), which waits for both.

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
from sglang_morph.elastic.control import answer_of_every_replica, json_object


async def _forward(req: Any) -> JSONResponse:
    return await answer_of_every_replica(req, "KunServe", "groups")


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


async def _transition(request: Request, req: Any) -> JSONResponse:
    error = await _empty_body(request)
    if error is not None:
        return JSONResponse({"error": error}, status_code=400)
    return await _forward(req)


def add_routes(app: Any) -> None:
    """Add the /kunserve routes to SGLang's FastAPI ``app`` (launcher process, before serving)."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def kunserve_status():
        """Groups, layers held per replica, KV capacity per replica, transitions.

        Answers: 200 with ``{"groups": [[0, 1]], "replicas": [...]}`` (``[[0], [1]]`` while
        the replicas serve apart), one status per replica; 503 when KunServe is not running
        in this server.
        """
        return await _forward(KunServeStatusReq())

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def kunserve_drop(request: Request):
        """Merge replicas 0 and 1 into one group: replica 0 keeps decoder layers [0, k) and
        replica 1 layers [k, L) (k from the drop planner), the dropped weights' memory becomes
        KV capacity, and each batch runs through the pair as a two-stage pipeline. Requests in
        flight keep running; their KV moves with the layers.

        Body: none, or an empty JSON object (the transition takes no parameters).

        Answers: 200 with the new status (as ``GET /kunserve/status``); 400 with
        ``{"error": ...}`` for any other body; 409 when a replica refuses (already merged);
        500 when the drop failed on a replica and was undone on both; 503 when KunServe is not
        running in this server. A 409 or 500 carries ``{"error": ..., "replicas": [...]}``.
        """
        return await _transition(request, KunServeDropReq())

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def kunserve_restore(request: Request):
        """Split the group: each replica takes back every layer and its own KV, and serves on
        its own again. Requests in flight keep running.

        Body: none, or an empty JSON object (the transition takes no parameters).

        Answers: 200 with the new status (as ``GET /kunserve/status``); 400 with
        ``{"error": ...}`` for any other body; 409 when a replica refuses (not merged, or it
        holds more KV tokens in flight than a whole replica's pool: retry once fewer are held);
        500 when the restore failed (undone on both replicas when moving the KV back failed);
        503 when KunServe is not running in this server. A 409 or 500 carries
        ``{"error": ..., "replicas": [...]}``.
        """
        return await _transition(request, KunServeRestoreReq())

    app.add_api_route("/kunserve/status", kunserve_status, methods=["GET"])
    app.add_api_route("/kunserve/drop", kunserve_drop, methods=["POST"])
    app.add_api_route("/kunserve/restore", kunserve_restore, methods=["POST"])
