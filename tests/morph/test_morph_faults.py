"""Transitions are all or nothing: failures injected into every step of a swap and a restore.

Without a server: ``LayerVariantInstaller`` on a small stand-in model with SGLang's linear
surface (``weight`` + ``quant_method.apply``) and real W8/W4 engines written for it, and
``MorphRuntime`` over that model and SGLang's real KV pool, allocator and radix cache (the
stand-in scheduler of ``test_kv_resizer``). With a server: the same faults through
``SGLANG_MORPH_FAULT`` in a live float32 server, variant files removed or corrupted after
startup, and pinning of operator swaps. "Unchanged" always means: the model's outputs are
bit-identical, every layer's bits and bytes, the KV capacity and its copies, the budget and
``/morph/status`` are as before, and ``check_integrity()`` holds.
"""

from __future__ import annotations

import hashlib
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.morph.config import MorphConfig
from sglang_morph.morph.control.controller import SwapLayers
from sglang_morph.engines import formats
from sglang_morph.engines.manifest import (
    LINEAR_NAMES,
    EngineManifest,
    VariantInfo,
    variant_file_name,
)
from sglang_morph.engines import variants
from sglang_morph.faults import RUNTIME_STEPS, FaultInjector, InjectedFault, parse_spec
from sglang_morph.engines.variants import (
    FUSED_LINEARS,
    LayerVariantInstaller,
    MorphQuantLinearMethod,
    StagedVariants,
)
from test_kv_resizer import capacity_copies, finish_request, make_scheduler, request_kv, start_request

HIDDEN, INTERMEDIATE, Q_OUT, KV_OUT = 64, 128, 64, 32
NUM_LAYERS = 3
# HF linear -> (fused SGLang linear, its row range in the fused weight)
_ROWS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0, Q_OUT),
    "self_attn.k_proj": ("self_attn.qkv_proj", Q_OUT, Q_OUT + KV_OUT),
    "self_attn.v_proj": ("self_attn.qkv_proj", Q_OUT + KV_OUT, Q_OUT + 2 * KV_OUT),
    "self_attn.o_proj": ("self_attn.o_proj", 0, HIDDEN),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0, INTERMEDIATE),
    "mlp.up_proj": ("mlp.gate_up_proj", INTERMEDIATE, 2 * INTERMEDIATE),
    "mlp.down_proj": ("mlp.down_proj", 0, HIDDEN),
}


class _Unquantized:
    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class Linear(torch.nn.Module):
    """SGLang's linear surface as the installer sees it."""

    def __init__(self, out_features: int, in_features: int, generator: torch.Generator):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(out_features, in_features, generator=generator) * 0.05,
            requires_grad=False)
        self.quant_method = _Unquantized()

    def forward(self, x):
        return self.quant_method.apply(self, x)


class DecoderLayer(torch.nn.Module):
    def __init__(self, generator):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = Linear(Q_OUT + 2 * KV_OUT, HIDDEN, generator)
        self.self_attn.o_proj = Linear(HIDDEN, Q_OUT, generator)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = Linear(2 * INTERMEDIATE, HIDDEN, generator)
        self.mlp.down_proj = Linear(HIDDEN, INTERMEDIATE, generator)

    def forward(self, h):
        h = h + self.self_attn.o_proj(self.self_attn.qkv_proj(h)[:, :Q_OUT])
        gate, up = self.mlp.gate_up_proj(h).chunk(2, dim=-1)
        return h + self.mlp.down_proj(F.silu(gate) * up)


