"""IPC messages of the ``/amoebas`` routes (HTTP process -> every replica's scheduler).

Every replica answers with the elastic core's ``ControlOutput``: the members of the group a
transition names run it (a voted transition over their link), the others answer with their
status. Registered with SGLang's msgpack decoder in every process that imports this module.
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class AmoebasStatusReq(BaseReq, kw_only=True):
    """``GET /amoebas/status`` (``?digest=1``: with a SHA-256 of the FFN rows each replica
    holds)."""

    digest: bool = False


class AmoebasMergeReq(BaseReq, kw_only=True):
    """``POST /amoebas/merge``: ``replicas`` (serving apart) merge into one group."""

    replicas: list[int]


class AmoebasSplitReq(BaseReq, kw_only=True):
    """``POST /amoebas/split``: the group of exactly ``group`` splits into groups of
    ``degree`` (1: back into replicas serving alone)."""

    group: list[int]
    degree: int = 1


AMOEBAS_REQUESTS = (AmoebasStatusReq, AmoebasMergeReq, AmoebasSplitReq)

hook_custom_types(*AMOEBAS_REQUESTS)
