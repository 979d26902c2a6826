"""Open-loop replay against a running server: every request is sent at its trace arrival time
whether or not earlier ones have finished, and streamed so each token's arrival is timed. The
last chunk brings the server's precision provenance of the request's tokens.

Alongside, a poller samples ``GET /morph/status`` (KV capacity and use, waiting requests,
quantized layers, retractions) for the timelines. Times are wall-clock (``time.time()``), the
clock the server's transition log uses too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Callable

import httpx
from tqdm import tqdm

from benchmark.replay.trace import TraceRequest

STATUS_POLL_INTERVAL_S = 0.25
KEEPALIVE_EXPIRY_S = 1.0
# The client's event loop is watched at this interval; a wake-up later than STALL_S is a
# stall (every send and every chunk read waits for it), recorded with where its time went.
LOOP_WATCH_INTERVAL_S = 0.05
STALL_S = 0.1


@dataclasses.dataclass
class RequestRecord:
    """One replayed request as the client saw it. ``chunks`` are (arrival time, completion
    tokens so far) per streamed chunk; ``error`` is set when the request failed."""

    index: int
    scheduled_unix_s: float  # when the trace says it arrives (latencies count from here)
    sent_unix_s: float = 0.0
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    queue_time_s: float | None = None  # SGLang's own: waiting queue to first forward
    num_retractions: int = 0
    finish_reason: str | None = None
    # The server's precision provenance of the output (meta_info.morph_precision of the last
    # chunk): segments of output tokens with the layers quantized while they were produced.
    precision: dict[str, Any] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.scheduled_unix_s if self.ok else None

    @property
    def e2e_s(self) -> float | None:
        return self.chunks[-1][0] - self.scheduled_unix_s if self.ok else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for a single-token output)."""
        if not self.ok or self.chunks[-1][1] < 2:
            return None
        first_t, first_n = self.chunks[0]
        last_t, last_n = self.chunks[-1]
        return (last_t - first_t) / (last_n - first_n) if last_n > first_n else None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d


@dataclasses.dataclass
class ReplayResult:
    url: str
    start_unix_s: float
    end_unix_s: float
    records: list[RequestRecord]
    status_samples: list[dict[str, Any]]  # {"t": unix s, status fields ...}
    # The client's own event-loop stalls (``_watch_loop``): a late send or a late chunk is
    # the client's when one covers it.
    client_stalls: list[dict[str, float]] = dataclasses.field(default_factory=list)


def _schedstat() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of this process's main
    thread so far (Linux ``/proc/self/schedstat``; None elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu_ns, wait_ns, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu_ns) / 1e9, int(wait_ns) / 1e9


async def _watch_loop(out: list[dict[str, float]], stop: asyncio.Event) -> None:
    """Record every wake-up of the event loop later than ``STALL_S``: when, how late, and
    how much of the stall the process spent waiting for a CPU (``runqueue_s``: the cores
    were busy with other processes) or running (``on_cpu_s``: the client's own work). What
    is left is time blocked elsewhere (a system call, the machine paused)."""
    before, stat = time.time(), _schedstat()
    while not stop.is_set():
        await asyncio.sleep(LOOP_WATCH_INTERVAL_S)
        now, now_stat = time.time(), _schedstat()
        late = now - before - LOOP_WATCH_INTERVAL_S
        if late > STALL_S:
            stall = {"t": round(before + LOOP_WATCH_INTERVAL_S, 3), "late_s": round(late, 3)}
            if stat is not None and now_stat is not None:
                stall.update(on_cpu_s=round(now_stat[0] - stat[0], 3),
                             runqueue_s=round(now_stat[1] - stat[1], 3))
            out.append(stall)
        before, stat = now, now_stat


