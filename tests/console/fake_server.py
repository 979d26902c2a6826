"""A stand-in HTTP server for the console tests that need answers but no SGLang: it answers
each ``(method, path)`` with a recorded status code and JSON body and keeps every request it
got (path, headers, body), so the tests see exactly what ``sglang-morph`` sent."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = tuple[int, Any]  # (status code, JSON body)
# Seconds a route takes to answer (default none), as a busy server's would.
Delays = dict[tuple[str, str], float]


class FakeServer:
    def __init__(self, routes: dict[tuple[str, str], Route], delays: Delays | None = None):
        self.routes = dict(routes)
        self.delays = dict(delays or {})
        self.requests: list[dict[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                fake.requests.append({"method": method, "path": self.path,
                                      "headers": dict(self.headers),
                                      "body": json.loads(raw) if raw else None})
                time.sleep(fake.delays.get((method, self.path), 0.0))
                code, body = fake.routes.get((method, self.path),
                                             (404, {"detail": "Not Found"}))
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802  (http.server's name)
                self._answer("GET")

            def do_POST(self):  # noqa: N802
                self._answer("POST")

            def log_message(self, *args):  # keep the test output clean
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
