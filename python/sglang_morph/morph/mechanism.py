"""MorphServe's registration with the plugin: its flags, launch checks, hooks, scheduler side
and routes (``MECHANISM``). Everything here runs only with ``--enable-morph``, except the hooks,
which return at once on a server without it."""

from __future__ import annotations

import logging
from typing import Any

from sglang_morph import surface as sym
from sglang_morph.elastic.registry import Mechanism
from sglang_morph.morph import config as morph_config
from sglang_morph.morph import messages  # noqa: F401  (registers the /morph IPC types)
from sglang_morph.surface import IN_SCHEDULER, Hook, PluginError

logger = logging.getLogger("sglang_morph")


def configure(server_args: Any, args: Any, enabled_before: frozenset[str]) -> bool:
    """In the launcher: parse, check and attach the morph config; size the KV pool for the
    budget. Raises MorphConfigError (one line) having attached nothing. Without
    ``--morph-engines`` the variants are built (or found in the cache) at launch, not here:
    parsing stays cheap (``_before_launch_subprocesses``)."""
    from sglang_morph.morph.startup import local_hf_config, plan_startup

    cfg = morph_config.MorphConfig.from_cli_namespace(args)
    if cfg.enabled:
        from sglang_morph.morph.parallel.pipeline import check_launch

        check_supported(server_args)
        check_launch(server_args, cfg)
    hf_config = local_hf_config(server_args.model_path)
    plan = None
    if hf_config is not None:
        # Fail here, before any process is spawned (checksums too: the scheduler reads
        # every variant at startup and would stop with a traceback).
        plan = plan_startup(cfg, hf_config, verify_checksums=True)
        if cfg.precision_map is not None and cfg.engines_dir is None:
            cfg.precision_map.resolve(hf_config["num_hidden_layers"])  # before a build
    if cfg.enabled:
        from sglang_morph.morph.parallel import tensor

        tensor.check_launch(server_args, cfg, hf_config,
                            plan.manifest if plan is not None else None)
    if cfg.memory_budget_bytes is not None or cfg.stage_budget_bytes is not None:
        _size_kv_for_budget(server_args, cfg, hf_config)
    morph_config.attach(server_args, cfg)
    return cfg.enabled


# Flags of parallel layouts the runtime does not morph yet. Pipeline parallelism is supported
# (sglang_morph.morph.parallel.pipeline: each stage morphs its own layers), also with its stages on
# several nodes (--nnodes); so are data parallelism (morph/parallel/__init__.py: each replica morphs
# on its own) and tensor parallelism (parallel/tensor.py: each rank swaps its shards at the same
# step), one at a time and on one node (checked in check_supported).
_PARALLEL_FLAGS = ("attn_dp_size", "attn_cp_size", "dcp_size")
# KV caches the resizer cannot grow or shrink (it supports the device radix cache only).
_KV_CACHE_FLAGS = ("enable_hierarchical_cache", "enable_lmcache", "enable_hisparse",
                   "enable_flexkv", "enable_unified_cache_external_linker",
                   "enable_session_radix_cache", "disable_radix_cache")
# KV dtypes stored unquantized (the resizer copies rows as they are).
_PLAIN_KV_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "float")


def check_supported(server_args: Any) -> None:
    """Raise MorphConfigError (one line, naming the flag) for a configuration the morph runtime
    does not support; called in the launcher, before anything is spawned."""
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    for name in _PARALLEL_FLAGS:
        value = getattr(server_args, name, 1)
        if value is not None and value > 1:
            raise morph_config.MorphConfigError(
                f"--enable-morph does not support {flag(name)} {value} yet: layer swaps and KV "
                f"resizing run per tensor-parallel rank, pipeline stage or data-parallel "
                f"replica on one node (--tp-size N, --pp-size N or --dp-size N is supported)")
    # One parallel layout at a time: each is tested alone, and two at once would need both
    # routings of /morph (e.g. replicas of pipelines).
    layouts = [name for name in ("tp_size", "pp_size", "dp_size")
               if (getattr(server_args, name, 1) or 1) > 1]
    if len(layouts) > 1:
        raise morph_config.MorphConfigError(
            f"--enable-morph does not support {flag(layouts[0])} and {flag(layouts[1])} "
            f"together yet: use one")
    nnodes = getattr(server_args, "nnodes", 1) or 1
    if nnodes > 1 and (layouts != ["pp_size"] or nnodes > server_args.pp_size):
        # Tested: whole pipeline stages on each node. Not tested: TP ranks or DP replicas
        # across nodes.
        raise morph_config.MorphConfigError(
            f"--enable-morph with --nnodes {nnodes} supports pipeline stages across nodes only "
            f"(--pp-size N, whole stages per node); tensor-parallel ranks or data-parallel "
            f"replicas across nodes are not supported yet")
    for name in _KV_CACHE_FLAGS:
        if getattr(server_args, name, False):
            raise morph_config.MorphConfigError(
                f"--enable-morph does not support {flag(name)}: KV resizing works on SGLang's "
                f"device radix cache only")
    if getattr(server_args, "speculative_algorithm", None) is not None:
        raise morph_config.MorphConfigError(
            "--enable-morph does not support --speculative-algorithm: a draft model's KV pool "
            "shares the slot indices a KV shrink rewrites")
    if str(getattr(server_args, "disaggregation_mode", "null")) != "null":
        raise morph_config.MorphConfigError(
            "--enable-morph does not support --disaggregation-mode (prefill/decode "
            "disaggregation)")
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto"))
    if kv_dtype not in _PLAIN_KV_DTYPES:
        raise morph_config.MorphConfigError(
            f"--enable-morph does not support --kv-cache-dtype {kv_dtype}: KV resizing needs an "
            f"unquantized KV cache ({', '.join(_PLAIN_KV_DTYPES)})")


