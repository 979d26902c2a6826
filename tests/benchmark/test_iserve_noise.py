"""benchmark/iserve/noise.py without servers: the launch spread of given measurements, and the
Monte Carlo floor of L2's error (no noise: no error; noise on the references only: the error
an exact estimate has against one noisy launch, computed independently)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from benchmark.iserve import noise as iserve_noise

PROFILE = Path(__file__).resolve().parents[2] / "benchmark/results/iserve/grid_19605d6/profile.json"


def _record(kind, ttft_reps, tpot_reps):
    return {"kind": kind, "latency": [{"batch": 1, "output_tokens": 64, "ttft_s": ttft_reps,
                                       "tpot_s": tpot_reps}]}


def test_spread_scores_the_fastest_repetition_of_each_launch():
    launches = [_record("full", [0.12, 0.10, 0.11], [0.030, 0.031, 0.029]),
                _record("full", [0.13, 0.14, 0.13], [0.033, 0.033, 0.034]),
                _record("full", [0.10, 0.11, 0.12], [0.027, 0.028, 0.028])]
    rows = {(r["phase"]): r for r in iserve_noise.spread({"W16-TP1-PP1": launches})}
    ttft = rows["ttft"]
    assert ttft["values_s"] == [0.10, 0.13, 0.10]
    mean = statistics.mean([0.10, 0.13, 0.10])
    assert ttft["cv"] == pytest.approx(statistics.stdev([0.10, 0.13, 0.10]) / mean)
    assert ttft["mean_abs_dev"] == pytest.approx(
        statistics.mean(abs(v - mean) for v in [0.10, 0.13, 0.10]) / mean)
    assert ttft["range"] == pytest.approx(0.03 / mean)
    within = statistics.mean(statistics.pstdev(r) / statistics.mean(r) for r in
                             ([0.12, 0.10, 0.11], [0.13, 0.14, 0.13], [0.10, 0.11, 0.12]))
    assert ttft["within_launch_cv"] == pytest.approx(within)
    assert rows["tpot"]["values_s"] == [0.029, 0.033, 0.027]


def test_launch_cv_pools_runs_of_a_kind_as_root_mean_square():
    noise = {"spread": [{"kind": "full", "phase": "tpot", "cv": 0.06},
                        {"kind": "full", "phase": "tpot", "cv": 0.08},
                        {"kind": "fingerprint", "phase": "tpot", "cv": 0.05}]}
    cv = iserve_noise.launch_cv(noise)
    assert cv[("full", "tpot")] == pytest.approx(np.sqrt((0.06 ** 2 + 0.08 ** 2) / 2))
    assert cv[("fingerprint", "tpot")] == pytest.approx(0.05)


def test_parse_run():
    cfg, layers, kind = iserve_noise.parse_run("W8-TP1-PP2@9", 30)
    assert (cfg.bits, cfg.tp, cfg.pp, layers, kind) == (8, 1, 2, 9, "fingerprint")
    assert iserve_noise.parse_run("W16-TP3-PP1", 30)[1:] == (30, "full")
    for bad in ("W16-TP1", "W16-TP1-PP1@0", "W16-TP1-PP1@31", "W16-TP1-PP1@x"):
        with pytest.raises(SystemExit, match="error: run"):
            iserve_noise.parse_run(bad, 30)


@pytest.fixture(scope="module")
def profile():
    return json.loads(PROFILE.read_text())


def test_without_noise_the_refit_is_the_truth(profile):
    zero = {"ttft": 0.0, "tpot": 0.0}
    errors = iserve_noise.mean_errors(profile, zero, zero, 2, np.random.default_rng(0))
    assert max(max(errors["ttft"]), max(errors["tpot"])) < 1e-9
    # Exact estimates against exact measurements: every intent picks the measured best.
    assert errors["intents_within"] == errors["intents"] and min(errors["intents"]) > 0


def test_noisy_references_cost_an_exact_estimate_what_the_noise_predicts(profile):
    # An exact estimate e against a measurement e (1 + c z) is off by |1 - 1 / (1 + c z)|;
    # its expectation, by quadrature over z ~ N(0, 1), independently of the Monte Carlo.
    c = 0.06
    z = np.linspace(-6, 6, 20001)
    density = np.exp(-z ** 2 / 2) / np.sqrt(2 * np.pi)
    expected = float(np.sum(np.abs(1 - 1 / (1 + c * z)) * density) * (z[1] - z[0]))
    errors = iserve_noise.mean_errors(profile, {"ttft": 0.0, "tpot": 0.0},
                                      {"ttft": c, "tpot": c}, 200, np.random.default_rng(1))
    for phase in ("ttft", "tpot"):
        assert statistics.mean(errors[phase]) == pytest.approx(expected, rel=0.08)


def _launch(kind, layers, ttft_s, tpot_s, batch=1):
    return {"kind": kind, "config": "W16-TP1-PP1", "bits": 16, "tp": 1, "pp": 1,
            "num_layers": layers, "latency": [{"batch": batch, "output_tokens": 64,
                                               "ttft_s": [ttft_s], "tpot_s": [tpot_s]}]}


def test_paired_fits_each_launch_on_its_own_fingerprints():
    # Launch 0: the fingerprints lie on 5 ms + 1 ms/layer (TPOT) and the full model on the
    # same line; launch 1: the full model is 10% slower than its fingerprints' line.
    line = lambda n, f: (0.01 + 0.002 * n) * f, lambda n, f: (0.005 + 0.001 * n) * f  # noqa: E731
    runs = {"W16-TP1-PP1": [], "W16-TP1-PP1@8": [], "W16-TP1-PP1@16": []}
    for full_factor in (1.0, 1.1):
        runs["W16-TP1-PP1"].append(_launch("full", 30, line[0](30, full_factor),
                                           line[1](30, full_factor)))
        for n in (8, 16):
            runs[f"W16-TP1-PP1@{n}"].append(_launch("fingerprint", n, line[0](n, 1),
                                                    line[1](n, 1)))
    rows = iserve_noise.paired(runs)
    assert len(rows) == 4 and {r["fingerprint_layers"] == [8, 16] for r in rows} == {True}
    for r in rows:
        expected = 0.0 if r["launch"] == 0 else 1 / 1.1 - 1
        assert r["error"] == pytest.approx(expected, abs=1e-9)
