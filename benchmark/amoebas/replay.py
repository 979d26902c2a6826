"""Live end-to-end replay of AMOEBAs against plain DP 3 and one TP 3 server.

    .venv/bin/python -m benchmark.amoebas.replay [--runs 3] [--arms amoebas,dp3,tp3]
    .venv/bin/python -m benchmark.amoebas.replay --quick   # harness check: 1 run, 11 requests

Every (run, arm) is a fresh ``scripts/serve.sh`` server of the default model (9 query / 3 KV
heads), ``--dtype float32 --enable-metrics``, ``OMP_NUM_THREADS=1``; runs interleave the arms:

| arm | flags |
|---|---|
| ``amoebas`` | ``--dp-size 3 --max-total-tokens N --enable-amoebas`` (automatic transitions) |
| ``dp3`` | ``--dp-size 3 --max-total-tokens N`` (SGLang aborts a prompt over its pool: 400) |
| ``tp3`` | ``--tp-size 3 --max-total-tokens M`` |

M = 3 x a member's owner pool after a merge (``CapacityModel.owner_capacity_tokens(3)``: the
startup pool plus the FFN bytes a member releases, at the bytes of a token's every KV head):
the KV bytes of the merged group. (TP 3 ranks also hold a third of the attention and embedding
weights, which AMOEBAs' members keep whole.)

Workload: a window of the Azure code trace with short prompts and outputs, plus long prompts at
fixed times that no replica's pool holds but a merged group's does; the same token ids to every
arm (disjoint WikiText-2 slices), greedy, ``ignore_eos``. Greedy float32 outputs do not depend
on the batch, so requests both ``amoebas`` and ``dp3`` served are compared token for token
(counted, not asserted). The ``amoebas`` arm samples ``GET /amoebas/status`` (at most every
0.25 s: each replica answers between its batches) and, after the load, until the group has
split (``--split-wait-s``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmark.harness import (
    REPO_ROOT,
    git_state,
    load_average,
    run_meta,
    running_server,
    spread,
)
from benchmark.replay import metrics as M
from benchmark.replay import report as R
from benchmark.replay.__main__ import repo_path, trace_settings
from benchmark.replay.client import RequestRecord, replay
from benchmark.replay.trace import TRACES, TraceRequest, TraceWindow, load_window, prompt_token_ids
from sglang_morph.repo_data import WIKITEXT2_TRAIN_HEAD

ARMS = ("amoebas", "dp3", "tp3")
REFERENCE = "dp3"  # outputs are compared with plain DP's
REPLICAS = 3
DTYPE = "float32"
# One thread per rank: SGLang binds a rank's threads only on AMX/arm64 CPUs, and three
# replicas of two threads each would oversubscribe the two cores.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
RESULTS = REPO_ROOT / "benchmark" / "results" / "amoebas"
RAW = REPO_ROOT / "benchmark" / "results" / "raw"  # git-ignored: server logs, output ids
WARMUP_PROMPT_TOKENS, WARMUP_NEW_TOKENS = 16, 4
ALONE = [[r] for r in range(REPLICAS)]


@dataclasses.dataclass(frozen=True)
class LongPrompts:
    """Prompts added at fixed replay times. Invariants: one length per arrival, all > 0."""

    arrivals_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...]
    output_tokens: int

    def __post_init__(self) -> None:
        if (len(self.arrivals_s) != len(self.prompt_tokens) or self.output_tokens < 1
                or min(self.prompt_tokens, default=1) < 1 or min(self.arrivals_s, default=0) < 0):
            raise ValueError(f"long prompts: one length >= 1 per arrival time >= 0: {self}")


# The Azure code trace at 1,190-1,220 s (the tail of one burst, a lull, a second burst), every
# 7th request, stretched 2.5x: 32 short requests over 64 s; prompts 1/16 of the trace's
# (24-150 tokens), outputs 2x (16-32 tokens), 820 output tokens, which 3 replicas on 2 cores
# serve in about a minute. A long prompt lands in each phase (first burst, lull, second burst).
WINDOW = TraceWindow(TRACES / "azure_llm_2023_code.csv", start_s=1190.0, duration_s=30.0,
                     time_scale=2.5, keep_every=7, prompt_scale=1 / 16, output_scale=2.0,
                     min_prompt_tokens=24, max_prompt_tokens=150, min_output_tokens=16,
                     max_output_tokens=32)
LONGS = LongPrompts((8.0, 30.0, 50.0), (1300, 1500, 1400), 24)
QUICK_WINDOW = dataclasses.replace(WINDOW, duration_s=6.0, time_scale=2.0, output_scale=1.0,
                                   min_output_tokens=8, max_output_tokens=12)
QUICK_LONGS = LongPrompts((4.0,), (1200,), 8)


@dataclasses.dataclass(frozen=True)
class Settings:
    window: TraceWindow
    longs: LongPrompts
    pool_tokens: int  # N: each replica's KV pool in the amoebas and dp3 arms
    arms: tuple[str, ...]
    runs: int
    drain_timeout_s: float
    split_wait_s: float
    out_dir: Path
    raw_dir: Path
    # SGLang's --chunked-prefill-size for every arm (None: SGLang's default, 4096 on this CPU,
    # above every prompt here: a long prompt's prefill is one forward)
    chunked_prefill_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: tuple[TraceRequest, ...]  # by arrival; index = position
    long_indices: frozenset[int]


def build_workload(shorts: Sequence[TraceRequest], longs: LongPrompts) -> Workload:
    """The trace's requests and the long prompts in one arrival order, indices renumbered
    (a long prompt goes after a short one arriving at the same time)."""
    tagged = [(r.arrival_s, False, r) for r in shorts] + [
        (t, True, TraceRequest(0, t, p, longs.output_tokens, p, longs.output_tokens))
        for t, p in zip(longs.arrivals_s, longs.prompt_tokens)]
    tagged.sort(key=lambda x: (x[0], x[1]))
    return Workload(tuple(dataclasses.replace(r, index=k) for k, (_, _, r) in enumerate(tagged)),
                    frozenset(k for k, (_, long, _) in enumerate(tagged) if long))


def load_prompts(workload: Workload) -> tuple[list[list[int]], list[int]]:
    """Disjoint corpus slices: one per request, and one more for the warm-up."""
    from transformers import AutoTokenizer

    from sglang_morph.models import default_model_path

    need = sum(r.prompt_tokens for r in workload.requests) + WARMUP_PROMPT_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    corpus = tokenizer(WIKITEXT2_TRAIN_HEAD.read_text()[:need * 8], verbose=False)["input_ids"]
    if len(corpus) < need:  # a wrap-around would repeat a prefix the radix cache holds
        raise ValueError(f"corpus of {len(corpus)} tokens is shorter than the {need} needed")
    warm = corpus[need - WARMUP_PROMPT_TOKENS:need]
    return prompt_token_ids(list(workload.requests), corpus), warm


def tp3_kv_tokens(pool_tokens: int) -> int:
    """M: the KV tokens of the memory a merged group of the three replicas holds."""
    from sglang_morph.amoebas.capacity import CapacityModel
    from sglang_morph.models import default_model_path
    from sglang_morph.models.spec import ModelSpec

    spec = ModelSpec.from_model_dir(default_model_path(), dtype_bytes=4)
    capacity = CapacityModel.from_kv_pool(spec, REPLICAS, pool_tokens)
    return REPLICAS * capacity.owner_capacity_tokens(REPLICAS)


def server_args(arm: str, pool_tokens: int, tp3_tokens: int,
                chunked_prefill_tokens: int | None = None) -> tuple[str, ...]:
    base = ("--dtype", DTYPE, "--enable-metrics")
    if chunked_prefill_tokens is not None:
        base += ("--chunked-prefill-size", str(chunked_prefill_tokens))
    if arm == "amoebas":
        return base + ("--dp-size", str(REPLICAS), "--max-total-tokens", str(pool_tokens),
                       "--enable-amoebas")
    if arm == "dp3":
        return base + ("--dp-size", str(REPLICAS), "--max-total-tokens", str(pool_tokens))
    if arm == "tp3":
        return base + ("--tp-size", str(REPLICAS), "--max-total-tokens", str(tp3_tokens))
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")


def amoebas_sample(s: dict[str, Any]) -> dict[str, Any]:
    """A timeline sample of ``GET /amoebas/status``: the units, each replica's degree and pool."""
    reps = sorted(s.get("replicas", []), key=lambda r: r["replica"])
    return {"units": s.get("units"), "degree": [r["degree"] for r in reps],
            "kv_capacity_tokens": [r["kv_capacity_tokens"] for r in reps],
            "kv_used_tokens": [r["kv_used_tokens"] for r in reps]}


