"""The SIMULATED iServe cluster (``benchmark/iserve/sim.py``), without servers: service times are
L2's, every request finishes once with all its tokens, the simulation is deterministic, a single
replica matches hand-computed token times, more replicas never lower SLO attainment, and each
system deploys the configuration it claims (iServe: the deploy tool's own ``select``)."""

from __future__ import annotations

import json

import pytest

from benchmark.iserve import sim
from benchmark.replay.metrics import Slo
from benchmark.replay.trace import read_trace
from sglang_morph.iserve import intents, placement, space
from sglang_morph.repo_data import TRACES_DIR
from test_iserve import EMBEDDING, fingerprint_records

GIB = 2**30
W16 = space.Configuration(16, 1, 1)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory, default_model_path):
    """The synthetic fingerprints of test_iserve (known M2/L2 coefficients) as a profile."""
    path = tmp_path_factory.mktemp("iserve_sim") / "profile.json"
    path.write_text(json.dumps({
        "model_dir": str(default_model_path), "engines_dir": "/e", "num_layers": 30,
        "embedding_bytes": EMBEDDING, "records": fingerprint_records(),
        "workload": {"prompt_tokens": 128, "kv_tokens": 4096}}))
    return str(path)


def setting(profile_path, devices=sim.CLUSTERS["uniform"], slo=Slo(3.0, 0.2), **kw):
    return sim.load_setting(profile_path, devices, max_running=4, output_tokens=32, slo=slo,
                            **kw)


def hand_service(ttft=(1.0, 1.5, 2.0, 2.5), tpot=(0.1, 0.12, 0.14, 0.16)):
    return sim.ServiceTimes(W16, 128, ttft, tpot)


def tokens(finished):
    return {r.rid: [round(t, 9) for t in r.token_times_s] for r in finished}


# ---- service times ------------------------------------------------------------------------


def test_service_times_are_the_l2_estimates_at_each_batch(profile_path):
    s = setting(profile_path)
    for name in ("W16-TP1-PP1", "W8-TP1-PP2", "W16-TP3-PP3"):
        cfg = space.Configuration.parse(name)
        service = s.service(cfg, 4 * 512)
        for b in range(1, 5):
            ttft, tpot = s.profile.estimates.latency_of(cfg, b)
            assert service.prefill_s(128 * b) == pytest.approx(ttft, rel=1e-12)
            assert service.decode_s(b) == pytest.approx(tpot, rel=1e-12)
        # Linear in tokens between batch sizes; a shorter prompt costs the profiled one.
        assert service.prefill_s(192) == pytest.approx(
            (service.prefill_s(128) + service.prefill_s(256)) / 2)
        assert service.prefill_s(40) == service.prefill_s(128)
    with pytest.raises(ValueError, match="non-positive"):
        sim.ServiceTimes(W16, 128, (0.5, 0.0), (0.1, 0.1)).check_integrity()


# ---- the simulation -----------------------------------------------------------------------


def test_single_replica_matches_hand_computed_token_times():
    service = hand_service()
    R = sim.Request
    # Far apart: TTFT is one 128-token prefill, then a decode step of batch 1 per token.
    done = tokens(sim.simulate([R(0, 0.0, 128, 4), R(1, 100.0, 128, 3)], service, 1, 4096, 4))
    assert done == {0: [1.0, 1.1, 1.2, 1.3], 1: [101.0, 101.1, 101.2]}
    # Together: one prefill of 3 x 128 tokens (L2 at batch 3), then decode steps of batch 3.
    done = tokens(sim.simulate([R(k, 0.0, 128, 3) for k in range(3)], service, 1, 4096, 4))
    assert all(t == [2.0, 2.14, 2.28] for t in done.values())
    # One running request at a time (by --max-running-requests, or by the KV pool): queued.
    for max_running, kv in ((1, 4096), (4, 100)):
        done = tokens(sim.simulate([R(0, 0.0, 64, 3), R(1, 0.0, 64, 2)], service, 1, kv,
                                   max_running))
        assert done == {0: [1.0, 1.1, 1.2], 1: [2.2, 2.3]}
    # A prefill stops the running decode (as SGLang's scheduler), both decode at batch 2 until
    # request 1 is done, then request 0 alone at batch 1.
    done = tokens(sim.simulate([R(0, 0.0, 128, 5), R(1, 1.05, 128, 3)], service, 1, 4096, 4))
    assert done == {0: [1.0, 1.1, 2.22, 2.34, 2.44], 1: [2.1, 2.22, 2.34]}


