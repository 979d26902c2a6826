"""Shared fixtures: real SGLang servers started through scripts/serve.sh, on 127.0.0.1.

A server holds about 5 GiB of host memory (three processes plus its KV pool) on a 24 GiB
machine, so only the default server lives for the whole session; other configurations live for
one module (``server_factory``) or one ``with running_server(...)`` block, and every server is
stopped as a whole process group.
"""

from __future__ import annotations

import contextlib
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


def start_server(extra_args, log_dir: Path, env: dict[str, str] | None = None) -> ServerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(list(extra_args), log_dir / "server.log", env)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_server(extra_args, log_dir: Path, env: dict[str, str] | None = None):
    """A server for one block of a test, stopped at the end of the block."""
    server = start_server(extra_args, log_dir, env)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """``server_factory(*extra_args, env=None)`` -> a ready ServerProcess, shared per arguments

    within one test module and stopped when the module is done.
    """
    servers: dict[tuple, ServerProcess] = {}

    def get(*extra_args: str, env: dict[str, str] | None = None) -> ServerProcess:
        key = (extra_args, tuple(sorted((env or {}).items())))
        if key not in servers:
            servers[key] = start_server(extra_args, tmp_path_factory.mktemp("server"), env)
        return servers[key]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory) -> ServerProcess:
    """The server exactly as the README's first command starts it (plugin loaded, morph off)."""
    server = start_server([], tmp_path_factory.mktemp("default_server"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "sglang_morph.models", "path"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(out)


def build_engines(*flags: str) -> Path:
    """Engines for the default model in the builder's default cache directory: a CI run on a

    machine that already built them reuses the build (the builder returns the existing
    directory when recipe, model and calibration are unchanged).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_morph.build_engines", *flags],
        capture_output=True, text=True, timeout=1800,
        # One thread: the search's many small matmuls lose more to thread hand-offs than they
        # gain on 2 cores, and the idle test servers still hold a little CPU.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def engines_awq() -> Path:
    """AWQ W8 + W4 variants of every layer of the default model."""
    return build_engines("--bits", "8,4")


@pytest.fixture(scope="session")
def engines_rtn() -> Path:
    return build_engines("--bits", "4", "--no-awq")
