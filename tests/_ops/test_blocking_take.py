"""An idle consumer's blocking take (docs/diagrams/blocking-take.md): a pushed task
reaches its handler through the block, without a dequeue; the take's id is recorded
before the block can move anything, so a reclaim returns what it moved; a peer
failing a worker as dead stands back while that worker's take refreshes its
heartbeat; a paused queue and a stop end the take, and a push at another level runs
beside it, without losing or doubling a task; strict priority and FIFO hold whatever
the block moves; through a slow link every task runs once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from worqr import Process, Worqr, _ops
from worqr._layout.keys import Keys
from worqr._layout.names import new_process_id
from worqr._redis import wire as _wire
from worqr.testing import EmbeddedServer

from ..helpers import FAST, STEADY, Factory, eventually, raw_keys, reap
from ..proxy import LatencyProxy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def _armed(raw: Redis, prefix: str, queue: str = "q") -> bool:
    """Whether some worker of ``queue`` has a blocking take registered."""
    return any(":blocking:" in key for key in await raw_keys(raw, f"{prefix}:q:{{{queue}}}"))


def counting(ran: Counter[str]) -> Callable[[Process], Awaitable[None]]:
    """A handler that counts the runs of each task in ``ran``."""

    async def handler(process: Process) -> None:
        ran[process.task] += 1

    return handler


async def _calls(raw: Redis, command: str) -> int:
    stats = await raw.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_an_idle_consumer_gets_a_pushed_task_without_a_dequeue(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    ran: list[str] = []
    worker, producer = real_make(), real_make()

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("q", handler, concurrency=4))
        await eventually(lambda: _armed(real_client, prefix))
        moves, blocks = await _calls(real_client, "lmove"), await _calls(real_client, "blmove")
        for i in range(5):
            await producer.enqueue("q", f"t{i}")
            await eventually(lambda: len(ran) == i + 1)  # noqa: B023 - awaited here
        assert ran == [f"t{i}" for i in range(5)]
        assert await _calls(real_client, "blmove") >= blocks + 5
        assert await _calls(real_client, "lmove") == moves  # no dequeue transaction ran
        tg.cancel_scope.cancel()
    await eventually(lambda: _no_process_left(real_client, prefix))


async def _no_process_left(raw: Redis, prefix: str) -> bool:
    state = await raw_keys(raw, prefix)
    return not [key for key in state if ":p:" in key or ":held:" in key or ":blocking:" in key]


async def test_an_idle_worker_passes_the_check(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    worker = real_make()

    async def handler(process: Process) -> None:
        pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("q", handler))
        await eventually(lambda: _armed(real_client, prefix))
        await anyio.sleep(0.6)  # blocks time out and are armed again meanwhile
        report = await worker.check()
        assert report.problems == ()
        assert await worker.get_processes() == []
        tg.cancel_scope.cancel()


async def test_a_paused_queue_hands_out_nothing_through_an_armed_take(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    ran: Counter[str] = Counter()
    worker, producer = real_make(), real_make()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("q", counting(ran)))
        await eventually(lambda: _armed(real_client, prefix))
        await producer.pause_queue("q")
        await producer.enqueue("q", "held back")
        await anyio.sleep(0.3)
        assert ran == Counter()
        assert await producer.get_tasks("q") == ["held back"]  # back at the front
        await producer.resume_queue("q")
        await eventually(lambda: ran == Counter({"held back": 1}))
        tg.cancel_scope.cancel()


async def test_a_push_at_another_level_runs_beside_the_take(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    ran: list[str] = []
    worker, producer = real_make(), real_make()

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("q", handler, concurrency=1))
        await eventually(lambda: _armed(real_client, prefix))
        await producer.enqueue("q", "urgent", priority="high")
        await producer.enqueue("q", "later", priority="low")
        await producer.enqueue("q", "plain")
        await eventually(lambda: sorted(ran) == ["later", "plain", "urgent"])
        tg.cancel_scope.cancel()
    await eventually(lambda: _no_process_left(real_client, prefix))


async def test_a_reclaim_returns_what_a_dead_workers_block_moved(
    real_client: Redis, prefix: str, real_make: Factory
) -> None:
    keys = Keys(prefix)
    pid = new_process_id("gone", "q").id
    await real_client.sadd(keys.blocking("q", "gone"), pid)  # its block moved T1, then
    await real_client.rpush(keys.process("q", pid), "T1")  # it died before the SMOVE
    await real_client.sadd(keys.holders("q"), "gone")
    await real_client.sadd(keys.worker_queues("gone"), "q")
    await real_client.sadd(keys.workers, "gone")
    peer = real_make()
    assert await peer.cleanup_workers() == ["gone"]
    assert await peer.get_tasks("q") == ["T1"]
    assert await real_client.exists(keys.blocking("q", "gone")) == 0


async def test_a_peer_stands_back_while_a_take_refreshes_the_heartbeat(
    redis_url: str, real_client: Redis, prefix: str, real_make: Factory
) -> None:
    """The race forced by hand: the worker is taken for dead (no heartbeat), then its
    take registers an id and refreshes the heartbeat before the reclaim runs: the
    reclaim must leave it; once the heartbeat expired, a task the block moved comes
    back."""
    keys = Keys(prefix)
    client = Redis.from_url(redis_url, decode_responses=True)
    connection = await client.connection_pool.get_connection()
    await real_client.sadd(keys.worker_queues("w9"), "q")  # it works on q
    try:
        pid = new_process_id("w9", "q").id
        armed = await _ops.block.arm(
            connection,
            keys,
            "w9",
            "q",
            pid,
            timeout_ms=400,
            seconds=0.2,
            limit=5,
        )
        assert armed.lapsed and armed.corrupt is None  # it had no heartbeat before
        assert await _ops.workers.fail_worker(real_client, keys, "w9", only_if_dead=True) is None
        assert await real_client.sismember(keys.blocking("q", "w9"), pid)
        await real_client.rpush(keys.tasks("q"), "T1")  # the block moves it
        done = await _ops.block.outcome(connection, keys, "w9", "q", 0.2)
        assert done.task == "T1" and not done.leveled
        await eventually(lambda: _expired(real_client, keys.heartbeat("w9")))
        failed = await _ops.workers.fail_worker(real_client, keys, "w9", only_if_dead=True)
        assert failed is not None and failed.reclaimed["q"].returned == ["T1"]
        assert await real_client.lrange(keys.tasks("q"), 0, -1) == ["T1"]
    finally:
        await client.connection_pool.release(connection)
        await client.aclose()


async def test_concurrency_holds_with_a_blocking_take_and_a_dequeue_at_once(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    running, peak = 0, 0
    ran: Counter[str] = Counter()
    worker, producer = real_make(), real_make()

    async def handler(process: Process) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        ran[process.task] += 1
        await anyio.sleep(random.uniform(0.02, 0.1))
        running -= 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("q", handler, concurrency=2))
        await eventually(lambda: _armed(real_client, prefix))
        names = []
        for i in range(60):  # single pushes and small batches, some while handlers run
            batch = [f"t{i}-{j}" for j in range(random.choice([1, 1, 2, 3]))]
            names += batch
            await producer.enqueue("q", batch)
            await anyio.sleep(random.uniform(0.0, 0.06))
        await eventually(lambda: ran == Counter(names), within=20)
        tg.cancel_scope.cancel()
    assert peak <= 2


async def test_a_task_arriving_as_the_take_is_stopped_still_runs(
    proxy: LatencyProxy, prefix: str, real_client: Redis, redis_url: str
) -> None:
    """A timed job reaches the take; the deadline it then records takes a slow round
    trip, during which a push at another level stops the take: the job must run."""
    proxy.delay = 0.1
    ran: Counter[str] = Counter()

    async with (
        Worqr.from_url(proxy.url, prefix=prefix, **STEADY) as worker,
        Worqr.from_url(redis_url, prefix=prefix, **STEADY) as producer,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: worker.consume("q", counting(ran), concurrency=2))
        await eventually(lambda: _armed(real_client, prefix), within=10)
        job = await producer.submit("q", "timed", timeout=30)
        await anyio.sleep(0.15)  # its block's reply is back; its deadline on the way
        await producer.enqueue("q", "urgent", priority="high")
        assert await job.result(timeout=10) is None
        await eventually(lambda: ran["urgent"] == 1, within=10)
        assert ran["timed"] == 1
        tg.cancel_scope.cancel()


async def test_a_live_worker_failed_by_hand_loses_no_task_its_block_moves(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    ran: Counter[str] = Counter()
    worker, operator = real_make(), real_make()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: worker.consume("q", counting(ran)))
        await eventually(lambda: _armed(real_client, prefix))
        await operator.fail_worker(worker.worker_id)  # its block is still on the server
        await operator.enqueue("q", "T1")
        await eventually(lambda: ran["T1"] >= 1, within=15)
        await eventually(lambda: _no_list_left(real_client, prefix), within=15)
        assert await operator.get_tasks("q") == []
        tg.cancel_scope.cancel()


async def _no_list_left(raw: Redis, prefix: str) -> bool:
    return not [key for key in await raw_keys(raw, prefix) if ":p:" in key]


async def _expired(raw: Redis, key: str) -> bool:
    return not await raw.exists(key)


async def test_every_task_runs_once_through_a_slow_link(
    proxy: LatencyProxy, prefix: str, real_client: Redis
) -> None:
    proxy.delay, proxy.jitter = 0.002, 0.001
    ran: Counter[str] = Counter()

    async with (
        Worqr.from_url(proxy.url, prefix=prefix, **STEADY) as worker,
        Worqr.from_url(proxy.url, prefix=prefix, **STEADY) as other,
        Worqr.from_url(proxy.url, prefix=prefix, **STEADY) as producer,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: worker.consume("q", counting(ran), concurrency=2))
        tg.start_soon(lambda: other.consume("q", counting(ran), concurrency=2))
        await eventually(lambda: _armed(real_client, prefix))
        for i in range(40):
            await producer.enqueue("q", f"t{i}")
            if i % 10 == 9:
                await producer.enqueue("q", [f"b{i}-{j}" for j in range(5)])
            await anyio.sleep(0.003)
        expected = Counter({f"t{i}": 1 for i in range(40)})
        expected.update({f"b{i}-{j}": 1 for i in range(9, 40, 10) for j in range(5)})
        await eventually(lambda: ran == expected, within=20)
        tg.cancel_scope.cancel()
    await eventually(lambda: _no_process_left(real_client, prefix))


@pytest.mark.parametrize("slow", [False, True], ids=["loopback", "slow-link"])
async def test_a_task_enqueued_after_its_cancel_runs_through_a_waiting_take(
    slow: bool, proxy: LatencyProxy, redis_url: str, prefix: str, real_client: Redis
) -> None:
    """A ``cancel`` that came while the take still waited predates the push that fed
    it: a task enqueued again after `cancel_tasks` returned runs (once), it is not
    finished as cancelled."""
    if slow:
        proxy.delay, proxy.jitter = 0.002, 0.001
    url = proxy.url if slow else redis_url
    ran: Counter[str] = Counter()
    async with (
        Worqr.from_url(url, prefix=prefix, **STEADY) as consumer,
        Worqr.from_url(url, prefix=prefix, **STEADY) as producer,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: consumer.consume("q", counting(ran), concurrency=2))
        for round_ in range(3):
            await eventually(lambda: _armed(real_client, prefix))
            task = f"t{round_}"
            assert await producer.cancel_tasks("q", task) == 0  # not queued, not running
            await anyio.sleep(0.05)  # the cancel reaches the waiting take first
            await producer.enqueue("q", task)
            await eventually(lambda: ran[task] == 1)  # noqa: B023 - awaited here
        await anyio.sleep(0.2)
        assert ran == Counter({"t0": 1, "t1": 1, "t2": 1})
        tg.cancel_scope.cancel()
    await eventually(lambda: _no_process_left(real_client, prefix))


def _worker(server: EmbeddedServer, prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.worker_process", server.url, prefix, "q"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
async def test_a_killed_blocked_worker_takes_nothing(server: EmbeddedServer, raw: Redis) -> None:
    prefix = "killed-block"
    child = _worker(server, prefix)
    try:
        await eventually(lambda: _armed(raw, prefix), within=20)
        child.kill()
        child.wait(5)
        async with Worqr.from_url(server.url, prefix=prefix, **FAST) as peer:
            await peer.enqueue("q", "T1")
            ran: list[str] = []

            async def handler(process: Process) -> None:
                ran.append(process.task)

            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: peer.consume("q", handler))
                await eventually(lambda: ran == ["T1"], within=10)
                tg.cancel_scope.cancel()
    finally:
        reap(child)


async def _blocked_in_blmove(raw: Redis) -> bool:
    """Whether some client of the server waits in BLMOVE now."""
    clients = await raw.client_list()
    return any("b" in c.get("flags", "") and c.get("cmd") == "blmove" for c in clients)


@pytest.mark.slow
async def test_a_frozen_workers_moved_task_is_reclaimed_and_runs_once(
    server: EmbeddedServer, raw: Redis
) -> None:
    prefix = "frozen-block"
    keys = Keys(prefix)
    child = _worker(server, prefix)
    ran: list[str] = []
    try:
        await eventually(lambda: _armed(raw, prefix), within=20)
        for attempt in range(20):  # freeze it while its block waits, then push T1
            os.kill(child.pid, signal.SIGSTOP)
            if await _blocked_in_blmove(raw):
                await raw.rpush(keys.tasks("q"), f"T{attempt}")
                await anyio.sleep(0.05)
                if not await raw.llen(keys.tasks("q")):
                    break  # the frozen worker's block moved it
                await raw.delete(keys.tasks("q"))  # its block had just timed out
            os.kill(child.pid, signal.SIGCONT)
            await anyio.sleep(0.1)
        else:
            pytest.fail("never froze the worker while its block waited")
        task = f"T{attempt}"
        held = [key for key in await raw_keys(raw, prefix) if ":p:" in key]
        assert len(held) == 1 and await raw.lrange(held[0], 0, -1) == [task]
        async with Worqr.from_url(server.url, prefix=prefix, **FAST) as peer:

            async def handler(process: Process) -> None:
                ran.append(process.task)

            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: peer.consume("q", handler))
                await eventually(lambda: ran == [task], within=15)  # reclaimed, run
                os.kill(child.pid, signal.SIGCONT)  # back: it must not run it too
                await anyio.sleep(1.5)
                tg.cancel_scope.cancel()
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(5)
        assert child.stdout is not None
        lines = child.stdout.read()
        reap(child)
    assert f"started {task}" not in lines
    assert ran == [task]


@pytest.mark.parametrize("slow", [False, True], ids=["loopback", "slow-link"])
async def test_strict_order_holds_whatever_the_take_moves(
    slow: bool, proxy: LatencyProxy, redis_url: str, prefix: str, real_client: Redis
) -> None:
    """An idle strict consumer waits in a blocking take on the normal level; a high
    task is pushed, then normal ones. The high one runs first, the normal ones in
    their order, and none is left behind while later ones run (a task the block moved
    as the take was ending would otherwise wait for the take's withdrawal)."""
    if slow:
        proxy.delay, proxy.jitter = 0.002, 0.001
    url = proxy.url if slow else redis_url
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with (
        Worqr.from_url(url, prefix=prefix, **STEADY) as consumer,
        Worqr.from_url(url, prefix=prefix, **STEADY) as producer,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(lambda: consumer.consume("q", handler, concurrency=1, priority="strict"))
        for round_ in range(40):
            await eventually(lambda: _armed(real_client, prefix))
            expected = [f"h{round_}", *(f"n{round_}-{i}" for i in range(3))]
            await producer.enqueue("q", expected[0], priority="high")
            for task in expected[1:]:
                await producer.enqueue("q", task)
            await eventually(lambda: len(ran) >= 4 * (round_ + 1), within=20)  # noqa: B023
            assert ran[-4:] == expected, f"round {round_}"
        tg.cancel_scope.cancel()
    await eventually(lambda: _no_process_left(real_client, prefix))


async def test_a_task_moved_by_a_block_whose_arm_reply_was_lost_runs_at_once(
    real_make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arm's transaction and block ran on the server and moved a task at once,
    then the connection failed before its replies were read (a kill, a lost reply):
    the outcome is unknown to the worker, but the task moved goes back and runs
    before a task pushed later, not a minute later (the late withdrawal stays for a
    block still alive on the server)."""
    worker, producer = real_make(), real_make()
    replies = _wire.replies
    lost: list[object] = []
    armed, both = anyio.Event(), anyio.Event()

    async def losing(
        connection: AbstractConnection, count: int, limit: float | None
    ) -> list[object]:
        if count == 5 and not lost:  # the arm's replies
            lost.append(await replies(connection, count, limit))
            await producer.enqueue("q", "first")  # the block moves it at once
            await anyio.sleep(0.1)
            await connection.disconnect(nowait=True)
            armed.set()
            raise RedisConnectionError("connection lost before the replies were read")
        return await replies(connection, count, limit)

    monkeypatch.setattr(_ops.block, "replies", losing)
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)
        if len(ran) == 2:
            both.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "q", handler)
        with anyio.fail_after(10):
            await armed.wait()
            await anyio.sleep(0.3)
            await producer.enqueue("q", "second")
            await both.wait()
        tg.cancel_scope.cancel()
    assert ran == ["first", "second"]
