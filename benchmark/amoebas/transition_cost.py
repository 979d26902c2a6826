"""What AMOEBAs' transitions cost live, per layer and per KV token, against a gloo wire model
measured in the same run.

    .venv/bin/python -m benchmark.amoebas.transition_cost [--rounds 3] [--quick]

Default model, float32, ``--dp-size 3`` (three replicas <-> one TP 3 group), each run alone on
the machine:

1. **The wire.** gloo send/recv between two processes on loopback
   (``benchmark.kunserve.transfer``), fitted as ``latency + bytes / bandwidth``.
2. **Operator merges and splits** (``--amoebas-manual``, 1,024-token pools). For each level of
   live KV tokens per replica, every replica streams one request of that many prompt tokens
   across a merge and the split right after it; the cache is flushed between rounds. Each
   member's transition record gives the whole time (from the end of the vote), the KV phases
   (prepare, exchange, install), the bytes it exchanged, and the FFN release (merge) or
   gather (split). The wire model's figure beside them: the KV exchange visits the pairs one
   after the other, each pair two metadata messages each way and its rows each way; the FFN
   gather receives each layer's shard from each of the ``d - 1`` others, one message per
   section, counted one after the other.
3. **From the decision to the first token** (automatic transitions, 512-token pools, as the
   live replay): a prompt no replica holds (1,500 tokens): from the client's send to the
   merge's start (placement, parking, the proposal, the vote), the merge itself, and from its
   end to the first token (the prompt's prefill in the group); then the automatic split.

Results: ``benchmark/results/amoebas/transition_cost.{json,md}`` (median and min-max over the
rounds; the group's time is the slowest member's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmark.amoebas.replay import ALONE, REPLICAS, SERVER_ENV, wait_for_split, warm_up
from benchmark.harness import (
    REPO_ROOT,
    load_average,
    run_meta,
    running_server,
    spread,
    write_results,
)
from benchmark.kunserve.transfer import fit_wire, measure_gloo
from sglang_morph.amoebas.weights import SECTIONS

BLOCK = list(range(REPLICAS))
COMMON_ARGS = ("--dtype", "float32", "--dp-size", str(REPLICAS), "--enable-amoebas")
OUT_DIR = REPO_ROOT / "benchmark" / "results" / "amoebas"
RAW_DIR = REPO_ROOT / "benchmark" / "results" / "raw"  # server logs, quick runs (not in git)


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int = 3
    live_levels: tuple[int, ...] = (0, 256, 768)  # prompt tokens in flight per replica
    new_tokens: int = 32
    manual_pool_tokens: int = 1024
    auto_pool_tokens: int = 512
    long_prompt_tokens: int = 1500
    split_wait_s: float = 180.0
    out_dir: Path = OUT_DIR


QUICK = Settings(rounds=1, live_levels=(0, 256), new_tokens=8)


# ---- requests ----


def corpus_ids(tokens: int) -> list[int]:
    """``tokens`` token ids of the repo's text (disjoint slices keep the radix cache out)."""
    from transformers import AutoTokenizer

    from sglang_morph.models import default_model_path
    from sglang_morph.repo_data import WIKITEXT2_TRAIN_HEAD

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    ids = tokenizer(WIKITEXT2_TRAIN_HEAD.read_text()[:tokens * 8], verbose=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"the corpus has {len(ids)} tokens, {tokens} are needed")
    return ids[:tokens]


