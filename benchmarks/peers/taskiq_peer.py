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

Jobs. taskiq's brokers have no delay of their own: a task runs later only through a
schedule source read by the separate ``taskiq scheduler`` process, which reloads its
sources every 60 s (``update_interval``) and sends what is due on ticks of 1 s
(taskiq-redis keys one-off schedules by the minute), so ``schedule`` and ``live`` report
unsupported rather than measure a lateness of up to a minute. ``roundtrip`` and
``worker --reply`` give the broker taskiq-redis's ``RedisAsyncResultBackend`` (a
result is only kept with one); the client waits with ``wait_result()``, which polls
``is_ready`` every ``check_interval=0.2`` s by default. ``retry`` adds taskiq's
``SimpleRetryMiddleware`` with ``default_retry_count=--attempts``, registers the task
with the ``retry_on_error`` label (a failed attempt is kicked again at once as a new
message), and counts a job in a middleware's ``post_save`` once its last attempt's
error result is saved (to the default backend, which keeps nothing: taskiq has no
failed list).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from common import (
    DrainClock,
    RetryClock,
    Schedule,
    calls,
    emit,
    parse_args,
    payload,
    round_trips,
    run,
    say,
    started,
)
from taskiq import (
    AsyncTaskiqDecoratedTask,
    SimpleRetryMiddleware,
    TaskiqMessage,
    TaskiqMiddleware,
    TaskiqResult,
)
from taskiq.receiver import Receiver
from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker

ARGS = parse_args()
BROKER = RedisStreamBroker(ARGS.url, queue_name=ARGS.queue)
if ARGS.reply or ARGS.mode == "roundtrip":
    BROKER = BROKER.with_result_backend(RedisAsyncResultBackend(ARGS.url))
TASK = "bench"
Handler = Callable[[str], Awaitable[str | None]]


async def enqueue() -> None:
    if ARGS.batch:
        emit({"unsupported": "taskiq has no batch enqueue; every kiq() is its own XADD"})
        return
    async with producing() as task:
        double = BROKER.register_task(noop_double, "double")

        async def call(i: int) -> None:
            if ARGS.calls:
                await double.kiq(i)
            else:
                await task.kiq(payload(i, ARGS.payload_bytes))

        emit({"seconds": await calls(ARGS.n, ARGS.callers, call)})


async def drain() -> None:
    clock = DrainClock(ARGS.expect)

    async def handler(payload: str) -> None:
        clock.tick()

    async with consuming(handler, before=clock.start):
        await clock.wait()
    emit(clock.result())


async def worker() -> None:
    async def handler(payload: str) -> str | None:
        started(payload)
        if ARGS.hang:
            await asyncio.sleep(3600)
        return payload if ARGS.reply else None

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


async def schedule() -> None:
    emit({"unsupported": "taskiq delays only through `taskiq scheduler` (60 s reload, 1 s ticks)"})


async def roundtrip() -> None:
    async with producing() as task:

        async def once(payload: str) -> Any:
            kicked = await task.kiq(payload)
            return (await kicked.wait_result()).return_value

        await round_trips(ARGS.n, ARGS.interval, once)


class Ended(TaskiqMiddleware):
    """Counts the jobs whose last attempt's error result was saved."""

    def __init__(self, clock: RetryClock) -> None:
        super().__init__()
        self.clock = clock

    def post_save(self, message: TaskiqMessage, result: TaskiqResult[Any]) -> None:
        if result.is_err:
            self.clock.tick()


async def retry() -> None:
    clock = RetryClock(ARGS.n)

    async def handler(payload: str) -> None:
        clock.attempt()
        raise RuntimeError("always fails")

    async def fill(task: AsyncTaskiqDecoratedTask[[str], Any]) -> None:
        for i in range(ARGS.n):
            await task.kiq(str(i))

    BROKER.add_middlewares(SimpleRetryMiddleware(default_retry_count=ARGS.attempts), Ended(clock))
    async with consuming(handler, before=clock.start, fill=fill, retry_on_error=True):
        await clock.wait()
    emit(clock.result())


async def noop(payload: str) -> None:
    """What producers register under the task's name; they never run it."""


async def noop_double(n: int) -> int:
    """What the producer registers as ``double`` to kick it (cli/taskiq_calls.py runs it)."""
    return 2 * n


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
async def consuming(
    handler: Handler,
    before: Callable[[], None],
    fill: Callable[[AsyncTaskiqDecoratedTask[[str], Any]], Awaitable[None]] | None = None,
    **labels: Any,
) -> AsyncIterator[None]:
    """Run a receiver over ``handler`` (registered with ``labels``) for the block,
    then stop it gracefully.

    ``fill`` (kicking the task) runs once the broker is started, then ``before`` is
    called, just before the receiver starts.
    """
    task = BROKER.register_task(handler, TASK, **labels)
    BROKER.is_worker_process = True
    await BROKER.startup()
    if fill is not None:
        await fill(task)
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


MODES = {
    "enqueue": enqueue,
    "drain": drain,
    "worker": worker,
    "produce": produce,
    "schedule": schedule,
    "roundtrip": roundtrip,
    "retry": retry,
    "live": schedule,
}
run(MODES[ARGS.mode], use_uvloop=ARGS.uvloop)
