"""Bursty-load benchmark: replay an arrival trace against SGLang in each serving configuration.

    python -m benchmark.replay                      # default CPU profile, all six configs
    python -m benchmark.replay --quick              # harness check (CI), < 2 minutes
    python -m benchmark.replay --url http://127.0.0.1:30000 --label mine   # a running server
    python -m benchmark.replay --sweep 0.5,1,2,3    # rate sweep, full precision vs morph default
    python -m benchmark.replay --dp2                # two replicas: KunServe, DP 2, morph, W4

Every configuration gets a fresh server (``scripts/serve.sh``) with the same memory budget for
weights + KV (``--morph-memory-budget``), the same trace and the same prompts. See
benchmark/README.md for the method.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmark.harness import (REPO_ROOT, SERVER_NICE, behind_the_client, build_engines,
                               git_state, load_average, machine_info, running_server)
from benchmark.replay import metrics as M
from benchmark.replay import report as R
from benchmark.replay.client import replay
from benchmark.replay.trace import TRACES, TraceWindow, load_window, prompt_token_ids
from sglang_morph.kunserve.live.config import MERGED_PRIORITIES
from sglang_morph.repo_data import WIKITEXT2_TRAIN_HEAD

RESULTS = Path(__file__).resolve().parents[1] / "results"
SWAP_ORDER = RESULTS / "swap_order.json"
CORPUS = WIKITEXT2_TRAIN_HEAD
CONFIG_NAMES = ("fp", "w4", "mixed", "accuracy", "default", "performance")
STATIC = ("fp", "w4", "mixed")


@dataclasses.dataclass(frozen=True)
class Profile:
    """One benchmark setting: the trace window, the budget, the SLOs and what to run."""

    window: TraceWindow
    budget: str
    slo: M.Slo
    configs: tuple[str, ...]
    mixed_layers: int  # the static mixed config quantizes the first N layers of the LIS order
    ppl_tokens: int
    drain_timeout_s: float
    out_dir: Path


# The default CPU profile: the Azure code trace at 1,190-1,220 s — the tail of one burst
# (about 10 requests/s), a 4-s lull, a second burst of about 116 requests in 12 s, then
# silence — every fifth request, stretched 3x (this CPU serves about 1 request/s of this size);
# prompts scaled 1/8 and outputs 2x so a request holds a few hundred KV tokens for tens of
# decode steps. Under the 290 MB budget full precision has KV for 863 tokens.
DEFAULT_WINDOW = dict(path=TRACES / "azure_llm_2023_code.csv", start_s=1190.0, duration_s=30.0,
                      time_scale=3.0, keep_every=5, prompt_scale=0.125, output_scale=2.0,
                      min_prompt_tokens=32, max_prompt_tokens=384, min_output_tokens=16,
                      max_output_tokens=64)
DEFAULT_BUDGET = "290MB"
QUICK_WINDOW = dict(DEFAULT_WINDOW, start_s=1203.0, duration_s=4.0, keep_every=4, time_scale=2.0,
                    max_prompt_tokens=96, min_output_tokens=8, max_output_tokens=12)


def server_args(name: str, budget: str, engines: Path, mixed_layers: int,
                log: Path) -> tuple[str, ...]:
    # --enable-metrics makes SGLang report each request's queueing time in its meta_info.
    base = ("--enable-morph", "--morph-memory-budget", budget, "--morph-log", str(log),
            "--enable-metrics")
    static = base + ("--morph-engines", str(engines), "--disable-morph-controller")
    if name == "fp":
        return static  # no controller and no map: nothing is swapped; budget and status stay
    if name == "w4":
        return static + ("--morph-precision-map", "*:4")
    if name == "mixed":
        order = json.loads(SWAP_ORDER.read_text())["order"][:mixed_layers]
        return static + ("--morph-precision-map", ",".join(f"{i}:4" for i in order))
    return base + ("--morph-engines", str(engines), "--morph-swap-order", str(SWAP_ORDER),
                   "--morph-mode", name)


def repo_path(path: Path) -> str:
    """A path inside the checkout relative to its root (results do not name the checkout)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flush_and_restore(url: str) -> None:
    """Back to the start state between sweep points: all layers at 16 bits and still the
    controller's (``"pin": false``: an operator's swap would otherwise pin them), empty cache."""
    status = httpx.get(f"{url}/morph/status", timeout=60).json()
    quantized = [layer["index"] for layer in status["layers"] if layer["bits"] != 16]
    if quantized:
        httpx.post(f"{url}/morph/swap", json={"layers": quantized, "bits": 16, "pin": False},
                   timeout=120).raise_for_status()
    httpx.post(f"{url}/flush_cache", timeout=60)


