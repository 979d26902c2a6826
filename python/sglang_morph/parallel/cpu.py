"""Hooks that let SGLang run with several ranks (TP, PP, DP, several nodes) on a CPU.

Both act only in a CPU process (``sglang.srt.utils.is_cpu()``: ``SGLANG_USE_CPU_ENGINE=1`` on
x86-64 or arm64), with or without ``--enable-morph``; on CUDA they call SGLang unchanged.

- **Process groups without GPU communicators.** ``init_model_parallel_group`` turns PyNccl on
  for every group unless the platform says otherwise, and PyPI's torch ships libnccl, so on a
  CPU the TP/PP groups try to build a PyNccl communicator on device ``cpu`` and fail ("Expected
  a cuda device"). SGLang's collectives already send CPU tensors through torch.distributed on
  the groups' gloo backend; the hook only builds the groups without PyNccl, MSCCL++, custom or
  symmetric-memory all-reduce, which need a GPU.
- **One thread count per rank.** SGLang binds each rank's OpenMP threads to its
  ``SGLANG_CPU_OMP_THREADS_BIND`` entry only with the Intel AMX backend or on arm64; elsewhere
  every rank would run as many threads as the machine has cores, and N ranks would fight over
  them. After SGLang picked the rank's entry, the hook pins the process to those cores and sets
  torch's thread count to their number. Single-rank servers are left as they are.
- **A data-parallel controller that waits.** SGLang's ``DataParallelController.event_loop``
  polls the tokenizer's socket without blocking, in a loop with no wait: measured here, the
  controller of an idle ``--dp-size 2`` server used 99% of a core (the schedulers 0.1% each).
  On a GPU host that is one core of many; on this 2-core machine it is half the machine, taken
  from the two schedulers whenever they compute. The hook runs the same dispatch, but blocks
  in ``zmq.Poller.poll`` until a request arrives (or ``DP_POLL_TIMEOUT_MS`` passes, to feed
  SGLang's soft watchdog as its loop does). A mechanism that holds requests in the controller
  (``surface.DP_CONTROLLER_TICK_ATTR``) is called after each round and may wake it sooner.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Callable

from sglang_morph.parallel.binding import parse_core_list
from sglang_morph.surface import DP_CONTROLLER_TICK_ATTR

logger = logging.getLogger("sglang_morph.parallel")

DP_POLL_TIMEOUT_MS = 1000  # the watchdog's timeout is minutes; a request wakes the poll at once

# Communicators that need a GPU; each is a keyword of init_model_parallel_group.
_GPU_COMMUNICATORS = ("use_pynccl", "use_custom_allreduce", "use_mscclpp",
                      "use_torch_symm_mem_allreduce")


def on_cpu() -> bool:
    """SGLang's own test for its CPU engine (SGLANG_USE_CPU_ENGINE=1 on x86-64 or arm64)."""
    from sglang.srt.utils import is_cpu

    return is_cpu()


def _sglang_binds_threads() -> bool:
    """SGLang binds OpenMP threads itself (sgl_kernel.init_cpu_threads_env) on these CPUs."""
    from sglang.srt.utils import cpu_has_amx_support, is_host_cpu_arm64

    return cpu_has_amx_support() or is_host_cpu_arm64()


def around_init_model_parallel_group(original: Callable[..., Any], *args: Any,
                                      **kwargs: Any) -> Any:
    if not on_cpu():
        return original(*args, **kwargs)
    # Bind against the signature so a flag SGLang passes positionally is overridden too.
    bound = inspect.signature(original).bind(*args, **kwargs)
    for name in _GPU_COMMUNICATORS:
        bound.arguments[name] = False
    group = original(*bound.args, **bound.kwargs)
    logger.debug("sglang-morph: CPU group %s (ranks %s) over torch.distributed/gloo",
                 group.unique_name, group.ranks)
    return group


def after_init_threads_binding(local_omp_cpuid: Any, *args: Any, **kwargs: Any) -> None:
    world_size = kwargs.get("world_size", 1)
    if world_size <= 1 or _sglang_binds_threads():
        return
    cores = parse_core_list(str(local_omp_cpuid))
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    logger.info("sglang-morph: rank %s of %d on CPU cores %s, %d torch threads",
                kwargs.get("numa_index"), world_size, local_omp_cpuid, len(cores))


def around_dp_event_loop(original: Callable[..., Any], controller: Any) -> Any:
    """``DataParallelController.event_loop`` on a CPU: dispatch every request waiting on the
    tokenizer's socket, then block until the next one (never returns, like SGLang's)."""
    if not on_cpu():
        return original(controller)
    import zmq
    from sglang.srt.managers.io_struct import sock_recv

    socket = controller.recv_from_tokenizer
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    # A mechanism holding requests here (AMOEBAs' placement) is called between requests.
    tick = getattr(controller, DP_CONTROLLER_TICK_ATTR, None)
    while True:
        controller.soft_watchdog.feed()
        while True:
            try:
                request = sock_recv(socket, flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing waiting (zmq.Again)
                break
            controller._request_dispatcher(request)
        wake_ms = tick() if tick is not None else None
        poller.poll(DP_POLL_TIMEOUT_MS if wake_ms is None else wake_ms)
