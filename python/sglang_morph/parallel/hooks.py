"""The parallel package's SGLang hooks, registered and verified by ``sglang_morph.plugin.load``
in every process, with or without a mechanism enabled. Each hook acts on CPU only."""

from __future__ import annotations

from sglang_morph import surface as sym
from sglang_morph.parallel import cpu, tied_head
from sglang_morph.surface import IN_SCHEDULER, Hook

# Scheduler processes build the process groups, bind threads and load the model.
HOOKS: tuple[Hook, ...] = (
    Hook(sym.HOOK_INIT_GROUP, cpu.around_init_model_parallel_group, "AROUND",
         only_if_imported=IN_SCHEDULER),
    Hook(sym.HOOK_THREADS_BINDING, cpu.after_init_threads_binding, "AFTER",
         only_if_imported=IN_SCHEDULER),
    Hook(sym.HOOK_LLAMA_INIT, tied_head.after_llama_init, "AFTER",
         only_if_imported=IN_SCHEDULER),
    Hook(sym.HOOK_LLAMA_LOAD_WEIGHTS, tied_head.around_llama_load_weights, "AROUND",
         only_if_imported=IN_SCHEDULER),
    # The data-parallel controller's process imports its module before loading plugins.
    Hook(sym.HOOK_DP_EVENT_LOOP, cpu.around_dp_event_loop, "AROUND",
         only_if_imported=sym.DP_CONTROLLER_MODULE),
)