def run_one(url: str, name: str, requests, prompts, profile: Profile,
            log_path: Path | None) -> dict[str, Any]:
    result = replay(url, requests, prompts, profile.drain_timeout_s, label=name)
    status = httpx.get(f"{url}/morph/status", timeout=60).json()
    transitions = read_log(log_path) if log_path else status["transitions"]
    steps = M.precision_steps(transitions, len(status["layers"]))
    during = [t for t in transitions
              if result.start_unix_s <= t["time_unix_s"] <= result.end_unix_s]
    out = {
        "metrics": M.summarize(result, profile.slo, steps) | {"transitions": len(during)},
        "records": [r.to_json() for r in result.records],
        "status_samples": result.status_samples, "client_stalls": result.client_stalls,
        "start_unix_s": result.start_unix_s,
        "transitions": during,
    }
    return out


def perplexity(url: str, tokens: int) -> float:
    from benchmark.perplexity import server_perplexity

    return server_perplexity(url, max_tokens=tokens).perplexity


def git_and_machine() -> dict[str, Any]:
    return {"git": git_state(), "machine": machine_info(), "load_average": load_average()}


def load_inputs(window: TraceWindow):
    from transformers import AutoTokenizer

    from sglang_morph.models import default_model_path

    model = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = load_window(window, context_tokens=tokenizer.model_max_length
                           if tokenizer.model_max_length < 10**6 else None)
    need_chars = sum(r.prompt_tokens for r in requests) * 8  # < 8 characters per token here
    corpus_ids = tokenizer(CORPUS.read_text()[:need_chars], verbose=False)["input_ids"]
    return requests, prompt_token_ids(requests, corpus_ids)


def engines_dir() -> Path:
    return build_engines("--bits", "8,4")  # cached after the first build


def trace_settings(window: TraceWindow, requests: Sequence[Any]) -> dict[str, Any]:
    """What every report says of the replayed trace (single-server and two-replica drivers)."""
    return {
        "trace": dataclasses.asdict(window) | {"path": repo_path(window.path)},
        "requests": len(requests),
        "replay_duration_s": window.replay_duration_s,
        "offered_requests_per_s": len(requests) / window.replay_duration_s,
        "prompt_tokens_total": sum(r.prompt_tokens for r in requests),
        "output_tokens_total": sum(r.output_tokens for r in requests),
    }


def run_driver(profile: Profile) -> dict[str, Any]:
    requests, prompts = load_inputs(profile.window)
    engines = engines_dir()
    raw = profile.out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "settings": {
            **trace_settings(profile.window, requests),
            "memory_budget": profile.budget,
            "slo": dataclasses.asdict(profile.slo),
            "mixed_layers": profile.mixed_layers,
            "engines": str(engines),
            "swap_order": repo_path(SWAP_ORDER),
            "prompt_corpus": str(CORPUS.name),
            "sampling": "greedy, ignore_eos, max_new_tokens = the request's output length",
            "server_nice": SERVER_NICE,
        } | git_and_machine(),
        "configs": {},
    }
    started = time.time()
    for name in profile.configs:
        log_path = raw / f"{name}_transitions.jsonl"
        log_path.unlink(missing_ok=True)
        args = server_args(name, profile.budget, engines, profile.mixed_layers, log_path)
        t0 = time.time()
        with running_server(args, raw / f"{name}_server.log") as server:
            behind_the_client(server)
            url = server.url
            startup_s = time.time() - t0
            status0 = httpx.get(f"{url}/morph/status", timeout=60).json()
            res = run_one(url, name, requests, prompts, profile, log_path)
            res["server_args"] = list(args)
            res["startup_s"] = startup_s
            res["kv_capacity_tokens_at_start"] = status0["kv_capacity_tokens"]
            if name in STATIC:
                res["quality"] = {"perplexity": perplexity(url, profile.ppl_tokens)}
        report["configs"][name] = res
        print(f"[replay] {name}: TTFT p95 {res['metrics']['ttft_s']['p95']:.2f} s, "
              f"SLO violations {100 * res['metrics']['slo_violation_rate']:.1f}%", flush=True)
    report["wall_s"] = time.time() - started
    add_agreement(report)
    return report


