"""The link between the replicas of a KunServe group: a ``groups.link.GroupLink`` named
``kunserve-A-B[-C...]`` after the group's data-parallel replicas (process groups ``control``,
``calls0`` ... and the mailbox under that prefix, on the group's own TCPStore). In a pair the
peer is implied: a member of a pair always talks to the other one."""

from __future__ import annotations

from typing import Any

import torch

from sglang_morph.groups.link import _HEADER_BYTES, GroupLink

__all__ = ["PeerLink", "_HEADER_BYTES"]


class PeerLink(GroupLink):
    """Invariant: ``rank`` is this member of the group (0: the first stage); ``replicas`` are the
    group's data-parallel replicas, in stage order; in a pair ``peer`` is the other member
    (None in a larger group, whose members name the member they talk to); every bundle sent on
    a group is received whole, in order, on the same group."""

    def __init__(self, rank: int, port: int, host: str = "127.0.0.1",
                 replicas: tuple[int, ...] = (0, 1)):
        super().__init__("kunserve-" + "-".join(str(r) for r in replicas), rank,
                         len(replicas), port, host, replicas=replicas)
        self.peer = 1 - rank if len(replicas) == 2 else None

    def send(self, pg: Any, tensors: dict[str, torch.Tensor], **ints: int) -> None:
        self.send_to(pg, self._the_peer(), tensors, **ints)

    def recv(self, pg: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return self.recv_from(pg, self._the_peer())

    def _the_peer(self) -> int:
        if self.peer is None:
            raise RuntimeError(f"a group of {self.size} has no single peer: name the member")
        return self.peer
