"""Dequeue: a worker moves a task from its queue into a process of its own.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import BackendError, CorruptDataError, is_wrong_type, redis_boundary
from .._layout.flow import Flow, Paused, Throttled, read_flow
from .._layout.keys import Keys
from .._layout.levels import LEVELS, Picker
from .._layout.models import Process
from .._layout.names import new_process_id, split_process_id
from .._redis.connections import Client as Client
from .._redis.connections import NotApplied, on_slot
from .._redis.replies import paired, score_ms, server_ms, text
from .commands import (
    _MAX_ATTEMPTS,
    Command,
    _atomic,
    _beside,
    _corrupt,
    _optimistic,
    _raise_wrong,
    _transaction,
    reads,
)
from .writes import as_process

_LAG_ROUND_TRIPS = 2.5  # round trips from a rate-limited dequeue's TIME to its EXEC


_LAG_MS = 5  # ms on top: the scheduling noise of a busy host


_LATE_TRIES = 5  # rate-limited dequeues in a row whose EXEC ran later than allowed


@dataclass(frozen=True, slots=True)
class Look:
    """What a dequeue read of a queue besides its tasks: its flow control, and whether
    its high or low list held tasks (a worker then looks before each take)."""

    flow: Flow
    leveled: bool


NewIds = Callable[[Sequence[str]], list[str]]


"""Fresh process ids, one per level given (the level goes into the id's token)."""


def _lengths(replies: Sequence[Any]) -> dict[str, int]:
    """The LLEN replies of a queue's levels (highest first) by level."""
    return {level: int(reply) for level, reply in zip(LEVELS, replies, strict=True)}


@redis_boundary
async def dequeue(
    r: Client,
    once: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    count: int = 1,
    *,
    announced: bool = False,
    new_ids: NewIds | None = None,
    seen: Callable[[Look], None] | None = None,
    picker: Picker | None = None,
    policy: str = "weighted",
    normal: bool = True,
) -> list[Process]:
    """Move up to ``count`` tasks from the heads of the queue's level lists into new
    processes of this worker, the levels chosen by ``picker`` under ``policy`` (see
    `_layout.levels`), FIFO within a level; an empty list when the queue is empty. Raises
    `Paused` (nothing taken) while the queue is paused; a queue with a rate limit
    goes through `_dequeue_limited`.

    ``new_ids(levels)`` makes fresh process ids (a worker keeps them known as in
    flight; by default they are made here); ``seen(look)`` is told the queue's flow
    control and levels as read (a worker skips the announced path of a queue that is
    rate-limited or has tasks of other levels than normal). Without ``normal`` the
    normal level is left alone (a blocking take's task may be on its way back to its
    front: a task taken behind it would run first).
    ``once`` is a client whose transactions are never resent (see `_redis.connections`):
    the transaction must not run twice. If its reply is lost, LINDEX p:<id> 0 for each
    id tells whether it took effect: then its processes are adopted. Otherwise it is
    sent again with FRESH ids, because "not yet" is not "never": a transaction held up
    on the way (a timeout, a slow link) can still land later, and with the same ids it
    would append a second task to each process list. Processes of an attempt that lands
    late are unknown to the worker, and its audit returns them to the front.
    Keys: high, tasks, low (LIST), p:<id>... (LIST), held:<w> (SET), holders (SET),
    flow (HASH).
      1. LLEN high;  LLEN tasks;  LLEN low;  HMGET flow paused limit per
                                          -> paused: raise; limited: `_dequeue_limited`;
                                             all 0: return (an idle poll: one round trip)
                                             (skipped when ``announced``: a ``work:N``
                                             event just said N normal tasks came)
      2. MULTI                            (k slots, each given a level by the picker)
      3. LMOVE <level> p:<idi> LEFT RIGHT for i = 1..k -> the task, or nil once empty
      4. SADD held:<w> <id1> ... <idk>
      5. SADD holders <w>
      6. HMGET flow paused limit per      -> paused or limited since step 1: what was
                                             taken goes back to the front (`_undo`)
      7. EXEC
      8. (some LMOVE found its list empty) SREM held:<w> <unused ids>
    The SADD cannot be conditional on the LMOVEs inside MULTI, so ids that got no task
    are withdrawn in step 8; an id left behind by a crash there names no process list
    and goes with the next reclaim.
    """
    if new_ids is None:

        def new_ids(levels: Sequence[str]) -> list[str]:
            return [new_process_id(worker_id, queue, level).id for level in levels]

    if announced:
        levels = ["normal"] * count
    else:
        replies = await reads(
            r, [*(("LLEN", key) for key in keys.levels(queue)), read_flow(keys, queue)]
        )
        _raise_wrong([("LLEN", key) for key in keys.levels(queue)], replies[:3])
        lengths = _lengths(replies[:3])
        flow = Flow.parse(replies[3], keys.flow(queue))
        if seen is not None:
            seen(Look(flow, bool(lengths["high"] or lengths["low"])))
        if flow.paused:
            raise Paused
        if flow.limit is not None:
            return await _dequeue_limited(
                r, once, keys, worker_id, queue, count, new_ids, picker or Picker(), policy
            )
        if not normal:
            lengths["normal"] = 0
        levels = (picker or Picker()).plan(lengths, count, policy)
    if not levels:
        return []
    held = keys.held(queue, worker_id)
    k = len(levels)

    def take(ids: list[str]) -> list[Command]:
        moves: list[Command] = [
            ("LMOVE", keys.level(queue, level), keys.process(queue, pid), "LEFT", "RIGHT")
            for level, pid in zip(levels, ids, strict=True)
        ]
        return [
            *moves,
            ("SADD", held, *ids),
            ("SADD", keys.holders(queue), worker_id),
            read_flow(keys, queue),
        ]

    recorded: Any = 1
    flow_reply = None
    for _ in range(_MAX_ATTEMPTS):
        ids = new_ids(levels)
        try:
            replies = await on_slot(once, keys.tasks(queue), _transaction(take(ids)))
            tasks, recorded, flow_reply = replies[:k], replies[k], replies[k + 2]
            break
        except (MaxConnectionsError, NotApplied):
            raise  # nothing sent, or nothing applied
        except (RedisConnectionError, RedisTimeoutError):
            lookups: list[Command] = [("LINDEX", keys.process(queue, pid), 0) for pid in ids]
            tasks = await reads(once, lookups)
            if any(isinstance(task, str | bytes) for task in tasks):
                break  # the lost EXEC was applied: adopt what it took
    else:
        raise BackendError(f"gave up dequeuing from {queue!r} after {_MAX_ATTEMPTS} tries")
    # A wrong-typed level list fails its LMOVEs (nothing taken); a wrong-typed held
    # set fails the record (the tasks go straight back). holders is the check's.
    found = [task if isinstance(task, str | bytes) else None for task in tasks]
    taken_ids = [pid for pid, task in zip(ids, found, strict=True) if task is not None]
    if is_wrong_type(recorded) and taken_ids:
        await _undo(once, keys, queue, taken_ids)
        raise _corrupt(held)
    if len(taken_ids) < len(ids):
        unused = [pid for pid, task in zip(ids, found, strict=True) if task is None]
        await reads(r, [("SREM", held, *unused)])
    wrong = [level for level, task in zip(levels, tasks, strict=True) if is_wrong_type(task)]
    if wrong:
        if taken_ids:  # the levels that could be read gave tasks: back they go
            await _undo(once, keys, queue, taken_ids, held)
        raise _corrupt(keys.level(queue, wrong[0]))
    if flow_reply is None and taken_ids:  # the reply was lost: read the flow now
        (flow_reply,) = await reads(r, [read_flow(keys, queue)])
    if taken_ids:
        try:
            flow = Flow.parse(flow_reply, keys.flow(queue)) if flow_reply is not None else Flow()
        except CorruptDataError:  # unreadable flow control: hand out nothing
            await _undo(once, keys, queue, taken_ids, held)
            raise
        if flow.paused or flow.limit is not None:  # changed since step 1 (or unread)
            if seen is not None:
                seen(Look(flow, True))
            await _undo(once, keys, queue, taken_ids, held)
            if flow.paused:
                raise Paused
            return await _dequeue_limited(
                r, once, keys, worker_id, queue, count, new_ids, picker or Picker(), policy
            )
    return [
        as_process(pid, text(task), queue)
        for pid, task in zip(ids, found, strict=True)
        if task is not None
    ]


async def _undo(
    once: Client, keys: Keys, queue: str, pids: Sequence[str], held: str | None = None
) -> None:
    """Return the tasks of processes just taken to the front of their levels, newest
    first (so the queue's order is as before), withdrawing their ids from ``held``
    (without it, they go with the next reclaim, which finds no process list). No
    ``work`` event: the queue is paused or rate-limited, and an announcement would
    only bring its workers back to take and return them again."""
    for pid in reversed(pids):
        level = keys.level(queue, split_process_id(pid).level)
        back: Command = ("LMOVE", keys.process(queue, pid), level, "RIGHT", "LEFT")
        withdraw: list[Command] = [] if held is None else [("SREM", held, pid)]
        await _atomic(once, keys.tasks(queue), [back, *withdraw])


async def _dequeue_limited(
    r: Client,
    once: Client,
    keys: Keys,
    worker_id: str,
    queue: str,
    count: int,
    new_ids: NewIds,
    picker: Picker,
    policy: str,
) -> list[Process]:
    """`dequeue` from a rate-limited queue: no ``per`` ms window of the server's clock
    holds more than ``limit`` starts, fleet-wide. Raises `Throttled` (with the wait
    until the window frees a start) when none is left, `Paused` when paused.

    WATCH serialises the dequeues of the queue: each one counts the window and records
    its starts in one transaction, so two cannot both take the last start.
    Keys: starts (ZSET), flow (HASH), high, tasks, low, p:<id>..., held:<w>, holders.
      1. WATCH starts flow
      2. TIME;  HMGET flow paused limit per           -> paused: raise;  no limit: back
                                                         to `dequeue`
      3. ZCOUNT starts (<now - per> +inf;  ZRANGE starts (<now - per> +inf BYSCORE
         LIMIT 0 1 WITHSCORES;  LLEN high;  LLEN tasks;  LLEN low
                           -> none left: UNWATCH, raise `Throttled` (the oldest start
                              leaves the window at its score + per);  empty: return
      4. MULTI             (k = min(count, starts left, tasks), levels by the picker)
      5. ZREMRANGEBYSCORE starts -inf <now - per>
      6. LMOVE <level> p:<idi> LEFT RIGHT                              for i = 1..k
      7. ZADD starts <t> <id1> ... <t> <idk>    (t = now + 2 round trips + 5 ms: no
                                                 earlier than the EXEC can run)
      8. SADD held:<w> <ids>;  SADD holders <w>
      9. TIME                                   -> when the EXEC ran
     10. EXEC                                                          -> nil: back to 1
     11. (it ran after t: a stall) every task back to the front of its level, SREM
         held:<w> <ids>;  ZREM starts <ids>;  back to 1
     12. (some LMOVE found its list empty) SREM held:<w> <unused>;  ZREM starts <unused>
    A lost EXEC reply raises `BackendUnavailableError`: its processes, if it landed,
    are returned by the worker's audit; its starts count until they leave the window.
    """
    starts, held = keys.starts(queue), keys.held(queue, worker_id)
    plain = False
    levels: list[str] = []
    stamp = 0  # the score of this attempt's starts: now plus the allowance

    async def body(pipe: Pipeline) -> list[str]:
        nonlocal plain, levels, stamp
        sent = time.monotonic()
        clock, raw_flow = await _beside(pipe, [("TIME",), read_flow(keys, queue)])
        now = server_ms(clock)
        # The tasks move at EXEC, two round trips from now: the starts are scored at
        # the latest time that EXEC may run at (checked by the TIME inside it), never
        # earlier than they happen, so that no window ever counts one of them short.
        stamp = now + round(_LAG_ROUND_TRIPS * (time.monotonic() - sent) * 1000) + _LAG_MS
        flow = Flow.parse(raw_flow, keys.flow(queue))
        if flow.paused or flow.limit is None or flow.per_ms is None:
            await pipe.reset()
            plain = not flow.paused
            if flow.paused:
                raise Paused
            return []
        floor = now - flow.per_ms
        lists: list[Command] = [("LLEN", key) for key in keys.levels(queue)]
        window: list[Command] = [
            ("ZCOUNT", starts, f"({floor}", "+inf"),
            ("ZRANGE", starts, f"({floor}", "+inf", "BYSCORE", "LIMIT", 0, 1, "WITHSCORES"),
        ]
        replies = await _beside(pipe, [*window, *lists])
        _raise_wrong([*window, *lists], replies)
        used, oldest = replies[:2]
        room = flow.limit - int(used)
        if room <= 0:
            await pipe.reset()
            first = paired(oldest)
            leaves = (score_ms(first[0][1]) or now) + flow.per_ms if first else now + 1
            raise Throttled(max(leaves - now, 1) / 1000)
        levels = picker.plan(_lengths(replies[2:]), min(count, room), policy)
        if not levels:
            await pipe.reset()
            return []
        ids = new_ids(levels)
        pipe.multi()
        pipe.execute_command("ZREMRANGEBYSCORE", starts, "-inf", floor)
        for level, pid in zip(levels, ids, strict=True):
            pipe.execute_command(
                "LMOVE", keys.level(queue, level), keys.process(queue, pid), "LEFT", "RIGHT"
            )
        pipe.execute_command("ZADD", starts, *(part for pid in ids for part in (stamp, pid)))
        pipe.execute_command("SADD", held, *ids)
        pipe.execute_command("SADD", keys.holders(queue), worker_id)
        pipe.execute_command("TIME")
        return ids

    for _ in range(_LATE_TRIES):
        ids, replies = await _optimistic(r, [starts, keys.flow(queue)], body)
        if plain:
            return await dequeue(
                r,
                once,
                keys,
                worker_id,
                queue,
                count,
                new_ids=new_ids,
                picker=picker,
                policy=policy,
            )
        if not ids:
            return []
        tasks = replies[1 : 1 + len(ids)]
        found = [task if isinstance(task, str | bytes) else None for task in tasks]
        taken = [pid for pid, task in zip(ids, found, strict=True) if task is not None]
        unused = [pid for pid, task in zip(ids, found, strict=True) if task is None]
        ran = server_ms(replies[-1])
        if ran > stamp:  # EXEC ran later than its starts say (a stall): none of them counts
            await _undo(once, keys, queue, taken, held)
            await reads(r, [("SREM", held, *ids), ("ZREM", starts, *ids)])
            continue
        if unused:
            await reads(r, [("SREM", held, *unused), ("ZREM", starts, *unused)])
        if is_wrong_type(replies[-3]):  # the held set: what was taken goes straight back
            await _undo(once, keys, queue, taken)
            raise _corrupt(held)
        break
    else:
        raise BackendError(f"dequeues from {queue!r} keep running late for its rate limit")
    return [
        as_process(pid, text(task), queue)
        for pid, task in zip(ids, found, strict=True)
        if task is not None
    ]
