"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from worqr import Process, Worqr

FAST = {"heartbeat_interval": 0.1, "worker_timeout": 0.5, "cleanup_interval": 0.1}
"""Short intervals so that supervision tests run in well under a second."""

RELAXED = {**FAST, "worker_timeout": 5.0}
"""``make()``'s default: FAST's checks, but a lease that a busy machine's stall cannot
expire. A test whose claim is about expiry asks for ``make(**FAST)``."""

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


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], within: float = 5.0
) -> None:
    """Wait, bounded, until ``check()`` is true (polling the state, not sleeping blind)."""
    with anyio.fail_after(within):
        while True:
            outcome = check()
            if not isinstance(outcome, bool):
                outcome = await outcome
            if outcome:
                return
            await anyio.sleep(0.01)


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