def outcome(rec: RequestRecord) -> str:
    """served; refused (SGLang streams a prompt longer than its pool back as an abort with one
    placeholder token, or answers 400); failed (an error, a timeout, an abort mid-stream)."""
    if rec.ok and rec.finish_reason != "abort":
        return "served"
    if ((rec.finish_reason == "abort" and (not rec.chunks or rec.chunks[-1][1] <= 1))
            or (rec.error or "").startswith("HTTP 400")):
        return "refused"
    return "failed"


def summarize_run(records: Sequence[RequestRecord], long_indices: frozenset[int],
                  start_unix_s: float) -> dict[str, Any]:
    """Short-request latency percentiles; long prompts served, refused and their TTFTs; output
    tokens per second of makespan (replay start to the last token of any served request)."""
    kinds = {r.index: outcome(r) for r in records}
    ok = [r for r in records if kinds[r.index] == "served"]
    parts: dict[str, Any] = {}
    for name, is_long in (("short", False), ("long", True)):
        part = [r for r in records if (r.index in long_indices) == is_long]
        served = [r for r in part if kinds[r.index] == "served"]
        parts[name] = {"requests": len(part), **{k: sum(kinds[r.index] == k for r in part)
                                                 for k in ("served", "refused", "failed")},
                       "ttft_s": M.percentiles([r.ttft_s for r in served]),
                       "tpot_s": M.percentiles([r.tpot_s for r in served if r.tpot_s is not None]),
                       "e2e_s": M.percentiles([r.e2e_s for r in served])}
    parts["long"]["ttft_each_s"] = [r.ttft_s if kinds[r.index] == "served" else None
                                    for r in records if r.index in long_indices]
    span_s = max(max((r.chunks[-1][0] for r in ok), default=start_unix_s) - start_unix_s, 1e-9)
    tokens = sum(r.chunks[-1][1] for r in ok)
    return {**parts, "output_tokens": tokens, "makespan_s": span_s,
            "throughput_tokens_per_s": tokens / span_s,
            "truncated": sum(r.chunks[-1][1] != r.max_new_tokens for r in ok)}


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max over the runs that completed (long TTFT: over every long prompt
    served in any run)."""
    ok = [r for r in runs if "summary" in r]
    sums = [r["summary"] for r in ok]
    out: dict[str, Any] = {"runs": len(ok), "runs_failed": len(runs) - len(ok)}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        out[f"short_{key}"] = {p: spread([s["short"][key][p] for s in sums])
                               for p in ("p50", "p95", "p99")}
    out["throughput_tokens_per_s"] = spread([s["throughput_tokens_per_s"] for s in sums])
    for part in ("short", "long"):
        out[part] = {k: sum(s[part][k] for s in sums)
                     for k in ("requests", "served", "refused", "failed")}
    out["long_ttft_s"] = spread([t for s in sums for t in s["long"]["ttft_each_s"]])
    if any("transitions" in r for r in ok):
        for k in ("merges", "splits"):
            out[k] = spread([r["transitions"][k] for r in ok if "transitions" in r])
    return out


def output_mismatches(records: Sequence[dict], reference: Sequence[dict]) -> dict[str, Any]:
    """Requests both runs served (``RequestRecord.to_json`` dicts) whose output ids differ."""
    def served(recs):
        return {r["index"]: r["output_ids"] for r in recs if r["error"] is None
                and r["chunks"] and r["finish_reason"] != "abort"}

    got, ref = served(records), served(reference)
    common = sorted(set(got) & set(ref))
    bad = [i for i in common if got[i] != ref[i]]
    return {"compared": len(common), "mismatches": len(bad), "indices": bad}


def group_transitions(status: dict[str, Any], since_unix_s: float) -> dict[str, Any]:
    """Merges and splits since ``since_unix_s``, each once (its group's first member's record)."""
    trs = [t for rep in status["replicas"] for t in rep["transitions"]
           if rep["replica"] == t["group"][0] and t["at_unix_s"] >= since_unix_s]
    trs.sort(key=lambda t: t["at_unix_s"])
    return {"merges": sum(t["action"] == "merge" for t in trs),
            "splits": sum(t["action"] == "split" for t in trs), "list": trs}


def warm_up(url: str, arm: str, ids: list[int]) -> None:
    """One short request on every replica, then an empty cache: the first timed request does
    not pay a process's first forward."""
    def one(rank: int | None) -> None:
        httpx.post(f"{url}/generate", timeout=300, json={
            "input_ids": ids, **({} if rank is None else {"routed_dp_rank": rank}),
            "sampling_params": {"temperature": 0, "max_new_tokens": WARMUP_NEW_TOKENS,
                                "ignore_eos": True}}).raise_for_status()

    ranks = [None] if arm == "tp3" else list(range(REPLICAS))
    with concurrent.futures.ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(one, ranks))
    httpx.post(f"{url}/flush_cache", timeout=60)


