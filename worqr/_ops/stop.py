"""Stop: a worker hands one process back to the front of its queue.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from .._errors import CorruptDataError, is_wrong_type, redis_boundary
from .._layout.keys import Keys
from .._layout.names import ProcessRef
from .._redis.connections import Client as Client
from .._redis.replies import text
from .commands import _atomic, _optimistic, read, reads
from .writes import _ended, announce, envelope_of


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
