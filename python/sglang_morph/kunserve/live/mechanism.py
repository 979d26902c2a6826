"""KunServe's registration with the plugin (``MECHANISM``): its flags, launch checks, hooks,
replica side and routes. The hooks return at once on a server without ``--enable-kunserve``."""

from __future__ import annotations

from typing import Any

from sglang_morph import surface as sym
from sglang_morph.elastic.registry import Mechanism, routes_in_launcher
from sglang_morph.kunserve.live import config as kunserve_config
from sglang_morph.kunserve.live import messages  # noqa: F401  (registers its IPC types)
from sglang_morph.surface import Hook, PluginError


def configure(server_args: Any, args: Any, enabled_before: frozenset[str]) -> bool:
    """In the launcher: parse, check and attach the KunServe config. Raises
    KunServeConfigError (one line) having attached nothing."""
    cfg = kunserve_config.KunServeLiveConfig.from_cli_namespace(
        args, dp_size=getattr(server_args, "dp_size", 1) or 1)
    if cfg.enabled:
        kunserve_config.check_launch(server_args, morph_enabled="morph" in enabled_before)
    kunserve_config.attach(server_args, cfg)
    return cfg.enabled


def add_routes(app: Any) -> None:
    from sglang_morph.kunserve.live.http import add_routes as add

    add(app)


def attach(scheduler: Any):
    """After ``Scheduler.__init__``: this replica's KunServe side and its control requests."""
    from sglang_morph.kunserve.live.hooks import attach as attach_replica

    cfg = kunserve_config.get(scheduler.server_args)
    try:
        attach_replica(scheduler, cfg)
    except NotImplementedError as e:
        raise PluginError(f"sglang-morph: error: --enable-kunserve does not support this "
                          f"configuration: {e}") from e
    replica = scheduler.kunserve
    return replica.on_step, replica.elastic_state


def hooks() -> tuple[Hook, ...]:
    from sglang_morph.kunserve.live import forward_timings
    from sglang_morph.kunserve.live.hooks import HOOKS

    # forward_timings: none unless SGLANG_MORPH_FORWARD_TIMINGS names a file (cost benchmark).
    return HOOKS + forward_timings.hooks()


MECHANISM = Mechanism(
    name="kunserve",
    flag="--enable-kunserve",
    add_cli_args=kunserve_config.add_cli_args,
    configure=configure,
    enabled=lambda server_args: kunserve_config.get(server_args).enabled,
    hooks=hooks,
    symbols=lambda: sym.KUNSERVE_SYMBOLS,
    launcher_setup=routes_in_launcher(add_routes),
    attach=attach,
    add_routes=add_routes,
)