def wait_for_split(url: str, samples: list[dict[str, Any]], wait_s: float) -> dict[str, Any]:
    """Keep sampling until every replica serves alone again or ``wait_s`` passed."""
    deadline = time.time() + wait_s
    while True:
        status = httpx.get(f"{url}/amoebas/status", timeout=60).json()
        samples.append({"t": time.time(), **amoebas_sample(status)})
        if status["units"] == ALONE or time.time() > deadline:
            return status
        time.sleep(0.25)


def log_excerpt(path: Path, lines: int = 30) -> list[str]:
    """The server log's last AMOEBAs lines, errors and refusals."""
    keys = ("AMOEBAs", "Traceback", "Exception", "Error:", "exceeds")
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [ln for ln in text.splitlines() if any(k in ln for k in keys)][-lines:]


def run_arm(st: Settings, arm: str, run: int, workload: Workload, prompts: list[list[int]],
            warm_ids: list[int], tp3_tokens: int) -> dict[str, Any]:
    """One fresh server, one replay. A failure is this run's result; the others still run."""
    args = server_args(arm, st.pool_tokens, tp3_tokens, st.chunked_prefill_tokens)
    log = st.raw_dir / f"{arm}_run{run}_server.log"
    out: dict[str, Any] = {"run": run, "server_args": list(args), "server_log": repo_path(log)}
    t0, result = time.time(), None
    try:
        with running_server(args, log, env=SERVER_ENV) as server:
            out["startup_s"] = time.time() - t0
            warm_up(server.url, arm, warm_ids)
            result = replay(server.url, list(workload.requests), prompts, st.drain_timeout_s,
                            label=f"{arm} run {run}", sample=amoebas_sample,
                            status_path="/amoebas/status" if arm == "amoebas" else None)
            if arm == "amoebas":
                final = wait_for_split(server.url, result.status_samples, st.split_wait_s)
                out["transitions"] = group_transitions(final, result.start_unix_s)
                out["split_back"] = final["units"] == ALONE
    except Exception as e:  # e.g. a scheduler died; the server is stopped either way
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[amoebas replay] {arm} run {run}: FAILED {out['error']}", flush=True)
    if result is None:
        return out | {"log_excerpt": log_excerpt(log)}
    s = summarize_run(result.records, workload.long_indices, result.start_unix_s)
    out.update(summary=s, start_unix_s=result.start_unix_s, status_samples=result.status_samples,
               records=[r.to_json() for r in result.records])
    if "error" in out or (s["long"]["served"] < s["long"]["requests"] and arm != REFERENCE):
        out["log_excerpt"] = log_excerpt(log)
    print(f"[amoebas replay] {arm} run {run}: short TTFT p50 {R._fmt(s['short']['ttft_s']['p50'])}"
          f" s, {s['throughput_tokens_per_s']:.1f} tok/s, long served / refused / failed "
          f"{s['long']['served']} / {s['long']['refused']} / {s['long']['failed']}", flush=True)
    return out


