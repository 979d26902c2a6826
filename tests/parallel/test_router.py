"""A cluster from SGLang's own parts: the SGLang router in front of two morph servers.

Two single-rank ``--enable-morph`` servers (float32, 650 MB budget, controller off so only the
test moves layers, ``--enable-metrics``) and ``python -m sglang_router.launch_router`` with the
``round_robin`` policy in front of them, all on 127.0.0.1:

- greedy ``/generate`` and OpenAI ``/v1/chat/completions`` through the router equal a direct
  request to a server token for token, and each response still carries the worker's precision
  provenance (``meta_info.morph_precision`` / ``metadata.morph_precision``, also the last chunk
  of a streamed chat);
- each routed request reaches exactly one worker (its own ``sglang:http_requests_total``
  counter), alternating between the two;
- the router does not forward ``/morph/*`` (404, nothing changes); a ``POST /morph/swap`` sent to
  one worker directly changes that worker only, and routed requests then report the precision of
  the worker that served them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import SERVER_START_TIMEOUT_S
from benchmark.harness import ServerProcess, free_port
from sglang_morph.morph.provenance import KEY
from test_provenance import prompt

pytestmark = pytest.mark.server  # two servers and a router

BUDGET = "650MB"
SWAPPED = [17, 14, 13, 15, 12, 25, 16, 26]  # the first 8 of the LIS profile order
N_NEW = 8
ROUTER_START_TIMEOUT_S = 120.0
TIMEOUT = httpx.Timeout(600.0)


def full_precision(n_tokens: int) -> dict:
    return {"quantized_token_share": 0.0, "quantized_tokens": 0, "output_tokens": n_tokens,
            "segments": [{"start": 0, "end": n_tokens, "quantized_layers": {}}]}


def swapped_to_w4(n_tokens: int) -> dict:
    return {"quantized_token_share": 1.0, "quantized_tokens": n_tokens,
            "output_tokens": n_tokens,
            "segments": [{"start": 0, "end": n_tokens,
                          "quantized_layers": {"4": sorted(SWAPPED)}}]}


class Router:
    """``python -m sglang_router.launch_router`` in its own process group (stopped as a whole)."""

    def __init__(self, worker_urls: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router",
             "--worker-urls", *worker_urls, "--policy", "round_robin",
             "--host", "127.0.0.1", "--port", str(self.port),
             # it waits for workers that are still starting; check each second, not each 30 s
             "--worker-startup-check-interval", "1",
             # its Prometheus exporter binds 0.0.0.0:29000 unless told otherwise
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, n_workers: int) -> None:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited:\n{self.log_path.read_text()[-4000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readiness", timeout=5).status_code == 200:
                    info = httpx.get(f"{self.url}/get_server_info", timeout=5).json()
                    if info.get("workers_count") == n_workers:
                        return
            time.sleep(0.5)
        raise TimeoutError(f"router not ready:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self._log.closed:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        self._log.close()


@pytest.fixture(scope="module")
def cluster(engines_awq, tmp_path_factory):
    """(router, [worker A, worker B]); the two workers and the router start side by side
    (serve.sh's setup step is a no-op check once scripts/setup.sh or a server has run)."""
    log_dir = tmp_path_factory.mktemp("router")
    workers, router = [], None
    try:
        for name in ("a", "b"):
            workers.append(ServerProcess(
                ["--dtype", "float32", "--enable-morph", "--morph-engines", str(engines_awq),
                 "--morph-memory-budget", BUDGET, "--disable-morph-controller",
                 "--enable-metrics"],
                log_dir / f"worker_{name}.log", start_timeout_s=SERVER_START_TIMEOUT_S,
                # the router is given these URLs before the workers are ready
                relaunch_on_port_clash=False))
        # Started beside the workers, as in a deployment: it registers them once they answer.
        router = Router([w.url for w in workers], log_dir / "router.log")
        for worker in workers:
            worker.wait_ready()
        router.wait_ready(n_workers=len(workers))
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each waits for its group
            list(pool.map(ServerProcess.stop, workers))


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=TIMEOUT)


