"""``python -m sglang_morph.models path|info``: the embedded default model from the shell.

``path`` prints only the converted model's directory on stdout, so scripts can write
``--model-path "$(python -m sglang_morph.models path)"``; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from sglang_morph.models import (
    DEFAULT_MODEL,
    DefaultModelUnavailableError,
    default_gguf_path,
    default_model_dir,
    default_model_path,
    missing_parts,
)


def _path() -> int:
    # Libraries print during conversion (transformers, gguf); stdout must carry only the path.
    with contextlib.redirect_stdout(sys.stderr):
        model_dir = default_model_path()
    print(model_dir)
    return 0


def _info() -> int:
    spec = DEFAULT_MODEL
    model_dir = default_model_dir(spec)
    missing = missing_parts(model_dir, spec)
    try:
        gguf = str(default_gguf_path(spec))
    except DefaultModelUnavailableError as error:
        gguf = f"unavailable: {error}"
    print(f"name: {spec.name}")
    print(f"gguf package: {spec.gguf_distribution}=={spec.gguf_distribution_version}")
    print(f"gguf file: {gguf}")
    print(f"dtype: {spec.dtype}")
    print(f"directory: {model_dir}")
    if not model_dir.exists():
        converted = "no"
    elif missing:
        converted = f"incomplete, lacks {', '.join(missing)}"
    else:
        converted = "yes"
    print(f"converted: {converted}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_morph.models",
        description=f"The embedded default model, {DEFAULT_MODEL.name}.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("path", help="convert the model on first use; print only its directory")
    commands.add_parser("info", help="describe the model and whether it is converted yet")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return {"path": _path, "info": _info}[args.command]()
    except DefaultModelUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
