"""The SIMULATED AMOEBAs cluster (``benchmark/amoebas/sim.py``), without servers: token times
against hand-computed step costs, a merge and a split where the capacity model says, and a
small run that ends with every request done or refused and exactly the transitions the
policy decided."""

from __future__ import annotations

import dataclasses

import pytest

from benchmark.amoebas import sim
from sglang_morph.amoebas.capacity import CapacityModel
from sglang_morph.amoebas.policy import AmoebasPolicy, Merge, MergeOnDemand, Request, Split
from sglang_morph.kunserve.cost import ChunkCostModel, PhaseCosts
from test_policy import TINY_SPEC

GBPS = 1e9
HAND = sim.StepCosts(PhaseCosts(ChunkCostModel(0.0, 0.001, 0.01), ChunkCostModel(0.0, 0.002, 0.02)),
                     num_layers=4, allreduce_s_per_layer=0.001, merge_fixed_s=0.5,
                     split_fixed_s=0.25, link_bytes_per_s=GBPS, host_copy_bytes_per_s=2 * GBPS)


class Recording:
    """The policy, with every decision it returned kept."""

    def __init__(self, policy):
        self.policy, self.name, self.decisions = policy, policy.name, []

    def dispatch(self, request, fleet):
        self.decisions.append(self.policy.dispatch(request, fleet))
        return self.decisions[-1]

    def maintenance(self, fleet):
        splits = self.policy.maintenance(fleet)
        self.decisions += splits
        return splits


def request(rid, arrival_s, prompt, new, capacity):
    return sim.SimRequest(Request(rid, prompt, new), arrival_s,
                          capacity.is_long(prompt + new))


def test_token_times_are_the_step_costs():
    cap = CapacityModel.from_kv_pool(TINY_SPEC, 2, 2048)
    done = sim.simulate([request("a", 1.0, 100, 3, cap)], cap, HAND, AmoebasPolicy(cap), None)
    (r,) = done.requests
    # Prefill 0.01 + 100 x 0.001, then two decode steps of 0.02 + 0.002.
    assert r.first_token_s == pytest.approx(1.11)
    assert r.finish_s == pytest.approx(1.11 + 2 * 0.022)
    assert done.transitions == []


def test_a_long_request_merges_then_the_group_splits():
    cap = CapacityModel.from_kv_pool(TINY_SPEC, 2, 2048)
    policy = Recording(AmoebasPolicy(cap))
    done = sim.simulate([request("long", 0.0, 2100, 2, cap)], cap, HAND, policy, None)
    (r,) = done.requests
    merge_s = 0.5  # nothing running to re-shard
    prefill_s = (0.01 + 0.001 * 2100) / 2 + 4 * 0.001  # TP 2: half the work + 4 all-reduces
    decode_s = 0.022 / 2 + 4 * 0.001
    assert r.first_token_s == pytest.approx(merge_s + prefill_s)
    assert r.finish_s == pytest.approx(merge_s + prefill_s + decode_s)
    merge, split = done.transitions
    assert (merge["kind"], merge["members"], merge["seconds"]) == ("merge", [0, 1],
                                                                    pytest.approx(merge_s))
    # The split refills the FFN shard each member freed, from the host copy.
    refill_s = cap.freed_bytes(2) / (2 * GBPS)
    assert (split["kind"], split["at_s"]) == ("split", pytest.approx(r.finish_s))
    assert split["seconds"] == pytest.approx(0.25 + refill_s)
    assert [type(d) for d in policy.decisions] == [Merge, Split]
    assert done.timeline[0]["units"] == [[[0], "serving"], [[1], "serving"]]
    assert done.timeline[-1]["units"] == [[[0], "serving"], [[1], "serving"]]
    assert [[0, 1], "transitioning"] in [u for t in done.timeline for u in t["units"]]
    # One decode step of the group: one token over two replicas' time.
    m = sim.metrics(done, 10.0)
    assert m["decode_tokens_per_replica_s"] == {2: pytest.approx(1 / (2 * decode_s))}
    assert m["completed_long_tokens_per_s"] == pytest.approx(2102 / 10.0)
    assert m["waiting_at_end"] == 0


@pytest.mark.parametrize("make_policy", [
    AmoebasPolicy, lambda c: MergeOnDemand(c, "round_robin"),
    lambda c: MergeOnDemand(c, "least_loaded")])
