"""``--enable-morph`` without ``--morph-engines``: the variants and layer order are built on
first use into the cache (locked, atomic), reused afterwards, and the controller runs on them.

The builds here use the tiny random Llama (``sglang_morph.models.tiny``, 4 layers) and a cache
of their own (``SGLANG_MORPH_CACHE_DIR``), so every build really happens; the converted models
are linked into that cache so that ``serve.sh`` does not convert the default model again. The
lock and atomicity tests use a cheap build (W8 only, no calibration) in subprocesses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import REPO_ROOT, running_server
from sglang_morph.morph import auto_build
from sglang_morph.morph.config import MorphConfigError

# The same cheap spec in the test process and in the builder subprocesses.
CHEAP_SPEC_CODE = """
import dataclasses
from sglang_morph.morph import auto_build
_spec = auto_build.default_spec()
SPEC = dataclasses.replace(
    _spec, recipe=dataclasses.replace(_spec.recipe, bits=(8,), awq=False), profile_bits=8,
    profile_samples=2, profile_tokens_per_sample=32)
"""
BUILDER_CODE = CHEAP_SPEC_CODE + """
import json, sys
variants = auto_build.ensure_variants(sys.argv[1], SPEC)
print(json.dumps({"built": variants.built, "entry": str(variants.entry_dir)}))
"""
BUILD_TIMEOUT_S = 600


def cheap_spec() -> auto_build.AutoBuildSpec:
    scope: dict = {}
    exec(CHEAP_SPEC_CODE, scope)
    return scope["SPEC"]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from sglang_morph.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_model, default_model_path) -> Path:
    """An empty morph cache sharing the already converted models."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    for model in (tiny_model, default_model_path):
        (cache / "models" / model.name).symlink_to(model)
    monkeypatch.setenv("SGLANG_MORPH_CACHE_DIR", str(cache))
    return cache


def start_builder(model: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILDER_CODE, str(model)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)


def partials(entry: Path) -> list[Path]:
    return sorted(entry.parent.glob(f".{entry.name}.partial-*"))


def test_concurrent_builders_build_once(cache, tiny_model):
    """Two builders wait on one lock; released together, one builds and the other reuses."""
    from filelock import FileLock

    spec = cheap_spec()
    entry = auto_build.entry_dir(tiny_model, spec, None)
    entry.parent.mkdir(parents=True)
    held = FileLock(f"{entry}.lock")
    held.acquire()  # as a build in progress would
    procs = [start_builder(tiny_model) for _ in range(2)]
    try:
        # Both are blocked on the lock once each has said so on stderr.
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        for proc in procs:
            line = ""
            while "waiting for it" not in line:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline
                line = proc.stderr.readline()
        assert not entry.exists()
        held.release()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
            assert proc.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        if held.is_locked:
            held.release()
        for proc in procs:
            proc.kill()
    assert sorted(r["built"] for r in results) == [False, True]
    assert {r["entry"] for r in results} == {str(entry)}
    assert auto_build.is_complete(entry) and not partials(entry)
    order = json.loads((entry / auto_build.SWAP_ORDER_FILE).read_text())
    assert sorted(order["order"]) == [0, 1, 2, 3]
    assert order["engines"] == str(entry / auto_build.ENGINES_DIR)


