"""The benchmark suite's harness runs end to end (worqr only, quick sizes): every
workload produces its figure. No timing is asserted here; docs/benchmarks.md has
the figures of a full run against the peers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from redis import Redis

from benchmarks import suite
from worqr.testing import EmbeddedServer

pytestmark = pytest.mark.slow


@pytest.mark.long
@pytest.mark.timeout(300)
def test_quick_suite_runs_every_worqr_workload(tmp_path: Path) -> None:
    code = suite.main(
        [
            "--quick",
            "--peers",
            "worqr",
            "--python",
            f"worqr={sys.executable}",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    figures = data["samples"]["worqr"]
    for key in (
        "drain_1",
        "drain_2",
        "enqueue_single",
        "enqueue_over_ping",
        "enqueue_concurrent",
        "enqueue_batch",
        "drain_cli_50",
        "drain_cli_64",
        "drain_jobs_cli_50",
        "drain_jobs_cli_64",
        "latency_p50_ms",
        "latency_p99_ms",
        "recovery_s",
        "commands_per_task",
        "bytes_per_task",
        "idle_10_commands_per_s",
        "idle_20_commands_per_s",
    ):
        assert figures[key] and all(value > 0 for value in figures[key]), key
    assert data["notes"] == {}  # every task ran, the killed worker's task came back
    page = (tmp_path / "benchmarks.md").read_text()
    assert "| Drain, 1 process (tasks/s) |" in page
    assert "## Supervision cost of idle workers (worqr)" in page


@pytest.mark.timeout(120)
def test_the_worker_command_drains_plain_tasks_and_job_envelopes() -> None:
    results = suite.Results()
    with EmbeddedServer() as server:
        redis = Redis.from_url(server.url, decode_responses=True)
        adapter = suite.Adapter("worqr", sys.executable, server.url, "bench")
        suite.drain_cli(adapter, redis, 300, 50, results)
        suite.drain_cli(adapter, redis, 300, 50, results, jobs=True)
        assert redis.llen("worqr:q:{bench}:tasks") == 0  # every one was taken
        redis.close()
    assert all(value > 0 for value in results.samples["worqr"]["drain_cli_50"])
    assert all(value > 0 for value in results.samples["worqr"]["drain_jobs_cli_50"])
