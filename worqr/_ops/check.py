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

from .._errors import CorruptDataError, InvalidProcessIdError, is_wrong_type, redis_boundary
from .._layout.deps import decode
from .._layout.flow import Flow, read_flow
from .._layout.keys import TYPES, Keys
from .._layout.names import parse_process_id
from .._layout.schedules import Definition
from .._layout.state import IN_QUEUE, LIVE, JobState
from .._redis.connections import Client
from .._redis.replies import fields_of, members, text
from .commands import Command, reads
from .writes import level_of_stored, live_score

_SECOND_LOOK = 0.1  # seconds before a dangling id is confirmed


@dataclass(frozen=True, slots=True)
class Problem:
    """One violation of the invariants."""

    kind: str
    """``orphan-process``, ``malformed-process``, ``dangling-process-id``,
    ``dead-worker``, ``stale-holder``, ``stale-work-list``, ``unregistered-worker``,
    ``unregistered-queue``, ``wrong-type`` (a key that is not of the type worqr's
    layout gives it, written by some other client), ``no-expiry`` (a heartbeat or
    the supervision lease without its expiry, which would never end),
    ``stale-deadline`` (the deadline of a process that is gone), ``dangling-job`` (a
    live entry of the job index without its record: the id would be refused forever),
    ``unindexed-job`` (a live job record missing from the index: its id would be
    accepted again while it lives), ``lost-job`` (a live job record whose envelope
    is nowhere: queued, delayed or in process) or ``stuck-waiting`` (a waiting job
    that no release will reach: in no ``after`` set of a dependency that goes on,
    nor in ``released``)."""
    detail: str
    queue: str | None = None
    worker_id: str | None = None
    process_id: str | None = None
    key: str | None = None
    """The key in question, for ``wrong-type`` and ``no-expiry``."""


@dataclass(frozen=True, slots=True)
class CheckReport:
    """What `Worqr.check` found (and, with ``repair``, fixed)."""

    problems: tuple[Problem, ...]
    repaired: bool
    """True when ``check(repair=True)`` found problems and repaired each (False when
    there was nothing to repair; every repair re-checks its finding first, so one
    that had resolved itself is left as it is)."""

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
    blocking: dict[tuple[str, str], set[str]]  # (queue, worker) -> ids of blocking takes
    holders: dict[str, set[str]]  # queue -> workers
    work_lists: set[str]  # workers with a w:queues key
    queues_with_tasks: set[str]
    wrong: list[tuple[str, str, str]]  # (key, found type, layout type)
    endless: list[str]  # heartbeats and the lease without expiry
    process_tasks: dict[tuple[str, str], str]  # (queue, id) -> its (first) task
    deadlines: dict[str, list[str]]  # queue -> process ids with a deadline
    live_jobs: dict[tuple[str, str], str]  # (queue, job id) -> live envelope
    waiting: set[tuple[str, str]]  # (queue, job id) of waiting jobs
    records: set[tuple[str, str]]  # (queue, job id) with a record
    indexed: set[tuple[str, str]]  # (queue, job id) live in the index
    settings: list[tuple[str, str, str]]  # (kind, queue, rest) of flow and s:<name> keys


