"""Guards on SGLang's HTTP surface, installed by the plugin in the launcher.

- **Token ids outside the vocabulary** (always, with or without a mechanism). SGLang 0.5.23's
  tokenizer manager checks a request's length and its ``token_ids_logprob`` against the
  vocabulary, but not its ``input_ids``: an id past the embedding table raises ``IndexError``
  inside a scheduler, and SGLang tears the whole server down. ``before_validate_one_request``
  runs before ``TokenizerManager._validate_one_request``, which every request that reaches a
  scheduler passes (``/generate`` single and batch, ``/v1/completions``, chat), and raises the
  ``ValueError`` SGLang answers with 400.
- **Control routes** (the mechanisms' routes that change state: every method but GET, HEAD
  and OPTIONS under their prefixes). SGLang's CORS reflects any ``Origin`` with credentials, and
  a ``text/plain`` POST needs no preflight, so without keys any web page could reshape a
  localhost server. A control request with a body must say ``application/json`` (415), and one
  from another origin (an ``Origin`` header naming another host) is refused (403). Non-browser
  clients send no ``Origin``.
- **Error replies** of the mechanisms' routes repeat at most ``MAX_ERROR_CHARS`` of the error
  (a malformed 10 MB layer list is not echoed back).
- **``/metrics`` behind the API key** (``--elastic-metrics-auth``): SGLang serves it to anyone
  even with ``--api-key``; it shows the model path, per-layer bits, KV capacity and use.
"""

from __future__ import annotations

import json
from typing import Any, Sequence
from urllib.parse import urlsplit

MAX_ERROR_CHARS = 1000
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def out_of_vocabulary(input_ids: Sequence[int] | None, vocab_size: int) -> str | None:
    """Why ``input_ids`` cannot reach the model (one line), or None."""
    if not input_ids:
        return None
    low, high = min(input_ids), max(input_ids)
    if low >= 0 and high < vocab_size:
        return None
    bad = low if low < 0 else high
    return (f"input_ids contains the token id {bad}, outside the model's vocabulary "
            f"[0, {vocab_size})")


def before_validate_one_request(tokenizer_manager: Any, obj: Any, input_ids: Any,
                                *args: Any, **kwargs: Any) -> None:
    if not isinstance(input_ids, list) or not all(type(i) is int for i in input_ids):
        return  # SGLang's own checks (and types) apply
    error = out_of_vocabulary(input_ids, int(tokenizer_manager.model_config.vocab_size))
    if error is not None:
        raise ValueError(error)


def shortened(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters)"


def control_refusal(method: str, path: str, headers: Any, prefixes: Sequence[str]
                    ) -> tuple[int, str] | None:
    """(HTTP status, error) for a control request a browser page could have sent, or None."""
    if method.upper() in _READ_METHODS or not path.startswith(tuple(prefixes)):
        return None
    origin = headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != headers.get("host"):
        return 403, (f"cross-origin requests to control routes are refused (Origin "
                     f"{shortened(origin, 100)!r} is not this server)")
    has_body = int(headers.get("content-length") or 0) > 0 or "transfer-encoding" in headers
    media = (headers.get("content-type") or "").split(";")[0].strip().lower()
    if has_body and media != "application/json":
        return 415, (f"control routes take a JSON body: Content-Type must be "
                     f"application/json, not {shortened(media, 100) or 'none'!r}")
    return None


def metrics_refusal(path: str, headers: Any, api_keys: Sequence[str]) -> str | None:
    if not (path == "/metrics" or path.startswith("/metrics/")) or not api_keys:
        return None
    if headers.get("authorization", "") in {f"Bearer {k}" for k in api_keys}:
        return None
    return "/metrics needs the API key (--elastic-metrics-auth): Authorization: Bearer <key>"


def install_http_guard(app: Any, control_prefixes: Sequence[str],
                       metrics_api_keys: Sequence[str] = ()) -> None:
    """One middleware on SGLang's app (launcher, before serving) for the control routes,
    their error replies and, when ``metrics_api_keys`` is given, ``/metrics``. A plain ASGI
    middleware: SGLang's ``@app.middleware("http")`` sends the route's reply itself and ignores
    what the function returns, so a refusal there would never reach the client."""
    app.add_middleware(HttpGuard, control_prefixes=tuple(control_prefixes),
                       metrics_api_keys=tuple(k for k in metrics_api_keys if k))


class HttpGuard:
    """The ASGI middleware of ``install_http_guard``."""

    def __init__(self, app: Any, control_prefixes: tuple[str, ...],
                 metrics_api_keys: tuple[str, ...]):
        self.app, self.prefixes, self.keys = app, control_prefixes, metrics_api_keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        path, headers = scope["path"], Headers(scope=scope)
        refusal = metrics_refusal(path, headers, self.keys)
        status = 401
        if refusal is None:
            status, refusal = control_refusal(scope["method"], path, headers, self.prefixes) or (
                0, None)
        if refusal is not None:
            return await JSONResponse({"error": refusal}, status_code=status)(scope, receive,
                                                                              send)
        if not path.startswith(self.prefixes):
            return await self.app(scope, receive, send)
        await self.app(scope, receive, _ShortErrors(send))


class _ShortErrors:
    """``send`` for a control route: an error reply (status >= 400, a small JSON body) is held
    until complete and sent with its long strings shortened; others pass through."""

    def __init__(self, send: Any):
        self.send, self.start, self.chunks = send, None, None

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self.start, self.chunks = message, []
            return
        if self.chunks is None or message["type"] != "http.response.body":
            return await self.send(message)
        self.chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(self.chunks)
        if len(body) > MAX_ERROR_CHARS:
            body = _shortened_error(body)
        headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
        await self.send({**self.start, "headers": [*headers, (b"content-length",
                                                              str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})


def _shortened_error(body: bytes) -> bytes:
    """The error reply with its ``error`` (and any other long string) shortened."""
    try:
        data = json.loads(body)
    except ValueError:
        return shortened(body.decode("utf-8", "replace")).encode()

    def cut(value: Any) -> Any:
        if isinstance(value, str):
            return shortened(value)
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        return value

    return json.dumps(cut(data)).encode()
