"""Morph configuration: parsed once at the CLI edge, frozen, and carried on ``server_args``.

SGLang's ``ServerArgs`` is a sealed record whose fields are SGLang's own; unknown attributes are
only allowed as underscore-prefixed bookkeeping, which ``ServerArgs.__reduce__`` carries into the
scheduler and detokenizer processes. So the whole morph configuration rides along as one frozen
``MorphConfig`` under ``server_args._morph_config``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

SERVER_ARGS_ATTR = "_morph_config"


@dataclasses.dataclass(frozen=True)
class MorphConfig:
    """Everything ``--enable-morph`` and its companion flags decide.

    Invariant: when ``enabled`` is False the plugin changes nothing in SGLang's behaviour.
    """

    enabled: bool = False

    @classmethod
    def from_cli_namespace(cls, args: argparse.Namespace) -> "MorphConfig":
        return cls(enabled=bool(getattr(args, "enable_morph", False)))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the morph flags to SGLang's launch parser (an argument group of their own)."""
    group = parser.add_argument_group(
        "sglang-morph", "Elastic serving: runtime layer swapping and KV resizing."
    )
    group.add_argument(
        "--enable-morph",
        action="store_true",
        help="Enable sglang-morph runtime morphing. Without it the plugin is a no-op.",
    )


def attach(server_args: Any, config: MorphConfig) -> None:
    """Store ``config`` on a not-yet-resolved ``ServerArgs`` record."""
    setattr(server_args, SERVER_ARGS_ATTR, config)


def get(server_args: Any) -> MorphConfig:
    """The morph config of ``server_args``; disabled when the record was built without our flags

    (e.g. through ``sglang.Engine(...)`` keyword arguments or a launcher that bypasses the CLI).
    """
    return getattr(server_args, SERVER_ARGS_ATTR, None) or MorphConfig()
