"""The W4 side-by-side GPU benchmark runs end to end without a GPU (Triton's interpreter).

Its device run is one call with no second chance, so the script itself is run here on tiny
shapes: every implementation is built and called, a library that cannot run is recorded as an
error rather than ending the run, each linear runs in its own process and the results merge.
The numbers of this dry run mean nothing (one eager call per timing; the interpreter's bf16
dot multiplies raw bit patterns), except the cuBLAS-side paths, which run in torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("w4")
    env = {**os.environ, "OUT": str(out), "W4_BENCH_DEVICE": "cpu", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "python"),
                                          str(REPO / "sgl-kernel" / "morph-kernels" / "python"),
                                          str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "benchmark.gpu.w4_side_by_side", "--only",
                           "qkv_proj"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "w4_side_by_side.json").read_text()), proc.stdout


def test_every_point_has_every_implementation(dry_run):
    result, _ = dry_run
    assert result["processes"] == {"qkv_proj": "exit 0"}
    points = {(r["input_scale"], r["tokens"]) for r in result["rows"]}
    assert points == {(awq, t) for awq in (False, True) for t in (1, 8, 16, 40)}
    for row in result["rows"]:
        expected = {"bf16_cublas", "triton", "dequant_cublas", "served"}
        if not row["input_scale"]:
            expected |= {"previous", "tinygemm", "torchao"}
        assert expected <= set(row["impls"])
        assert row["served_backend"] in ("triton", "dequant_cublas")


def test_a_library_that_cannot_run_is_recorded_not_fatal(dry_run):
    result, _ = dry_run
    plain = [r for r in result["rows"] if not r["input_scale"]]
    # torch's tinygemm int4 op has no CPU kernel: an error cell, and the run went on.
    assert all("error" in r["impls"]["tinygemm"] for r in plain)
    assert all("ms" in r["impls"]["dequant_cublas"] for r in result["rows"])


def test_the_cublas_paths_match_the_reference(dry_run):
    result, _ = dry_run
    for row in result["rows"]:
        assert row["impls"]["bf16_cublas"]["rel_error"] < 5e-3
        assert row["impls"]["dequant_cublas"]["rel_error"] < 1e-2


def test_choices_and_markdown_are_reported(dry_run):
    result, stdout = dry_run
    buckets = {(c["input_scale"], c["bucket"]) for c in result["choices"]}
    assert {(awq, b) for awq in (False, True) for b in (1, 2, 4, 8, 16, 32, 64)} <= buckets
    assert "# W4A16 at Llama-3-8B shapes, side by side" in stdout
    assert "## With an AWQ input scale (as served)" in stdout


def test_report_takes_medians_over_the_committed_runs():
    import statistics

    from benchmark.gpu import w4_report

    directory = REPO / "benchmark" / "results" / "gpu" / "h200_c5a33ab"
    runs = [json.loads(p.read_text()) for p in sorted(directory.glob("w4_ours_r*.json"))]
    assert len(runs) == 3
    _, medians = w4_report.served_runs(runs)
    key = ("gate_up_proj", False, 1)
    ratios = []
    for run in runs:
        row = next(r for r in run["rows"] if w4_report._key(r) == key)
        ratios.append(row["impls"]["bf16_cublas"]["ms"] / row["impls"]["served"]["ms"])
    assert medians[key]["ratio"] == statistics.median(ratios)
    text = w4_report.markdown(directory)
    assert "## Against the W4 targets" in text and "| gate_up_proj |" in text
