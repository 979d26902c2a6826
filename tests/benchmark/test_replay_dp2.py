"""The replay's two-replica arms (benchmark/replay/dp2.py): pure parts, no server."""

from __future__ import annotations

import pytest

from benchmark.replay import dp2


def test_every_arm_gets_the_same_budget_per_replica(tmp_path):
    tokens = dp2.kv_tokens_for("580MB")
    assert tokens == (580_000_000 - 538_060_032) // 46_080  # float32 weights, KV per token
    args = {name: dp2.server_args(name, "580MB", tokens, tmp_path, tmp_path / "log",
                                  tmp_path / "order.json") for name in dp2.DP2_CONFIGS}
    for name, a in args.items():
        assert a[:4] == ("--dp-size", "2", "--dtype", "float32")
        budget = a[a.index("--max-total-tokens") + 1] if "--max-total-tokens" in a else (
            a[a.index("--morph-memory-budget") + 1])
        assert budget == (str(tokens) if name in ("dp2", "kunserve") else "580MB")
    assert "--kunserve-auto" in args["kunserve"] and "--enable-kunserve" not in args["dp2"]
    assert args["w4_dp2"][-2:] == ("--morph-precision-map", "*:4")
    with pytest.raises(ValueError, match="unknown DP-2 arm"):
        dp2.server_args("dp4", "580MB", tokens, None, tmp_path, tmp_path)
    # --dp-size 4: every arm with four replicas, the same budget per replica.
    assert dp2.server_args("kunserve", "580MB", tokens, None, tmp_path, tmp_path,
                           dp_size=4)[:2] == ("--dp-size", "4")


def test_the_replays_dp_size_is_even_and_goes_with_the_dp2_arms(capsys):
    from benchmark.replay.__main__ import parse_args

    assert parse_args(["--dp2", "--dp-size", "4"])[0].dp_size == 4
    for argv, message in ((["--dp2", "--dp-size", "3"], "--dp-size must be even"),
                          (["--dp-size", "4"], "--dp-size goes with --dp2")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_kunserve_arms_flags_are_the_servers_own():
    arm = dp2.KunServeArm(auto_config='{"min_dwell_s": 2}', merged_chunked_prefill=128)
    args = dp2.server_args("kunserve", "580MB", 910, None, None, None, arm)
    assert args[-4:] == ("--kunserve-auto-config", '{"min_dwell_s": 2}',
                         "--kunserve-merged-chunked-prefill", "128")
    assert arm.settings() == {"kunserve_auto_config": '{"min_dwell_s": 2}',
                              "kunserve_merged_max_running": None,
                              "kunserve_merged_chunked_prefill": 128,
                              "kunserve_merged_priority": None,
                              "kunserve_merged_prefill_gap_steps": None}
    # every flag the arm passes is one the server parses
    import argparse

    from sglang_morph.kunserve.live.config import KunServeLiveConfig, add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    full = dp2.KunServeArm("{}", 2, 64, "decode", 8)
    cfg = KunServeLiveConfig.from_cli_namespace(parser.parse_args(
        ["--enable-kunserve", "--kunserve-auto", "--kunserve-link-port", "1", *full.flags()]))
    assert (cfg.merged_max_running, cfg.merged_chunked_prefill, cfg.merged_priority,
            cfg.merged_prefill_gap_steps) == (2, 64, "decode", 8)


def test_kunserve_sample_and_targets():
    rep = {"replica": 0, "kv_capacity_tokens": 5120, "kv_used_tokens": 300, "layers": [0, 15],
           "group": [0, 1], "transitions": [{}], "load": {"waiting_reqs": 2, "running_reqs": 3}}
    back = {**rep, "replica": 1, "layers": [15, 30]}
    s = dp2.kunserve_sample({"replicas": [rep, back]})
    assert (s["kv_capacity_tokens"], s["layers_per_replica"], s["group_size"],
            s["num_waiting_reqs"], s["transitions_total"]) == (10240, [15, 15], 2, 4, 1)
    # Two pairs: each pair's transitions count once (its first replica's log), the second
    # pair whole after a drop and a restore.
    whole = {**rep, "kv_capacity_tokens": 910, "layers": [0, 30], "transitions": [{}, {}]}
    s = dp2.kunserve_sample({"replicas": [rep, back, {**whole, "replica": 2, "group": [2]},
                                          {**whole, "replica": 3, "group": [3]}]})
    assert (s["layers_per_replica"], s["group_size"], s["transitions_total"]) == (
        [15, 15, 30, 30], 2, 3)

    def arm(p99, tpot, outputs):
        return {"metrics": {"ttft_s": {"p99": p99}, "tpot_s": {"p50": tpot}},
                "records": [{"index": i, "error": None, "chunks": [[0, 1]], "output_ids": o}
                            for i, o in enumerate(outputs)]}

    arms = {"dp2": arm(10.0, 0.1, [[1, 2], [3]]), "kunserve": arm(2.0, 0.12, [[1, 2], [4]])}
    dp2.add_agreement(arms)
    t = dp2.targets(arms)
    assert t["p99_ttft_ratio_dp2_over_kunserve"] == 5.0
    assert t["p50_tpot_increase_kunserve_over_dp2"] == pytest.approx(0.2)
    assert t["exact_match_kunserve_vs_dp2"] == 0.5
