"""MorphServe's transition record and error type, shared by the runtime and its pipeline
stages (``morph/parallel/pipeline.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang_morph.elastic.contract import ElasticError


class MorphRequestError(ElasticError):
    """A /morph request or transition that cannot be applied; ``status_code`` is its HTTP
    status (the elastic core's error type)."""


@dataclasses.dataclass(frozen=True)
class Transition:
    time_unix_s: float
    # "swap" (to fewer bits) or "restore" (to more bits) when applied; "refused" or "failed"
    # when nothing changed (``to_bits`` says which direction was asked for, ``error`` why).
    action: str
    source: str  # "controller", "api" or "startup"
    layers: tuple[int, ...]
    from_bits: tuple[int, ...]
    to_bits: int
    freed_bytes: int  # weight bytes freed (negative: reclaimed by a restore)
    kv_capacity_tokens_before: int
    kv_capacity_tokens_after: int
    kv_moved_tokens: int
    kv_evicted_tokens: int
    duration_s: float
    reason: str
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
