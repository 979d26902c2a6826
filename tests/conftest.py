"""Shared fixtures: real SGLang servers started through scripts/serve.sh, on 127.0.0.1.

A server holds about 5 GiB of host memory (three processes plus its KV pool) on a 24 GiB
machine, so only the default server lives for the whole session; other configurations live for
one module (``server_factory``) or one ``with running_server(...)`` block, and every server is
stopped as a whole process group. The server and engine helpers are the benchmarks' own
(``benchmark/harness.py``); here they take a log directory and the test timeout.

The test folders mirror the package (core/, morph/, kunserve/, ...); their modules import each
other by bare name (``from test_morph_runtime_server import corpus_ids``), so every folder is
on ``sys.path`` and every test file name is unique across folders.

Tests that start a server (or run ``scripts/serve.sh``, or build the default model's engines)
carry the marker ``server``: ``pytest -m "not server"`` runs the rest in a few minutes.
A test gets it from the fixtures it uses (``SERVER_FIXTURES``, directly or through other
fixtures) or from an explicit ``pytest.mark.server`` where it starts servers itself.
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

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SERVER_START_TIMEOUT_S = float(os.environ.get("MORPH_TEST_SERVER_START_TIMEOUT_S", "600"))


for _folder in sorted(TESTS_DIR.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Fixtures that start a server, or a subprocess build of the default model's layer engines.
SERVER_FIXTURES = frozenset({"server_factory", "default_server", "engines_awq", "engines_rtn"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.server)


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
