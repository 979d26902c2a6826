"""Prefill and decode throughput, SGLang (sglang-morph plugin loaded) vs plain transformers.

    python -m benchmark.throughput [--batch-sizes 1,8,32] [--prompt-tokens 256]
        [--decode-tokens 64] [--dtype bfloat16] [--repetitions 3]
        [--out benchmark/results/throughput.json] [--quick]

One run starts its own server (``scripts/serve.sh``, default model, ``--dtype`` passed through),
loads the same model directory into transformers, measures both at every batch size B, writes
JSON (``--out``) and a Markdown table (same path, ``.md``; also printed), and stops the server
(also on error or Ctrl-C). ``--quick`` is a smoke test: B in {1, 2}, 32 prompt tokens, 8 new
tokens, one repetition, written under ``benchmark/results/raw/`` unless ``--out`` is given.

Method, for batch size B, P prompt tokens and D new tokens per sequence:

- Prompts: B consecutive, non-overlapping P-token windows of WikiText-2 test, tokenized with the
  model's tokenizer. Every run, warm-ups included, takes fresh windows and SGLang's radix cache
  is flushed before it, so no prompt token is served from cache; the cached prompt tokens SGLang
  reports are recorded as the check. Both engines get the same ids in the same repetition.
- SGLang: ONE streaming ``/generate`` call carrying all B prompts as ``input_ids`` (greedy,
  ``max_new_tokens=D``, ``ignore_eos``). Why one batch call and not B HTTP requests: separate
  requests reach the scheduler a few ms apart, and the scheduler, woken by the first, often
  prefills it alone (seen for B=8: prefill batches of 1+7 and 2+6), so "batch B" would not be
  what ran. Each streamed chunk is timestamped on arrival. t0 = request sent; t_first = when
  the last of the B sequences got its first token. prefill tokens/s = B*P / (t_first - t0);
  decode tokens/s = (tokens that arrived after t_first) / (t_last_token - t_first). That count is
  B*(D-1) unless some sequences were already decoding at t_first; counting it from the stream
  keeps the number right either way. These are end-to-end numbers: HTTP, tokenizer manager,
  scheduler, detokenizer and streaming are all inside them, and SGLang's helper processes and
  this client share the cores with the model's threads.
- transformers: one ``generate(max_new_tokens=D, min_new_tokens=D, do_sample=False)`` call per
  batch, with a streamer that timestamps each step's tokens as ``generate`` hands them over.
  prefill tokens/s = B*P / (first new tokens - call start); decode tokens/s = B*(D-1) / (end -
  first new tokens), the same split and token count as SGLang's. Both phases come from one call:
  subtracting a separately timed prefill forward from a timed ``generate`` could read a negative
  decode time when the two prefills' noise exceeded the short decode.
  In-process under ``torch.inference_mode()``, torch's default thread count (as the server).
- Each (engine, B) first runs one untimed warm-up (P prompt tokens, a short decode) so
  per-shape kernel setup is not timed. Repetitions alternate the engines, so drifting
  background load hits both alike. Reported: the median of the repetitions; min and max and
  every single run are in the JSON.
- The machine's load average is recorded at start and end. On a small CPU machine these
  numbers are only meaningful when nothing else runs: a 2-thread bf16 matmul that shares a
  core with another busy process was seen to slow down 60x (OpenMP threads wait on each other).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from benchmark.harness import REPO_ROOT, git_state, machine_info, running_server
from sglang_morph.models import default_model_path
from sglang_morph.repo_data import WIKITEXT2_TEST

TEXT_PATH = WIKITEXT2_TEST
RESULTS_DIR = REPO_ROOT / "benchmark" / "results"
RAW_DIR = RESULTS_DIR / "raw"  # git-ignored: server logs and smoke-test output
DTYPES = ("bfloat16", "float16", "float32")
ENGINES = ("sglang", "transformers")
FLUSH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ThroughputConfig:
    batch_sizes: tuple[int, ...]
    prompt_tokens: int
    decode_tokens: int  # new tokens per sequence; the first comes from prefill
    warmup_decode_tokens: int
    repetitions: int
    dtype: str
    out_json: Path
    model_path: Path
    text_path: Path
    server_log: Path

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.prompt_tokens < 1 or self.repetitions < 1:
            raise ValueError("prompt tokens and repetitions must be >= 1")
        if self.decode_tokens < 2 or self.warmup_decode_tokens < 2:
            raise ValueError("decode phases need >= 2 new tokens (the first comes from prefill)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def out_md(self) -> Path:
        return self.out_json.with_suffix(".md")

    @property
    def windows_needed(self) -> int:
        """Prompt windows one run consumes: per batch size, one warm-up batch + the repetitions."""
        return sum(batch_size * (1 + self.repetitions) for batch_size in self.batch_sizes)


@dataclass(frozen=True)
class PhaseTiming:
    prefill_s: float
    prefill_tokens: int
    decode_s: float
    decode_tokens: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


@dataclass(frozen=True)
class StreamEvent:
    """One streamed ``/generate`` chunk: arrival time, sequence index, tokens generated so far."""

    time_s: float
    index: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class SglangRun:
    timing: PhaseTiming
    cached_prompt_tokens: int  # served from the radix cache; 0 after the flush
    first_token_spread_s: float  # large when chunked prefill split the batch


@dataclass(frozen=True)
class Measurement:
    engine: str
    batch_size: int
    repetition: int
    timing: PhaseTiming
    cached_prompt_tokens: int | None = None  # SGLang only, see SglangRun
    first_token_spread_s: float | None = None  # SGLang only


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float


@dataclass(frozen=True)
class BatchResult:
    batch_size: int
    sglang_prefill_tokens_per_s: Stat
    sglang_decode_tokens_per_s: Stat
    transformers_prefill_tokens_per_s: Stat
    transformers_decode_tokens_per_s: Stat

    @property
    def prefill_ratio(self) -> float:
        """SGLang / transformers, medians."""
        return (
            self.sglang_prefill_tokens_per_s.median
            / self.transformers_prefill_tokens_per_s.median
        )

    @property
    def decode_ratio(self) -> float:
        """SGLang / transformers, medians."""
        return (
            self.sglang_decode_tokens_per_s.median / self.transformers_decode_tokens_per_s.median
        )


# ---------------------------------------------------------------------------------------------
# Pure parts: prompt slicing, stream -> phases, statistics, table.


def prompt_windows(
    token_ids: Sequence[int], first_window: int, batch_size: int, prompt_tokens: int
) -> list[list[int]]:
    """Windows ``first_window .. first_window+batch_size-1`` of ``prompt_tokens`` ids each."""
    end = (first_window + batch_size) * prompt_tokens
    if end > len(token_ids):
        raise ValueError(f"need {end} token ids, the text has {len(token_ids)}")
    return [
        list(token_ids[start : start + prompt_tokens])
        for start in range(first_window * prompt_tokens, end, prompt_tokens)
    ]


def phases_from_stream(
    t0_s: float,
    events: Sequence[StreamEvent],
    batch_size: int,
    prompt_tokens: int,
    decode_tokens: int,
) -> PhaseTiming:
    """Split one streamed batch into prefill and decode (see the module docstring).

    ``events`` are in arrival order; every sequence must reach ``decode_tokens``.
    """
    first_position: dict[int, int] = {}
    for position, event in enumerate(events):
        first_position.setdefault(event.index, position)
    if sorted(first_position) != list(range(batch_size)):
        raise ValueError(f"expected sequences 0..{batch_size - 1}, got {sorted(first_position)}")
    last_first = max(first_position.values())
    tokens_at_first: dict[int, int] = {}
    final_tokens: dict[int, int] = {}
    for position, event in enumerate(events):
        if position <= last_first:
            tokens_at_first[event.index] = event.completion_tokens
        final_tokens[event.index] = event.completion_tokens
    short = {i: n for i, n in final_tokens.items() if n != decode_tokens}
    if short:
        raise ValueError(f"sequences ended with {short} tokens, expected {decode_tokens}")
    t_first_s = events[last_first].time_s
    return PhaseTiming(
        prefill_s=t_first_s - t0_s,
        prefill_tokens=batch_size * prompt_tokens,
        decode_s=events[-1].time_s - t_first_s,
        decode_tokens=sum(final_tokens[i] - tokens_at_first[i] for i in final_tokens),
    )


def summarize(values: Sequence[float]) -> Stat:
    return Stat(median=statistics.median(values), min=min(values), max=max(values))


def batch_results(
    measurements: Sequence[Measurement], batch_sizes: Sequence[int]
) -> list[BatchResult]:
    def stat(engine: str, batch_size: int, phase: str) -> Stat:
        return summarize([
            getattr(m.timing, f"{phase}_tokens_per_s")
            for m in measurements
            if m.engine == engine and m.batch_size == batch_size
        ])

    return [
        BatchResult(
            batch_size=b,
            sglang_prefill_tokens_per_s=stat("sglang", b, "prefill"),
            sglang_decode_tokens_per_s=stat("sglang", b, "decode"),
            transformers_prefill_tokens_per_s=stat("transformers", b, "prefill"),
            transformers_decode_tokens_per_s=stat("transformers", b, "decode"),
        )
        for b in batch_sizes
    ]


def render_markdown(results: Sequence[BatchResult], header_lines: Sequence[str]) -> str:
    rows = [
        "| batch | prefill tok/s SGLang | prefill tok/s transformers | prefill SGLang/HF "
        "| decode tok/s SGLang | decode tok/s transformers | decode SGLang/HF |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.batch_size} | {r.sglang_prefill_tokens_per_s.median:.1f} "
            f"| {r.transformers_prefill_tokens_per_s.median:.1f} | {r.prefill_ratio:.2f}x "
            f"| {r.sglang_decode_tokens_per_s.median:.1f} "
            f"| {r.transformers_decode_tokens_per_s.median:.1f} | {r.decode_ratio:.2f}x |"
        )
    title = "# Throughput: SGLang + sglang-morph vs transformers"
    return "\n".join([title, "", *header_lines, "", *rows, ""])


# ---------------------------------------------------------------------------------------------
# Engines.


def run_sglang(
    client: httpx.Client, url: str, prompts: list[list[int]], decode_tokens: int
) -> SglangRun:
    """One streamed batch request (see the module docstring)."""
    payload = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": decode_tokens, "ignore_eos": True},
        "stream": True,
    }
    # An empty radix tree makes "no prompt token is reused" exact (fresh windows alone can still
    # share a leading token) and keeps eviction work out of the timed region. The timeout lets
    # the flush wait until the previous batch is fully released instead of failing.
    client.post(f"{url}/flush_cache", params={"timeout": FLUSH_TIMEOUT_S}).raise_for_status()
    events: list[StreamEvent] = []
    t0_s = time.perf_counter()
    with client.stream("POST", f"{url}/generate", json=payload) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            arrival_s = time.perf_counter()  # before parsing, so JSON work is not counted
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"/generate failed: {chunk['error']}")
            meta = chunk["meta_info"]
            events.append(StreamEvent(
                arrival_s, chunk["index"], meta["completion_tokens"], meta["cached_tokens"]
            ))
    final_cached_tokens = {event.index: event.cached_tokens for event in events}
    first_token_s: dict[int, float] = {}
    for event in events:
        first_token_s.setdefault(event.index, event.time_s)
    return SglangRun(
        timing=phases_from_stream(t0_s, events, len(prompts), len(prompts[0]), decode_tokens),
        cached_prompt_tokens=sum(final_cached_tokens.values()),
        first_token_spread_s=max(first_token_s.values()) - min(first_token_s.values()),
    )


class _StepClock(BaseStreamer):
    """Times ``generate``: its first ``put`` is the prompt, the next ones each step's new tokens."""

    def __init__(self) -> None:
        self.put_times_s: list[float] = []

    def put(self, value) -> None:
        self.put_times_s.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(
    model, prompts: list[list[int]], decode_tokens: int, pad_token_id: int
) -> PhaseTiming:
    input_ids = torch.tensor(prompts)
    attention_mask = torch.ones_like(input_ids)  # equal lengths: no padding anywhere
    batch_size, prompt_tokens = input_ids.shape
    clock = _StepClock()
    with torch.inference_mode():
        start_s = time.perf_counter()
        output_ids = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
            streamer=clock,
        )
        end_s = time.perf_counter()
    if output_ids.shape != (batch_size, prompt_tokens + decode_tokens):
        raise RuntimeError(f"generate returned shape {tuple(output_ids.shape)}")
    # One put for the prompt, then one per generated step.
    if len(clock.put_times_s) != 1 + decode_tokens:
        raise RuntimeError(
            f"generate streamed {len(clock.put_times_s)} times, expected {1 + decode_tokens}"
        )
    first_token_s = clock.put_times_s[1]
    return PhaseTiming(
        prefill_s=first_token_s - start_s,
        prefill_tokens=batch_size * prompt_tokens,
        decode_s=end_s - first_token_s,
        decode_tokens=batch_size * (decode_tokens - 1),
    )


