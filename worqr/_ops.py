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
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._connections import Client as Client
from ._connections import Pinned, on_slot, pinned
from ._errors import (
    BackendError,
    BackendUnavailableError,
    DuplicateTaskError,
    ReplicationError,
    redis_boundary,
)
from ._keys import Keys
from ._models import FailedTask, Process, WorkerInfo
from ._names import ProcessRef, new_process_id, parse_process_id, split_process_id

_T = TypeVar("_T")
_MAX_ATTEMPTS = 100

Command = tuple[str | int | float, ...]


def text(value: bytes | str) -> str:
    """A Redis reply as str, whatever the client's ``decode_responses``."""
    return value.decode() if isinstance(value, bytes) else value


def event(kind: str, message: str = "") -> str:
    """The wire form of an event on a queue's channel."""
    return f"{kind}:{message}"


def done_record(process_id: str, worker_id: str, task: str, result: str | None) -> str:
    """One finished process, as JSON; a ``done`` message is a JSON array of these."""
    return json.dumps(
        {"process_id": process_id, "worker_id": worker_id, "task": task, "result": result}
    )


async def call(client: Client | Pipeline, *args: str | int | float) -> Any:
    """Run one command now and return its raw reply."""
    return await cast("Awaitable[Any]", client.execute_command(*args))


async def _pipelined(client: Redis, commands: Iterable[Command]) -> list[Any]:
    """Send commands in one round trip, without MULTI; their replies in order."""
    async with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute()
        return replies


async def _in_order(r: Client, groups: Sequence[tuple[str, Sequence[Command]]]) -> list[Any]:
    """Run groups of commands, each group applied after the one before it and each on
    the server of its key's slot; the replies of all, in order.

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
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise _unknown_outcome() from exc


def _transaction(commands: Sequence[Command]) -> Callable[[Redis], Awaitable[list[Any]]]:
    """What `on_slot` runs for one MULTI/EXEC of ``commands``: their replies."""

    async def run(node: Redis) -> list[Any]:
        async with node.pipeline(transaction=True) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            replies: list[Any] = await pipe.execute()
            return replies

    return run


async def _optimistic(
    r: Client, watch: Sequence[str], body: Callable[[Pipeline], Awaitable[_T]]
) -> tuple[_T, list[Any]]:
    """WATCH ``watch``, run ``body`` (reads, then ``pipe.multi()`` and queued writes), EXEC.

    Returns the body's value and EXEC's replies (empty when the body wrote nothing).
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
                        return result, await pipe.execute()
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
    except DuplicateTaskError:
        raise  # refused: nothing was pushed
    except Exception:
        with contextlib.suppress(RedisError, OSError):
            await call(r, "SADD", keys.queues, queue)
        raise
    await call(r, "SADD", keys.queues, queue)
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
    if wait is None:
        await _in_order(r, [(keys.tasks(queue), push), (keys.queues, register)])
        return None

    async def waited(node: Redis) -> int:
        async with pinned(node) as one:  # WAIT counts the writes of its own connection
            await _pipelined(one.client, push)
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
        present = await call(pipe, "SMISMEMBER", keys.unique(queue), *tasks)
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

    async def waited(node: Redis, wait: tuple[int, int]) -> int:
        async with pinned(node) as one:  # WAIT counts the writes of its own connection
            await _optimistic(one.client, [keys.unique(queue)], body)
            return await _wait(one, wait)

    if wait is None:
        await _register_after(r, keys, queue, _optimistic(r, [keys.unique(queue)], body))
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

    removed, _, _, _ = await _atomic(
        once,
        keys.tasks(queue),
        [
            ("LREM", keys.tasks(queue), 0, task),
            ("SREM", keys.unique(queue), task),
            ("HDEL", keys.deaths(queue), digest(task)),
            ("PUBLISH", keys.events(queue), event("cancel", task)),
        ],
    )
    return int(removed)


