"""``benchmark.replay.status_cost``'s parts without a server: the CPU of a process tree (a
child's included), one sampled window at the replay's rate against a local HTTP server, and
the report."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest

from benchmark.replay import status_cost as SC
from benchmark.replay.client import STATUS_POLL_INTERVAL_S


def test_tree_cpu_counts_a_busy_child():
    before = SC.tree_cpu_s(os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend = time.process_time() + 0.4\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while SC.tree_cpu_s(os.getpid()) - before < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert SC.tree_cpu_s(os.getpid()) - before >= 0.4
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def status_server():
    hits: list[float] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            hits.append(time.monotonic())
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/kunserve/status", hits
    server.shutdown()


def test_a_sampled_window_requests_at_the_replays_rate(status_server):
    url, hits = status_server
    got = SC.window(os.getpid(), url, seconds=1.0)
    expected = 1.0 / STATUS_POLL_INTERVAL_S
    assert got["requests"] == len(hits) and expected - 1 <= len(hits) <= expected + 1
    assert len(got["latencies_s"]) == got["requests"] and got["wall_s"] >= 1.0
    idle = SC.window(os.getpid(), None, seconds=0.5)
    assert idle["requests"] == 0 and len(hits) == got["requests"]


def test_the_report_names_every_figure():
    runs = [{"round": r, "requests": 80, "sampled_cpu_s": 0.8, "idle_cpu_s": 0.4,
             "cpu_s_per_request": 0.005 * r, "cores_at_replay_rate": 0.02,
             "latency_s_p50": 0.004, "latency_s_max": 0.008} for r in (1, 2, 3)]
    keys = ("cpu_s_per_request", "cores_at_replay_rate", "latency_s_p50", "latency_s_max")
    report = {"runs": runs, "summary": {k: SC.spread([r[k] for r in runs]) for k in keys},
              "settings": {"seconds": 20.0},
              "meta": {"command": "python -m benchmark.replay.status_cost", "load_before": [0],
                       "git": {"commit": "abc", "dirty": False},
                       "machine": {"cpu_model": "CPU", "cpu_cores": 2}}}
    text = SC.markdown(report)
    assert "| CPU seconds per status request (all server processes) | 0.0100 (0.0050 to " \
           "0.0150) |" in text
    assert "round 3: 80 requests, 0.80 CPU s sampled vs 0.40 idle" in text
