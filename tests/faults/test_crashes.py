"""Real faults: a worker process SIGKILLed mid-task, connections killed, the server
restarted. Only a real server will do here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr
from worqr.testing import EmbeddedServer

from ..helpers import FAST, eventually, raw_keys, reap, works_on

ROOT = Path(__file__).resolve().parents[2]


async def _no_process_state(raw: Redis, prefix: str) -> bool:
    state = await raw_keys(raw, prefix)
    return not [key for key in state if ":p:" in key or ":held:" in key]


async def test_sigkilled_worker_task_returns_to_front_and_a_peer_does_it(
    server: EmbeddedServer, raw: Redis
) -> None:
    prefix = "crash"
    child = subprocess.Popen(  # noqa: ASYNC220 - starting it does not block
        [sys.executable, "-m", "tests.worker_process", server.url, prefix, "jobs"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        async with Worqr.from_url(server.url, prefix=prefix, **FAST) as peer:
            await peer.enqueue("jobs", ["victim", "b", "c"])
            assert child.stdout is not None
            line = await anyio.to_thread.run_sync(child.stdout.readline)
            assert line.strip() == "started victim"
            assert await peer.get_tasks("jobs") == ["b", "c"]
            child.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            child.wait(5)
            await peer.start_worker()  # supervises: reclaims the dead worker's task
            await eventually(lambda: _tasks_are(peer, ["victim", "b", "c"]))
            assert time.monotonic() - killed_at < 5
            done: list[str] = []

            async def handler(process: Process) -> None:
                done.append(process.task)

            async with anyio.create_task_group() as tg:
                tg.start_soon(peer.consume, "jobs", handler)
                await eventually(lambda: len(done) == 3)
                tg.cancel_scope.cancel()
            assert done == ["victim", "b", "c"]
            assert await peer.get_workers() == [peer.worker_id]
    finally:
        reap(child)
    assert await _no_process_state(raw, prefix)


async def _tasks_are(worqr: Worqr, expected: list[str]) -> bool:
    return await worqr.get_tasks("jobs") == expected


async def _drain_through_faults(
    server: EmbeddedServer, raw: Redis, fault: str, total: int = 60
) -> None:
    prefix = f"fault-{fault}"
    done: dict[str, int] = {}

    async def handler(process: Process) -> str:
        done[process.task] = done.get(process.task, 0) + 1
        await anyio.sleep(0.01)
        return "ok"

    async with (
        Worqr.from_url(server.url, prefix=prefix, **FAST) as worker,
        Worqr.from_url(server.url, prefix=prefix, **FAST) as producer,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: worker.consume("jobs", handler, concurrency=4))
        for round_ in range(3):
            await producer.enqueue("jobs", [f"{round_}-{i}" for i in range(total // 3)])
            reached = round_ * total // 3 + 5
            await eventually(lambda: len(done) >= reached)  # noqa: B023 - awaited here
            if fault == "client-kill":
                await raw.execute_command("CLIENT", "KILL", "TYPE", "normal")
                await raw.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            else:
                await anyio.to_thread.run_sync(server.restart)
        await eventually(lambda: len(done) == total, within=20)
        await eventually(lambda: _no_process_state(raw, prefix), within=10)
        tg.cancel_scope.cancel()
    assert sorted(done) == sorted(f"{r}-{i}" for r in range(3) for i in range(total // 3))
    assert await raw.llen(f"{prefix}:q:{{jobs}}:tasks") == 0
    assert await raw.llen(f"{prefix}:q:{{jobs}}:failed") == 0


async def test_killed_connections_lose_nothing(server: EmbeddedServer, raw: Redis) -> None:
    await _drain_through_faults(server, raw, "client-kill")


async def test_server_restart_loses_nothing(server: EmbeddedServer, raw: Redis) -> None:
    await _drain_through_faults(server, raw, "restart")


async def test_events_resume_after_the_subscriber_connection_is_killed(
    server: EmbeddedServer, raw: Redis
) -> None:
    async with Worqr.from_url(server.url, prefix="resub", **FAST) as watcher:
        seen: list[str] = []
        await watcher.on("jobs", lambda kind, message: seen.append(message))
        await raw.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        with anyio.fail_after(10):
            while not seen:  # re-subscription takes a moment; publish until heard
                await raw.publish("resub:q:{jobs}:events", "work:7")
                await anyio.sleep(0.05)
        assert seen[0] == "7"


async def test_operations_fail_clearly_while_server_is_down(server: EmbeddedServer) -> None:
    from worqr import BackendUnavailableError

    async with Worqr.from_url(server.url, prefix="down", **FAST) as worqr:
        await worqr.enqueue("jobs", "t")
        server.kill()
        with pytest.raises(BackendUnavailableError):
            await worqr.enqueue("jobs", "t2")
        await anyio.to_thread.run_sync(server.start)
        await worqr.enqueue("jobs", "t3")
        assert "t3" in await worqr.get_tasks("jobs")
        assert os.environ.get("REDIS_URL") != server.url


async def test_delete_missed_while_the_subscriber_was_away_still_ends_consume(
    server: EmbeddedServer, raw: Redis
) -> None:
    async with (
        Worqr.from_url(server.url, prefix="missed", **FAST) as worker,
        Worqr.from_url(server.url, prefix="missed", **FAST) as producer,
    ):

        async def handler(process: Process) -> None:
            return None

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(worker.consume, "jobs", handler)
                await eventually(lambda: works_on(producer, ["jobs"], worker.worker_id))
                await raw.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                await producer.delete_queue("jobs")  # published while nobody listens


async def test_close_while_waiting_for_a_subscription_does_not_hang(
    server: EmbeddedServer,
) -> None:
    from worqr import ClosedError

    worqr = Worqr.from_url(server.url, prefix="closing", **FAST)
    await worqr.start_worker()
    server.kill()  # the subscription can never be confirmed
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def start() -> None:
                with pytest.raises(ClosedError):
                    await worqr.start_work("jobs")

            tg.start_soon(start)
            await anyio.sleep(0.2)
            await worqr.close()


async def test_outage_longer_than_the_timeout_loses_the_leases(
    server: EmbeddedServer, raw: Redis
) -> None:
    """Redis away for longer than worker_timeout: the worker fences itself (``lost``,
    handler cancelled), re-registers when Redis is back, and the task runs again."""
    runs: list[str] = []
    lost: list[str] = []

    async def handler(process: Process) -> str:
        runs.append(process.id)
        if len(runs) == 1:
            await anyio.sleep_forever()  # held across the outage
        return "ok"

    async with Worqr.from_url(server.url, prefix="outage", **FAST) as worker:
        worker.on("jobs", lambda kind, message: lost.append(message) if kind == "lost" else None)
        await worker.enqueue("jobs", "t")
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.consume, "jobs", handler)
            await eventually(lambda: len(runs) == 1)
            await anyio.to_thread.run_sync(server.stop)  # AOF is flushed on SIGTERM
            await anyio.sleep(FAST["worker_timeout"] * 2)
            await anyio.to_thread.run_sync(server.start)
            await eventually(lambda: len(runs) == 2, within=15)
            tg.cancel_scope.cancel()
        assert lost == [runs[0]]
        assert worker.worker_id in await worker.get_workers()
    await eventually(lambda: _no_process_state(raw, "outage"))
