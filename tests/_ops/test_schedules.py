"""Schedules: stored, listed, removed; each tick submitted once across peers; misfire
and overlap rules; on every backend, and through a latency-injecting proxy."""

from __future__ import annotations

import datetime
import time

import anyio
import pytest
from redis.asyncio import Redis

from worqr import JobStatus, Process, ScheduleInfo, Worqr
from worqr._layout.schedules import tick_id
from worqr._ops.schedules import fire

from ..helpers import FAST, Factory, consuming, eventually
from ..proxy import LatencyProxy

HOUR_MS = 3_600_000


def _tick_ms(job_id: str) -> int:
    """The tick time (Unix ms) of a schedule's job id."""
    stamp = job_id.partition("@")[2].replace("Z", "+00:00")
    return round(datetime.datetime.fromisoformat(stamp).timestamp() * 1000)


async def test_a_schedule_is_stored_listed_and_removed(make: Factory) -> None:
    worqr = make()
    assert await worqr.get_schedules() == []
    await worqr.schedule("nightly", "q", "report", cron="0 3 * * *", timezone="Europe/Paris")
    await worqr.schedule("often", "q2", "ping", every=30, misfire="all", overlap=False)
    found = await worqr.get_schedules()
    assert [s.name for s in found] == ["nightly", "often"]
    nightly, often = found
    assert isinstance(nightly, ScheduleInfo)
    assert (nightly.queue, nightly.payload, nightly.cron, nightly.every) == (
        "q",
        "report",
        "0 3 * * *",
        None,
    )
    assert (nightly.timezone, nightly.misfire, nightly.overlap) == ("Europe/Paris", "latest", True)
    assert nightly.last_tick is None and nightly.next_tick is not None
    assert nightly.next_tick > time.time() - 5
    assert (often.every, often.misfire, often.overlap, often.cron) == (30.0, "all", False, None)
    assert often.next_tick is not None and often.next_tick % 30 == 0
    assert await worqr.unschedule("nightly") is True
    assert await worqr.unschedule("nightly") is False
    assert [s.name for s in await worqr.get_schedules()] == ["often"]
    with pytest.raises(AttributeError):
        often.name = "x"  # type: ignore[misc]  # frozen: the assignment must raise


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, ValueError),
        ({"cron": "* * * * *", "every": 1}, ValueError),
        ({"cron": "not a cron"}, ValueError),
        ({"cron": "* * *"}, ValueError),
        ({"cron": 5}, TypeError),
        ({"every": 0}, ValueError),
        ({"every": -1}, ValueError),
        ({"every": "1"}, TypeError),
        ({"every": True}, TypeError),
        ({"every": 1, "timezone": "Mars/Olympus"}, ValueError),
        ({"every": 1, "misfire": "sometimes"}, ValueError),
        ({"every": 1, "overlap": "no"}, TypeError),
        ({"every": 1, "max_attempts": 0}, ValueError),
        ({"every": 1, "timeout": -1}, ValueError),
    ],
)
async def test_bad_schedules_are_refused_and_nothing_is_stored(
    make: Factory, options: dict[str, object], error: type[Exception]
) -> None:
    worqr = make()
    with pytest.raises(error):
        await worqr.schedule("s", "q", "p", **options)  # type: ignore[arg-type]  # bad on purpose: must be refused
    assert await worqr.get_schedules() == []


@pytest.mark.parametrize("name", ["", "a@b", "a b", "x" * 101, "a/b"])
async def test_bad_schedule_names_are_refused(make: Factory, name: str) -> None:
    with pytest.raises(ValueError, match="schedule name"):
        await make().schedule(name, "q", "p", every=1)


async def test_each_tick_runs_once_across_peers(make: Factory) -> None:
    producer = make()
    workers = [make(), make(), make()]
    runs: list[str] = []

    async def handler(process: Process) -> None:
        assert process.job_id is not None
        runs.append(process.job_id)

    await producer.schedule("tick", "q", "payload", every=0.1)
    async with (
        consuming(workers[0], handler, queue="q"),
        consuming(workers[1], handler, queue="q"),
        consuming(workers[2], handler, queue="q"),
    ):
        await eventually(lambda: len(runs) >= 12, within=10)
    assert len(runs) == len(set(runs)), sorted(runs)
    ticks = sorted(runs)
    (info,) = await producer.get_schedules()
    assert info.last_job_id is not None and info.last_job_id >= ticks[-1]
    job = producer.job("q", ticks[0])
    assert await job.status() == JobStatus.DONE
    assert ticks[0].startswith("tick@") and ticks[0].endswith("Z")


