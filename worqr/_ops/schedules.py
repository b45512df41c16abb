"""The atomic operations of schedules (see `_layout.schedules`): store, drop, read, fire.

A schedule lives in its queue's hash slot (``s:<name>``, listed in the queue's
``schedules`` set), so that the claim of a tick and the submission of its job are
one transaction; the fleet-wide ``schedules`` registry maps names to queues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio.client import Pipeline

from .._errors import CorruptDataError, is_wrong_type, redis_boundary
from .._layout.envelope import Envelope
from .._layout.keys import Keys
from .._layout.schedules import Definition
from .._layout.state import JobState
from .._redis.connections import Client
from .._redis.replies import fields_of, members, server_ms, text
from .commands import Command, _beside, _corrupt, _optimistic, _raise_wrong, call, read, reads
from .writes import _record_job, announce, event, live_score, new_life

SCHEDULE_EVENT = "schedule"
"""The event (``schedule:<name>``) telling a queue's workers that one of its
schedules was stored or dropped: they read it again."""


@redis_boundary
async def claim(r: Client, keys: Keys, name: str, queue: str | None) -> str | None:
    """Point the registry entry of a schedule at ``queue`` (None: remove it); return
    the queue it named before. The registry decides which queue's copy of a schedule
    is its own: a copy elsewhere is an orphan, which `fire_due` removes instead of firing.

      1. WATCH <prefix>:schedules;  HGET <prefix>:schedules <name>     -> before
      2. MULTI;  HSET <prefix>:schedules <name> <queue> (or HDEL);  EXEC  -> nil: back to 1
    """

    async def body(pipe: Pipeline) -> str | None:
        found = await read(pipe, "HGET", keys.schedules, name)
        pipe.multi()
        if queue is None:
            pipe.execute_command("HDEL", keys.schedules, name)
        else:
            pipe.execute_command("HSET", keys.schedules, name, queue)
        return None if found is None else text(found)

    before, _ = await _optimistic(r, [keys.schedules], body)
    return before


@redis_boundary
async def store(
    r: Client,
    keys: Keys,
    queue: str,
    name: str,
    definition: Definition,
    carried: dict[str, str] | None = None,
) -> bool:
    """Store a schedule in its queue (replacing its definition, keeping its record of
    ticks); whether anything changed. A new definition counts ticks from now on; one
    ``carried`` over from another queue (its record as `drop` returned it) counts them
    from that queue's latest tick, so that a move neither repeats nor skips one.

      1. WATCH s:<name>;  HGET s:<name> def     -> the same: UNWATCH, return False
      2. TIME                                   -> now
      3. MULTI;  HSET s:<name> def <json> since <now or the carried last tick>
         [last <the carried last tick> job .. skipped .. seen .. late ..];
         SADD schedules <name>
         PUBLISH events schedule:<name>;  EXEC  -> nil: back to 1
    """
    key, raw = keys.schedule(queue, name), definition.dumps()
    kept: dict[str, str] = {
        f: carried[f]
        for f in ("last", "job", "skipped", "seen", "late")
        if carried and f in carried
    }

    async def body(pipe: Pipeline) -> bool:
        (found,) = await _beside(pipe, [("HGET", key, "def")])
        _raise_wrong([("HGET", key)], [found])
        if found is not None and text(found) == raw and not kept:
            return False
        now = server_ms(await call(pipe, "TIME"))
        since = kept.get("last") or (carried or {}).get("since") or now
        pipe.multi()
        pipe.execute_command("HSET", key, "def", raw, "since", since, *_flat(kept))
        pipe.execute_command("SADD", keys.queue_schedules(queue), name)
        pipe.execute_command("PUBLISH", keys.events(queue), event(SCHEDULE_EVENT, name))
        return True

    changed, replies = await _optimistic(r, [key], body)
    if any(is_wrong_type(reply) for reply in replies):
        raise _corrupt(keys.queue_schedules(queue))
    return changed


def _flat(fields: dict[str, str]) -> list[str]:
    return [part for pair in fields.items() for part in pair]


@redis_boundary
async def drop(r: Client, keys: Keys, queue: str, name: str) -> dict[str, str] | None:
    """Remove a schedule's copy from a queue; its record as it was (None if there was
    none), read in the same transaction, so that a tick fired just before is in it.

      1. WATCH s:<name>;  HGETALL s:<name>      -> empty: UNWATCH (still SREM)
      2. MULTI;  DEL s:<name>;  SREM schedules <name>;  PUBLISH events schedule:<name>
         EXEC                                   -> nil: back to 1
    """
    key = keys.schedule(queue, name)

    async def body(pipe: Pipeline) -> dict[str, str] | None:
        (raw,) = await _beside(pipe, [("HGETALL", key)])
        state = None if is_wrong_type(raw) or not raw else fields_of(raw)
        pipe.multi()
        pipe.execute_command("DEL", key)
        pipe.execute_command("SREM", keys.queue_schedules(queue), name)
        pipe.execute_command("PUBLISH", keys.events(queue), event(SCHEDULE_EVENT, name))
        return state

    state, _ = await _optimistic(r, [key], body)
    return state


@redis_boundary
async def drop_orphan(r: Client, keys: Keys, queue: str, name: str) -> bool:
    """Remove a copy of a schedule that the registry does not name (`claim`): the
    repair of ``orphan-schedule``; whether it was removed.

      1. WATCH s:<name>;  HGET <prefix>:schedules <name>   -> <queue>: UNWATCH, False
      2. MULTI;  DEL s:<name>;  SREM schedules <name>;  EXEC  -> nil: back to 1
    """
    key = keys.schedule(queue, name)

    async def body(pipe: Pipeline) -> bool:
        if await queue_of(r, keys, name) == queue:  # claimed by a store meanwhile
            await pipe.reset()
            return False
        pipe.multi()
        pipe.execute_command("DEL", key)
        pipe.execute_command("SREM", keys.queue_schedules(queue), name)
        return True

    dropped, _ = await _optimistic(r, [key], body)
    return dropped


@redis_boundary
async def queue_of(r: Client, keys: Keys, name: str) -> str | None:
    """The queue a schedule submits to, by the registry; None if none.

    1. HGET <prefix>:schedules <name>
    """
    (found,) = await reads(r, [("HGET", keys.schedules, name)])
    if is_wrong_type(found):
        raise _corrupt(keys.schedules)
    return None if found is None else text(found)


@dataclass(frozen=True, slots=True)
class Stored:
    """A schedule as read: its definition (None if unreadable) and its state."""

    name: str
    queue: str
    definition: Definition | None
    state: dict[str, str]


@redis_boundary
async def registry(r: Client, keys: Keys) -> dict[str, str]:
    """Every registered schedule: name -> queue.

    1. HGETALL <prefix>:schedules
    """
    (found,) = await reads(r, [("HGETALL", keys.schedules)])
    if is_wrong_type(found):
        raise _corrupt(keys.schedules)
    return fields_of(found)


@redis_boundary
async def read_schedules(r: Client, keys: Keys, where: Sequence[tuple[str, str]]) -> list[Stored]:
    """The schedules (name, queue) given that exist, in that order; one round trip.

    1. HGETALL s:<name>   (each)
    """
    replies = await reads(r, [("HGETALL", keys.schedule(queue, name)) for name, queue in where])
    found = []
    for (name, queue), reply in zip(where, replies, strict=True):
        if is_wrong_type(reply) or not reply:
            continue
        state = fields_of(reply)
        try:
            definition = Definition.loads(state.get("def", ""), keys.schedule(queue, name))
        except CorruptDataError:
            definition = None
        found.append(Stored(name, queue, definition, state))
    return found


@redis_boundary
async def of_queue(r: Client, keys: Keys, queue: str) -> list[Stored]:
    """The schedules of one queue.

    1. SMEMBERS schedules
    2. HGETALL s:<name>   (each)
    """
    (names,) = await reads(r, [("SMEMBERS", keys.queue_schedules(queue))])
    return await read_schedules(r, keys, [(name, queue) for name in members(names)])


@dataclass(frozen=True, slots=True)
class Firing:
    """What one look at a schedule did."""

    submitted: list[str]
    """Job ids of the ticks submitted."""
    skipped: bool
    """A due tick was skipped: its previous run was still live (``overlap=False``)."""
    next_ms: int | None
    """The next tick after the server's now; None if the schedule is gone (or broken)."""
    now_ms: int
    late_ms: list[int] = field(default_factory=list)
    """How late each tick submitted late was found (see `ScheduleInfo.late`)."""


