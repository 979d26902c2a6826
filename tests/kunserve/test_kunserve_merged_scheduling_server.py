"""Scheduling while merged: admission control (``--kunserve-merged-max-running N``) and mixed
chunked prefill (``--kunserve-merged-chunked-prefill TOKENS``).

One DP 2 server (float32, greedy, CPU) with N = 2, chunks of 256 tokens and G = 16. The reference
outputs are the whole replicas' own, before the drop.

- whole, a replica runs several requests at once (the cap is SGLang's as launched) and
  prefills a prompt in one step (the launch's chunking, not mixed);
- after a drop each replica runs at most two requests, the others wait in its queue, and every
  request finishes with the undropped output;
- merged, a long prompt prefills in chunks whose steps carry a running stream's decodes, and
  both finish with the undropped outputs;
- after the restore the launch cap and chunking are back and requests run together again;
- merged, a replica fits the chunk cost model on its own micro-batches and cuts its later
  prefills by it, with the undropped outputs;
- admission pacing (``--kunserve-merged-prefill-gap-steps G``): the pacing rule on a stand-in
  replica (the cap held at the running count until G decode steps since the last prefill,
  then put back; none without a queue or running requests; the first prefill after a drop
  free); live, merged, a long prompt that arrives while a stream decodes waits for the stream's
  steps (counted in ``prefills_paced``) and both finish with the undropped outputs;
- decode first (``--kunserve-merged-priority decode``): while one replica's cut prefill runs
  through the other's layers, the other's decode steps go between its micro-batches (none
  held back), with the undropped outputs;
- the flags need ``--enable-kunserve`` and default to SGLang's scheduling (bad values:
  ``test_kunserve_live.py``).
"""

from __future__ import annotations

import argparse
import threading
import time
import types

import pytest

from sglang_morph.kunserve.live import config as kunserve_config
from sglang_morph.kunserve.live.replica import KunServeReplica
from sglang_morph.surface import PluginError
# (corpus_ids and tokenizer are that module's fixtures)
from test_kunserve_live import configure_kunserve, generate_on, launch_args, post, status
from test_morph_runtime_server import Stream, corpus_ids, prompt_ids, tokenizer  # noqa: F401

N_NEW = 24
PROMPT_LENGTHS = (24, 40, 56)
CAP = 2
CHUNK_TOKENS = 256
LONG_PROMPT_TOKENS, LONG_NEW = 600, 8  # three chunks, each cut into micro-batches
CUT_PROMPT_TOKENS, CUT_PROMPTS = 200, 5  # not chunked; cut into three micro-batches each
STREAM_PROMPT_TOKENS, STREAM_NEW = 24, 64
GAP_STEPS = 16  # admission pacing: within a stream's STREAM_NEW, after its wait_for(4)


@pytest.mark.parametrize("field, flag, value", [
    ("kunserve_merged_max_running", "--kunserve-merged-max-running", 3),
    ("kunserve_merged_chunked_prefill", "--kunserve-merged-chunked-prefill", 64),
    ("kunserve_merged_prefill_gap_steps", "--kunserve-merged-prefill-gap-steps", 8),
])
def test_the_flags_need_kunserve_and_default_to_none(field, flag, value):
    with pytest.raises(PluginError, match=f"{flag} needs --enable-kunserve"):
        configure_kunserve(launch_args(), argparse.Namespace(**{field: value}), False)
    from_cli = kunserve_config.KunServeLiveConfig.from_cli_namespace
    name = field.removeprefix("kunserve_")
    assert getattr(from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=1)),
                   name) is None
    assert getattr(from_cli(argparse.Namespace(enable_kunserve=True, kunserve_link_port=1,
                                               **{field: value})), name) == value


def test_the_priority_needs_kunserve_and_defaults_to_prefill():
    with pytest.raises(PluginError, match="--kunserve-merged-priority needs --enable-kunserve"):
        configure_kunserve(launch_args(), argparse.Namespace(kunserve_merged_priority="decode"),
                           False)
    from_cli = kunserve_config.KunServeLiveConfig.from_cli_namespace
    on = dict(enable_kunserve=True, kunserve_link_port=1)
    assert from_cli(argparse.Namespace(**on)).merged_priority == "prefill"
    assert from_cli(argparse.Namespace(**on, kunserve_merged_priority="decode")
                    ).merged_priority == "decode"
    with pytest.raises(kunserve_config.KunServeConfigError,
                       match="--kunserve-merged-priority must be one of prefill, decode, got "
                             "'first'"):
        kunserve_config.KunServeLiveConfig(merged_priority="first")


