"""Cancel a job, wherever it is: waiting, queued, delayed or running.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from .._errors import redis_boundary
from .._layout.deps import dependencies_of
from .._layout.keys import Keys
from .._layout.state import LIVE, JobState
from .._redis.connections import Client as Client
from .._redis.replies import text
from .commands import _optimistic, read
from .writes import (
    CANCELLED,
    LOOK,
    _end_job,
    _still_queued,
    _trim_jobs,
    _waiters,
    done_record,
    envelope_of,
    event,
)


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
        if state is None or raw is None or text(state) not in LIVE:
            return False
        envelope = envelope_of(text(raw))
        if envelope is None:
            return False
        attempts = envelope.header.attempt - 1  # the attempts that ended
        waits_in = keys.level(queue, envelope.header.priority)
        if text(state) == JobState.QUEUED.value and not await _still_queued(pipe, waits_in, raw):
            attempts += 1  # not in the list: an attempt runs (and counts)
        waiters = None
        if waited_on is not None:
            waiters = await _waiters(pipe, keys, queue, job_id)
        pipe.multi()
        pipe.execute_command("LREM", waits_in, 0, envelope.raw)
        pipe.execute_command("ZREM", keys.delayed(queue), envelope.raw)
        pipe.execute_command("HDEL", keys.deaths(queue), f"job:{job_id}")
        if text(state) == JobState.WAITING.value:  # its entries go (stale ones would be harmless)
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