# ---------------------------------------------------------------------------------------------
# The run.


def measure(
    config: ThroughputConfig, token_ids: list[int], model, pad_token_id: int
) -> list[Measurement]:
    server_args = ("--model-path", str(config.model_path), "--dtype", config.dtype)
    steps = len(ENGINES) * (1 + config.repetitions) * len(config.batch_sizes)
    measurements: list[Measurement] = []
    next_window = 0
    with running_server(server_args, config.server_log) as server, \
            httpx.Client(timeout=None) as client, \
            tqdm(total=steps, desc="throughput", unit="run", file=sys.stderr) as bar:
        for batch_size in config.batch_sizes:
            for repetition in range(-1, config.repetitions):  # -1: the untimed warm-up
                prompts = prompt_windows(token_ids, next_window, batch_size, config.prompt_tokens)
                next_window += batch_size
                warmup = repetition < 0
                decode_tokens = config.warmup_decode_tokens if warmup else config.decode_tokens
                label = "warm-up" if warmup else f"rep {repetition + 1}/{config.repetitions}"
                bar.set_postfix_str(f"sglang B={batch_size} {label}")
                sglang = run_sglang(client, server.url, prompts, decode_tokens)
                if not warmup:
                    measurements.append(Measurement(
                        "sglang", batch_size, repetition, sglang.timing,
                        sglang.cached_prompt_tokens, sglang.first_token_spread_s,
                    ))
                bar.update()
                bar.set_postfix_str(f"transformers B={batch_size} {label}")
                timing = run_transformers(model, prompts, decode_tokens, pad_token_id)
                if not warmup:
                    measurements.append(Measurement("transformers", batch_size, repetition, timing))
                bar.update()
    return measurements


