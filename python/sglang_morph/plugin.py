"""SGLang plugin entry point (entry-point group ``sglang.srt.plugins``, name ``morph``).

SGLang calls ``load()`` in every process it starts (launcher, scheduler, detokenizer, DP
controller). We register hooks, apply them at once and verify that each one took
(``surface.register_and_verify``): a hook that did not apply ends the process with a message
naming the SGLang release the plugin was written for.

The live mechanisms are listed in ``MECHANISMS``, one line each; this module loops over them.
In the launcher each mechanism parses and checks its flags before anything is spawned (one
line naming the flag on error), the SGLang symbols of every enabled mechanism are checked, and
the enabled ones install their routes. In each scheduler the enabled ones attach and get their
per-step entry called between batches. With no mechanism enabled the hooks only add our CLI
flags and refuse token ids outside the vocabulary (``server/guard.py``: SGLang would crash on
them); otherwise SGLang's behaviour is unchanged.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

from sglang_morph import surface as sym
from sglang_morph.config import ConfigError
from sglang_morph.elastic import registry
from sglang_morph.elastic.registry import Mechanism
from sglang_morph.server import guard
from sglang_morph.surface import IN_SCHEDULER, Hook, PluginError

logger = logging.getLogger("sglang_morph")

# The live mechanisms, in the order they are configured and attached: a module each, exporting
# ``MECHANISM``. Adding a mechanism is one line here.
MECHANISMS = (
    "sglang_morph.morph.mechanism",
    "sglang_morph.kunserve.live.mechanism",
    "sglang_morph.amoebas.mechanism",
)
# More mechanism modules, comma-separated, for mechanisms that live outside this package.
EXTRA_MECHANISMS_ENV = "SGLANG_MORPH_EXTRA_MECHANISMS"

@functools.lru_cache(maxsize=None)
def mechanisms() -> tuple[Mechanism, ...]:
    extra = [m for m in os.environ.get(EXTRA_MECHANISMS_ENV, "").split(",") if m.strip()]
    found = tuple(importlib.import_module(m.strip()).MECHANISM for m in (*MECHANISMS, *extra))
    names = [m.name for m in found]
    if len(set(names)) != len(names):
        raise PluginError(f"sglang-morph: error: two mechanisms share a name: {names}")
    return found


def enabled_mechanisms(server_args: Any) -> tuple[Mechanism, ...]:
    return tuple(m for m in mechanisms() if m.enabled(server_args))


def add_cli_args(parser: Any) -> None:
    """Every flag the plugin adds: the elastic core's, then each mechanism's."""
    registry.add_cli_args(parser)
    for mechanism in mechanisms():
        mechanism.add_cli_args(parser)


def add_routes(app: Any) -> None:
    """Every route the plugin can add (the reference docs read them here)."""
    from sglang_morph.elastic.status import add_routes as add_elastic_routes

    add_elastic_routes(app)
    for mechanism in mechanisms():
        mechanism.add_routes(app)


def configure(mechanism: Mechanism, server_args: Any, args: Any,
              enabled_before: frozenset[str]) -> bool:
    """One mechanism's launcher-side configuration; its ConfigError becomes one line."""
    try:
        return mechanism.configure(server_args, args, enabled_before)
    except ConfigError as e:
        raise PluginError(f"sglang-morph: error: {e}") from e


def _after_add_cli_args(_result: None, parser: Any) -> None:
    add_cli_args(parser)


def _after_from_cli_args(server_args: Any, _cls: Any, args: Any) -> None:
    elastic = registry.ElasticConfig.from_cli_namespace(args)
    registry.attach_config(server_args, elastic)
    enabled: list[Mechanism] = []
    for mechanism in mechanisms():
        if configure(mechanism, server_args, args, frozenset(m.name for m in enabled)):
            enabled.append(mechanism)
    # A token id outside the vocabulary would kill a scheduler, and with it the server.
    sym.register_and_verify((Hook(sym.HOOK_VALIDATE_REQUEST,
                                  guard.before_validate_one_request, "BEFORE"),))
    if enabled or elastic.metrics_auth:
        from sglang.srt.entrypoints.http_server import app

        keys = (server_args.api_key, server_args.admin_api_key) if elastic.metrics_auth else ()
        guard.install_http_guard(app, tuple(f"/{m.name}/" for m in mechanisms()), keys)
    if not enabled:
        return
    missing = sym.missing_symbols(
        sym.CORE_SYMBOLS + tuple(s for m in enabled for s in m.symbols()))
    if missing:
        raise PluginError(sym.mismatch_message(missing))
    if any(m.transitions_between_batches for m in enabled):
        _prepare_for_transitions(server_args)
    from sglang.srt.entrypoints.http_server import app

    from sglang_morph.elastic.status import add_routes as add_elastic_routes

    add_elastic_routes(app)
    sym.register_and_verify((Hook(sym.HOOK_TOKENIZER_MANAGER_INIT,
                                  _after_tokenizer_manager_init, "AFTER"),))
    for mechanism in enabled:
        mechanism.launcher_setup(server_args)


