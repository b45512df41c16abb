"""The benchmark adapter for worqr (see common.py for the modes).

``enqueue --batch --jobs`` submits job envelopes (`Worqr.submit_many`, every option
at its default) instead of plain tasks, for the job-envelope drain.

Jobs: ``schedule`` submits with ``submit_many(at=...)`` in batches of `BATCH` (the due
time in Unix seconds, judged by the Redis server's clock, which on this host is the
producer's clock too); every worker of the queue keeps a timer at the earliest due
time and is woken early by the ``delayed`` event of each submit, so nothing polls.
``roundtrip`` is ``submit`` then ``await job.result()`` (it listens on the queue's
``done`` channel). ``live`` submits with ``submit(at=...)``, one call per job, on
one client (`Worqr.from_url`). ``retry`` submits with ``max_attempts`` and ``backoff=0`` and
reads the failed list's length (`Worqr.statistics`) every few milliseconds.

Schedules. ``cron --role setup`` stores the schedule once, ``schedule("tick",
queue, "tick", every=--every)`` with every other option at its default; ``cron``
(``--role worker``) is one process holding one `Worqr` (``Worqr.from_url``) that
consumes the queue with ``concurrency=--concurrency``, as the README runs a worker:
any worker that consumes a schedule's queue drives it, so there is no scheduler
process. Each tick is a job whose id is ``tick@<tick in UTC ISO 8601>``, from which
the tick is read back. The wall clock is offset by `skew_clock` first.

The job modes, and ``worker`` with ``--buffered`` or ``--reply``, build their client
with `Worqr.from_url`, as the README does (its pool waits for a connection when all
are busy); the other modes keep the plain ``Redis.from_url`` client their published
figures were measured with.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from common import (
    DrainClock,
    RetryClock,
    Schedule,
    calls,
    due_times,
    emit,
    live,
    parse_args,
    payload,
    ran,
    round_trips,
    run,
    say,
    scheduled,
    skew_clock,
    started,
)
from redis.asyncio import Redis

from worqr import Process, Tasks, Worqr

ARGS = parse_args()
Handler = Callable[[Process], Awaitable[str | None]]
BATCH = 1000


def plain() -> Worqr:
    """The client of the suite's modes."""
    return Worqr(Redis.from_url(ARGS.url))


def jobs_client() -> Worqr:
    """The client of the job modes."""
    return Worqr.from_url(ARGS.url)


CALLS = Tasks()


@CALLS.task(queue=ARGS.queue, name="double")
async def double(n: int) -> int:
    """The function the function-call drain calls (cli/worqr_calls.py runs it)."""
    return 2 * n


async def enqueue() -> None:
    async with Worqr(Redis.from_url(ARGS.url)) as worqr:
        begun = time.perf_counter()
        if ARGS.calls:
            emit({"seconds": await calls(ARGS.n, ARGS.callers, lambda i: double.submit(worqr, i))})
            return
        if ARGS.batch:
            for first in range(0, ARGS.n, BATCH):
                last = min(ARGS.n, first + BATCH)
                tasks = [payload(i, ARGS.payload_bytes) for i in range(first, last)]
                if ARGS.jobs:
                    await worqr.submit_many(ARGS.queue, tasks)
                else:
                    await worqr.enqueue(ARGS.queue, tasks)
            emit({"seconds": time.perf_counter() - begun})
            return

        async def call(i: int) -> None:
            await worqr.enqueue(ARGS.queue, payload(i, ARGS.payload_bytes))

        seconds = await calls(ARGS.n, ARGS.callers, call)
        # The floor of one call at a time: a bare round trip on a client like worqr's.
        ping = Redis.from_url(ARGS.url)
        floor = await calls(ARGS.n, 1, lambda i: ping.ping())
        await ping.aclose()
        emit({"seconds": seconds, "ping_seconds": floor})


async def drain() -> None:
    clock = DrainClock(ARGS.expect)

    async def handler(process: Process) -> None:
        clock.tick()

    async with Worqr(Redis.from_url(ARGS.url)) as worqr:
        await worqr.start_worker()
        clock.start()
        async with consuming(worqr, handler):
            await clock.wait()
        await worqr.shutdown()
    emit(clock.result())


async def worker() -> None:
    async def handler(process: Process) -> str | None:
        started(process.task)
        if ARGS.hang:
            await asyncio.sleep(3600)
        return process.task if ARGS.reply else None

    async with jobs_client() if ARGS.buffered or ARGS.reply else plain() as worqr:
        await worqr.start_worker()
        async with consuming(worqr, handler):
            say("ready")
            await asyncio.sleep(3600)


