"""Per-configuration metrics of one replay: latency percentiles, SLOs, throughput, goodput,
queueing, retractions, the share of tokens served while quantized, and output agreement with
the full-precision run on the same prompts."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from benchmark.replay.client import ReplayResult, RequestRecord
from sglang_morph.config import FULL_PRECISION_BITS

PERCENTILES = (50, 95, 99)


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float | None = None  # None: TTFT alone decides

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        if ttft_s is None or ttft_s > self.ttft_s:
            return False  # a failed request violates every SLO
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not len(values):
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values, dtype=float)
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES} | {"mean": float(arr.mean())}


def precision_steps(transitions: list[dict[str, Any]], num_layers: int
                    ) -> list[tuple[float, tuple[int, ...]]]:
    """(time, every layer's bits from then on) after each applied transition of a
    ``--morph-log``; refused or failed transitions changed nothing and are skipped."""
    bits = [FULL_PRECISION_BITS] * num_layers
    steps = [(0.0, tuple(bits))]
    for t in sorted(transitions, key=lambda t: t["time_unix_s"]):
        if t["action"] not in ("swap", "restore"):
            continue
        for layer in t["layers"]:
            bits[layer] = t["to_bits"]
        steps.append((t["time_unix_s"], tuple(bits)))
    return steps


def log_tokens(rec: RequestRecord, steps: list[tuple[float, tuple[int, ...]]],
               served_while: Callable[[tuple[int, ...]], bool]) -> int:
    """Output tokens of ``rec`` that arrived while ``served_while(layer bits)`` held, by the
    transitions log. A chunk's tokens are attributed to its arrival time."""
    times = [s[0] for s in steps]
    matching = prev = 0
    for t, n in rec.chunks:
        if served_while(steps[bisect.bisect_right(times, t) - 1][1]):
            matching += n - prev
        prev = n
    return matching


def provenance_tokens(precision: dict[str, Any],
                      served_while: Callable[[tuple[int, ...]], bool]) -> int:
    """Output tokens the server says were produced while ``served_while`` held: the segments of
    its ``morph_precision`` (each segment's quantized layers as ``{bits: [layers]}``)."""
    return sum(seg["end"] - seg["start"] for seg in precision["segments"]
               if served_while(tuple(int(b) for b, layers in seg["quantized_layers"].items()
                                     for _ in layers) or (FULL_PRECISION_BITS,)))


def transitions_during(rec: RequestRecord, steps: list[tuple[float, tuple[int, ...]]]) -> int:
    return sum(rec.sent_unix_s <= t <= rec.chunks[-1][0] for t, _ in steps[1:])


def token_shares(result: ReplayResult, steps: list[tuple[float, tuple[int, ...]]],
                 served_while: Callable[[tuple[int, ...]], bool]) -> dict[str, Any]:
    """The share of output tokens served while ``served_while`` held, from the servers'
    provenance (when every completed request has one) and from the transitions log, and how
    many requests the two disagree on.

    Agreement is within one token per transition during the request: the log attributes a
    token to its chunk's arrival, while the server attributes it to the forward pass that
    sampled it. A token sampled just before a transition reaches the client a streaming hop
    later, possibly after the transition's log time, and so lands on the wrong side of that
    boundary; one pass is in flight per boundary (a client that falls further behind, so
    that the server coalesces its chunks, can put more tokens on the wrong side)."""
    ok = [r for r in result.records if r.ok]
    total = sum(r.chunks[-1][1] for r in ok)
    by_log = {r.index: log_tokens(r, steps, served_while) for r in ok}
    out: dict[str, Any] = {"log": sum(by_log.values()) / total if total else 0.0}
    if not ok or any(r.precision is None for r in ok):
        out.update(provenance=None, compared=0, disagreements=None, max_difference_tokens=None)
        return out
    by_server = {r.index: provenance_tokens(r.precision, served_while) for r in ok}
    diffs = {r.index: abs(by_server[r.index] - by_log[r.index]) for r in ok}
    out.update(provenance=sum(by_server.values()) / total if total else 0.0, compared=len(ok),
               disagreements=sum(diffs[r.index] > transitions_during(r, steps) for r in ok),
               max_difference_tokens=max(diffs.values()))
    return out


def any_quantized(bits: tuple[int, ...]) -> bool:
    return min(bits) < FULL_PRECISION_BITS


def any_w4(bits: tuple[int, ...]) -> bool:
    return min(bits) <= 4


def _preferred(shares: dict[str, Any]) -> float:
    return shares["log"] if shares["provenance"] is None else shares["provenance"]


class _TokenIds:
    """rouge-score tokenizer over space-separated token ids: ROUGE-L on the model's own tokens,
    so outputs made only of symbols (code) are compared too, which its word tokenizer drops."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return text.split()


def agreement(outputs: dict[int, list[int]], reference: dict[int, list[int]]
              ) -> dict[str, float | int | None]:
    """Exact-match rate and mean ROUGE-L F1 (over token ids) of each request's output against
    the reference output for the same request, over the requests both runs completed."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_TokenIds())
    common = sorted(set(outputs) & set(reference))
    if not common:
        return {"compared": 0, "exact_match_rate": None, "rouge_l_f1": None}
    exact = sum(outputs[i] == reference[i] for i in common)
    rouge = [scorer.score(" ".join(map(str, reference[i])),
                          " ".join(map(str, outputs[i])))["rougeL"].fmeasure for i in common]
    return {"compared": len(common), "exact_match_rate": exact / len(common),
            "rouge_l_f1": float(np.mean(rouge))}


def summarize(result: ReplayResult, slo: Slo,
              steps: list[tuple[float, tuple[int, ...]]]) -> dict[str, Any]:
    recs = result.records
    ok = [r for r in recs if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    queue = [r.queue_time_s for r in ok if r.queue_time_s is not None]
    end = max((r.chunks[-1][0] for r in ok), default=result.start_unix_s)
    span_s = max(end - result.start_unix_s, 1e-9)
    tokens = sum(r.chunks[-1][1] for r in ok)
    good = [r for r in ok if slo.met(r.ttft_s, r.tpot_s)]
    samples = result.status_samples
    retractions = (samples[-1]["retractions_total"] - samples[0]["retractions_total"]
                   if len(samples) >= 2 else sum(r.num_retractions for r in recs))
    quantized = token_shares(result, steps, any_quantized)
    w4 = token_shares(result, steps, any_w4)
    return {
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "truncated": sum(r.ok and r.chunks[-1][1] != r.max_new_tokens for r in recs),
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e),
        "queue_time_s": percentiles(queue),
        "slo": dataclasses.asdict(slo),
        "slo_violation_rate": 1.0 - len(good) / len(recs),
        "makespan_s": span_s,
        "throughput_tokens_per_s": tokens / span_s,
        "throughput_requests_per_s": len(ok) / span_s,
        "goodput_requests_per_s": len(good) / span_s,
        "goodput_tokens_per_s": sum(r.chunks[-1][1] for r in good) / span_s,
        "retractions": retractions,
        # Output tokens served while any layer was below 16 bits, and while any was at W4: the
        # servers' provenance (the log's inference where the server reports none), and the
        # transitions log's inference next to it (token_shares says when they agree).
        "quantized_token_share": _preferred(quantized),
        "w4_token_share": _preferred(w4),
        "quantized_token_share_log": quantized["log"],
        "w4_token_share_log": w4["log"],
        "share_source": "log" if quantized["provenance"] is None else "provenance",
        "provenance_compared": quantized["compared"],
        "provenance_disagreements": quantized["disagreements"],
        "provenance_max_difference_tokens": quantized["max_difference_tokens"],
        "max_quantized_layers": max(sum(b < FULL_PRECISION_BITS for b in bits)
                                    for _, bits in steps),
        "max_w4_layers": max(sum(b <= 4 for b in bits) for _, bits in steps),
        "max_kv_capacity_tokens": max((s["kv_capacity_tokens"] for s in samples), default=None),
        "max_waiting_requests": max((s["num_waiting_reqs"] for s in samples), default=None),
    }
