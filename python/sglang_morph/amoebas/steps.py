"""A merged group's steps: every member's batch of one step run as one forward.

Per owner, a group of d members runs d forwards a step, each with its own all-reduces (two a
layer) and its own pass over the weights; batched, it runs one. The member of shard rank 0
(the *leader*) takes the steps: each owner posts its batch to the leader's ``StepQueue`` and
waits for its hidden states (``Pending``); the leader's step thread takes what was posted as
one step and sends it to every other member, and every member runs the step's forward over all
its parts (``forward.forward``), each owner keeping the rows of its own part.

When to step: the schedulers' steps fall into line by themselves (each owner's next batch
follows the step that answered its last one), so the leader waits, after the first post, for
the owners of the last step to post again, up to ``wait_s``; an owner that has nothing left to
run costs one such wait, an owner that starts posting joins the next step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import torch

from sglang_morph.amoebas.forward import Batch

_BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(Batch))
Step = Sequence[tuple[int, Batch]]  # (owner's shard rank, its batch), by owner


class StepQueue:
    """The leader's posted batches of one group. Invariants: at most one batch per owner is
    waiting (an owner waits for its step before it posts again); ``take`` returns the owners
    in rank order, so every member runs the parts in the same order."""

    def __init__(self, wait_s: float):
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._posted: dict[int, Batch] = {}
        self._expected: frozenset[int] = frozenset()
        self.steps = self.parts = 0

    def post(self, owner: int, batch: Batch) -> None:
        with self._cond:
            if owner in self._posted:
                raise RuntimeError(f"owner {owner} posted a second batch before its step ran")
            self._posted[owner] = batch
            self._cond.notify_all()

    def take(self) -> list[tuple[int, Batch]]:
        """The next step (blocks until a batch is posted): what is posted once the last
        step's owners have all posted, or ``wait_s`` after the first post."""
        with self._cond:
            while not self._posted:
                self._cond.wait()
            deadline = time.monotonic() + self.wait_s
            while not self._expected <= self._posted.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            step = sorted(self._posted.items())
            self._posted.clear()
            self._expected = frozenset(owner for owner, _ in step)
            self.steps += 1
            self.parts += len(step)
            return step


class Pending:
    """One owner's hidden states of its posted batch, set by whichever thread ran its part."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._rows: torch.Tensor | None = None
        self._error: str | None = None

    def set(self, rows: torch.Tensor) -> None:
        self._rows = rows
        self._done.set()

    def fail(self, error: str) -> None:
        self._error = error
        self._done.set()

    def wait(self, lock: threading.Lock, timeout_s: float) -> torch.Tensor:
        """The rows; ``lock`` (held by the caller) is released while waiting so that this
        process's step runs. RuntimeError when the part failed or nothing came in
        ``timeout_s``."""
        lock.release()
        try:
            done = self._done.wait(timeout_s)
        finally:
            lock.acquire()
        if not done:
            raise RuntimeError(f"no merged step ran this batch in {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(self._error)
        return self._rows


def step_message(step: Step) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A step as one bundle of ``GroupLink.send_to``: each part's tensors under ``i.name``."""
    tensors = {f"{i}.{name}": t for i, (_, batch) in enumerate(step)
               for name, t in batch.tensors().items()}
    ints = {"parts": len(step), **{f"owner{i}": owner for i, (owner, _) in enumerate(step)}}
    return tensors, ints


def step_from_message(tensors: dict[str, torch.Tensor], ints: dict[str, int]) -> Step:
    return [(int(ints[f"owner{i}"]),
             Batch.from_tensors({name: tensors[f"{i}.{name}"] for name in _BATCH_FIELDS}))
            for i in range(int(ints["parts"]))]
