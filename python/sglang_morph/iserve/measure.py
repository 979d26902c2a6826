"""Serving one configuration (of a fingerprint or of the full model) and measuring it.

Memory on a CPU has no device allocator to ask, so it is defined twice, per scheduler process
(one per TP rank x PP stage: the processes that hold weights and KV):

- **accounted** = weights + KV + activation peak. Weights and KV are the bytes the process's
  tensors hold, from ``/morph/status`` (``weight_bytes`` sums the served modules' tensors,
  ``kv_bytes`` the pool; per stage under PP, per rank under TP). The activation peak is what
  serving adds on top: the process's RSS high-water mark over the workload minus its RSS just
  before it (the mark is reset first, ``echo 5 > /proc/<pid>/clear_refs``, so the peak of
  loading does not hide it).
- **rss_hwm** = the process's ``VmHWM`` over its whole life (load and workload): what the
  machine must have for it, Python, torch, SGLang and staged variants included.

16-bit configurations are measured with ``--enable-morph`` and no engines (nothing is staged or
installed; ``/morph/status`` reports the served tensors), under TP alone or PP alone. TP x PP is
refused by ``--enable-morph``, so 16-bit TP x PP runs as plain SGLang, as it is launched, with no
status: only its RSS and activation peak are measured.

Latency (L2's inputs): ``batch`` greedy requests of ``prompt_tokens`` fixed token ids and ``n``
new tokens (``ignore_eos``: a 1-layer model's text is noise and must not stop early), sent as
one batch request so that they are prefilled together.
Two timings (``Workload.timing``):

- ``e2e``: the batch's end-to-end seconds at two output lengths; ``estimate`` solves
  ``E2E(n) = TTFT + (n - 1) * TPOT`` from the two. A slow stretch anywhere in the 128-token
  request moves both (identical requests here varied by up to 27%), and the subtraction of two
  such numbers adds their noise.
- ``stream``: each request streamed (SGLang sends every token as it is sampled): TTFT is the
  time to its first token, TPOT the median over the request's windows of ``TPOT_WINDOW_TOKENS``
  tokens of each window's seconds per token. One output length gives both, and the median does
  not move when a few steps are slowed by another process or interrupted by a prefill. Windows,
  not single gaps: when the client reads late, several one-token events arrive in one read and
  all but one of their gaps are ~0 s (a 4-layer fingerprint, 4 requests, had the median gap of
  a whole request at 0.0 ms); a window spans such a clump.

Every repetition is recorded; ``estimate`` takes the fastest (on a shared machine other
processes only ever add time; here a two-thread rank next to other work measured several times
its quiet time). Fingerprints and full configurations are timed the same way.

The CPU-seconds of every process of the server (start-up included: it is the price of
profiling) are read from ``/proc/<pid>/stat`` once the server is ready (``start_cpu_s``) and
before it stops (``cpu_s``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import httpx

from sglang_morph.config import FULL_PRECISION_BITS
from sglang_morph.iserve.space import Configuration, serve_argv

_TITLE = re.compile(r"^sglang::scheduler")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TIMINGS = ("e2e", "stream")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What each server is asked to do. Invariant: ``e2e`` timing has two distinct output
    lengths (L2 solves TTFT and TPOT from them), ``stream`` timing one or more."""

    prompt_tokens: int = 128
    output_tokens: tuple[int, ...] = (8, 40)
    batches: tuple[int, ...] = (1, 4)
    repetitions: int = 3
    kv_tokens: int = 4096  # --max-total-tokens of every rank / stage
    timing: str = "e2e"  # or "stream" (see the module docstring)

    def check_integrity(self) -> None:
        if self.timing not in TIMINGS:
            raise ValueError(f"timing {self.timing!r}: expected one of {TIMINGS}")
        if self.timing == "e2e" and len(set(self.output_tokens)) != 2:
            raise ValueError("e2e timing needs two distinct output lengths (L2 solves TTFT and "
                             "TPOT from them)")
        if not self.output_tokens or min(self.output_tokens) < 2:
            raise ValueError("output lengths must be at least 2 tokens (TPOT needs a second)")
        if self.repetitions < 1:
            raise ValueError(f"repetitions must be >= 1, got {self.repetitions}")
        if self.prompt_tokens < 1 or not self.batches or min(self.batches) < 1:
            raise ValueError(f"bad workload {self}")
        if max(self.batches) * (self.prompt_tokens + max(self.output_tokens)) > self.kv_tokens:
            raise ValueError("the largest batch does not fit the KV pool")


