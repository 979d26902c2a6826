"""MorphServe under SGLang pipeline parallelism: ``--enable-morph --pp-size 2``.

One PP 2 server (float32, greedy, even split: layers 0-14 and 15-29) with a precision map that
quantizes layers on both stages, unequal stage budgets (``--morph-stage-budgets``) and the
controller on (stage 0's decides, walking the LIS swap order), against one PP 1 server with the
same map. Each PP rank runs one torch thread here, so the reference does too
(``OMP_NUM_THREADS=1``): then PP 2 is bit-identical to PP 1 (tests/parallel/test_parallel.py).

- greedy tokens equal PP 1 token for token; ``/morph/status`` reports both stages;
- each stage's ``weight_bytes`` equals the SplitQuant memory model (``models/memory.py``) to the
  byte, and the common KV capacity is the tightest stage's budget in whole tokens;
- a swap of 8 layers (3 on stage 0, 5 on stage 1) to W4 while a request streams grows the KV
  capacity on both stages alike, the stream finishes, the restore gives the exact capacity back
  and greedy outputs after it equal those before;
- a swap one stage refuses changes nothing on any stage;
- under a burst, stage 0's controller swaps layers of both stages in the global LIS order,
  every stage records the same transitions with the same KV capacities, and the controller
  restores every layer when quiet, to the exact capacity;
- unsupported launches (``--nnodes`` without PP or beyond the stages, ``--tp-size 3`` with PP,
  a budget count that is not the stage count) stop in the launcher with one line.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import requests

# (corpus_ids and tokenizer are that module's fixtures; status/swap send keys this server ignores)
from conftest import REPO_ROOT
from test_morph_runtime_server import (  # noqa: F401
    ADMIN,
    USER,
    Stream,
    corpus_ids,
    generate_ids,
    prompt_ids,
    status,
    swap,
    tokenizer,
)

PRECISION_MAP = "0-3:4,20-23:8"  # W4 on stage 0, W8 on stage 1
STAGE_BUDGETS = ("330MB", "320MB")  # stage 1 is the tighter one
SWAPPED = [17, 14, 13, 15, 12, 25, 16, 26]  # the first 8 of the LIS order: 3 + 5 per stage
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
COMMON = ("--dtype", "float32", "--enable-morph", "--morph-precision-map", PRECISION_MAP)
LIS_ORDER = REPO_ROOT / "benchmark" / "results" / "swap_order.json"  # starts with SWAPPED


def map_bits(layer: int) -> int:
    return 4 if layer <= 3 else 8 if 20 <= layer <= 23 else 16


@pytest.fixture(scope="module")
def pp2_log(tmp_path_factory):
    return tmp_path_factory.mktemp("pp2_log") / "transitions.jsonl"


@pytest.fixture(scope="module")
def pp2(server_factory, engines_awq, pp2_log):
    # (the controller is on: stage 0's decides; the operator's swaps below pin their layers)
    return server_factory(*COMMON, "--morph-engines", str(engines_awq), "--pp-size", "2",
                          "--morph-stage-budgets", ",".join(STAGE_BUDGETS),
                          "--morph-swap-order", str(LIS_ORDER), "--morph-log", str(pp2_log))


def one_rank_with_the_map(server_factory, engines_awq):
    """One rank, one thread, the same precision map, the controller off: the reference of the
    PP 2 server here and of the TP 3 server in test_morph_tp."""
    return server_factory(*COMMON, "--morph-engines", str(engines_awq), "--max-total-tokens",
                          "4096", "--disable-morph-controller", env=ONE_THREAD)


# What test_morph_tp compares its TP 3 server with, recorded from the one-rank server once per
# test run (here when this module runs first): greedy tokens and their logprobs for the
# first prompts below, and the bytes of the variants it staged.
ONE_RANK_WITH_THE_MAP: dict = {}
# It lives in this process: test_morph_tp runs in the same test process.
pytestmark = pytest.mark.xdist_group("one_rank_with_the_map")
REFERENCE_SEEDS = range(2)


def reference_prompt(corpus_ids, seed: int) -> list[int]:
    return prompt_ids(corpus_ids, seed, 24 + 8 * seed)


def greedy_with_logprobs(server, ids, n_new) -> tuple[list[int], list[float]]:
    r = requests.post(f"{server.url}/generate", headers=USER, timeout=600, json={
        "input_ids": ids, "return_logprob": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": n_new, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], [lp for lp, _tok, _text in body["meta_info"]["output_token_logprobs"]]


def record_one_rank_with_the_map(server, corpus_ids) -> dict:
    if not ONE_RANK_WITH_THE_MAP:
        ONE_RANK_WITH_THE_MAP.update(
            greedy={seed: greedy_with_logprobs(server, reference_prompt(corpus_ids, seed), 16)
                    for seed in REFERENCE_SEEDS},
            staged_variants_host_bytes=status(server)["staged_variants_host_bytes"])
    return ONE_RANK_WITH_THE_MAP


@pytest.fixture(scope="module")
def pp1(server_factory, engines_awq, corpus_ids):
    server = one_rank_with_the_map(server_factory, engines_awq)
    record_one_rank_with_the_map(server, corpus_ids)
    return server


def test_pp2_with_a_precision_map_equals_pp1_token_for_token(pp2, pp1, corpus_ids):
    prompts = [reference_prompt(corpus_ids, seed) for seed in range(3)]
    got = [generate_ids(pp2, ids, 16) for ids in prompts]
    want = [generate_ids(pp1, ids, 16) for ids in prompts]
    assert got == want
    s = status(pp2)
    assert [layer["bits"] for layer in s["layers"]] == [map_bits(i) for i in range(30)]
    assert [st["layer_range"] for st in s["stages"]] == [[0, 14], [15, 29]]
    assert [st["layer_bits"] for st in s["stages"]] == [
        [map_bits(i) for i in range(15)], [map_bits(i) for i in range(15, 30)]]
    # Precision provenance names both stages' quantized layers, as one rank reports them.
    for server in (pp2, pp1):
        r = requests.post(f"{server.url}/generate", timeout=600, json={
            "input_ids": prompts[0],
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["morph_precision"]["segments"] == [
            {"start": 0, "end": 4, "quantized_layers": {"4": [0, 1, 2, 3],
                                                       "8": [20, 21, 22, 23]}}], server.url


def test_stage_memory_equals_the_plan_memory_model(pp2, default_model_path):
    from sglang_morph.morph.config import parse_bytes
    from sglang_morph.models.memory import MemoryModel
    from sglang_morph.models.spec import ModelSpec
    from sglang_morph.models.workload import Workload

    memory = MemoryModel.from_spec(ModelSpec.from_model_dir(default_model_path, dtype_bytes=4),
                                   layout="cpu")
    s = status(pp2)
    capacities = []
    for stage, (first, last), budget in zip(s["stages"], ([0, 14], [15, 29]), STAGE_BUDGETS):
        layers = range(first, last + 1)
        predicted = memory.stage_memory(layers, [map_bits(i) for i in layers], Workload(1, 1, 1),
                                        first=first == 0, last=last == 29)
        assert stage["weight_bytes"] == predicted.weight_bytes, stage
        assert stage["memory_budget_bytes"] == parse_bytes(budget, "budget")
        assert stage["kv_bytes_per_token"] == len(layers) * memory.model.kv_bytes_per_token_per_layer()
        assert stage["weight_bytes"] + stage["kv_bytes"] <= stage["memory_budget_bytes"]
        capacities.append(memory.kv_capacity_tokens(stage["memory_budget_bytes"],
                                                    predicted.weight_bytes, len(layers)))
    # one capacity for the pipeline: the tightest stage's (stage 1 here)
    assert capacities[1] < capacities[0]
    assert [st["kv_capacity_tokens"] for st in s["stages"]] == [capacities[1]] * 2
    assert s["kv_capacity_tokens"] == capacities[1]
    assert s["weight_bytes"] == sum(st["weight_bytes"] for st in s["stages"])


def swap_mid_stream_and_restore(server, corpus_ids, start_bits) -> None:
    """Swap SWAPPED (3 layers of stage 0, 5 of stage 1) to W4 while a request streams, then
    restore them: the capacity grows on every stage alike, the stream finishes, the restore
    is exact and greedy outputs equal those before. ``start_bits``: every layer's bits before."""
    prompts = [prompt_ids(corpus_ids, 10 + seed, 32) for seed in range(3)]
    before = [generate_ids(server, ids, 24) for ids in prompts]
    start = status(server)
    ids = prompt_ids(corpus_ids, 20, 48)
    reference = generate_ids(server, ids, 120)
    stream = Stream(server, ids, 120)
    stream.wait_for(15)
    tokens_before_swap = list(stream.ids)

    r = swap(server, SWAPPED, 4)
    assert r.status_code == 200, r.text
    s = r.json()
    assert [layer["bits"] for layer in s["layers"]] == [
        4 if i in SWAPPED else start_bits[i] for i in range(30)]
    grown = s["kv_capacity_tokens"] - start["kv_capacity_tokens"]
    assert grown > 0
    for st, st0 in zip(s["stages"], start["stages"]):
        assert st["kv_capacity_tokens"] == s["kv_capacity_tokens"]  # both stages alike
        assert st["weight_bytes"] < st0["weight_bytes"] and st["kv_bytes"] > st0["kv_bytes"]
        assert st["weight_bytes"] + st["kv_bytes"] <= st["memory_budget_bytes"]
    # the tighter stage after the swap decides: its budget has less than a token left
    assert min(st["free_budget_bytes"] // st["kv_bytes_per_token"] for st in s["stages"]) == 0
    swaps = [t for t in s["transitions"] if t["action"] == "swap" and t["source"] == "api"]
    assert sorted(i for t in swaps[-2:] for i in t["layers"]) == sorted(SWAPPED)
    stream.wait_for(len(tokens_before_swap) + 30)

    r = swap(server, SWAPPED, 16)
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["kv_capacity_tokens"] == start["kv_capacity_tokens"]
    for st, st0 in zip(s["stages"], start["stages"]):
        for key in ("kv_capacity_tokens", "weight_bytes", "kv_bytes", "free_budget_bytes"):
            assert st[key] == st0[key], (key, st, st0)
    out = stream.join()
    assert len(out) == 120 and stream.finish_reason["type"] == "length"
    assert out[:len(tokens_before_swap)] == reference[:len(tokens_before_swap)]
    assert [generate_ids(server, p, 24) for p in prompts] == before
    assert [layer["bits"] for layer in status(server)["layers"]] == list(start_bits)


def test_swap_mid_stream_under_pp2_grows_both_stages_and_restore_is_exact(pp2, corpus_ids):
    swap_mid_stream_and_restore(pp2, corpus_ids, [map_bits(i) for i in range(30)])


def test_each_stage_logs_its_own_part_of_a_swap_and_says_which_stage(pp2, pp2_log):
    """Both stages append to the one --morph-log file; each line names its stage and holds
    only that stage's layers (layers 0-14 on stage 0, 15-29 on stage 1)."""
    lines = [json.loads(line) for line in pp2_log.read_text().splitlines()]
    swaps = [t for t in lines if t["action"] == "swap"]
    assert {t["pp_stage"] for t in swaps} == {0, 1}, lines
    for t in lines:
        assert t["replica"] == 0 and t["pp_stage"] in (0, 1)
        stage_layers = range(0, 15) if t["pp_stage"] == 0 else range(15, 30)
        assert set(t["layers"]) <= set(stage_layers), t


def test_the_operator_view_shows_both_stages(pp2):
    """``sglang-morph top --once`` against this PP 2 server: one panel with both stages, each
    with its own layers and KV."""
    from click.testing import CliRunner

    from sglang_morph.console.main import main
    from sglang_morph.console.view import precision_label

    frame = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["top", "--once", "--url", pp2.url])
    assert frame.exit_code == 0, frame.output
    assert "(2 pipeline stages)" in frame.output, frame.output
    assert "stage 0 (layers 0-14)" in frame.output and "stage 1 (layers 15-29)" in frame.output
    bits = {layer["index"]: layer["bits"] for layer in status(pp2)["layers"]}
    for layer in (0, 14, 15, 29):  # the first and last layer of each stage, as it is served
        label = re.compile(rf"(?<!\d){layer}:{precision_label(bits[layer])}")
        assert label.search(frame.output), frame.output