_DELETE_PASSES = 10


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
      1. SMEMBERS holders;  SMEMBERS held:<w> (per holder)     -> ids
      2. MULTI
      3. DEL tasks failed unique deaths p:<id>...
      4. SREM held:<w> <id>...                                  (per holder)
      5. PUBLISH events delete:                                 (first pass)
      6. EXEC
      7. SMEMBERS holders;  SMEMBERS held:<w>   -> ids: back to 2 with them
      8. `drop_holder` per holder
      9. SREM queues queue
     10. EXISTS tasks holders                   -> any: SADD queues queue
    """
    doomed = [keys.tasks(queue), keys.failed(queue), keys.unique(queue), keys.deaths(queue)]

    async def read() -> tuple[list[str], list[list[Any]]]:
        holders = [text(w) for w in await call(r, "SMEMBERS", keys.holders(queue))]
        if not holders:
            return holders, []
        async with r.pipeline(transaction=False) as pipe:
            for worker_id in holders:
                pipe.execute_command("SMEMBERS", keys.held(queue, worker_id))
            return holders, await pipe.execute()

    holders, held = await read()
    for attempt in range(_DELETE_PASSES):
        sweep: list[Command] = [
            ("DEL", *doomed, *(keys.process(queue, text(pid)) for pids in held for pid in pids))
        ]
        sweep += [
            ("SREM", keys.held(queue, worker_id), *pids)
            for worker_id, pids in zip(holders, held, strict=True)
            if pids
        ]
        if attempt == 0:
            sweep.append(("PUBLISH", keys.events(queue), event("delete")))
        await _atomic(once, keys.tasks(queue), sweep)
        # Read again AFTER the sweep: a process dequeued between the last read and the
        # sweep survived it, and only a read made after the sweep can see it.
        holders, held = await read()
        if not any(held):
            break
    for worker_id in holders:
        await drop_holder(r, keys, queue, worker_id)
    await call(r, "SREM", keys.queues, queue)
    if await call(r, "EXISTS", keys.tasks(queue), keys.holders(queue)):
        await call(r, "SADD", keys.queues, queue)  # the queue's next life began meanwhile


@redis_boundary
async def retry_failed(r: Client, keys: Keys, queue: str, limit: int | None) -> int:
    """Move the oldest ``limit`` (default all) failed tasks to the back of the queue.

    Keys: queues (SET), failed (LIST of JSON records), tasks (LIST).
      1. SADD queues queue
      2. WATCH failed;  LRANGE failed 0 limit-1      -> records (none: UNWATCH, 0)
      3. MULTI
      4. LTRIM failed <n> -1
      5. RPUSH tasks task...
      6. PUBLISH events work:<n>
      7. EXEC                                         -> nil: back to 2
    """

    async def body(pipe: Pipeline) -> int:
        stop = -1 if limit is None else limit - 1
        records = await call(pipe, "LRANGE", keys.failed(queue), 0, stop)
        if not records:
            return 0
        tasks = [parse_failed(record).task for record in records]
        pipe.multi()
        pipe.execute_command("LTRIM", keys.failed(queue), len(tasks), -1)
        pipe.execute_command("RPUSH", keys.tasks(queue), *tasks)
        pipe.execute_command("PUBLISH", keys.events(queue), event("work", str(len(tasks))))
        return len(tasks)

    if limit is not None and limit <= 0:
        return 0
    await call(r, "SADD", keys.queues, queue)
    moved, _ = await _optimistic(r, [keys.failed(queue)], body)
    return moved


@redis_boundary
async def failed_tasks(r: Client, keys: Keys, queue: str) -> list[FailedTask]:
    """The failed list, oldest first.

    1. LRANGE failed 0 -1
    """
    return [parse_failed(record) for record in await call(r, "LRANGE", keys.failed(queue), 0, -1)]


@redis_boundary
async def registered(r: Client, keys: Keys, queues: Sequence[str]) -> list[bool]:
    """Whether each queue is in the registry (a deleted queue is not).

    1. SMISMEMBER queues queue...
    """
    return [bool(flag) for flag in await call(r, "SMISMEMBER", keys.queues, *queues)]


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
    waiting = int(await call(r, "LLEN", keys.tasks(queue)))
    if waiting:
        await publish(r, keys, queue, "work", str(waiting))
    return waiting


def parse_failed(record: bytes | str) -> FailedTask:
    """Decode one failed-list record."""
    data = json.loads(text(record))
    return FailedTask(
        task=data["task"],
        error=data["error"],
        worker_id=data["worker_id"],
        failed_at=data["failed_at"],
    )


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
    length = count if announced else await call(r, "LLEN", keys.tasks(queue))
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

    for _ in range(_MAX_ATTEMPTS):
        ids = new_ids(k)
        try:
            tasks = (await on_slot(once, keys.tasks(queue), _transaction(take(ids))))[:k]
            break
        except (RedisConnectionError, RedisTimeoutError):
            async with r.pipeline(transaction=False) as reads:
                for pid in ids:
                    reads.execute_command("LINDEX", keys.process(queue, pid), 0)
                tasks = await reads.execute()
            if any(task is not None for task in tasks):
                break  # the lost EXEC was applied: adopt what it took
    else:
        raise BackendError(f"gave up dequeuing from {queue!r} after {_MAX_ATTEMPTS} tries")
    taken = [
        Process(pid, text(task), queue)
        for pid, task in zip(ids, tasks, strict=True)
        if task is not None
    ]
    if len(taken) < len(ids):
        unused = [pid for pid, task in zip(ids, tasks, strict=True) if task is None]
        await call(r, "SREM", held, *unused)
    return taken


async def _end_process(
    r: Client, keys: Keys, ref: ProcessRef, queue_writes: Callable[[Pipeline, str], None]
) -> str | None:
    """Fenced end of a process: if it still exists, delete it and its bookkeeping and
    release the task's unique mark, plus the caller's writes; return its task.

    WATCH is needed because the unique mark may only be released while the process
    exists: a late finish after a reclaim must not free the mark of the requeued task.
      1. WATCH p:<id>;  LINDEX p:<id> 0   -> nil: UNWATCH, return None (gone)
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
        raw = await call(pipe, "LINDEX", proc, 0)
        if raw is None:
            return None
        task = text(raw)
        pipe.multi()
        pipe.execute_command("DEL", proc)
        pipe.execute_command("SREM", keys.held(ref.queue, ref.worker_id), ref.id)
        pipe.execute_command("SREM", keys.unique(ref.queue), task)
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
      8. PUBLISH done done:[{...}, ...]   (one message, a record per process)
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
            pipe.execute_command("SREM", keys.unique(queue), *tasks)
            pipe.execute_command("HDEL", keys.deaths(queue), *{digest(task) for task in tasks})
            records = ",".join(
                done_record(refs[i].id, worker_id, done[i][0].task, done[i][1]) for i in at
            )
            pipe.execute_command("PUBLISH", keys.done(queue), event("done", f"[{records}]"))
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

    return await _end_process(r, keys, ref, writes)


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
        ids = sorted(
            (text(pid) for pid in await call(pipe, "SMEMBERS", held)),
            key=lambda pid: parse_process_id(pid).token,
            reverse=True,
        )
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
                pipe.execute_command("SREM", keys.unique(queue), task)
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
        if kind == "returned" and replies[position] is not None:
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
    async with r.pipeline(transaction=False) as pipe:
        for pid in ids:
            pipe.execute_command("LINDEX", keys.process(queue, pid), 0)
        raw_tasks = await pipe.execute()
    tasks = {pid: text(raw) for pid, raw in zip(ids, raw_tasks, strict=True) if raw is not None}
    if not tasks:
        return {}
    digests = [digest(task) for task in tasks.values()]
    counts = await call(r, "HMGET", keys.deaths(queue), *digests)
    return {
        pid: (task, int(count or 0))
        for (pid, task), count in zip(tasks.items(), counts, strict=True)
    }


