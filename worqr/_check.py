"""The consistency check: read everything under a prefix and list what breaks the
invariants (every task in exactly one place, every process owned, no bookkeeping of
dead workers left behind). An admin operation: it SCANs the keyspace once (on a
Cluster, every primary's).

On a live fleet an operation in flight can show for a moment as a finding (an empty
dequeue between its two steps, a held set the SCAN missed because it was created
while the SCAN ran): a second look drops those, and every repair re-checks its
finding under WATCH before it writes, so repairing a live fleet moves no task that a
worker holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from ._errors import redis_boundary
from ._keys import Keys
from ._names import parse_process_id
from ._ops import Client, text

_SECOND_LOOK = 0.1  # seconds before a dangling id is confirmed


@dataclass(frozen=True, slots=True)
class Problem:
    """One violation of the invariants."""

    kind: str
    """``orphan-process``, ``malformed-process``, ``dangling-process-id``,
    ``dead-worker``, ``stale-holder``, ``stale-work-list``, ``unregistered-worker`` or
    ``unregistered-queue``."""
    detail: str
    queue: str | None = None
    worker_id: str | None = None
    process_id: str | None = None


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What `Worqr.check` found (and, with ``repair``, fixed)."""

    problems: tuple[Problem, ...]
    repaired: bool

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.problems


@dataclass
class _State:
    """The raw state under a prefix, as one SCAN saw it."""

    workers: set[str]
    queues: set[str]
    alive: set[str]
    process_lengths: dict[tuple[str, str], int]  # (queue, id) -> LLEN p:<id>
    held: dict[tuple[str, str], set[str]]  # (queue, worker) -> ids
    holders: dict[str, set[str]]  # queue -> workers
    work_lists: set[str]  # workers with a w:queues key
    queues_with_tasks: set[str]


@redis_boundary
async def _read(r: Client, keys: Keys) -> _State:
    process_keys: list[tuple[str, str]] = []
    held_keys: list[tuple[str, str]] = []
    holder_queues: list[str] = []
    task_queues: list[str] = []
    workers_seen: set[str] = set()
    work_lists: set[str] = set()
    async for raw in r.scan_iter(match=keys.everything, count=1000):  # every primary's
        parsed = keys.parse(text(raw))
        if parsed is None:
            continue
        kind, owner, rest = parsed
        if kind == "p":
            process_keys.append((owner, rest))
        elif kind == "held":
            held_keys.append((owner, rest))
        elif kind == "holders":
            holder_queues.append(owner)
        elif kind == "tasks":
            task_queues.append(owner)
        elif kind in ("alive", "queues"):
            workers_seen.add(owner)
            if kind == "queues":
                work_lists.add(owner)
    async with r.pipeline(transaction=False) as pipe:
        pipe.execute_command("SMEMBERS", keys.workers)
        pipe.execute_command("SMEMBERS", keys.queues)
        for queue, pid in process_keys:
            pipe.execute_command("LLEN", keys.process(queue, pid))
        for queue, worker_id in held_keys:
            pipe.execute_command("SMEMBERS", keys.held(queue, worker_id))
        for queue in holder_queues:
            pipe.execute_command("SMEMBERS", keys.holders(queue))
        replies = await pipe.execute()
    workers = {text(w) for w in replies[0]}
    queues = {text(q) for q in replies[1]}
    at = 2
    lengths = {
        key: int(n)
        for key, n in zip(process_keys, replies[at : at + len(process_keys)], strict=True)
    }
    at += len(process_keys)
    held = {
        key: {text(pid) for pid in members}
        for key, members in zip(held_keys, replies[at : at + len(held_keys)], strict=True)
    }
    at += len(held_keys)
    holders = {
        queue: {text(w) for w in members}
        for queue, members in zip(holder_queues, replies[at:], strict=True)
    }
    everyone = sorted(
        workers
        | workers_seen
        | {w for _, w in held_keys}
        | {w for ws in holders.values() for w in ws}
    )
    async with r.pipeline(transaction=False) as pipe:
        for worker_id in everyone:
            pipe.execute_command("EXISTS", keys.heartbeat(worker_id))
        flags = await pipe.execute()
    alive = {w for w, flag in zip(everyone, flags, strict=True) if flag}
    return _State(workers, queues, alive, lengths, held, holders, work_lists, set(task_queues))