class TinyModel(torch.nn.Module):
    """``model.model.layers`` like SGLang's Llama."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(DecoderLayer(generator) for _ in range(NUM_LAYERS))

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


def write_engines(model: TinyModel, out_dir):
    """W8 and W4 variants of every layer of ``model`` in the builder's on-disk format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = []
    for i, layer in enumerate(model.model.layers):
        entry = {16: VariantInfo(16, "fp", 1)}
        for bits in (8, 4):
            fmt = formats.get_format(bits)
            flat = {}
            for name in LINEAR_NAMES:
                fused, first, last = _ROWS[name]
                weight = variants._submodule(layer, fused).weight[first:last]
                for tensor_name, t in fmt.quantize(weight).items():
                    flat[f"{name}.{tensor_name}"] = t.contiguous()
            path = out_dir / variant_file_name(i, bits)
            save_file(flat, path)
            entry[bits] = VariantInfo(bits, fmt.name, formats.device_bytes(flat),
                                      file=path.name,
                                      sha256=hashlib.sha256(path.read_bytes()).hexdigest())
        layers.append(entry)
    manifest = EngineManifest({"num_hidden_layers": NUM_LAYERS, "path": "tiny"}, {}, {},
                              tuple(layers))
    manifest.save(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return write_engines(TinyModel(), tmp_path_factory.mktemp("tiny_engines"))


@pytest.fixture(scope="module")
def staged(engines):
    return StagedVariants(EngineManifest.load(engines), engines)


X = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))