def to_json(
    config: ThroughputConfig,
    measurements: list[Measurement],
    results: list[BatchResult],
    meta: dict,
) -> dict:
    def stat_dict(stat: Stat) -> dict:
        return dataclasses.asdict(stat)

    return {
        "benchmark": "throughput",
        **meta,
        "settings": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in dataclasses.asdict(config).items()
        },
        "results": [
            {
                "batch_size": r.batch_size,
                "sglang": {
                    "prefill_tokens_per_s": stat_dict(r.sglang_prefill_tokens_per_s),
                    "decode_tokens_per_s": stat_dict(r.sglang_decode_tokens_per_s),
                },
                "transformers": {
                    "prefill_tokens_per_s": stat_dict(r.transformers_prefill_tokens_per_s),
                    "decode_tokens_per_s": stat_dict(r.transformers_decode_tokens_per_s),
                },
                "ratio_sglang_over_transformers": {
                    "prefill": r.prefill_ratio,
                    "decode": r.decode_ratio,
                },
            }
            for r in results
        ],
        "measurements": [
            {
                **dataclasses.asdict(m),
                "prefill_tokens_per_s": m.timing.prefill_tokens_per_s,
                "decode_tokens_per_s": m.timing.decode_tokens_per_s,
            }
            for m in measurements
        ],
    }


