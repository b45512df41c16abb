"""Task functions are typed end to end: mypy --strict accepts every right call of
typing_cases.py and refuses each line marked ``# wrong:``, and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("typing_cases.py")


@pytest.mark.timeout(300)  # mypy checks worqr's sources the first time
def test_mypy_accepts_right_calls_and_refuses_wrong_ones(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            str(CASES),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    errors: dict[int, list[str]] = {}
    for line in done.stdout.splitlines():
        found = re.match(r"(?:.*/)?typing_cases\.py:(\d+): error: (.*)", line)
        if found:
            errors.setdefault(int(found[1]), []).append(found[2])
    lines = CASES.read_text().splitlines()
    marked = {n for n, text in enumerate(lines, 1) if re.search(r"\S  # wrong: ", text)}
    assert marked and set(errors) == marked, (done.stdout, done.stderr)
