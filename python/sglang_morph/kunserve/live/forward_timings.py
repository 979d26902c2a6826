"""Server-side forward timings for the chunk cost model (``benchmark/kunserve/costs.py``).

With ``SGLANG_MORPH_FORWARD_TIMINGS=<path>`` in the server's environment, every scheduler
process wraps ``ModelRunner.forward`` and appends one JSON line per forward to ``<path>``:
``{"mode": ..., "cached": [p_i], "new": [c_i], "seconds": s, "t": start, "pid": ...}``: the
chunks of the batch exactly as SGLang ran them (its own prefix and extend lengths; a decode
step is ``c = 1`` behind ``seq_len - 1``), the wall clock at the forward's start (so a
scheduler's gaps between forwards show) and the time of the forward alone: the model and
its logits, not sampling, scheduling, IPC or HTTP, which a client's end-to-end latency mixes in
and which a pipeline stage does not pay. Without the variable nothing is hooked and SGLang's
path is unchanged.

The line is written after the forward returns (on CUDA after a synchronize, so the time is the
kernels'); a write costs tens of microseconds, against forwards of tens of milliseconds here.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from sglang_morph.surface import HOOK_RUNNER_FORWARD, IN_SCHEDULER, Hook

ENV = "SGLANG_MORPH_FORWARD_TIMINGS"


def batch_chunks(forward_batch: Any) -> tuple[str, list[int], list[int]]:
    """(mode, cached tokens per request, new tokens per request) of one ForwardBatch."""
    mode = forward_batch.forward_mode
    if mode.is_decode():
        seq_lens = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
        return "decode", [n - 1 for n in seq_lens], [1] * len(seq_lens)
    if mode.is_extend() and forward_batch.extend_seq_lens_cpu is not None:
        return (mode.name.lower(), [int(n) for n in forward_batch.extend_prefix_lens_cpu],
                [int(n) for n in forward_batch.extend_seq_lens_cpu])
    return mode.name.lower(), [], []


def timed_forward(path: str) -> Callable[..., Any]:
    def around_runner_forward(original: Callable[..., Any], runner: Any, forward_batch: Any,
                              *args: Any, **kwargs: Any) -> Any:
        if runner.is_draft_worker:
            return original(runner, forward_batch, *args, **kwargs)
        started_unix_s, start = time.time(), time.perf_counter()
        out = original(runner, forward_batch, *args, **kwargs)
        if str(runner.device).startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        mode, cached, new = batch_chunks(forward_batch)
        line = json.dumps({"mode": mode, "cached": cached, "new": new, "seconds": seconds,
                           "t": started_unix_s, "pid": os.getpid()})
        # One write per line in append mode: lines of several ranks never interleave.
        with open(path, "a") as f:
            f.write(line + "\n")
        return out

    return around_runner_forward


def hooks() -> tuple[Hook, ...]:
    path = os.environ.get(ENV)
    if not path:
        return ()
    return (Hook(HOOK_RUNNER_FORWARD, timed_forward(path), "AROUND",
                 only_if_imported=IN_SCHEDULER),)
