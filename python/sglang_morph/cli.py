"""What the offline commands share (SplitQuant's ``python -m sglang_morph.splitquant`` and
iServe's ``python -m sglang_morph.iserve``): the error type, the JSON-or-one-line convention,
memory sizes, and the default model's W8/W4 variants."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sglang_morph.config import ConfigError, parse_bytes


class CliError(ConfigError):
    """A command-line problem; the command prints ``error: <message>`` and exits 2."""


def run_command(commands: dict, args) -> int:
    """Run ``commands[args.command](args)`` and print its JSON result (exit 0), or the
    CliError it raised as ``error: ...`` on stderr (exit 2)."""
    try:
        result = commands[args.command](args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def parse_size(text: str) -> int:
    """A memory size in the server flags' syntax (``450MB``, ``0.5GB``, ``1GiB``)."""
    try:
        return parse_bytes(text, "memory size", CliError)
    except CliError:
        raise CliError(f"bad memory size {text!r} (e.g. 450MB, 0.5GB)") from None


def default_engines(model_dir: Path) -> Path:
    """The W8/W4 layer variants of ``model_dir`` (built once, then found in the cache)."""
    out = subprocess.run([sys.executable, "-m", "sglang_morph.morph.build_engines", "--bits",
                          "8,4", "--model-path", str(model_dir)], capture_output=True, text=True)
    if out.returncode != 0:
        raise CliError(f"building the W8/W4 variants failed: {out.stderr.strip()[-300:]}")
    return Path(out.stdout.strip().splitlines()[-1])
