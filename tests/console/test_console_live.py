"""``sglang-morph`` against a live MorphServe server: ``top`` in a real terminal (tmux) shows a
swap made through the HTTP API within two seconds, and ``status``, ``swap`` and ``mode`` work
with the server's keys.

One float32 server with the default model's W8/W4 variants, manual control only (so nothing
but these tests moves a layer), SGLang's ``--api-key`` and ``--admin-api-key``. The tests
use different layers, so their order does not matter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY, ADMIN_KEY = "console-api-key", "console-admin-key"
SGLANG_MORPH = Path(sys.executable).parent / "sglang-morph"
TOP_LAYER = 5  # the layer the top test swaps
COMMAND_LAYERS = (6, 7)  # the layers the command tests swap
SHOWN_WITHIN_S = 2.0
SCREEN_POLL_S = 0.1

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


@pytest.fixture(scope="module")
def server(server_factory, engines_awq):
    return server_factory(
        "--dtype", "float32", "--enable-morph", "--morph-engines", str(engines_awq),
        "--morph-memory-budget", "600MB", "--disable-morph-controller",
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SGLANG_MORPH), *args], capture_output=True, text=True,
                          timeout=300)


class Terminal:
    """A 200x50 tmux terminal on its own tmux server (socket), killed as a whole."""

    def __init__(self, command: str):
        self.socket = f"sglang-morph-console-test-{os.getpid()}"
        self._tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "50", command)
        self.socket_path = self._tmux("display-message", "-p", "#{socket_path}").stdout.strip()

    def _tmux(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                              text=True, timeout=30)

    def screen(self) -> str:
        out = self._tmux("capture-pane", "-p", "-t", "top")
        assert out.returncode == 0, f"the terminal is gone (top exited?): {out.stderr}"
        return out.stdout

    def wait_for(self, text: str, timeout_s: float) -> float:
        """Seconds until ``text`` is on the screen; fails with the screen after ``timeout_s``."""
        started = time.monotonic()
        while True:
            shown = self.screen()
            if text in shown:
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                pytest.fail(f"{text!r} not on screen after {timeout_s} s:\n{shown}")
            time.sleep(SCREEN_POLL_S)

    def close(self) -> None:
        self._tmux("kill-server")
        if self.socket_path:  # tmux leaves its socket file behind
            Path(self.socket_path).unlink(missing_ok=True)


@pytest.fixture
def terminal():
    opened: list[Terminal] = []
    yield lambda command: opened.append(Terminal(command)) or opened[-1]
    for t in opened:
        t.close()


def test_top_shows_a_swap_within_two_seconds(server, terminal):
    term = terminal(f"{SGLANG_MORPH} top --url {server.url} --api-key {API_KEY}")
    term.wait_for(f" {TOP_LAYER}:FP ", timeout_s=60)
    assert "mechanisms: morph" in term.screen()
    r = httpx.post(f"{server.url}/morph/swap", json={"layers": [TOP_LAYER], "bits": 4},
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300)
    assert r.status_code == 200, r.text
    capacity = r.json()["kv_capacity_tokens"]
    shown_after_s = term.wait_for(f" {TOP_LAYER}:W4* ", timeout_s=10)
    assert shown_after_s <= SHOWN_WITHIN_S, f"shown {shown_after_s:.2f} s after the swap"
    screen = term.screen()
    assert f"layers {TOP_LAYER} -> W4" in screen  # the transition
    assert f"/ {capacity:,} tokens" in screen  # the grown KV capacity


def test_status_swap_and_mode_commands(server):
    layers = ",".join(map(str, COMMAND_LAYERS))
    swapped = cli("swap", layers, "8", "--url", server.url, "--admin-api-key", ADMIN_KEY)
    assert swapped.returncode == 0, swapped.stderr
    assert " ".join(f"{i}:W8*" for i in COMMAND_LAYERS) in swapped.stdout

    status = cli("status", "--json", "--url", server.url, "--api-key", API_KEY)
    assert status.returncode == 0, status.stderr
    answers = json.loads(status.stdout)
    bits = {layer["index"]: layer["bits"] for layer in answers["morph"]["layers"]}
    assert all(bits[i] == 8 for i in COMMAND_LAYERS)
    assert answers["elastic"]["replicas"][0]["mechanisms"]["morph"]["state"]["layer_bits"] == [
        bits[i] for i in range(len(bits))]
    recent = answers["elastic"]["replicas"][0]["mechanisms"]["morph"]["transitions"]["recent"]
    assert recent[-1]["detail"]["layers"] == list(COMMAND_LAYERS)

    table = cli("status", "--url", server.url, "--api-key", API_KEY)
    assert table.returncode == 0 and f"{COMMAND_LAYERS[0]}:W8*" in table.stdout

    restored = cli("swap", layers, "16", "--no-pin", "--url", server.url,
                   "--admin-api-key", ADMIN_KEY)
    assert restored.returncode == 0, restored.stderr
    assert " ".join(f"{i}:FP" for i in COMMAND_LAYERS) in restored.stdout

    mode = cli("mode", "performance", "--url", server.url, "--admin-api-key", ADMIN_KEY)
    assert mode.returncode == 0 and "mode performance" in mode.stdout, mode.stderr


@pytest.mark.parametrize("args, answer", [
    (["status", "--api-key", "wrong"], "/elastic/status answered 401"),
    (["swap", "0", "4", "--api-key", API_KEY], "/morph/swap answered 401"),  # needs the admin key
    (["swap", "99", "4", "--admin-api-key", ADMIN_KEY], "/morph/swap answered 400"),
])
def test_refusals_are_one_line(server, args, answer):
    proc = cli(*args, "--url", server.url)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert answer in proc.stderr
