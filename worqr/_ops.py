"""The atomic operations: the only code that writes to Redis.
(Over 800 lines: one module per transition is the package's move to layers, `_ops/`,
which is its own step with behaviour unchanged; until then the sections below are
those modules.)

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
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._connections import Client as Client
from ._connections import NotApplied, Pinned, on_nodes, on_slot, pinned, unsent
from ._deps import dependencies_of
from ._envelope import Envelope, Header, unwrap, wrap
from ._errors import (
    BackendError,
    BackendUnavailableError,
    CorruptDataError,
    DependencyError,
    DuplicateTaskError,
    InvalidProcessIdError,
    ReplicationError,
    is_wrong_type,
    redis_boundary,
    translate,
)
from ._flow import Flow, Paused, Throttled, read_flow
from ._jobs import Backoff
from ._keys import Keys
from ._lane import Lane
from ._levels import LEVELS, Picker
from ._models import FailedTask, Process, WorkerInfo, escaped, readable
from ._names import ProcessRef, new_process_id, parse_process_id, split_process_id
from ._wire import Watching, Wire, exchange, transaction, watching

_T = TypeVar("_T")
_MAX_ATTEMPTS = 100
_LAG_ROUND_TRIPS = 2.5  # round trips from a rate-limited dequeue's TIME to its EXEC
_LAG_MS = 5  # ms on top: the scheduling noise of a busy host
_LATE_TRIES = 5  # rate-limited dequeues in a row whose EXEC ran later than allowed

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
    WRONGTYPE is raised (a Cluster pipeline also puts routing failures in place, such as
    redirections exhausted during a slot migration); WRONGTYPE replies stay in place for
    the caller to isolate."""
    for reply in replies:
        if isinstance(reply, Exception) and not is_wrong_type(reply):
            raise reply
    return replies