def test_a_swap_one_stage_refuses_changes_nothing_on_any_stage(pp2):
    start = status(pp2)
    # layer 2 (stage 0) is at W4 and goes up only to 16: stage 0 refuses W8 for it, so layer
    # 27 (stage 1, at 16), which stage 1 alone would move, must stay too.
    r = swap(pp2, [2, 27], 8)
    assert r.status_code == 400, r.text
    assert "stage 0" in r.json()["error"] and "below 8 bits" in r.json()["error"]
    s = status(pp2)
    for key in ("layers", "kv_capacity_tokens", "weight_bytes", "kv_bytes"):
        assert s[key] == start[key], key
    assert [st["layer_bits"] for st in s["stages"]] == [st["layer_bits"] for st in start["stages"]]


def start_burst(server, corpus_ids, seeds, prompt, new) -> tuple[list, dict[int, int]]:
    """One greedy /generate of ``prompt`` tokens per seed, all at once (a thread each);
    returns the threads and, once they ended, each seed's output length (-1: an error)."""
    outputs: dict[int, int] = {}

    def one(seed):
        r = requests.post(f"{server.url}/generate", headers=USER, timeout=900, json={
            "input_ids": prompt_ids(corpus_ids, seed, prompt), "sampling_params": {
                "temperature": 0, "max_new_tokens": new, "ignore_eos": True}})
        outputs[seed] = len(r.json()["output_ids"]) if r.status_code == 200 else -1

    threads = [threading.Thread(target=one, args=(seed,)) for seed in seeds]
    for th in threads:
        th.start()
    return threads, outputs