def outputs(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(X)


def layer_state(installer: LayerVariantInstaller) -> list:
    """What each layer runs: bits, device bytes, and the identity of every method and weight."""
    return [(installer.bits[i], installer.layer_device_bytes(i),
             [(id(variants._submodule(layer, p).quant_method),
               variants._submodule(layer, p).weight.data_ptr()) for p in FUSED_LINEARS])
            for i, layer in enumerate(installer.layers)]


def test_fault_spec_parsing():
    assert parse_spec("down:2, up") == {"down": 2, "up": 1}
    assert parse_spec("") == {}
    for bad in ("sideways", "down:x", "grow:-1"):
        with pytest.raises(ValueError, match="SGLANG_MORPH_FAULT"):
            parse_spec(bad)
    faults = FaultInjector()
    faults.arm("grow:2")
    for _ in range(2):
        with pytest.raises(InjectedFault):
            faults.check("grow")
    faults.check("grow")  # spent
    faults.arm("up")
    with faults.suppressed():
        faults.check("up")
    with pytest.raises(InjectedFault):
        faults.check("up")


def test_staging_verifies_checksums_and_never_reads_the_directory_again(engines, tmp_path):
    copy = shutil.copytree(engines, tmp_path / "engines")
    manifest = EngineManifest.load(copy)
    staged = StagedVariants(manifest, copy)
    assert staged.host_bytes == sum(
        t.numel() * t.element_size() for i in range(NUM_LAYERS) for b in (8, 4)
        for tensors in staged.get(i, b).values() for t in tensors.values()) > 0
    reference = TinyModel()
    LayerVariantInstaller(reference, staged, torch.float32).set_layers([0, 2], 4)
    # One variant file removed, another corrupted: a swap from the staged copy does not notice.
    (copy / variant_file_name(0, 4)).unlink()
    (copy / variant_file_name(2, 4)).write_bytes(b"garbage")
    model = TinyModel()
    LayerVariantInstaller(model, staged, torch.float32).set_layers([0, 2], 4)
    assert torch.equal(outputs(model), outputs(reference))
    assert not torch.equal(outputs(model), outputs(TinyModel()))  # the swap did change layers
    # Staging refuses bytes that differ from the manifest's checksum, naming the file.
    shutil.copy(engines / variant_file_name(0, 4), copy / variant_file_name(0, 4))
    with pytest.raises(ValueError, match=r"layer_002\.w4\.safetensors: sha256 .* does not match"):
        StagedVariants(manifest, copy)


def test_a_failure_preparing_the_third_linear_changes_nothing(staged, monkeypatch):
    """The case this guards: a failure on the 3rd of 4 linears used to lose the first two's
    full-precision weights. Now every linear is prepared before any is touched."""
    model = TinyModel()
    installer = LayerVariantInstaller(model, staged, torch.float32)
    before_out, before = outputs(model), layer_state(installer)
    real_prepare, calls = variants.morph_kernels.prepare, []

    def prepare_failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated allocation failure")
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(variants.morph_kernels, "prepare", prepare_failing_third)
    with pytest.raises(RuntimeError, match="simulated"):
        installer.set_layers([1], 4)
    assert layer_state(installer) == before and torch.equal(outputs(model), before_out)
    installer.check_integrity()


@pytest.mark.parametrize("start_bits,bits", [(16, 4), (16, 8), (8, 4), (4, 16), (8, 16)])
def test_a_fault_while_installing_puts_every_linear_back(staged, start_bits, bits):
    """The fault fires before the last linear of the move is switched (all others are)."""
    model, faults = TinyModel(), FaultInjector()
    installer = LayerVariantInstaller(model, staged, torch.float32, faults)
    if start_bits != FULL_PRECISION_BITS:
        installer.set_layers([0, 1], start_bits)
    before_out, before = outputs(model), layer_state(installer)
    faults.arm("up" if bits == FULL_PRECISION_BITS else "down")

    with pytest.raises(InjectedFault):
        installer.set_layers([0, 1], bits)

    assert layer_state(installer) == before and torch.equal(outputs(model), before_out)
    installer.check_integrity()
    installer.set_layers([0, 1], bits)  # disarmed: the same move goes through
    assert installer.bits == (bits, bits, FULL_PRECISION_BITS)
    installer.check_integrity()
    if bits == FULL_PRECISION_BITS:
        assert torch.equal(outputs(model), outputs(TinyModel()))  # exactly full precision


def test_revert_puts_an_applied_move_back_exactly(staged):
    model = TinyModel()
    installer = LayerVariantInstaller(model, staged, torch.float32)
    installer.set_layers([2], 8)
    before_out, before = outputs(model), layer_state(installer)
    applied = installer.apply(installer.prepare([0, 2], 4))
    assert installer.bits == (4, FULL_PRECISION_BITS, 4)
    installer.revert(applied)
    assert layer_state(installer) == before and torch.equal(outputs(model), before_out)
    installer.check_integrity()
    assert isinstance(variants._submodule(model.model.layers[2], "mlp.down_proj").quant_method,
                      MorphQuantLinearMethod)


# ----- MorphRuntime over SGLang's real KV pool ------------------------------------------------


def make_runtime(staged):
    from sglang_morph.morph.executor.runtime import MorphRuntime

    s = make_scheduler()
    model = TinyModel()
    runner = s.tp_worker.model_runner
    runner.model = model
    runner.morph_installer = LayerVariantInstaller(model, staged, torch.float32)
    s.model_config.num_hidden_layers = NUM_LAYERS
    s.waiting_queue = []
    s.new_token_ratio_tracker = SimpleNamespace(current=0.5)
    s.emitted_capacities.append(s.max_total_num_tokens)
    return s, model, MorphRuntime(s, MorphConfig(enabled=True, controller_enabled=False))


# Status fields a failed transition may change: the record of it, and the hook's self-timing.
_HISTORY = {"transitions", "transitions_total", "refused_transitions_total",
            "failed_transitions_total", "hook_calls_total", "hook_seconds_total", "signals"}


def runtime_state(s, model, runtime, reqs=()) -> dict:
    status = {k: v for k, v in runtime.status().items() if k not in _HISTORY}
    return {"status": status, "budget": runtime.budget, "capacity": capacity_copies(s),
            "layers": layer_state(runtime.installer), "outputs": outputs(model).tolist(),
            "kv": [request_kv(s, r).tolist() for r in reqs]}


def live_kv_above_the_start_capacity(s) -> list:
    """After a swap grew the pool: a running request whose KV lies above the start capacity
    (cached prompts fill the slots below), so a restore's shrink must move it."""
    low = start_request(s, list(range(100, 115)))
    high = start_request(s, list(range(300, 310)), decode_tokens=2)
    finish_request(s, low)  # its prompt stays cached (evictable) below the boundary
    s.running_batch.reqs = [high]
    row = s.req_to_token_pool.req_to_token[high.kv.req_pool_idx, : high.kv.kv_allocated_len]
    assert row.max().item() > 16
    return [high]


@pytest.mark.parametrize("step", RUNTIME_STEPS)
def test_runtime_fault_in_each_step_changes_nothing(staged, step):
    from sglang_morph.morph.executor.runtime import MorphRequestError

    s, model, runtime = make_runtime(staged)
    start_capacity, fp_out = runtime.resizer.capacity_tokens, outputs(model)
    reqs = []
    action = SwapLayers((0, 1), 4, "test")
    if step in ("shrink", "up"):  # the restore's steps
        runtime.apply(action, source="api")
        reqs = live_kv_above_the_start_capacity(s)
        action = SwapLayers((0, 1), FULL_PRECISION_BITS, "test")
    before = runtime_state(s, model, runtime, reqs)
    runtime.faults.arm(step)

    with pytest.raises(MorphRequestError) as failure:
        runtime.apply(action, source="controller")

    assert failure.value.status_code == 500 and "injected into step" in str(failure.value)
    assert runtime_state(s, model, runtime, reqs) == before
    runtime.check_integrity()
    record = runtime.status()["transitions"][-1]
    assert record["action"] == "failed" and f"'{step}'" in record["error"]
    assert record["kv_capacity_tokens_before"] == record["kv_capacity_tokens_after"]
    assert runtime.failed_transitions_total == 1
    # Disarmed, the same transition goes through.
    t = runtime.apply(action, source="controller")
    assert t.action == ("restore" if action.restore else "swap")
    runtime.check_integrity()
    if action.restore:
        assert runtime.resizer.capacity_tokens == start_capacity
        assert torch.equal(outputs(model), fp_out)
        assert [request_kv(s, r).tolist() for r in reqs] == before["kv"]
    else:
        assert runtime.resizer.capacity_tokens > start_capacity


def test_runtime_refused_restore_is_recorded_and_changes_nothing(staged):
    from sglang_morph.morph.executor.runtime import MorphRequestError

    s, model, runtime = make_runtime(staged)
    runtime.apply(SwapLayers((0, 1, 2), 4, "test"), source="api")
    big = start_request(s, list(range(500, 520)), decode_tokens=2)  # more than 16 tokens
    s.running_batch.reqs = [big]
    before = runtime_state(s, model, runtime, [big])
    with pytest.raises(MorphRequestError) as refusal:
        runtime.apply(SwapLayers((0, 1, 2), FULL_PRECISION_BITS, "test"), source="api")
    assert refusal.value.status_code == 409
    assert runtime_state(s, model, runtime, [big]) == before
    assert runtime.status()["transitions"][-1]["action"] == "refused"
    assert runtime.refused_transitions_total == 1 and runtime.failed_transitions_total == 0
    runtime.check_integrity()


class RecordingController:
    """Stands in for MorphController: proposes ``action`` and records what it was told."""

    def __init__(self, action):
        self.action, self.pinned, self.noted = action, [], []

    def decide(self, signals, layer_bits, pinned=frozenset()):
        self.pinned.append(pinned)
        return self.action

    def note_transition(self, time_s):
        self.noted.append(time_s)


def test_controller_failure_keeps_the_scheduler_hook_alive(staged):
    """A controller action that fails inside the per-step hook is recorded and the hook
    returns normally (it used to raise through the scheduler loop)."""
    s, model, runtime = make_runtime(staged)
    runtime.controller = RecordingController(SwapLayers((2,), 4, "pressure"))
    before = runtime_state(s, model, runtime)
    runtime.faults.arm("grow")
    runtime.on_step()  # must not raise
    assert runtime_state(s, model, runtime) == before
    assert runtime.status()["transitions"][-1]["source"] == "controller"
    assert runtime.failed_transitions_total == 1
    runtime.check_integrity()


def test_operator_swaps_are_pinned_until_handed_back(staged):
    import time

    s, model, runtime = make_runtime(staged)
    controller = runtime.controller = RecordingController(None)
    t0 = time.monotonic()
    runtime.swap_from_api([0, 2], 4)
    assert runtime.pinned == {0, 2} and controller.noted and controller.noted[-1] >= t0
    assert [x["pinned"] for x in runtime.status()["layers"]] == [True, False, True]
    runtime.on_step()
    assert controller.pinned[-1] == frozenset({0, 2})
    noted = len(controller.noted)
    runtime.swap_from_api([2], 4, pin=False)  # already at 4 bits: only handed back
    assert runtime.pinned == {0} and runtime.status()["pinned_layers"] == [0]
    assert len(controller.noted) == noted  # nothing moved, nothing to note
    runtime.loop._next_s = 0.0  # the next step samples again
    runtime.on_step()
    assert controller.pinned[-1] == frozenset({0})
    # A swap that moves nothing changes nothing unless it asks to pin.
    before = runtime.status()
    runtime.swap_from_api([1], 16)  # already at full precision
    assert runtime.pinned == {0} and runtime.status()["layers"] == before["layers"]
    runtime.swap_from_api([1], 16, pin=True)
    assert runtime.pinned == {0, 1}


# ----- a live server -------------------------------------------------------------------------

SWAPPED = [17, 14, 13, 15, 12, 25, 16, 26]  # the first 8 of the LIS profile order
FAULTS = "down:1,grow:1,shrink:1,up:1"


@pytest.fixture(scope="module")
def fault_server(server_factory, engines_awq, tmp_path_factory):
    """float32, 650 MB budget, the default-mode controller on, every fault step armed once,
    serving from a copy of the engines that the tests damage after startup."""
    engines = shutil.copytree(engines_awq, tmp_path_factory.mktemp("engines") / "engines")
    srv = server_factory("--dtype", "float32", "--enable-morph", "--morph-engines", str(engines),
                         "--morph-memory-budget", "650MB", env={"SGLANG_MORPH_FAULT": FAULTS})
    srv.engines = engines
    return srv


@pytest.fixture(scope="module")
def corpus_ids(default_model_path):
    from conftest import DATA_DIR
    from sglang_morph.engines import hf_variants

    tokenizer = hf_variants.load_tokenizer(default_model_path)
    return tokenizer((DATA_DIR / "text" / "wikitext2_test.txt").read_text())["input_ids"]


def _status(srv) -> dict:
    import requests

    r = requests.get(f"{srv.url}/morph/status", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _state(srv) -> dict:
    """/morph/status without the history a failed transition adds to it and without the KV
    that requests in flight hold at this moment."""
    return {k: v for k, v in _status(srv).items() if k not in _HISTORY | {"kv_used_tokens"}}


def _swap(srv, layers, bits, **extra):
    import requests

    return requests.post(f"{srv.url}/morph/swap", json={"layers": layers, "bits": bits, **extra},
                         timeout=600)


def _generate(srv, ids, n_new=24) -> list[int]:
    import requests

    r = requests.post(f"{srv.url}/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _stream(srv, ids, n_new):
    """A streamed greedy request in a thread; returns the thread and its result list."""
    import threading

    out: list = []
    thread = threading.Thread(target=lambda: out.append(_generate(srv, ids, n_new)), daemon=True)
    thread.start()
    return thread, out


def _fail_each_step_while_streaming(srv, bits, steps, state, stream, greedy):
    """One failed swap of SWAPPED to ``bits`` per armed fault step, while a long request streams:
    each returns 500 naming the step, is recorded as failed and leaves ``state``; the stream and
    the greedy prompts then give exactly their expected tokens."""
    (long_prompt, long_expected), (prompts, expected) = stream, greedy
    thread, streamed = _stream(srv, long_prompt, len(long_expected))
    for step in steps:
        r = _swap(srv, SWAPPED, bits)
        assert r.status_code == 500 and f"'{step}'" in r.json()["error"], r.text
        assert _state(srv) == state
        last = _status(srv)["transitions"][-1]
        assert (last["action"], last["source"], last["layers"]) == ("failed", "api", SWAPPED)
    thread.join(600)
    assert streamed == [long_expected]
    assert [_generate(srv, p) for p in prompts] == expected


def test_server_fault_in_each_step_changes_nothing_and_keeps_serving(fault_server, corpus_ids):
    srv = fault_server
    prompts = [corpus_ids[600 * k: 600 * k + 40] for k in range(3)]
    long_prompt = corpus_ids[5000:5064]
    full = [_generate(srv, p) for p in prompts]
    long_full = _generate(srv, long_prompt, 160)
    start = _state(srv)
    assert start["quantized_layers"] == 0 and start["controller"] is True

    # Swap: the first attempt fails installing the variants, the second growing KV; a request
    # streams across both and is untouched.
    _fail_each_step_while_streaming(srv, 4, ("down", "grow"), start, (long_prompt, long_full),
                                    (prompts, full))

    r = _swap(srv, SWAPPED, 4)
    assert r.status_code == 200, r.text
    swapped = _state(srv)
    assert swapped["kv_capacity_tokens"] > start["kv_capacity_tokens"]
    quantized = [_generate(srv, p) for p in prompts]
    assert quantized != full
    long_quantized = _generate(srv, long_prompt, 160)

    # Restore: the first attempt fails shrinking KV, the second putting weights back (after
    # the shrink: the KV is given back). A request streams across both.
    _fail_each_step_while_streaming(srv, 16, ("shrink", "up"), swapped,
                                    (long_prompt, long_quantized), (prompts, quantized))

    r = _swap(srv, SWAPPED, 16)
    assert r.status_code == 200, r.text
    restored = _state(srv)
    assert restored["pinned_layers"] == sorted(SWAPPED)  # the operator's layers, now at 16
    assert [x["bits"] for x in restored["layers"]] == [16] * 30
    pin_fields = {"layers", "pinned_layers"}
    assert ({k: v for k, v in restored.items() if k not in pin_fields}
            == {k: v for k, v in start.items() if k not in pin_fields})
    assert [_generate(srv, p) for p in prompts] == full
    s = _status(srv)
    assert s["failed_transitions_total"] == 4 and s["refused_transitions_total"] == 0
    log = srv.log_text()
    assert log.count("checked after the failed transition: layers, KV pool and budget are "
                     "consistent") == 4
    assert "inconsistent" not in log and "Traceback" not in log
    _swap(srv, SWAPPED, 16, pin=False)


def test_server_variant_files_removed_or_corrupted_after_startup_do_not_matter(fault_server,
                                                                               corpus_ids):
    """Variants are staged at startup: a swap after their files were deleted or overwritten
    serves exactly what a swap served before."""
    srv = fault_server
    prompts = [corpus_ids[600 * k: 600 * k + 40] for k in range(3)]
    assert _swap(srv, SWAPPED, 4).status_code == 200
    before = [_generate(srv, p) for p in prompts]
    assert _swap(srv, SWAPPED, 16).status_code == 200
    for k, layer in enumerate(SWAPPED):
        path = srv.engines / variant_file_name(layer, 4)
        if k % 2:
            path.unlink()
        else:
            path.write_bytes(b"\0" * path.stat().st_size)
    r = _swap(srv, SWAPPED, 4)
    assert r.status_code == 200, r.text
    assert [_generate(srv, p) for p in prompts] == before
    assert _swap(srv, SWAPPED, 16, pin=False).status_code == 200


def test_server_operator_swap_survives_a_quiet_controller_until_handed_back(fault_server):
    import time

    srv = fault_server
    r = _swap(srv, SWAPPED, 4)
    assert r.status_code == 200 and r.json()["pinned_layers"] == sorted(SWAPPED)
    assert [x["pinned"] for x in r.json()["layers"]] == [i in SWAPPED for i in range(30)]
    time.sleep(10.0)  # quiet: the controller restores unpinned layers after 5 s of quiet
    s = _status(srv)
    assert s["quantized_layers"] == 8 and s["transitions"][-1]["source"] == "api", \
        s["transitions"][-1]
    # Handed back (no move): the controller restores them once the server is quiet.
    r = _swap(srv, SWAPPED, 4, pin=False)
    assert r.status_code == 200 and r.json()["pinned_layers"] == []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _status(srv)["quantized_layers"]:
        time.sleep(1.0)
    s = _status(srv)
    assert s["quantized_layers"] == 0, s["transitions"][-3:]
    assert s["transitions"][-1]["source"] == "controller"
    assert s["kv_capacity_tokens"] == s["kv_capacity_tokens_at_start"]
