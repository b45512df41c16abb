"""The end of a process: finish, fail (retry or the failed list), and deadlines.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import BackendError, is_wrong_type, redis_boundary
from .._layout.envelope import Envelope, Header, wrap
from .._layout.jobs import Backoff
from .._layout.keys import Keys
from .._layout.models import Process, escaped
from .._layout.names import ProcessRef, split_process_id
from .._layout.state import JobState
from .._redis.connections import Client as Client
from .._redis.connections import on_slot
from .._redis.replies import members, text
from .._redis.wire import Watching, Wire, watching
from .commands import (
    _MAX_ATTEMPTS,
    Command,
    _beside,
    _corrupt,
    _optimistic,
    _require,
    _unknown_outcome,
    _unless_wrong,
    read,
    reads,
)
from .writes import (
    DUE_EVENT,
    LOOK,
    LOOK_LIFE,
    _end_job,
    _says_ended,
    _trim_jobs,
    death_field,
    digest,
    done_messages,
    done_record,
    envelope_of,
    event,
    failed_record,
    job_end,
    level_pushes,
    life_of,
    local_ms,
    stored,
    trim_jobs,
    waited,
    waited_keys,
    waiters_of,
)


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


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt, as `fail` takes it: its ``error`` (and ``trace``), the
    ``delay`` before another attempt (None: its backoff), and whether it is ``final``."""

    error: str
    trace: str = ""
    delay: float | None = None
    final: bool = False


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
    return await _end_many(r, keys, worker_id, queue, done, now_ms)


@redis_boundary
async def fail_many(
    r: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    failed: Sequence[tuple[Process, Failure]],
    now_ms: int | None = None,
) -> list[bool]:
    """End failed attempts of processes that this worker dequeued from one queue, in
    one transaction, each as `fail` would; return, per process, whether it still
    existed. Fenced and read as in `finish_many`, whose steps it takes, with these
    differences:
      1. also, in the same round trip: TYPE failed, TYPE <level> (each level a retry
         goes back to), TYPE delayed (when a retry waits)  -> another type: raise
         (nothing written; the caller fails each process alone, to find which)
      2. only for jobs that end failed (a retry hands nothing on)
      9. per process, the writes of `fail`: the failed list (one RPUSH for all), the
         job's outcome (`job_end` with its error), or its next attempt:
           now: RPUSH <level> <envelope'>... (one per level);  PUBLISH events work:N;
                HSET j:<id> env <envelope'> state queued attempts <a> error <e>;
                HDEL j:<id> due progress note
           later: ZADD delayed <due> <envelope'>...;  HSET j:<id> env <envelope'>
                state delayed attempts <a> error <e> due <due>;  HDEL j:<id> progress
                note;  PUBLISH events delayed:<earliest due>
     10. PUBLISH done with a record of each job that ended failed
    Retries of failing jobs then cost a transaction per batch, as finishes do.
    """
    return await _end_many(r, keys, worker_id, queue, failed, now_ms)


async def _end_many(
    r: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    ends: Sequence[tuple[Process, str | Failure | None]],
    now_ms: int | None,
) -> list[bool]:
    """`finish_many` and `fail_many`: passes of `_Batch` until every process that still
    exists is ended."""
    now = local_ms(now_ms)
    refs = [split_process_id(process.id) for process, _ in ends]
    if any(ref.worker_id != worker_id or ref.queue != queue for ref in refs):
        raise ValueError(f"ending many: every process must be {worker_id}'s in {queue!r}")
    outcome = [False] * len(ends)
    remaining = list(range(len(ends)))
    while remaining:  # each pass ends them all, or finds at least one gone for good
        ending = [ends[i] for i in remaining]
        procs = [keys.process(queue, refs[i].id) for i in remaining]
        batch = _Batch(keys, worker_id, queue, ending, procs, [refs[i].id for i in remaining])

        async def run(node: Redis, batch: _Batch = batch) -> bool:
            return await batch.end(node, now)

        if await on_slot(r, procs[0], run):
            for i in remaining:
                outcome[i] = True
            return outcome
        # Some process is gone (reclaimed, stopped, its queue deleted): ids are never
        # reused, so a gone one stays gone; end the others together.
        present = await reads(r, [("EXISTS", proc) for proc in procs])
        remaining = [i for i, flag in zip(remaining, present, strict=True) if flag]
    return outcome


