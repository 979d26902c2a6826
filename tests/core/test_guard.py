"""The HTTP guards' decisions (``sglang_morph.server.guard``) without a server; the live
checks are in ``test_bad_input.py`` (token ids) and ``test_morph_runtime_server.py`` (control
routes, error replies, ``/metrics``)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request  # module level: the route's annotation must resolve
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from sglang.srt.utils.http_middleware_patch import patch_app_http_middleware

from sglang_morph.server import guard

PREFIXES = ("/morph/", "/kunserve/", "/amoebas/")


def test_out_of_vocabulary():
    assert guard.out_of_vocabulary([0, 5, 99], 100) is None
    assert guard.out_of_vocabulary([], 100) is None
    assert "100," in guard.out_of_vocabulary([3, 100], 100)
    assert "-2," in guard.out_of_vocabulary([-2, 7, 500], 100)  # the negative one first


def headers(**h):
    return {k.replace("_", "-"): v for k, v in h.items()}


def test_control_refusal():
    body = headers(host="127.0.0.1:30000", content_length="20")
    assert guard.control_refusal("POST", "/morph/swap", {**body, "content-type":
                                 "application/json; charset=utf-8"}, PREFIXES) is None
    status, why = guard.control_refusal("POST", "/morph/swap", {**body, "content-type":
                                        "text/plain"}, PREFIXES)
    assert status == 415 and "text/plain" in why
    assert guard.control_refusal("POST", "/morph/swap", body, PREFIXES)[0] == 415
    # No body (a restore that takes none): no content type needed.
    assert guard.control_refusal("POST", "/kunserve/restore", headers(
        host="127.0.0.1:30000"), PREFIXES) is None
    cross = {**body, "content-type": "application/json", "origin": "http://evil.example"}
    assert guard.control_refusal("POST", "/amoebas/merge", cross, PREFIXES)[0] == 403
    same = {**cross, "origin": "http://127.0.0.1:30000"}
    assert guard.control_refusal("POST", "/amoebas/merge", same, PREFIXES) is None
    # Reads, and SGLang's own routes, are not control routes.
    assert guard.control_refusal("GET", "/morph/status", cross, PREFIXES) is None
    assert guard.control_refusal("POST", "/generate", cross, PREFIXES) is None


def test_metrics_refusal():
    keys = ("user-key", "admin-key")
    assert guard.metrics_refusal("/metrics", {}, keys) is not None
    assert guard.metrics_refusal("/metrics", {"authorization": "Bearer admin-key"}, keys) is None
    assert guard.metrics_refusal("/metrics", {"authorization": "Bearer nope"}, keys) is not None
    assert guard.metrics_refusal("/generate", {}, keys) is None
    assert guard.metrics_refusal("/metrics", {}, ()) is None  # no key set: SGLang's behaviour


def test_long_errors_are_shortened():
    error = f"unknown layers {list(range(100_000))}"
    body = json.loads(guard._shortened_error(json.dumps({"error": error, "code": 400}).encode()))
    assert body["code"] == 400 and len(body["error"]) < guard.MAX_ERROR_CHARS + 100
    assert body["error"].startswith("unknown layers [0, 1, 2")
    assert body["error"].endswith(f"({len(error) - guard.MAX_ERROR_CHARS} more characters)")
    assert len(guard._shortened_error(b"x" * 5000)) < guard.MAX_ERROR_CHARS + 100


def test_the_middleware_on_an_app_patched_as_sglang_patches_its_own():
    """SGLang's ``@app.middleware("http")`` ignores what the function returns: the guard is a
    plain ASGI middleware, so its refusals and shortened errors reach the client."""
    app = FastAPI()
    patch_app_http_middleware(app)
    calls = []

    @app.post("/morph/swap")
    async def swap(request: Request):
        body = await request.json()
        calls.append(body)
        if "layers" not in body:
            return JSONResponse({"error": f"bad body {'x' * 50_000}"}, status_code=400)
        return {"layers": body["layers"]}

    @app.get("/metrics")
    async def metrics():
        return {"series": 1}

    guard.install_http_guard(app, PREFIXES, ("key",))
    client = TestClient(app)
    r = client.post("/morph/swap", content='{"layers": [1]}', headers={"Content-Type":
                                                                       "text/plain"})
    assert r.status_code == 415 and calls == []
    r = client.post("/morph/swap", json={"layers": [1]}, headers={"Origin": "http://evil"})
    assert r.status_code == 403 and calls == []
    assert client.post("/morph/swap", json={"layers": [1]}).json() == {"layers": [1]}
    r = client.post("/morph/swap", json={"nope": 1})
    assert r.status_code == 400 and r.json()["error"].startswith("bad body xxx")
    assert len(r.content) < guard.MAX_ERROR_CHARS + 100
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer key"}).json() == {
        "series": 1}
