"""Priority levels on every backend: strict and weighted serving, FIFO within a level,
stopped and reclaimed tasks back at the front of their own level, jobs and retries
keeping their level."""

from __future__ import annotations

from collections import Counter

import anyio
import anyio.lowlevel
import pytest

from worqr import Process, Worqr
from worqr._layout.levels import Picker
from worqr._worqr import runtime

from ..helpers import Factory, consuming, eventually, texts


def test_weighted_plans_serve_16_4_1_and_interleave() -> None:
    picker = Picker()
    plenty = {"high": 10_000, "normal": 10_000, "low": 10_000}
    picks = [level for _ in range(210) for level in picker.plan(plenty, 1, "weighted")]
    assert Counter(picks) == {"high": 160, "normal": 40, "low": 10}
    assert "low" in picks[:21] and "normal" in picks[:21]  # no level waits out a run
    assert picker.plan({"high": 0, "normal": 3, "low": 1}, 10, "weighted") == [
        "normal",
        "normal",
        "normal",
        "low",
    ]
    assert picker.plan({"high": 2, "normal": 3, "low": 1}, 4, "strict") == [
        "high",
        "high",
        "normal",
        "normal",
    ]
    assert picker.plan({}, 3, "strict") == []


async def test_strict_takes_the_highest_level_and_keeps_fifo_within(make: Factory) -> None:
    producer, worker = make(), make()
    await producer.enqueue("q", ["n1", "n2"])
    await producer.enqueue("q", ["l1", "l2"], priority="low")
    await producer.enqueue("q", ["h1", "h2"], priority="high")
    assert await producer.count_queue("q") == 6
    assert await producer.get_tasks("q") == ["h1", "h2", "n1", "n2", "l1", "l2"]
    assert await producer.peek_queue("q") == "h1"
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with consuming(worker, handler, queue="q", priority="strict"):
        await eventually(lambda: len(ran) == 6)
    assert ran == ["h1", "h2", "n1", "n2", "l1", "l2"]
    (stats,) = await producer.queue_statistics()
    assert stats.levels == {"high": 0, "normal": 0, "low": 0}


async def strict_run(worker: Worqr, count: int) -> list[str]:
    """The tasks a strict consumer of queue "q" runs, in order, until ``count`` ran."""
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with consuming(worker, handler, queue="q", priority="strict"):
        await eventually(lambda: len(ran) == count)
    return ran


async def test_strict_sees_overdue_high_jobs_before_its_first_take(make: Factory) -> None:
    """High jobs came due while no worker was on the queue, and a low task was queued
    meanwhile: a strict consumer that starts now runs the high jobs first (they are
    promoted as it starts work, before its first take)."""
    producer, worker = make(), make()
    await producer.submit_many("q", ["h1", "h2"], delay=0.05, priority="high")
    await producer.enqueue("q", "l1", priority="low")
    await anyio.sleep(0.2)
    assert await strict_run(worker, 3) == ["h1", "h2", "l1"]


async def test_weighted_serves_every_level_under_saturation(make: Factory) -> None:
    producer, worker = make(), make()
    for level in ("high", "normal", "low"):
        await producer.enqueue("q", [f"{level}-{i}" for i in range(60)], priority=level)
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with consuming(worker, handler, queue="q"):
        await eventually(lambda: len(ran) >= 42)
    first = Counter(task.partition("-")[0] for task in ran[:42])
    assert first["low"] >= 1 and first["normal"] >= 4 and first["high"] >= 20, first
    for level in ("high", "normal", "low"):  # FIFO within each level
        mine = [int(task.partition("-")[2]) for task in ran if task.startswith(level)]
        assert mine == sorted(mine)


@pytest.mark.parametrize("priority", ["urgent", "", "HIGH"])
async def test_unknown_priorities_are_refused(make: Factory, priority: str) -> None:
    worqr = make()
    with pytest.raises(ValueError, match="priority"):
        await worqr.enqueue("q", "t", priority=priority)
    with pytest.raises(ValueError, match="priority"):
        await worqr.submit("q", "t", priority=priority)
    with pytest.raises(ValueError, match="priority"):
        await worqr.schedule("s", "q", "t", every=60, priority=priority)
    with pytest.raises(TypeError, match="priority"):
        await worqr.enqueue("q", "t", priority=1)  # type: ignore[arg-type]  # bad on purpose: must be refused
    assert await worqr.count_queue("q") == 0

    async def handler(process: Process) -> None:
        pass

    with pytest.raises(ValueError, match="weighted, strict"):
        await worqr.consume("q", handler, priority="fair")


async def test_a_stopped_task_goes_back_to_the_front_of_its_level(make: Factory) -> None:
    producer, worker = make(), make()
    await worker.start_worker()
    await worker.start_work("q")
    await producer.enqueue("q", ["n1"])
    await producer.enqueue("q", ["l1", "l2"], priority="low")
    await producer.enqueue("q", ["h1", "h2"], priority="high")
    taken = [await worker.dequeue("q") for _ in range(5)]
    processes = {p.task: p for p in taken if p is not None}
    assert sorted(processes) == ["h1", "h2", "l1", "l2", "n1"]
    await worker.stop_process(processes["l2"])
    await worker.stop_process(processes["l1"])
    await worker.stop_process(processes["h1"])
    assert await producer.get_tasks("q") == ["h1", "l1", "l2"]


