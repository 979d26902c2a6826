"""The pure parts of the simulator's live check (``benchmark/amoebas/validate.py``), without a
server: the workload, a streamed request's progress, the metrics and the comparison, the
simulator's wait after a merge, the calibration read from the schedulers' log and its fit, and
the operating point sized from the probed capacity."""

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


PREFILL = ChunkCostModel(2e-8, 3e-4, 0.012)
DECODE = ChunkCostModel(1e-6, 4e-3, 0.03)
STEPS = V.DECODE_LOG_INTERVAL_STEPS


def stamp(rank: int) -> str:
    return f"[2026-11-27 06:49:03 DP{rank}] "


def decode_line(rank: int, running: int, kv_tokens: int, seconds: float) -> str:
    """What a scheduler logs after ``STEPS`` decode steps of ``running`` requests that took
    ``seconds`` (SGLang's format)."""
    return (f"{stamp(rank)}Decode batch, #running-req: {running}, #token: {kv_tokens}, token "
            f"usage: 0.40, cpu graph: False, gen throughput (token/s): "
            f"{STEPS * running / seconds:.4f}, #queue-req: 0")


def prefill_line(rank: int, new_tokens: int, running: int) -> str:
    return (f"{stamp(rank)}Prefill batch, #new-seq: 1, #new-token: {new_tokens}, #cached-token: "
            f"0, token usage: 0.41, #running-req: {running}, #queue-req: 0, #pending-token: 0, "
            f"cpu graph: False, input throughput (token/s): 812.31")


def synthetic_log(points=((1, 100), (4, 60), (8, 30)), sizes=(32, 96, 192, 384)) -> str:
    """Four replicas' interleaved lines for decode points (batch, prompt) timed by ``DECODE``,
    with a prefill timed by ``PREFILL`` in every other interval; an unrelated line and a
    replica's batch change in between."""
    lines, k = ["[2026-11-27 06:48:50] INFO:     127.0.0.1 - \"POST /generate HTTP/1.1\" 200 OK"], 0
    for b, prompt in points:
        for rank in range(V.REPLICAS):
            lines.append(decode_line(rank, b, b * prompt, 1.0))  # opens the point: no interval
        for i in range(1, 9):
            for rank in range(V.REPLICAS):
                kv = b * (prompt + i * STEPS)
                steps_s = STEPS * DECODE.seconds(
                    [V.C.Chunk(round(kv / b - STEPS / 2), 1)] * b)
                extra = 0.0
                if (i + rank) % 2:
                    n = sizes[k % len(sizes)]
                    k += 1
                    lines.append(prefill_line(rank, n, b))
                    extra = PREFILL.seconds([V.C.Chunk(0, n)])
                lines.append(decode_line(rank, b, kv, steps_s + extra))
    lines.append(decode_line(0, 7, 400, 0.5))  # a request left: the batch changed, no interval
    return "\n".join(lines)


def test_the_schedulers_log_lines_are_read_into_timed_intervals():
    events = V.log_events(synthetic_log(points=((4, 60),)))
    assert {e["kind"] for e in events} == {"decode", "prefill"}
    assert all(0 <= e["rank"] < V.REPLICAS for e in events)
    first = next(e for e in events if e["kind"] == "decode")
    assert (first["running"], first["kv_tokens"]) == (4, 240)
    assert first["tokens_per_s"] == pytest.approx(STEPS * 4 / 1.0)
    intervals = V.decode_intervals(events, STEPS)
    assert len(intervals) == 8 * V.REPLICAS  # the opening line of each replica starts none
    with_prefill = [iv for iv in intervals if iv["prefill_tokens"]]
    assert len(with_prefill) == len(intervals) // 2
    assert all(len(iv["prefill_tokens"]) == 1 and iv["prefill_seqs"] == 1 for iv in with_prefill)
    clean = next(iv for iv in intervals if not iv["prefill_tokens"])
    ctx = clean["context_tokens"]
    assert clean["seconds"] == pytest.approx(
        STEPS * DECODE.seconds([V.C.Chunk(round(ctx), 1)] * 4), rel=1e-4)
    # A prefill logged by one replica belongs to that replica's next interval only.
    text = "\n".join([decode_line(0, 2, 100, 1.0), decode_line(1, 2, 100, 1.0),
                      prefill_line(1, 64, 2), decode_line(0, 2, 110, 0.4),
                      decode_line(1, 2, 110, 0.5), decode_line(1, 3, 150, 0.5)])
    ivs = V.decode_intervals(V.log_events(text), STEPS)
    assert [(iv["rank"], iv["prefill_tokens"]) for iv in ivs] == [(0, []), (1, [64])]
    assert ivs[0]["seconds"] == pytest.approx(0.4, rel=1e-4)
    assert ivs[0]["context_tokens"] == pytest.approx(110 / 2 - STEPS / 2)


