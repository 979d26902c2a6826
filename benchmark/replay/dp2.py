"""The replay's two-replica arms: KunServe against plain DP 2, morph default on each
replica and static W4, under the same memory budget.

    python -m benchmark.replay --dp2                     # the four arms (see benchmark/README.md)
    python -m benchmark.replay --dp2 --configs dp2,kunserve
    python -m benchmark.replay --dp2 --configs dp2,kunserve --dp-size 4   # two KunServe pairs

Every arm is one fresh server with ``--dp-size 2`` and ``--dtype float32`` (greedy float32
outputs do not depend on the batch they run in, so KunServe's can be compared with plain DP's
token for token; in bf16 even two plain runs differ), the same trace and prompts, and the same
budget per replica, weights + KV (``--replica-budget``, default 580 MB: float32 weights of the
default model are 538 MB, which leaves KV for 910 tokens per replica, the bf16 profile's 910 at
290 MB). The pair's total is twice that in every arm:

| arm | flags beyond ``--dp-size 2 --dtype float32 --enable-metrics`` |
|---|---|
| ``dp2`` | plain SGLang: ``--max-total-tokens N`` (N = the budget's KV tokens) |
| ``kunserve`` | ``--max-total-tokens N --enable-kunserve --kunserve-auto`` (the controller drops and restores) |
| ``morph_dp2`` | ``--enable-morph --morph-memory-budget B`` + engines, swap order, mode default (each replica morphs on its own) |
| ``w4_dp2`` | ``--enable-morph --morph-memory-budget B`` + engines, ``--morph-precision-map '*:4'``, controller off |

Exact match is against ``dp2`` (full precision, the same dtype), request by request.

``--dp-size 4`` (or any even count) runs every arm with that many replicas instead: ``dp2`` is
then plain DP 4 and ``kunserve`` two pairs, each dropping and restoring on its own; the
results name the size (``dp_size``), the arms keep their names.

Every arm's schedulers log their forwards (``SGLANG_MORPH_FORWARD_TIMINGS``, tens of
microseconds a forward) to ``raw/<arm>_forwards.jsonl``; the arm's results carry the cost
model fitted on them and the schedulers' step gaps (``benchmark/replay/forwards.py``), which
the KunServe simulation's check against this replay uses (``benchmark/kunserve/validate.py``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from benchmark.harness import SERVER_NICE, behind_the_client, running_server
from benchmark.kunserve.rounds import merged_windows
from benchmark.replay import forwards
from benchmark.replay import metrics as M
from benchmark.replay import report as R
from benchmark.replay.client import replay
from sglang_morph.kunserve.live.forward_timings import ENV as TIMINGS_ENV

DP2_CONFIGS = ("dp2", "kunserve", "morph_dp2", "w4_dp2")
REPLICA_BUDGET = "580MB"
DTYPE = "float32"
# One core per replica: SGLang binds a rank's OpenMP threads to its core list only on CPUs with
# AMX (not this one); otherwise each replica would run as many threads as the machine has cores,
# two replicas oversubscribe the two cores, and KunServe's service thread adds a third team.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
# The reference of exact match: plain DP 2 at full precision.
REFERENCE = "dp2"
RESTORE_WAIT_S = 30.0
STATUS = {"kunserve": "/kunserve/status", "morph_dp2": "/morph/status",
          "w4_dp2": "/morph/status", "dp2": None}


@dataclasses.dataclass(frozen=True)
class KunServeArm:
    """The kunserve arm's flags beyond ``--enable-kunserve --kunserve-auto`` (None: the
    server's default). The results' settings record each as ``kunserve_<field>``."""

    auto_config: str | None = None  # --kunserve-auto-config JSON
    merged_max_running: int | None = None  # --kunserve-merged-max-running N
    merged_chunked_prefill: int | None = None  # --kunserve-merged-chunked-prefill TOKENS
    merged_priority: str | None = None  # --kunserve-merged-priority prefill|decode
    merged_prefill_gap_steps: int | None = None  # --kunserve-merged-prefill-gap-steps N

    def flags(self) -> tuple[str, ...]:
        return tuple(arg for field in dataclasses.fields(self)
                     if (value := getattr(self, field.name)) is not None
                     for arg in (f"--kunserve-{field.name.replace('_', '-')}", str(value)))

    def settings(self) -> dict[str, Any]:
        return {f"kunserve_{k}": v for k, v in dataclasses.asdict(self).items()}


def kv_tokens_for(budget: str) -> int:
    """KV tokens per replica that ``budget`` leaves beside the float32 weights, as
    ``--morph-memory-budget`` sizes them (the plain and KunServe arms get the same pool)."""
    from sglang_morph.morph.config import parse_bytes
    from sglang_morph.morph.startup import size_kv_for_budget
    from sglang_morph.models import default_model_path

    model = Path(default_model_path())
    cfg = json.loads((model / "config.json").read_text())
    return size_kv_for_budget(parse_bytes(budget, "--replica-budget"), model, cfg, DTYPE,
                              "auto").kv_capacity_tokens


def server_args(name: str, budget: str, kv_tokens: int, engines: Path | None, log: Path,
                swap_order: Path, kunserve: KunServeArm = KunServeArm(),
                dp_size: int = 2) -> tuple[str, ...]:
    base = ("--dp-size", str(dp_size), "--dtype", DTYPE, "--enable-metrics")
    if name == "dp2":
        return base + ("--max-total-tokens", str(kv_tokens))
    if name == "kunserve":
        return base + ("--max-total-tokens", str(kv_tokens), "--enable-kunserve",
                       "--kunserve-auto") + kunserve.flags()
    morph = base + ("--enable-morph", "--morph-memory-budget", budget, "--morph-log", str(log),
                    "--morph-engines", str(engines))
    if name == "morph_dp2":
        return morph + ("--morph-swap-order", str(swap_order), "--morph-mode", "default")
    if name == "w4_dp2":
        return morph + ("--disable-morph-controller", "--morph-precision-map", "*:4")
    raise ValueError(f"unknown DP-2 arm {name!r}")


def leaders(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The first replica of each pair in a ``GET /kunserve/status``: each logs its pair's
    transitions once."""
    return [r for r in s["replicas"] if r["replica"] % 2 == 0]


