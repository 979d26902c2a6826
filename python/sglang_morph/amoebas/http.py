"""``/amoebas/*`` routes in SGLang's HTTP server. Every replica answers every request through
the elastic core's control client (``elastic/control.py``), which waits for all of them.

Auth as ``/morph`` and ``/kunserve``: ``GET /amoebas/status`` is a normal endpoint
(``--api-key``), the transitions are ``ADMIN_OPTIONAL`` (``--admin-api-key`` when set).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_morph.amoebas.messages import AmoebasMergeReq, AmoebasSplitReq, AmoebasStatusReq
from sglang_morph.elastic.control import answer_of_every_replica, json_object


async def _forward(req: Any) -> JSONResponse:
    return await answer_of_every_replica(req, "AMOEBAs", "units")


async def _replica_list(request: Request, field: str) -> tuple[list[int] | None, str | None]:
    """``body[field]``: a list of at least two distinct replica numbers, sorted; or an
    error message naming the field."""
    body = await json_object(request)
    if body is None:
        return None, f"the body must be a JSON object with {field!r}"
    unknown = sorted(set(body) - {field})
    if unknown:
        return None, f"unknown fields {unknown}; the only field is {field!r}"
    value = body.get(field)
    if (not isinstance(value, list) or len(value) < 2
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in value)
            or len(set(value)) != len(value)):
        return None, f"{field!r} must be a list of at least two distinct replica numbers"
    return sorted(value), None


def add_routes(app: Any) -> None:
    """Add the /amoebas routes to SGLang's FastAPI ``app`` (launcher process, before serving)."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def amoebas_status(digest: bool = False):
        """Units (replicas serving alone and merged groups), each replica's group, degree,
        heads and FFN rows, KV capacity and use, FFN bytes released, and its recent
        transitions.

        Body: none. The query parameter ``digest=1`` adds ``ffn_sha256``, a digest of the FFN
        rows each replica holds (to check that a merge and split gave every byte back), and
        ``kv_resident_bytes``, the KV mapping's bytes backed by memory; both read every page,
        so a client polling the status leaves it off.

        Answers: 200 with ``{"units": [[0, 1, 2]] or [[0], [1], [2]], "replicas": [...]}``,
        one status per replica; 503 when AMOEBAs is not running in this server.
        """
        return await _forward(AmoebasStatusReq(digest=digest))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def amoebas_merge(request: Request):
        """Merge replicas serving alone into one tensor-parallel group: each keeps its share
        of the heads and the FFN, the KV of requests in flight is re-sharded by head, and each
        batch of a member runs on every member. Requests in flight keep running.

        Body: ``{"replicas": [0, 1, 2]}``: a group the server allows (``--amoebas-degrees``;
        aligned runs of replicas, e.g. [0, 1] or [2, 3] of degree 2).

        Answers: 200 with the new status (as ``GET /amoebas/status``); 400 with
        ``{"error": ...}`` for a bad body or a group the server does not allow; 409 when a
        member refuses (not serving alone); 500 when the merge failed on a member and was
        undone on all; 503 when AMOEBAs is not running in this server.
        """
        replicas, error = await _replica_list(request, "replicas")
        if error is not None:
            return JSONResponse({"error": error}, status_code=400)
        return await _forward(AmoebasMergeReq(replicas=replicas))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def amoebas_split(request: Request):
        """Split a merged group back into replicas serving alone: each takes back every head
        of its requests' KV and its whole FFN. Requests in flight keep running.

        Body: ``{"group": [0, 1, 2]}``, the group's replicas as ``GET /amoebas/status`` lists
        them.

        Answers: 200 with the new status; 400 for a bad body; 409 when the group does not
        exist or a member holds more KV than a replica alone can (retry once fewer tokens are
        held); 500 when the split failed and was undone on every member; 503 when AMOEBAs is
        not running in this server.
        """
        group, error = await _replica_list(request, "group")
        if error is not None:
            return JSONResponse({"error": error}, status_code=400)
        return await _forward(AmoebasSplitReq(group=group))

    app.add_api_route("/amoebas/status", amoebas_status, methods=["GET"])
    app.add_api_route("/amoebas/merge", amoebas_merge, methods=["POST"])
    app.add_api_route("/amoebas/split", amoebas_split, methods=["POST"])
