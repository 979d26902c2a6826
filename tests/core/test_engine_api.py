"""``sglang.Engine(...)`` takes the plugin's options as keyword arguments, with the same checks
as the command line, and ``sglang_morph.morph.engine_api`` swaps layers through the Engine.

The Engine runs in a fresh Python process, as in a user's program: its first ``sglang.Engine``
loads the plugins from inside ``Engine.__init__``, a later one finds them loaded (two ways in
for the options, both checked). The tiny random Llama (4 layers) keeps it quick; its variants
come from the cache (built on first use, as ``--enable-morph`` alone does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

ENGINE_SCRIPT = r"""
import json, sys

import sglang

from sglang_morph.morph import engine_api

model = sys.argv[1]
cpu = dict(device="cpu", attention_backend="torch_native", dtype="float32",
           max_total_tokens=2048, sleep_on_idle=True)
report = {"errors": {}}


def refused(name, **kwargs):
    try:
        sglang.Engine(model_path=model, **cpu, **kwargs)
    except (ValueError, TypeError) as e:
        report["errors"][name] = f"{type(e).__name__}: {e}"


# The first Engine of this process: SGLang loads the plugins inside its __init__.
refused("first", enable_morph=True, morph_mode="fast")
# From here the plugins are loaded: later Engines take the options through the plugin's hook.
refused("switch", enable_morph="yes")
refused("without_enable", morph_log="/tmp/x.jsonl")
refused("budget", enable_morph=True, morph_memory_budget="1MB")
refused("unknown_sglang_field", enable_morph=True, no_such_field=1)

engine = sglang.Engine(model_path=model, **cpu, enable_morph=True, morph_mode="performance",
                       disable_morph_controller=True)
try:
    ids = list(range(1000, 1040))

    def generate():
        engine.flush_cache()  # every generation prefills in full: same shapes, same numbers
        out = engine.generate(input_ids=ids, return_logprob=True, sampling_params={
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        return {"ids": out["output_ids"],
                "logprobs": [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                "precision": out["meta_info"].get("morph_precision")}

    report["status"] = engine_api.status(engine)
    report["full"] = generate()
    report["swapped"] = engine_api.swap(engine, [0, 1, 2, 3], 4)
    report["w4"] = generate()
    report["restored"] = engine_api.swap(engine, [0, 1, 2, 3], 16)
    report["full_again"] = generate()
    try:
        engine_api.swap(engine, [9], 4)
    except engine_api.MorphControlError as e:
        report["bad_swap"] = [e.status_code, e.message]
finally:
    engine.shutdown()
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from sglang_morph.models.tiny import tiny_model_path

    model = tiny_model_path()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE_SCRIPT, str(model)], stdout=subprocess.PIPE,
            stderr=out, text=True, start_new_session=True,
            env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
        try:
            stdout, _ = proc.communicate(timeout=900)
        finally:
            # The engine shuts down in the script; its process group goes in any case.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, log.read_text()[-6000:]
    return json.loads(lines[-1].removeprefix("REPORT "))


pytestmark = pytest.mark.server


def test_bad_options_are_refused_like_the_flags(report):
    errors = report["errors"]
    assert errors["first"].startswith("ConfigError: argument --morph-mode: invalid choice: "
                                      "'fast'"), errors
    assert "--enable-morph (enable_morph=...): expected True or False" in errors["switch"]
    assert "--morph-log requires --enable-morph" in errors["without_enable"]
    # The launcher's checks too: the budget sizes the pool, so it excludes --max-total-tokens.
    assert errors["budget"] == ("ConfigError: sglang-morph: error: --morph-memory-budget sizes "
                                "the KV pool itself; drop --max-total-tokens"), errors
    # SGLang's own fields keep SGLang's own check.
    assert errors["unknown_sglang_field"].startswith("TypeError") and "no_such_field" in errors[
        "unknown_sglang_field"]


def test_the_engine_serves_with_the_options_given(report):
    status = report["status"]
    assert status["available_bits"] == [4, 8, 16]
    assert status["mode"] == "performance" and status["controller"] is False
    assert [x["bits"] for x in status["layers"]] == [16, 16, 16, 16]
    assert status["kv_capacity_tokens"] == 2048


def test_a_swap_through_the_engine_changes_the_forward_and_a_restore_undoes_it(report):
    full, w4, again = report["full"], report["w4"], report["full_again"]
    assert [x["bits"] for x in report["swapped"]["layers"]] == [4, 4, 4, 4]
    assert report["swapped"]["kv_capacity_tokens"] > report["status"]["kv_capacity_tokens"]
    assert w4["logprobs"] != full["logprobs"]
    assert [x["bits"] for x in report["restored"]["layers"]] == [16, 16, 16, 16]
    assert report["restored"]["kv_capacity_tokens"] == report["status"]["kv_capacity_tokens"]
    assert again == full  # the untransformed model's tokens and logprobs, exactly
    assert report["bad_swap"][0] == 400 and "9" in report["bad_swap"][1]
