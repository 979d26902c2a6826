"""The planning problem and the one objective every solver shares.

A plan gives every decoder layer one device (a pipeline stage) and one bit-width; stages are
contiguous ranges of layers on the devices in a chosen order, each holding at least one layer.
For a fixed device order and micro-batch sizes (eta for prefill, xi for decode) a plan costs
(SplitQuant / LLM-PQ's pipeline model):

- stage j's prefill time per micro-batch ``P_j`` = its layers' prefill times at eta x s, plus
  the LM head on the last stage and the activation transfer to the next stage;
- stage j's decode time ``D_j`` = its layers' times summed over the decode steps of one
  micro-batch (contexts s+1 .. s+n-1), plus head and transfers;
- prefill of ``m_p`` micro-batches through the pipeline: ``sum_j P_j + (m_p - 1) max_j P_j``;
- decode of ``m_d`` micro-batches in round robin: ``max(m_d max_j D_j, sum_j D_j)`` (the
  bottleneck stage busy all the time, or each micro-batch waiting on its own previous token);
- objective = prefill + decode time + ``theta_s * sum(omega)`` (the quality term; ``theta_s``
  converts the normalized quality loss into seconds).

Constraints: per device, weights + KV + activation peak (``memory.MemoryModel``) within its
usable memory; optionally ``sum(omega) <= max_omega``. ``StageTables`` precomputes every
per-(layer group, stage, bit-width) number once, so the ILP, the brute force, the heuristic
and the baselines evaluate exactly the same function.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from sglang_morph.splitquant.cost import LatencyModel
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import ModelSpec
from sglang_morph.models.workload import Workload


@dataclasses.dataclass(frozen=True)
class Device:
    """One pipeline stage's hardware: ``memory_bytes`` usable for weights + KV + activations."""

    name: str
    memory_bytes: int
    latency: LatencyModel

    @property
    def kind(self) -> tuple:
        """Devices of one kind are interchangeable (same memory and cost model)."""
        return (self.name, self.memory_bytes, id(self.latency))


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    link_gbs: float = 12.0  # activation transfer between consecutive stages (PCIe 3 x16 ~12)
    link_latency_s: float = 20e-6

    def unique_orders(self) -> list[tuple[int, ...]]:
        """Device orders that differ in the sequence of device kinds (identical devices
        swapped give the same plan)."""
        seen, orders = set(), []
        for order in itertools.permutations(range(len(self.devices))):
            key = tuple(self.devices[i].kind for i in order)
            if key not in seen:
                seen.add(key)
                orders.append(order)
        return orders


@dataclasses.dataclass(frozen=True)
class PlanningProblem:
    """Invariant: ``omega`` is ``[num_layers, len(bits)]``, zero at 16 bits, and ``bits`` are
    available in ``memory``."""

    model: ModelSpec
    memory: MemoryModel
    cluster: Cluster
    workload: Workload
    bits: tuple[int, ...]
    omega: np.ndarray
    theta_s: float = 0.0
    max_omega: float | None = None

    def __post_init__(self) -> None:
        if self.omega.shape != (self.model.num_layers, len(self.bits)):
            raise ValueError(f"omega must be [{self.model.num_layers}, {len(self.bits)}]")
        if len(self.cluster.devices) > self.model.num_layers:
            raise ValueError(f"{len(self.cluster.devices)} devices for "
                             f"{self.model.num_layers} layers: every stage needs a layer")


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A plan for one device order: ``stage_layers[j]`` layers on stage j, ``bits[l]`` per
    layer."""

    order: tuple[int, ...]
    stage_layers: tuple[int, ...]
    bits: tuple[int, ...]

    @property
    def boundaries(self) -> list[tuple[int, int]]:
        ends = list(itertools.accumulate(self.stage_layers))
        return [(end - n, end) for n, end in zip(self.stage_layers, ends)]


def layer_groups(num_layers: int, group_size: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of ``group_size`` layers (the last may be shorter)."""
    if group_size < 1:
        raise ValueError("group size must be >= 1")
    return [(a, min(a + group_size, num_layers)) for a in range(0, num_layers, group_size)]


