"""Arrival traces: which requests arrive when, with how many prompt and output tokens.

Reads the Azure LLM inference traces (``TIMESTAMP,ContextTokens,GeneratedTokens``) and BurstGPT
(``Timestamp,...,Request tokens,Response tokens,...``) as they are stored in
``data/traces``, cuts a time window, rescales time and lengths, and yields
``TraceRequest``s with arrival times relative to the start of the replay.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from sglang_morph.repo_data import TRACES_DIR as TRACES


@dataclasses.dataclass(frozen=True)
class TraceWindow:
    """How one trace becomes a replay.

    Invariants (checked): ``duration_s > 0``, ``time_scale > 0`` (replay seconds per trace
    second: 2.0 replays at half the rate), ``keep_every >= 1`` (keep every k-th request of the
    window, to thin a trace whose rate this machine cannot serve), length scales > 0, and
    ``1 <= min <= max`` for both lengths.
    """

    path: Path
    start_s: float = 0.0  # trace seconds after the trace's first request
    duration_s: float = 60.0  # trace seconds
    time_scale: float = 1.0
    keep_every: int = 1
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 1024
    min_output_tokens: int = 4
    max_output_tokens: int = 128

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.time_scale <= 0 or self.start_s < 0:
            raise ValueError(f"trace window: start >= 0, duration > 0 and time scale > 0 "
                             f"needed, got {self.start_s}, {self.duration_s}, {self.time_scale}")
        if self.keep_every < 1:
            raise ValueError(f"trace window: keep_every must be >= 1, got {self.keep_every}")
        if self.prompt_scale <= 0 or self.output_scale <= 0:
            raise ValueError("trace window: length scales must be > 0")
        for lo, hi, what in ((self.min_prompt_tokens, self.max_prompt_tokens, "prompt"),
                             (self.min_output_tokens, self.max_output_tokens, "output")):
            if not 1 <= lo <= hi:
                raise ValueError(f"trace window: need 1 <= min <= max {what} tokens, "
                                 f"got {lo}, {hi}")

    @property
    def replay_duration_s(self) -> float:
        return self.duration_s * self.time_scale


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    index: int  # position in the replay (0-based); the same index means the same prompt
    arrival_s: float  # seconds after the replay's start
    prompt_tokens: int
    output_tokens: int
    trace_prompt_tokens: int  # as in the trace, before scaling and capping
    trace_output_tokens: int


def read_trace(path: Path) -> pd.DataFrame:
    """Columns ``time_s`` (from the first row), ``prompt_tokens``, ``output_tokens``; rows
    with zero tokens on either side (failed requests in BurstGPT) are dropped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path}")
    df = pd.read_csv(path)
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(df.columns):  # Azure 2023
        t = pd.to_datetime(df["TIMESTAMP"])
        time_s = (t - t.iloc[0]).dt.total_seconds()
        prompt, output = df["ContextTokens"], df["GeneratedTokens"]
    elif {"Timestamp", "Request tokens", "Response tokens"} <= set(df.columns):  # BurstGPT
        time_s = df["Timestamp"].astype(float) - float(df["Timestamp"].iloc[0])
        prompt, output = df["Request tokens"], df["Response tokens"]
    else:
        raise ValueError(f"{path}: unknown trace format, columns {list(df.columns)}; expected "
                         f"Azure (TIMESTAMP,ContextTokens,GeneratedTokens) or BurstGPT")
    out = pd.DataFrame({"time_s": time_s.astype(float), "prompt_tokens": prompt.astype(int),
                        "output_tokens": output.astype(int)})
    out = out[(out.prompt_tokens > 0) & (out.output_tokens > 0)]
    return out.sort_values("time_s", kind="stable").reset_index(drop=True)


def _scale(n: int, scale: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(n * scale))))


def load_window(w: TraceWindow, context_tokens: int | None = None) -> list[TraceRequest]:
    if context_tokens is not None and w.max_prompt_tokens + w.max_output_tokens > context_tokens:
        raise ValueError(f"max prompt + output tokens ({w.max_prompt_tokens} + "
                         f"{w.max_output_tokens}) exceed the model's context of {context_tokens}")
    df = read_trace(w.path)
    sel = df[(df.time_s >= w.start_s) & (df.time_s < w.start_s + w.duration_s)]
    sel = sel.iloc[:: w.keep_every]
    if sel.empty:
        span = df.time_s.iloc[-1] if len(df) else 0.0
        raise ValueError(f"{w.path.name}: no requests in [{w.start_s}, "
                         f"{w.start_s + w.duration_s}) s; the trace spans 0-{span:.0f} s")
    return [
        TraceRequest(
            index=k,
            arrival_s=(row.time_s - w.start_s) * w.time_scale,
            prompt_tokens=_scale(row.prompt_tokens, w.prompt_scale, w.min_prompt_tokens,
                                 w.max_prompt_tokens),
            output_tokens=_scale(row.output_tokens, w.output_scale, w.min_output_tokens,
                                 w.max_output_tokens),
            trace_prompt_tokens=int(row.prompt_tokens),
            trace_output_tokens=int(row.output_tokens),
        )
        for k, row in enumerate(sel.itertuples(index=False))
    ]


def prompt_token_ids(requests: list[TraceRequest], corpus_ids: list[int]) -> list[list[int]]:
    """Consecutive, non-overlapping slices of a tokenized corpus, one per request (wrapping
    around when the corpus runs out), so no two prompts share a cached prefix by accident."""
    if not corpus_ids:
        raise ValueError("empty corpus")
    out, pos = [], 0
    for r in requests:
        if r.prompt_tokens > len(corpus_ids):
            raise ValueError(f"corpus of {len(corpus_ids)} tokens is shorter than a "
                             f"{r.prompt_tokens}-token prompt")
        if pos + r.prompt_tokens > len(corpus_ids):
            pos = 0
        out.append(corpus_ids[pos: pos + r.prompt_tokens])
        pos += r.prompt_tokens
    return out