async def reads(r: Client, commands: Sequence[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order, a
    wrong-typed key's WRONGTYPE error in its place (so one bad key spoils nothing else).

    On a Cluster, one round trip per node, the nodes at once (`on_nodes`): commands
    Redis refused are sent again where their slots are served now, and so, when every
    command is a read (`_READS`), are those whose connection was lost, as after a
    failover. Others (idempotent writes beside reads) are not resent after a lost
    connection: whether they were applied is unknown."""
    if not commands:
        return []
    if isinstance(r, Redis):
        return await _pipelined(r, commands)

    async def run(node: Redis, indexes: list[int]) -> list[Any]:
        return await _sent(node, [commands[index] for index in indexes])

    resend = all(str(command[0]).upper() in _READS for command in commands)
    keys = [str(command[1]) for command in commands]
    return _unless_wrong(await on_nodes(r, keys, run, resend=resend))


_READS = frozenset(
    {
        "EXISTS", "GET", "HGET", "HGETALL", "HMGET", "LINDEX", "LLEN", "LPOS", "LRANGE",
        "PTTL", "SCARD", "SISMEMBER", "SMEMBERS", "SMISMEMBER", "SRANDMEMBER", "TYPE",
        "ZCARD", "ZMSCORE", "ZRANGE", "ZSCORE",
    }
)  # fmt: skip
"""Commands that only read, the ones worqr sends in `reads`: resent after a lost
connection on a Cluster."""


async def reads_checked(r: Client, commands: Sequence[Command]) -> list[Any]:
    """`reads`, raising `CorruptDataError` for the first wrong-typed key."""
    replies = await reads(r, commands)
    _raise_wrong(commands, replies)
    return replies


async def _beside(pipe: Pipeline, commands: Sequence[Wire]) -> list[Any]:
    """Reads sent on a WATCHing pipeline's own connection, in one round trip: their raw
    replies in order, a WRONGTYPE error in place (as `reads`).

    Not on another connection of the pool: an operation that holds one connection must
    never wait for a second, or enough of them at once (a burst of failing handlers)
    hold every connection of the pool, each waiting for one more, until the pool's
    timeout. Reads after WATCH on its own connection are covered by it all the same.
    """
    if not commands:
        return []
    connection = pipe.connection
    if connection is None:
        raise RuntimeError("_beside needs a pipeline that has sent its WATCH")
    return _unless_wrong(await exchange(connection, commands))


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
    what = f"a {found}, not" if found else "of another type than"
    return CorruptDataError(f"{key} is {what} the type worqr's layout gives it", key)


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


def announce(keys: Keys, queue: str, level: str, count: int) -> Command:
    """The ``work`` event of ``count`` tasks pushed at ``level``: ``work:N`` for
    normal ones, which a worker may take without a look at the levels; a bare
    ``work:`` (a look) for the others, so that the worker reads which level holds
    them rather than take from the normal list."""
    return ("PUBLISH", keys.events(queue), event("work", str(count) if level == "normal" else ""))


DONE_FIELD_LIMIT = 65_536
"""Characters of a task or result that a ``done`` record carries: a message over
Redis's pub/sub output-buffer limit (32 MB by default) would disconnect every
listener, and the ``cancel`` and ``delete`` events behind it would be lost."""
_DONE_MESSAGE_LIMIT = 1 << 20  # characters of records one ``done`` message carries


def done_record(
    process_id: str | None,
    worker_id: str,
    task: str,
    result: str | None,
    *,
    job_id: str | None = None,
    error: str | None = None,
    attempts: int | None = None,
) -> str:
    """One finished process, as JSON; a ``done`` message is a JSON array of these. A
    task or result longer than `DONE_FIELD_LIMIT` is cut there, with ``"truncated":
    true``. A job's record also has ``job_id`` (``task`` is its payload) and, when
    it ended failed, ``"status": "failed"`` and its ``error``."""
    cut = len(task) > DONE_FIELD_LIMIT or (result is not None and len(result) > DONE_FIELD_LIMIT)
    # As json.dumps would write the dict of these fields, at a third of its cost (one
    # record per finished task): strings through its own C quoting.
    record = (
        f'{{"process_id": {"null" if process_id is None else _quote(process_id)}, '
        f'"worker_id": {_quote(worker_id)}, '
        f'"task": {_quote(task[:DONE_FIELD_LIMIT])}, "result": {_json_str(result)}'
    )
    if job_id is not None:
        record += f', "job_id": {_quote(job_id)}, "status": '
        record += '"done"' if error is None else '"failed"'
        if attempts is not None:
            record += f', "attempts": {int(attempts)}'
        if error is not None:
            record += f', "error": {_quote(error[:DONE_FIELD_LIMIT])}'
    return record + (', "truncated": true}' if cut else "}")


_quote = json.encoder.encode_basestring_ascii


def _json_str(value: str | None) -> str:
    """A result cut at `DONE_FIELD_LIMIT`, or None, as JSON."""
    return "null" if value is None else _quote(value[:DONE_FIELD_LIMIT])


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
    """Send commands in one round trip, without MULTI; their replies in order, a
    WRONGTYPE error in place (any other error raised)."""
    return _unless_wrong(await _sent(client, commands))


async def _sent(client: Redis, commands: Iterable[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order, every
    error reply in its place."""
    async with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)


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
    except (MaxConnectionsError, NotApplied):
        raise  # nothing sent, or nothing applied
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise _unknown_outcome() from exc


def _transaction(commands: Sequence[Command]) -> Callable[[Redis], Awaitable[list[Any]]]:
    """What `on_slot` runs for one MULTI/EXEC of ``commands``: their replies."""

    async def run(node: Redis) -> list[Any]:
        return _unless_wrong(await transaction(node, commands))

    return run


async def _optimistic(
    r: Client,
    watch: Sequence[str],
    body: Callable[[Pipeline], Awaitable[_T]],
    *,
    slot: str | None = None,
) -> tuple[_T, list[Any]]:
    """WATCH ``watch``, run ``body`` (reads, then ``pipe.multi()`` and queued writes), EXEC.
    With no ``watch`` (the body watches what its first reads name), ``slot`` is a key
    of the slot the body works on.

    Returns the body's value and EXEC's replies (empty when the body wrote nothing),
    a WRONGTYPE error in place of the reply of a command that met a wrong-typed key
    (the other commands of the transaction were applied: the body checks the types
    of the keys whose failure could lose a task before it writes).
    The body is re-run when a watched key changed before EXEC. Contention is bounded:
    after many conflicts in a row the operation gives up with a `BackendError`. A
    connection lost before EXEC was sent (on the WATCH or the body's reads) applied
    nothing: `NotApplied`, which `on_slot` runs again on a Cluster. One lost with the
    MULTI/EXEC on its way (redis-py reports it as a WatchError rather than resending)
    is not re-run: the outcome is unknown, so `BackendUnavailableError`.
    """

    async def attempts(node: Redis) -> tuple[_T, list[Any]]:
        async with node.pipeline(transaction=True) as pipe:
            for _ in range(_MAX_ATTEMPTS):
                try:
                    if watch:
                        await pipe.watch(*watch)
                    result = await body(pipe)
                except RedisConnectionError as exc:  # on the WATCH, or a read beside it
                    unsent(exc)
                except WatchError as exc:  # lost while watching, before MULTI
                    if isinstance(exc.__context__, RedisConnectionError):
                        unsent(exc.__context__)
                    if isinstance(exc.__context__, RedisTimeoutError):
                        raise _unknown_outcome() from exc
                    continue
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
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {where}")

    where = slot if slot is not None else watch[0]
    return await on_slot(r, where, attempts)


async def _register_after(
    r: Client, keys: Keys, queue: str, push: Awaitable[_T], *, registered: bool = False
) -> _T:
    """Run a push, then add the queue to the registry (unless the push ``registered``
    it itself, inside its transaction): also when the push's outcome is unknown or
    its WAIT fell short, since the tasks may be there."""
    try:
        outcome = await push
    except (DuplicateTaskError, DependencyError, CorruptDataError):
        raise  # refused: nothing was pushed
    except Exception:
        with contextlib.suppress(RedisError, OSError):
            await call(r, "SADD", keys.queues, queue)
        raise
    if not registered:
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


@redis_boundary
async def cancel(once: Client, keys: Keys, queue: str, task: str) -> int:
    """Remove every queued copy of a task and release its unique mark (``once``: a
    client that never resends, see `_atomic`).

    Keys: high, tasks, low (LIST), unique (SET), deaths (HASH).
      1. MULTI
      2. LREM <level> 0 task            (each level) -> numbers removed
      3. SREM unique task
      4. HDEL deaths <sha1>
      5. PUBLISH events cancel:<task>   (running copies are the handlers' to stop)
      6. EXEC
    """

    removals: list[Command] = [("LREM", level, 0, task) for level in keys.levels(queue)]
    commands: list[Command] = [
        *removals,
        ("SREM", keys.unique(queue), task),
        ("HDEL", keys.deaths(queue), digest(task)),
        ("PUBLISH", keys.events(queue), event("cancel", task)),
    ]
    replies = await _atomic(once, keys.tasks(queue), commands)
    _raise_wrong(removals, replies[:3])  # the marks' keys are the check's to report
    return sum(int(reply) for reply in replies[:3])


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
    finds, in a read made after its sweep, no process and no task list (a process
    handed back between the sweep and the read, by a stop or a reclaim, is no longer
    recorded but its task is back in a list), at most `_DELETE_PASSES`: processes
    that appear after that come from tasks enqueued after the delete, which belong to
    the queue's next life.

    The registry entry goes after the data, and comes back if the queue's next life
    began meanwhile (tasks pushed, or a process taken from them): `enqueue` registers
    after its push, so a queue with tasks or processes is never left unregistered.
    Keys: holders, held:<w>..., blocking:<w>..., p:<id>..., high, tasks, low, failed,
    unique, deaths, delayed, deadlines, released, jobs, j:<id>..., after:<id>...; queues.
      0. SISMEMBER queues queue                                 -> known
      1. SMEMBERS holders;  ZRANGE jobs 0 -1;  SMEMBERS held:<w> (per holder) -> ids
         SMEMBERS blocking:<w> (per holder)     -> their p:<id> are swept too
      2. MULTI
      3. DEL high tasks low failed unique deaths delayed deadlines released j:<job>...
             after:<job>... p:<id>...
         ZREM jobs <job>...                             (the ids read: a job submitted
                                                          since is found by the next read)
      4. SREM held:<w> <id>...                                  (per holder)
      5. PUBLISH events delete:                                 (first pass)
      6. EXEC
         ZADD deleted <now> queue;  ZREMRANGEBYSCORE deleted -inf (<now - 1 h>
                                          (first pass; a queue registered or not empty)
      7. SMEMBERS holders;  SMEMBERS held:<w>;  EXISTS high tasks low
                                                -> ids, or a list: back to 2 with them
      8. `drop_holder` per holder
      9. SREM queues queue
     10. EXISTS high tasks low holders          -> any: SADD queues queue
    """
    doomed = [
        *keys.levels(queue),
        keys.failed(queue),
        keys.unique(queue),
        keys.deaths(queue),
        keys.delayed(queue),
        keys.deadlines(queue),
        keys.released(queue),
    ]

    async def read() -> tuple[list[str], list[list[str]], list[str]]:
        """Holders (every listed worker when holders is of the wrong type), their held
        ids, and the keys to delete besides `doomed`: those of the wrong type (which
        read as empty) and the records of the queue's jobs."""
        found = await reads(
            r, [("SMEMBERS", keys.holders(queue)), ("ZRANGE", keys.jobs(queue), 0, -1)]
        )
        jobs = [keys.jobs(queue)] if is_wrong_type(found[1]) else []
        ids.clear()
        ids.extend(members(found[1]))
        jobs += [keys.job(queue, job_id) for job_id in ids]
        jobs += [keys.after(queue, job_id) for job_id in ids]
        found = found[:1]
        holders = members(found[0])
        if is_wrong_type(found[0]):  # it names nobody: any listed worker may hold some
            holders = members((await reads(r, [("SMEMBERS", keys.workers)]))[0])
        commands: list[Command] = [("SMEMBERS", keys.held(queue, w)) for w in holders]
        takes: list[Command] = [("SMEMBERS", keys.blocking(queue, w)) for w in holders]
        held = await reads(r, commands)
        blocked = await reads(r, takes)
        wrong = wrong_keys([("SMEMBERS", keys.holders(queue))], found)
        wrong += wrong_keys(commands, held) + wrong_keys(takes, blocked)
        # A blocking take's list (a task its block moved, not yet held) goes like a
        # process; its id stays: the take withdraws it (see `_ops_block`).
        taken.clear()
        taken.extend(keys.process(queue, pid) for reply in blocked for pid in members(reply))
        return holders, [members(reply) for reply in held], wrong + jobs

    ids: list[str] = []  # the job ids the last read found in the index
    taken: list[str] = []  # the lists of the blocking takes the last read found
    (known,) = await reads(r, [("SISMEMBER", keys.queues, queue)])
    holders, held, wrong = await read()
    for attempt in range(_DELETE_PASSES):
        processes = [keys.process(queue, pid) for pids in held for pid in pids]
        sweep: list[Command] = [("DEL", *doomed, *wrong, *processes, *taken)]
        if ids:  # by id, not the whole index: a job submitted meanwhile stays indexed,
            sweep.append(("ZREM", keys.jobs(queue), *ids))  # so the next read finds it
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
        # sweep survived it, and only a read made after the sweep can see it; and a
        # process handed back meanwhile (a stop or reclaim between the sweep and this
        # read) left the held sets but brought its task back to a list.
        holders, held, wrong = await read()
        if not any(held) and not wrong and not await call(r, "EXISTS", *keys.levels(queue)):
            break
    for worker_id in holders:
        await drop_holder(r, keys, queue, worker_id)
    await reads(r, [("SREM", keys.queues, queue)])  # a wrong-typed registry: check's
    if await call(r, "EXISTS", *keys.levels(queue), keys.holders(queue)):
        await reads(r, [("SADD", keys.queues, queue)])  # the queue's next life began


@redis_boundary
async def retry_failed(
    r: Client, keys: Keys, queue: str, limit: int | None, only: str | None = None
) -> int:
    """Move the oldest ``limit`` (default all) failed tasks to the back of the queue,
    or with ``only`` the one record of that id (`failed_id`); a job goes back as a new
    life with a fresh set of attempts.

    Keys: queues (SET), failed (LIST of JSON records), tasks (LIST); jobs' j:<id>, jobs.
      1. WATCH failed;  LRANGE failed 0 limit-1      -> records (none: UNWATCH, 0)
         (``only``: LRANGE failed 0 -1, the record of that id)
         TYPE tasks                                   -> not a list: UNWATCH, raise
         (jobs) WATCH j:<id>...;  ZMSCORE jobs <id>... -> live ids (submitted anew
                                                         since): their records stay
      2. MULTI
      3. LTRIM failed <n> -1;  LPUSH failed <record of a live id>...  (order kept)
         (``only``: LREM failed 1 <record>, unless its id is live)
      4. RPUSH <level> task...                        (a job: its envelope, attempt 1,
                                                         to its priority's list)
      5. per job: DEL j:<id>;  HSET j:<id> env <envelope> state queued attempts 0
                  max <m> enqueued <e>;  ZADD jobs +inf <id>
      6. PUBLISH events work:<n>                      (work: when not all are normal)
      7. EXEC                                         -> nil: back to 1
      8. SADD queues queue                            (if any moved: after the push)
    """

    async def body(pipe: Pipeline) -> int:
        stop = -1 if limit is None or only is not None else limit - 1
        records = await read(pipe, "LRANGE", keys.failed(queue), 0, stop)
        if only is not None:
            records = [record for record in records if failed_id(text(record)) == only][:1]
        if not records:
            return 0
        failed = [(text(record), parse_failed(record)) for record in records]
        lives = [(raw, task, _new_life(task)) for raw, task in failed]
        for level in {"normal" if env is None else env.header.priority for _, _, env in lives}:
            await _require(pipe, keys.level(queue, level), "list")  # else records are lost
        ids = [env.header.id for _, _, env in lives if env is not None]
        live: set[str] = set()
        if ids:  # an id submitted anew since is that job's now: its old life waits
            await pipe.watch(*(keys.job(queue, job_id) for job_id in ids))
            scores = await read(pipe, "ZMSCORE", keys.jobs(queue), *ids)
            live = {job_id for job_id, score in zip(ids, scores, strict=True) if live_score(score)}
        kept, moved = [], []
        life = new_life()
        for raw, task, env in lives:  # one life per id: a second record of it waits
            if env is not None and env.header.id in live:
                kept.append(raw)
                continue
            moved.append((task, env))
            if env is not None:
                live.add(env.header.id)
        pipe.multi()
        if only is not None:
            if moved:
                pipe.execute_command("LREM", keys.failed(queue), 1, failed[0][0])
        else:
            pipe.execute_command("LTRIM", keys.failed(queue), len(failed), -1)
            if kept:
                pipe.execute_command("LPUSH", keys.failed(queue), *reversed(kept))
        if moved:
            _push_levels(
                pipe,
                keys,
                queue,
                [
                    ("normal", stored(task.task)) if env is None else (env.header.priority, env.raw)
                    for task, env in moved
                ],
            )
            for _, env in moved:
                if env is not None:
                    _record_job(pipe, keys, queue, env, "queued", life=life)
        return len(moved)

    if limit is not None and limit <= 0:
        return 0
    moved, _ = await _optimistic(r, [keys.failed(queue)], body)
    if moved:  # after the push, as `enqueue` (a wrong-typed registry: check's)
        await reads(r, [("SADD", keys.queues, queue)])
    return moved


def failed_id(record: str) -> str:
    """The id of a failed-list record: the first 16 hex digits of the SHA-256 of its
    stored text. Every record has one (those of older versions and foreign ones too),
    it never changes while the record is listed, and records differ in their time and
    worker, so two with one id are the same failure listed twice."""
    return hashlib.sha256(record.encode("utf-8", "surrogateescape")).hexdigest()[:16]


@redis_boundary
async def drop_failed(r: Client, keys: Keys, queue: str, record_id: str) -> bool:
    """Remove the failed record of that id; whether it was there.

    Keys: failed (LIST).
      1. LRANGE failed 0 -1                 -> the record of that id (none: False)
      2. LREM failed 1 <record>             -> 0: gone meanwhile (retried or dropped)
    LREM by value needs no transaction: it removes that record or nothing.
    """
    records = await read(r, "LRANGE", keys.failed(queue), 0, -1)
    for record in records:
        if failed_id(text(record)) == record_id:
            return bool(await read(r, "LREM", keys.failed(queue), 1, record))
    return False


@redis_boundary
async def clear_failed(r: Client, keys: Keys, queue: str) -> int:
    """Remove every failed record of the queue; how many there were.

    Keys: failed (LIST).
      1. WATCH failed;  TYPE failed         -> not a list: UNWATCH, `CorruptDataError`
                                              (check() repairs it; nothing is deleted)
      2. MULTI;  LLEN failed;  DEL failed;  EXEC   -> the length it had
    """

    async def body(pipe: Pipeline) -> None:
        await _require(pipe, keys.failed(queue), "list")
        pipe.multi()
        pipe.execute_command("LLEN", keys.failed(queue))
        pipe.execute_command("DEL", keys.failed(queue))

    _, (length, _) = await _optimistic(r, [keys.failed(queue)], body)
    return int(length)


def _push_levels(pipe: Pipeline, keys: Keys, queue: str, items: Sequence[tuple[str, Any]]) -> None:
    """Queue `level_pushes` on a transaction's pipeline."""
    for command in level_pushes(keys, queue, items):
        pipe.execute_command(*command)


def level_pushes(keys: Keys, queue: str, items: Sequence[tuple[str, Any]]) -> list[Wire]:
    """The RPUSH of each (level, stored task) to the back of its level's list, in
    order within a level, and one ``work`` event (``work:N`` when all are normal)."""
    commands: list[Wire] = []
    for level in LEVELS:
        tasks = [task for at, task in items if at == level]
        if tasks:
            commands.append(("RPUSH", keys.level(queue, level), *tasks))
    mixed = any(level != "normal" for level, _ in items)
    commands.append(announce(keys, queue, "high" if mixed else "normal", len(items)))
    return commands


def _new_life(task: FailedTask) -> Envelope | None:
    """The envelope a failed job is retried with (attempt 1 again); None for a plain
    task (or a job record whose envelope is unreadable: its payload goes back plain)."""
    if task.envelope is None:
        return None
    found = envelope_of(task.envelope)
    if found is None:
        return None
    header = found.header.first_attempt()
    return Envelope(header, found.payload, wrap(header, found.payload))


def new_life() -> str:
    """A token that tells the lives of one job id apart (``life`` in `Keys.job`). One
    per transaction that starts lives is enough: none starts two lives of one id."""
    return secrets.token_hex(8)


def _record_job(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    env: Envelope,
    state: str,
    due: int | None = None,
    *,
    life: str,
) -> None:
    """Queue the writes of a job's record at the start of a life (submit, retry of a
    failed job): a fresh hash, live in the index.

      DEL j:<id>;  HSET j:<id> env <envelope> state <state> attempts 0 max <m>
      enqueued <e> life <life> [due <due>];  ZADD jobs +inf <id>
    """
    header = env.header
    record = keys.job(queue, header.id)
    fields: list[str | int] = [
        "env",
        env.raw,
        "state",
        state,
        "attempts",
        header.attempt - 1,
        "max",
        header.max_attempts,
        "enqueued",
        header.enqueued_at,
        "life",
        life,
    ]
    if due is not None:
        fields += ["due", due]
    pipe.execute_command("DEL", record)
    pipe.execute_command("HSET", record, *fields)
    pipe.execute_command("ZADD", keys.jobs(queue), "+inf", header.id)


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

    1. LLEN high;  LLEN tasks;  LLEN low
    2. PUBLISH events work:<count>   (if count > 0; a bare work: if not all are normal)
    """
    lengths = await reads_checked(r, [("LLEN", level) for level in keys.levels(queue)])
    high, normal, low = (int(n) for n in lengths)
    if high or normal or low:
        await publish(r, keys, queue, "work", "" if high or low else str(normal))
    return high + normal + low


def parse_failed(record: bytes | str) -> FailedTask:
    """Decode one failed-list record; total: a record worqr did not write (not JSON,
    or not of this shape) is returned whole as the task, with an error saying so, so
    that listing, retrying and deleting failed tasks go on around it."""
    raw = text(record)
    unreadable = FailedTask(
        task=raw, error="unreadable failed record", worker_id="", failed_at=0.0, id=failed_id(raw)
    )
    try:
        data = json.loads(raw)
        task, error, worker_id, failed_at = (
            data["task"],
            data["error"],
            data["worker_id"],
            float(data["failed_at"]),
        )
        job_id, attempts = data.get("job_id"), data.get("attempts", 1)
        trace, envelope = data.get("traceback", ""), data.get("envelope")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return unreadable
    if not all(isinstance(value, str) for value in (task, error, worker_id, trace)):
        return unreadable
    if not (job_id is None or isinstance(job_id, str)) or not (
        envelope is None or isinstance(envelope, str)
    ):
        return unreadable
    return FailedTask(
        task=task,
        error=error,
        worker_id=worker_id,
        failed_at=failed_at,
        job_id=job_id,
        attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 1,
        traceback=trace,
        envelope=envelope,
        id=failed_id(raw),
    )


# -- jobs ---------------------------------------------------------------------------------

DUE_EVENT = "delayed"
"""The event announcing a due time (``delayed:<unix ms>``): workers of the queue wake
then to promote what is due."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One job to submit: its first envelope, and when it is due (None: now)."""

    envelope: Envelope
    due_ms: int | None


@redis_boundary
async def submit(
    r: Client,
    once: Client,
    keys: Keys,
    queue: str,
    jobs: Sequence[Submission],
    *,
    check: bool,
    wait: tuple[int, int] | None = None,
) -> int | None:
    """Submit jobs: each a fresh record, its envelope at the back of the queue or in
    the delayed set. With ``check`` (ids given by the caller), none is written if one
    of the ids is live (queued, delayed or running) in the queue: `DuplicateTaskError`.
    With ``wait`` (replicas, timeout in ms), return how many replicas confirmed it.

    Keys: j:<id>... (HASH), jobs (ZSET), tasks or high or low (LIST: the jobs'
    priority's, written ``tasks`` below), delayed (ZSET); queues.
      1. (check) WATCH j:<id>...;  ZMSCORE jobs <id>...  -> any +inf: UNWATCH, raise
      2. MULTI
      3. per job: DEL j:<id>;  HSET j:<id> env .. state queued|delayed attempts 0
                  max .. enqueued .. life .. [due ..];  ZADD jobs +inf <id>
      4. RPUSH tasks <envelope>...                 (jobs due now, in order)
      5. ZADD delayed <due> <envelope> ...         (the others)
      6. PUBLISH events work:<n>;  PUBLISH events delayed:<earliest due>
      7. SADD queues queue                         (one server: after the push, inside
                                                    the transaction)
      8. EXEC                                      -> nil: back to 1
      9. WAIT <replicas> <timeout>                 (with ``wait``: on the connection
                                                    of 1-8, never resent)
     10. SADD queues queue                         (a Cluster: its own slot, after 8)
    Without ``check`` (fresh random ids) steps 2-8 are one round trip, through
    ``once`` (a client that never resends, see `_atomic`): a resent transaction whose
    first reply was lost would queue the job twice. The outcome is then unknown:
    `BackendUnavailableError`.
    """
    ids = check_ids(jobs)
    pushed_to = keys.level(queue, jobs[0].envelope.header.priority)
    ready = [job.envelope.raw for job in jobs if job.due_ms is None]
    later = [job for job in jobs if job.due_ms is not None]
    registers = isinstance(r, Redis)  # one server: the registry joins the transaction
    life = new_life()

    def writes(pipe: Pipeline) -> None:
        submit_writes(pipe, keys, queue, jobs, life=life)
        if registers:
            pipe.execute_command("SADD", keys.queues, queue)

    async def body(pipe: Pipeline) -> None:
        # In one round trip: the ids in the index, and the types of the keys the push
        # writes (a push failing inside MULTI would replace the records of ended
        # lives, their outcomes, for nothing).
        scores, *types = await _beside(
            pipe,
            [
                ("ZMSCORE", keys.jobs(queue), *ids),
                ("TYPE", pushed_to),
                ("TYPE", keys.delayed(queue)),
            ],
        )
        if is_wrong_type(scores):  # ids cannot be checked against the index: refused
            await pipe.reset()
            raise _corrupt(keys.jobs(queue))
        for key, kind, found, needed in (
            (pushed_to, "list", types[0], ready),
            (keys.delayed(queue), "zset", types[1], later),
        ):
            if needed and text(found) not in (kind, "none"):
                await pipe.reset()
                raise _corrupt(key, text(found))
        live = [job_id for job_id, score in zip(ids, scores, strict=True) if live_score(score)]
        if live:
            await pipe.reset()
            raise DuplicateTaskError(
                f"job {live[0]!r} is already queued, delayed, running or waiting"
            )
        pipe.multi()
        writes(pipe)

    async def transaction(node: Redis) -> list[Any]:
        async with node.pipeline(transaction=True) as pipe:
            writes(pipe)
            try:
                return _unless_wrong(await pipe.execute(raise_on_error=False))
            except (MaxConnectionsError, NotApplied):
                raise  # nothing sent (a refused connect is re-routed by on_slot)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                raise _unknown_outcome() from exc

    async def pushed(client: Client, node_once: Client) -> None:
        if check:
            watch = [keys.job(queue, job_id) for job_id in ids]
            _, replies = await _optimistic(client, watch, body)
        else:
            replies = await on_slot(node_once, keys.tasks(queue), transaction)
        if registers:
            replies = replies[:-1]  # a wrong-typed registry fails only its SADD: check's
        # The records come first (3 commands a job), then the pushes. A wrong-typed
        # index fails only its ZADD: the job is queued and recorded (check reports
        # the index, and the repair indexes the live jobs anew); a given id is refused
        # before (its duplicates cannot be checked). A push that met a wrong-typed key
        # (not checked on this path, for one round trip): withdraw the records.
        if any(is_wrong_type(reply) for reply in replies[3 * len(jobs) :]):
            await reads(r, [("DEL", *(keys.job(queue, job_id) for job_id in ids))])
            await reads(r, [("ZREM", keys.jobs(queue), *ids)])
            raise CorruptDataError(
                f"{pushed_to} or {keys.delayed(queue)} is of another type than"
                " worqr's layout gives it",
                pushed_to,
            )

    if wait is None:
        await _register_after(r, keys, queue, pushed(r, once), registered=registers)
        return None

    async def waited(node: Redis, wait: tuple[int, int] = wait) -> int:
        async with pinned(node) as one:  # WAIT counts the writes of its own connection
            await pushed(one.client, one.client)
            return await _wait(one, wait)

    return await _register_after(
        r, keys, queue, on_slot(once, keys.tasks(queue), waited), registered=registers
    )


def check_ids(jobs: Sequence[Submission]) -> list[str]:
    """The ids of one submit's jobs; `DuplicateTaskError` if one appears twice."""
    ids = [job.envelope.header.id for job in jobs]
    if len(set(ids)) != len(ids):
        raise DuplicateTaskError("the same job id appears twice in one submit")
    return ids


def submit_writes(
    pipe: Pipeline, keys: Keys, queue: str, jobs: Sequence[Submission], *, life: str
) -> None:
    """Queue the writes of `submit` (steps 3-6): the records, the pushes of the jobs
    due now (one priority per submit) and the delayed set's entries of the others."""
    level = jobs[0].envelope.header.priority
    ready = [job.envelope.raw for job in jobs if job.due_ms is None]
    later = [job for job in jobs if job.due_ms is not None]
    for job in jobs:
        state = "queued" if job.due_ms is None else "delayed"
        _record_job(pipe, keys, queue, job.envelope, state, job.due_ms, life=life)
    if ready:
        pipe.execute_command("RPUSH", keys.level(queue, level), *ready)
        pipe.execute_command(*announce(keys, queue, level, len(ready)))
    if later:
        pairs = [part for job in later for part in (job.due_ms, job.envelope.raw)]
        pipe.execute_command("ZADD", keys.delayed(queue), *pairs)
        earliest = min(job.due_ms or 0 for job in later)
        pipe.execute_command("PUBLISH", keys.events(queue), event(DUE_EVENT, str(earliest)))


def live_score(score: Any) -> bool:
    """Whether a ``jobs`` score says the job lives (+inf)."""
    if score is None or isinstance(score, Exception):
        return False
    try:
        return float(text(score) if isinstance(score, bytes | str) else score) == float("inf")
    except (TypeError, ValueError):
        return False


_PROMOTE_BATCH = 1000  # envelopes one promotion moves at most
_LOOK_AHEAD_MS = 5  # a promotion reads this far past its caller's guess of the time


@dataclass(frozen=True, slots=True)
class Promotion:
    """What one promotion did."""

    moved: int
    next_due_ms: int | None
    """The due time of the earliest job still delayed, None if none."""
    now_ms: int
    """The server's time the promotion judged by."""


@redis_boundary
async def promote(r: Client, keys: Keys, queue: str, guess_ms: int) -> Promotion:
    """Move the jobs whose due time has come (by the server's ``TIME``) from the
    delayed set to the back of the queue, earliest first, in three round trips.

    ``guess_ms`` is the caller's estimate of the server's time: the first round trip
    reads the entries due by then (and `_LOOK_AHEAD_MS` more) beside ``TIME``, and
    only those the server's time has reached move. A guess behind the server (this
    host's clock was stepped back) leaves due entries unread, which the entry read
    after them shows: they are read again up to the server's time, one round trip
    more. Only what is due (by the guess) is read, and the one entry after it,
    however many jobs wait for later.

    Every worker of the queue may try at once: one moves each job, the others find it
    gone. The fence is the due jobs' records, which every other writer that takes a
    job out of the delayed set writes too (a promotion, `cancel_job`, `delete_queue`),
    not the delayed set itself: each `submit` with a delay writes that, and under
    live traffic a WATCH on it failed nearly every EXEC. An entry that is no job
    (nothing else writes one, but data under the prefix may be anything) is fenced
    by the set.
      1. TIME                                          -> now (ms)
         ZRANGE delayed -inf <horizon> BYSCORE LIMIT 0 1000 WITHSCORES
         ZRANGE delayed (<horizon> +inf BYSCORE LIMIT 0 1 WITHSCORES
                                    (one round trip)   -> those due: score <= now
         (the entry after them due too: the same with <now> as the horizon)
         (none due: done)
      2. WATCH j:<id>...  (and delayed, for a non-job)
         ZMSCORE delayed <envelope>...;  TYPE <level>...
                                    (one round trip)   -> gone or not due: left out
                                                          (none left: UNWATCH)
      3. MULTI
         ZREM delayed <envelope>...
         RPUSH <level> <envelope>...                   (each to its priority's list)
         HSET j:<id> state queued;  HDEL j:<id> due    (per job)
         PUBLISH events work:<n>                       (work: when not all are normal)
         SADD queues queue                             (one server: in the transaction)
         EXEC                                          -> nil: back to 1
      4. SADD queues queue                             (a Cluster: another slot)
    """
    delayed = keys.delayed(queue)
    single = isinstance(r, Redis)

    def looks(horizon: int) -> list[Wire]:
        return [
            ("TIME",),
            (
                "ZRANGE",
                delayed,
                "-inf",
                horizon,
                "BYSCORE",
                "LIMIT",
                0,
                _PROMOTE_BATCH,
                "WITHSCORES",
            ),
            ("ZRANGE", delayed, f"({horizon}", "+inf", "BYSCORE", "LIMIT", 0, 1, "WITHSCORES"),
        ]

    async def first_look(session: Watching, horizon: int) -> tuple[int, list[Any], list[Any]]:
        """Step 1: the server's time, the entries up to ``horizon``, the one after."""
        clock, head, after = _unless_wrong(await session.look([], looks(horizon)))
        _raise_wrong([("ZRANGE", delayed)], [head])
        return server_ms(clock), _pairs(head), _pairs(after)

    async def attempt(session: Watching) -> Promotion | None:
        now, head, after = await first_look(session, guess_ms + _LOOK_AHEAD_MS)
        if len(head) < _PROMOTE_BATCH and any(_reached(score, now) for _, score in after):
            now, head, after = await first_look(session, now)  # the guess is behind
        due = [text(member) for member, score in head if _reached(score, now)]
        waiting = [_ms(score) for _, score in head if not _reached(score, now)]
        waiting += [_ms(score) for _, score in after]
        next_due = min((ms for ms in waiting if ms is not None), default=None)
        if len(due) == _PROMOTE_BATCH:
            next_due = now  # more may be due: the caller promotes again at once
        if not due:
            return Promotion(0, next_due, now)
        ids = [_job_id(member) for member in due]
        fences = {keys.job(queue, job_id) for job_id in ids if job_id is not None}
        moving = [stored(member) for member in due]  # written back as they are stored
        levels = [level_of_stored(member) for member in due]
        kinds = sorted(set(levels))
        replies = _unless_wrong(
            await session.look(
                [*sorted(fences), *([delayed] if None in ids else [])],
                [("ZMSCORE", delayed, *moving)] + [("TYPE", keys.level(queue, k)) for k in kinds],
            )
        )
        for level, found in zip(kinds, replies[1:], strict=True):
            if text(found) not in ("list", "none"):
                raise _corrupt(keys.level(queue, level), text(found))
        still = [_reached(score, now) for score in replies[0]]
        if not any(still):
            return Promotion(0, next_due, now)
        moved = [i for i, kept in enumerate(still) if kept]
        writes: list[Wire] = [("ZREM", delayed, *(moving[i] for i in moved))]
        writes += level_pushes(keys, queue, [(levels[i], moving[i]) for i in moved])
        for i in moved:
            job_id = ids[i]
            if job_id is not None:
                writes.append(("HSET", keys.job(queue, job_id), "state", "queued"))
                writes.append(("HDEL", keys.job(queue, job_id), "due"))
        if single:
            writes.append(("SADD", keys.queues, queue))
        try:
            outcome = await session.commit(writes)
        except MaxConnectionsError:
            raise
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _unknown_outcome() from exc
        if outcome is None:
            return None  # a fence changed: read again
        _unless_wrong(outcome)
        return Promotion(len(moved), next_due, now)

    async def run(node: Redis) -> Promotion:
        async with watching(node) as session:
            for _ in range(_MAX_ATTEMPTS):
                done = await attempt(session)
                if done is not None:
                    return done
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {delayed}")

    done = await on_slot(r, delayed, run)
    if done.moved and not single:
        await reads(r, [("SADD", keys.queues, queue)])
    return done


def _reached(score: Any, now: int) -> bool:
    """Whether a delayed entry's score (None: gone) is ``now`` or earlier. A score
    below any time (``-inf``: nothing worqr writes) counts as reached: the entry moves
    as any due one does, rather than hold the head of the set, and every promotion
    behind it, for good."""
    try:
        return float(text(score) if isinstance(score, bytes | str) else score) <= now
    except (TypeError, ValueError):
        return False


def level_of_stored(task: str) -> str:
    """The priority level a stored task goes back to: its envelope's, else normal."""
    envelope = envelope_of(task)
    return "normal" if envelope is None else envelope.header.priority


def server_ms(reply: Any) -> int:
    """A ``TIME`` reply (seconds, microseconds) as Unix ms."""
    seconds, micros = reply
    return int(text(seconds)) * 1000 + int(text(micros)) // 1000


def fields_of(reply: Any) -> dict[str, str]:
    """An ``HGETALL`` reply as a dict of str, whether the client paired it."""
    pairs = reply.items() if isinstance(reply, dict) else _pairs(reply)
    return {text(k): text(v) for k, v in pairs}


def _pairs(reply: Any) -> list[tuple[Any, Any]]:
    """A WITHSCORES reply as (member, score) pairs, whether the client paired them."""
    if reply and not isinstance(reply[0], list | tuple):
        return list(zip(reply[::2], reply[1::2], strict=True))
    return [(member, score) for member, score in reply]


def _job_id(task: str) -> str | None:
    envelope = envelope_of(task)
    return None if envelope is None else envelope.header.id


def job_label(task: str) -> str:
    """A job's id, or for anything else in a delayed set, its first characters."""
    job_id = _job_id(task)
    return job_id if job_id is not None else repr(task[:40])


@redis_boundary
async def next_due(r: Client, keys: Keys, queues: Sequence[str]) -> list[int | None]:
    """The earliest due time in each queue's delayed set (Unix ms), None for none.

    1. ZRANGE delayed 0 0 WITHSCORES             (per queue, one round trip)
    """
    replies = await reads(r, [("ZRANGE", keys.delayed(q), 0, 0, "WITHSCORES") for q in queues])
    return [_first_due(reply) for reply in replies]


@redis_boundary
async def delayed_jobs(r: Client, keys: Keys, queue: str, limit: int) -> list[tuple[int, str]]:
    """The delayed set, next first: (due time in Unix ms, stored envelope).

    1. ZRANGE delayed 0 <limit - 1> WITHSCORES
    """
    reply = await read(r, "ZRANGE", keys.delayed(queue), 0, limit - 1, "WITHSCORES")
    found = [(_ms(score), text(member)) for member, score in _pairs(reply)]
    return [(due, member) for due, member in found if due is not None]


@redis_boundary
async def set_deadlines(
    r: Client, keys: Keys, queue: str, deadlines: Sequence[tuple[str, int]]
) -> None:
    """Record when peers may take processes of jobs with a timeout away (Unix ms,
    server time: the timeout plus a grace from the dequeue).

    1. ZADD deadlines <deadline> <id> ...
    """
    pairs = [part for pid, deadline in deadlines for part in (deadline, pid)]
    await reads(r, [("ZADD", keys.deadlines(queue), *pairs)])


@redis_boundary
async def take_overdue(r: Client, keys: Keys, ref: ProcessRef, error: str, now_ms: int) -> bool:
    """End an attempt that ran past its deadline, as timed out (see `fail`: it may be
    retried), whoever holds it; False if the process was gone (its deadline entry is
    then dropped). Fenced as every end: a holder's late finish finds it gone.

    1. `fail` (ref, error)
    2. ZREM deadlines <id>                      (the process was gone)
    """
    if await fail(r, keys, ref, error, now_ms) is not None:
        return True
    await reads(r, [("ZREM", keys.deadlines(ref.queue), ref.id)])
    return False


@redis_boundary
async def cancel_job(r: Client, keys: Keys, queue: str, job_id: str, now_ms: int) -> bool:
    """End a job that is waiting, queued, delayed or running, as failed with the
    error ``cancelled``; False if it is unknown or already ended.

    A running attempt cannot be removed from its process here: the ``cancel`` event
    asks its worker to stop it, and whatever ends the attempt later (`finish`,
    `fail`, `stop`, `reclaim`) sees the job ended: it keeps this outcome and puts
    the job nowhere again.
      1. WATCH j:<id>;  HMGET j:<id> state env waited after
                                                  -> not waiting/queued/delayed:
                                                     UNWATCH, False
         LPOS tasks <env>                         (queued: nil means an attempt runs)
         found: WATCH tasks;  LPOS tasks <env>    (a dequeue since the first look, or
                                                   before EXEC, is not missed)
         (waited) TYPE released;  TYPE after:<id>   -> not sets: UNWATCH, raise
                  WATCH after:<id>;  SMEMBERS after:<id>   -> the jobs to hand on
      2. MULTI
      3. LREM tasks 0 <envelope>;  ZREM delayed <envelope>;  HDEL deaths job:<id>
         (waiting) SREM released <id>;  SREM after:<dependency> <id>...
      4. the writes of `_end_job` with the error "cancelled"
      5. PUBLISH events cancel:<envelope>
      6. PUBLISH done done:[{"job_id", "status": "failed", "error": "cancelled", ...}]
      7. EXEC                                    -> nil: back to 1
    """
    record = keys.job(queue, job_id)

    async def body(pipe: Pipeline) -> bool:
        state, raw, waited_on, after = await read(pipe, "HMGET", record, *LOOK, "after")
        if state is None or raw is None or text(state) not in ("waiting", "queued", "delayed"):
            return False
        envelope = envelope_of(text(raw))
        if envelope is None:
            return False
        attempts = envelope.header.attempt - 1  # the attempts that ended
        waits_in = keys.level(queue, envelope.header.priority)
        if text(state) == "queued" and not await _still_queued(pipe, waits_in, raw):
            attempts += 1  # not in the list: an attempt runs (and counts)
        waiters = None
        if waited_on is not None:
            waiters = await _waiters(pipe, keys, queue, job_id)
        pipe.multi()
        pipe.execute_command("LREM", waits_in, 0, envelope.raw)
        pipe.execute_command("ZREM", keys.delayed(queue), envelope.raw)
        pipe.execute_command("HDEL", keys.deaths(queue), f"job:{job_id}")
        if text(state) == "waiting":  # its entries go (stale ones would be harmless)
            pipe.execute_command("SREM", keys.released(queue), job_id)
            for dependency in dependencies_of(None if after is None else text(after)):
                pipe.execute_command("SREM", keys.after(queue, dependency), job_id)
        _end_job(
            pipe,
            keys,
            queue,
            envelope.header,
            now_ms,
            error=CANCELLED,
            attempts=attempts,
            waiters=waiters,
        )
        _trim_jobs(pipe, keys, queue, now_ms)
        pipe.execute_command("PUBLISH", keys.events(queue), event("cancel", envelope.raw))
        notice = done_record(None, "", envelope.payload, None, job_id=job_id, error=CANCELLED)
        pipe.execute_command("PUBLISH", keys.done(queue), event("done", f"[{notice}]"))
        return True

    cancelled, _ = await _optimistic(r, [record], body)
    return cancelled


CANCELLED = "cancelled"
"""The error of a cancelled job."""


async def _still_queued(pipe: Pipeline, tasks: str, envelope: Any) -> bool:
    """Whether ``envelope`` waits in the list ``tasks``, and will until EXEC: once it
    is found, the list is watched and looked at again, so that a dequeue (an attempt
    that counts) is seen whether it ran before the watch or runs before EXEC."""
    if await read(pipe, "LPOS", tasks, envelope) is None:
        return False
    await pipe.watch(tasks)
    return await read(pipe, "LPOS", tasks, envelope) is not None


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job's record as read (see `Keys.job`), with where its envelope was found."""

    fields: dict[str, str]
    queued: bool
    """The live envelope is in the queue's task list (else, if live and not
    delayed, a worker runs it); True when it was not looked for."""


@redis_boundary
async def job_record(
    r: Client, keys: Keys, queue: str, job_id: str, *, locate: bool = True
) -> JobRecord | None:
    """A job's record, None if there is none; with ``locate``, a live job's envelope
    is looked for in the task list (queued, or running).

    1. HGETALL j:<id>
    2. LPOS tasks <envelope>                     (``locate``, state queued: O(position))
    """
    raw = await read(r, "HGETALL", keys.job(queue, job_id))
    if not raw:
        return None
    fields = fields_of(raw)
    queued = True
    if locate and fields.get("state") == "queued" and "env" in fields:
        level = level_of_stored(fields["env"])
        queued = await read(r, "LPOS", keys.level(queue, level), fields["env"]) is not None
    return JobRecord(fields, queued)


# -- processes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Look:
    """What a dequeue read of a queue besides its tasks: its flow control, and whether
    its high or low list held tasks (a worker then looks before each take)."""

    flow: Flow
    leveled: bool


NewIds = Callable[[Sequence[str]], list[str]]
"""Fresh process ids, one per level given (the level goes into the id's token)."""


def _lengths(replies: Sequence[Any]) -> dict[str, int]:
    """The LLEN replies of a queue's levels (highest first) by level."""
    return {level: int(reply) for level, reply in zip(LEVELS, replies, strict=True)}


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
    new_ids: NewIds | None = None,
    seen: Callable[[Look], None] | None = None,
    picker: Picker | None = None,
    policy: str = "weighted",
    normal: bool = True,
) -> list[Process]:
    """Move up to ``count`` tasks from the heads of the queue's level lists into new
    processes of this worker, the levels chosen by ``picker`` under ``policy`` (see
    `_levels`), FIFO within a level; an empty list when the queue is empty. Raises
    `Paused` (nothing taken) while the queue is paused; a queue with a rate limit
    goes through `_dequeue_limited`.

    ``new_ids(levels)`` makes fresh process ids (a worker keeps them known as in
    flight; by default they are made here); ``seen(look)`` is told the queue's flow
    control and levels as read (a worker skips the announced path of a queue that is
    rate-limited or has tasks of other levels than normal). Without ``normal`` the
    normal level is left alone (a blocking take's task may be on its way back to its
    front: a task taken behind it would run first).
    ``once`` is a client whose transactions are never resent (see `_connections`):
    the transaction must not run twice. If its reply is lost, LINDEX p:<id> 0 for each
    id tells whether it took effect: then its processes are adopted. Otherwise it is
    sent again with FRESH ids, because "not yet" is not "never": a transaction held up
    on the way (a timeout, a slow link) can still land later, and with the same ids it
    would append a second task to each process list. Processes of an attempt that lands
    late are unknown to the worker, and its audit returns them to the front.
    Keys: high, tasks, low (LIST), p:<id>... (LIST), held:<w> (SET), holders (SET),
    flow (HASH).
      1. LLEN high;  LLEN tasks;  LLEN low;  HMGET flow paused limit per
                                          -> paused: raise; limited: `_dequeue_limited`;
                                             all 0: return (an idle poll: one round trip)
                                             (skipped when ``announced``: a ``work:N``
                                             event just said N normal tasks came)
      2. MULTI                            (k slots, each given a level by the picker)
      3. LMOVE <level> p:<idi> LEFT RIGHT for i = 1..k -> the task, or nil once empty
      4. SADD held:<w> <id1> ... <idk>
      5. SADD holders <w>
      6. HMGET flow paused limit per      -> paused or limited since step 1: what was
                                             taken goes back to the front (`_undo`)
      7. EXEC
      8. (some LMOVE found its list empty) SREM held:<w> <unused ids>
    The SADD cannot be conditional on the LMOVEs inside MULTI, so ids that got no task
    are withdrawn in step 8; an id left behind by a crash there names no process list
    and goes with the next reclaim.
    """
    if new_ids is None:

        def new_ids(levels: Sequence[str]) -> list[str]:
            return [new_process_id(worker_id, queue, level).id for level in levels]

    if announced:
        levels = ["normal"] * count
    else:
        replies = await reads(
            r, [*(("LLEN", key) for key in keys.levels(queue)), read_flow(keys, queue)]
        )
        _raise_wrong([("LLEN", key) for key in keys.levels(queue)], replies[:3])
        lengths = _lengths(replies[:3])
        flow = Flow.parse(replies[3], keys.flow(queue))
        if seen is not None:
            seen(Look(flow, bool(lengths["high"] or lengths["low"])))
        if flow.paused:
            raise Paused
        if flow.limit is not None:
            return await _dequeue_limited(
                r, once, keys, worker_id, queue, count, new_ids, picker or Picker(), policy
            )
        if not normal:
            lengths["normal"] = 0
        levels = (picker or Picker()).plan(lengths, count, policy)
    if not levels:
        return []
    held = keys.held(queue, worker_id)
    k = len(levels)

    def take(ids: list[str]) -> list[Command]:
        moves: list[Command] = [
            ("LMOVE", keys.level(queue, level), keys.process(queue, pid), "LEFT", "RIGHT")
            for level, pid in zip(levels, ids, strict=True)
        ]
        return [
            *moves,
            ("SADD", held, *ids),
            ("SADD", keys.holders(queue), worker_id),
            read_flow(keys, queue),
        ]

    recorded: Any = 1
    flow_reply = None
    for _ in range(_MAX_ATTEMPTS):
        ids = new_ids(levels)
        try:
            replies = await on_slot(once, keys.tasks(queue), _transaction(take(ids)))
            tasks, recorded, flow_reply = replies[:k], replies[k], replies[k + 2]
            break
        except (MaxConnectionsError, NotApplied):
            raise  # nothing sent, or nothing applied
        except (RedisConnectionError, RedisTimeoutError):
            lookups: list[Command] = [("LINDEX", keys.process(queue, pid), 0) for pid in ids]
            tasks = await reads(once, lookups)
            if any(isinstance(task, str | bytes) for task in tasks):
                break  # the lost EXEC was applied: adopt what it took
    else:
        raise BackendError(f"gave up dequeuing from {queue!r} after {_MAX_ATTEMPTS} tries")
    # A wrong-typed level list fails its LMOVEs (nothing taken); a wrong-typed held
    # set fails the record (the tasks go straight back). holders is the check's.
    found = [task if isinstance(task, str | bytes) else None for task in tasks]
    taken_ids = [pid for pid, task in zip(ids, found, strict=True) if task is not None]
    if is_wrong_type(recorded) and taken_ids:
        await _undo(once, keys, queue, taken_ids)
        raise _corrupt(held)
    if len(taken_ids) < len(ids):
        unused = [pid for pid, task in zip(ids, found, strict=True) if task is None]
        await reads(r, [("SREM", held, *unused)])
    wrong = [level for level, task in zip(levels, tasks, strict=True) if is_wrong_type(task)]
    if wrong:
        if taken_ids:  # the levels that could be read gave tasks: back they go
            await _undo(once, keys, queue, taken_ids, held)
        raise _corrupt(keys.level(queue, wrong[0]))
    if flow_reply is None and taken_ids:  # the reply was lost: read the flow now
        (flow_reply,) = await reads(r, [read_flow(keys, queue)])
    if taken_ids:
        try:
            flow = Flow.parse(flow_reply, keys.flow(queue)) if flow_reply is not None else Flow()
        except CorruptDataError:  # unreadable flow control: hand out nothing
            await _undo(once, keys, queue, taken_ids, held)
            raise
        if flow.paused or flow.limit is not None:  # changed since step 1 (or unread)
            if seen is not None:
                seen(Look(flow, True))
            await _undo(once, keys, queue, taken_ids, held)
            if flow.paused:
                raise Paused
            return await _dequeue_limited(
                r, once, keys, worker_id, queue, count, new_ids, picker or Picker(), policy
            )
    return [
        as_process(pid, text(task), queue)
        for pid, task in zip(ids, found, strict=True)
        if task is not None
    ]


async def _undo(
    once: Client, keys: Keys, queue: str, pids: Sequence[str], held: str | None = None
) -> None:
    """Return the tasks of processes just taken to the front of their levels, newest
    first (so the queue's order is as before), withdrawing their ids from ``held``
    (without it, they go with the next reclaim, which finds no process list). No
    ``work`` event: the queue is paused or rate-limited, and an announcement would
    only bring its workers back to take and return them again."""
    for pid in reversed(pids):
        level = keys.level(queue, split_process_id(pid).level)
        back: Command = ("LMOVE", keys.process(queue, pid), level, "RIGHT", "LEFT")
        withdraw: list[Command] = [] if held is None else [("SREM", held, pid)]
        await _atomic(once, keys.tasks(queue), [back, *withdraw])


async def _dequeue_limited(
    r: Client,
    once: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    count: int,
    new_ids: NewIds,
    picker: Picker,
    policy: str,
) -> list[Process]:
    """`dequeue` from a rate-limited queue: no ``per`` ms window of the server's clock
    holds more than ``limit`` starts, fleet-wide. Raises `Throttled` (with the wait
    until the window frees a start) when none is left, `Paused` when paused.

    WATCH serialises the dequeues of the queue: each one counts the window and records
    its starts in one transaction, so two cannot both take the last start.
    Keys: starts (ZSET), flow (HASH), high, tasks, low, p:<id>..., held:<w>, holders.
      1. WATCH starts flow
      2. TIME;  HMGET flow paused limit per           -> paused: raise;  no limit: back
                                                         to `dequeue`
      3. ZCOUNT starts (<now - per> +inf;  ZRANGE starts (<now - per> +inf BYSCORE
         LIMIT 0 1 WITHSCORES;  LLEN high;  LLEN tasks;  LLEN low
                           -> none left: UNWATCH, raise `Throttled` (the oldest start
                              leaves the window at its score + per);  empty: return
      4. MULTI             (k = min(count, starts left, tasks), levels by the picker)
      5. ZREMRANGEBYSCORE starts -inf <now - per>
      6. LMOVE <level> p:<idi> LEFT RIGHT                              for i = 1..k
      7. ZADD starts <t> <id1> ... <t> <idk>    (t = now + 2 round trips + 5 ms: no
                                                 earlier than the EXEC can run)
      8. SADD held:<w> <ids>;  SADD holders <w>
      9. TIME                                   -> when the EXEC ran
     10. EXEC                                                          -> nil: back to 1
     11. (it ran after t: a stall) every task back to the front of its level, SREM
         held:<w> <ids>;  ZREM starts <ids>;  back to 1
     12. (some LMOVE found its list empty) SREM held:<w> <unused>;  ZREM starts <unused>
    A lost EXEC reply raises `BackendUnavailableError`: its processes, if it landed,
    are returned by the worker's audit; its starts count until they leave the window.
    """
    starts, held = keys.starts(queue), keys.held(queue, worker_id)
    plain = False
    levels: list[str] = []
    stamp = 0  # the score of this attempt's starts: now plus the allowance

    async def body(pipe: Pipeline) -> list[str]:
        nonlocal plain, levels, stamp
        sent = time.monotonic()
        clock, raw_flow = await _beside(pipe, [("TIME",), read_flow(keys, queue)])
        now = server_ms(clock)
        # The tasks move at EXEC, two round trips from now: the starts are scored at
        # the latest time that EXEC may run at (checked by the TIME inside it), never
        # earlier than they happen, so that no window ever counts one of them short.
        stamp = now + round(_LAG_ROUND_TRIPS * (time.monotonic() - sent) * 1000) + _LAG_MS
        flow = Flow.parse(raw_flow, keys.flow(queue))
        if flow.paused or flow.limit is None or flow.per_ms is None:
            await pipe.reset()
            plain = not flow.paused
            if flow.paused:
                raise Paused
            return []
        floor = now - flow.per_ms
        lists: list[Command] = [("LLEN", key) for key in keys.levels(queue)]
        window: list[Command] = [
            ("ZCOUNT", starts, f"({floor}", "+inf"),
            ("ZRANGE", starts, f"({floor}", "+inf", "BYSCORE", "LIMIT", 0, 1, "WITHSCORES"),
        ]
        replies = await _beside(pipe, [*window, *lists])
        _raise_wrong([*window, *lists], replies)
        used, oldest = replies[:2]
        room = flow.limit - int(used)
        if room <= 0:
            await pipe.reset()
            first = _pairs(oldest)
            leaves = (_ms(first[0][1]) or now) + flow.per_ms if first else now + 1
            raise Throttled(max(leaves - now, 1) / 1000)
        levels = picker.plan(_lengths(replies[2:]), min(count, room), policy)
        if not levels:
            await pipe.reset()
            return []
        ids = new_ids(levels)
        pipe.multi()
        pipe.execute_command("ZREMRANGEBYSCORE", starts, "-inf", floor)
        for level, pid in zip(levels, ids, strict=True):
            pipe.execute_command(
                "LMOVE", keys.level(queue, level), keys.process(queue, pid), "LEFT", "RIGHT"
            )
        pipe.execute_command("ZADD", starts, *(part for pid in ids for part in (stamp, pid)))
        pipe.execute_command("SADD", held, *ids)
        pipe.execute_command("SADD", keys.holders(queue), worker_id)
        pipe.execute_command("TIME")
        return ids

    for _ in range(_LATE_TRIES):
        ids, replies = await _optimistic(r, [starts, keys.flow(queue)], body)
        if plain:
            return await dequeue(
                r,
                once,
                keys,
                worker_id,
                queue,
                count,
                new_ids=new_ids,
                picker=picker,
                policy=policy,
            )
        if not ids:
            return []
        tasks = replies[1 : 1 + len(ids)]
        found = [task if isinstance(task, str | bytes) else None for task in tasks]
        taken = [pid for pid, task in zip(ids, found, strict=True) if task is not None]
        unused = [pid for pid, task in zip(ids, found, strict=True) if task is None]
        ran = server_ms(replies[-1])
        if ran > stamp:  # EXEC ran later than its starts say (a stall): none of them counts
            await _undo(once, keys, queue, taken, held)
            await reads(r, [("SREM", held, *ids), ("ZREM", starts, *ids)])
            continue
        if unused:
            await reads(r, [("SREM", held, *unused), ("ZREM", starts, *unused)])
        if is_wrong_type(replies[-3]):  # the held set: what was taken goes straight back
            await _undo(once, keys, queue, taken)
            raise _corrupt(held)
        break
    else:
        raise BackendError(f"dequeues from {queue!r} keep running late for its rate limit")
    return [
        as_process(pid, text(task), queue)
        for pid, task in zip(ids, found, strict=True)
        if task is not None
    ]


def as_process(pid: str, task: str, queue: str) -> Process:
    """A process of a stored task: a job's payload with its envelope, or the plain
    task (also an unreadable envelope, which no handler is given: see `Worqr._take`)."""
    envelope = envelope_of(task)
    if envelope is None:
        return Process(pid, task, queue)
    header = envelope.header
    return Process(
        pid,
        envelope.payload,
        queue,
        job_id=header.id,
        attempt=header.attempt,
        max_attempts=header.max_attempts,
        envelope=envelope,
    )


def _back_to_front(keys: Keys, queue: str, pid: str) -> list[Command]:
    """The commands that return a process's task to the front of its level's list."""
    level = split_process_id(pid).level
    return [
        ("LMOVE", keys.process(queue, pid), keys.level(queue, level), "RIGHT", "LEFT"),
        announce(keys, queue, level, 1),
    ]


@dataclass(frozen=True, slots=True)
class Ending:
    """What ending one process writes besides its own bookkeeping: the keys whose
    failing write inside MULTI would lose the task (each must be of its type, or
    absent), and the writes."""

    requires: tuple[tuple[str, str], ...]
    writes: Callable[[Pipeline], None]


Plan = Callable[[str, Envelope | None, bool, list[str] | None], Ending]
"""What ending a process writes, given its task, its envelope (a job), whether the
job ended already (cancelled while its attempt ran) and, if other jobs wait for it
(see `waited`), those to hand on (else None)."""


def local_ms(now_ms: int | None) -> int:
    """``now_ms`` (server time, from the caller's clock estimate), or this host's
    Unix ms when the caller gave none (outcome times only: due times always come
    from the server's clock)."""
    return round(time.time() * 1000) if now_ms is None else now_ms


def envelope_of(task: str) -> Envelope | None:
    """A stored task's envelope; None for a plain task or an unreadable envelope."""
    try:
        return unwrap(task)
    except ValueError:
        return None


async def _end_process(
    r: Client,
    keys: Keys,
    ref: ProcessRef,
    plan: Plan,
    *,
    known: str | None = None,
    checks: Sequence[tuple[str, str]] = (),
) -> str | None:
    """Fenced end of a process: if it still exists, delete it and its bookkeeping and
    release the task's unique mark, plus the writes ``plan`` gives for its task (and
    envelope, for a job); return its task as stored.

    ``known`` is the task, when the caller dequeued it itself: ids are never reused
    and only `dequeue` writes a process list, so EXISTS then stands in for LINDEX,
    and the job's record is watched from the start. ``checks`` are the keys (and their
    types) that the plan's writes may push to: read beside the fence, since a push
    failing inside MULTI would lose the task.

    WATCH is needed because the unique mark may only be released while the process
    exists: a late finish after a reclaim must not free the mark of the requeued task;
    and a job's record is watched because a cancel may end the job meanwhile.
      1. WATCH p:<id> [j:<job> after:<job>]  (known: one round trip)
         EXISTS p:<id>                    -> 0: UNWATCH, return None (gone)
           with it, on the same connection: TYPE <key> (per check, and for a
           job released and after:<job>, which a waited job's end writes);
           SMEMBERS after:<job>            -> the jobs waiting for it
           HMGET j:<job> state env waited -> done/failed: the job ended (cancelled);
                                             waited: its end hands those on
         (not known: WATCH p:<id>;  LINDEX p:<id> 0 -> nil: gone;  WATCH j:<job>
          after:<job>;  then the reads beside, alone)
         a checked key not of its type: UNWATCH, raise (nothing written)
      2. MULTI
      3. DEL p:<id>
      4. SREM held:<w> <id>
      5. SREM unique task                 (a plain task)
      6. HDEL deaths <field>              (the task ended: its death count goes)
      7. ZREM deadlines <id>              (a job with a timeout)
      8. ...the plan's writes
      9. EXEC                             -> nil: back to 1
    """
    queue = ref.queue
    proc = keys.process(queue, ref.id)
    given = None if known is None else envelope_of(known)
    watch = [proc]
    if given is not None:
        watch += [keys.job(queue, given.header.id), keys.after(queue, given.header.id)]

    async def body(pipe: Pipeline) -> str | None:
        if known is None:
            raw = await read(pipe, "LINDEX", proc, 0)
            if raw is None:
                return None
            task, envelope = text(raw), envelope_of(text(raw))
            if envelope is not None:
                job_id = envelope.header.id
                await pipe.watch(keys.job(queue, job_id), keys.after(queue, job_id))
        else:
            task, envelope = known, given
        # A job's end may hand the jobs waiting for it on: the types of those keys are
        # read here too, in the same round trip, whether it turns out waited or not.
        typed = [*checks, *(waited_keys(keys, queue, envelope.header.id) if envelope else ())]
        side: list[Command] = [("TYPE", key) for key, _ in typed]
        if envelope is not None:  # the jobs waiting for it, and whether it is waited for
            side.append(("SMEMBERS", keys.after(queue, envelope.header.id)))
            side.append(("HMGET", keys.job(queue, envelope.header.id), *LOOK))
        if known is None:
            replies = await _beside(pipe, side)
        else:
            exists, *replies = await _beside(pipe, [("EXISTS", proc), *side])
            if not exists:
                await pipe.reset()
                return None
        types = {key: text(found) for (key, _), found in zip(typed, replies, strict=False)}
        ended = envelope is not None and _says_ended(replies[-1], envelope.raw)
        waiters = None if envelope is None else waiters_of(replies[-1], replies[-2])
        ending = plan(task, envelope, ended, waiters)
        for key, kind in ending.requires:
            found = types.get(key)
            if found is None:
                await _require(pipe, key, kind)
            elif found not in (kind, "none"):
                await pipe.reset()
                raise _corrupt(key, found)
        pipe.multi()
        pipe.execute_command("DEL", proc)
        pipe.execute_command("SREM", keys.held(queue, ref.worker_id), ref.id)
        if envelope is None:
            pipe.execute_command("SREM", keys.unique(queue), stored(task))
        pipe.execute_command("HDEL", keys.deaths(queue), death_field(task))
        if envelope is not None and envelope.header.timeout is not None:
            pipe.execute_command("ZREM", keys.deadlines(queue), ref.id)
        ending.writes(pipe)
        return task

    task, _ = await _optimistic(r, watch, body)
    return task


def _says_ended(reply: Any, envelope: str) -> bool:
    """Whether an ``HMGET j:<id> state env`` reply says that the life of the job whose
    attempt carries ``envelope`` ended: its record ended (cancelled while the attempt
    ran), or holds another envelope (the id was submitted anew since). A missing or
    unreadable record says nothing (the check's to report)."""
    if is_wrong_type(reply) or not reply or reply[0] is None:
        return False
    if text(reply[0]) in _ENDED_STATES:
        return True
    return reply[1] is not None and text(reply[1]) != envelope


_ENDED_STATES = ("done", "failed")


def _end_job(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    header: Header,
    now_ms: int,
    *,
    result: str | None = None,
    error: str | None = None,
    attempts: int | None = None,
    waiters: Sequence[str] | None = None,
) -> None:
    """Queue the writes of `job_end` on ``pipe``, its index entry with them."""
    writes, (score, job_id) = job_end(
        keys, queue, header, now_ms, result=result, error=error, attempts=attempts, waiters=waiters
    )
    for command in writes:
        pipe.execute_command(*command)
    pipe.execute_command("ZADD", keys.jobs(queue), score, job_id)


def job_end(
    keys: Keys,
    queue: str,
    header: Header,
    now_ms: int,
    *,
    result: str | None = None,
    error: str | None = None,
    attempts: int | None = None,
    waiters: Sequence[str] | None = None,
) -> tuple[list[Command], tuple[int, str]]:
    """The writes that record a job's outcome (done, or failed with ``error``) and let
    it expire after its result TTL, and its entry in the job index (score, id: the
    caller adds it, several ends' in one ZADD). A job that others wait for (see
    `waited`) hands ``waiters`` (the members of its ``after`` set, read under WATCH)
    to the next release, and keeps its outcome for them at least `WAITED_KEEP_MS`;
    the caller made sure that ``released`` and ``after:<id>`` are sets or absent
    (`waited_keys`).

      HSET j:<id> state done|failed attempts <n> finished <now> [result <r>] [error <e>]
      HDEL j:<id> env due after
      PEXPIRE j:<id> <ttl>
      (waited) SADD released <waiter>...;  DEL after:<id>;  PUBLISH events released:
      and the entry: ZADD jobs <now + ttl> <id>
    (and, once per transaction, `_trim_jobs`)
    """
    record = keys.job(queue, header.id)
    fields: list[str | int] = [
        "state",
        "done" if error is None else "failed",
        "attempts",
        header.attempt if attempts is None else attempts,
        "finished",
        now_ms,
    ]
    if result is not None:
        fields += ["result", result]
    if error is not None:
        fields += ["error", error]
    waited = waiters is not None
    ttl = max(header.result_ttl_ms, WAITED_KEEP_MS) if waited else header.result_ttl_ms
    writes: list[Command] = [
        ("HSET", record, *fields),
        ("HDEL", record, "env", "due", "after"),
        ("PEXPIRE", record, ttl),
    ]
    if waiters is not None:
        writes.append(("DEL", keys.after(queue, header.id)))
        if waiters:
            writes.append(("SADD", keys.released(queue), *waiters))
            writes.append(("PUBLISH", keys.events(queue), event(RELEASED_EVENT)))
    return writes, (now_ms + ttl, header.id)


WAITED_KEEP_MS = 3_600_000
"""How long at least the outcome of a job that others waited for stays readable (ms):
the release of its dependents reads it, and may come late when no worker of the
queue was running as it ended."""

RELEASED_EVENT = "released"
"""The event telling a queue's workers that waiting jobs were handed to the next
release (``released:``): one of them releases them."""


def waited(reply: Any) -> bool:
    """Whether an ``HMGET j:<id> state env waited`` reply says that other jobs wait for
    the job's current life."""
    return not is_wrong_type(reply) and len(reply) > 2 and reply[2] is not None


def waiters_of(look: Any, after: Any) -> list[str] | None:
    """The jobs a job's end hands on: the members of its ``after`` set (an ``SMEMBERS``
    reply read under WATCH) when its ``LOOK`` reply says it is waited for, else None."""
    return members(after) if waited(look) else None


def waited_keys(keys: Keys, queue: str, job_id: str) -> tuple[tuple[str, str], ...]:
    """The keys the end of a waited job writes, with their types: a write of one of
    them failing inside MULTI would lose the waiting jobs."""
    return ((keys.released(queue), "set"), (keys.after(queue, job_id), "set"))


async def _waiters(pipe: Pipeline, keys: Keys, queue: str, job_id: str) -> list[str]:
    """In a WATCHed pipeline, for the end of a waited job that did not read them with
    its fence: check the types of the keys the end writes, watch its ``after`` set and
    return its members."""
    for key, kind in waited_keys(keys, queue, job_id):
        await _require(pipe, key, kind)
    after = keys.after(queue, job_id)
    await pipe.watch(after)
    return members(await call(pipe, "SMEMBERS", after))


LOOK = ("state", "env", "waited")
"""The fields of a job's record an end reads under WATCH: has its life ended (see
`_says_ended`), and does another job wait for it (`waited`)."""


def _trim_jobs(pipe: Pipeline, keys: Keys, queue: str, now_ms: int) -> None:
    """Queue the trim of the job index: entries of outcomes expired by ``now_ms``
    (once per transaction that ends jobs).

      ZREMRANGEBYSCORE jobs -inf (<now>
    """
    pipe.execute_command(*trim_jobs(keys, queue, now_ms))


def trim_jobs(keys: Keys, queue: str, now_ms: int) -> Command:
    """The trim of the job index, as a command (see `_trim_jobs`)."""
    return ("ZREMRANGEBYSCORE", keys.jobs(queue), "-inf", f"({now_ms}")


def failed_record(
    task: str,
    error: str,
    worker_id: str,
    *,
    trace: str = "",
    envelope: Envelope | None = None,
) -> str:
    """A failed-list record: for a job, ``task`` is its payload and the record also has
    ``job_id``, ``attempts`` and ``envelope`` (to submit it anew)."""
    record: dict[str, Any] = {
        "task": task if envelope is None else envelope.payload,
        "error": error,
        "worker_id": worker_id,
        "failed_at": time.time(),
    }
    if trace:
        record["traceback"] = trace
    if envelope is not None:
        record["job_id"] = envelope.header.id
        record["attempts"] = envelope.header.attempt
        record["envelope"] = envelope.raw
    return json.dumps(record)


@redis_boundary
async def finish(
    r: Client, keys: Keys, ref: ProcessRef, result: str | None, now_ms: int | None = None
) -> str | None:
    """Finish a process (see `_end_process`), publishing ``done``; return its task or None.

      (a job) WATCH j:<id>;  HMGET j:<id> state  -> done/failed (cancelled meanwhile):
                                                    no writes but 3-7
    8. (a job) the writes of `_end_job` with its result
       PUBLISH done done:[{"process_id","worker_id","task","result"[,"job_id","status"]}]
    """
    now = local_ms(now_ms)

    def plan(task: str, envelope: Envelope | None, ended: bool, waits: list[str] | None) -> Ending:
        if ended:
            return Ending((), lambda pipe: None)  # cancelled meanwhile: its outcome stays

        def writes(pipe: Pipeline) -> None:
            if envelope is None:
                record = done_record(ref.id, ref.worker_id, task, result)
            else:
                header = envelope.header
                _end_job(pipe, keys, ref.queue, header, now, result=result, waiters=waits)
                _trim_jobs(pipe, keys, ref.queue, now)
                record = done_record(
                    ref.id,
                    ref.worker_id,
                    envelope.payload,
                    result,
                    job_id=header.id,
                    attempts=header.attempt,
                )
            pipe.execute_command("PUBLISH", keys.done(ref.queue), event("done", f"[{record}]"))

        job_id = None if envelope is None else envelope.header.id
        needs = waited_keys(keys, ref.queue, job_id) if waits is not None and job_id else ()
        return Ending(needs, writes)

    return await _end_process(r, keys, ref, plan)


@redis_boundary
async def finish_many(
    r: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    done: Sequence[tuple[Process, str | None]],
    now_ms: int | None = None,
) -> list[bool]:
    """Finish processes that this worker dequeued from one queue (so it knows their
    tasks), in one transaction; return, per process, whether it still existed.

    Each process is fenced as in `finish`: only a process that still exists is ended.
    Ids are never reused and only `dequeue` writes a process list, so an existing
    p:<id> holds exactly the task it was dequeued with, and EXISTS stands in for the
    LINDEX of `finish`.
      1. WATCH p:<id1> ... p:<idk> j:<job>...  (the jobs among them)
         with it, in the same round trip (covered by it):
         EXISTS p:<id1> ... p:<idk>       -> fewer than k: UNWATCH; EXISTS p:<id> each
                                             (one round trip), and back to 1 with the
                                             ones that exist (the others: False)
         HMGET j:<job> state env waited ...  -> a job that ended meanwhile (cancelled)
                                             keeps its outcome: no writes of step 9 for
                                             it; one that others wait for: step 2
      2. (waited jobs only) WATCH after:<job> ...;  TYPE released;
         SMEMBERS after:<job> ...         -> the jobs to
                                             hand on; not sets: UNWATCH, raise
      3. MULTI
      4. DEL p:<id1> ... p:<idk>
      5. SREM held:<w> <id>...
      6. SREM unique <task>...            (plain tasks)
      7. HDEL deaths <field>...
      8. ZREM deadlines <id>...           (jobs with a timeout)
      9. the writes of `job_end` per job;  ZADD jobs <expiry> <job> ... (one for all);
         ZREMRANGEBYSCORE jobs -inf (<now>
     10. PUBLISH done done:[{...}, ...]   (a record per process; a message per MB)
     11. EXEC                             -> nil: back to 1
    A job that nothing waits for costs four commands (HMGET, HSET, HDEL, PEXPIRE) and
    a few arguments: the drain of jobs stays close to that of plain tasks.
    """
    now = local_ms(now_ms)
    refs = [split_process_id(process.id) for process, _ in done]
    if any(ref.worker_id != worker_id or ref.queue != queue for ref in refs):
        raise ValueError(f"finish_many: every process must be {worker_id}'s in {queue!r}")
    outcome = [False] * len(done)
    remaining = list(range(len(done)))
    while remaining:  # each pass ends them all, or finds at least one gone for good
        ending = [done[i] for i in remaining]
        procs = [keys.process(queue, refs[i].id) for i in remaining]
        batch = _Batch(keys, worker_id, queue, ending, procs, [refs[i].id for i in remaining])

        async def run(node: Redis, batch: _Batch = batch) -> bool:
            return await batch.end(node, now)

        if await on_slot(r, procs[0], run):
            for i in remaining:
                outcome[i] = True
            return outcome
        # Some process is gone (reclaimed, stopped, its queue deleted): ids are never
        # reused, so a gone one stays gone; finish the others together.
        present = await reads(r, [("EXISTS", proc) for proc in procs])
        remaining = [i for i, flag in zip(remaining, present, strict=True) if flag]
    return outcome


@dataclass(frozen=True)
class _Batch:
    """The processes one `finish_many` pass ends, with their keys."""

    keys: Keys
    worker_id: str
    queue: str
    ending: Sequence[tuple[Process, str | None]]
    procs: Sequence[str]
    ids: Sequence[str]

    async def end(self, node: Redis, now: int) -> bool:
        """Steps 1-11 on ``node``: True when every process was ended, False (nothing
        written) when one was gone. A lost reply to the first look is resent as the
        client's policy says (nothing was written); a lost EXEC reply is an unknown
        outcome."""
        keys, queue = self.keys, self.queue
        jobs = [p for p, _ in self.ending if p.job_id is not None]
        records = [keys.job(queue, p.job_id) for p in jobs if p.job_id is not None]
        looks: list[Wire] = [("EXISTS", *self.procs), *(("HMGET", rec, *LOOK) for rec in records)]
        async with watching(node) as session:
            for _ in range(_MAX_ATTEMPTS):
                exists, *states = _unless_wrong(await session.look([*self.procs, *records], looks))
                if exists != len(self.procs):
                    return False
                ended: set[str | None] = set()
                waited_ids: list[str] = []
                for p, look in zip(jobs, states, strict=True):
                    if _says_ended(look, p.stored):
                        ended.add(p.job_id)
                    elif p.job_id is not None and waited(look):
                        waited_ids.append(p.job_id)
                if ended and waited_ids:  # two copies of one job, one read as ended
                    waited_ids = [job_id for job_id in waited_ids if job_id not in ended]
                waits = await _waiters_of(session, keys, queue, waited_ids)
                try:
                    replies = await session.commit(self._writes(now, ended, waits))
                except MaxConnectionsError:
                    raise
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    raise _unknown_outcome() from exc
                if replies is not None:
                    _unless_wrong(replies)
                    return True
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {self.procs[0]}")

    def _writes(self, now: int, ended: set[str | None], waits: dict[str, list[str]]) -> list[Wire]:
        """Steps 4-10: the writes of the transaction."""
        keys, queue, worker_id = self.keys, self.queue, self.worker_id
        ending = self.ending
        writes: list[Wire] = [
            ("DEL", *self.procs),
            ("SREM", keys.held(queue, worker_id), *self.ids),
        ]
        plain = [stored(p.task) for p, _ in ending if p.envelope is None]
        if plain:
            writes.append(("SREM", keys.unique(queue), *plain))
        fields = {digest(p.task) if p.envelope is None else f"job:{p.job_id}" for p, _ in ending}
        writes.append(("HDEL", keys.deaths(queue), *fields))
        timed = [p.id for p, _ in ending if p.envelope and p.envelope.header.timeout]
        if timed:
            writes.append(("ZREM", keys.deadlines(queue), *timed))
        records: list[str] = []
        index: list[str | int] = []
        for process, result in ending:
            if process.envelope is None:
                records.append(done_record(process.id, worker_id, process.task, result))
                continue
            header = process.envelope.header
            if header.id in ended:
                continue  # cancelled while it ran: its outcome stays
            job_writes, (expiry, job_id) = job_end(
                keys, queue, header, now, result=result, waiters=waits.get(header.id)
            )
            writes += job_writes
            index += [expiry, job_id]
            records.append(
                done_record(
                    process.id,
                    worker_id,
                    process.task,
                    result,
                    job_id=header.id,
                    attempts=header.attempt,
                )
            )
        if index:
            writes.append(("ZADD", keys.jobs(queue), *index))
        if any(p.envelope is not None for p, _ in ending):
            writes.append(trim_jobs(keys, queue, now))
        writes += [("PUBLISH", keys.done(queue), message) for message in done_messages(records)]
        return writes


async def _waiters_of(
    session: Watching, keys: Keys, queue: str, job_ids: Sequence[str]
) -> dict[str, list[str]]:
    """Step 2 of `finish_many`: for jobs that others wait for, the members of their
    ``after`` sets, watched from here on, once the keys their ends write are found to
    be sets or absent (a failing write inside MULTI would lose the waiting jobs).

    Step 1 watches only the records: a job's first dependent adds itself to ``after``
    and sets ``waited`` in one transaction, which the record's WATCH sees, so the
    ``after`` set of a job read as not waited for cannot change unseen; watching every
    job's set there would double the keys of the WATCH, whose cost grows with the
    square of their number on the server."""
    if not job_ids:
        return {}
    released = keys.released(queue)
    afters = [keys.after(queue, job_id) for job_id in job_ids]
    kind, *sets = await session.look(
        afters, [("TYPE", released), *(("SMEMBERS", a) for a in afters)]
    )
    if text(kind) not in ("set", "none"):
        raise _corrupt(released, text(kind))
    for after, found in zip(afters, sets, strict=True):
        if isinstance(found, Exception):
            if is_wrong_type(found):
                raise _corrupt(after)
            raise found
    return {job_id: members(found) for job_id, found in zip(job_ids, sets, strict=True)}


@redis_boundary
async def fail(
    r: Client,
    keys: Keys,
    ref: ProcessRef,
    error: str,
    now_ms: int | None = None,
    *,
    trace: str = "",
    delay: float | None = None,
    final: bool = False,
    known: str | None = None,
) -> str | None:
    """End a failed attempt (see `_end_process`, ``known`` as there); return the task
    as stored, or None.

    A plain task, or a job at its last attempt (or ``final``), goes to the failed list
    and the job's outcome is recorded. Another attempt of a job goes to the back of
    the queue (no delay) or to the delayed set, due after ``delay`` seconds (default:
    its backoff), as a new envelope whose attempt is one higher. A job that ended
    meanwhile (cancelled) only has its process ended. An ``error`` with a lone
    surrogate that stands for no byte is stored with it escaped (``\\ud800``): a
    message that cannot be written would fail every time.
      (a job) HMGET j:<id> state under WATCH     -> done/failed: no writes but 3-7
      8. the failed list: RPUSH failed <record>
            (a job) the writes of `_end_job` with the error;
            PUBLISH done done:[{..., "job_id", "status": "failed", "error"}]
         another attempt now: RPUSH tasks <envelope'>;  PUBLISH events work:1;
            HSET j:<id> env <envelope'> state queued attempts <a> error <e>;  HDEL j:<id> due
         another attempt later: ZADD delayed <due> <envelope'>;
            HSET j:<id> env <envelope'> state delayed attempts <a> error <e> due <due>;
            PUBLISH events delayed:<due>
    """
    queue = ref.queue
    now = local_ms(now_ms)
    error = escaped(error)  # a message (an exception's, say): shown escaped, not refused

    def plan(task: str, envelope: Envelope | None, ended: bool, waits: list[str] | None) -> Ending:
        if envelope is None:
            record = failed_record(task, error, ref.worker_id, trace=trace)

            def to_failed_list(pipe: Pipeline) -> None:
                pipe.execute_command("RPUSH", keys.failed(queue), record)

            return Ending(((keys.failed(queue), "list"),), to_failed_list)
        header = envelope.header
        job = keys.job(queue, header.id)
        if ended:  # cancelled meanwhile
            return Ending((), lambda pipe: None)
        if final or header.attempt >= header.max_attempts:
            record = failed_record(task, error, ref.worker_id, trace=trace, envelope=envelope)
            notice = done_record(
                ref.id,
                ref.worker_id,
                envelope.payload,
                None,
                job_id=header.id,
                error=error,
                attempts=header.attempt,
            )

            def to_failed(pipe: Pipeline) -> None:
                pipe.execute_command("RPUSH", keys.failed(queue), record)
                _end_job(pipe, keys, queue, header, now, error=error, waiters=waits)
                _trim_jobs(pipe, keys, queue, now)
                pipe.execute_command("PUBLISH", keys.done(queue), event("done", f"[{notice}]"))

            needs = waited_keys(keys, queue, header.id) if waits is not None else ()
            return Ending(((keys.failed(queue), "list"), *needs), to_failed)
        wait = delay if delay is not None else backoff_delay(header)
        again = wrap(header.next_attempt(), envelope.payload)
        due = now + round(wait * 1000)
        fields: list[str | int] = ["env", again, "attempts", header.attempt, "error", error]

        back_to = keys.level(queue, header.priority)

        def at_once(pipe: Pipeline) -> None:
            pipe.execute_command("RPUSH", back_to, again)
            pipe.execute_command(*announce(keys, queue, header.priority, 1))
            pipe.execute_command("HSET", job, *fields, "state", "queued")
            pipe.execute_command("HDEL", job, "due")

        def later(pipe: Pipeline) -> None:
            pipe.execute_command("ZADD", keys.delayed(queue), due, again)
            pipe.execute_command("HSET", job, *fields, "state", "delayed", "due", due)
            pipe.execute_command("PUBLISH", keys.events(queue), event("delayed", str(due)))

        if wait <= 0:
            return Ending(((back_to, "list"),), at_once)
        return Ending(((keys.delayed(queue), "zset"),), later)

    checks = [(keys.failed(queue), "list")]
    if known is None or envelope_of(known) is not None:
        checks += [(key, "list") for key in keys.levels(queue)] + [(keys.delayed(queue), "zset")]
    return await _end_process(r, keys, ref, plan, known=known, checks=checks)


async def _ended(pipe: Pipeline, keys: Keys, queue: str, envelope: Envelope) -> bool:
    """In a WATCHed pipeline: watch the job's record too, and tell whether the life
    of ``envelope`` ended (see `_says_ended`): then the attempt's end must neither
    overwrite the outcome nor put the job anywhere again."""
    record = keys.job(queue, envelope.header.id)
    await pipe.watch(record)
    return _says_ended(await read(pipe, "HMGET", record, "state", "env"), envelope.raw)


def backoff_delay(header: Header) -> float:
    """Seconds before the attempt after ``header``'s, by its backoff."""
    initial, factor, maximum, jitter = header.backoff
    return Backoff(initial, factor, maximum, jitter).delay(header.attempt)


@redis_boundary
async def stop(
    once: Client, keys: Keys, ref: ProcessRef, job_id: str | None = None, *, look: bool = False
) -> str | None:
    """Return a process's task to the FRONT of its queue; its unique mark stays
    (``once``: a client that never resends, see `_atomic`). A job (``job_id``) goes
    back as it was, giving a process up is not an attempt; but a job that ended
    meanwhile (cancelled while it ran) does not go back: its process is dropped.

    (a job, or ``look``: a process whose task is unknown, LINDEX p:<id> 0 first)
            WATCH p:<id>;  WATCH j:<job>;  HMGET j:<job> state
            -> done/failed: MULTI;  DEL p:<id>;  HDEL deaths job:<job>;  SREM held:<w>
               <id>;  ZREM deadlines <id>;  EXEC
            -> else the block below under that WATCH (EXEC nil: back to WATCH)

    Keys: p:<id> (LIST), tasks (LIST: the list of the level in the id), held:<w>
    (SET), deadlines (ZSET). No WATCH: LMOVE from a missing list is a no-op, so a late
    stop changes nothing.
      1. MULTI
      2. LMOVE p:<id> tasks RIGHT LEFT   -> the task, or nil (process gone)
      3. SREM held:<w> <id>
      4. ZREM deadlines <id>
      5. PUBLISH events work:1          (a harmless hint if the process was gone)
      6. EXEC
    """
    queue = ref.queue
    if job_id is not None or look:
        return await _stop_job(once, keys, ref, job_id)
    back_to = keys.level(queue, ref.level)
    task, _, _, _ = await _atomic(
        once,
        keys.tasks(queue),
        [
            ("LMOVE", keys.process(queue, ref.id), back_to, "RIGHT", "LEFT"),
            ("SREM", keys.held(queue, ref.worker_id), ref.id),
            ("ZREM", keys.deadlines(queue), ref.id),
            announce(keys, queue, ref.level, 1),
        ],
    )
    if is_wrong_type(task):  # the task stays in its process list: keep it recorded
        await reads(once, [("SADD", keys.held(queue, ref.worker_id), ref.id)])
        raise CorruptDataError(f"{back_to} or {keys.process(queue, ref.id)} is not a list", back_to)
    return None if task is None else text(task)


async def _stop_job(once: Client, keys: Keys, ref: ProcessRef, job_id: str | None) -> str | None:
    """`stop` of a job, in one transaction with the look at its record: a job that
    ended meanwhile (cancelled while it ran) has its process dropped instead; with
    no ``job_id``, the process's task says whether it is a job."""
    queue = ref.queue
    proc = keys.process(queue, ref.id)
    back_to = keys.level(queue, ref.level)

    async def body(pipe: Pipeline) -> tuple[bool, str | None]:
        raw = await read(pipe, "LINDEX", proc, 0)
        envelope = None if raw is None else envelope_of(text(raw))
        found = None if envelope is None else envelope.header.id
        ended = envelope is not None and await _ended(pipe, keys, queue, envelope)
        pipe.multi()
        if ended:
            pipe.execute_command("DEL", proc)
            pipe.execute_command("HDEL", keys.deaths(queue), f"job:{found}")
        else:
            pipe.execute_command("LMOVE", proc, back_to, "RIGHT", "LEFT")
            pipe.execute_command(*announce(keys, queue, ref.level, 1))
        pipe.execute_command("SREM", keys.held(queue, ref.worker_id), ref.id)
        pipe.execute_command("ZREM", keys.deadlines(queue), ref.id)
        return ended, found

    (ended, _), replies = await _optimistic(once, [proc], body)
    if ended:
        return None
    task = replies[0]
    if is_wrong_type(task):  # the task stays in its process list: keep it recorded
        await reads(once, [("SADD", keys.held(queue, ref.worker_id), ref.id)])
        raise CorruptDataError(f"{back_to} or {proc} is not a list", back_to)
    return None if task is None else text(task)


class Alive(Exception):
    """A worker taken for dead has a heartbeat again (see `reclaim`)."""


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What a reclaim did with a worker's processes in one queue."""

    returned: list[str]
    """Tasks back at the front of the queue, in their original order."""
    quarantined: list[str]
    """Tasks moved to the failed list: their holders died too often while running them."""


@redis_boundary
async def reclaim(
    r: Client,
    keys: Keys,
    queue: str,
    worker_id: str,
    *,
    quarantine_after: int | None = None,
    now_ms: int | None = None,
    unless_alive: bool = False,
) -> Reclaimed:
    """Return every process a worker holds in a queue to the FRONT, oldest first.

    With ``unless_alive`` (a peer failing a worker it found dead), the worker's
    heartbeat is WATCHed and read with its held set, and nothing is done (`Alive`
    raised) if it exists: a worker's blocking take (`_ops_block`) refreshes its
    heartbeat as it registers its process id, so a reclaim that began before that
    must not remove the id while the block may still move a task into its list.
    On a Cluster the heartbeat lives on another slot: no blocking takes run there,
    and the caller's check of the heartbeat is enough.

    WATCH is needed: a process dequeued, finished or reclaimed by a racing peer
    between the read and EXEC aborts the transaction, so no task is duplicated or
    dropped. Idempotent: a second reclaim finds nothing.

    With ``quarantine_after`` (the worker died), each task's death count goes up; a
    task whose holders died that many times goes to the failed list instead, so that
    a poison pill cannot crash-loop the fleet. Counts are per task string (its SHA-1),
    per job id for a job (see `death_field`): a death is not an attempt, so a job goes
    back with its envelope unchanged; a quarantined job's outcome is recorded failed.
    The ids of the worker's blocking takes (``blocking:<w>``, see `_ops_block`) are
    reclaimed with its processes: a task a block moved into one's list goes back too.
    Keys: held:<w>, blocking:<w> (SET), p:<id>... (LIST), tasks (LIST), holders (SET),
    deadlines (ZSET); with quarantine also deaths (HASH), failed (LIST), unique (SET),
    j:<id>.
      1. WATCH held:<w> blocking:<w> [alive];  (unless_alive) EXISTS alive
                                              -> 1: UNWATCH, raise Alive
         SMEMBERS held:<w>;  SMEMBERS blocking:<w>   -> ids, sorted newest first
         TYPE tasks;  (quarantine) TYPE failed -> not lists: UNWATCH, raise (nothing moved)
      2. LINDEX p:<id> 0 ...;  (quarantine) HMGET deaths <sha1>...   (one round trip each)
         (jobs) WATCH j:<job>... after:<job>...;  HMGET j:<job> state env waited ...;
                SMEMBERS after:<job> ...                            (another round trip)
         (quarantine, waited jobs) TYPE released;  TYPE after:<job>  -> not sets: raise
      3. MULTI
      4. per id, newest first, a job that ended meanwhile (cancelled while it ran):
           DEL p:<id>;  HDEL deaths job:<job>
         else:
           LMOVE p:<id> <level> RIGHT LEFT;  (quarantine) HINCRBY deaths <sha1> 1
                                            (the level in the id: high, tasks or low)
         or, for a task at its limit:
           DEL p:<id>;  RPUSH failed <record>;  HDEL deaths <sha1>;  SREM unique task
           (a job: instead of the SREM, the writes of `_end_job` and PUBLISH done)
         ZREM deadlines <id>...
      5. DEL held:<w> blocking:<w>
      6. SREM holders <w>
      7. PUBLISH events work:<returned>         (if any returned)
      8. EXEC                                   -> nil: back to 1
    """
    held, blocking = keys.held(queue, worker_id), keys.blocking(queue, worker_id)
    now = local_ms(now_ms)

    alive = keys.heartbeat(worker_id) if unless_alive and isinstance(r, Redis) else None

    async def body(pipe: Pipeline) -> list[tuple[str, str | None, int]]:
        if alive is not None and await read(pipe, "EXISTS", alive):
            await pipe.reset()
            raise Alive(worker_id)
        recorded, waiting = await _beside(pipe, [("SMEMBERS", held), ("SMEMBERS", blocking)])
        for key, reply in ((held, recorded), (blocking, waiting)):
            if is_wrong_type(reply):
                await pipe.reset()
                raise _corrupt(key)
        ids = sorted({*members(recorded), *members(waiting)}, key=_token, reverse=True)
        if ids:  # the LMOVEs must not fail inside MULTI, nor the quarantine's RPUSH
            for level in sorted({split_process_id(pid).level for pid in ids}):
                await _require(pipe, keys.level(queue, level), "list")
            if quarantine_after:
                await _require(pipe, keys.failed(queue), "list")
        counts = await _death_counts(pipe, keys, queue, ids, with_counts=bool(quarantine_after))
        ended, waits = await _ended_jobs(pipe, keys, queue, [t for t, _ in counts.values()])
        if quarantine_after:  # a quarantined job's end must not lose its waiters
            for raw in waits.keys() - ended:
                job_id = _job_id(raw)
                for key, kind in waited_keys(keys, queue, job_id) if job_id else ():
                    await _require(pipe, key, kind)
        plan: list[tuple[str, str | None, int]] = []  # what each group of replies is
        leveled = False  # a task went back to another level than normal
        pipe.multi()
        for pid in ids:
            proc = keys.process(queue, pid)
            task, deaths = counts.get(pid, (None, 0))
            if task is not None and task in ended:  # its life ended while it ran
                pipe.execute_command("DEL", proc)
                pipe.execute_command("HDEL", keys.deaths(queue), death_field(task))
                plan.append(("dropped", task, 2))
                continue
            if task is not None and quarantine_after and deaths + 1 >= quarantine_after:
                before = len(pipe.command_stack)
                error = f"quarantined: its worker died while running it {deaths + 1} times"
                envelope = envelope_of(task)
                pipe.execute_command("DEL", proc)
                pipe.execute_command(
                    "RPUSH",
                    keys.failed(queue),
                    failed_record(task, error, worker_id, envelope=envelope),
                )
                pipe.execute_command("HDEL", keys.deaths(queue), death_field(task))
                if envelope is None:
                    pipe.execute_command("SREM", keys.unique(queue), stored(task))
                else:
                    _end_job(
                        pipe,
                        keys,
                        queue,
                        envelope.header,
                        now,
                        error=error,
                        waiters=waits.get(task),
                    )
                    notice = done_record(
                        pid,
                        worker_id,
                        envelope.payload,
                        None,
                        job_id=envelope.header.id,
                        error=error,
                        attempts=envelope.header.attempt,
                    )
                    pipe.execute_command("PUBLISH", keys.done(queue), event("done", f"[{notice}]"))
                plan.append(("quarantined", task, len(pipe.command_stack) - before))
                continue
            level = split_process_id(pid).level
            pipe.execute_command("LMOVE", proc, keys.level(queue, level), "RIGHT", "LEFT")
            plan.append(("returned", None, 1))
            leveled = leveled or level != "normal"
            if task is not None and quarantine_after:
                pipe.execute_command("HINCRBY", keys.deaths(queue), death_field(task), 1)
                plan.append(("counted", None, 1))
        if ids:
            pipe.execute_command("ZREM", keys.deadlines(queue), *ids)
        if any(kind == "quarantined" and task and envelope_of(task) for kind, task, _ in plan):
            _trim_jobs(pipe, keys, queue, now)
        pipe.execute_command("DEL", held, blocking)
        pipe.execute_command("SREM", keys.holders(queue), worker_id)
        back = sum(kind == "returned" for kind, _, _ in plan)
        if back:
            pipe.execute_command(*announce(keys, queue, "high" if leveled else "normal", back))
        return plan

    watched = [held, blocking] if alive is None else [held, blocking, alive]
    plan, replies = await _optimistic(r, watched, body)
    returned: list[str] = []
    quarantined: list[str] = []
    position = 0
    for kind, task, size in plan:
        if kind == "returned" and isinstance(replies[position], str | bytes):
            returned.append(text(replies[position]))
        elif kind == "quarantined" and task is not None:
            quarantined.append(task)
        position += size
    returned.reverse()  # moved newest first: report them in queue order
    quarantined.reverse()
    return Reclaimed(returned, quarantined)


async def _death_counts(
    pipe: Pipeline, keys: Keys, queue: str, ids: Sequence[str], *, with_counts: bool = True
) -> dict[str, tuple[str, int]]:
    """In a WATCHed pipeline: each process's task and (``with_counts``) how often
    holders of that task died so far.

    Read outside the transaction: the WATCH on the worker's held set already aborts
    it if any of these processes changes.
    """
    if not ids:
        return {}
    raw_tasks = await _beside(pipe, [("LINDEX", keys.process(queue, pid), 0) for pid in ids])
    tasks = {
        pid: text(raw)
        for pid, raw in zip(ids, raw_tasks, strict=True)
        if isinstance(raw, str | bytes)
    }
    if not tasks or not with_counts:
        return {pid: (task, 0) for pid, task in tasks.items()}
    digests = [death_field(task) for task in tasks.values()]
    (counts,) = await _beside(pipe, [("HMGET", keys.deaths(queue), *digests)])
    if is_wrong_type(counts):  # a wrong-typed deaths hash counts nothing (check's)
        counts = [None] * len(digests)
    return {
        pid: (task, _count(count)) for (pid, task), count in zip(tasks.items(), counts, strict=True)
    }


async def _ended_jobs(
    pipe: Pipeline, keys: Keys, queue: str, tasks: Sequence[str]
) -> tuple[set[str], dict[str, list[str]]]:
    """In a WATCHed pipeline: watch the records (and ``after`` sets) of the jobs among
    ``tasks`` and return the envelopes of those that ended already (cancelled while
    they ran: they must not go back to the queue), and, for those others wait for
    (see `waited`), the jobs their end would hand on."""
    envelopes = [envelope for task in tasks if (envelope := envelope_of(task)) is not None]
    if not envelopes:
        return set(), {}
    ids = [e.header.id for e in envelopes]
    await pipe.watch(*{keys.job(queue, i) for i in ids}, *{keys.after(queue, i) for i in ids})
    replies = await _beside(
        pipe,
        [("HMGET", keys.job(queue, i), *LOOK) for i in ids]
        + [("SMEMBERS", keys.after(queue, i)) for i in ids],
    )
    looks = list(zip(envelopes, replies[: len(ids)], replies[len(ids) :], strict=True))
    return (
        {e.raw for e, reply, _ in looks if _says_ended(reply, e.raw)},
        {
            e.raw: found
            for e, reply, after in looks
            if (found := waiters_of(reply, after)) is not None
        },
    )


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


def death_field(task: str) -> str:
    """The deaths field of a stored task: ``job:<id>`` for a job (its envelopes differ
    from attempt to attempt, and identical payloads are different jobs), else its
    `digest`."""
    envelope = envelope_of(task)
    return digest(task) if envelope is None else f"job:{envelope.header.id}"


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
        as_process(pid, text(task), queue)
        for (_, queue, pid), task in zip(candidates, tasks, strict=True)
        if isinstance(task, str | bytes)
    ]