async def test_a_schedules_ticks_wait_at_its_priority(
    real_make: Factory, real_client: Redis, prefix: str
) -> None:
    producer, worker = real_make(), real_make()
    await producer.schedule("urgent", "q", "p", every=0.05, priority="high")
    await producer.enqueue("q", [f"t{i}" for i in range(3)])
    runs: list[str] = []

    async def handler(process: Process) -> None:
        runs.append(process.job_id or process.task)

    await worker.start_worker()
    await worker.start_work("q")  # its timer fires the schedule; nothing is taken yet
    await eventually(lambda: _has_high(real_client, prefix))
    async with consuming(worker, handler, queue="q", priority="strict"):
        await eventually(lambda: len(runs) >= 4, within=10)
    assert runs[0].startswith("urgent@")  # from the high list, ahead of the plain tasks


async def _has_high(redis: Redis, prefix: str) -> bool:
    return bool(await redis.llen(f"{prefix}:q:{{q}}:high"))


async def _stored(worqr: Worqr, redis: Redis, name: str, queue: str, **since: int) -> None:
    """Rewrite a schedule's record as if it was stored, or last ticked, long ago."""
    key = worqr._keys.schedule(queue, name)
    await redis.hset(key, mapping={field: value for field, value in since.items()})


async def _server_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def _clear_of_hour_boundary(redis: Redis) -> None:
    """Wait until the server's clock is past the first 2 s of an hour (``skip``'s
    grace would otherwise count the latest hourly tick as on time)."""
    if await _server_ms(redis) % HOUR_MS < 2000:
        await anyio.sleep(2)


@pytest.mark.parametrize(("misfire", "expected"), [("latest", 1), ("all", 5), ("skip", 0)])
async def test_misfired_ticks_follow_the_rule(
    real_make: Factory, real_client: Redis, misfire: str, expected: int
) -> None:
    worqr = real_make()
    await _clear_of_hour_boundary(real_client)
    await worqr.schedule("hourly", "q", "p", every=3600, misfire=misfire)
    now = await _server_ms(real_client)
    await _stored(worqr, real_client, "hourly", "q", since=now - 5 * HOUR_MS - 1000)
    done = await fire(worqr._redis, worqr._keys, "q", "hourly")
    assert len(done.submitted) == expected
    latest = now - now % HOUR_MS
    if expected:
        assert done.submitted[-1] == tick_id("hourly", latest)
    assert await worqr.count_queue("q") == expected
    (info,) = await worqr.get_schedules()
    assert info.last_tick == latest / 1000  # handled, whether submitted or not
    again = await fire(worqr._redis, worqr._keys, "q", "hourly")
    assert again.submitted == []


async def test_misfire_all_submits_at_most_100(real_make: Factory, real_client: Redis) -> None:
    worqr = real_make()
    await worqr.schedule("fast", "q", "p", every=1, misfire="all")
    now = await _server_ms(real_client)
    await _stored(worqr, real_client, "fast", "q", since=now - 500_000)
    done = await fire(worqr._redis, worqr._keys, "q", "fast")
    assert len(done.submitted) == 100
    assert done.submitted == sorted(done.submitted)
    assert await worqr.count_queue("q") == 100


async def test_no_overlap_skips_ticks_while_the_last_run_lives(make: Factory) -> None:
    producer, worker = make(), make()
    release = anyio.Event()
    runs: list[str] = []

    async def handler(process: Process) -> None:
        runs.append(process.job_id or "")
        await release.wait()

    await producer.schedule("slow", "q", "p", every=0.1, overlap=False)
    async with consuming(worker, handler, queue="q", concurrency=5):
        await eventually(lambda: len(runs) == 1)

        async def skipped() -> bool:
            (info,) = await producer.get_schedules()
            return info.skipped >= 3

        await eventually(skipped)
        assert len(runs) == 1
        release.set()
        await eventually(lambda: len(runs) >= 2)
    assert len(set(runs)) == len(runs)


