"""One data-parallel replica's side of a replica group: what every group mechanism's member
shares (scheduler process).

- **Compute lock** (``compute_lock``): the model's layers run under one lock per process. The
  scheduler thread holds it through its forward except while it waits for another member's
  answer (``answer`` releases it meanwhile), and a service thread takes it to run a caller's
  batch. SGLang publishes the forward context (the attention backend) in a module global, not
  per thread; the lock keeps a service thread's context strictly nested inside the
  scheduler's. Waiting never holds the lock, so members calling each other at once cannot
  deadlock.
- **Service threads**: one per other member ``r``, the only reader of ``link.calls[r]`` in
  this process; each answers every call with the mechanism's result (or ``failed=1`` when it
  raised, logged here) and runs as long as the process (daemon).
- **Live requests** of the scheduler, between two batches (what a transition moves along).
- **Status and metrics**: the member's replica and current group, and Prometheus series named
  ``sglang_morph_<mechanism>_*``, each labelled with the replica.
- **Transitions**: ``group_transitions`` runs voted transitions over the link (``transition.py``)
  and records them in the scheduler's ``TransitionRecorder`` (``elastic``).

Invariant (``check_integrity``): every service thread started is alive.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

from sglang_morph.elastic.record import recorder
from sglang_morph.groups.link import GroupLink
from sglang_morph.groups.transition import GroupTransitions

logger = logging.getLogger("sglang_morph.groups")

# What a service thread runs for a caller: (caller's rank, tensors, ints) -> answer tensors.
CallHandler = Callable[[int, dict[str, torch.Tensor], dict[str, int]], dict[str, torch.Tensor]]


class GroupMember:
    """A scheduler's membership in the group of ``link``; mechanisms subclass it."""

    def __init__(self, scheduler: Any, link: GroupLink, mechanism: str,
                 capacity_tokens: Callable[[], int],
                 compute_lock: threading.Lock | None = None):
        """``compute_lock``: the process's lock when it is a member of several groups (one
        lock per process, whatever the number of links)."""
        self.scheduler, self.link, self.mechanism = scheduler, link, mechanism
        self.compute_lock = compute_lock if compute_lock is not None else threading.Lock()
        self.elastic = recorder(scheduler)
        self.group_transitions = GroupTransitions(
            link.all_gather, link.rank, link.replicas, mechanism, self.elastic, capacity_tokens)
        self._services: list[threading.Thread] = []

    @property
    def replica(self) -> int:
        return self.link.replicas[self.link.rank]

    # ---- calls between members ----

    def start_services(self, handler: CallHandler) -> None:
        """Start one service thread per other member, answering its calls with ``handler``
        (run under the compute lock, without grad, as SGLang runs its own forwards)."""
        if self._services:
            raise RuntimeError(f"replica {self.replica}'s service threads already run")
        for caller in self.link.others:
            thread = threading.Thread(target=self._serve, args=(caller, handler),
                                      name=f"{self.mechanism}-service-{caller}", daemon=True)
            thread.start()
            self._services.append(thread)

    def _serve(self, caller: int, handler: CallHandler) -> None:
        pg = self.link.calls[caller]
        while True:
            tensors, ints = self.link.recv_from(pg, caller)
            try:
                with self.compute_lock, torch.no_grad():
                    out, failed = handler(caller, tensors, ints), 0
            except Exception:
                logger.exception("sglang-morph: %s replica %d could not run replica %d's batch",
                                 self.mechanism, self.replica, self.link.replicas[caller])
                out, failed = {}, 1
            self.link.send_to(pg, caller, out, failed=failed)

    def call(self, member: int, tensors: dict[str, torch.Tensor], **ints: int) -> None:
        """Send a batch to ``member``'s layers (scheduler thread); ``answer`` takes the
        result."""
        self.link.send_to(self.link.calls[self.link.rank], member, tensors, **ints)

    def answer(self, member: int) -> dict[str, torch.Tensor]:
        """``member``'s answer to our last call to it; the compute lock (held by the caller)
        is released while waiting, so that other members may run their calls here."""
        self.compute_lock.release()
        try:
            out, ints = self.link.recv_from(self.link.calls[self.link.rank], member)
        finally:
            self.compute_lock.acquire()
        if ints.get("failed"):
            raise RuntimeError(f"replica {self.link.replicas[member]} failed to run its layers "
                               f"for replica {self.replica}'s batch (see its log)")
        return out

    # ---- the scheduler's requests ----

    def live_requests(self) -> list:
        """Requests holding KV here, between two batches: the running batch's, the chunked
        request, and the last prefill's (get_next_batch_to_run merges them into the running
        batch only after this point)."""
        s = self.scheduler
        batches = [s.running_batch]
        if s.last_batch is not None and s.last_batch.forward_mode.is_extend():
            batches.append(s.last_batch)
        live = {id(r): r for b in batches if b is not None for r in b.reqs}
        if s.chunked_req is not None:
            live[id(s.chunked_req)] = s.chunked_req
        return [r for r in live.values() if not r.finished()]

    # ---- status ----

    def group_status(self, group: Sequence[int]) -> dict[str, Any]:
        """This member's replica and the replicas it serves with now (``group``: some or all
        of the link's members while joined, itself alone otherwise)."""
        return {"replica": self.replica, "group": list(group)}

    def check_integrity(self) -> None:
        dead = [t.name for t in self._services if not t.is_alive()]
        assert not dead, f"service threads {dead} of replica {self.replica} have stopped"


class MemberMetrics:
    """Prometheus series of one member (SGLang's multiprocess registry serves them on /metrics
    with --enable-metrics): ``sglang_morph_<mechanism>_<name>``, each labelled with the
    replica; ``group_size`` is every group mechanism's."""

    def __init__(self, mechanism: str, replica: int):
        self.prefix, self.replica = f"sglang_morph_{mechanism}", str(replica)
        self.group_size = self.gauge("group_size", "Replicas in this replica's group (1: whole)")

    @staticmethod
    def enabled(scheduler: Any) -> bool:
        reporter = getattr(scheduler, "metrics_reporter", None)
        return bool(getattr(reporter, "enable_metrics", False))

    def gauge(self, name: str, doc: str) -> Any:
        from prometheus_client import Gauge

        return Gauge(f"{self.prefix}_{name}", doc, ("replica",),
                     multiprocess_mode="mostrecent").labels(replica=self.replica)

    def counter(self, name: str, doc: str, label: str) -> Callable[[str], Any]:
        """A counter with one more label; returns ``value -> the series for that value``."""
        from prometheus_client import Counter

        counter = Counter(f"{self.prefix}_{name}", doc, ("replica", label))
        return lambda value: counter.labels(**{"replica": self.replica, label: value})
