"""The atomic operations: the only code that writes to Redis.

One function per transition. Each docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/. Every MULTI/EXEC block
touches the keys of one hash slot and runs on the server of that slot (`on_slot`);
registry updates (other slots) are separate single-key commands ordered so that a
crash between them loses nothing (docs/diagrams/cluster.md gives the argument).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._connections import Client as Client
from ._connections import Pinned, on_slot, pinned
from ._errors import (
    BackendError,
    BackendUnavailableError,
    CorruptDataError,
    DuplicateTaskError,
    InvalidProcessIdError,
    ReplicationError,
    is_wrong_type,
    redis_boundary,
)
from ._keys import Keys
from ._models import FailedTask, Process, WorkerInfo, readable
from ._names import ProcessRef, new_process_id, parse_process_id, split_process_id

_T = TypeVar("_T")
_MAX_ATTEMPTS = 100

Command = tuple[str | int | float, ...]


def text(value: bytes | str) -> str:
    """A Redis reply as str, whatever the client's ``decode_responses``: bytes that
    are not valid UTF-8 become lone surrogates, as worqr's own clients decode them, so
    that writing the str back stores the same bytes (see `_models.readable`)."""
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def stored(task: str) -> str | bytes:
    """A task read from Redis, as it goes back to Redis: its original bytes when they
    were not valid UTF-8 (so that no client's strict encoder meets the surrogates)."""
    return task if readable(task) else task.encode("utf-8", "surrogateescape")


def wrong_keys(commands: Sequence[Command], replies: Sequence[Any]) -> list[str]:
    """The keys (first arguments) of the commands whose reply is a WRONGTYPE error."""
    return [
        str(command[1])
        for command, reply in zip(commands, replies, strict=False)
        if is_wrong_type(reply)
    ]


def _unless_wrong(replies: list[Any]) -> list[Any]:
    """Replies of a pipeline run with ``raise_on_error=False``: an error other than
    WRONGTYPE is raised; WRONGTYPE replies stay in place for the caller to isolate."""
    for reply in replies:
        if isinstance(reply, ResponseError) and not is_wrong_type(reply):
            raise reply
    return replies


async def reads(r: Client, commands: Sequence[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order, a
    wrong-typed key's WRONGTYPE error in its place (so one bad key spoils nothing else)."""
    if not commands:
        return []
    async with r.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return _unless_wrong(await pipe.execute(raise_on_error=False))


async def read(client: Client | Pipeline, *command: str | int | float) -> Any:
    """`call` for a read of a layout key: a WRONGTYPE reply raises `CorruptDataError`
    naming the key."""
    try:
        return await call(client, *command)
    except ResponseError as exc:
        if is_wrong_type(exc):
            raise _corrupt(str(command[1])) from exc
        raise


def _corrupt(key: str, found: str | None = None) -> CorruptDataError:
    what = f"a {found}" if found else "of another type"
    return CorruptDataError(f"{key} is {what} than worqr's layout gives it", key)


async def _require(pipe: Pipeline, key: str, kind: str) -> None:
    """In a WATCHed pipeline: raise `CorruptDataError` unless ``key`` is a ``kind``
    or absent (for a key whose failed write inside MULTI would lose a task)."""
    found = text(await call(pipe, "TYPE", key))
    if found not in (kind, "none"):
        await pipe.reset()
        raise _corrupt(key, found)


def _raise_wrong(commands: Sequence[Command], replies: Sequence[Any]) -> None:
    """Raise `CorruptDataError` for the first command whose reply is WRONGTYPE."""
    bad = wrong_keys(commands, replies)
    if bad:
        raise _corrupt(bad[0])


def members(reply: Any) -> list[str]:
    """A SMEMBERS reply as sorted strs; a wrong-typed key's reply as no members."""
    if is_wrong_type(reply):
        return []
    return sorted(text(m) for m in reply)


def event(kind: str, message: str = "") -> str:
    """The wire form of an event on a queue's channel."""
    return f"{kind}:{message}"


DONE_FIELD_LIMIT = 65_536
"""Characters of a task or result that a ``done`` record carries: a message over
Redis's pub/sub output-buffer limit (32 MB by default) would disconnect every
listener, and the ``cancel`` and ``delete`` events behind it would be lost."""
_DONE_MESSAGE_LIMIT = 1 << 20  # characters of records one ``done`` message carries


def done_record(process_id: str, worker_id: str, task: str, result: str | None) -> str:
    """One finished process, as JSON; a ``done`` message is a JSON array of these. A
    task or result longer than `DONE_FIELD_LIMIT` is cut there, with ``"truncated":
    true``."""
    record: dict[str, Any] = {
        "process_id": process_id,
        "worker_id": worker_id,
        "task": task[:DONE_FIELD_LIMIT],
        "result": None if result is None else result[:DONE_FIELD_LIMIT],
    }
    if len(task) > DONE_FIELD_LIMIT or len(result or "") > DONE_FIELD_LIMIT:
        record["truncated"] = True
    return json.dumps(record)


def done_messages(records: Sequence[str]) -> list[str]:
    """``done`` messages carrying the records, each at most about a megabyte."""
    messages: list[str] = []
    batch: list[str] = []
    size = 0
    for record in records:
        if batch and size + len(record) > _DONE_MESSAGE_LIMIT:
            messages.append(event("done", f"[{','.join(batch)}]"))
            batch, size = [], 0
        batch.append(record)
        size += len(record) + 1
    if batch:
        messages.append(event("done", f"[{','.join(batch)}]"))
    return messages


async def call(client: Client | Pipeline, *args: str | int | float) -> Any:
    """Run one command now and return its raw reply."""
    return await cast("Awaitable[Any]", client.execute_command(*args))


async def _pipelined(client: Redis, commands: Iterable[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order."""
    async with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return _unless_wrong(await pipe.execute(raise_on_error=False))


async def _in_order(r: Client, groups: Sequence[tuple[str, Sequence[Command]]]) -> list[Any]:
    """Run groups of commands, each group applied after the one before it and each on
    the server of its key's slot; the replies of all, in order (WRONGTYPE in place).

    On one server the groups go in one pipeline (one connection keeps the order), in
    one round trip; on a Cluster each group is a round trip of its own.
    """
    if isinstance(r, Redis):
        return await _pipelined(r, [command for _, commands in groups for command in commands])
    replies: list[Any] = []
    for key, commands in groups:

        async def run(node: Redis, group: Sequence[Command] = commands) -> list[Any]:
            return await _pipelined(node, group)

        replies += await on_slot(r, key, run)
    return replies


async def _atomic(once: Client, key: str, commands: Sequence[Command]) -> list[Any]:
    """Run commands in one MULTI/EXEC on the server of ``key``'s slot; their replies.

    ``once`` must not resend (see `_connections`): a transaction whose reply was lost
    may still land later, so a resend could apply it twice, or report "nothing to do"
    for what the first attempt did. The outcome is then unknown:
    `BackendUnavailableError`.
    """

    try:
        return await on_slot(once, key, _transaction(commands))
    except MaxConnectionsError:
        raise  # no connection, nothing sent
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise _unknown_outcome() from exc


def _transaction(commands: Sequence[Command]) -> Callable[[Redis], Awaitable[list[Any]]]:
    """What `on_slot` runs for one MULTI/EXEC of ``commands``: their replies."""

    async def run(node: Redis) -> list[Any]:
        async with node.pipeline(transaction=True) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return _unless_wrong(await pipe.execute(raise_on_error=False))

    return run


async def _optimistic(
    r: Client, watch: Sequence[str], body: Callable[[Pipeline], Awaitable[_T]]
) -> tuple[_T, list[Any]]:
    """WATCH ``watch``, run ``body`` (reads, then ``pipe.multi()`` and queued writes), EXEC.

    Returns the body's value and EXEC's replies (empty when the body wrote nothing),
    a WRONGTYPE error in place of the reply of a command that met a wrong-typed key
    (the other commands of the transaction were applied: the body checks the types
    of the keys whose failure could lose a task before it writes).
    The body is re-run when a watched key changed before EXEC. Contention is bounded:
    after many conflicts in a row the operation gives up with a `BackendError`. A
    connection lost while watching (redis-py reports it as a WatchError rather than
    resending) is not re-run: the outcome is unknown, so `BackendUnavailableError`.
    """

    async def attempts(node: Redis) -> tuple[_T, list[Any]]:
        async with node.pipeline(transaction=True) as pipe:
            for _ in range(_MAX_ATTEMPTS):
                try:
                    await pipe.watch(*watch)
                    result = await body(pipe)
                    if not pipe.explicit_transaction:
                        await pipe.reset()
                        return result, []
                    try:
                        return result, _unless_wrong(await pipe.execute(raise_on_error=False))
                    except MaxConnectionsError:
                        raise  # no connection, nothing sent
                    except (RedisConnectionError, RedisTimeoutError) as exc:
                        raise _unknown_outcome() from exc
                except WatchError as exc:
                    if isinstance(exc.__context__, RedisConnectionError | RedisTimeoutError):
                        raise _unknown_outcome() from exc
                    continue
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {watch[0]}")

    return await on_slot(r, watch[0], attempts)


async def _register_after(r: Client, keys: Keys, queue: str, push: Awaitable[_T]) -> _T:
    """Run a push, then add the queue to the registry: also when the push's outcome is
    unknown or its WAIT fell short, since the tasks may be there."""
    try:
        outcome = await push
    except (DuplicateTaskError, CorruptDataError):
        raise  # refused: nothing was pushed
    except Exception:
        with contextlib.suppress(RedisError, OSError):
            await call(r, "SADD", keys.queues, queue)
        raise
    await reads(r, [("SADD", keys.queues, queue)])  # a wrong-typed registry: check's
    return outcome


def _unknown_outcome() -> BackendUnavailableError:
    return BackendUnavailableError(
        "connection lost while a transaction was in flight; it may or may not have been applied"
    )


async def _wait(one: Pinned, wait: tuple[int, int]) -> int:
    """How many replicas have the writes made on ``one``'s connection (`Pinned.wait`)."""
    try:
        return await one.wait(*wait)
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise ReplicationError(
            f"the tasks are queued, but whether replicas have them is unknown: {exc}"
        ) from exc


# -- queues and tasks -------------------------------------------------------------------


@redis_boundary
async def enqueue(
    r: Client, keys: Keys, queue: str, tasks: Sequence[str], wait: tuple[int, int] | None = None
) -> int | None:
    """Append tasks at the back of the queue; with ``wait`` (replicas, timeout in ms),
    return how many replicas confirmed the push.

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
        ("RPUSH", keys.tasks(queue), *tasks),
        ("PUBLISH", keys.events(queue), event("work", str(len(tasks)))),
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


@redis_boundary
async def enqueue_unique(
    r: Client, keys: Keys, queue: str, tasks: Sequence[str], wait: tuple[int, int] | None = None
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
        pipe.execute_command("RPUSH", keys.tasks(queue), *tasks)
        pipe.execute_command("SADD", keys.unique(queue), *tasks)
        pipe.execute_command("PUBLISH", keys.events(queue), event("work", str(len(tasks))))

    async def pushed(client: Client) -> None:
        _, replies = await _optimistic(client, [keys.unique(queue)], body)
        if is_wrong_type(replies[0]):  # tasks is no list: withdraw the marks just set
            await call(client, "SREM", keys.unique(queue), *tasks)
            raise _corrupt(keys.tasks(queue))

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


@redis_boundary
async def cancel(once: Client, keys: Keys, queue: str, task: str) -> int:
    """Remove every queued copy of a task and release its unique mark (``once``: a
    client that never resends, see `_atomic`).

    Keys: tasks (LIST), unique (SET), deaths (HASH).
      1. MULTI
      2. LREM tasks 0 task              -> number removed
      3. SREM unique task
      4. HDEL deaths <sha1>
      5. PUBLISH events cancel:<task>   (running copies are the handlers' to stop)
      6. EXEC
    """

    commands: list[Command] = [
        ("LREM", keys.tasks(queue), 0, task),
        ("SREM", keys.unique(queue), task),
        ("HDEL", keys.deaths(queue), digest(task)),
        ("PUBLISH", keys.events(queue), event("cancel", task)),
    ]
    replies = await _atomic(once, keys.tasks(queue), commands)
    _raise_wrong(commands[:1], replies)  # the marks' keys are the check's to report
    return int(replies[0])


_DELETE_PASSES = 10
DELETIONS_KEPT_US = 3_600_000_000
"""How long (µs) a deletion stays readable by workers that missed its event."""


@redis_boundary
async def delete_queue(r: Client, once: Client, keys: Keys, queue: str) -> None:
    """Delete a queue with everything in it: queued, in-process and failed tasks, marks.
    The sweeps go through ``once``, a client that never resends (see `_atomic`): a
    sweep that lands late must not find tasks enqueued after the call returned.

    No WATCH over the workers' bookkeeping: on a busy queue the workers change their
    held sets all the time, and a transaction that must see none of them change would
    never get through. Instead each pass deletes what it read, and every write is
    correct whatever happened in between: the first pass deletes the queued tasks
    (so no new process can start from them) and publishes ``delete`` (so consumers
    stop); a process dequeued between a pass's read and its EXEC survives it, still
    recorded, and the next pass deletes it. A late finish or reclaim of a deleted
    process finds it gone (their WATCH on it aborts them). Passes go on until one
    finds no process in a read made after its sweep, at most `_DELETE_PASSES`:
    processes that appear after that come from tasks enqueued after the delete, which
    belong to the queue's next life.

    The registry entry goes after the data, and comes back if the queue's next life
    began meanwhile (tasks pushed, or a process taken from them): `enqueue` registers
    after its push, so a queue with tasks or processes is never left unregistered.
    Keys: holders, held:<w>..., p:<id>..., tasks, failed, unique, deaths; queues.
      0. SISMEMBER queues queue                                 -> known
      1. SMEMBERS holders;  SMEMBERS held:<w> (per holder)     -> ids
      2. MULTI
      3. DEL tasks failed unique deaths p:<id>...
      4. SREM held:<w> <id>...                                  (per holder)
      5. PUBLISH events delete:                                 (first pass)
      6. EXEC
         ZADD deleted <now> queue;  ZREMRANGEBYSCORE deleted -inf (<now - 1 h>
                                          (first pass; a queue registered or not empty)
      7. SMEMBERS holders;  SMEMBERS held:<w>   -> ids: back to 2 with them
      8. `drop_holder` per holder
      9. SREM queues queue
     10. EXISTS tasks holders                   -> any: SADD queues queue
    """
    doomed = [keys.tasks(queue), keys.failed(queue), keys.unique(queue), keys.deaths(queue)]

    async def read() -> tuple[list[str], list[list[str]], list[str]]:
        """Holders (every listed worker when holders is of the wrong type), their held
        ids, and the keys among those of the wrong type (which read as empty, and
        which the next sweep deletes)."""
        found = await reads(r, [("SMEMBERS", keys.holders(queue))])
        holders = members(found[0])
        if is_wrong_type(found[0]):  # it names nobody: any listed worker may hold some
            holders = members((await reads(r, [("SMEMBERS", keys.workers)]))[0])
        commands: list[Command] = [("SMEMBERS", keys.held(queue, w)) for w in holders]
        held = await reads(r, commands)
        wrong = wrong_keys([("SMEMBERS", keys.holders(queue))], found)
        return holders, [members(reply) for reply in held], wrong + wrong_keys(commands, held)

    (known,) = await reads(r, [("SISMEMBER", keys.queues, queue)])
    holders, held, wrong = await read()
    for attempt in range(_DELETE_PASSES):
        processes = [keys.process(queue, pid) for pids in held for pid in pids]
        sweep: list[Command] = [("DEL", *doomed, *wrong, *processes)]
        sweep += [
            ("SREM", keys.held(queue, worker_id), *pids)
            for worker_id, pids in zip(holders, held, strict=True)
            if pids
        ]
        if attempt == 0:
            sweep.append(("PUBLISH", keys.events(queue), event("delete")))
        deleted = (await _atomic(once, keys.tasks(queue), sweep))[0]
        if attempt == 0 and (known == 1 or deleted):  # for workers that miss the event
            now = time.time_ns() // 1000
            await reads(
                r,
                [
                    ("ZADD", keys.deletions, now, queue),
                    ("ZREMRANGEBYSCORE", keys.deletions, "-inf", f"({now - DELETIONS_KEPT_US}"),
                ],
            )
        # Read again AFTER the sweep: a process dequeued between the last read and the
        # sweep survived it, and only a read made after the sweep can see it.
        holders, held, wrong = await read()
        if not any(held) and not wrong:
            break
    for worker_id in holders:
        await drop_holder(r, keys, queue, worker_id)
    await reads(r, [("SREM", keys.queues, queue)])  # a wrong-typed registry: check's
    if await call(r, "EXISTS", keys.tasks(queue), keys.holders(queue)):
        await reads(r, [("SADD", keys.queues, queue)])  # the queue's next life began


@redis_boundary
async def retry_failed(r: Client, keys: Keys, queue: str, limit: int | None) -> int:
    """Move the oldest ``limit`` (default all) failed tasks to the back of the queue.

    Keys: queues (SET), failed (LIST of JSON records), tasks (LIST).
      1. WATCH failed;  LRANGE failed 0 limit-1      -> records (none: UNWATCH, 0)
         TYPE tasks                                   -> not a list: UNWATCH, raise
      2. MULTI
      3. LTRIM failed <n> -1
      4. RPUSH tasks task...
      5. PUBLISH events work:<n>
      6. EXEC                                         -> nil: back to 1
      7. SADD queues queue                            (if any moved: after the push)
    """

    async def body(pipe: Pipeline) -> int:
        stop = -1 if limit is None else limit - 1
        records = await read(pipe, "LRANGE", keys.failed(queue), 0, stop)
        if not records:
            return 0
        await _require(pipe, keys.tasks(queue), "list")  # else the records would be lost
        tasks = [parse_failed(record).task for record in records]
        pipe.multi()
        pipe.execute_command("LTRIM", keys.failed(queue), len(tasks), -1)
        pipe.execute_command("RPUSH", keys.tasks(queue), *map(stored, tasks))
        pipe.execute_command("PUBLISH", keys.events(queue), event("work", str(len(tasks))))
        return len(tasks)

    if limit is not None and limit <= 0:
        return 0
    moved, _ = await _optimistic(r, [keys.failed(queue)], body)
    if moved:  # after the push, as `enqueue` (a wrong-typed registry: check's)
        await reads(r, [("SADD", keys.queues, queue)])
    return moved


@redis_boundary
async def failed_tasks(r: Client, keys: Keys, queue: str) -> list[FailedTask]:
    """The failed list, oldest first.

    1. LRANGE failed 0 -1
    """
    return [parse_failed(record) for record in await read(r, "LRANGE", keys.failed(queue), 0, -1)]


@redis_boundary
async def publish(r: Client, keys: Keys, queue: str, kind: str, message: str) -> None:
    """Announce an event on a queue's channel.

    1. PUBLISH events <kind>:<message>
    """
    await call(r, "PUBLISH", keys.events(queue), event(kind, message))


@redis_boundary
async def request_work(r: Client, keys: Keys, queue: str) -> int:
    """Publish ``work`` with the number of waiting tasks, if there are any.

    1. LLEN tasks
    2. PUBLISH events work:<count>   (if count > 0)
    """
    waiting = int(await read(r, "LLEN", keys.tasks(queue)))
    if waiting:
        await publish(r, keys, queue, "work", str(waiting))
    return waiting


def parse_failed(record: bytes | str) -> FailedTask:
    """Decode one failed-list record; total: a record worqr did not write (not JSON,
    or not of this shape) is returned whole as the task, with an error saying so, so
    that listing, retrying and deleting failed tasks go on around it."""
    raw = text(record)
    try:
        data = json.loads(raw)
        task, error, worker_id, failed_at = (
            data["task"],
            data["error"],
            data["worker_id"],
            float(data["failed_at"]),
        )
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return FailedTask(task=raw, error="unreadable failed record", worker_id="", failed_at=0.0)
    if not all(isinstance(value, str) for value in (task, error, worker_id)):
        return FailedTask(task=raw, error="unreadable failed record", worker_id="", failed_at=0.0)
    return FailedTask(task=task, error=error, worker_id=worker_id, failed_at=failed_at)


# -- processes ----------------------------------------------------------------------------


@redis_boundary
async def dequeue(
    r: Client,
    once: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    count: int = 1,
    *,
    announced: bool = False,
    new_ids: Callable[[int], list[str]] | None = None,
) -> list[Process]:
    """Move up to ``count`` tasks from the head of the queue into new processes of
    this worker, in queue order; an empty list when the queue is empty.

    ``new_ids(k)`` makes k fresh process ids (a worker keeps them known as in flight;
    by default they are made here).
    ``once`` is a client whose transactions are never resent (see `_connections`):
    the transaction must not run twice. If its reply is lost, LINDEX p:<id> 0 for each
    id tells whether it took effect: then its processes are adopted. Otherwise it is
    sent again with FRESH ids, because "not yet" is not "never": a transaction held up
    on the way (a timeout, a slow link) can still land later, and with the same ids it
    would append a second task to each process list. Processes of an attempt that lands
    late are unknown to the worker, and its audit returns them to the front.
    Keys: tasks (LIST), p:<id>... (LIST), held:<w> (SET), holders (SET).
      1. LLEN tasks                       -> 0: return (an idle poll costs one command)
                                             (skipped when ``announced``: a ``work``
                                             event just said ``count`` tasks came)
      2. MULTI                            (k = min(count, length))
      3. LMOVE tasks p:<idi> LEFT RIGHT   for i = 1..k -> the task, or nil once empty
      4. SADD held:<w> <id1> ... <idk>
      5. SADD holders <w>
      6. EXEC
      7. (some LMOVE found the queue empty) SREM held:<w> <unused ids>
    The SADD cannot be conditional on the LMOVEs inside MULTI, so ids that got no task
    are withdrawn in step 7; an id left behind by a crash there names no process list
    and goes with the next reclaim.
    """
    length = count if announced else await read(r, "LLEN", keys.tasks(queue))
    if not length:
        return []
    held = keys.held(queue, worker_id)
    k = min(count, length)
    if new_ids is None:

        def new_ids(count: int) -> list[str]:
            return [new_process_id(worker_id, queue).id for _ in range(count)]

    def take(ids: list[str]) -> list[Command]:
        moves: list[Command] = [
            ("LMOVE", keys.tasks(queue), keys.process(queue, pid), "LEFT", "RIGHT") for pid in ids
        ]
        return [*moves, ("SADD", held, *ids), ("SADD", keys.holders(queue), worker_id)]

    recorded: Any = 1
    for _ in range(_MAX_ATTEMPTS):
        ids = new_ids(k)
        try:
            replies = await on_slot(once, keys.tasks(queue), _transaction(take(ids)))
            tasks, recorded = replies[:k], replies[k]
            break
        except MaxConnectionsError:
            raise  # no connection, nothing sent
        except (RedisConnectionError, RedisTimeoutError):
            lookups: list[Command] = [("LINDEX", keys.process(queue, pid), 0) for pid in ids]
            tasks = await reads(once, lookups)
            if any(isinstance(task, str | bytes) for task in tasks):
                break  # the lost EXEC was applied: adopt what it took
    else:
        raise BackendError(f"gave up dequeuing from {queue!r} after {_MAX_ATTEMPTS} tries")
    # A wrong-typed tasks key fails every LMOVE (nothing taken); a wrong-typed held
    # set fails the record (the tasks go straight back). holders is the check's.
    found = [task if isinstance(task, str | bytes) else None for task in tasks]
    if is_wrong_type(recorded) and any(task is not None for task in found):
        for pid in reversed([pid for pid, task in zip(ids, found, strict=True) if task]):
            await _atomic(once, keys.tasks(queue), _back_to_front(keys, queue, pid))
        raise _corrupt(held)
    taken = [
        Process(pid, text(task), queue)
        for pid, task in zip(ids, found, strict=True)
        if task is not None
    ]
    if len(taken) < len(ids):
        unused = [pid for pid, task in zip(ids, found, strict=True) if task is None]
        await reads(r, [("SREM", held, *unused)])
    if any(is_wrong_type(task) for task in tasks):
        raise _corrupt(keys.tasks(queue))
    return taken


def _back_to_front(keys: Keys, queue: str, pid: str) -> list[Command]:
    """The commands that return a process's task to the front of its queue."""
    return [
        ("LMOVE", keys.process(queue, pid), keys.tasks(queue), "RIGHT", "LEFT"),
        ("PUBLISH", keys.events(queue), event("work", "1")),
    ]


async def _end_process(
    r: Client,
    keys: Keys,
    ref: ProcessRef,
    queue_writes: Callable[[Pipeline, str], None],
    *,
    appends_to: str | None = None,
) -> str | None:
    """Fenced end of a process: if it still exists, delete it and its bookkeeping and
    release the task's unique mark, plus the caller's writes; return its task.
    ``appends_to`` names a list the writes push the task to: it must be a list (or
    absent), since its push failing inside MULTI would lose the task.

    WATCH is needed because the unique mark may only be released while the process
    exists: a late finish after a reclaim must not free the mark of the requeued task.
      1. WATCH p:<id>;  LINDEX p:<id> 0   -> nil: UNWATCH, return None (gone)
         (TYPE <appends_to>                -> not a list: UNWATCH, raise)
      2. MULTI
      3. DEL p:<id>
      4. SREM held:<w> <id>
      5. SREM unique task
      6. HDEL deaths <sha1>               (the task ended: its death count goes)
      7. ...the caller's writes
      8. EXEC                             -> nil: back to 1
    """
    proc = keys.process(ref.queue, ref.id)

    async def body(pipe: Pipeline) -> str | None:
        raw = await read(pipe, "LINDEX", proc, 0)
        if raw is None:
            return None
        if appends_to is not None:
            await _require(pipe, appends_to, "list")
        task = text(raw)
        pipe.multi()
        pipe.execute_command("DEL", proc)
        pipe.execute_command("SREM", keys.held(ref.queue, ref.worker_id), ref.id)
        pipe.execute_command("SREM", keys.unique(ref.queue), stored(task))
        pipe.execute_command("HDEL", keys.deaths(ref.queue), digest(task))
        queue_writes(pipe, task)
        return task

    task, _ = await _optimistic(r, [proc], body)
    return task


@redis_boundary
async def finish(r: Client, keys: Keys, ref: ProcessRef, result: str | None) -> str | None:
    """Finish a process (see `_end_process`), publishing ``done``; return its task or None.

    6. PUBLISH done done:[{"process_id","worker_id","task","result"}]
    """

    def writes(pipe: Pipeline, task: str) -> None:
        record = done_record(ref.id, ref.worker_id, task, result)
        pipe.execute_command("PUBLISH", keys.done(ref.queue), event("done", f"[{record}]"))

    return await _end_process(r, keys, ref, writes)


@redis_boundary
async def finish_many(
    r: Client, keys: Keys, worker_id: str, queue: str, done: Sequence[tuple[Process, str | None]]
) -> list[bool]:
    """Finish processes that this worker dequeued from one queue (so it knows their
    tasks), in one transaction; return, per process, whether it still existed.

    Each process is fenced as in `finish`: only a process that still exists is ended.
    Ids are never reused and only `dequeue` writes a process list, so an existing
    p:<id> holds exactly the task it was dequeued with, and EXISTS stands in for the
    LINDEX of `finish`.
      1. WATCH p:<id1> ... p:<idk>
      2. EXISTS p:<id1> ... p:<idk>       -> fewer than k: UNWATCH; EXISTS p:<id> each
                                             (one round trip), and back to 1 with the
                                             ones that exist (the others: False)
      3. MULTI
      4. DEL p:<id1> ... p:<idk>
      5. SREM held:<w> <id>...
      6. SREM unique <task>...
      7. HDEL deaths <sha1>...
      8. PUBLISH done done:[{...}, ...]   (a record per process; a message per MB)
      9. EXEC                             -> nil: back to 1
    """
    refs = [split_process_id(process.id) for process, _ in done]
    if any(ref.worker_id != worker_id or ref.queue != queue for ref in refs):
        raise ValueError(f"finish_many: every process must be {worker_id}'s in {queue!r}")
    outcome = [False] * len(done)
    remaining = list(range(len(done)))
    while remaining:  # each pass ends them all, or finds at least one gone for good
        procs = [keys.process(queue, refs[i].id) for i in remaining]

        async def body(pipe: Pipeline, at: list[int] = remaining, procs: list[str] = procs) -> bool:
            if await call(pipe, "EXISTS", *procs) != len(procs):
                await pipe.reset()
                return False
            tasks = [done[i][0].task for i in at]
            pipe.multi()
            pipe.execute_command("DEL", *procs)
            pipe.execute_command("SREM", keys.held(queue, worker_id), *(refs[i].id for i in at))
            pipe.execute_command("SREM", keys.unique(queue), *map(stored, tasks))
            pipe.execute_command("HDEL", keys.deaths(queue), *{digest(task) for task in tasks})
            records = [done_record(refs[i].id, worker_id, done[i][0].task, done[i][1]) for i in at]
            for message in done_messages(records):
                pipe.execute_command("PUBLISH", keys.done(queue), message)
            return True

        whole, _ = await _optimistic(r, procs, body)
        if whole:
            for i in remaining:
                outcome[i] = True
            return outcome
        # Some process is gone (reclaimed, stopped, its queue deleted): ids are never
        # reused, so a gone one stays gone; finish the others together.
        async with r.pipeline(transaction=False) as pipe:
            for proc in procs:
                pipe.execute_command("EXISTS", proc)
            present = await pipe.execute()
        remaining = [i for i, flag in zip(remaining, present, strict=True) if flag]
    return outcome


@redis_boundary
async def fail(r: Client, keys: Keys, ref: ProcessRef, error: str) -> str | None:
    """Move a process's task to the queue's failed list (see `_end_process`).

    6. RPUSH failed {"task","error","worker_id","failed_at"}
    """

    def writes(pipe: Pipeline, task: str) -> None:
        record = {
            "task": task,
            "error": error,
            "worker_id": ref.worker_id,
            "failed_at": time.time(),
        }
        pipe.execute_command("RPUSH", keys.failed(ref.queue), json.dumps(record))

    return await _end_process(r, keys, ref, writes, appends_to=keys.failed(ref.queue))


@redis_boundary
async def stop(once: Client, keys: Keys, ref: ProcessRef) -> str | None:
    """Return a process's task to the FRONT of its queue; its unique mark stays
    (``once``: a client that never resends, see `_atomic`).

    Keys: p:<id> (LIST), tasks (LIST), held:<w> (SET). No WATCH: LMOVE from a
    missing list is a no-op, so a late stop changes nothing.
      1. MULTI
      2. LMOVE p:<id> tasks RIGHT LEFT   -> the task, or nil (process gone)
      3. SREM held:<w> <id>
      4. PUBLISH events work:1          (a harmless hint if the process was gone)
      5. EXEC
    """
    queue = ref.queue
    task, _, _ = await _atomic(
        once,
        keys.tasks(queue),
        [
            ("LMOVE", keys.process(queue, ref.id), keys.tasks(queue), "RIGHT", "LEFT"),
            ("SREM", keys.held(queue, ref.worker_id), ref.id),
            ("PUBLISH", keys.events(queue), event("work", "1")),
        ],
    )
    if is_wrong_type(task):  # the task stays in its process list: keep it recorded
        await reads(once, [("SADD", keys.held(queue, ref.worker_id), ref.id)])
        raise CorruptDataError(
            f"{keys.tasks(queue)} or {keys.process(queue, ref.id)} is not a list",
            keys.tasks(queue),
        )
    return None if task is None else text(task)


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What a reclaim did with a worker's processes in one queue."""

    returned: list[str]
    """Tasks back at the front of the queue, in their original order."""
    quarantined: list[str]
    """Tasks moved to the failed list: their holders died too often while running them."""


@redis_boundary
async def reclaim(
    r: Client, keys: Keys, queue: str, worker_id: str, *, quarantine_after: int | None = None
) -> Reclaimed:
    """Return every process a worker holds in a queue to the FRONT, oldest first.

    WATCH is needed: a process dequeued, finished or reclaimed by a racing peer
    between the read and EXEC aborts the transaction, so no task is duplicated or
    dropped. Idempotent: a second reclaim finds nothing.

    With ``quarantine_after`` (the worker died), each task's death count goes up; a
    task whose holders died that many times goes to the failed list instead, so that
    a poison pill cannot crash-loop the fleet. Counts are per task string (its SHA-1).
    Keys: held:<w> (SET), p:<id>... (LIST), tasks (LIST), holders (SET); with
    quarantine also deaths (HASH), failed (LIST), unique (SET).
      1. WATCH held:<w>;  SMEMBERS held:<w>     -> ids, sorted newest first
         TYPE tasks;  (quarantine) TYPE failed -> not lists: UNWATCH, raise (nothing moved)
      2. (quarantine) LINDEX p:<id> 0 ...;  HMGET deaths <sha1>...   (one round trip each)
      3. MULTI
      4. per id, newest first:
           LMOVE p:<id> tasks RIGHT LEFT;  (quarantine) HINCRBY deaths <sha1> 1
         or, for a task at its limit:
           DEL p:<id>;  RPUSH failed <record>;  HDEL deaths <sha1>;  SREM unique task
      5. DEL held:<w>
      6. SREM holders <w>
      7. PUBLISH events work:<returned>         (if any returned)
      8. EXEC                                   -> nil: back to 1
    """
    held = keys.held(queue, worker_id)

    async def body(pipe: Pipeline) -> list[tuple[str, str | None]]:
        ids = sorted(members(await read(pipe, "SMEMBERS", held)), key=_token, reverse=True)
        if ids:  # the LMOVEs must not fail inside MULTI, nor the quarantine's RPUSH
            await _require(pipe, keys.tasks(queue), "list")
            if quarantine_after:
                await _require(pipe, keys.failed(queue), "list")
        counts = await _death_counts(r, keys, queue, ids) if quarantine_after and ids else {}
        plan: list[tuple[str, str | None]] = []  # what each group of replies belongs to
        pipe.multi()
        for pid in ids:
            proc = keys.process(queue, pid)
            task, deaths = counts.get(pid, (None, 0))
            if task is not None and quarantine_after and deaths + 1 >= quarantine_after:
                record = {
                    "task": task,
                    "error": f"quarantined: its worker died while running it {deaths + 1} times",
                    "worker_id": worker_id,
                    "failed_at": time.time(),
                }
                pipe.execute_command("DEL", proc)
                pipe.execute_command("RPUSH", keys.failed(queue), json.dumps(record))
                pipe.execute_command("HDEL", keys.deaths(queue), digest(task))
                pipe.execute_command("SREM", keys.unique(queue), stored(task))
                plan.append(("quarantined", task))
                continue
            pipe.execute_command("LMOVE", proc, keys.tasks(queue), "RIGHT", "LEFT")
            plan.append(("returned", None))
            if task is not None:
                pipe.execute_command("HINCRBY", keys.deaths(queue), digest(task), 1)
                plan.append(("counted", None))
        pipe.execute_command("DEL", held)
        pipe.execute_command("SREM", keys.holders(queue), worker_id)
        back = sum(kind == "returned" for kind, _ in plan)
        if back:
            pipe.execute_command("PUBLISH", keys.events(queue), event("work", str(back)))
        return plan

    plan, replies = await _optimistic(r, [held], body)
    returned: list[str] = []
    quarantined: list[str] = []
    position = 0
    for kind, task in plan:
        if kind == "returned" and isinstance(replies[position], str | bytes):
            returned.append(text(replies[position]))
        elif kind == "quarantined" and task is not None:
            quarantined.append(task)
        position += 4 if kind == "quarantined" else 1
    returned.reverse()  # moved newest first: report them in queue order
    quarantined.reverse()
    return Reclaimed(returned, quarantined)


async def _death_counts(
    r: Client, keys: Keys, queue: str, ids: Sequence[str]
) -> dict[str, tuple[str, int]]:
    """Each process's task and how often holders of that task died so far.

    Read outside the transaction: the WATCH on the worker's held set already aborts
    it if any of these processes changes.
    """
    raw_tasks = await reads(r, [("LINDEX", keys.process(queue, pid), 0) for pid in ids])
    tasks = {
        pid: text(raw)
        for pid, raw in zip(ids, raw_tasks, strict=True)
        if isinstance(raw, str | bytes)
    }
    if not tasks:
        return {}
    digests = [digest(task) for task in tasks.values()]
    (counts,) = await reads(r, [("HMGET", keys.deaths(queue), *digests)])
    if is_wrong_type(counts):  # a wrong-typed deaths hash counts nothing (check's)
        counts = [None] * len(digests)
    return {
        pid: (task, _count(count)) for (pid, task), count in zip(tasks.items(), counts, strict=True)
    }


def _count(raw: Any) -> int:
    """A stored counter; 0 for one that is missing or not a number."""
    try:
        return max(0, int(raw or 0))
    except (TypeError, ValueError):
        return 0


def _token(pid: str) -> str:
    """The sort key of a process id (its dequeue order); "" for an id worqr did not
    give out, which sorts first."""
    try:
        return parse_process_id(pid).token
    except InvalidProcessIdError:
        return ""


def digest(task: str) -> str:
    """The field under which a task's death count is kept (tasks may be megabytes)."""
    return hashlib.sha1(task.encode("utf-8", "surrogateescape")).hexdigest()


@redis_boundary
async def processes(r: Client, keys: Keys, queues: Sequence[str] | None = None) -> list[Process]:
    """Every process of the given queues (default: every registered queue), oldest first.

    A read-only walk, O(queues + workers + processes):
      1. SMEMBERS queues               (without ``queues``)
      2. SMEMBERS holders              (per queue, one round trip)
      3. SMEMBERS held:<w>             (per holder, one round trip)
      4. LINDEX p:<id> 0               (per process, one round trip)
    """
    if queues is None:
        queues = members(await read(r, "SMEMBERS", keys.queues))
    # Wrong-typed keys read as empty and unparsable ids are skipped: check reports both.
    holders = await reads(r, [("SMEMBERS", keys.holders(queue)) for queue in queues])
    pairs = [(q, w) for q, ws in zip(queues, holders, strict=True) for w in members(ws)]
    held = await reads(r, [("SMEMBERS", keys.held(q, w)) for q, w in pairs])
    candidates = sorted(
        (
            (token, queue, pid)
            for (queue, _), pids in zip(pairs, held, strict=True)
            for pid in members(pids)
            if (token := _token(pid))
        ),
    )
    tasks = await reads(r, [("LINDEX", keys.process(q, pid), 0) for _, q, pid in candidates])
    return [
        Process(pid, text(task), queue)
        for (_, queue, pid), task in zip(candidates, tasks, strict=True)
        if isinstance(task, str | bytes)
    ]


# -- workers ------------------------------------------------------------------------------


@redis_boundary
async def register_worker(
    r: Client, keys: Keys, worker_id: str, timeout_ms: int, queues: Iterable[str]
) -> None:
    """Mark a worker alive and list it, with the queues it works on.

    The registry entry comes first: every key of a worker that a crash between the
    steps (two round trips on a Cluster) can leave behind is then findable by the
    dead-worker scan, which removes them once the heartbeat is gone. A listed worker
    whose heartbeat is not yet set may be failed by a peer meanwhile: it holds
    nothing yet, and its own next `touch_worker` lists it again.
      1. SADD workers <w>
      2. SET alive <now> PX <timeout>
      3. SADD w:queues queue...        (if any)
    """
    queue_list = list(queues)
    own: list[Command] = [("SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms)]
    if queue_list:
        own.append(("SADD", keys.worker_queues(worker_id), *queue_list))
    listed: list[Command] = [("SADD", keys.workers, worker_id)]
    replies = await _in_order(r, [(keys.workers, listed), (keys.heartbeat(worker_id), own)])
    _raise_wrong(own, replies[1:])  # a wrong-typed registry is the check's to report


@redis_boundary
async def heartbeat(r: Client, keys: Keys, worker_id: str, timeout_ms: int) -> bool:
    """Extend the heartbeat; False when it had already expired (the worker was presumed dead).

    1. SET alive <now> PX <timeout> XX
    """
    reply = await call(
        r, "SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms, "XX"
    )
    return reply is not None


@redis_boundary
async def start_work(r: Client, keys: Keys, worker_id: str, queue: str) -> tuple[int, str | None]:
    """Record that a worker works on a queue; return how many tasks wait in it (0 when
    the tasks key is of the wrong type: the consumer's dequeues then report it) and
    the time of the queue's last deletion in the last hour (see `deletions`).

    The work list comes before the registry, so that a `prune_queues` that read no
    worker working on the queue unregisters it before this SADD re-registers it.
      1. SADD w:queues queue
      2. SADD queues queue;  ZSCORE deleted queue
      3. LLEN tasks
    """
    own: list[Command] = [("SADD", keys.worker_queues(worker_id), queue)]
    replies = await _in_order(
        r,
        [
            (keys.worker_queues(worker_id), own),
            (keys.queues, [("SADD", keys.queues, queue)]),
            (keys.deletions, [("ZSCORE", keys.deletions, queue)]),
            (keys.tasks(queue), [("LLEN", keys.tasks(queue))]),
        ],
    )
    _raise_wrong(own, replies)
    _, deleted, waiting = replies[1:]
    return 0 if is_wrong_type(waiting) else int(waiting), _score(deleted)


def _score(reply: Any) -> str | None:
    """A deletion time as ZSCORE gives it; None for none (or a registry of the wrong
    type, which the check reports)."""
    if reply is None or is_wrong_type(reply):
        return None
    return text(reply) if isinstance(reply, str | bytes) else repr(reply)


@redis_boundary
async def deletions(r: Client, keys: Keys, queues: Sequence[str]) -> list[str | None]:
    """When each queue was last deleted (within the hour), to compare with what
    `start_work` read: a worker that missed a ``delete`` event learns of it so.

    1. ZMSCORE deleted queue...
    """
    (scores,) = await reads(r, [("ZMSCORE", keys.deletions, *queues)])
    return [None] * len(queues) if is_wrong_type(scores) else [_score(s) for s in scores]


@redis_boundary
async def stop_work(r: Client, keys: Keys, worker_id: str, queue: str) -> list[str]:
    """Stop a worker's work on a queue: reclaim its processes there, then forget the queue.

    1. `reclaim` (queue, worker)
    2. SREM w:queues queue
    """
    returned = await reclaim(r, keys, queue, worker_id)
    await reads(r, [("SREM", keys.worker_queues(worker_id), queue)])
    return returned.returned


@redis_boundary
async def queues_held_by(r: Client, keys: Keys, worker_id: str) -> tuple[set[str], list[str]]:
    """Every queue where a worker may hold processes: its work list and any queue
    whose holders name it (processes recorded after its work list was lost); and the
    keys of the wrong type met on the way (read as empty).

      1. SMEMBERS w:queues;  SMEMBERS queues
      2. SISMEMBER holders <w>   (per queue, one round trip)
    """
    first: list[Command] = [("SMEMBERS", keys.worker_queues(worker_id)), ("SMEMBERS", keys.queues)]
    working, known = await reads(r, first)
    candidates = members(known)
    second: list[Command] = [("SISMEMBER", keys.holders(q), worker_id) for q in candidates]
    flags = await reads(r, second)
    holding = {q for q, flag in zip(candidates, flags, strict=True) if flag is True or flag == 1}
    return set(members(working)) | holding, wrong_keys(first, [working, known]) + wrong_keys(
        second, flags
    )


@dataclass(frozen=True, slots=True)
class FailedWorker:
    """What `fail_worker` did."""

    reclaimed: dict[str, Reclaimed]
    """Per queue, what went back or to quarantine."""
    corrupt: list[str]
    """Keys of the wrong type met: processes in such a queue were left recorded (and
    the worker listed) for a later pass, once ``check(repair=True)`` removed them."""


@redis_boundary
async def fail_worker(
    r: Client,
    keys: Keys,
    worker_id: str,
    *,
    only_if_dead: bool,
    quarantine_after: int | None = None,
) -> FailedWorker | None:
    """Return all of a worker's processes to the front of their queues and deregister it.

    With ``only_if_dead`` nothing happens (None) while the worker's heartbeat exists.
    ``quarantine_after`` is passed to `reclaim` when the worker died (not when it is
    failed on purpose). Each step is idempotent and the registry entry goes last, so a
    peer that crashes midway leaves the worker listed for the next cleanup to finish.
    A queue with a key of the wrong type is skipped (the others go on); the worker then
    stays listed, without heartbeat, so that a later pass reclaims that queue too.
      1. EXISTS alive (only_if_dead)  |  DEL alive
      2. `queues_held_by` worker
      3. `reclaim` (queue, worker)    per queue
      4. DEL w:queues                 (nothing skipped)
      5. SREM workers <w>             (nothing skipped)
    """
    if only_if_dead:
        if await call(r, "EXISTS", keys.heartbeat(worker_id)):
            return None
    else:
        await call(r, "DEL", keys.heartbeat(worker_id))
    queues, corrupt = await queues_held_by(r, keys, worker_id)
    reclaimed: dict[str, Reclaimed] = {}
    skipped = False
    for queue in sorted(queues):
        try:
            reclaimed[queue] = await reclaim(
                r, keys, queue, worker_id, quarantine_after=quarantine_after
            )
        except CorruptDataError as exc:
            corrupt.append(exc.key or f"a key of queue {queue!r}")
            skipped = True
    if not skipped:
        await call(r, "DEL", keys.worker_queues(worker_id))
        await reads(r, [("SREM", keys.workers, worker_id)])
    return FailedWorker(reclaimed, corrupt)


@dataclass(frozen=True, slots=True)
class Scan:
    """What one supervision scan found."""

    dead: list[str]
    """Workers, listed or named as holders, whose heartbeat is gone."""
    idle: list[str]
    """Registered queues with no queued, failed or in-process task and no worker."""
    corrupt: list[str]
    """Keys of the wrong type met (read as empty: one bad key costs only what it holds)."""


@redis_boundary
async def scan(r: Client, keys: Keys) -> Scan:
    """The fleet-wide scan: dead workers, and queues idle enough to leave the registry.

    O(workers + registered queues) per call; only one peer per interval runs it (see
    `acquire_supervision`), and since idle queues are pruned (`prune_queues`), its cost
    follows the queues in use, not every queue ever used.
      1. SMEMBERS workers;  SMEMBERS queues
      2. SMEMBERS holders;  EXISTS tasks failed     (per queue)
         SMEMBERS w:queues                          (per listed worker)   one round trip
      3. EXISTS alive                               (per candidate, one round trip)
    """
    first: list[Command] = [("SMEMBERS", keys.workers), ("SMEMBERS", keys.queues)]
    listed, known = await reads(r, first)
    workers, queues = members(listed), members(known)
    second: list[Command] = []
    for queue in queues:
        second += [
            ("SMEMBERS", keys.holders(queue)),
            ("EXISTS", keys.tasks(queue), keys.failed(queue)),
        ]
    second += [("SMEMBERS", keys.worker_queues(worker_id)) for worker_id in workers]
    replies = await reads(r, second)
    holders, contents = replies[: 2 * len(queues) : 2], replies[1 : 2 * len(queues) : 2]
    worked = {q for reply in replies[2 * len(queues) :] for q in members(reply)}
    candidates = sorted(set(workers).union(*(members(reply) for reply in holders)))
    alive = await reads(r, [("EXISTS", keys.heartbeat(worker_id)) for worker_id in candidates])
    idle = [
        queue
        for queue, held_by, content in zip(queues, holders, contents, strict=True)
        if not held_by and content == 0 and queue not in worked
    ]
    return Scan(
        dead=[w for w, flag in zip(candidates, alive, strict=True) if not flag],
        idle=idle,
        corrupt=wrong_keys(first, [listed, known]) + wrong_keys(second, replies),
    )


@redis_boundary
async def prune_queues(r: Client, keys: Keys, idle: Sequence[str]) -> list[str]:
    """Unregister queues a `scan` found idle; return those that stayed out.

    No lock, and no queue that comes to life meanwhile is lost: the entries go first,
    then a second read re-registers every queue that has tasks, failed tasks or
    processes, or a worker, by then. A push the read missed comes after it, so its
    own SADD (after the push, see `enqueue`) re-registers the queue; a `start_work`
    the read missed writes its work list after the read and the registry after that.
      1. SREM queues queue...
      2. SMEMBERS workers;  EXISTS tasks failed holders (per queue)
      3. SMEMBERS w:queues (per listed worker)
      4. SADD queues queue...                       (those in use by now)
    """
    if not idle:
        return []
    await reads(r, [("SREM", keys.queues, *idle)])
    checks: list[Command] = [
        ("EXISTS", keys.tasks(q), keys.failed(q), keys.holders(q)) for q in idle
    ]
    replies = await reads(r, [("SMEMBERS", keys.workers), *checks])
    work_lists = [("SMEMBERS", keys.worker_queues(w)) for w in members(replies[0])]
    worked = {q for reply in await reads(r, work_lists) for q in members(reply)}
    back = [q for q, n in zip(idle, replies[1:], strict=True) if n != 0 or q in worked]
    if back:
        await reads(r, [("SADD", keys.queues, *back)])
    return [q for q in idle if q not in back]


@redis_boundary
async def acquire_supervision(r: Client, keys: Keys, worker_id: str, lease_ms: int) -> bool:
    """Take the fleet-wide supervision lease for one interval, if nobody holds it.

    A lease key without expiry (not written by worqr, which always sets one) would
    stop supervision for good: then every peer scans, as if it held the lease, until
    ``check(repair=True)`` removes the key.
      1. SET supervisor <w> NX PX <lease>
      2. PTTL supervisor              (taken: -1 means no expiry)
    """
    taken, ttl = await reads(
        r,
        [
            ("SET", keys.supervision_lease, worker_id, "NX", "PX", lease_ms),
            ("PTTL", keys.supervision_lease),
        ],
    )
    return taken is not None or ttl == -1


@redis_boundary
async def touch_worker(
    r: Client, keys: Keys, worker_id: str, queues: Sequence[str]
) -> list[tuple[int, list[str] | None]]:
    """Periodic self-check: keep the registry entries true, count waiting tasks and
    list the processes Redis records under this worker, per queue (None for a queue
    whose held set is of the wrong type: then nothing is known of it, and a tasks key
    of the wrong type counts 0).

    Re-adding is idempotent and heals an entry a racing peer removed just after
    this worker re-registered.
      1. SADD workers <w>;  SADD w:queues queue...
      2. LLEN tasks;  SMEMBERS held:<w>      (per queue)
    """
    commands: list[Command] = [("SADD", keys.workers, worker_id)]
    if queues:
        commands.append(("SADD", keys.worker_queues(worker_id), *queues))
    for queue in queues:
        commands.append(("LLEN", keys.tasks(queue)))
        commands.append(("SMEMBERS", keys.held(queue, worker_id)))
    per_queue = (await reads(r, commands))[2 if queues else 1 :]
    return [
        (
            0 if is_wrong_type(waiting) else int(waiting),
            None if is_wrong_type(held) else members(held),
        )
        for waiting, held in zip(per_queue[::2], per_queue[1::2], strict=True)
    ]


# -- repairs (the consistency check) ------------------------------------------------------


@redis_boundary
async def return_orphan(r: Client, keys: Keys, queue: str, process_id: str) -> int:
    """Put the tasks of a process list that no worker records back at the FRONT.

    The SCAN that reported it may have missed a held set created meanwhile, so the
    orphan is confirmed under WATCH first: a recorded process belongs to its worker
    (alive, or reclaimed with the rest of its processes once dead) and is left alone.
      1. WATCH p:<id> held:<w>;  SISMEMBER held:<w> <id>  -> 1: UNWATCH, done
      2. LLEN p:<id>                                       -> n (0: UNWATCH, done)
      3. MULTI
      4. LMOVE p:<id> tasks RIGHT LEFT                     (n times: order kept)
      5. PUBLISH events work:<n>
      6. EXEC                                              -> nil: back to 1
    """
    proc = keys.process(queue, process_id)
    try:
        held = keys.held(queue, parse_process_id(process_id).worker_id)
    except InvalidProcessIdError:  # an id worqr never gave out: no worker records it
        held = None

    async def body(pipe: Pipeline) -> int:
        if held is not None and await read(pipe, "SISMEMBER", held, process_id):
            await pipe.reset()
            return 0
        return await _move_back(pipe, keys, queue, proc, keep=0)

    moved, replies = await _optimistic(r, [proc] if held is None else [proc, held], body)
    if replies and is_wrong_type(replies[0]):  # nothing moved: the task stays where it was
        raise _corrupt(keys.tasks(queue))
    return moved


@redis_boundary
async def trim_process(r: Client, keys: Keys, queue: str, process_id: str) -> int:
    """Put every task of a process list but its first back at the FRONT: the first is
    the one its worker was given (and may be running); the others belong in the queue.

      1. WATCH p:<id>;  LLEN p:<id>                        -> n (<= 1: UNWATCH, done)
      2. MULTI
      3. LMOVE p:<id> tasks RIGHT LEFT                     (n - 1 times: order kept)
      4. PUBLISH events work:<n - 1>
      5. EXEC                                              -> nil: back to 1
    """
    proc = keys.process(queue, process_id)

    async def body(pipe: Pipeline) -> int:
        return await _move_back(pipe, keys, queue, proc, keep=1)

    moved, replies = await _optimistic(r, [proc], body)
    if replies and is_wrong_type(replies[0]):  # nothing moved: the tasks stay where they were
        raise _corrupt(keys.tasks(queue))
    return moved


async def _move_back(pipe: Pipeline, keys: Keys, queue: str, proc: str, *, keep: int) -> int:
    """In a WATCHed pipeline: queue moving all but the first ``keep`` tasks of a process
    list to the front of the queue, newest first (so their order is kept)."""
    count = int(await read(pipe, "LLEN", proc)) - keep
    if count <= 0:
        await pipe.reset()
        return 0
    pipe.multi()
    for _ in range(count):
        pipe.execute_command("LMOVE", proc, keys.tasks(queue), "RIGHT", "LEFT")
    pipe.execute_command("PUBLISH", keys.events(queue), event("work", str(count)))
    return count


@redis_boundary
async def drop_process_id(r: Client, keys: Keys, queue: str, worker_id: str, pid: str) -> bool:
    """Forget a recorded process id whose process list does not exist.

    1. WATCH p:<id>;  EXISTS p:<id>             -> 1: UNWATCH, keep it
    2. MULTI;  SREM held:<w> <id>;  EXEC
    """
    proc = keys.process(queue, pid)

    async def body(pipe: Pipeline) -> bool:
        if await call(pipe, "EXISTS", proc):
            return False
        pipe.multi()
        pipe.execute_command("SREM", keys.held(queue, worker_id), pid)
        return True

    dropped, _ = await _optimistic(r, [proc], body)
    return dropped


@redis_boundary
async def drop_holder(r: Client, keys: Keys, queue: str, worker_id: str) -> bool:
    """Forget a worker as holder of a queue where it holds nothing.

    1. WATCH held:<w>;  EXISTS held:<w>         -> 1: UNWATCH, keep it
    2. MULTI;  SREM holders <w>;  EXEC
    """
    held = keys.held(queue, worker_id)

    async def body(pipe: Pipeline) -> bool:
        if await call(pipe, "EXISTS", held):
            return False
        pipe.multi()
        pipe.execute_command("SREM", keys.holders(queue), worker_id)
        return True

    dropped, _ = await _optimistic(r, [held], body)
    return dropped


@redis_boundary
async def drop_work_list(r: Client, keys: Keys, worker_id: str) -> bool:
    """Delete the work list of a worker that is gone (no heartbeat).

    1. WATCH alive;  EXISTS alive               -> 1: UNWATCH, keep it
    2. MULTI;  DEL w:queues;  EXEC
    """
    alive = keys.heartbeat(worker_id)

    async def body(pipe: Pipeline) -> bool:
        if await call(pipe, "EXISTS", alive):
            return False
        pipe.multi()
        pipe.execute_command("DEL", keys.worker_queues(worker_id))
        return True

    dropped, _ = await _optimistic(r, [alive], body)
    return dropped


@redis_boundary
async def drop_wrong_type(r: Client, key: str, kind: str) -> bool:
    """Delete a key that is not of the type ``kind`` the layout gives it (another
    client wrote it there); False if it is of that type (or gone) by now.

    1. WATCH key;  TYPE key                     -> kind or none: UNWATCH, keep it
    2. MULTI;  DEL key;  EXEC
    """

    async def body(pipe: Pipeline) -> bool:
        if text(await call(pipe, "TYPE", key)) in (kind, "none"):
            return False
        pipe.multi()
        pipe.execute_command("DEL", key)
        return True

    dropped, _ = await _optimistic(r, [key], body)
    return dropped


@redis_boundary
async def expire_endless(r: Client, key: str, ttl_ms: int) -> bool:
    """Give a heartbeat or lease key that has no expiry one of ``ttl_ms`` (worqr always
    sets one: without it a dead worker would stay alive, or supervision held, for
    good). Not a delete: a live worker's next heartbeat renews its key as usual.

    1. WATCH key;  PTTL key                     -> not -1: UNWATCH, keep it
    2. MULTI;  PEXPIRE key <ttl>;  EXEC
    """

    async def body(pipe: Pipeline) -> bool:
        if await call(pipe, "PTTL", key) != -1:
            return False
        pipe.multi()
        pipe.execute_command("PEXPIRE", key, ttl_ms)
        return True

    expired, _ = await _optimistic(r, [key], body)
    return expired


@redis_boundary
async def register(r: Client, registry: str, member: str) -> None:
    """Add a missing registry entry (a live worker or a queue with tasks).

    1. SADD <registry> <member>
    """
    await call(r, "SADD", registry, member)


# -- inspection ---------------------------------------------------------------------------

PROTOCOL_VERSION = "2"


@redis_boundary
async def claim_protocol(r: Client, keys: Keys) -> str:
    """Record this protocol version under the prefix unless one is there; return the
    version found.

      1. SET protocol <PROTOCOL_VERSION> NX
      2. GET protocol
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SET", keys.protocol, PROTOCOL_VERSION, "NX")
        pipe.execute_command("GET", keys.protocol)
        _, found = await pipe.execute()
    return text(found)


@redis_boundary
async def workers(r: Client, keys: Keys) -> list[WorkerInfo]:
    """Every registered worker with its queues, process count and heartbeat age.

    1. SMEMBERS workers
    2. GET alive;  SMEMBERS w:queues         (per worker, one round trip)
    3. `processes` of all queues
    """
    ids = members(await read(r, "SMEMBERS", keys.workers))
    commands: list[Command] = []
    for worker_id in ids:
        commands += [
            ("GET", keys.heartbeat(worker_id)),
            ("SMEMBERS", keys.worker_queues(worker_id)),
        ]
    replies = await reads(r, commands)
    held: dict[str, int] = {}
    for process in await processes(r, keys):
        held[process.worker_id] = held.get(process.worker_id, 0) + 1
    now = time.time()
    return [
        WorkerInfo(worker_id, tuple(members(queues)), held.get(worker_id, 0), _age(beat, now))
        for worker_id, beat, queues in zip(ids, replies[::2], replies[1::2], strict=True)
    ]


def _age(beat: Any, now: float) -> float | None:
    """Seconds since a heartbeat written at ``beat`` (unix time); None for none, or
    for a value worqr did not write."""
    try:
        return max(0.0, now - float(text(beat)))
    except (TypeError, ValueError, AttributeError):
        return None


@redis_boundary
async def queue_table(
    r: Client, keys: Keys, queues: Sequence[str] | None = None
) -> list[tuple[str, int, int, int, int]]:
    """Per queue (default: every registered one, sorted): its name, queued, in-process
    and failed tasks, and the workers working on it; three round trips however many
    queues there are. A key of the wrong type counts 0.

    1. SMEMBERS queues (without ``queues``);  SMEMBERS workers
    2. LLEN tasks;  LLEN failed;  SMEMBERS holders  (per queue)
       SMEMBERS w:queues                            (per worker)
    3. SCARD held:<w>                               (per queue and holder)
    """
    first: list[Command] = [("SMEMBERS", keys.workers)]
    if queues is None:
        first.append(("SMEMBERS", keys.queues))
    replies = await reads(r, first)
    worker_ids = members(replies[0])
    names = list(queues) if queues is not None else members(replies[1])
    second: list[Command] = []
    for queue in names:
        second += [
            ("LLEN", keys.tasks(queue)),
            ("LLEN", keys.failed(queue)),
            ("SMEMBERS", keys.holders(queue)),
        ]
    second += [("SMEMBERS", keys.worker_queues(w)) for w in worker_ids]
    counts = await reads(r, second)
    per_queue = counts[: 3 * len(names)]
    worked: dict[str, int] = {}
    for reply in counts[3 * len(names) :]:
        for queue in members(reply):
            worked[queue] = worked.get(queue, 0) + 1
    pairs = [
        (q, w) for q, holders in zip(names, per_queue[2::3], strict=True) for w in members(holders)
    ]
    sizes = await reads(r, [("SCARD", keys.held(q, w)) for q, w in pairs])
    in_process: dict[str, int] = {}
    for (queue, _), size in zip(pairs, sizes, strict=True):
        in_process[queue] = in_process.get(queue, 0) + _count(size)
    return [
        (queue, _count(queued), in_process.get(queue, 0), _count(failed), worked.get(queue, 0))
        for queue, queued, failed in zip(names, per_queue[::3], per_queue[1::3], strict=True)
    ]
