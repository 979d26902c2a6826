"""The package's import rules (.importlinter): plugin over mechanisms over the elastic core over
the shared layer, mechanisms independent of each other, and
nothing in the package imports the benchmarks or the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(REPO_ROOT / ".importlinter")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


def test_a_broken_rule_is_reported(tmp_path):
    """The check can fail: a contract that forbids what the plugin does import is broken."""
    config = tmp_path / "rules.ini"
    config.write_text("[importlinter]\nroot_package = sglang_morph\n\n"
                      "[importlinter:contract:x]\nname = x\ntype = forbidden\n"
                      "source_modules =\n    sglang_morph.plugin\n"
                      "forbidden_modules =\n    sglang_morph.elastic\n")
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--config", str(config)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "BROKEN" in proc.stdout
