"""worqr.testing as a user meets it: a test file of their own, run by pytest in a
directory of its own, using the plugin's fixtures against a real throwaway server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import worqr.testing
from worqr.testing import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]

USER_TESTS = textwrap.dedent(
    """
    import anyio
    import pytest
    from redis.asyncio import Redis

    from worqr import Process, Worqr
    from worqr.testing import EmbeddedServer


    async def send_mail(process: Process) -> str:
        return "sent to " + process.task


    @pytest.mark.asyncio
    async def test_my_handler_sends_the_mail(worqr: Worqr) -> None:
        job = await worqr.submit("emails", "ada@example.com")
        async with anyio.create_task_group() as tg:
            tg.start_soon(worqr.consume, "emails", send_mail)
            assert await job.result(timeout=10) == "sent to ada@example.com"
            tg.cancel_scope.cancel()


    @pytest.mark.asyncio
    async def test_each_test_has_its_own_prefix(worqr: Worqr, worqr_prefix: str) -> None:
        assert worqr.prefix == worqr_prefix
        assert await worqr.get_queues() == []  # nothing of the other test is seen
        await worqr.enqueue("left-behind", "x")  # deleted after the test


    def test_the_server_is_real(worqr_server: EmbeddedServer, worqr_url: str) -> None:
        assert worqr_server.pid is not None and worqr_url == worqr_server.url


    @pytest.mark.asyncio
    async def test_no_key_of_an_earlier_test_is_left(worqr_url: str) -> None:
        async with Redis.from_url(worqr_url) as client:
            assert [key async for key in client.scan_iter(match="t*")] == []
    """
)


def test_a_users_tests_run_on_the_plugins_fixtures(tmp_path: Path) -> None:
    (tmp_path / "test_mail.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "WORQR_TEST_URL")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mail.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout


def test_the_guides_test_runs_as_the_guide_gives_it(tmp_path: Path) -> None:
    """The testing guide's test (docs/snippets/test_send_email.py) of the Quickstart's
    handler, with the guide's pytest setting, passes without a warning."""
    guide = (ROOT / "docs" / "guide" / "testing.md").read_text()
    test = (ROOT / "docs" / "snippets" / "test_send_email.py").read_text()
    setting = re.search(r"```toml\n(.*?)```", guide, re.DOTALL)
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    handler = re.search(r"\nasync def send_email.*?\n\n", quickstart, re.DOTALL)
    assert f"```python\n{test}```" in guide
    assert setting and handler
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "tasks.py").write_text(f"from worqr import Process\n{handler[0]}")
    (tmp_path / "test_app.py").write_text(test)
    (tmp_path / "pyproject.toml").write_text(setting[1])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "WORQR_TEST_URL")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout and "warning" not in result.stdout


def test_the_public_names(worqr_server: EmbeddedServer) -> None:
    assert set(worqr.testing.__all__) >= {"EmbeddedServer", "EmbeddedCluster", "EmbeddedSentinel"}
    assert worqr_server.url.startswith("redis://127.0.0.1:")
