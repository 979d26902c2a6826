"""``sglang-morph`` without SGLang: the commands and their help, one-line errors with exit
status 2, the wrappers' hand-over to the offline modules and serve.sh, and the server commands
against a stand-in server that answers with recorded status answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fake_server import FakeServer
from sglang_morph.console import main as cli
from sglang_morph.console.main import main, parse_layers
from sglang_morph.server.ports import free_late_bind_port

DATA = Path(__file__).resolve().parent / "data"
REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_MORPH = Path(sys.executable).parent / "sglang-morph"
COMMANDS = ("serve", "build-engines", "profile-layers", "plan", "deploy", "bench", "status",
            "swap", "mode", "top")
SERVER_COMMANDS = {"status": [], "swap": ["0", "4"], "mode": ["default"], "top": ["--once"]}
API_KEY, ADMIN_KEY = "user-key", "admin-key"


def recorded(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def invoke(*args: str, **kw):
    return CliRunner().invoke(main, list(args), **kw)


def one_line_error(result, *fragments: str) -> str:
    """The result is exit status 2 with exactly one line on stderr that names the problem."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---- help -------------------------------------------------------------------------------------


def test_help_lists_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    listed = result.output.split("Commands:")[1]
    for command in COMMANDS:
        assert f"\n  {command} " in listed, command


