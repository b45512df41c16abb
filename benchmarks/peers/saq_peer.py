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

SAQ 0.26 has no bulk enqueue (``Queue.batch()`` only aborts a group's jobs on error,
``Queue.map()`` enqueues concurrently and waits for results), so ``enqueue --batch``
reports unsupported. Job keys default to uuid1, so every task is a new job.
saq 0.26.4 imports ``typing_extensions`` without declaring it: install it in the venv.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from common import DrainClock, Schedule, emit, parse_args, run, say, started
from saq import Worker
from saq.queue.redis import RedisQueue
from saq.types import Context

ARGS = parse_args()
TASK = "task"  # the function name jobs are enqueued under and registered as


async def connect() -> RedisQueue:
    queue = RedisQueue.from_url(ARGS.url, name=ARGS.queue)
    await queue.connect()
    return queue


def make_worker(task: Callable[..., Awaitable[None]], queue: RedisQueue) -> Worker[Context]:
    return Worker(queue, [(TASK, task)], concurrency=ARGS.concurrency)


async def blocked(queue: RedisQueue) -> int:
    """How many clients of the server wait in SAQ's blocking dequeue."""
    clients = await queue.redis.client_list()
    return sum(c.get("cmd") in ("blmove", "brpoplpush") for c in clients)


async def enqueue() -> None:
    if ARGS.batch:
        emit({"unsupported": "saq 0.26 has no bulk enqueue: one enqueue script call per job"})
        return
    queue = await connect()
    begun = time.perf_counter()
    for i in range(ARGS.n):
        await queue.enqueue(TASK, payload=str(i))
    emit({"seconds": time.perf_counter() - begun})
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
    async def task(ctx: Context, *, payload: str) -> None:
        started(payload)
        if ARGS.hang:
            await asyncio.sleep(3600)

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


MODES = {"enqueue": enqueue, "drain": drain, "worker": worker, "produce": produce}
run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
