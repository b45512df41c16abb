"""What several transitions write or read alike: events, the ``done`` records, the
pushes to a queue's levels, a job record's fields and the death counts."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio.client import Pipeline

from .._errors import InvalidProcessIdError, is_wrong_type, redis_boundary
from .._layout.envelope import Envelope, Header, unwrap
from .._layout.keys import Keys
from .._layout.levels import LEVELS
from .._layout.models import Process, readable
from .._layout.names import parse_process_id
from .._layout.state import ENDED, JobState
from .._redis.connections import Client as Client
from .._redis.replies import members, text
from .._redis.wire import Wire
from .commands import Command, _require, call, read, reads_checked


def stored(task: str) -> str | bytes:
    """A task read from Redis, as it goes back to Redis: its original bytes when they
    were not valid UTF-8 (so that no client's strict encoder meets the surrogates)."""
    return task if readable(task) else task.encode("utf-8", "surrogateescape")


def event(kind: str, message: str = "") -> str:
    """The wire form of an event on a queue's channel."""
    return f"{kind}:{message}"


def announce(keys: Keys, queue: str, level: str, count: int) -> Command:
    """The ``work`` event of ``count`` tasks pushed at ``level``: ``work:N`` for
    normal ones, which a worker may take without a look at the levels; a bare
    ``work:`` (a look) for the others, so that the worker reads which level holds
    them rather than take from the normal list."""
    return ("PUBLISH", keys.events(queue), event("work", str(count) if level == "normal" else ""))


DONE_FIELD_LIMIT = 65_536


"""Characters of a task or result that a ``done`` record carries: a message over
Redis's pub/sub output-buffer limit (32 MB by default) would disconnect every
listener, and the ``cancel`` and ``delete`` events behind it would be lost."""


_DONE_MESSAGE_LIMIT = 1 << 20  # characters of records one ``done`` message carries


def done_record(
    process_id: str | None,
    worker_id: str,
    task: str,
    result: str | None,
    *,
    job_id: str | None = None,
    error: str | None = None,
    attempts: int | None = None,
    life: str | None = None,
) -> str:
    """One finished process, as JSON; a ``done`` message is a JSON array of these. A
    task or result longer than `DONE_FIELD_LIMIT` is cut there, with ``"truncated":
    true`` (an error too). A job's record also has ``job_id`` (``task`` is its payload) and, when
    it ended failed, ``"status": "failed"`` and its ``error``; and, when the end read
    it, ``life``, the token of the life that ended (the record's ``life`` field): a
    waiter that read that life need not read the outcome again."""
    cut = (
        len(task) > DONE_FIELD_LIMIT
        or (result is not None and len(result) > DONE_FIELD_LIMIT)
        or (error is not None and len(error) > DONE_FIELD_LIMIT)
    )
    # As json.dumps would write the dict of these fields, at a third of its cost (one
    # record per finished task): strings through its own C quoting.
    record = (
        f'{{"process_id": {"null" if process_id is None else _quote(process_id)}, '
        f'"worker_id": {_quote(worker_id)}, '
        f'"task": {_quote(task[:DONE_FIELD_LIMIT])}, "result": {_json_str(result)}'
    )
    if job_id is not None:
        record += f', "job_id": {_quote(job_id)}, "status": '
        record += '"done"' if error is None else '"failed"'
        if attempts is not None:
            record += f', "attempts": {int(attempts)}'
        if error is not None:
            record += f', "error": {_quote(error[:DONE_FIELD_LIMIT])}'
        if life is not None:
            record += f', "life": {_quote(life)}'
    return record + (', "truncated": true}' if cut else "}")


_quote = json.encoder.encode_basestring_ascii


def _json_str(value: str | None) -> str:
    """A result cut at `DONE_FIELD_LIMIT`, or None, as JSON."""
    return "null" if value is None else _quote(value[:DONE_FIELD_LIMIT])


def done_messages(records: Sequence[str]) -> list[str]:
    """``done`` messages carrying the records, each at most about a megabyte."""
    messages: list[str] = []
    batch: list[str] = []
    size = 0
    for record in records:
        if batch and size + len(record) > _DONE_MESSAGE_LIMIT:
            messages.append(event("done", f"[{','.join(batch)}]"))
            batch, size = [], 0
        batch.append(record)
        size += len(record) + 1
    if batch:
        messages.append(event("done", f"[{','.join(batch)}]"))
    return messages


def _push_levels(pipe: Pipeline, keys: Keys, queue: str, items: Sequence[tuple[str, Any]]) -> None:
    """Queue `level_pushes` on a transaction's pipeline."""
    for command in level_pushes(keys, queue, items):
        pipe.execute_command(*command)


def level_pushes(keys: Keys, queue: str, items: Sequence[tuple[str, Any]]) -> list[Wire]:
    """The RPUSH of each (level, stored task) to the back of its level's list, in
    order within a level, and one ``work`` event (``work:N`` when all are normal)."""
    commands: list[Wire] = []
    for level in LEVELS:
        tasks = [task for at, task in items if at == level]
        if tasks:
            commands.append(("RPUSH", keys.level(queue, level), *tasks))
    mixed = any(level != "normal" for level, _ in items)
    commands.append(announce(keys, queue, "high" if mixed else "normal", len(items)))
    return commands


@redis_boundary
async def publish(r: Client, keys: Keys, queue: str, kind: str, message: str) -> None:
    """Announce an event on a queue's channel.

    1. PUBLISH events <kind>:<message>
    """
    await call(r, "PUBLISH", keys.events(queue), event(kind, message))


@redis_boundary
async def request_work(r: Client, keys: Keys, queue: str) -> int:
    """Publish ``work`` with the number of waiting tasks, if there are any.

    1. LLEN high;  LLEN tasks;  LLEN low
    2. PUBLISH events work:<count>   (if count > 0; a bare work: if not all are normal)
    """
    lengths = await reads_checked(r, [("LLEN", level) for level in keys.levels(queue)])
    high, normal, low = (int(n) for n in lengths)
    if high or normal or low:
        await publish(r, keys, queue, "work", "" if high or low else str(normal))
    return high + normal + low


DUE_EVENT = "delayed"


"""The event announcing a due time (``delayed:<unix ms>``): workers of the queue wake
then to promote what is due."""


def live_score(score: Any) -> bool:
    """Whether a ``jobs`` score says the job lives (+inf)."""
    if score is None or isinstance(score, Exception):
        return False
    try:
        return float(text(score) if isinstance(score, bytes | str) else score) == float("inf")
    except (TypeError, ValueError):
        return False


def level_of_stored(task: str) -> str:
    """The priority level a stored task goes back to: its envelope's, else normal."""
    envelope = envelope_of(task)
    return "normal" if envelope is None else envelope.header.priority


def _job_id(task: str) -> str | None:
    envelope = envelope_of(task)
    return None if envelope is None else envelope.header.id


def job_label(task: str) -> str:
    """A job's id, or for anything else in a delayed set, its first characters."""
    job_id = _job_id(task)
    return job_id if job_id is not None else repr(task[:40])


CANCELLED = "cancelled"


"""The error of a cancelled job."""


async def _still_queued(pipe: Pipeline, tasks: str, envelope: Any) -> bool:
    """Whether ``envelope`` waits in the list ``tasks``, and will until EXEC: once it
    is found, the list is watched and looked at again, so that a dequeue (an attempt
    that counts) is seen whether it ran before the watch or runs before EXEC."""
    if await read(pipe, "LPOS", tasks, envelope) is None:
        return False
    await pipe.watch(tasks)
    return await read(pipe, "LPOS", tasks, envelope) is not None


def as_process(pid: str, task: str, queue: str) -> Process:
    """A process of a stored task: a job's payload with its envelope, or the plain
    task (also an unreadable envelope, which no handler is given: see `Worqr._take`)."""
    envelope = envelope_of(task)
    if envelope is None:
        return Process(pid, task, queue)
    header = envelope.header
    return Process(
        pid,
        envelope.payload,
        queue,
        job_id=header.id,
        attempt=header.attempt,
        max_attempts=header.max_attempts,
        envelope=envelope,
    )


def local_ms(now_ms: int | None) -> int:
    """``now_ms`` (server time, from the caller's clock estimate), or this host's
    Unix ms when the caller gave none (outcome times only: due times always come
    from the server's clock)."""
    return round(time.time() * 1000) if now_ms is None else now_ms


def envelope_of(task: str) -> Envelope | None:
    """A stored task's envelope; None for a plain task or an unreadable envelope."""
    try:
        return unwrap(task)
    except ValueError:
        return None


def _says_ended(reply: Any, envelope: str) -> bool:
    """Whether an ``HMGET j:<id> state env`` reply says that the life of the job whose
    attempt carries ``envelope`` ended: its record ended (cancelled while the attempt
    ran), or holds another envelope (the id was submitted anew since). A missing or
    unreadable record says nothing (the check's to report)."""
    if is_wrong_type(reply) or not reply or reply[0] is None:
        return False
    if text(reply[0]) in ENDED:
        return True
    return reply[1] is not None and text(reply[1]) != envelope


WAITED_KEEP_MS = 3_600_000


"""How long at least the outcome of a job that others waited for stays readable (ms):
the release of its dependents reads it, and may come late when no worker of the
queue was running as it ended."""


RELEASED_EVENT = "released"


"""The event telling a queue's workers that waiting jobs were handed to the next
release (``released:``): one of them releases them."""


def waited(reply: Any) -> bool:
    """Whether an ``HMGET j:<id> state env waited`` reply says that other jobs wait for
    the job's current life."""
    return not is_wrong_type(reply) and len(reply) > 2 and reply[2] is not None


def waiters_of(look: Any, after: Any) -> list[str] | None:
    """The jobs a job's end hands on: the members of its ``after`` set (an ``SMEMBERS``
    reply read under WATCH) when its ``LOOK`` reply says it is waited for, else None."""
    return members(after) if waited(look) else None


def waited_keys(keys: Keys, queue: str, job_id: str) -> tuple[tuple[str, str], ...]:
    """The keys the end of a waited job writes, with their types: a write of one of
    them failing inside MULTI would lose the waiting jobs."""
    return ((keys.released(queue), "set"), (keys.after(queue, job_id), "set"))


LOOK = ("state", "env", "waited")


"""The fields of a job's record an end reads under WATCH: has its life ended (see
`_says_ended`), and does another job wait for it (`waited`)."""


LOOK_LIFE = (*LOOK, "life")
"""`LOOK` and which life it is, for a batched end: its ``done`` record names that life
(see `done_record`)."""


def life_of(reply: Any) -> str | None:
    """The life token in a `LOOK_LIFE` reply (None: none, or not a readable reply)."""
    if is_wrong_type(reply) or not isinstance(reply, list) or len(reply) < 4 or reply[3] is None:
        return None
    return text(reply[3])


def _trim_jobs(pipe: Pipeline, keys: Keys, queue: str, now_ms: int) -> None:
    """Queue the trim of the job index: entries of outcomes expired by ``now_ms``
    (once per transaction that ends jobs).

      ZREMRANGEBYSCORE jobs -inf (<now>
    """
    pipe.execute_command(*trim_jobs(keys, queue, now_ms))


def trim_jobs(keys: Keys, queue: str, now_ms: int) -> Command:
    """The trim of the job index, as a command (see `_trim_jobs`)."""
    return ("ZREMRANGEBYSCORE", keys.jobs(queue), "-inf", f"({now_ms}")


def failed_record(
    task: str,
    error: str,
    worker_id: str,
    *,
    trace: str = "",
    envelope: Envelope | None = None,
) -> str:
    """A failed-list record: for a job, ``task`` is its payload and the record also has
    ``job_id``, ``attempts`` and ``envelope`` (to submit it anew)."""
    record: dict[str, Any] = {
        "task": task if envelope is None else envelope.payload,
        "error": error,
        "worker_id": worker_id,
        "failed_at": time.time(),
    }
    if trace:
        record["traceback"] = trace
    if envelope is not None:
        record["job_id"] = envelope.header.id
        record["attempts"] = envelope.header.attempt
        record["envelope"] = envelope.raw
    return json.dumps(record)


async def _ended(pipe: Pipeline, keys: Keys, queue: str, envelope: Envelope) -> bool:
    """In a WATCHed pipeline: watch the job's record too, and tell whether the life
    of ``envelope`` ended (see `_says_ended`): then the attempt's end must neither
    overwrite the outcome nor put the job anywhere again."""
    record = keys.job(queue, envelope.header.id)
    await pipe.watch(record)
    return _says_ended(await read(pipe, "HMGET", record, "state", "env"), envelope.raw)


def _count(raw: Any) -> int:
    """A stored counter; 0 for one that is missing or not a number."""
    try:
        return max(0, int(raw or 0))
    except (TypeError, ValueError):
        return 0


def _token(pid: str) -> str:
    """The sort key of a process id (its dequeue order); "" for an id worqr did not
    give out, which sorts first."""
    try:
        return parse_process_id(pid).token
    except InvalidProcessIdError:
        return ""


def digest(task: str) -> str:
    """The field under which a task's death count is kept (tasks may be megabytes)."""
    return hashlib.sha1(task.encode("utf-8", "surrogateescape")).hexdigest()


def death_field(task: str) -> str:
    """The deaths field of a stored task: ``job:<id>`` for a job (its envelopes differ
    from attempt to attempt, and identical payloads are different jobs), else its
    `digest`."""
    envelope = envelope_of(task)
    return digest(task) if envelope is None else f"job:{envelope.header.id}"


async def _life_ended(pipe: Pipeline, keys: Keys, queue: str, task: str) -> bool:
    """In a WATCHed pipeline: whether ``task`` is the envelope of a job whose life ended
    (its record watched from now on); False for a plain task."""
    envelope = envelope_of(task)
    if envelope is None:
        return False
    record = keys.job(queue, envelope.header.id)
    await pipe.watch(record)
    return _says_ended(await read(pipe, "HMGET", record, "state", "env"), envelope.raw)


def _end_job(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    header: Header,
    now_ms: int,
    *,
    result: str | None = None,
    error: str | None = None,
    attempts: int | None = None,
    waiters: Sequence[str] | None = None,
) -> None:
    """Queue the writes of `job_end` on ``pipe``, its index entry with them."""
    writes, (score, job_id) = job_end(
        keys, queue, header, now_ms, result=result, error=error, attempts=attempts, waiters=waiters
    )
    for command in writes:
        pipe.execute_command(*command)
    pipe.execute_command("ZADD", keys.jobs(queue), score, job_id)


def job_end(
    keys: Keys,
    queue: str,
    header: Header,
    now_ms: int,
    *,
    result: str | None = None,
    error: str | None = None,
    attempts: int | None = None,
    waiters: Sequence[str] | None = None,
) -> tuple[list[Command], tuple[int, str]]:
    """The writes that record a job's outcome (done, or failed with ``error``) and let
    it expire after its result TTL, and its entry in the job index (score, id: the
    caller adds it, several ends' in one ZADD). A job that others wait for (see
    `waited`) hands ``waiters`` (the members of its ``after`` set, read under WATCH)
    to the next release, and keeps its outcome for them at least `WAITED_KEEP_MS`;
    the caller made sure that ``released`` and ``after:<id>`` are sets or absent
    (`waited_keys`).

      HSET j:<id> state done|failed attempts <n> finished <now> [result <r>] [error <e>]
      HDEL j:<id> env due after
      PEXPIRE j:<id> <ttl>
      (waited) SADD released <waiter>...;  DEL after:<id>;  PUBLISH events released:
      and the entry: ZADD jobs <now + ttl> <id>
    (and, once per transaction, `_trim_jobs`)
    """
    record = keys.job(queue, header.id)
    fields: list[str | int] = [
        "state",
        JobState.DONE.value if error is None else JobState.FAILED.value,
        "attempts",
        header.attempt if attempts is None else attempts,
        "finished",
        now_ms,
    ]
    if result is not None:
        fields += ["result", result]
    if error is not None:
        fields += ["error", error]
    waited = waiters is not None
    ttl = max(header.result_ttl_ms, WAITED_KEEP_MS) if waited else header.result_ttl_ms
    writes: list[Command] = [
        ("HSET", record, *fields),
        ("HDEL", record, "env", "due", "after"),
        ("PEXPIRE", record, ttl),
    ]
    if waiters is not None:
        writes.append(("DEL", keys.after(queue, header.id)))
        if waiters:
            writes.append(("SADD", keys.released(queue), *waiters))
            writes.append(("PUBLISH", keys.events(queue), event(RELEASED_EVENT)))
    return writes, (now_ms + ttl, header.id)


async def _waiters(pipe: Pipeline, keys: Keys, queue: str, job_id: str) -> list[str]:
    """In a WATCHed pipeline, for the end of a waited job that did not read them with
    its fence: check the types of the keys the end writes, watch its ``after`` set and
    return its members."""
    for key, kind in waited_keys(keys, queue, job_id):
        await _require(pipe, key, kind)
    after = keys.after(queue, job_id)
    await pipe.watch(after)
    return members(await call(pipe, "SMEMBERS", after))


def new_life() -> str:
    """A token that tells the lives of one job id apart (``life`` in `Keys.job`). One
    per transaction that starts lives is enough: none starts two lives of one id."""
    return secrets.token_hex(8)


def _record_job(
    pipe: Pipeline,
    keys: Keys,
    queue: str,
    env: Envelope,
    state: str,
    due: int | None = None,
    *,
    life: str,
) -> None:
    """Queue the writes of `record_job` on ``pipe``."""
    for command in record_job(keys, queue, env, state, due, life=life):
        pipe.execute_command(*command)


def record_job(
    keys: Keys, queue: str, env: Envelope, state: str, due: int | None = None, *, life: str
) -> list[Command]:
    """The writes of a job's record at the start of a life (submit, retry of a failed
    job): a fresh hash, live in the index.

      DEL j:<id>;  HSET j:<id> env <envelope> state <state> attempts 0 max <m>
      enqueued <e> life <life> [due <due>] [fn <function>];  ZADD jobs +inf <id>
    """
    header = env.header
    record = keys.job(queue, header.id)
    fields: list[str | int] = [
        "env",
        env.raw,
        "state",
        state,
        "attempts",
        header.attempt - 1,
        "max",
        header.max_attempts,
        "enqueued",
        header.enqueued_at,
        "life",
        life,
    ]
    if due is not None:
        fields += ["due", due]
    if header.function is not None:
        fields += ["fn", header.function]
    return [
        ("DEL", record),
        ("HSET", record, *fields),
        ("ZADD", keys.jobs(queue), "+inf", header.id),
    ]