def test_a_killed_build_leaves_nothing_that_is_reused(cache, tiny_model):
    """SIGKILL once the builder has written variant files: no entry exists, and the next build
    removes the leftovers and builds the whole entry."""
    spec = cheap_spec()
    entry = auto_build.entry_dir(tiny_model, spec, None)
    proc = start_builder(tiny_model, start_new_session=True)
    try:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while not any(p for d in partials(entry) for p in d.rglob("*.safetensors")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not entry.exists() and not auto_build.is_complete(entry)
    assert partials(entry)  # what the killed build left
    variants = auto_build.ensure_variants(tiny_model, spec)
    assert variants.built and auto_build.is_complete(entry) and not partials(entry)
    from sglang_morph.engines.manifest import EngineManifest

    manifest = EngineManifest.load(variants.engines_dir)
    manifest.check_integrity(variants.engines_dir, verify_checksums=True)
    assert set(manifest.bits_available) == {16, 8}
    again = auto_build.ensure_variants(tiny_model, spec)
    assert not again.built and again.entry_dir == entry


def test_the_cache_key_follows_the_model_files(tmp_path):
    """Another config or rewritten weights name another entry; the same files the same one."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    key = auto_build.model_key(model)
    assert auto_build.model_key(model) == key
    os.utime(model / "model.safetensors", ns=(1, 1))
    assert auto_build.model_key(model) != key
    key = auto_build.model_key(model)
    (model / "config.json").write_text('{"num_hidden_layers": 3}')
    assert auto_build.model_key(model) != key


def test_a_model_the_builder_cannot_handle_is_one_line(cache, tmp_path):
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "attention_bias": True}))
    with pytest.raises(MorphConfigError, match=r"^--enable-morph: cannot build W8/W4 variants "
                       r"of .*Qwen2ForCausalLM.*--morph-engines DIR$"):
        auto_build.ensure_variants(model, cheap_spec())
    assert not (cache / auto_build.ENTRIES_DIR).exists()


def test_an_unwritable_cache_is_one_line(tmp_path, monkeypatch, tiny_model):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("SGLANG_MORPH_CACHE_DIR", str(not_a_dir))
    with pytest.raises(MorphConfigError, match=r"^--enable-morph: cannot write the variants "
                       r"cache .*SGLANG_MORPH_CACHE_DIR"):
        auto_build.ensure_variants(tiny_model, cheap_spec())


def test_a_bad_precision_map_fails_at_parse_time_before_any_build(cache, tiny_model):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from sglang_morph.surface import PluginError

    load_plugins()
    with pytest.raises(PluginError, match="layer 7 does not exist; the model has 4 layers"):
        prepare_server_args(["--model-path", str(tiny_model), "--enable-morph",
                             "--morph-precision-map", "7:4"])
    assert not (cache / auto_build.ENTRIES_DIR).exists()


@pytest.mark.server
def test_the_launcher_refuses_an_unwritable_cache_with_one_line(tmp_path, tiny_model):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    # SGLang's launcher itself: serve.sh's setup would first convert the default model into
    # the broken cache and fail there.
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model),
         "--enable-morph", "--device", "cpu", "--attention-backend", "torch_native",
         "--host", "127.0.0.1", "--port", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1",
             "SGLANG_MORPH_CACHE_DIR": str(not_a_dir)},
    )
    assert proc.returncode != 0
    assert "sglang-morph: error: --enable-morph: cannot write the variants cache" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----- a live server ---------------------------------------------------------------------------

SERVER_ARGS = ("--dtype", "float32", "--enable-morph", "--max-total-tokens", "2048")


def morph_status(server) -> dict:
    r = requests.get(f"{server.url}/morph/status", timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def entry_state(cache: Path) -> dict[str, int]:
    """Every file of the cache's morph entries and its mtime (ns)."""
    root = cache / auto_build.ENTRIES_DIR
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.server
def test_enable_morph_alone_builds_once_then_reuses_and_morphs(cache, tiny_model, tmp_path):
    """An empty cache: the first start builds the variants and the layer order and serves with
    the controller on, starting from SGLang's own KV pool; a second start reuses the entry
    unchanged and is faster; under a burst the controller swaps layers and restores them."""
    args = ("--model-path", str(tiny_model), *SERVER_ARGS)
    started_s = time.monotonic()
    with running_server(args, tmp_path / "first") as srv:
        first_start_s = time.monotonic() - started_s
        status = morph_status(srv)
        log = (tmp_path / "first" / "server.log").read_text()
    assert "first-use build" in log and "built " in log
    assert status["available_bits"] == [4, 8, 16]
    assert status["controller"] is True
    (entry,) = [p for p in (cache / auto_build.ENTRIES_DIR).iterdir() if p.is_dir()]
    assert auto_build.is_complete(entry)
    assert status["swap_order"] == json.loads((entry / auto_build.SWAP_ORDER_FILE).read_text())[
        "order"]
    # The budget is SGLang's own sizing: its weights plus the pool --max-total-tokens asked for.
    assert status["kv_capacity_tokens"] == 2048
    assert status["memory_budget_bytes"] == status["weight_bytes"] + 2048 * status[
        "kv_bytes_per_token"]
    built = entry_state(cache)

    morph_log = tmp_path / "transitions.jsonl"
    started_s = time.monotonic()
    with running_server((*args, "--morph-log", str(morph_log)), tmp_path / "second") as srv:
        second_start_s = time.monotonic() - started_s
        log = (tmp_path / "second" / "server.log").read_text()
        start = morph_status(srv)
        peak_layers = burst(srv, start["kv_capacity_tokens"])
        deadline = time.monotonic() + 240  # restores come a quiet window apart
        while time.monotonic() < deadline:
            after = morph_status(srv)
            if after["quantized_layers"] == 0:
                break
            time.sleep(1.0)
    print(f"first start (build included) {first_start_s:.1f} s, second start "
          f"{second_start_s:.1f} s")
    # Reused, not rebuilt: the log and the entry's files say so. (The start times are only
    # printed: with another test process starting servers beside this one, a start varies by
    # tens of seconds, and a second start was once measured slower than the first.)
    assert "first-use build" not in log
    assert entry_state(cache) == built  # nothing rebuilt, nothing rewritten
    logged = [json.loads(line) for line in morph_log.read_text().splitlines()]
    actions = [x["action"] for x in logged]
    assert "swap" in actions and actions[-1] == "restore", actions
    assert all(x["source"] == "controller" for x in logged)
    assert max(x["kv_capacity_tokens_after"] for x in logged) > start["kv_capacity_tokens"]
    assert peak_layers > 0 or len(logged) >= 2
    assert after["quantized_layers"] == 0, after["transitions"]
    assert after["kv_capacity_tokens"] == start["kv_capacity_tokens"]


def burst(server, kv_capacity_tokens: int) -> int:
    """Twelve concurrent greedy requests that need about 1.4x the KV pool; the most quantized
    layers seen while they run."""
    import random

    def one(seed: int) -> None:
        ids = random.Random(seed).choices(range(100, 40_000), k=200)
        requests.post(f"{server.url}/generate", timeout=900, json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}})

    assert 12 * 232 > 1.3 * kv_capacity_tokens
    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    peak = 0
    while any(th.is_alive() for th in threads):
        peak = max(peak, morph_status(server)["quantized_layers"])
        time.sleep(0.3)
    return peak
