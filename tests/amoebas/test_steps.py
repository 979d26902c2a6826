"""A merged group's batched steps (``amoebas/steps.py``), without a server: when the leader
takes a step, in what order, what a step looks like on the wire, and an owner's wait."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_morph.amoebas.forward import Batch
from sglang_morph.amoebas.steps import Pending, StepQueue, step_from_message, step_message


def batch(owner: int, tokens: int = 2) -> Batch:
    ids = torch.arange(tokens, dtype=torch.int64) + 100 * owner
    return Batch(ids, torch.arange(tokens), ids + 1, torch.tensor([tokens]), torch.tensor([0]),
                 torch.tensor([tokens]), torch.arange(tokens)[None])


def post_later(queue: StepQueue, owner: int, after_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after_s),
                                              queue.post(owner, batch(owner))))
    thread.start()
    return thread


def test_a_step_waits_for_the_last_steps_owners_then_runs_in_rank_order():
    queue = StepQueue(wait_s=2.0)
    queue.post(2, batch(2))
    # Nobody ran before: what is posted runs at once.
    assert [o for o, _ in queue.take()] == [2]
    queue.post(2, batch(2))
    queue.post(0, batch(0))
    assert [o for o, _ in queue.take()] == [0, 2]
    # Owner 0 posts first; the step waits for owner 2 (in the last step), well under wait_s.
    queue.post(0, batch(0))
    late = post_later(queue, 2, 0.2)
    started = time.monotonic()
    assert [o for o, _ in queue.take()] == [0, 2]
    assert 0.15 < time.monotonic() - started < 1.5
    late.join()
    assert (queue.steps, queue.parts) == (3, 5)


def test_an_owner_with_nothing_left_costs_one_wait():
    queue = StepQueue(wait_s=1.0)
    queue.post(0, batch(0))
    queue.post(1, batch(1))
    queue.take()
    queue.post(0, batch(0))  # owner 1 has finished its requests
    started = time.monotonic()
    assert [o for o, _ in queue.take()] == [0]
    assert 0.95 < time.monotonic() - started < 3.0
    queue.post(0, batch(0))  # owner 1 is no longer waited for
    started = time.monotonic()
    assert [o for o, _ in queue.take()] == [0]
    assert time.monotonic() - started < 0.5  # (a wait would take the whole second)


def test_take_blocks_until_a_post_and_a_second_post_is_refused():
    queue = StepQueue(wait_s=0.0)
    late = post_later(queue, 1, 0.2)
    started = time.monotonic()
    assert [o for o, _ in queue.take()] == [1]
    assert time.monotonic() - started >= 0.15
    late.join()
    queue.post(1, batch(1))
    with pytest.raises(RuntimeError, match="owner 1 posted a second batch"):
        queue.post(1, batch(1))
    with pytest.raises(ValueError, match="wait_s must be >= 0"):
        StepQueue(wait_s=-1)


def test_a_step_crosses_the_wire_unchanged():
    step = [(0, batch(0, 3)), (2, batch(2, 1))]
    back = step_from_message(*step_message(step))
    assert [o for o, _ in back] == [0, 2]
    for (_, a), (_, b) in zip(step, back):
        for name, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[name]), name


def test_pending_releases_the_lock_while_it_waits_and_says_why_it_failed():
    lock = threading.Lock()
    pending = Pending()
    rows = torch.ones(2, 4)

    def run_step():
        with lock:  # the step needs the lock the owner held when it posted
            pending.set(rows)

    lock.acquire()
    threading.Thread(target=run_step).start()
    assert pending.wait(lock, timeout_s=10) is rows
    assert lock.locked()  # held again, as before the wait
    failed = Pending()
    failed.fail("replica 1 could not run its share")
    with pytest.raises(RuntimeError, match="replica 1 could not run its share"):
        failed.wait(lock, timeout_s=10)
    with pytest.raises(RuntimeError, match="no merged step ran this batch"):
        Pending().wait(lock, timeout_s=0.05)
    lock.release()