def generate(base_url: str, ids: list[int]) -> dict:
    r = post(f"{base_url}/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


CHAT = {"model": "default", "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}


def chat(base_url: str, **extra) -> dict:
    r = post(f"{base_url}/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def morph_status(worker: ServerProcess) -> dict:
    r = httpx.get(f"{worker.url}/morph/status", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def layer_bits(worker: ServerProcess) -> dict[int, int]:
    return {layer["index"]: layer["bits"] for layer in morph_status(worker)["layers"]}


def requests_served(worker: ServerProcess, endpoint: str) -> float:
    """The worker's own count of POSTs to ``endpoint`` (SGLang's HTTP metrics)."""
    text = httpx.get(f"{worker.url}/metrics", timeout=60).text
    return sum(sample.value
               for family in text_string_to_metric_families(text)
               if family.name == "sglang:http_requests"  # the parser drops "_total"
               for sample in family.samples
               if sample.name.endswith("_total")
               and sample.labels.get("endpoint") == endpoint
               and sample.labels.get("method") == "POST")


def routed(router: Router, workers: list[ServerProcess], endpoint: str, send) -> tuple[int, dict]:
    """Send one request through the router; (index of the worker that served it, response)."""
    before = [requests_served(w, endpoint) for w in workers]
    response = send(router.url)
    grown = [requests_served(w, endpoint) - b for w, b in zip(workers, before)]
    assert sorted(grown) == [0, 1], f"one routed request, served by exactly one worker: {grown}"
    return grown.index(1), response


def test_router_answers_like_a_direct_request_and_spreads_requests(cluster):
    router, workers = cluster
    ids = prompt(10)
    direct = generate(workers[0].url, ids)

    served_by = []
    for _ in range(2):  # round robin: one request to each worker
        worker, out = routed(router, workers, "/generate", lambda url: generate(url, ids))
        served_by.append(worker)
        assert out["output_ids"] == direct["output_ids"]
        assert out["text"] == direct["text"]
        assert out["meta_info"][KEY] == full_precision(N_NEW)
    assert sorted(served_by) == [0, 1], served_by

    direct_chat = chat(workers[0].url)
    chat_served_by = []
    for _ in range(2):
        worker, out = routed(router, workers, "/v1/chat/completions", chat)
        chat_served_by.append(worker)
        assert out["choices"][0]["message"]["content"] == \
            direct_chat["choices"][0]["message"]["content"]
        assert out["usage"]["completion_tokens"] == N_NEW
        assert out["metadata"][KEY] == direct_chat["metadata"][KEY] == full_precision(N_NEW)
    assert sorted(chat_served_by) == [0, 1]

    # Streamed through the router: the chunks and the provenance chunk before [DONE] pass.
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", timeout=TIMEOUT,
                      json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][5:])
    assert last["choices"] == [] and last["metadata"] == {KEY: full_precision(N_NEW)}
    text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                   for line in lines[:-2])
    assert text == direct_chat["choices"][0]["message"]["content"]


def test_morph_control_goes_to_each_worker_not_through_the_router(cluster):
    router, workers = cluster
    a, b = workers
    all_full = {i: 16 for i in layer_bits(a)}
    assert layer_bits(a) == layer_bits(b) == all_full

    # The router has no /morph routes: 404, and no worker moves a layer.
    r = post(f"{router.url}/morph/swap", {"layers": SWAPPED, "bits": 4})
    assert r.status_code == 404, r.text
    assert httpx.get(f"{router.url}/morph/status", timeout=60).status_code == 404
    assert layer_bits(a) == layer_bits(b) == all_full

    ids = prompt(12)
    full_out = generate(b.url, ids)["output_ids"]
    r = post(f"{a.url}/morph/swap", {"layers": SWAPPED, "bits": 4})
    assert r.status_code == 200, r.text
    try:
        assert layer_bits(a) == {**all_full, **{i: 4 for i in SWAPPED}}
        assert layer_bits(b) == all_full and not [
            t for t in morph_status(b)["transitions"] if t["source"] == "api"]
        w4_out = generate(a.url, ids)["output_ids"]

        # Each routed request reports the precision of the worker that served it.
        served_by = set()
        for _ in range(2):
            worker, out = routed(router, workers, "/generate", lambda url: generate(url, ids))
            served_by.add(worker)
            if worker == 0:
                assert out["output_ids"] == w4_out
                assert out["meta_info"][KEY] == swapped_to_w4(N_NEW)
            else:
                assert out["output_ids"] == full_out
                assert out["meta_info"][KEY] == full_precision(N_NEW)
        assert served_by == {0, 1}
    finally:
        r = post(f"{a.url}/morph/swap", {"layers": SWAPPED, "bits": 16})
        assert r.status_code == 200, r.text
    assert layer_bits(a) == all_full
