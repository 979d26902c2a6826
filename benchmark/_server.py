"""A benchmark's own SGLang server: started through ``scripts/serve.sh``, always stopped.

``running_server(launch)`` is a context manager yielding the base URL once ``GET /health``
answers 200. The server runs in its own process group (serve.sh execs launch_server, which
spawns the scheduler and detokenizer), so stopping signals the whole group: SIGTERM first,
SIGKILL for whatever is left after ``stop_timeout_s``. Leaving the ``with`` block by an
exception or Ctrl-C stops it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE_SH = REPO_ROOT / "scripts" / "serve.sh"


@dataclass(frozen=True)
class ServerLaunch:
    """How to start one server: extra ``serve.sh`` arguments (never ``--port``) and its log."""

    extra_args: tuple[str, ...]
    log_path: Path
    start_timeout_s: float = 600.0  # serve.sh runs setup first; a cold start here took ~60 s
    stop_timeout_s: float = 30.0
    health_poll_interval_s: float = 1.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(launch: ServerLaunch) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launch.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(launch.log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", str(SERVE_SH), "--port", str(port), *launch.extra_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,  # own process group, so stopping reaches the scheduler too
        )
        try:
            _wait_ready(proc, url, launch)
            yield url
        finally:
            _stop(proc, launch.stop_timeout_s)


def _wait_ready(proc: subprocess.Popen, url: str, launch: ServerLaunch) -> None:
    deadline = time.monotonic() + launch.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode} before it was ready; "
                f"log: {launch.log_path}\n{_log_tail(launch.log_path)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(launch.health_poll_interval_s)
    raise TimeoutError(
        f"server not ready after {launch.start_timeout_s} s; log: {launch.log_path}\n"
        f"{_log_tail(launch.log_path)}"
    )


def _stop(proc: subprocess.Popen, stop_timeout_s: float) -> None:
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=stop_timeout_s)
    except subprocess.TimeoutExpired:
        pass
    # launch_server normally takes its children down with it; SIGKILL to the group makes sure no
    # scheduler (gigabytes of KV pool) outlives an interrupted benchmark.
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, sig)


def _log_tail(log_path: Path, n_chars: int = 4000) -> str:
    return log_path.read_text(errors="replace")[-n_chars:]