def test_stage0s_controller_swaps_both_stages_alike_and_restores_when_quiet(pp2, corpus_ids):
    # hand the layers the operator's swaps above pinned back to the controller
    r = requests.post(f"{pp2.url}/morph/swap", headers=ADMIN, timeout=600,
                      json={"layers": SWAPPED, "bits": 16, "pin": False})
    assert r.status_code == 200 and r.json()["pinned_layers"] == [], r.text
    start = r.json()
    assert start["controller"] is True
    assert start["pipeline_parallel"]["controller"].startswith("stage 0 decides")
    # the LIS order without the layers the precision map holds: the controller's order
    order = [i for i in start["swap_order"] if map_bits(i) == 16]
    assert order[:3] == [17, 14, 13]  # 17 on stage 1, 14 and 13 on stage 0
    # 6 requests that fill 90% of the pool: their prompts alone are over 0.8 of it
    # (kv_usage_high), and none waits for KV
    n_reqs, new = 6, 24
    prompt = int(0.9 * start["kv_capacity_tokens"] / n_reqs) - new
    assert n_reqs * prompt > 0.8 * start["kv_capacity_tokens"]
    threads, outputs = start_burst(pp2, corpus_ids, range(30, 30 + n_reqs), prompt, new)
    for th in threads:
        th.join()
    assert sorted(outputs.values()) == [new] * n_reqs
    # quiet now: the controller gives every layer back (10 s of quiet per restore of 3 layers)
    deadline = time.monotonic() + 120
    while True:
        s = status(pp2)
        controller = [t for t in s["transitions"] if t["source"] == "controller"]
        if controller and [layer["bits"] for layer in s["layers"]] == \
                [layer["bits"] for layer in start["layers"]]:
            break
        assert time.monotonic() < deadline, (s["layers"], controller)
        time.sleep(2)
    for st, st0 in zip(s["stages"], start["stages"]):
        for key in ("kv_capacity_tokens", "weight_bytes", "kv_bytes", "free_budget_bytes"):
            assert st[key] == st0[key], (key, st, st0)
    # every stage recorded the same transitions (its own layers of each), with the same KV
    # capacities before and after: the one capacity of the pipeline
    per_stage = [[t for t in controller if t["stage"] == k] for k in (0, 1)]
    assert len(per_stage[0]) == len(per_stage[1]) >= 2, controller
    moved: list[int] = []
    for t0, t1 in zip(*per_stage):
        for key in ("action", "to_bits", "kv_capacity_tokens_before", "kv_capacity_tokens_after"):
            assert t0[key] == t1[key], (key, t0, t1)
        assert all(i <= 14 for i in t0["layers"]) and all(i >= 15 for i in t1["layers"])
        if t0["action"] == "swap":
            moved += [*t0["layers"], *t1["layers"]]
    assert [t["action"] for t in per_stage[0]][0] == "swap"
    assert per_stage[0][-1]["action"] == "restore"
    # the swaps took a prefix of the global order (some of each stage's layers)
    assert sorted(moved) == sorted(order[:len(moved)])
    assert any(i <= 14 for i in moved) and any(i >= 15 for i in moved)


