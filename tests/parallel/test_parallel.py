"""Multi-rank SGLang on CPU: tensor, pipeline and data parallelism through serve.sh.

Every configuration is compared with one rank of the same model, in float32 and greedy, on the
same prompts sent one at a time (so every server runs the same batch shapes):

- **PP 2** (uneven with ``SGLANG_PP_LAYER_PARTITION`` here; the even split launched as two
  nodes in tests/parallel/test_multinode.py) must be *bit-identical* to PP 1: a stage runs exactly the ops one rank runs on its layers and hands the hidden state and
  residual on unchanged (gloo sends of the float32 tensors). The one-rank reference runs one
  torch thread (``OMP_NUM_THREADS=1``) like each multi-rank rank here: with two threads the
  float32 GEMMs split their sums differently and the logprobs already differ in the last bits
  (seen: PP 2 vs a two-thread PP 1 differs, vs a one-thread PP 1 it is bit-identical).
- **TP 3** (default model) and **TP 2** (tiny model) cannot be bit-identical: ``o_proj`` and
  ``down_proj`` are row-parallel, so each rank sums its third (half) of the input dimension and
  the all-reduce adds the partial sums; float32 addition is not associative, so the result
  differs from one rank's single sum in the last bits (relative ~1e-7 per element), and the
  difference travels through the remaining layers. It stays tiny: against a one-thread
  reference, the largest difference on a chosen token's logprob was 6.2e-6 nats for TP 3 and
  2.9e-6 for the tiny model's TP 2, and 1.3e-5 for DP 2's differently batched concurrent
  requests (the tests print it). ``LOGPROB_TOL`` (1e-4 nats) is a bound 7-35x above what
  reordering produced, and far below the gap between the best and second-best token on all
  but genuine near-ties. The check: every token both runs chose must have logprobs within the
  bound, and the runs may
  only part ways at a step where one rank's best and second-best token are within
  ``2 * LOGPROB_TOL`` (a near-tie that any reduction order may flip); most prompts must match to
  the end. A wrong shard, a missing all-reduce or a mis-loaded head changes logprobs by
  orders of magnitude more and fails.
- **DP 2** must answer concurrent requests from both replicas (``meta_info["dp_rank"]`` and
  the replicas' log lines), each answer matching one rank (within the same bound: replicas
  batch the concurrent requests differently from the one-at-a-time reference).
- SGLang's frontend language and ``python -m sglang.bench_serving`` run against TP 3.

At most two of these servers run at once (``_Servers``); servers of a configuration are shared
by its tests and started in pairs where two are needed anyway; the one-rank reference's outputs
are recorded once per test run (``REFERENCES``, with tests/parallel/test_multinode.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys

import httpx
import pytest
import sglang as sgl

from conftest import ServerProcess, SERVER_START_TIMEOUT_S
from sglang_morph.models.tiny import tiny_model_path
from sglang_morph.parallel.binding import default_bind, parse_core_list
from test_frontend_and_bench import _sharegpt_file_from_corpus, capital_quiz

# Small pools: a float32 rank of the default model would otherwise allocate 3 GiB of KV.
COMMON = ("--dtype", "float32", "--max-total-tokens", "4096")
REF = COMMON
# Same thread count as each rank of the multi-rank servers (one core each on this machine).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TP3 = COMMON + ("--tp-size", "3")
PP2 = COMMON + ("--pp-size", "2")
UNEVEN_PARTITION = {"SGLANG_PP_LAYER_PARTITION": "12,18"}  # 30 layers: 12 + 18
DP2 = COMMON + ("--dp-size", "2")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
NEW_TOKENS = 12
LOGPROB_TOL = 1e-4
MAX_LIVE_SERVERS = 2
# REFERENCES lives in this process: test_multinode runs in the same test process.
pytestmark = pytest.mark.xdist_group("one_rank_references")


@dataclasses.dataclass(frozen=True)
class Greedy:
    """One greedy continuation with the logprob of each chosen token and, per step, the gap
    between the best and the second-best token's logprob."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    margins: tuple[float, ...]

    @classmethod
    def from_response(cls, body: dict) -> "Greedy":
        meta = body["meta_info"]
        chosen = meta["output_token_logprobs"]
        tops = meta["output_top_logprobs"]
        return cls(tuple(t[1] for t in chosen), tuple(t[0] for t in chosen),
                   tuple(top[0][0] - top[1][0] for top in tops))