async def test_a_dead_workers_tasks_return_to_their_own_levels(make: Factory) -> None:
    producer, doomed, survivor = make(), make(), make()
    await doomed.start_worker()
    await doomed.start_work("q")
    await producer.enqueue("q", ["h1"], priority="high")
    await producer.enqueue("q", ["l1"], priority="low")
    await producer.enqueue("q", ["n1"])
    taken = [await doomed.dequeue("q") for _ in range(2)]
    assert sorted(p.task for p in taken if p) == ["h1", "n1"]  # weighted: high, then normal
    await producer.enqueue("q", ["h2"], priority="high")
    await producer.enqueue("q", ["n2"])
    await doomed.close()
    await survivor.fail_worker(doomed.worker_id)
    assert await producer.get_tasks("q") == ["h1", "h2", "n1", "n2", "l1"]


async def test_jobs_and_their_retries_keep_their_level(make: Factory) -> None:
    producer, worker = make(), make()
    failed = anyio.Event()

    async def handler(process: Process) -> None:
        if process.task == "flaky" and process.attempt == 1:
            await producer.pause_queue("q")  # so that the retry stays where it is put
            failed.set()
            raise RuntimeError("first attempt fails")
        await anyio.sleep(3600)

    await producer.enqueue("q", [f"n{i}" for i in range(3)])
    await producer.submit("q", "flaky", priority="high", max_attempts=2, backoff=0)
    async with consuming(worker, handler, queue="q", priority="strict"):
        await failed.wait()

        async def retried() -> bool:
            return len(await producer.get_tasks("q")) == 4

        await eventually(retried)
        high = texts(await producer._redis.lrange(producer._keys.level("q", "high"), 0, -1))
        assert len(high) == 1 and high[0].endswith("\nflaky") and '"p":"high"' in high[0]
        await producer.submit_many("q", ["later"], priority="low", delay=0.01)

        async def promoted() -> bool:
            return len(await producer.get_tasks("q")) == 5

        await eventually(promoted)
        low = texts(await producer._redis.lrange(producer._keys.level("q", "low"), 0, -1))
        assert len(low) == 1 and low[0].endswith("\nlater")


async def test_priority_moves_the_prefix_to_protocol_3(make: Factory) -> None:
    worqr = make()
    await worqr.enqueue("q", "t", priority="low")
    info = await worqr.queue_statistics()
    assert info[0].levels == {"high": 0, "normal": 0, "low": 1}
    await anyio.lowlevel.checkpoint()


async def test_an_idle_worker_wakes_for_work_of_any_level(make: Factory) -> None:
    producer, worker = make(), make()
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with consuming(worker, handler, queue="q", concurrency=4):
        await eventually(lambda: "q" in runtime(worker).working)
        await anyio.sleep(0.05)
        await producer.enqueue("q", "h", priority="high")
        await eventually(lambda: ran == ["h"], within=2)
        await producer.submit("q", "low job", priority="low")
        await eventually(lambda: ran == ["h", "low job"], within=2)
        await producer.enqueue("q", "n")
        await eventually(lambda: len(ran) == 3, within=2)


async def test_levels_under_a_rate_limit(make: Factory) -> None:
    producer, worker = make(), make()
    await producer.set_rate_limit("q", 100, 60)
    await producer.enqueue("q", ["n1", "n2"])
    await producer.enqueue("q", ["h1"], priority="high")
    assert await strict_run(worker, 3) == ["h1", "n1", "n2"]


async def test_a_busy_strict_consumer_looks_before_taking_announced_work(make: Factory) -> None:
    """A push at another level announces a look (a bare ``work:``), normal ones their
    count: a consumer that got both while its slot was busy reads the levels first,
    rather than take the announced normal tasks ahead of a waiting high one."""
    producer, worker = make(), make()
    ran: list[str] = []
    release = anyio.Event()

    async def handler(process: Process) -> None:
        ran.append(process.task)
        if process.task.startswith("busy"):
            await release.wait()

    async with consuming(worker, handler, queue="q", priority="strict"):
        for round_ in range(3):
            release = anyio.Event()
            await producer.enqueue("q", f"busy{round_}")
            await eventually(lambda: len(ran) == 3 * round_ + 1)  # noqa: B023
            await producer.enqueue("q", f"h{round_}", priority="high")
            await producer.enqueue("q", f"n{round_}")
            await anyio.sleep(0.2)  # both events reach the busy consumer
            release.set()
            await eventually(lambda: len(ran) == 3 * round_ + 3)  # noqa: B023
            assert ran[-2:] == [f"h{round_}", f"n{round_}"]