def test_the_gap_must_be_a_positive_integer():
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(kunserve_config.KunServeConfigError,
                           match="--kunserve-merged-prefill-gap-steps must be an integer >= 1"):
            kunserve_config.KunServeLiveConfig(merged_prefill_gap_steps=bad)


class _Req:
    def __init__(self, finished: bool = False):
        self._finished = finished

    def finished(self) -> bool:
        return self._finished


def paced_replica(gap: int | None, merged: bool = True, running: int = 2, queued: int = 1,
                  merged_cap: int | None = None) -> types.SimpleNamespace:
    """A stand-in for ``KunServeReplica`` with what its pacing reads; ``caps`` lists every
    running-request cap set on SGLang."""
    r = types.SimpleNamespace(
        merged_prefill_gap_steps=gap, merged=merged, merged_max_running=merged_cap,
        _whole_max_running=48, decodes_since_prefill=0, paced_cap=None, prefills_paced=0,
        merged_chunked_prefill=None, caps=[],
        scheduler=types.SimpleNamespace(waiting_queue=[_Req()] * queued,
                                        running_batch=types.SimpleNamespace(batch_is_full=True)))
    reqs = [_Req() for _ in range(running)]
    r.live_requests = lambda: reqs
    r._base_running_cap = lambda: KunServeReplica._base_running_cap(r)
    r._set_running_cap = r.caps.append
    return r


