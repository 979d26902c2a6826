"""IPC messages of the ``/kunserve`` routes (HTTP process -> every replica's scheduler).

Each replica answers with the elastic core's ``ControlOutput`` (status code, JSON body,
replica), so its control client collects the answers of both replicas.
Registered with SGLang's msgpack decoder in every process that imports this module (the plugin
imports it in every process).
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class KunServeStatusReq(BaseReq, kw_only=True):
    """``GET /kunserve/status``."""


class KunServeDropReq(BaseReq, kw_only=True):
    """``POST /kunserve/drop``: replicas of one link merge into one pipeline group. ``group``:
    the pair, or two or more replicas of a larger group, sorted (None: the whole group of a
    launch of one)."""

    group: list[int] | None = None


class KunServeRestoreReq(BaseReq, kw_only=True):
    """``POST /kunserve/restore``: merged replicas split back into whole ones (``group`` as
    for the drop)."""

    group: list[int] | None = None


KUNSERVE_REQUESTS = (KunServeStatusReq, KunServeDropReq, KunServeRestoreReq)

hook_custom_types(*KUNSERVE_REQUESTS)
