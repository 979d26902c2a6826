"""The SplitQuant solvers against each other: the ILP equals exhaustive search on small models,
a 30-layer 4-device plan is solved within 60 s, the bit-transfer heuristic stays within 5% of
the ILP and is at least 10x faster; the baselines are feasible plans of the same model."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from sglang_morph.splitquant import baselines, brute_force, heuristic, ilp
from sglang_morph.splitquant.devices import GPUS, gpu_latency_model
from sglang_morph.models.memory import MemoryModel
from sglang_morph.models.spec import SIMULATED_MODELS
from sglang_morph.splitquant.problem import Cluster, Device, PlanningProblem, StageTables
from sglang_morph.splitquant.search import search
from sglang_morph.models.workload import Workload

BITS = (16, 8, 4)


def _problem(num_layers: int, gpus: tuple[str, ...], memory_scale: float, seed: int,
             max_omega_share: float | None = None, theta_s: float = 0.0) -> PlanningProblem:
    """A llama-2-13b-shaped model cut to ``num_layers`` on ``gpus`` whose memory is scaled so
    that full precision does not fit everywhere (the interesting case)."""
    model = dataclasses.replace(SIMULATED_MODELS["llama-2-13b"], num_layers=num_layers,
                                name=f"llama-13b-{num_layers}")
    memory = MemoryModel.from_spec(model, BITS)
    w = Workload(batch_requests=16, prompt_tokens=512, output_tokens=64)
    fp_bytes = num_layers * (memory.layer_weight_bytes(0, 16) + memory.kv_bytes_per_layer(w))
    devices = tuple(
        Device(name, int(memory_scale * fp_bytes * GPUS[name].memory_bytes
                         / sum(GPUS[g].memory_bytes for g in gpus))
               + model.stage_static_bytes(True, True) + 2 * 10**9,
               gpu_latency_model(name, model))
        for name in gpus)
    rng = np.random.default_rng(seed)
    omega = np.zeros((num_layers, 3))
    omega[:, 1] = rng.uniform(0.01, 0.05, num_layers)
    omega[:, 2] = omega[:, 1] * rng.uniform(10, 40, num_layers)
    max_omega = None if max_omega_share is None else max_omega_share * omega[:, 2].sum()
    return PlanningProblem(model, memory, Cluster("test", devices), w, BITS, omega,
                           theta_s=theta_s, max_omega=max_omega)


@pytest.mark.parametrize("num_layers,gpus,scale,share,theta", [
    (4, ("T4", "V100"), 0.7, None, 0.0),
    (6, ("T4", "A100-40G"), 0.6, 0.4, 0.0),
    (8, ("T4", "V100"), 0.8, None, 0.5),
    (6, ("T4", "V100", "A100-40G"), 0.6, 0.5, 0.1),
    (8, ("V100", "A100-40G"), 0.45, None, 1.0),
])
def test_ilp_equals_brute_force(num_layers, gpus, scale, share, theta):
    problem = _problem(num_layers, gpus, scale, seed=num_layers, max_omega_share=share,
                       theta_s=theta)
    compared = 0
    for order in problem.cluster.unique_orders():
        t = StageTables.build(problem, order, problem.workload.with_micro_batches(4, 8))
        exact = brute_force.solve(t)
        found = ilp.solve(t, mip_rel_gap=1e-9)
        assert (exact is None) == (found is None)
        if exact is None:
            continue
        compared += 1
        assert t.feasible(found.stage_groups, found.bit_index)
        assert found.objective == pytest.approx(exact.objective, rel=1e-6)
        quality_exact = brute_force.solve(t, quality_only=True)
        quality_found = ilp.solve(t, quality_only=True, mip_rel_gap=1e-9)
        assert quality_found.objective == pytest.approx(quality_exact.objective, rel=1e-6,
                                                        abs=1e-12)
    assert compared > 0  # memory is tight, not impossible


def test_unfittable_problem_has_no_plan():
    problem = _problem(6, ("T4", "V100"), 0.5, seed=0)
    small = tuple(dataclasses.replace(d, memory_bytes=10**9) for d in problem.cluster.devices)
    problem = dataclasses.replace(problem, cluster=Cluster("small", small))
    t = StageTables.build(problem, (0, 1), problem.workload)
    assert brute_force.solve(t) is None
    assert ilp.solve(t) is None


def test_grouped_layers_plan_is_feasible_and_close():
    problem = _problem(8, ("T4", "V100"), 0.7, seed=3)
    t1 = StageTables.build(problem, (0, 1), problem.workload.with_micro_batches(4, 8))
    t2 = StageTables.build(problem, (0, 1), problem.workload.with_micro_batches(4, 8),
                           group_size=2)
    one, two = ilp.solve(t1), ilp.solve(t2)
    a = t2.to_assignment(two.stage_groups, two.bit_index)
    assert sum(a.stage_layers) == 8 and len(a.bits) == 8
    # grouping restricts the plans, so it can only be worse, and here by little
    assert one.objective <= two.objective * (1 + 1e-6) <= one.objective * 1.15


def test_30_layer_4_device_plan_within_60_s_and_heuristic_close_and_fast():
    problem = _problem(30, ("T4", "T4", "V100", "A100-40G"), 0.55, seed=30,
                       max_omega_share=0.5, theta_s=0.2)
    grid = [(2, 4), (4, 4), (4, 16)]
    # "Fast" compares CPU seconds of this process (both searches run on one thread): under the
    # parallel suite a wall clock also counts the time the other worker's servers hold the
    # cores, which once made the heuristic take 9.7 s of wall time for 0.4 s of work.
    started, started_cpu = time.perf_counter(), time.process_time()
    exact = search(problem, "ilp", micro_batches=grid)
    ilp_s, ilp_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    assert exact is not None and ilp_s < 60
    started_cpu = time.process_time()
    fast = search(problem, "heuristic", micro_batches=grid)
    heuristic_cpu_s = time.process_time() - started_cpu
    assert fast is not None
    assert fast.objective <= exact.objective * 1.05
    assert exact.objective <= fast.objective * (1 + 1e-3)  # the ILP is (near) optimal
    assert heuristic_cpu_s * 10 <= ilp_cpu_s, (heuristic_cpu_s, ilp_cpu_s)
    for result in (exact, fast):
        assert result.quality <= problem.max_omega * (1 + 1e-9)
        for stage, device in zip(result.stage_memory, result.devices):
            capacity = next(d.memory_bytes for d in problem.cluster.devices if d.name == device)
            assert stage.total_bytes <= capacity


def test_baselines_are_feasible_and_not_better_than_the_ilp():
    problem = _problem(12, ("T4", "V100", "A100-40G"), 0.6, seed=12)
    grid = [(4, 8)]
    best = search(problem, "ilp", micro_batches=grid)
    for name in baselines.BASELINES:
        result = getattr(baselines, name)(problem, micro_batches=grid)
        assert result is not None, name
        assert result.total_s >= best.total_s * (1 - 1e-6), name
        if name == "uniform":
            assert len(set(result.assignment.bits)) == 1
            assert max(result.assignment.stage_layers) - min(result.assignment.stage_layers) <= 1
        if name == "pipeedge":
            assert len(set(result.assignment.bits)) == 1


def test_heuristic_improves_its_quality_only_start():
    problem = _problem(8, ("T4", "A100-40G"), 0.6, seed=5)
    t = StageTables.build(problem, (0, 1), problem.workload.with_micro_batches(4, 8))
    start = ilp.solve(t, quality_only=True)
    found = heuristic.solve(t, start)
    assert found.objective <= t.objective(start.stage_groups, start.bit_index)
    assert t.feasible(found.stage_groups, found.bit_index)
