"""Admission control while merged: ``--kunserve-merged-max-running N``.

One DP 2 server (float32, greedy, CPU) with N = 1. The reference outputs are the whole
replicas' own, before the drop.

- whole, a replica runs several requests at once (the cap is SGLang's as launched);
- after a drop each replica runs at most one request, the others wait in its queue, and every
  request finishes with the undropped output;
- after the restore the launch cap is back and requests run together again;
- the flag needs ``--enable-kunserve`` and defaults to no cap (bad values:
  ``test_kunserve_live.py``).
"""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from sglang_morph.kunserve.live import config as kunserve_config
from sglang_morph.surface import PluginError
# (corpus_ids and tokenizer are that module's fixtures)
from test_kunserve_live import configure_kunserve, generate_on, launch_args, post, status
from test_morph_runtime_server import Stream, corpus_ids, prompt_ids, tokenizer  # noqa: F401

N_NEW = 24
PROMPT_LENGTHS = (24, 40, 56)


def test_the_cap_needs_kunserve_and_defaults_to_none():
    with pytest.raises(PluginError, match="--kunserve-merged-max-running needs --enable-kunserve"):
        configure_kunserve(launch_args(), argparse.Namespace(kunserve_merged_max_running=2),
                           False)
    from_cli = kunserve_config.KunServeLiveConfig.from_cli_namespace
    assert from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=1)
                    ).merged_max_running is None
    assert from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=1,
                                       kunserve_merged_max_running=3)).merged_max_running == 3


@pytest.fixture(scope="module")
def capped(server_factory):
    return server_factory("--dtype", "float32", "--dp-size", "2", "--enable-kunserve",
                          "--max-total-tokens", "1024", "--kunserve-merged-max-running", "1",
                          "--api-key", "test-api-key", "--admin-api-key", "test-admin-key")


@pytest.fixture(scope="module")
def prompts(corpus_ids):  # noqa: F811
    return [prompt_ids(corpus_ids, seed=40 + i, n_tokens=n)
            for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def undropped(capped, prompts):
    return [generate_on(capped, ids, 0, N_NEW) for ids in prompts]


def together_on_replica_0(server, prompts) -> tuple[list[list[int]], int, int]:
    """Every prompt streamed at once on replica 0, its status polled meanwhile: (the outputs,
    the most requests it ran at once, the most it queued)."""
    streams = [Stream(server, ids, N_NEW, routed_dp_rank=0) for ids in prompts]
    most_running = most_waiting = 0
    done = threading.Event()
    watcher_error: list[BaseException] = []

    def watch() -> None:
        nonlocal most_running, most_waiting
        try:
            while not done.is_set():
                load = status(server)["replicas"][0]["load"]
                most_running = max(most_running, load["running_reqs"])
                most_waiting = max(most_waiting, load["waiting_reqs"])
                time.sleep(0.02)
        except BaseException as e:  # reported below
            watcher_error.append(e)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outputs = [s.join() for s in streams]
    done.set()
    watcher.join(timeout=60)
    assert not watcher_error, watcher_error
    return outputs, most_running, most_waiting


def test_whole_replicas_run_requests_together(capped, prompts, undropped):
    s = status(capped)
    for rep in s["replicas"]:
        assert rep["merged_max_running_requests"] == 1
        assert rep["max_running_requests"] > len(prompts)
    outputs, most_running, _ = together_on_replica_0(capped, prompts)
    assert outputs == undropped
    assert most_running >= 2


def test_merged_replicas_run_at_most_the_cap_and_serve_undropped_outputs(capped, prompts,
                                                                        undropped):
    whole = [rep["max_running_requests"] for rep in status(capped)["replicas"]]
    r = post(capped, "drop")
    assert r.status_code == 200, r.text
    assert [rep["max_running_requests"] for rep in r.json()["replicas"]] == [1, 1]
    outputs, most_running, most_waiting = together_on_replica_0(capped, prompts)
    assert outputs == undropped
    assert most_running == 1 and most_waiting >= 1
    # the other replica serves beside it, also one at a time
    assert [generate_on(capped, ids, 1, N_NEW) for ids in prompts] == undropped

    r = post(capped, "restore")
    assert r.status_code == 200, r.text
    assert [rep["max_running_requests"] for rep in r.json()["replicas"]] == whole
    outputs, most_running, _ = together_on_replica_0(capped, prompts)
    assert outputs == undropped
    assert most_running >= 2
