"""Replica groups (``sglang_morph.groups``).

- ``GroupLink`` with three members in three real processes on 127.0.0.1: every member's calls
  reach every other member bit for bit and the answers come back on the caller's group; the
  all-gather returns every member's vote by rank; a voted transition over the real link is
  refused everywhere by one member's refusal and undone everywhere by one member's failure.
- ``GroupTransitions`` with three members in threads (an in-memory all-gather): a refusal on
  any member changes nothing anywhere; a failure in phase k on member m undoes phases < k on
  every member, phase k on the members that completed it and its partial work on m, newest
  first, and no later phase runs; the outcome, the error text and the record say so.
"""

from __future__ import annotations

import io
import itertools
import json
import multiprocessing as mp
import threading

import pytest
import torch

from sglang_morph.elastic.contract import Outcome
from sglang_morph.elastic.record import TransitionRecorder
from sglang_morph.groups.transition import GroupTransitions, LastStep, Phase, VotedTransition
from sglang_morph.server.ports import free_late_bind_port

MEMBERS = 3


# ---- a member's state: phases that log what they do ----


class Member:
    """Fake phases on one member: ``do`` adds the phase to ``state`` (a failing one adds only
    its partial work, then raises); ``undo`` removes whatever the phase left. ``log`` is the
    order of everything run."""

    def __init__(self, rank: int, fail_in: set[str] = frozenset(), undo_fails: set[str] =
                 frozenset(), last_fails: bool = False):
        self.rank, self.fail_in, self.undo_fails = rank, fail_in, undo_fails
        self.last_fails = last_fails
        self.state: set[str] = set()
        self.log: list[tuple[str, str]] = []

    def phase(self, name: str) -> Phase:
        def do():
            if name in self.fail_in:
                self.state.add(f"{name} (partial)")
                self.log.append(("partial", name))
                raise RuntimeError(f"{name} broke on member {self.rank}")
            self.state.add(name)
            self.log.append(("do", name))

        def undo():
            self.log.append(("undo", name))
            if name in self.undo_fails:
                raise OSError(f"cannot undo {name}")
            self.state -= {name, f"{name} (partial)"}

        return Phase(name, do, undo)

    def last(self) -> LastStep:
        def do():
            self.log.append(("last", "resize"))
            if self.last_fails:
                raise MemoryError("no room")
            self.state.add("resized")

        return LastStep(do, "every phase stays applied")


# ---- the voted transition, members in threads ----


