"""Enqueue: plain tasks onto a queue's level lists, one, many, or unique.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from .._errors import BackendError, DuplicateTaskError, is_wrong_type, redis_boundary, translate
from .._layout.keys import Keys
from .._redis.connections import Client as Client
from .._redis.connections import on_slot, pinned
from .._redis.lane import Lane
from .commands import (
    Command,
    _corrupt,
    _in_order,
    _optimistic,
    _pipelined,
    _raise_wrong,
    _register_after,
    _wait,
    call,
    read,
)
from .writes import announce


@redis_boundary
async def enqueue(
    r: Client,
    keys: Keys,
    queue: str,
    tasks: Sequence[str],
    wait: tuple[int, int] | None = None,
    level: str = "normal",
) -> int | None:
    """Append tasks at the back of the queue's ``level`` list (``tasks`` for normal);
    with ``wait`` (replicas, timeout in ms), return how many replicas confirmed the
    push.

    The registry entry follows the push, so that a `delete_queue` racing it, which
    unregisters and then looks for tasks, cannot leave tasks in an unregistered queue.
    Keys: tasks (LIST), queues (SET). One round trip (two on a Cluster):
      1. RPUSH tasks task... (one command: all tasks or none)
      2. PUBLISH events work:<count>  (on the connection of 1: after the push)
      3. WAIT <replicas> <timeout>     (with ``wait``: on the connection of 1-2; WAIT is
                                        never resent)
      4. SADD queues queue
    """
    register: list[Command] = [("SADD", keys.queues, queue)]
    push: list[Command] = [
        ("RPUSH", keys.level(queue, level), *tasks),
        announce(keys, queue, level, len(tasks)),
    ]
    if wait is None:  # a wrong-typed registry fails only its SADD: check reports it
        replies = await _in_order(r, [(keys.tasks(queue), push), (keys.queues, register)])
        _raise_wrong(push, replies[:1])
        return None

    async def waited(node: Redis) -> int:
        async with pinned(node) as one:  # WAIT counts the writes of its own connection
            _raise_wrong(push, await _pipelined(one.client, push))
            return await _wait(one, wait)

    return await _register_after(r, keys, queue, on_slot(r, keys.tasks(queue), waited))


Push = tuple[str, str, Sequence[str]]


"""One `enqueue` call's push: (queue, level, tasks)."""


@redis_boundary
async def enqueue_many(lane: Lane, keys: Keys, pushes: Sequence[Push]) -> list[BackendError | None]:
    """Several callers' pushes (as `enqueue`'s, no ``wait``) in one round trip on
    ``lane`` (one server); each push's outcome, in order: None, or the error of its own
    commands.

    The pushes to one list become one RPUSH in call order (one event for them all),
    so each list gets its tasks as the calls one after the other would have given
    them. An error in place (WRONGTYPE, an ACL's NOPERM) fails only the calls whose
    commands it answered; the registry's, as in `enqueue`, every call but for WRONGTYPE.
    Keys: the level lists (LIST), queues (SET). One pipeline, one round trip:
      1. RPUSH <level> task...                 (each list the batch pushes to)
      2. PUBLISH events work:<count>           (after its list's push)
      3. SADD queues queue...                  (after every push, as in `enqueue`)
    """
    lists: dict[tuple[str, str], list[str]] = {}
    for queue, level, tasks in pushes:
        lists.setdefault((queue, level), []).extend(tasks)
    commands: list[Command] = []
    for (queue, level), tasks in lists.items():
        commands += [
            ("RPUSH", keys.level(queue, level), *tasks),
            announce(keys, queue, level, len(tasks)),
        ]
    commands.append(("SADD", keys.queues, *dict.fromkeys(queue for queue, _, _ in pushes)))
    replies = await lane.round_trip(commands)
    failed: dict[tuple[str, str], ResponseError] = {}
    for index, pushed in enumerate(lists):
        pushed_reply, event_reply = replies[2 * index], replies[2 * index + 1]
        for reply in (pushed_reply, event_reply):
            if isinstance(reply, ResponseError):
                failed[pushed] = reply
                break
    registry = replies[-1]
    if not isinstance(registry, ResponseError) or is_wrong_type(registry):
        registry = None  # a wrong-typed registry: check() reports it
    outcomes: list[BackendError | None] = []
    for queue, level, _ in pushes:
        reply = failed.get((queue, level), registry)
        if reply is None:
            outcomes.append(None)
            continue
        error = _corrupt(keys.level(queue, level)) if is_wrong_type(reply) else translate(reply)
        error.__cause__ = reply
        outcomes.append(error)
    return outcomes


@redis_boundary
async def enqueue_unique(
    r: Client,
    keys: Keys,
    queue: str,
    tasks: Sequence[str],
    wait: tuple[int, int] | None = None,
    level: str = "normal",
) -> int | None:
    """Append tasks that must not already hold a unique mark in this queue; with
    ``wait``, as `enqueue`.

    WATCH is needed: two producers must not both see "absent" and both push.
    Keys: unique (SET), tasks (LIST), queues (SET).
      1. WATCH unique
      2. SMISMEMBER unique task...      -> any present: UNWATCH, raise DuplicateTaskError
      3. MULTI
      4. RPUSH tasks task...
      5. SADD unique task...
      6. PUBLISH events work:<count>
      7. EXEC                            -> nil (unique changed): back to 1
      8. WAIT <replicas> <timeout>       (with ``wait``; on the connection of 1-7)
      9. SADD queues queue               (after the push, as in `enqueue`)
    """
    if len(set(tasks)) != len(tasks):
        raise DuplicateTaskError("the same unique task appears twice in one enqueue")

    async def body(pipe: Pipeline) -> None:
        present = await read(pipe, "SMISMEMBER", keys.unique(queue), *tasks)
        taken = [task for task, flag in zip(tasks, present, strict=True) if flag]
        if taken:
            await pipe.reset()
            raise DuplicateTaskError(
                f"unique task already queued or in process in {queue!r}: {taken[0]!r}"
            )
        pipe.multi()
        pipe.execute_command("RPUSH", keys.level(queue, level), *tasks)
        pipe.execute_command("SADD", keys.unique(queue), *tasks)
        pipe.execute_command(*announce(keys, queue, level, len(tasks)))

    async def pushed(client: Client) -> None:
        _, replies = await _optimistic(client, [keys.unique(queue)], body)
        if is_wrong_type(replies[0]):  # tasks is no list: withdraw the marks just set
            await call(client, "SREM", keys.unique(queue), *tasks)
            raise _corrupt(keys.level(queue, level))

    async def waited(node: Redis, wait: tuple[int, int]) -> int:
        async with pinned(node) as one:  # WAIT counts the writes of its own connection
            await pushed(one.client)
            return await _wait(one, wait)

    if wait is None:
        await _register_after(r, keys, queue, pushed(r))
        return None
    return await _register_after(
        r, keys, queue, on_slot(r, keys.unique(queue), functools.partial(waited, wait=wait))
    )
