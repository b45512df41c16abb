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


def test_a_missed_target_says_by_how_much_and_why() -> None:
    """The suite's report of its targets: a target met says so; one missed says by how
    much and where its reason is written (the jobs ratio, its own reason)."""
    results = suite.Results()
    for figure, worqr, taskiq in (
        ("drain_cli_50", 22_000.0, 3_000.0),
        ("drain_cli_64", 24_000.0, 6_000.0),
        ("latency_p50_ms", 0.5, 0.7),
        ("latency_p99_ms", 1.3, 1.5),
    ):
        results.add("worqr", figure, worqr)
        results.add("taskiq", figure, taskiq)
    results.add("worqr", "drain_jobs_cli_50", 16_280.0)  # 0.74x
    results.add("worqr", "drain_jobs_cli_64", 24_000.0)  # 1.00x
    results.add("worqr", "enqueue_over_ping", 1.25)
    lines = "\n".join(suite.targets(results, ["worqr", "taskiq"]))
    assert "7.3x the fastest at-least-once peer (taskiq); target 5x: met." in lines
    assert (
        "4.0x the fastest at-least-once peer (taskiq); target 5x: not met, short by 1.00x" in lines
    )
    assert (
        f"0.74x plain tasks; target at least 0.90x: not met, short by 0.16x ({suite.JOBS_WHY})"
        in lines
    )
    assert "1.00x plain tasks; target at least 0.90x: met." in lines
    assert f"(1.10x): not met, 0.15x above ({suite.LIMITS_WHY})." in lines
    assert "29% below the lowest peer (taskiq, 0.70 ms); target at least 20% below: met." in lines
    assert (
        "13% below the lowest peer (taskiq, 1.50 ms); target at least 20% below and under" in lines
    )
    assert f"not met, short by 7% points ({suite.LIMITS_WHY}); 0.10 ms above the ceiling." in lines
