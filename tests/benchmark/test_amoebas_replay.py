"""AMOEBAs' live replay (benchmark/amoebas/replay.py): the pure parts, no server."""

from __future__ import annotations

import numpy as np
import pytest

from benchmark.amoebas import replay as AR
from benchmark.replay.client import RequestRecord
from benchmark.replay.trace import TraceRequest, load_window


def short(index: int, arrival_s: float, prompt: int = 40, output: int = 16) -> TraceRequest:
    return TraceRequest(index, arrival_s, prompt, output, prompt * 16, output // 2)


def test_long_prompts_go_in_at_their_times_with_their_lengths():
    longs = AR.LongPrompts((1.0, 2.5), (1300, 1500), 24)
    w = AR.build_workload([short(0, 0.0), short(1, 1.0), short(2, 2.0), short(3, 3.0)], longs)
    assert [r.index for r in w.requests] == list(range(6))
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 1.0, 2.0, 2.5, 3.0]
    # A long prompt arriving with a short one goes after it.
    assert w.long_indices == {2, 4}
    assert [(w.requests[i].prompt_tokens, w.requests[i].output_tokens) for i in (2, 4)] == [
        (1300, 24), (1500, 24)]
    assert [w.requests[i].trace_prompt_tokens for i in (0, 1, 3, 5)] == [640] * 4