def _cell(sp: dict[str, Any], digits: int = 2) -> str:
    if sp["median"] is None:
        return "-"
    return f"{sp['median']:.{digits}f} ({sp['min']:.{digits}f}-{sp['max']:.{digits}f})"


def markdown(report: dict[str, Any]) -> str:
    meta, st, arms = report["meta"], report["settings"], report["arms"]
    m, git, tr = meta["machine"], meta["git"], st["trace"]
    w = tr["trace"]
    rows = [
        "# AMOEBAs live replay: 3 replicas merging on demand vs DP 3 vs TP 3", "",
        f"Command: `{meta['command']}`; commit {git['commit']}{' (dirty)' if git['dirty'] else ''}"
        f"; {meta['date']}; {m['cpu_model']}, {m['cpu_cores']} cores, versions {m['versions']}; "
        f"load average before {meta['load_before']}, after {meta['load_after']}; server env "
        f"{st['server_env']}.", "",
        f"Workload: {tr['requests']} requests, {tr['output_tokens_total']} output tokens: "
        f"{w['path']} from {w['start_s']:g} s for {w['duration_s']:g} s, every "
        f"{w['keep_every']}th request, x{w['time_scale']:g} time ({tr['replay_duration_s']:g} s),"
        f" plus long prompts of {st['longs']['prompt_tokens']} tokens at "
        f"{st['longs']['arrivals_s']} s ({st['longs']['output_tokens']} new tokens); greedy, "
        "ignore_eos, the same token ids to every arm.", "",
        f"Pools: N = {st['pool_tokens']} tokens per replica (amoebas, dp3); tp3 M = "
        f"{st['tp3_kv_tokens']}, {st['tp3_kv_tokens_method']} (the amoebas arm's pools reached "
        f"{report.get('amoebas_max_kv_tokens_total')} tokens in all). Chunked prefill: "
        + (f"`--chunked-prefill-size {st['chunked_prefill_tokens']}` on every arm."
           if st.get("chunked_prefill_tokens") else "SGLang's default (a prompt's prefill in "
           "one forward here)."), "",
        "Median over the runs (min-max); runs per arm "
        f"{ {a: c['summary']['runs'] for a, c in arms.items()} }.", "",
        "| arm | short requests | P50 s | P95 s | P99 s |", "|---|---|---:|---:|---:|"]
    for arm, c in arms.items():
        for key, label, d in (("ttft_s", "TTFT", 2), ("tpot_s", "TPOT", 3), ("e2e_s", "E2E", 2)):
            sp = c["summary"][f"short_{key}"]
            rows.append(f"| {arm} | {label} | " + " | ".join(_cell(sp[p], d) for p in
                                                             ("p50", "p95", "p99")) + " |")
    rows += ["", "| arm | output tok/s | short served / refused / failed | long served / "
             "refused / failed | long TTFT s | merges / splits | outputs unlike "
             f"{REFERENCE} (compared) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, c in arms.items():
        s, mm = c["summary"], c.get("mismatches_vs_reference")
        sh, lg = s["short"], s["long"]
        rows.append(
            f"| {arm} | {_cell(s['throughput_tokens_per_s'], 1)} | {sh['served']} / "
            f"{sh['refused']} / {sh['failed']} | {lg['served']} / {lg['refused']} / "
            f"{lg['failed']} | {_cell(s['long_ttft_s'])} | "
            + (f"{_cell(s['merges'], 0)} / {_cell(s['splits'], 0)}" if "merges" in s else "-")
            + " | " + (f"{sum(x['mismatches'] for x in mm)} ({sum(x['compared'] for x in mm)})"
                       if mm else "-") + " |")
    rows += ["", "Served / refused / failed: totals over the runs; long TTFT over every long "
             "prompt served; merges / splits per run."]
    rows += [f"- {a} run {r['run']} FAILED: {r['error']} ({r['server_log']})"
             for a, c in arms.items() for r in c["runs"] if "error" in r]
    return "\n".join(rows) + "\n"


def plot_timeline(run: dict[str, Any], long_indices: frozenset[int], path: Path) -> None:
    """Arrivals (long prompts marked with their length), each replica's group degree, and its
    KV pool and use, as sampled; merges (red) and splits (green) at their logged times."""
    import numpy as np

    plt = R.pyplot()
    t0, samples, recs = run["start_unix_s"], run["status_samples"], run["records"]
    ts = [s["t"] - t0 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    arrivals = {r["index"]: r["scheduled_unix_s"] - t0 for r in recs}
    axes[0].hist([a for i, a in arrivals.items() if i not in long_indices],
                 bins=np.arange(0, max([*arrivals.values(), *ts]) + 1.0, 1.0),
                 color="tab:gray", alpha=0.6, label="short arrivals / s")
    for r in recs:
        if r["index"] in long_indices:
            axes[0].axvline(arrivals[r["index"]], color="tab:red", lw=1.5)
            axes[0].text(arrivals[r["index"]], 0.9, f" {r['prompt_tokens']} tok", color="tab:red",
                         fontsize=8, transform=axes[0].get_xaxis_transform())
    for i, color in enumerate(("tab:green", "tab:purple", "tab:blue")):
        # Dots mark the samples: a replica answers between batches, so a long forward leaves
        # a gap in which the plot holds the last answer.
        axes[1].step(ts, [s["degree"][i] + 0.05 * i for s in samples], where="post",
                     color=color, marker=".", ms=3, label=f"replica {i}")
        axes[2].step(ts, [s["kv_capacity_tokens"][i] for s in samples], where="post",
                     color=color, marker=".", ms=3, label=f"replica {i} capacity")
        axes[2].step(ts, [s["kv_used_tokens"][i] for s in samples], where="post", color=color,
                     ls=":", label=f"replica {i} used")
    for ax, label in zip(axes, ("requests", "group degree", "KV tokens (own pool)")):
        ax.set_ylabel(label)
        ax.legend(loc="upper right", fontsize=7)
        for tr in run.get("transitions", {}).get("list", []):
            ax.axvline(tr["at_unix_s"] - t0, color="tab:red" if tr["action"] == "merge"
                       else "tab:green", lw=0.8, ls="--", alpha=0.7)
    axes[2].set_xlabel("seconds since replay start")
    fig.suptitle(f"AMOEBAs, run {run['run']}: groups and KV pools")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict[str, Any], st: Settings, long_indices: frozenset[int]) -> None:
    """``replay.json`` (no output ids or chunks: those are in the raw folder's
    ``replay_full.json``), ``replay.md``, ``timeline_amoebas.png`` (the first amoebas run),
    ``cdf_short.png`` (TTFT and TPOT of the short requests, every run pooled)."""
    arms = report["arms"]
    ref = arms.get(REFERENCE, {}).get("runs", [])
    for arm, c in arms.items():
        c["summary"] = aggregate(c["runs"])
        if arm != REFERENCE and ref:
            c["mismatches_vs_reference"] = [
                {"run": r["run"], **output_mismatches(r["records"], f["records"])}
                for r, f in zip(c["runs"], ref) if "records" in r and "records" in f]
    samples = [s for r in arms.get("amoebas", {}).get("runs", [])
               for s in r.get("status_samples", [])]
    report["amoebas_max_kv_tokens_total"] = max(
        (sum(s["kv_capacity_tokens"]) for s in samples), default=None)
    st.out_dir.mkdir(parents=True, exist_ok=True)
    (st.raw_dir / "replay_full.json").write_text(json.dumps(report))
    slim = {**report, "arms": {a: {**c, "runs": [
        {**r, "records": [{k: v for k, v in rec.items() if k not in ("chunks", "output_ids")}
                          for rec in r["records"]]} if "records" in r else r
        for r in c["runs"]]} for a, c in arms.items()}}
    (st.out_dir / "replay.json").write_text(json.dumps(slim, indent=1))
    (st.out_dir / "replay.md").write_text(markdown(report))
    am = [r for r in arms.get("amoebas", {}).get("runs", []) if "records" in r]
    if am:
        plot_timeline(am[0], long_indices, st.out_dir / "timeline_amoebas.png")
    short = {a: {"records": [r for run in c["runs"] for r in run.get("records", [])
                             if r["index"] not in long_indices]} for a, c in arms.items()}
    R.plot_cdfs({"configs": short, "settings": {"slo": {"ttft_s": M.Slo().ttft_s}}},
                st.out_dir / "cdf_short.png")


def run_all(st: Settings, command: str) -> dict[str, Any]:
    workload = build_workload(load_window(st.window), st.longs)
    prompts, warm_ids = load_prompts(workload)
    tp3_tokens = tp3_kv_tokens(st.pool_tokens)
    merged_pool = tp3_tokens // REPLICAS  # a member's owner pool in the group of three
    if not all(st.pool_tokens < p + st.longs.output_tokens <= merged_pool
               for p in st.longs.prompt_tokens):
        raise ValueError(f"long prompts {st.longs.prompt_tokens} must exceed a replica's "
                         f"{st.pool_tokens}-token pool and fit a merged owner's {merged_pool}")
    st.raw_dir.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report: dict[str, Any] = {"settings": {
        "trace": trace_settings(st.window, workload.requests),
        "longs": dataclasses.asdict(st.longs), "long_indices": sorted(workload.long_indices),
        "pool_tokens": st.pool_tokens, "tp3_kv_tokens": tp3_tokens,
        "tp3_kv_tokens_method": f"{REPLICAS} x a member's owner pool after a merge "
        "(CapacityModel.owner_capacity_tokens: startup pool + released FFN bytes / KV bytes "
        "per token), the merged group's KV bytes",
        "arms": list(st.arms), "runs": st.runs, "dtype": DTYPE, "server_env": SERVER_ENV,
        "chunked_prefill_tokens": st.chunked_prefill_tokens,
        "drain_timeout_s": st.drain_timeout_s, "split_wait_s": st.split_wait_s,
        "raw_dir": repo_path(st.raw_dir), "prompt_corpus": WIKITEXT2_TRAIN_HEAD.name,
        "sampling": "greedy, ignore_eos, max_new_tokens = the request's output length"},
        "arms": {a: {"runs": []} for a in st.arms}}
    # The commit and whether the tree is clean, read before this run writes its results.
    git = git_state()
    for run in range(st.runs):  # arms interleaved: background drift hits every arm alike
        for arm in st.arms:
            report["arms"][arm]["runs"].append(
                run_arm(st, arm, run, workload, prompts, warm_ids, tp3_tokens))
            report["meta"] = {**run_meta(command, load_before, date=date), "git": git}
            write(report, st, workload.long_indices)
    return report


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="harness check: 1 run per arm, 10 short requests and 1 long prompt")
    p.add_argument("--runs", type=int, help="runs per arm (default 3; 1 with --quick)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of "
                   f"{','.join(ARMS)}")
    p.add_argument("--pool-tokens", type=int, default=512,
                   help="N: each replica's KV pool (amoebas, dp3)")
    p.add_argument("--drain-timeout-s", type=float, help="per request, after the last arrival")
    p.add_argument("--split-wait-s", type=float, default=60.0,
                   help="amoebas: sampling after the load until the group has split")
    p.add_argument("--chunked-prefill-size", type=int, metavar="TOKENS",
                   help="SGLang's --chunked-prefill-size on every arm (default: SGLang's)")
    p.add_argument("--out", type=Path, help="results folder (default benchmark/results/amoebas;"
                   " --quick: benchmark/results/raw/amoebas_replay_quick)")
    a = p.parse_args(argv)
    arms = tuple(x for x in a.arms.split(",") if x)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        p.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    runs = a.runs if a.runs is not None else (1 if a.quick else 3)
    if runs < 1:
        p.error("--runs must be at least 1")
    if a.chunked_prefill_size is not None and a.chunked_prefill_size < 1:
        p.error("--chunked-prefill-size must be at least 1")
    out = a.out or (RAW / "amoebas_replay_quick" if a.quick else RESULTS)
    return Settings(QUICK_WINDOW if a.quick else WINDOW, QUICK_LONGS if a.quick else LONGS,
                    a.pool_tokens, arms, runs,
                    a.drain_timeout_s or (120.0 if a.quick else 300.0), a.split_wait_s, out,
                    out / "raw" if a.quick else RAW / "amoebas_replay", a.chunked_prefill_size)


def main(argv: Sequence[str] | None = None) -> int:
    st = parse_args(argv)
    report = run_all(st, "python -m benchmark.amoebas.replay " + " ".join(
        sys.argv[1:] if argv is None else argv))
    print(markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
