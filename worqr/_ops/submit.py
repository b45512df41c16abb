"""Submit: jobs with ids, delays and records.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .._errors import CorruptDataError, DuplicateTaskError, is_wrong_type, redis_boundary
from .._layout.envelope import Envelope
from .._layout.keys import Keys
from .._layout.state import JobState
from .._redis.connections import Client as Client
from .._redis.connections import on_slot, pinned
from .._redis.replies import text
from .commands import (
    Command,
    _atomic,
    _beside,
    _corrupt,
    _optimistic,
    _register_after,
    _wait,
    reads,
)
from .writes import DUE_EVENT, announce, event, live_score, new_life, record_job


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

    commands = submit_commands(keys, queue, jobs, life=life)
    if registers:
        commands.append(("SADD", keys.queues, queue))

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
        for command in commands:
            pipe.execute_command(*command)

    async def pushed(client: Client, node_once: Client) -> None:
        if check:
            watch = [keys.job(queue, job_id) for job_id in ids]
            _, replies = await _optimistic(client, watch, body)
        else:
            replies = await _atomic(node_once, keys.tasks(queue), commands)
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
    """Queue the writes of `submit_commands` on ``pipe``."""
    for command in submit_commands(keys, queue, jobs, life=life):
        pipe.execute_command(*command)


def submit_commands(
    keys: Keys, queue: str, jobs: Sequence[Submission], *, life: str
) -> list[Command]:
    """The writes of `submit` (steps 3-6): the records, the pushes of the jobs due now
    (one priority per submit) and the delayed set's entries of the others."""
    level = jobs[0].envelope.header.priority
    ready = [job.envelope.raw for job in jobs if job.due_ms is None]
    later = [job for job in jobs if job.due_ms is not None]
    commands: list[Command] = []
    for job in jobs:
        state = JobState.QUEUED.value if job.due_ms is None else JobState.DELAYED.value
        commands += record_job(keys, queue, job.envelope, state, job.due_ms, life=life)
    if ready:
        commands.append(("RPUSH", keys.level(queue, level), *ready))
        commands.append(announce(keys, queue, level, len(ready)))
    if later:
        pairs = [part for job in later for part in (job.due_ms or 0, job.envelope.raw)]
        commands.append(("ZADD", keys.delayed(queue), *pairs))
        earliest = min(job.due_ms or 0 for job in later)
        commands.append(("PUBLISH", keys.events(queue), event(DUE_EVENT, str(earliest))))
    return commands
