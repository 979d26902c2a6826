"""benchmark/harness.py: a run's record of the code it ran on."""

from __future__ import annotations

import subprocess

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
