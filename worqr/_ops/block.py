"""The blocking take: an idle consumer's next task, handed over by Redis as it arrives.

An idle worker that waits for a ``work`` event and then dequeues spends two trips
more than the task needs: the event to the worker, the dequeue to Redis and back. A
blocking take removes both: the worker registers a process id beforehand and blocks
in ``BLMOVE tasks p:<id>``, so Redis moves the task into that process list the moment
a producer pushes it, and the reply carries it to the worker. docs/diagrams/
blocking-take.md draws it with its failure analysis; in short:

- The id is in ``blocking:<w>`` before the block can move anything (the same write,
  ahead of it), so a task moved in is always recorded under the worker: a reclaim
  returns what the lists of both ``held:<w>`` and ``blocking:<w>`` hold. As the block
  returns, the same write records the id in ``held:<w>``: from then on the process
  is like any other (after a block that timed out the worker withdraws it at once).
- The same transaction refreshes the worker's heartbeat (``SET alive ... GET``), and
  a peer failing a dead worker checks that heartbeat under WATCH (`_ops.reclaim`
  with ``unless_alive``): the block, at most ``seconds`` < ``worker_timeout`` long,
  is over before any peer may take the worker for dead, so no reclaim can drop the
  id while the block may still fill its list. ``GET`` tells the worker whether its
  heartbeat had lapsed (then it gives the take up and hands back).
- The block ends on its own within ``seconds``; a worker that stops waiting earlier
  drops the connection (Redis then unblocks it) and gives the id up (`withdraw`: what
  reached its list goes back to the front) only once the block is over for certain:
  after its reply, or ``seconds`` after the reply to the transaction that began it.
- The block waits on the normal list only: as it returns, the same write reads the
  other levels, and a task it moved while one held tasks goes back to the front
  (the consumer then looks at every level), so strict priority and FIFO hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from .._errors import is_wrong_type, redis_boundary
from .._layout.flow import read_flow
from .._layout.keys import Keys
from .._redis.connections import Client
from .._redis.replies import text
from .._redis.wire import Wire, replies, send
from .commands import _atomic, _corrupt
from .writes import announce


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a block's reply and the reads right after it said."""

    task: str | None
    """The task moved, or None when the block timed out."""
    flow: Any
    """The flow control's raw fields (`Flow.parse`)."""
    leveled: bool
    """Another level than normal held tasks as the block returned: whatever it moved
    must not run before the queue's levels were looked at."""


@dataclass(frozen=True, slots=True)
class Armed:
    """What the transaction before a block said."""

    lapsed: bool
    """The worker's heartbeat had expired: peers may be failing it."""
    corrupt: str | None
    """A key of the wrong type that kept the id from being recorded (held, alive)."""
    at: float
    """When (monotonic) its reply was read: the block had begun by then."""


