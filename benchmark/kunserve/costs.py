"""Measure KunServe's chunk cost model on this machine, through a real SGLang server.

The server runs with ``SGLANG_MORPH_FORWARD_TIMINGS`` (``kunserve/live/forward_timings.py``):
each scheduler forward is timed around ``ModelRunner.forward`` and logged with its chunks as
SGLang ran them (its own prefix and extend lengths). So a point is the forward alone (model and
logits), not a client's end-to-end latency (HTTP, tokenizer and scheduler IPC, scheduling,
sampling), and its ``(p, c)`` are what ran, not what was asked for.

Prefill points (grid ``PREFILL_CACHED x PREFILL_NEW`` at one request, ``PREFILL_BATCHED`` at 2
and 4): ``b`` random prompts of ``p`` tokens are prefilled (the radix cache keeps them), then
the same prompts extended by ``c`` fresh tokens run as one batch with ``max_new_tokens=1``;
the extend forward whose chunks are ``b x (p, c)`` is the point (another shape, e.g. a batch
SGLang split in two, is counted as a miss). Each repetition uses fresh new tokens behind the
same prefix. Decode points (grid ``DECODE_CONTEXT x DECODE_BATCH``): ``b`` prompts of ``p``
tokens generate ``DECODE_STEPS`` tokens; every decode forward of all ``b`` requests is a step
at contexts ``p .. p + DECODE_STEPS - 2``; the point is the mean over steps of each step's
median over repetitions, at the mean context (the model is linear in ``p`` for ``c = 1``).

A point's time is the median of ``--repeats`` runs (all runs are kept). A seeded quarter of
each phase's grid points is held out; the fit uses the rest. Two models per phase: KunServe's
as the paper writes it (alpha, beta, gamma) and with torch_native's padded prefix (``+ delta
p^2 + epsilon p``, ``cost.TORCH_NATIVE_TERMS``; prefill only: a decode step attends with its
one row, no padding). The results (JSON with every run, and a table) are written by this
script; ``--refit`` fits them again without a server; ``--resume`` measures only the grid
points the results lack (a full grid takes longer than one quiet window on a slow, shared machine).

    .venv/bin/python -m benchmark.kunserve.costs [--out benchmark/results/kunserve]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from benchmark.harness import git_state, load_average, run_meta, running_server
from sglang_morph.kunserve.cost import (
    KUNSERVE_TERMS,
    TORCH_NATIVE_TERMS,
    Chunk,
    ForwardTiming,
    PhaseCosts,
    fit_chunk_cost,
    relative_errors,
    timings_from_json,
    timings_to_json,
)
from sglang_morph.kunserve.live.forward_timings import ENV as TIMINGS_ENV

PREFILL_CACHED = (0, 256, 512, 1024, 1536, 2048)
PREFILL_NEW = (16, 64, 128, 256, 512, 1024)
PREFILL_BATCHED = {2: ((0, 64), (0, 256), (512, 64), (512, 256), (1536, 64), (1536, 256)),
                   4: ((0, 64), (0, 256), (512, 64), (512, 256), (1536, 64), (1536, 256))}
DECODE_CONTEXT = (64, 512, 1024, 2048)
DECODE_BATCH = (1, 2, 4, 8, 16)
DECODE_MAX_TOKENS = 8192  # b * p at most: the prompts' prefill is not what is measured
DECODE_STEPS = 9  # generated tokens: the first from the prefill, then 8 decode forwards
MAX_BATCH_TOKENS = 8192  # one forward per point (no chunked prefill splitting it)
HELD_OUT_SHARE = 0.25
MIN_POINTS_TO_HOLD_OUT = 8
RAW = Path("benchmark/results/raw")  # server log and the forward timings (git-ignored)
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # ordinary tokens of the default model's vocabulary
SERVER_ARGS = ("--chunked-prefill-size", str(MAX_BATCH_TOKENS),
               "--max-prefill-tokens", str(MAX_BATCH_TOKENS))


class Client:
    """Requests to the server, and the forwards its scheduler logged since the last read."""

    def __init__(self, url: str, seed: int, timings_path: Path):
        self.http = httpx.Client(base_url=url, timeout=600.0)
        self.rng = np.random.default_rng(seed)
        self.timings_path = timings_path
        self.read_at = 0
        self.forwards()  # the server's own warm-up forwards are not points

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        r = self.http.post("/generate", json={
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}})
        r.raise_for_status()

    def flush_cache(self) -> None:
        self.http.post("/flush_cache").raise_for_status()

    def forwards(self) -> list[dict]:
        """The forwards logged since the last call (the request that caused them has been
        answered, so its forwards are in the file)."""
        with open(self.timings_path) as f:
            f.seek(self.read_at)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.read_at += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines()]


def prefill_runs(client: Client, p: int, c: int, b: int, repeats: int) -> tuple[list[float], int]:
    """``repeats`` forwards of ``b x (p, c)`` behind one set of cached prefixes; the misses."""
    client.flush_cache()
    prefixes = [client.tokens(p) for _ in range(b)]
    if p:
        client.generate(prefixes, 1)
        client.forwards()
    runs, misses = [], 0
    for _ in range(repeats):
        client.generate([pre + client.tokens(c) for pre in prefixes], 1)
        hits = [f["seconds"] for f in client.forwards() if f["mode"] == "extend"
                and sorted(zip(f["cached"], f["new"])) == [(p, c)] * b]
        runs += hits[:1]
        misses += not hits
    return runs, misses


def decode_runs(client: Client, p: int, b: int, repeats: int) -> dict[int, list[float]]:
    """Step -> its times over ``repeats`` runs of ``b`` prompts of ``p`` tokens (prefilled by
    the first run and cached for the others, whose prefill is one token each)."""
    client.flush_cache()
    prompts = [client.tokens(p) for _ in range(b)]
    steps: dict[int, list[float]] = {}
    for _ in range(repeats):
        client.generate(prompts, DECODE_STEPS)
        for f in client.forwards():
            if f["mode"] == "decode" and len(f["cached"]) == b:
                step = min(f["cached"]) - p
                if max(f["cached"]) - p == step and 0 <= step < DECODE_STEPS - 1:
                    steps.setdefault(step, []).append(f["seconds"])
    return steps


def grid() -> list[tuple[str, int, int, int]]:
    points = [("prefill", p, c, 1) for p in PREFILL_CACHED for c in PREFILL_NEW]
    points += [("prefill", p, c, b) for b, pcs in PREFILL_BATCHED.items() for p, c in pcs]
    points += [("decode", p, 1, b) for p in DECODE_CONTEXT for b in DECODE_BATCH
               if b * p <= DECODE_MAX_TOKENS]
    return points


def measure(client: Client, repeats: int, deadline: float, progress: Path,
            done: list[dict]) -> list[dict]:
    """Every grid point in a seeded order (a stretch of load on the machine does not fall on
    one kind of point; a run stopped by its time limit still holds both phases), except the
    points already in ``done`` (a resumed run), which are kept."""
    prefill_runs(client, 64, 64, 1, 2)  # first forwards of a shape pay one-time costs
    decode_runs(client, 64, 2, 1)
    points = grid()
    order = np.random.default_rng(len(points)).permutation(len(points))
    measured = {(r["phase"], *r["grid"]) for r in done}
    records = list(done)
    for k, i in enumerate(order):
        phase, p, c, b = points[i]
        if (phase, p, c, b) in measured:
            continue
        if time.monotonic() > deadline:
            print(f"time limit: stopped after {k} of {len(points)} points", flush=True)
            break
        if phase == "prefill":
            runs, misses = prefill_runs(client, p, c, b, repeats)
            if not runs:
                print(f"[{k + 1}/{len(points)}] prefill p={p} c={c} b={b}: no forward of that "
                      f"shape in {repeats} runs", flush=True)
                continue
            record = {"phase": phase, "grid": [p, c, b], "chunks": [[p, c]] * b,
                      "seconds": statistics.median(runs), "runs_s": runs, "misses": misses}
        else:
            steps = decode_runs(client, p, b, repeats)
            if not steps:
                print(f"[{k + 1}/{len(points)}] decode p={p} b={b}: no decode step of all "
                      f"{b} requests", flush=True)
                continue
            mean_context = p + round(statistics.mean(steps))
            record = {"phase": phase, "grid": [p, 1, b], "chunks": [[mean_context, 1]] * b,
                      "seconds": statistics.mean(statistics.median(v) for v in steps.values()),
                      "runs_s": {str(s): v for s, v in sorted(steps.items())}}
        records.append(record)
        progress.write_text(json.dumps(records))  # a run cut short keeps what it measured
        print(f"[{k + 1}/{len(points)}] {phase} p={p} c={c} b={b}: "
              f"{record['seconds'] * 1e3:.1f} ms", flush=True)
    return records


def split_held_out(records: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """A seeded quarter of the grid points held out (a point with all its runs, so no run of
    a held-out point is seen by the fit)."""
    rng = np.random.default_rng(seed)
    held = set(rng.permutation(len(records))[: round(HELD_OUT_SHARE * len(records))].tolist())
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def timing(record: dict) -> ForwardTiming:
    return timings_from_json([record])[0]


# Decode attends with its one query row, unpadded: the torch_native terms are prefill-only.
VARIANTS = {"kunserve": {"prefill": KUNSERVE_TERMS, "decode": KUNSERVE_TERMS},
            "kunserve + torch_native prefix":
                {"prefill": TORCH_NATIVE_TERMS, "decode": KUNSERVE_TERMS}}
USED = "kunserve + torch_native prefix"


def fit_and_evaluate(records: list[dict], seed: int, source: str) -> dict:
    """Both variants per phase, fitted on the same training points and scored on the same
    held-out ones. The simulation and the lookahead use ``USED``: KunServe's terms cannot
    express what torch_native's extend does with a cached prefix (``cost.py``)."""
    fits: dict[str, dict] = {}
    models: dict[str, dict] = {}
    split = {}
    for phase in ("prefill", "decode"):
        own = [r for r in records if r["phase"] == phase]
        # Too few points to spare any: fit them all and report no held-out error.
        split[phase] = split_held_out(own, seed) if len(own) >= MIN_POINTS_TO_HOLD_OUT \
            else (own, [])
    for variant, terms in VARIANTS.items():
        fits[variant], models[variant] = {}, {}
        for phase in ("prefill", "decode"):
            train, test = split[phase]
            model = fit_chunk_cost([timing(r) for r in train], terms[phase])
            models[variant][phase] = model
            train_err = relative_errors(model, [timing(r) for r in train])
            test_err = relative_errors(model, [timing(r) for r in test]) if test else None
            fits[variant][phase] = {
                "coefficients": dataclasses.asdict(model), "terms": list(terms[phase]),
                "points": len(train) + len(test), "train_points": len(train),
                "held_out_points": len(test),
                "train_mean_error": float(train_err.mean()),
                "held_out_mean_error": float(test_err.mean()) if test else None,
                "held_out_max_error": float(test_err.max()) if test else None}
    fit = PhaseCosts(models[USED]["prefill"], models[USED]["decode"], f"{source}, {USED}")
    held = {id(r) for phase in split.values() for r in phase[1]}
    points = [{**r, "held_out": id(r) in held,
               "predicted_s": {v: models[v][r["phase"]].seconds(timing(r).chunks)
                               for v in VARIANTS}} for r in records]
    return {"fit": fit.to_json(), "chosen": USED, "fits": fits, "points": points}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def write_markdown(path: Path, result: dict) -> None:
    meta = result["meta"]
    lines = ["# KunServe chunk cost model, measured on this machine (real SGLang server)", "",
             f"`{meta['command']}` at commit {meta['git']['commit']} "
             f"(dirty: {meta['git']['dirty']}), {meta['started_utc']} UTC, "
             f"{meta['machine']['cpu_model']}, {meta['machine']['cpu_cores']} cores, sglang "
             f"{meta['machine']['versions']['sglang']}, default dtype, torch_native attention; "
             f"load average before {meta['load_before']}, after {meta['load_after']}; "
             f"{meta['seconds']:.0f} s. Fitted at commit {result['fitted_at']}.", "",
             *[f"- run {i + 1}: `{r['command']}` at {r['git']['commit']}, {r['started_utc']} "
               f"UTC, load {r['load_before']} -> {r['load_after']}, {r['seconds']:.0f} s"
               for i, r in enumerate(meta.get("runs", []))], "",
             "cost(batch) = gamma + sum_i [alpha (p_i c_i + c_i^2 + c_i) + beta c_i] "
             "(KunServe) + delta sum_i p_i^2 + epsilon sum_i p_i (torch_native's extend pads "
             "each request's query over its cached prefix: attention in p^2, gathered and "
             "padded rows in p; prefill only). Times: the scheduler's `ModelRunner.forward` "
             "(model and logits, no sampling, scheduling or HTTP), logged by "
             "`SGLANG_MORPH_FORWARD_TIMINGS` with the chunks SGLang ran; median of "
             f"{meta['repeats']} runs per point (decode: mean over {DECODE_STEPS - 1} steps of "
             f"each step's median); {HELD_OUT_SHARE:.0%} of each phase's points held out "
             f"(seed {meta['seed']}). Used by the simulation and the lookahead: "
             f"**{result['chosen']}**.", "",
             "| model | phase | alpha (s) | beta (s/token) | gamma (s) | delta (s) | "
             "epsilon (s/token) | points (train + held out) | train mean err | "
             "held-out mean err | held-out max err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant, phases in result["fits"].items():
        for phase, e in phases.items():
            f = e["coefficients"]
            lines.append(
                f"| {variant} | {phase} | {f['alpha_s']:.3e} | {f['beta_s']:.3e} | "
                f"{f['gamma_s']:.3e} | {f['delta_s']:.3e} | {f['epsilon_s']:.3e} | "
                f"{e['train_points']} + {e['held_out_points']} | "
                f"{e['train_mean_error']:.1%} | {_pct(e['held_out_mean_error'])} | "
                f"{_pct(e['held_out_max_error'])} |")
    names = list(result["fits"])
    lines += ["", "Every point (ms; error relative to the measured median):", "",
              "| phase | p | c | b | held out | measured | runs | "
              + " | ".join(f"{n} (err)" for n in names) + " |",
              "|---|---|---|---|---|---|---|" + "---|" * len(names)]
    for r in sorted(result["points"], key=lambda r: (r["phase"], *r["grid"])):
        p, c, b = r["grid"]
        runs = (r["runs_s"] if isinstance(r["runs_s"], list)
                else [t for v in r["runs_s"].values() for t in v])
        spread = f"{min(runs) * 1e3:.1f}-{max(runs) * 1e3:.1f} ({len(runs)})"
        cells = [f"{r['predicted_s'][n] * 1e3:.1f} "
                 f"({abs(r['predicted_s'][n] / r['seconds'] - 1):.1%})" for n in names]
        lines.append(f"| {r['phase']} | {p} | {c} | {b} | {'yes' if r['held_out'] else ''} | "
                     f"{r['seconds'] * 1e3:.1f} | {spread} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmark.kunserve.costs",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit-s", type=float, default=14 * 60,
                    help="stop measuring past this many seconds and fit the points measured")
    ap.add_argument("--refit", action="store_true",
                    help="fit OUT/costs.json's points again (no server)")
    ap.add_argument("--resume", action="store_true",
                    help="measure only the grid points OUT/costs.json lacks and fit them all "
                         "(each run's command, commit and load are kept in meta.runs)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    previous = {"points": [], "meta": {}}
    if args.refit or args.resume:
        previous = json.loads((args.out / "costs.json").read_text())
    done = [{k: v for k, v in r.items() if k not in ("held_out", "predicted_s")}
            for r in previous["points"]]
    if args.refit:
        write_results(args.out, done, previous["meta"])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # A background run ignores SIGINT; SIGTERM must still stop the server (the with block).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.monotonic()
    started_utc = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    load_before = load_average()
    RAW.mkdir(parents=True, exist_ok=True)
    timings_path = (RAW / "kunserve_forward_timings.jsonl").resolve()
    timings_path.unlink(missing_ok=True)
    timings_path.touch()
    with running_server(SERVER_ARGS, RAW / "kunserve_costs_server.log",
                        env={TIMINGS_ENV: str(timings_path)}) as server:
        records = measure(Client(server.url, args.seed, timings_path), args.repeats,
                          started + args.time_limit_s, RAW / "kunserve_costs_progress.json",
                          done)
    meta = run_meta(f"python -m benchmark.kunserve.costs --repeats {args.repeats} "
                    f"--seed {args.seed}", load_before, repeats=args.repeats, seed=args.seed,
                    server_args=list(SERVER_ARGS), started_utc=started_utc,
                    seconds=time.monotonic() - started)
    if args.resume:
        earlier = previous["meta"].get("runs") or [
            {k: v for k, v in previous["meta"].items() if k != "runs"}]
        meta["runs"] = earlier + [{k: v for k, v in meta.items() if k != "machine"}]
    write_results(args.out, records, meta)


def write_results(out: Path, records: list[dict], meta: dict) -> None:
    source = f"{meta['machine']['cpu_model']}, commit {meta['git']['commit']}"
    result = {**fit_and_evaluate(records, meta["seed"], source),
              "fitted_at": git_state()["commit"], "meta": meta}
    (out / "costs.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "costs.md", result)
    print(json.dumps(result["fits"], indent=1))


if __name__ == "__main__":
    main()
