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
    """``POST /kunserve/drop``: replicas 0 and 1 merge into one pipeline group."""


class KunServeRestoreReq(BaseReq, kw_only=True):
    """``POST /kunserve/restore``: the group splits back into two whole replicas."""


KUNSERVE_REQUESTS = (KunServeStatusReq, KunServeDropReq, KunServeRestoreReq)

hook_custom_types(*KUNSERVE_REQUESTS)
