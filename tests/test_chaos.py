"""The chaos harness, scaled down, in each of its modes: a calm phase, then real worker
processes SIGKILLed, stalled and cut off, the server restarted; and, in the default
mode, the hostile-data phase (another client writing garbage under the prefix while
workers are SIGKILLed) and the frozen-node phase (the server and a worker SIGSTOPped
mid-drain). Only counts are asserted, never a duration: a busy machine may be slow,
not wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def chaos(*flags: str, timeout: float) -> tuple[list[str], dict[str, Any]]:
    """Run the harness at its quick size; its table's lines and its report."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos", "--quick", "--json", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


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
    lines, report = chaos("--phases", "calm,fault", *flags, timeout=280)
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


@pytest.mark.slow
@pytest.mark.timeout(500)  # a failing run waits out its settle limits before it reports
def test_quick_frozen_and_hostile_phases_lose_nothing() -> None:
    """Freezes, then garbage under the prefix: no task lost, none finished twice, every
    garbage task in the failed list with a reason and never given to a handler, every
    SIGKILLed worker reclaimed, check() not thrown by the garbage."""
    lines, report = chaos("--phases", "frozen,hostile", timeout=480)
    assert lines[0].startswith("Chaos run, default")
    assert report["frozen lost"] == 0
    assert report["server freezes"] == 3
    assert report["worker SIGSTOPs"] == 1
    assert report["tasks finished twice"] == 0
    assert report["hostile lost"] == 0
    assert report["hostile SIGKILLs"] >= 5
    assert report["SIGKILLed workers holding tasks"] >= 3
    assert report["their tasks back in time"] == report["SIGKILLed workers holding tasks"]
    pushed = report["garbage tasks pushed"]
    assert pushed >= 10
    assert report["garbage tasks in the failed list with a reason"] == pushed
    assert report["garbage tasks a handler was given"] == 0
    assert report["malformed messages published"] > 0
    assert report["check() on the garbage"] == "ok"
    assert report["orphaned keys"] == 0
    assert report["check() findings after shutdown"] == 0
    assert report["workers listed after shutdown"] == 0