def test_the_fit_recovers_the_decode_step_and_the_prefill_from_the_log():
    intervals = V.decode_intervals(V.log_events(synthetic_log()), STEPS)
    prefill, decode, fit = V.fit_step_costs(intervals)
    for b, ctx in ((1, 150), (4, 90), (8, 60)):
        chunks = [V.C.Chunk(ctx, 1)] * b
        assert decode.seconds(chunks) == pytest.approx(DECODE.seconds(chunks), rel=0.01)
    for n in (32, 192, 384):
        assert prefill.seconds([V.C.Chunk(0, n)]) == pytest.approx(
            PREFILL.seconds([V.C.Chunk(0, n)]), rel=0.02)
    assert set(fit["prefill_median_s"]) == {"32", "96", "192", "384"}
    assert max(fit["fit_mean_relative_error"].values()) < 0.02
    # One batch size cannot separate a step's fixed cost from its per-request cost.
    one_batch = [iv for iv in intervals if iv["batch"] == 4]
    with pytest.raises(ValueError, match="two batch sizes"):
        V.fit_step_costs(one_batch)
    with pytest.raises(ValueError, match="prefill"):
        V.fit_step_costs([iv for iv in intervals if not iv["prefill_tokens"]])


def test_the_step_costs_come_from_the_calibration_log_ttft_and_transitions():
    outside_s = 0.15
    cal = {"decode_intervals": V.decode_intervals(V.log_events(synthetic_log()), STEPS),
           "prefill_points": [{"prompt_tokens": n, "seconds": PREFILL.seconds(
               [V.C.Chunk(0, n)]) + outside_s} for n in (32, 256, 512, 960)],
           "transitions": [{"action": "merge", "duration_s": 0.02},
                           {"action": "split", "duration_s": 0.05}]}
    transfer = {"gloo_latency_s": 0.001, "gloo_bandwidth_bytes_per_s": 1e9,
                "host_copy_bandwidth_bytes_per_s": 2e9}
    costs, fit = V.fit_costs(cal, 4, transfer)
    # A prompt's time to first token beyond its prefill is latency that holds no replica.
    assert fit["request_overhead_s"] == pytest.approx(outside_s, abs=0.005)
    assert costs.prefill_s([300], 1) == pytest.approx(
        PREFILL.seconds([V.C.Chunk(0, 300)]), rel=0.02)
    assert costs.decode_s([100] * 3, 1) == pytest.approx(
        DECODE.seconds([V.C.Chunk(100, 1)] * 3), rel=0.01)
    # A TP 2 step: half the TP 1 compute plus two all-reduces a layer.
    assert costs.decode_s([100] * 3, 2) == pytest.approx(
        costs.decode_s([100] * 3, 1) / 2 + 4 * 0.002)
    assert (costs.merge_fixed_s, costs.split_fixed_s) == (0.02, 0.05)
    assert costs.allreduce_s_per_layer == pytest.approx(0.002) and fit["transitions_measured"]
    costs, fit = V.fit_costs({**cal, "transitions": []}, 4, transfer)
    assert (costs.merge_fixed_s, costs.split_fixed_s) == (0.14, 0.28)  # assumed, and said so
    assert not fit["transitions_measured"]


