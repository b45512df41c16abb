"""The flow-control benchmark (benchmarks/flow.py) in its quick form: it runs, and what
it measures holds (the rate limit in the dequeues' own record, every level served)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import flow


def test_windows_are_counted_half_open() -> None:
    assert flow._most_in_window([0, 500, 999, 1000, 1500], 1000) == 3
    assert flow._most_in_window([], 1000) == 0


@pytest.mark.slow
def test_the_quick_run_writes_its_part_and_the_limit_holds(tmp_path: Path) -> None:
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\nkept\n")
    assert flow.main(["--quick", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "benchmarks.md").read_text()
    assert "kept" in page and flow.START in page and flow.END in page
    results = json.loads((tmp_path / "benchmarks-flow.json").read_text())
    rate = results["rate"]
    assert 0 < rate["max_in_window"] <= rate["limit"]  # the guarantee, as recorded
    weighted, strict = results["fairness"]
    assert weighted["high"]["share"] > weighted["normal"]["share"] > weighted["low"]["share"] > 0
    assert strict["high"]["share"] == 1.0
    for run in (weighted, strict):
        assert all(run[level]["fifo"] for level in ("high", "normal", "low"))
    flow.main(["--quick", "--out", str(tmp_path)])  # a second run replaces its part
    assert (tmp_path / "benchmarks.md").read_text().count(flow.START) == 1
