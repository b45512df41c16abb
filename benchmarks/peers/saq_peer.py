"""The benchmark adapter for SAQ 0.26 (see common.py for the modes).

SAQ's own ``Worker`` runs in-process on a ``RedisQueue`` (``from_url``) the way
SAQ's CLI runs it (``queue.connect()``, ``worker.start()``, ``queue.disconnect()``),
with ``concurrency=--concurrency`` and every other setting left at its default. These
defaults matter for the figures:

* ``dequeue_timeout=0``: each of the ``concurrency`` slots waits in a blocking BLMOVE
  on its own Redis connection, so a task starts with no polling delay.
* upkeep timers: schedule 1 s, abort check 1 s, worker info 10 s, sweep 60 s.
* job defaults: ``timeout=10`` (a handler is cancelled after 10 s, so a ``--hang``
  task fails then), ``retries=1`` (a single attempt), ``ttl=600`` (a finished job is
  kept for 10 min).
* recovery: a job whose worker was SIGKILLed stays in the active list until a sweep
  (each worker runs one at start and every 60 s, at most one a minute per queue
  through a 60 s lock key) finds it past its 10 s timeout; as ``retries=1`` allows no
  second attempt, the sweep marks it aborted and the task is never run again.
* ``shutdown_grace_period_s=None``: stopping cancels running jobs at once.

Jobs. ``schedule`` enqueues with ``scheduled=`` the due time in Unix seconds (ms
precision: SAQ keeps it as the score of its ``incomplete`` sorted set and compares it
with ``time.time()``, and its own retries store fractional times there too),
`SUBMITTERS` calls at a time. A worker moves due jobs to the queue in its
``schedule`` upkeep timer, every 1 s (``timers["schedule"]``), under a 1 s lock
shared by the workers of the queue, so lateness is up to about 1 s. ``live``
enqueues with ``scheduled=`` too, one ``enqueue`` per job. ``roundtrip``
is ``enqueue`` then ``job.refresh(until_complete=...)``, which waits for the job's
status on a pub/sub channel (``Queue.apply``, the other way, polls the job every
``poll_interval=0.5`` s and sleeps once more after the result: about 1 s a call).
``retry`` enqueues with ``retries=--attempts`` (``retry_delay`` 0: a failed attempt
goes straight back to the queue) and counts a job in an ``after_process`` hook
once SAQ has finished it as failed.

Schedules. ``cron`` runs SAQ's own CLI (``saq saq_peer.cron_settings``, its ``main``
called in this process after `skew_clock` and, with ``--uvloop``, uvloop's event
loop policy, which the loop the CLI makes follows) with one ``CronJob`` firing every
``--every`` seconds (a six-field croniter expression, seconds last; ``unique=True``
and the other options at their defaults) and ``concurrency=--concurrency``. Every
worker's ``schedule`` upkeep timer (1 s) enqueues the next tick under the fixed key
``cron:tick`` with ``scheduled`` set to the tick's Unix second, a no-op while that
key's job is still incomplete, then moves due jobs to the queue under a 1 s lock.
The tick is read back from the job's ``scheduled`` field. ``--role setup`` does
nothing: the schedule lives in each worker's settings.

Web. ``web`` runs SAQ's CLI with ``--web --port`` (``saq saq_peer.web_settings --web``,
as ``cron`` runs it): SAQ's aiohttp app (its routes: the queues' info, a job's status,
retry and abort) served by the same process as a worker of ``--queue`` at
``--concurrency``. Its ``startup`` hook enqueues one job under the key ``bench-read``,
1 s later (SAQ's first sweep, at start, aborts a job it finds active then).

SAQ 0.26 has no bulk enqueue (``Queue.batch()`` only aborts a group's jobs on error,
``Queue.map()`` enqueues concurrently and waits for results), so ``enqueue --batch``
reports unsupported. Job keys default to uuid1, so every task is a new job.
saq 0.26.4 imports ``typing_extensions`` without declaring it: install it in the venv.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from common import (
    DrainClock,
    RetryClock,
    Schedule,
    calls,
    cron_fields,
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
from saq import CronJob, Status, Worker
from saq.queue.redis import RedisQueue
from saq.types import Context

ARGS = parse_args()
TASK = "task"  # the function name jobs are enqueued under and registered as
SUBMITTERS = 32  # enqueue calls in flight while filling the delayed set
ROUND_TRIP_LIMIT = 10.0  # seconds a round trip waits for its job at most


async def connect() -> RedisQueue:
    queue = RedisQueue.from_url(ARGS.url, name=ARGS.queue)
    await queue.connect()
    return queue


def make_worker(
    task: Callable[..., Awaitable[str | None]], queue: RedisQueue, **hooks: Any
) -> Worker[Context]:
    return Worker(queue, [(TASK, task)], concurrency=ARGS.concurrency, **hooks)


async def blocked(queue: RedisQueue) -> int:
    """How many clients of the server wait in SAQ's blocking dequeue."""
    clients = await queue.redis.client_list()
    return sum(c.get("cmd") in ("blmove", "brpoplpush") for c in clients)


async def enqueue() -> None:
    if ARGS.batch:
        emit({"unsupported": "saq 0.26 has no bulk enqueue: one enqueue script call per job"})
        return
    queue = await connect()

    async def call(i: int) -> None:
        if ARGS.calls:
            await queue.enqueue("double", n=i)
        else:
            await queue.enqueue(TASK, payload=payload(i, ARGS.payload_bytes))

    emit({"seconds": await calls(ARGS.n, ARGS.callers, call)})
    await queue.disconnect()


