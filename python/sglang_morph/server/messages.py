"""IPC messages between the HTTP process (TokenizerManager) and the scheduler process.

SGLang's IPC encodes msgspec structs with msgpack and only decodes types it was told about, so
both processes register these with ``hook_custom_types`` when this module is imported (the
plugin imports it in every process). Payloads are JSON text: the scheduler answers with an HTTP
status and body that the route returns unchanged.
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class MorphControlReq(BaseReq, kw_only=True):
    command: str  # "status" | "swap" | "mode"
    payload_json: str = "{}"


class MorphControlReqOutput(BaseReq, kw_only=True):
    status_code: int
    body_json: str


hook_custom_types(MorphControlReq, MorphControlReqOutput)
