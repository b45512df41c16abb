"""The failed list: records of tasks that failed for good, their retry and removal.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

import hashlib
import json

from redis.asyncio.client import Pipeline

from .._errors import redis_boundary
from .._layout.envelope import Envelope, wrap
from .._layout.keys import Keys
from .._layout.models import FailedTask
from .._layout.state import JobState
from .._redis.connections import Client as Client
from .._redis.replies import text
from .commands import _optimistic, _require, read, reads
from .writes import _push_levels, _record_job, envelope_of, live_score, new_life, stored


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
                    _record_job(pipe, keys, queue, env, JobState.QUEUED.value, life=life)
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


@redis_boundary
async def failed_tasks(r: Client, keys: Keys, queue: str) -> list[FailedTask]:
    """The failed list, oldest first.

    1. LRANGE failed 0 -1
    """
    return [parse_failed(record) for record in await read(r, "LRANGE", keys.failed(queue), 0, -1)]


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
