"""The benchmark adapter for arq 0.28 (see common.py for the modes).

arq's own ``Worker`` runs in-process through ``async_run``, on a pool made with
``create_pool``, with ``max_jobs=--concurrency`` and every other setting left at its
default. These defaults matter for the figures:

* ``poll_delay=0.5``: the worker looks for due jobs every 0.5 s, so a task enqueued
  into an idle worker waits up to 0.5 s (0.25 s on average) before it starts.
* ``queue_read_limit=max(5 * max_jobs, 100)``: a poll starts at most that many jobs
  and the next poll comes 0.5 s after the last one began, so a drain cannot beat
  ``queue_read_limit / poll_delay`` jobs/s (640/s at max_jobs=64, 2000/s at 200).
* ``keep_result=3600``: every finished job writes a result key, kept for an hour.
* ``job_timeout=300``: a job is cancelled after 5 min. Its in-progress key expires
  ``job_timeout + 10`` = 310 s after it started, so a job whose worker was SIGKILLed
  stays in the queue untouched until then; only then can another worker run it again
  (``max_tries=5``).
* ``handle_signals=True``: SIGINT/SIGTERM stop the worker, as with arq's CLI.

Jobs. ``schedule`` enqueues with ``_defer_until`` (the same mechanism as ``_defer_by``:
the job's score in the queue's sorted set is its due time in ms, by the producer's
clock), `SUBMITTERS` calls at a time; a deferred job starts at the first poll after
it is due, so lateness is up to ``poll_delay`` (0.5 s). ``live`` enqueues with
``_defer_until`` too, one ``enqueue_job`` per job. ``roundtrip`` is
``enqueue_job`` then ``await job.result()``, which polls every ``poll_delay=0.5`` s
by default. ``retry``: arq retries a job only when it raises ``Retry``, so the
always-failing handler raises ``Retry(defer=0)`` on tries 1 and 2 and ``RuntimeError``
on try 3 (its function registered with ``max_tries=3``); a job counts as failed in
``after_job_end``, which runs once arq has stored the failed result.

Schedules. ``cron`` runs arq's own CLI (``arq arq_peer.CronSettings``, its
``cli`` entry point called in this process, after `skew_clock` and, with
``--uvloop``, uvloop's event loop policy) with one ``cron()`` job in
``WorkerSettings.cron_jobs`` firing every ``--every`` seconds (``second`` set to
those seconds, ``microsecond=0`` so that ticks fall on whole seconds as the other
libraries' do; every other option at its default: ``unique=True``,
``keep_result=0``, ``max_tries=1``). Every worker enqueues each tick whose time falls
within its next heartbeat window, under the job id ``cron:tick:<tick Unix ms>``;
the id dedupes while the job or its result exists, and the tick is read back from
it. ``--role setup`` does nothing: the schedule lives in each worker's settings.

arq has no batch enqueue, so ``enqueue --batch`` reports unsupported. Each
``enqueue_job`` call gets a fresh random job id (uuid4), so no task is deduplicated.
Logging is left unconfigured (arq's CLI would log every job at INFO).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from arq import cron as arq_cron
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.worker import Retry, Worker, func
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

ARGS = parse_args()
TASK = "task"  # the function name jobs are enqueued under and registered as
Ctx = dict[Any, Any]
SUBMITTERS = 32  # enqueue_job calls in flight while filling the delayed set


async def connect() -> ArqRedis:
    return await create_pool(RedisSettings.from_dsn(ARGS.url), default_queue_name=ARGS.queue)


def make_worker(
    task: Callable[[Ctx, str], Awaitable[str | None]],
    redis: ArqRedis,
    max_tries: int | None = None,
    **hooks: Any,
) -> Worker:
    return Worker(
        [func(task, name=TASK, max_tries=max_tries)],  # type: ignore[arg-type]
        queue_name=ARGS.queue,
        redis_pool=redis,
        max_jobs=ARGS.concurrency,
        **hooks,
    )


async def enqueue() -> None:
    if ARGS.batch:
        emit({"unsupported": "arq has no batch enqueue: one enqueue_job transaction per job"})
        return
    redis = await connect()

    async def call(i: int) -> None:
        if ARGS.calls:
            await redis.enqueue_job("double", i)
        else:
            await redis.enqueue_job(TASK, payload(i, ARGS.payload_bytes))

    emit({"seconds": await calls(ARGS.n, ARGS.callers, call)})
    await redis.aclose()


async def drain() -> None:
    clock = DrainClock(ARGS.expect)

    async def task(ctx: Ctx, payload: str) -> None:
        clock.tick()

    worker = make_worker(task, await connect())
    clock.start()
    main = asyncio.create_task(worker.async_run())
    await clock.wait()
    # arq's SIGTERM handler cancels running jobs, and close() then fails on them, so
    # first stop picking and let the jobs in flight record their end.
    worker.allow_pick_jobs = False
    while pending := [t for t in worker.tasks.values() if not t.done()]:
        await asyncio.wait(pending)
    worker.handle_sig(signal.SIGTERM)
    with contextlib.suppress(asyncio.CancelledError):
        await main
    await worker.close()
    emit(clock.result())


async def worker() -> None:
    async def task(ctx: Ctx, payload: str) -> str | None:
        started(payload)
        if ARGS.hang:
            await asyncio.sleep(3600)
        return payload if ARGS.reply else None

    async def ready(ctx: Ctx) -> None:  # on_startup runs right before the first poll
        say("ready")

    arq_worker = make_worker(task, await connect(), on_startup=ready)
    with contextlib.suppress(asyncio.CancelledError):  # how SIGTERM ends async_run
        await arq_worker.async_run()
    await arq_worker.close()


async def produce() -> None:
    redis = await connect()
    schedule = Schedule(ARGS.interval)
    for _ in range(ARGS.n):
        await redis.enqueue_job(TASK, repr(time.time()))
        await schedule.next()
    await redis.aclose()


async def schedule() -> None:
    redis = await connect()
    dues = due_times(ARGS.n, ARGS.rate, ARGS.lead)
    queue = asyncio.Queue[int]()
    for k in range(ARGS.n):
        queue.put_nowait(k)

    async def submitter() -> None:
        while not queue.empty():
            k = queue.get_nowait()
            due = datetime.datetime.fromtimestamp(dues[k] / 1000, tz=datetime.timezone.utc)
            await redis.enqueue_job(TASK, f"{dues[k]}:{k}", _defer_until=due)

    await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
    scheduled(dues, time.time())
    await redis.aclose()


async def live_jobs() -> None:
    redis = await connect()

    async def submit(k: int, due: int) -> None:
        at = datetime.datetime.fromtimestamp(due / 1000, tz=datetime.timezone.utc)
        await redis.enqueue_job(TASK, f"{due}:{k}", _defer_until=at)

    await live(ARGS.n, ARGS.rate, ARGS.delay_min, ARGS.delay_max, submit)
    await redis.aclose()


async def roundtrip() -> None:
    redis = await connect()

    async def once(payload: str) -> Any:
        job = await redis.enqueue_job(TASK, payload)
        assert job is not None
        return await job.result()

    await round_trips(ARGS.n, ARGS.interval, once)
    await redis.aclose()


async def retry() -> None:
    redis = await connect()
    for i in range(ARGS.n):
        await redis.enqueue_job(TASK, str(i))
    clock = RetryClock(ARGS.n)

    async def task(ctx: Ctx, payload: str) -> None:
        clock.attempt()
        if ctx["job_try"] < ARGS.attempts:
            raise Retry(defer=0)
        ctx["failed"] = True
        raise RuntimeError("always fails")

    async def ended(ctx: Ctx) -> None:
        if ctx.get("failed"):
            clock.tick()

    worker = make_worker(task, redis, max_tries=ARGS.attempts, after_job_end=ended)
    clock.start()
    main = asyncio.create_task(worker.async_run())
    await clock.wait()
    worker.allow_pick_jobs = False
    while pending := [t for t in worker.tasks.values() if not t.done()]:
        await asyncio.wait(pending)
    worker.handle_sig(signal.SIGTERM)
    with contextlib.suppress(asyncio.CancelledError):
        await main
    await worker.close()
    emit(clock.result())


async def tick(ctx: Ctx) -> None:
    """The scheduled handler: report the tick named by the job id."""
    job_id: str = ctx["job_id"]
    ran(int(job_id.rsplit(":", 1)[1]) / 1000, job_id)


async def cron_ready(ctx: Ctx) -> None:
    say("ready")


class CronSettings:
    """The ``WorkerSettings`` arq's CLI runs in ``cron`` mode."""

    functions: ClassVar[list[Any]] = []
    cron_jobs: ClassVar[list[Any]] = [
        arq_cron(
            tick,
            name="cron:tick",
            second=set(range(0, 60, max(1, round(ARGS.every)))),
            microsecond=0,
        )
    ]
    redis_settings = RedisSettings.from_dsn(ARGS.url)
    queue_name = ARGS.queue
    max_jobs = ARGS.concurrency
    on_startup = cron_ready


def cron() -> None:
    if ARGS.role != "worker":
        return
    skew_clock()
    if ARGS.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from arq.cli import cli

    # The CLI imports the settings by name: make that name this very module.
    sys.modules["arq_peer"] = sys.modules["__main__"]
    cli.main(args=["arq_peer.CronSettings"], prog_name="arq")


MODES = {
    "enqueue": enqueue,
    "drain": drain,
    "worker": worker,
    "produce": produce,
    "schedule": schedule,
    "roundtrip": roundtrip,
    "retry": retry,
    "live": live_jobs,
}
if ARGS.mode == "cron":
    cron()
else:
    run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
