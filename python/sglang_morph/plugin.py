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
them); otherwise SGLang's behaviour is unchanged. ``sglang.Engine(...)`` takes the same flags as
keyword arguments, parsed and configured the same way (the section on ``sglang.Engine`` below).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import logging
import multiprocessing
import os
import sys
from typing import Any, NoReturn

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
    "sglang_morph.iserve.live",
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
    configure_server_args(server_args, args)


def configure_server_args(server_args: Any, args: Any) -> None:
    """The launcher's configuration of a not yet resolved ``server_args`` from the plugin's
    parsed options ``args`` (the command line's, or ``sglang.Engine``'s keyword arguments)."""
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


# ----- sglang.Engine(**kwargs): the plugin's options as keyword arguments -----------------------
# ``sglang.Engine(model_path=..., enable_morph=True, morph_mode="performance")`` takes every flag
# the plugin adds to the command line under its argparse name. SGLang builds the Engine's
# ServerArgs with ``self.server_args_class(**kwargs)``, a record that refuses unknown fields; the
# Engine gets an instance attribute of that name (``_EngineServerArgs``) which takes the
# plugin's options out, builds SGLang's record from the rest and configures it as the command
# line would. Patching the class attribute instead would go through HookRegistry's REPLACE,
# which also rebinds ``ServerArgs`` in every module that imported it.


class _OptionParser(argparse.ArgumentParser):
    """The plugin's flags alone; an error raises (a Python caller gets an exception, not an
    exit)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


@functools.lru_cache(maxsize=None)
def _option_parser() -> _OptionParser:
    parser = _OptionParser(prog="sglang.Engine", add_help=False, allow_abbrev=False)
    add_cli_args(parser)
    return parser


def engine_option_names() -> frozenset[str]:
    """The keyword arguments ``sglang.Engine`` takes for the plugin (argparse names)."""
    return frozenset(a.dest for a in _option_parser()._actions)


def parse_engine_options(options: dict[str, Any]) -> argparse.Namespace:
    """``options`` (keyword name -> value) parsed as the command line would parse the flags:
    the same types and choices, unset options at the flags' defaults. A switch takes True or
    False; a list or tuple stands for a comma-separated value, a dict for a JSON object.
    Raises ConfigError naming the flag."""
    parser = _option_parser()
    actions = {a.dest: a for a in parser._actions}
    argv: list[str] = []
    for name, value in options.items():
        action = actions[name]
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} ({name}=...): expected True or False, got {value!r}")
            if value:
                argv.append(flag)
        elif value is not None:
            if isinstance(value, dict):
                text = json.dumps(value)
            elif isinstance(value, (list, tuple)):
                text = ",".join(str(v) for v in value)
            else:
                text = str(value)
            argv += [flag, text]
    return parser.parse_args(argv)


class _EngineServerArgs:
    """Stands in for ``Engine.server_args_class`` on one Engine."""

    def __call__(self, **kwargs: Any) -> Any:
        from sglang.srt.server_args import ServerArgs

        names = engine_option_names()
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        args = parse_engine_options(options)
        server_args = ServerArgs(**kwargs)
        try:
            configure_server_args(server_args, args)
        except PluginError as e:
            if isinstance(e.__cause__, ConfigError):  # bad input: a ValueError for Python
                raise ConfigError(str(e)) from e.__cause__
            raise
        return server_args


def _before_engine_init(engine: Any, *args: Any, **kwargs: Any) -> None:
    engine.server_args_class = _EngineServerArgs()


def _engine_hooks() -> tuple[Hook, ...]:
    """Where a program may build an ``sglang.Engine``: its main process (the module may not be
    imported yet when plugins load there), or a process that imported the Engine already."""
    if multiprocessing.parent_process() is not None and sym.ENGINE_MODULE not in sys.modules:
        return ()
    return (Hook(sym.HOOK_ENGINE_INIT, _before_engine_init, "BEFORE"),)


def _adopt_engine_under_construction() -> None:
    """When this load runs inside ``Engine.__init__`` (the first Engine of a program loads the
    plugins itself, after its BEFORE hooks would have run), that Engine gets its options taken
    the same way."""
    engine_module = sys.modules.get(sym.ENGINE_MODULE)
    if engine_module is None:
        return
    code = inspect.unwrap(engine_module.Engine.__init__).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            _before_engine_init(frame.f_locals["self"])
            return
        frame = frame.f_back


def hooks() -> tuple[Hook, ...]:
    """Every hook this process registers: the core's, ``sglang.Engine``'s options where a
    program may build an Engine, multi-rank CPU support, each mechanism's."""
    from sglang_morph.parallel.hooks import HOOKS as PARALLEL_HOOKS

    return (CORE_HOOKS + _engine_hooks() + PARALLEL_HOOKS
            + tuple(h for m in mechanisms() for h in m.hooks()))


def load() -> None:
    """Entry point called by ``sglang.srt.plugins.load_plugins()``."""
    # Registers the control IPC message types with SGLang's msgpack decoder in this process
    # (each mechanism's module imports its own).
    from sglang_morph.elastic import control, status

    del control, status
    applied = sym.register_and_verify(hooks())
    # The first sglang.Engine of a program loads the plugins from its own __init__, past
    # the hook that takes our options for later Engines.
    _adopt_engine_under_construction()
    logger.debug("sglang-morph hooks applied: %s", applied)
