"""``/morph/*`` routes in SGLang's HTTP server.

The morphing state lives in the scheduler process; a route sends a typed request
(``messages.MorphStatusReq``, ``MorphSwapReq``, ``MorphModeReq``) through the elastic core's
control client (``sglang_morph.elastic.control``) and returns the scheduler's answer. The
scheduler applies a swap between two batches and answers with the new status.

Auth: the control routes are ``ADMIN_OPTIONAL`` in SGLang's auth model (``--api-key`` protects
them; with ``--admin-api-key`` set only the admin key opens them); ``GET /morph/status`` is a
normal endpoint (``--api-key`` protects it).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sglang_morph.elastic.control import control_client, json_object, not_running
from sglang_morph.morph.messages import MorphModeReq, MorphStatusReq, MorphSwapReq

logger = logging.getLogger("sglang_morph")


def _bad_request(message: str):
    return JSONResponse({"error": message}, status_code=400)


async def _forward(req: MorphStatusReq | MorphSwapReq | MorphModeReq):
    """The scheduler's answer; under ``--dp-size N`` (several answers) ``{"replicas": [...]}``,
    with the first failing replica's status code if any failed."""
    client = control_client()
    if client is None:
        return not_running("sglang-morph")
    outs = await client.call(req)
    if client.replicas == 1 or getattr(req, "replica", None) is not None:
        (out,) = outs
        return JSONResponse(out.body, status_code=out.status_code)
    failed = [o.status_code for o in outs if o.status_code != 200]
    return JSONResponse({"replicas": [o.body for o in outs]},
                        status_code=failed[0] if failed else 200)


def _replica_field(body: dict[str, Any], replicas: int, required: bool):
    """The ``replica`` of a control request body: (value, None) or (None, error response)."""
    replica = body.get("replica")
    if replica is None:
        if required and replicas > 1:
            return None, _bad_request(
                f"this server has {replicas} data-parallel replicas and each swaps on its own: "
                f"name one with \"replica\" (0-{replicas - 1})")
        return None, None
    if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < replicas:
        return None, _bad_request(f"'replica' must be a data-parallel replica index, "
                                  f"0-{replicas - 1} on this server")
    return replica, None


def _replicas() -> int:
    client = control_client()
    return 1 if client is None else client.replicas


def add_routes(app: Any) -> None:
    """Add the /morph routes to SGLang's FastAPI ``app`` (launcher process, before serving)."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    async def morph_status():
        """Layer precisions, KV capacity and usage, the memory budget, recent transitions.

        Answers: 200 with the status object (under ``--dp-size N``: ``{"replicas": [...]}``,
        one status per replica); 500 with ``{"error": ...}`` when the scheduler could not build
        it; 503 when sglang-morph is not running in this server.
        """
        return await _forward(MorphStatusReq())

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def morph_swap(request: Request):
        """Move layers to another precision in one transition, between two batches: a swap
        down grows the KV cache into the freed weight memory, a restore first shrinks it by
        what the returning weights need.

        Body: a JSON object ``{"layers": [0, 3], "bits": 4}``; bits 16 restores full
        precision. The layers the swap moves stay pinned where the operator put them (the
        controller does not move them); ``"pin": true`` pins every layer named, moved or not,
        and ``"pin": false`` hands them back to the controller; a layer already at ``bits``
        with no ``"pin"`` keeps its state. Under
        ``--dp-size N`` the body names the ``"replica"`` (0 to N-1) that swaps.

        Answers: 200 with the new status (as ``GET /morph/status``; nothing moves when every
        layer is already at ``bits``); 400 with ``{"error": ...}`` for a malformed body (or no
        ``"replica"`` under ``--dp-size N``) or a swap that cannot be (unknown or repeated
        layers, no variant of ``bits``, no ``--morph-engines``, a layer asked to go up to fewer
        than 16 bits, layers that would move both up and down); 409 when a restore is refused
        because live requests hold the KV tokens it must give back; 500 when the transition
        failed and was undone; 503 when sglang-morph is not running in this server.
        """
        body = await json_object(request)
        if body is None:
            return _bad_request('expected a JSON object like {"layers": [0, 1], "bits": 4}')
        unknown = sorted(set(body) - {"layers", "bits", "pin", "replica"})
        if unknown:
            return _bad_request(f"unknown fields {unknown}; expected 'layers', 'bits' and "
                                f"optionally 'pin' and 'replica'")
        layers, bits = body.get("layers"), body.get("bits")
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
            return _bad_request("'layers' must be a non-empty list of layer indices")
        if not isinstance(bits, int) or isinstance(bits, bool):
            return _bad_request("'bits' must be an integer bit-width (16 restores)")
        pin = body.get("pin")
        if pin is not None and not isinstance(pin, bool):
            return _bad_request("'pin' must be true or false")
        replica, error = _replica_field(body, _replicas(), required=True)
        if error is not None:
            return error
        return await _forward(MorphSwapReq(layers=layers, bits=bits, pin=pin, replica=replica))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def morph_mode(request: Request):
        """Change the controller's policy at runtime (every replica's, or one's).

        Body: a JSON object ``{"mode": "performance"}`` (``accuracy``, ``default`` or
        ``performance``), with ``"replica"`` under ``--dp-size N`` to change one replica's only.

        Answers: 200 with the new status (as ``GET /morph/status``); 400 with
        ``{"error": ...}`` for a malformed body or an unknown mode; 503 when sglang-morph is
        not running in this server.
        """
        body = await json_object(request)
        if (body is None or not isinstance(body.get("mode"), str)
                or not set(body) <= {"mode", "replica"}):
            return _bad_request('expected a JSON object like {"mode": "performance"}')
        replica, error = _replica_field(body, _replicas(), required=False)
        if error is not None:
            return error
        return await _forward(MorphModeReq(mode=body["mode"], replica=replica))

    app.add_api_route("/morph/status", morph_status, methods=["GET"])
    app.add_api_route("/morph/swap", morph_swap, methods=["POST"])
    app.add_api_route("/morph/mode", morph_mode, methods=["POST"])
