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
from sglang_morph.config import is_int
from sglang_morph.elastic.control import answer_of_every_replica, replica_list


async def _forward(req: Any) -> JSONResponse:
    return await answer_of_every_replica(req, "AMOEBAs", "units")


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
        aligned runs of replicas, e.g. [0, 1] or [2, 3] of degree 2). Its replicas serve
        alone, or they are the merged groups of the degree below that tile it: two TP 2
        groups [0, 1] and [2, 3] merge into TP 4 without moving an FFN row.

        Answers: 200 with the new status (as ``GET /amoebas/status``); 400 with
        ``{"error": ...}`` for a bad body or a group the server does not allow; 409 when a
        member refuses (in another group); 500 when the merge failed on a member and was
        undone on all; 503 when AMOEBAs is not running in this server.
        """
        replicas, _, error = await replica_list(request, "replicas")
        if error is not None:
            return JSONResponse({"error": error}, status_code=400)
        return await _forward(AmoebasMergeReq(replicas=replicas))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def amoebas_split(request: Request):
        """Split a merged group back into replicas serving alone (or into smaller groups):
        each takes back the heads of its requests' KV and the FFN rows of its new shard.
        Requests in flight keep running.

        Body: ``{"group": [0, 1, 2, 3], "degree": 2}``: the group's replicas as ``GET
        /amoebas/status`` lists them; ``degree`` (optional, default 1) the size of the
        groups it splits into (an allowed degree whose aligned groups tile it: a TP 4 group
        of replicas 0-3 into [0, 1] and [2, 3]).

        Answers: 200 with the new status; 400 for a bad body or a degree the group cannot
        split into; 409 when the group does not exist or a member holds more KV than the
        smaller unit can (retry once fewer tokens are held); 500 when the split failed and
        was undone on every member; 503 when AMOEBAs is not running in this server.
        """
        group, body, error = await replica_list(request, "group", optional=("degree",))
        degree = body.get("degree", 1)
        if error is None and (not is_int(degree) or degree < 1):
            error = "'degree' must be a positive integer (1: replicas alone)"
        if error is not None:
            return JSONResponse({"error": error}, status_code=400)
        return await _forward(AmoebasSplitReq(group=group, degree=degree))

    app.add_api_route("/amoebas/status", amoebas_status, methods=["GET"])
    app.add_api_route("/amoebas/merge", amoebas_merge, methods=["POST"])
    app.add_api_route("/amoebas/split", amoebas_split, methods=["POST"])
