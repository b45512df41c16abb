"""The benchmark adapter for BullMQ's Python port, ``bullmq`` (see common.py for the modes).

Tasks are jobs named ``task`` whose data is ``{"payload": str}``. ``enqueue`` adds them
with ``Queue.add``, or with ``--batch`` with ``Queue.addBulk`` (one MULTI pipeline of
``addStandardJob`` scripts) in chunks of `BATCH`. The worker is ``bullmq.Worker`` with
``concurrency`` from ``--concurrency`` and every other option at its default:

- ``lockDuration`` 30 000 ms (renewed every ``lockRenewTime`` = 15 000 ms) and
  ``stalledInterval`` 30 000 ms, ``maxStalledCount`` 1. After a SIGKILL the dead
  worker's lock expires within 30 s; a surviving worker's stalled check, every 30 s
  from its start, first marks the active job and at the next run, once the lock is
  gone, moves it back to ``wait``: recovery takes 30-60 s (up to 90 s if the lock
  had just been renewed), and a job stalled twice fails.
- ``removeOnComplete``/``removeOnFail`` unset: finished jobs stay in Redis (hash
  plus ``completed`` zset entry). Kept as the default: removing them costs about as
  much per job as recording them, so it does not change what a drain measures; Redis
  memory grows with every run, so the suite should flush between runs.
- ``drainDelay`` 5 s: the idle worker blocks in BZPOPMIN on the queue's marker key
  for up to 5 s, and is woken by every add, so it does not delay pickup.

Every job also appends to the queue's events stream (XADD, capped near 10 000).

Jobs. ``schedule`` adds with ``addBulk`` in chunks of `BATCH`, each job with the
``delay`` option (due at its ``timestamp`` + ``delay``, by the producer's clock; the
adapter passes ``timestamp`` too, so that the due time is exactly the one asked for,
not the one of a millisecond later). An idle worker blocks in BZPOPMIN on the queue's
marker key until the next delayed job's due time, and is woken by each add. bullmq
3.4.4 rounds that timeout up to whole seconds: it checks ``canDoubleTimeout`` on the
worker's blocking connection, whose capabilities keep their default (False) because
the Redis version is only ever read on the other connection. A delayed job therefore
starts up to 1 s after it is due, as if polled every second. ``live`` adds with
``Queue.add``, one call per job, with ``delay`` and ``timestamp`` as ``schedule``
does. ``roundtrip`` adds a job and waits for
its ``completed`` event from a ``QueueEvents`` (a blocking XREAD on the events
stream): the Python port has no ``waitUntilFinished``, so this is the pattern it
stands for in Node. ``retry`` adds with ``attempts=--attempts`` and no ``backoff`` (a
failed attempt goes straight back to ``wait``) and reads ``getFailedCount()`` (ZCARD
of the ``failed`` set) every few milliseconds.

Schedules. BullMQ's Python port has no CLI: ``cron`` runs ``bullmq.Worker`` in this
process as ``worker`` does (after `skew_clock`), under uvloop with ``--uvloop``.
The schedule is a job scheduler, ``Queue.upsertJobScheduler("tick", {"every": ms})``,
stored once in Redis by ``--role setup`` before any worker starts (a scheduler
record plus one delayed job for its next iteration); a worker that takes an
iteration's job materializes the next one in the same step. Iterations of ``every``
fall on multiples of it since the epoch, and each job's id is
``repeat:tick:<tick Unix ms>``, from which the tick is read back.

The venv pins redis-py below 8: from 8.0 its default ``socket_timeout`` is 5 s, equal
to ``drainDelay``, so an idle worker's BZPOPMIN times out on the client and redis-py
retries with backoff growing to 20 s, during which new jobs wait.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bullmq import Job, Queue, QueueEvents, Worker  # type: ignore[import-untyped]
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
BATCH = 1000
NAME = "task"


def connection() -> dict[str, Any]:
    return {"connection": ARGS.url}


def task(payload: str) -> dict[str, Any]:
    return {"name": NAME, "data": {"payload": payload}}


async def enqueue() -> None:
    queue = Queue(ARGS.queue, connection())
    begun = time.perf_counter()
    if ARGS.batch:
        for first in range(0, ARGS.n, BATCH):
            last = min(ARGS.n, first + BATCH)
            await queue.addBulk([task(payload(i, ARGS.payload_bytes)) for i in range(first, last)])
        seconds = time.perf_counter() - begun
    else:

        async def call(i: int) -> None:
            await queue.add(NAME, {"payload": payload(i, ARGS.payload_bytes)})

        seconds = await calls(ARGS.n, ARGS.callers, call)
    emit({"seconds": seconds})
    await queue.close()


async def drain() -> None:
    clock = DrainClock(ARGS.expect)

    async def process(job: Job, token: str) -> None:
        clock.tick()

    worker = Worker(ARGS.queue, process, {**connection(), "concurrency": ARGS.concurrency})
    clock.start()
    await clock.wait()
    await worker.close()
    emit(clock.result())


async def worker() -> None:
    async def process(job: Job, token: str) -> str | None:
        started(job.data["payload"])
        if ARGS.hang:
            await asyncio.sleep(3600)
        return job.data["payload"] if ARGS.reply else None

    # The worker starts its loop as a background task and signals nothing when it has
    # connected: poll its flag.
    consumer = Worker(ARGS.queue, process, {**connection(), "concurrency": ARGS.concurrency})
    while not consumer.running:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    say("ready")
    await asyncio.sleep(3600)


async def produce() -> None:
    queue = Queue(ARGS.queue, connection())
    schedule = Schedule(ARGS.interval)
    for _ in range(ARGS.n):
        await queue.add(NAME, {"payload": repr(time.time())})
        await schedule.next()
    await queue.close()


async def schedule() -> None:
    queue = Queue(ARGS.queue, connection())
    dues = due_times(ARGS.n, ARGS.rate, ARGS.lead)
    for first in range(0, ARGS.n, BATCH):
        now = round(time.time() * 1000)
        jobs = [
            {**task(f"{dues[k]}:{k}"), "opts": {"timestamp": now, "delay": dues[k] - now}}
            for k in range(first, min(ARGS.n, first + BATCH))
        ]
        await queue.addBulk(jobs)
    scheduled(dues, time.time())
    await queue.close()


async def live_jobs() -> None:
    queue = Queue(ARGS.queue, connection())

    async def submit(k: int, due: int) -> None:
        now = round(time.time() * 1000)
        await queue.add(NAME, {"payload": f"{due}:{k}"}, {"timestamp": now, "delay": due - now})

    await live(ARGS.n, ARGS.rate, ARGS.delay_min, ARGS.delay_max, submit)
    await queue.close()


async def roundtrip() -> None:
    queue = Queue(ARGS.queue, connection())
    events = QueueEvents(ARGS.queue, connection())
    while not events.running:  # noqa: ASYNC110 (it signals nothing when it reads)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # its first XREAD (from "$") is sent by now
    ended: dict[str, asyncio.Future[Any]] = {}

    def future(job_id: str) -> asyncio.Future[Any]:
        return ended.setdefault(job_id, asyncio.get_running_loop().create_future())

    def completed(args: dict[str, Any], entry: str) -> None:
        found = future(args["jobId"])
        if not found.done():
            found.set_result(args.get("returnvalue"))

    events.on("completed", completed)

    async def once(payload: str) -> Any:
        job = await queue.add(NAME, {"payload": payload})
        return await future(job.id)

    await round_trips(ARGS.n, ARGS.interval, once)
    await events.close()
    await queue.close()


async def retry() -> None:
    queue = Queue(ARGS.queue, connection())
    for first in range(0, ARGS.n, BATCH):
        last = min(ARGS.n, first + BATCH)
        await queue.addBulk(
            [{**task(str(i)), "opts": {"attempts": ARGS.attempts}} for i in range(first, last)]
        )
    clock = RetryClock(ARGS.n)

    async def process(job: Job, token: str) -> None:
        clock.attempt()
        raise RuntimeError("always fails")

    async def failed() -> int:
        return int(await queue.getFailedCount())

    clock.start()
    worker = Worker(ARGS.queue, process, {**connection(), "concurrency": ARGS.concurrency})
    await clock.poll(failed)
    await worker.close()
    await queue.close()
    emit(clock.result())


SCHEDULER = "tick"


async def cron() -> None:
    skew_clock()
    if ARGS.role == "setup":
        queue = Queue(ARGS.queue, connection())
        await queue.upsertJobScheduler(SCHEDULER, {"every": round(ARGS.every * 1000)}, NAME)
        await queue.close()
        return
    if ARGS.role != "worker":
        return

    async def process(job: Job, token: str) -> None:
        ran(int(job.id.rsplit(":", 1)[1]) / 1000, job.id)

    consumer = Worker(ARGS.queue, process, {**connection(), "concurrency": ARGS.concurrency})
    while not consumer.running:  # noqa: ASYNC110 (as in worker)
        await asyncio.sleep(0.01)
    say("ready")
    await asyncio.sleep(24 * 3600)


MODES = {
    "enqueue": enqueue,
    "drain": drain,
    "worker": worker,
    "produce": produce,
    "schedule": schedule,
    "roundtrip": roundtrip,
    "retry": retry,
    "live": live_jobs,
    "cron": cron,
}
run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
