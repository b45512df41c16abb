"""Reclaim: a live peer hands a dead worker's processes back to the front of their
queues.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .._errors import is_wrong_type, redis_boundary
from .._layout.keys import Keys
from .._layout.names import split_process_id
from .._redis.connections import Client as Client
from .._redis.replies import members, text
from .commands import _beside, _corrupt, _optimistic, _require, read
from .writes import (
    LOOK,
    _count,
    _end_job,
    _job_id,
    _says_ended,
    _token,
    _trim_jobs,
    announce,
    death_field,
    done_record,
    envelope_of,
    event,
    failed_record,
    local_ms,
    stored,
    waited_keys,
    waiters_of,
)


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
    raised) if it exists: a worker's blocking take (`_ops.block`) refreshes its
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
    The ids of the worker's blocking takes (``blocking:<w>``, see `_ops.block`) are
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