def generate(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/generate", timeout=300, json={
        "text": prompt, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def greedy_one_at_a_time(server: ServerProcess) -> list[Greedy]:
    return [Greedy.from_response(generate(server.url, p)) for p in PROMPTS]


def compare(ref: Greedy, got: Greedy, tol: float) -> tuple[bool, float]:
    """Assert ``got`` is what ``ref``'s numerics allow (see the module docstring); returns
    whether the two ran to the end together and the largest logprob difference seen."""
    max_diff = 0.0
    for step, (a, b) in enumerate(zip(ref.ids, got.ids)):
        if a != b:
            assert ref.margins[step] <= 2 * tol, (
                f"token {step} differs ({a} vs {b}) although the reference's best token led "
                f"the runner-up by {ref.margins[step]:.2e} nats")
            return False, max_diff
        diff = abs(ref.logprobs[step] - got.logprobs[step])
        assert diff <= tol, f"token {step} ({a}): logprob differs by {diff:.2e} > {tol}"
        max_diff = max(max_diff, diff)
    assert len(ref.ids) == len(got.ids) == NEW_TOKENS
    return True, max_diff


def assert_matches(refs: list[Greedy], gots: list[Greedy], tol: float = LOGPROB_TOL) -> float:
    results = [compare(r, g, tol) for r, g in zip(refs, gots, strict=True)]
    together = sum(ok for ok, _ in results)
    # A near-tie may part one continuation; more would mean the check lost its teeth.
    assert together >= len(refs) - 1, f"only {together} of {len(refs)} continuations agree"
    return max(d for _, d in results)


# One rank's greedy outputs per (args, env), shared by this module and test_multinode (which
# records the one-thread reference first): the same server would answer the same prompts
# with the same numbers, so it is started once per test run.
REFERENCES: dict[tuple, list[Greedy]] = {}


def reference_key(args, env) -> tuple:
    return tuple(args), tuple(sorted((env or {}).items()))


class _Servers:
    """Servers of this module, at most MAX_LIVE_SERVERS alive (oldest stopped first)."""

    def __init__(self, log_root):
        self.log_root = log_root
        self.live: dict[tuple, ServerProcess] = {}
        self.started = 0

    _key = staticmethod(reference_key)

    def get(self, *configs: tuple[tuple[str, ...], dict | None]) -> list[ServerProcess]:
        """Ready servers for ``(args, env)`` configurations, the missing ones started together."""
        assert len(configs) <= MAX_LIVE_SERVERS
        keys = [self._key(a, e) for a, e in configs]
        missing = [(k, c) for k, c in zip(keys, configs) if k not in self.live]
        while missing and len(self.live) + len(missing) > MAX_LIVE_SERVERS:
            oldest = next(k for k in self.live if k not in keys)
            self.live.pop(oldest).stop()
        started = []
        try:
            for key, (args, env) in missing:
                self.started += 1
                self.live[key] = ServerProcess(
                    list(args), self.log_root / f"server{self.started}" / "server.log", env,
                    start_timeout_s=SERVER_START_TIMEOUT_S)
                started.append(key)
            for key in started:
                self.live[key].wait_ready()
        except BaseException:
            for key in started:
                self.live.pop(key).stop()
            raise
        return [self.live[k] for k in keys]

    def reference(self, args: tuple[str, ...], env: dict | None = None) -> list[Greedy]:
        """One rank's greedy outputs, recorded once per test run (``REFERENCES``)."""
        key = self._key(args, env)
        if key not in REFERENCES:
            REFERENCES[key] = greedy_one_at_a_time(self.get((args, env))[0])
        return REFERENCES[key]

    def stop_all(self) -> None:
        while self.live:
            self.live.popitem()[1].stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pool = _Servers(tmp_path_factory.mktemp("parallel"))
    yield pool
    pool.stop_all()


@pytest.fixture
def tp3(servers) -> ServerProcess:
    # Kept alive by the pool until other configurations need its slot.
    (server,) = servers.get((TP3, None))
    return server


@pytest.mark.server
def test_tp3_equals_tp1_default_model(servers, tp3):
    refs = servers.reference(REF, ONE_THREAD)
    max_diff = assert_matches(refs, greedy_one_at_a_time(tp3))
    print(f"TP3 vs TP1: largest logprob difference {max_diff:.2e} nats")
    assert "rank 2 of 3 on CPU cores" in tp3.log_text()  # each rank pinned by our hook


@pytest.mark.server
def test_frontend_language_against_tp3(tp3):
    states = capital_quiz.run_batch([{"country": "France"}, {"country": "Germany"}],
                                    backend=sgl.RuntimeEndpoint(tp3.url), temperature=0)
    assert "Paris" in states[0]["city"] and "Berlin" in states[1]["city"]
    assert all(state["kind"] == " city" for state in states)


@pytest.mark.server
def test_bench_serving_against_tp3(tp3, default_model_path, tmp_path):
    dataset = tmp_path / "sharegpt_from_wikitext.json"
    _sharegpt_file_from_corpus(dataset, n_conversations=8)
    result_file = tmp_path / "bench.jsonl"
    num_prompts, output_len = 4, 8
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
         "--base-url", tp3.url, "--tokenizer", str(default_model_path),
         "--dataset-name", "random", "--dataset-path", str(dataset),
         "--num-prompts", str(num_prompts), "--random-input-len", "32",
         "--random-output-len", str(output_len), "--random-range-ratio", "1.0",
         "--request-rate", "inf", "--output-file", str(result_file), "--seed", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text().strip().splitlines()[-1])
    assert result["completed"] == num_prompts
    assert result["total_output_tokens"] == num_prompts * output_len


