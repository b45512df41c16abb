"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypedDict

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr


class Intervals(TypedDict):
    """The supervision intervals of `Worqr` (its keyword arguments of the same names)."""

    heartbeat_interval: float
    worker_timeout: float
    cleanup_interval: float


FAST: Intervals = {"heartbeat_interval": 0.1, "worker_timeout": 0.5, "cleanup_interval": 0.1}
"""Short intervals so that supervision tests run in well under a second."""

RELAXED: Intervals = {**FAST, "worker_timeout": 5.0}
"""``make()``'s default: FAST's checks, but a lease that a busy machine's stall cannot
expire. A test whose claim is about expiry asks for ``make(**FAST)``."""

STEADY: dict[str, float] = {"worker_timeout": 30.0}
"""For peers of tests whose claim is not about leases: a lease no stall of a machine
kept busy by other work expires (a fenced worker runs its tasks again, by design)."""

Factory = Callable[..., Worqr]
Handler = Callable[[Process], Awaitable[str | None]]


@contextlib.asynccontextmanager
async def consuming(
    worker: Worqr,
    handler: Handler,
    *,
    queue: str,
    concurrency: int = 1,
    priority: str = "weighted",
) -> AsyncIterator[None]:
    """``worker.consume(queue, handler)`` for the length of the block."""
    consume = functools.partial(
        worker.consume, queue, handler, concurrency=concurrency, priority=priority
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        yield
        tg.cancel_scope.cancel()


def texts(replies: Iterable[object]) -> list[str]:
    """A decoding client's replies, as the strs they are (redis-py's types allow bytes)."""
    decoded: list[str] = []
    for reply in replies:
        assert isinstance(reply, str), reply
        decoded.append(reply)
    return decoded


def scored(replies: Iterable[object]) -> list[tuple[str, float]]:
    """A decoding client's ``withscores`` replies, as the (member, score) pairs they are."""
    pairs: list[tuple[str, float]] = []
    for reply in replies:
        assert isinstance(reply, tuple | list) and len(reply) == 2, reply
        member, score = reply
        assert isinstance(member, str) and isinstance(score, float), reply
        pairs.append((member, score))
    return pairs


async def eventually(
    check: Callable[[], Awaitable[object]] | Callable[[], bool], within: float = 20.0
) -> None:
    """Wait, bounded, until ``check()`` is true (polling the state, not sleeping blind);
    an async ``check``'s result counts by its truth (a count, a found object). The
    bound is generous: it only says when to give up on a busy machine, and a check that
    holds returns at once."""
    with anyio.fail_after(within):
        while True:
            outcome = check()
            reached = outcome if isinstance(outcome, bool) else await outcome
            if reached:
                return
            await anyio.sleep(0.01)


async def progressing(
    count: Callable[[], int], goal: int, *, stall: float = 30.0, within: float = 600.0
) -> None:
    """Wait until ``count()`` reaches ``goal``, for as long as it keeps growing: give up
    (TimeoutError) only once it has not grown for ``stall`` seconds, or after ``within``
    in all. A busy machine slows a fleet down without stopping it; a lost task stops
    the count for good."""
    started = last_change = time.monotonic()
    seen = count()
    while seen < goal:
        now = time.monotonic()
        if now - last_change > stall or now - started > within:
            raise TimeoutError(f"stuck at {seen} of {goal}")
        await anyio.sleep(0.05)
        current = count()
        if current != seen:
            seen, last_change = current, time.monotonic()


async def raw_keys(redis: Redis, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` with its type and value, for asserting raw state."""
    state: dict[str, Any] = {}
    async for key in redis.scan_iter(match=f"{prefix}:*"):
        kind = await redis.type(key)
        if kind == "list":
            state[key] = await redis.lrange(key, 0, -1)
        elif kind == "set":
            state[key] = sorted(await redis.smembers(key))
        elif kind == "zset":
            state[key] = await redis.zrange(key, 0, -1)
        elif kind == "hash":
            state[key] = await redis.hgetall(key)
        else:
            state[key] = await redis.get(key)
    return state


def reap(child: subprocess.Popen[str]) -> None:
    """Kill a child process if it still runs, wait for it and close its stdout."""
    if child.poll() is None:
        child.kill()
    child.wait(5)
    if child.stdout is not None:
        child.stdout.close()


def patch_everywhere(monkeypatch: pytest.MonkeyPatch, original: object, replacement: object) -> int:
    """Replace ``original`` by ``replacement`` in every worqr module that imported it by
    name (each caller looks a function up in its own module); in how many modules."""
    count = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "worqr" or name.startswith("worqr.")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is original:
                monkeypatch.setattr(module, attribute, replacement)
                count += 1
    assert count, f"no worqr module holds {original!r}"
    return count


async def works_on(watcher: Worqr, queues: Sequence[str], worker_id: str | None = None) -> bool:
    """Whether Redis says that ``worker_id`` (``watcher``'s own by default) works on
    exactly ``queues``."""
    return sorted(await watcher.get_working_queues(worker_id)) == sorted(queues)