# ---- processes ----------------------------------------------------------------------------


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                pass
    return pids


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")


def scheduler_processes(pgid: int) -> dict[tuple[int, int], int]:
    """``{(pp_rank, tp_rank): pid}`` of a server's scheduler processes, from the titles SGLang
    gives them (``sglang::scheduler_PP1_TP0``; no suffix for one rank)."""
    out = {}
    for pid in _group_pids(pgid):
        try:
            title = _title(pid)
        except OSError:
            continue
        if _TITLE.match(title):
            pp = re.search(r"PP(\d+)", title)
            tp = re.search(r"TP(\d+)", title)
            out[(int(pp.group(1)) if pp else 0, int(tp.group(1)) if tp else 0)] = pid
    return out


def status_kib(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{key} not in /proc/{pid}/status")


def reset_hwm(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process of the group and of the children they
    already reaped."""
    total = 0
    for pid in _group_pids(pgid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _CLOCK_TICKS


# ---- accounted memory ---------------------------------------------------------------------


def accounted_per_process(status: dict[str, Any], tp: int) -> dict[tuple[int, int], dict]:
    """``{(pp_rank, tp_rank): {weight_bytes, kv_bytes, kv_capacity_tokens}}`` from
    ``/morph/status`` (per stage under PP; every rank's own figures under TP)."""
    keys = ("weight_bytes", "kv_bytes", "kv_capacity_tokens")
    if "stages" in status:
        return {(s["stage"], 0): {k: s[k] for k in keys} for s in status["stages"]}
    if status.get("tp_ranks"):
        return {(0, r["tp_rank"]): {k: r[k] for k in keys} for r in status["tp_ranks"]}
    return {(0, rank): {k: status[k] for k in keys} for rank in range(tp)}


# ---- latency ------------------------------------------------------------------------------


def _generate_body(prompts: list[list[int]], new_tokens: int, stream: bool) -> dict:
    # All prompts in one request: SGLang's tokenizer manager hands pre-tokenized batches to the
    # scheduler as one message, so they are prefilled together. Concurrent single requests (as
    # before 2026-11-25) raced: the scheduler's logs showed "batch 4" prefilled as 1 + 3, 1 + 3,
    # 1 + 2 + 1, a different split each repetition (batch-4 TTFT spread up to 3.6x).
    return {"input_ids": prompts[0] if len(prompts) == 1 else prompts, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                "ignore_eos": True}}


def _prompts(batch: int, prompt_tokens: int, salt: int) -> list[list[int]]:
    # Every request of every call (``salt``) has its own first token, so SGLang's radix cache
    # reuses no prefix: a repeated prompt would prefill one token and hide the prefill (the
    # first profile here did).
    rest = [1000 + (i * 13) % 4000 for i in range(1, prompt_tokens)]
    return [[1000 + 97 * salt + 7 * b] + rest for b in range(batch)]


def e2e_seconds(url: str, batch: int, prompt_tokens: int, new_tokens: int,
                salt: int = 0) -> float:
    """End-to-end seconds of ``batch`` requests sent as one batch (they run the same number of
    steps, so they end together)."""
    started = time.perf_counter()
    r = httpx.post(f"{url}/generate", timeout=600,
                   json=_generate_body(_prompts(batch, prompt_tokens, salt), new_tokens, False))
    elapsed = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:300]}")
    outs = r.json()
    outs = outs if isinstance(outs, list) else [outs]
    got = sorted({len(o["output_ids"]) for o in outs})
    if len(outs) != batch or got != [new_tokens]:
        raise RuntimeError(f"asked {batch} x {new_tokens} new tokens, got {len(outs)} "
                           f"outputs of {got}")
    return elapsed


TPOT_WINDOW_TOKENS = 8