@redis_boundary
async def _second_look(
    r: Client, keys: Keys, candidates: list[tuple[str, str, str]]
) -> list[tuple[bool, bool]]:
    """For each (queue, worker, id): whether the id is recorded in the worker's held
    set and whether its process list exists, a moment after the SCAN.

    One SCAN is not a snapshot: an empty dequeue records its id and withdraws it one
    round trip later, and a held set created while the SCAN ran can be missed. A
    finding is kept only if it still holds at the second look.
    """
    if not candidates:
        return []
    await anyio.sleep(_SECOND_LOOK)
    async with r.pipeline(transaction=False) as pipe:
        for queue, worker_id, pid in candidates:
            pipe.execute_command("SISMEMBER", keys.held(queue, worker_id), pid)
            pipe.execute_command("EXISTS", keys.process(queue, pid))
        replies = await pipe.execute()
    return [
        (bool(recorded), bool(exists))
        for recorded, exists in zip(replies[::2], replies[1::2], strict=True)
    ]


async def inspect(r: Client, keys: Keys) -> list[Problem]:
    """Every violation of the invariants in the state under ``keys.prefix``."""
    state = await _read(r, keys)
    problems: list[Problem] = []
    recorded = {(queue, pid) for (queue, _), pids in state.held.items() for pid in pids}
    orphans = [
        (queue, parse_process_id(pid).worker_id, pid)
        for queue, pid in sorted(state.process_lengths)
        if (queue, pid) not in recorded
    ]
    dangling = [
        (queue, worker_id, pid)
        for (queue, worker_id), pids in sorted(state.held.items())
        for pid in sorted(pids)
        if (queue, pid) not in state.process_lengths
    ]
    looks = await _second_look(r, keys, orphans + dangling)
    for (queue, owner, pid), (is_recorded, exists) in zip(
        orphans, looks[: len(orphans)], strict=True
    ):
        if exists and not is_recorded:
            problems.append(
                Problem("orphan-process", "a process list no worker records", queue, owner, pid)
            )
    for (queue, pid), length in sorted(state.process_lengths.items()):
        if (queue, pid) in recorded and length != 1:
            owner = parse_process_id(pid).worker_id
            problems.append(
                Problem("malformed-process", f"a process list of {length} tasks", queue, owner, pid)
            )
    for (queue, worker_id, pid), (is_recorded, exists) in zip(
        dangling, looks[len(orphans) :], strict=True
    ):
        if is_recorded and not exists:
            problems.append(
                Problem(
                    "dangling-process-id",
                    "a recorded process id without its process list",
                    queue,
                    worker_id,
                    pid,
                )
            )
    dead_holders = {w for (_, w), pids in state.held.items() if pids and w not in state.alive}
    for worker_id in sorted(dead_holders | (state.workers - state.alive)):
        problems.append(
            Problem(
                "dead-worker",
                "a worker without heartbeat still listed or holding processes",
                worker_id=worker_id,
            )
        )
    for queue, workers in sorted(state.holders.items()):
        for worker_id in sorted(workers):
            if worker_id not in state.alive and (queue, worker_id) not in state.held:
                problems.append(
                    Problem(
                        "stale-holder",
                        "a dead worker named as holder of a queue",
                        queue,
                        worker_id,
                    )
                )
    for worker_id in sorted(state.work_lists - state.alive - state.workers):
        problems.append(
            Problem("stale-work-list", "the work list of a gone worker", worker_id=worker_id)
        )
    for worker_id in sorted(state.alive - state.workers):
        problems.append(
            Problem(
                "unregistered-worker",
                "a live worker missing from the registry",
                worker_id=worker_id,
            )
        )
    for queue in sorted(state.queues_with_tasks - state.queues):
        problems.append(
            Problem("unregistered-queue", "a queue with tasks missing from the registry", queue)
        )
    return problems
