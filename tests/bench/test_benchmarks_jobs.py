"""The job benchmarks' harness runs end to end (worqr only, quick sizes, the live
submits smaller still): every delayed job starts once, those submitted while the
worker runs too, every round trip returns its payload, every always-failing job ends
in the failed list after exactly its attempts, and the page gets its Jobs part while
the suite's part stays. No timing is asserted here; docs/benchmarks.md has the
figures of a full run against the peers."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from benchmarks import jobs, suite

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_quick_jobs_run_counts_every_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = dataclasses.replace(jobs.QUICK, live_seconds=0.5, idle=50)
    monkeypatch.setattr(jobs, "QUICK", sizes)
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nthe suite's part\n")
    argv = ["--quick", "--peers", "worqr", "--python", f"worqr={sys.executable}"]
    assert jobs.main([*argv, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "benchmarks-jobs.json").read_text())
    # All started once, results right, attempts exact: no note but a timing one (a
    # fill that a busy machine slowed past the first due time, a live producer it
    # slowed below its rate, a live job started early by a submit's estimate of the
    # server's clock: the report's to say).
    notes = data["notes"].get("worqr", [])
    for note in notes:
        early = note.startswith(("live ", "back to back")) and "before its due time" in note
        assert early or "the fill ended" in note or "the producer reached" in note, notes
    assert set(data["notes"]) <= {"worqr"}
    figures = data["samples"]["worqr"]
    keys = [key for key, _, _ in jobs.figures(sizes)]
    for key in keys:
        assert len(figures[key]) == sizes.repetitions, key
    assert {"live_p99_ms", "idle_p99_ms"} <= set(keys)
    assert all(value > 0 for value in figures["retry_jobs_per_s"])
    assert figures["retry_attempts"] == [jobs.ATTEMPTS * sizes.retry]
    for rate, _ in sizes.rates:
        assert figures[f"late_{rate}_min_ms"][0] >= -1  # never before the due time
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nthe suite's part\n")
    assert text.count(suite.JOBS_BEGIN) == 1 and text.rstrip().endswith(suite.JOBS_END)
    assert "| Lateness p99, 1,000 delayed/s (ms) |" in text
    assert "| Retry, 3 attempts, to failed (jobs/s) |" in text
    assert "| Lateness p99, live submits, 1,000/s (ms) |" in text
    assert "| Lateness p99, 50 back to back, idle (ms) |" in text

    # Run again from the saved samples: the Jobs part is replaced, not added twice.
    saved = tmp_path / "saved.json"
    saved.write_text((tmp_path / "benchmarks-jobs.json").read_text())
    assert jobs.main(["--render", str(saved), "--out", str(tmp_path)]) == 0
    assert page.read_text() == text


def test_the_suite_keeps_the_jobs_part() -> None:
    part = f"{suite.JOBS_BEGIN}\n\n## Jobs\n\nfigures\n{suite.JOBS_END}"
    old = suite.with_jobs_part("# Benchmarks\n\nold figures\n", part)
    assert old == f"# Benchmarks\n\nold figures\n\n{part}\n"
    kept = suite.jobs_part(old)
    assert kept == part
    assert suite.with_jobs_part("# Benchmarks\n\nnew figures\n", kept).count("## Jobs") == 1
    assert suite.jobs_part("# Benchmarks\n") is None