async def arm(
    connection: AbstractConnection,
    keys: Keys,
    worker_id: str,
    queue: str,
    process_id: str,
    *,
    timeout_ms: int,
    seconds: float,
    limit: float | None,
) -> Armed:
    """Register ``process_id`` and begin the block, in one write on ``connection`` (a
    connection of its own: it stays blocked up to ``seconds``); return what the
    registration said. The block's own replies are read by `outcome`.

      1. MULTI
      2. SADD blocking:<w> <id>
      3. SADD holders <w>
      4. SET alive <now> PX <worker_timeout> GET   -> nil: the heartbeat had lapsed
      5. EXEC
      6. BLMOVE tasks p:<id> LEFT RIGHT <seconds>  (runs as EXEC ends: the same write)
      7. SADD held:<w> <id>                        (run as the block returns: the id is a
      8. SREM blocking:<w> <id>                     process of the worker like any other,
                                                    recorded even if a reclaim deleted
                                                    blocking:<w> meanwhile; after a
                                                    timeout, `forget` withdraws it)
      9. HMGET flow paused limit per
     10. LLEN high;  LLEN low                   -> not both 0: the queue has other levels
                                                    now, the task goes back (see `outcome`)
    """
    blocking, held = keys.blocking(queue, worker_id), keys.held(queue, worker_id)
    writes: list[Wire] = [
        ("MULTI",),
        ("SADD", blocking, process_id),
        ("SADD", keys.holders(queue), worker_id),
        ("SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms, "GET"),
        ("EXEC",),
        ("BLMOVE", keys.tasks(queue), keys.process(queue, process_id), "LEFT", "RIGHT", seconds),
        ("SADD", held, process_id),
        ("SREM", blocking, process_id),
        read_flow(keys, queue),
        ("LLEN", keys.level(queue, "high")),
        ("LLEN", keys.level(queue, "low")),
    ]
    await send(connection, writes)
    *queued, done = await replies(connection, 5, limit)
    at = time.monotonic()
    for reply in queued:
        if isinstance(reply, ResponseError):
            raise reply  # refused as queued: nothing applied
    if isinstance(done, ResponseError):
        raise done
    for command, reply in zip(writes[1:4], done, strict=True):
        if is_wrong_type(reply):
            return Armed(lapsed=False, corrupt=str(command[1]), at=at)
    return Armed(lapsed=done[-1] is None, corrupt=None, at=at)


async def outcome(
    connection: AbstractConnection, keys: Keys, worker_id: str, queue: str, seconds: float
) -> Outcome:
    """The block's reply, and the flow control and the other levels as read right
    after it (a level that cannot be read counts as holding tasks: the look that
    follows reports it). Raises `CorruptDataError` naming ``tasks`` (nothing was
    moved), ``held:<w>`` or ``blocking:<w>`` when of the wrong type."""
    moved, *recorded, flow, high, low = await replies(connection, 6, seconds + _REPLY_MARGIN)
    if is_wrong_type(moved):
        raise _corrupt(keys.tasks(queue))
    keyed = (keys.held(queue, worker_id), keys.blocking(queue, worker_id))
    for key, reply in zip(keyed, recorded, strict=True):
        if is_wrong_type(reply):
            raise _corrupt(key)
    if isinstance(moved, ResponseError):
        raise moved
    leveled = not (isinstance(high, int) and isinstance(low, int) and high == low == 0)
    return Outcome(None if moved is None else text(moved), flow, leveled)


async def forget(
    connection: AbstractConnection, keys: Keys, worker_id: str, queue: str, process_id: str
) -> None:
    """After a block that timed out (its reply read: it moved nothing), withdraw its
    id, which steps 7-8 of `arm` recorded without a list, on the take's connection.

      1. SREM held:<w> <id>
    """
    await send(connection, [("SREM", keys.held(queue, worker_id), process_id)])
    await replies(connection, 1, _REPLY_MARGIN)


_REPLY_MARGIN = 2.0
"""Seconds a block's reply may take beyond the block itself (a slow link)."""


@redis_boundary
async def withdraw(once: Client, keys: Keys, worker_id: str, queue: str, process_id: str) -> int:
    """Give a blocking take's id up, once its block is over for certain: what reached
    its list goes back to the front of the queue, announced. Returns how many tasks
    went back (0 or 1).

      1. MULTI
      2. LMOVE p:<id> tasks RIGHT LEFT    -> the task, or nil
      3. SREM blocking:<w> <id>
      4. SREM held:<w> <id>               (adopted already)
      5. PUBLISH events work:1            (a harmless hint when nothing went back)
      6. EXEC
    """
    back, *_ = await _atomic(
        once,
        keys.tasks(queue),
        [
            ("LMOVE", keys.process(queue, process_id), keys.tasks(queue), "RIGHT", "LEFT"),
            ("SREM", keys.blocking(queue, worker_id), process_id),
            ("SREM", keys.held(queue, worker_id), process_id),
            announce(keys, queue, "normal", 1),
        ],
    )
    if is_wrong_type(back):
        raise _corrupt(keys.tasks(queue))
    return 0 if back is None else 1
