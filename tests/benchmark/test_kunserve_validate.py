"""The KunServe simulation's check against a live replay (``benchmark/kunserve/validate.py``),
on a replay the simulator itself produced with known step and transition costs: configured
from the replay's files, the simulation must find exactly those latencies again (zero error
with the replay's calibration, for the plain pair and for KunServe's drops and restores), and
another calibration must not."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmark.kunserve import sim as KS
from benchmark.kunserve import validate as V
from sglang_morph.kunserve.controller import ControllerConfig
from sglang_morph.kunserve.cost import Chunk, ChunkCostModel, PhaseCosts
from sglang_morph.models import default_model_path
from sglang_morph.models.spec import ModelSpec

START_UNIX_S = 1_800_000_000.0
KV_TOKENS = 910
COSTS = PhaseCosts(ChunkCostModel(alpha_s=4e-7, beta_s=1.2e-3, gamma_s=0.09),
                   ChunkCostModel(alpha_s=1.3e-5, beta_s=5e-3, gamma_s=0.06), "made up")
GAP_S = 0.002
DROP_S, RESTORE_S = 0.5, 0.8


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_model_dir(default_model_path(), dtype_bytes=V.DTYPE_BYTES)


def workload() -> list[KS.Request]:
    """A calm start, a burst more than two 910-token pools hold, then a trickle again (the
    pair restores in it)."""
    rng = np.random.default_rng(7)
    calm = [KS.Request(str(i), 1.5 * i, int(rng.integers(32, 200)), 32) for i in range(6)]
    burst = [KS.Request(str(6 + i), 10.0 + 0.1 * i, int(rng.integers(250, 384)), 48)
             for i in range(14)]
    trickle = [KS.Request(str(20 + i), 40.0 + 4 * i, 64, 16) for i in range(8)]
    return calm + burst + trickle


def records_of(finished: list[KS.Request]) -> list[dict]:
    return [{"index": int(r.rid), "scheduled_unix_s": START_UNIX_S + r.arrival_s,
             "queue_time_s": 0.0,
             "prompt_tokens": r.prompt_tokens, "max_new_tokens": r.output_tokens,
             "ttft_s": r.token_times_s[0] - r.arrival_s,
             "tpot_s": (r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1),
             "e2e_s": r.token_times_s[-1] - r.arrival_s} for r in finished]


SERVER_ARGS = {"dp2": ["--dp-size", "2"], "kunserve": ["--dp-size", "2", "--enable-kunserve"]}


def write_round(path, spec, with_forwards=True, merged=None):
    """The replay a pair with ``COSTS`` (+ ``GAP_S`` a forward) and KunServe's transitions of
    ``DROP_S`` / ``RESTORE_S`` would have recorded, plain DP 2 with SGLang's overlap scheduler
    (its default) and KunServe without; ``merged``: (decode, prefill), the merged pair's
    forwards over a whole replica's, in its steps and in the replay's summary of its forward
    log."""
    planner = V.planner_for(spec, KV_TOKENS)
    idle = KS.Calibration.load(KS.RESULTS, spec)
    costs = PhaseCosts(*(dataclasses.replace(m, gamma_s=m.gamma_s + GAP_S)
                         for m in (COSTS.prefill, COSTS.decode)))
    cal = dataclasses.replace(idle, costs=costs, drop_s=DROP_S, restore_s=RESTORE_S)
    if merged is not None:
        cal = dataclasses.replace(cal, merged_step_factor=merged[0],
                                  merged_prefill_factor=merged[1])
    arms = {}
    for arm in V.ARMS:
        s = KS.simulate(workload(), 2, planner, cal, arm == "kunserve",
                        monitor_s=V.DEFAULT_INTERVAL_S, controller_cfg=ControllerConfig(),
                        overlap_schedule=arm == "dp2")
        arms[arm] = {"records": records_of(s.finished), "start_unix_s": START_UNIX_S,
                     "status_samples": [], "server_args": SERVER_ARGS[arm],
                     "kunserve_transitions": [
                         # what a live pair records: the transition's own time, not the
                         # wait for the batch in flight that the simulation counts in, and
                         # when it ended
                         {"replica": 0, "action": t["kind"],
                          "duration_s": DROP_S if t["kind"] == "drop" else RESTORE_S,
                          "at_unix_s": START_UNIX_S + t["at_s"] + t["seconds"]}
                         for t in s.transitions]}
    if with_forwards:
        arms["dp2"]["forwards"] = {"fit": COSTS.to_json(), "step_gap_s": {"median": GAP_S,
                                                                          "count": 100},
                                   "phases": {p: {"forwards": 10, "mean_error": 0.0}
                                              for p in ("prefill", "decode")}}
    if merged is not None:
        arms["kunserve"]["forwards"] = {f"merged_{phase}_ratio": {"median": m, "forwards": 9}
                                        for phase, m in zip(("decode", "prefill"), merged)}
    report = {"settings": {"kunserve_auto_config": None, "git": {"commit": "abc1234"}},
              "dp2": {"kv_capacity_tokens_per_replica": KV_TOKENS, "configs": arms}}
    path.mkdir(parents=True, exist_ok=True)
    (path / "replay_dp2.json").write_text(json.dumps(report))
    return arms


def test_the_replays_own_costs_find_its_latencies_again(tmp_path, spec):
    arms = write_round(tmp_path / "r1", spec)
    kinds = [t["action"] for t in arms["kunserve"]["kunserve_transitions"]]
    assert kinds[:2] == ["drop", "restore"], "the burst should make the pair drop"
    rnd = V.load_round(tmp_path / "r1")
    assert (rnd.drops_s, rnd.kv_tokens_per_replica, rnd.interval_s) == ((DROP_S,), 910, 0.25)
    got = V.validate([rnd], spec)["calibrations"]
    # Transitions modelled from the link: the plain pair is found exactly, KunServe is not.
    assert all(got["replay"]["error"]["dp2"][k] == pytest.approx(0.0, abs=1e-6)
               for k in V.SHOWN)
    assert any(abs(e) > 1e-3 for e in got["replay"]["error"]["kunserve"].values())
    exact = got["replay+transitions"]
    assert all(exact["error"][arm][k] == pytest.approx(0.0, abs=1e-6)
               for arm in V.ARMS for k in V.SHOWN)
    assert exact["within_tolerance"]
    # The idle machine's costs are another machine's: the check must notice.
    assert not got["idle"]["within_tolerance"]
    assert max(abs(e) for e in got["idle"]["error"]["dp2"].values()) > V.TOLERANCE
    # No merged forwards were logged: the rows that need them say so instead of guessing.
    left_out = V.validate([rnd], spec)["left_out"]
    assert set(left_out) == {"replay+transitions+merged prefill", V.PER_REPLICA_PREFILL}
    assert all("merged prefill ratio" in why for why in left_out.values())


def test_the_merged_prefill_the_replay_logged_is_found_again(tmp_path, spec):
    """A pair whose merged prefills took 1.6x a whole replica's (as one batch, not pipelined)
    and its merged decode steps 1.3x: only the row that takes both finds it exactly."""
    write_round(tmp_path / "r1", spec, merged=(1.3, 1.6))
    rnd = V.load_round(tmp_path / "r1")
    assert (rnd.merged_decode_ratio, rnd.merged_prefill_ratio) == (1.3, 1.6)
    got = V.validate([rnd], spec)
    assert got["left_out"] == {}
    rows = got["calibrations"]
    exact = rows["replay+transitions+merged prefill"]
    assert all(exact["error"][arm][k] == pytest.approx(0.0, abs=1e-6)
               for arm in V.ARMS for k in V.SHOWN)
    # Pipelined merged prefills reach the first token sooner than this pair did.
    decode_only = rows["replay+transitions+merged"]["error"]["kunserve"]
    assert decode_only["ttft_s_p99"] < -1e-3


def test_a_replay_without_forward_timings_is_refused(tmp_path, spec):
    write_round(tmp_path / "old", spec, with_forwards=False)
    with pytest.raises(ValueError, match="no fitted forwards"):
        V.load_round(tmp_path / "old")


def test_the_levers_start_from_the_checked_simulation(tmp_path, spec):
    from benchmark.kunserve import levers as L

    write_round(tmp_path / "r1", spec)
    rnd = V.load_round(tmp_path / "r1")
    checked = V.validate([rnd], spec)["calibrations"][V.VALIDATED_ROW]["simulated"]
    want = L.against_dp2({k: v["median"] for k, v in checked["dp2"].items()},
                    {k: v["median"] for k, v in checked["kunserve"].items()})
    got = L.run_lever(L.LEVERS[0], [rnd], spec)["rounds"][0]
    assert got == pytest.approx(want)
    # The replay's drop costs 0.5 s: free transitions serve the burst's worst request sooner.
    free = L.run_lever(L.Lever("free", costs={"drop_s": 0.0, "restore_s": 0.0}), [rnd], spec)
    assert free["rounds"][0]["p99_ttft_ratio"] > got["p99_ttft_ratio"]


def test_the_plain_arms_overlap_scheduler_is_what_the_check_finds(tmp_path, spec):
    """The replay's plain pair handed each token on after the next forward (SGLang's overlap
    scheduler); simulated without it, the same costs give every request its first token a
    decode step sooner, which the check must see as an error."""
    write_round(tmp_path / "r1", spec)
    rnd = V.load_round(tmp_path / "r1")
    assert rnd.overlap_schedule == {"dp2": True, "kunserve": False}
    cal = V.calibration("replay+transitions", rnd, spec, [rnd])
    planner = V.planner_for(spec, KV_TOKENS)
    found, _ = V.simulated(rnd, cal, planner, False)
    assert found["ttft_s_p50"] == pytest.approx(rnd.live["dp2"]["ttft_s_p50"], abs=1e-6)
    without = dataclasses.replace(rnd, overlap_schedule={})
    sooner, _ = V.simulated(without, cal, planner, False)
    assert sooner["ttft_s_p50"] < found["ttft_s_p50"] - 0.5 * COSTS.decode.gamma_s


def write_log(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_merged_decode_factor_is_taken_against_the_simulations_own_costs(tmp_path, spec):
    """With forward logs, the merged decode factor is the KunServe arm's merged decode
    forwards over the simulation's cost model (the plain arm's fit and its error per batch
    size), not over any other fit: forwards logged at exactly 0.8x it give 0.8."""
    arms = write_round(tmp_path / "r1", spec)
    window = [t["at_unix_s"] for t in arms["kunserve"]["kunserve_transitions"][:2]]
    decode_at = [(b, [40 + 7 * i for i in range(b)]) for b in (1, 2, 3, 5, 9, 12) * 3]
    err = {1: 0.01, 2: -0.004}  # the plain arm's fit misses these batch sizes by this much
    dp2_rows = [{"mode": "decode", "cached": cached, "new": [1] * b, "pid": 1,
                 "t": START_UNIX_S + 1.0,
                 "seconds": COSTS.seconds([Chunk(p, 1) for p in cached]) + err.get(b, 0.0)}
                for b, cached in decode_at for _ in range(8)]
    from benchmark.kunserve.sim import BatchCorrectedCosts

    corrected = BatchCorrectedCosts(COSTS.prefill, COSTS.decode, "", (0.01, -0.004))
    merged_rows = [{"mode": "decode", "cached": cached, "new": [1] * b, "pid": 2,
                    "t": window[0] + 0.5,
                    "seconds": 0.8 * corrected.seconds([Chunk(p, 1) for p in cached])}
                   for b, cached in decode_at]
    write_log(tmp_path / "r1" / "raw" / "dp2_forwards.jsonl", dp2_rows)
    write_log(tmp_path / "r1" / "raw" / "kunserve_forwards.jsonl", merged_rows)
    report = json.loads((tmp_path / "r1" / "replay_dp2.json").read_text())
    report["dp2"]["configs"]["dp2"]["forwards"]["log"] = "raw/dp2_forwards.jsonl"
    report["dp2"]["configs"]["kunserve"]["forwards"] = {"log": "raw/kunserve_forwards.jsonl"}
    (tmp_path / "r1" / "replay_dp2.json").write_text(json.dumps(report))
    rnd = V.load_round(tmp_path / "r1")
    assert len(rnd.dp2_timings) == len(dp2_rows)
    assert len(rnd.merged_decode_timings) == len(merged_rows)
    assert V.forward_costs(rnd).decode_error_s[:2] == pytest.approx((0.01, -0.004))
    assert V.merged_decode_ratio(rnd) == pytest.approx(0.8)
    cal = V.calibration("replay+transitions+merged", rnd, spec, [rnd])
    assert cal.merged_step_factor == pytest.approx(0.8)


def test_the_controller_is_simulated_as_the_live_leader_ran_it(tmp_path, spec):
    """A replay without --kunserve-auto-config ran the defaults of its own code: the
    simulation takes what the arm's leader reported, not this code's defaults."""
    from sglang_morph.kunserve.controller import ControllerConfig

    write_round(tmp_path / "r1", spec)
    path = tmp_path / "r1" / "replay_dp2.json"
    report = json.loads(path.read_text())
    ran = {"interval_ms": 200.0, "drop_persist": 2, "restore_usage": 0.5,
           "restore_headroom": 0.8, "restore_persist": 3, "min_dwell_s": 5.0,
           "partial_drop": True, "finishing_steps": ControllerConfig().finishing_steps + 5}
    report["dp2"]["configs"]["kunserve"]["kunserve_auto"] = [
        {"role": "follower", "config": {**ran, "finishing_steps": 0}},
        {"role": "leader", "config": ran}]
    path.write_text(json.dumps(report))
    rnd = V.load_round(tmp_path / "r1")
    assert rnd.controller.finishing_steps == ran["finishing_steps"]
    assert rnd.interval_s == pytest.approx(0.2)
    del report["dp2"]["configs"]["kunserve"]["kunserve_auto"]
    path.write_text(json.dumps(report))
    assert V.load_round(tmp_path / "r1").controller == ControllerConfig()
