"""Schedules and flow control against races and hostile data: moves and concurrent
stores never fire a tick twice, a definition no worker can run stops nothing else,
and check() finds what cannot be read."""

from __future__ import annotations

import datetime
import json

import anyio
import anyio.lowlevel
import pytest
from redis.asyncio import Redis

from worqr import Process

from ..helpers import Factory, consuming, eventually


async def test_moving_a_schedule_back_and_forth_fires_each_tick_once(
    real_make: Factory,
) -> None:
    owner, a, b = real_make(), real_make(), real_make()
    runs: list[str] = []

    async def handler(process: Process) -> None:
        runs.append(process.job_id or "")

    await owner.schedule("mv", "qa", "p", every=0.05, misfire="all")
    async with consuming(a, handler, queue="qa"), consuming(b, handler, queue="qb"):
        await eventually(lambda: len(runs) >= 3)
        for i in range(8):
            await owner.schedule("mv", "qb" if i % 2 == 0 else "qa", "p", every=0.05, misfire="all")
            await anyio.sleep(0.07)
        await eventually(lambda: len(runs) >= 20)
    assert len(runs) == len(set(runs)), sorted(runs)
    ticks = sorted(_tick_ms(job_id) for job_id in runs)  # misfire="all": no gap either
    assert ticks == list(range(ticks[0], ticks[-1] + 1, 50))


def _tick_ms(job_id: str) -> int:
    stamp = job_id.partition("@")[2].replace("Z", "+00:00")
    return round(datetime.datetime.fromisoformat(stamp).timestamp() * 1000)


async def test_concurrent_stores_leave_no_copy_behind(real_make: Factory) -> None:
    one, two, worker = real_make(), real_make(), real_make()
    await anyio.lowlevel.checkpoint()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: one.schedule("n", "qx", "p", every=0.05))
        tg.start_soon(lambda: two.schedule("n", "qy", "p", every=0.05))
    assert await one.unschedule("n") is True
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.queue)

    async with consuming(worker, handler, queue="qx"), consuming(worker, handler, queue="qy"):
        await anyio.sleep(0.4)
    assert ran == []  # a copy the registry does not name never fires
    assert await one.get_schedules() == []
    assert {p.kind for p in (await one.check()).problems} <= {"orphan-schedule"}
    await one.check(repair=True)
    assert (await one.check()).ok


async def test_no_overlap_submits_one_of_many_missed_ticks(
    real_make: Factory, real_client: Redis
) -> None:
    worqr = real_make()
    await worqr.schedule("one", "q", "p", every=1, misfire="all", overlap=False)
    seconds, micros = await real_client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    await real_client.hset(worqr._keys.schedule("q", "one"), "since", now - 5500)
    from worqr._ops.schedules import fire

    done = await fire(worqr._redis, worqr._keys, "q", "one")
    assert len(done.submitted) == 1


@pytest.mark.parametrize(
    "broken",
    [
        {"every_ms": 0},
        {"every_ms": -50},
        {"every_ms": 1.5},
        {"cron": 123, "every_ms": None},
        {"misfire": "sometimes"},
        {"options": {"max_attempts": 0}},
        "not json",
    ],
)
async def test_a_definition_no_worker_can_run_stops_nothing_else(
    real_make: Factory, real_client: Redis, broken: dict[str, object] | str
) -> None:
    producer, worker = real_make(), real_make()
    await producer.schedule("bad", "qa", "p", every=0.05)
    await producer.schedule("good", "qb", "p", every=0.05)
    key = producer._keys.schedule("qa", "bad")
    definition = await real_client.hget(key, "def")
    assert definition is not None
    stored = json.loads(definition)
    raw = broken if isinstance(broken, str) else json.dumps({**stored, **broken})
    await real_client.hset(key, "def", raw)
    runs: list[str] = []

    async def handler(process: Process) -> None:
        runs.append(process.queue)

    async with consuming(worker, handler, queue="qa"), consuming(worker, handler, queue="qb"):
        await eventually(lambda: runs.count("qb") >= 4)
    assert "qa" not in runs[2:]  # at most what ran before the definition broke
    assert [s.name for s in await producer.get_schedules()] == ["good"]
    report = await producer.check()
    assert [p.kind for p in report.problems] == ["unreadable-schedule"]
    await producer.check(repair=True)
    assert (await producer.check()).ok
    assert not await real_client.exists(key)


@pytest.mark.parametrize("cron", ["0 0 30 2 *", "61 * * * *", "* * *"])
async def test_crons_that_never_fire_or_do_not_parse_are_refused(make: Factory, cron: str) -> None:
    with pytest.raises(ValueError, match="cron"):
        await make().schedule("s", "q", "p", cron=cron)


async def test_an_unreadable_limit_hands_out_nothing_and_check_repairs_it(
    real_make: Factory, real_client: Redis
) -> None:
    producer, worker = real_make(), real_make()
    await producer.enqueue("q", ["a", "b"])
    await real_client.hset(producer._keys.flow("q"), mapping={"limit": "-1", "per": "1000"})
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.task)

    async with consuming(worker, handler, queue="q"):
        await anyio.sleep(0.3)
        assert ran == []
        assert await producer.get_tasks("q") == ["a", "b"]  # none stranded in a process
        report = await producer.check()
        assert [p.kind for p in report.problems] == ["unreadable-flow"]
        await producer.check(repair=True)
        await eventually(lambda: sorted(ran) == ["a", "b"], within=5)


async def test_a_missed_tick_of_every_queue_fires_at_once(
    real_make: Factory, real_client: Redis
) -> None:
    producer, worker = real_make(), real_make()
    for queue in ("q1", "q2", "q3"):
        await producer.schedule(f"s-{queue}", queue, "p", every=3600)
        seconds, _ = await real_client.time()
        await real_client.hset(
            producer._keys.schedule(queue, f"s-{queue}"), "since", (int(seconds) - 4000) * 1000
        )
    ran: list[str] = []

    async def handler(process: Process) -> None:
        ran.append(process.queue)

    async with (
        consuming(worker, handler, queue="q1"),
        consuming(worker, handler, queue="q2"),
        consuming(worker, handler, queue="q3"),
    ):
        await eventually(lambda: sorted(ran) == ["q1", "q2", "q3"], within=5)
