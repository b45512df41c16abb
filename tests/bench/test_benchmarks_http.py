"""The HTTP benchmark (benchmarks/http_api.py) in a small run against a real
``worqr dashboard``: its load client reads, enqueues, and works a queue as HTTP
workers that finish every task exactly once; its part of the page is written and
replaced. No timing is asserted: docs/benchmarks.md has a full run's figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import http_api
from benchmarks.suite import Results
from worqr.testing import EmbeddedServer

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_a_small_run_reads_enqueues_and_leases_every_task_once() -> None:
    results = Results()
    port = http_api.free_port()
    with EmbeddedServer() as server:
        argv = [sys.executable, "-m", "worqr", "--url", server.url, "dashboard"]
        with http_api.serving([*argv, "--port", str(port)], port):
            http_api.done_job(port)
            http_api.reads("worqr", port, "/api/queues/http/jobs/bench-read", 0.3, results)
            http_api.http_enqueue(port, 0.3, results)
            # the lease raises unless every task was finished exactly once
            http_api.http_lease(port, 300, 1, results, "lease_1")
            http_api.http_lease(port, 300, 7, results, "lease_batch")
            queues = http_api.answers(port, "/api/queues")["queues"]
    assert [(q["ready"], q["in_process"]) for q in queues] == [(0, 0)]
    for key, _, _ in http_api.FIGURES:
        if not key.startswith("library"):
            assert results.median("worqr", key), key


def test_a_refused_request_fails_the_run() -> None:
    with EmbeddedServer() as server:
        port = http_api.free_port()
        argv = [sys.executable, "-m", "worqr", "--url", server.url, "dashboard"]
        with (
            http_api.serving([*argv, "--port", str(port)], port),
            pytest.raises(RuntimeError, match="400"),
        ):
            http_api.rate(port, "POST", "/api/queues/q/tasks", {"tasks": []}, 1, 0.1)


def test_the_part_is_written_and_replaced(tmp_path: Path) -> None:
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\nkept\n")
    results = Results()
    for key, _, _ in http_api.FIGURES:
        results.add("worqr", key, 1000.0)
        if key.startswith(("read", "library")):
            results.add("saq", key, 500.0)
    meta = {
        "versions": {"worqr": "worqr==0.4.0", "saq": "saq==0.26.4"},
        "sizes": http_api.QUICK.__dict__,
        "load_before": [0.5, 0.5, 0.5],
        "load_after": [0.5, 0.5, 0.5],
        "server": "redis-server 7.0.15",
        "date": "2026-11-26",
        "mode": "quick",
        "machine": "2 cores",
        "python": "3.11.7",
    }
    http_api.write(tmp_path, results, meta, ["worqr", "saq"])
    http_api.write(tmp_path, results, meta, ["worqr", "saq"])
    page = (tmp_path / "benchmarks.md").read_text()
    assert "kept" in page and page.count(http_api.START) == 1
    assert "| GET /api/queues, 16 connections (requests/s) | 1,000 | 500 | 2.00x |" in page
    assert "p50, 1 connection (ms) | 1,000 | 500 | 0.50x |" in page
