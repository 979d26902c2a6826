"""The elastic core: the loop, the recorder, the mechanism registry, and a toy mechanism built
only on the contract, running on a live server (``tests/toy_mechanism``)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
from pathlib import Path

import pytest
import requests

from sglang_morph.elastic.contract import ElasticError, Outcome, Transition
from sglang_morph.elastic.loop import ElasticLoop
from sglang_morph.elastic.record import TransitionRecorder
from toy_mechanism.mechanism import Load, Noop, PressureRule

TESTS_DIR = Path(__file__).resolve().parents[1]  # holds toy_mechanism


class FakeMechanism:
    """Counts what the loop asks of it; refuses when told to."""

    name = "fake"

    def __init__(self, leader: bool = True, refuse: bool = False):
        self.leader, self.refuse = leader, refuse
        self.observed = self.applied = self.checked = 0
        self.capacity = 100

    def observe(self) -> Load:
        self.observed += 1
        return Load(requests=5, kv_capacity_tokens=self.capacity)

    def apply(self, action: Noop) -> Transition:
        if self.refuse:
            raise ElasticError("not now", status_code=409)
        self.applied += 1
        self.capacity += 10
        return Transition("fake", 0, "grow", action.reason, Outcome.APPLIED, 0.01,
                          self.capacity - 10, self.capacity)

    def is_leader(self) -> bool:
        return self.leader

    def state(self) -> dict:
        return {"kv_capacity_tokens": self.capacity}

    def check_integrity(self) -> None:
        self.checked += 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_loop_is_rate_limited_and_records_every_outcome(tmp_path):
    clock, mechanism = Clock(), FakeMechanism()
    rec = TransitionRecorder(replica=0, log_path=str(tmp_path / "log.jsonl"))
    loop = ElasticLoop(mechanism, PressureRule(requests=1, pause_s=0.0), rec, interval_s=0.5,
                       clock=clock)
    for _ in range(100):  # one step's worth of busy-loop calls: one observation
        loop.on_step()
    assert (mechanism.observed, mechanism.applied, mechanism.checked) == (1, 1, 1)
    clock.now = 0.6
    loop.on_step()
    assert (mechanism.observed, mechanism.applied) == (2, 2)
    mechanism.refuse = True
    clock.now = 1.2
    loop.on_step()
    recent = rec.recent("fake")
    assert [t.outcome for t in recent] == [Outcome.APPLIED, Outcome.APPLIED, Outcome.REFUSED]
    # A refused transition changed nothing: its capacities are equal and its error is kept.
    assert recent[-1].capacity_before_tokens == recent[-1].capacity_after_tokens == 120
    assert recent[-1].error == "not now" and recent[-1].action == "Noop"
    assert rec.summary("fake")["totals"] == {"applied": 2, "refused": 1, "failed": 0}
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["outcome"] for x in logged] == ["applied", "applied", "refused"]
    assert logged[0]["capacity_after_tokens"] == 110 and logged[0]["mechanism"] == "fake"


def test_only_the_leader_decides():
    clock, follower = Clock(), FakeMechanism(leader=False)
    loop = ElasticLoop(follower, PressureRule(requests=1), TransitionRecorder(0), 0.1, clock)
    loop.on_step()
    assert follower.observed == 1 and follower.applied == 0
    assert loop.last_observation == Load(5, 100)


def test_a_failed_transition_is_recorded_as_failed():
    mechanism = FakeMechanism()
    rec = TransitionRecorder(0)

    def fail(action):
        raise ElasticError("undone", status_code=500)

    mechanism.apply = fail
    t = ElasticLoop(mechanism, PressureRule(1), rec, 0.1, Clock()).run(Noop("op"), "operator")
    assert t.outcome is Outcome.FAILED and t.reason == "operator"


def test_recorder_keeps_the_last_transitions_per_mechanism():
    from sglang_morph.elastic.record import RECENT_TRANSITIONS

    rec = TransitionRecorder(0)
    for i in range(RECENT_TRANSITIONS + 5):
        rec.record(Transition("a", 0, "x", str(i), Outcome.APPLIED, 0.0, 0, 0))
    rec.record(Transition("b", 0, "y", "", Outcome.FAILED, 0.0, 0, 0))
    assert [t.reason for t in rec.recent("a")][0] == "5"
    assert len(rec.recent("a")) == RECENT_TRANSITIONS and len(rec.recent("b")) == 1
    assert rec.summary("a")["totals"]["applied"] == RECENT_TRANSITIONS + 5


def test_the_answer_of_a_route_whose_mechanism_is_not_running_is_503_naming_it():
    from sglang_morph.elastic.control import not_running

    response = not_running("KunServe")
    assert response.status_code == 503
    assert json.loads(response.body) == {"error": "KunServe is not running in this server"}


def test_registry_lists_every_mechanism_and_their_flags(monkeypatch):
    from sglang_morph import plugin

    plugin.mechanisms.cache_clear()
    monkeypatch.setenv(plugin.EXTRA_MECHANISMS_ENV, "toy_mechanism.mechanism")
    try:
        assert [m.name for m in plugin.mechanisms()] == ["morph", "kunserve", "amoebas", "iserve",
                                                       "toy"]
        parser = argparse.ArgumentParser()
        plugin.add_cli_args(parser)
        flags = {a for action in parser._actions for a in action.option_strings}
        assert {"--elastic-log", "--enable-morph", "--enable-kunserve", "--enable-amoebas",
                "--enable-iserve-profiling", "--enable-toy"} <= flags
    finally:
        plugin.mechanisms.cache_clear()


def test_a_mechanisms_bad_flag_is_one_line_and_attaches_nothing(monkeypatch):
    from sglang_morph.plugin import configure
    from sglang_morph.surface import PluginError
    from toy_mechanism.mechanism import MECHANISM, SERVER_ARGS_ATTR

    server_args = argparse.Namespace()
    with pytest.raises(PluginError, match="^sglang-morph: error: --toy-requests requires "
                                          "--enable-toy$"):
        configure(MECHANISM, server_args, argparse.Namespace(toy_requests=2), frozenset())
    assert not hasattr(server_args, SERVER_ARGS_ATTR)


# ---- the toy mechanism on a live server ----

def _generate(server, text: str) -> dict:
    r = requests.post(f"{server.url}/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                        "ignore_eos": True}}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.server
def test_toy_mechanism_runs_on_a_live_server(tmp_path_factory):
    from conftest import running_server

    log = tmp_path_factory.mktemp("toy") / "elastic.jsonl"
    env = {"SGLANG_MORPH_EXTRA_MECHANISMS": "toy_mechanism.mechanism",
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    args = ["--enable-toy", "--toy-requests", "2", "--elastic-log", str(log), "--enable-metrics"]
    with running_server(args, tmp_path_factory.mktemp("toy_server"), env) as server:
        r = requests.get(f"{server.url}/elastic/status", timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["mechanisms"] == ["toy"]
        (idle,) = r.json()["replicas"]
        assert idle["mechanisms"]["toy"]["transitions"]["totals"]["applied"] == 0
        prompts = [f"Write a sentence about the number {i}." for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: _generate(server, p), prompts))
        assert all(o["meta_info"]["completion_tokens"] == 24 for o in outs)
        deadline = time.monotonic() + 30
        while True:
            (replica,) = requests.get(f"{server.url}/elastic/status", timeout=60).json()[
                "replicas"]
            toy = replica["mechanisms"]["toy"]
            if toy["transitions"]["totals"]["applied"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        recent = toy["transitions"]["recent"]
        assert recent and recent[0]["action"] == "noop" and recent[0]["outcome"] == "applied"
        assert recent[0]["reason"].endswith(">= 2")
        assert recent[0]["capacity_before_tokens"] == toy["state"]["kv_capacity_tokens"]
        logged = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(logged) == toy["transitions"]["totals"]["applied"]
        assert {x["mechanism"] for x in logged} == {"toy"}
        metrics = requests.get(f"{server.url}/metrics", timeout=60).text
        assert (f'sglang_morph_elastic_transitions_total{{action="noop",mechanism="toy",'
                f'outcome="applied",replica="0"}} {float(len(logged))}') in metrics
        # The no-op changed nothing a request sees: the same prompt, the same tokens.
        assert _generate(server, prompts[0])["text"] == outs[0]["text"]