async def test_restoring_the_same_schedule_changes_nothing(
    real_make: Factory, real_client: Redis
) -> None:
    worqr = real_make()
    await worqr.schedule("s", "q", "p", every=60)
    key = worqr._keys.schedule("q", "s")
    since = await real_client.hget(key, "since")
    await anyio.sleep(0.01)
    await worqr.schedule("s", "q", "p", every=60)
    assert await real_client.hget(key, "since") == since
    await worqr.schedule("s", "q", "p", every=30)  # a new definition counts from now
    assert await real_client.hget(key, "since") != since


async def test_moving_a_schedule_to_another_queue(make: Factory) -> None:
    worqr = make()
    await worqr.schedule("s", "a", "p", every=60)
    await worqr.schedule("s", "b", "p", every=60)
    (info,) = await worqr.get_schedules()
    assert info.queue == "b"
    assert await worqr.unschedule("s") is True
    assert await worqr.get_schedules() == []


async def test_a_six_field_cron_ticks_on_the_second(make: Factory) -> None:
    producer, worker = make(), make()
    runs: list[str] = []

    async def handler(process: Process) -> None:
        runs.append(process.job_id or "")

    await producer.schedule("sec", "q", "p", cron="* * * * * *")
    async with consuming(worker, handler, queue="q"):
        await eventually(lambda: len(runs) >= 2, within=5)
    assert all(job_id.startswith("sec@") and job_id[-4] != "." for job_id in runs), runs


async def test_workers_of_other_queues_do_not_drive_a_schedule(make: Factory) -> None:
    producer, other = make(), make()

    async def handler(process: Process) -> None:
        pass

    await producer.schedule("s", "q", "p", every=0.05)
    async with consuming(other, handler, queue="elsewhere"):
        await anyio.sleep(0.3)
    assert await producer.count_queue("q") == 0


async def test_ticks_run_once_through_a_slow_link(redis_url: str, proxy: LatencyProxy) -> None:
    """Three peers behind 3 ms (+- 1.5 ms) each way: no tick twice, none skipped."""
    proxy.delay, proxy.jitter = 0.003, 0.0015
    prefix = f"t{time.time_ns()}"
    clients = [Redis.from_url(proxy.url, decode_responses=True) for _ in range(3)]
    peers = [Worqr(client, prefix=prefix, **FAST) for client in clients]
    runs: list[str] = []

    async def handler(process: Process) -> None:
        runs.append(process.job_id or "")

    try:
        await peers[0].schedule("tick", "q", "p", every=0.1, misfire="all")
        async with (
            consuming(peers[0], handler, queue="q"),
            consuming(peers[1], handler, queue="q"),
            consuming(peers[2], handler, queue="q"),
        ):
            await eventually(lambda: len(runs) >= 10, within=10)
        assert len(runs) == len(set(runs))
        ticks = sorted(_tick_ms(job_id) for job_id in runs)
        # misfire="all": however late a peer was, no tick between the first and the last
        assert ticks == list(range(ticks[0], ticks[-1] + 1, 100))
    finally:
        for peer in peers:
            await peer.close()
        for client in clients:
            await client.aclose()


@pytest.mark.parametrize("late_ms", [1500, 5000])
def test_a_late_tick_of_a_long_period_schedule_whose_workers_live_is_submitted(
    late_ms: int,
) -> None:
    """every=60, misfire="skip": the previous tick was fired on time (``seen`` just
    after it), the workers live on; the next tick is reached ``late_ms`` late because
    they are busy. It passed while a worker lived: misfire must not apply, the tick is
    submitted (and counted late), not dropped unseen."""
    from worqr._layout.schedules import Definition

    schedule = Definition(
        payload="p", cron=None, every_ms=60_000, timezone="UTC", misfire="skip",
        overlap=True, options={},
    )  # fmt: skip
    previous = 1_700_000_040_000
    state = {"since": str(previous - 600_000), "last": str(previous), "seen": str(previous + 20)}
    tick = previous + 60_000
    assert schedule.due(state, tick + late_ms) == ([tick], tick)
