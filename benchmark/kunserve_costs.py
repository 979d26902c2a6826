"""Measure KunServe's chunk cost model on this machine, through a real SGLang server.

Prefill chunks: for every (p cached tokens, c new tokens, b requests) point, ``b`` random
prompts of ``p`` tokens are prefilled once (the radix cache keeps them), then the same prompts
extended by ``c`` fresh tokens run as one batch with ``max_new_tokens=1``; SGLang reports
``cached_tokens`` (checked to equal ``p``) and its own ``e2e_latency`` per request, which is
the forward of the ``c`` tokens plus the fixed per-request path (IPC, scheduling, sampling,
detokenizing) that the model's ``gamma`` absorbs.

Decode steps: ``b`` fresh prompts of ``p`` tokens run once with ``max_new_tokens=1`` and once
(other fresh prompts, the same prefill) with ``N``; ``(e2e(N) - e2e(1)) / (N - 1)`` is one
decode step of the batch, at the mean context ``p + N/2`` (the model is linear in ``p`` for
``c = 1``, so the mean step is the step at the mean context).

Every point is the fastest of ``--repeats`` runs (other work on a shared 2-core machine only
ever makes a run slower, so the fastest is the least disturbed one). A fixed quarter of the points (seeded) is held
out; the fit uses the rest, and the held-out mean relative error is reported per phase.

    .venv/bin/python -m benchmark.kunserve_costs [--out benchmark/results/kunserve]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from benchmark.harness import git_state, load_average, machine_info, running_server
from sglang_morph.kunserve.cost import (
    Chunk,
    ForwardTiming,
    PhaseCosts,
    fit_chunk_cost,
    relative_errors,
    timings_from_json,
    timings_to_json,
)

# About 7 minutes on this 2-core machine (prefill ~900 tokens/s, a decode step 50-150 ms);
# batched points only up to BATCHED_TOKENS tokens in the forward.
PREFILL_CACHED = (0, 256, 1024, 2048)
PREFILL_NEW = (16, 128, 512, 1024)
PREFILL_BATCH = (1, 2)
DECODE_CONTEXT = (32, 512, 1024, 2048)
DECODE_BATCH = (1, 4, 8)
BATCHED_TOKENS = 4096
DECODE_STEPS = 34  # 33 decode steps after the prefill's token: cached p+1 .. p+33, mean p+17
MAX_BATCH_TOKENS = 8192  # one forward (no chunked prefill splitting a point)
HELD_OUT_SHARE = 0.25
MIN_POINTS_TO_HOLD_OUT = 8
RAW = Path("benchmark/results/raw")  # server log and partial progress (git-ignored)
VOCAB_LOW, VOCAB_HIGH = 1000, 40000  # ordinary tokens of the default model's vocabulary
SERVER_ARGS = ("--chunked-prefill-size", str(MAX_BATCH_TOKENS),
               "--max-prefill-tokens", str(MAX_BATCH_TOKENS))


class Client:
    def __init__(self, url: str, seed: int):
        self.http = httpx.Client(base_url=url, timeout=600.0)
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(VOCAB_LOW, VOCAB_HIGH, n).tolist()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
        r = self.http.post("/generate", json={
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}})
        r.raise_for_status()
        out = r.json()
        return out if isinstance(out, list) else [out]

    def e2e_s(self, outs: list[dict]) -> float:
        # One forward serves the whole batch: the slowest member's path is the batch's.
        return max(float(o["meta_info"]["e2e_latency"]) for o in outs)


def prefill_point(client: Client, p: int, c: int, b: int) -> float:
    prefixes = [client.tokens(p) for _ in range(b)]
    if p:
        client.generate(prefixes, 1)
    outs = client.generate([pre + client.tokens(c) for pre in prefixes], 1)
    cached = [int(o["meta_info"]["cached_tokens"]) for o in outs]
    if cached != [p] * b:
        raise RuntimeError(f"prefill point p={p} c={c} b={b}: cached_tokens {cached}, "
                           f"expected {p} each (radix cache off or evicted?)")
    return client.e2e_s(outs)


def decode_point(client: Client, p: int, b: int) -> float:
    one = client.e2e_s(client.generate([client.tokens(p) for _ in range(b)], 1))
    many = client.e2e_s(client.generate([client.tokens(p) for _ in range(b)], DECODE_STEPS))
    return (many - one) / (DECODE_STEPS - 1)


def measure(client: Client, repeats: int, deadline: float,
            progress: Path) -> list[ForwardTiming]:
    points: list[tuple[str, int, int, int]] = []
    for b in PREFILL_BATCH:
        for p in PREFILL_CACHED:
            for c in PREFILL_NEW:
                if b == 1 or b * (p + c) <= BATCHED_TOKENS * 5 // 8:
                    points.append(("prefill", p, c, b))
    for b in DECODE_BATCH:
        for p in DECODE_CONTEXT:
            if b * p <= BATCHED_TOKENS:
                points.append(("decode", p, 1, b))
    # Warm-up: first forwards of each shape pay one-time costs (allocator, kernels).
    prefill_point(client, 64, 64, 1)
    decode_point(client, 64, 1)
    # A seeded shuffle: a run cut short by its time limit still holds both phases and all
    # sizes, and a stretch of other load on the machine does not fall on one kind of point.
    order = np.random.default_rng(len(points)).permutation(len(points))
    points = [points[i] for i in order]
    timings = []
    for k, (phase, p, c, b) in enumerate(points):
        if time.monotonic() > deadline:
            print(f"time limit: stopped after {k} of {len(points)} points", flush=True)
            break
        runs = [prefill_point(client, p, c, b) if phase == "prefill" else decode_point(client, p, b)
                for _ in range(repeats)]
        seconds = min(runs)
        cached = p if phase == "prefill" else p + DECODE_STEPS // 2
        timings.append(ForwardTiming(tuple(Chunk(cached, c) for _ in range(b)), seconds))
        # Kept as it goes: a run cut short still leaves what it measured.
        progress.write_text(json.dumps(timings_to_json(timings)))
        print(f"[{k + 1}/{len(points)}] {phase} p={p} c={c} b={b}: {seconds * 1e3:.1f} ms "
              f"(runs {', '.join(f'{r * 1e3:.1f}' for r in runs)})", flush=True)
    return timings


def split_held_out(timings: list[ForwardTiming], seed: int):
    rng = np.random.default_rng(seed)
    held = set(rng.permutation(len(timings))[: round(HELD_OUT_SHARE * len(timings))].tolist())
    train = [t for i, t in enumerate(timings) if i not in held]
    test = [t for i, t in enumerate(timings) if i in held]
    return train, test


VARIANTS = {"kunserve": False, "kunserve + delta p^2": True}


def fit_and_evaluate(timings: list[ForwardTiming], seed: int, source: str) -> dict:
    """Both variants of the model per phase (KunServe's, and with the ``p^2`` term SGLang's
    torch_native attention adds), fitted on the same training points; the simulation and the
    lookahead use the variant with the lower held-out prefill error."""
    fits: dict[str, dict] = {}
    models: dict[str, dict] = {}
    for variant, squared in VARIANTS.items():
        fits[variant], models[variant] = {}, {}
        for phase in ("prefill", "decode"):
            own = [t for t in timings if t.phase == phase]
            # Too few points to spare any: fit them all and report no held-out error.
            train, test = split_held_out(own, seed) if len(own) >= MIN_POINTS_TO_HOLD_OUT \
                else (own, [])
            # Decode attends with one query row: the p^2 term is a prefill-only effect.
            model = fit_chunk_cost(train, prefix_squared=squared and phase == "prefill")
            models[variant][phase] = model
            train_err = relative_errors(model, train)
            test_err = relative_errors(model, test) if test else None
            fits[variant][phase] = {
                "coefficients": dataclasses.asdict(model), "points": len(own),
                "train_points": len(train), "held_out_points": len(test),
                "train_mean_error": float(train_err.mean()),
                "held_out_mean_error": float(test_err.mean()) if test else None,
                "held_out_max_error": float(test_err.max()) if test else None}
    chosen = min(VARIANTS, key=lambda v: fits[v]["prefill"]["held_out_mean_error"]
                 if fits[v]["prefill"]["held_out_mean_error"] is not None
                 else fits[v]["prefill"]["train_mean_error"])
    fit = PhaseCosts(models[chosen]["prefill"], models[chosen]["decode"],
                     f"{source}, {chosen}")
    return {"fit": fit.to_json(), "chosen": chosen, "fits": fits}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def write_markdown(path: Path, result: dict) -> None:
    meta = result["meta"]
    lines = ["# KunServe chunk cost model, measured on this machine (real SGLang server)", "",
             f"Measured with `{meta['command']}` at commit {meta['git']['commit']} "
             f"(dirty: {meta['git']['dirty']}), {meta['machine']['cpu_model']}, "
             f"{meta['machine']['cpu_cores']} cores, sglang {meta['machine']['versions']['sglang']}, "
             f"default dtype, torch_native attention; load average before {meta['load_before']}, "
             f"after {meta['load_after']}; `uptime` after: {meta['uptime']}; "
             f"{meta['seconds']:.0f} s. Fitted at commit {result['fitted_at']}.", "",
             *[f"- {key.replace('_', ' ')}: {value}" for key, value in meta.items()
               if key.endswith("_provenance")], "",
             "cost(batch) = gamma + sum_i [alpha (p_i c_i + c_i^2 + c_i) + beta c_i] "
             "(+ delta sum_i p_i^2 in the second variant: SGLang's torch_native extend pads each "
             "request's query to the whole sequence, so its attention also grows with p^2); "
             "server-side `e2e_latency`, fastest of "
             f"{meta['repeats']} runs per point, {HELD_OUT_SHARE:.0%} of the points held out "
             f"(seed {meta['seed']}). Used by the simulation and the lookahead: "
             f"**{result['chosen']}**.", "",
             "| model | phase | alpha (s) | beta (s/token) | gamma (s) | delta (s) | points | "
             "train mean err | held-out mean err | held-out max err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for variant, phases in result["fits"].items():
        for phase, e in phases.items():
            f = e["coefficients"]
            lines.append(
                f"| {variant} | {phase} | {f['alpha_s']:.3e} | {f['beta_s']:.3e} | "
                f"{f['gamma_s']:.3e} | {f['delta_s']:.3e} | {e['points']} | "
                f"{e['train_mean_error']:.1%} | {_pct(e['held_out_mean_error'])} | "
                f"{_pct(e['held_out_max_error'])} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmark/results/kunserve"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit-s", type=float, default=14 * 60,
                    help="stop measuring past this many seconds and fit the points measured")
    ap.add_argument("--refit", action="store_true",
                    help="fit timings again (no server): OUT/costs.json's or --timings'")
    ap.add_argument("--timings", type=Path, default=None,
                    help="with --refit: a JSON file with 'meta' and 'timings'")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.refit:
        raw = json.loads((args.timings or args.out / "costs.json").read_text())
        timings = timings_from_json(raw["timings"])
        meta = raw["meta"]
        source = f"{meta['machine']['cpu_model']}, commit {meta['git']['commit']}"
        write_results(args.out, timings, meta, source)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # A background run ignores SIGINT; SIGTERM must still stop the server (the with block).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.monotonic()
    load_before = load_average()
    RAW.mkdir(parents=True, exist_ok=True)
    with running_server(SERVER_ARGS, RAW / "kunserve_costs_server.log") as server:
        timings = measure(Client(server.url, args.seed), args.repeats,
                          started + args.time_limit_s, RAW / "kunserve_costs_progress.json")
    meta = {"command": "python -m benchmark.kunserve_costs", "git": git_state(),
            "machine": machine_info(), "repeats": args.repeats, "seed": args.seed,
            "server_args": list(SERVER_ARGS), "load_before": load_before,
            "load_after": load_average(), "seconds": time.monotonic() - started,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    source = f"{meta['machine']['cpu_model']}, commit {meta['git']['commit']}"
    write_results(args.out, timings, meta, source)


def write_results(out: Path, timings: list[ForwardTiming], meta: dict, source: str) -> None:
    result = {**fit_and_evaluate(timings, meta["seed"], source),
              "fitted_at": git_state()["commit"], "meta": meta,
              "timings": timings_to_json(timings)}
    (out / "costs.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "costs.md", result)
    print(json.dumps(result["fits"], indent=1))


if __name__ == "__main__":
    main()
