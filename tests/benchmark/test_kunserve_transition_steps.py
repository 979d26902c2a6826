"""The transition-steps benchmark's summary (no server): per step, the spread over every
replica's record of every round; the pause per round is the slowest replica's."""

from __future__ import annotations

from benchmark.kunserve import transition_steps as ts


def _record(steps: dict[str, float], duration_s: float) -> dict:
    return {"step_seconds": steps, "duration_s": duration_s, "kv_moved_bytes": 1_000_000,
            "requests_in_flight": 2}


def test_summary_spreads_every_replica_and_pauses_on_the_slowest():
    def pair(a: float, b: float) -> list[dict]:
        drop = lambda x: _record({"vote": 0.001, "the KV move": x,  # noqa: E731
                                  "the KV move exchange": 0.002}, x + 0.002)
        restore = lambda x: _record({"vote": 0.0, "last step": x}, x)  # noqa: E731
        return [{"replica": 0, "drop": drop(a), "restore": restore(a)},
                {"replica": 1, "drop": drop(b), "restore": restore(b)}]

    summary = ts.summarize([pair(0.010, 0.030), pair(0.020, 0.050), pair(0.040, 0.060)])
    move = summary["drop"]["steps_s"]["the KV move"]
    assert (move["median"], move["min"], move["max"], move["n"]) == (
        0.035, 0.010, 0.060, 6)
    assert list(summary["drop"]["steps_s"]) == ["vote", "the KV move", "the KV move exchange"]
    pause = summary["restore"]["pause_s"]  # the slower replica of each round: 30, 50, 60 ms
    assert (pause["median"], pause["min"], pause["max"], pause["n"]) == (0.050, 0.030, 0.060, 3)
    text = ts.markdown({"summary": summary, "settings": {
        "server_args": ["--dp-size", "2"], "streams_per_replica": 2, "rounds": 3},
        "meta": {"git": {"commit": "abc", "dirty": False}, "machine": {"cpu_cores": 2},
                 "load_before": [0, 0, 0], "load_after": [0, 0, 0], "command": "x"}})
    assert "| the KV move | 35.0 (10.0-60.0) |" in text
    assert "| **pause** | **50.0 (30.0-60.0)** |" in text
