"""Workers: register, heartbeat, work on queues, fail, and the supervision scan.

One function per transition; its docstring names the keys it touches and the
numbered commands it runs, as drawn in docs/diagrams/."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._errors import CorruptDataError, InvalidProcessIdError, is_wrong_type, redis_boundary
from .._layout.keys import Keys
from .._layout.names import ProcessRef, parse_process_id
from .._redis.connections import Client as Client
from .._redis.replies import first_due, members, text
from .commands import Command, _in_order, _raise_wrong, call, reads, wrong_keys
from .reclaim import Alive, Reclaimed, reclaim


@redis_boundary
async def register_worker(
    r: Client,
    keys: Keys,
    worker_id: str,
    timeout_ms: int,
    queues: Iterable[str],
    *,
    exclusive: bool = False,
) -> bool:
    """Mark a worker alive and list it, with the queues it works on. ``exclusive``:
    only if its heartbeat is absent (False, and nothing of the worker's own written,
    when it is live: an id is live in one place at a time).

    The registry entry comes first: every key of a worker that a crash between the
    steps (two round trips on a Cluster) can leave behind is then findable by the
    dead-worker scan, which removes them once the heartbeat is gone. A listed worker
    whose heartbeat is not yet set may be failed by a peer meanwhile: it holds
    nothing yet, and its own next `touch_worker` lists it again.
      1. SADD workers <w>
      2. SET alive <now> PX <timeout>   (NX when exclusive)
      3. SADD w:queues queue...        (if any; after the SET when exclusive)
    """
    queue_list = list(queues)
    beat = ("SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms)
    own: list[Command] = [(*beat, "NX") if exclusive else beat]
    work: list[Command] = (
        [("SADD", keys.worker_queues(worker_id), *queue_list)] if queue_list else []
    )
    if not exclusive:
        own += work
    listed: list[Command] = [("SADD", keys.workers, worker_id)]
    replies = await _in_order(r, [(keys.workers, listed), (keys.heartbeat(worker_id), own)])
    _raise_wrong(own, replies[1:])  # a wrong-typed registry is the check's to report
    if replies[1] is None:
        return False
    if exclusive and work:
        _raise_wrong(work, await reads(r, work))
    return True


@redis_boundary
async def heartbeat(r: Client, keys: Keys, worker_id: str, timeout_ms: int) -> bool:
    """Extend the heartbeat; False when it had already expired (the worker was presumed dead).

    1. SET alive <now> PX <timeout> XX
    """
    reply = await call(
        r, "SET", keys.heartbeat(worker_id), str(time.time()), "PX", timeout_ms, "XX"
    )
    return reply is not None


@redis_boundary
async def start_work(
    r: Client, keys: Keys, worker_id: str, queue: str
) -> tuple[int, str | None, str]:
    """Record that a worker works on a queue; return how many tasks wait in it (0 when
    the tasks key is of the wrong type: the consumer's dequeues then report it) and
    the time of the queue's last deletion in the last hour (see `deletions`).

    The work list comes before the registry, so that a `prune_queues` that read no
    worker working on the queue unregisters it before this SADD re-registers it.
      1. SADD w:queues queue
      2. SADD queues queue;  ZSCORE deleted queue
      3. LLEN high;  LLEN tasks;  LLEN low
    The work to announce is ``work:N`` when only normal tasks wait, else a bare
    ``work:`` (a look: see `announce`), as the returned ``(count, deleted, message)``.
    """
    own: list[Command] = [("SADD", keys.worker_queues(worker_id), queue)]
    replies = await _in_order(
        r,
        [
            (keys.worker_queues(worker_id), own),
            (keys.queues, [("SADD", keys.queues, queue)]),
            (keys.deletions, [("ZSCORE", keys.deletions, queue)]),
            (keys.tasks(queue), [("LLEN", key) for key in keys.levels(queue)]),
        ],
    )
    _raise_wrong(own, replies)
    deleted = replies[2]
    high, normal, low = (0 if is_wrong_type(n) else int(n) for n in replies[3:])
    return high + normal + low, _score(deleted), "" if high or low else str(normal)


def _score(reply: Any) -> str | None:
    """A deletion time as ZSCORE gives it; None for none (or a registry of the wrong
    type, which the check reports)."""
    if reply is None or is_wrong_type(reply):
        return None
    return text(reply) if isinstance(reply, str | bytes) else repr(reply)


@redis_boundary
async def deletions(r: Client, keys: Keys, queues: Sequence[str]) -> list[str | None]:
    """When each queue was last deleted (within the hour), to compare with what
    `start_work` read: a worker that missed a ``delete`` event learns of it so.

    1. ZMSCORE deleted queue...
    """
    (scores,) = await reads(r, [("ZMSCORE", keys.deletions, *queues)])
    return [None] * len(queues) if is_wrong_type(scores) else [_score(s) for s in scores]


@redis_boundary
async def forget_work(r: Client, keys: Keys, worker_id: str, queue: str) -> None:
    """Take a queue off a worker's work list, where a `start_work` that raced the
    worker's end (a shutdown, `fail_worker`) put it after the end cleared the list.

    1. SREM w:queues queue
    """
    await reads(r, [("SREM", keys.worker_queues(worker_id), queue)])


@redis_boundary
async def stop_work(r: Client, keys: Keys, worker_id: str, queue: str) -> list[str]:
    """Stop a worker's work on a queue: reclaim its processes there, then forget the queue.

    1. `reclaim` (queue, worker)
    2. SREM w:queues queue
    """
    returned = await reclaim(r, keys, queue, worker_id)
    await reads(r, [("SREM", keys.worker_queues(worker_id), queue)])
    return returned.returned


@redis_boundary
async def queues_held_by(r: Client, keys: Keys, worker_id: str) -> tuple[set[str], list[str]]:
    """Every queue where a worker may hold processes: its work list and any queue
    whose holders name it (processes recorded after its work list was lost); and the
    keys of the wrong type met on the way (read as empty).

      1. SMEMBERS w:queues;  SMEMBERS queues
      2. SISMEMBER holders <w>   (per queue, one round trip)
    """
    first: list[Command] = [("SMEMBERS", keys.worker_queues(worker_id)), ("SMEMBERS", keys.queues)]
    working, known = await reads(r, first)
    candidates = members(known)
    second: list[Command] = [("SISMEMBER", keys.holders(q), worker_id) for q in candidates]
    flags = await reads(r, second)
    holding = {q for q, flag in zip(candidates, flags, strict=True) if flag is True or flag == 1}
    return set(members(working)) | holding, wrong_keys(first, [working, known]) + wrong_keys(
        second, flags
    )


@dataclass(frozen=True, slots=True)
class FailedWorker:
    """What `fail_worker` did."""

    reclaimed: dict[str, Reclaimed]
    """Per queue, what went back or to quarantine."""
    corrupt: list[str]
    """Keys of the wrong type met: processes in such a queue were left recorded (and
    the worker listed) for a later pass, once ``check(repair=True)`` removed them."""


@redis_boundary
async def fail_worker(
    r: Client,
    keys: Keys,
    worker_id: str,
    *,
    only_if_dead: bool,
    quarantine_after: int | None = None,
    now_ms: int | None = None,
) -> FailedWorker | None:
    """Return all of a worker's processes to the front of their queues and deregister it.

    With ``only_if_dead`` nothing happens (None) while the worker's heartbeat exists,
    checked again by each reclaim (see `reclaim`): a queue reclaimed before the worker
    came back stays reclaimed, and the worker, whose leases lapsed, hands back and
    registers anew.
    ``quarantine_after`` is passed to `reclaim` when the worker died (not when it is
    failed on purpose). Each step is idempotent and the registry entry goes last, so a
    peer that crashes midway leaves the worker listed for the next cleanup to finish.
    A queue with a key of the wrong type is skipped (the others go on); the worker then
    stays listed, without heartbeat, so that a later pass reclaims that queue too.
      1. EXISTS alive (only_if_dead)  |  DEL alive
      2. `queues_held_by` worker
      3. `reclaim` (queue, worker)    per queue
      4. DEL w:queues                 (nothing skipped)
      5. SREM workers <w>             (nothing skipped)
    """
    if only_if_dead:
        if await call(r, "EXISTS", keys.heartbeat(worker_id)):
            return None
    else:
        await call(r, "DEL", keys.heartbeat(worker_id))
    queues, corrupt = await queues_held_by(r, keys, worker_id)
    reclaimed: dict[str, Reclaimed] = {}
    skipped = False
    for queue in sorted(queues):
        try:
            reclaimed[queue] = await reclaim(
                r,
                keys,
                queue,
                worker_id,
                quarantine_after=quarantine_after,
                now_ms=now_ms,
                unless_alive=only_if_dead,
            )
        except Alive:  # it came back (a blocking take refreshed its heartbeat)
            return None
        except CorruptDataError as exc:
            corrupt.append(exc.key or f"a key of queue {queue!r}")
            skipped = True
    if not skipped:
        await call(r, "DEL", keys.worker_queues(worker_id))
        await reads(r, [("SREM", keys.workers, worker_id)])
    return FailedWorker(reclaimed, corrupt)


@dataclass(frozen=True, slots=True)
class Scan:
    """What one supervision scan found."""

    dead: list[str]
    """Workers, listed or named as holders, whose heartbeat is gone."""
    idle: list[str]
    """Registered queues with no queued, failed or in-process task and no worker."""
    corrupt: list[str]
    """Keys of the wrong type met (read as empty: one bad key costs only what it holds)."""
    overdue: list[ProcessRef] = field(default_factory=list)
    """Processes of jobs past their deadline (timeout plus grace): any peer may end
    the attempt, as timed out (see `fail`)."""


_OVERDUE_BATCH = 100  # overdue processes per queue one scan reports


@redis_boundary
async def scan(r: Client, keys: Keys, now_ms: int | None = None) -> Scan:
    """The fleet-wide scan: dead workers, and queues idle enough to leave the registry.

    O(workers + registered queues) per call; only one peer per interval runs it (see
    `acquire_supervision`), and since idle queues are pruned (`prune_queues`), its cost
    follows the queues in use, not every queue ever used.
    With ``now_ms`` (server time) it also lists processes past their deadline.
      1. SMEMBERS workers;  SMEMBERS queues
      2. SMEMBERS holders;  EXISTS high tasks low failed delayed       (per queue)
         (now_ms) ZRANGE deadlines -inf <now> BYSCORE LIMIT 0 100
         SMEMBERS w:queues                          (per listed worker)   one round trip
      3. EXISTS alive                               (per candidate, one round trip)
    """
    first: list[Command] = [("SMEMBERS", keys.workers), ("SMEMBERS", keys.queues)]
    listed, known = await reads(r, first)
    workers, queues = members(listed), members(known)
    step = 2 if now_ms is None else 3
    second: list[Command] = []
    for queue in queues:
        second += [
            ("SMEMBERS", keys.holders(queue)),
            ("EXISTS", *keys.levels(queue), keys.failed(queue), keys.delayed(queue)),
        ]
        if now_ms is not None:
            second.append(
                (
                    "ZRANGE",
                    keys.deadlines(queue),
                    "-inf",
                    now_ms,
                    "BYSCORE",
                    "LIMIT",
                    0,
                    _OVERDUE_BATCH,
                )
            )
    second += [("SMEMBERS", keys.worker_queues(worker_id)) for worker_id in workers]
    replies = await reads(r, second)
    per_queue = replies[: step * len(queues)]
    holders, contents = per_queue[::step], per_queue[1::step]
    overdue = [
        ref
        for reply in (per_queue[2::step] if now_ms is not None else [])
        if not is_wrong_type(reply)
        for pid in reply
        if (ref := _ref_or_none(text(pid))) is not None
    ]
    worked = {q for reply in replies[step * len(queues) :] for q in members(reply)}
    candidates = sorted(set(workers).union(*(members(reply) for reply in holders)))
    alive = await reads(r, [("EXISTS", keys.heartbeat(worker_id)) for worker_id in candidates])
    idle = [
        queue
        for queue, held_by, content in zip(queues, holders, contents, strict=True)
        if not held_by and content == 0 and queue not in worked
    ]
    return Scan(
        dead=[w for w, flag in zip(candidates, alive, strict=True) if not flag],
        idle=idle,
        corrupt=wrong_keys(first, [listed, known]) + wrong_keys(second, replies),
        overdue=overdue,
    )


def _ref_or_none(pid: str) -> ProcessRef | None:
    try:
        return parse_process_id(pid)
    except InvalidProcessIdError:
        return None


@redis_boundary
async def prune_queues(r: Client, keys: Keys, idle: Sequence[str]) -> list[str]:
    """Unregister queues a `scan` found idle; return those that stayed out.

    No lock, and no queue that comes to life meanwhile is lost: the entries go first,
    then a second read re-registers every queue that has tasks, failed tasks or
    processes, or a worker, by then. A push the read missed comes after it, so its
    own SADD (after the push, see `enqueue`) re-registers the queue; a `start_work`
    the read missed writes its work list after the read and the registry after that.
      1. SREM queues queue...
      2. SMEMBERS workers;  EXISTS high tasks low failed holders delayed (per queue)
      3. SMEMBERS w:queues (per listed worker)
      4. SADD queues queue...                       (those in use by now)
    """
    if not idle:
        return []
    await reads(r, [("SREM", keys.queues, *idle)])
    checks: list[Command] = [
        ("EXISTS", *keys.levels(q), keys.failed(q), keys.holders(q), keys.delayed(q)) for q in idle
    ]
    replies = await reads(r, [("SMEMBERS", keys.workers), *checks])
    work_lists = [("SMEMBERS", keys.worker_queues(w)) for w in members(replies[0])]
    worked = {q for reply in await reads(r, work_lists) for q in members(reply)}
    back = [q for q, n in zip(idle, replies[1:], strict=True) if n != 0 or q in worked]
    if back:
        await reads(r, [("SADD", keys.queues, *back)])
    return [q for q in idle if q not in back]


@redis_boundary
async def acquire_supervision(r: Client, keys: Keys, worker_id: str, lease_ms: int) -> bool:
    """Take the fleet-wide supervision lease for one interval, if nobody holds it.

    A lease key without expiry (not written by worqr, which always sets one) would
    stop supervision for good: then every peer scans, as if it held the lease, until
    ``check(repair=True)`` removes the key.
      1. SET supervisor <w> NX PX <lease>
      2. PTTL supervisor              (taken: -1 means no expiry)
    """
    taken, ttl = await reads(
        r,
        [
            ("SET", keys.supervision_lease, worker_id, "NX", "PX", lease_ms),
            ("PTTL", keys.supervision_lease),
        ],
    )
    return taken is not None or ttl == -1


@dataclass(frozen=True, slots=True)
class QueueLook:
    """What a worker's self-check saw of one queue it works on."""

    waiting: int
    """Queued tasks (0 when the tasks key is of the wrong type)."""
    held: list[str] | None
    """The process ids Redis records under the worker (None: the held set is of the
    wrong type, so nothing is known of them)."""
    next_due: int | None
    """The earliest due time in the delayed set (Unix ms), None for none."""
    leveled: bool = False
    """Tasks wait at another level than normal."""
    released: int = 0
    """Waiting jobs handed to the next release (see `_ops.deps.release`)."""


@redis_boundary
async def touch_worker(
    r: Client, keys: Keys, worker_id: str, queues: Sequence[str]
) -> list[QueueLook]:
    """Periodic self-check: keep the registry entries true, and per queue count
    waiting tasks, list the processes Redis records under this worker and read the
    next due time of its delayed jobs and the jobs waiting for a release (in case a
    ``delayed`` or ``released`` event was missed).

    Re-adding is idempotent and heals an entry a racing peer removed just after
    this worker re-registered.
      1. SADD workers <w>;  SADD w:queues queue...
      2. LLEN high;  LLEN tasks;  LLEN low;  SMEMBERS held:<w>
         ZRANGE delayed 0 0 WITHSCORES;  SCARD released                 (per queue)
    """
    commands: list[Command] = [("SADD", keys.workers, worker_id)]
    if queues:
        commands.append(("SADD", keys.worker_queues(worker_id), *queues))
    for queue in queues:
        commands += [("LLEN", key) for key in keys.levels(queue)]
        commands.append(("SMEMBERS", keys.held(queue, worker_id)))
        commands.append(("ZRANGE", keys.delayed(queue), 0, 0, "WITHSCORES"))
        commands.append(("SCARD", keys.released(queue)))
    per_queue = (await reads(r, commands))[2 if queues else 1 :]
    looks = []
    for i in range(len(queues)):
        high, normal, low, held, due, released = per_queue[6 * i : 6 * i + 6]
        high, normal, low = (0 if is_wrong_type(n) else int(n) for n in (high, normal, low))
        looks.append(
            QueueLook(
                high + normal + low,
                None if is_wrong_type(held) else members(held),
                first_due(due),
                bool(high or low),
                0 if is_wrong_type(released) else int(released),
            )
        )
    return looks