async def _one(client: httpx.AsyncClient, url: str, req: TraceRequest, ids: list[int],
               start: float, rec: RequestRecord, bar: tqdm, timeout_s: float) -> None:
    delay = start + req.arrival_s - time.time()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.sent_unix_s = time.time()
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": req.output_tokens,
                                "ignore_eos": True}}
    try:
        async with client.stream("POST", f"{url}/generate", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.time()
                chunk = json.loads(line[5:])
                meta = chunk.get("meta_info", {})
                n = meta.get("completion_tokens", len(chunk.get("output_ids", [])))
                if n > (rec.chunks[-1][1] if rec.chunks else 0):
                    rec.chunks.append((now, n))
                rec.output_ids = chunk.get("output_ids", rec.output_ids)
                if meta.get("queue_time") is not None:
                    rec.queue_time_s = meta["queue_time"]
                rec.num_retractions = meta.get("num_retractions", rec.num_retractions)
                rec.precision = meta.get("morph_precision", rec.precision)
                if meta.get("finish_reason"):
                    rec.finish_reason = meta["finish_reason"].get("type")
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        bar.update(1)


def morph_sample(s: dict[str, Any]) -> dict[str, Any]:
    """A timeline sample of ``GET /morph/status`` (one server, no data parallelism)."""
    sig = s.get("signals") or {}
    return {
        "kv_capacity_tokens": s["kv_capacity_tokens"],
        "kv_used_tokens": s["kv_used_tokens"],
        "quantized_layers": s["quantized_layers"],
        "num_waiting_reqs": sig.get("num_waiting_reqs", 0),
        "num_running_reqs": sig.get("num_running_reqs", 0),
        "retractions_total": s["retractions_total"],
        "transitions_total": s["transitions_total"],
    }


Sampler = Callable[[dict[str, Any]], dict[str, Any]]


async def _poll_status(client: httpx.AsyncClient, url: str, out: list[dict[str, Any]],
                       stop: asyncio.Event, path: str, sample: Sampler) -> None:
    while not stop.is_set():
        try:
            r = await client.get(f"{url}{path}", timeout=10.0)
            if r.status_code == 200:
                out.append({"t": time.time(), **sample(r.json())})
        except httpx.HTTPError:
            pass  # a busy scheduler answers late; a missed sample is only a gap in a plot
        try:
            await asyncio.wait_for(stop.wait(), STATUS_POLL_INTERVAL_S)
        except asyncio.TimeoutError:
            pass


async def _replay(url: str, requests: list[TraceRequest], prompts: list[list[int]],
                  drain_timeout_s: float, label: str, status_path: str | None,
                  sample: Sampler) -> ReplayResult:
    # An idle connection is dropped well before the server's keep-alive timeout (uvicorn's is
    # 5 s, httpx's expiry too): a request sent on one the server closed at that instant fails
    # with a ReadError the server never saw (seen once in a replay).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.time() + 0.5  # time to schedule every task before the first arrival
        records = [RequestRecord(r.index, start + r.arrival_s, prompt_tokens=len(p),
                                 max_new_tokens=r.output_tokens)
                   for r, p in zip(requests, prompts)]
        samples: list[dict[str, Any]] = []
        stalls: list[dict[str, float]] = []
        stop = asyncio.Event()
        poller = (asyncio.create_task(_poll_status(client, url, samples, stop, status_path,
                                                   sample)) if status_path else None)
        watcher = asyncio.create_task(_watch_loop(stalls, stop))
        last_arrival = max(r.arrival_s for r in requests)
        # Every request gets until the end of the trace plus the drain time to finish.
        timeout_s = last_arrival + drain_timeout_s
        with tqdm(total=len(requests), desc=f"replay {label}", unit="req") as bar:
            await asyncio.gather(*(
                _one(client, url, r, p, start, rec, bar, timeout_s)
                for r, p, rec in zip(requests, prompts, records)))
        end = time.time()
        await asyncio.sleep(STATUS_POLL_INTERVAL_S)  # one sample of the drained state
        stop.set()
        if poller is not None:
            await poller
        await watcher
    return ReplayResult(url, start, end, records, samples, stalls)


def replay(url: str, requests: list[TraceRequest], prompts: list[list[int]],
           drain_timeout_s: float = 300.0, label: str = "",
           status_path: str | None = "/morph/status",
           sample: Sampler = morph_sample) -> ReplayResult:
    """Replay ``requests`` (with their ``prompts`` as token ids) open-loop against ``url``;
    meanwhile sample ``status_path`` (None: no samples) through ``sample``."""
    if len(requests) != len(prompts) or not requests:
        raise ValueError("replay needs one prompt per request and at least one request")
    return asyncio.run(_replay(url.rstrip("/"), requests, prompts, drain_timeout_s, label,
                               status_path, sample))