def header_lines(config: ThroughputConfig, meta: dict) -> list[str]:
    machine = meta["machine"]
    versions = machine["versions"]
    commit = meta["git"]["commit"]
    commit_text = (commit[:12] if commit else "no commit") + (
        " (dirty)" if meta["git"]["dirty"] else ""
    )
    load_start, load_end = meta["load_average_at_start"], meta["load_average_at_end"]
    return [
        f"Model `{config.model_path.name}`, dtype {config.dtype}, {config.prompt_tokens} prompt "
        f"tokens and {config.decode_tokens} new tokens per sequence; median of "
        f"{config.repetitions} repetition(s), tokens/s (min/max and single runs in the JSON).",
        f"Commit {commit_text}; {machine['cpu_model']}, {machine['cpu_cores']} cores, "
        f"{machine['torch_threads']} torch threads; torch {versions['torch']}, "
        f"sglang {versions['sglang']}, transformers {versions['transformers']}.",
        f"Load average (1/5/15 min) at start {'/'.join(f'{x:.2f}' for x in load_start)}, "
        f"at end {'/'.join(f'{x:.2f}' for x in load_end)}; run took {meta['duration_s']:.0f} s.",
    ]


def run(config: ThroughputConfig) -> dict:
    start_s = time.monotonic()
    load_average_at_start = os.getloadavg()
    if load_average_at_start[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"warning: load average {load_average_at_start[0]:.2f} before start; other work on "
            "this machine will distort the numbers",
            file=sys.stderr,
        )
    created_utc = datetime.now(timezone.utc).isoformat(timespec="seconds")
    tokenizer = AutoTokenizer.from_pretrained(config.model_path, local_files_only=True)
    text = config.text_path.read_text()
    token_ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    # Fail before the (minute-long) server start if the text cannot supply fresh prompts.
    prompt_windows(token_ids, 0, config.windows_needed, config.prompt_tokens)
    model = AutoModelForCausalLM.from_pretrained(
        config.model_path, dtype=getattr(torch, config.dtype), local_files_only=True
    ).eval()
    measurements = measure(config, token_ids, model, tokenizer.pad_token_id)
    results = batch_results(measurements, config.batch_sizes)
    meta = {
        "created_utc": created_utc,
        "duration_s": time.monotonic() - start_s,
        "git": git_state(),
        "machine": machine_info(),
        "load_average_at_start": list(load_average_at_start),
        "load_average_at_end": list(os.getloadavg()),
    }
    report = to_json(config, measurements, results, meta)
    markdown = render_markdown(results, header_lines(config, meta))
    config.out_json.parent.mkdir(parents=True, exist_ok=True)
    config.out_json.write_text(json.dumps(report, indent=2) + "\n")
    config.out_md.write_text(markdown)
    print(markdown)
    return report


