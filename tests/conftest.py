"""Shared fixtures: real SGLang servers started through scripts/serve.sh, on 127.0.0.1.

A server holds about 5 GiB of host memory (three processes plus its KV pool) on a 24 GiB
machine, so only the default server lives for the whole session; other configurations live for
one module (``server_factory``) or one ``with running_server(...)`` block, and every server is
stopped as a whole process group. The server and engine helpers are the benchmarks' own
(``benchmark/harness.py``); here they take a log directory and the test timeout.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import harness
from benchmark.harness import ServerProcess, build_engines, free_port  # noqa: F401  (for tests)
from sglang_morph.repo_data import DATA_DIR  # noqa: F401  (the tests' data files)

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_START_TIMEOUT_S = float(os.environ.get("MORPH_TEST_SERVER_START_TIMEOUT_S", "600"))


def start_server(extra_args, log_dir: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """A ready server logging to ``log_dir/server.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return harness.start_server(list(extra_args), log_dir / "server.log", env,
                                start_timeout_s=SERVER_START_TIMEOUT_S)


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
    """The server exactly as the README's serve command starts it (plugin loaded, morph off)."""
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


@pytest.fixture(scope="session")
def engines_awq() -> Path:
    """AWQ W8 + W4 variants of every layer of the default model."""
    return build_engines("--bits", "8,4")


@pytest.fixture(scope="session")
def engines_rtn() -> Path:
    return build_engines("--bits", "4", "--no-awq")