@pytest.mark.parametrize("plan", [V.FULL_CAL, V.QUICK_CAL])
def test_calibration_points_run_the_replays_batches_and_leave_room_for_injections(plan):
    assert max(b for b, _, _ in plan.decode_points) >= 4
    assert len({b for b, _, _ in plan.decode_points}) >= 2  # the decode fit needs two
    for point in plan.decode_points:
        b, prompt, new = point
        sizes = plan.inject_sizes(point, POOL)
        assert len(sizes) >= len(V.C.KUNSERVE_TERMS)  # the prefill fit needs three
        # The point's requests and any injection fit a TP 1 pool together.
        assert b * (prompt + new) + max(sizes) + 1 <= POOL - V.SGLANG_PROMPT_MARGIN_TOKENS
        # A dozen log intervals at least, so some run without a prefill.
        assert new >= 12 * STEPS
    assert V.FULL_CAL.inject_sizes((8, 24, 72), POOL) == (32, 96, 192)
    assert V.FULL_CAL.inject_sizes((1, 128, 200), POOL) == V.FULL_CAL.inject_prompt_tokens


def test_the_sized_rate_offers_the_share_of_the_probed_capacity():
    w = V.FULL
    rate = V.size_rate(w, 400.0, V.LOAD_SHARE)
    sized = dataclasses.replace(w, short_per_s=rate)
    reqs, longs = sized.requests()
    offered = sum(r.output_tokens for r in reqs) / w.duration_s
    # The Poisson draw's own spread: a few percent over 75 s at these rates.
    assert offered == pytest.approx(V.LOAD_SHARE * 400.0, rel=0.1)
    longs_per_s = w.long_new_tokens * len(w.long_arrivals_s) / w.duration_s
    assert rate * sum(w.short_new_tokens) / 2 + longs_per_s == pytest.approx(
        V.LOAD_SHARE * 400.0, abs=0.05)
    assert V.size_rate(w, 800.0, V.LOAD_SHARE) > 2 * rate  # the long output is fixed
    with pytest.raises(ValueError, match="no room"):
        V.size_rate(w, 3.0, V.LOAD_SHARE)  # the long prompts alone offer more


def test_the_simulated_capacity_is_where_the_simulator_falls_behind():
    cap = capacity()
    policy = AmoebasPolicy(cap, groups=((0, 1), (2, 3), (0, 1, 2, 3)), merge_from_degrees=(1,))
    slow = V.simulated_capacity(V.QUICK, policy, HAND, 2.0, 0.0, 10.0, 4.0)
    assert slow["saturated"]
    # A smaller per-request decode cost serves more of the same mix.
    fast_costs = dataclasses.replace(HAND, phases=PhaseCosts(
        HAND.phases.prefill, ChunkCostModel(0.0, 0.0002, 0.02)))
    fast = V.simulated_capacity(V.QUICK, policy, fast_costs, 2.0, 0.0, 10.0, 4.0)
    assert fast["saturated"] and fast["output_tokens_per_s"] > slow["output_tokens_per_s"]
    # Below the rate found, the simulator kept up: the capacity sits between the two.
    half = dataclasses.replace(V.QUICK, duration_s=10.0, long_arrivals_s=(),
                               long_prompt_tokens=(), short_per_s=slow["short_per_s"] / 2)
    s, _, _ = V.simulate_same(half.requests()[0], cap, HAND, policy, 2.0, 10.0, 11.0)
    assert slow["short_per_s"] > 4.0  # the start rate was served
    assert s["window_output_tokens_per_s"] >= 0.9 * s["offered_output_tokens_per_s"]
    assert slow["output_tokens_per_s"] >= s["window_output_tokens_per_s"]
    # A start far above capacity is saturated at once.
    assert V.simulated_capacity(V.QUICK, policy, HAND, 2.0, 0.0, 10.0, 500.0)["short_per_s"] \
        == 500.0