@redis_boundary
async def _read(r: Client, keys: Keys) -> _State:
    """One SCAN, the type of every key met, and the reads of the well-typed ones (a
    key of the wrong type is a finding of its own and is read as empty)."""
    parsed: list[tuple[str, str, str, str]] = []  # (key, kind, owner, rest)
    async for raw in r.scan_iter(match=keys.everything, count=1000):  # every primary's
        key = text(raw)
        found = keys.parse(key)
        if found is not None:
            parsed.append((key, *found))
    layout = [(key, keys.type_of(key) or "") for key in keys.registries]
    layout += [(key, TYPES[kind]) for key, kind, _, _ in parsed]
    types = await reads(r, [("TYPE", key) for key, _ in layout])
    wrong = [  # "none": deleted since the SCAN
        (key, text(found), expected)
        for (key, expected), found in zip(layout, types, strict=True)
        if text(found) not in (expected, "none")
    ]
    bad = {key for key, _, _ in wrong}
    good = [entry for entry in parsed if entry[0] not in bad]
    process_keys = [(owner, rest) for _, kind, owner, rest in good if kind == "p"]
    held_keys = [(owner, rest) for _, kind, owner, rest in good if kind == "held"]
    blocking_keys = [(owner, rest) for _, kind, owner, rest in good if kind == "blocking"]
    holder_queues = [owner for _, kind, owner, _ in good if kind == "holders"]
    task_queues = {
        owner for _, kind, owner, _ in good if kind in ("tasks", "high", "low", "delayed")
    }
    deadline_queues = [owner for _, kind, owner, _ in good if kind == "deadlines"]
    index_queues = [owner for _, kind, owner, _ in good if kind == "jobs"]
    job_keys = [(owner, rest) for _, kind, owner, rest in good if kind == "j"]
    workers_seen = {owner for _, kind, owner, _ in good if kind in ("alive", "queues")}
    work_lists = {owner for _, kind, owner, _ in good if kind == "queues"}
    replies = await reads(
        r,
        [
            ("SMEMBERS", keys.workers),
            ("SMEMBERS", keys.queues),
            ("PTTL", keys.supervision_lease),
            *(("LLEN", keys.process(queue, pid)) for queue, pid in process_keys),
            *(("SMEMBERS", keys.held(queue, worker_id)) for queue, worker_id in held_keys),
            *(("SMEMBERS", keys.blocking(q, worker_id)) for q, worker_id in blocking_keys),
            *(("SMEMBERS", keys.holders(queue)) for queue in holder_queues),
        ],
    )
    jobs_read = await reads(
        r,
        [
            *(("LINDEX", keys.process(queue, pid), 0) for queue, pid in process_keys),
            *(("ZRANGE", keys.deadlines(queue), 0, -1) for queue in deadline_queues),
            *(("ZRANGE", keys.jobs(queue), "+inf", "+inf", "BYSCORE") for queue in index_queues),
            *(("HMGET", keys.job(queue, job_id), "state", "env") for queue, job_id in job_keys),
        ],
    )
    at = 0
    process_tasks = {
        key: text(task)
        for key, task in zip(process_keys, jobs_read[: len(process_keys)], strict=True)
        if isinstance(task, str | bytes)
    }
    at += len(process_keys)
    deadlines = {
        queue: members(reply)
        for queue, reply in zip(
            deadline_queues, jobs_read[at : at + len(deadline_queues)], strict=True
        )
    }
    at += len(deadline_queues)
    indexed = {
        (queue, job_id)
        for queue, reply in zip(index_queues, jobs_read[at : at + len(index_queues)], strict=True)
        for job_id in members(reply)
    }
    at += len(index_queues)
    states = [
        (key, fields)
        for key, fields in zip(job_keys, jobs_read[at:], strict=True)
        if not is_wrong_type(fields) and fields[0] is not None
    ]
    live_jobs = {
        key: text(fields[1])
        for key, fields in states
        if text(fields[0]) in IN_QUEUE and fields[1] is not None
    }
    waiting = {key for key, fields in states if text(fields[0]) == JobState.WAITING.value}
    workers, queues = set(members(replies[0])), set(members(replies[1]))
    endless = [keys.supervision_lease] if replies[2] == -1 else []
    at = 3
    lengths = {
        key: int(n) if isinstance(n, int) else 0
        for key, n in zip(process_keys, replies[at : at + len(process_keys)], strict=True)
    }
    at += len(process_keys)
    held = {
        key: set(members(reply))
        for key, reply in zip(held_keys, replies[at : at + len(held_keys)], strict=True)
    }
    at += len(held_keys)
    blocking = {
        key: set(members(reply))
        for key, reply in zip(blocking_keys, replies[at : at + len(blocking_keys)], strict=True)
    }
    at += len(blocking_keys)
    holders = {
        queue: set(members(reply)) for queue, reply in zip(holder_queues, replies[at:], strict=True)
    }
    everyone = sorted(
        workers
        | workers_seen
        | {w for _, w in held_keys}
        | {w for _, w in blocking_keys}
        | {w for ws in holders.values() for w in ws}
    )
    ttls = await reads(r, [("PTTL", keys.heartbeat(worker_id)) for worker_id in everyone])
    alive = {w for w, ttl in zip(everyone, ttls, strict=True) if ttl != -2}
    endless += [keys.heartbeat(w) for w, ttl in zip(everyone, ttls, strict=True) if ttl == -1]
    return _State(
        workers,
        queues,
        alive,
        lengths,
        held,
        blocking,
        holders,
        work_lists,
        task_queues,
        wrong,
        endless,
        process_tasks,
        deadlines,
        live_jobs,
        waiting,
        set(job_keys),
        indexed,
        [(kind, owner, rest) for _, kind, owner, rest in good if kind in ("flow", "s")],
    )


