"""Inspection: read-only views of queues, processes, workers and job records, and
the prefix's protocol version."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import Pipeline

from .._errors import CorruptDataError, redis_boundary
from .._layout.flow import Flow, read_flow
from .._layout.jobs import fraction_of
from .._layout.keys import Keys
from .._layout.models import Process, WorkerInfo
from .._layout.state import JobState
from .._redis.connections import Client as Client
from .._redis.replies import fields_of, members, text
from .commands import Command, _optimistic, call, read, reads
from .writes import _count, _token, as_process, level_of_stored


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job's record as read (see `Keys.job`), with where its envelope was found."""

    fields: dict[str, str]
    queued: bool
    """The live envelope is in the queue's task list (else, if live and not
    delayed, a worker runs it); True when it was not looked for."""


@redis_boundary
async def job_record(
    r: Client, keys: Keys, queue: str, job_id: str, *, locate: bool = True
) -> JobRecord | None:
    """A job's record, None if there is none; with ``locate``, a live job's envelope
    is looked for in the task list (queued, or running).

    1. HGETALL j:<id>
    2. LPOS tasks <envelope>                     (``locate``, state queued: O(position))
    """
    raw = await read(r, "HGETALL", keys.job(queue, job_id))
    if not raw:
        return None
    fields = fields_of(raw)
    queued = True
    if locate and fields.get("state") == JobState.QUEUED.value and "env" in fields:
        level = level_of_stored(fields["env"])
        queued = await read(r, "LPOS", keys.level(queue, level), fields["env"]) is not None
    return JobRecord(fields, queued)


@redis_boundary
async def processes(r: Client, keys: Keys, queues: Sequence[str] | None = None) -> list[Process]:
    """Every process of the given queues (default: every registered queue), oldest first.

    A read-only walk, O(queues + workers + processes):
      1. SMEMBERS queues               (without ``queues``)
      2. SMEMBERS holders              (per queue, one round trip)
      3. SMEMBERS held:<w>             (per holder, one round trip)
      4. LINDEX p:<id> 0               (per process, one round trip)
    """
    if queues is None:
        queues = members(await read(r, "SMEMBERS", keys.queues))
    # Wrong-typed keys read as empty and unparsable ids are skipped: check reports both.
    holders = await reads(r, [("SMEMBERS", keys.holders(queue)) for queue in queues])
    pairs = [(q, w) for q, ws in zip(queues, holders, strict=True) for w in members(ws)]
    held = await reads(r, [("SMEMBERS", keys.held(q, w)) for q, w in pairs])
    candidates = sorted(
        (
            (token, queue, pid)
            for (queue, _), pids in zip(pairs, held, strict=True)
            for pid in members(pids)
            if (token := _token(pid))
        ),
    )
    tasks = await reads(r, [("LINDEX", keys.process(q, pid), 0) for _, q, pid in candidates])
    return [
        as_process(pid, text(task), queue)
        for (_, queue, pid), task in zip(candidates, tasks, strict=True)
        if isinstance(task, str | bytes)
    ]


@redis_boundary
async def progress(
    r: Client, keys: Keys, jobs: Sequence[tuple[str, str]]
) -> list[tuple[float, str | None] | None]:
    """The progress last reported on each job's record (queue, id): (fraction, note),
    or None where none was (or the record is gone or wrong-typed).

      1. HMGET j:<id> progress note          (per job, pipelined: one round trip)
    """
    replies = await reads(
        r, [("HMGET", keys.job(queue, job_id), "progress", "note") for queue, job_id in jobs]
    )
    found: list[tuple[float, str | None] | None] = []
    for reply in replies:  # a wrong-typed record's error in place: no progress
        fraction = fraction_of(reply[0]) if isinstance(reply, list) and len(reply) == 2 else None
        found.append(None if fraction is None else (fraction, _text_or_none(reply[1])))
    return found


def _text_or_none(raw: str | bytes | None) -> str | None:
    return None if raw is None else text(raw)


PLAIN_PROTOCOL = "2"


"""What a prefix records until a job feature is used: version-2 peers still work with it."""


PROTOCOL_VERSION = "3"


"""The version this library speaks: version 2 plus jobs (envelopes, delayed sets, records)."""


PROTOCOLS = frozenset({PLAIN_PROTOCOL, PROTOCOL_VERSION})


@redis_boundary
async def claim_protocol(r: Client, keys: Keys) -> str:
    """Record protocol 2 under the prefix unless a version is there; return the
    version found (a prefix moves to 3 with its first job, see `require_jobs`).

      1. SET protocol 2 NX
      2. GET protocol
    """
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SET", keys.protocol, PLAIN_PROTOCOL, "NX")
        pipe.execute_command("GET", keys.protocol)
        _, found = await pipe.execute()
    return text(found)


