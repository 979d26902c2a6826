"""``/kunserve/*`` routes in SGLang's HTTP server. Every replica answers every request through
the elastic core's control client (``elastic/control.py``), which waits for all of them; a
transition runs on the group it names (a pair, or ``--kunserve-group-size`` replicas), the
other replicas answer with their status.

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
from sglang_morph.elastic.control import answer_of_every_replica, json_object, replica_list


async def _forward(req: Any) -> JSONResponse:
    return await answer_of_every_replica(req, "KunServe", "groups")


async def _group(request: Request) -> tuple[list[int] | None, str | None]:
    """The group a transition names: ``{"group": [a, b, ...]}``, or None for no body or an
    empty JSON object (the only group of the launch; the replicas refuse it on a launch of
    several). A message when the body is anything else; whether the group is one of the
    launch's (its size included), the replicas check."""
    if not (await request.body()).strip():
        return None, None
    body = await json_object(request)
    if body is None:
        return None, "the body must be empty or a JSON object"
    if not body:
        return None, None
    group, _, error = await replica_list(request, "group")
    return group, error


async def _transition(request: Request, req_type: Any) -> JSONResponse:
    group, error = await _group(request)
    if error is not None:
        return JSONResponse({"error": error}, status_code=400)
    return await _forward(req_type(group=group))


def add_routes(app: Any) -> None:
    """Add the /kunserve routes to SGLang's FastAPI ``app`` (launcher process, before serving)."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def kunserve_status():
        """Groups, layers held per replica, KV capacity per replica, transitions.

        Answers: 200 with ``{"groups": [[0, 1]], "replicas": [...]}`` (``[[0], [1]]`` while
        the replicas serve apart; on --dp-size 4, e.g. ``[[0, 1], [2], [3]]``), one status per
        replica; 503 when KunServe is not running in this server.
        """
        return await _forward(KunServeStatusReq())

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def kunserve_drop(request: Request):
        """Merge replicas (a pair, or two or more of a ``--kunserve-group-size`` group): in a
        pair its first replica keeps decoder layers [0, k) and its second layers [k, L) (k
        from the drop planner); in a merge of m each keeps its stage of the planner's m
        ranges, in replica order. The dropped weights' memory becomes KV capacity, and each
        batch runs through the merged replicas as a pipeline of their stages. Requests in
        flight keep running; their KV moves with the layers. The other replicas do not change.

        Body: ``{"group": [2, 3]}``, the pair, or two or more replicas of one group (replicas
        G*i .. G*i + G - 1), taken in replica order; none, or an empty JSON object, for the
        whole group on a launch of one group.

        Answers: 200 with the new status (as ``GET /kunserve/status``); 400 with
        ``{"error": ...}`` for any other body, replicas that are not one pair or two or more
        of one group, or no group on a launch of several groups; 409 when a replica refuses
        (already merged); 500 when the drop failed on a replica and was undone on every one;
        503 when KunServe is not running in this server. A 409 or 500 carries
        ``{"error": ..., "replicas": [...]}``.
        """
        return await _transition(request, KunServeDropReq)

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def kunserve_restore(request: Request):
        """Split merged replicas: each takes back every layer and its own KV, and serves on its
        own again. Requests in flight keep running.

        Body: ``{"group": [2, 3]}``, the replicas merged together (as they dropped); none, or
        an empty JSON object, for the whole group on a launch of one group.

        Answers: 200 with the new status (as ``GET /kunserve/status``); 400 with
        ``{"error": ...}`` as for the drop; 409 when a replica refuses (not merged, merged
        with other replicas, or it holds more KV tokens in flight than a whole replica's pool:
        retry once fewer are held); 500 when the restore failed (undone on every merged
        replica when moving the KV back failed);
        503 when KunServe is not running in this server. A 409 or 500 carries
        ``{"error": ..., "replicas": [...]}``.
        """
        return await _transition(request, KunServeRestoreReq)

    app.add_api_route("/kunserve/status", kunserve_status, methods=["GET"])
    app.add_api_route("/kunserve/drop", kunserve_drop, methods=["POST"])
    app.add_api_route("/kunserve/restore", kunserve_restore, methods=["POST"])
