"""Every SGLang symbol sglang-morph hooks, patches, calls or reads outside SGLang's public API,
and the one way the plugin hooks SGLang (``Hook``, ``register_and_verify``).

SGLang has no stable internal API: a release may rename any of these. The plugin is written
for one release (``sglang_morph.SGLANG_VERSION``), and ``check_symbols`` verifies at startup
that each symbol below exists, so a server on another release stops with one line naming the
missing symbols and the release to install, instead of failing mid-transition.

A symbol is a dotted path: a module, then attributes. ``instance=True`` marks an attribute SGLang
sets on instances (``self.x = ...``), which no import can show: it is checked by reading the
class (its dataclass / msgspec fields, its class attributes, and the ``self.x =`` assignments
in the source of every class of its MRO). Runtime classes that differ per launch (the tree
core is Rust or Python) are listed by the interface they implement.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import sys
from typing import Any, Callable

from sglang_morph import SGLANG_VERSION


class PluginError(SystemExit):
    """Fatal plugin setup error. A SystemExit, because SGLang's plugin loader catches and only
    logs ``Exception``: startup must stop here instead of serving without the plugin."""


# Scheduler processes import the scheduler module before SGLang loads plugins; the launcher,
# tokenizer and detokenizer never do.
IN_SCHEDULER = "sglang.srt.managers.scheduler"
DP_CONTROLLER_MODULE = "sglang.srt.managers.data_parallel_controller"
# A mechanism that holds requests in the data-parallel controller sets this attribute on it: a
# callable that places what waits and returns the milliseconds until the controller's loop
# should call it again (None: at the next request). The CPU loop (parallel/cpu.py) calls it.
DP_CONTROLLER_TICK_ATTR = "sglang_morph_tick"


@dataclasses.dataclass(frozen=True)
class Hook:
    """One patch of an SGLang attribute through SGLang's ``HookRegistry``."""

    target: str
    fn: Callable[..., Any]
    kind: str  # a HookType member name: BEFORE, AFTER, AROUND or REPLACE
    # Only hook the target in processes that already imported this module (the scheduler
    # process imports the scheduler before calling load_plugins): importing the model runner
    # into the launcher or the detokenizer would cost seconds and memory for nothing.
    # None means "always" (the CLI hooks run in the launcher before anything else is imported).
    only_if_imported: str | None = None