def test_the_leaders_action_goes_out_once_and_it_waits_for_it():
    """parallel/relay.py without a server: what the hook on _poll_timeout_aborts adds."""
    import types

    from sglang_morph.morph.control.controller import SwapLayers
    from sglang_morph.morph.parallel.relay import ActionRelay
    from sglang_morph.morph.mechanism import _after_poll_timeout_aborts

    relay = ActionRelay(leads=True)
    scheduler = types.SimpleNamespace(morph_runtime=types.SimpleNamespace(relay=relay))
    assert relay.decides() and _after_poll_timeout_aborts(["abort"], scheduler) == ["abort"]
    relay.send(SwapLayers((17, 14, 13), 8, "kv_usage 0.85 >= 0.80"))
    assert not relay.decides()
    with pytest.raises(RuntimeError):
        relay.send(SwapLayers((15,), 8, "again"))  # one action at a time
    out = _after_poll_timeout_aborts(["abort"], scheduler)
    assert out[0] == "abort" and len(out) == 2
    assert (out[1].layers, out[1].bits, out[1].pipeline_stages) == ([17, 14, 13], 8, [])
    assert _after_poll_timeout_aborts([], scheduler) == []  # out once
    assert not relay.decides()  # until it came back through the dispatcher
    relay.received()
    assert relay.decides()
    follower = ActionRelay(leads=False)
    assert not follower.decides()
    with pytest.raises(RuntimeError):
        follower.send(SwapLayers((17,), 8, "a follower never decides"))


