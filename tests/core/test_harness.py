"""The test and benchmark harness itself: where server ports come from, what happens when a
server loses its port before binding it (a CI run lost 10 minutes to that: SGLang logs
uvicorn's "address already in use" and then hangs in its shutdown instead of exiting), and how
the two test processes share the machine's memory when they start servers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from sglang_morph.server import process as harness
from conftest import SERVER_START_TIMEOUT_S, _StartGate
from sglang_morph.server import ports


def test_late_bind_ports_are_free_and_outside_the_ephemeral_and_sglang_bands():
    picks = {ports.free_late_bind_port() for _ in range(20)}
    for port in picks:
        assert port in ports.LATE_BIND_PORTS
        assert port < ports.ephemeral_low()
        assert not 22000 <= port <= 29999  # SGLang's own late-bound picks (PortArgs.nccl_port)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: raises if not
    assert len(picks) > 1  # random within the band, not one fixed port


def test_late_bind_port_falls_back_to_the_kernel_when_the_band_is_ephemeral(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LATE_BIND_PORTS.start + 10)
    port = ports.free_late_bind_port()
    assert port not in range(ports.LATE_BIND_PORTS.start, ports.LATE_BIND_PORTS.start + 10)
    assert 0 < port < 65536


@pytest.fixture
def taken_port():
    """A port held by a listening socket for the test's duration, as another process would."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_uvicorn_reports_a_taken_port_with_the_marker_the_harness_looks_for(taken_port):
    """SGLang's HTTP server is uvicorn: on a taken port it logs this error (SGLang then hangs
    in its shutdown, which is why the harness reads the log rather than waiting for an exit)."""
    app = "async def app(scope, receive, send):\n    pass\n"
    proc = subprocess.run(
        [sys.executable, "-c", f"{app}import uvicorn\nuvicorn.run(app, host='127.0.0.1', "
                               f"port={taken_port}, log_level='info')"],
        capture_output=True, text=True, timeout=120)
    assert harness.BIND_CLASH_MARKER in proc.stdout + proc.stderr, proc.stderr[-2000:]


def stand_in_that_loses(port: str, path) -> None:
    """Write a stand-in for serve.sh at ``path`` that does what SGLang does when it loses
    ``port`` (a port number, or "$2" for whatever port it is given): log uvicorn's error, then
    hang; on any other port it runs serve.sh itself."""
    path.write_text(
        f'if [[ "$2" == {port} ]]; then\n'
        f'  echo "ERROR: [Errno 98] {harness.BIND_CLASH_MARKER} (\'127.0.0.1\', $2)"\n'
        f'  exec sleep 600\n'
        f'fi\n'
        f'exec bash {harness.SERVE_SH} "$@"\n')


@pytest.mark.server
def test_server_that_loses_its_port_is_started_again_on_another(monkeypatch, tmp_path,
                                                                 taken_port):
    """The first attempt gets the taken port: a stand-in for serve.sh logs uvicorn's error
    there and hangs, as SGLang does (the real message is checked above); the relaunch is
    serve.sh itself, on a free port."""
    picks = iter([taken_port])
    monkeypatch.setattr(harness, "free_port",
                        lambda: next(picks, None) or ports.free_late_bind_port())
    stand_in_that_loses(str(taken_port), tmp_path / "serve.sh")
    monkeypatch.setattr(harness, "SERVE_SH", tmp_path / "serve.sh")
    log_path = tmp_path / "server.log"
    with harness.running_server([], log_path, start_timeout_s=SERVER_START_TIMEOUT_S) as server:
        assert server.attempt == 2 and server.port != taken_port
        lost_log = log_path.with_name(f"server.log.port{taken_port}")
        assert harness.BIND_CLASH_MARKER in lost_log.read_text(errors="replace")
        reply = httpx.post(f"{server.url}/generate", timeout=60.0, json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 4
    # The first attempt's process group is gone too, not only the second's.
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0


def test_server_that_loses_its_port_raises_at_once_without_relaunch(monkeypatch, tmp_path):
    """The branch for servers whose URL was already handed out; a stand-in for serve.sh that
    does what SGLang does on a lost port (log uvicorn's error, then hang) keeps it cheap."""
    stand_in_that_loses('"$2"', tmp_path / "serve.sh")  # every port
    monkeypatch.setattr(harness, "SERVE_SH", tmp_path / "serve.sh")
    server = harness.ServerProcess([], tmp_path / "server.log", relaunch_on_port_clash=False,
                                   start_timeout_s=60.0)
    try:
        with pytest.raises(harness.PortClashError, match=f"port {server.port} was taken"):
            server.wait_ready()
        assert server.proc.poll() is not None  # stopped, not left hanging
        assert server.attempt == 1
    finally:
        server.stop()


def test_start_gate_estimates_memory_by_the_ranks_on_this_node():
    one, more = _StartGate.ONE_RANK_GIB, _StartGate.MORE_RANK_GIB
    assert _StartGate.estimate_gib(["--dtype", "float32"]) == one
    assert _StartGate.estimate_gib(["--tp-size", "3"]) == one + 2 * more
    assert _StartGate.estimate_gib(["--dp-size", "2", "--tp-size", "2"]) == one + 3 * more
    assert _StartGate.estimate_gib(["--pp-size", "2", "--nnodes", "2"]) == one  # a rank a node


def test_start_gate_waits_for_room_and_drops_dead_processes(tmp_path, monkeypatch):
    gate = _StartGate(tmp_path / "ledger.json")
    monkeypatch.setattr(gate, "POLL_S", 0.05)
    free = {"gib": 9.0}
    monkeypatch.setattr(gate, "available_gib", lambda: free["gib"])
    gate.reserve("a", 4.0)  # 9 free: 4 + 2 headroom fit
    # A second 4 GiB start would leave less than the headroom: it waits.
    started = threading.Event()
    second = threading.Thread(target=lambda: (gate.reserve("b", 4.0), started.set()))
    second.start()
    time.sleep(0.5)
    assert not started.is_set()
    gate.release("a")  # the first server is ready: its memory is now in use, not reserved
    free["gib"] = 6.5
    assert started.wait(5.0)
    second.join()
    assert set(json.loads(gate.ledger.read_text())) == {"b"}
    # A reservation of a process that died no longer counts.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gate.ledger.write_text(json.dumps({"b": [os.getpid(), 4.0],
                                       "gone": [int(dead.stdout), 100.0]}))
    free["gib"] = 100.0
    gate.reserve("c", 4.0)
    assert set(json.loads(gate.ledger.read_text())) == {"b", "c"}


def test_start_gate_goes_ahead_after_its_wait(tmp_path, monkeypatch):
    gate = _StartGate(tmp_path / "ledger.json")
    monkeypatch.setattr(gate, "POLL_S", 0.05)
    monkeypatch.setattr(gate, "MEMORY_WAIT_S", 0.3)
    monkeypatch.setattr(gate, "available_gib", lambda: 1.0)
    t0 = time.monotonic()
    gate.reserve("a", 4.0)  # never room: starts anyway, its test reports a failure
    assert 0.3 <= time.monotonic() - t0 < 5.0