@dataclasses.dataclass
class StageTables:
    """Everything the objective needs for one (device order, eta, xi), per layer group.

    ``prefill_s[j, g, k]`` / ``decode_s[j, g, k]``: group g at bits[k] on stage j;
    ``memory_bytes[g, k]`` weights + KV of group g; ``capacity_bytes[j]``: what stage j may
    spend on layers (usable memory minus static tensors and the activation peak);
    ``*_fixed_s[j]``: head and transfers of stage j; ``omega[g, k]``.
    """

    problem: PlanningProblem
    order: tuple[int, ...]
    workload: Workload
    groups: list[tuple[int, int]]
    prefill_s: np.ndarray
    decode_s: np.ndarray
    memory_bytes: np.ndarray
    capacity_bytes: np.ndarray
    prefill_fixed_s: np.ndarray
    decode_fixed_s: np.ndarray
    omega: np.ndarray

    @classmethod
    def build(cls, problem: PlanningProblem, order: Sequence[int], workload: Workload,
              group_size: int = 1) -> "StageTables":
        m, w, mem = problem.model, workload, problem.memory
        devices = [problem.cluster.devices[i] for i in order]
        n_stages = len(devices)
        groups = layer_groups(m.num_layers, group_size)
        sizes = np.array([b - a for a, b in groups], dtype=np.float64)
        steps = w.decode_steps
        per_layer_pre = np.array([[d.latency.prefill_s(b, w.prefill_micro_batch, w.prompt_tokens)
                                   for b in problem.bits] for d in devices])
        per_layer_dec = np.array([[d.latency.decode_total_s(b, w.decode_micro_batch,
                                                            w.prompt_tokens, steps)
                                   for b in problem.bits] for d in devices])
        prefill = per_layer_pre[:, None, :] * sizes[None, :, None]
        decode = per_layer_dec[:, None, :] * sizes[None, :, None]
        kv_layer = mem.kv_bytes_per_layer(w)
        memory = np.array([[sum(mem.layer_weight_bytes(l, b) + kv_layer for l in range(a, e))
                            for b in problem.bits] for a, e in groups], dtype=np.float64)
        omega = np.array([problem.omega[a:e].sum(axis=0) for a, e in groups])
        capacity = np.empty(n_stages)
        pre_fixed = np.zeros(n_stages)
        dec_fixed = np.zeros(n_stages)
        link = problem.cluster
        act_bytes = m.hidden_size * m.dtype_bytes
        for j, d in enumerate(devices):
            first, last = j == 0, j == n_stages - 1
            capacity[j] = (d.memory_bytes - m.stage_static_bytes(first, last)
                           - mem.activation_peak_bytes(w, last))
            if last:
                pre_fixed[j] += d.latency.head_s(w.prefill_micro_batch)
                dec_fixed[j] += steps * d.latency.head_s(w.decode_micro_batch)
            else:
                pre_fixed[j] += link.link_latency_s + (
                    w.prefill_micro_batch * w.prompt_tokens * act_bytes / (link.link_gbs * 1e9))
                dec_fixed[j] += steps * (link.link_latency_s + w.decode_micro_batch * act_bytes
                                         / (link.link_gbs * 1e9))
        return cls(problem, tuple(order), w, groups, prefill, decode, memory, capacity,
                   pre_fixed, dec_fixed, omega)

    @property
    def n_stages(self) -> int:
        return len(self.order)

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    # ---- the objective ----------------------------------------------------------------------

    def stage_times(self, stage_groups: Sequence[int], bit_index: Sequence[int]
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-stage prefill and decode times of a plan given in groups."""
        stage_of = np.repeat(np.arange(self.n_stages), stage_groups)
        g = np.arange(self.n_groups)
        k = np.asarray(bit_index)
        pre = np.bincount(stage_of, self.prefill_s[stage_of, g, k], self.n_stages)
        dec = np.bincount(stage_of, self.decode_s[stage_of, g, k], self.n_stages)
        return pre + self.prefill_fixed_s, dec + self.decode_fixed_s

    def times(self, stage_groups: Sequence[int], bit_index: Sequence[int]) -> tuple[float, float]:
        pre, dec = self.stage_times(stage_groups, bit_index)
        w = self.workload
        prefill = pre.sum() + (w.prefill_micro_batches - 1) * pre.max()
        decode = max(w.decode_micro_batches * dec.max(), dec.sum())
        return float(prefill), float(decode)

    def quality(self, bit_index: Sequence[int]) -> float:
        return float(self.omega[np.arange(self.n_groups), np.asarray(bit_index)].sum())

    def objective(self, stage_groups: Sequence[int], bit_index: Sequence[int]) -> float:
        prefill, decode = self.times(stage_groups, bit_index)
        return prefill + decode + self.problem.theta_s * self.quality(bit_index)

    def feasible(self, stage_groups: Sequence[int], bit_index: Sequence[int]) -> bool:
        if len(stage_groups) != self.n_stages or min(stage_groups) < 1:
            return False
        stage_of = np.repeat(np.arange(self.n_stages), stage_groups)
        used = np.bincount(stage_of, self.memory_bytes[np.arange(self.n_groups),
                                                       np.asarray(bit_index)], self.n_stages)
        if np.any(used > self.capacity_bytes):
            return False
        max_omega = self.problem.max_omega
        return max_omega is None or self.quality(bit_index) <= max_omega * (1 + 1e-9)

    def to_assignment(self, stage_groups: Sequence[int], bit_index: Sequence[int]) -> Assignment:
        layers_per_stage, bits = [], []
        gi = 0
        for n in stage_groups:
            layers_per_stage.append(sum(e - a for a, e in self.groups[gi:gi + n]))
            gi += n
        for (a, e), k in zip(self.groups, bit_index):
            bits += [self.problem.bits[k]] * (e - a)
        return Assignment(self.order, tuple(layers_per_stage), tuple(bits))
