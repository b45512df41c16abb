"""The transactions of dependencies between jobs (see `_layout.deps`): submitting jobs that
wait, and releasing waiting jobs whose dependencies ended.

A waiting job is in no list: its envelope stays in its record (state ``waiting``),
and its id in ``after:<id>`` of each dependency whose life goes on, whose record says
``waited``. The end of such a life moves the members of its ``after`` set to
``released`` in the end's own transaction and publishes ``released:``
(`_ops.writes._end_job`); a worker of the queue then runs `release`. A release judges each
job from the records alone, so a job handed to it early, twice, or by a stale entry
is judged right all the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .._errors import (
    CorruptDataError,
    DependencyError,
    DuplicateTaskError,
    is_wrong_type,
    redis_boundary,
)
from .._layout.deps import FIELDS, MAX_DEPENDENCIES, Dependency, Verdict, decode, encode, judge
from .._layout.envelope import Envelope, Header
from .._layout.keys import Keys
from .._layout.state import JobState
from .._redis.connections import Client, on_slot, pinned
from .._redis.replies import members, server_ms, text
from .commands import (
    Command,
    _atomic,
    _beside,
    _corrupt,
    _optimistic,
    _raise_wrong,
    _register_after,
    _wait,
    reads,
    reads_checked,
)
from .submit import Submission, check_ids, submit_writes
from .writes import (
    DUE_EVENT,
    RELEASED_EVENT,
    _end_job,
    _record_job,
    _trim_jobs,
    announce,
    done_record,
    envelope_of,
    event,
    live_score,
    new_life,
)


@redis_boundary
async def submit_after(
    r: Client,
    keys: Keys,
    queue: str,
    jobs: Sequence[Submission],
    after: Sequence[str],
    *,
    wait: tuple[int, int] | None = None,
) -> int | None:
    """Submit jobs that wait for the jobs ``after`` (ids in the same queue) to end done;
    with ``wait`` as in `_ops.submit`. A dependency that ended done already is not
    waited for; if all did, the jobs are submitted as by `_ops.submit`. If one of them
    ended failed, the jobs are recorded failed at once, with an error naming it.
    `DependencyError` (nothing written) for an id with no record, `ValueError` for a
    job's own id, `DuplicateTaskError` for a job id that is live.

    Keys: j:<id>... (HASH), jobs (ZSET), j:<dependency>... (HASH),
    after:<dependency>... (SET), and those of `_ops.submit`.
      1. WATCH j:<id>... j:<dependency>...
         ZMSCORE jobs <id>...                 -> any +inf: UNWATCH, DuplicateTaskError
         HMGET j:<dependency> state life error ...   -> none: DependencyError
         TYPE <level>;  TYPE delayed;  TYPE after:<dependency>...   -> wrong: raise
      2. MULTI
      3. every dependency done: the writes of `_ops.submit` (steps 3-6)
         one failed:   per job: the record (state waiting), then the writes of
                       `_end_job` with the error;  PUBLISH done done:[...]
         else per job: DEL j:<id>;  HSET j:<id> env .. state waiting attempts 0 max ..
                       enqueued .. life .. [due ..];  HSET j:<id> after <{id: life}>;
                       ZADD jobs +inf <id>
                       per live dependency: SADD after:<dependency> <id>...;
                       HSETNX j:<dependency> waited 1  (once set, a no-op: the
                       WATCHes on the record, its own end's among them, hold)
      4. SADD queues queue                     (one server: inside; a Cluster: after)
      5. EXEC                                  -> nil: back to 1
    """
    ids = check_ids(jobs)
    own = [job_id for job_id in ids if job_id in after]
    if own:
        raise ValueError(f"job {own[0]!r} cannot wait for itself")
    pushed_to = keys.level(queue, jobs[0].envelope.header.priority)
    registers = isinstance(r, Redis)
    life = new_life()
    waits_on = [keys.job(queue, job_id) for job_id in after]
    kinds = {pushed_to: "list", keys.delayed(queue): "zset"}  # else a set (after:<id>)

    async def body(pipe: Pipeline) -> None:
        looks: list[Command] = [("HMGET", record, *FIELDS) for record in waits_on]
        checks = [pushed_to, keys.delayed(queue), *(keys.after(queue, d) for d in after)]
        scores, *replies = await _beside(
            pipe, [("ZMSCORE", keys.jobs(queue), *ids), *looks, *(("TYPE", k) for k in checks)]
        )
        _raise_wrong([("ZMSCORE", keys.jobs(queue)), *looks], [scores, *replies[: len(after)]])
        live = [job_id for job_id, score in zip(ids, scores, strict=True) if live_score(score)]
        if live:
            raise DuplicateTaskError(
                f"job {live[0]!r} is already queued, delayed, running or waiting"
            )
        found = {d: _dependency(reply) for d, reply in zip(after, replies, strict=False)}
        unknown = [d for d in after if found[d].state is None]
        if unknown:
            named = ", ".join(repr(d) for d in unknown[:10]) + (", ..." if unknown[10:] else "")
            raise DependencyError(
                f"no job {named} in {queue!r} to wait for (never submitted, deleted, or"
                " its outcome expired; a job waits only for jobs of its own queue)"
            )
        verdict = judge({d: found[d].life for d in after}, found)
        types = dict(zip(checks, (text(t) for t in replies[len(after) :]), strict=True))
        needs = [keys.after(queue, d) for d in verdict.pending] if verdict.failed is None else []
        if verdict.failed is None and not verdict.pending:
            needs = [pushed_to if job.due_ms is None else keys.delayed(queue) for job in jobs]
        for key in needs:
            if types[key] not in (kinds.get(key, "set"), "none"):
                raise _corrupt(key, types[key])
        pipe.multi()
        _writes(pipe, keys, queue, jobs, verdict, life)
        if registers:
            pipe.execute_command("SADD", keys.queues, queue)

    async def pushed(client: Client) -> None:
        await _optimistic(client, [*(keys.job(queue, job_id) for job_id in ids), *waits_on], body)

    if wait is None:
        await _register_after(r, keys, queue, pushed(r), registered=registers)
        return None

    async def waited(node: Redis, wait: tuple[int, int] = wait) -> int:
        async with pinned(node) as one:  # WAIT counts the writes of its own connection
            await pushed(one.client)
            return await _wait(one, wait)

    return await _register_after(
        r, keys, queue, on_slot(r, keys.tasks(queue), waited), registered=registers
    )


def _dependency(reply: Any) -> Dependency:
    """A dependency's `FIELDS` as read (a record of the wrong type reads as one whose
    state no one knows: unreadable)."""
    if is_wrong_type(reply):
        return Dependency("?", "", "")
    if not reply:
        return Dependency.of(None)
    return Dependency.of([None if part is None else text(part) for part in reply])


def _writes(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    jobs: Sequence[Submission],
    verdict: Verdict,
    life: str,
) -> None:
    """Queue the writes of `submit_after` for its verdict."""
    if verdict.failed is None and not verdict.pending:
        submit_writes(pipe, keys, queue, jobs, life=life)
        return
    for job in jobs:
        _record_job(pipe, keys, queue, job.envelope, JobState.WAITING.value, job.due_ms, life=life)
    if verdict.failed is not None:
        now = int(jobs[0].envelope.header.enqueued_at)
        for job in jobs:
            _fail(pipe, keys, queue, job.envelope.header, job.envelope.payload, now, verdict.failed)
        _trim_jobs(pipe, keys, queue, now)
        return
    ids = [job.envelope.header.id for job in jobs]
    for job_id in ids:
        pipe.execute_command("HSET", keys.job(queue, job_id), "after", encode(verdict.pending))
    for dependency in verdict.pending:
        pipe.execute_command("SADD", keys.after(queue, dependency), *ids)
        pipe.execute_command("HSETNX", keys.job(queue, dependency), "waited", 1)


def _fail(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    header: Header,
    payload: str,
    now_ms: int,
    error: str,
    *,
    waiters: Sequence[str] | None = None,
) -> None:
    """Queue the end of a waiting job that will never run: failed with ``error``, no
    attempt made, no failed-list record (its dependency's is the one to look at)."""
    _end_job(pipe, keys, queue, header, now_ms, error=error, attempts=0, waiters=waiters)
    notice = done_record(None, "", payload, None, job_id=header.id, error=error, attempts=0)
    pipe.execute_command("PUBLISH", keys.done(queue), event("done", f"[{notice}]"))


_RELEASE_BATCH = 100  # waiting jobs one release transaction judges at most
_DEPENDENCIES_READ = 1000  # and the dependencies it reads at most (one job's, if more)


@dataclass(frozen=True, slots=True)
class _Waiting:
    """A waiting job as read by a release."""

    id: str
    envelope: Envelope | None
    waits: dict[str, str] | None
    due_ms: int | None
    waited: bool


@redis_boundary
async def release(r: Client, keys: Keys, queue: str) -> int:
    """Judge the jobs in ``released`` (see `_layout.deps.judge`), at most `_RELEASE_BATCH` a
    transaction, until none is left; return how many were judged. A job whose
    dependencies all ended done goes to the back of its level (or to the delayed set,
    if it is not due yet); one with a failed dependency, or whose dependency's outcome
    can no longer be known, ends failed; one whose dependencies go on waits again
    in their ``after`` sets. An id that names no waiting job is dropped.

    Every record read is watched, so it is safe for every worker of the queue to
    release at once, and against the ends of the dependencies meanwhile; ``released``
    is not watched (releases of other ids, and the ends that add to it, would abort
    this one for nothing): an id is judged from its record, whenever it was added.
      1. SRANDMEMBER released 100                        -> none: done
      2. WATCH j:<id>...;  HMGET j:<id> state env after due waited ...
      3. WATCH j:<dependency>... after:<id>...;  TIME;
         HMGET j:<dependency> state life error ...;  SMEMBERS after:<id> ...;
         TYPE high tasks low delayed after:<dependency>... after:<id>...
                                                          -> wrong: UNWATCH, raise
      4. MULTI
      5. per job judged: SREM released <id>, and
         (waits on, first)  SADD after:<dependency> <id>;  HSETNX j:<dependency> waited 1
                            HSET j:<id> after <{id: life} of those that go on>
         (ready)            RPUSH <level> <env>;  HSET j:<id> state queued;
                            HDEL j:<id> after due;  PUBLISH events work:1
                            (not due yet: ZADD delayed <due> <env>;  HSET j:<id> state
                            delayed;  HDEL j:<id> after;  PUBLISH events delayed:<due>)
         (failed)           the writes of `_end_job` with the error (which hand its
                            own dependents to the next round);  PUBLISH done ...
      6. EXEC                                             -> nil: back to 2
      7. SADD queues queue                                (if any was queued)
    """
    released = keys.released(queue)
    total, queued = 0, False

    async def body(pipe: Pipeline, ids: list[str]) -> tuple[int, bool]:
        fields = ("state", "env", "after", "due", "waited")
        records = await _beside(pipe, [("HMGET", keys.job(queue, i), *fields) for i in ids])
        judged: list[str] = []
        waiting: list[_Waiting] = []
        reads_left = _DEPENDENCIES_READ
        for job_id, reply in zip(ids, records, strict=True):
            w = _waiting(job_id, reply)
            if w is not None:
                cost = len(w.waits or {}) if _readable(w) else 0
                if waiting and cost > reads_left:
                    continue  # the next round's
                reads_left -= cost
                waiting.append(w)
            judged.append(job_id)
        deps = sorted({d for w in waiting if _readable(w) for d in w.waits or {}})
        afters = [keys.after(queue, w.id) for w in waiting]  # a failed one hands these on
        if deps or afters:
            await pipe.watch(*(keys.job(queue, d) for d in deps), *afters)
        layout = [(key, "list") for key in keys.levels(queue)] + [(keys.delayed(queue), "zset")]
        layout += [(keys.after(queue, i), "set") for i in [*deps, *(w.id for w in waiting)]]
        clock, *replies = await _beside(
            pipe,
            [
                ("TIME",),
                *(("HMGET", keys.job(queue, d), *FIELDS) for d in deps),
                *(("SMEMBERS", after) for after in afters),
                *(("TYPE", key) for key, _ in layout),
            ],
        )
        now = server_ms(clock)
        found = {d: _dependency(reply) for d, reply in zip(deps, replies, strict=False)}
        handed = {
            w.id: members(reply)
            for w, reply in zip(waiting, replies[len(deps) : len(deps) + len(afters)], strict=True)
        }
        wrong = {
            key: text(reply)
            for (key, kind), reply in zip(layout, replies[len(deps) + len(afters) :], strict=True)
            if text(reply) not in (kind, "none")
        }
        verdicts = {w.id: _verdict(w, found) for w in waiting}
        waited_on: dict[str, list[str]] = {}  # a job -> those of this batch that wait on it
        for job_id, v in verdicts.items():
            for d in v.pending if v.failed is None else ():
                waited_on.setdefault(d, []).append(job_id)
        # A job whose writes would meet a key of the wrong type stays for later (a
        # failing write inside MULTI would lose it); the others go on.
        blocked = {
            w.id
            for w in waiting
            if wrong.keys() & _writes_to(keys, queue, w, verdicts[w.id], now, waited_on)
        }
        if blocked:
            waiting = [w for w in waiting if w.id not in blocked]
            judged = [job_id for job_id in judged if job_id not in blocked]
            if not judged:  # every one stays: the caller decides (see below)
                await pipe.reset()
                return 0, False
        pipe.multi()
        pipe.execute_command("SREM", released, *judged)
        # Jobs that wait on go first: a dependency ending in this same transaction
        # then hands them to the next round.
        for w in sorted(waiting, key=lambda w: not verdicts[w.id].pending):
            verdict = verdicts[w.id]
            if verdict.failed is not None:
                waiters = None
                if w.waited or w.id in waited_on:  # those of this batch are written first
                    waiters = sorted({*handed[w.id], *waited_on.get(w.id, ())})
                _fail_waiting(pipe, keys, queue, w, now, verdict.failed, waiters)
            elif verdict.pending:
                _wait_again(pipe, keys, queue, w.id, verdict.pending)
            elif w.envelope is not None:
                _ready(pipe, keys, queue, w.envelope, w.due_ms, now)
        if any(v.failed is not None for v in verdicts.values()):
            _trim_jobs(pipe, keys, queue, now)
        ready = any(v.failed is None and not v.pending for v in verdicts.values())
        return len(judged), ready

    while True:  # until none is left: a job failed here hands its own dependents on
        ids = members((await reads_checked(r, [("SRANDMEMBER", released, _RELEASE_BATCH)]))[0])
        if not ids:
            break
        watch = [keys.job(queue, job_id) for job_id in ids]
        (handled, ready), _ = await _optimistic(r, watch, functools.partial(body, ids=ids))
        if not handled:  # all left are blocked by a key of the wrong type (check's)
            if total:
                break
            raise CorruptDataError(
                f"the waiting jobs {', '.join(map(repr, ids[:3]))} of {queue!r} cannot be"
                " released: a key they go to is of the wrong type (see check())"
            )
        total += handled
        queued = queued or ready
    if queued:
        await reads(r, [("SADD", keys.queues, queue)])
    return total


def _waiting(job_id: str, reply: Any) -> _Waiting | None:
    """The waiting job of an ``HMGET j:<id> state env after due waited`` reply; None
    for a record that is not waiting (ended, released meanwhile, gone, unreadable)."""
    if is_wrong_type(reply) or not reply or reply[0] is None:
        return None
    if text(reply[0]) != JobState.WAITING.value:
        return None
    raw, after, due, waited = (None if part is None else text(part) for part in reply[1:])
    return _Waiting(
        job_id,
        None if raw is None else envelope_of(raw),
        decode(after),
        int(due) if due is not None and due.isdigit() else None,
        waited is not None,
    )


def _writes_to(
    keys: Keys,
    queue: str,
    w: _Waiting,
    verdict: Verdict,
    now: int,
    waited_on: dict[str, list[str]],
) -> set[str]:
    """The keys, among those whose types a release checks, that judging ``w`` writes."""
    if verdict.failed is not None:
        return {keys.after(queue, w.id)} if w.waited or w.id in waited_on else set()
    if verdict.pending:
        return {keys.after(queue, d) for d in verdict.pending}
    if w.due_ms is not None and w.due_ms > now:
        return {keys.delayed(queue)}
    return {keys.level(queue, w.envelope.header.priority if w.envelope else "normal")}


def _readable(w: _Waiting) -> bool:
    """Whether a waiting job's dependencies are to be read (not for one whose list is
    over the limit: it fails unread)."""
    return w.envelope is not None and len(w.waits or {}) <= MAX_DEPENDENCIES


def _verdict(w: _Waiting, found: dict[str, Dependency]) -> Verdict:
    if w.envelope is None:
        return Verdict("its envelope is unreadable", {})
    if w.waits is None:
        return Verdict("its list of dependencies is unreadable", {})
    if len(w.waits) > MAX_DEPENDENCIES:
        return Verdict(f"its list of dependencies is longer than {MAX_DEPENDENCIES}", {})
    return judge(w.waits, found)


def _fail_waiting(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    w: _Waiting,
    now: int,
    error: str,
    waiters: list[str] | None,
) -> None:
    header = (
        w.envelope.header
        if w.envelope is not None
        else Header(w.id, 1, 1, (1.0, 2.0, 300.0, True), None, 86400.0, 0)
    )
    payload = "" if w.envelope is None else w.envelope.payload
    _fail(pipe, keys, queue, header, payload, now, error, waiters=waiters)


def _wait_again(
    pipe: Pipeline, keys: Keys, queue: str, job_id: str, pending: dict[str, str]
) -> None:
    for dependency in pending:
        pipe.execute_command("SADD", keys.after(queue, dependency), job_id)
        pipe.execute_command("HSETNX", keys.job(queue, dependency), "waited", 1)
    pipe.execute_command("HSET", keys.job(queue, job_id), "after", encode(pending))


def _ready(
    pipe: Pipeline, keys: Keys, queue: str, envelope: Envelope, due_ms: int | None, now: int
) -> None:
    record = keys.job(queue, envelope.header.id)
    if due_ms is not None and due_ms > now:
        pipe.execute_command("ZADD", keys.delayed(queue), due_ms, envelope.raw)
        pipe.execute_command("HSET", record, "state", JobState.DELAYED.value)
        pipe.execute_command("HDEL", record, "after")
        pipe.execute_command("PUBLISH", keys.events(queue), event(DUE_EVENT, str(due_ms)))
        return
    level = envelope.header.priority
    pipe.execute_command("RPUSH", keys.level(queue, level), envelope.raw)
    pipe.execute_command("HSET", record, "state", JobState.QUEUED.value)
    pipe.execute_command("HDEL", record, "after", "due")
    pipe.execute_command(*announce(keys, queue, level, 1))


@redis_boundary
async def hand_to_release(r: Client, keys: Keys, queue: str, job_id: str) -> None:
    """Hand a waiting job to the next release (the repair of ``stuck-waiting``): the
    release judges it from the records, so this is right whatever it waits for.

    1. MULTI;  SADD released <id>;  PUBLISH events released:;  EXEC
    """
    await _atomic(
        r,
        keys.tasks(queue),
        [
            ("SADD", keys.released(queue), job_id),
            ("PUBLISH", keys.events(queue), event(RELEASED_EVENT)),
        ],
    )
