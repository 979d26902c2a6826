"""AMOEBAs' registration with the plugin (``MECHANISM``): its flags, launch checks, hooks,
replica side and routes. The hooks return at once on a server without ``--enable-amoebas``."""

from __future__ import annotations

from typing import Any, Callable

from sglang_morph import surface as sym
from sglang_morph.amoebas import config as amoebas_config
from sglang_morph.amoebas import messages  # noqa: F401  (registers its IPC types)
from sglang_morph.elastic.registry import Mechanism, routes_in_launcher
from sglang_morph.surface import (
    DP_CONTROLLER_MODULE,
    HOOK_DP_INIT_DISPATCHER,
    HOOK_LLAMA_FORWARD,
    HOOK_RUNNER_FORWARD,
    HOOK_SCHEDULER_GENERATE,
    IN_SCHEDULER,
    Hook,
)


def configure(server_args: Any, args: Any, enabled_before: frozenset[str]) -> bool:
    """In the launcher: check, parse and attach the AMOEBAs config. Raises
    AmoebasConfigError (one line) having attached nothing."""
    if getattr(args, "enable_amoebas", False):
        amoebas_config.check_launch(server_args, enabled_before)
    cfg = amoebas_config.AmoebasConfig.from_cli_namespace(args, server_args)
    amoebas_config.attach(server_args, cfg)
    return cfg.enabled


def add_routes(app: Any) -> None:
    from sglang_morph.amoebas.http import add_routes as add

    add(app)


def attach(scheduler: Any):
    """After ``Scheduler.__init__``: this replica's AMOEBAs side and its control requests."""
    from sglang.utils import TypeBasedDispatcher

    from sglang_morph.amoebas.messages import AMOEBAS_REQUESTS
    from sglang_morph.amoebas.replica import AmoebasReplica
    from sglang_morph.surface import PluginError

    try:
        replica = AmoebasReplica(scheduler, amoebas_config.get(scheduler.server_args))
    except NotImplementedError as e:
        raise PluginError(f"sglang-morph: error: --enable-amoebas does not support this "
                          f"configuration: {e}") from e
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(req_type, replica.handle_control) for req_type in AMOEBAS_REQUESTS])
    scheduler.amoebas = replica
    return (replica.auto.on_step if replica.auto is not None else None), replica.elastic_state


def around_runner_forward(original: Callable[..., Any], runner: Any, *args: Any,
                          **kwargs: Any) -> Any:
    replica = runner.__dict__.get("amoebas")
    if replica is None:
        return original(runner, *args, **kwargs)
    # The layers run under the process's compute lock (replica.py, "Concurrency").
    with replica.lock:
        return original(runner, *args, **kwargs)


def around_llama_forward(original: Callable[..., Any], model: Any, *args: Any,
                         **kwargs: Any) -> Any:
    replica = model.__dict__.get("amoebas")
    if replica is None or not replica.merged:
        return original(model, *args, **kwargs)
    return replica.forward_merged(*args, **kwargs)


def around_generate_request(original: Callable[..., Any], scheduler: Any, recv_req: Any,
                            *args: Any, **kwargs: Any) -> Any:
    replica = scheduler.__dict__.get("amoebas")
    if replica is None or replica.auto is None or args or kwargs:
        return original(scheduler, recv_req, *args, **kwargs)
    # A prompt no replica alone holds may wait for a merge (auto.py).
    return replica.auto.admit(original, scheduler, recv_req)


def after_init_dispatcher(_result: None, controller: Any) -> None:
    """The data-parallel controller places requests by AMOEBAs' policy (dispatch.py) when the
    transitions are automatic; an operator's manual mode keeps SGLang's round-robin."""
    cfg = amoebas_config.get(controller.server_args)
    if not (cfg.enabled and cfg.auto):
        return
    from sglang_morph.amoebas.dispatch import AmoebasDispatcher

    AmoebasDispatcher.install(controller, cfg)


HOOKS: tuple[Hook, ...] = (
    Hook(HOOK_RUNNER_FORWARD, around_runner_forward, "AROUND", only_if_imported=IN_SCHEDULER),
    Hook(HOOK_LLAMA_FORWARD, around_llama_forward, "AROUND", only_if_imported=IN_SCHEDULER),
    Hook(HOOK_SCHEDULER_GENERATE, around_generate_request, "AROUND",
         only_if_imported=IN_SCHEDULER),
    Hook(HOOK_DP_INIT_DISPATCHER, after_init_dispatcher, "AFTER",
         only_if_imported=DP_CONTROLLER_MODULE),
)

MECHANISM = Mechanism(
    name="amoebas",
    flag="--enable-amoebas",
    add_cli_args=amoebas_config.add_cli_args,
    configure=configure,
    enabled=lambda server_args: amoebas_config.get(server_args).enabled,
    hooks=lambda: HOOKS,
    symbols=lambda: sym.AMOEBAS_SYMBOLS,
    launcher_setup=routes_in_launcher(add_routes),
    attach=attach,
    add_routes=add_routes,
)
