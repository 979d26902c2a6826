"""``benchmark.kunserve.tail`` over hand-built replay rounds: token intervals from streamed
chunks, stalls against steady decode, the decode forwards a request ran beside, the slowest
requests of each arm and KunServe's E2E excess by part."""

from __future__ import annotations

import json

import pytest

from benchmark.kunserve import tail as KT

T0 = 2_000_000.0


def test_token_intervals_spread_a_chunk_over_its_tokens():
    # Three chunks: one token, then 3 more 0.6 s later, then one 0.1 s after that.
    assert KT.token_intervals_s([[T0, 1], [T0 + 0.6, 4], [T0 + 0.7, 5]]) == pytest.approx(
        [0.2, 0.2, 0.2, 0.1])
    assert KT.token_intervals_s([[T0, 1]]) == []


def chunks(first_s: float, intervals: list[float]) -> list[list[float]]:
    out, t = [[T0 + first_s, 1]], T0 + first_s
    for k, dt in enumerate(intervals, 2):
        t += dt
        out.append([t, k])
    return out


def rec(index: int, at_s: float, first_s: float, intervals: list[float]) -> dict:
    c = chunks(at_s + first_s, intervals)
    return {"index": index, "scheduled_unix_s": T0 + at_s, "prompt_tokens": 100 + index,
            "ttft_s": first_s, "e2e_s": c[-1][0] - T0 - at_s, "chunks": c}


def forward(t_s: float, batch: int, seconds: float, mode: str = "decode") -> dict:
    return {"mode": mode, "cached": [10] * batch, "new": [1] * batch, "seconds": seconds,
            "t": T0 + t_s, "pid": 1}


def write_round(path, dp2_records, ks_records, dp2_forwards, ks_forwards, transitions):
    raw = path / "raw"
    raw.mkdir(parents=True)
    full = {"dp2": {"configs": {
        "dp2": {"records": dp2_records, "start_unix_s": T0},
        "kunserve": {"records": ks_records, "start_unix_s": T0,
                     "kunserve_transitions": transitions, "end_unix_s": T0 + 100}}}}
    (raw / "replay_dp2_full.json").write_text(json.dumps(full))
    for arm, fw in (("dp2", dp2_forwards), ("kunserve", ks_forwards)):
        (raw / f"{arm}_forwards.jsonl").write_text("".join(json.dumps(f) + "\n" for f in fw))


def a_round(path):
    """Five requests. On KunServe #4 decodes through a 1.2-s stall at 0.15 s steps inside a
    merged window [5, 20] s; on DP 2 it waits 3 s for its first token, then 0.1-s steps."""
    dp2 = [rec(i, i, 0.5, [0.1] * 9) for i in range(4)] + [rec(4, 6.0, 3.0, [0.1] * 19)]
    ks = [rec(i, i, 0.5, [0.1] * 9) for i in range(4)] + [
        rec(4, 6.0, 1.0, [0.15] * 5 + [1.2] + [0.15] * 13)]
    dp2_fw = [forward(9.5 + k / 10, 3, 0.09) for k in range(20)]
    ks_fw = ([forward(7.5 + k / 10, 6, 0.14) for k in range(30)]
             + [forward(8.0, 1, 1.1, mode="extend"),  # the prefill its stall ran beside
                forward(30.0, 9, 0.5)])  # after the request: not its forwards
    transitions = [{"replica": 0, "action": "drop", "at_unix_s": T0 + 5.1, "duration_s": 0.1},
                   {"replica": 0, "action": "restore", "at_unix_s": T0 + 20, "duration_s": 0.2}]
    write_round(path, dp2, ks, dp2_fw, ks_fw, transitions)


def test_a_round_names_the_slowest_requests_and_splits_their_decode(tmp_path):
    a_round(tmp_path / "r1")
    rnd = KT.one_round(tmp_path / "r1")
    assert rnd["requests"] == 5 and rnd["merged_windows_s"] == [[5.0, 20.0]]
    slowest = rnd["e2e_s"][0]
    assert slowest["index"] == 4 and [r["index"] for r in rnd["ttft_s"]][0] == 4
    ks, dp = slowest["kunserve"], slowest["dp2"]
    assert ks["arrived_merged"] and not dp["arrived_merged"]
    assert ks["stalls"] == 1 and ks["stall_s"] == pytest.approx(1.2)
    assert ks["steady_s"] == pytest.approx(18 * 0.15) and ks["steady_median_s"] == pytest.approx(0.15)
    assert ks["decode_s"] == pytest.approx(ks["stall_s"] + ks["steady_s"])
    assert dp["stalls"] == 0 and dp["steady_s"] == pytest.approx(1.9)
    # The forwards started while it decoded: KunServe's 6-request ones, not the late 9.
    assert (ks["batch_median"], ks["seconds_median"]) == (6, 0.14)
    assert (dp["batch_median"], dp["seconds_median"]) == (3, 0.09)
    assert ks["prefill_s"] == pytest.approx(1.1) and dp["prefill_s"] == 0
    assert ks["output_tokens"] == 20


def test_the_excess_is_the_sum_of_its_parts_and_the_report_is_written(tmp_path):
    for k in (1, 2):
        a_round(tmp_path / f"r{k}")
    assert KT.main([str(tmp_path / "r1"), str(tmp_path / "r2"), "--out",
                    str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "tail.json").read_text())
    ex = report["excess_s"]
    assert ex["e2e"] == pytest.approx(ex["ttft"] + ex["stalls"] + ex["steady"])
    # Per round, #4: TTFT 1.0 - 3.0, stalls 1.2 - 0, steady 2.7 - 1.9; the other two tail
    # requests are alike in both arms.
    assert ex["ttft"] == pytest.approx(2 * -2.0)
    assert ex["stalls"] == pytest.approx(2 * 1.2)
    assert ex["steady"] == pytest.approx(2 * 0.8)
    assert "#4 (104 + 20 tokens" in (tmp_path / "out" / "tail.md").read_text()


def test_a_round_without_raw_files_is_a_cli_error(tmp_path, capsys):
    (tmp_path / "r1").mkdir()
    with pytest.raises(SystemExit) as e:
        KT.main([str(tmp_path / "r1"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "replay_dp2_full.json does not exist" in capsys.readouterr().err
