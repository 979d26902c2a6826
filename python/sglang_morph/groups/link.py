"""The gloo link between the members of a replica group (separate from each replica's own world).

A group has ``size`` members, ranks ``0 .. size-1`` (``replicas[rank]`` is each one's
data-parallel replica). Its process groups, all of ``size`` ranks, are built with SGLang's
``init_custom_process_group`` on one TCPStore (rank 0 hosts it; a prefix per process group):

- ``control``: the members' scheduler threads, only while all handle the same request: the
  votes and phase outcomes of a transition (``all_gather``) and the state a transition moves
  between members (bundles);
- ``calls[r]``: member ``r``'s scheduler thread calls another member's layers (sends a batch,
  waits for the result); on every other member one service thread answers it.

Invariant: each process group is used by exactly one thread of each process (the scheduler
thread for ``control`` and its own ``calls[rank]``, one service thread for each other
``calls[r]``), so no gloo pair is ever used by two threads at once, and every bundle sent on a
group is received whole, in order, on the same group.

A message is a *bundle*: named tensors and a few integers. Its layout travels first as JSON in
a fixed-size header, then all its tensors' bytes in one payload, so neither side needs to know
shapes up front and a bundle costs two gloo messages. Tensors go as they are on CPU (gloo); on
a GPU they would be staged through host memory.

Beside the process groups, a *mailbox* (keys in the TCPStore) carries small messages that one
member writes and another reads without either waiting (gloo's recv cannot be polled).
"""

from __future__ import annotations

import datetime
import json
import math
from typing import Any, Sequence

import torch

# A service thread waits for its caller's next batch for as long as the server runs; an idle
# server must not time out its link.
_IDLE_TIMEOUT = datetime.timedelta(days=365)
# Every member reaches the rendezvous while its scheduler starts (seconds apart).
_RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
_HEADER_BYTES = 4096  # a bundle's layout (JSON, NUL-padded): names, dtypes, shapes, offsets
_VOTE_BYTES = 4096  # one member's vote or phase outcome (JSON, NUL-padded)
_ALIGN_BYTES = 16
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                torch.int32, torch.uint8, torch.bool)}


class GroupLink:
    """Invariants: ``rank`` is this member, ``0 <= rank < size``; ``calls`` has one process
    group per member, ``calls[r]`` carrying member ``r``'s calls; ``replicas`` names the
    data-parallel replica of each member (distinct)."""

    def __init__(self, name: str, rank: int, size: int, port: int, host: str = "127.0.0.1",
                 replicas: Sequence[int] | None = None):
        from sglang.srt.utils.common import init_custom_process_group
        from torch.distributed import PrefixStore, TCPStore

        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"a group link of {size} members has ranks 0 to {size - 1}, "
                             f"not {rank}")
        self.replicas = tuple(range(size) if replicas is None else replicas)
        if len(self.replicas) != size or len(set(self.replicas)) != size:
            raise ValueError(f"a group of {size} members needs {size} distinct replicas, not "
                             f"{list(self.replicas)}")
        self.name, self.rank, self.size = name, rank, size
        store = TCPStore(host, port, size, is_master=rank == 0, timeout=_RENDEZVOUS_TIMEOUT)

        def group(part: str):
            return init_custom_process_group(
                backend="gloo", store=PrefixStore(f"{name}/{part}", store), world_size=size,
                rank=rank, group_name=f"{name}-{part}", timeout=_IDLE_TIMEOUT)

        self._store = store  # the groups' rendezvous; kept alive with them
        self.mailbox = PrefixStore(f"{name}/mailbox", store)
        self.control = group("control")
        self.calls = tuple(group(f"calls{r}") for r in range(size))

    @property
    def others(self) -> list[int]:
        """The other members' ranks, in order."""
        return [r for r in range(self.size) if r != self.rank]

    def send_to(self, pg: Any, dst: int, tensors: dict[str, torch.Tensor], **ints: int) -> None:
        """One bundle to member ``dst`` as two gloo messages, whatever its tensors: the layout
        (a fixed-size header) and every tensor's bytes packed in one payload (at 16-byte
        offsets, so the receiver's views of it are aligned for any dtype). One message per
        tensor cost ~1 ms each on this machine's gloo: 10-14 ms per pipeline call of ~10
        tensors, as much as a stage's layers (a trace of decode at batch 1)."""
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
        header = _padded_json({"ints": ints, "tensors": layout, "bytes": offset},
                              _HEADER_BYTES, "a bundle's layout")
        works = [pg.send([header], dst, 0)]
        if offset:
            works.append(pg.send([torch.cat(parts)], dst, 0))
        for w in works:
            w.wait()

    def recv_from(self, pg: Any, src: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The next bundle from member ``src``; its tensors are views of one received buffer
        (writable)."""
        header = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
        pg.recv([header], src, 0).wait()
        layout = _unpad_json(header)
        payload = torch.empty(layout["bytes"], dtype=torch.uint8)
        if layout["bytes"]:
            pg.recv([payload], src, 0).wait()
        tensors = {}
        for name, dtype, shape, offset in layout["tensors"]:
            dt = _DTYPES[dtype]
            size = math.prod(shape) * dt.itemsize
            tensors[name] = payload[offset:offset + size].view(dt).reshape(shape)
        return tensors, layout["ints"]

    def all_gather(self, value: Any) -> list[Any]:
        """Every member's ``value`` (JSON: an integer, a string, None, a small dict), indexed
        by rank; all members' scheduler threads, at the same point of the same request. One
        gloo all-gather of a fixed-size buffer on ``control``."""
        mine = _padded_json(value, _VOTE_BYTES, "a vote")
        out = [torch.empty(_VOTE_BYTES, dtype=torch.uint8) for _ in range(self.size)]
        self.control.allgather([out], [mine]).wait()
        return [_unpad_json(t) for t in out]


def _padded_json(value: Any, size_bytes: int, what: str) -> torch.Tensor:
    """``value`` as JSON in a NUL-padded uint8 tensor of ``size_bytes``; refused (ValueError)
    before anything is sent when it does not fit."""
    text = json.dumps(value).encode()
    if len(text) > size_bytes:
        raise ValueError(f"{what} is {len(text)} bytes, over {size_bytes}")
    out = torch.zeros(size_bytes, dtype=torch.uint8)
    out[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out


def _unpad_json(buffer: torch.Tensor) -> Any:
    return json.loads(buffer.numpy().tobytes().rstrip(b"\0"))
