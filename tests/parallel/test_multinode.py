"""SGLang's own multi-node launch on loopback: two processes as two "nodes".

``scripts/serve.sh --pp-size 2 --nnodes 2 --node-rank {0,1} --dist-init-addr 127.0.0.1:PORT
--enable-morph``: node 0 runs pipeline stage 0 plus SGLang's HTTP server, tokenizer and
detokenizer; node 1 runs only the stage-1 scheduler (and SGLang's dummy health server on its
``--port``). The stages meet through torch.distributed at ``--dist-init-addr`` (gloo on CPU,
made possible by our process-group hook) exactly as they would across machines; only the
address is loopback. Morph is on (every layer at full precision at start): stage 1 answers
``/morph`` requests through stage 0 (a tcp socket on the ``--dist-init-addr`` host), as it
must from another machine.

- Greedy float32 outputs (token ids, chosen-token logprobs, best-vs-runner-up margins) of the
  two-node PP 2 equal a one-process PP 1 server's bit for bit. Each stage runs one torch thread
  (node 0 on the first core, node 1 on the last), like the one-thread reference: with the same
  per-layer ops and gloo sends of the float32 hidden state, nothing may differ.
- Node 1 holds layers 15-29 and runs its own prefills; it serves no API (``/generate`` 404).
- A swap of 8 layers to W4 while a request streams moves layers on both nodes and grows both
  stages' KV alike, the stream finishes, the restore is exact and greedy outputs equal those
  before (tests/morph/test_morph_parallel.py's check).
- ``--enable-morph`` with ``--nnodes 2`` and no pipeline is refused on node rank 1 too, with
  one line (node rank 0: tests/morph/test_morph_parallel.py).

The reference runs first and is stopped before the two nodes start (two servers at most).
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from conftest import REPO_ROOT, SERVER_START_TIMEOUT_S, free_port, running_server
from benchmark.harness import ServerProcess
from test_morph_parallel import swap_mid_stream_and_restore
from test_morph_runtime_server import corpus_ids, tokenizer  # noqa: F401 (fixtures)
from test_parallel import (
    COMMON,
    ONE_THREAD,
    REFERENCES,
    greedy_one_at_a_time,
    reference_key,
)

pytestmark = [pytest.mark.server,  # every test runs scripts/serve.sh
              pytest.mark.xdist_group("one_rank_references")]  # REFERENCES, one process

PP2_TWO_NODES = COMMON + ("--pp-size", "2", "--nnodes", "2", "--enable-morph")


def test_enable_morph_with_nnodes_2_without_pp_is_refused_on_node_rank_1():
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "serve.sh"), "--enable-morph", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{free_port()}",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "sglang-morph: error:" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "--enable-morph with --nnodes 2 supports pipeline stages across nodes only" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy outputs of a one-process PP 1 server running one thread (then stopped), recorded
    once per test run with tests/parallel/test_parallel.py."""
    key = reference_key(COMMON, ONE_THREAD)
    if key not in REFERENCES:
        with running_server(COMMON, tmp_path_factory.mktemp("pp1"), ONE_THREAD) as server:
            REFERENCES[key] = greedy_one_at_a_time(server)
    return REFERENCES[key]


@pytest.fixture(scope="module")
def two_nodes(reference, tmp_path_factory, engines_awq):
    """(node 0, node 1) of one PP 2 morph server, each stage pinned to one core."""
    log_dir = tmp_path_factory.mktemp("two_nodes")
    cores = sorted(os.sched_getaffinity(0))
    dist_init_addr = f"127.0.0.1:{free_port()}"
    nodes = []
    try:
        for rank, core in enumerate((cores[0], cores[-1])):
            nodes.append(ServerProcess(
                [*PP2_TWO_NODES, "--morph-engines", str(engines_awq), "--node-rank", str(rank),
                 "--dist-init-addr", dist_init_addr],
                log_dir / f"node{rank}.log", {"SGLANG_CPU_OMP_THREADS_BIND": str(core)},
                start_timeout_s=SERVER_START_TIMEOUT_S,
                # a relaunched node 0 would leave node 1 on the old gloo group
                relaunch_on_port_clash=False))
        for node in nodes:  # node 1's dummy /health answers once its scheduler is ready
            node.wait_ready()
        yield nodes
    finally:
        for node in nodes:  # node 0 first: node 1 waits for its shutdown (or its gloo peer)
            node.stop()


def test_pp2_across_two_nodes_equals_pp1_bit_for_bit(reference, two_nodes):
    node0, node1 = two_nodes
    assert greedy_one_at_a_time(node0) == reference
    log0, log1 = node0.log_text(), node1.log_text()
    assert "pipeline stage 0 of 2 holds decoder layers 0-14" in log0
    assert "pipeline stage 1 of 2 holds decoder layers 15-29" in log1
    assert "holds decoder layers 15-29" not in log0 and "holds decoder layers 0-14" not in log1
    assert "PP1] Prefill batch" in log1  # stage 1 ran in node 1's process


def test_node_1_serves_no_api(two_nodes):
    _, node1 = two_nodes
    assert httpx.get(f"{node1.url}/health", timeout=30).status_code == 200
    r = httpx.post(f"{node1.url}/generate", timeout=30,
                   json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 404, r.text


def test_swap_and_restore_across_two_nodes(two_nodes, corpus_ids):
    node0, node1 = two_nodes
    swap_mid_stream_and_restore(node0, corpus_ids, [16] * 30)
    # stage 1 (node 1's process) moved its layers of the swap and of the restore
    assert "sglang-morph: swap layers [17, 15, 25, 16, 26]" in node1.log_text()
    assert "sglang-morph: restore layers [17, 15, 25, 16, 26]" in node1.log_text()
    assert "sglang-morph: swap layers [14, 13, 12]" in node0.log_text()