def parse_args(argv: Sequence[str] | None = None) -> ThroughputConfig:
    parser = argparse.ArgumentParser(prog="python -m benchmark.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # None = "not given": --quick and the full run have different defaults, explicit flags win.
    parser.add_argument("--batch-sizes", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="comma-separated (default 1,8,32; quick 1,2)")
    parser.add_argument("--prompt-tokens", type=int, help="default 256; quick 32")
    parser.add_argument("--decode-tokens", type=int,
                        help="new tokens per sequence (default 64; quick 8)")
    parser.add_argument("--repetitions", type=int, help="timed runs per engine and batch size, "
                        "median reported (default 3; quick 1)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--out", type=Path, help="JSON path; the table goes next to it as .md "
                        "(default benchmark/results/throughput.json; quick under results/raw/)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: small sizes, one repetition")
    args = parser.parse_args(argv)
    defaults = (
        {"batch_sizes": (1, 2), "prompt_tokens": 32, "decode_tokens": 8, "repetitions": 1,
         "out": RAW_DIR / "throughput_quick.json"}
        if args.quick else
        {"batch_sizes": (1, 8, 32), "prompt_tokens": 256, "decode_tokens": 64, "repetitions": 3,
         "out": RESULTS_DIR / "throughput.json"}
    )
    chosen = {key: default if getattr(args, key) is None else getattr(args, key)
              for key, default in defaults.items()}
    return ThroughputConfig(
        batch_sizes=chosen["batch_sizes"],
        prompt_tokens=chosen["prompt_tokens"],
        decode_tokens=chosen["decode_tokens"],
        warmup_decode_tokens=min(4, chosen["decode_tokens"]),
        repetitions=chosen["repetitions"],
        dtype=args.dtype,
        out_json=chosen["out"].resolve(),
        model_path=default_model_path(),
        text_path=TEXT_PATH,
        server_log=RAW_DIR / "throughput_server.log",
    )


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C, so the server is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
