"""Results of a replay run as Markdown and PNG plots (timelines, latency CDFs, rate sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _disagreeing(m: dict[str, Any]) -> str:
    """Requests whose provenance and log-inferred quantized tokens differ by more than one
    token per transition during them, of those compared ("-": the server reported none)."""
    if m.get("provenance_disagreements") is None:
        return "-"
    return f"{m['provenance_disagreements']} of {m['provenance_compared']}"


def markdown_table(report: dict[str, Any]) -> str:
    """The configs side by side. "quantized tokens" is what the servers' precision provenance
    says (``meta_info.morph_precision``); "by log" is the same share inferred from the
    transitions log and chunk arrival times, with the requests on which the two disagree."""
    slo = report["settings"]["slo"]
    rows = [
        f"TTFT SLO {slo['ttft_s']} s" + (f", TPOT SLO {slo['tpot_s']} s" if slo["tpot_s"] else ""),
        "",
        "| config | TTFT p50 / p95 / p99 s | TPOT p50 / p95 s | E2E p50 / p95 s | queue p95 s "
        "| SLO viol. | tok/s | goodput req/s | retractions | max KV tokens | quantized tokens "
        "(W4) | by log (disagreeing req.) | max quantized layers (W4) | exact match | ROUGE-L "
        "| ppl |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in report["configs"].items():
        m, q = c["metrics"], c.get("quality", {})
        rows.append(
            f"| {name} | {_fmt(m['ttft_s']['p50'])} / {_fmt(m['ttft_s']['p95'])} / "
            f"{_fmt(m['ttft_s']['p99'])} | {_fmt(m['tpot_s']['p50'], 3)} / "
            f"{_fmt(m['tpot_s']['p95'], 3)} | {_fmt(m['e2e_s']['p50'])} / {_fmt(m['e2e_s']['p95'])} "
            f"| {_fmt(m['queue_time_s']['p95'])} | {_pct(m['slo_violation_rate'])} "
            f"| {_fmt(m['throughput_tokens_per_s'], 1)} | {_fmt(m['goodput_requests_per_s'])} "
            f"| {m['retractions']} | {m['max_kv_capacity_tokens']} "
            f"| {_pct(m['quantized_token_share'])} ({_pct(m['w4_token_share'])}) "
            f"| {_pct(m.get('quantized_token_share_log'))} "
            f"({_disagreeing(m)}) "
            f"| {m['max_quantized_layers']} ({m['max_w4_layers']}) "
            f"| {_pct(q.get('exact_match_rate'))} "
            f"| {_fmt(q.get('rouge_l_f1'), 3)} | {_fmt(q.get('perplexity'))} |")
    return "\n".join(rows) + "\n"


def plot_timeline(name: str, config: dict[str, Any], start_unix_s: float, path: Path,
                  ttft_slo_s: float) -> None:
    plt = pyplot()
    recs, samples = config["records"], config["status_samples"]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    arrivals = np.array([r["scheduled_unix_s"] - start_unix_s for r in recs])
    end = max([arrivals.max()] + [s["t"] - start_unix_s for s in samples]) if len(arrivals) else 1
    bins = np.arange(0, end + 1.0, 1.0)
    ax = axes[0]
    ax.hist(arrivals, bins=bins, color="tab:gray", alpha=0.6, label="arrivals / s")
    ts = [s["t"] - start_unix_s for s in samples]
    ax.plot(ts, [s["num_waiting_reqs"] for s in samples], color="tab:red", label="waiting")
    ax.plot(ts, [s["num_running_reqs"] for s in samples], color="tab:blue", label="running")
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    ax.plot(ts, [s["kv_capacity_tokens"] for s in samples], label="KV capacity")
    ax.plot(ts, [s["kv_used_tokens"] for s in samples], label="KV used")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    ax.step(ts, [s["quantized_layers"] for s in samples], where="post", color="tab:purple")
    ax.set_ylabel("quantized layers")
    ax = axes[3]
    ok = [r for r in recs if r["ttft_s"] is not None]
    ax.scatter([r["scheduled_unix_s"] - start_unix_s for r in ok], [r["ttft_s"] for r in ok],
               s=8, color="tab:orange")
    ax.axhline(ttft_slo_s, color="k", ls="--", lw=0.8, label=f"SLO {ttft_slo_s} s")
    ax.set_ylabel("TTFT s (by arrival)")
    ax.set_xlabel("seconds since replay start")
    ax.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"{name}: timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, c in report["configs"].items():
        for ax, key in zip(axes, ("ttft_s", "tpot_s")):
            v = np.sort([r[key] for r in c["records"] if r[key] is not None])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
    for ax, label in zip(axes, ("TTFT s", "TPOT s")):
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].axvline(report["settings"]["slo"]["ttft_s"], color="k", ls="--", lw=0.8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_markdown(sweep: dict[str, Any]) -> str:
    rows = ["| config | rate x | offered req/s | TTFT p95 s | SLO viol. | tok/s | goodput req/s "
            "| max quantized layers |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, points in sweep["configs"].items():
        for p in points:
            m = p["metrics"]
            rows.append(f"| {name} | {p['rate_multiplier']} | {_fmt(p['offered_requests_per_s'])} "
                        f"| {_fmt(m['ttft_s']['p95'])} | {_pct(m['slo_violation_rate'])} "
                        f"| {_fmt(m['throughput_tokens_per_s'], 1)} "
                        f"| {_fmt(m['goodput_requests_per_s'])} | {m['max_quantized_layers']} |")
    return "\n".join(rows) + "\n"


def plot_sweep(sweep: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, points in sweep["configs"].items():
        x = [p["offered_requests_per_s"] for p in points]
        axes[0].plot(x, [p["metrics"]["ttft_s"]["p95"] for p in points], "o-", label=name)
        axes[1].plot(x, [p["metrics"]["throughput_tokens_per_s"] for p in points], "o-", label=name)
        axes[2].plot(x, [p["metrics"]["goodput_requests_per_s"] for p in points], "o-", label=name)
    for ax, label in zip(axes, ("P95 TTFT s", "output tokens/s", "goodput req/s")):
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
