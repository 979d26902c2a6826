"""MorphServe under SGLang pipeline parallelism (issue 11, PP): ``--enable-morph --pp-size 2``.

One PP 2 server (float32, greedy, even split: layers 0-14 and 15-29) with a precision map that
quantizes layers on both stages and unequal stage budgets (``--morph-stage-budgets``), against
one PP 1 server with the same map. Each PP rank runs one torch thread here, so the reference
does too (``OMP_NUM_THREADS=1``): then PP 2 is bit-identical to PP 1 (tests/test_parallel.py).

- greedy tokens equal PP 1 token for token; ``/morph/status`` reports both stages;
- each stage's ``weight_bytes`` equals the SplitQuant memory model (``plan/memory.py``) to the
  byte, and the common KV capacity is the tightest stage's budget in whole tokens;
- a swap of 8 layers (3 on stage 0, 5 on stage 1) to W4 while a request streams grows the KV
  capacity on both stages alike, the stream finishes, the restore gives the exact capacity back
  and greedy outputs after it equal those before;
- a swap one stage refuses changes nothing on any stage;
- unsupported launches (``--nnodes 2``, ``--tp-size 3`` with PP, PP with the controller on, a
  budget count that is not the stage count) stop in the launcher with one line.
"""

from __future__ import annotations

import pytest

# (corpus_ids and tokenizer are that module's fixtures; status/swap send keys this server ignores)
from test_morph_runtime_server import (  # noqa: F401
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
COMMON = ("--dtype", "float32", "--enable-morph", "--disable-morph-controller",
          "--morph-precision-map", PRECISION_MAP)


def map_bits(layer: int) -> int:
    return 4 if layer <= 3 else 8 if 20 <= layer <= 23 else 16


@pytest.fixture(scope="module")
def pp2(server_factory, engines_awq):
    return server_factory(*COMMON, "--morph-engines", str(engines_awq), "--pp-size", "2",
                          "--morph-stage-budgets", ",".join(STAGE_BUDGETS))


@pytest.fixture(scope="module")
def pp1(server_factory, engines_awq):
    return server_factory(*COMMON, "--morph-engines", str(engines_awq), "--max-total-tokens",
                          "4096", env=ONE_THREAD)


def test_pp2_with_a_precision_map_equals_pp1_token_for_token(pp2, pp1, corpus_ids):
    prompts = [prompt_ids(corpus_ids, seed, 24 + 8 * seed) for seed in range(3)]
    got = [generate_ids(pp2, ids, 16) for ids in prompts]
    want = [generate_ids(pp1, ids, 16) for ids in prompts]
    assert got == want
    s = status(pp2)
    assert [layer["bits"] for layer in s["layers"]] == [map_bits(i) for i in range(30)]
    assert [st["layer_range"] for st in s["stages"]] == [[0, 14], [15, 29]]
    assert [st["layer_bits"] for st in s["stages"]] == [
        [map_bits(i) for i in range(15)], [map_bits(i) for i in range(15, 30)]]


def test_stage_memory_equals_the_plan_memory_model(pp2, default_model_path):
    from sglang_morph.config import parse_bytes
    from sglang_morph.plan.memory import MemoryModel
    from sglang_morph.plan.model import ModelSpec
    from sglang_morph.plan.workload import Workload

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


def test_swap_mid_stream_under_pp2_grows_both_stages_and_restore_is_exact(pp2, corpus_ids):
    prompts = [prompt_ids(corpus_ids, 10 + seed, 32) for seed in range(3)]
    before = [generate_ids(pp2, ids, 24) for ids in prompts]
    start = status(pp2)
    ids = prompt_ids(corpus_ids, 20, 48)
    reference = generate_ids(pp2, ids, 120)
    stream = Stream(pp2, ids, 120)
    stream.wait_for(15)
    tokens_before_swap = list(stream.ids)

    r = swap(pp2, SWAPPED, 4)
    assert r.status_code == 200, r.text
    s = r.json()
    assert [layer["bits"] for layer in s["layers"]] == [
        4 if i in SWAPPED else map_bits(i) for i in range(30)]
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

    r = swap(pp2, SWAPPED, 16)
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["kv_capacity_tokens"] == start["kv_capacity_tokens"]
    for st, st0 in zip(s["stages"], start["stages"]):
        for key in ("kv_capacity_tokens", "weight_bytes", "kv_bytes", "free_budget_bytes"):
            assert st[key] == st0[key], (key, st, st0)
    out = stream.join()
    assert len(out) == 120 and stream.finish_reason["type"] == "length"
    assert out[:len(tokens_before_swap)] == reference[:len(tokens_before_swap)]
    assert [generate_ids(pp2, p, 24) for p in prompts] == before
    assert [layer["bits"] for layer in status(pp2)["layers"]] == [map_bits(i) for i in range(30)]


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


@pytest.fixture(scope="module")
def parse(default_model_path):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    return lambda *flags: prepare_server_args(["--model-path", str(default_model_path),
                                               "--enable-morph", *flags])


@pytest.mark.parametrize("flags,line", [
    (("--pp-size", "2", "--disable-morph-controller", "--nnodes", "2", "--node-rank", "0",
      "--dist-init-addr", "127.0.0.1:29555"), "--enable-morph does not support --nnodes 2 yet"),
    (("--pp-size", "2", "--tp-size", "3", "--disable-morph-controller"),
     "--enable-morph does not support --tp-size and --pp-size together yet"),
    (("--pp-size", "2"), "--enable-morph with --pp-size 2 needs --disable-morph-controller"),
    (("--pp-size", "2", "--disable-morph-controller", "--morph-stage-budgets", "1GB"),
     "--morph-stage-budgets has 1 budgets for --pp-size 2"),
    (("--pp-size", "2", "--morph-stage-budgets", "1GB,1GB", "--morph-memory-budget", "1GB"),
     "--morph-memory-budget and --morph-stage-budgets exclude each other"),
])
def test_unsupported_pipeline_configurations_are_refused(parse, flags, line):
    from sglang_morph.plugin import MorphPluginError

    with pytest.raises(MorphPluginError) as e:
        parse(*flags)
    assert str(e.value) == f"sglang-morph: error: {line}" or line in str(e.value)
    assert "\n" not in str(e.value)


def test_pipeline_flags_parse(parse):
    from sglang_morph import config as morph_config

    args = parse("--pp-size", "2", "--disable-morph-controller", "--morph-stage-budgets",
                 "300MB,1GiB")
    assert morph_config.get(args).stage_budget_bytes == (300 * 10**6, 2**30)
    # the launcher's pool is an upper bound the stages trim: the tighter budget over 15 layers
    # of bf16 KV (2 x 3 heads x 64 x 2 bytes per layer and token), no weights subtracted
    assert args.max_total_tokens == 300 * 10**6 // (15 * 2 * 3 * 64 * 2)
