"""Per-configuration metrics of one replay: latency percentiles, SLOs, throughput, goodput,
queueing, retractions, the share of tokens served while quantized, and output agreement with
the full-precision run on the same prompts."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from benchmark.replay.client import ReplayResult
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


def token_share(result: ReplayResult, steps: list[tuple[float, tuple[int, ...]]],
                served_while: Callable[[tuple[int, ...]], bool]) -> float:
    """Output tokens that arrived while ``served_while(layer bits)`` held / all output tokens.

    A chunk's tokens are attributed to its arrival time; a token is produced one streaming
    hop earlier, a few milliseconds at most, far below the spacing of transitions."""
    times = [s[0] for s in steps]
    matching = total = 0
    for rec in result.records:
        prev = 0
        for t, n in rec.chunks:
            total += n - prev
            if served_while(steps[bisect.bisect_right(times, t) - 1][1]):
                matching += n - prev
            prev = n
    return matching / total if total else 0.0


def any_quantized(bits: tuple[int, ...]) -> bool:
    return min(bits) < FULL_PRECISION_BITS


def any_w4(bits: tuple[int, ...]) -> bool:
    return min(bits) <= 4


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
        # Output tokens served while any layer was below 16 bits, and while any was at W4.
        "quantized_token_share": token_share(result, steps, any_quantized),
        "w4_token_share": token_share(result, steps, any_w4),
        "max_quantized_layers": max(sum(b < FULL_PRECISION_BITS for b in bits)
                                    for _, bits in steps),
        "max_w4_layers": max(sum(b <= 4 for b in bits) for _, bits in steps),
        "max_kv_capacity_tokens": max((s["kv_capacity_tokens"] for s in samples), default=None),
        "max_waiting_requests": max((s["num_waiting_reqs"] for s in samples), default=None),
    }
