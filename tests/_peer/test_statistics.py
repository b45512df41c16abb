"""statistics() and get_worker_info(): fleet counts from Redis, this peer's own figures."""

from __future__ import annotations

import anyio
import pytest

from worqr import Process, QueueStatistics, Worqr

from ..helpers import Factory, eventually


async def test_statistics_snapshot(make: Factory) -> None:
    worker, producer = make(), make()
    await producer.enqueue("jobs", ["ok-1", "ok-2", "bad", "held"])

    async def handler(process: Process) -> str:
        if process.task == "bad":
            raise ValueError("no")
        if process.task == "held":
            await anyio.sleep_forever()
        await anyio.sleep(0.01)
        return "done"

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.consume, "jobs", handler)
        await eventually(lambda: _settled(worker))
        stats = await worker.statistics("jobs")
        tg.cancel_scope.cancel()
    assert isinstance(stats, QueueStatistics)
    assert (stats.queue, stats.queued, stats.in_process, stats.failed, stats.workers) == (
        "jobs",
        0,
        1,
        1,
        1,
    )
    assert (stats.completed_here, stats.failed_here) == (2, 1)
    assert stats.duration_p50 is not None and 0.0 <= stats.duration_p50 < 5
    assert stats.duration_p90 is not None and stats.duration_p99 is not None
    assert stats.duration_p50 <= stats.duration_p90 <= stats.duration_p99
    with pytest.raises(AttributeError):
        stats.queued = 5  # type: ignore[misc]  # frozen: the assignment must raise
    other = await producer.statistics("jobs")
    assert (other.completed_here, other.duration_p50) == (0, None)  # this peer did nothing
    assert other.failed == 1


async def _settled(worqr: Worqr) -> bool:
    stats = await worqr.statistics("jobs")
    return bool(stats.completed_here == 2 and stats.failed_here == 1 and stats.in_process == 1)


async def test_worker_info(make: Factory) -> None:
    worker, watcher = make(worker_id="w-info"), make()
    await worker.start_worker()
    await worker.start_work("b")
    await worker.start_work("a")
    await worker.enqueue("a", ["x", "y"])
    assert await worker.dequeue("a")
    [info] = await watcher.get_worker_info()
    assert (info.id, info.queues, info.in_process) == ("w-info", ("a", "b"), 1)
    assert info.heartbeat_age is not None and 0 <= info.heartbeat_age < 1
