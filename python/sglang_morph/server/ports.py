"""Ports that a child process binds later (an HTTP server, the KunServe link).

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range and releases it
at once; the child binds it seconds later (a server start takes ~10 s here), and in that window
any outgoing connection or gloo pair of any process may be given the same port: a CI run
lost a server that way ("address already in use", then a hang in uvicorn's shutdown).
So the ports picked here come from below the ephemeral range, which the kernel never hands out
on its own, and from a band SGLang does not use: SGLang picks its own late-bound ports (the
torch.distributed store) from 22000-29999, so two picks of ours and SGLang's cannot meet there.
"""

from __future__ import annotations

import random
import socket

# Below SGLang's 22000-29999 band; the kernel's ephemeral range starts at 32768 by default.
LATE_BIND_PORTS = range(12000, 22000)
_ATTEMPTS = 64


def ephemeral_low() -> int:
    """The first port the kernel hands out on its own (32768 if it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_late_bind_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and outside the ephemeral range, for a later bind.

    Falls back to a kernel-chosen port if the band is unusable (ephemeral range moved below it,
    or 64 random tries all taken); the caller must still handle a lost race (see harness)."""
    band = range(LATE_BIND_PORTS.start, min(LATE_BIND_PORTS.stop, ephemeral_low()))
    if len(band) >= _ATTEMPTS:
        for port in random.sample(band, _ATTEMPTS):
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_late_bind_ports(count: int, host: str = "127.0.0.1", attempts: int = 16) -> int | None:
    """The first of ``count`` consecutive ports free now on ``host`` for later binds (one per
    replica group's link), or None when ``attempts`` tries found no such run."""
    for _ in range(attempts):
        first = free_late_bind_port(host)
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return first
    return None
