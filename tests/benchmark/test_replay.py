"""benchmark.replay: trace windows, prompts, metrics on synthetic records, and the --quick
driver end to end (two real servers; checks the harness, not performance)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmark.replay import metrics as M
from benchmark.replay.client import ReplayResult, RequestRecord
from benchmark.replay.trace import TRACES, TraceWindow, load_window, prompt_token_ids, read_trace
from conftest import REPO_ROOT
from sglang_morph.morph.provenance import check_provenance

CODE = TRACES / "azure_llm_2023_code.csv"
BURSTGPT = TRACES / "burstgpt_first400.csv"


def test_azure_window_scales_time_and_lengths():
    raw = read_trace(CODE)
    w = TraceWindow(CODE, start_s=1200, duration_s=20, time_scale=2.0, keep_every=3,
                    prompt_scale=0.125, output_scale=2.0, min_prompt_tokens=32,
                    max_prompt_tokens=384, min_output_tokens=16, max_output_tokens=64)
    reqs = load_window(w)
    sel = raw[(raw.time_s >= 1200) & (raw.time_s < 1220)].iloc[::3]
    assert len(reqs) == len(sel) > 0
    for r, (_, row) in zip(reqs, sel.iterrows()):
        assert r.arrival_s == pytest.approx((row.time_s - 1200) * 2.0)
        assert r.prompt_tokens == min(384, max(32, round(row.prompt_tokens / 8)))
        assert r.output_tokens == min(64, max(16, round(row.output_tokens * 2)))
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))


def test_burstgpt_format_drops_failed_rows():
    df = read_trace(BURSTGPT)
    assert len(df) == 400 - 17  # 17 rows with 0 request tokens (SOURCES.md)
    assert df.time_s.iloc[0] == 0 and (df.prompt_tokens > 0).all()


def test_bad_windows_and_caps_are_refused():
    with pytest.raises(ValueError, match="no requests"):
        load_window(TraceWindow(CODE, start_s=10**6, duration_s=10))
    with pytest.raises(ValueError, match="exceed the model's context"):
        load_window(TraceWindow(CODE, max_prompt_tokens=8000, max_output_tokens=500), 8192)
    for kw in ({"duration_s": 0}, {"time_scale": -1}, {"keep_every": 0},
               {"min_output_tokens": 9, "max_output_tokens": 8}):
        with pytest.raises(ValueError):
            TraceWindow(CODE, **kw)
    with pytest.raises(FileNotFoundError):
        read_trace(TRACES / "missing.csv")


def test_prompts_are_disjoint_corpus_slices():
    reqs = load_window(TraceWindow(CODE, start_s=1204, duration_s=3, prompt_scale=0.01,
                                   max_prompt_tokens=64))
    corpus = list(range(10_000))
    prompts = prompt_token_ids(reqs, corpus)
    assert [len(p) for p in prompts] == [r.prompt_tokens for r in reqs]
    flat = [t for p in prompts for t in p]
    assert len(set(flat)) == len(flat)  # no shared tokens, hence no shared prefixes


def record(i, start, ttft, n, gap, max_new=None):
    r = RequestRecord(i, start, sent_unix_s=start, max_new_tokens=max_new or n)
    r.chunks = [(start + ttft + k * gap, k + 1) for k in range(n)]
    r.output_ids = list(range(n))
    return r


def test_summary_percentiles_slo_and_quantized_share():
    recs = [record(i, 100.0 + i, ttft=0.5 * i, n=5, gap=0.1) for i in range(10)]
    failed = RequestRecord(10, 111.0, error="HTTP 500: boom")
    res = ReplayResult("x", 100.0, 130.0, recs + [failed], [])
    # Layers were quantized from 104.2 to 107.0 (W8, then one at W4 from 105.5); tokens
    # arriving in that span count. A refused restore at 106.0 changed nothing.
    steps = M.precision_steps([
        {"time_unix_s": 104.2, "action": "swap", "layers": [3, 4], "to_bits": 8},
        {"time_unix_s": 105.5, "action": "swap", "layers": [4], "to_bits": 4},
        {"time_unix_s": 106.0, "action": "refused", "layers": [3, 4], "to_bits": 16},
        {"time_unix_s": 107.0, "action": "restore", "layers": [3, 4], "to_bits": 16}],
        num_layers=5)
    assert steps == [(0.0, (16,) * 5), (104.2, (16, 16, 16, 8, 8)),
                     (105.5, (16, 16, 16, 8, 4)), (107.0, (16,) * 5)]
    s = M.summarize(res, M.Slo(ttft_s=2.0), steps)
    assert s["share_source"] == "log"  # these records carry no provenance
    ttfts = [0.5 * i for i in range(10)]
    assert s["ttft_s"]["p95"] == pytest.approx(np.percentile(ttfts, 95))
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)
    assert s["completed"] == 10 and s["failed"] == 1
    # TTFT <= 2 s: requests 0-4 meet it; the failed one violates it.
    assert s["slo_violation_rate"] == pytest.approx(6 / 11)
    tokens_in = sum(1 for r in recs for t, _ in r.chunks if 104.2 <= t < 107.0)
    assert 0 < tokens_in < 50
    assert s["quantized_token_share"] == pytest.approx(tokens_in / 50)
    w4_in = sum(1 for r in recs for t, _ in r.chunks if 105.5 <= t < 107.0)
    assert 0 < w4_in < tokens_in and s["w4_token_share"] == pytest.approx(w4_in / 50)
    assert s["max_quantized_layers"] == 2 and s["max_w4_layers"] == 1
    end = max(r.chunks[-1][0] for r in recs)
    assert s["throughput_tokens_per_s"] == pytest.approx(50 / (end - 100.0))
    assert s["goodput_requests_per_s"] == pytest.approx(5 / (end - 100.0))
    with_tpot = M.summarize(res, M.Slo(ttft_s=2.0, tpot_s=0.05), steps)
    assert with_tpot["slo_violation_rate"] == 1.0  # every TPOT is 0.1 s


def precision(*segments):
    """A ``morph_precision`` object from (start, end, {bits: [layers]}) triples."""
    segs = [{"start": a, "end": b, "quantized_layers": q} for a, b, q in segments]
    n = segs[-1]["end"]
    quantized = sum(b - a for a, b, q in segments if q)
    return {"quantized_token_share": quantized / n, "quantized_tokens": quantized,
            "output_tokens": n, "segments": segs}


def test_quantized_share_comes_from_provenance_and_is_checked_against_the_log():
    # Layer 3 at W4 from 104.2 to 107.0; request 0 streams a token every 0.5 s from 103.0, so
    # by arrival time its tokens 3-7 (104.5-106.5) were quantized; request 1 comes later.
    steps = M.precision_steps([
        {"time_unix_s": 104.2, "action": "swap", "layers": [3], "to_bits": 4},
        {"time_unix_s": 107.0, "action": "restore", "layers": [3], "to_bits": 16}], num_layers=5)
    across, later = record(0, 100.0, ttft=3.0, n=10, gap=0.5), record(1, 120.0, 0.5, 10, 0.1)
    later.precision = precision((0, 10, {}))
    res = ReplayResult("x", 100.0, 130.0, [across, later], [])
    w4 = {"4": [3]}
    cases = [
        # (the server's segments for request 0, quantized tokens by it, disagreeing requests)
        (precision((0, 3, {}), (3, 8, w4), (8, 10, {})), 5, 0),  # exactly the log's
        # A token sampled before the swap and arriving after it: one off at one boundary.
        (precision((0, 4, {}), (4, 8, w4), (8, 10, {})), 4, 0),
        (precision((0, 2, {}), (2, 9, w4), (9, 10, {})), 7, 0),  # one off at each of two
        (precision((0, 10, w4)), 10, 1),  # 5 off with two transitions: they disagree
    ]
    for segs, quantized, disagreements in cases:
        across.precision = segs
        s = M.summarize(res, M.Slo(), steps)
        assert s["share_source"] == "provenance"
        assert s["quantized_token_share"] == s["w4_token_share"] == quantized / 20
        assert s["quantized_token_share_log"] == s["w4_token_share_log"] == 5 / 20
        assert s["provenance_compared"] == 2
        assert s["provenance_disagreements"] == disagreements
        assert s["provenance_max_difference_tokens"] == abs(quantized - 5)
    # W8 is quantized but not W4.
    across.precision = precision((0, 3, {}), (3, 8, {"8": [3]}), (8, 10, {}))
    s = M.summarize(res, M.Slo(), steps)
    assert s["quantized_token_share"] == 5 / 20 and s["w4_token_share"] == 0.0
    # A server that reports no provenance: the log's inference, nothing compared.
    later.precision = None
    s = M.summarize(res, M.Slo(), steps)
    assert s["share_source"] == "log" and s["quantized_token_share"] == 5 / 20
    assert s["provenance_disagreements"] is None


def test_the_clients_loop_stalls_say_where_their_time_went():
    """A coroutine that blocks the loop in a system call (sleep) stalls it off the CPU; one
    that computes stalls it on the CPU. Both are recorded, nothing else is."""
    import asyncio
    import time

    from benchmark.replay import client

    async def run() -> list[dict]:
        stalls: list[dict] = []
        stop = asyncio.Event()
        watcher = asyncio.create_task(client._watch_loop(stalls, stop))
        await asyncio.sleep(0.2)
        time.sleep(0.4)  # blocked, not running
        await asyncio.sleep(0.2)
        deadline = time.perf_counter() + 0.4
        while time.perf_counter() < deadline:  # running
            pass
        await asyncio.sleep(0.2)
        stop.set()
        await watcher
        return stalls

    stalls = asyncio.run(run())
    assert len(stalls) == 2, stalls
    blocked, busy = stalls
    assert 0.3 < blocked["late_s"] < 0.6 and 0.3 < busy["late_s"] < 0.6
    if "on_cpu_s" in blocked:  # Linux: the process's own schedstat
        assert blocked["on_cpu_s"] < 0.1 and busy["on_cpu_s"] > 0.25


def test_agreement_exact_and_rouge_on_token_ids():
    ref = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 10]}
    assert M.agreement(dict(ref), ref) == {"compared": 3, "exact_match_rate": 1.0,
                                           "rouge_l_f1": 1.0}
    other = M.agreement({0: [1, 2, 3, 4], 1: [5, 6, 99, 98], 3: [1]}, ref)
    assert other["compared"] == 2 and other["exact_match_rate"] == 0.5
    assert other["rouge_l_f1"] == pytest.approx((1.0 + 0.5) / 2)  # LCS 2 of 4 each way
    assert M.agreement({}, ref)["rouge_l_f1"] is None


@pytest.mark.server
def test_quick_replay_end_to_end(tmp_path, room_for_a_server):
    """Two servers (full precision, morph default) under the same budget replay the same
    trace; every request completes with its full length and the report files appear."""
    out = tmp_path / "replay"
    proc = subprocess.run([sys.executable, "-m", "benchmark.replay", "--quick", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "raw" / "replay_full.json").read_text())
    slim = json.loads((out / "replay.json").read_text())
    assert slim["configs"]["fp"]["metrics"] == report["configs"]["fp"]["metrics"]
    assert "chunks" not in slim["configs"]["fp"]["records"][0]
    assert set(report["configs"]) == {"fp", "default"}
    n = report["settings"]["requests"]
    assert n >= 3
    budget_caps = set()
    for name, c in report["configs"].items():
        m = c["metrics"]
        assert m["completed"] == n and m["failed"] == 0 and m["truncated"] == 0, name
        for r in c["records"]:
            assert len(r["output_ids"]) == r["max_new_tokens"]
            assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert c["status_samples"], name
        budget_caps.add(c["kv_capacity_tokens_at_start"])
    assert len(budget_caps) == 1  # same budget, same full-precision KV pool at start
    fp = report["configs"]["fp"]
    assert fp["quality"]["exact_match_rate"] == 1.0 and fp["quality"]["perplexity"] > 1
    assert fp["metrics"]["max_quantized_layers"] == 0
    # Every request's provenance came with its last chunk and covers its output. Full
    # precision all along: share 0, one segment with nothing quantized, agreeing with the log
    # (morph default's count under its transitions is reported, not asserted: a client that
    # lags on this loaded CPU may legitimately put tokens on the wrong side of a boundary).
    for name, c in report["configs"].items():
        assert c["metrics"]["share_source"] == "provenance", name
        assert c["metrics"]["provenance_compared"] == n
        for r in c["records"]:
            check_provenance(r["precision"])
            assert r["precision"]["output_tokens"] == r["max_new_tokens"]
    assert fp["metrics"]["quantized_token_share"] == 0.0
    assert fp["metrics"]["provenance_disagreements"] == 0
    assert all(r["precision"]["segments"] == [
        {"start": 0, "end": r["max_new_tokens"], "quantized_layers": {}}] for r in fp["records"])
    assert report["settings"]["git"]["commit"]
    for f in ("replay.md", "cdf.png", "timeline_fp.png", "timeline_default.png"):
        assert (out / f).stat().st_size > 0, f