@pytest.mark.parametrize("command", ["serve", "status", "swap", "mode", "top"])
def test_command_help(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: sglang-morph {command}")
    if command in SERVER_COMMANDS:
        assert "--url" in result.output and "--api-key" in result.output


@pytest.mark.parametrize("command, module", [
    ("build-engines", "sglang_morph.morph.build_engines"),
    ("profile-layers", "sglang_morph.morph.profile_layers"),
    ("plan", "sglang_morph.splitquant"),
    ("deploy", "sglang_morph.iserve"),
])
def test_wrapper_help_is_the_module_help(command, module):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert f"the same command as `python -m {module}`" in result.output
    assert f"usage: python -m {module}" in result.output


def test_bench_help_is_the_replay_help():
    # bench runs the replay as a child process, so this reads the real process's output.
    proc = subprocess.run([str(SGLANG_MORPH), "bench", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "python -m benchmark.replay" in proc.stdout and "--quick" in proc.stdout


def test_wrapper_passes_arguments_and_exit_status(monkeypatch):
    seen = []

    def fake_main(argv):
        seen.append(argv)
        return 3

    import sglang_morph.splitquant.__main__ as splitquant

    monkeypatch.setattr(splitquant, "main", fake_main)
    result = invoke("plan", "plan", "--devices", "cpu:0.45GB", "--serve")
    assert seen == [["plan", "--devices", "cpu:0.45GB", "--serve"]]
    assert result.exit_code == 3


def test_wrapper_bad_argument_keeps_the_module_convention():
    result = invoke("plan", "nope")
    assert result.exit_code == 2
    assert "invalid choice: 'nope'" in result.stderr


def test_serve_hands_every_argument_to_serve_sh(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: calls.append((path, argv)))
    result = invoke("serve", "--enable-morph", "--port", "8000", "--dtype=float32")
    assert result.exit_code == 0, result.output
    ((path, argv),) = calls
    assert path == "/bin/bash"
    assert argv == ["bash", str(REPO_ROOT / "scripts" / "serve.sh"), "--enable-morph", "--port",
                    "8000", "--dtype=float32"]


# ---- bad arguments: one line, exit 2 ----------------------------------------------------------


@pytest.mark.parametrize("args, fragments", [
    (["nosuchcommand"], ["sglang-morph: error:", "nosuchcommand"]),
    (["status", "--bogus"], ["sglang-morph status: error:", "--bogus"]),
    (["swap", "1-x", "4"], ["sglang-morph swap: error:", "LAYERS", "1-x"]),
    (["swap", "5-2", "4"], ["runs backwards"]),
    (["swap", "1"], ["Missing argument 'BITS'"]),
    (["swap", "1", "four"], ["BITS", "four"]),
    (["mode", "fast"], ["sglang-morph mode: error:", "'fast' is not one of"]),
    (["top", "--interval-s", "0"], ["sglang-morph top: error:", "--interval-s"]),
    (["status", "--url", "ftp://x"], ["sglang-morph status: error:", "--url 'ftp://x'"]),
])
def test_bad_arguments_give_one_line_and_exit_2(args, fragments):
    one_line_error(invoke(*args), *fragments)


def test_parse_layers():
    assert parse_layers("17,14") == [17, 14]
    assert parse_layers("0-3,12") == [0, 1, 2, 3, 12]
    assert parse_layers(" 5 ") == [5]


@pytest.mark.parametrize("command", sorted(SERVER_COMMANDS))
def test_unreachable_server_is_one_line(command):
    url = f"http://127.0.0.1:{free_late_bind_port()}"  # nothing listens there
    line = one_line_error(invoke(command, *SERVER_COMMANDS[command], "--url", url))
    assert f"sglang-morph {command}: error:" in line and url in line
    assert "cannot reach the server" in line


def test_real_process_bad_argument_and_unreachable_server():
    """The installed console script itself: one line on stderr, exit 2, no traceback."""
    proc = subprocess.run([str(SGLANG_MORPH), "swap", "0-x", "4"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("sglang-morph swap: error:")
    url = f"http://127.0.0.1:{free_late_bind_port()}"
    proc = subprocess.run([str(SGLANG_MORPH), "status", "--url", url], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot reach the server" in proc.stderr


# ---- against a stand-in server ----------------------------------------------------------------


@pytest.fixture
def fake():
    """Recorded answers of a one-rank MorphServe server (layer 14 at W4, two transitions)."""
    server = FakeServer({
        ("GET", "/elastic/status"): (200, recorded("elastic_status")),
        ("GET", "/morph/status"): (200, recorded("morph_status")),
        ("GET", "/v1/loads?include=core"): (200, recorded("loads")),
        ("POST", "/morph/swap"): (200, recorded("morph_status")),
        ("POST", "/morph/mode"): (400, {"error": "unknown mode 'x'"}),
    })
    yield server
    server.close()


def test_status_json_has_every_answer(fake):
    result = invoke("status", "--url", fake.url, "--json", "--api-key", API_KEY)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out == {"elastic": recorded("elastic_status"), "morph": recorded("morph_status")}
    assert [r["path"] for r in fake.requests] == ["/elastic/status", "/morph/status"]
    assert all(r["headers"]["Authorization"] == f"Bearer {API_KEY}" for r in fake.requests)


def test_status_table(fake):
    result = invoke("status", "--url", fake.url, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "default, 1/30 layers quantized" in result.output
    assert "14:W4*" in result.output and "17:FP*" in result.output
    assert "0 / 1,557 (0%)" in result.output and "2 applied" in result.output


def test_swap_sends_the_body_with_the_admin_key(fake):
    result = invoke("swap", "14,17", "4", "--replica", "0", "--no-pin", "--url", fake.url,
                    "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
    assert result.exit_code == 0, result.output
    (request,) = fake.requests
    assert request["body"] == {"layers": [14, 17], "bits": 4, "pin": False, "replica": 0}
    assert request["headers"]["Authorization"] == f"Bearer {ADMIN_KEY}"
    assert request["headers"]["Content-Type"] == "application/json"
    assert "14:W4* 17:FP*" in result.output and "1,557 tokens" in result.output


def test_swap_without_admin_key_sends_the_api_key(fake):
    assert invoke("swap", "3", "8", "--url", fake.url, "--api-key", API_KEY).exit_code == 0
    assert fake.requests[0]["headers"]["Authorization"] == f"Bearer {API_KEY}"


def test_http_error_is_one_line_with_the_servers_reason(fake):
    line = one_line_error(invoke("mode", "performance", "--url", fake.url))
    assert "POST" in line and "/morph/mode answered 400: unknown mode 'x'" in line
    fake.routes[("GET", "/elastic/status")] = (401, {"error": "Unauthorized"})
    line = one_line_error(invoke("status", "--url", fake.url))
    assert line.endswith("/elastic/status answered 401: Unauthorized")
    # top's first poll fails the same way
    one_line_error(invoke("top", "--once", "--url", fake.url), "answered 401")


def test_env_vars_set_url_and_keys(fake):
    result = invoke("status", "--json", env={"SGLANG_MORPH_URL": fake.url,
                                             "SGLANG_MORPH_API_KEY": API_KEY})
    assert result.exit_code == 0, result.output
    assert fake.requests[0]["headers"]["Authorization"] == f"Bearer {API_KEY}"


def test_top_once_prints_one_frame(fake):
    result = invoke("top", "--once", "--url", fake.url, "--transitions", "1")
    assert result.exit_code == 0, result.output
    assert "mechanisms: morph" in result.output and "14:W4*" in result.output
    assert "KV 0 / 1,557 tokens" in result.output
    assert "queue  replica 0: 0 waiting, 0 running" in result.output
    # the newest transition only: the restore of layer 17
    assert "layers 17 -> FP" in result.output and "layers 17,14" not in result.output
    assert {r["path"] for r in fake.requests} == {"/elastic/status", "/morph/status",
                                                 "/v1/loads?include=core"}


def test_help_pages_cover_every_command_at_a_fixed_width():
    """The reference docs (docs/reference/cli.md) are generated from these pages."""
    pages = dict(cli.help_pages(100))
    assert list(pages) == ["sglang-morph", *(f"sglang-morph {c}" for c in sorted(COMMANDS))]
    assert pages["sglang-morph swap"].startswith("Usage: sglang-morph swap [OPTIONS] LAYERS BITS")
    assert pages["sglang-morph plan"].startswith("Usage: sglang-morph plan [ARGS]...")
    assert max(len(line) for text in pages.values() for line in text.splitlines()) <= 100
    narrow = dict(cli.help_pages(60))["sglang-morph top"]
    assert narrow != pages["sglang-morph top"]
    assert max(len(line) for line in narrow.splitlines()) <= 60


def test_mode_prints_every_replica(fake):
    """Under --dp-size the answer lists every replica's status: one line each."""
    one = recorded("morph_status")
    two = dict(one, replica=1, mode="performance", kv_capacity_tokens=2_000)
    fake.routes[("POST", "/morph/mode")] = (200, {"replicas": [dict(one, mode="performance"),
                                                               two]})
    result = invoke("mode", "performance", "--url", fake.url)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "replica 0: mode performance | 14:W4* | KV 0 / 1,557 tokens (0%)",
        "replica 1: mode performance | 14:W4* | KV 0 / 2,000 tokens (0%)"]
    assert fake.requests[-1]["body"] == {"mode": "performance"}
