"""Flow control on every backend: pause and resume, rate limits."""

from __future__ import annotations

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr
from worqr._layout.flow import RateLimit
from worqr._worqr import runtime

from ..helpers import Factory, consuming, eventually
from ..proxy import LatencyProxy


async def test_a_paused_queue_accepts_work_and_hands_out_nothing(make: Factory) -> None:
    producer, worker = make(), make()
    await worker.start_worker()
    await worker.start_work("q")
    assert await producer.is_paused("q") is False
    await producer.pause_queue("q")
    assert await producer.is_paused("q") is True
    await producer.enqueue("q", ["a", "b"])
    await producer.submit("q", "job")
    assert await worker.dequeue("q") is None
    assert await producer.count_queue("q") == 3
    await producer.resume_queue("q")
    assert await producer.is_paused("q") is False
    taken = await worker.dequeue("q")
    assert taken is not None and taken.task == "a"


async def test_consumers_sleep_while_paused_and_wake_on_resume(make: Factory) -> None:
    producer, worker = make(), make()
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    await producer.pause_queue("q")
    await producer.enqueue("q", [str(i) for i in range(5)])
    async with consuming(worker, handler, queue="q", concurrency=3):
        await eventually(lambda: "q" in runtime(worker).working)
        await anyio.sleep(0.3)
        assert ran == []
        await producer.resume_queue("q")
        await eventually(lambda: len(ran) == 5)
    assert sorted(ran) == [str(i) for i in range(5)]


async def test_pausing_leaves_running_tasks_alone(make: Factory) -> None:
    producer, worker = make(), make()
    started, release = anyio.Event(), anyio.Event()
    done: list[str] = []

    async def handler(process: Process) -> str:
        started.set()
        await release.wait()
        done.append(process.task)
        return "ok"

    await producer.enqueue("q", ["running", "waiting"])
    async with consuming(worker, handler, queue="q"):
        await started.wait()
        await producer.pause_queue("q")
        release.set()
        await eventually(lambda: done == ["running"])
        await anyio.sleep(0.2)
        assert done == ["running"]
        assert await producer.get_tasks("q") == ["waiting"]


async def test_rate_limits_are_stored_and_removed(make: Factory) -> None:
    worqr = make()
    assert await worqr.get_rate_limit("q") is None
    await worqr.set_rate_limit("q", 10, 2.5)
    assert await worqr.get_rate_limit("q") == RateLimit(10, 2.5)
    limit = await worqr.get_rate_limit("q")
    assert limit is not None and limit.limit == 10 and limit.per == 2.5
    await worqr.set_rate_limit("q", None)
    assert await worqr.get_rate_limit("q") is None
    assert await worqr.is_paused("q") is False


@pytest.mark.parametrize(
    ("limit", "per", "error"),
    [
        (0, 1.0, ValueError),
        (-1, 1.0, ValueError),
        (True, 1.0, TypeError),
        (1.5, 1.0, TypeError),
        (5, 0, ValueError),
        (5, float("nan"), ValueError),
        (5, "1", TypeError),
        (5, None, TypeError),
        (None, 1.0, ValueError),
    ],
)
async def test_bad_rate_limits_are_refused(
    make: Factory, limit: object, per: object, error: type[Exception]
) -> None:
    worqr = make()
    with pytest.raises(error):
        await worqr.set_rate_limit("q", limit, per)  # type: ignore[arg-type]  # bad on purpose: must be refused
    assert await worqr.get_rate_limit("q") is None


async def _starts_within_the_limit(producer: Worqr, workers: list[Worqr]) -> None:
    """14 tasks under a limit of 4 per 0.6 s on two workers: no window of the server's
    clock holds more than 4 starts, as the dequeues recorded them (each handler reads
    its own start's score before the window can drop it)."""
    limit, per_ms = 4, 600
    await producer.set_rate_limit("q", limit, per_ms / 1000)
    starts: list[float] = []

    async def handler(process: Process) -> None:
        score = await producer._redis.zscore(producer._keys.starts("q"), process.id)
        assert score is not None
        starts.append(score)

    await producer.enqueue("q", [str(i) for i in range(14)])
    async with (
        consuming(workers[0], handler, queue="q", concurrency=8),
        consuming(workers[1], handler, queue="q", concurrency=8),
    ):
        await eventually(lambda: len(starts) == 14, within=20)
    starts.sort()
    for i, first in enumerate(starts):
        within = [t for t in starts[i:] if t - first < per_ms]
        assert len(within) <= limit, (i, [t - first for t in within])


async def test_no_window_holds_more_starts_than_the_limit(make: Factory) -> None:
    await _starts_within_the_limit(make(), [make(), make()])


async def test_the_limit_holds_through_a_slow_link(real_make: Factory, proxy: LatencyProxy) -> None:
    """One worker behind 5 ms (+- 2.5 ms) each way, one direct: its starts are scored
    no earlier than its EXEC, so the window still holds."""
    proxy.delay, proxy.jitter = 0.005, 0.0025
    slow = Redis.from_url(proxy.url, decode_responses=True)
    try:
        await _starts_within_the_limit(real_make(), [real_make(redis=slow), real_make()])
    finally:
        await slow.aclose()


async def test_a_pause_holds_through_a_slow_link(real_make: Factory, proxy: LatencyProxy) -> None:
    proxy.delay, proxy.jitter = 0.005, 0.0025
    slow = Redis.from_url(proxy.url, decode_responses=True)
    producer, worker = real_make(), real_make(redis=slow)
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    try:
        async with consuming(worker, handler, queue="q", concurrency=4):
            await producer.enqueue("q", [str(i) for i in range(20)])
            await producer.pause_queue("q")
            await anyio.sleep(0.5)  # a handler whose dequeue came before the pause has started
            before = len(ran)
            await anyio.sleep(0.3)
            assert len(ran) == before
            await producer.resume_queue("q")
            await eventually(lambda: len(ran) == 20)
        assert sorted(ran, key=int) == [str(i) for i in range(20)]
    finally:
        await slow.aclose()


async def test_removing_a_limit_lets_waiting_workers_go(make: Factory) -> None:
    producer, worker = make(), make()
    await producer.set_rate_limit("q", 1, 3600)
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    await producer.enqueue("q", ["a", "b", "c"])
    async with consuming(worker, handler, queue="q", concurrency=3):
        await eventually(lambda: ran == ["a"])
        await anyio.sleep(0.2)
        assert ran == ["a"]
        await producer.set_rate_limit("q", None)
        await eventually(lambda: len(ran) == 3)
