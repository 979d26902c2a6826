"""Precision provenance (morph/provenance.py): the segment bookkeeping, and on a live float32
morph server, what responses say about the precisions that produced their tokens while
``POST /morph/swap`` moves layers to W4 and back mid-stream."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from sglang_morph.morph import provenance as prov
# The runtime test's 8 layers (the first of the LIS order) and its transformers reference with
# a precision schedule.
import test_morph_runtime_server as runtime_test
from test_morph_runtime_server import SWAPPED as LAYERS, transformers_schedule
from sglang_morph.morph.provenance import (
    PrecisionState,
    ProvenanceTracker,
    Segment,
    check_provenance,
    provenance_json,
    segments,
)

FP = 16
NUM_LAYERS = 6


def bits_with(quantized: dict[int, int]) -> tuple[int, ...]:
    return tuple(quantized.get(i, FP) for i in range(NUM_LAYERS))


# ----- bookkeeping ---------------------------------------------------------------------------


def test_precision_state_groups_quantized_layers_by_bits():
    state = PrecisionState.of((FP, 4, 8, 4, FP, 8))
    assert state.quantized == ((4, (1, 3)), (8, (2, 5)))
    assert state.to_json() == {"4": [1, 3], "8": [2, 5]}
    assert state.any_quantized
    full = PrecisionState.of((FP,) * NUM_LAYERS)
    assert full == PrecisionState() and not full.any_quantized and full.to_json() == {}


def test_segments_merge_equal_neighbours_drop_empty_ranges_and_clip():
    fp, w4 = PrecisionState(), PrecisionState.of(bits_with({0: 4}))
    w8 = PrecisionState.of(bits_with({0: 8}))
    # No change: one segment of the current state.
    assert segments([], fp, 5) == [Segment(0, 5, fp)]
    # fp for 3 tokens, w4 for 4, fp again.
    assert segments([(3, fp), (7, w4)], fp, 10) == [
        Segment(0, 3, fp), Segment(3, 7, w4), Segment(7, 10, fp)]
    # Two changes at the same output length (no token between them): the empty range vanishes;
    # w4 -> w8 -> w4 with no token at w8 merges into one w4 segment.
    assert segments([(2, fp), (4, w4), (4, w8)], w4, 6) == [Segment(0, 2, fp), Segment(2, 6, w4)]
    # A change recorded past the final length (tokens a stop condition cut off) is clipped.
    assert segments([(3, fp), (9, w4)], fp, 5) == [Segment(0, 3, fp), Segment(3, 5, w4)]
    assert segments([(3, fp)], w4, 0) == []


def test_provenance_json_share_counts_tokens_under_any_quantized_layer():
    fp, w4 = PrecisionState(), PrecisionState.of(bits_with({1: 4, 2: 4}))
    p = provenance_json([Segment(0, 3, fp), Segment(3, 7, w4), Segment(7, 10, fp)], 10)
    assert p == {"quantized_token_share": 0.4, "quantized_tokens": 4, "output_tokens": 10,
                 "segments": [{"start": 0, "end": 3, "quantized_layers": {}},
                              {"start": 3, "end": 7, "quantized_layers": {"4": [1, 2]}},
                              {"start": 7, "end": 10, "quantized_layers": {}}]}
    check_provenance(p)
    empty = provenance_json([], 0)
    assert empty["quantized_token_share"] == 0.0 and empty["segments"] == []
    check_provenance(empty)
    with pytest.raises(AssertionError):
        check_provenance({**p, "quantized_tokens": 3})
    with pytest.raises(AssertionError):  # a gap between segments
        check_provenance({**p, "segments": [p["segments"][0], p["segments"][2]]})


class FakeReq:
    def __init__(self, produced: int = 0):
        self.output_ids = [0] * produced


def test_tracker_records_a_boundary_at_each_live_requests_output_length():
    tracker = ProvenanceTracker(bits_with({}))
    a, b, waiting = FakeReq(3), FakeReq(1), FakeReq(0)
    live = [a, b, waiting]
    calls = []

    def live_reqs():
        calls.append(1)
        return live

    # Unchanged bits: nothing recorded, and the live requests are not even listed.
    assert tracker.observe(bits_with({}), live_reqs) == 0 and not calls
    assert tracker.observe(bits_with({2: 4, 0: 4}), live_reqs) == 2  # waiting has no output
    a.output_ids += [0] * 4  # 7
    b.output_ids += [0] * 4  # 5
    waiting.output_ids += [0] * 2  # admitted after the swap: all its tokens at W4
    late = FakeReq(0)  # arrives later
    live.append(late)
    assert tracker.observe(bits_with({}), live_reqs) == 3  # restore; late has no output yet
    a.output_ids += [0] * 2  # 9
    late.output_ids += [0] * 2
    w4 = {"4": [0, 2]}

    def segs(req):
        p = tracker.report(req, len(req.output_ids))
        check_provenance(p)
        return [(s["start"], s["end"], s["quantized_layers"]) for s in p["segments"]]

    assert segs(a) == [(0, 3, {}), (3, 7, w4), (7, 9, {})]
    assert segs(b) == [(0, 1, {}), (1, 5, w4)]
    assert segs(waiting) == [(0, 2, w4)]
    assert segs(late) == [(0, 2, {})]
    assert tracker.report(a, 9)["quantized_token_share"] == 4 / 9
    # A request SGLang drops takes its record with it.
    live.remove(a)
    del a
    gc.collect()
    assert len(tracker._changes) == 2


def test_tracker_at_a_static_precision_map_reports_every_token_quantized():
    tracker = ProvenanceTracker(bits_with({1: 8}))
    req = FakeReq(4)
    p = tracker.report(req, 4)
    assert p["quantized_token_share"] == 1.0
    assert p["segments"] == [{"start": 0, "end": 4, "quantized_layers": {"8": [1]}}]


def test_meta_info_hook_sets_our_value_and_leaves_other_keys_to_sglang():
    seen = []

    def original(tm, meta_info, state, customized_info, index, finish_reason):
        seen.append(customized_info)
        meta_info.update({k: v[index] for k, v in customized_info.items()})

    value = {"quantized_token_share": 0.0}
    meta: dict = {}
    prov.meta_info_around(original, None, meta, None, {prov.KEY: [None, value]}, 1, {})
    assert meta == {prov.KEY: value} and seen == []  # nothing else to accumulate
    meta = {}
    prov.meta_info_around(original, None, meta, None, {prov.KEY: [None], "x": [[1]]}, 0, None)
    assert meta == {"x": [1]} and seen == [{"x": [[1]]}]  # not finished: no value yet


def test_openai_stream_ends_with_a_chunk_carrying_every_choices_provenance():
    """The stream and generate_request hooks together, on plain async generators."""
    outputs = [{"index": 0, "meta_info": {"id": "r0"}},
               {"index": 1, "meta_info": {"id": "r1", prov.KEY: {"c": 1}}},
               {"index": 0, "meta_info": {"id": "r0", prov.KEY: {"c": 0}}}]

    async def generate_request(tm, obj, request=None):
        for out in outputs:
            yield out

    async def chat_stream(serving, adapted_request, request, raw_request):
        async for out in prov.generate_request_around(generate_request, None, adapted_request,
                                                       raw_request):
            yield f"data: {json.dumps(out)}\n\n"
        yield "data: [DONE]\n\n"

    async def run(stream):
        return [chunk async for chunk in stream]

    adapted = SimpleNamespace()
    around = prov._stream_around("chat.completion.chunk")
    chunks = asyncio.run(run(around(chat_stream, None, adapted, SimpleNamespace(model="m"), None)))
    assert len(chunks) == 5 and chunks[-1] == "data: [DONE]\n\n"
    last = json.loads(chunks[-2][len("data: "):])
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert last["id"] == "r0" and last["model"] == "m"
    assert last["metadata"] == {prov.KEY: [{"c": 0}, {"c": 1}]}
    assert prov._watched == {}  # the watch ends with the stream
    # A request nobody watches gets SGLang's generator itself.
    gen = prov.generate_request_around(generate_request, None, SimpleNamespace())
    assert gen.ag_code is generate_request.__code__


def test_output_streamer_subclass_reports_finished_requests_only():
    """SGLang's own SchedulerOutputStreamer, subclassed as the scheduler hook does."""
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )

    tracker = ProvenanceTracker(bits_with({}))
    scheduler = SimpleNamespace(morph_runtime=SimpleNamespace(provenance=tracker))
    cls = prov.output_streamer_class(SchedulerOutputStreamer, scheduler)
    assert issubclass(cls, SchedulerOutputStreamer) and cls.has_additional_customized_info
    assert not SchedulerOutputStreamer.has_additional_customized_info  # SGLang's is unchanged
    streamer = cls(send_to_detokenizer=None, tree_cache=None, server_args=None,
                   is_generation=True, spec_algorithm=None, disaggregation_mode=None,
                   enable_hicache_storage=lambda: False)

    class Req(FakeReq):
        def __init__(self, produced, done):
            super().__init__(produced)
            self.output_ids_through_stop = self.output_ids[:produced - 1] if done else []
            self.done = done

        def finished(self):
            return self.done

    info = streamer.build_additional_customized_info([Req(3, False), Req(5, True)])
    assert info == {prov.KEY: [None, provenance_json([Segment(0, 4, PrecisionState())], 4)]}


