"""MorphServe under SGLang's data parallelism (``--enable-morph --dp-size N``).

Each data-parallel replica is a scheduler process of its own with its own copy of the weights
and its own KV pool, so each runs its own ``MorphRuntime``: its own budget
(``--morph-memory-budget`` is per replica), its own controller deciding from its own pressure,
its own transitions. Nothing is shared, so nothing needs to agree: a replica that swaps grows
only its own pool, and SGLang's data-parallel controller sees the bigger pool in that
replica's load reports and sends it more.

The ``/morph`` requests reach every replica: SGLang's ``DataParallelController`` sends a
message type it does not know (ours) to every active worker (``send_control_message``), and
each replica's scheduler answers the TokenizerManager directly, so one request gets one answer
per replica (``morph/http.py`` waits for them all). A swap names its ``replica``: the others
answer that it was not for them (``SKIPPED``) and change nothing, so a swap is one replica's
transaction, applied completely or not at all like on one rank; there is no swap across
replicas that could half-happen.
"""

from __future__ import annotations

# The status code of a replica's answer to a request addressed to another replica; the HTTP
# side drops these (never sent to a client).
SKIPPED = 204


def replica_index() -> int:
    """This scheduler's data-parallel replica: SGLang's ``dp_rank`` (0 without a data-parallel
    controller, and in processes SGLang did not spawn, such as unit tests)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        rank = get_parallel().dp_rank
    except (RuntimeError, ValueError):  # never published: not an SGLang scheduler process
        return 0
    return rank or 0


def replica_count(server_args) -> int:
    """How many replicas answer each /morph request (``--dp-size``)."""
    return max(1, int(getattr(server_args, "dp_size", 1) or 1))
