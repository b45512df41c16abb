"""The flow-control benchmark (benchmarks/flow.py) in small runs: what it measures
holds (the rate limit in the dequeues' own record, every level served, FIFO within
each), and its part of the page is written and replaced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import flow
from worqr.testing import EmbeddedServer


def test_windows_are_counted_half_open() -> None:
    assert flow._most_in_window([0, 500, 999, 1000, 1500], 1000) == 3
    assert flow._most_in_window([], 1000) == 0


def _level(share: float) -> dict[str, Any]:
    return {"share": share, "gap_p99_ms": 1.0, "fifo": True}


def test_the_part_is_written_and_replaced(tmp_path: Path) -> None:
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\nkept\n")
    results = {
        "when": "2026-11-26",
        "machine": "2 cores",
        "fairness": [
            {"policy": p, "high": _level(0.76), "normal": _level(0.19), "low": _level(0.05)}
            for p in ("weighted", "strict")
        ],
        "rate": {
            "limit": 200,
            "per": 1.0,
            "seconds": 10.0,
            "starts": 2200,
            "max_in_window": 200,
            "max_in_window_handlers": 210,
            "utilisation": 1.0,
            "commands_per_start": 3.5,
        },
        "ticks": {
            "every": 0.2,
            "ticks": 150,
            "duplicates": 0,
            "p50_ms": 2,
            "p99_ms": 5,
            "max_ms": 6,
        },
    }
    flow.write(tmp_path, results)
    flow.write(tmp_path, results)
    page = (tmp_path / "benchmarks.md").read_text()
    assert "kept" in page and page.count(flow.START) == 1 and "the limit holds" in page


@pytest.mark.slow
def test_small_runs_serve_every_level_and_keep_the_limit() -> None:
    with EmbeddedServer() as server:
        weighted = flow.fairness(server.url, "weighted", 400)
        rate = flow.rate_limit(server.url, 1.5)
    assert weighted["high"]["share"] > weighted["normal"]["share"] > weighted["low"]["share"] > 0
    assert all(weighted[level]["fifo"] for level in ("high", "normal", "low"))
    assert 0 < rate["max_in_window"] <= rate["limit"]  # the guarantee, as recorded
