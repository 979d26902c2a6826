"""SGLang plugin entry point (entry-point group ``sglang.srt.plugins``, name ``morph``).

SGLang calls ``load()`` in every process it starts (launcher, scheduler, detokenizer, DP
controller). We register hooks, apply them at once and verify that each one took: SGLang's
``HookRegistry`` only logs a hook it could not apply, which would leave a half-patched server
that silently ignores ``--enable-morph``. A hook that did not apply ends the process with a
message naming the SGLang release the plugin was written for.

Without ``--enable-morph`` the hooks only add our CLI flags and carry a disabled ``MorphConfig``;
SGLang's behaviour is unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import sys
from typing import Any, Callable

from sglang_morph import SGLANG_VERSION
from sglang_morph import config as morph_config

logger = logging.getLogger("sglang_morph")


class MorphPluginError(SystemExit):
    """Fatal plugin setup error. A SystemExit, because SGLang's plugin loader catches and only

    logs ``Exception``: startup must stop here instead of serving without the plugin.
    """


@dataclasses.dataclass(frozen=True)
class Hook:
    target: str
    fn: Callable[..., Any]
    kind: str  # a HookType member name: BEFORE, AFTER, AROUND or REPLACE
    # Only hook the target in processes that already imported this module (the scheduler
    # process imports the scheduler before calling load_plugins): importing the model runner
    # into the launcher or the detokenizer would cost seconds and memory for nothing.
    # None means "always" (the CLI hooks run in the launcher before anything else is imported).
    only_if_imported: str | None = None


_IN_SCHEDULER = "sglang.srt.managers.scheduler"


def _after_add_cli_args(_result: None, parser: Any) -> None:
    morph_config.add_cli_args(parser)


def _after_from_cli_args(server_args: Any, _cls: Any, args: Any) -> None:
    from sglang_morph.engines.startup import local_hf_config, plan_startup

    try:
        cfg = morph_config.MorphConfig.from_cli_namespace(args)
        hf_config = local_hf_config(server_args.model_path)
        if hf_config is not None:
            plan_startup(cfg, hf_config)  # fail here, before any process is spawned
        if cfg.memory_budget_bytes is not None:
            _size_kv_for_budget(server_args, cfg, hf_config)
    except morph_config.MorphConfigError as e:
        raise MorphPluginError(f"sglang-morph: error: {e}") from e
    morph_config.attach(server_args, cfg)
    if cfg.enabled:
        # Transitions rewrite weights and KV slot indices between two batches; with overlap
        # scheduling a launched batch's results would still hold the old ones.
        server_args.disable_overlap_schedule = True
        _install_http_side()


def _size_kv_for_budget(server_args: Any, cfg: morph_config.MorphConfig, hf_config: Any) -> None:
    from pathlib import Path

    from sglang_morph.engines.startup import size_kv_for_budget

    if server_args.max_total_tokens is not None:
        raise morph_config.MorphConfigError(
            "--morph-memory-budget sizes the KV pool itself; drop --max-total-tokens")
    if hf_config is None:
        raise morph_config.MorphConfigError(
            "--morph-memory-budget needs a local model directory (--model-path PATH)")
    sizing = size_kv_for_budget(cfg.memory_budget_bytes, Path(server_args.model_path).expanduser(),
                                hf_config, server_args.dtype, server_args.kv_cache_dtype)
    server_args.max_total_tokens = sizing.kv_capacity_tokens
    logger.info("sglang-morph: memory budget %d bytes = weights %d + KV %d tokens x %d bytes",
                sizing.budget_bytes, sizing.weight_bytes, sizing.kv_capacity_tokens,
                sizing.kv_bytes_per_token)


def _install_http_side() -> None:
    """In the launcher (the HTTP process): the /morph routes and the TokenizerManager's side of
    their IPC. Only with --enable-morph, so a server without it has no /morph routes."""
    from sglang.srt.entrypoints.http_server import app

    from sglang_morph.server.http import add_routes

    add_routes(app)
    register_and_verify((Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__",
        _after_tokenizer_manager_init, "AFTER"),))


def _after_tokenizer_manager_init(_result: None, tokenizer_manager: Any, *args: Any,
                                  **kwargs: Any) -> None:
    from sglang_morph.server.http import attach_to_tokenizer_manager

    attach_to_tokenizer_manager(tokenizer_manager)


def _after_load_model(_result: None, runner: Any) -> None:
    cfg = morph_config.get(runner.server_args)
    if not cfg.enabled or cfg.engines_dir is None or runner.is_draft_worker:
        return
    from sglang_morph.engines.startup import plan_startup
    from sglang_morph.executor.variants import LayerVariantInstaller

    try:
        plan = plan_startup(cfg, runner.model_config.hf_config.to_dict())
    except morph_config.MorphConfigError as e:
        raise MorphPluginError(f"sglang-morph: error: {e}") from e
    installer = LayerVariantInstaller(runner.model, plan.manifest, plan.engines_dir,
                                      act_dtype=runner.model_config.dtype)
    bytes_before = sum(installer.layer_device_bytes(i) for i in range(len(plan.layer_bits)))
    for i, bits in enumerate(plan.layer_bits):
        installer.set_layer_bits(i, bits)
    installer.check_integrity()
    warmed = installer.warmup(max_tokens=WARMUP_MAX_TOKENS)
    bytes_after = sum(installer.layer_device_bytes(i) for i in range(len(plan.layer_bits)))
    # The executors of later stages (swapping, KV resizing) find the installer here.
    runner.morph_installer = installer
    logger.info(
        "sglang-morph: layer precision %s; decoder linears %d -> %d bytes; %d kernels warmed",
        ",".join(str(b) for b in plan.layer_bits), bytes_before, bytes_after, warmed,
    )


def _after_scheduler_init(_result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    cfg = morph_config.get(scheduler.server_args)
    if not cfg.enabled:
        return
    from sglang.utils import TypeBasedDispatcher

    from sglang_morph.executor.runtime import MorphRuntime
    from sglang_morph.server.messages import MorphControlReq

    model_config = scheduler.model_config
    runtime = MorphRuntime(scheduler, cfg)
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(MorphControlReq, runtime.handle_control)])
    scheduler.morph_runtime = runtime
    logger.info(
        "sglang-morph enabled in scheduler: %s, %d decoder layers, kv_capacity_tokens=%d, "
        "memory budget %d bytes, mode %s, controller %s",
        model_config.hf_config.architectures[0],
        model_config.num_hidden_layers,
        scheduler.max_total_num_tokens,
        runtime.budget.total_bytes,
        runtime.mode,
        "on" if runtime.controller is not None else "off",
    )


def _before_get_next_batch(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    runtime = getattr(scheduler, "morph_runtime", None)
    if runtime is not None:
        runtime.on_step()


def _after_retract_decode(result: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_morph.executor.runtime import count_retractions

    count_retractions(result)


# Kernels are run at up to this many tokens at startup: enough for decode and short prefills.
WARMUP_MAX_TOKENS = 256

HOOKS: tuple[Hook, ...] = (
    Hook("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, "AFTER"),
    Hook("sglang.srt.server_args.ServerArgs.from_cli_args", _after_from_cli_args, "AFTER"),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        _after_scheduler_init,
        "AFTER",
        only_if_imported=_IN_SCHEDULER,
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        _after_load_model,
        "AFTER",
        only_if_imported=_IN_SCHEDULER,
    ),
    # Between two forward passes: the morph runtime samples pressure and applies its actions.
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        _before_get_next_batch,
        "BEFORE",
        only_if_imported=_IN_SCHEDULER,
    ),
    Hook(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
        _after_retract_decode,
        "AFTER",
        only_if_imported=_IN_SCHEDULER,
    ),
)


def _installed_sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def register_and_verify(hooks: tuple[Hook, ...]) -> list[str]:
    """Register ``hooks`` with SGLang's HookRegistry, apply them and check each one took.

    Returns the targets that were applied in this process; raises MorphPluginError otherwise.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    wanted = [h for h in hooks if h.only_if_imported is None or h.only_if_imported in sys.modules]
    for hook in wanted:
        HookRegistry.register(hook.target, hook.fn, HookType[hook.kind])
    # apply_hooks() is idempotent: targets already patched are skipped, so SGLang's own call
    # right after the plugins ran changes nothing.
    HookRegistry.apply_hooks()
    missing = [h.target for h in wanted if h.target not in HookRegistry._patched]
    if missing:
        raise MorphPluginError(
            f"sglang-morph: could not hook {', '.join(missing)}. sglang-morph is written for "
            f"sglang=={SGLANG_VERSION} and found sglang {_installed_sglang_version()}. "
            f"Install sglang=={SGLANG_VERSION}, or exclude this plugin with "
            f"SGLANG_PLUGINS=<other plugins>."
        )
    return [h.target for h in wanted]


def load() -> None:
    """Entry point called by ``sglang.srt.plugins.load_plugins()``."""
    # Registers the /morph IPC message types with SGLang's msgpack decoder in this process.
    from sglang_morph.server import messages

    del messages

    applied = register_and_verify(HOOKS)
    logger.debug("sglang-morph hooks applied: %s", applied)
