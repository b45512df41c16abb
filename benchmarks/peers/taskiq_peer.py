"""The benchmark adapter for taskiq with taskiq-redis's RedisStreamBroker (see common.py).

The worker is taskiq's own ``Receiver``, built as the ``taskiq worker`` command builds
it, in this one process, with taskiq's defaults except ``max_async_tasks``, which is
``--concurrency``: ``max_prefetch=0`` (at most ``max_async_tasks`` deliveries held by
the receiver), parameter validation on, and ``ack_type=WHEN_SAVED``, so a message is
XACKed after its handler returns (there is no result backend to save to). The broker
itself reads up to ``xread_count=100`` entries per XREADGROUP (blocking 2 s), and
every ack is one XACK on a connection of its pool (``BlockingConnectionPool`` of 100).

Redelivery is the broker's default: after each non-empty read it XAUTOCLAIMs up to
100 entries that have been pending (unacked) for ``idle_timeout=600000`` ms, i.e. a
task whose worker was SIGKILLed is run again only after 10 minutes, and only by a
worker that is still receiving new messages.

The consumer group is created by ``broker.startup()`` at ``consumer_id="$"`` (the
stream's end), so entries added before the group exists are never delivered. The
producing modes therefore call ``startup()`` too (taskiq's normal client usage), which
creates the group before their first XADD; nothing else is changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from common import DrainClock, Schedule, emit, parse_args, run, say, started
from taskiq import AsyncTaskiqDecoratedTask
from taskiq.receiver import Receiver
from taskiq_redis import RedisStreamBroker

ARGS = parse_args()
BROKER = RedisStreamBroker(ARGS.url, queue_name=ARGS.queue)
TASK = "bench"
Handler = Callable[[str], Awaitable[None]]


async def enqueue() -> None:
    if ARGS.batch:
        emit({"unsupported": "taskiq has no batch enqueue; every kiq() is its own XADD"})
        return
    async with producing() as task:
        begun = time.perf_counter()
        for i in range(ARGS.n):
            await task.kiq(str(i))
        emit({"seconds": time.perf_counter() - begun})


async def drain() -> None:
    clock = DrainClock(ARGS.expect)

    async def handler(payload: str) -> None:
        clock.tick()

    async with consuming(handler, before=clock.start):
        await clock.wait()
    emit(clock.result())


async def worker() -> None:
    async def handler(payload: str) -> None:
        started(payload)
        if ARGS.hang:
            await asyncio.sleep(3600)

    # Once startup() has run, the group exists and any task added from now on waits
    # in the stream for the receiver, so the worker is ready.
    async with consuming(handler, before=lambda: say("ready")):
        await asyncio.sleep(3600)


async def produce() -> None:
    async with producing() as task:
        schedule = Schedule(ARGS.interval)
        for _ in range(ARGS.n):
            await task.kiq(repr(time.time()))
            await schedule.next()


async def noop(payload: str) -> None:
    """What producers register under the task's name; they never run it."""


@contextlib.asynccontextmanager
async def producing() -> AsyncIterator[AsyncTaskiqDecoratedTask[[str], Coroutine[Any, Any, None]]]:
    """The task to kick, with the broker started (and the group created) for the block."""
    task = BROKER.register_task(noop, TASK)
    await BROKER.startup()
    try:
        yield task
    finally:
        await BROKER.shutdown()


@contextlib.asynccontextmanager
async def consuming(handler: Handler, before: Callable[[], None]) -> AsyncIterator[None]:
    """Run a receiver over ``handler`` for the block, then stop it gracefully.

    ``before`` is called once the broker is started, just before the receiver is.
    """
    BROKER.register_task(handler, TASK)
    BROKER.is_worker_process = True
    await BROKER.startup()
    receiver = Receiver(BROKER, max_async_tasks=ARGS.concurrency, run_startup=False)
    finish = asyncio.Event()
    before()
    listening = asyncio.create_task(receiver.listen(finish))
    try:
        yield
    finally:
        # As on SIGTERM to `taskiq worker`: stop fetching, wait for running handlers.
        finish.set()
        await listening
        await BROKER.shutdown()


MODES = {"enqueue": enqueue, "drain": drain, "worker": worker, "produce": produce}
run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
