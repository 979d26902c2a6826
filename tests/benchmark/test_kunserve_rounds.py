"""``benchmark.kunserve.rounds`` over hand-built replay reports: merged windows, the requests
they touch, percentiles against numpy's, the per-round comparison and its spread."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmark.kunserve import rounds as KR

T0 = 1_000_000.0


def record(index: int, at_s: float, ttft_s: float, tpot_s: float, e2e_s: float) -> dict:
    return {"index": index, "scheduled_unix_s": T0 + at_s, "sent_unix_s": T0 + at_s,
            "ttft_s": ttft_s, "tpot_s": tpot_s, "e2e_s": e2e_s}


def report(scale: float, windows=((10.0, 0.2, 20.0),)) -> dict:
    """Ten requests, one a second; KunServe's are ``scale`` times DP 2's latencies except
    its worst TTFT, which is a quarter; its merged windows (drop end, drop seconds, restore
    end) in seconds since T0."""
    dp2 = [record(i, i, 0.5 + i / 10, 0.1, 2.0 + i / 5) for i in range(10)]
    dp2[9]["ttft_s"] = 8.0
    ks = [dict(r, ttft_s=r["ttft_s"] * scale, tpot_s=r["tpot_s"] * scale,
               e2e_s=r["e2e_s"] * scale) for r in dp2]
    ks[9]["ttft_s"] = 2.0
    transitions = []
    for drop_at, drop_s, restore_at in windows:
        transitions.append({"replica": 0, "action": "drop", "at_unix_s": T0 + drop_at,
                            "duration_s": drop_s})
        transitions.append({"replica": 1, "action": "drop", "at_unix_s": T0 + drop_at,
                            "duration_s": drop_s})
        if restore_at is not None:
            transitions.append({"replica": 0, "action": "restore",
                                "at_unix_s": T0 + restore_at, "duration_s": 0.3})
    return {"settings": {"git": {"commit": "abc"}}, "dp2": {"configs": {
        "dp2": {"records": dp2},
        "kunserve": {"records": ks, "kunserve_transitions": transitions,
                     "end_unix_s": T0 + 60, "quality": {"exact_match_rate": 1.0}}}}}


def test_merged_windows_and_the_requests_they_touch():
    arm = report(1.0, windows=((10.0, 0.5, 12.0), (30.0, 0.2, None)))["dp2"]["configs"][
        "kunserve"]
    assert KR.merged_windows(arm) == [(T0 + 9.5, T0 + 12.0), (T0 + 29.8, float("inf"))]
    # Request i lives [i, i + 2 + i/5]: 6 (to 9.2) does not reach 9.5; 7 (to 10.4) does.
    assert KR.overlapping(arm, KR.merged_windows(arm)) == {7, 8, 9}


def test_merged_windows_of_two_pairs_are_each_pairs_own():
    arm = report(1.0, windows=((10.0, 0.5, 12.0),))["dp2"]["configs"]["kunserve"]
    # Pair [2, 3] drops while pair [0, 1] is merged and restores after it: its own window.
    arm["kunserve_transitions"] += [
        {"replica": r, "action": action, "at_unix_s": T0 + at, "duration_s": 0.4}
        for r, action, at in ((2, "drop", 11.0), (3, "drop", 11.0), (2, "restore", 15.0),
                              (3, "restore", 15.0))]
    assert KR.merged_windows(arm) == [(T0 + 9.5, T0 + 12.0), (T0 + 10.6, T0 + 15.0)]


def test_the_clients_loop_stalls_are_summed_with_their_runqueue_time():
    arm = {"records": [], "client_stalls": [
        {"t": T0, "late_s": 2.0, "on_cpu_s": 0.1, "runqueue_s": 1.5},
        {"t": T0 + 5, "late_s": 0.5, "on_cpu_s": 0.0, "runqueue_s": 0.5}]}
    assert KR.loop_stalls(arm) == {"stalls": 2, "stall_max_s": 2.0, "stall_total_s": 2.5,
                                   "stall_runqueue_s": 2.0}
    assert KR.loop_stalls({"records": []}) == {}  # a replay that did not watch its loop


def test_one_round_against_numpy_and_the_comparison():
    r = KR.one_round(report(1.5))
    # KunServe's lives overlapping [9.8, 20.0] (request 6 lives to 6 + 1.5 * 3.2 = 10.8 there,
    # to 9.2 on DP 2): the same requests count in both arms.
    touched = [6, 7, 8, 9]
    dp2 = report(1.5)["dp2"]["configs"]["dp2"]["records"]
    assert r["arms"]["dp2"]["merged"]["requests"] == 4
    assert r["arms"]["dp2"]["merged"]["e2e_s_p95"] == pytest.approx(
        np.percentile([dp2[i]["e2e_s"] for i in touched], 95))
    assert r["arms"]["dp2"]["all"]["ttft_s_p99"] == pytest.approx(
        np.percentile([x["ttft_s"] for x in dp2], 99))
    ks_all = r["arms"]["kunserve"]["all"]
    vs = r["vs_dp2"]
    assert vs["p99_ttft_ratio"] == pytest.approx(
        r["arms"]["dp2"]["all"]["ttft_s_p99"] / ks_all["ttft_s_p99"])
    assert vs["p50_tpot_change"] == pytest.approx(0.5)
    assert vs["e2e_p95_change"] == pytest.approx(0.5)
    assert vs["exact_match"] == 1.0
    assert r["merged_windows_s"] == [10.2]
    assert r["client"]["dp2"] == {"max_s": 0.0, "late_sends": 0,
                                  "ttft_s_p99_from_send": r["arms"]["dp2"]["all"]["ttft_s_p99"]}


def test_the_clients_late_sends_and_the_p99_counted_from_the_send():
    rep = report(1.5)
    slow = rep["dp2"]["configs"]["dp2"]["records"][9]
    slow["sent_unix_s"] += 5.0  # the client sent DP 2's worst request 5 s after its time
    r = KR.one_round(rep)
    dp2 = rep["dp2"]["configs"]["dp2"]["records"]
    from_send = [x["ttft_s"] - (x["sent_unix_s"] - x["scheduled_unix_s"]) for x in dp2]
    assert r["client"]["dp2"]["late_sends"] == 1 and r["client"]["dp2"]["max_s"] == 5.0
    assert r["client"]["dp2"]["ttft_s_p99_from_send"] == pytest.approx(
        np.percentile(from_send, 99))
    assert r["vs_dp2"]["p99_ttft_ratio_from_send"] == pytest.approx(
        np.percentile(from_send, 99) / r["arms"]["kunserve"]["all"]["ttft_s_p99"])
    assert r["vs_dp2"]["p99_ttft_ratio_from_send"] < r["vs_dp2"]["p99_ttft_ratio"]


def test_the_spread_over_rounds_and_the_files(tmp_path):
    dirs = []
    for k, scale in enumerate((1.1, 1.5, 1.3)):
        d = tmp_path / f"r{k}"
        d.mkdir()
        r = report(scale)
        # Each arm's own forwards as the replay summarized them; the first round has none
        if k:
            for arm, decode_s in (("dp2", 0.05 * k), ("kunserve", 0.06 * k)):
                r["dp2"]["configs"][arm]["forwards"] = {
                    "phases": {"decode": {"median_seconds": decode_s},
                               "prefill": {"median_seconds": 0.6}},
                    "step_gap_s": {"median": 0.002}}
        (d / "replay_dp2.json").write_text(json.dumps(r))
        dirs.append(str(d))
    assert KR.main([*dirs, "--out", str(tmp_path / "out"), "--point", "test point"]) == 0
    out = json.loads((tmp_path / "out" / "rounds.json").read_text())
    tpot = out["aggregate"]["vs_dp2"]["p50_tpot_change"]
    assert (tpot["median"], tpot["min"], tpot["max"], tpot["n"]) == pytest.approx(
        (0.3, 0.1, 0.5, 3))
    md = (tmp_path / "out" / "rounds.md").read_text()
    assert "3 replay rounds (test point)" in md and "| kunserve (merged) |" in md
    assert "P50 TPOT change: +0.300 (+0.100 to +0.500)" in md
    assert "per round, DP 2 / KunServe: 0 / 0, 0 / 0, 0 / 0 requests, at most 0.00 s" in md
    assert (tmp_path / "out" / "rounds_cdf.png").stat().st_size > 0
    # The forwards' spread over the rounds that have them
    assert "| dp2 | 0.0750 (0.0500 to 0.1000) | 0.6000 (0.6000 to 0.6000) | 0.0020 (0.0020 " \
           "to 0.0020) |" in md
    assert out["aggregate"]["forwards"]["kunserve"]["decode_s_p50"]["n"] == 2
    # The plot pools the rounds: 3 x 10 requests; a merged window touches requests 7-9 at
    # scale 1.1 and 6-9 at 1.5 and 1.3 (request 6 then lives past 9.8 s).
    reports = [json.loads((tmp_path / f"r{k}" / "replay_dp2.json").read_text()) for k in range(3)]
    assert len(KR.pooled(reports, "dp2", "ttft_s", merged=False)) == 30
    touched = KR.pooled(reports, "kunserve", "e2e_s", merged=True)
    assert len(touched) == 11 and min(touched) == pytest.approx((2.0 + 7 / 5) * 1.1)


def test_a_round_without_both_arms_is_a_cli_error(tmp_path, capsys):
    bad = report(1.0)
    del bad["dp2"]["configs"]["kunserve"]["records"]
    (tmp_path / "replay_dp2.json").write_text(json.dumps(bad))
    with pytest.raises(SystemExit) as e:
        KR.main([str(tmp_path), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "no completed arm ['kunserve']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        KR.main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
