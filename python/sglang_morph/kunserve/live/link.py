"""The gloo link between the two replicas of a group (separate from each replica's own world).

Three process groups of two ranks (rank = data-parallel replica), built with SGLang's
``init_custom_process_group`` on one TCPStore (a prefix per group), each used by exactly one
thread on each side, so no gloo pair is ever used by two threads at once:

- ``control``: the scheduler threads, only while both handle the same ``/kunserve`` request
  (the vote and the outcome of a transition);
- ``calls[r]``: replica ``r``'s scheduler thread calls its peer's layers (sends a batch, waits
  for the result), the peer's service thread answers.

A message is a *bundle*: named tensors and a few integers. Its layout travels first as JSON in
a fixed-size header, then all its tensors' bytes in one payload, so neither side needs to know
shapes up front and a bundle costs two gloo messages.
Tensors go as they are on CPU (gloo); on a GPU they would be staged through host memory.
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Any

import torch

# A service thread waits for its peer's next batch for as long as the server runs; an idle
# server must not time out its link.
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# Both replicas reach the rendezvous while their schedulers start (seconds apart).
_RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
_HEADER_BYTES = 4096  # a bundle's layout (JSON, NUL-padded): names, dtypes, shapes, offsets
_ALIGN_BYTES = 16
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
        """One bundle as two gloo messages, whatever its tensors: the layout (a fixed-size
        header) and every tensor's bytes packed in one payload (at 16-byte offsets, so the
        receiver's views of it are aligned for any dtype). One message per tensor cost ~1 ms
        each on this machine's gloo: 10-14 ms per pipeline call of ~10 tensors, as much as a
        stage's layers (a trace of decode at batch 1)."""
        layout, parts, offset = [], [], 0
        for name, t in tensors.items():
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            pad = -offset % _ALIGN_BYTES
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            layout.append([name, str(t.dtype), list(t.shape), offset])
            parts.append(raw)
            offset += raw.numel()
        text = json.dumps({"ints": ints, "tensors": layout, "bytes": offset}).encode()
        if len(text) > _HEADER_BYTES:
            raise ValueError(f"a bundle's layout is {len(text)} bytes, over {_HEADER_BYTES}")
        header = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
        header[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        works = [pg.send([header], self.peer, 0)]
        if offset:
            works.append(pg.send([torch.cat(parts)], self.peer, 0))
        for w in works:
            w.wait()

    def recv(self, pg: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The next bundle; its tensors are views of one received buffer (writable)."""
        header = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
        pg.recv([header], self.peer, 0).wait()
        layout = json.loads(header.numpy().tobytes().rstrip(b"\0"))
        payload = torch.empty(layout["bytes"], dtype=torch.uint8)
        if layout["bytes"]:
            pg.recv([payload], self.peer, 0).wait()
        tensors = {}
        for name, dtype, shape, offset in layout["tensors"]:
            dt = _DTYPES[dtype]
            size = math.prod(shape) * dt.itemsize
            tensors[name] = payload[offset:offset + size].view(dt).reshape(shape)
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
