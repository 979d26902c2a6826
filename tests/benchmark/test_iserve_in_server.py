"""benchmark/iserve/in_server.py and ``profile --in-server``'s plan, without servers: the truth
is the mean over rounds of each round's fastest repetition; a profile generated from an exact
linear model scores 0% against a truth generated from the same model; the launches group every
bit-width and depth of a layout into one server."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmark.iserve import in_server
from sglang_morph.iserve import space
from sglang_morph.iserve.__main__ import fingerprint_runs, in_server_launches
from sglang_morph.models import default_model_path


def _full(config, ttft_reps, tpot_reps, rss, cpu_s=50.0):
    cfg = space.Configuration.parse(config)
    return {"kind": "full", "config": config, "bits": cfg.bits, "tp": cfg.tp, "pp": cfg.pp,
            "num_layers": 30, "cpu_s": cpu_s,
            "processes": [{"pp_rank": 0, "tp_rank": 0, "rss_hwm_bytes": rss,
                           "weight_bytes": None}],
            "latency": [{"batch": 1, "output_tokens": 64, "e2e_s": [1.0, 1.1],
                         "ttft_s": ttft_reps, "tpot_s": tpot_reps}]}


def test_truth_is_the_mean_of_each_rounds_fastest_repetition():
    rounds = [{"records": [_full("W16-TP1-PP1", [0.12, 0.10], [0.030, 0.031], 100),
                           _full("W8-TP1-PP1", [0.2], [0.02], 50)]},
              {"records": [_full("W16-TP1-PP1", [0.14, 0.13], [0.034, 0.033], 110)]},
              {"records": [_full("W16-TP1-PP1", [0.16, 0.19], [0.036, 0.035], 120)]}]
    records, spread = in_server.truth_records(rounds)
    assert [r["config"] for r in records] == ["W16-TP1-PP1"]  # W8 is not in every round
    (point,) = records[0]["latency"]
    assert point["ttft_s"] == [pytest.approx(statistics.mean([0.10, 0.13, 0.16]))]
    assert point["tpot_s"] == [pytest.approx(statistics.mean([0.030, 0.033, 0.035]))]
    assert records[0]["processes"][0]["rss_hwm_bytes"] == pytest.approx(110)
    assert records[0]["processes"][0]["weight_bytes"] is None
    (s,) = spread
    assert s["ttft_s"] == [0.10, 0.13, 0.16]
    assert s["ttft_cv"] == pytest.approx(statistics.stdev([0.10, 0.13, 0.16]) / 0.13)


def _line(bits, layers, batch, phase):
    # an exact model per bit-width: T = f0 + f1 B + L (g0 + g1 B)
    f0, f1, g0, g1 = {"ttft": (0.05, 0.02, 0.004, 0.003), "tpot": (0.004, 0.001, 0.0008,
                                                                   0.0002)}[phase]
    scale = {16: 1.0, 8: 0.8, 4: 0.7}[bits]
    return scale * (f0 + f1 * batch + layers * (g0 + g1 * batch))


def _points(bits, layers):
    return [{"batch": b, "output_tokens": 64, "e2e_s": [1.0],
             "ttft_s": [_line(bits, layers, b, "ttft")], "tpot_s": [_line(bits, layers, b, "tpot")]}
            for b in (1, 4)]


def _exact_profile_and_truth(tmp_path):
    """A profile of the exact model's fingerprints (``p.json``) and three truth rounds at 0.9,
    1.0 and 1.1 times the exact full configurations' times."""
    workload = {"prompt_tokens": 128, "output_tokens": [64], "batches": [1, 4]}
    fingerprints = [{"kind": "fingerprint", "source": "in-server", "config": f"W{b}-TP1-PP1",
                     "bits": b, "tp": 1, "pp": 1, "num_layers": n, "cpu_s": 10.0,
                     "processes": [], "latency": _points(b, n)}
                    for b in (16, 8) for n in (8, 16)]
    profile = {"model_dir": str(default_model_path()), "num_layers": 30,
               "embedding_bytes": 0, "workload": workload, "records": fingerprints}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    truth_dirs = []
    for i, spread in enumerate((0.9, 1.0, 1.1)):
        records = [{**_full(f"W{b}-TP1-PP1", [], [], 100, cpu_s=60.0 + i),
                    "latency": [{**p, "ttft_s": [p["ttft_s"][0] * spread],
                                 "tpot_s": [p["tpot_s"][0] * spread]} for p in _points(b, 30)]}
                   for b in (16, 8)]
        d = tmp_path / f"round{i}"
        d.mkdir()
        (d / "profile.json").write_text(json.dumps({"workload": workload, "records": records}))
        truth_dirs.append(str(d))
    return profile, workload, truth_dirs


