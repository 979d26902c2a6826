"""MorphServe under SGLang tensor parallelism: ``--enable-morph --tp-size 3``.

One TP 3 server on the default model (9 query / 3 KV heads: 3 + 1 per rank; float32, greedy,
a precision map with W4 and W8 layers, a 184 MB budget per rank, the controller on) against a
TP 1 server with the same map running one thread like each rank (the reference, shared with
tests/morph/test_morph_parallel.py; itself tested against transformers with the
dequantized weights in tests/morph/test_precision_map_server.py). Each rank shards the whole-layer
variants at load (parallel/tensor.py).

- the shards are SGLang's layout: each rank's dequantized shard equals the rows (q/k/v heads,
  gate/up) or input columns (o_proj/down_proj) of the dequantized whole variant;
- greedy output under TP 3 with the map equals TP 1 with the map token for token, logprobs
  within 1e-4 nats (the row-parallel linears sum per-rank partial products: float32 order);
- every rank reports the same budget, weights and KV pool (``tp_ranks``);
- a swap of 8 layers to W4 while a request streams grows the KV pool of every rank by the same
  tokens, the stream finishes, the restore gives every rank its exact capacity back, and greedy
  output after it equals the output before; a refused swap changes nothing on any rank;
- under a burst, rank 0's controller swaps and every rank applies the same transitions;
- launches the sharding cannot serve stop in the launcher with one line.

The README's TP 3 command, in the model's own bf16, runs too (one server, stopped before the
float32 pair starts): it serves with the precision map, and a rank's budget, startup swaps and
swaps count its shards' exact bytes. Without a server: the controller prices a layer at each
bit-width as a rank's installer holds it: a rank's shard, not the manifest's whole layer (in
bf16 a whole W8 layer outweighs a rank's full-precision third).
"""

from __future__ import annotations

import re
import time
import types

import pytest
import requests
import torch

from conftest import running_server
# (parse, corpus_ids and tokenizer are those modules' fixtures)
from test_morph_parallel import (  # noqa: F401
    ONE_RANK_WITH_THE_MAP,
    REFERENCE_SEEDS,
    greedy_with_logprobs as generate,
    one_rank_with_the_map,
    parse,
    record_one_rank_with_the_map,
    reference_prompt,
    start_burst,
)
from test_morph_runtime_server import (  # noqa: F401
    ADMIN,
    USER,
    Stream,
    corpus_ids,
    prompt_ids,
    status,
    swap,
    tokenizer,
)

PRECISION_MAP = "0-3:4,20-23:8"
# A rank holds a third of the ~540 MB of float32 weights (151.5 MB with the map): this leaves
# it 2114 KV tokens, which the burst below nearly fills.
BUDGET_PER_RANK = 184 * 10**6
SWAPPED = [17, 14, 13, 15, 12, 25, 16, 26]  # the first 8 of the LIS profile order
COMMON = ("--dtype", "float32", "--enable-morph", "--morph-precision-map", PRECISION_MAP)
# ONE_RANK_WITH_THE_MAP lives in one test process: test_morph_parallel runs in the same one.
pytestmark = pytest.mark.xdist_group("one_rank_with_the_map")
# The default model under TP 3, per rank: 3 query heads, 1 KV head of 64, 512 of 1536 MLP rows.
KV_BYTES_PER_TOKEN_PER_RANK = 2 * 30 * 1 * 64 * 4
# A rank's decoder linears hold 3538944 / 3 weights: 2 bytes each in bf16; W8 holds them at
# 1 byte plus a bf16 scale per output channel of its shard (320 q/k/v and 1024 gate/up rows;
# o_proj's and down_proj's 576 channels whole, as a row-parallel shard keeps them).
BF16_LAYER_BYTES_PER_RANK = 3538944 // 3 * 2
W8_LAYER_BYTES_PER_RANK = 3538944 // 3 + 2 * (320 + 576 + 1024 + 576)
BF16_KV_BYTES_PER_TOKEN_PER_RANK = 2 * 30 * 1 * 64 * 2


