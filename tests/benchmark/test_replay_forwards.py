"""A replay's forward log (``benchmark/replay/forwards.py``): the cost model fitted on it
recovers the model that made the times, and the step gaps count a scheduler's own work between
forwards, not its idle waits."""

from __future__ import annotations

import json

import pytest

from benchmark.replay import forwards
from sglang_morph.kunserve.cost import ChunkCostModel, PhaseCosts

TRUE = PhaseCosts(ChunkCostModel(alpha_s=2e-7, beta_s=3e-4, gamma_s=0.02),
                  ChunkCostModel(alpha_s=1e-5, beta_s=1.5e-3, gamma_s=0.025))


def log_lines():
    """Two schedulers: prefills of fresh prompts, then decode steps 4 ms apart, then an idle
    second, then more decode steps."""
    lines, t = [], {101: 1000.0, 202: 1000.01}
    for pid in t:
        for k, c in enumerate((32, 96, 200, 384, 64, 150)):
            news = [c] if k % 2 else [c, c // 2]
            s = TRUE.prefill.seconds([forwards.Chunk(0, n) for n in news])
            lines.append({"mode": "extend", "cached": [0] * len(news), "new": news,
                          "seconds": s, "t": t[pid], "pid": pid})
            t[pid] += s + 0.004
        for step in range(30):
            contexts = [100 + step * 7 + j * 50 for j in range(1 + step % 5)]
            s = TRUE.decode.seconds([forwards.Chunk(p, 1) for p in contexts])
            lines.append({"mode": "decode", "cached": contexts, "new": [1] * len(contexts),
                          "seconds": s, "t": t[pid], "pid": pid})
            t[pid] += s + (1.0 if step == 14 else 0.004)
    return lines


def test_the_fit_recovers_the_model_and_the_gaps_are_the_busy_ones(tmp_path):
    path = tmp_path / "forwards.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in log_lines()))
    got = forwards.summarize(forwards.read_log(path), "test")
    fit = PhaseCosts.from_json(got["fit"])
    for phase in ("prefill", "decode"):
        want, have = getattr(TRUE, phase), getattr(fit, phase)
        for name in ("alpha_s", "beta_s", "gamma_s"):
            assert getattr(have, name) == pytest.approx(getattr(want, name), rel=1e-3)
        assert got["phases"][phase]["mean_error"] < 1e-3
    # Fresh prompts only: nothing is padded, and the padded-prefix terms stay 0.
    assert fit.prefill.delta_s == fit.prefill.epsilon_s == 0.0
    assert got["schedulers"] == 2
    # 35 gaps per scheduler, one of them the idle second (left out).
    assert got["step_gap_s"]["count"] == 2 * 34
    assert got["step_gap_s"]["median"] == pytest.approx(0.004)


def test_a_log_without_decode_steps_determines_no_model():
    prefills = [line for line in log_lines() if line["mode"] == "extend"]
    with pytest.raises(ValueError, match="decode"):
        forwards.summarize(prefills, "test")


def test_merged_forwards_are_ratios_over_the_unmerged_fit():
    """Forwards inside a merged window are left out of the fit and measured against it: here
    the merged decode steps took 1.25x and the merged prefills 1.5x what the same batches
    cost on a whole replica."""
    lines = log_lines()
    start = 1000.0 + 10_000
    merged = []
    for k, (mode, news) in enumerate((("extend", [300]), ("decode", [1, 1]),
                                      ("extend", [100, 40]), ("decode", [1]))):
        phase = TRUE.prefill if mode == "extend" else TRUE.decode
        cached = [0] * len(news) if mode == "extend" else [200] * len(news)
        s = phase.seconds([forwards.Chunk(p, n) for p, n in zip(cached, news)])
        merged.append({"mode": mode, "cached": cached, "new": news, "pid": 101,
                       "seconds": s * (1.5 if mode == "extend" else 1.25), "t": start + k})
    got = forwards.summarize(lines + merged, "test", merged_windows=[(start - 1, start + 10)])
    assert got["merged_decode_ratio"] == {"median": pytest.approx(1.25, rel=1e-3),
                                          "forwards": 2}
    assert got["merged_prefill_ratio"] == {"median": pytest.approx(1.5, rel=1e-3),
                                           "forwards": 2}
    # The merged forwards did not move the fit.
    alone = forwards.summarize(lines, "test")
    assert got["fit"] == alone["fit"]
