"""The gloo link between the two replicas of a group (separate from each replica's own world).

Three process groups of two ranks (rank = data-parallel replica), built with SGLang's
``init_custom_process_group`` on one TCPStore (a prefix per group), each used by exactly one
thread on each side, so no gloo pair is ever used by two threads at once:

- ``control``: the scheduler threads, only while both handle the same ``/kunserve`` request
  (the vote and the outcome of a transition);
- ``calls[r]``: replica ``r``'s scheduler thread calls its peer's layers (sends a batch, waits
  for the result), the peer's service thread answers.

A message is a *bundle*: named tensors and a few integers. Its layout travels first as JSON
(a length, then the bytes), then each tensor, so neither side needs to know shapes up front.
Tensors go as they are on CPU (gloo); on a GPU they would be staged through host memory.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch

# A service thread waits for its peer's next batch for as long as the server runs; an idle
# server must not time out its link.
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# Both replicas reach the rendezvous while their schedulers start (seconds apart).
_RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                torch.int32, torch.uint8, torch.bool)}


class PeerLink:
    """Invariant: ``rank`` is this replica (0 or 1) and ``peer`` the other; every bundle sent
    on a group is received whole, in order, on the same group."""

    def __init__(self, rank: int, port: int, host: str = "127.0.0.1"):
        from sglang.srt.utils.common import init_custom_process_group
        from torch.distributed import PrefixStore, TCPStore

        if rank not in (0, 1):
            raise ValueError(f"a group link has ranks 0 and 1, not {rank}")
        self.rank, self.peer = rank, 1 - rank
        store = TCPStore(host, port, 2, is_master=rank == 0, timeout=_RENDEZVOUS_TIMEOUT)

        def group(name: str):
            return init_custom_process_group(
                backend="gloo", store=PrefixStore(f"kunserve/{name}", store), world_size=2,
                rank=rank, group_name=f"kunserve-{name}", timeout=_IDLE_TIMEOUT)

        self._store = store  # the groups' rendezvous; kept alive with them
        # Small non-blocking messages (the automatic control's views and proposals): a key
        # written on one side is read on the other without either waiting (gloo's recv
        # cannot be polled).
        self.mailbox = PrefixStore("kunserve/mailbox", store)
        self.control = group("control")
        self.calls = (group("calls0"), group("calls1"))

    def send(self, pg: Any, tensors: dict[str, torch.Tensor], **ints: int) -> None:
        tensors = {k: t.contiguous() for k, t in tensors.items()}
        layout = json.dumps({"ints": ints, "tensors": [
            [k, str(t.dtype), list(t.shape)] for k, t in tensors.items()]}).encode()
        header = torch.frombuffer(bytearray(layout), dtype=torch.uint8)
        works = [pg.send([torch.tensor([header.numel()], dtype=torch.int64)], self.peer, 0),
                 pg.send([header], self.peer, 0)]
        works += [pg.send([t], self.peer, 0) for t in tensors.values() if t.numel()]
        for w in works:
            w.wait()

    def recv(self, pg: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        size = torch.empty(1, dtype=torch.int64)
        pg.recv([size], self.peer, 0).wait()
        header = torch.empty(int(size), dtype=torch.uint8)
        pg.recv([header], self.peer, 0).wait()
        layout = json.loads(bytes(header.tolist()).decode())
        tensors = {}
        for name, dtype, shape in layout["tensors"]:
            t = torch.empty(shape, dtype=_DTYPES[dtype])
            if t.numel():
                pg.recv([t], self.peer, 0).wait()
            tensors[name] = t
        return tensors, layout["ints"]

    def exchange(self, **ints: int) -> dict[str, int]:
        """Both scheduler threads, at the same point of the same request: send ours, return
        the peer's."""
        keys = sorted(ints)  # both sides send the same keys
        sent = self.control.send([torch.tensor([ints[k] for k in keys], dtype=torch.int64)],
                                 self.peer, 1)
        theirs = torch.empty(len(keys), dtype=torch.int64)
        self.control.recv([theirs], self.peer, 1).wait()
        sent.wait()
        return dict(zip(keys, theirs.tolist()))