# -- workers ------------------------------------------------------------------------------


@redis_boundary
async def register_worker(
    r: Client,
    keys: Keys,
    worker_id: str,
    timeout_ms: int,
    queues: Iterable[str],
    *,
    exclusive: bool = False,
) -> bool:
    """Mark a worker alive and list it, with the queues it works on. ``exclusive``:
    only if its heartbeat is absent (False, and nothing of the worker's own written,
    when it is live: an id is live in one place at a time).

    The registry entry comes first: every key of a worker that a crash between the
    steps (two round trips on a Cluster) can leave behind is then findable by the
    dead-worker scan, which removes them once the heartbeat is gone. A listed worker
    whose heartbeat is not yet set may be failed by a peer meanwhile: it holds
    nothing yet, and its own next `touch_worker` lists it again.
      1. SADD workers <w>
      2. SET alive <now> PX <timeout>   (NX when exclusive)
      3. SADD w:queues queue...        (if any; after the SET when exclusive)
    """
    queue_list = list(queues)
    beat = ("SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms)
    own: list[Command] = [(*beat, "NX") if exclusive else beat]
    work: list[Command] = (
        [("SADD", keys.worker_queues(worker_id), *queue_list)] if queue_list else []
    )
    if not exclusive:
        own += work
    listed: list[Command] = [("SADD", keys.workers, worker_id)]
    replies = await _in_order(r, [(keys.workers, listed), (keys.heartbeat(worker_id), own)])
    _raise_wrong(own, replies[1:])  # a wrong-typed registry is the check's to report
    if replies[1] is None:
        return False
    if exclusive and work:
        _raise_wrong(work, await reads(r, work))
    return True


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
async def start_work(
    r: Client, keys: Keys, worker_id: str, queue: str
) -> tuple[int, str | None, str]:
    """Record that a worker works on a queue; return how many tasks wait in it (0 when
    the tasks key is of the wrong type: the consumer's dequeues then report it) and
    the time of the queue's last deletion in the last hour (see `deletions`).

    The work list comes before the registry, so that a `prune_queues` that read no
    worker working on the queue unregisters it before this SADD re-registers it.
      1. SADD w:queues queue
      2. SADD queues queue;  ZSCORE deleted queue
      3. LLEN high;  LLEN tasks;  LLEN low
    The work to announce is ``work:N`` when only normal tasks wait, else a bare
    ``work:`` (a look: see `announce`), as the returned ``(count, deleted, message)``.
    """
    own: list[Command] = [("SADD", keys.worker_queues(worker_id), queue)]
    replies = await _in_order(
        r,
        [
            (keys.worker_queues(worker_id), own),
            (keys.queues, [("SADD", keys.queues, queue)]),
            (keys.deletions, [("ZSCORE", keys.deletions, queue)]),
            (keys.tasks(queue), [("LLEN", key) for key in keys.levels(queue)]),
        ],
    )
    _raise_wrong(own, replies)
    deleted = replies[2]
    high, normal, low = (0 if is_wrong_type(n) else int(n) for n in replies[3:])
    return high + normal + low, _score(deleted), "" if high or low else str(normal)


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
    now_ms: int | None = None,
) -> FailedWorker | None:
    """Return all of a worker's processes to the front of their queues and deregister it.

    With ``only_if_dead`` nothing happens (None) while the worker's heartbeat exists,
    checked again by each reclaim (see `reclaim`): a queue reclaimed before the worker
    came back stays reclaimed, and the worker, whose leases lapsed, hands back and
    registers anew.
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
                r,
                keys,
                queue,
                worker_id,
                quarantine_after=quarantine_after,
                now_ms=now_ms,
                unless_alive=only_if_dead,
            )
        except Alive:  # it came back (a blocking take refreshed its heartbeat)
            return None
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
    overdue: list[ProcessRef] = field(default_factory=list)
    """Processes of jobs past their deadline (timeout plus grace): any peer may end
    the attempt, as timed out (see `fail`)."""


_OVERDUE_BATCH = 100  # overdue processes per queue one scan reports


@redis_boundary
async def scan(r: Client, keys: Keys, now_ms: int | None = None) -> Scan:
    """The fleet-wide scan: dead workers, and queues idle enough to leave the registry.

    O(workers + registered queues) per call; only one peer per interval runs it (see
    `acquire_supervision`), and since idle queues are pruned (`prune_queues`), its cost
    follows the queues in use, not every queue ever used.
    With ``now_ms`` (server time) it also lists processes past their deadline.
      1. SMEMBERS workers;  SMEMBERS queues
      2. SMEMBERS holders;  EXISTS high tasks low failed delayed       (per queue)
         (now_ms) ZRANGE deadlines -inf <now> BYSCORE LIMIT 0 100
         SMEMBERS w:queues                          (per listed worker)   one round trip
      3. EXISTS alive                               (per candidate, one round trip)
    """
    first: list[Command] = [("SMEMBERS", keys.workers), ("SMEMBERS", keys.queues)]
    listed, known = await reads(r, first)
    workers, queues = members(listed), members(known)
    step = 2 if now_ms is None else 3
    second: list[Command] = []
    for queue in queues:
        second += [
            ("SMEMBERS", keys.holders(queue)),
            ("EXISTS", *keys.levels(queue), keys.failed(queue), keys.delayed(queue)),
        ]
        if now_ms is not None:
            second.append(
                (
                    "ZRANGE",
                    keys.deadlines(queue),
                    "-inf",
                    now_ms,
                    "BYSCORE",
                    "LIMIT",
                    0,
                    _OVERDUE_BATCH,
                )
            )
    second += [("SMEMBERS", keys.worker_queues(worker_id)) for worker_id in workers]
    replies = await reads(r, second)
    per_queue = replies[: step * len(queues)]
    holders, contents = per_queue[::step], per_queue[1::step]
    overdue = [
        ref
        for reply in (per_queue[2::step] if now_ms is not None else [])
        if not is_wrong_type(reply)
        for pid in reply
        if (ref := _ref_or_none(text(pid))) is not None
    ]
    worked = {q for reply in replies[step * len(queues) :] for q in members(reply)}
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
        overdue=overdue,
    )


def _ref_or_none(pid: str) -> ProcessRef | None:
    try:
        return parse_process_id(pid)
    except InvalidProcessIdError:
        return None


@redis_boundary
async def prune_queues(r: Client, keys: Keys, idle: Sequence[str]) -> list[str]:
    """Unregister queues a `scan` found idle; return those that stayed out.

    No lock, and no queue that comes to life meanwhile is lost: the entries go first,
    then a second read re-registers every queue that has tasks, failed tasks or
    processes, or a worker, by then. A push the read missed comes after it, so its
    own SADD (after the push, see `enqueue`) re-registers the queue; a `start_work`
    the read missed writes its work list after the read and the registry after that.
      1. SREM queues queue...
      2. SMEMBERS workers;  EXISTS high tasks low failed holders delayed (per queue)
      3. SMEMBERS w:queues (per listed worker)
      4. SADD queues queue...                       (those in use by now)
    """
    if not idle:
        return []
    await reads(r, [("SREM", keys.queues, *idle)])
    checks: list[Command] = [
        ("EXISTS", *keys.levels(q), keys.failed(q), keys.holders(q), keys.delayed(q)) for q in idle
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


@dataclass(frozen=True, slots=True)
class QueueLook:
    """What a worker's self-check saw of one queue it works on."""

    waiting: int
    """Queued tasks (0 when the tasks key is of the wrong type)."""
    held: list[str] | None
    """The process ids Redis records under the worker (None: the held set is of the
    wrong type, so nothing is known of them)."""
    next_due: int | None
    """The earliest due time in the delayed set (Unix ms), None for none."""
    leveled: bool = False
    """Tasks wait at another level than normal."""
    released: int = 0
    """Waiting jobs handed to the next release (see `_ops_deps.release`)."""