def kunserve_sample(s: dict[str, Any]) -> dict[str, Any]:
    """A timeline sample of ``GET /kunserve/status``: the pairs' KV (own pools: merged, each
    holds half the group's tokens), each replica's pool and layers, the largest group."""
    reps = s["replicas"]
    return {
        "kv_capacity_tokens": sum(r["kv_capacity_tokens"] for r in reps),
        "kv_used_tokens": sum(r["kv_used_tokens"] for r in reps),
        "kv_capacity_per_replica": [r["kv_capacity_tokens"] for r in reps],
        "kv_used_per_replica": [r["kv_used_tokens"] for r in reps],
        "layers_per_replica": [r["layers"][1] - r["layers"][0] for r in reps],
        "group_size": max(len(r["group"]) for r in reps),
        "num_waiting_reqs": sum(r["load"]["waiting_reqs"] for r in reps),
        "num_running_reqs": sum(r["load"]["running_reqs"] for r in reps),
        "retractions_total": 0,
        "transitions_total": sum(len(r["transitions"]) for r in leaders(s)),
    }


def morph_dp_sample(s: dict[str, Any]) -> dict[str, Any]:
    """A timeline sample of ``GET /morph/status`` under ``--dp-size 2`` (one body per replica)."""
    reps = s["replicas"]
    return {
        "kv_capacity_tokens": sum(r["kv_capacity_tokens"] for r in reps),
        "kv_used_tokens": sum(r["kv_used_tokens"] for r in reps),
        "kv_capacity_per_replica": [r["kv_capacity_tokens"] for r in reps],
        "quantized_layers": max(r["quantized_layers"] for r in reps),
        "num_waiting_reqs": sum((r.get("signals") or {}).get("num_waiting_reqs", 0)
                                for r in reps),
        "num_running_reqs": sum((r.get("signals") or {}).get("num_running_reqs", 0)
                                for r in reps),
        "retractions_total": sum(r["retractions_total"] for r in reps),
        "transitions_total": sum(r["transitions_total"] for r in reps),
    }