@pytest.fixture(scope="module")
def parse(default_model_path):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    return lambda *flags: prepare_server_args(["--model-path", str(default_model_path),
                                               "--enable-morph", *flags])


NODES = ("--node-rank", "0", "--dist-init-addr", "127.0.0.1:29555")


@pytest.mark.parametrize("flags,line", [
    (("--tp-size", "3", "--nnodes", "3", *NODES),
     "--enable-morph with --nnodes 3 supports pipeline stages across nodes only"),
    (("--pp-size", "2", "--nnodes", "4", *NODES),
     "--enable-morph with --nnodes 4 supports pipeline stages across nodes only"),
    (("--pp-size", "2", "--tp-size", "3"),
     "--enable-morph does not support --tp-size and --pp-size together yet"),
    (("--pp-size", "2", "--morph-stage-budgets", "1GB"),
     "--morph-stage-budgets has 1 budgets for --pp-size 2"),
    (("--pp-size", "2", "--morph-stage-budgets", "1GB,1GB", "--morph-memory-budget", "1GB"),
     "--morph-memory-budget and --morph-stage-budgets exclude each other"),
])
def test_unsupported_pipeline_configurations_are_refused(parse, flags, line):
    from sglang_morph.surface import PluginError

    with pytest.raises(PluginError) as e:
        parse(*flags)
    assert str(e.value) == f"sglang-morph: error: {line}" or line in str(e.value)
    assert "\n" not in str(e.value)


def test_pipeline_flags_parse(parse):
    from sglang_morph.morph import config as morph_config

    args = parse("--pp-size", "2", "--morph-stage-budgets", "300MB,1GiB")
    assert morph_config.get(args).stage_budget_bytes == (300 * 10**6, 2**30)
    assert morph_config.get(args).controller_enabled  # stage 0's controller decides
    # the launcher's pool is an upper bound the stages trim: the tighter budget over 15 layers
    # of bf16 KV (2 x 3 heads x 64 x 2 bytes per layer and token), no weights subtracted
    assert args.max_total_tokens == 300 * 10**6 // (15 * 2 * 3 * 64 * 2)