@redis_boundary
async def touch_worker(
    r: Client, keys: Keys, worker_id: str, queues: Sequence[str]
) -> list[QueueLook]:
    """Periodic self-check: keep the registry entries true, and per queue count
    waiting tasks, list the processes Redis records under this worker and read the
    next due time of its delayed jobs and the jobs waiting for a release (in case a
    ``delayed`` or ``released`` event was missed).

    Re-adding is idempotent and heals an entry a racing peer removed just after
    this worker re-registered.
      1. SADD workers <w>;  SADD w:queues queue...
      2. LLEN high;  LLEN tasks;  LLEN low;  SMEMBERS held:<w>
         ZRANGE delayed 0 0 WITHSCORES;  SCARD released                 (per queue)
    """
    commands: list[Command] = [("SADD", keys.workers, worker_id)]
    if queues:
        commands.append(("SADD", keys.worker_queues(worker_id), *queues))
    for queue in queues:
        commands += [("LLEN", key) for key in keys.levels(queue)]
        commands.append(("SMEMBERS", keys.held(queue, worker_id)))
        commands.append(("ZRANGE", keys.delayed(queue), 0, 0, "WITHSCORES"))
        commands.append(("SCARD", keys.released(queue)))
    per_queue = (await reads(r, commands))[2 if queues else 1 :]
    looks = []
    for i in range(len(queues)):
        high, normal, low, held, due, released = per_queue[6 * i : 6 * i + 6]
        high, normal, low = (0 if is_wrong_type(n) else int(n) for n in (high, normal, low))
        looks.append(
            QueueLook(
                high + normal + low,
                None if is_wrong_type(held) else members(held),
                _first_due(due),
                bool(high or low),
                0 if is_wrong_type(released) else int(released),
            )
        )
    return looks