def register_and_verify(hooks: tuple[Hook, ...]) -> list[str]:
    """Register ``hooks`` with SGLang's HookRegistry, apply them and check each one took.

    SGLang's registry only logs a hook it could not apply, which would leave a half-patched
    server; this returns the targets applied in this process, or raises PluginError.
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
        raise PluginError(mismatch_message(missing, "hook"))
    return [h.target for h in wanted]


@dataclasses.dataclass(frozen=True)
class Symbol:
    path: str
    use: str  # "hook", "call", "read" or "write": what the plugin does with it
    instance: bool = False


def _group(owner: str, use: str, names: str, instance: bool = True) -> tuple[Symbol, ...]:
    return tuple(Symbol(f"{owner}.{name}", use, instance) for name in names.split())


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_BATCH = "sglang.srt.managers.schedule_batch"
_MEM = "sglang.srt.mem_cache"
_COMPONENTS = "sglang.srt.managers.scheduler_components"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

# Hook targets (plugin.HOOKS and the HTTP side's hook name these constants).
HOOK_ADD_CLI_ARGS = f"{_SERVER_ARGS}.add_cli_args"
HOOK_FROM_CLI_ARGS = f"{_SERVER_ARGS}.from_cli_args"
HOOK_SCHEDULER_INIT = f"{_SCHEDULER}.__init__"
HOOK_LOAD_MODEL = f"{_RUNNER}.load_model"
HOOK_NEXT_BATCH = f"{_SCHEDULER}.get_next_batch_to_run"
HOOK_SCHEDULER_GENERATE = f"{_SCHEDULER}.handle_generate_request"
HOOK_RETRACT_DECODE = f"{_BATCH}.ScheduleBatch.retract_decode"
HOOK_TOKENIZER_MANAGER_INIT = f"{_TOKENIZER_MANAGER}.__init__"
ENGINE_MODULE = "sglang.srt.entrypoints.engine"
# sglang.Engine(**kwargs) builds its ServerArgs with self.server_args_class(**kwargs): before
# __init__, the plugin gives the Engine its own, which takes the plugin's options (plugin.py).
HOOK_ENGINE_INIT = f"{ENGINE_MODULE}.Engine.__init__"
# Both launchers (launch_server and sglang.Engine) spawn the schedulers here: the last point
# before any rank starts (morph/auto_build.py builds the variants there, once for every rank).
HOOK_LAUNCH_SUBPROCESSES = f"{ENGINE_MODULE}.Engine._launch_subprocesses"
# Every request that reaches a scheduler passes here (server/guard.py: token ids in range).
HOOK_VALIDATE_REQUEST = f"{_TOKENIZER_MANAGER}._validate_one_request"
# TP rank 0's local inputs (SGLang's timeout aborts), broadcast to every rank with the step's.
HOOK_RANK0_LOCAL_INPUTS = f"{_SCHEDULER}._poll_timeout_aborts"
# The forward passes KunServe routes through a merged group (and the cost benchmark times).
HOOK_RUNNER_FORWARD = f"{_RUNNER}.forward"
HOOK_LLAMA_FORWARD = "sglang.srt.models.llama.LlamaModel.forward"
# Multi-rank SGLang on CPU (parallel/): process groups, thread binding, the DP controller's
# loop, the last pipeline stage's own head for tied embeddings.
HOOK_INIT_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
HOOK_THREADS_BINDING = "sglang.srt.utils.numa_utils.init_threads_binding"
HOOK_DP_EVENT_LOOP = f"{DP_CONTROLLER_MODULE}.DataParallelController.event_loop"
# AMOEBAs places requests itself once the controller built its dispatcher.
HOOK_DP_INIT_DISPATCHER = f"{DP_CONTROLLER_MODULE}.DataParallelController.init_dispatcher"
HOOK_LLAMA_INIT = "sglang.srt.models.llama.LlamaForCausalLM.__init__"
HOOK_LLAMA_LOAD_WEIGHTS = "sglang.srt.models.llama.LlamaForCausalLM.load_weights"

# Used in the launcher / HTTP process (checked there, before any process is spawned).
HTTP_SYMBOLS: tuple[Symbol, ...] = (
    *(Symbol(t, "hook") for t in (HOOK_ADD_CLI_ARGS, HOOK_FROM_CLI_ARGS,
                                  HOOK_TOKENIZER_MANAGER_INIT, HOOK_VALIDATE_REQUEST,
                                  HOOK_ENGINE_INIT, HOOK_LAUNCH_SUBPROCESSES)),
    Symbol(f"{ENGINE_MODULE}.Engine.server_args_class", "write"),
    # sglang.Engine's own objects (morph/engine_api.py drives /morph's operations through them).
    *_group(f"{ENGINE_MODULE}.Engine", "read", "tokenizer_manager loop"),
    Symbol(f"{_TOKENIZER_MANAGER}.model_config", "read", True),
    *_group(_SERVER_ARGS, "read", "api_key admin_api_key"),
    Symbol("sglang.srt.plugins.hook_registry.HookRegistry.register", "call"),
    Symbol("sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks", "call"),
    Symbol("sglang.srt.plugins.hook_registry.HookRegistry._patched", "read"),
    Symbol("sglang.srt.plugins.hook_registry.HookType", "read"),
    # ServerArgs fields the launcher hook reads or sets before resolution.
    *_group(_SERVER_ARGS, "read", "model_path dtype kv_cache_dtype tp_size pp_size dp_size "
            "attn_dp_size attn_cp_size dcp_size nnodes speculative_algorithm "
            "disaggregation_mode enable_hierarchical_cache disable_radix_cache enable_lmcache "
            "enable_hisparse enable_flexkv enable_unified_cache_external_linker "
            "enable_session_radix_cache device"),
    *_group(_SERVER_ARGS, "write", "max_total_tokens disable_overlap_schedule "
            "disable_cuda_graph disable_decode_cuda_graph disable_prefill_cuda_graph "
            "cuda_graph_backend_decode cuda_graph_backend_prefill cuda_graph_config "
            "enable_torch_compile"),
    Symbol("sglang.srt.entrypoints.http_server.app", "write"),
    Symbol("sglang.srt.entrypoints.http_server.get_global_state", "call"),
    Symbol("sglang.srt.entrypoints.http_server._GlobalState.tokenizer_manager", "read", True),
    Symbol("sglang.srt.utils.auth.AuthLevel.ADMIN_OPTIONAL", "read"),
    Symbol("sglang.srt.utils.auth.auth_level", "call"),
    Symbol("sglang.srt.managers.io_struct.BaseReq", "read"),
    Symbol("sglang.srt.managers.io_struct.hook_custom_types", "call"),
    Symbol("sglang.utils.TypeBasedDispatcher", "call"),
    *_group(_TOKENIZER_MANAGER, "call", "_async_dispatch_to_scheduler auto_create_handle_loop",
            instance=False),
    Symbol(f"{_TOKENIZER_MANAGER}._result_dispatcher", "write", True),
)

# Used in the scheduler process.
SCHEDULER_SYMBOLS: tuple[Symbol, ...] = (
    *(Symbol(t, "hook") for t in (HOOK_SCHEDULER_INIT, HOOK_LOAD_MODEL, HOOK_NEXT_BATCH,
                                  HOOK_RETRACT_DECODE, HOOK_RANK0_LOCAL_INPUTS)),
    Symbol(f"{_SCHEDULER}.emit_metrics_constants", "call"),
    *_group(_SCHEDULER, "read", "server_args model_config tp_worker waiting_queue "
            "running_batch last_batch chunked_req new_token_ratio_tracker "
            "token_to_kv_pool_allocator req_to_token_pool tree_cache enable_overlap "
            "draft_worker metrics_reporter pool_stats_observer load_inquirer "
            "invariant_checker kv_events_publisher"),
    *_group(_SCHEDULER, "write", "_request_dispatcher max_total_num_tokens max_req_len "
            "max_req_input_len beam_coordinator"),
    Symbol("sglang.srt.managers.tp_worker.TpModelWorker.model_runner", "read"),
    *_group(_RUNNER, "read", "model server_args model_config is_draft_worker"),
    *_group(_RUNNER, "write", "max_total_num_tokens memory_pool_config"),
    Symbol("sglang.srt.model_executor.pool_configurator.MemoryPoolConfig.max_total_num_tokens",
           "write", True),
    *_group("sglang.srt.configs.model_config.ModelConfig", "read",
            "context_len num_hidden_layers hf_config dtype"),
    Symbol(f"{_COMPONENTS}.new_token_ratio_tracker.NewTokenRatioTracker.current", "read", True),
    Symbol(f"{_COMPONENTS}.metrics_reporter.SchedulerMetricsReporter.enable_metrics", "read",
           True),
    # Components that keep their own copy of the KV capacity (kv_resizer._CAPACITY_COMPONENTS).
    *(Symbol(f"{_COMPONENTS}.{module}.{cls}.max_total_num_tokens", "write", True)
      for module, cls in (("pool_stats_observer", "SchedulerPoolStatsObserver"),
                          ("load_inquirer", "SchedulerLoadInquirer"),
                          ("invariant_checker", "SchedulerInvariantChecker"),
                          ("kv_events_publisher", "SchedulerKvEventsPublisher"))),
    Symbol("sglang.srt.beam_search.coordinator.BeamCoordinator.max_req_len", "write", True),
    # Requests and batches (pressure signals, the holders a KV shrink rewrites).
    Symbol("sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS", "read"),
    *_group(f"{_BATCH}.ScheduleBatch", "read", "reqs out_cache_loc"),
    Symbol(f"{_BATCH}.ScheduleBatch.batch_is_full", "write", True),
    *_group(f"{_BATCH}.Req", "read", "origin_input_ids output_ids sampling_params time_stats "
            "lock kv"),
    *_group(f"{_BATCH}.ReqKvInfo", "read",
            "holds_kv req_pool_idx cache_protected_len kv_allocated_len"),
    *_group("sglang.srt.sampling.sampling_params.SamplingParams", "read",
            "max_new_tokens ignore_eos"),
    Symbol("sglang.srt.observability.req_time_stats.SchedulerReqTimeStats."
           "wait_queue_entry_time", "read", True),
    Symbol(f"{_MEM}.base_prefix_cache.TreeLock.node", "read", True),
    Symbol(f"{_MEM}.base_prefix_cache.EvictParams", "call"),
    # The KV pool, its allocators and the radix cache (executor/kv_resizer.py).
    Symbol(f"{_MEM}.memory_pool.ReqToTokenPool.req_to_token", "write", True),
    *_group(f"{_MEM}.memory_pool.MHATokenToKVPool", "write",
            "k_buffer v_buffer size mem_usage _kv_buffer_descs"),
    *_group(f"{_MEM}.memory_pool.MHATokenToKVPool", "read",
            "page_size kv_cache_layout is_quantized_kv_cache post_capture_active"),
    *_group(f"{_MEM}.memory_pool.MHATokenToKVPool", "call",
            "_build_kv_buffer_descs _init_data_ptrs_and_strides get_kv_size_bytes",
            instance=False),
    *(s for cls in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator") for s in (
        *_group(f"{_MEM}.allocator.{cls}", "write", "free_pages size"),
        *_group(f"{_MEM}.allocator.{cls}", "read", "page_size device free_group"),
        *_group(f"{_MEM}.allocator.{cls}", "call", "get_kvcache available_size "
                "merge_and_sort_free get_all_free_pages", instance=False))),
    Symbol(f"{_MEM}.allocator.PagedTokenToKVPoolAllocator.num_pages", "write", True),
    *_group(f"{_MEM}.unified_radix_cache.UnifiedRadixCache", "read",
            "tree_components cache_controller linker tree_core"),
    *_group(f"{_MEM}.unified_radix_cache.UnifiedRadixCache", "call", "evictable_size "
            "protected_size all_values_flatten evict session_records", instance=False),
    Symbol(f"{_MEM}.unified_cache.component_type.ComponentType.FULL", "read"),
    *_group(f"{_MEM}.unified_cache.unified_tree_core_interface.UnifiedTreeCoreInterface",
            "call", "collect_path_info get_component_device_value", instance=False),
    # Decoder linears (executor/variants.py swaps their quant_method and weight).
    Symbol("sglang.srt.layers.linear.LinearBase.quant_method", "write", True),
    # Tensor parallelism (parallel/tensor.py): how SGLang sharded each linear, the TP group.
    Symbol("sglang.srt.layers.linear.LinearBase.tp_group", "read", True),
    *_group("sglang.srt.layers.linear.QKVParallelLinear", "read", "num_heads num_kv_heads "
            "num_kv_head_replicas head_size v_head_size kv_tp_group"),
    Symbol("sglang.srt.layers.linear.MergedColumnParallelLinear.output_sizes", "read", True),
    Symbol("sglang.srt.layers.linear.RowParallelLinear.input_size_per_partition", "read", True),
    Symbol(f"{_SCHEDULER}.tp_group", "read", True),
    *_group("sglang.srt.distributed.parallel_state.GroupCoordinator", "read",
            "rank_in_group world_size cpu_group"),
    # Pipeline parallelism (parallel/pipeline.py): the stages, their micro-batches, and the
    # last stage's /morph answers, which go back to stage 0 over zmq and on to the tokenizer.
    *_group(_SCHEDULER, "read", "pp_group running_mbs idle_sleeper ipc_channels"),
    Symbol(f"{_COMPONENTS}.ipc_channels.SchedulerIpcChannels.send_to_tokenizer", "read", True),
    Symbol(f"{_COMPONENTS}.idle_sleeper.IdleSleeper.poller", "read", True),
    Symbol(f"{_COMPONENTS}.output_sender.SenderWrapper", "call"),
    *_group("sglang.srt.utils.network", "call", "get_zmq_socket get_zmq_socket_on_host "
            "NetworkAddress", instance=False),
    Symbol("sglang.srt.managers.io_struct.sock_recv", "call"),
    *_group(_SERVER_ARGS, "read", "nnodes dist_init_addr"),
)

# ----- precision provenance (morph/provenance.py) -----
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
_COMPLETION = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion"
_PROTOCOL = "sglang.srt.entrypoints.openai.protocol"
HOOK_OUTPUT_STREAMER_CLASS = f"{_SCHEDULER}.get_output_streamer_class"
HOOK_META_INFO = f"{_TOKENIZER_MANAGER}.update_request_meta_info"
HOOK_GENERATE_REQUEST = f"{_TOKENIZER_MANAGER}.generate_request"
HOOK_CHAT_STREAM = f"{_CHAT}._generate_chat_stream"
HOOK_CHAT_RESPONSE = f"{_CHAT}._build_chat_response"
HOOK_COMPLETION_STREAM = f"{_COMPLETION}._generate_completion_stream"
HOOK_COMPLETION_RESPONSE = f"{_COMPLETION}._build_completion_response"

PROVENANCE_SYMBOLS: tuple[Symbol, ...] = (
    *(Symbol(t, "hook") for t in (HOOK_OUTPUT_STREAMER_CLASS, HOOK_META_INFO,
                                  HOOK_GENERATE_REQUEST, HOOK_CHAT_STREAM, HOOK_CHAT_RESPONSE,
                                  HOOK_COMPLETION_STREAM, HOOK_COMPLETION_RESPONSE)),
    # Subclassed: the opt-in flag and the method SGLang calls per emitted batch.
    *_group(f"{_COMPONENTS}.output_streamer.SchedulerOutputStreamer", "write",
            "has_additional_customized_info build_additional_customized_info", instance=False),
    Symbol(f"{_SCHEDULER}.collect_inflight_reqs", "call"),
    Symbol(f"{_SCHEDULER}.rust_server", "read", True),
    *_group(f"{_BATCH}.Req", "read", "output_ids_through_stop finished", instance=False),
    *(Symbol(f"{_PROTOCOL}.{cls}.metadata", "write", True)
      for cls in ("ChatCompletionResponse", "CompletionResponse")),
)

# ----- KunServe (kunserve/live/): the replica reads the pools, batches and the Llama model -----
_FB = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
KUNSERVE_SYMBOLS: tuple[Symbol, ...] = (
    *(Symbol(t, "hook") for t in (HOOK_RUNNER_FORWARD, HOOK_LLAMA_FORWARD)),
    *_group(_SCHEDULER, "read", "server_args tp_worker token_to_kv_pool_allocator "
            "req_to_token_pool tree_cache waiting_queue running_batch last_batch chunked_req "
            "metrics_reporter"),
    Symbol(f"{_SCHEDULER}._request_dispatcher", "write", True),
    *_group(_RUNNER, "read", "model device is_draft_worker"),
    *_group(f"{_MEM}.memory_pool.MHATokenToKVPool", "read",
            "k_buffer v_buffer size start_layer end_layer layer_num"),
    Symbol(f"{_MEM}.memory_pool.MHATokenToKVPool.get_kv_size_bytes", "call"),
    *_group("sglang.srt.models.llama.LlamaModel", "read", "layers embed_tokens norm"),
    *_group(_FB, "read", "forward_mode input_ids positions seq_lens out_cache_loc "
            "req_pool_indices extend_seq_lens extend_prefix_lens extend_seq_lens_cpu"),
    Symbol("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend", "call"),
)

# ----- AMOEBAs (amoebas/): the replica reads the pools, batches and the Llama model -----
AMOEBAS_SYMBOLS: tuple[Symbol, ...] = (
    *(Symbol(t, "hook") for t in (HOOK_RUNNER_FORWARD, HOOK_LLAMA_FORWARD,
                                  HOOK_SCHEDULER_GENERATE, HOOK_DP_INIT_DISPATCHER)),
    # The controller's placement (dispatch.py): its dispatch function, sockets and routing.
    *_group(f"{DP_CONTROLLER_MODULE}.DataParallelController", "write", "dispatching"),
    *_group(f"{DP_CONTROLLER_MODULE}.DataParallelController", "read", "workers server_args"),
    Symbol(f"{DP_CONTROLLER_MODULE}.DataParallelController.maybe_external_dp_rank_routing",
           "call"),
    Symbol("sglang.srt.managers.io_struct.sock_send", "call"),
    Symbol("sglang.srt.managers.utils.is_health_check_generate_req", "call"),
    *_group(_SCHEDULER, "read", "server_args tp_worker token_to_kv_pool_allocator "
            "req_to_token_pool tree_cache metrics_reporter model_config max_req_len "
            "max_req_input_len waiting_queue running_batch last_batch chunked_req"),
    *_group(_SCHEDULER, "call", "is_fully_idle flush_cache", instance=False),
    Symbol(f"{_SCHEDULER}._request_dispatcher", "write", True),
    # An idle scheduler's sleep also polls the replica's wake socket (auto.Waker).
    Symbol(f"{_SCHEDULER}.idle_sleeper", "read", True),
    Symbol(f"{_COMPONENTS}.idle_sleeper.IdleSleeper.poller", "read", True),
    *_group(_RUNNER, "read", "model model_config"),
    *_group(f"{_MEM}.memory_pool.MHATokenToKVPool", "read", "k_buffer v_buffer size"),
    *_group("sglang.srt.models.llama.LlamaModel", "read", "layers embed_tokens norm"),
    *_group(_FB, "read", "forward_mode seq_lens out_cache_loc req_pool_indices "
            "extend_seq_lens extend_prefix_lens"),
)

# ----- iServe profiling (iserve/live.py): the depth each forward runs -----
ISERVE_SYMBOLS: tuple[Symbol, ...] = (
    Symbol(HOOK_LLAMA_FORWARD, "hook"),
    *_group(_SCHEDULER, "read", "tp_worker tree_cache model_config"),
    *_group(_SCHEDULER, "call", "is_fully_idle", instance=False),
    *_group(_RUNNER, "read", "model"),
    *_group("sglang.srt.models.llama.LlamaModel", "read", "pp_group start_layer"),
    Symbol("sglang.srt.models.llama.LlamaModel.end_layer", "write", True),
    Symbol(f"{_MEM}.base_prefix_cache.EvictParams", "call"),
)

# ----- the elastic core (plugin.py, elastic/): what every enabled server uses -----
CORE_SYMBOLS: tuple[Symbol, ...] = (
    *HTTP_SYMBOLS,
    *(Symbol(t, "hook") for t in (HOOK_SCHEDULER_INIT, HOOK_NEXT_BATCH)),
    *_group(_SCHEDULER, "read", "server_args metrics_reporter"),
    Symbol(f"{_SCHEDULER}._request_dispatcher", "write", True),
    Symbol(f"{_COMPONENTS}.metrics_reporter.SchedulerMetricsReporter.enable_metrics", "read",
           True),
    Symbol("sglang.srt.runtime_context.get_parallel", "call"),
)

MORPH_SYMBOLS: tuple[Symbol, ...] = SCHEDULER_SYMBOLS + PROVENANCE_SYMBOLS

# ----- multi-rank SGLang on CPU (parallel/): hooked in every process -----
PARALLEL_SYMBOLS: tuple[Symbol, ...] = tuple(
    Symbol(t, "hook") for t in (HOOK_INIT_GROUP, HOOK_THREADS_BINDING, HOOK_DP_EVENT_LOOP,
                                HOOK_LLAMA_INIT, HOOK_LLAMA_LOAD_WEIGHTS))

ALL_SYMBOLS: tuple[Symbol, ...] = tuple(dict.fromkeys(
    CORE_SYMBOLS + MORPH_SYMBOLS + KUNSERVE_SYMBOLS + AMOEBAS_SYMBOLS + PARALLEL_SYMBOLS))


def _resolve(path: str) -> Any:
    """The object at a dotted path (longest importable module, then attributes); raises
    ImportError or AttributeError."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            if split == 1:
                raise
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


