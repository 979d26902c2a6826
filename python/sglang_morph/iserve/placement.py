"""Placing each model's chosen configuration on a device of a described cluster.

A device is a machine: its free memory, its cores and its load (the busy share of its cores,
0..1). One model's configuration runs as one ``scripts/serve.sh`` on one device (all its TP
ranks and PP stages there; spanning machines is SGLang's multi-node launch, which
``--enable-morph`` refuses, so it is not planned here). Placing it takes its estimated memory
from the device and adds its processes' share of the cores to the device's load (a serving
rank keeps a core busy while it runs; ranks beyond the cores share them).

Policies (a registry; each returns the device to use among those with room, or None):

- ``least-loaded``: the lowest load (spreads work; ties: the most free memory);
- ``packing``: the least free memory that still fits (best fit: keeps large devices whole for
  large models; ties: the lowest load);
- ``hybrid``: packing among devices whose load after placing stays at or below
  ``load_threshold``, else least-loaded among all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Device:
    """Invariant: ``memory_bytes > 0``, ``cores >= 1``, ``0 <= load <= 1``."""

    name: str
    memory_bytes: int
    cores: int = 1
    load: float = 0.0

    def check_integrity(self) -> None:
        if not self.name or self.memory_bytes <= 0 or self.cores < 1 or not 0 <= self.load <= 1:
            raise ValueError(f"device {self.name!r}: needs memory > 0, cores >= 1 and load in "
                             f"[0, 1]; got {self}")

    def load_after(self, processes: int) -> float:
        return min(1.0, self.load + processes / self.cores)

    def fits(self, memory_bytes: float) -> bool:
        return memory_bytes <= self.memory_bytes


def _least_loaded(devices: Sequence[Device], memory_bytes: float, processes: int,
                  load_threshold: float) -> Device | None:
    fit = [d for d in devices if d.fits(memory_bytes)]
    return min(fit, key=lambda d: (d.load, -d.memory_bytes, d.name), default=None)


def _packing(devices: Sequence[Device], memory_bytes: float, processes: int,
             load_threshold: float) -> Device | None:
    fit = [d for d in devices if d.fits(memory_bytes)]
    return min(fit, key=lambda d: (d.memory_bytes, d.load, d.name), default=None)


def _hybrid(devices: Sequence[Device], memory_bytes: float, processes: int,
            load_threshold: float) -> Device | None:
    calm = [d for d in devices if d.load_after(processes) <= load_threshold]
    return (_packing(calm, memory_bytes, processes, load_threshold)
            or _least_loaded(devices, memory_bytes, processes, load_threshold))


POLICIES: dict[str, Callable[[Sequence[Device], float, int, float], Device | None]] = {
    "least-loaded": _least_loaded,
    "packing": _packing,
    "hybrid": _hybrid,
}


@dataclasses.dataclass
class Cluster:
    """Devices as they are now; ``place`` takes room from them."""

    devices: list[Device]

    def check_integrity(self) -> None:
        names = [d.name for d in self.devices]
        if not names:
            raise ValueError("the cluster has no device")
        if len(set(names)) != len(names):
            raise ValueError(f"device names repeat: {names}")
        for d in self.devices:
            d.check_integrity()

    def choose(self, policy: str, memory_bytes: float, processes: int,
               load_threshold: float = 0.75) -> Device | None:
        if policy not in POLICIES:
            raise ValueError(f"unknown placement {policy!r}; choose from {', '.join(POLICIES)}")
        return POLICIES[policy](self.devices, memory_bytes, processes, load_threshold)

    def place(self, device: Device, memory_bytes: float, processes: int) -> Device:
        i = self.devices.index(device)
        self.devices[i] = dataclasses.replace(
            device, memory_bytes=int(device.memory_bytes - memory_bytes),
            load=device.load_after(processes))
        return self.devices[i]