def _first_due(reply: Any) -> int | None:
    """The score of a ``ZRANGE delayed 0 0 WITHSCORES`` reply, None for none (or for
    one that is no time: never due); 0 for ``-inf``, which a promotion moves (`_reached`)."""
    pairs = [] if is_wrong_type(reply) else _pairs(reply)
    if not pairs:
        return None
    score = pairs[0][1]
    ms = _ms(score)
    return 0 if ms is None and _reached(score, 0) else ms


def _ms(score: Any) -> int | None:
    """A score as Unix ms; None for one that is not a finite number in range."""
    try:
        value = float(text(score) if isinstance(score, bytes | str) else score)
    except (TypeError, ValueError):
        return None
    return round(value) if math.isfinite(value) and abs(value) <= 2**53 else None


# -- repairs (the consistency check) ------------------------------------------------------


@redis_boundary
async def return_orphan(r: Client, keys: Keys, queue: str, process_id: str) -> int:
    """Put the tasks of a process list that no worker records back at the FRONT.

    The SCAN that reported it may have missed a held set created meanwhile, so the
    orphan is confirmed under WATCH first: a recorded process belongs to its worker
    (alive, or reclaimed with the rest of its processes once dead) and is left alone.
    The envelope of a job whose life ended meanwhile (cancelled) is dropped, not put
    back: its job must not run again.
      1. WATCH p:<id> held:<w>;  SISMEMBER held:<w> <id>  -> 1: UNWATCH, done
      2. LRANGE p:<id> 0 -1                                -> its tasks (none: done)
         per envelope: WATCH j:<id>;  HMGET j:<id> state env   -> its life ended?
      (none ended)
      3. MULTI;  LMOVE p:<id> tasks RIGHT LEFT  (n times: order kept)
      (some ended)
      3. TYPE tasks                                        -> not a list: raise
         MULTI;  DEL p:<id>;  LPUSH tasks <the others, last first>
      4. PUBLISH events work:<n>
      5. EXEC                                              -> nil: back to 1
    """
    proc = keys.process(queue, process_id)
    try:
        ref = parse_process_id(process_id)
        held, level = keys.held(queue, ref.worker_id), ref.level
    except InvalidProcessIdError:  # an id worqr never gave out: no worker records it
        held, level = None, "normal"
    back_to = keys.level(queue, level)

    async def body(pipe: Pipeline) -> int:
        if held is not None and await read(pipe, "SISMEMBER", held, process_id):
            await pipe.reset()
            return 0
        tasks = [text(task) for task in await read(pipe, "LRANGE", proc, 0, -1)]
        ended = [await _life_ended(pipe, keys, queue, task) for task in tasks]
        if not any(ended):
            return await _move_back(pipe, keys, queue, proc, level, keep=0)
        back = [stored(task) for task, over in zip(tasks, ended, strict=True) if not over]
        await _require(pipe, back_to, "list")  # else DEL would lose the others
        pipe.multi()
        pipe.execute_command("DEL", proc)
        if back:
            pipe.execute_command("LPUSH", back_to, *reversed(back))
            pipe.execute_command(*announce(keys, queue, level, len(back)))
        return len(back)

    moved, replies = await _optimistic(r, [proc] if held is None else [proc, held], body)
    if replies and is_wrong_type(replies[0]):  # nothing moved: the task stays where it was
        raise _corrupt(back_to)
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
    level = split_process_id(process_id).level

    async def body(pipe: Pipeline) -> int:
        return await _move_back(pipe, keys, queue, proc, level, keep=1)

    moved, replies = await _optimistic(r, [proc], body)
    if replies and is_wrong_type(replies[0]):  # nothing moved: the tasks stay where they were
        raise _corrupt(keys.level(queue, level))
    return moved


