"""The transition-cost benchmark's arithmetic (no server): the wire model and the summary of
the members' transition records."""

from __future__ import annotations

import pytest

from benchmark.amoebas import transition_cost as T

SIZES = {"layers": 30, "kv_heads": 3, "head_dim": 64, "hidden": 576, "intermediate": 1536,
         "head_token_bytes": 30 * 2 * 64 * 4}


def test_the_wire_model_adds_latency_and_bytes_over_bandwidth():
    wire = T.Wire(latency_s=0.001, bandwidth_bytes_per_s=1e9)
    assert wire.message_s(2e6) == pytest.approx(0.003)
    # Two pairs: 4 metadata latencies each, then one message each way.
    assert wire.kv_exchange_s([(1e6, 2e6), (0.0, 0.0)]) == pytest.approx(
        (0.004 + 0.002 + 0.003) + (0.004 + 0.001 + 0.001))
    # Per layer two shards, each as three messages of a third of it.
    assert wire.ffn_gather_s(30, 1e6, 3) == pytest.approx(30 * 2 * 3 * (0.001 + 1e6 / 3 / 1e9))


def record(duration_s, live, exchange_s, ffn_s, sent):
    return {"duration_s": duration_s, "live_tokens": live, "ffn_s": ffn_s,
            "kv_phase_s": {"kv_prepare": 0.001, "kv_exchange": exchange_s, "kv_install": 0.002},
            "kv_sent_bytes": sent, "kv_peak_extra_bytes": 10}


def test_a_level_summary_takes_the_slowest_member_and_the_live_tokens_of_the_group():
    wire = T.Wire(latency_s=0.001, bandwidth_bytes_per_s=1e9)
    rounds = [{action: [record(0.5, 100, 0.2, 0.03, 7), record(0.7, 200, 0.1, 0.06, 5),
                        record(0.6, 300, 0.3, 0.09, 3)] for action in ("merge", "split")},
              {action: [record(0.4, 100, 0.1, 0.03, 7), record(0.4, 200, 0.1, 0.03, 5),
                        record(0.4, 300, 0.1, 0.03, 3)] for action in ("merge", "split")}]
    s = T.summarize_level(rounds, SIZES, wire)
    merge = s["merge"]
    assert merge["whole_s"] == {"median": pytest.approx(0.55), "min": 0.4, "max": 0.7, "n": 2}
    assert merge["kv_exchange_s"]["max"] == 0.3
    assert merge["ffn_s_per_layer"]["max"] == pytest.approx(0.09 / 30)
    assert merge["live_tokens_group"]["median"] == 600
    assert merge["kv_bytes_exchanged"]["median"] == 15
    assert merge["kv_exchange_us_per_live_token"]["max"] == pytest.approx(0.3 / 600 * 1e6)
    hb = SIZES["head_token_bytes"]
    pairs = [(100 * hb, 200 * hb), (100 * hb, 300 * hb), (200 * hb, 300 * hb)]
    assert merge["wire_kv_exchange_s"]["median"] == pytest.approx(wire.kv_exchange_s(pairs))
    assert merge["wire_ffn_gather_s"]["median"] is None  # a merge gathers nothing
    shard = 3 * 512 * 576 * 4
    assert s["split"]["wire_ffn_gather_s"]["median"] == pytest.approx(
        wire.ffn_gather_s(30, shard, 3))


def test_no_live_token_has_no_cost_per_token():
    wire = T.Wire(0.001, 1e9)
    rounds = [{a: [record(0.1, 0, 0.01, 0.01, 0)] * 3 for a in ("merge", "split")}]
    assert T.summarize_level(rounds, SIZES, wire)["merge"][
        "kv_exchange_us_per_live_token"]["median"] is None