@dataclass(frozen=True)
class _Batch:
    """The processes one `_end_many` pass ends, with their keys; each ends finished
    with its result, or failed (a `Failure`)."""

    keys: Keys
    worker_id: str
    queue: str
    ending: Sequence[tuple[Process, str | Failure | None]]
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
        typed = self._typed()
        looks: list[Wire] = [
            ("EXISTS", *self.procs),
            *(("HMGET", rec, *LOOK_LIFE) for rec in records),
            *(("TYPE", key) for key, _ in typed),
        ]
        async with watching(node) as session:
            for _ in range(_MAX_ATTEMPTS):
                exists, *rest = _unless_wrong(await session.look([*self.procs, *records], looks))
                if exists != len(self.procs):
                    return False
                states, types = rest[: len(records)], rest[len(records) :]
                for (key, kind), found in zip(typed, types, strict=True):
                    if text(found) not in (kind, "none"):
                        raise _corrupt(key, text(found))
                # Per process, not per job id: a copy of an ended life (cancelled while
                # it ran, the id submitted anew since) may end beside the live copy.
                ended: set[str] = set()
                waited_ids: list[str] = []
                lives: dict[str | None, str | None] = {}
                for (p, end), look in zip(self._jobs(), states, strict=True):
                    lives[p.job_id] = life_of(look)
                    if _says_ended(look, p.stored):
                        ended.add(p.id)
                    elif p.job_id is not None and waited(look) and self._ends_job(p, end):
                        waited_ids.append(p.job_id)
                waits = await _waiters_of(session, keys, queue, list(dict.fromkeys(waited_ids)))
                try:
                    replies = await session.commit(self._writes(now, ended, waits, lives))
                except MaxConnectionsError:
                    raise
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    raise _unknown_outcome() from exc
                if replies is not None:
                    _unless_wrong(replies)
                    return True
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {self.procs[0]}")

    def _jobs(self) -> list[tuple[Process, str | Failure | None]]:
        return [(p, end) for p, end in self.ending if p.job_id is not None]

    @staticmethod
    def _ends_job(process: Process, end: str | Failure | None) -> bool:
        """Whether this end records the job's outcome (not another attempt)."""
        if not isinstance(end, Failure):
            return True
        envelope = process.envelope
        return (
            envelope is None or end.final or envelope.header.attempt >= envelope.header.max_attempts
        )

    def _typed(self) -> list[tuple[str, str]]:
        """The keys that the failures' writes push to, with their types (step 1): a
        push failing inside MULTI would lose the task."""
        keys, queue = self.keys, self.queue
        typed: dict[str, str] = {}
        for process, end in self.ending:
            if not isinstance(end, Failure):
                continue
            envelope = process.envelope
            if self._ends_job(process, end):
                typed[keys.failed(queue)] = "list"
            elif envelope is not None and _wait_of(envelope.header, end) > 0:
                typed[keys.delayed(queue)] = "zset"
            elif envelope is not None:
                typed[keys.level(queue, envelope.header.priority)] = "list"
        return list(typed.items())

    def _writes(
        self,
        now: int,
        ended: set[str],
        waits: dict[str, list[str]],
        lives: dict[str | None, str | None],
    ) -> list[Wire]:
        """Steps 4-10: the writes of the transaction; ``ended`` are the processes of
        lives that ended meanwhile, ``lives`` the life tokens read in step 1, per job,
        for the ``done`` records."""
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
        records: list[str] = []  # of the done channel
        failed: list[str] = []  # of the failed list
        index: list[str | int] = []
        again: list[tuple[str, str]] = []  # (level, envelope) of attempts that follow now
        later: list[str | int] = []  # due, envelope of attempts that follow later
        for process, end in ending:
            if process.envelope is None:
                if isinstance(end, Failure):
                    why = escaped(end.error)
                    failed.append(failed_record(process.task, why, worker_id, trace=end.trace))
                else:
                    records.append(done_record(process.id, worker_id, process.task, end))
                continue
            header = process.envelope.header
            if process.id in ended:
                continue  # its life ended while it ran (cancelled): the outcome stays
            if isinstance(end, Failure) and not self._ends_job(process, end):
                writes += _next_attempt(keys, queue, process.envelope, end, now, again, later)
                continue
            result: str | None = None if isinstance(end, Failure) else end
            error = escaped(end.error) if isinstance(end, Failure) else None
            job_writes, (expiry, job_id) = job_end(
                keys,
                queue,
                header,
                now,
                result=result,
                error=error,
                waiters=waits.get(header.id),
            )
            writes += job_writes
            index += [expiry, job_id]
            if isinstance(end, Failure):
                failed.append(
                    failed_record(
                        process.task,
                        escaped(end.error),
                        worker_id,
                        trace=end.trace,
                        envelope=process.envelope,
                    )
                )
            records.append(
                done_record(
                    process.id,
                    worker_id,
                    process.envelope.payload,
                    result,
                    job_id=header.id,
                    error=error,
                    attempts=header.attempt,
                    life=lives.get(header.id),
                )
            )
        if failed:
            writes.append(("RPUSH", keys.failed(queue), *failed))
        writes += _attempt_pushes(keys, queue, again, later)
        if index:
            writes.append(("ZADD", keys.jobs(queue), *index))
            writes.append(trim_jobs(keys, queue, now))
        writes += [("PUBLISH", keys.done(queue), message) for message in done_messages(records)]
        return writes