def test_the_default_workloads_fit_the_pools():
    tp3 = AR.tp3_kv_tokens(512)
    # The default model in float32: 212,336,640 FFN bytes released per member, 46,080 KV
    # bytes per token; three owner pools of 512 + 4,608 tokens.
    assert tp3 == 3 * (512 + 212_336_640 // 46_080)
    for window, longs, n_short in ((AR.WINDOW, AR.LONGS, 32),
                                   (AR.QUICK_WINDOW, AR.QUICK_LONGS, 10)):
        w = AR.build_workload(load_window(window), longs)
        shorts = [r for r in w.requests if r.index not in w.long_indices]
        assert len(shorts) == n_short
        assert all(r.prompt_tokens + r.output_tokens < 512 for r in shorts)
        assert all(512 < p + longs.output_tokens <= tp3 // 3 for p in longs.prompt_tokens)
        assert [w.requests[i].arrival_s for i in sorted(w.long_indices)] == list(longs.arrivals_s)
    with pytest.raises(ValueError, match="one length"):
        AR.LongPrompts((1.0,), (100, 200), 8)


def test_server_args_per_arm():
    assert AR.server_args("amoebas", 512, 15360) == (
        "--dtype", "float32", "--enable-metrics", "--dp-size", "3", "--max-total-tokens", "512",
        "--enable-amoebas")
    assert AR.server_args("dp3", 512, 15360)[3:] == ("--dp-size", "3", "--max-total-tokens",
                                                       "512")
    assert AR.server_args("tp3", 512, 15360)[3:] == ("--tp-size", "3", "--max-total-tokens",
                                                       "15360")
    assert AR.server_args("dp3", 512, 15360, 256)[3:5] == ("--chunked-prefill-size", "256")
    with pytest.raises(ValueError, match="unknown arm"):
        AR.server_args("dp4", 512, 0)


def record(index: int, start: float, ttft: float, gap: float, n: int) -> RequestRecord:
    rec = RequestRecord(index, start, max_new_tokens=n, output_ids=list(range(n)))
    rec.chunks = [(start + ttft + k * gap, k + 1) for k in range(n)]
    return rec


def test_summary_splits_short_and_long_and_matches_numpy():
    rng = np.random.default_rng(0)
    t0 = 1000.0
    ttft, gap = rng.uniform(0.1, 3.0, 40), rng.uniform(0.05, 0.5, 40)
    recs = [record(i, t0 + i, ttft[i], gap[i], 8) for i in range(40)]
    recs.append(record(40, t0 + 5, 20.0, 0.3, 8))  # a long prompt served
    # SGLang streams a prompt over its pool back as an abort with one placeholder token.
    refused = RequestRecord(41, t0 + 6, max_new_tokens=8, chunks=[(t0 + 6.1, 1)],
                            output_ids=[0], finish_reason="abort")
    failed = RequestRecord(42, t0 + 7, max_new_tokens=8, error="ReadTimeout: ")
    s = AR.summarize_run(recs + [refused, failed], frozenset({40, 41, 42}), t0)
    for p in (50, 95, 99):
        assert s["short"]["ttft_s"][f"p{p}"] == pytest.approx(np.percentile(ttft, p))
        assert s["short"]["tpot_s"][f"p{p}"] == pytest.approx(np.percentile(gap, p))
        assert s["short"]["e2e_s"][f"p{p}"] == pytest.approx(np.percentile(ttft + 7 * gap, p))
    assert (s["short"]["served"], s["short"]["refused"], s["short"]["failed"]) == (40, 0, 0)
    assert (s["long"]["requests"], s["long"]["served"], s["long"]["refused"],
            s["long"]["failed"]) == (3, 1, 1, 1)
    assert s["long"]["ttft_each_s"] == [pytest.approx(20.0), None, None]
    end = max(r.chunks[-1][0] for r in recs)
    assert s["output_tokens"] == 41 * 8
    assert s["throughput_tokens_per_s"] == pytest.approx(41 * 8 / (end - t0))
    assert AR.outcome(RequestRecord(0, 0.0, error="HTTP 400: too long")) == "refused"
    cut = RequestRecord(0, 0.0, chunks=[(1.0, 1), (2.0, 3)], finish_reason="abort")
    assert AR.outcome(cut) == "failed"


def test_aggregate_mismatches_and_transitions():
    def run(k, ttft_p50, merges=None):
        s = {"short": {"requests": 2, "served": 2, "refused": 0, "failed": 0,
                       **{key: {"p50": ttft_p50 + k, "p95": 1.0, "p99": 2.0}
                          for key in ("ttft_s", "tpot_s", "e2e_s")}},
             "long": {"requests": 1, "served": 1, "refused": 0, "failed": 0,
                      "ttft_each_s": [10.0 + k]},
             "throughput_tokens_per_s": 10.0 + k}
        return {"run": k, "summary": s, **({"transitions": {"merges": merges, "splits": merges}}
                                           if merges is not None else {})}

    agg = AR.aggregate([run(0, 1.0, 1), run(1, 1.0, 2), run(2, 1.0, 1), {"run": 3, "error": "x"}])
    assert agg["runs"] == 3 and agg["runs_failed"] == 1
    assert agg["short_ttft_s"]["p50"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert agg["long_ttft_s"]["median"] == 11.0 and agg["long"]["served"] == 3
    assert agg["merges"] == {"median": 1, "min": 1, "max": 2, "n": 3}
    assert AR.spread([None]) == {"median": None, "min": None, "max": None, "n": 0}

    def rec(i, ids, finish="length"):
        return {"index": i, "error": None, "chunks": [[0, 1]], "output_ids": ids,
                "finish_reason": finish}

    got = [rec(0, [1, 2]), rec(1, [3]), rec(2, [5]), rec(3, [6])]
    ref = [rec(0, [1, 2]), rec(1, [4]), rec(2, [0], finish="abort")]
    assert AR.output_mismatches(got, ref) == {"compared": 2, "mismatches": 1, "indices": [1]}

    status = {"replicas": [
        {"replica": r, "transitions": [
            {"action": "merge", "group": [0, 1, 2], "at_unix_s": 5.0 + r / 100},
            {"action": "split", "group": [0, 1, 2], "at_unix_s": 9.0 + r / 100}]}
        for r in range(3)]}
    t = AR.group_transitions(status, since_unix_s=1.0)
    assert (t["merges"], t["splits"]) == (1, 1) and [x["at_unix_s"] for x in t["list"]] == [5, 9]
    assert AR.group_transitions(status, since_unix_s=6.0)["merges"] == 0


def test_amoebas_sample_orders_replicas():
    rep = {"degree": 3, "kv_capacity_tokens": 5120, "kv_used_tokens": 7}
    s = AR.amoebas_sample({"units": [[0, 1, 2]], "replicas": [
        {**rep, "replica": 1, "kv_used_tokens": 9}, {**rep, "replica": 0}, {**rep, "replica": 2}]})
    assert s == {"units": [[0, 1, 2]], "degree": [3, 3, 3],
                 "kv_capacity_tokens": [5120] * 3, "kv_used_tokens": [7, 9, 7]}
