"""A merged prefill cut into micro-batches: equal token ranges against ranges of equal cost.

One ``--dp-size 2 --enable-kunserve`` server per arm (float32, one core per replica, the test
suite's 1,024-token pools), dropped at once; replica 0 prefills fresh prompts (1 new token, no
prefix cached) while replica 1 only serves its layers. The arms differ in
``--kunserve-micro-batch-cuts`` alone: ``tokens`` cuts a prompt into four equal token ranges,
``cost`` into four of equal cost under the chunk cost model replica 0 fits on its own
micro-batches. Each server first runs ``WARMUP`` prompts (in the ``cost`` arm they give the
model its timings), then ``MEASURED`` prompts of each length. A prompt is timed by SGLang's
forward on replica 0 (``SGLANG_MORPH_FORWARD_TIMINGS``; a merged front member's forward
holds both stages of every micro-batch) and by the client (TTFT). Servers alternate
``tokens, cost, cost, tokens, ...`` so that a drift of the machine's speed falls on both arms.

    .venv/bin/python -m benchmark.kunserve.cuts [--rounds 3] [--out benchmark/results/kunserve/cuts]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.harness import arm_rounds, running_server, spread
from sglang_morph.kunserve.cost import Chunk, ChunkCostModel, balanced_bounds

SERVER_ARGS = ("--dp-size", "2", "--dtype", "float32", "--max-total-tokens", "1024",
               "--enable-kunserve", "--kunserve-micro-batches", "4")
ARMS = ("tokens", "cost")
PROMPT_TOKENS = (384, 1024)
WARMUP = 4  # 384-token prompts: 16 micro-batch timings, past the 12 the model needs
MEASURED = 8


def prompt(seed: int, n_tokens: int) -> list[int]:
    """Deterministic token ids that share no prefix with another seed's (the text does not
    matter to a timing, its length does; a cached prefix would shorten the prefill)."""
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(n_tokens)]


def prefill(url: str, ids: list[int]) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": ids, "routed_dp_rank": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
    r.raise_for_status()
    return time.perf_counter() - start


def own_prefills(path: Path, since_line: int, n_tokens: int) -> list[float]:
    """Seconds of every forward of one fresh ``n_tokens`` prompt logged after ``since_line``
    (replica 1's forwards are its own and none here)."""
    out = []
    for line in path.read_text().splitlines()[since_line:]:
        rec = json.loads(line)
        if rec["mode"] == "extend" and rec["new"] == [n_tokens] and rec["cached"] == [0]:
            out.append(rec["seconds"])
    return out


def run_arm(arm: str, seed0: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "forwards.jsonl"
        env = {"OMP_NUM_THREADS": "1", "SGLANG_MORPH_FORWARD_TIMINGS": str(timings)}
        args = SERVER_ARGS + ("--kunserve-micro-batch-cuts", arm)
        with running_server(args, Path(tmp) / "server.log", env) as server:
            r = httpx.post(f"{server.url}/kunserve/drop", timeout=600)
            if r.status_code != 200:
                raise RuntimeError(f"drop refused: {r.status_code} {r.text}")
            for i in range(WARMUP):
                prefill(server.url, prompt(seed0 + i, PROMPT_TOKENS[0]))
            out: dict = {"arm": arm, "by_prompt": {}}
            seed = seed0 + WARMUP
            for n in PROMPT_TOKENS:
                first = len(timings.read_text().splitlines())
                ttft = []
                for _ in range(MEASURED):
                    ttft.append(prefill(server.url, prompt(seed, n)))
                    seed += 1
                forwards = own_prefills(timings, first, n)
                if len(forwards) != MEASURED:
                    raise RuntimeError(f"{arm}: {len(forwards)} prefill forwards of {n} tokens "
                                       f"logged, expected {MEASURED}")
                out["by_prompt"][str(n)] = {"forward_s": forwards, "ttft_s": ttft}
            rep = httpx.get(f"{server.url}/kunserve/status", timeout=60).json()["replicas"][0]
    out["micro_batch_cost"] = rep["micro_batch_cost"]
    out["micro_batch_timings"] = rep["micro_batch_timings"]
    out["batches_micro"] = rep["batches_micro"]
    if arm == "cost" and out["micro_batch_cost"] is None:
        raise RuntimeError("the cost arm fitted no model: its prompts were cut by tokens")
    return out


def cuts_of(model: dict | None, n_tokens: int, k: int = 4) -> list[int]:
    """The bounds a fresh ``n_tokens`` prompt gets under the fitted model (equal without)."""
    if model is None:
        return [n_tokens * j // k for j in range(k + 1)]
    return balanced_bounds([Chunk(0, n_tokens)], k, ChunkCostModel(**model), 64)


def summarize(runs: list[dict]) -> dict:
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    summary: dict = {}
    for n in map(str, PROMPT_TOKENS):
        medians = {arm: [statistics.median(r["by_prompt"][n]["forward_s"]) for r in rs]
                   for arm, rs in by_arm.items()}
        ttft = {arm: [statistics.median(r["by_prompt"][n]["ttft_s"]) for r in rs]
                for arm, rs in by_arm.items()}
        # The arms' servers of one round ran next to each other: their ratio is that round's.
        ratios = [c / t for t, c in zip(medians["tokens"], medians["cost"])]
        summary[n] = {"forward_s": {arm: spread(v) for arm, v in medians.items()},
                      "ttft_s": {arm: spread(v) for arm, v in ttft.items()},
                      "cost_over_tokens": spread(ratios), "per_round": ratios}
    return summary


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Merged prefill: micro-batches of equal tokens against equal cost", "",
        f"`{meta['command']}` at commit {meta['git']['commit']} (dirty: {meta['git']['dirty']}), "
        f"{meta['machine'].get('cpu_model')}, {meta['machine'].get('cpu_cores')} cores; load "
        f"{meta['load_before']} -> {meta['load_after']}. {result['settings']['rounds']} rounds; "
        f"a round is one server per arm, next to each other (order alternating).", "",
        "Replica 0's prefill forward of a fresh prompt (1 new token), both stages of its four "
        "micro-batches, median over a server's prompts; then median (min to max) over the "
        "rounds. The ratio is each round's cost-cut median over its tokens-cut median.", "",
        "| prompt tokens | equal tokens (s) | equal cost (s) | cost / tokens | TTFT tokens (s) "
        "| TTFT cost (s) | cuts by cost (last round's model) |",
        "|---:|---|---|---|---|---|---|"]

    def fmt(s: dict, digits: int = 3) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f} to {s['max']:.{digits}f})"

    last_model = [r for r in result["runs"] if r["arm"] == "cost"][-1]["micro_batch_cost"]
    for n, s in result["summary"].items():
        lines.append(f"| {n} | {fmt(s['forward_s']['tokens'])} | {fmt(s['forward_s']['cost'])} "
                     f"| {fmt(s['cost_over_tokens'])} | {fmt(s['ttft_s']['tokens'])} | "
                     f"{fmt(s['ttft_s']['cost'])} | {cuts_of(last_model, int(n))} |")
    lines += ["", "The cost arm's fitted models (replica 0, per round; KunServe's terms, "
              "seconds): " + "; ".join(
                  f"alpha {m['alpha_s']:.3g}, beta {m['beta_s']:.3g}, gamma {m['gamma_s']:.3g}"
                  for r in result["runs"] if r["arm"] == "cost"
                  for m in [r["micro_batch_cost"]])]
    return "\n".join(lines) + "\n"


def main() -> None:
    arm_rounds("cuts", __doc__, list(ARMS), run_arm, summarize, markdown, {
        "server_args": list(SERVER_ARGS), "prompt_tokens": PROMPT_TOKENS, "warmup": WARMUP,
        "measured": MEASURED, "omp_threads_per_replica": 1})


if __name__ == "__main__":
    main()