def test_small_run_finishes_every_request_and_applies_the_policy_transitions(make_policy):
    cap = CapacityModel.from_kv_pool(TINY_SPEC, 4, 2048)
    workload = sim.Workload(90.0, short_per_min=40.0, long_per_min=8.0, short_new_tokens=32,
                            long_new_tokens=32)
    requests = workload.requests(cap, seed=3)
    requests.append(request("too-long", 5.0, 3200, 1, cap))  # over the TP 4 pool of 3200
    assert sum(r.long for r in requests) >= 8
    policy = Recording(make_policy(cap))
    costs = sim.StepCosts.measured(TINY_SPEC.num_layers)
    done = sim.simulate(requests, cap, costs, policy, None)
    finished = [r for r in done.requests if r.finish_s is not None]
    assert [r.request.rid for r in done.refused] == ["too-long"]
    assert len(finished) + len(done.refused) == len(requests)
    assert all(r.generated == r.request.max_new_tokens for r in finished)
    assert not done.central
    merges = [d for d in policy.decisions if isinstance(d, Merge)]
    splits = [d for d in policy.decisions if isinstance(d, Split)]
    assert merges, "the long requests never merged anything"
    kinds = [t["kind"] for t in done.transitions]
    assert kinds.count("merge") == len(merges) == sum(
        a["decision"] == "merge" for a in done.applied)
    assert kinds.count("split") == len(splits)
    assert [sorted(t["members"]) for t in done.transitions if t["kind"] == "merge"] == [
        list(m.members) for m in merges]
    # Every group split back: the run ends with every replica serving at TP 1.
    assert done.timeline[-1]["units"] == [[[m], "serving"] for m in range(4)]
    # Deterministic: the same run again gives the same times.
    again = sim.simulate(requests, cap, costs, make_policy(cap), None)
    assert [(r.first_token_s, r.finish_s) for r in again.requests] == [
        (r.first_token_s, r.finish_s) for r in done.requests]


def test_metrics_count_only_the_window():
    cap = CapacityModel.from_kv_pool(TINY_SPEC, 2, 2048)
    reqs = [request("a", 0.0, 100, 3, cap), request("b", 0.0, 200, 400, cap)]
    done = sim.simulate(reqs, cap, HAND, AmoebasPolicy(cap), 2.0)
    m = sim.metrics(done, 2.0)
    (a, b) = done.requests
    assert (m["arrived"], m["completed"]) == (2, 1) and b.finish_s is None
    assert m["completed_tokens_per_s"] == pytest.approx(103 / 2.0)
    assert m["output_tokens_per_s"] == pytest.approx((a.generated + b.generated) / 2.0)
    assert dataclasses.replace(reqs[0]).generated == 0  # the inputs were copied, not consumed
    assert m["completed_long_tokens_per_s"] == 0 and m["waiting_at_end"] == 0
    # b is still decoding at the window's end: a TP 1 replica's decoded tokens over its time.
    assert m["decode_tokens_per_replica_s"][1] == pytest.approx(
        done.decode_tokens[1] / done.replica_s["decode_tp1"])
    assert done.decode_tokens[1] == a.generated - 1 + b.generated - 1


def test_the_paper_shape_on_eight_tiny_replicas_needs_groups_of_four():
    """``paper_tiny8``: long prompts above a TP 2 group's pool, so only a TP 4 group holds
    them (the default model's heads allow no TP 2)."""
    from benchmark.amoebas.__main__ import SCENARIOS, model_spec

    sc = SCENARIOS["paper_tiny8"]
    capacity = CapacityModel.from_kv_pool(model_spec(sc.model), sc.replicas,
                                          sc.kv_capacity_tokens_tp1)
    assert capacity.allowed_degrees == (1, 2, 4)
    reqs = sim.Workload(600.0, sc.short_per_min, sc.long_per_min,
                        long_above_degree=sc.long_above_degree).requests(capacity, 0)
    longs = [r.kv_tokens for r in reqs if r.long]
    assert longs and all(capacity.owner_capacity_tokens(2) < kv
                         <= capacity.owner_capacity_tokens(4) for kv in longs)
    shorts = [r.kv_tokens for r in reqs if not r.long]
    assert 0.2 * 2048 < min(shorts) and max(shorts) < 0.3 * 2048
