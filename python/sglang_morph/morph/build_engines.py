"""``python -m sglang_morph.morph.build_engines``: build the per-layer precision variants of a model.

    python -m sglang_morph.morph.build_engines [--model-path M] [--bits 8,4] [--out DIR]
        [--recipe trt_engines/recipes/llama.json] [--w4-group-size auto|128|64|32] [--no-awq]
        [--calibration-file F] [--calibration-samples N] [--calibration-tokens-per-sample T]
        [--seed S] [--force]

Flags override the recipe's fields. The engines directory defaults to
``<cache>/engines/<model dir name>-<recipe hash>`` (cache: ``$SGLANG_MORPH_CACHE_DIR`` or
~/.cache/sglang-morph). Only that directory is printed on stdout, as the last line, so scripts can
write ``--morph-engines "$(python -m sglang_morph.morph.build_engines)"``; logs and progress go to
stderr. Bad input exits with 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
from pathlib import Path

from sglang_morph.engines.build import (
    DEFAULT_RECIPE_FILE,
    BuildError,
    BuildRecipe,
    build,
    parse_group_size,
    plan_build,
)
from sglang_morph.models import DefaultModelUnavailableError, default_model_path
from sglang_morph.repo_data import REPO_ROOT


def _parse_bits(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 8,4, got {value!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_morph.morph.build_engines",
        description="Build W8/W4 variants of every decoder layer (AWQ-style W4 scales).",
    )
    parser.add_argument("--model-path", type=Path, metavar="DIR",
                        help="HF model directory (default: the embedded default model)")
    parser.add_argument("--bits", type=_parse_bits, metavar="B[,B...]",
                        help="quantized bit-widths to build, e.g. 8,4 (default: the recipe's)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="engines directory (default: <cache>/engines/<model>-<recipe hash>)")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE_FILE, metavar="JSON",
                        help=f"recipe JSON (default: {DEFAULT_RECIPE_FILE.relative_to(REPO_ROOT)})")
    parser.add_argument("--w4-group-size", metavar="auto|128|64|32",
                        help="W4 group size for every linear, or 'auto' for the per-linear rule")
    parser.add_argument("--no-awq", action="store_true",
                        help="plain round-to-nearest W4 without activation-aware scales")
    parser.add_argument("--calibration-file", type=Path, metavar="TXT",
                        help="calibration text (train split, never the test split)")
    parser.add_argument("--calibration-samples", type=int, metavar="N", help="calibration windows")
    parser.add_argument("--calibration-tokens-per-sample", type=int, metavar="T",
                        help="tokens per calibration window")
    parser.add_argument("--seed", type=int, metavar="S",
                        help="seed that picks the calibration windows")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even when --out already holds a build (same or different)")
    return parser


def _recipe(args: argparse.Namespace) -> BuildRecipe:
    recipe = BuildRecipe.load(args.recipe)
    overrides = {
        "bits": args.bits,
        "calibration_file": args.calibration_file and args.calibration_file.expanduser().absolute(),
        "calibration_samples": args.calibration_samples,
        "calibration_tokens_per_sample": args.calibration_tokens_per_sample,
        "seed": args.seed,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.w4_group_size is not None:
        overrides["w4_group_size"] = parse_group_size(args.w4_group_size)
    if args.no_awq:
        overrides["awq"] = False
    return dataclasses.replace(recipe, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        recipe = _recipe(args)
        if args.model_path is None:
            with contextlib.redirect_stdout(sys.stderr):
                args.model_path = default_model_path()
        plan = plan_build(args.model_path, recipe, args.out, args.force)
        out_dir = build(plan)
    except (BuildError, DefaultModelUnavailableError) as error:
        parser.error(str(error))
    print(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