async def produce() -> None:
    async with Worqr(Redis.from_url(ARGS.url)) as worqr:
        schedule = Schedule(ARGS.interval)
        for _ in range(ARGS.n):
            await worqr.enqueue(ARGS.queue, repr(time.time()))
            await schedule.next()


async def fleet() -> None:
    async def handler(process: Process) -> None:
        pass

    async with jobs_client() as setup:  # the duties every worker of the queue shares
        await setup.schedule("hourly", ARGS.queue, "tick", every=3600)
        await setup.submit(ARGS.queue, "later", delay=3600)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(ARGS.workers):
            worqr = await stack.enter_async_context(Worqr(Redis.from_url(ARGS.url)))
            await worqr.start_worker()
            await stack.enter_async_context(consuming(worqr, handler))
        say("ready")
        await asyncio.sleep(3600)


@contextlib.asynccontextmanager
async def consuming(worqr: Worqr, handler: Handler) -> AsyncIterator[None]:
    """Run ``consume`` in the background for the block; stop it after."""
    await worqr.start_work(ARGS.queue)
    task = asyncio.create_task(worqr.consume(ARGS.queue, handler, concurrency=ARGS.concurrency))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def schedule() -> None:
    dues = due_times(ARGS.n, ARGS.rate, ARGS.lead)
    async with jobs_client() as worqr:
        for first in range(0, ARGS.n, BATCH):
            chunk = range(first, min(ARGS.n, first + BATCH))
            # One call per due time: submit_many gives all its jobs one `at`.
            by_due: dict[int, list[str]] = {}
            for k in chunk:
                by_due.setdefault(dues[k], []).append(f"{dues[k]}:{k}")
            for due, payloads in by_due.items():
                await worqr.submit_many(ARGS.queue, payloads, at=due / 1000)
        scheduled(dues, time.time())


async def live_jobs() -> None:
    async with jobs_client() as worqr:

        async def submit(k: int, due: int) -> None:
            await worqr.submit(ARGS.queue, f"{due}:{k}", at=due / 1000)

        await live(ARGS.n, ARGS.rate, ARGS.delay_min, ARGS.delay_max, submit)


async def roundtrip() -> None:
    async with jobs_client() as worqr:

        async def once(payload: str) -> str | None:
            job = await worqr.submit(ARGS.queue, payload)
            return await job.result()

        await round_trips(ARGS.n, ARGS.interval, once)


async def retry() -> None:
    clock = RetryClock(ARGS.n)

    async def handler(process: Process) -> None:
        clock.attempt()
        raise RuntimeError("always fails")

    async with jobs_client() as worqr:
        for first in range(0, ARGS.n, BATCH):
            payloads = [str(i) for i in range(first, min(ARGS.n, first + BATCH))]
            await worqr.submit_many(ARGS.queue, payloads, max_attempts=ARGS.attempts, backoff=0)
        await worqr.start_worker()

        async def failed() -> int:
            return (await worqr.statistics(ARGS.queue)).failed

        clock.start()
        async with consuming(worqr, handler):
            await clock.poll(failed)
        await worqr.shutdown()
    emit(clock.result())


SCHEDULE = "tick"


def tick_of(job_id: str) -> float:
    """The tick (Unix seconds) in a scheduled job's id, ``<name>@<UTC ISO 8601>``."""
    stamp = job_id.rpartition("@")[2]
    moment = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return moment.timestamp()


async def cron() -> None:
    skew_clock()
    if ARGS.role == "setup":
        async with Worqr.from_url(ARGS.url) as worqr:
            await worqr.schedule(SCHEDULE, ARGS.queue, "tick", every=ARGS.every)
        return
    if ARGS.role != "worker":
        return

    async def handler(process: Process) -> None:
        if process.job_id is None:  # not a scheduled run: off every tick's grid
            ran(float("nan"), "task")
            return
        ran(tick_of(process.job_id), process.job_id)

    async with Worqr.from_url(ARGS.url) as worqr:
        consuming = asyncio.create_task(
            worqr.consume(ARGS.queue, handler, concurrency=ARGS.concurrency)
        )
        say("ready")
        await consuming


MODES = {
    "enqueue": enqueue,
    "drain": drain,
    "worker": worker,
    "produce": produce,
    "fleet": fleet,
    "schedule": schedule,
    "roundtrip": roundtrip,
    "retry": retry,
    "live": live_jobs,
    "cron": cron,
}
run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