def digest(task: str) -> str:
    """The field under which a task's death count is kept (tasks may be megabytes)."""
    return hashlib.sha1(task.encode()).hexdigest()


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
        queues = sorted(text(q) for q in await call(r, "SMEMBERS", keys.queues))
    async with r.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.execute_command("SMEMBERS", keys.holders(queue))
        holders = await pipe.execute()
    pairs = [(q, text(w)) for q, ws in zip(queues, holders, strict=True) for w in ws]
    async with r.pipeline(transaction=False) as pipe:
        for queue, worker_id in pairs:
            pipe.execute_command("SMEMBERS", keys.held(queue, worker_id))
        held = await pipe.execute()
    candidates = sorted(
        (parse_process_id(text(pid)) for pids in held for pid in pids), key=lambda ref: ref.token
    )
    async with r.pipeline(transaction=False) as pipe:
        for ref in candidates:
            pipe.execute_command("LINDEX", keys.process(ref.queue, ref.id), 0)
        tasks = await pipe.execute()
    return [
        Process(ref.id, text(task), ref.queue)
        for ref, task in zip(candidates, tasks, strict=True)
        if task is not None
    ]


# -- workers ------------------------------------------------------------------------------


@redis_boundary
async def register_worker(
    r: Client, keys: Keys, worker_id: str, timeout_ms: int, queues: Iterable[str]
) -> None:
    """Mark a worker alive and list it, with the queues it works on.

    The heartbeat comes first so that a listed worker is never mistaken for a dead one.
      1. SET alive <now> PX <timeout>
      2. SADD w:queues queue...        (if any)
      3. SADD workers <w>              (after 1 and 2, on a Cluster too)
    """
    queue_list = list(queues)
    own: list[Command] = [("SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms)]
    if queue_list:
        own.append(("SADD", keys.worker_queues(worker_id), *queue_list))
    await _in_order(
        r,
        [(keys.heartbeat(worker_id), own), (keys.workers, [("SADD", keys.workers, worker_id)])],
    )


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
async def start_work(r: Client, keys: Keys, worker_id: str, queue: str) -> int:
    """Record that a worker works on a queue; return how many tasks wait in it.

    1. SADD queues queue
    2. SADD w:queues queue
    3. LLEN tasks
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SADD", keys.queues, queue)
        pipe.execute_command("SADD", keys.worker_queues(worker_id), queue)
        pipe.execute_command("LLEN", keys.tasks(queue))
        _, _, waiting = await pipe.execute()
    return int(waiting)


@redis_boundary
async def stop_work(r: Client, keys: Keys, worker_id: str, queue: str) -> list[str]:
    """Stop a worker's work on a queue: reclaim its processes there, then forget the queue.

    1. `reclaim` (queue, worker)
    2. SREM w:queues queue
    """
    returned = await reclaim(r, keys, queue, worker_id)
    await call(r, "SREM", keys.worker_queues(worker_id), queue)
    return returned.returned


@redis_boundary
async def queues_held_by(r: Client, keys: Keys, worker_id: str) -> set[str]:
    """Every queue where a worker may hold processes: its work list and any queue
    whose holders name it (processes recorded after its work list was lost).

      1. SMEMBERS w:queues;  SMEMBERS queues
      2. SISMEMBER holders <w>   (per queue, one round trip)
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SMEMBERS", keys.worker_queues(worker_id))
        pipe.execute_command("SMEMBERS", keys.queues)
        working, known = await pipe.execute()
    queues = {text(q) for q in working}
    candidates = [text(q) for q in known]
    async with r.pipeline(transaction=False) as pipe:
        for queue in candidates:
            pipe.execute_command("SISMEMBER", keys.holders(queue), worker_id)
        flags = await pipe.execute()
    return queues | {q for q, flag in zip(candidates, flags, strict=True) if flag}


@redis_boundary
async def fail_worker(
    r: Client,
    keys: Keys,
    worker_id: str,
    *,
    only_if_dead: bool,
    quarantine_after: int | None = None,
) -> dict[str, Reclaimed] | None:
    """Return all of a worker's processes to the front of their queues and deregister it.

    With ``only_if_dead`` nothing happens (None) while the worker's heartbeat exists.
    ``quarantine_after`` is passed to `reclaim` when the worker died (not when it is
    failed on purpose). Each step is idempotent and the registry entry goes last, so a
    peer that crashes midway leaves the worker listed for the next cleanup to finish.
      1. EXISTS alive (only_if_dead)  |  DEL alive
      2. `queues_held_by` worker
      3. `reclaim` (queue, worker)    per queue
      4. DEL w:queues
      5. SREM workers <w>
    """
    if only_if_dead:
        if await call(r, "EXISTS", keys.heartbeat(worker_id)):
            return None
    else:
        await call(r, "DEL", keys.heartbeat(worker_id))
    outcome = {
        queue: await reclaim(r, keys, queue, worker_id, quarantine_after=quarantine_after)
        for queue in sorted(await queues_held_by(r, keys, worker_id))
    }
    await call(r, "DEL", keys.worker_queues(worker_id))
    await call(r, "SREM", keys.workers, worker_id)
    return outcome


@redis_boundary
async def dead_workers(r: Client, keys: Keys) -> list[str]:
    """Workers, listed or recorded as holders of some queue, whose heartbeat is gone.

    O(workers + queues) per call; only one peer per interval runs it (see
    `acquire_supervision`), so fleet-wide cost stays linear in workers.
      1. SMEMBERS workers;  SMEMBERS queues
      2. SMEMBERS holders             (per queue, one round trip)
      3. EXISTS alive                 (per candidate, one round trip)
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SMEMBERS", keys.workers)
        pipe.execute_command("SMEMBERS", keys.queues)
        listed, known = await pipe.execute()
    candidates = {text(w) for w in listed}
    async with r.pipeline(transaction=False) as pipe:
        for queue in known:
            pipe.execute_command("SMEMBERS", keys.holders(text(queue)))
        for holders in await pipe.execute():
            candidates.update(text(w) for w in holders)
    ordered = sorted(candidates)
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in ordered:
            pipe.execute_command("EXISTS", keys.heartbeat(worker_id))
        alive = await pipe.execute()
    return [w for w, flag in zip(ordered, alive, strict=True) if not flag]


@redis_boundary
async def acquire_supervision(r: Client, keys: Keys, worker_id: str, lease_ms: int) -> bool:
    """Take the fleet-wide supervision lease for one interval, if nobody holds it.

    1. SET supervisor <w> NX PX <lease>
    """
    return await call(r, "SET", keys.supervision_lease, worker_id, "NX", "PX", lease_ms) is not None


@redis_boundary
async def touch_worker(
    r: Client, keys: Keys, worker_id: str, queues: Sequence[str]
) -> list[tuple[int, list[str]]]:
    """Periodic self-check: keep the registry entries true, count waiting tasks and
    list the processes Redis records under this worker, per queue.

    Re-adding is idempotent and heals an entry a racing peer removed just after
    this worker re-registered.
      1. SADD workers <w>;  SADD w:queues queue...
      2. LLEN tasks;  SMEMBERS held:<w>      (per queue)
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SADD", keys.workers, worker_id)
        if queues:
            pipe.execute_command("SADD", keys.worker_queues(worker_id), *queues)
        for queue in queues:
            pipe.execute_command("LLEN", keys.tasks(queue))
            pipe.execute_command("SMEMBERS", keys.held(queue, worker_id))
        replies = await pipe.execute()
    per_queue = replies[2 if queues else 1 :]
    return [
        (int(waiting), [text(pid) for pid in held])
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
    ref = parse_process_id(process_id)
    proc = keys.process(queue, process_id)
    held = keys.held(queue, ref.worker_id)

    async def body(pipe: Pipeline) -> int:
        if await call(pipe, "SISMEMBER", held, process_id):
            await pipe.reset()
            return 0
        return await _move_back(pipe, keys, queue, proc, keep=0)

    moved, _ = await _optimistic(r, [proc, held], body)
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

    moved, _ = await _optimistic(r, [proc], body)
    return moved


async def _move_back(pipe: Pipeline, keys: Keys, queue: str, proc: str, *, keep: int) -> int:
    """In a WATCHed pipeline: queue moving all but the first ``keep`` tasks of a process
    list to the front of the queue, newest first (so their order is kept)."""
    count = int(await call(pipe, "LLEN", proc)) - keep
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
    ids = sorted(text(w) for w in await call(r, "SMEMBERS", keys.workers))
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.execute_command("GET", keys.heartbeat(worker_id))
            pipe.execute_command("SMEMBERS", keys.worker_queues(worker_id))
        replies = await pipe.execute()
    held: dict[str, int] = {}
    for process in await processes(r, keys):
        held[process.worker_id] = held.get(process.worker_id, 0) + 1
    now = time.time()
    return [
        WorkerInfo(
            worker_id,
            tuple(sorted(text(q) for q in queues)),
            held.get(worker_id, 0),
            None if beat is None else max(0.0, now - float(text(beat))),
        )
        for worker_id, beat, queues in zip(ids, replies[::2], replies[1::2], strict=True)
    ]


@redis_boundary
async def queue_counts(r: Client, keys: Keys, queue: str) -> tuple[int, int, int, int]:
    """Queued, in-process and failed tasks of a queue, and the workers working on it.

    1. LLEN tasks;  LLEN failed;  SMEMBERS holders;  SMEMBERS workers
    2. SCARD held:<w> (per holder);  SISMEMBER w:queues queue (per worker)
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("LLEN", keys.tasks(queue))
        pipe.execute_command("LLEN", keys.failed(queue))
        pipe.execute_command("SMEMBERS", keys.holders(queue))
        pipe.execute_command("SMEMBERS", keys.workers)
        queued, failed, holders, listed = await pipe.execute()
    holder_ids = [text(w) for w in holders]
    worker_ids = [text(w) for w in listed]
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in holder_ids:
            pipe.execute_command("SCARD", keys.held(queue, worker_id))
        for worker_id in worker_ids:
            pipe.execute_command("SISMEMBER", keys.worker_queues(worker_id), queue)
        replies = await pipe.execute()
    in_process = sum(int(n) for n in replies[: len(holder_ids)])
    working = sum(bool(flag) for flag in replies[len(holder_ids) :])
    return int(queued), in_process, int(failed), working
