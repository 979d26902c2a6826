"""The live view's renderer on status answers: recorded from a one-rank MorphServe server
(``data/``: layer 14 swapped to W4 and 17 swapped and restored, both pinned), and for the
parallel layouts built from them by the code that builds those answers (the pipeline's
``merge_status``) or as the routes document them (DP replicas, TP, KunServe, AMOEBAs)."""

from __future__ import annotations

import copy
import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from fake_server import FakeServer
from sglang_morph.console.client import Client, ServerError
from sglang_morph.console.top import poll
from sglang_morph.console.view import Frame, layers_text, render, transitions
from sglang_morph.morph.parallel.pipeline import merge_status

DATA = Path(__file__).resolve().parent / "data"
URL = "http://127.0.0.1:30000"
T0 = 1_795_770_338.0  # the recorded transitions' time


def recorded(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def screen(renderable, width: int = 200) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def with_bits(status: dict, bits_by_layer: dict[int, int], pinned=()) -> dict:
    out = copy.deepcopy(status)
    for layer in out["layers"]:
        if layer["index"] in bits_by_layer:
            layer["bits"] = bits_by_layer[layer["index"]]
        layer["pinned"] = layer["index"] in pinned
    out["quantized_layers"] = sum(layer["bits"] != 16 for layer in out["layers"])
    return out


def elastic_of(*replicas: dict, mechanism="morph") -> dict:
    """``/elastic/status`` with the recorded morph entry once per replica."""
    entry = recorded("elastic_status")["replicas"][0]["mechanisms"]["morph"]
    return {"mechanisms": [mechanism], "replicas": [
        {"replica": r, "mechanisms": {mechanism: {**copy.deepcopy(entry), **extra}}}
        for r, extra in enumerate(replicas)]}


# ---- one rank, recorded -----------------------------------------------------------------------


def test_recorded_one_rank_frame():
    frame = Frame(URL, T0, recorded("elastic_status"), {"morph": recorded("morph_status")},
                  recorded("loads"))
    text = screen(render(frame))
    assert "mechanisms: morph" in text
    assert "queue  replica 0: 0 waiting, 0 running" in text
    # every layer's precision, pinned ones starred
    assert "13:FP 14:W4* 15:FP 16:FP 17:FP* 18:FP" in text
    assert "1 of 30 layers quantized (FP 29, W4 1)" in text
    # KV use and capacity, the capacity at start, the budget
    assert "KV 0 / 1,557 tokens (0%) | at start 1,297" in text
    assert "budget 600.0 MB: weights 528.2 MB, KV 71.7 MB" in text
    # both transitions, oldest first, with the KV capacity each changed
    assert "transitions applied 2, refused 0, failed 0" in text
    swap_at = text.index("layers 17,14 -> W4")
    restore_at = text.index("layers 17 -> FP")
    assert swap_at < restore_at
    assert "1,297 -> 1,817" in text and "1,817 -> 1,557" in text
    assert "POST /morph/swap" in text


def test_fewer_transitions_shown_keeps_the_newest():
    frame = Frame(URL, T0, recorded("elastic_status"), {"morph": recorded("morph_status")})
    text = screen(render(frame, transitions_shown=1))
    assert "layers 17 -> FP" in text and "layers 17,14" not in text


def test_layers_text_labels_and_pins():
    text = layers_text([{"index": 0, "bits": 16, "pinned": False},
                        {"index": 1, "bits": 8, "pinned": True},
                        {"index": 2, "bits": 4, "pinned": False}])
    assert text.plain == "0:FP 1:W8* 2:W4"
    assert [span.style for span in text.spans] == ["green", "yellow", "magenta"]


def test_a_refused_transition_shows_its_error():
    elastic = recorded("elastic_status")
    refused = dict(elastic["replicas"][0]["mechanisms"]["morph"]["transitions"]["recent"][-1],
                   action="restore", outcome="refused", time_unix_s=T0 + 60,
                   error="live requests hold the KV tokens it must give back")
    elastic["replicas"][0]["mechanisms"]["morph"]["transitions"]["recent"].append(refused)
    text = screen(render(Frame(URL, T0, elastic)))
    assert "morph restore refused" in text
    assert "live requests hold the KV tokens it must give back" in text


# ---- parallel layouts -------------------------------------------------------------------------


def test_data_parallel_replicas_each_get_their_panel():
    one = recorded("morph_status")
    two = with_bits(one, {3: 8, 4: 8}, pinned={3, 4})
    two.update(replica=1, kv_capacity_tokens=2_000, kv_used_tokens=500)
    loads = {"loads": [{"dp_rank": 0, "num_waiting_reqs": 0, "num_running_reqs": 1},
                       {"dp_rank": 1, "num_waiting_reqs": 4, "num_running_reqs": 2}]}
    frame = Frame(URL, T0, elastic_of({}, {}), {"morph": {"replicas": [one, two]}}, loads)
    text = screen(render(frame))
    panel_0, panel_1 = text.split("morph replica 1")
    assert "morph replica 0" in panel_0 and "14:W4*" in panel_0 and "3:FP 4:FP" in panel_0
    assert "3:W8* 4:W8*" in panel_1 and "KV 500 / 2,000 tokens (25%)" in panel_1
    assert "replica 1: 4 waiting, 2 running" in text
    # transitions of both replicas
    assert len(transitions(frame.elastic)) == 4


def test_pipeline_stages_show_every_stage_and_all_layers():
    """Two stages merged by the pipeline's own ``merge_status``: stage 1 swapped layer 20."""
    base = recorded("morph_status")
    stages = []
    for stage, (first, last), status in ((0, (0, 14), base),
                                         (1, (15, 29), with_bits(base, {20: 4}, {20}))):
        s = copy.deepcopy(status)
        s.update(stage=stage, layer_range=[first, last],
                 layer_bits=[layer["bits"] for layer in s["layers"][first:last + 1]],
                 pinned_layers=[i for i in s["pinned_layers"] if first <= i <= last],
                 kv_capacity_tokens=1_000 + stage, kv_used_tokens=10 * stage,
                 transitions=[dict(t, stage=stage) for t in s["transitions"]])
        stages.append(s)
    merged = merge_status(stages)
    frame = Frame(URL, T0, recorded("elastic_status"), {"morph": merged})
    text = screen(render(frame))
    assert "morph (2 pipeline stages)" in text
    # layer 14 from stage 0, layer 20 from stage 1
    assert "14:W4*" in text and "20:W4*" in text
    assert "stage 0 (layers 0-14): KV 0 / 1,000 tokens" in text
    assert "stage 1 (layers 15-29): KV 10 / 1,001 tokens" in text


def test_tensor_parallel_says_whose_figures():
    status = dict(recorded("morph_status"), tensor_parallel={
        "tp_size": 3, "tp_rank": 0, "variant_shards": "sliced", "controller": "rank 0"})
    text = screen(render(Frame(URL, T0, recorded("elastic_status"), {"morph": status})))
    assert "tensor parallel: 3 ranks; figures are rank 0's" in text
    assert "14:W4*" in text


# ---- the other mechanisms ---------------------------------------------------------------------


def test_kunserve_groups_and_layers_held():
    def replica(r, layers, peer):
        return {"replica": r, "group": [0, 1], "layers": layers, "num_layers": 30,
                "kv_capacity_tokens": 1_800, "kv_used_tokens": 900,
                "peer_kv_capacity_tokens": peer,
                "load": {"kv_used_tokens": 900, "waiting_reqs": 3, "running_reqs": 2},
                "auto": {"enabled": True, "role": "leader" if r == 0 else "follower"},
                "transitions": []}

    answer = {"groups": [[0, 1]], "replicas": [replica(0, [0, 16], 400),
                                               replica(1, [16, 30], 400)]}
    elastic = {"mechanisms": ["kunserve"], "replicas": [
        {"replica": r, "mechanisms": {"kunserve": {"state": {}, "transitions": {
            "totals": {"applied": 1}, "recent": [
                {"mechanism": "kunserve", "replica": r, "action": "drop", "outcome": "applied",
                 "reason": "KV short", "duration_s": 0.5, "capacity_before_tokens": 910,
                 "capacity_after_tokens": 1_800, "time_unix_s": T0, "error": "",
                 "detail": {"layers": [0, 16]}}]}}}} for r in (0, 1)]}
    text = screen(render(Frame(URL, T0, elastic, {"kunserve": answer})))
    assert "groups [[0, 1]] (merged: dropped layers, pipeline)" in text
    assert "0-15 of 30" in text and "16-29 of 30" in text
    assert "900 / 1,800 tokens (50%)" in text and "leader" in text and "follower" in text
    assert "kunserve drop" in text and "910 -> 1,800" in text


def test_amoebas_units_heads_and_rows():
    answer = {"units": [[0, 1], [2]], "replicas": [
        {"replica": r, "group": [0, 1] if r < 2 else [2], "degree": 2 if r < 2 else 1,
         "kv_heads": [0, 2] if r == 0 else [2, 3] if r == 1 else [0, 3],
         "ffn_rows": [0, 768] if r == 0 else [768, 1536] if r == 1 else [0, 1536],
         "kv_capacity_tokens": 5_632 if r < 2 else 1_024, "kv_used_tokens": 100,
         "released_ffn_bytes": 212_336_640 if r < 2 else 0} for r in range(3)]}
    text = screen(render(Frame(URL, T0, {"mechanisms": ["amoebas"], "replicas": []},
                               {"amoebas": answer})))
    assert "units [[0, 1], [2]]" in text
    assert "768-1536" in text and "100 / 5,632 tokens" in text and "212.3 MB" in text


def test_mechanism_without_its_route_shows_its_elastic_state():
    elastic = {"mechanisms": ["toy"], "replicas": [{"replica": 0, "mechanisms": {"toy": {
        "state": {"level": 3}, "transitions": {"totals": {}, "recent": []}}}}]}
    text = screen(render(Frame(URL, T0, elastic)))
    assert "toy" in text and "replica 0: level=3" in text


def test_server_without_mechanisms_and_failed_routes():
    text = screen(render(Frame(URL, T0, loads=recorded("loads"))))
    assert "mechanisms: none" in text and "no elastic mechanism is enabled" in text
    text = screen(render(Frame(URL, T0, recorded("elastic_status"), errors={
        "/morph/status": "GET .../morph/status answered 500: boom"})))
    assert "/morph/status: GET .../morph/status answered 500: boom" in text


# ---- one poll against a stand-in server -------------------------------------------------------


@pytest.fixture
def fake():
    server = FakeServer({
        ("GET", "/elastic/status"): (200, recorded("elastic_status")),
        ("GET", "/morph/status"): (500, {"error": "RuntimeError: boom"}),
        ("GET", "/v1/loads?include=core"): (200, recorded("loads")),
    })
    yield server
    server.close()


def test_poll_keeps_a_failed_route_as_an_error(fake):
    frame = poll(Client(fake.url), clock=lambda: T0)
    assert frame.elastic == recorded("elastic_status") and frame.mechanisms == {}
    assert frame.loads == recorded("loads") and frame.time_unix_s == T0
    assert frame.errors == {"/morph/status": f"GET {fake.url}/morph/status answered 500: "
                                             f"RuntimeError: boom"}
    text = screen(render(frame))
    assert "answered 500: RuntimeError: boom" in text
    assert "transitions applied 2" in text  # what did answer is still shown


def test_poll_asks_the_mechanism_and_queue_routes_at_once(fake):
    # Each route answers after 0.8 s, as a busy server's: one after the other a poll would
    # take 2.4 s (longer than top's one-second interval); the two after /elastic/status go
    # out together, 1.6 s in all (the bound leaves 0.6 s for a loaded two-core machine).
    fake.routes[("GET", "/morph/status")] = (200, {"replicas": []})
    fake.delays = {route: 0.8 for route in fake.routes}
    started = time.monotonic()
    frame = poll(Client(fake.url))
    took_s = time.monotonic() - started
    assert frame.errors == {} and frame.mechanisms == {"morph": {"replicas": []}}
    assert 1.6 <= took_s < 2.2, f"{took_s:.2f} s"


def test_poll_of_a_server_without_mechanisms(fake):
    fake.routes[("GET", "/elastic/status")] = (503, {"error": "not running"})
    frame = poll(Client(fake.url), strict=True)
    assert frame.elastic is None and frame.errors == {} and frame.loads is not None
    fake.routes[("GET", "/elastic/status")] = (401, {"error": "Unauthorized"})
    with pytest.raises(ServerError, match="answered 401"):
        poll(Client(fake.url), strict=True)
    assert "/elastic/status" in poll(Client(fake.url)).errors