@redis_boundary
async def require_jobs(r: Client, keys: Keys) -> str:
    """Move the prefix to protocol 3 (so that version-2 peers refuse to start rather
    than hand envelopes to handlers); return the version found before.

      1. WATCH protocol;  GET protocol    -> 3 or another: UNWATCH, return it
      2. MULTI;  SET protocol 3;  EXEC    -> nil: back to 1
    """

    async def body(pipe: Pipeline) -> str:
        raw = await call(pipe, "GET", keys.protocol)
        found = PLAIN_PROTOCOL if raw is None else text(raw)
        if found == PLAIN_PROTOCOL:
            pipe.multi()
            pipe.execute_command("SET", keys.protocol, PROTOCOL_VERSION)
        return found

    found, _ = await _optimistic(r, [keys.protocol], body)
    return found


@redis_boundary
async def workers(r: Client, keys: Keys) -> list[WorkerInfo]:
    """Every registered worker with its queues, process count and heartbeat age.

    1. SMEMBERS workers
    2. GET alive;  SMEMBERS w:queues         (per worker, one round trip)
    3. `processes` of all queues
    """
    ids = members(await read(r, "SMEMBERS", keys.workers))
    commands: list[Command] = []
    for worker_id in ids:
        commands += [
            ("GET", keys.heartbeat(worker_id)),
            ("SMEMBERS", keys.worker_queues(worker_id)),
        ]
    replies = await reads(r, commands)
    held: dict[str, int] = {}
    for process in await processes(r, keys):
        held[process.worker_id] = held.get(process.worker_id, 0) + 1
    now = time.time()
    return [
        WorkerInfo(worker_id, tuple(members(queues)), held.get(worker_id, 0), _age(beat, now))
        for worker_id, beat, queues in zip(ids, replies[::2], replies[1::2], strict=True)
    ]


def _age(beat: Any, now: float) -> float | None:
    """Seconds since a heartbeat written at ``beat`` (unix time); None for none, or
    for a value worqr did not write."""
    try:
        return max(0.0, now - float(text(beat)))
    except (TypeError, ValueError, AttributeError):
        return None


@redis_boundary
async def queue_table(r: Client, keys: Keys, queues: Sequence[str] | None = None) -> list[QueueRow]:
    """Per queue (default: every registered one, sorted): its queued, in-process,
    failed and delayed tasks, the workers working on it and its flow control; three
    round trips however many queues there are. A key of the wrong type counts 0 (a
    flow hash of the wrong type: neither paused nor limited).

    1. SMEMBERS queues (without ``queues``);  SMEMBERS workers
    2. LLEN high;  LLEN tasks;  LLEN low;  LLEN failed;  SMEMBERS holders
       ZCARD delayed;  HMGET flow paused limit per  (per queue)
       SMEMBERS w:queues                            (per worker)
    3. SCARD held:<w>                               (per queue and holder)
    """
    first: list[Command] = [("SMEMBERS", keys.workers)]
    if queues is None:
        first.append(("SMEMBERS", keys.queues))
    replies = await reads(r, first)
    worker_ids = members(replies[0])
    names = list(queues) if queues is not None else members(replies[1])
    second: list[Command] = []
    for queue in names:
        second += [
            *(("LLEN", key) for key in keys.levels(queue)),
            ("LLEN", keys.failed(queue)),
            ("SMEMBERS", keys.holders(queue)),
            ("ZCARD", keys.delayed(queue)),
            read_flow(keys, queue),
        ]
    second += [("SMEMBERS", keys.worker_queues(w)) for w in worker_ids]
    counts = await reads(r, second)
    per_queue = counts[: _ROW * len(names)]
    worked: dict[str, int] = {}
    for reply in counts[_ROW * len(names) :]:
        for queue in members(reply):
            worked[queue] = worked.get(queue, 0) + 1
    pairs = [
        (q, w)
        for q, holders in zip(names, per_queue[4::_ROW], strict=True)
        for w in members(holders)
    ]
    sizes = await reads(r, [("SCARD", keys.held(q, w)) for q, w in pairs])
    in_process: dict[str, int] = {}
    for (queue, _), size in zip(pairs, sizes, strict=True):
        in_process[queue] = in_process.get(queue, 0) + _count(size)
    rows = []
    for i, queue in enumerate(names):
        high, normal, low, failed, _, delayed, flow_reply = per_queue[_ROW * i : _ROW * (i + 1)]
        try:
            flow = Flow.parse(flow_reply, keys.flow(queue))
        except CorruptDataError:
            flow = Flow()
        rows.append(
            QueueRow(
                queue,
                _count(high) + _count(normal) + _count(low),
                in_process.get(queue, 0),
                _count(failed),
                worked.get(queue, 0),
                _count(delayed),
                flow,
                {"high": _count(high), "normal": _count(normal), "low": _count(low)},
            )
        )
    return rows


@dataclass(frozen=True, slots=True)
class QueueRow:
    """One queue as `queue_table` reads it."""

    queue: str
    queued: int
    in_process: int
    failed: int
    workers: int
    delayed: int
    flow: Flow
    levels: dict[str, int]
    """Queued tasks per priority level."""


_ROW = 7  # the replies `queue_table` reads per queue
