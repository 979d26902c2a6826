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

``scripts/test.sh`` runs two test processes (pytest-xdist, ``--dist loadgroup``): a server
start is mostly one Python process importing SGLang, so the other core is free for the other
process's tests. Each module is one group (its module-scoped servers start once), and so are
the modules that share a process-wide resource: the users of ``default_server``, and modules
that mark one group explicitly because they share recorded outputs. Groups that start servers
go first, so the short server-free modules fill the end of the run. A server starts only when
the machine has room for it (``_StartGate``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

from benchmark import harness
from benchmark.harness import ServerProcess, build_engines, free_port  # noqa: F401  (for tests)
from sglang_morph.parallel.binding import local_ranks
from sglang_morph.repo_data import DATA_DIR  # noqa: F401  (the tests' data files)

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SERVER_START_TIMEOUT_S = float(os.environ.get("MORPH_TEST_SERVER_START_TIMEOUT_S", "600"))


for _folder in sorted(TESTS_DIR.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Fixtures that start a server, or a subprocess build of the default model's layer engines.
SERVER_FIXTURES = frozenset({"server_factory", "default_server", "engines_awq", "engines_rtn"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects and xdist reads the groups
def pytest_collection_modifyitems(config, items):
    by_module: dict[str, list[pytest.Item]] = collections.defaultdict(list)
    for item in items:
        if SERVER_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.server)
        by_module[item.nodeid.split("::")[0]].append(item)
    groups: dict[str, list[pytest.Item]] = collections.defaultdict(list)
    for module_items in by_module.values():
        group = _group_of(module_items)
        for item in module_items:
            item.add_marker(pytest.mark.xdist_group(group))
        groups[group] += module_items
    # Most server tests first (stable otherwise): the long groups start early.
    servers = {g: sum(1 for i in group if i.get_closest_marker("server")) for g, group in
               groups.items()}
    items[:] = [i for g in sorted(groups, key=lambda g: -servers[g]) for i in groups[g]]


def _group_of(module_items: list[pytest.Item]) -> str:
    """A module's xdist group (all its tests in one: its module-scoped servers start once): an
    explicit ``xdist_group`` mark, else ``default_server`` if a test uses that session server
    (one per test process), else the module itself."""
    marked = {str(m.args[0] if m.args else m.kwargs["name"])
              for i in module_items for m in i.iter_markers("xdist_group")}
    assert len(marked) <= 1, f"one xdist_group per module: {sorted(marked)}"
    if marked:
        return marked.pop()
    if any("default_server" in i.fixturenames for i in module_items):
        return "default_server"
    return Path(module_items[0].nodeid.split("::")[0]).stem  # test file names are unique


class _StartGate:
    """A server starts only when the machine has room for it.

    A server takes its memory (three or more processes, weights, KV pool) only as it starts,
    so free memory alone over-counts while another server is starting: each start reserves an
    estimate in a ledger shared by the run's test processes (a JSON file under a file lock)
    until the server is ready or stopped, and a start waits until free memory less the other
    reservations covers its own estimate and ``HEADROOM_GIB``. Starts that fit run together
    (their imports keep both cores busy). After ``MEMORY_WAIT_S`` a start goes ahead anyway
    (a failure for memory is then its test's to report). Entries of dead processes are dropped.
    """

    # Measured here: a one-rank server ~3.6 GiB (bf16, 65,536-token pool), DP 2 ~5.3 GiB.
    ONE_RANK_GIB = 3.5
    MORE_RANK_GIB = 1.5
    HEADROOM_GIB = 2.0
    MEMORY_WAIT_S = 900.0
    POLL_S = 2.0

    def __init__(self, ledger: Path):
        self.ledger = ledger
        self.lock = FileLock(f"{ledger}.lock")

    @classmethod
    def estimate_gib(cls, args) -> float:
        """The memory a server of ``args`` (serve.sh arguments) takes on this node."""
        ranks = local_ranks([str(a) for a in args])
        return cls.ONE_RANK_GIB + cls.MORE_RANK_GIB * (ranks - 1)

    @staticmethod
    def available_gib() -> float:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
        return float("inf")  # not Linux: no gate

    def _entries(self) -> dict[str, list]:
        """``{key: [pid, GiB]}`` of live processes' reservations (call under the lock)."""
        try:
            entries = json.loads(self.ledger.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return {k: v for k, v in entries.items() if _alive(v[0])}

    def reserve(self, key: str, gib: float) -> None:
        deadline = time.monotonic() + self.MEMORY_WAIT_S
        while True:
            with self.lock:
                entries = self._entries()
                free = self.available_gib() - sum(g for _pid, g in entries.values())
                if free >= gib + self.HEADROOM_GIB or time.monotonic() >= deadline:
                    entries[key] = [os.getpid(), gib]
                    self.ledger.write_text(json.dumps(entries))
                    return
            time.sleep(self.POLL_S)

    def release(self, key: str) -> None:
        with self.lock:
            entries = self._entries()
            if entries.pop(key, None) is not None:
                self.ledger.write_text(json.dumps(entries))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: alive, another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


START_GATE: _StartGate | None = None


def pytest_configure(config):
    """Under pytest-xdist, every server this process starts passes the run's start gate, and
    this process and its servers wait for work without spinning (``OMP_WAIT_POLICY``)."""
    global START_GATE
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None or START_GATE is not None:
        return
    # OpenMP threads spin while they wait for work; with two test processes' servers on two
    # cores, spinning threads take the cores from the threads with work. Measured here (two
    # processes of small float32 matmuls, two threads each): 38 s each at once instead of
    # 6.6 s alone; passive waiting, 16-17 s at once (7.6 s alone). Results are unchanged.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    START_GATE = _StartGate(Path(tempfile.gettempdir()) / f"sglang-morph-tests-{run_id}.json")
    launch, wait_ready, stop = ServerProcess._launch, ServerProcess.wait_ready, ServerProcess.stop

    def gated_launch(self):
        if getattr(self, "_gate_key", None) is None:  # once per start (and per relaunch)
            self._gate_key = f"{os.getpid()}-{id(self)}-{time.monotonic_ns()}"
            START_GATE.reserve(self._gate_key, START_GATE.estimate_gib(self.extra_args))
        launch(self)

    def release(self):
        if getattr(self, "_gate_key", None) is not None:
            START_GATE.release(self._gate_key)
            self._gate_key = None

    def gated_wait_ready(self):
        try:
            wait_ready(self)
        finally:
            release(self)

    def gated_stop(self, *args, **kwargs):
        release(self)
        stop(self, *args, **kwargs)

    ServerProcess._launch = gated_launch
    ServerProcess.wait_ready = gated_wait_ready
    ServerProcess.stop = gated_stop


@pytest.fixture
def room_for_a_server():
    """For a test whose one-rank servers start in a subprocess, one after another: under
    pytest-xdist, room for one is reserved for the test's duration."""
    if START_GATE is None:
        yield
        return
    key = f"{os.getpid()}-test-{time.monotonic_ns()}"
    START_GATE.reserve(key, START_GATE.ONE_RANK_GIB)
    try:
        yield
    finally:
        START_GATE.release(key)


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
