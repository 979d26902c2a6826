"""A merged prefill through the stages of a group of four: uncut against a wavefront of
micro-batches.

One ``--dp-size 4 --enable-kunserve --kunserve-group-size 4`` server per arm (float32, one
thread per replica, four replicas on this machine's cores, 1,024-token pools), dropped at once
to four stages; replica 0 prefills fresh prompts (1 new token, no prefix cached) while the
three others only serve their layers. The arms differ in ``--kunserve-micro-batches`` alone:
``uncut`` (1) runs each prompt through the four stages in turn, ``cut`` (4) as four
micro-batches in a wavefront (stage i runs micro-batch t - i at tick t). A third server,
``whole``, prefills the same prompts on replica 0 undropped. A prompt is timed by SGLang's
forward on replica 0 (``SGLANG_MORPH_FORWARD_TIMINGS``: the merged forward holds every stage)
and by the client (TTFT). The arms' order rotates round by round so that a drift of the
machine's speed falls on all of them.

    .venv/bin/python -m benchmark.kunserve.stages [--rounds 3] [--out benchmark/results/kunserve/stages]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import httpx

from benchmark.harness import arm_rounds, running_server, spread
from benchmark.kunserve.cuts import own_prefills, prefill, prompt

SERVER_ARGS = ("--dp-size", "4", "--dtype", "float32", "--max-total-tokens", "1024",
               "--enable-kunserve", "--kunserve-group-size", "4")
ARMS = {"whole": None, "uncut": 1, "cut": 4}  # arm: --kunserve-micro-batches (None: no drop)
PROMPT_TOKENS = 384
WARMUP = 2
MEASURED = 6


def run_arm(arm: str, seed0: int) -> dict:
    micro = ARMS[arm]
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "forwards.jsonl"
        env = {"OMP_NUM_THREADS": "1", "SGLANG_MORPH_FORWARD_TIMINGS": str(timings)}
        args = SERVER_ARGS + ("--kunserve-micro-batches", str(micro or 4))
        with running_server(args, Path(tmp) / "server.log", env) as server:
            if micro is not None:
                r = httpx.post(f"{server.url}/kunserve/drop", timeout=600)
                if r.status_code != 200:
                    raise RuntimeError(f"drop refused: {r.status_code} {r.text}")
            for i in range(WARMUP):
                prefill(server.url, prompt(seed0 + i, PROMPT_TOKENS))
            first = len(timings.read_text().splitlines())
            ttft = [prefill(server.url, prompt(seed0 + WARMUP + i, PROMPT_TOKENS))
                    for i in range(MEASURED)]
            forwards = own_prefills(timings, first, PROMPT_TOKENS)
            if len(forwards) != MEASURED:
                raise RuntimeError(f"{arm}: {len(forwards)} prefill forwards of "
                                   f"{PROMPT_TOKENS} tokens logged, expected {MEASURED}")
            rep = httpx.get(f"{server.url}/kunserve/status", timeout=60).json()["replicas"][0]
    expected_micro = (WARMUP + MEASURED) if micro == 4 else 0
    if rep["batches_micro"] != expected_micro:
        raise RuntimeError(f"{arm}: replica 0 ran {rep['batches_micro']} cut batches, "
                           f"expected {expected_micro}")
    return {"arm": arm, "forward_s": forwards, "ttft_s": ttft, "layers": rep["layers"],
            "batches_micro": rep["batches_micro"]}


def summarize(runs: list[dict]) -> dict:
    def per_round(arm: str, key: str) -> list[float]:
        return [statistics.median(r[key])
                for r in sorted(runs, key=lambda r: r["round"]) if r["arm"] == arm]

    forward = {arm: per_round(arm, "forward_s") for arm in ARMS}
    # Each round's servers ran next to each other: their ratios are that round's.
    return {
        "forward_s": {arm: spread(v) for arm, v in forward.items()},
        "ttft_s": {arm: spread(per_round(arm, "ttft_s")) for arm in ARMS},
        "cut_over_uncut": spread([c / u for u, c in zip(forward["uncut"], forward["cut"])]),
        "cut_over_whole": spread([c / w for w, c in zip(forward["whole"], forward["cut"])]),
        "uncut_over_whole": spread([u / w for w, u in zip(forward["whole"],
                                                          forward["uncut"])]),
    }


def markdown(result: dict) -> str:
    meta, s = result["meta"], result["summary"]

    def fmt(x: dict, digits: int = 3) -> str:
        return f"{x['median']:.{digits}f} ({x['min']:.{digits}f} to {x['max']:.{digits}f})"

    lines = [
        "# A merged prefill through four stages: uncut against micro-batches", "",
        f"`{meta['command']}` at commit {meta['git']['commit']} (dirty: {meta['git']['dirty']}), "
        f"{meta['machine'].get('cpu_model')}, {meta['machine'].get('cpu_cores')} cores; load "
        f"{meta['load_before']} -> {meta['load_after']}. {result['settings']['rounds']} rounds; "
        "a round is one server per arm, one after the other (order rotating); server "
        f"`{' '.join(SERVER_ARGS)}`, one thread per replica.", "",
        f"Replica 0's prefill of a fresh {PROMPT_TOKENS}-token prompt (1 new token), median "
        f"over a server's {MEASURED} prompts; then median (min to max) over the rounds. Ratios "
        "are per round.", "",
        "| arm | prefill forward (s) | TTFT (s) |", "|---|---|---|"]
    for arm in ARMS:
        lines.append(f"| {arm} | {fmt(s['forward_s'][arm])} | {fmt(s['ttft_s'][arm])} |")
    lines += ["", f"- cut / uncut: {fmt(s['cut_over_uncut'])}",
              f"- cut / whole: {fmt(s['cut_over_whole'])}",
              f"- uncut / whole: {fmt(s['uncut_over_whole'])}",
              f"- replica 0's stage when dropped: {result['runs'][-1]['layers']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    arm_rounds("stages", __doc__, list(ARMS), run_arm, summarize, markdown, {
        "server_args": list(SERVER_ARGS), "prompt_tokens": PROMPT_TOKENS, "warmup": WARMUP,
        "measured": MEASURED, "omp_threads_per_replica": 1})


if __name__ == "__main__":
    main()