def _prepare_for_transitions(server_args: Any) -> None:
    """Transitions rewrite weights and KV slot indices between two batches; with overlap
    scheduling a launched batch's results would still hold the old ones, and graphs would
    replay the old tensors."""
    server_args.disable_overlap_schedule = True
    _turn_off_graphs(server_args)


def _turn_off_graphs(server_args: Any) -> None:
    """CUDA graphs and torch.compile keep the weight and KV addresses they captured, which a
    transition replaces: they would replay stale tensors. Off until graphs are re-captured per
    transition (the GPU path's VmmKVArena keeps KV addresses stable, not the weights')."""
    on = []
    if str(getattr(server_args, "device", None)) != "cpu" and not server_args.disable_cuda_graph:
        on.append("CUDA graphs")
    if server_args.enable_torch_compile:
        on.append("torch.compile")
    server_args.disable_cuda_graph = True
    server_args.disable_decode_cuda_graph = True
    server_args.disable_prefill_cuda_graph = True
    server_args.cuda_graph_backend_decode = "disabled"
    server_args.cuda_graph_backend_prefill = "disabled"
    server_args.cuda_graph_config = None  # a --cuda-graph-config JSON would override the above
    server_args.enable_torch_compile = False
    if on:
        logger.warning("sglang-morph: %s turned off with a live mechanism enabled (its "
                       "transitions replace tensors a captured graph would keep reading)",
                       " and ".join(on))


def _after_tokenizer_manager_init(_result: None, tokenizer_manager: Any, *args: Any,
                                  **kwargs: Any) -> None:
    from sglang_morph.elastic.control import attach_to_tokenizer_manager

    attach_to_tokenizer_manager(tokenizer_manager)


def _after_scheduler_init(_result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    enabled = enabled_mechanisms(scheduler.server_args)
    if not enabled:
        return
    from sglang_morph.elastic.status import host

    elastic = host(scheduler)
    for mechanism in enabled:
        step, state = mechanism.attach(scheduler)
        elastic.add(mechanism.name, step, state)


def _before_get_next_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    elastic = scheduler.__dict__.get("elastic")
    if elastic is not None:
        elastic.on_step()


CORE_HOOKS: tuple[Hook, ...] = (
    Hook(sym.HOOK_ADD_CLI_ARGS, _after_add_cli_args, "AFTER"),
    Hook(sym.HOOK_FROM_CLI_ARGS, _after_from_cli_args, "AFTER"),
    Hook(sym.HOOK_SCHEDULER_INIT, _after_scheduler_init, "AFTER", only_if_imported=IN_SCHEDULER),
    # Between two forward passes: every enabled mechanism's per-step entry.
    Hook(sym.HOOK_NEXT_BATCH, _before_get_next_batch, "BEFORE", only_if_imported=IN_SCHEDULER),
)


def hooks() -> tuple[Hook, ...]:
    """Every hook this process registers: the core's, multi-rank CPU support, each
    mechanism's."""
    from sglang_morph.parallel.hooks import HOOKS as PARALLEL_HOOKS

    return CORE_HOOKS + PARALLEL_HOOKS + tuple(h for m in mechanisms() for h in m.hooks())


def load() -> None:
    """Entry point called by ``sglang.srt.plugins.load_plugins()``."""
    # Registers the control IPC message types with SGLang's msgpack decoder in this process
    # (each mechanism's module imports its own).
    from sglang_morph.elastic import control, status

    del control, status
    applied = sym.register_and_verify(hooks())
    logger.debug("sglang-morph hooks applied: %s", applied)