def run_arm(url: str, name: str, requests, prompts, slo: M.Slo, drain_timeout_s: float,
            num_layers: int) -> dict[str, Any]:
    path = STATUS[name]
    sample = kunserve_sample if name == "kunserve" else morph_dp_sample
    result = replay(url, requests, prompts, drain_timeout_s, label=name, status_path=path,
                    sample=sample)
    # The quantized shares come from the servers' provenance (every replica reports it); no
    # layer-by-layer log is merged across the replicas here.
    steps = [(0.0, (16,) * num_layers)]
    out = {"metrics": M.summarize(result, slo, steps),
           "records": [r.to_json() for r in result.records],
           "status_samples": result.status_samples, "client_stalls": result.client_stalls,
           "start_unix_s": result.start_unix_s,
           "end_unix_s": result.end_unix_s}
    if name == "kunserve":
        # The restore comes after the load ends (usage under 50% for a few views, the dwell):
        # keep sampling until the group has split or RESTORE_WAIT_S passed, for the timeline.
        deadline = time.time() + RESTORE_WAIT_S
        while True:
            final = httpx.get(f"{url}/kunserve/status", timeout=60).json()
            out["status_samples"].append({"t": time.time(), **kunserve_sample(final)})
            if all(len(g) == 1 for g in final["groups"]) or time.time() > deadline:
                break
            time.sleep(0.25)
        out["kunserve_transitions"] = [
            {**t, "replica": rep["replica"]} for rep in final["replicas"]
            for t in rep["transitions"]]
        out["kunserve_auto"] = [rep["auto"] for rep in final["replicas"]]
        out["metrics"]["transitions"] = sum(len(r["transitions"]) for r in leaders(final))
        out["metrics"]["max_group_size"] = max(
            (s["group_size"] for s in result.status_samples), default=None)
    elif path is not None:
        final = httpx.get(f"{url}{path}", timeout=60).json()
        out["metrics"]["transitions"] = sum(r["transitions_total"] for r in final["replicas"])
    return out


