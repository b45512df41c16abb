"""The schedule and flow-control verbs of the ``worqr`` command (``schedule``,
``schedules``, ``unschedule``, ``pause``, ``resume``, ``rate-limit``, and what
``stats`` shows of them), through the installed console script against a real server."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from worqr import RateLimit, Worqr

from .test_cli import worqr_cli


@pytest.fixture
async def peer(real_client: Redis, prefix: str) -> AsyncIterator[Worqr]:
    async with Worqr(real_client, prefix=prefix) as worqr:
        yield worqr


def cli(url: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return worqr_cli("--prefix", prefix, *args, url=url)


async def test_schedule_list_and_unschedule(redis_url: str, prefix: str, peer: Worqr) -> None:
    done = cli(redis_url, prefix, "schedule", "nightly", "q", "report", "--cron", "0 3 * * *")
    assert done.returncode == 0, done.stderr
    assert "scheduled 'nightly'" in done.stdout
    done = cli(
        redis_url,
        prefix,
        "schedule",
        "often",
        "q",
        "ping",
        "--every",
        "30",
        "--no-overlap",
        "--misfire",
        "all",
    )
    assert done.returncode == 0, done.stderr
    (nightly, often) = await peer.get_schedules()
    assert (nightly.cron, often.every, often.overlap, often.misfire) == (
        "0 3 * * *",
        30.0,
        False,
        "all",
    )
    listed = cli(redis_url, prefix, "schedules", "--json")
    rows = json.loads(listed.stdout)
    assert [row["name"] for row in rows] == ["nightly", "often"]
    assert rows[0]["next_tick"] is not None
    text = cli(redis_url, prefix, "schedules").stdout
    assert "nightly" in text and "every 30s" in text
    assert cli(redis_url, prefix, "unschedule", "nightly").returncode == 0
    gone = cli(redis_url, prefix, "unschedule", "nightly")
    assert gone.returncode == 1 and "unknown schedule" in gone.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["schedule", "s", "q", "p"],
        ["schedule", "s", "q", "p", "--cron", "* * * * *", "--every", "1"],
        ["schedule", "s", "q", "p", "--cron", "nonsense"],
        ["schedule", "s", "q", "p", "--every", "-1"],
        ["schedule", "s@x", "q", "p", "--every", "1"],
    ],
)
async def test_bad_schedules_fail_and_store_nothing(
    redis_url: str, prefix: str, peer: Worqr, args: list[str]
) -> None:
    done = cli(redis_url, prefix, *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip()
    assert await peer.get_schedules() == []


async def test_pause_resume_and_rate_limit(redis_url: str, prefix: str, peer: Worqr) -> None:
    await peer.enqueue("q", ["a", "b"])
    await peer.submit("q", "later", delay=60)
    assert cli(redis_url, prefix, "pause", "q").returncode == 0
    assert await peer.is_paused("q")
    assert cli(redis_url, prefix, "rate-limit", "q", "10", "2.5").returncode == 0
    assert await peer.get_rate_limit("q") == RateLimit(10, 2.5)
    stats = json.loads(cli(redis_url, prefix, "stats", "--json").stdout)
    assert stats["paused"] == 1 and stats["delayed"] == 1
    (row,) = stats["per_queue"]
    assert row["paused"] is True and row["delayed"] == 1
    assert row["rate_limit"] == {"limit": 10, "per": 2.5}
    text = cli(redis_url, prefix, "stats").stdout
    assert "10/2.5s" in text and "PAUSED" in text
    assert cli(redis_url, prefix, "resume", "q").returncode == 0
    assert not await peer.is_paused("q")
    assert cli(redis_url, prefix, "rate-limit", "q", "none").returncode == 0
    assert await peer.get_rate_limit("q") is None
    for bad, says in (
        (["rate-limit", "q", "0", "1"], "LIMIT must be at least 1"),
        (["rate-limit", "q", "5"], "give LIMIT PER"),
        (["rate-limit", "q", "5", "x"], "PER must be a number of seconds"),
        (["rate-limit", "q", "none", "5"], "none alone"),
    ):
        done = cli(redis_url, prefix, *bad)
        assert done.returncode == 2 and says in done.stderr, (bad, done.stderr)
    assert await peer.get_rate_limit("q") is None


async def test_priority_options_and_levels_in_stats(
    redis_url: str, prefix: str, peer: Worqr
) -> None:
    assert cli(redis_url, prefix, "enqueue", "q", "a", "b", "--priority", "high").returncode == 0
    assert cli(redis_url, prefix, "submit", "q", "job", "--priority", "low").returncode == 0
    assert cli(redis_url, prefix, "enqueue", "q", "n").returncode == 0
    bad = cli(redis_url, prefix, "enqueue", "q", "x", "--priority", "urgent")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    stats = json.loads(cli(redis_url, prefix, "stats", "--json").stdout)
    assert stats["per_queue"][0]["levels"] == {"high": 2, "normal": 1, "low": 1}
    assert "2/1/1" in cli(redis_url, prefix, "stats").stdout
    assert (await peer.get_tasks("q"))[:3] == ["a", "b", "n"]