def forward(mode: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(forward_mode=types.SimpleNamespace(
        is_decode=lambda: mode == "decode", is_extend=lambda: mode == "extend"))


def test_pacing_holds_the_cap_at_the_running_count_until_the_gap_is_decoded():
    r = paced_replica(gap=3)
    KunServeReplica._pace(r)
    assert r.caps == [2] and r.prefills_paced == 1  # nothing admitted beside the two running
    for expected in (1, 2):
        KunServeReplica.count_merged_forward(r, forward("decode"))
        assert r.decodes_since_prefill == expected
        KunServeReplica._pace(r)
        assert r.caps == [2]  # held, not set again
    assert r.prefills_paced == 3
    KunServeReplica.count_merged_forward(r, forward("decode"))
    KunServeReplica._pace(r)
    # The gap is decoded: SGLang's cap is back, and its refused admission's flag cleared
    assert r.caps == [2, 48] and r.prefills_paced == 3
    assert r.scheduler.running_batch.batch_is_full is False
    KunServeReplica.count_merged_forward(r, forward("extend"))  # the queue's prefill ran
    assert r.decodes_since_prefill == 0
    KunServeReplica._pace(r)
    assert r.caps == [2, 48, 2]


def test_pacing_holds_nothing_without_a_queue_running_requests_a_merge_or_the_flag():
    for r in (paced_replica(gap=3, queued=0), paced_replica(gap=3, running=0),
              paced_replica(gap=3, merged=False), paced_replica(gap=None)):
        KunServeReplica._pace(r)
        assert r.caps == [] and r.prefills_paced == 0


def test_pacing_holds_under_the_merged_cap_and_puts_it_back():
    r = paced_replica(gap=2, running=5, merged_cap=3)
    KunServeReplica._pace(r)
    assert r.caps == [3]  # never above the cap admission control sets while merged
    r.decodes_since_prefill = 2
    KunServeReplica._pace(r)
    assert r.caps == [3, 3]


def test_the_first_prefill_after_a_drop_is_not_paced_and_a_restore_puts_the_cap_back():
    r = paced_replica(gap=5)
    KunServeReplica._admit(r)  # the drop
    assert r.decodes_since_prefill == 5 and r.caps == []
    KunServeReplica._pace(r)
    assert r.caps == [] and r.prefills_paced == 0
    r.decodes_since_prefill = 0
    KunServeReplica._pace(r)
    assert r.caps == [2]
    r.merged = False
    KunServeReplica._admit(r)  # the restore while held: the launch's cap
    assert r.caps == [2, 48] and r.paced_cap is None


def test_a_pacing_error_is_logged_and_the_step_goes_on(caplog):
    def fail() -> None:
        raise RuntimeError("SGLang refused the running-request cap 0")

    ran = []
    r = types.SimpleNamespace(shrink_pending_tokens=0, replica=1, _pace=fail,
                              auto=types.SimpleNamespace(on_step=lambda: ran.append("auto")))
    KunServeReplica.on_step(r)  # raises nothing: the scheduler's step must go on
    assert ran == ["auto"]
    assert "admission pacing" in caplog.text and "cap 0" in caplog.text


@pytest.fixture(scope="module")
def capped(server_factory):
    return server_factory("--dtype", "float32", "--dp-size", "2", "--enable-kunserve",
                          "--max-total-tokens", "1024", "--kunserve-merged-max-running", str(CAP),
                          "--kunserve-merged-chunked-prefill", str(CHUNK_TOKENS),
                          "--kunserve-merged-priority", "decode",
                          "--kunserve-merged-prefill-gap-steps", str(GAP_STEPS),
                          "--api-key", "test-api-key", "--admin-api-key", "test-admin-key")


@pytest.fixture(scope="module")
def prompts(corpus_ids):  # noqa: F811
    return [prompt_ids(corpus_ids, seed=40 + i, n_tokens=n)
            for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def undropped(capped, prompts):
    return [generate_on(capped, ids, 0, N_NEW) for ids in prompts]


@pytest.fixture(scope="module")
def long_and_stream(corpus_ids):  # noqa: F811
    """A long prompt and a stream's prompt for each replica."""
    return [(prompt_ids(corpus_ids, seed=50 + 2 * r, n_tokens=LONG_PROMPT_TOKENS),
             prompt_ids(corpus_ids, seed=51 + 2 * r, n_tokens=STREAM_PROMPT_TOKENS))
            for r in (0, 1)]


@pytest.fixture(scope="module")
def long_and_stream_undropped(capped, long_and_stream):
    """Each replica's pair of prompts served whole on the other replica: a replica's radix
    cache must not hold its prompts, or the merged run below would prefill nothing."""
    return [(generate_on(capped, long_ids, 1 - r, LONG_NEW),
             generate_on(capped, stream_ids, 1 - r, STREAM_NEW))
            for r, (long_ids, stream_ids) in enumerate(long_and_stream)]


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


def test_whole_replicas_run_requests_together(capped, prompts, undropped,
                                              long_and_stream_undropped):
    s = status(capped)
    for rep in s["replicas"]:
        assert rep["merged_max_running_requests"] == CAP
        assert (rep["merged_prefill_gap_steps"], rep["prefills_paced"]) == (GAP_STEPS, 0)
        assert rep["max_running_requests"] > len(prompts)
        assert rep["merged_chunked_prefill_tokens"] == CHUNK_TOKENS
        assert rep["chunked_prefill_size"] > LONG_PROMPT_TOKENS and not rep["mixed_chunk"]
        assert rep["batches_mixed"] == 0
    outputs, most_running, _ = together_on_replica_0(capped, prompts)
    assert outputs == undropped
    assert most_running >= 2
    # Each replica has prefilled and decoded whole: the pay rule's measured rate is there
    for rep in status(capped)["replicas"]:
        rate = rep["load"]["prefill_tokens_per_step"]
        assert isinstance(rate, float) and rate > 1, rep["load"]


def test_merged_replicas_run_at_most_the_cap_and_serve_undropped_outputs(
        capped, prompts, undropped, long_and_stream, long_and_stream_undropped):
    before = status(capped)["replicas"]
    whole = [rep["max_running_requests"] for rep in before]
    whole_chunk = [rep["chunked_prefill_size"] for rep in before]
    r = post(capped, "drop")
    assert r.status_code == 200, r.text
    merged = r.json()["replicas"]
    assert [rep["max_running_requests"] for rep in merged] == [CAP, CAP]
    assert [(rep["chunked_prefill_size"], rep["mixed_chunk"]) for rep in merged] == [
        (CHUNK_TOKENS, True)] * 2
    outputs, most_running, most_waiting = together_on_replica_0(capped, prompts)
    assert outputs == undropped
    assert most_running == CAP and most_waiting >= 1
    # the other replica serves beside it, also capped
    assert [generate_on(capped, ids, 1, N_NEW) for ids in prompts] == undropped

    # A long prompt arrives while a stream decodes on the same replica: it prefills in
    # chunks, and every chunk's step carries the stream's decode (mixed batches), so the
    # stream keeps producing tokens through the prefill. On the front member, and on the back
    # member, whose batches go to the front's layers before its forward.
    # The long prompt arrives within GAP_STEPS of the stream's prefill: it waits for them.
    for replica, (long_ids, stream_ids) in enumerate(long_and_stream):
        mixed_before = status(capped)["replicas"][replica]["batches_mixed"]
        paced_before = status(capped)["replicas"][replica]["prefills_paced"]
        stream = Stream(capped, stream_ids, STREAM_NEW, routed_dp_rank=replica)
        stream.wait_for(4)
        long_out = generate_on(capped, long_ids, replica, LONG_NEW)
        assert len(stream.ids) < STREAM_NEW, "the stream ended before the long prompt"
        assert (long_out, stream.join()) == long_and_stream_undropped[replica]
        chunks = -(-LONG_PROMPT_TOKENS // CHUNK_TOKENS)
        after = status(capped)["replicas"][replica]
        assert after["batches_mixed"] - mixed_before >= chunks - 1
        assert after["prefills_paced"] > paced_before

    r = post(capped, "restore")
    assert r.status_code == 200, r.text
    restored = r.json()["replicas"]
    assert [rep["max_running_requests"] for rep in restored] == whole
    assert [rep["chunked_prefill_size"] for rep in restored] == whole_chunk
    assert not any(rep["mixed_chunk"] for rep in restored)
    outputs, most_running, _ = together_on_replica_0(capped, prompts)
    assert outputs == undropped
    assert most_running >= 2
    assert generate_on(capped, long_and_stream[0][0], 0,
                       LONG_NEW) == long_and_stream_undropped[0][0]


def test_merged_prefills_are_cut_by_the_cost_model_fitted_on_their_micro_batches(
        capped, corpus_ids):  # noqa: F811
    prompts = [prompt_ids(corpus_ids, seed=60 + i, n_tokens=CUT_PROMPT_TOKENS)
               for i in range(CUT_PROMPTS + 1)]
    # On replica 1: replica 0's radix cache must not hold them (the last is for decode first)
    reference = [generate_on(capped, ids, 1, N_NEW) for ids in prompts]
    # A stream for replica 1, on replica 0 for the same reason
    stream_ids = prompt_ids(corpus_ids, seed=70, n_tokens=STREAM_PROMPT_TOKENS)
    stream_reference = generate_on(capped, stream_ids, 0, STREAM_NEW)
    prompts, last_prompt = prompts[:CUT_PROMPTS], prompts[CUT_PROMPTS]
    r = post(capped, "drop")
    assert r.status_code == 200, r.text
    before = r.json()["replicas"][0]
    timings = before["micro_batch_timings"]
    outputs, models = [], []
    for ids in prompts:
        outputs.append(generate_on(capped, ids, 0, N_NEW))
        models.append(status(capped)["replicas"][0]["micro_batch_cost"])
    assert outputs == reference[:CUT_PROMPTS]
    # Three micro-batches a prompt, each stage timed; twelve timings fit the model, so at
    # least the last prompt was cut by it.
    after = status(capped)["replicas"][0]
    assert after["micro_batch_timings"] - timings == 3 * CUT_PROMPTS
    assert models[-1] is not None and set(models[-1]) >= {"alpha_s", "beta_s", "gamma_s"}
    assert all(v >= 0 for v in models[-1].values())
    # Decode first: while replica 0's cut prefill runs through replica 1's layers, replica
    # 1's stream keeps its steps going (none held back), and both outputs stay exact
    held = status(capped)["replicas"][1]["batches_held"]
    assert status(capped)["replicas"][1]["merged_priority"] == "decode"
    stream = Stream(capped, stream_ids, STREAM_NEW, routed_dp_rank=1)
    stream.wait_for(3)
    assert generate_on(capped, last_prompt, 0, N_NEW) == reference[CUT_PROMPTS]
    assert len(stream.ids) < STREAM_NEW, "the stream ended before the prefill"
    assert stream.join() == stream_reference
    assert status(capped)["replicas"][1]["batches_held"] == held
    r = post(capped, "restore")
    assert r.status_code == 200, r.text