def run_dp2(configs, requests, prompts, *, budget: str, slo: M.Slo, drain_timeout_s: float,
            engines: Path | None, swap_order: Path, out_dir: Path,
            kunserve: KunServeArm = KunServeArm(), dp_size: int = 2,
            checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Each arm in turn; an arm whose server fails records the error and the next one runs.
    ``checkpoint`` gets the results so far after each arm (a long run keeps what it measured)."""
    kv_tokens = kv_tokens_for(budget)
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "kv_capacity_tokens_per_replica": kv_tokens, "replica_budget": budget,
        "dp_size": dp_size, "total_budget": f"{dp_size} x {budget}", "dtype": DTYPE,
        "reference": REFERENCE,
        "server_env": SERVER_ENV, "server_nice": SERVER_NICE, "configs": {}}
    arms = out["configs"]
    for name in configs:
        log = raw / f"{name}_transitions.jsonl"
        log.unlink(missing_ok=True)
        args = server_args(name, budget, kv_tokens, engines, log, swap_order, kunserve, dp_size)
        forwards_log = raw / f"{name}_forwards.jsonl"
        forwards_log.unlink(missing_ok=True)
        env = {**SERVER_ENV, TIMINGS_ENV: str(forwards_log.resolve())}
        t0 = time.time()
        try:
            with running_server(args, raw / f"{name}_server.log", env=env) as server:
                behind_the_client(server)
                startup_s = time.time() - t0
                res = run_arm(server.url, name, requests, prompts, slo, drain_timeout_s, 30)
        except Exception as e:  # e.g. SGLang's watchdog killed a scheduler mid-forward
            arms[name] = {"error": f"{type(e).__name__}: {e}", "server_args": list(args),
                          "failed_after_s": time.time() - t0,
                          "server_log": f"raw/{name}_server.log"}
            print(f"[replay dp2] {name}: FAILED {arms[name]['error']}", flush=True)
        else:
            res.update(server_args=list(args), startup_s=startup_s,
                       kv_capacity_tokens_per_replica_at_start=kv_tokens,
                       forwards=arm_forwards(forwards_log, res, name))
            arms[name] = res
            m = res["metrics"]
            print(f"[replay dp2] {name}: TTFT p50 {m['ttft_s']['p50']:.2f} p99 "
                  f"{m['ttft_s']['p99']:.2f} s, TPOT p50 {m['tpot_s']['p50']:.3f} s",
                  flush=True)
        add_agreement(arms)
        if checkpoint is not None:
            checkpoint(out)
    return out


def arm_forwards(path: Path, arm: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The cost model and step gaps of the arm's forwards during the replay (its server's
    warm-up before the replay's start left out; KunServe's: outside its merged windows, with
    the merged decode forwards' ratio to them); None when there is no log."""
    if not path.exists():
        return None
    during = [f for f in forwards.read_log(path) if f.get("t", 0.0) >= arm["start_unix_s"]]
    windows = [(a, min(b, arm["end_unix_s"])) for a, b in merged_windows(arm)]
    try:
        return {**forwards.summarize(during, f"the {name} arm's forwards during the replay",
                                     windows),
                "log": f"raw/{path.name}"}
    except ValueError as e:
        return {"error": str(e), "log": f"raw/{path.name}"}


def add_agreement(arms: dict[str, Any]) -> None:
    if "records" not in arms.get(REFERENCE, {}):
        return

    def outputs(c):
        return {r["index"]: r["output_ids"] for r in c["records"]
                if r["error"] is None and r["chunks"]}

    ref = outputs(arms[REFERENCE])
    for c in arms.values():
        if "records" in c:
            c.setdefault("quality", {}).update(M.agreement(outputs(c), ref))


def targets(arms: dict[str, Any]) -> dict[str, Any]:
    """The targets for KunServe against plain DP 2, computed, never asserted."""
    if not all("metrics" in arms.get(name, {}) for name in ("dp2", "kunserve")):
        return {}
    dp, ks = arms["dp2"]["metrics"], arms["kunserve"]["metrics"]
    return {
        "p99_ttft_ratio_dp2_over_kunserve": (dp["ttft_s"]["p99"] / ks["ttft_s"]["p99"]
                                             if ks["ttft_s"]["p99"] else None),
        "p50_tpot_increase_kunserve_over_dp2": (ks["tpot_s"]["p50"] / dp["tpot_s"]["p50"] - 1
                                                if dp["tpot_s"]["p50"] else None),
        "exact_match_kunserve_vs_dp2": arms["kunserve"]["quality"].get("exact_match_rate"),
        "goals": {"p99_ttft_ratio_dp2_over_kunserve": ">= 5",
                  "p50_tpot_increase_kunserve_over_dp2": "<= 0.30",
                  "exact_match_kunserve_vs_dp2": "1.0"},
    }


def markdown(report: dict[str, Any]) -> str:
    st, dp = report["settings"], report["dp2"]
    rows = [
        f"# Bursty-load replay, {dp.get('dp_size', 2)} replicas "
        f"({st['trace']['path'].split('/')[-1]})", "",
        f"commit {st['git']['commit']}{' (dirty)' if st['git']['dirty'] else ''}, "
        f"{st['machine']['cpu_model']}, {st['machine']['cpu_cores']} cores; load average "
        f"before {st['load_average']}, after {report.get('load_average_after')}; "
        f"{st['requests']} requests over {st['replay_duration_s']:.0f} s; {dp['dtype']}, "
        f"budget {dp['replica_budget']} per replica (weights + KV; KV for "
        f"{dp['kv_capacity_tokens_per_replica']} tokens per replica at full precision), "
        f"{dp['total_budget']} per arm; server env {dp.get('server_env')}, nice "
        f"{dp.get('server_nice', 0)} below the client; wall "
        f"{report.get('wall_s', 0):.0f} s; arms done {report.get('arms_done')} of "
        f"{report.get('arms_planned')}", "", f"Command: `{st.get('command')}`", "",
        f"TTFT SLO {st['slo']['ttft_s']} s; exact match and ROUGE-L against `{dp['reference']}`",
        "",
        "| arm | TTFT p50 / p95 / p99 s | TPOT p50 / p95 s | E2E p50 / p95 s | queue p95 s "
        "| SLO viol. | tok/s | failed | transitions | max KV tokens (pair) | quantized tokens "
        "(W4) | exact match | ROUGE-L |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt, pct = R._fmt, R._pct
    for name, c in dp["configs"].items():
        if "error" in c:
            rows.append(f"| {name} | failed after {c['failed_after_s']:.0f} s: {c['error'][:160]} "
                        f"(see {c['server_log']}) |" + " |" * 12)
            continue
        m, q = c["metrics"], c.get("quality", {})
        rows.append(
            f"| {name} | {fmt(m['ttft_s']['p50'])} / {fmt(m['ttft_s']['p95'])} / "
            f"{fmt(m['ttft_s']['p99'])} | {fmt(m['tpot_s']['p50'], 3)} / "
            f"{fmt(m['tpot_s']['p95'], 3)} | {fmt(m['e2e_s']['p50'])} / {fmt(m['e2e_s']['p95'])} "
            f"| {fmt(m['queue_time_s']['p95'])} | {pct(m['slo_violation_rate'])} "
            f"| {fmt(m['throughput_tokens_per_s'], 1)} | {m['failed']} "
            f"| {m.get('transitions', '-')} | {m['max_kv_capacity_tokens'] or '-'} "
            f"| {pct(m['quantized_token_share'])} ({pct(m['w4_token_share'])}) "
            f"| {pct(q.get('exact_match_rate'))} | {fmt(q.get('rouge_l_f1'), 3)} |")
    t = report.get("targets") or {}
    if t:
        rows += ["", f"Targets (KunServe vs plain DP {dp.get('dp_size', 2)}): " + json.dumps(
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()
             if k != "goals"}) + "; goals " + json.dumps(t["goals"])]
    ks = dp["configs"].get("kunserve")
    if ks:
        rows += ["", "KunServe transitions (each pair's first replica; seconds since the replay "
                 "started):", ""]
        for tr in sorted(ks["kunserve_transitions"], key=lambda tr: tr["at_unix_s"]):
            if tr["replica"] % 2 == 0:
                rows.append(f"- {tr['at_unix_s'] - ks['start_unix_s']:.1f} s pair "
                            f"[{tr['replica']}, {tr['replica'] + 1}] {tr['action']} "
                            f"({tr['trigger']}, {tr['duration_s']:.2f} s, "
                            f"{tr['requests_in_flight']} in flight, KV "
                            f"{tr['kv_capacity_tokens'][0]} -> {tr['kv_capacity_tokens'][1]} "
                            f"tokens per replica): {tr['reason']}")
    return "\n".join(rows) + "\n"


def plot_kunserve_timeline(config: dict[str, Any], reference: dict[str, Any] | None,
                           path: Path, ttft_slo_s: float) -> None:
    """Arrivals and queue, each replica's KV capacity and use, layers held per replica (the
    group), TTFT by arrival (plain DP's beside it when it ran)."""
    import numpy as np

    plt = R.pyplot()
    start = config["start_unix_s"]
    recs, samples = config["records"], config["status_samples"]
    ts = [s["t"] - start for s in samples]
    colors = ("tab:green", "tab:purple", "tab:olive", "tab:cyan", "tab:brown", "tab:pink")
    replicas = range(min(len(colors), len(samples[0]["kv_capacity_per_replica"]) if samples
                         else 2))
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    arrivals = np.array([r["scheduled_unix_s"] - start for r in recs])
    ax = axes[0]
    ax.hist(arrivals, bins=np.arange(0, max(arrivals.max(), max(ts, default=0)) + 1.0, 1.0),
            color="tab:gray", alpha=0.6, label="arrivals / s")
    ax.plot(ts, [s["num_waiting_reqs"] for s in samples], color="tab:red", label="waiting")
    ax.plot(ts, [s["num_running_reqs"] for s in samples], color="tab:blue", label="running")
    ax.set_ylabel("requests (all replicas)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    for i, color in zip(replicas, colors):
        ax.step(ts, [s["kv_capacity_per_replica"][i] for s in samples], where="post",
                color=color, label=f"replica {i} KV capacity")
        ax.plot(ts, [s["kv_used_per_replica"][i] for s in samples], color=color, ls=":",
                label=f"replica {i} KV used")
    ax.set_ylabel("KV tokens (own pool)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    for i, color in zip(replicas, colors):
        ax.step(ts, [s["layers_per_replica"][i] + 0.3 * i for s in samples], where="post",
                color=color, label=f"replica {i} layers held")
    ax.step(ts, [10 * s["group_size"] for s in samples], where="post", color="k", lw=0.8,
            label="10 x group size")
    ax.set_ylabel("layers / group")
    ax.legend(loc="center right", fontsize=8)
    ax = axes[3]
    for name, c, color in (("kunserve", config, "tab:orange"),
                           ("dp2", reference, "tab:gray")):
        if c is None:
            continue
        ok = [r for r in c["records"] if r["ttft_s"] is not None]
        ax.scatter([r["scheduled_unix_s"] - c["start_unix_s"] for r in ok],
                   [r["ttft_s"] for r in ok], s=8, color=color, label=name)
    ax.axhline(ttft_slo_s, color="k", ls="--", lw=0.8, label=f"SLO {ttft_slo_s} s")
    ax.set_ylabel("TTFT s (by arrival)")
    ax.set_xlabel("seconds since replay start")
    ax.legend(loc="upper right", fontsize=8)
    for tr in config.get("kunserve_transitions", []):
        if tr["replica"] % 2 == 0:  # each pair's first replica
            for a in axes:
                a.axvline(tr["at_unix_s"] - start, color="tab:red" if tr["action"] == "drop"
                          else "tab:green", lw=0.8, alpha=0.6)
    fig.suptitle(f"KunServe (auto) on {len(replicas)} replicas: capacity and groups")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: dict[str, Any], out_dir: Path) -> None:
    """``replay_dp2.json`` (every request's latencies, samples, transitions), ``replay_dp2.md``,
    ``timeline_kunserve.png``, ``cdf_dp2.png``; output ids in ``raw/replay_dp2_full.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "raw").mkdir(exist_ok=True)
    report["targets"] = targets(report["dp2"]["configs"])
    (out_dir / "raw" / "replay_dp2_full.json").write_text(json.dumps(report))
    slim = {**report, "dp2": {**report["dp2"], "configs": {
        name: {**c, "records": [{k: v for k, v in r.items() if k not in ("chunks", "output_ids")}
                                for r in c["records"]]} if "records" in c else c
        for name, c in report["dp2"]["configs"].items()}}}
    (out_dir / "replay_dp2.json").write_text(json.dumps(slim, indent=1))
    md = markdown(report)
    (out_dir / "replay_dp2.md").write_text(md)
    print(md)
    arms = {k: c for k, c in report["dp2"]["configs"].items() if "records" in c}
    if "kunserve" in arms:
        plot_kunserve_timeline(arms["kunserve"], arms.get("dp2"),
                               out_dir / "timeline_kunserve.png", report["settings"]["slo"]["ttft_s"])
    R.plot_cdfs({"configs": arms, "settings": report["settings"]}, out_dir / "cdf_dp2.png")
