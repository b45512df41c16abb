"""Cancel a queued task, and delete a whole queue.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

import time

from .._errors import is_wrong_type, redis_boundary
from .._layout.keys import Keys
from .._redis.connections import Client as Client
from .._redis.replies import members
from .commands import Command, _atomic, _raise_wrong, call, reads, wrong_keys
from .repairs import drop_holder
from .writes import digest, event


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
        # process; its id stays: the take withdraws it (see `_ops.block`).
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
