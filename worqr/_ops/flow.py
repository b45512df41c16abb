"""The writes of flow control (see `_layout.flow`): pause, resume, rate limits."""

from __future__ import annotations

from typing import Any

from .._errors import is_wrong_type, redis_boundary
from .._layout.flow import Flow, read_flow
from .._layout.keys import Keys
from .._redis.connections import Client, on_slot
from .commands import Command, _corrupt, _transaction, read
from .writes import event


async def _write(r: Client, keys: Keys, queue: str, commands: list[Command]) -> list[Any]:
    """Run flow writes and a ``flow:`` event (workers look at the queue again) in one
    transaction on the queue's server: safe to resend, they are idempotent."""
    wake: Command = ("PUBLISH", keys.events(queue), event("flow"))
    return await on_slot(r, keys.flow(queue), _transaction([*commands, wake]))


@redis_boundary
async def pause(r: Client, keys: Keys, queue: str) -> bool:
    """Pause a queue; whether it was running.

    1. MULTI;  HSET flow paused 1;  PUBLISH events flow:;  EXEC
    """
    replies = await _write(r, keys, queue, [("HSET", keys.flow(queue), "paused", 1)])
    _refuse_wrong(replies, keys.flow(queue))
    return bool(replies[0])


@redis_boundary
async def resume(r: Client, keys: Keys, queue: str) -> bool:
    """Resume a paused queue; whether it was paused. The ``work:`` event wakes the
    workers that wait on it.

    1. MULTI;  HDEL flow paused;  PUBLISH events flow:;  EXEC
    """
    replies = await _write(r, keys, queue, [("HDEL", keys.flow(queue), "paused")])
    _refuse_wrong(replies, keys.flow(queue))
    return bool(replies[0])


@redis_boundary
async def set_rate_limit(r: Client, keys: Keys, queue: str, limit: int | None, per_ms: int) -> None:
    """Set (or, with None, remove) a queue's rate limit. Removing it also drops the
    window's record of starts; a new limit counts the starts already recorded.

    1. MULTI;  HSET flow limit <limit> per <ms>    (or: HDEL flow limit per;  DEL starts)
       PUBLISH events flow:;  EXEC
    """
    flow = keys.flow(queue)
    commands: list[Command] = (
        [("HDEL", flow, "limit", "per"), ("DEL", keys.starts(queue))]
        if limit is None
        else [("HSET", flow, "limit", limit, "per", per_ms)]
    )
    _refuse_wrong(await _write(r, keys, queue, commands), flow)


@redis_boundary
async def get_flow(r: Client, keys: Keys, queue: str) -> Flow:
    """A queue's flow control.

    1. HMGET flow paused limit per
    """
    return Flow.parse(await read(r, *read_flow(keys, queue)), keys.flow(queue))


def _refuse_wrong(replies: list[Any], key: str) -> None:
    if any(is_wrong_type(reply) for reply in replies):
        raise _corrupt(key)