async def fire(r: Client, keys: Keys, queue: str, name: str) -> Firing:
    """`fire_due` for one schedule."""
    return (await fire_due(r, keys, queue, [name]))[name]


@redis_boundary
async def fire_due(r: Client, keys: Keys, queue: str, names: Sequence[str]) -> dict[str, Firing]:
    """Submit the due ticks of a queue's schedules ``names`` as jobs, each exactly once,
    fleet-wide, in a number of round trips that does not grow with how many are due.

    The records of the ticks handled and the jobs move in one transaction, watched: of
    the workers that wake for a tick, one submits it and the others find it handled.
    Ticks already in the job index (a job made by hand under a tick's id) are not
    submitted again. Which ticks are due: `Definition.due` (a tick late because the
    workers are busy is submitted and counted ``late``; ``misfire`` applies only to
    ticks that passed while no worker fired the schedule).
    A schedule whose copy is an orphan (see `claim`), gone or unreadable fires nothing
    (next_ms None); so does one whose level list is wrong-typed (check() reports both).
    Keys: s:<name> (HASH), jobs (ZSET), j:<id>... (HASH), tasks (LIST: the list of
    the schedule's priority, see `Keys.level`).
      0. HMGET <prefix>:schedules <name>...      -> another queue, or none: an orphan
      1. WATCH s:<name>...
      2. TIME;  HGETALL s:<name>...;  TYPE high tasks low  -> due ticks (`Definition.due`);
                                                  none due anywhere: UNWATCH
      3. per schedule with due ticks: ZMSCORE jobs <id>...;
         (overlap=False) ZSCORE jobs <job>      -> +inf: skip
      4. MULTI
      5. per schedule with due ticks: HSET s:<name> last <tick> seen <now> [job <id>];
         (skipped) HINCRBY s:<name> skipped 1;  (late) HINCRBY s:<name> late <n>
      6. per job: DEL j:<id>;  HSET j:<id> ...;  ZADD jobs +inf <id>
      7. per level: RPUSH tasks <envelope>...;  PUBLISH events work:<n>
      8. EXEC                                   -> nil: back to 1
      9. SADD queues queue
    """
    (owners,) = await reads(r, [("HMGET", keys.schedules, *names)])
    if is_wrong_type(owners):
        raise _corrupt(keys.schedules)
    mine = [n for n, q in zip(names, owners, strict=True) if q is not None and text(q) == queue]
    gone = {n: Firing([], False, None, 0) for n in names if n not in mine}
    if not mine:
        return gone
    watched = [keys.schedule(queue, name) for name in mine]
    levels = keys.levels(queue)

    async def body(pipe: Pipeline) -> dict[str, Firing]:
        clock, *found = await _beside(
            pipe,
            [("TIME",), *(("HGETALL", key) for key in watched), *(("TYPE", lv) for lv in levels)],
        )
        now = server_ms(clock)
        raws, kinds = found[: len(mine)], found[len(mine) :]
        sound = {lv: text(kind) in ("list", "none") for lv, kind in zip(levels, kinds, strict=True)}
        done = dict(gone)
        plans: list[tuple[str, str, Definition, dict[str, str], list[int], int]] = []
        for name, key, raw in zip(mine, watched, raws, strict=True):
            state = {} if is_wrong_type(raw) or not raw else fields_of(raw)
            try:
                definition = Definition.loads(state.get("def", ""), key)
            except CorruptDataError:
                done[name] = Firing([], False, None, now)
                continue
            made = definition.job_options()
            ticks, latest = definition.due(state, now)
            if latest is not None and not sound[keys.level(queue, made.priority)]:
                done[name] = Firing([], False, None, now)  # check() reports the level
                continue
            done[name] = Firing([], False, definition.next_after(now), now)
            if latest is not None:
                if not definition.overlap:  # one run at a time: missed ticks beyond the
                    ticks = ticks[-1:]  # latest would run beside it
                plans.append((name, key, definition, state, ticks, latest))
        if not plans:
            await pipe.reset()
            return done
        looks: list[Command] = []
        for name, _, definition, state, ticks, _ in plans:
            ids = [definition.tick_id(name, tick) for tick in ticks]
            looks.append(("ZMSCORE", keys.jobs(queue), *ids) if ids else ("TIME",))
            previous = state.get("job") if not definition.overlap else None
            looks.append(("ZSCORE", keys.jobs(queue), previous) if previous else ("TIME",))
        replies = await _beside(pipe, looks)
        if any(is_wrong_type(reply) for reply in replies):
            await pipe.reset()
            raise _corrupt(keys.jobs(queue))
        pipe.multi()
        life = new_life()
        pushed: dict[str, list[Envelope]] = {}
        for i, (name, key, definition, state, ticks, latest) in enumerate(plans):
            scores, running = replies[2 * i], replies[2 * i + 1]
            previous = state.get("job") if not definition.overlap else None
            skipped = bool(previous) and live_score(running)
            made = definition.job_options()
            envelopes: list[Envelope] = []
            late: list[int] = []
            for tick, score in zip(ticks, scores if ticks else [], strict=True):
                if skipped or score is not None:
                    continue
                envelopes += made.envelopes(
                    [definition.payload], definition.tick_id(name, tick), now
                )
                if now - tick > definition.grace_ms:
                    late.append(now - tick)
            record: list[str | int] = ["last", latest, "seen", now]
            if envelopes:
                record += ["job", envelopes[-1].header.id]
            pipe.execute_command("HSET", key, *record)
            if skipped:
                pipe.execute_command("HINCRBY", key, "skipped", 1)
            if late:
                pipe.execute_command("HINCRBY", key, "late", len(late))
            for envelope in envelopes:
                _record_job(pipe, keys, queue, envelope, JobState.QUEUED.value, life=life)
            pushed.setdefault(made.priority, []).extend(envelopes)
            done[name] = Firing(
                [e.header.id for e in envelopes], skipped, done[name].next_ms, now, late
            )
        for priority, envelopes in pushed.items():
            if envelopes:
                pipe.execute_command(
                    "RPUSH", keys.level(queue, priority), *(e.raw for e in envelopes)
                )
                pipe.execute_command(*announce(keys, queue, priority, len(envelopes)))
        return done

    fired, _ = await _optimistic(r, watched, body)
    if any(f.submitted for f in fired.values()):
        await reads(r, [("SADD", keys.queues, queue)])
    return fired
