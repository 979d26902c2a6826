"""Morph configuration: parsed once at the CLI edge, frozen, and carried on ``server_args``.

SGLang's ``ServerArgs`` is a sealed record whose fields are SGLang's own; unknown attributes are
only allowed as underscore-prefixed bookkeeping, which ``ServerArgs.__reduce__`` carries into the
scheduler and detokenizer processes. So the whole morph configuration rides along as one frozen
``MorphConfig`` under ``server_args._morph_config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from sglang_morph.config import FULL_PRECISION_BITS, KNOWN_BITS, ConfigError
from sglang_morph.config import parse_bytes as shared_parse_bytes

SERVER_ARGS_ATTR = "_morph_config"
# Controller modes (morph.control.policy.MODES must name the same ones).
MORPH_MODES = ("accuracy", "default", "performance")


def parse_bytes(text: str, flag: str) -> int:
    """``'1073741824'``, ``'1GiB'``, ``'800MB'`` -> bytes; MorphConfigError naming ``flag``."""
    return shared_parse_bytes(text, flag, MorphConfigError)


class MorphConfigError(ConfigError):
    """A morph flag is malformed or inconsistent; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class PrecisionMap:
    """Per-layer precision from ``--morph-precision-map``, e.g. ``0-7:4,8-29:16``.

    Items are ``A-B:bits``, ``A:bits`` or ``*:bits`` (every layer), separated by commas; later
    items override earlier ones and layers not named stay at 16 bits. Layer indices are checked
    against the model when it is known (``resolve``).
    """

    spec: str
    items: tuple[tuple[int | None, int | None, int], ...]  # (first, last, bits); None = all

    @classmethod
    def parse(cls, spec: str) -> "PrecisionMap":
        items = []
        for raw in (part.strip() for part in spec.split(",")):
            m = re.fullmatch(r"(?:(\*)|(\d+)(?:-(\d+))?):(\d+)", raw)
            if not m:
                raise MorphConfigError(
                    f"--morph-precision-map: cannot parse {raw!r}; expected items like "
                    f"'0-7:4', '12:8' or '*:8' separated by commas"
                )
            star, first, last, bits = m.groups()
            bits = int(bits)
            if bits not in KNOWN_BITS:
                raise MorphConfigError(
                    f"--morph-precision-map: unknown bit-width {bits} in {raw!r}; "
                    f"choose from {KNOWN_BITS}"
                )
            if star:
                items.append((None, None, bits))
                continue
            first_i = int(first)
            last_i = int(last) if last is not None else first_i
            if last_i < first_i:
                raise MorphConfigError(f"--morph-precision-map: empty range {raw!r}")
            items.append((first_i, last_i, bits))
        return cls(spec, tuple(items))

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """Bits per layer for a model with ``num_layers`` decoder layers."""
        bits = [FULL_PRECISION_BITS] * num_layers
        for first, last, b in self.items:
            if first is None:
                bits = [b] * num_layers
                continue
            if last >= num_layers:
                raise MorphConfigError(
                    f"--morph-precision-map: layer {last} does not exist; the model has "
                    f"{num_layers} layers (0-{num_layers - 1})"
                )
            bits[first : last + 1] = [b] * (last - first + 1)
        return tuple(bits)


