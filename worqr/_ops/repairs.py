"""Repairs: the writes of the consistency check, each undoing one kind of problem
that it found, fenced so that it acts only if the problem is still there.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from .._errors import InvalidProcessIdError, is_wrong_type, redis_boundary
from .._layout.keys import Keys
from .._layout.names import parse_process_id, split_process_id
from .._layout.state import IN_QUEUE
from .._redis.connections import Client as Client
from .._redis.replies import members, text
from .commands import Command, _beside, _corrupt, _optimistic, _require, call, read
from .writes import (
    LOOK,
    _end_job,
    _life_ended,
    _waiters,
    announce,
    done_record,
    envelope_of,
    event,
    live_score,
    stored,
)


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
        live = state is not None and text(state) in IN_QUEUE
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
        if state is None or text(state) not in IN_QUEUE or envelope is None:
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