async def _life_ended(pipe: Pipeline, keys: Keys, queue: str, task: str) -> bool:
    """In a WATCHed pipeline: whether ``task`` is the envelope of a job whose life ended
    (its record watched from now on); False for a plain task."""
    envelope = envelope_of(task)
    if envelope is None:
        return False
    record = keys.job(queue, envelope.header.id)
    await pipe.watch(record)
    return _says_ended(await read(pipe, "HMGET", record, "state", "env"), envelope.raw)


async def _move_back(
    pipe: Pipeline, keys: Keys, queue: str, proc: str, level: str, *, keep: int
) -> int:
    """In a WATCHed pipeline: queue moving all but the first ``keep`` tasks of a process
    list to the front of ``level``'s list, newest first (so their order is kept)."""
    count = int(await read(pipe, "LLEN", proc)) - keep
    if count <= 0:
        await pipe.reset()
        return 0
    pipe.multi()
    for _ in range(count):
        pipe.execute_command("LMOVE", proc, keys.level(queue, level), "RIGHT", "LEFT")
    pipe.execute_command(*announce(keys, queue, level, count))
    return count


async def _unless_exists(r: Client, key: str, command: Command, *also: str) -> bool:
    """Run ``command`` in a transaction only while ``key`` (and each of ``also``) does
    not exist (the repairs that forget bookkeeping of something gone); whether it ran.

    1. WATCH key...;  EXISTS key...             -> any: UNWATCH, keep it
    2. MULTI;  <command>;  EXEC
    """

    async def body(pipe: Pipeline) -> bool:
        if await call(pipe, "EXISTS", key, *also):
            return False
        pipe.multi()
        pipe.execute_command(*command)
        return True

    ran, _ = await _optimistic(r, [key, *also], body)
    return ran


