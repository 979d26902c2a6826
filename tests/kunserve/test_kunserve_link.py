"""The KunServe peer link's bundles (``kunserve/live/link.py``) between two real processes:
what is sent arrives bit for bit (every dtype the pipeline and the KV exchange send, empty and
0-d tensors, non-contiguous inputs) in two gloo messages per bundle, in order, on each group."""

from __future__ import annotations

import io
import multiprocessing as mp

import pytest
import torch

from sglang_morph.server.ports import free_late_bind_port


def bundles() -> list[tuple[dict[str, torch.Tensor], dict[str, int]]]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 9, generator=g)
    return [
        ({"hidden_states": hidden, "residual": torch.randn(7, 9, generator=g).bfloat16(),
          "positions": torch.arange(7), "out_cache_loc": torch.arange(3, 10, dtype=torch.int32),
          "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(5),
          "empty": torch.empty(0, 4), "half": torch.randn(3, generator=g).half(),
          "bytes": torch.arange(5, dtype=torch.uint8),
          "transposed": hidden.t()}, {"mode": 2}),  # non-contiguous: sent as its values
        ({}, {"failed": 1}),  # no tensors at all
        ({"k": torch.randn(33, 2, 8, generator=g)}, {}),
    ]


def _side(rank: int, port: int, queue) -> None:
    from sglang_morph.kunserve.live.link import PeerLink

    link = PeerLink(rank, port)
    peer = 1 - rank
    sent = bundles()
    if rank == 0:
        for tensors, ints in sent:
            link.send_to(link.calls[0], peer, tensors, **ints)
        # the answers, on the other group
        got = [link.recv_from(link.calls[1], peer) for _ in sent]
    else:
        got = [link.recv_from(link.calls[0], peer) for _ in sent]
        for tensors, ints in got:
            link.send_to(link.calls[1], peer, tensors, **ints)
    buf = io.BytesIO()  # bytes through the queue: torch's shared-memory handover needs the
    torch.save([({k: v.clone() for k, v in t.items()}, i) for t, i in got], buf)  # child alive
    queue.put((rank, buf.getvalue()))


def test_bundles_cross_two_processes_bit_for_bit():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_late_bind_port()
    procs = [ctx.Process(target=_side, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {rank: torch.load(io.BytesIO(data))
                   for rank, data in (queue.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        for (want_t, want_i), (got_t, got_i) in zip(bundles(), results[rank]):
            assert got_i == want_i and list(got_t) == list(want_t)
            for name, want in want_t.items():
                got = got_t[name]
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert torch.equal(got, want), name


def test_a_layout_over_the_header_is_refused_before_anything_is_sent():
    from sglang_morph.kunserve.live.link import _HEADER_BYTES, PeerLink

    link = object.__new__(PeerLink)  # no process group: the check comes before any send

    class NoSend:
        def send(self, *a):
            raise AssertionError("sent")

    many = {f"tensor_{i:04d}": torch.zeros(1) for i in range(_HEADER_BYTES // 16)}
    with pytest.raises(ValueError, match="layout is .* bytes, over 4096"):
        link.send_to(NoSend(), 1, many)
