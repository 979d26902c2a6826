"""The link between the replicas of a KunServe group: a ``groups.link.GroupLink`` named
``kunserve-A-B[-C...]`` after the group's data-parallel replicas (process groups ``control``,
``calls0`` ... and the mailbox under that prefix, on the group's own TCPStore)."""

from __future__ import annotations

from sglang_morph.groups.link import _HEADER_BYTES, GroupLink

__all__ = ["PeerLink", "_HEADER_BYTES"]


class PeerLink(GroupLink):
    """Invariant: ``rank`` is this member of the group (0: the first stage); ``replicas`` are the
    group's data-parallel replicas, in stage order; every bundle sent on a group is received
    whole, in order, on the same group. Members name the member they talk to (in a group of
    more than two, a merged pair's peer is whichever other member it merged with)."""

    def __init__(self, rank: int, port: int, host: str = "127.0.0.1",
                 replicas: tuple[int, ...] = (0, 1)):
        super().__init__("kunserve-" + "-".join(str(r) for r in replicas), rank,
                         len(replicas), port, host, replicas=replicas)
