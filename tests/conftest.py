"""Shared fixtures: real SGLang servers started through scripts/serve.sh, on 127.0.0.1.

Servers are session-scoped and keyed by their extra arguments, so every test that needs
"the default server" talks to one process; each is stopped (whole process group) at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
SERVER_START_TIMEOUT_S = float(os.environ.get("MORPH_TEST_SERVER_START_TIMEOUT_S", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``scripts/serve.sh`` process and its log; ``url`` is its base address."""

    def __init__(self, extra_args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            ["bash", str(REPO_ROOT / "scripts" / "serve.sh"), "--port", str(self.port), *extra_args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # own process group, so teardown reaches the scheduler too
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready after {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n_chars: int = 6000) -> str:
        return self.log_text()[-n_chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """``server_factory(*extra_args, env=None)`` -> a ready ServerProcess, shared per arguments."""
    servers: dict[tuple, ServerProcess] = {}

    def get(*extra_args: str, env: dict[str, str] | None = None) -> ServerProcess:
        key = (extra_args, tuple(sorted((env or {}).items())))
        if key not in servers:
            log_path = tmp_path_factory.mktemp("server") / "server.log"
            server = ServerProcess(list(extra_args), log_path, env)
            servers[key] = server
            server.wait_ready()
        return servers[key]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def default_server(server_factory) -> ServerProcess:
    """The server exactly as the README's first command starts it (plugin loaded, morph off)."""
    return server_factory()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "sglang_morph.models", "path"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(out)
