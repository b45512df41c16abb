"""The chaos harness, scaled down, in each of its modes: a calm phase, then real worker
processes SIGKILLed, stalled and cut off, the server restarted. Only counts are
asserted, never a duration: a busy machine may be slow, not wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("flags", "min_kills"),
    [((), 10), (("--proxy",), 5), (("--high-concurrency",), 5)],
    ids=["default", "proxy", "high-concurrency"],
)
def test_quick_chaos_run_loses_nothing_and_leaves_nothing(
    flags: tuple[str, ...], min_kills: int
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--quick", "--json", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    mode = flags[0].removeprefix("--") if flags else "default"
    assert lines[0].startswith(f"Chaos run, {mode}")
    assert report["calm tasks"] > 0
    assert report["calm lost"] == 0
    assert report["calm duplicates"] == 0
    assert report["fault lost"] == 0
    assert report["orphaned keys"] == 0
    assert report["check() findings after shutdown"] == 0
    assert report["workers listed after shutdown"] == 0
    assert report["SIGKILLs"] >= min_kills
    assert report["CLIENT KILLs"] == 5
    assert report["SIGSTOPs"] == 1
    assert report["server restarts"] == 1
    if "--high-concurrency" in flags:  # one worker took a burst of tasks at once
        assert report["most processes one worker held"] >= 1000
