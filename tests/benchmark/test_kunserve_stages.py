"""The four-stage prefill benchmark (benchmark/kunserve/stages.py): its summary, no server."""

from __future__ import annotations

import pytest

from benchmark.kunserve import stages


def test_summary_pairs_each_rounds_arms_whatever_their_order():
    def run(arm, rnd, seconds):
        return {"arm": arm, "round": rnd, "forward_s": [seconds - 0.1, seconds, seconds + 0.5],
                "ttft_s": [seconds + 0.05]}

    runs = [run("whole", 1, 1.0), run("uncut", 1, 1.2), run("cut", 1, 0.6),
            run("cut", 2, 1.08), run("whole", 2, 1.5), run("uncut", 2, 1.8)]
    s = stages.summarize(runs)
    assert s["cut_over_uncut"]["min"] == pytest.approx(0.5)
    assert s["cut_over_uncut"]["max"] == pytest.approx(0.6)
    assert s["cut_over_whole"]["median"] == pytest.approx((0.6 + 0.72) / 2)
    assert s["uncut_over_whole"]["max"] == pytest.approx(1.2)
    assert s["ttft_s"]["whole"]["median"] == pytest.approx(1.3)
