"""Promotion: delayed jobs whose time came move to the back of their queue.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import BackendError, redis_boundary
from .._layout.keys import Keys
from .._layout.state import JobState
from .._redis.connections import Client as Client
from .._redis.connections import on_slot
from .._redis.replies import first_due, paired, reached, score_ms, server_ms, text
from .._redis.wire import Watching, Wire, watching
from .commands import (
    _MAX_ATTEMPTS,
    _corrupt,
    _raise_wrong,
    _unknown_outcome,
    _unless_wrong,
    read,
    reads,
)
from .writes import _job_id, level_of_stored, level_pushes, stored

_PROMOTE_BATCH = 1000  # envelopes one promotion moves at most


_LOOK_AHEAD_MS = 5  # a promotion reads this far past its caller's guess of the time


@dataclass(frozen=True, slots=True)
class Promotion:
    """What one promotion did."""

    moved: int
    next_due_ms: int | None
    """The due time of the earliest job still delayed, None if none."""
    now_ms: int
    """The server's time the promotion judged by."""


@redis_boundary
async def promote(r: Client, keys: Keys, queue: str, guess_ms: int) -> Promotion:
    """Move the jobs whose due time has come (by the server's ``TIME``) from the
    delayed set to the back of the queue, earliest first, in three round trips.

    ``guess_ms`` is the caller's estimate of the server's time: the first round trip
    reads the entries due by then (and `_LOOK_AHEAD_MS` more) beside ``TIME``, and
    only those the server's time has reached move. A guess behind the server (this
    host's clock was stepped back) leaves due entries unread, which the entry read
    after them shows: they are read again up to the server's time, one round trip
    more. Only what is due (by the guess) is read, and the one entry after it,
    however many jobs wait for later.

    Every worker of the queue may try at once: one moves each job, the others find it
    gone. The fence is the due jobs' records, which every other writer that takes a
    job out of the delayed set writes too (a promotion, `cancel_job`, `delete_queue`),
    not the delayed set itself: each `submit` with a delay writes that, and under
    live traffic a WATCH on it failed nearly every EXEC. An entry that is no job
    (nothing else writes one, but data under the prefix may be anything) is fenced
    by the set.
      1. TIME                                          -> now (ms)
         ZRANGE delayed -inf <horizon> BYSCORE LIMIT 0 1000 WITHSCORES
         ZRANGE delayed (<horizon> +inf BYSCORE LIMIT 0 1 WITHSCORES
                                    (one round trip)   -> those due: score <= now
         (the entry after them due too: the same with <now> as the horizon)
         (none due: done)
      2. WATCH j:<id>...  (and delayed, for a non-job)
         ZMSCORE delayed <envelope>...;  TYPE <level>...
                                    (one round trip)   -> gone or not due: left out
                                                          (none left: UNWATCH)
      3. MULTI
         ZREM delayed <envelope>...
         RPUSH <level> <envelope>...                   (each to its priority's list)
         HSET j:<id> state queued;  HDEL j:<id> due    (per job)
         PUBLISH events work:<n>                       (work: when not all are normal)
         SADD queues queue                             (one server: in the transaction)
         EXEC                                          -> nil: back to 1
      4. SADD queues queue                             (a Cluster: another slot)
    """
    delayed = keys.delayed(queue)
    single = isinstance(r, Redis)

    def looks(horizon: int) -> list[Wire]:
        return [
            ("TIME",),
            (
                "ZRANGE",
                delayed,
                "-inf",
                horizon,
                "BYSCORE",
                "LIMIT",
                0,
                _PROMOTE_BATCH,
                "WITHSCORES",
            ),
            ("ZRANGE", delayed, f"({horizon}", "+inf", "BYSCORE", "LIMIT", 0, 1, "WITHSCORES"),
        ]

    async def first_look(session: Watching, horizon: int) -> tuple[int, list[Any], list[Any]]:
        """Step 1: the server's time, the entries up to ``horizon``, the one after."""
        clock, head, after = _unless_wrong(await session.look([], looks(horizon)))
        _raise_wrong([("ZRANGE", delayed)], [head])
        return server_ms(clock), paired(head), paired(after)

    async def attempt(session: Watching) -> Promotion | None:
        now, head, after = await first_look(session, guess_ms + _LOOK_AHEAD_MS)
        if len(head) < _PROMOTE_BATCH and any(reached(score, now) for _, score in after):
            now, head, after = await first_look(session, now)  # the guess is behind
        due = [text(member) for member, score in head if reached(score, now)]
        waiting = [score_ms(score) for _, score in head if not reached(score, now)]
        waiting += [score_ms(score) for _, score in after]
        next_due = min((ms for ms in waiting if ms is not None), default=None)
        if len(due) == _PROMOTE_BATCH:
            next_due = now  # more may be due: the caller promotes again at once
        if not due:
            return Promotion(0, next_due, now)
        ids = [_job_id(member) for member in due]
        fences = {keys.job(queue, job_id) for job_id in ids if job_id is not None}
        moving = [stored(member) for member in due]  # written back as they are stored
        levels = [level_of_stored(member) for member in due]
        kinds = sorted(set(levels))
        replies = _unless_wrong(
            await session.look(
                [*sorted(fences), *([delayed] if None in ids else [])],
                [("ZMSCORE", delayed, *moving)] + [("TYPE", keys.level(queue, k)) for k in kinds],
            )
        )
        for level, found in zip(kinds, replies[1:], strict=True):
            if text(found) not in ("list", "none"):
                raise _corrupt(keys.level(queue, level), text(found))
        still = [reached(score, now) for score in replies[0]]
        if not any(still):
            return Promotion(0, next_due, now)
        moved = [i for i, kept in enumerate(still) if kept]
        writes: list[Wire] = [("ZREM", delayed, *(moving[i] for i in moved))]
        writes += level_pushes(keys, queue, [(levels[i], moving[i]) for i in moved])
        for i in moved:
            job_id = ids[i]
            if job_id is not None:
                writes.append(("HSET", keys.job(queue, job_id), "state", JobState.QUEUED.value))
                writes.append(("HDEL", keys.job(queue, job_id), "due"))
        if single:
            writes.append(("SADD", keys.queues, queue))
        try:
            outcome = await session.commit(writes)
        except MaxConnectionsError:
            raise
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _unknown_outcome() from exc
        if outcome is None:
            return None  # a fence changed: read again
        _unless_wrong(outcome)
        return Promotion(len(moved), next_due, now)

    async def run(node: Redis) -> Promotion:
        async with watching(node) as session:
            for _ in range(_MAX_ATTEMPTS):
                done = await attempt(session)
                if done is not None:
                    return done
        raise BackendError(f"gave up after {_MAX_ATTEMPTS} conflicting attempts on {delayed}")

    done = await on_slot(r, delayed, run)
    if done.moved and not single:
        await reads(r, [("SADD", keys.queues, queue)])
    return done


@redis_boundary
async def next_due(r: Client, keys: Keys, queues: Sequence[str]) -> list[int | None]:
    """The earliest due time in each queue's delayed set (Unix ms), None for none.

    1. ZRANGE delayed 0 0 WITHSCORES             (per queue, one round trip)
    """
    replies = await reads(r, [("ZRANGE", keys.delayed(q), 0, 0, "WITHSCORES") for q in queues])
    return [first_due(reply) for reply in replies]


@redis_boundary
async def delayed_jobs(r: Client, keys: Keys, queue: str, limit: int) -> list[tuple[int, str]]:
    """The delayed set, next first: (due time in Unix ms, stored envelope).

    1. ZRANGE delayed 0 <limit - 1> WITHSCORES
    """
    reply = await read(r, "ZRANGE", keys.delayed(queue), 0, limit - 1, "WITHSCORES")
    found = [(score_ms(score), text(member)) for member, score in paired(reply)]
    return [(due, member) for due, member in found if due is not None]
