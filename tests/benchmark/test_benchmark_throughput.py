"""benchmark/throughput.py: its pure parts, and the ``--quick`` run end to end (about 40 s here:
server start ~25 s warm, model load, 8 tiny runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# `benchmark` is a top-level folder, not an installed package; plain `pytest` (unlike
# `python -m pytest` from the root) does not put the repo root on sys.path.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmark.throughput import (  # noqa: E402
    BatchResult,
    Measurement,
    PhaseTiming,
    Stat,
    StreamEvent,
    batch_results,
    parse_args,
    phases_from_stream,
    prompt_windows,
    render_markdown,
    summarize,
)

QUICK_RUN_TIMEOUT_S = 600  # generous: a cold server start on a loaded 2-core machine took ~60 s


def test_prompt_windows_are_consecutive_and_disjoint():
    token_ids = list(range(20))
    assert prompt_windows(token_ids, first_window=0, batch_size=2, prompt_tokens=3) == [
        [0, 1, 2], [3, 4, 5],
    ]
    assert prompt_windows(token_ids, first_window=2, batch_size=3, prompt_tokens=3) == [
        [6, 7, 8], [9, 10, 11], [12, 13, 14],
    ]


def test_prompt_windows_refuse_to_run_past_the_text():
    assert len(prompt_windows(list(range(12)), 3, 1, 3)) == 1  # exactly the last window
    with pytest.raises(ValueError, match="need 15 token ids"):
        prompt_windows(list(range(12)), 4, 1, 3)


def test_windows_needed_counts_warmup_and_repetitions():
    config = parse_args(["--batch-sizes", "1,8", "--repetitions", "3"])
    assert config.windows_needed == 1 * 4 + 8 * 4


def test_phases_from_stream_splits_at_the_last_first_token():
    # B=2, D=3: both first tokens by t=1.0, then two decode steps each.
    events = [
        StreamEvent(0.5, 0, 1, 0), StreamEvent(1.0, 1, 1, 0),
        StreamEvent(1.5, 0, 2, 0), StreamEvent(1.6, 1, 2, 0),
        StreamEvent(2.0, 1, 3, 0), StreamEvent(2.5, 0, 3, 0),
    ]
    timing = phases_from_stream(0.0, events, batch_size=2, prompt_tokens=10, decode_tokens=3)
    assert timing == PhaseTiming(prefill_s=1.0, prefill_tokens=20, decode_s=1.5, decode_tokens=4)
    assert timing.prefill_tokens_per_s == 20.0
    assert timing.decode_tokens_per_s == pytest.approx(4 / 1.5)


def test_phases_from_stream_does_not_count_tokens_decoded_before_the_last_prefill():
    # Chunked prefill: sequence 0 decodes a token before sequence 1 gets its first one.
    events = [
        StreamEvent(1.0, 0, 1, 0), StreamEvent(1.2, 0, 2, 0), StreamEvent(2.0, 1, 1, 0),
        StreamEvent(2.5, 0, 3, 0), StreamEvent(2.5, 1, 2, 0), StreamEvent(3.0, 1, 3, 0),
    ]
    timing = phases_from_stream(0.0, events, batch_size=2, prompt_tokens=4, decode_tokens=3)
    assert (timing.prefill_s, timing.decode_s, timing.decode_tokens) == (2.0, 1.0, 3)


def test_phases_from_stream_rejects_missing_or_short_sequences():
    with pytest.raises(ValueError, match="expected sequences 0..1"):
        phases_from_stream(0.0, [StreamEvent(1.0, 0, 2, 0)], 2, 4, 2)
    with pytest.raises(ValueError, match="ended with"):
        phases_from_stream(0.0, [StreamEvent(1.0, 0, 1, 0)], 1, 4, 2)


def test_summarize_takes_median_min_max():
    assert summarize([3.0, 1.0, 2.0]) == Stat(median=2.0, min=1.0, max=3.0)
    assert summarize([4.0, 1.0]) == Stat(median=2.5, min=1.0, max=4.0)


def _measurement(engine: str, batch_size: int, repetition: int, prefill_s: float, decode_s: float):
    timing = PhaseTiming(
        prefill_s=prefill_s, prefill_tokens=100, decode_s=decode_s, decode_tokens=10
    )
    return Measurement(engine, batch_size, repetition, timing)


def test_batch_results_and_ratios():
    measurements = [
        _measurement("sglang", 1, 0, prefill_s=1.0, decode_s=1.0),
        _measurement("sglang", 1, 1, prefill_s=0.5, decode_s=2.0),
        _measurement("sglang", 1, 2, prefill_s=0.25, decode_s=0.5),
        _measurement("transformers", 1, 0, prefill_s=2.0, decode_s=1.0),
    ]
    [result] = batch_results(measurements, [1])
    assert result.sglang_prefill_tokens_per_s == Stat(median=200.0, min=100.0, max=400.0)
    assert result.sglang_decode_tokens_per_s.median == 10.0
    assert result.prefill_ratio == 200.0 / 50.0
    assert result.decode_ratio == 1.0


def test_render_markdown_has_one_row_per_batch_size():
    stat = Stat(median=100.0, min=90.0, max=110.0)
    half = Stat(median=50.0, min=50.0, max=50.0)
    results = [BatchResult(b, stat, half, half, stat) for b in (1, 8)]
    table = render_markdown(results, ["settings line"])
    assert "settings line" in table
    assert "| 1 | 100.0 | 50.0 | 2.00x | 50.0 | 100.0 | 0.50x |" in table
    assert "| 8 | 100.0 | 50.0 | 2.00x | 50.0 | 100.0 | 0.50x |" in table


def test_parse_args_quick_defaults_and_explicit_flags_win(tmp_path):
    quick = parse_args(["--quick"])
    assert (quick.batch_sizes, quick.prompt_tokens, quick.decode_tokens, quick.repetitions) == (
        (1, 2), 32, 8, 1,
    )
    assert quick.out_json.parent.name == "raw"  # smoke runs never overwrite the real results
    full = parse_args(["--batch-sizes", "4", "--out", str(tmp_path / "t.json")])
    assert (full.batch_sizes, full.prompt_tokens, full.decode_tokens) == ((4,), 256, 64)
    assert full.out_md == tmp_path / "t.md"
    with pytest.raises(ValueError, match=">= 2 new tokens"):
        parse_args(["--decode-tokens", "1"])


@pytest.mark.server
def test_quick_run_end_to_end(tmp_path, room_for_a_server):
    out_json = tmp_path / "throughput.json"
    subprocess.run(
        [sys.executable, "-m", "benchmark.throughput", "--quick", "--out", str(out_json)],
        cwd=REPO_ROOT, check=True, timeout=QUICK_RUN_TIMEOUT_S,
    )
    report = json.loads(out_json.read_text())
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        for engine in ("sglang", "transformers"):
            for phase in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                assert row[engine][phase]["median"] > 0
    sglang_runs = [m for m in report["measurements"] if m["engine"] == "sglang"]
    assert len(sglang_runs) == 2
    # Fresh prompts every run: the radix cache must not serve any prompt token.
    assert all(m["cached_prompt_tokens"] == 0 for m in sglang_runs)
    assert out_json.with_suffix(".md").read_text().count("\n| ") == 3  # header + 2 rows
