"""The pure parts of the simulator's live check (``benchmark/amoebas/validate.py``), without a
server: the workload, a streamed request's progress, the metrics and the comparison, and the
simulator's wait after a merge."""

from __future__ import annotations

import dataclasses

import pytest

from benchmark.amoebas import validate as V
from benchmark.amoebas.sim import StepCosts
from sglang_morph.amoebas.capacity import CapacityModel
from sglang_morph.amoebas.policy import AmoebasPolicy
from sglang_morph.kunserve.cost import ChunkCostModel, PhaseCosts
from test_policy import TINY, TINY_SPEC

POOL = 1024
HAND = StepCosts(PhaseCosts(ChunkCostModel(0.0, 0.0001, 0.01), ChunkCostModel(0.0, 0.001, 0.02)),
                 num_layers=4, allreduce_s_per_layer=0.001, merge_fixed_s=0.3,
                 split_fixed_s=0.2, link_bytes_per_s=1e9, host_copy_bytes_per_s=1e9)


def capacity() -> CapacityModel:
    return CapacityModel.from_kv_pool(TINY_SPEC, V.REPLICAS, POOL)


@pytest.mark.parametrize("workload", [V.FULL, V.QUICK])
def test_the_workload_is_one_per_seed_and_its_long_prompts_need_a_pair(workload):
    reqs, longs = workload.requests()
    assert (reqs, longs) == workload.requests()
    assert reqs != dataclasses.replace(workload, seed=1).requests()[0]
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert sorted(reqs[k].prompt_tokens for k in longs) == sorted(workload.long_prompt_tokens)
    cap = capacity()
    workload.check_lengths(cap)
    for r in reqs:
        kv = r.prompt_tokens + r.output_tokens
        # Long: no TP 1 pool holds it and the policy merges exactly a pair for it.
        assert cap.is_long(kv) == (r.index in longs)
        assert cap.degree_for(kv) == (2 if r.index in longs else 1)
        assert r.index in longs or r.arrival_s < workload.duration_s


def test_long_prompts_a_replica_admits_or_a_pair_cannot_hold_are_refused():
    cap = capacity()
    for prompt in (POOL - 100, cap.owner_capacity_tokens(2)):
        with pytest.raises(ValueError, match="long prompt"):
            dataclasses.replace(V.QUICK, long_prompt_tokens=(prompt,)).check_lengths(cap)
    with pytest.raises(ValueError):
        dataclasses.replace(V.QUICK, long_arrivals_s=(1.0, 2.0))  # one prompt for two times


def test_progress_between_chunks_is_linear():
    chunks = [(1.0, 1), (2.0, 9), (3.0, 12)]
    assert [V.tokens_by(chunks, t) for t in (0.5, 1.0, 1.5, 2.5, 3.0, 9.0)] == \
        [0.0, 1.0, 5.0, 10.5, 12.0, 12.0]
    assert V.tokens_by([], 1.0) == 0.0


def outcome(arrival, first, finish, n, long=False):
    return {"long": long, "arrival_s": arrival, "first_token_s": first, "finish_s": finish,
            "output_tokens": n, "max_new_tokens": 10}


def test_the_summary_and_the_comparison_arithmetic():
    outs = [outcome(0.0, 1.0, 3.0, 10), outcome(1.0, 1.5, 4.0, 10),
            outcome(2.0, 5.0, 9.0, 10, long=True), outcome(11.0, None, None, 0)]
    s = V.summarize(outs, 10.0, 25.0, merges=1, splits=1, kv_held_share=0.5)
    assert (s["completed"], s["completed_long"], s["transitions"]) == (3, 1, 2)
    assert s["offered_output_tokens_per_s"] == pytest.approx(3.0)  # the last arrives late
    assert s["window_output_tokens_per_s"] == pytest.approx(2.5)
    assert s["makespan_output_tokens_per_s"] == pytest.approx(30 / 9.0)
    assert s["short_ttft_p50_s"] == pytest.approx(0.75) and s["long_e2e_p50_s"] == 7.0

    assert V.relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert V.relative_error(0, 0) == 0.0 and V.relative_error(1, 0) is None
    assert V.relative_error(None, 1.0) is None
    sim = {**s, "window_output_tokens_per_s": 2.5 * 1.14, "transitions": 3}
    c = V.compare(s, sim, 0.15)
    assert c["rows"]["window_output_tokens_per_s"]["within_target"]
    assert not c["rows"]["transitions"]["within_target"]  # 3 against 2: +50%
    assert c["rows"]["completed"]["within_target"] is None  # reported, not checked
    assert not c["passed"] and c["saturated"]  # 2.5 achieved of 3.0 offered
    assert V.compare(s, {**s, "transitions": 2}, 0.15)["passed"]


