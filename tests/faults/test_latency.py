"""The behavioural core through a link with latency: every peer reaches the real server
through the proxy, 1 ms and 5 ms each way (plus jitter), with handlers shorter and
longer than ``worker_timeout``. No fault is injected, so each task runs exactly once."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from worqr import DuplicateTaskError, JobFailedError, Process, Worqr
from worqr._worqr import runtime

from ..helpers import FAST, RELAXED, eventually, raw_keys
from ..proxy import LatencyProxy

SHORT = 0.005
LONG = FAST["worker_timeout"] * 1.5  # spans several audits and heartbeats


@pytest.fixture(params=[0.001, 0.005], ids=["1ms", "5ms"])
async def slow(request: pytest.FixtureRequest, proxy: LatencyProxy) -> LatencyProxy:
    proxy.delay = request.param
    proxy.jitter = request.param / 2
    return proxy


@pytest.fixture
async def peers(slow: LatencyProxy, prefix: str) -> AsyncIterator[Callable[..., Worqr]]:
    """Peers whose every connection goes through the slow link, on leases a busy
    machine cannot expire (``peers(**FAST)`` for one that is to die and be reclaimed)."""
    made: list[Worqr] = []

    def make(**options: Any) -> Worqr:
        worqr = Worqr.from_url(slow.url, prefix=prefix, **{**RELAXED, **options})
        made.append(worqr)
        return worqr

    yield make
    for worqr in made:
        await worqr.close()


class Ledger:
    """Handler outcomes by task, and the ``lost`` events heard."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.lost: list[str] = []

    def handler(
        self, seconds: float, fail: Callable[[str], bool] = lambda _: False
    ) -> Callable[[Process], Awaitable[str]]:
        async def run(process: Process) -> str:
            self.runs[process.task] += 1
            await anyio.sleep(seconds)
            if fail(process.task):
                raise RuntimeError(f"{process.task} failed on purpose")
            return "ok"

        return run

    def listen(self, kind: str, message: str) -> None:
        if kind == "lost":
            self.lost.append(message)


def settled(worqr: Worqr, queue: str, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        stats = await worqr.statistics(queue)
        return stats.completed_here + stats.failed_here >= count

    return check


async def no_processes(redis: Redis, prefix: str) -> bool:
    return not [key for key in await raw_keys(redis, prefix) if ":p:" in key]


@pytest.mark.parametrize("seconds", [SHORT, LONG], ids=["short", "long"])
async def test_consume_finish_and_fail_run_each_task_once(
    peers: Callable[..., Worqr], real_client: Redis, prefix: str, seconds: float
) -> None:
    worqr = peers()
    ledger = Ledger()
    await worqr.on("jobs", ledger.listen)
    tasks = [f"t{i}" for i in range(24 if seconds == LONG else 120)]
    failing = {task for task in tasks[::7]}
    await worqr.enqueue("jobs", tasks)
    async with anyio.create_task_group() as tg:
        handler = ledger.handler(seconds, fail=failing.__contains__)
        tg.start_soon(lambda: worqr.consume("jobs", handler, concurrency=8))
        await eventually(settled(worqr, "jobs", len(tasks)), within=60)
        await anyio.sleep(FAST["cleanup_interval"] * 3)  # a requeued copy would start now
        tg.cancel_scope.cancel()
    assert ledger.runs == dict.fromkeys(tasks, 1)
    assert ledger.lost == []
    assert sorted(f.task for f in await worqr.get_failed("jobs")) == sorted(failing)
    assert await worqr.get_tasks("jobs") == []
    assert await no_processes(real_client, prefix)


async def test_stop_returns_to_the_front_and_unique_marks_hold(
    peers: Callable[..., Worqr],
) -> None:
    worqr = peers()
    await worqr.start_worker()
    await worqr.start_work("jobs")
    await worqr.enqueue("jobs", ["u1", "u2"], unique=True)
    first = await worqr.dequeue("jobs")
    assert first is not None and first.task == "u1"
    await anyio.sleep(LONG)  # audits pass over a process held without a handler
    with pytest.raises(DuplicateTaskError):
        await worqr.enqueue("jobs", "u1", unique=True)
    assert await worqr.stop_process(first)
    assert await worqr.get_tasks("jobs") == ["u1", "u2"]
    again = await worqr.dequeue("jobs")
    assert again is not None and again.task == "u1"
    assert await worqr.finish_process(again)
    await worqr.enqueue("jobs", "u1", unique=True)  # the mark went with the finish
    assert await worqr.get_tasks("jobs") == ["u2", "u1"]


async def test_a_dead_peers_tasks_are_reclaimed_once_and_finished_once(
    peers: Callable[..., Worqr], real_client: Redis, prefix: str
) -> None:
    doomed, survivor = peers(**FAST), peers()
    ledger = Ledger()
    tasks = [f"t{i}" for i in range(16)]
    await doomed.enqueue("jobs", tasks)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: doomed.consume("jobs", ledger.handler(60), concurrency=4))
        await eventually(lambda: sum(ledger.runs.values()) == 4)
        await doomed.close()  # like a crash: nothing handed back
        taken = set(ledger.runs)
        ledger.runs.clear()
        tg.start_soon(lambda: survivor.consume("jobs", ledger.handler(SHORT), concurrency=4))
        await eventually(settled(survivor, "jobs", len(tasks)), within=30)
        await anyio.sleep(FAST["cleanup_interval"] * 3)
        tg.cancel_scope.cancel()
    assert ledger.runs == dict.fromkeys(tasks, 1)
    assert taken <= set(tasks)
    assert await no_processes(real_client, prefix)
    assert (await survivor.check()).ok