def _size_kv_for_budget(server_args: Any, cfg: morph_config.MorphConfig, hf_config: Any) -> None:
    from pathlib import Path

    from sglang_morph.morph.startup import size_kv_for_budget

    if server_args.max_total_tokens is not None:
        raise morph_config.MorphConfigError(
            "--morph-memory-budget sizes the KV pool itself; drop --max-total-tokens")
    if hf_config is None:
        raise morph_config.MorphConfigError(
            "--morph-memory-budget needs a local model directory (--model-path PATH)")
    if (server_args.pp_size or 1) > 1 or (server_args.tp_size or 1) > 1:
        from sglang_morph.morph.parallel import pipeline, tensor

        sizing = pipeline if (server_args.pp_size or 1) > 1 else tensor
        server_args.max_total_tokens = sizing.initial_kv_tokens(cfg, hf_config, server_args)
        return
    sizing = size_kv_for_budget(cfg.memory_budget_bytes, Path(server_args.model_path).expanduser(),
                                hf_config, server_args.dtype, server_args.kv_cache_dtype)
    server_args.max_total_tokens = sizing.kv_capacity_tokens
    logger.info("sglang-morph: memory budget %d bytes = weights %d + KV %d tokens x %d bytes",
                sizing.budget_bytes, sizing.weight_bytes, sizing.kv_capacity_tokens,
                sizing.kv_bytes_per_token)


def launcher_setup(server_args: Any) -> None:
    """The /morph routes and precision provenance on the HTTP side; without
    ``--morph-engines``, the build (or reuse) of the cache's variants at launch."""
    from sglang.srt.entrypoints.http_server import app

    from sglang_morph.morph.provenance import http_hooks

    add_routes(app)
    hooks = [Hook(target, fn, kind) for target, fn, kind in http_hooks()]
    if morph_config.get(server_args).engines_dir is None:
        hooks.append(Hook(sym.HOOK_LAUNCH_SUBPROCESSES, _before_launch_subprocesses, "BEFORE"))
    sym.register_and_verify(tuple(hooks))


def _before_launch_subprocesses(*args: Any, **kwargs: Any) -> None:
    """In the launcher (``launch_server`` or ``sglang.Engine``), before SGLang spawns any
    scheduler: the cache's variants and layer order for a config without ``--morph-engines``,
    built once for every rank. Raises PluginError (one line)."""
    server_args = kwargs["server_args"] if "server_args" in kwargs else args[1]
    cfg = morph_config.get(server_args)
    if not cfg.enabled or cfg.engines_dir is not None:
        return
    try:
        cfg = with_cached_variants(server_args, cfg)
    except morph_config.MorphConfigError as e:
        raise PluginError(f"sglang-morph: error: {e}") from e
    morph_config.attach(server_args, cfg)


def with_cached_variants(server_args: Any, cfg: morph_config.MorphConfig
                         ) -> morph_config.MorphConfig:
    """``cfg`` with the cache's variants and layer order of the served model (built now on
    first use), checked as ``--morph-engines`` would be. Raises MorphConfigError."""
    import dataclasses
    from pathlib import Path

    from sglang_morph.morph import auto_build
    from sglang_morph.morph.parallel import tensor
    from sglang_morph.morph.startup import local_hf_config, plan_startup

    hf_config = local_hf_config(server_args.model_path)
    if hf_config is None:
        raise morph_config.MorphConfigError(
            f"--enable-morph without --morph-engines builds the variants from a local model "
            f"directory, and {server_args.model_path} is not one (no config.json); give "
            f"prebuilt variants with --morph-engines DIR")
    variants = auto_build.ensure_variants(Path(server_args.model_path))
    cfg = dataclasses.replace(cfg, engines_dir=str(variants.engines_dir),
                              swap_order_path=cfg.swap_order_path or str(variants.swap_order_path))
    plan = plan_startup(cfg, hf_config, verify_checksums=True)
    tensor.check_launch(server_args, cfg, hf_config, plan.manifest)
    logger.info("sglang-morph: variants and layer order %s %s", "built into" if variants.built
                else "reused from", variants.entry_dir)
    return cfg


def add_routes(app: Any) -> None:
    from sglang_morph.morph.http import add_routes as add

    add(app)


