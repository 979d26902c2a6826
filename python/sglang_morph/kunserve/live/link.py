"""The link between the two replicas of a KunServe pair: a two-member ``groups.link.GroupLink``
named ``kunserve-A-B`` after the pair's data-parallel replicas (process groups ``control``,
``calls0``, ``calls1`` and the mailbox under that prefix, on the pair's own TCPStore), with the
peer implied: a member of a pair always talks to the other one."""

from __future__ import annotations

from typing import Any

import torch

from sglang_morph.groups.link import _HEADER_BYTES, GroupLink

__all__ = ["PeerLink", "_HEADER_BYTES"]


class PeerLink(GroupLink):
    """Invariant: ``rank`` is this member of the pair (0: the front, 1: the back) and ``peer``
    the other; ``replicas`` are the pair's data-parallel replicas; every bundle sent on a group
    is received whole, in order, on the same group."""

    def __init__(self, rank: int, port: int, host: str = "127.0.0.1",
                 replicas: tuple[int, int] = (0, 1)):
        super().__init__(f"kunserve-{replicas[0]}-{replicas[1]}", rank, 2, port, host,
                         replicas=replicas)
        self.peer = 1 - rank

    def send(self, pg: Any, tensors: dict[str, torch.Tensor], **ints: int) -> None:
        self.send_to(pg, self.peer, tensors, **ints)

    def recv(self, pg: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return self.recv_from(pg, self.peer)