@redis_boundary
async def drop_process_id(r: Client, keys: Keys, queue: str, worker_id: str, pid: str) -> bool:
    """Forget a recorded process id whose process list does not exist.

    1. WATCH p:<id>;  EXISTS p:<id>             -> 1: UNWATCH, keep it
    2. MULTI;  SREM held:<w> <id>;  EXEC
    """
    return await _unless_exists(
        r, keys.process(queue, pid), ("SREM", keys.held(queue, worker_id), pid)
    )


@redis_boundary
async def drop_holder(r: Client, keys: Keys, queue: str, worker_id: str) -> bool:
    """Forget a worker as holder of a queue where it holds nothing (no process, no
    blocking take).

    1. WATCH held:<w> blocking:<w>;  EXISTS held:<w> blocking:<w>   -> any: keep it
    2. MULTI;  SREM holders <w>;  EXEC
    """
    return await _unless_exists(
        r,
        keys.held(queue, worker_id),
        ("SREM", keys.holders(queue), worker_id),
        keys.blocking(queue, worker_id),
    )


@redis_boundary
async def drop_work_list(r: Client, keys: Keys, worker_id: str) -> bool:
    """Delete the work list of a worker that is gone (no heartbeat).

    1. WATCH alive;  EXISTS alive               -> 1: UNWATCH, keep it
    2. MULTI;  DEL w:queues;  EXEC
    """
    return await _unless_exists(
        r, keys.heartbeat(worker_id), ("DEL", keys.worker_queues(worker_id))
    )


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
async def drop_deadline(r: Client, keys: Keys, queue: str, process_id: str) -> bool:
    """Forget the deadline of a process that no longer exists.

    1. WATCH p:<id>;  EXISTS p:<id>             -> 1: UNWATCH, keep it
    2. MULTI;  ZREM deadlines <id>;  EXEC
    """
    return await _unless_exists(
        r, keys.process(queue, process_id), ("ZREM", keys.deadlines(queue), process_id)
    )


