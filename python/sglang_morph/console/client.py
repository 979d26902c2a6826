"""The HTTP calls ``sglang-morph`` makes to a running server, and their one-line errors.

Keys follow the server's auth model (docs/security.md): ``--api-key`` opens the status routes,
the control routes take ``--admin-api-key`` when the server has one and the API key otherwise.
Both go as ``Authorization: Bearer KEY``. Control bodies are JSON, which the server requires
of every control route.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from urllib.parse import urlsplit

import click
import httpx

DEFAULT_URL = "http://127.0.0.1:30000"
# A status answer comes from the scheduler between two batches: under load that is one step,
# seconds on a slow CPU. A transition moves weights and KV before it answers.
STATUS_TIMEOUT_S = 30.0
CONTROL_TIMEOUT_S = 600.0
# What an error line repeats of the server's answer.
ERROR_BODY_CHARS = 300


class CommandError(click.ClickException):
    """A problem the command names in one line on stderr; exit status 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        # The command it came from, so that its line names the command (click's usage errors
        # carry theirs).
        self.ctx = click.get_current_context(silent=True)


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or CommandError when it is no http(s) address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CommandError(f"--url {url!r} is not an http:// or https:// address")
    return url.rstrip("/")


def _one_line(text: str, limit: int = ERROR_BODY_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return _one_line(response.text)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return _one_line(body["error"])
    if isinstance(body, dict) and "detail" in body:  # FastAPI's own errors (401, 404, 422)
        return _one_line(str(body["detail"]))
    return _one_line(json.dumps(body))


@dataclasses.dataclass(eq=False)  # raised and caught like any exception, never compared
class ServerError(Exception):
    """A request that got no usable answer: ``status_code`` None when the server was not
    reached."""

    method: str
    url: str
    status_code: int | None
    message: str

    def __str__(self) -> str:
        if self.status_code is None:
            return f"{self.method} {self.url}: {self.message}"
        return f"{self.method} {self.url} answered {self.status_code}: {self.message}"


@dataclasses.dataclass
class Client:
    """One server: ``base_url`` (checked), the keys, and a pooled connection."""

    base_url: str
    api_key: str | None = None
    admin_api_key: str | None = None
    status_timeout_s: float = STATUS_TIMEOUT_S
    control_timeout_s: float = CONTROL_TIMEOUT_S

    def __post_init__(self) -> None:
        self.base_url = check_url(self.base_url)
        self._http = httpx.Client()

    def close(self) -> None:
        self._http.close()

    def _headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _send(self, method: str, path: str, key: str | None, timeout_s: float,
              body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        try:
            response = self._http.request(method, url, json=body, headers=self._headers(key),
                                          timeout=timeout_s)
        except httpx.TimeoutException:
            raise ServerError(method, url, None, f"no answer within {timeout_s:g} s") from None
        except httpx.HTTPError as e:
            reason = _one_line(str(e)) or type(e).__name__
            raise ServerError(method, url, None, f"cannot reach the server ({reason})") from None
        if response.status_code != 200:
            raise ServerError(method, url, response.status_code, _error_text(response))
        try:
            out = response.json()
        except ValueError:
            raise ServerError(method, url, 200, "the answer is not JSON") from None
        if not isinstance(out, dict):
            raise ServerError(method, url, 200, "the answer is not a JSON object")
        return out

    def get(self, path: str) -> dict[str, Any]:
        """A status route (the API key)."""
        return self._send("GET", path, self.api_key, self.status_timeout_s)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A control route (the admin key if given, else the API key)."""
        return self._send("POST", path, self.admin_api_key or self.api_key,
                          self.control_timeout_s, body)
