"""The chaos harness, scaled down: real worker processes SIGKILLed, stalled and cut off,
the server restarted; the run fails on any lost task or orphaned key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_chaos_run_loses_nothing_and_leaves_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["lost"] == 0
    assert report["orphaned keys"] == 0
    assert report["check() findings after shutdown"] == 0
    assert report["workers listed after shutdown"] == 0
    assert report["SIGKILLs"] >= 10
    assert report["server restarts"] == 1