# ----- live server ---------------------------------------------------------------------------

W4 = {"4": sorted(LAYERS)}


@pytest.fixture(scope="module")
def server(server_factory, engines_awq):
    srv = server_factory("--dtype", "float32", "--enable-morph", "--morph-engines",
                         str(engines_awq), "--disable-morph-controller")
    srv.engines = engines_awq
    return srv


def swap(server, layers, bits) -> dict:
    r = requests.post(f"{server.url}/morph/swap", json={"layers": layers, "bits": bits},
                      timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def generate(server, ids, n_new) -> dict:
    r = requests.post(f"{server.url}/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def prompt(seed: int, n_tokens: int = 32) -> list[int]:
    """Distinct prompts per seed (no radix-cache hit between them); token ids of the vocab's
    ordinary range, which greedy decoding continues without hitting EOS (ignore_eos anyway)."""
    return [1000 + (seed * 7919 + i * 104729) % 40000 for i in range(n_tokens)]


class Stream(runtime_test.Stream):
    """The runtime test's streamed greedy /generate, also keeping each chunk's arrival time
    with the tokens so far, and every chunk's meta_info."""

    def __init__(self, server, ids, n_new):
        self.chunks: list[tuple[float, int]] = []
        self.meta_infos: list[dict] = []
        super().__init__(server, ids, n_new)

    def _run(self, server, ids, n_new, fields):
        try:
            with requests.post(f"{server.url}/generate", stream=True, timeout=600, json={
                    "input_ids": ids, "stream": True, "sampling_params": {
                        "temperature": 0, "max_new_tokens": n_new, "ignore_eos": True},
                    **fields}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data:") and line != b"data: [DONE]":
                        chunk = json.loads(line[5:])
                        self.ids = list(chunk["output_ids"])
                        self.chunks.append((time.time(), len(self.ids)))
                        self.meta_infos.append(chunk["meta_info"])
        except BaseException as e:  # reported by join()
            self.error = e

    def tokens_arrived_before(self, t_unix_s: float) -> int:
        return max((n for t, n in self.chunks if t < t_unix_s), default=0)


def test_stream_across_swap_and_restore_reports_the_transitions_tokens(server,
                                                                      default_model_path):
    ids, n_new = prompt(1), 120
    stream = Stream(server, ids, n_new)
    stream.wait_for(10)
    seen_before_swap = len(stream.ids)
    swap(server, LAYERS, 4)
    stream.wait_for(len(stream.ids) + 15)
    seen_before_restore = len(stream.ids)
    status = swap(server, LAYERS, 16)
    out = stream.join()
    assert len(out) == n_new
    assert seen_before_restore < n_new, "the stream ended before the restore; lengthen it"

    # Only the last chunk carries it.
    assert all(prov.KEY not in m for m in stream.meta_infos[:-1])
    p = stream.meta_infos[-1][prov.KEY]
    check_provenance(p)  # consecutive segments, share = quantized segment tokens / total
    assert p["output_tokens"] == n_new == stream.meta_infos[-1]["completion_tokens"]
    segs = p["segments"]
    assert [s["quantized_layers"] for s in segs] == [{}, W4, {}]
    w4_start, w4_end = segs[1]["start"], segs[1]["end"]
    assert p["quantized_token_share"] == (w4_end - w4_start) / n_new
    # Each boundary lies after every token the client had before asking for the transition,
    # and equals the tokens that had arrived when the transition was recorded (within one:
    # a token produced just before the transition may arrive just after it is recorded).
    assert seen_before_swap <= w4_start and seen_before_restore <= w4_end
    swapped, restored = [t for t in status["transitions"] if t["source"] == "api"][-2:]
    assert (swapped["action"], restored["action"]) == ("swap", "restore")
    assert swapped["layers"] == restored["layers"] == LAYERS
    assert abs(w4_start - stream.tokens_arrived_before(swapped["time_unix_s"])) <= 1
    assert abs(w4_end - stream.tokens_arrived_before(restored["time_unix_s"])) <= 1
    # Exactly those tokens came from the W4 layers: transformers with W4 for them and full
    # precision for the others (one KV cache) produces the stream's tokens.
    assert out == transformers_schedule(default_model_path, server.engines, ids, n_new,
                                        quantized_until=w4_end, quantized_from=w4_start)


def test_non_streaming_native_and_openai_responses_carry_it(server):
    full = {"quantized_token_share": 0.0, "quantized_tokens": 0, "output_tokens": 6,
            "segments": [{"start": 0, "end": 6, "quantized_layers": {}}]}
    assert generate(server, prompt(2), 6)["meta_info"][prov.KEY] == full
    chat = {"model": "default", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{server.url}/v1/chat/completions", json=chat, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"][prov.KEY] == full
    r = requests.post(f"{server.url}/v1/chat/completions", json={**chat, "n": 2}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"][prov.KEY] == [full, full]  # one per choice

    swap(server, LAYERS, 4)
    try:
        quantized = {"quantized_token_share": 1.0, "quantized_tokens": 6, "output_tokens": 6,
                     "segments": [{"start": 0, "end": 6, "quantized_layers": W4}]}
        assert generate(server, prompt(3), 6)["meta_info"][prov.KEY] == quantized
        r = requests.post(f"{server.url}/v1/completions", timeout=600, json={
            "model": "default", "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["metadata"][prov.KEY] == quantized
        # A streamed chat: one last chunk before [DONE], with no choices, carries it.
        with requests.post(f"{server.url}/v1/chat/completions", stream=True, timeout=600,
                           json={**chat, "stream": True}) as r:
            r.raise_for_status()
            lines = [line for line in r.iter_lines() if line.startswith(b"data:")]
        assert lines[-1] == b"data: [DONE]"
        last = json.loads(lines[-2][5:])
        assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
        assert last["metadata"] == {prov.KEY: quantized}
        assert all(b"morph_precision" not in line for line in lines[:-2])
    finally:
        swap(server, LAYERS, 16)
