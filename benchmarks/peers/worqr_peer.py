"""The benchmark adapter for worqr (see common.py for the modes)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from common import DrainClock, Schedule, emit, parse_args, run, say, started
from redis.asyncio import Redis

from worqr import Process, Worqr

ARGS = parse_args()
Handler = Callable[[Process], Awaitable[None]]
BATCH = 1000


async def enqueue() -> None:
    async with Worqr(Redis.from_url(ARGS.url)) as worqr:
        begun = time.perf_counter()
        if ARGS.batch:
            for first in range(0, ARGS.n, BATCH):
                last = min(ARGS.n, first + BATCH)
                await worqr.enqueue(ARGS.queue, [str(i) for i in range(first, last)])
        else:
            for i in range(ARGS.n):
                await worqr.enqueue(ARGS.queue, str(i))
        emit({"seconds": time.perf_counter() - begun})


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
    async def handler(process: Process) -> None:
        started(process.task)
        if ARGS.hang:
            await asyncio.sleep(3600)

    async with Worqr(Redis.from_url(ARGS.url)) as worqr:
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


MODES = {"enqueue": enqueue, "drain": drain, "worker": worker, "produce": produce, "fleet": fleet}
run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
