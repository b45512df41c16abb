"""Every example file runs, and the README shows them verbatim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

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


@pytest.mark.parametrize("how", ["REDIS_URL", "--url"])
def test_demo_command_runs_and_leaves_no_key_behind(redis_url: str, how: str) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    argv = [sys.executable, "-m", "worqr", "demo"]
    if how == "--url":
        argv += ["--url", redis_url]
    else:
        environment["REDIS_URL"] = redis_url
    result = subprocess.run(
        argv, env=environment, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 lost" in result.stdout
    assert "returned" in result.stdout
    assert f"on {redis_url}" in result.stdout
    with redis.Redis.from_url(redis_url) as client:
        assert list(client.scan_iter(match="worqr-demo-*")) == []


def test_readme_commands_match_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in readme and "python3 dev.py test" in ci
    assert "python3 dev.py demo" in readme
