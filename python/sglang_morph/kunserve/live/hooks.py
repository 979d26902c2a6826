"""KunServe's SGLang hooks, registered by the plugin in every scheduler process. Each is a
dict lookup and a call to the original on a replica without ``--enable-kunserve``."""

from __future__ import annotations

import time
from typing import Any, Callable

from sglang_morph.surface import HOOK_LLAMA_FORWARD, HOOK_RUNNER_FORWARD, IN_SCHEDULER, Hook



def around_runner_forward(original: Callable[..., Any], runner: Any, *args: Any,
                          **kwargs: Any) -> Any:
    replica = runner.__dict__.get("kunserve")
    if replica is None:
        return original(runner, *args, **kwargs)
    # The layers run under the replica's compute lock (replica.py, "Concurrency"); a merged
    # replica lets another member's cut prefill finish first, and a merged back member sends
    # its batch to the front's layers before it waits for the lock.
    forward_batch = args[0] if args else kwargs["forward_batch"]
    replica.hold_for_peer_prefill()
    replica.send_ahead(forward_batch)
    try:
        with replica.compute_lock:
            if replica.merged:
                replica.count_merged_forward(forward_batch)
                return original(runner, *args, **kwargs)
            # Whole: its forwards are what the controller's measured pay rule weighs with
            start_s = time.perf_counter()
            out = original(runner, *args, **kwargs)
            replica.record_whole_forward(forward_batch, time.perf_counter() - start_s)
            return out
    finally:
        replica.settle_ahead()


def around_llama_forward(original: Callable[..., Any], model: Any, *args: Any,
                         **kwargs: Any) -> Any:
    replica = model.__dict__.get("kunserve")
    if replica is None or not replica.merged:
        return original(model, *args, **kwargs)
    return replica.forward_merged(*args, **kwargs)


HOOKS: tuple[Hook, ...] = (
    Hook(HOOK_RUNNER_FORWARD, around_runner_forward, "AROUND", only_if_imported=IN_SCHEDULER),
    Hook(HOOK_LLAMA_FORWARD, around_llama_forward, "AROUND", only_if_imported=IN_SCHEDULER),
)


def attach(scheduler: Any, cfg: Any) -> None:
    """After the scheduler's init: this replica's KunServe side (``cfg``: the launch's
    ``KunServeLiveConfig``) and its control requests."""
    from sglang.utils import TypeBasedDispatcher

    from sglang_morph.kunserve.live.messages import KUNSERVE_REQUESTS
    from sglang_morph.kunserve.live.replica import KunServeReplica

    replica = KunServeReplica(scheduler, cfg)
    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(req_type, replica.handle_control) for req_type in KUNSERVE_REQUESTS])
    scheduler.kunserve = replica
