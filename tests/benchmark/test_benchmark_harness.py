"""benchmark/harness.py: a run's record of the code it ran on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

from benchmark import harness


def test_results_a_run_writes_do_not_make_the_tree_dirty(tmp_path, monkeypatch):
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    monkeypatch.setattr(harness, "REPO_ROOT", tmp_path)
    assert harness.git_state()["dirty"] is False
    (tmp_path / "benchmark" / "results" / "run").mkdir(parents=True)
    (tmp_path / "benchmark" / "results" / "run" / "out.json").write_text("{}")
    assert harness.git_state()["dirty"] is False  # a result, not code
    git("add", "benchmark")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a result")
    (tmp_path / "benchmark" / "results" / "run" / "out.json").write_text('{"again": 1}')
    assert harness.git_state()["dirty"] is False  # a result rewritten by a rerun
    (tmp_path / "new_module.py").write_text("y = 2\n")
    assert harness.git_state()["dirty"] is True  # code not committed
    (tmp_path / "new_module.py").unlink()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert harness.git_state()["dirty"] is True  # committed code changed


def test_a_server_runs_behind_the_client():
    """Every thread of the server's process group, and its session's scheduling group where
    the kernel has one, get the lower priority; the caller keeps its own."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); " \
           "time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        harness.behind_the_client(types.SimpleNamespace(proc=proc))
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert len(threads) == 2
        assert [os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads] == [harness.SERVER_NICE] * 2
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
        autogroup = Path(f"/proc/{proc.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == str(harness.SERVER_NICE)
    finally:
        proc.kill()
        proc.wait()
