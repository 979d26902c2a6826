"""IPC messages between the HTTP process (TokenizerManager) and the scheduler process.

One typed msgspec message per command; the scheduler answers every one with a
``elastic.control.ControlOutput`` (the HTTP status and the JSON body the route returns unchanged). SGLang's
IPC encodes msgspec structs with msgpack and only decodes types it was told about, so both
processes register these with ``hook_custom_types`` when this module is imported (the plugin
imports it in every process).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class _MorphReq(BaseReq, kw_only=True):
    # Under pipeline parallelism each stage adds what it did (its status, its outcome) before
    # SGLang forwards the request to the next stage; the last one answers from all of them.
    pipeline_stages: list[dict[str, Any]] = []


class MorphStatusReq(_MorphReq, kw_only=True):
    """``GET /morph/status``."""


class MorphSwapReq(_MorphReq, kw_only=True):
    """``POST /morph/swap``: serve ``layers`` at ``bits`` (16 restores). ``pin``: the
    controller leaves these layers where the operator put them (False hands them back; None,
    the default: the layers the swap moves are pinned, a layer already at ``bits`` keeps its
    state). ``replica``: the data-parallel replica that swaps (the others answer ``SKIPPED``)."""

    layers: list[int]
    bits: int
    pin: bool | None = None
    replica: int | None = None


class MorphModeReq(_MorphReq, kw_only=True):
    """``POST /morph/mode``: the controller's policy from now on (one replica's, or every
    replica's when ``replica`` is None)."""

    mode: str
    replica: int | None = None


class MorphActionReq(_MorphReq, kw_only=True):
    """A controller action under tensor or pipeline parallelism: TP rank 0's or stage 0's
    controller decides and adds this to its own scheduler inputs, which SGLang hands every rank
    (the TP broadcast of each step's inputs, the forward of each step's inputs down the
    pipeline), so every rank applies it at the same point (``parallel/relay.py``). No
    answer."""

    layers: list[int]
    bits: int
    reason: str


MORPH_REQUESTS = (MorphStatusReq, MorphSwapReq, MorphModeReq)

hook_custom_types(*MORPH_REQUESTS, MorphActionReq)