class ThreadGroup:
    """An all-gather between threads, JSON on the way as on the link."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list = [None] * size
        self.rounds = [0] * size

    def gather(self, rank: int):
        def all_gather(value):
            self.slots[rank] = json.loads(json.dumps(value))
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()  # everyone has read this round before anyone writes the next
            self.rounds[rank] += 1
            return out

        return all_gather


PHASES = ("p0", "p1", "p2")


def run_group(members: list[Member], refusals=None, last: bool = False,
              replicas=None) -> tuple[list, list[TransitionRecorder]]:
    """Every member runs the same transition in its own thread; the records by rank."""
    group = ThreadGroup(len(members))
    replicas = replicas or list(range(len(members)))
    recorders = [TransitionRecorder(replicas[m.rank]) for m in members]
    records: list = [None] * len(members)
    errors: list = []

    def one(m: Member):
        try:
            runner = GroupTransitions(group.gather(m.rank), m.rank, replicas, "test",
                                      recorders[m.rank], lambda: len(m.state))
            t = VotedTransition(
                "grow", "a test", (refusals or {}).get(m.rank),
                tuple(m.phase(p) for p in PHASES), m.last() if last else None,
                detail={"trigger": "test"})
            records[m.rank] = runner.run(t, applied=lambda s: {"state": sorted(m.state)})
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert group.rounds[0] == group.rounds[-1]  # every member took part in every exchange
    return records, recorders


def test_every_member_applies_every_phase_in_order():
    members = [Member(r) for r in range(MEMBERS)]
    records, recorders = run_group(members, last=True)
    for m, rec, recorder in zip(members, records, recorders):
        assert m.log == [("do", p) for p in PHASES] + [("last", "resize")]
        assert m.state == {*PHASES, "resized"}
        assert rec.outcome is Outcome.APPLIED and rec.error == ""
        assert rec.mechanism == "test" and rec.action == "grow" and rec.reason == "a test"
        assert (rec.capacity_before_tokens, rec.capacity_after_tokens) == (0, 4)
        steps = rec.detail["step_seconds"]
        assert list(steps) == ["vote"] + [name for p in PHASES
                                          for name in (p, f"{p} exchange")] + ["last step"]
        assert all(s >= 0 for s in steps.values()) and sum(steps.values()) <= rec.duration_s
        assert rec.detail == {"trigger": "test", "step_seconds": steps,
                              "state": sorted(m.state)}
        assert recorder.recent("test") == [rec]


@pytest.mark.parametrize("refusing", range(MEMBERS))
def test_a_refusal_on_any_member_changes_nothing(refusing):
    members = [Member(r) for r in range(MEMBERS)]
    records, recorders = run_group(members, refusals={refusing: f"replica {refusing} is busy"},
                                   last=True)
    for m, rec, recorder in zip(members, records, recorders):
        assert m.log == [] and m.state == set()
        assert rec.outcome is Outcome.REFUSED
        assert set(rec.detail) == {"trigger", "step_seconds"}
        assert list(rec.detail["step_seconds"]) == ["vote"]  # nothing else ran
        if m.rank == refusing:
            assert rec.error == f"replica {refusing} is busy"
        else:
            assert rec.error == (f"replica {refusing} refused the grow: "
                                 f"replica {refusing} is busy")
        assert recorder.summary("test")["totals"]["refused"] == 1


def test_refusals_on_several_members_each_give_their_own_reason():
    members = [Member(r) for r in range(MEMBERS)]
    records, _ = run_group(members, refusals={1: "one", 2: "two"})
    assert [r.error for r in records] == ["replica 1 refused the grow: one", "one", "two"]


@pytest.mark.parametrize("k, failing", list(itertools.product(range(len(PHASES)),
                                                          range(MEMBERS))))
def test_a_failure_in_phase_k_on_member_m_undoes_everything_everywhere(k, failing):
    name = PHASES[k]
    members = [Member(r, fail_in={name} if r == failing else set()) for r in range(MEMBERS)]
    records, recorders = run_group(members, last=True)
    undone = [("undo", p) for p in reversed(PHASES[:k + 1])]
    for m, rec, recorder in zip(members, records, recorders):
        ran = [("do", p) for p in PHASES[:k]]
        ran.append(("partial" if m.rank == failing else "do", name))
        # Phase k undone (completed, or partial on the failing member), then the earlier
        # ones newest first; no later phase and no last step ran.
        assert m.log == ran + undone
        assert m.state == set()
        assert rec.outcome is Outcome.FAILED
        assert rec.capacity_before_tokens == rec.capacity_after_tokens == 0
        assert list(rec.detail["step_seconds"]) == ["vote"] + [
            step for p in PHASES[:k + 1] for step in (p, f"{p} exchange")] + ["undo"]
        cause = (f"replica {failing} failed in {name}: "
                 f"RuntimeError: {name} broke on member {failing}")
        if m.rank == failing:
            assert rec.error == f"grow failed, nothing changed: {cause}"
        else:
            assert rec.error == f"grow failed, nothing changed: {cause}; undone on replica {m.rank}"
        assert recorder.summary("test")["totals"] == {"applied": 0, "refused": 0, "failed": 1}


def test_failures_on_two_members_each_report_their_own_and_the_others_the_first():
    members = [Member(0), Member(1, fail_in={"p1"}), Member(2, fail_in={"p1"})]
    records, _ = run_group(members, replicas=[4, 5, 6])
    assert all(m.state == set() for m in members)
    assert records[0].error.endswith("replica 5 failed in p1: RuntimeError: p1 broke on member "
                                     "1; undone on replica 4")
    assert records[1].error.endswith("replica 5 failed in p1: RuntimeError: p1 broke on member 1")
    assert records[2].error.endswith("replica 6 failed in p1: RuntimeError: p1 broke on member 2")
    assert [r.replica for r in records] == [4, 5, 6]


def test_an_undo_that_fails_is_reported_and_the_other_undos_still_run():
    members = [Member(0, undo_fails={"p1"}), Member(1, fail_in={"p2"}), Member(2)]
    records, _ = run_group(members)
    assert members[0].log[-3:] == [("undo", "p2"), ("undo", "p1"), ("undo", "p0")]
    assert members[0].state == {"p1"}
    assert records[0].outcome is Outcome.FAILED
    assert records[0].error.startswith("grow failed and could not be undone on replica 0 "
                                       "(undo of p1: OSError: cannot undo p1): replica 1 failed")
    assert records[2].error.startswith("grow failed, nothing changed: replica 1 failed")


def test_a_failed_last_step_leaves_the_phases_applied_and_says_so():
    members = [Member(0), Member(1, last_fails=True), Member(2)]
    records, _ = run_group(members, last=True)
    assert [r.outcome for r in records] == [Outcome.APPLIED, Outcome.FAILED, Outcome.APPLIED]
    assert members[1].state == set(PHASES)
    assert records[1].error == "grow: every phase stays applied: MemoryError: no room"


# ---- GroupLink: three members in three processes ----


def _bundle(caller: int, callee: int, answer: bool = False) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(100 * caller + 10 * callee + answer)
    hidden = torch.randn(5 + callee, 3, generator=g)
    return ({"hidden_states": hidden, "residual": torch.randn(4, generator=g).bfloat16(),
             "positions": torch.arange(caller + 2, dtype=torch.int32), "mask":
             torch.tensor([True, bool(callee)]), "transposed": hidden.t()},
            {"caller": caller, "callee": callee, "answer": int(answer)})


def _member(rank: int, port: int, queue) -> None:
    from sglang_morph.groups.link import GroupLink

    link = GroupLink("testgroup", rank, MEMBERS, port)
    got = []
    # Each member calls every other one on its own group, then takes their answers; the
    # others answer on the caller's group, as the service threads do.
    for caller in range(MEMBERS):
        pg = link.calls[caller]
        if rank == caller:
            for q in link.others:
                tensors, ints = _bundle(caller, q)
                link.send_to(pg, q, tensors, **ints)
            got += [link.recv_from(pg, q) for q in link.others]
        else:
            got.append(link.recv_from(pg, caller))
            tensors, ints = _bundle(caller, rank, answer=True)
            link.send_to(pg, caller, tensors, **ints)
    votes = link.all_gather({"rank": rank, "reason": None if rank else "busy", "n": [rank] * rank})
    # A voted transition over the link: member 2 refuses, then member 1 fails in phase 1.
    member = Member(rank, fail_in={"p1"} if rank == 1 else set())
    runner = GroupTransitions(link.all_gather, rank, link.replicas, "test", None,
                              lambda: len(member.state))
    phases = tuple(member.phase(p) for p in PHASES)
    refused = runner.run(VotedTransition("grow", "test", "full" if rank == 2 else None, phases))
    failed = runner.run(VotedTransition("grow", "test", None, phases))
    buf = io.BytesIO()  # bytes through the queue: torch's shared-memory handover needs the
    torch.save([({k: v.clone() for k, v in t.items()}, i) for t, i in got], buf)  # child alive
    queue.put((rank, buf.getvalue(), votes, [refused.to_json(), failed.to_json()],
               member.log, sorted(member.state)))


def test_three_members_call_each_other_and_vote_over_the_link():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_late_bind_port()
    procs = [ctx.Process(target=_member, args=(r, port, queue)) for r in range(MEMBERS)]
    for p in procs:
        p.start()
    try:
        results = {r[0]: r[1:] for r in (queue.get(timeout=180) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * MEMBERS
    for rank, (data, votes, transitions, log, state) in results.items():
        got = torch.load(io.BytesIO(data))
        want = []
        for caller in range(MEMBERS):
            if caller == rank:
                want += [_bundle(caller, q, answer=True) for q in range(MEMBERS) if q != rank]
            else:
                want.append(_bundle(caller, rank))
        assert len(got) == len(want)
        for (want_t, want_i), (got_t, got_i) in zip(want, got):
            assert got_i == want_i and list(got_t) == list(want_t)
            for name, w in want_t.items():
                assert got_t[name].dtype == w.dtype and torch.equal(got_t[name], w), name
        assert votes == [{"rank": r, "reason": None if r else "busy", "n": [r] * r}
                         for r in range(MEMBERS)]
        refused, failed = transitions
        assert refused["outcome"] == "refused" and failed["outcome"] == "failed"
        assert refused["error"] == ("full" if rank == 2 else "replica 2 refused the grow: full")
        assert failed["error"].startswith("grow failed, nothing changed: replica 1 failed in p1")
        assert state == []
        assert log == [("do", "p0"), ("partial" if rank == 1 else "do", "p1"),
                       ("undo", "p1"), ("undo", "p0")]


def test_a_vote_or_a_layout_over_its_buffer_is_refused_before_anything_is_sent():
    from sglang_morph.groups.link import _HEADER_BYTES, _VOTE_BYTES, GroupLink

    link = object.__new__(GroupLink)  # no process group: the checks come before any send
    link.size = MEMBERS

    class NoSend:
        def send(self, *a):
            raise AssertionError("sent")

        allgather = send

    link.control = NoSend()
    with pytest.raises(ValueError, match=f"a vote is .* bytes, over {_VOTE_BYTES}"):
        link.all_gather("x" * _VOTE_BYTES)
    many = {f"tensor_{i:04d}": torch.zeros(1) for i in range(_HEADER_BYTES // 16)}
    with pytest.raises(ValueError, match=f"layout is .* bytes, over {_HEADER_BYTES}"):
        link.send_to(NoSend(), 2, many)