def test_stats_and_slo_of_a_closed_form_case():
    finished = sim.simulate([sim.Request(k, 0.0, 128, 3) for k in range(3)], hand_service(), 1,
                            4096, 4)
    stats = sim.latency_stats(finished, Slo(2.0, 0.1401))
    assert stats["p50_ttft_s"] == pytest.approx(2.0) and stats["p99_ttft_s"] == pytest.approx(2.0)
    assert stats["p50_tpot_s"] == pytest.approx(0.14) and stats["slo_attainment"] == 1.0
    assert sim.latency_stats(finished, Slo(1.99, 0.1401))["slo_attainment"] == 0.0
    assert sim.latency_stats(finished, Slo(2.0, 0.1399))["slo_attainment"] == 0.0


@pytest.fixture(scope="module")
def conv():
    history, evaluated = sim.trace_windows(sim.TRACES["azure_conv"], 150, 0.25)
    return history, evaluated


def test_every_request_finishes_once_with_all_its_tokens_and_runs_are_deterministic(conv):
    _, evaluated = conv
    reqs = evaluated.at_rate(2.0)
    service = hand_service(tuple(0.3 + 0.1 * b for b in range(16)),
                           tuple(0.02 + 0.005 * b for b in range(16)))
    first = sim.simulate(reqs, service, 3, 4096, 4)
    assert sorted(r.rid for r in first) == sorted(r.rid for r in reqs)
    by_rid = {r.rid: r for r in reqs}
    for r in first:
        assert len(r.token_times_s) == by_rid[r.rid].output_tokens
        assert r.token_times_s[0] > r.arrival_s == by_rid[r.rid].arrival_s
        assert r.token_times_s == sorted(r.token_times_s)
    assert all(not r.token_times_s for r in reqs)  # the inputs are not touched
    assert tokens(sim.simulate(reqs, service, 3, 4096, 4)) == tokens(first)
    with pytest.raises(ValueError, match="never fit"):
        sim.simulate([sim.Request(0, 0.0, 4000, 200)], service, 1, 4096, 4)


def test_more_replicas_never_lower_attainment(conv):
    _, evaluated = conv
    reqs = evaluated.at_rate(1.5)
    service = hand_service(tuple(0.3 + 0.1 * b for b in range(16)),
                           tuple(0.02 + 0.005 * b for b in range(16)))
    slo = Slo(1.5, 0.05)
    got = [sim.latency_stats(sim.simulate(reqs, service, n, 4096, 4), slo)["slo_attainment"]
           for n in range(1, 7)]
    assert got == sorted(got) and got[0] < 0.5 < got[-1], got


def test_workload_rates_keep_the_trace_shape(conv):
    history, evaluated = conv
    assert len(history.requests) == len(evaluated.requests) == 150
    # Consecutive windows of the trace: the history, then the evaluated requests.
    trace = read_trace(TRACES_DIR / sim.TRACES["azure_conv"])
    assert [r.output_tokens for r in history.requests + evaluated.requests] == \
        [min(256, max(4, n)) for n in trace.output_tokens[:300]]
    assert evaluated.requests[0].arrival_s == 0.0
    at = evaluated.at_rate(0.5)
    span = at[-1].arrival_s - at[0].arrival_s
    assert (len(at) - 1) / span == pytest.approx(0.5)
    ratio = at[10].arrival_s / evaluated.requests[10].arrival_s
    assert at[100].arrival_s / evaluated.requests[100].arrival_s == pytest.approx(ratio)
    assert all(16 <= r.prompt_tokens <= 512 and 4 <= r.output_tokens <= 256 for r in at)


# ---- the systems --------------------------------------------------------------------------


MIXED = (placement.Device("big", 24 * GIB, 2), placement.Device("mid", 8 * GIB, 2),
         placement.Device("s0", 3 * GIB, 2), placement.Device("s1", 3 * GIB, 2))


def holders(s, name):
    return {d.name for d in s.devices if d.memory_bytes >= s.rows[name].memory_bytes}


