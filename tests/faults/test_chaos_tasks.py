"""The chaos run of task functions, scaled down (``benchmarks/chaos_tasks.py``):
``worqr worker`` processes serving a registry are SIGKILLed while calls fail, retry and
time out (async and plain ``def``); every call ends as its plan says, none is lost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.chaos_tasks import main


@pytest.mark.slow
@pytest.mark.timeout(400)  # a failing run waits for each call's result before it reports
def test_quick_chaos_run_of_task_functions_loses_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos_tasks", "--quick"],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = done.stdout.splitlines()[0]
    assert "wrong 0, lost 0" in line and " 0 SIGKILLs" not in line, line


@pytest.mark.timeout(200)
def test_without_kills_no_attempt_runs_twice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--calls", "120", "--workers", "2", "--kill-every", "0"]) == 0
    assert "attempts run twice 0" in capsys.readouterr().out