def _owner(pid: str) -> str | None:
    """The worker of a process id; None for an id worqr never gave out."""
    try:
        return parse_process_id(pid).worker_id
    except InvalidProcessIdError:
        return None


@redis_boundary
async def _second_look(
    r: Client, keys: Keys, candidates: list[tuple[str, str, str]]
) -> list[tuple[bool, bool]]:
    """For each (queue, worker, id): whether the id is recorded in the worker's held
    set (or, for a task a blocking take received, in its blocking set) and whether its
    process list exists, a moment after the SCAN.

    One SCAN is not a snapshot: an empty dequeue records its id and withdraws it one
    round trip later, and a held set created while the SCAN ran can be missed. A
    finding is kept only if it still holds at the second look.
    """
    if not candidates:
        return []
    await anyio.sleep(_SECOND_LOOK)
    commands: list[Command] = []
    for queue, worker_id, pid in candidates:
        commands.append(("SISMEMBER", keys.held(queue, worker_id), pid))
        commands.append(("SISMEMBER", keys.blocking(queue, worker_id), pid))
        commands.append(("EXISTS", keys.process(queue, pid)))
    replies = await reads(r, commands)
    # A set of the wrong type says nothing: its ids count as recorded (no finding).
    return [
        (any(is_wrong_type(flag) or bool(flag) for flag in (held, taking)), bool(exists))
        for held, taking, exists in zip(replies[::3], replies[1::3], replies[2::3], strict=True)
    ]


