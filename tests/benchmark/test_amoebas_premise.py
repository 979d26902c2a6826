"""The premise benchmark's arithmetic (no server): a streamed request's TTFT, TPOT and E2E,
the per-round ratios and the report."""

from __future__ import annotations

import pytest

from benchmark.amoebas import premise as P


def chunks(ttft_s: float, step_s: float) -> list[tuple[float, int]]:
    return [(ttft_s + k * step_s, k + 1) for k in range(P.NEW_TOKENS)]


def run(rate: float, step_s: float) -> dict:
    return {"output_tokens_per_s": rate, "wall_s": 1.0,
            "requests": [P.request_times(chunks(0.5, step_s * f)) for f in (0.5, 1.0, 3.0)]}


def test_request_times_read_the_decode_step_and_refuse_a_short_request():
    t = P.request_times(chunks(0.4, 0.1))
    assert t["ttft_s"] == 0.4
    assert t["tpot_s"] == pytest.approx(0.1)
    assert t["e2e_s"] == pytest.approx(0.4 + (P.NEW_TOKENS - 1) * 0.1)
    with pytest.raises(RuntimeError, match=f"ended with 5 of {P.NEW_TOKENS} tokens"):
        P.request_times(chunks(0.4, 0.1)[:5])
    with pytest.raises(RuntimeError, match="ended with 0"):
        P.request_times([])


def test_ratios_per_round_and_the_report():
    plain = [run(10.0, 0.10), run(12.0, 0.10), run(8.0, 0.20)]
    alone = [run(9.0, 0.11), run(12.0, 0.10), run(10.0, 0.16)]
    r = P.ratios(alone, plain)
    assert r["throughput"] == pytest.approx({"median": 1.0, "min": 0.9, "max": 1.25, "n": 3})
    assert r["tpot_p50"] == pytest.approx({"median": 1.0, "min": 0.8, "max": 1.1, "n": 3})
    s = P.summary(alone)
    assert s["output_tokens_per_s_median"] == 10.0
    assert s["tpot_s"]["p50"] == pytest.approx(0.11)  # nine requests: the fifth smallest
    meta = {"command": "python -m benchmark.amoebas.premise", "git": {"commit": "abcdef0123",
                                                                      "dirty": False},
            "machine": {"cpu_model": "CPU", "cpu_cores": 2}, "load_before": [0.1, 0.2, 0.3],
            "load_after": [0.4, 0.5, 0.6]}
    result = {"meta": meta, "plain": P.summary(plain), "alone": s,
              "merged": P.summary(plain), "per_owner": P.summary(alone),
              "merged_over_alone": P.ratios(plain, alone),
              "per_owner_over_alone": P.ratios(alone, alone),
              "merged_over_per_owner": P.ratios(plain, alone),
              "alone_over_plain": r, "transitions_s": [{"merge_s": 0.3, "split_s": 0.6}]}
    text = P.report(result, 3)
    assert "| 3 x TP 1, AMOEBAs' layouts | 10.0 (9.0-12.0) |" in text
    assert "AMOEBAs' layouts / plain SGLang, both 3 x TP 1: throughput 1.000 (0.900-1.250)" in text
    assert "| TP 3 group, per owner | 10.0 (9.0-12.0) |" in text
    assert "TP 3 group, per owner / 3 x TP 1 (AMOEBAs' layouts): throughput 1.000" in text
    assert "TP 3 group, batched steps / per owner: throughput 1.000 (0.800-1.111)" in text
    assert "0.30 / 0.60 s" in text and "commit abcdef0" in text
