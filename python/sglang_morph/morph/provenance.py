"""Precision provenance: which layer precisions produced each response's tokens.

Every response of a server started with ``--enable-morph`` says, in its last chunk, under what
layer precisions its output tokens were produced::

    "morph_precision": {
        "quantized_token_share": 0.4,       # quantized_tokens / output_tokens (0.0 for none)
        "quantized_tokens": 8,              # tokens produced while any layer was below 16 bits
        "output_tokens": 20,
        "segments": [                       # consecutive, cover [0, output_tokens)
            {"start": 0, "end": 12, "quantized_layers": {}},
            {"start": 12, "end": 20, "quantized_layers": {"4": [12, 13, 14, 15]}}]}

Native ``/generate``: ``meta_info.morph_precision`` of the final output (of the last chunk when
streaming). OpenAI ``/v1/chat/completions`` and ``/v1/completions``: ``metadata.morph_precision``
(SGLang's ``metadata`` object already carries the weight version that produced a response);
when streaming, one last chunk with ``"choices": []`` and that ``metadata`` comes right before
``data: [DONE]``. With several choices (``n`` > 1, several prompts) it is a list, one object per
choice in choice order.

A token is attributed to the precision of the forward pass that sampled it. Transitions run on
the scheduler thread between two forward passes (``MorphRuntime``), so the layer bits are
constant during every pass, and a request that has produced ``k`` tokens when they change
produced tokens ``0..k-1`` at the old precision and the rest at the new one (while a request
waits it produces nothing). The bookkeeping follows SGLang's own weight-version spans
(``srt/utils/weight_versions.py``): at each change every live request with output records
``(k, old state)``; the spans are built when the request finishes. The KV of earlier tokens
(prompt included) keeps the precision it was computed at; provenance speaks of sampling only.

Path through SGLang (its extension points, no copied code):
- scheduler: ``Scheduler.get_output_streamer_class`` returns a subclass of SGLang's
  ``SchedulerOutputStreamer`` that opts into ``build_additional_customized_info``: each emitted
  request gets its provenance when it finishes (None before); SGLang carries the value in
  ``customized_info`` through the detokenizer to the TokenizerManager;
- TokenizerManager: ``update_request_meta_info`` (documented for subclasses' terminal data)
  puts that value into ``meta_info`` instead of accumulating it as a per-token list;
- OpenAI: ``_build_chat_response`` / ``_build_completion_response`` add it to ``metadata``; the
  streaming generators watch their ``GenerateReqInput`` in ``TokenizerManager.generate_request``
  to collect it and send the extra chunk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import weakref
from typing import Any, Callable, Iterable, Sequence

from sglang_morph.config import FULL_PRECISION_BITS

logger = logging.getLogger("sglang_morph")

KEY = "morph_precision"


# ----- bookkeeping (plain data; unit-tested without SGLang) --------------------------------------

@dataclasses.dataclass(frozen=True)
class PrecisionState:
    """The layers below full precision, grouped by bit-width: ``((4, (0, 1)), (8, (5,)))``
    (bits ascending, layers ascending). Empty when every layer is at full precision."""

    quantized: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @classmethod
    def of(cls, layer_bits: Sequence[int]) -> PrecisionState:
        groups: dict[int, list[int]] = {}
        for layer, bits in enumerate(layer_bits):
            if bits != FULL_PRECISION_BITS:
                groups.setdefault(bits, []).append(layer)
        return cls(tuple((bits, tuple(groups[bits])) for bits in sorted(groups)))

    @property
    def any_quantized(self) -> bool:
        return bool(self.quantized)

    def to_json(self) -> dict[str, list[int]]:
        return {str(bits): list(layers) for bits, layers in self.quantized}


@dataclasses.dataclass(frozen=True)
class Segment:
    """Output tokens ``start..end-1`` were produced under ``state``."""

    start: int
    end: int
    state: PrecisionState

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "quantized_layers": self.state.to_json()}


def segments(changes: Iterable[tuple[int, PrecisionState]], current: PrecisionState,
             num_output_tokens: int) -> list[Segment]:
    """Segments of one request from its ``changes`` (in order: the request had produced ``k``
    tokens when ``state``, its precision until then, was left) and ``current``, the state of
    every later token. Adjacent equal states merge; empty ranges vanish; changes past
    ``num_output_tokens`` (tokens a stop condition cut off) are clipped.

    Invariant: the segments are consecutive, start at 0 and end at ``num_output_tokens``
    (none for an empty output), and no two neighbours share a state.
    """
    out: list[Segment] = []
    start = 0
    for end, state in (*changes, (num_output_tokens, current)):
        end = min(end, num_output_tokens)
        if end <= start:
            continue
        if out and out[-1].state == state:
            out[-1] = dataclasses.replace(out[-1], end=end)
        else:
            out.append(Segment(start, end, state))
        start = end
    return out


def provenance_json(segs: Sequence[Segment], num_output_tokens: int) -> dict[str, Any]:
    quantized = sum(s.end - s.start for s in segs if s.state.any_quantized)
    return {
        "quantized_token_share": quantized / num_output_tokens if num_output_tokens else 0.0,
        "quantized_tokens": quantized,
        "output_tokens": num_output_tokens,
        "segments": [s.to_json() for s in segs],
    }


def check_provenance(p: dict[str, Any]) -> None:
    """Raise AssertionError unless ``p`` (a ``morph_precision`` object) is self-consistent."""
    segs = p["segments"]
    assert [s["start"] for s in segs] == [0, *(s["end"] for s in segs)][:len(segs)], segs
    assert (segs[-1]["end"] if segs else 0) == p["output_tokens"], (segs, p["output_tokens"])
    assert all(s["end"] > s["start"] for s in segs), segs
    assert all(a["quantized_layers"] != b["quantized_layers"] for a, b in zip(segs, segs[1:]))
    quantized = sum(s["end"] - s["start"] for s in segs if s["quantized_layers"])
    assert p["quantized_tokens"] == quantized, p
    share = quantized / p["output_tokens"] if p["output_tokens"] else 0.0
    assert abs(p["quantized_token_share"] - share) < 1e-12, p


class ProvenanceTracker:
    """The precision state now and, per live request (weakly held, so a request SGLang drops
    takes its record with it), the precision changes it has seen.

    Invariant: a request's changes are in order of its output length, each recorded with the
    state that was left, so ``segments(changes, state, n)`` covers its tokens exactly.
    """

    def __init__(self, layer_bits: Sequence[int]):
        self._layer_bits = tuple(layer_bits)
        self.state = PrecisionState.of(self._layer_bits)
        self._changes: weakref.WeakKeyDictionary[Any, list[tuple[int, PrecisionState]]] = (
            weakref.WeakKeyDictionary())

    def observe(self, layer_bits: Sequence[int], live_reqs: Callable[[], Iterable[Any]]) -> int:
        """Called between batches with the layer bits the next forward pass uses; when they
        differ from the last ones, every request of ``live_reqs()`` that has output records the
        change. Returns how many did."""
        layer_bits = tuple(layer_bits)
        if layer_bits == self._layer_bits:
            return 0
        self._layer_bits = layer_bits
        recorded = 0
        for req in live_reqs():
            produced = len(req.output_ids)
            if produced:
                self._changes.setdefault(req, []).append((produced, self.state))
                recorded += 1
        self.state = PrecisionState.of(layer_bits)
        return recorded

    def report(self, req: Any, num_output_tokens: int) -> dict[str, Any]:
        segs = segments(self._changes.get(req, ()), self.state, num_output_tokens)
        return provenance_json(segs, num_output_tokens)


# ----- scheduler process -------------------------------------------------------------------------

def live_requests(scheduler: Any) -> set[Any]:
    """Every request that may still produce tokens: in flight, waiting (a retracted request
    keeps its output) or half-prefilled (SGLang's weight-version bookkeeping takes the same)."""
    reqs = set(scheduler.collect_inflight_reqs())
    reqs.update(scheduler.waiting_queue)
    if scheduler.chunked_req is not None:
        reqs.add(scheduler.chunked_req)
    return reqs


def output_streamer_class(base: type, scheduler: Any) -> type:
    """``base`` (SGLang's ``SchedulerOutputStreamer``) reporting each finished request's
    provenance in ``customized_info[KEY]``; the tracker is ``scheduler.morph_runtime``'s."""

    class MorphOutputStreamer(base):
        __slots__ = ()
        has_additional_customized_info = True

        def build_additional_customized_info(self, reqs: list[Any]) -> dict[str, list]:
            info = super().build_additional_customized_info(reqs)
            tracker = scheduler.morph_runtime.provenance
            # The count SGLang reports as completion_tokens (tokens after a stop cut are out).
            info[KEY] = [tracker.report(r, len(r.output_ids_through_stop)) if r.finished()
                         else None for r in reqs]
            return info

    return MorphOutputStreamer


# ----- HTTP process (TokenizerManager and OpenAI) ------------------------------------------------

def meta_info_around(original, tokenizer_manager, meta_info, state, customized_info, index,
                     finish_reason):
    """``TokenizerManager.update_request_meta_info``: our value goes to ``meta_info`` as it is;
    SGLang accumulates the other keys as usual."""
    if KEY in customized_info:
        value = customized_info[KEY][index]
        if value is not None:
            meta_info[KEY] = value
        customized_info = {k: v for k, v in customized_info.items() if k != KEY}
        if not customized_info:
            return None
    return original(tokenizer_manager, meta_info, state, customized_info, index, finish_reason)


@dataclasses.dataclass
class _Collected:
    rid: str | None = None
    by_choice: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


# GenerateReqInput objects of OpenAI streams in progress (by id: they are alive meanwhile).
_watched: dict[int, _Collected] = {}


def generate_request_around(original, tokenizer_manager, *args, **kwargs):
    """``TokenizerManager.generate_request``: outputs of a watched request are collected on
    their way out; any other request gets SGLang's generator untouched."""
    gen = original(tokenizer_manager, *args, **kwargs)
    obj = args[0] if args else kwargs.get("obj")
    sink = _watched.get(id(obj))
    return gen if sink is None else _collect(gen, sink)


async def _collect(gen, sink: _Collected):
    async for out in gen:
        meta_info = out.get("meta_info") or {}
        if KEY in meta_info:
            sink.rid = meta_info.get("id", sink.rid)
            sink.by_choice[out.get("index", 0)] = meta_info[KEY]
        yield out


def _per_choice(values: list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
    return values[0] if len(values) == 1 else values


_DONE = "data: [DONE]\n\n"


def _stream_around(chunk_object: str):
    def around(original, serving, adapted_request, request, raw_request):
        return _stream(original(serving, adapted_request, request, raw_request),
                       adapted_request, request, chunk_object)
    return around


async def _stream(gen, adapted_request, request, chunk_object: str):
    sink = _watched[id(adapted_request)] = _Collected()
    try:
        async for chunk in gen:
            if chunk == _DONE and sink.by_choice:
                values = [sink.by_choice[i] for i in sorted(sink.by_choice)]
                last = {"id": sink.rid, "object": chunk_object, "created": int(time.time()),
                        "model": request.model, "choices": [],
                        "metadata": {KEY: _per_choice(values)}}
                yield f"data: {json.dumps(last)}\n\n"
            yield chunk
    finally:
        _watched.pop(id(adapted_request), None)


def response_after(response, serving, request, ret, created):
    """``_build_chat_response`` / ``_build_completion_response``: ``metadata[KEY]``."""
    metadata = getattr(response, "metadata", None)  # an error response has none
    values = [item.get("meta_info", {}).get(KEY) for item in ret]
    if isinstance(metadata, dict) and values and all(v is not None for v in values):
        metadata[KEY] = _per_choice(values)
    return response


# ----- hooks (plugin.py registers them) ----------------------------------------------------------

def after_get_output_streamer_class(result: type, scheduler: Any) -> type | None:
    """``Scheduler.get_output_streamer_class`` (called in ``Scheduler.__init__``): with
    ``--enable-morph``, the provenance-reporting subclass."""
    from sglang_morph.morph import config

    if not config.get(scheduler.server_args).enabled:
        return None
    if getattr(scheduler, "rust_server", None) is not None:
        # SGLang's Rust egress does not carry customized_info (its streamer refuses it).
        logger.warning("sglang-morph: no precision provenance in responses with "
                       "SGLANG_RUST_SERVER (its egress carries no customized_info)")
        return None
    return output_streamer_class(result, scheduler)


def http_hooks() -> tuple[tuple[str, Callable[..., Any], str], ...]:
    """(target, function, HookType name) for the HTTP process, with ``--enable-morph``."""
    from sglang_morph import surface as sym

    return (
        (sym.HOOK_META_INFO, meta_info_around, "AROUND"),
        (sym.HOOK_GENERATE_REQUEST, generate_request_around, "AROUND"),
        (sym.HOOK_CHAT_STREAM, _stream_around("chat.completion.chunk"), "AROUND"),
        (sym.HOOK_COMPLETION_STREAM, _stream_around("text_completion"), "AROUND"),
        (sym.HOOK_CHAT_RESPONSE, response_after, "AFTER"),
        (sym.HOOK_COMPLETION_RESPONSE, response_after, "AFTER"),
    )
