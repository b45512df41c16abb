"""Progress: a running attempt records how far it got on its job's record."""

from __future__ import annotations

from redis.asyncio.client import Pipeline

from .._errors import redis_boundary
from .._layout.keys import Keys
from .._redis.connections import Client as Client
from .commands import _optimistic, read


@redis_boundary
async def report_progress(
    r: Client,
    keys: Keys,
    queue: str,
    job_id: str,
    process_id: str,
    fraction: float,
    note: str | None,
) -> bool:
    """Write ``fraction`` (and ``note``, or none) on the record of job ``job_id`` while
    process ``process_id`` still holds it: an attempt that was reclaimed, handed back,
    timed out or cancelled has no process list any more and writes nothing. False then.
    (A job's record lives as long as one of its processes does.)

      1. WATCH p:<process id>;  EXISTS p:<process id>     -> 0: UNWATCH, False
      2. MULTI;  HSET j:<id> progress <fraction> [note <note>];  [HDEL j:<id> note];  EXEC
    """
    process, record = keys.process(queue, process_id), keys.job(queue, job_id)

    async def body(pipe: Pipeline) -> bool:
        if not await read(pipe, "EXISTS", process):
            await pipe.reset()
            return False
        pipe.multi()
        pipe.execute_command("HSET", record, "progress", repr(fraction))
        if note is None:
            pipe.execute_command("HDEL", record, "note")
        else:
            pipe.execute_command("HSET", record, "note", note)
        return True

    written, _ = await _optimistic(r, [process], body)
    return written