def attach(scheduler: Any):
    """After ``Scheduler.__init__``: this scheduler's ``MorphRuntime`` and its control
    requests."""
    from sglang.utils import TypeBasedDispatcher

    from sglang_morph.morph.executor.runtime import MorphRuntime
    from sglang_morph.morph.messages import MORPH_REQUESTS, MorphActionReq
    from sglang_morph.morph.parallel.pipeline import stage_config

    cfg = morph_config.get(scheduler.server_args)
    model_config = scheduler.model_config
    try:
        runtime = MorphRuntime(scheduler, stage_config(cfg, scheduler))
    except NotImplementedError as e:  # a KV pool or cache the resizer does not support
        raise PluginError(f"sglang-morph: error: --enable-morph does not support this "
                          f"configuration: {e}") from e
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(req_type, runtime.handle_control) for req_type in MORPH_REQUESTS]
        + [(MorphActionReq, runtime.handle_action)])  # the leader's controller, to every rank
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
    return runtime.on_step, runtime.elastic_state


def _after_load_model(_result: None, runner: Any) -> None:
    cfg = morph_config.get(runner.server_args)
    if not cfg.enabled or cfg.engines_dir is None or runner.is_draft_worker:
        return
    from sglang_morph.config import FULL_PRECISION_BITS
    from sglang_morph.morph.startup import plan_startup
    from sglang_morph.engines.variants import LayerVariantInstaller, StagedVariants, held_layers
    from sglang_morph.morph.parallel.tensor import sharder

    try:
        plan = plan_startup(cfg, runner.model_config.hf_config.to_dict())
        # Every variant into host memory now (pinned on CUDA, so copies can be asynchronous):
        # a transition never reads the engines directory while serving.
        # A pipeline stage holds (and stages the variants of) start_layer..end_layer-1 only.
        owned = held_layers(runner.model)
        staged = StagedVariants(plan.manifest, plan.engines_dir,
                                pin_memory=str(runner.device).startswith("cuda"), layers=owned,
                                shard=sharder(runner.model))  # a TP rank keeps its shards
    except (morph_config.MorphConfigError, OSError, ValueError) as e:
        raise PluginError(f"sglang-morph: error: --morph-engines: {e}") from e
    installer = LayerVariantInstaller(runner.model, staged, act_dtype=runner.model_config.dtype)
    bytes_before = sum(installer.layer_device_bytes(i) for i in owned)
    for bits in sorted(set(plan.layer_bits) - {FULL_PRECISION_BITS}):
        installer.set_layers([i for i in owned if plan.layer_bits[i] == bits], bits)
    installer.check_integrity()
    warmed = installer.warmup(max_tokens=WARMUP_MAX_TOKENS)
    bytes_after = sum(installer.layer_device_bytes(i) for i in owned)
    # The executors of later stages (swapping, KV resizing) find the installer here.
    runner.morph_installer = installer
    logger.info(
        "sglang-morph: layer precision %s (layers %d-%d here); decoder linears %d -> %d bytes; "
        "%d kernels warmed", ",".join(str(b) for b in plan.layer_bits), owned.start,
        owned.stop - 1, bytes_before, bytes_after, warmed,
    )


def _after_poll_timeout_aborts(result: list, scheduler: Any) -> list:
    """TP rank 0 / pipeline stage 0 (the only callers): its controller's action joins the
    inputs that SGLang hands every rank this step (parallel/relay.py)."""
    runtime = getattr(scheduler, "morph_runtime", None)
    relay = getattr(runtime, "relay", None)
    return result + relay.outgoing() if relay is not None else result


def _after_get_output_streamer_class(result: type, scheduler: Any) -> type | None:
    from sglang_morph.morph.provenance import after_get_output_streamer_class

    return after_get_output_streamer_class(result, scheduler)


def _after_retract_decode(result: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_morph.morph.executor.runtime import count_retractions

    count_retractions(result)


# Kernels are run at up to this many tokens at startup: enough for decode and short prefills.
WARMUP_MAX_TOKENS = 256


def hooks() -> tuple[Hook, ...]:
    return (
        Hook(sym.HOOK_LOAD_MODEL, _after_load_model, "AFTER", only_if_imported=IN_SCHEDULER),
        Hook(sym.HOOK_RETRACT_DECODE, _after_retract_decode, "AFTER",
             only_if_imported=IN_SCHEDULER),
        # Under TP and PP: the leader's controller actions ride SGLang's inputs to every rank.
        Hook(sym.HOOK_RANK0_LOCAL_INPUTS, _after_poll_timeout_aborts, "AFTER",
             only_if_imported=IN_SCHEDULER),
        # Precision provenance: the output streamer reports what precisions produced each
        # response.
        Hook(sym.HOOK_OUTPUT_STREAMER_CLASS, _after_get_output_streamer_class, "AFTER",
             only_if_imported=IN_SCHEDULER),
    )


def symbols() -> tuple[sym.Symbol, ...]:
    return sym.MORPH_SYMBOLS


MECHANISM = Mechanism(
    name="morph",
    flag="--enable-morph",
    add_cli_args=morph_config.add_cli_args,
    configure=configure,
    enabled=lambda server_args: morph_config.get(server_args).enabled,
    hooks=hooks,
    symbols=symbols,
    launcher_setup=launcher_setup,
    attach=attach,
    add_routes=add_routes,
)