def test_an_exact_model_scores_no_error_and_the_cost_is_both_sides_measured(tmp_path):
    profile, workload, truth_dirs = _exact_profile_and_truth(tmp_path)
    result = in_server.score(str(tmp_path / "p.json"), truth_dirs, None)
    assert result["configs_scored"] == 2
    assert result["mean_error"]["ttft"] == pytest.approx(0, abs=1e-9)
    assert result["mean_error"]["tpot"] == pytest.approx(0, abs=1e-9)
    # against one round alone the error is that round's offset from the mean
    assert result["mean_error_per_round"]["ttft"] == pytest.approx([0.1 / 0.9, 0, 0.1 / 1.1])
    assert result["truth_cv_mean"]["ttft"] == pytest.approx(0.1)
    cost = result["profiling_cpu_s"]
    assert cost["fingerprints_latency"] == 40.0
    assert cost["full_once_per_round"] == [120.0, 122.0, 124.0]
    assert cost["ratio_full_over_fingerprints_latency"] == pytest.approx([3.0, 3.05, 3.1])
    assert "Mean error against the truth's mean: TTFT 0.0%" in in_server.markdown(result)

    fewer = {**profile, "workload": {**workload, "output_tokens": [32], "repetitions": 2}}
    (tmp_path / "f.json").write_text(json.dumps(fewer))
    assert in_server.score(str(tmp_path / "f.json"), truth_dirs, None)["configs_scored"] == 2
    other = {**profile, "workload": {**workload, "batches": [1]}}
    (tmp_path / "q.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="workload"):
        in_server.score(str(tmp_path / "q.json"), truth_dirs, None)


def test_noise_measures_a_slow_windows_drift_and_the_truths_own_floor(tmp_path):
    profile, _, truth_dirs = _exact_profile_and_truth(tmp_path)
    slow = json.loads(json.dumps(profile))
    for r in slow["records"]:  # the same fingerprints measured 10% slower
        for p in r["latency"]:
            p["ttft_s"] = [v * 1.1 for v in p["ttft_s"]]
            p["tpot_s"] = [v * 1.1 for v in p["tpot_s"]]
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    result = in_server.noise([str(tmp_path / "p.json"), str(tmp_path / "slow.json")],
                             str(tmp_path / "p.json"), truth_dirs, None)
    exact, late = result["profiles"]
    assert exact["drift"] == {"ttft": pytest.approx(1.0), "tpot": pytest.approx(1.0)}
    assert exact["mean_error"]["ttft"] == pytest.approx(0, abs=1e-9)
    assert late["shared_points"] == 8  # 2 bit-widths x 2 depths x 2 batches
    assert late["drift"] == {"ttft": pytest.approx(1.1), "tpot": pytest.approx(1.1)}
    assert late["mean_error"]["ttft"] == pytest.approx(0.1)  # a slope and an intercept 10% high
    assert late["signed_mean_error"]["tpot"] == pytest.approx(0.1)
    assert late["mean_error_at_reference_speed"]["ttft"] == pytest.approx(0, abs=1e-9)
    # each round against the other two's mean: 0.9 vs 1.05, 1.0 vs 1.0, 1.1 vs 0.95
    floor = (0.15 / 1.05 + 0 + 0.15 / 0.95) / 3
    assert result["leave_one_out"] == {"ttft": pytest.approx(floor), "tpot": pytest.approx(floor)}
    assert "drift TTFT / TPOT" in in_server.noise_markdown(result)
    with pytest.raises(SystemExit, match="shares no fingerprint point"):
        other = {**profile, "records": [{**r, "tp": 3} for r in profile["records"]]}
        (tmp_path / "tp3.json").write_text(json.dumps(other))
        in_server.noise([str(tmp_path / "tp3.json")], str(tmp_path / "p.json"), truth_dirs, None)


def test_in_server_launches_one_server_per_layout():
    jobs = [(cfg, n, "fingerprint") for cfg, n in fingerprint_runs((16, 8, 4), (1, 3), (8, 16),
                                                                  layout_bits=16)]
    launches = in_server_launches(jobs)
    assert launches == {(1, 1): [(16, [8, 16]), (8, [8, 16]), (4, [8, 16])],
                        (3, 1): [(16, [8, 16])],
                        (1, 2): [(16, [9, 17])]}
    every = in_server_launches([(cfg, n, "fingerprint") for cfg, n in
                                fingerprint_runs((16, 8), (1, 3), (8, 16))])
    assert every[(3, 1)] == [(16, [8, 16]), (8, [8, 16])]
    assert sorted(every) == [(1, 1), (1, 2), (3, 1)]
    with_tp_pp = in_server_launches(jobs, tp_pp=True)
    assert with_tp_pp == {**launches, (3, 2): [(16, [9, 17])]}


def test_repetitions_taken_in_turns_add_up_per_point():
    from sglang_morph.iserve.measure import _extend

    points = [{"batch": 1, "output_tokens": 64, "e2e_s": [1.0], "ttft_s": [0.1],
               "tpot_s": [0.01], "e2e_median_s": 1.0}]
    _extend(points, [{"batch": 1, "output_tokens": 64, "e2e_s": [3.0], "ttft_s": [0.3],
                      "tpot_s": [0.03], "e2e_median_s": 3.0}])
    assert points[0]["ttft_s"] == [0.1, 0.3] and points[0]["e2e_median_s"] == 2.0
    with pytest.raises(AssertionError):
        _extend(points, [{"batch": 4, "output_tokens": 64, "e2e_s": [1.0]}])
