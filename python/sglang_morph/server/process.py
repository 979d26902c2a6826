"""One ``scripts/serve.sh`` server as a child process group: started on a free port of
127.0.0.1, ready once ``GET /health`` answers 200, stopped as a whole.

serve.sh execs launch_server, which spawns the scheduler and detokenizer, so stopping signals
the whole group: SIGTERM, then SIGKILL for whatever is left. A server that fails to start is
stopped before the error is raised; leaving a ``with running_server(...)`` block by an
exception or Ctrl-C stops it too. The benchmarks, the tests and iServe's profiler use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

from sglang_morph.repo_data import REPO_ROOT
from sglang_morph.server.ports import free_late_bind_port

SERVE_SH = REPO_ROOT / "scripts" / "serve.sh"
# serve.sh runs setup first; a cold start here took ~60 s, a first-ever setup a few minutes.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
HEALTH_POLL_INTERVAL_S = 1.0
# What uvicorn logs when the HTTP port is taken; SGLang then hangs in its shutdown rather than
# exiting, so without this check a lost port race costs the whole start timeout.
BIND_CLASH_MARKER = "error while attempting to bind on address"
PORT_ATTEMPTS = 3
# A server that lost its port holds no requests, and its SIGTERM shutdown hangs like the rest.
CLASH_STOP_TIMEOUT_S = 2.0
# Stopping the group stops the scheduler first; SGLang's launcher takes that for a crash and
# sleeps 5 s before looking for py-spy and CUDA diagnostics. Off unless the caller's
# environment turns them on.
NO_CRASH_DIAGNOSTICS_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
                            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def free_port() -> int:
    """A free port of 127.0.0.1 for a server that binds it later (see sglang_morph's ports)."""
    return free_late_bind_port()


class PortClashError(RuntimeError):
    """The server's port was taken between the pick and its bind; it was stopped."""


class ServerProcess:
    """One ``scripts/serve.sh`` process and its log; ``url`` is its base address.

    ``extra_args`` go to serve.sh (never ``--port``: a free one is chosen); ``env`` is added to
    this process's environment. Construction starts the process; ``wait_ready`` waits for it.
    If the port is lost to another process before the server binds it, ``wait_ready`` starts
    the server again on a new port (``PORT_ATTEMPTS`` in all), so read ``url`` after it; with
    ``relaunch_on_port_clash=False`` (the address was already handed to a peer) it raises
    ``PortClashError`` at once instead.
    """

    def __init__(self, extra_args: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None, *,
                 start_timeout_s: float = START_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S,
                 relaunch_on_port_clash: bool = True):
        self.extra_args = list(extra_args)
        self.env = {**NO_CRASH_DIAGNOSTICS_ENV, **os.environ, **(env or {})}
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.relaunch_on_port_clash = relaunch_on_port_clash
        self.attempt = 0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launch()

    def _launch(self) -> None:
        self.attempt += 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["bash", str(SERVE_SH), "--port", str(self.port), *self.extra_args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=self.env,
            start_new_session=True,  # own process group, so stopping reaches the scheduler too
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"ready; log: {self.log_path}\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if BIND_CLASH_MARKER in self.log_text():
                self._port_clash()
                deadline = time.monotonic() + self.start_timeout_s
            time.sleep(HEALTH_POLL_INTERVAL_S)
        raise TimeoutError(f"server not ready after {self.start_timeout_s} s; "
                           f"log: {self.log_path}\n{self.log_tail()}")

    def _port_clash(self) -> None:
        """Stop the server that lost its port; start it again elsewhere, or raise."""
        self.stop(timeout_s=CLASH_STOP_TIMEOUT_S)
        lost = self.log_path.with_name(f"{self.log_path.name}.port{self.port}")
        self.log_path.replace(lost)  # kept for the record; the new attempt logs to log_path
        if not self.relaunch_on_port_clash or self.attempt >= PORT_ATTEMPTS:
            raise PortClashError(f"port {self.port} was taken before the server bound it "
                                 f"(attempt {self.attempt} of {PORT_ATTEMPTS}); log: {lost}")
        self._launch()

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n_chars: int = 6000) -> str:
        return self.log_text()[-n_chars:]

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to the group, then (after ``timeout_s``, default ``stop_timeout_s``) SIGKILL
        to whatever is left: launch_server normally takes its children down with it, and the
        SIGKILL makes sure no scheduler (gigabytes of KV pool) outlives an interrupted run.
        Safe to call twice."""
        if self._log.closed:
            return
        # Even when serve.sh itself has exited, its children may still be in the group.
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, sig)


def start_server(extra_args: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None, **timeouts: float) -> ServerProcess:
    """A ready server; if it does not become ready it is stopped and the error raised."""
    server = ServerProcess(extra_args, log_path, env, **timeouts)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def running_server(extra_args: Sequence[str], log_path: Path,
                   env: Mapping[str, str] | None = None,
                   **timeouts: float) -> Iterator[ServerProcess]:
    """A ready server for one ``with`` block, stopped at its end."""
    server = start_server(extra_args, log_path, env, **timeouts)
    try:
        yield server
    finally:
        server.stop()