@pytest.mark.server
def test_pp2_uneven_equals_pp1_bit_for_bit(servers):
    # The even split (15 + 15) is tested bit for bit against the same one-thread reference in
    # tests/parallel/test_multinode.py, its two stages launched as two nodes: the same two scheduler
    # processes and gloo sends, one server fewer to start here.
    refs = servers.reference(REF, ONE_THREAD)
    (uneven,) = servers.get((PP2, UNEVEN_PARTITION))
    assert greedy_one_at_a_time(uneven) == refs
    log = uneven.log_text()
    for stage, layers in enumerate(("0-11", "12-29")):
        assert f"pipeline stage {stage} of 2 holds decoder layers {layers}" in log


@pytest.mark.server
def test_dp2_serves_concurrent_requests_from_both_replicas(servers):
    refs = servers.reference(REF, ONE_THREAD)
    (dp2,) = servers.get((DP2, None))
    prompts = PROMPTS * 2
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda p: generate(dp2.url, p), prompts))
    assert {body["meta_info"]["dp_rank"] for body in bodies} == {0, 1}
    log = dp2.log_text()
    for rank in (0, 1):
        assert re.search(rf"DP{rank}\] Prefill batch", log), f"replica {rank} never prefilled"
    max_diff = assert_matches(refs * 2, [Greedy.from_response(b) for b in bodies])
    print(f"DP2 (concurrent) vs TP1: largest logprob difference {max_diff:.2e} nats")


@pytest.mark.server
def test_tp2_equals_tp1_tiny_model(servers):
    model = ("--model-path", str(tiny_model_path()))
    one, two = servers.get((COMMON + model, ONE_THREAD),
                           (COMMON + model + ("--tp-size", "2"), None))
    max_diff = assert_matches(greedy_one_at_a_time(one), greedy_one_at_a_time(two))
    print(f"tiny TP2 vs TP1: largest logprob difference {max_diff:.2e} nats")


# --- serve.sh's default core lists (no server) ---------------------------------------------

def test_default_bind_splits_cores_between_ranks():
    assert default_bind(1, [0, 1]) == "0-1"
    assert default_bind(2, [0, 1, 2, 3, 4]) == "0-1|2-3"  # equal blocks; core 4 stays unused
    assert default_bind(3, [0, 1]) == "0|1|0"  # more ranks than cores: shared, round robin
    assert [parse_core_list(e) for e in default_bind(2, [4, 6, 7, 9]).split("|")] == [
        [4, 6], [7, 9]]
    with pytest.raises(ValueError, match="bad core list"):
        parse_core_list("3-1")


def test_binding_cli_prints_one_entry_per_rank_of_the_node():
    def run(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "sglang_morph.parallel.binding", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    cores = len(os.sched_getaffinity(0))
    assert run("--model-path", "m", "--port", "1") == ""  # one rank: SGLang's own default
    assert len(run("--tp-size", "3", "--dp-size", "2").split("|")) == 6
    assert len(run("--pp-size", "2", "--tp-size", "2", "--nnodes", "2").split("|")) == 2
    assert run("--help", "--tp-size", "2") == default_bind(2, range(cores))