async def inspect(r: Client, keys: Keys) -> list[Problem]:
    """Every violation of the invariants in the state under ``keys.prefix``."""
    state = await _read(r, keys)
    problems: list[Problem] = []
    recorded = {(queue, pid) for (queue, _), pids in state.held.items() for pid in pids}
    # A blocking take's id has a list only once its block moved a task there.
    recorded |= {(queue, pid) for (queue, _), pids in state.blocking.items() for pid in pids}
    orphans = [
        (queue, _owner(pid) or "", pid)
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
                Problem(
                    "orphan-process", "a process list no worker records", queue, owner or None, pid
                )
            )
    for (queue, pid), length in sorted(state.process_lengths.items()):
        if (queue, pid) in recorded and length != 1:
            problems.append(
                Problem(
                    "malformed-process",
                    f"a process list of {length} tasks",
                    queue,
                    _owner(pid),
                    pid,
                )
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
    dead_holders = {
        w
        for (_, w), pids in [*state.held.items(), *state.blocking.items()]
        if pids and w not in state.alive
    }
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
            if (
                worker_id not in state.alive
                and (queue, worker_id) not in state.held
                and (queue, worker_id) not in state.blocking
            ):
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
    for key, found, expected in sorted(state.wrong):
        problems.append(Problem("wrong-type", f"a {found} where worqr keeps a {expected}", key=key))
    for key in sorted(state.endless):
        problems.append(Problem("no-expiry", "a key worqr always sets with an expiry", key=key))
    problems += await _job_problems(r, keys, state)
    problems += await _setting_problems(r, keys, state)
    return problems


async def _in_process(r: Client, keys: Keys, queues: list[str]) -> set[tuple[str, str]]:
    """(queue, task) of every process of ``queues`` now."""
    holders = await reads(r, [("SMEMBERS", keys.holders(q)) for q in queues])
    pairs = [(q, w) for q, reply in zip(queues, holders, strict=True) for w in members(reply)]
    held = await reads(r, [("SMEMBERS", keys.held(q, w)) for q, w in pairs])
    held += await reads(r, [("SMEMBERS", keys.blocking(q, w)) for q, w in pairs])
    pids = [
        (q, pid) for (q, _), reply in zip(pairs * 2, held, strict=True) for pid in members(reply)
    ]
    tasks = await reads(r, [("LINDEX", keys.process(q, pid), 0) for q, pid in pids])
    return {
        (q, text(task))
        for (q, _), task in zip(pids, tasks, strict=True)
        if isinstance(task, str | bytes)
    }


async def _dangling(r: Client, keys: Keys, found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Live index entries without a record, confirmed by a second look: the SCAN saw
    the records before the index was read, so a job submitted in between looks like
    one (its record and its entry are written in one transaction)."""
    if not found:
        return []
    await anyio.sleep(_SECOND_LOOK)
    commands: list[Command] = []
    for queue, job_id in found:
        commands += [("EXISTS", keys.job(queue, job_id)), ("ZSCORE", keys.jobs(queue), job_id)]
    replies = await reads(r, commands)
    return [
        entry
        for entry, exists, score in zip(found, replies[::2], replies[1::2], strict=True)
        if not exists and live_score(score)
    ]


async def _unindexed(r: Client, keys: Keys, state: _State) -> list[tuple[str, str]]:
    """Live job records whose id is not live in the index (a wrong-typed index deleted
    by a repair, or another client's writes), confirmed by a second read: a record
    and its index entry change in one transaction, but the first read of a Cluster
    node is no snapshot."""
    found = sorted((set(state.live_jobs) | state.waiting) - state.indexed)
    if not found:
        return []
    commands: list[Command] = []
    for queue, job_id in found:
        commands += [
            ("ZSCORE", keys.jobs(queue), job_id),
            ("HGET", keys.job(queue, job_id), "state"),
        ]
    replies = await reads(r, commands)
    return [
        entry
        for entry, score, state_now in zip(found, replies[::2], replies[1::2], strict=True)
        if not live_score(score) and isinstance(state_now, str | bytes) and text(state_now) in LIVE
    ]


async def _setting_problems(r: Client, keys: Keys, state: _State) -> list[Problem]:
    """Flow-control hashes and schedules that cannot be read: a limit that is no
    positive number (the queue hands out nothing) or a definition no worker can run."""
    commands: list[Command] = [
        read_flow(keys, queue) if kind == "flow" else ("HGET", keys.schedule(queue, rest), "def")
        for kind, queue, rest in state.settings
    ]
    (owners, *replies) = await reads(r, [("HGETALL", keys.schedules), *commands])
    registry = {} if is_wrong_type(owners) else fields_of(owners)
    problems = []
    for (kind, queue, rest), reply in zip(state.settings, replies, strict=True):
        if is_wrong_type(reply) or reply is None:
            continue  # a wrong type is its own finding; gone since the SCAN
        if kind == "s" and not is_wrong_type(owners) and registry.get(rest) != queue:
            text_ = "a copy of a schedule that the registry names elsewhere, or not at all"
            problems.append(
                Problem("orphan-schedule", text_, queue, key=keys.schedule(queue, rest))
            )
            continue
        try:
            if kind == "flow":
                Flow.parse(reply, keys.flow(queue))
            else:
                Definition.loads(text(reply), keys.schedule(queue, rest))
        except CorruptDataError as exc:
            what = "unreadable-flow" if kind == "flow" else "unreadable-schedule"
            key = keys.flow(queue) if kind == "flow" else keys.schedule(queue, rest)
            problems.append(Problem(what, str(exc), queue, key=key))
    return problems


async def _job_problems(r: Client, keys: Keys, state: _State) -> list[Problem]:
    """The findings about jobs: deadlines of gone processes, index entries without a
    record, live records whose envelope is nowhere (each confirmed by a second look)."""
    stale = [
        (queue, pid)
        for queue, pids in sorted(state.deadlines.items())
        for pid in pids
        if (queue, pid) not in state.process_lengths
    ]
    if stale:  # the SCAN came before the deadlines were read: look at those again
        await anyio.sleep(_SECOND_LOOK)
        commands: list[Command] = []
        for queue, pid in stale:
            commands += [
                ("EXISTS", keys.process(queue, pid)),
                ("ZSCORE", keys.deadlines(queue), pid),
            ]
        replies = await reads(r, commands)
        stale = [
            entry
            for entry, exists, score in zip(stale, replies[::2], replies[1::2], strict=True)
            if not exists and score is not None and not is_wrong_type(score)
        ]
    problems = [
        Problem("stale-deadline", "the deadline of a process that is gone", queue, None, pid)
        for queue, pid in stale
    ]
    problems += [
        _job_problem(
            keys,
            "dangling-job",
            f"job {job_id!r} is indexed as live but has no record",
            queue,
            job_id,
        )
        for queue, job_id in await _dangling(r, keys, sorted(state.indexed - state.records))
    ]
    problems += [
        _job_problem(
            keys,
            "unindexed-job",
            f"job {job_id!r} is live but missing from the index",
            queue,
            job_id,
        )
        for queue, job_id in await _unindexed(r, keys, state)
    ]
    in_process = {(queue, task) for (queue, _), task in state.process_tasks.items()}
    candidates = sorted(
        (queue, job_id, env)
        for (queue, job_id), env in state.live_jobs.items()
        if (queue, env) not in in_process
    )
    for _ in range(2):  # a look, and a second one a moment later: jobs move meanwhile
        if not candidates:
            break
        commands = []
        for queue, job_id, env in candidates:
            commands += [
                ("LPOS", keys.level(queue, level_of_stored(env)), env),
                ("ZSCORE", keys.delayed(queue), env),
                ("HMGET", keys.job(queue, job_id), "env"),
            ]
        replies = await reads(r, commands)
        running = await _in_process(r, keys, sorted({queue for queue, _, _ in candidates}))
        candidates = [
            candidate
            for candidate, (position, score, current) in zip(
                candidates,
                zip(replies[::3], replies[1::3], replies[2::3], strict=True),
                strict=True,
            )
            if position is None
            and score is None
            and not is_wrong_type(current)
            and current[0] is not None
            and text(current[0]) == candidate[2]
            and (candidate[0], candidate[2]) not in running
        ]
        await anyio.sleep(_SECOND_LOOK)
    problems += [
        _job_problem(
            keys, "lost-job", f"job {job_id!r} is live but its envelope is nowhere", queue, job_id
        )
        for queue, job_id, _ in candidates
    ]
    problems += [
        _job_problem(
            keys,
            "stuck-waiting",
            f"job {job_id!r} waits, but no release will reach it",
            queue,
            job_id,
        )
        for queue, job_id in await _stuck_waiting(r, keys, sorted(state.waiting))
    ]
    return problems


def _job_problem(keys: Keys, kind: str, detail: str, queue: str, job_id: str) -> Problem:
    """A finding about one job, naming its record."""
    return Problem(kind, detail, queue, key=keys.job(queue, job_id))


async def _stuck_waiting(
    r: Client, keys: Keys, candidates: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The waiting jobs that no release will reach (see `Problem`), confirmed by a
    second look: a release moves a job between ``released`` and the ``after`` sets in
    one transaction, but the reads here are no snapshot."""
    for _ in range(2):
        if not candidates:
            break
        looks = await reads(
            r,
            [
                command
                for queue, job_id in candidates
                for command in (
                    ("SISMEMBER", keys.released(queue), job_id),
                    ("HMGET", keys.job(queue, job_id), "state", "after"),
                )
            ],
        )
        waits = {
            entry: decode(text(record[1]) if record[1] is not None else None) or {}
            for entry, released, record in zip(candidates, looks[::2], looks[1::2], strict=True)
            if released == 0
            and not is_wrong_type(record)
            and record[0] is not None
            and text(record[0]) == JobState.WAITING.value
        }
        pairs = [(entry, dep, life) for entry, deps in waits.items() for dep, life in deps.items()]
        replies = await reads(
            r,
            [
                command
                for (queue, job_id), dep, _ in pairs
                for command in (
                    ("HMGET", keys.job(queue, dep), "state", "life", "waited"),
                    ("SISMEMBER", keys.after(queue, dep), job_id),
                )
            ],
        )
        reached = {
            entry
            for (entry, _, life), record, member in zip(
                pairs, replies[::2], replies[1::2], strict=True
            )
            if member == 1
            and not is_wrong_type(record)
            and record[0] is not None
            and text(record[0]) in LIVE
            and text(record[1] or "") == life
            and record[2] is not None
        }
        candidates = [entry for entry in waits if entry not in reached]
        await anyio.sleep(_SECOND_LOOK)
    return candidates
