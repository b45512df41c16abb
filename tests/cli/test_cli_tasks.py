"""``worqr worker MODULE:TASKS [QUEUE...]``: a registry served from the shell, all its
queues or those given, its hooks around the calls, a line per call, SIGTERM."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis

from worqr import JobStatus, Tasks, Worqr

from ..helpers import eventually
from .test_cli_worker import SCRIPT, cli, command, stop

APP = textwrap.dedent(
    """
    from pathlib import Path

    from worqr import Context, Tasks

    tasks = Tasks()

    @tasks.task(queue="math")
    async def add(a: int, b: int) -> int:
        return a + b

    @tasks.task(queue="text")
    def shout(ctx: Context, word: str) -> str:
        return word.upper() + ctx.state["mark"]

    @tasks.task(queue="slow")
    def hang(seconds: float) -> None:
        import time

        time.sleep(seconds)

    empty = Tasks()

    @tasks.on_startup
    async def begin(ctx: Context) -> None:
        ctx.state["mark"] = "!"
        Path("hooks.log").open("a").write("startup\\n")

    @tasks.on_shutdown
    async def end(ctx: Context) -> None:
        Path("hooks.log").open("a").write("shutdown\\n")
    """
)


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "calls.py").write_text(APP)
    return tmp_path


@pytest.fixture
async def peer(real_client: Redis, prefix: str) -> AsyncIterator[Worqr]:
    async with Worqr(real_client, prefix=prefix) as worqr:
        yield worqr


def producer() -> Tasks:
    """The producer's side of calls.py: the same names and signatures."""
    tasks = Tasks()

    @tasks.task(queue="math", name="calls.add")
    async def add(a: int, b: int) -> int:
        raise NotImplementedError  # runs in the worker

    @tasks.task(queue="text", name="calls.shout")
    async def shout(word: str) -> str:
        raise NotImplementedError

    return tasks


async def test_a_registry_is_served_on_all_its_queues_with_its_hooks(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    calls = producer()
    total = await calls["calls.add"].submit(peer, 2, 3)
    loud = await calls["calls.shout"].submit(peer, "hey")
    log = tmp_path / "worker.log"
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "calls:tasks"]
    async with command([*argv, "--worker-id", "w-tasks"], app, log) as process:
        assert await total.result(timeout=20) == 5
        assert await loud.result(timeout=20) == "HEY!"
        await stop(process)
    text = log.read_text()
    assert "worker w-tasks starts on 'math', 'slow', 'text', 10 task(s) at a time" in text
    assert f'job {total.id} calls.add \'{{"a":2,"b":3}}\': done (' in text
    assert (app / "hooks.log").read_text() == "startup\nshutdown\n"


async def test_only_the_queues_given_are_served(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    calls = producer()
    total = await calls["calls.add"].submit(peer, 1, 1)
    loud = await calls["calls.shout"].submit(peer, "no")
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "calls:tasks"]
    async with command([*argv, "--queue", "math", "-q"], app, tmp_path / "w.log") as process:
        assert await total.result(timeout=20) == 2
        await anyio.sleep(0.3)
        assert await loud.status() is JobStatus.QUEUED
        await stop(process)


async def test_a_handler_still_needs_its_queues(app: Path, redis_url: str, prefix: str) -> None:
    (app / "handlers.py").write_text("async def h(process):\n    return None\n")
    result = await anyio.to_thread.run_sync(
        lambda: cli(app, redis_url, prefix, "worker", "handlers:h")
    )
    assert result.returncode == 2
    assert "give the queues handlers:h works on" in result.stderr


async def test_a_hung_plain_def_does_not_keep_the_worker_after_sigterm(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    """Its call is handed back at once and the worker exits: the thread is a daemon."""
    producer_side = Tasks()

    @producer_side.task(queue="slow", name="calls.hang")
    def hang(seconds: float) -> None:
        raise NotImplementedError

    job = await hang.submit(peer, 3600.0)
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "calls:tasks"]
    async with command(
        [*argv, "--queue", "slow", "--grace", "0.2"], app, tmp_path / "w.log"
    ) as process:

        async def running() -> bool:
            return bool(await peer.get_processes("slow"))

        await eventually(running, within=20)
        await stop(process)  # it exits: not after the hour the thread sleeps
    assert await peer.get_tasks("slow") != [] and await job.status() is JobStatus.QUEUED


async def test_queues_may_follow_options_and_an_empty_registry_is_refused(
    app: Path, redis_url: str, prefix: str, peer: Worqr, tmp_path: Path
) -> None:
    (app / "handlers.py").write_text("async def h(process):\n    return 'ok'\n")
    await peer.enqueue("q1", "t")
    argv = [str(SCRIPT), "--url", redis_url, "--prefix", prefix, "worker", "handlers:h"]
    async with command(
        [*argv, "--concurrency", "4", "q1", "-q"], app, tmp_path / "w.log"
    ) as process:
        await eventually(lambda: _empty(peer, "q1"), within=20)
        await stop(process)
    result = await anyio.to_thread.run_sync(
        lambda: cli(app, redis_url, prefix, "worker", "calls:empty")
    )
    assert result.returncode == 2 and "calls:empty has no task function" in result.stderr


async def _empty(peer: Worqr, queue: str) -> bool:
    return await peer.count_queue(queue) == 0 and not await peer.get_processes(queue)