def windowed_tpot(arrivals: list[tuple[float, int]],
                  window_tokens: int = TPOT_WINDOW_TOKENS) -> float:
    """Median seconds per token over windows of at least ``window_tokens`` tokens between
    streamed chunks ``(arrival time, tokens so far)``, one window starting at each chunk (a
    chunk may carry several tokens; chunks read together arrive at the same time). A request
    shorter than a window gives its mean over all its tokens after the first."""
    rates = []
    for i, (t0, c0) in enumerate(arrivals):
        end = next(((t1, c1) for t1, c1 in arrivals[i + 1:] if c1 - c0 >= window_tokens), None)
        if end is not None:
            rates.append((end[0] - t0) / (end[1] - c0))
    if rates:
        return statistics.median(rates)
    (t0, c0), (t1, c1) = arrivals[0], arrivals[-1]
    if c1 == c0:
        raise ValueError("a streamed request needs at least two tokens for its TPOT")
    return (t1 - t0) / (c1 - c0)


def stream_seconds(url: str, batch: int, prompt_tokens: int, new_tokens: int,
                   salt: int = 0) -> tuple[float, float, float]:
    """(TTFT, TPOT, end-to-end) seconds of ``batch`` requests streamed as one batch, each the
    mean over the requests (a batch's events carry their request's ``index``)."""
    arrivals: dict[int, list[tuple[float, int]]] = {i: [] for i in range(batch)}
    started = time.perf_counter()
    body = _generate_body(_prompts(batch, prompt_tokens, salt), new_tokens, True)
    with httpx.stream("POST", f"{url}/generate", timeout=600, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out = json.loads(line[len("data: "):])
            if "error" in out:
                raise RuntimeError(f"/generate streamed an error: {out['error']}")
            arrivals[out.get("index", 0)].append(
                (time.perf_counter(), out["meta_info"]["completion_tokens"]))
    times = []
    for i, seen in arrivals.items():
        if not seen or seen[-1][1] != new_tokens:
            raise RuntimeError(f"request {i}: asked {new_tokens} new tokens, got "
                               f"{seen[-1][1] if seen else 0}")
        times.append((seen[0][0] - started, windowed_tpot(seen), seen[-1][0] - started))
    ttft, tpot, e2e = (statistics.mean(x) for x in zip(*times))
    return ttft, tpot, e2e


# ---- one server ---------------------------------------------------------------------------


def latency_points(url: str, workload: Workload, salt: int) -> tuple[list[dict[str, Any]], int]:
    """Every batch x output length of ``workload``, ``repetitions`` times each (every request
    salted anew, ``_prompts``), and the next unused salt."""
    points = []
    for batch in workload.batches:
        for n in workload.output_tokens:
            runs, ttfts, tpots = [], [], []
            for _ in range(workload.repetitions):
                if workload.timing == "stream":
                    ttft, tpot, e2e = stream_seconds(url, batch, workload.prompt_tokens, n, salt)
                    ttfts.append(ttft)
                    tpots.append(tpot)
                else:
                    e2e = e2e_seconds(url, batch, workload.prompt_tokens, n, salt)
                runs.append(e2e)
                salt += 1
            point = {"batch": batch, "output_tokens": n, "e2e_s": runs,
                     "e2e_median_s": statistics.median(runs)}
            if workload.timing == "stream":
                point.update(ttft_s=ttfts, tpot_s=tpots)
            points.append(point)
    return points, salt


def _warm_up(url: str, workload: Workload) -> None:
    # One short request first: kernels, caches and allocator pools settle before measuring.
    e2e_seconds(url, 1, 16, 2)
    if workload.timing == "stream":
        stream_seconds(url, 1, 16, 2)


def measure_server(cfg: Configuration, model_dir: Path, engines_dir: Path | None,
                   num_layers: int, workload: Workload, log_path: Path, kind: str,
                   with_latency: bool = True) -> dict[str, Any]:
    """Start ``cfg`` of ``model_dir``, warm it, measure memory and latency, stop it."""
    from sglang_morph.server import process as harness

    workload.check_integrity()
    extra: tuple[str, ...] = ()
    # 16 bits: --enable-morph with no engines gives /morph/status at the cost of nothing (not
    # under TP x PP, which it refuses; see the module docstring).
    morph_status = cfg.bits != FULL_PRECISION_BITS or cfg.tp == 1 or cfg.pp == 1
    if cfg.bits == FULL_PRECISION_BITS and morph_status:
        extra = ("--enable-morph", "--disable-morph-controller")
    argv = serve_argv(cfg, model_dir, engines_dir, workload.kv_tokens,
                      max_running_requests=max(workload.batches), extra=extra)[1:]
    started = time.monotonic()
    uptime_before = Path("/proc/uptime").read_text().split()[0]
    server = harness.start_server(argv, log_path, start_timeout_s=600)
    try:
        start_s = time.monotonic() - started
        pgid = server.proc.pid
        start_cpu_s = group_cpu_seconds(pgid)  # start-up's share of the profiling cost
        procs = scheduler_processes(pgid)
        if len(procs) != cfg.processes:
            raise RuntimeError(f"{cfg.name}: found {len(procs)} scheduler processes "
                               f"({sorted(procs)}), expected {cfg.processes}")
        _warm_up(server.url, workload)  # before the mark
        load_hwm = {k: status_kib(pid, "VmHWM") for k, pid in procs.items()}
        rss_idle = {k: status_kib(pid, "VmRSS") for k, pid in procs.items()}
        for pid in procs.values():
            reset_hwm(pid)
        points: list[dict[str, Any]] = []
        if with_latency:
            points, _ = latency_points(server.url, workload, salt=1)  # 0 was the warm-up
        else:  # memory only: one pass at the largest batch and length
            e2e_seconds(server.url, max(workload.batches), workload.prompt_tokens,
                        max(workload.output_tokens))
        serve_hwm = {k: status_kib(pid, "VmHWM") for k, pid in procs.items()}
        accounted = {}
        if morph_status:
            status = httpx.get(f"{server.url}/morph/status", timeout=60).json()
            accounted = accounted_per_process(status, cfg.tp)
        cpu_s = group_cpu_seconds(pgid)
        processes = []
        for key in sorted(procs):
            pp_rank, tp_rank = key
            acc = accounted.get(key, {})
            processes.append({
                "pp_rank": pp_rank, "tp_rank": tp_rank,
                "weight_bytes": acc.get("weight_bytes"), "kv_bytes": acc.get("kv_bytes"),
                "kv_capacity_tokens": acc.get("kv_capacity_tokens"),
                "rss_idle_bytes": rss_idle[key],
                "activation_peak_bytes": max(serve_hwm[key] - rss_idle[key], 0),
                "rss_hwm_bytes": max(load_hwm[key], serve_hwm[key]),
            })
    finally:
        server.stop()
    return {"kind": kind, "config": cfg.name, "bits": cfg.bits, "tp": cfg.tp, "pp": cfg.pp,
            "num_layers": num_layers, "argv": ["scripts/serve.sh", *argv],
            "start_s": start_s, "wall_s": time.monotonic() - started, "cpu_s": cpu_s,
            "start_cpu_s": start_cpu_s, "timing": workload.timing,
            "uptime_s_at_start": float(uptime_before), "load_average": list(os.getloadavg()),
            "processes": processes, "latency": points}


# ---- fingerprints inside one server --------------------------------------------------------


def measure_in_server(tp: int, pp: int, model_dir: Path, engines_dir: Path | None,
                      runs: Sequence[tuple[int, Sequence[int]]], workload: Workload,
                      log_path: Path) -> list[dict[str, Any]]:
    """One launch of the full model at TP ``tp`` x PP ``pp`` (``--enable-iserve-profiling``):
    for each ``(bits, depths)`` of ``runs``, every layer swapped to ``bits`` (``POST
    /morph/swap``; TP x PP serves 16 bits only, without the swap), then each depth set (``POST
    /iserve/depth``) and timed as ``measure_server`` times a fingerprint of that depth, the
    depths taking turns repetition by repetition. One record per bit-width and depth,
    ``source`` ``in-server``, latency only (``processes`` empty). CPU-seconds: each record has
    those of every server process up to the end of each of its repetitions since the
    measurement before it (a swap's go to the next record; the first record has the start-up
    too, ``start_cpu_s``), so the records of a launch sum to its whole cost."""
    from sglang_morph.server import process as harness

    workload.check_integrity()
    if any(b != FULL_PRECISION_BITS for b, _ in runs) and engines_dir is None:
        raise ValueError("W8/W4 in one server need an engines directory (--engines)")
    # TP x PP: --enable-morph refuses it, so it serves 16 bits as plain SGLang (as the full
    # configuration does) and swaps nothing.
    morph = tp == 1 or pp == 1
    if not morph and any(b != FULL_PRECISION_BITS for b, _ in runs):
        raise ValueError(f"TP {tp} x PP {pp} serves 16 bits only (--enable-morph refuses TP x PP)")
    extra = ["--enable-iserve-profiling"]
    if morph:
        extra += ["--enable-morph", "--disable-morph-controller"]
    if morph and engines_dir is not None:
        extra += ["--morph-engines", str(engines_dir)]
    layout = Configuration(FULL_PRECISION_BITS, tp, pp)
    argv = serve_argv(layout, model_dir, None, workload.kv_tokens,
                      max_running_requests=max(workload.batches), extra=tuple(extra))[1:]
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    started = time.monotonic()
    uptime_before = float(Path("/proc/uptime").read_text().split()[0])
    server = harness.start_server(argv, log_path, start_timeout_s=600)
    records: list[dict[str, Any]] = []
    try:
        start_s = time.monotonic() - started
        pgid = server.proc.pid
        start_cpu_s = group_cpu_seconds(pgid)
        cpu_before = 0.0  # the first record carries the start-up
        if len(scheduler_processes(pgid)) != layout.processes:
            raise RuntimeError(f"TP {tp} x PP {pp}: expected {layout.processes} scheduler "
                               f"processes")
        salt = 1
        one = dataclasses.replace(workload, repetitions=1)
        for bits, depths in runs:
            if morph:
                _control(server.url, "/morph/swap", {"layers": list(range(num_layers)),
                                                     "bits": bits})
            cfg = Configuration(bits, tp, pp)
            mine = {}
            # Depths alternate repetition by repetition: a machine that slows down for a
            # while (other tenants) slows every depth alike instead of tilting the line.
            for rep in range(workload.repetitions):
                for depth in depths:
                    rep_started = time.monotonic()
                    _control(server.url, "/iserve/depth", {"layers": depth})
                    if rep == 0:
                        _warm_up(server.url, workload)
                    points, salt = latency_points(server.url, one, salt)
                    cpu_now = group_cpu_seconds(pgid)
                    if depth not in mine:
                        mine[depth] = {
                            "kind": "fingerprint", "source": "in-server", "config": cfg.name,
                            "bits": bits, "tp": tp, "pp": pp, "num_layers": depth,
                            "argv": ["scripts/serve.sh", *argv], "launch_start_s": start_s,
                            "start_s": 0.0, "wall_s": 0.0, "cpu_s": 0.0,
                            "start_cpu_s": start_cpu_s if not records and not mine else 0.0,
                            "timing": workload.timing, "uptime_s_at_start": uptime_before,
                            "processes": [], "latency": points}
                    else:
                        _extend(mine[depth]["latency"], points)
                    mine[depth]["wall_s"] += time.monotonic() - rep_started
                    mine[depth]["cpu_s"] += cpu_now - cpu_before
                    mine[depth]["load_average"] = list(os.getloadavg())
                    cpu_before = cpu_now
            records += [mine[d] for d in depths]
        # What stopping costs is not counted (the server is killed), as for measure_server.
    finally:
        server.stop()
    return records


def _extend(points: list[dict[str, Any]], more: list[dict[str, Any]]) -> None:
    """Add another repetition's timings to each (batch, output length) point."""
    for point, extra in zip(points, more, strict=True):
        assert (point["batch"], point["output_tokens"]) == (extra["batch"],
                                                            extra["output_tokens"])
        for key in ("e2e_s", "ttft_s", "tpot_s"):
            if key in point:
                point[key] += extra[key]
        point["e2e_median_s"] = statistics.median(point["e2e_s"])


def _control(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{route}", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"{route} {body} answered {r.status_code}: {r.text[:300]}")
    return r.json()