@redis_boundary
async def drop_job_index(r: Client, keys: Keys, queue: str, job_id: str) -> bool:
    """Forget a live index entry whose job record is gone (it would refuse the id
    forever as a duplicate).

    1. WATCH j:<id>;  EXISTS j:<id>             -> 1: UNWATCH, keep it
    2. MULTI;  ZREM jobs <id>;  EXEC
    """
    return await _unless_exists(r, keys.job(queue, job_id), ("ZREM", keys.jobs(queue), job_id))


@redis_boundary
async def index_job(r: Client, keys: Keys, queue: str, job_id: str) -> bool:
    """Put a live job back in the index (it was missing: its id would be accepted
    again while the job lives); whether it was written.

    1. WATCH j:<id>;  HGET j:<id> state;  ZSCORE jobs <id>
                                           -> not queued/delayed, or +inf: UNWATCH
    2. MULTI;  ZADD jobs +inf <id>;  EXEC  -> nil: back to 1
    """
    record = keys.job(queue, job_id)

    async def body(pipe: Pipeline) -> bool:
        state = await read(pipe, "HGET", record, "state")
        live = state is not None and text(state) in ("queued", "delayed")
        if not live or live_score(await read(pipe, "ZSCORE", keys.jobs(queue), job_id)):
            await pipe.reset()
            return False
        pipe.multi()
        pipe.execute_command("ZADD", keys.jobs(queue), "+inf", job_id)
        return True

    indexed, _ = await _optimistic(r, [record], body)
    return indexed


LOST = "lost: its envelope was found neither queued, delayed nor in process"
"""The error a job's record ends with when `check` finds its envelope gone."""


@redis_boundary
async def end_lost_job(r: Client, keys: Keys, queue: str, job_id: str, now_ms: int) -> bool:
    """End the record of a live job whose envelope is nowhere (removed by another
    client, or by a `delete_queue` that raced its submit), as failed with `LOST`, so
    that its waiters wake and the record expires; False if the envelope turned up.

    WATCH covers the task list and the delayed set too: every move of an envelope
    between a process list and them (dequeue, stop, reclaim, promotion) writes one of
    them, so an envelope cannot slip past the looks below while they run.
      1. WATCH j:<id> high tasks low delayed;  HMGET j:<id> state env waited
                                                    -> not live: UNWATCH, False
      2. LPOS <its level> <env>;  ZSCORE delayed <env>    -> any: UNWATCH, False
      3. SMEMBERS holders;  SMEMBERS held:<w>;  LINDEX p:<id> 0   -> <env>: UNWATCH, False
      4. MULTI;  the writes of `_end_job`;  PUBLISH done done:[{...}];  EXEC
    """
    record = keys.job(queue, job_id)

    async def body(pipe: Pipeline) -> bool:
        state, raw, waited_on = await read(pipe, "HMGET", record, *LOOK)
        envelope = None if raw is None else envelope_of(text(raw))
        if state is None or text(state) not in ("queued", "delayed") or envelope is None:
            return False
        env = envelope.raw
        waits_in = keys.level(queue, envelope.header.priority)
        if await read(pipe, "LPOS", waits_in, env) is not None:
            return False
        if await read(pipe, "ZSCORE", keys.delayed(queue), env) is not None:
            return False
        (holders,) = await _beside(pipe, [("SMEMBERS", keys.holders(queue))])
        held: list[Command] = [("SMEMBERS", keys.held(queue, w)) for w in members(holders)]
        pids = [pid for reply in await _beside(pipe, held) for pid in members(reply)]
        tasks = await _beside(pipe, [("LINDEX", keys.process(queue, pid), 0) for pid in pids])
        if any(isinstance(t, str | bytes) and text(t) == env for t in tasks):
            return False
        waiters = None if waited_on is None else await _waiters(pipe, keys, queue, job_id)
        pipe.multi()
        _end_job(pipe, keys, queue, envelope.header, now_ms, error=LOST, waiters=waiters)
        notice = done_record(None, "", envelope.payload, None, job_id=job_id, error=LOST)
        pipe.execute_command("PUBLISH", keys.done(queue), event("done", f"[{notice}]"))
        return True

    watched = [record, *keys.levels(queue), keys.delayed(queue)]
    ended, _ = await _optimistic(r, watched, body)
    return ended


@redis_boundary
async def register(r: Client, registry: str, member: str) -> None:
    """Add a missing registry entry (a live worker or a queue with tasks).

    1. SADD <registry> <member>
    """
    await call(r, "SADD", registry, member)


# -- inspection ---------------------------------------------------------------------------

PLAIN_PROTOCOL = "2"
"""What a prefix records until a job feature is used: version-2 peers still work with it."""
PROTOCOL_VERSION = "3"
"""The version this library speaks: version 2 plus jobs (envelopes, delayed sets, records)."""
PROTOCOLS = frozenset({PLAIN_PROTOCOL, PROTOCOL_VERSION})


@redis_boundary
async def claim_protocol(r: Client, keys: Keys) -> str:
    """Record protocol 2 under the prefix unless a version is there; return the
    version found (a prefix moves to 3 with its first job, see `require_jobs`).

      1. SET protocol 2 NX
      2. GET protocol
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SET", keys.protocol, PLAIN_PROTOCOL, "NX")
        pipe.execute_command("GET", keys.protocol)
        _, found = await pipe.execute()
    return text(found)


@redis_boundary
async def require_jobs(r: Client, keys: Keys) -> str:
    """Move the prefix to protocol 3 (so that version-2 peers refuse to start rather
    than hand envelopes to handlers); return the version found before.

      1. WATCH protocol;  GET protocol    -> 3 or another: UNWATCH, return it
      2. MULTI;  SET protocol 3;  EXEC    -> nil: back to 1
    """

    async def body(pipe: Pipeline) -> str:
        raw = await call(pipe, "GET", keys.protocol)
        found = PLAIN_PROTOCOL if raw is None else text(raw)
        if found == PLAIN_PROTOCOL:
            pipe.multi()
            pipe.execute_command("SET", keys.protocol, PROTOCOL_VERSION)
        return found

    found, _ = await _optimistic(r, [keys.protocol], body)
    return found


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
async def queue_table(r: Client, keys: Keys, queues: Sequence[str] | None = None) -> list[QueueRow]:
    """Per queue (default: every registered one, sorted): its queued, in-process,
    failed and delayed tasks, the workers working on it and its flow control; three
    round trips however many queues there are. A key of the wrong type counts 0 (a
    flow hash of the wrong type: neither paused nor limited).

    1. SMEMBERS queues (without ``queues``);  SMEMBERS workers
    2. LLEN high;  LLEN tasks;  LLEN low;  LLEN failed;  SMEMBERS holders
       ZCARD delayed;  HMGET flow paused limit per  (per queue)
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
            *(("LLEN", key) for key in keys.levels(queue)),
            ("LLEN", keys.failed(queue)),
            ("SMEMBERS", keys.holders(queue)),
            ("ZCARD", keys.delayed(queue)),
            read_flow(keys, queue),
        ]
    second += [("SMEMBERS", keys.worker_queues(w)) for w in worker_ids]
    counts = await reads(r, second)
    per_queue = counts[: _ROW * len(names)]
    worked: dict[str, int] = {}
    for reply in counts[_ROW * len(names) :]:
        for queue in members(reply):
            worked[queue] = worked.get(queue, 0) + 1
    pairs = [
        (q, w)
        for q, holders in zip(names, per_queue[4::_ROW], strict=True)
        for w in members(holders)
    ]
    sizes = await reads(r, [("SCARD", keys.held(q, w)) for q, w in pairs])
    in_process: dict[str, int] = {}
    for (queue, _), size in zip(pairs, sizes, strict=True):
        in_process[queue] = in_process.get(queue, 0) + _count(size)
    rows = []
    for i, queue in enumerate(names):
        high, normal, low, failed, _, delayed, flow_reply = per_queue[_ROW * i : _ROW * (i + 1)]
        try:
            flow = Flow.parse(flow_reply, keys.flow(queue))
        except CorruptDataError:
            flow = Flow()
        rows.append(
            QueueRow(
                queue,
                _count(high) + _count(normal) + _count(low),
                in_process.get(queue, 0),
                _count(failed),
                worked.get(queue, 0),
                _count(delayed),
                flow,
                {"high": _count(high), "normal": _count(normal), "low": _count(low)},
            )
        )
    return rows


@dataclass(frozen=True, slots=True)
class QueueRow:
    """One queue as `queue_table` reads it."""

    queue: str
    queued: int
    in_process: int
    failed: int
    workers: int
    delayed: int
    flow: Flow
    levels: dict[str, int]
    """Queued tasks per priority level."""


_ROW = 7  # the replies `queue_table` reads per queue