def test_the_live_policy_params_take_the_pools_the_replicas_report():
    status = {"replicas": [{"replica": r, "kv_capacity_tokens_alone": POOL,
                            "groups_allowed": [[0, 1], [2, 3], [0, 1, 2, 3]]}
                           for r in range(V.REPLICAS)]}
    params = V.live_params(TINY, status, 1790)
    assert params["owner_tokens"] == [[1, POOL], [2, 1790]]
    assert params["groups"] == [[0, 1], [2, 3], [0, 1, 2, 3]]
    assert V.live_params(TINY, status, None)["owner_tokens"] == [[1, POOL]]


def simulate(dwell_s, overhead_s=0.0):
    cap = capacity()
    reqs, _ = dataclasses.replace(V.QUICK, short_per_s=0.5).requests()
    policy = AmoebasPolicy(cap, groups=((0, 1), (2, 3), (0, 1, 2, 3)), merge_from_degrees=(1,))
    return V.simulate_same(reqs, cap, HAND, policy, dwell_s, V.QUICK.duration_s, 300.0,
                           overhead_s)


def test_the_simulator_serves_every_request_and_splits_only_after_the_dwell():
    quick, _, outcomes = simulate(0.0)
    summary, transitions, _ = simulate(5.0)
    late, _, _ = simulate(0.0, overhead_s=0.5)  # latency outside the replicas: later, no slower
    assert late["short_ttft_p50_s"] == pytest.approx(quick["short_ttft_p50_s"] + 0.5)
    assert late["window_output_tokens_per_s"] == quick["window_output_tokens_per_s"]
    for s in (quick, summary):
        assert s["SIMULATED"] and s["completed"] == s["requests"] and s["refused"] == 0
        assert (s["merges"], s["splits"]) == (1, 1)
    merge, split = transitions
    assert (merge["kind"], split["kind"], merge["members"]) == ("merge", "split", split["members"])
    assert split["at_s"] >= merge["at_s"] + merge["seconds"] + 5.0 - 1e-9
    assert 0 < summary["kv_held_share"] < 1
    assert sorted(o["index"] for o in outcomes) == list(range(summary["requests"]))


def test_the_step_costs_come_from_the_calibration_points_and_transitions():
    prefill, decode = ChunkCostModel(2e-8, 1e-4, 0.05), ChunkCostModel(1e-6, 2e-3, 0.03)
    cal = {"prefill_points": [{"prompt_tokens": n, "seconds": prefill.seconds([
               V.C.Chunk(0, n)])} for n in (32, 256, 512, 960)],
           "decode_points": [{"batch": b, "cached_tokens": p, "seconds": decode.seconds(
               [V.C.Chunk(p, 1)] * b)} for b, p in ((1, 40), (4, 40), (8, 40), (4, 180))],
           "transitions": [{"action": "merge", "duration_s": 0.02},
                           {"action": "split", "duration_s": 0.05}]}
    transfer = {"gloo_latency_s": 0.001, "gloo_bandwidth_bytes_per_s": 1e9,
                "host_copy_bandwidth_bytes_per_s": 2e9}
    costs, fit = V.fit_costs(cal, 4, transfer)
    # A prefill holds its replica for the decode step's fixed cost; the rest of its intercept
    # is latency outside the replicas.
    assert fit["request_overhead_s"] == pytest.approx(0.02)
    assert costs.prefill_s([300], 1) == pytest.approx(prefill.seconds([V.C.Chunk(0, 300)]) - 0.02)
    assert costs.decode_s([100] * 3, 1) == pytest.approx(decode.seconds([V.C.Chunk(100, 1)] * 3))
    assert (costs.merge_fixed_s, costs.split_fixed_s) == (0.02, 0.05)
    assert costs.allreduce_s_per_layer == pytest.approx(0.002) and fit["transitions_measured"]
    assert max(fit["fit_mean_relative_error"].values()) < 1e-6
    costs, fit = V.fit_costs({**cal, "transitions": []}, 4, transfer)
    assert (costs.merge_fixed_s, costs.split_fixed_s) == (0.14, 0.28)  # assumed, and said so
    assert not fit["transitions_measured"]


def test_the_sized_rate_is_where_the_simulator_falls_behind():
    cap = capacity()
    policy = AmoebasPolicy(cap, groups=((0, 1), (2, 3), (0, 1, 2, 3)), merge_from_degrees=(1,))
    w = dataclasses.replace(V.QUICK, duration_s=20.0)

    def served_share(rate):
        s, _, _ = V.simulate_same(dataclasses.replace(w, short_per_s=rate).requests()[0], cap,
                                  HAND, policy, 2.0, w.duration_s, w.duration_s + 1.0)
        return s["window_output_tokens_per_s"] / s["offered_output_tokens_per_s"]

    rate = V.choose_rate(w, policy, HAND, 2.0, 0.0)
    assert 1.0 < rate < 64.0
    assert served_share(rate) < V.SIZE_RATIO <= served_share(rate / 1.25)
