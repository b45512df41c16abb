"""The Cluster benchmark's harness runs end to end at tiny sizes: every topology and
worker count yields a sample and a table row. No timing is asserted here;
docs/cluster-benchmark.md has the figures of a full run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cluster


@pytest.mark.slow
@pytest.mark.long
def test_tiny_run_writes_every_row(tmp_path: Path) -> None:
    argv = ["--quick", "--tasks", "300", "--queues", "6", "--workers", "1", "--out", str(tmp_path)]
    assert cluster.main(argv) == 0
    data = json.loads((tmp_path / "cluster-benchmark.json").read_text())
    samples = data["samples"]
    assert [(s["topology"], s["workers"]) for s in samples] == [
        (topology.name, 1) for topology in cluster.TOPOLOGIES
    ]
    assert all(s["tasks_per_s"] > 0 and s["redis_cpu_s"] >= 0 for s in samples)
    assert [s["split"] for s in samples] == [[6], [2, 2, 2], [2, 2, 2]]
    assert data["meta"]["machine"]["cpu_count"] and data["meta"]["machine"]["server"]
    page = (tmp_path / "cluster-benchmark.md").read_text()
    for topology in cluster.TOPOLOGIES:
        assert f"| {topology.name} | 1 |" in page
    assert "| one server | 1 | " in page and " | 1.00x | " in page
