"""Every example file runs, and the README shows them verbatim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path, redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(path)],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout


def test_quickstart_output(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert sorted(result.stdout.splitlines()) == [
        "sending ada@example.com",
        "sending alan@example.com",
    ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_readme_shows_example_verbatim(path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{path.read_text()}```" in readme


def test_demo_command_runs(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worqr", "demo"],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 lost" in result.stdout
    assert "returned" in result.stdout


def test_readme_commands_match_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in readme and "python3 dev.py test" in ci
    assert "python3 dev.py demo" in readme