def map_bits(layer: int) -> int:
    return 4 if layer <= 3 else 8 if 20 <= layer <= 23 else 16


@pytest.fixture(scope="module")
def tp3(server_factory, engines_awq):
    # (the controller is on: rank 0's decides; the swaps below pin their layers)
    return server_factory(*COMMON, "--morph-engines", str(engines_awq), "--tp-size", "3",
                          "--morph-memory-budget", str(BUDGET_PER_RANK))


@pytest.fixture(scope="module")
def tp1(server_factory, engines_awq, corpus_ids) -> dict:
    """The one-rank server with the same map (one thread, like each TP 3 rank here): its greedy
    outputs with logprobs and its staged bytes, recorded once per test run (test_morph_parallel
    records them when it runs first; else its server starts here)."""
    if not ONE_RANK_WITH_THE_MAP:
        record_one_rank_with_the_map(one_rank_with_the_map(server_factory, engines_awq),
                                     corpus_ids)
    return ONE_RANK_WITH_THE_MAP


def ranks_alike(body: dict) -> dict:
    """Every rank's figures (``tp_ranks``) are the same; returns rank 0's."""
    ranks = body["tp_ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1, 2]
    first = {k: v for k, v in ranks[0].items() if k != "tp_rank"}
    for r in ranks[1:]:
        assert {k: v for k, v in r.items() if k != "tp_rank"} == first, ranks
    return first


# ----- the shards (no server) -------------------------------------------------------------------

def _fake_model(rank: int, tp: int, kv_heads: int = 3):
    """The attributes parallel.tensor.sharder reads off SGLang's linears, as SGLang sets them
    for the default model at ``tp`` (QKVParallelLinear: kv heads replicated when fewer)."""
    ns = types.SimpleNamespace

    def group():
        return ns(rank_in_group=rank, world_size=tp)

    replicas = max(1, tp // kv_heads)
    layer = ns(
        self_attn=ns(qkv_proj=ns(tp_group=group(), kv_tp_group=group(), num_heads=9 // tp,
                                 num_kv_heads=max(1, kv_heads // tp),
                                 num_kv_head_replicas=replicas, head_size=64, v_head_size=64),
                     o_proj=ns(tp_group=group(), input_size_per_partition=576 // tp)),
        mlp=ns(gate_up_proj=ns(tp_group=group(), output_sizes=[1536, 1536]),
               down_proj=ns(tp_group=group(), input_size_per_partition=1536 // tp)))
    layer.get_submodule = lambda path: getattr(getattr(layer, path.split(".")[0]),
                                               path.split(".")[1])
    return ns(model=ns(layers=[layer] * 30))


@pytest.mark.parametrize("bits", [8, 4])
def test_each_rank_holds_sglangs_shard_of_the_variant(engines_awq, bits):
    from sglang_morph.engines.formats import get_format
    from sglang_morph.engines.manifest import EngineManifest, read_variant
    from sglang_morph.morph.parallel.tensor import sharder

    whole = read_variant(engines_awq, EngineManifest.load(engines_awq).variant(14, bits))
    fmt = get_format(bits)
    deq = {name: fmt.dequantize(t) for name, t in whole.items()}
    rows = {"self_attn.q_proj": 192, "self_attn.k_proj": 64, "self_attn.v_proj": 64,
            "mlp.gate_proj": 512, "mlp.up_proj": 512}
    columns = {"self_attn.o_proj": 192, "mlp.down_proj": 512}
    for rank in range(3):
        shard = sharder(_fake_model(rank, 3))(14, whole)
        for name, n in rows.items():
            assert torch.equal(fmt.dequantize(shard[name]), deq[name][rank * n:(rank + 1) * n])
        for name, n in columns.items():
            assert torch.equal(fmt.dequantize(shard[name]), deq[name][:, rank * n:(rank + 1) * n])
            if bits == 4:  # AWQ's input scales follow the input columns
                assert torch.equal(shard[name]["input_scale"],
                                   whole[name]["input_scale"][rank * n:(rank + 1) * n])
    if bits == 4:
        return  # (576 / 6 input columns would split W4's groups of 64: TP 6 is refused)
    # fewer KV heads than ranks (SGLang replicates them): ranks 2k and 2k+1 share KV head k
    k_rows = [sharder(_fake_model(rank, 6))(14, whole)["self_attn.k_proj"] for rank in range(6)]
    for rank in range(6):
        head = rank // 2
        assert torch.equal(fmt.dequantize(k_rows[rank]),
                           deq["self_attn.k_proj"][head * 64:(head + 1) * 64])


def test_a_shard_that_splits_a_w4_group_is_refused():
    from sglang_morph.morph.config import MorphConfig, MorphConfigError
    from sglang_morph.morph.parallel.tensor import check_launch

    manifest = types.SimpleNamespace(
        num_layers=1, bits_available=(4, 16),
        variant=lambda i, bits: types.SimpleNamespace(
            group_sizes={"self_attn.o_proj": 64, "mlp.down_proj": 128} if bits == 4 else None))
    hf = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 512,
          "intermediate_size": 1536}
    args = types.SimpleNamespace(tp_size=8, pp_size=1, dp_size=1)
    cfg = MorphConfig(enabled=True, controller_enabled=False)
    with pytest.raises(MorphConfigError) as e:
        check_launch(args, cfg, hf, manifest)
    assert str(e.value) == (
        "--enable-morph --tp-size 8: the W4 variant of layer 0 mlp.down_proj has groups of 128 "
        "input columns, which do not divide a rank's 192 columns (intermediate_size 1536 / 8); "
        "rebuild the engines with a group size that does")
    check_launch(types.SimpleNamespace(tp_size=4, pp_size=1, dp_size=1), cfg, hf, manifest)


def _rank_model(rank: int, tp: int, dtype: torch.dtype):
    """A stand-in for SGLang's model on TP rank ``rank`` of ``tp``: each layer's four fused
    linears with the attributes the sharder reads (``_fake_model``) and full-precision weights
    of a rank's shape in ``dtype``, the way SGLang's weight_loader leaves them."""
    kv_heads = max(1, 3 // tp)
    shapes = {"self_attn.qkv_proj": ((9 // tp + 2 * kv_heads) * 64, 576),
              "self_attn.o_proj": (576, 576 // tp),
              "mlp.gate_up_proj": (2 * 1536 // tp, 576),
              "mlp.down_proj": (576, 1536 // tp)}
    attrs = _fake_model(rank, tp).model.layers[0]
    layers = []
    for _ in range(30):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        for path, shape in shapes.items():
            parent, name = path.split(".")
            linear = torch.nn.Module()
            for key, value in vars(getattr(getattr(attrs, parent), name)).items():
                setattr(linear, key, value)
            linear.weight = torch.nn.Parameter(torch.zeros(shape, dtype=dtype),
                                               requires_grad=False)
            linear.quant_method = "unquantized"
            setattr(getattr(layer, parent), name, linear)
        layers.append(layer)
    return types.SimpleNamespace(model=types.SimpleNamespace(layers=layers))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_the_controller_prices_a_layer_as_a_rank_holds_it(engines_awq, dtype):
    """The controller's bytes per bit-width are a rank's shard, exactly what its installer
    holds, not the engines manifest's whole layer (in bf16 a whole W8 layer outweighs a rank's
    full-precision third, and ``LayerCosts`` refuses fewer bits that cost more)."""
    from sglang_morph.engines.manifest import EngineManifest
    from sglang_morph.morph.executor.runtime import layer_costs
    from sglang_morph.engines.variants import LayerVariantInstaller, StagedVariants
    from sglang_morph.morph.parallel.tensor import sharder

    manifest = EngineManifest.load(engines_awq)
    model = _rank_model(0, 3, dtype)
    staged = StagedVariants(manifest, engines_awq, layers=range(1), shard=sharder(model))
    installer = LayerVariantInstaller(model, staged, act_dtype=dtype)
    costs = layer_costs(installer, (4, 8, 16), KV_BYTES_PER_TOKEN_PER_RANK, 1)
    itemsize = torch.finfo(dtype).bits // 8
    assert costs.layer_bytes(16) == 3538944 // 3 * itemsize  # a third of a layer's linears
    assert costs.layer_bytes(8) < manifest.variant(0, 8).device_bytes / 2  # not a whole layer
    if dtype == torch.bfloat16:  # (float32 runs W8 on float32 scales)
        assert costs.layer_bytes(8) == W8_LAYER_BYTES_PER_RANK
    for bits in (8, 4, 16):  # down one step at a time, then back to full precision
        installer.set_layers([0], bits)
        assert costs.layer_bytes(bits) == installer.layer_device_bytes(0), bits
    assert costs.freed_tokens(16, 8) > 0 and costs.freed_tokens(8, 4) > 0


# ----- the README's TP 3 command: the model's own bf16 -------------------------------------------

def test_the_readme_tp3_command_serves_in_bf16(engines_awq, tmp_path):
    """The README's command (bf16, 250 MB a rank, the controller on, W4 and W8 layers) starts,
    serves, and every rank's budget holds its shards' exact bytes; a swap to W8 frees what a
    rank's W8 shard saves and the restore gives each rank its capacity back. (One block: at
    most two servers of this module run at once.)"""
    args = ("--tp-size", "3", "--enable-morph", "--morph-engines", str(engines_awq),
            "--morph-memory-budget", "250MB", "--morph-precision-map", PRECISION_MAP)
    with running_server(args, tmp_path) as server:
        r = requests.post(f"{server.url}/generate", headers=USER, timeout=600, json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["text"]
        s = status(server)
        assert s["controller"] is True and s["tensor_parallel"]["tp_size"] == 3
        assert [layer["bits"] for layer in s["layers"]] == [map_bits(i) for i in range(30)]
        start = ranks_alike(s)
        assert start["kv_bytes_per_token"] == BF16_KV_BYTES_PER_TOKEN_PER_RANK
        assert start["memory_budget_bytes"] == 250 * 10**6
        assert start["weight_bytes"] + start["kv_bytes"] + start["free_budget_bytes"] \
            == 250 * 10**6
        assert start["free_budget_bytes"] < BF16_KV_BYTES_PER_TOKEN_PER_RANK
        startup_w8 = next(t for t in s["transitions"] if t["to_bits"] == 8)
        assert startup_w8["freed_bytes"] == 4 * (BF16_LAYER_BYTES_PER_RANK
                                                 - W8_LAYER_BYTES_PER_RANK)

        r = swap(server, [10, 11], 8)
        assert r.status_code == 200, r.text
        rank = ranks_alike(r.json())
        freed = start["weight_bytes"] - rank["weight_bytes"]
        assert freed == 2 * (BF16_LAYER_BYTES_PER_RANK - W8_LAYER_BYTES_PER_RANK)
        assert rank["kv_capacity_tokens"] - start["kv_capacity_tokens"] == \
            (freed + start["free_budget_bytes"]) // BF16_KV_BYTES_PER_TOKEN_PER_RANK
        r = swap(server, [10, 11], 16)
        assert r.status_code == 200, r.text
        rank = ranks_alike(r.json())
        for key in ("layer_bits", "kv_capacity_tokens", "weight_bytes", "kv_bytes",
                    "free_budget_bytes"):
            assert rank[key] == start[key], key


# ----- one TP 3 server --------------------------------------------------------------------------

def test_tp3_with_a_precision_map_equals_tp1_token_for_token(tp3, tp1, corpus_ids,
                                                            record_property):
    gap = 0.0
    for seed in REFERENCE_SEEDS:
        got, got_lp = generate(tp3, reference_prompt(corpus_ids, seed), 16)
        want, want_lp = tp1["greedy"][seed]
        assert got == want
        gap = max(gap, *(abs(a - b) for a, b in zip(got_lp, want_lp)))
    record_property("max_logprob_gap_nats", gap)  # (in --junitxml; measured 7.6e-6 here)
    assert gap < 1e-4
    s = status(tp3)
    assert [layer["bits"] for layer in s["layers"]] == [map_bits(i) for i in range(30)]
    assert s["tensor_parallel"]["tp_size"] == 3
    assert s["tensor_parallel"]["variant_shards"].startswith("sharded at load")


def test_every_rank_holds_a_third_and_the_same_pool(tp3, tp1):
    s = status(tp3)
    rank = ranks_alike(s)
    assert rank["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN_PER_RANK
    assert rank["memory_budget_bytes"] == BUDGET_PER_RANK
    assert rank["weight_bytes"] + rank["kv_bytes"] <= BUDGET_PER_RANK
    assert rank["free_budget_bytes"] < KV_BYTES_PER_TOKEN_PER_RANK  # the rest became KV
    assert s["kv_capacity_tokens"] == rank["kv_capacity_tokens"] \
        == rank["kv_bytes"] // KV_BYTES_PER_TOKEN_PER_RANK
    # a rank stages a third of TP 1's variants, and the few scales a row-parallel shard keeps
    # whole (W8's per-output-channel ones; AWQ input scales of the column-parallel linears)
    third = tp1["staged_variants_host_bytes"] / 3
    assert third < s["staged_variants_host_bytes"] < 1.01 * third


def test_swap_mid_stream_grows_every_rank_alike_and_restore_is_exact(tp3, corpus_ids):
    prompts = [prompt_ids(corpus_ids, 10, 32)]
    before = [generate(tp3, ids, 16)[0] for ids in prompts]
    start = status(tp3)
    start_rank = ranks_alike(start)
    ids = prompt_ids(corpus_ids, 20, 48)
    reference = generate(tp3, ids, 48)[0]
    stream = Stream(tp3, ids, 48)
    stream.wait_for(8)
    tokens_before_swap = list(stream.ids)

    r = swap(tp3, SWAPPED, 4)
    assert r.status_code == 200, r.text
    s = r.json()
    rank = ranks_alike(s)
    assert rank["layer_bits"] == [4 if i in SWAPPED else map_bits(i) for i in range(30)]
    assert rank["kv_capacity_tokens"] > start_rank["kv_capacity_tokens"]
    assert rank["weight_bytes"] < start_rank["weight_bytes"]
    freed = start_rank["weight_bytes"] - rank["weight_bytes"]
    # every rank turned what its shards freed into whole KV tokens of its own size
    assert rank["kv_capacity_tokens"] - start_rank["kv_capacity_tokens"] == \
        (freed + start_rank["free_budget_bytes"]) // KV_BYTES_PER_TOKEN_PER_RANK
    stream.wait_for(len(tokens_before_swap) + 12)  # decoding goes on at W4

    r = swap(tp3, SWAPPED, 16)
    assert r.status_code == 200, r.text
    rank = ranks_alike(r.json())
    for key in ("layer_bits", "kv_capacity_tokens", "weight_bytes", "kv_bytes",
                "free_budget_bytes"):
        assert rank[key] == start_rank[key], key
    out = stream.join()
    assert len(out) == 48 and stream.finish_reason["type"] == "length"
    assert out[:len(tokens_before_swap)] == reference[:len(tokens_before_swap)]
    assert [generate(tp3, p, 16)[0] for p in prompts] == before


def test_a_refused_swap_changes_nothing_on_any_rank(tp3):
    start = ranks_alike(status(tp3))
    r = swap(tp3, [2, 27], 8)  # layer 2 is at W4: it goes up only to 16
    assert r.status_code == 400 and "below 8 bits" in r.json()["error"], r.text
    assert [rank["status_code"] for rank in r.json()["tp_ranks"]] == [400] * 3
    assert {k: v for k, v in ranks_alike(status(tp3)).items() if k != "status_code"} == \
        {k: v for k, v in start.items() if k != "status_code"}


def _controller_transitions(log_text: str) -> dict[int, list[tuple[str, str, int]]]:
    """Each rank's controller transitions, from its scheduler's log lines."""
    per_rank: dict[int, list[tuple[str, str, int]]] = {0: [], 1: [], 2: []}
    for m in re.finditer(r"TP(\d)\] sglang-morph: (swap|restore) layers (\[[^\]]*\]) "
                         r"\[[^\]]*\] -> (\d+) bits \(controller\)", log_text):
        per_rank[int(m[1])].append((m[2], m[3], int(m[4])))
    return per_rank


def test_rank0s_controller_swaps_every_rank_alike_under_a_burst(tp3, corpus_ids):
    start = status(tp3)
    start_rank = ranks_alike(start)
    assert start["controller"] is True
    assert start["tensor_parallel"]["controller"].startswith("rank 0 decides")
    n_reqs, prompt, new = 9, 200, 16
    assert n_reqs * (prompt + new) > 0.9 * start["kv_capacity_tokens"]  # above kv_usage_high
    threads, outputs = start_burst(tp3, corpus_ids, range(400, 400 + n_reqs), prompt, new)
    peak = 0
    while any(th.is_alive() for th in threads):
        # (answered between two batches: a 9-request prefill takes tens of seconds under TP 3)
        r = requests.get(f"{tp3.url}/morph/status", headers=USER, timeout=600)
        rank = ranks_alike(r.json())  # every answer: all three ranks alike
        peak = max(peak, sum(b != map_bits(i) for i, b in enumerate(rank["layer_bits"])))
        time.sleep(1.0)
    for th in threads:
        th.join()
    assert sorted(outputs.values()) == [new] * n_reqs
    after = ranks_alike(status(tp3))
    moved = [i for i, b in enumerate(after["layer_bits"]) if b != start_rank["layer_bits"][i]]
    assert peak > 0 or moved
    # hand what the controller still holds back (its quiet restores take tens of seconds)
    if moved:
        r = requests.post(f"{tp3.url}/morph/swap", headers=ADMIN, timeout=600,
                          json={"layers": moved, "bits": 16, "pin": False})
        assert r.status_code == 200, r.text
    end = ranks_alike(status(tp3))
    for key in ("layer_bits", "kv_capacity_tokens", "weight_bytes", "kv_bytes"):
        assert end[key] == start_rank[key], key
    # rank 0 decided, every rank applied the same transitions in the same order (each logs a
    # transition before it answers the status request that follows it)
    per_rank = _controller_transitions(tp3.log_path.read_text())
    assert per_rank[0] and per_rank[0][0][0] == "swap", per_rank
    assert per_rank[1] == per_rank[0] and per_rank[2] == per_rank[0], per_rank


# ----- launches that are refused ----------------------------------------------------------------

@pytest.mark.parametrize("flags,line", [
    (("--tp-size", "3", "--dp-size", "2", "--disable-morph-controller"),
     "--enable-morph does not support --tp-size and --dp-size together yet"),
    (("--tp-size", "2", "--disable-morph-controller"),
     "--enable-morph --tp-size 2 needs num_attention_heads (9) and intermediate_size (1536) "
     "divisible by 2, and num_key_value_heads (3) a multiple or a divisor of 2"),
])
def test_unsupported_tensor_parallel_launches_are_refused(parse, flags, line):
    from sglang_morph.surface import PluginError

    with pytest.raises(PluginError) as e:
        parse(*flags)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_budget_is_per_rank(parse, default_model_path):
    from sglang_morph.morph.startup import checkpoint_weight_bytes, local_hf_config

    args = parse("--tp-size", "3", "--morph-memory-budget", "250MB")
    weights = checkpoint_weight_bytes(default_model_path, local_hf_config(str(default_model_path)),
                                      2)
    # the launcher's pool is an upper bound each rank trims to its own weights: the budget less
    # a third of the (bf16) checkpoint, over one KV head per rank (2 x 30 layers x 64 x 2 bytes)
    assert args.max_total_tokens == (250 * 10**6 - weights // 3) // (2 * 30 * 64 * 2)