def add_agreement(report: dict[str, Any]) -> None:
    """Outputs of every config vs the full-precision run, request by request."""
    if "fp" not in report["configs"]:
        return
    def outputs(c):
        return {r["index"]: r["output_ids"] for r in c["records"]
                if r["error"] is None and r["chunks"]}

    ref = outputs(report["configs"]["fp"])
    for c in report["configs"].values():
        c.setdefault("quality", {}).update(M.agreement(outputs(c), ref))


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The targets for morph default, computed, never asserted."""
    cfg = report["configs"]
    if not {"fp", "default"} <= set(cfg):
        return {}
    fp, md = cfg["fp"]["metrics"], cfg["default"]["metrics"]
    out: dict[str, Any] = {
        "p95_ttft_ratio_fp_over_default": (fp["ttft_s"]["p95"] / md["ttft_s"]["p95"]
                                           if md["ttft_s"]["p95"] else None),
        "slo_violation_reduction": (1 - md["slo_violation_rate"] / fp["slo_violation_rate"]
                                    if fp["slo_violation_rate"] else None),
    }
    if "w4" in cfg:
        gap_w4 = 1 - cfg["w4"]["quality"]["rouge_l_f1"]
        gap_md = 1 - cfg["default"]["quality"]["rouge_l_f1"]
        out["rouge_l_gap_default_over_w4"] = gap_md / gap_w4 if gap_w4 > 0 else None
    out["goals"] = {"p95_ttft_ratio_fp_over_default": ">= 3.9",
                    "slo_violation_reduction": ">= 0.95",
                    "rouge_l_gap_default_over_w4": "<= 0.40"}
    return out


def write_report(report: dict[str, Any], out_dir: Path, timeline_configs: Sequence[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    report["targets"] = targets(report)
    # Every streamed chunk and output id go to raw/ (large); the results JSON keeps each
    # request's latencies, which the tables and plots need.
    (out_dir / "raw").mkdir(exist_ok=True)
    (out_dir / "raw" / "replay_full.json").write_text(json.dumps(report))
    slim = {**report, "configs": {
        name: {**c, "records": [{k: v for k, v in r.items() if k not in ("chunks", "output_ids")}
                                for r in c["records"]]}
        for name, c in report["configs"].items()}}
    (out_dir / "replay.json").write_text(json.dumps(slim, indent=1))
    md = [f"# Bursty-load replay ({report['settings']['trace']['path'].split('/')[-1]})", "",
          f"commit {report['settings']['git']['commit']}"
          f"{' (dirty)' if report['settings']['git']['dirty'] else ''}, "
          f"{report['settings']['machine']['cpu_model']}, "
          f"{report['settings']['machine']['cpu_cores']} cores; {report['settings']['requests']} "
          f"requests over {report['settings']['replay_duration_s']:.0f} s, budget "
          f"{report['settings']['memory_budget']}; wall {report.get('wall_s', 0):.0f} s", "",
          R.markdown_table(report)]
    if report["targets"]:
        md += ["", "Targets (morph default): " + json.dumps(
            {k: (round(v, 3) if isinstance(v, float) else v)
             for k, v in report["targets"].items() if k != "goals"}), ""]
    (out_dir / "replay.md").write_text("\n".join(md))
    print("\n".join(md))
    for name in timeline_configs:
        if name in report["configs"]:
            c = report["configs"][name]
            R.plot_timeline(name, c, c["start_unix_s"], out_dir / f"timeline_{name}.png",
                            report["settings"]["slo"]["ttft_s"])
    R.plot_cdfs(report, out_dir / "cdf.png")


def run_sweep(profile: Profile, multipliers: Sequence[float]) -> dict[str, Any]:
    """Full precision vs morph default at several rates: one server per config, the state
    reset between points (every layer back to 16 bits, cache flushed)."""
    requests, prompts = load_inputs(profile.window)
    engines = engines_dir()
    raw = profile.out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    base_rate = len(requests) / profile.window.replay_duration_s
    sweep: dict[str, Any] = {"settings": {"trace": dataclasses.asdict(profile.window)
                                          | {"path": repo_path(profile.window.path)},
                                          "memory_budget": profile.budget,
                                          "slo": dataclasses.asdict(profile.slo),
                                          "base_requests_per_s": base_rate} | git_and_machine(),
                             "configs": {}}
    for name in ("fp", "default"):
        args = server_args(name, profile.budget, engines, profile.mixed_layers,
                           raw / f"sweep_{name}_transitions.jsonl")
        points = []
        with running_server(args, raw / f"sweep_{name}_server.log") as server:
            behind_the_client(server)
            url = server.url
            for k in multipliers:
                scaled = [dataclasses.replace(r, arrival_s=r.arrival_s / k) for r in requests]
                flush_and_restore(url)
                res = run_one(url, f"{name} x{k}", scaled, prompts, profile, None)
                points.append({"rate_multiplier": k, "offered_requests_per_s": base_rate * k,
                               "metrics": res["metrics"]})
        sweep["configs"][name] = points
    out = profile.out_dir
    (out / "sweep.json").write_text(json.dumps(sweep, indent=1))
    md = R.sweep_markdown(sweep)
    (out / "sweep.md").write_text(md)
    R.plot_sweep(sweep, out / "sweep.png")
    print(md)
    return sweep


def run_dp2_arms(profile: Profile, replica_budget: str | None,
                 kunserve: "dp2.KunServeArm | None" = None, dp_size: int = 2) -> dict[str, Any]:
    from benchmark.replay import dp2

    kunserve = kunserve or dp2.KunServeArm()
    requests, prompts = load_inputs(profile.window)
    engines = engines_dir() if {"morph_dp2", "w4_dp2"} & set(profile.configs) else None
    budget = replica_budget or dp2.REPLICA_BUDGET
    report: dict[str, Any] = {"settings": {
        **trace_settings(profile.window, requests),
        "slo": dataclasses.asdict(profile.slo),
        "engines": str(engines) if engines else None,
        "swap_order": repo_path(SWAP_ORDER),
        "prompt_corpus": str(CORPUS.name),
        **kunserve.settings(),
        "sampling": "greedy, ignore_eos, max_new_tokens = the request's output length",
        "command": " ".join(sys.argv),
    } | git_and_machine()}
    started = time.time()

    def checkpoint(arms: dict[str, Any]) -> None:
        report.update(dp2=arms, wall_s=time.time() - started, load_average_after=load_average(),
                      arms_done=len(arms["configs"]), arms_planned=len(profile.configs))
        dp2.write(report, profile.out_dir)

    dp2.run_dp2(profile.configs, requests, prompts, budget=budget, slo=profile.slo,
                drain_timeout_s=profile.drain_timeout_s, engines=engines,
                swap_order=SWAP_ORDER, out_dir=profile.out_dir, kunserve=kunserve,
                dp_size=dp_size, checkpoint=checkpoint)
    return report


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Profile]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="harness check: a 4-s window, tiny lengths, fp + default (< 2 min)")
    p.add_argument("--url", help="replay against this running server instead of starting any")
    p.add_argument("--label", default="server", help="name of the --url run in the results")
    p.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIG_NAMES)}")
    p.add_argument("--trace", type=Path, help="trace CSV (Azure 2023 or BurstGPT format)")
    p.add_argument("--window", metavar="START:DURATION", help="trace seconds, e.g. 1195:40")
    p.add_argument("--time-scale", type=float, help="replay seconds per trace second")
    p.add_argument("--keep-every", type=int, help="keep every k-th request of the window")
    p.add_argument("--prompt-scale", type=float)
    p.add_argument("--output-scale", type=float)
    p.add_argument("--max-prompt-tokens", type=int)
    p.add_argument("--max-output-tokens", type=int)
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help=f"--morph-memory-budget of every server (default {DEFAULT_BUDGET})")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO in seconds")
    p.add_argument("--tpot-slo", type=float, help="optional TPOT SLO in seconds")
    p.add_argument("--mixed-layers", type=int, default=15,
                   help="W4 layers of the static mixed config (first N of the LIS order)")
    p.add_argument("--sweep", help="comma-separated rate multipliers: run the rate sweep")
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--dp2", action="store_true",
                   help="the two-replica arms instead (benchmark/replay/dp2.py): --configs from "
                   "dp2,kunserve,morph_dp2,w4_dp2 (default all), float32")
    p.add_argument("--dp-size", type=int, default=None, metavar="N",
                   help="--dp2: replicas of every arm, even (default 2; 4: plain DP 4 against "
                   "two KunServe pairs)")
    p.add_argument("--replica-budget", default=None,
                   help="--dp2: weights + KV budget of each replica (default 580MB)")
    p.add_argument("--kunserve-auto-config", default=None, metavar="JSON",
                   help="--dp2: the kunserve arm's --kunserve-auto-config (default: none)")
    p.add_argument("--kunserve-merged-max-running", type=int, default=None, metavar="N",
                   help="--dp2: the kunserve arm's --kunserve-merged-max-running (default: none)")
    p.add_argument("--kunserve-merged-chunked-prefill", type=int, default=None,
                   metavar="TOKENS", help="--dp2: the kunserve arm's "
                   "--kunserve-merged-chunked-prefill (default: none)")
    p.add_argument("--kunserve-merged-priority", default=None, choices=MERGED_PRIORITIES,
                   help="--dp2: the kunserve arm's --kunserve-merged-priority (default: the "
                   "server's)")
    p.add_argument("--kunserve-merged-prefill-gap-steps", type=int, default=None, metavar="N",
                   help="--dp2: the kunserve arm's --kunserve-merged-prefill-gap-steps "
                   "(default: none)")
    a = p.parse_args(argv)
    window = dict(QUICK_WINDOW if a.quick else DEFAULT_WINDOW)
    if a.trace:
        window["path"] = a.trace
    if a.window:
        try:
            start, duration = (float(x) for x in a.window.split(":"))
        except ValueError:
            p.error(f"--window wants START:DURATION in trace seconds, got {a.window!r}")
        window.update(start_s=start, duration_s=duration)
    for key in ("time_scale", "keep_every", "prompt_scale", "output_scale",
                "max_prompt_tokens", "max_output_tokens"):
        if getattr(a, key) is not None:
            window[key] = getattr(a, key)
    try:
        w = TraceWindow(**window)
    except ValueError as e:
        p.error(str(e))
    from benchmark.replay.dp2 import DP2_CONFIGS

    names = DP2_CONFIGS if a.dp2 else CONFIG_NAMES
    configs = tuple(a.configs.split(",")) if a.configs else (
        ("fp", "default") if a.quick and not a.dp2 else names)
    unknown = set(configs) - set(names)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(names)}"
                f"{' (with --dp2)' if a.dp2 else ''}")
    dp2_only = [flag for flag, value in (
        ("--dp-size", a.dp_size),
        ("--replica-budget", a.replica_budget),
        ("--kunserve-auto-config", a.kunserve_auto_config),
        ("--kunserve-merged-max-running", a.kunserve_merged_max_running),
        ("--kunserve-merged-chunked-prefill", a.kunserve_merged_chunked_prefill),
        ("--kunserve-merged-priority", a.kunserve_merged_priority),
        ("--kunserve-merged-prefill-gap-steps", a.kunserve_merged_prefill_gap_steps))
        if value is not None]
    if not a.dp2 and dp2_only:
        p.error(f"{', '.join(dp2_only)} {'goes' if len(dp2_only) == 1 else 'go'} with --dp2")
    if a.dp_size is not None and (a.dp_size < 2 or a.dp_size % 2):
        p.error(f"--dp-size must be even and at least 2 (KunServe serves pairs), got {a.dp_size}")
    out = a.out or (RESULTS / "raw" / "replay_quick" if a.quick else RESULTS / "replay")
    profile = Profile(w, a.budget, M.Slo(a.ttft_slo, a.tpot_slo), configs,
                      a.mixed_layers, 512 if a.quick else 3072, 120.0 if a.quick else 300.0, out)
    return a, profile


def main(argv: Sequence[str] | None = None) -> int:
    a, profile = parse_args(argv)
    if a.url:
        requests, prompts = load_inputs(profile.window)
        res = run_one(a.url, a.label, requests, prompts, profile, None)
        profile.out_dir.mkdir(parents=True, exist_ok=True)
        path = profile.out_dir / f"replay_{a.label}.json"
        path.write_text(json.dumps(res, indent=1))
        print(json.dumps(res["metrics"], indent=1))
        print(f"[replay] wrote {path}")
        return 0
    if a.sweep:
        run_sweep(profile, [float(x) for x in a.sweep.split(",")])
        return 0
    if a.dp2:
        from benchmark.replay.dp2 import KunServeArm

        run_dp2_arms(profile, a.replica_budget, KunServeArm(
            a.kunserve_auto_config, a.kunserve_merged_max_running,
            a.kunserve_merged_chunked_prefill, a.kunserve_merged_priority,
            a.kunserve_merged_prefill_gap_steps),
            dp_size=a.dp_size or 2)
        return 0
    report = run_driver(profile)
    write_report(report, profile.out_dir, profile.configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
