"""What a replay's servers spent per forward: the chunk cost model fitted on the forwards an
arm's schedulers ran during the replay itself, and the time each scheduler spent between two
forwards while it had work.

The log is the one ``SGLANG_MORPH_FORWARD_TIMINGS`` makes (``kunserve/live/forward_timings.py``:
one line per forward with its start ``t``, its chunks and its seconds, per scheduler ``pid``).
Fitted under the replay's own conditions (dtype, one thread per replica, both replicas and the
client sharing the cores), the model is what a simulation of that replay must use; the cost
model of ``benchmark.kunserve.costs`` was measured on an idle server.

The *step gap* is the time from the end of a forward to the start of the next one of the same
scheduler, counted only when it is short (``BUSY_GAP_S``: the scheduler went straight on, so the
gap is its own per-step work: sampling, the batch's results, scheduling, IPC), not when it
waited for requests.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sglang_morph.kunserve.cost import (
    KUNSERVE_TERMS,
    TORCH_NATIVE_TERMS,
    Chunk,
    ForwardTiming,
    PhaseCosts,
    fit_chunk_cost,
    relative_errors,
)

BUSY_GAP_S = 0.05  # longer gaps are idle waits, not a step's own work


def read_log(path: Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def timings_of(forwards: Sequence[dict[str, Any]]) -> list[ForwardTiming]:
    """The forwards with chunks, as ``ForwardTiming``s (a batch SGLang ran with no chunk
    lengths, e.g. an idle forward, has none)."""
    out = []
    for f in forwards:
        if f["new"] and f["seconds"] > 0:
            chunks = tuple(Chunk(int(p), int(c)) for p, c in zip(f["cached"], f["new"]))
            if len({ch.phase for ch in chunks}) == 1:
                out.append(ForwardTiming(chunks, float(f["seconds"])))
    return out


def step_gaps_s(forwards: Sequence[dict[str, Any]]) -> list[float]:
    """Each scheduler's gaps between a forward's end and its next forward's start, busy only."""
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for f in forwards:
        if "t" in f:
            by_pid[f["pid"]].append(f)
    gaps = []
    for own in by_pid.values():
        own.sort(key=lambda f: f["t"])
        for a, b in zip(own, own[1:]):
            gap = b["t"] - (a["t"] + a["seconds"])
            if 0 <= gap <= BUSY_GAP_S:
                gaps.append(gap)
    return gaps


def _fit(timings: list[ForwardTiming], phase: str):
    """torch_native's padded-prefix terms for prefill where the forwards determine them (a
    replay without cached prefixes does not), KunServe's terms otherwise."""
    own = [t for t in timings if t.phase == phase]
    for terms in ((TORCH_NATIVE_TERMS, KUNSERVE_TERMS) if phase == "prefill"
                  else (KUNSERVE_TERMS,)):
        try:
            return fit_chunk_cost(own, terms), terms, own
        except ValueError:
            continue
    raise ValueError(f"the log's {len(own)} {phase} forwards determine no cost model")


def in_windows(forward: dict[str, Any], windows: Sequence[tuple[float, float]]) -> bool:
    """The logged forward started inside one of ``windows`` (unix seconds, ends included)."""
    return any(a <= forward.get("t", 0.0) <= b for a, b in windows)


def summarize(forwards: Sequence[dict[str, Any]], source: str,
              merged_windows: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The fitted ``PhaseCosts`` (``fit``, the form ``PhaseCosts.from_json`` reads), each
    phase's terms, forwards and mean error, and the step gaps' median and count.

    With ``merged_windows`` (unix seconds a KunServe pair was merged) the fit and the gaps
    take the forwards outside them, and ``merged_decode_ratio`` / ``merged_prefill_ratio`` are
    the medians of the merged decode / prefill forwards' seconds over what that fit gives the
    same batch on a whole replica (a merged forward's seconds run from the replica's first
    layer to the peer's answer, micro-batches and waits for the peer's stage included)."""
    inside, outside = [], []
    for f in forwards:
        (inside if in_windows(f, merged_windows) else outside).append(f)
    out = _summarize(outside, source)
    if merged_windows:
        fit = PhaseCosts.from_json(out["fit"])
        for phase, model in (("decode", fit.decode), ("prefill", fit.prefill)):
            ratios = [t.seconds / model.seconds(t.chunks) for t in timings_of(inside)
                      if t.phase == phase]
            out[f"merged_{phase}_ratio"] = {
                "median": statistics.median(ratios) if ratios else None,
                "forwards": len(ratios)}
    return out


def _summarize(forwards: Sequence[dict[str, Any]], source: str) -> dict[str, Any]:
    timings = timings_of(forwards)
    fits, models = {}, {}
    for phase in ("prefill", "decode"):
        model, terms, own = _fit(timings, phase)
        models[phase] = model
        err = relative_errors(model, own)
        fits[phase] = {"terms": list(terms), "forwards": len(own),
                       "mean_error": float(err.mean()),
                       "median_seconds": float(np.median([t.seconds for t in own]))}
    gaps = step_gaps_s(forwards)
    return {"fit": PhaseCosts(models["prefill"], models["decode"], source).to_json(),
            "phases": fits, "schedulers": len({f["pid"] for f in forwards}),
            "step_gap_s": {"median": statistics.median(gaps) if gaps else None,
                           "count": len(gaps)}}


def main(argv: Sequence[str] | None = None) -> int:
    """Fit a replay's forward logs again (its ``raw/<arm>_forwards.jsonl``) into its results,
    e.g. after this module learned something new."""
    import argparse

    from benchmark.replay import dp2

    ap = argparse.ArgumentParser(prog="python -m benchmark.replay.forwards",
                                 description=main.__doc__.splitlines()[0])
    ap.add_argument("rounds", nargs="+", type=Path, help="output directories of `benchmark."
                    "replay --dp2` whose raw/ holds the forward logs")
    args = ap.parse_args(argv)
    for path in args.rounds:
        report = json.loads((path / "replay_dp2.json").read_text())
        for name, arm in report["dp2"]["configs"].items():
            if "records" in arm:
                arm["forwards"] = dp2.arm_forwards(path / "raw" / f"{name}_forwards.jsonl",
                                                   arm, name)
        (path / "replay_dp2.json").write_text(json.dumps(report, indent=1))
        print(f"[forwards] refitted {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