@dataclasses.dataclass(frozen=True)
class MorphConfig:
    """Everything ``--enable-morph`` and its companion flags decide.

    Invariant: when ``enabled`` is False the plugin changes nothing in SGLang's behaviour, and
    no other morph flag is set (``from_cli_namespace`` refuses that combination).
    """

    enabled: bool = False
    # None with ``enabled``: the launcher builds the served model's variants and layer order
    # into the cache (or reuses them) and fills this and ``swap_order_path`` in before any
    # scheduler starts (``morph.auto_build``).
    engines_dir: str | None = None
    precision_map: PrecisionMap | None = None
    mode: str = "default"
    swap_order_path: str | None = None  # profile JSON with "order"; None = front to back
    memory_budget_bytes: int | None = None  # weights + KV; None = derived from SGLang's sizing
    # One weights + KV budget per pipeline stage (--morph-stage-budgets); None = every stage
    # gets memory_budget_bytes (sglang_morph.morph.parallel.pipeline).
    stage_budget_bytes: tuple[int, ...] | None = None
    log_path: str | None = None  # JSONL of transitions
    controller_enabled: bool = True  # False: only POST /morph/swap moves layers

    @classmethod
    def from_cli_namespace(cls, args: argparse.Namespace) -> "MorphConfig":
        enabled = bool(getattr(args, "enable_morph", False))
        engines_dir = getattr(args, "morph_engines", None)
        spec = getattr(args, "morph_precision_map", None)
        mode = getattr(args, "morph_mode", None)
        swap_order = getattr(args, "morph_swap_order", None)
        budget = getattr(args, "morph_memory_budget", None)
        stage_budgets = getattr(args, "morph_stage_budgets", None)
        log_path = getattr(args, "morph_log", None)
        no_controller = bool(getattr(args, "disable_morph_controller", False))
        if not enabled:
            given = [f for f, v in (("--morph-engines", engines_dir),
                                    ("--morph-precision-map", spec),
                                    ("--morph-mode", mode),
                                    ("--morph-swap-order", swap_order),
                                    ("--morph-memory-budget", budget),
                                    ("--morph-stage-budgets", stage_budgets),
                                    ("--morph-log", log_path),
                                    ("--disable-morph-controller", no_controller or None))
                     if v is not None]
            if given:
                raise MorphConfigError(f"{', '.join(given)} requires --enable-morph")
        if mode is not None and mode not in MORPH_MODES:
            raise MorphConfigError(f"--morph-mode: unknown mode {mode!r}; choose from {MORPH_MODES}")
        if budget is not None and stage_budgets is not None:
            raise MorphConfigError("--morph-memory-budget and --morph-stage-budgets exclude each "
                                   "other: give one budget for every stage or one per stage")
        precision_map = PrecisionMap.parse(spec) if spec is not None else None
        return cls(
            enabled=enabled,
            engines_dir=engines_dir,
            precision_map=precision_map,
            mode=mode or "default",
            swap_order_path=swap_order,
            memory_budget_bytes=(parse_bytes(budget, "--morph-memory-budget")
                                 if budget is not None else None),
            stage_budget_bytes=(tuple(parse_bytes(b, "--morph-stage-budgets")
                                      for b in stage_budgets.split(","))
                                if stage_budgets is not None else None),
            log_path=log_path,
            controller_enabled=not no_controller,
        )


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the morph flags to SGLang's launch parser (an argument group of their own)."""
    group = parser.add_argument_group(
        "sglang-morph", "Elastic serving: runtime layer swapping and KV resizing."
    )
    group.add_argument(
        "--enable-morph",
        action="store_true",
        help="Enable sglang-morph runtime morphing. Without it the plugin is a no-op. Without "
        "--morph-engines the served model's W8/W4 variants and layer order are built on first "
        "use into the cache ($SGLANG_MORPH_CACHE_DIR or ~/.cache/sglang-morph) and reused.",
    )
    group.add_argument(
        "--morph-engines",
        metavar="PATH",
        default=None,
        help="Directory of prebuilt per-layer precision variants "
        "(`python -m sglang_morph.morph.build_engines`) instead of the cache's.",
    )
    group.add_argument(
        "--morph-precision-map",
        metavar="SPEC",
        default=None,
        help="Static per-layer precision at startup, e.g. '0-7:4,8-29:16' or '*:8' "
        "(layers not named stay at 16 bits). Serves static W4/W8/mixed baselines.",
    )
    group.add_argument(
        "--morph-mode",
        choices=MORPH_MODES,
        default=None,
        help="Controller policy: 'accuracy' (act late, W8 before W4, one layer at a time), "
        "'default', or 'performance' (act early, several layers per step). Default: default.",
    )
    group.add_argument(
        "--morph-swap-order",
        metavar="PATH",
        default=None,
        help="Layer Importance Score profile JSON (python -m sglang_morph.morph.profile_layers); "
        "its \"order\" is the order layers are swapped in. Default: the order built with the "
        "cache's variants; front to back with --morph-engines.",
    )
    group.add_argument(
        "--morph-memory-budget",
        metavar="BYTES",
        default=None,
        help="One budget for weights + KV cache, e.g. 1GiB or 800MB. The KV pool starts at "
        "what full-precision weights leave of it (sets --max-total-tokens). Default: the "
        "weights plus the KV pool SGLang sizes from its own memory settings.",
    )
    group.add_argument(
        "--morph-stage-budgets",
        metavar="BYTES,BYTES,...",
        default=None,
        help="With --pp-size N: one weights + KV budget per pipeline stage (N values, e.g. "
        "250MB,180MB). Every stage keeps the same KV token capacity, the most the tightest "
        "stage allows. Without it --morph-memory-budget is each stage's budget.",
    )
    group.add_argument(
        "--morph-log",
        metavar="PATH",
        default=None,
        help="Append every transition (swap, restore, KV resize) to this JSONL file.",
    )
    group.add_argument(
        "--disable-morph-controller",
        action="store_true",
        help="Do not morph on pressure; layers move only through POST /morph/swap.",
    )


def attach(server_args: Any, config: MorphConfig) -> None:
    """Store ``config`` on a not-yet-resolved ``ServerArgs`` record."""
    setattr(server_args, SERVER_ARGS_ATTR, config)


def get(server_args: Any) -> MorphConfig:
    """The morph config of ``server_args``; disabled when the record was built without our
    options (e.g. a ``ServerArgs`` made directly, outside the CLI and ``sglang.Engine(...)``).
    """
    return getattr(server_args, SERVER_ARGS_ATTR, None) or MorphConfig()