_SELF_ATTR = r"self\.([A-Za-z_]\w*)"
# ``self.x = ...``, ``self.x: T = ...``, ``self.x += ...``, ``self.x, self.y = ...``
_ASSIGNED = re.compile(_SELF_ATTR + r"\s*(?::[^=\n]+)?(?:,[^=\n]*)?[-+*/|&]?=(?!=)")
# ``(self.x, self.y, _) = ...`` over several lines
_TUPLE_TARGET = re.compile(r"\(([\w\s.,]*)\)\s*=(?!=)")
# ``self.x, self.y, self.z = ...`` (the first regex names only ``x``)
_BARE_TUPLE_TARGET = re.compile(r"^\s*((?:self\.\w+\s*,\s*)+self\.\w+)\s*=(?!=)", re.M)


@functools.lru_cache(maxsize=None)
def _assigned_in_source(cls: type) -> frozenset[str]:
    """Attribute names a class's own source assigns on ``self``."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return frozenset()
    names = set(_ASSIGNED.findall(source))
    for target in _TUPLE_TARGET.findall(source) + _BARE_TUPLE_TARGET.findall(source):
        names.update(re.findall(_SELF_ATTR, target))
    return frozenset(names)


def _has_instance_attribute(cls: type, name: str) -> bool:
    if hasattr(cls, name):  # class attribute, property, method, msgspec/slots descriptor
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    if name in getattr(cls, "__struct_fields__", ()):
        return True
    if name in getattr(cls, "model_fields", {}):  # a pydantic model's field
        return True
    return any(name in _assigned_in_source(c) for c in cls.__mro__ if c is not object)


def missing_symbols(symbols: tuple[Symbol, ...]) -> list[str]:
    """The paths of ``symbols`` that do not exist in the installed SGLang."""
    missing = []
    for symbol in symbols:
        try:
            if symbol.instance:
                owner_path, name = symbol.path.rsplit(".", 1)
                if not _has_instance_attribute(_resolve(owner_path), name):
                    missing.append(symbol.path)
            else:
                _resolve(symbol.path)
        except (ImportError, AttributeError):
            missing.append(symbol.path)
    return missing


def installed_sglang_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def mismatch_message(missing: list[str], what: str = "find") -> str:
    """The one line a server on the wrong SGLang release stops with."""
    return (f"sglang-morph: could not {what} {', '.join(missing)}. sglang-morph is written for "
            f"sglang=={SGLANG_VERSION} and found sglang {installed_sglang_version()}. Install "
            f"sglang=={SGLANG_VERSION}, or exclude this plugin with "
            f"SGLANG_PLUGINS=<other plugins>.")