async def test_delete_and_check_repair_on_a_busy_queue_run_nothing_twice(
    peers: Callable[..., Worqr], real_client: Redis, prefix: str
) -> None:
    workers = [peers(), peers()]
    admin = peers()
    ledger = Ledger()
    tasks = [f"t{i}" for i in range(150)]
    await admin.enqueue("jobs", tasks)
    async with anyio.create_task_group() as tg:
        for worqr in workers:
            tg.start_soon(
                functools.partial(worqr.consume, "jobs", ledger.handler(SHORT), concurrency=8)
            )
        with anyio.fail_after(60):
            while sum(ledger.runs.values()) < 60:
                report = await admin.check(repair=True)
                assert report.problems == ()  # nothing on a healthy fleet, however slow
        await admin.delete_queue("jobs")
        await eventually(lambda: not any(runtime(w).consumers for w in workers), within=10)
        tg.cancel_scope.cancel()
    assert [task for task, runs in ledger.runs.items() if runs != 1] == []
    assert await no_processes(real_client, prefix)
    assert "jobs" not in await admin.get_queues()
    assert (await admin.check()).ok


async def test_retries_and_results_of_jobs_run_each_attempt_once(
    peers: Callable[..., Worqr], real_client: Redis, prefix: str
) -> None:
    """Failed attempts end in batches, tried again at once or later, and waiters take
    outcomes from the done notices, over the slow link: each attempt runs once, and
    every job ends as its attempts say."""
    worker, producer = peers(), peers()
    runs: Counter[str] = Counter()

    async def handler(process: Process) -> str:
        runs[process.task] += 1
        await anyio.sleep(SHORT)
        if process.task.startswith("bad") or process.attempt < 3:
            raise RuntimeError(f"{process.task} failed attempt {process.attempt}")
        return process.task.upper()

    good = [f"good{i}" for i in range(20)]
    bad = [f"bad{i}" for i in range(20)]
    goods = [
        await producer.submit("jobs", task, max_attempts=3, backoff=0.05 * (i % 2))
        for i, task in enumerate(good)
    ]
    bads = [await producer.submit("jobs", task, max_attempts=3, backoff=0) for task in bad]
    failed: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(worker.consume, "jobs", handler, concurrency=8))
        with anyio.fail_after(120):  # a hang guard: the claims are below
            results = [await job.result() for job in goods]
            for job in bads:
                with pytest.raises(JobFailedError) as caught:
                    await job.result()
                failed.append(caught.value.error)
        tg.cancel_scope.cancel()
    assert results == [task.upper() for task in good]
    assert failed == [f"RuntimeError: {task} failed attempt 3" for task in bad]
    assert runs == dict.fromkeys(good + bad, 3)
    assert sorted(f.task for f in await producer.get_failed("jobs")) == sorted(bad)
    assert await no_processes(real_client, prefix)
    assert (await producer.check()).ok