def test_baselines_choose_the_configurations_they_claim(profile_path, conv):
    s = setting(profile_path, MIXED)
    tp, pp = sim.max_tp_deployment(s), sim.max_pp_deployment(s)
    assert tp.cfg == space.Configuration(16, 3, 1) and pp.cfg == space.Configuration(16, 1, 3)
    # One replica on every device whose memory holds the configuration's estimated RSS.
    for dep in (tp, pp):
        assert set(dep.devices) == holders(s, dep.cfg.name) and dep.devices
    assert len(holders(s, "W16-TP3-PP3")) < len(holders(s, "W16-TP1-PP1"))
    # AlpaServe-like: the candidate with the best simulated attainment on the history.
    history, _ = conv
    reqs = history.at_rate(1.0)
    alpa, trials = sim.alpaserve_deployment(s, reqs)
    assert {t["config"] for t in trials} == {c.name for c in sim.baseline_candidates(s)}
    assert all(c.bits == 16 for c in sim.baseline_candidates(s))
    best = max(t["slo_attainment"] for t in trials)
    assert [t for t in trials if t["config"] == alpa.cfg.name][0]["slo_attainment"] == best
    again = sim.run_deployment(s, alpa, reqs)
    assert again["slo_attainment"] == best and again["replicas"] == len(alpa.devices)
    # The any-bits reference searches iServe's space within its accuracy limit: no W4.
    _, trials = sim.alpaserve_deployment(s, reqs, "alpaserve-any-bits")
    assert {space.Configuration.parse(t["config"]).bits for t in trials} == {16, 8}


def test_iserve_is_the_deploy_tools_selection(profile_path):
    s = setting(profile_path, MIXED)
    dep, selection = sim.iserve_deployment(s)
    spec = intents.IntentSpec("latency-target", ttft_slo_s=3.0, tpot_slo_s=0.2,
                              max_perplexity=30.0)
    feasible = [c for c, why in intents.rank(list(s.rows.values()), spec) if why is None]
    assert dep.cfg == feasible[0].cfg and dep.note == ""
    assert dep.cfg.bits != 4  # the perplexity limit keeps W4 out
    assert selection["device"] == dep.devices[0]
    assert set(dep.devices) == holders(s, dep.cfg.name)
    assert "--intent latency-target" in selection["command"]
    # No configuration meets an impossible SLO: the fallback is min-latency, said so.
    tight = setting(profile_path, MIXED, slo=Slo(1e-6, 1e-6))
    dep, _ = sim.iserve_deployment(tight)
    best = min(tight.rows.values(), key=lambda c: (c.e2e_s, c.cost("memory-x-latency"))).cfg
    assert "fell back to min-latency" in dep.note and dep.cfg == best


def test_a_configuration_no_device_holds_serves_nothing(profile_path, conv):
    s = setting(profile_path, (placement.Device("tiny", 10**6, 2),))
    dep = sim.max_tp_deployment(s)
    assert dep.devices == () and "fits no device" in dep.note
    row = sim.run_deployment(s, dep, conv[1].at_rate(1.0))
    assert row["slo_attainment"] == 0.0 and row["p50_ttft_s"] is None


def test_main_writes_simulated_tables(profile_path, tmp_path):
    out = tmp_path / "out"
    assert sim.main(["--profile", profile_path, "--out", str(out), "--cluster", "mixed",
                     "--trace", "azure_code", "--requests", "60", "--loads", "0.25,1",
                     "--slo-scales", "5", "--no-plot"]) == 0
    result = json.loads((out / "simulated_cluster.json").read_text())
    assert result["meta"]["SIMULATED"] is True and result["meta"]["commit"]
    assert [(r["load"], r["slo_scale"]) for r in result["rows"]] == [(0.25, 5.0), (1.0, 5.0)]
    for r in result["rows"]:
        assert r["SIMULATED"] is True
        assert set(r["systems"]) == set(sim.SYSTEMS)
        assert all(x["requests"] == 60 for x in r["systems"].values())
    table = (out / "simulated_cluster.md").read_text()
    assert "SIMULATED" in table.splitlines()[0] and table.count("| mixed | azure_code |") == 2 + 2 * len(sim.SYSTEMS)
    # An SLO in seconds replaces the scales; iServe's latency target is that SLO.
    assert sim.main(["--profile", profile_path, "--out", str(out), "--cluster", "uniform",
                     "--trace", "azure_code", "--requests", "30", "--loads", "0.5",
                     "--ttft-slo-s", "3", "--tpot-slo-s", "0.2", "--no-plot"]) == 0
    (row,) = json.loads((out / "simulated_cluster.json").read_text())["rows"]
    assert row["slo_scale"] is None and row["slo"] == {"ttft_s": 3.0, "tpot_s": 0.2}
    assert "--ttft-slo-s 3.0 --tpot-slo-s 0.2" in row["iserve_selection"]["command"]
    for bad in (["--loads", "0,1"], ["--slo-scales", "x"]):
        with pytest.raises(SystemExit):
            sim.main(["--profile", profile_path, *bad])
