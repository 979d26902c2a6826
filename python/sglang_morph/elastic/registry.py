"""What a live mechanism exports to the plugin, and the elastic core's own flags.

A mechanism is a folder with a module that defines ``MECHANISM = Mechanism(...)``; the plugin
lists these modules (``sglang_morph.plugin.MECHANISMS``, one line each) and does the rest:
adds the flags, configures each mechanism once in the launcher, checks its SGLang symbols,
registers its hooks, attaches it to every scheduler, calls its per-step entry and lists it in
``GET /elastic/status``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

SERVER_ARGS_ATTR = "_elastic_config"


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """One live mechanism's surface.

    Invariants: ``configure`` runs in the launcher before anything is spawned, attaches the
    mechanism's frozen config to ``server_args`` and raises ``ConfigError`` (one line naming
    the flag) having attached nothing; ``enabled`` reads that config and is False on a record
    built without our flags; ``hooks`` are registered in every process and change nothing
    while the mechanism is disabled; ``attach`` runs after ``Scheduler.__init__`` on an
    enabled server and returns the per-step entry (or None) and the state ``/elastic/status``
    shows (a function of no argument returning a JSON object).
    """

    name: str
    flag: str  # the switch, e.g. --enable-morph
    add_cli_args: Callable[[argparse.ArgumentParser], None]
    # (server_args, parsed args, names of the mechanisms enabled before this one) -> enabled
    configure: Callable[[Any, argparse.Namespace, frozenset[str]], bool]
    enabled: Callable[[Any], bool]
    hooks: Callable[[], tuple[Any, ...]]  # surface.Hook records
    symbols: Callable[[], tuple[Any, ...]]  # surface.Symbol records checked at startup
    # In the launcher of an enabled server, after configure: routes, HTTP-side hooks.
    launcher_setup: Callable[[Any], None]
    # In each scheduler of an enabled server: (per-step entry or None, state for the status).
    attach: Callable[[Any], tuple[Callable[[], None] | None, Callable[[], dict[str, Any]]]]
    add_routes: Callable[[Any], None]  # its own routes (also read by the reference docs)
    # Rewrites weights or KV slots between batches: overlap scheduling and graphs go off.
    transitions_between_batches: bool = True


def routes_in_launcher(add_routes: Callable[[Any], None]) -> Callable[[Any], None]:
    """A mechanism's ``launcher_setup`` that adds its routes to SGLang's FastAPI app."""
    def launcher_setup(server_args: Any) -> None:
        from sglang.srt.entrypoints.http_server import app

        add_routes(app)
    return launcher_setup


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """The core's own flags: one JSONL log of every mechanism's transitions, and whether
    ``/metrics`` needs the API key."""

    log_path: str | None = None
    metrics_auth: bool = False  # /metrics only with the API key (server/guard.py)

    @classmethod
    def from_cli_namespace(cls, args: argparse.Namespace) -> "ElasticConfig":
        return cls(log_path=getattr(args, "elastic_log", None),
                   metrics_auth=bool(getattr(args, "elastic_metrics_auth", False)))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sglang-morph elastic core", "What every live mechanism shares.")
    group.add_argument(
        "--elastic-log", metavar="PATH", default=None,
        help="Append every transition of every enabled mechanism to this JSONL file "
        "(one record per transition and replica: mechanism, action, reason, outcome, "
        "duration, KV capacity before and after).")
    group.add_argument(
        "--elastic-metrics-auth", action="store_true",
        help="Serve /metrics only to requests with the --api-key (or --admin-api-key) as a "
        "Bearer token; SGLang serves it to anyone, and the mechanisms' metrics show the model "
        "path, per-layer bits and KV capacity and use.")


def attach_config(server_args: Any, cfg: ElasticConfig) -> None:
    setattr(server_args, SERVER_ARGS_ATTR, cfg)


def elastic_config(server_args: Any) -> ElasticConfig:
    return getattr(server_args, SERVER_ARGS_ATTR, None) or ElasticConfig()