async def drain() -> None:
    clock = DrainClock(ARGS.expect)

    async def task(ctx: Context, *, payload: str) -> None:
        clock.tick()

    queue = await connect()
    worker = make_worker(task, queue)
    clock.start()
    main = asyncio.create_task(worker.start())
    await clock.wait()
    # stop() cancels running jobs at once: let those in flight record their end first.
    while worker.job_task_contexts:  # noqa: ASYNC110 (SAQ offers no event for this)
        await asyncio.sleep(0.01)
    await worker.stop()
    await main
    await queue.disconnect()
    emit(clock.result())


async def worker() -> None:
    async def task(ctx: Context, *, payload: str) -> str | None:
        started(payload)
        if ARGS.hang:
            await asyncio.sleep(3600)
        return payload if ARGS.reply else None

    queue = await connect()
    saq_worker = make_worker(task, queue)
    main = asyncio.create_task(saq_worker.start())
    # start() has no hook for this: wait until its slots all block in a dequeue.
    while await blocked(queue) < ARGS.concurrency:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    say("ready")
    await main  # returns on SIGINT/SIGTERM
    await queue.disconnect()


async def produce() -> None:
    queue = await connect()
    schedule = Schedule(ARGS.interval)
    for _ in range(ARGS.n):
        await queue.enqueue(TASK, payload=repr(time.time()))
        await schedule.next()
    await queue.disconnect()


async def schedule() -> None:
    queue = await connect()
    dues = due_times(ARGS.n, ARGS.rate, ARGS.lead)
    todo = list(range(ARGS.n))

    async def submitter() -> None:
        while todo:
            k = todo.pop()
            await queue.enqueue(TASK, payload=f"{dues[k]}:{k}", scheduled=dues[k] / 1000)

    await asyncio.gather(*(submitter() for _ in range(SUBMITTERS)))
    scheduled(dues, time.time())
    await queue.disconnect()


async def live_jobs() -> None:
    queue = await connect()

    async def submit(k: int, due: int) -> None:
        await queue.enqueue(TASK, payload=f"{due}:{k}", scheduled=due / 1000)

    await live(ARGS.n, ARGS.rate, ARGS.delay_min, ARGS.delay_max, submit)
    await queue.disconnect()


async def roundtrip() -> None:
    queue = await connect()

    async def once(payload: str) -> Any:
        job = await queue.enqueue(TASK, payload=payload)
        assert job is not None
        await job.refresh(until_complete=ROUND_TRIP_LIMIT)
        return job.result

    await round_trips(ARGS.n, ARGS.interval, once)
    await queue.disconnect()


async def retry() -> None:
    queue = await connect()
    for i in range(ARGS.n):
        await queue.enqueue(TASK, payload=str(i), retries=ARGS.attempts)
    clock = RetryClock(ARGS.n)

    async def task(ctx: Context, *, payload: str) -> None:
        clock.attempt()
        raise RuntimeError("always fails")

    async def ended(ctx: Context) -> None:
        job = ctx.get("job")
        if job is not None and job.status == Status.FAILED:
            clock.tick()

    worker = make_worker(task, queue, after_process=ended)
    clock.start()
    main = asyncio.create_task(worker.start())
    await clock.wait()
    while worker.job_task_contexts:  # noqa: ASYNC110 (as in drain)
        await asyncio.sleep(0.01)
    await worker.stop()
    await main
    await queue.disconnect()
    emit(clock.result())


async def tick(ctx: Context) -> None:
    """The scheduled handler: report the tick named by the job's ``scheduled`` field."""
    job = ctx["job"]
    ran(float(job.scheduled), f"{job.key}@{job.scheduled}")


async def cron_ready(ctx: Context) -> None:
    say("ready")


def cron_settings() -> dict[str, Any]:
    """The settings SAQ's CLI runs in ``cron`` mode."""
    return {
        "queue": RedisQueue.from_url(ARGS.url, name=ARGS.queue),
        "functions": [],
        "cron_jobs": [CronJob(tick, cron=cron_fields(ARGS.every))],
        "concurrency": ARGS.concurrency,
        "startup": cron_ready,
    }


def cron() -> None:
    if ARGS.role != "worker":
        return
    skew_clock()
    cli("saq_peer.cron_settings")


async def noop(ctx: Context, **kwargs: Any) -> None:
    """The web mode's handler."""


LATER: set[asyncio.Task[None]] = set()


async def web_ready(ctx: Context) -> None:
    async def read_job() -> None:
        # After the worker's first sweep, which aborts a job it finds active at start.
        await asyncio.sleep(1.0)
        await ctx["worker"].queue.enqueue(TASK, key="bench-read")

    task = asyncio.create_task(read_job())
    LATER.add(task)
    task.add_done_callback(LATER.discard)
    say("ready")


def web_settings() -> dict[str, Any]:
    """The settings SAQ's CLI runs in ``web`` mode."""
    return {
        "queue": RedisQueue.from_url(ARGS.url, name=ARGS.queue),
        "functions": [(TASK, noop)],
        "concurrency": ARGS.concurrency,
        "startup": web_ready,
    }


def web() -> None:
    cli("saq_peer.web_settings", "--web", "--port", str(ARGS.port))


def cli(settings: str, *args: str) -> None:
    """Run SAQ's CLI in this process on ``settings`` (under uvloop with ``--uvloop``)."""
    if ARGS.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    from saq.__main__ import main

    # The CLI imports the settings by name: make that name this very module.
    sys.modules["saq_peer"] = sys.modules["__main__"]
    sys.argv = ["saq", settings, *args]
    main()


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
elif ARGS.mode == "web":
    web()
else:
    run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