def _wait_of(header: Header, failure: Failure) -> float:
    """Seconds before the attempt after a failed one: its ``delay``, else the backoff."""
    return failure.delay if failure.delay is not None else backoff_delay(header)


def _next_attempt(
    keys: Keys,
    queue: str,
    envelope: Envelope,
    failure: Failure,
    now: int,
    again: list[tuple[str, str]],
    later: list[str | int],
) -> list[Wire]:
    """The writes to a job's record for its next attempt (as `fail` writes them); its
    envelope goes to ``again`` (level, envelope: pushed now) or to ``later`` (due,
    envelope: to the delayed set), which the caller writes for the whole batch."""
    header = envelope.header
    job = keys.job(queue, header.id)
    following = wrap(header.next_attempt(), envelope.payload)
    fields: list[str | int] = [
        "env",
        following,
        "attempts",
        header.attempt,
        "error",
        escaped(failure.error),
    ]
    wait = _wait_of(header, failure)
    if wait <= 0:
        again.append((header.priority, following))
        return [
            ("HSET", job, *fields, "state", JobState.QUEUED.value),
            ("HDEL", job, "due", "progress", "note"),
        ]
    due = now + round(wait * 1000)
    later += [due, following]
    return [
        ("HSET", job, *fields, "state", JobState.DELAYED.value, "due", due),
        ("HDEL", job, "progress", "note"),
    ]


def _attempt_pushes(
    keys: Keys, queue: str, again: list[tuple[str, str]], later: list[str | int]
) -> list[Wire]:
    """The pushes of the next attempts that `_next_attempt` collected: ``again`` to the
    back of their levels with a ``work`` event, ``later`` to the delayed set with a
    ``delayed`` event of the earliest due time."""
    writes: list[Wire] = level_pushes(keys, queue, again) if again else []
    if later:
        writes.append(("ZADD", keys.delayed(queue), *later))
        earliest = min(int(due) for due in later[::2])
        writes.append(("PUBLISH", keys.events(queue), event(DUE_EVENT, str(earliest))))
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
            HSET j:<id> env <envelope'> state queued attempts <a> error <e>;
            HDEL j:<id> due progress note
         another attempt later: ZADD delayed <due> <envelope'>;
            HSET j:<id> env <envelope'> state delayed attempts <a> error <e> due <due>;
            HDEL j:<id> progress note;  PUBLISH events delayed:<due>
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
        failure = Failure(error, delay=delay)

        def again(pipe: Pipeline) -> None:
            now_pushed: list[tuple[str, str]] = []
            later: list[str | int] = []
            writes = _next_attempt(keys, queue, envelope, failure, now, now_pushed, later)
            for command in [*writes, *_attempt_pushes(keys, queue, now_pushed, later)]:
                pipe.execute_command(*command)

        if _wait_of(header, failure) <= 0:
            return Ending(((keys.level(queue, header.priority), "list"),), again)
        return Ending(((keys.delayed(queue), "zset"),), again)

    checks = [(keys.failed(queue), "list")]
    if known is None or envelope_of(known) is not None:
        checks += [(key, "list") for key in keys.levels(queue)] + [(keys.delayed(queue), "zset")]
    return await _end_process(r, keys, ref, plan, known=known, checks=checks)


def backoff_delay(header: Header) -> float:
    """Seconds before the attempt after ``header``'s, by its backoff."""
    initial, factor, maximum, jitter = header.backoff
    return Backoff(initial, factor, maximum, jitter).delay(header.attempt)