class Stream:
    """One streamed greedy /generate in a thread: its token count and first-token time."""

    def __init__(self, url: str, ids: list[int], new_tokens: int, rank: int | None = None):
        self.tokens, self.first_token_unix_s, self.error = 0, None, None
        self.sent_unix_s = time.time()
        body = {"input_ids": ids, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
        if rank is not None:
            body["routed_dp_rank"] = rank
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=900) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    self.tokens = len(json.loads(line[5:])["output_ids"])
                    if self.first_token_unix_s is None and self.tokens:
                        self.first_token_unix_s = time.time()
        except Exception as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def wait_for(self, tokens: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens < tokens and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a stream stuck at {self.tokens} tokens")
            time.sleep(0.02)

    def join(self) -> int:
        self._thread.join(timeout=900)
        if self.error is not None:
            raise RuntimeError(f"a request failed: {self.error}")
        return self.tokens


def status(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/amoebas/status", timeout=120)
    r.raise_for_status()
    return r.json()


def post(url: str, route: str, body: dict) -> dict[str, Any]:
    r = httpx.post(f"{url}/amoebas/{route}", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"POST /amoebas/{route} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def last_records(s: dict[str, Any], action: str) -> list[dict[str, Any]]:
    """Each replica's newest transition record of ``action``."""
    return [next(t for t in reversed(b["transitions"]) if t["action"] == action)
            for b in s["replicas"]]


# ---- the wire model ----


@dataclasses.dataclass(frozen=True)
class Wire:
    latency_s: float
    bandwidth_bytes_per_s: float

    def message_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def kv_exchange_s(self, pair_bytes: Sequence[tuple[float, float]]) -> float:
        """The pairs one after the other: per pair two metadata messages each way, then its
        rows each way (``(a to b, b to a)`` bytes)."""
        return sum(4 * self.latency_s + self.message_s(ab) + self.message_s(ba)
                   for ab, ba in pair_bytes)

    def ffn_gather_s(self, layers: int, shard_bytes: float, degree: int) -> float:
        """What one member receives, one message after the other: per layer a shard from
        each of the ``degree - 1`` others, as one message per section (gate, up, down^T)."""
        return layers * (degree - 1) * SECTIONS * self.message_s(shard_bytes / SECTIONS)


def measure_wire() -> tuple[Wire, dict[str, float]]:
    one_way = measure_gloo()
    latency_s, bandwidth = fit_wire(one_way)
    return Wire(latency_s, bandwidth), {str(k): v for k, v in sorted(one_way.items())}


# ---- the model's sizes ----


def model_sizes() -> dict[str, int]:
    from sglang_morph.models import default_model_path
    from sglang_morph.models.spec import ModelSpec

    spec = ModelSpec.from_model_dir(default_model_path(), dtype_bytes=4)
    head_dim = spec.head_dim
    return {"layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": head_dim,
            "hidden": spec.hidden_size, "intermediate": spec.intermediate_size,
            # one token of one KV head, K and V, every layer
            "head_token_bytes": spec.num_layers * 2 * head_dim * 4}


# ---- 2. operator merges and splits ----


def transition_round(url: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """A merge then the split with one stream per replica in flight (none for empty
    prompts); each member's records."""
    httpx.post(f"{url}/flush_cache", timeout=60)
    streams = [Stream(url, ids, new_tokens, r) for r, ids in enumerate(prompts) if ids]
    for s in streams:
        s.wait_for(2)
    post(url, "merge", {"replicas": BLOCK})
    merged = status(url)
    after = post(url, "split", {"group": BLOCK})
    for s in streams:
        s.join()
    if after["units"] != ALONE:
        raise RuntimeError(f"the split left {after['units']}")
    return {"merge": last_records(merged, "merge"), "split": last_records(after, "split")}


def summarize_level(rounds: list[dict[str, Any]], sizes: dict[str, int], wire: Wire
                    ) -> dict[str, Any]:
    """Per action: the group's times (slowest member), per layer and per live KV token, and
    the wire model's KV exchange and FFN gather."""
    d, layers = REPLICAS, sizes["layers"]
    shard_bytes = 3 * (sizes["intermediate"] // d) * sizes["hidden"] * 4  # gate, up, down^T
    out: dict[str, Any] = {}
    for action in ("merge", "split"):
        per_round = []
        for rnd in rounds:
            members = rnd[action]
            live = [m["live_tokens"] for m in members]
            # Each pair (a, b) trades the rows of one head each way: a's tokens of b's head.
            pairs = [(live[a] * sizes["head_token_bytes"], live[b] * sizes["head_token_bytes"])
                     for a in range(d) for b in range(a + 1, d)]
            exchange = max(m["kv_phase_s"].get("kv_exchange", 0.0) for m in members)
            ffn = max(m["ffn_s"] for m in members)
            per_round.append({
                "whole_s": max(m["duration_s"] for m in members),
                "kv_exchange_s": exchange,
                "kv_prepare_s": max(m["kv_phase_s"].get("kv_prepare", 0.0) for m in members),
                "kv_install_s": max(m["kv_phase_s"].get("kv_install", 0.0) for m in members),
                "ffn_s": ffn,
                "ffn_s_per_layer": ffn / layers,
                "live_tokens_group": sum(live),
                "kv_bytes_exchanged": sum(m["kv_sent_bytes"] for m in members),
                "kv_exchange_us_per_live_token": (exchange / sum(live) * 1e6) if sum(live)
                else None,
                "wire_kv_exchange_s": wire.kv_exchange_s(pairs),
                "wire_ffn_gather_s": wire.ffn_gather_s(layers, shard_bytes, d)
                if action == "split" else None,
                "kv_peak_extra_bytes": max(m["kv_peak_extra_bytes"] for m in members),
            })
        out[action] = {k: spread([r[k] for r in per_round]) for k in per_round[0]}
    return out


def operator_part(st: Settings, sizes: dict[str, int], wire: Wire, ids: list[int],
                  log: Path) -> dict[str, Any]:
    args = (*COMMON_ARGS, "--amoebas-manual", "--max-total-tokens", str(st.manual_pool_tokens))
    levels: dict[str, Any] = {}
    with running_server(args, log, env=SERVER_ENV) as server:
        warm_up(server.url, "amoebas", ids[:16])
        cursor = 16
        for level in st.live_levels:
            rounds = []
            for k in range(st.rounds):
                prompts = []
                for _ in BLOCK:
                    prompts.append(ids[cursor:cursor + level])
                    cursor += level
                rounds.append(transition_round(server.url, prompts, st.new_tokens))
                print(f"[transition cost] {level} live tokens, round {k}: merge "
                      f"{max(m['duration_s'] for m in rounds[-1]['merge']):.3f} s, split "
                      f"{max(m['duration_s'] for m in rounds[-1]['split']):.3f} s", flush=True)
            levels[str(level)] = {"rounds": rounds,
                                  "summary": summarize_level(rounds, sizes, wire)}
    return {"server_args": list(args), "levels": levels}


# ---- 3. from the decision to the first token ----


def auto_part(st: Settings, ids: list[int], log: Path) -> dict[str, Any]:
    args = (*COMMON_ARGS, "--max-total-tokens", str(st.auto_pool_tokens))
    rounds = []
    with running_server(args, log, env=SERVER_ENV) as server:
        warm_up(server.url, "amoebas", ids[:16])
        cursor = 16
        for k in range(st.rounds):
            prompt = ids[cursor:cursor + st.long_prompt_tokens]
            cursor += st.long_prompt_tokens
            stream = Stream(server.url, prompt, 4)
            stream.join()
            merged = [t for b in status(server.url)["replicas"] for t in b["transitions"]
                      if t["action"] == "merge" and t["at_unix_s"] >= stream.sent_unix_s]
            if not merged or stream.first_token_unix_s is None:
                raise RuntimeError("the long prompt was served without a merge")
            end = max(t["at_unix_s"] for t in merged)
            start = min(t["at_unix_s"] - t["duration_s"] for t in merged)
            split_wait = time.time()
            if wait_for_split(server.url, [], st.split_wait_s)["units"] != ALONE:
                raise RuntimeError("the group did not split back")
            rounds.append({"ttft_s": stream.first_token_unix_s - stream.sent_unix_s,
                           "send_to_merge_start_s": start - stream.sent_unix_s,
                           "merge_s": end - start,
                           "merge_end_to_first_token_s": stream.first_token_unix_s - end,
                           "split_after_s": time.time() - split_wait})
            print(f"[transition cost] long prompt round {k}: {rounds[-1]}", flush=True)
    return {"server_args": list(args), "rounds": rounds,
            "summary": {k: spread([r[k] for r in rounds]) for k in rounds[0]}}


# ---- report ----


def _ms(sp: dict[str, float | None], scale: float = 1e3, digits: int = 1) -> str:
    if sp["median"] is None:
        return "-"
    return (f"{sp['median'] * scale:.{digits}f} ({sp['min'] * scale:.{digits}f}-"
            f"{sp['max'] * scale:.{digits}f})")


def markdown(report: dict[str, Any]) -> str:
    meta, st, wire = report["meta"], report["settings"], report["wire"]
    lines = [
        "# AMOEBAs transition costs, live (default model, 3 replicas <-> TP 3)", "",
        f"Command: `{meta['command']}`; commit {meta['git']['commit']}"
        f"{' (dirty)' if meta['git']['dirty'] else ''}; {meta['machine']['cpu_model']}, "
        f"{meta['machine']['cpu_cores']} cores; load average before "
        f"{[round(x, 2) for x in meta['load_before']]}, after "
        f"{[round(x, 2) for x in meta.get('load_after', [])]}. {st['rounds']} rounds per "
        "point; median (min-max); the group's time is its slowest member's. Measured.", "",
        f"Wire (gloo send/recv, loopback, same run): latency {wire['latency_s'] * 1e3:.3f} ms, "
        f"bandwidth {wire['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s.", "",
        "## Operator merge and split (ms)", "",
        "| live tokens / replica | action | whole | KV exchange | wire model of it | KV prepare "
        "| KV install | FFN release / gather | per layer | wire model of the gather | KV "
        "exchange per live token (us) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level, body in report["operator"]["levels"].items():
        for action, s in body["summary"].items():
            lines.append(
                f"| {level} | {action} | {_ms(s['whole_s'])} | {_ms(s['kv_exchange_s'])} | "
                f"{_ms(s['wire_kv_exchange_s'])} | {_ms(s['kv_prepare_s'])} | "
                f"{_ms(s['kv_install_s'])} | {_ms(s['ffn_s'])} | "
                f"{_ms(s['ffn_s_per_layer'], digits=2)} | {_ms(s['wire_ffn_gather_s'])} | "
                f"{_ms(s['kv_exchange_us_per_live_token'], scale=1, digits=1)} |")
    a = report["auto"]["summary"]
    lines += ["", f"## From the decision to the first token ({st['long_prompt_tokens']}-token "
              f"prompt, {st['auto_pool_tokens']}-token pools, automatic transitions; s)", "",
              "| TTFT | send -> merge start | merge | merge end -> first token | split after |",
              "|---:|---:|---:|---:|---:|",
              f"| {_ms(a['ttft_s'], 1, 2)} | {_ms(a['send_to_merge_start_s'], 1, 2)} | "
              f"{_ms(a['merge_s'], 1, 3)} | {_ms(a['merge_end_to_first_token_s'], 1, 2)} | "
              f"{_ms(a['split_after_s'], 1, 2)} |", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.amoebas.transition_cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=Settings.rounds)
    ap.add_argument("--quick", action="store_true", help="one round of two levels: a "
                    "harness check, written under benchmark/results/raw/")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    st = QUICK if args.quick else dataclasses.replace(Settings(), rounds=args.rounds)
    raw = RAW_DIR / ("amoebas_transition_cost_quick" if args.quick
                     else "amoebas_transition_cost")
    out = raw if args.quick else st.out_dir
    for folder in (raw, out):
        folder.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmark.amoebas.transition_cost " + " ".join(sys.argv[1:] if
                                                                          argv is None else argv)
    load_before = load_average()
    sizes = model_sizes()
    operator_tokens = 16 + REPLICAS * st.rounds * sum(st.live_levels)
    ids = corpus_ids(operator_tokens + 16 + st.rounds * st.long_prompt_tokens)
    wire, one_way = measure_wire()
    operator = operator_part(st, sizes, wire, ids[:operator_tokens], raw / "manual_server.log")
    auto = auto_part(st, ids[operator_tokens:], raw / "auto_server.log")
    report = {"meta": run_meta(command.strip(), load_before),
              "settings": {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in dataclasses.asdict(st).items()},
              "sizes": sizes,
              "wire": {"latency_s": wire.latency_s,
                       "bandwidth_bytes_per_s": wire.bandwidth_bytes_per_s,
                       "one_way_s": one_way},
              "operator": operator, "auto": auto}
    write_results(out, "transition_cost", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
