"""Schedules: their definition as stored, their ticks, and what a caller reads back.

Tick times are Unix ms. ``every`` ticks fall on the multiples of the period since the
Unix epoch (``every=3600`` ticks on the hour, UTC), so every peer computes the same
ticks without agreeing on a start. ``cron`` ticks come from croniter, evaluated in the
schedule's timezone. A tick's job id is ``<name>@<tick time>``, the time in UTC ISO
8601 (``nightly@2026-11-26T03:00:00Z``; with ``.mmm`` before the Z for a period that
is no whole number of seconds).
"""

from __future__ import annotations

import datetime
import json
import re
import zoneinfo
from dataclasses import asdict, dataclass
from typing import Any

from croniter import croniter

from .._errors import CorruptDataError
from .jobs import Backoff, Options, options

MISFIRES = ("latest", "all", "skip")
MAX_MISFIRED = 100
"""Ticks ``misfire="all"`` submits at most, the most recent ones."""
MISFIRE_GRACE_MS = 1000
"""A tick found more than this late is late (and, if missed, ``misfire="skip"`` drops it)."""
MISSED_AFTER_MS = 10_000
"""A tick more than this after a schedule's latest firing pass (``seen``) passed while no
worker of its queue fired it: only such ticks are missed, and ``misfire`` applies to them."""
MAX_DUE = 1000
"""Ticks one firing pass handles at most, the most recent ones."""
MAX_NAME = 100
MIN_EVERY = 0.001
MAX_EVERY = 366 * 86_400.0
DAY = 86_400.0
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_UTC = datetime.timezone.utc


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """A schedule as Redis records it. Times are Unix seconds (server clock)."""

    name: str
    queue: str
    payload: str
    cron: str | None
    every: float | None
    timezone: str
    misfire: str
    overlap: bool
    last_tick: float | None
    """The latest tick handled (submitted, or skipped), None before the first."""
    next_tick: float | None
    """The next tick after now."""
    skipped: int = 0
    """Ticks skipped because the previous run was still live (``overlap=False``)."""
    last_job_id: str | None = None
    """The job of the latest submitted tick."""
    priority: str = "normal"
    """The level its jobs wait at."""
    late: int = 0
    """Ticks submitted late (found more than `MISFIRE_GRACE_MS`, or the period if shorter,
    after their time) because the workers of the queue were busy."""


@dataclass(frozen=True, slots=True)
class Definition:
    """What `Worqr.schedule` stores (JSON in the schedule's ``def`` field)."""

    payload: str
    cron: str | None
    every_ms: int | None
    timezone: str
    misfire: str
    overlap: bool
    options: dict[str, Any]
    """The submit options of each tick's job (see `_layout.jobs.options`)."""

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str, key: str) -> Definition:
        """A stored definition, checked as `definition` checks a new one (another
        client may have written anything); `CorruptDataError` naming ``key`` if it is
        not one."""
        try:
            fields = json.loads(raw)
            every_ms = fields["every_ms"]
            if every_ms is not None and (type(every_ms) is not int or every_ms <= 0):
                raise ValueError(f"every_ms must be a positive int, got {every_ms!r}")
            if not isinstance(fields["payload"], str) or not isinstance(fields["options"], dict):
                raise ValueError("payload must be a str and options an object")
            found = definition(
                fields["payload"],
                cron=fields["cron"],
                every=None if every_ms is None else every_ms / 1000,
                timezone=fields["timezone"],
                misfire=fields["misfire"],
                overlap=fields["overlap"],
                options=fields["options"],
            )
            found.job_options()
        except Exception as exc:  # whatever it holds, it must not stop other schedules
            raise CorruptDataError(f"{key} holds a schedule worqr cannot read: {exc}", key) from exc
        return found

    def tick_id(self, name: str, tick_ms: int) -> str:
        """The job id of one of this schedule's ticks (see `tick_id`)."""
        precise = self.every_ms is not None and self.every_ms % 1000 != 0
        return tick_id(name, tick_ms, precise=precise)

    def job_options(self) -> Options:
        """The submit options of each tick's job."""
        given = self.options
        backoff = given.get("backoff")
        return options(
            max_attempts=given.get("max_attempts", 1),
            backoff=None if backoff is None else Backoff(*backoff),
            timeout=given.get("timeout"),
            delay=None,
            at=None,
            result_ttl=given.get("result_ttl", DAY),
            unique=False,
            priority=given.get("priority", "normal"),
        )

    @property
    def grace_ms(self) -> int:
        """How late a tick may be found and still count as on time (``misfire="skip"``):
        `MISFIRE_GRACE_MS`, or the period if shorter."""
        return min(MISFIRE_GRACE_MS, self.every_ms or MISFIRE_GRACE_MS)

    def ticks(self, after_ms: int, until_ms: int, limit: int) -> list[int]:
        """The latest ``limit`` ticks t with after_ms < t <= until_ms, oldest first."""
        found: list[int] = []
        if self.every_ms is not None:
            tick = until_ms - until_ms % self.every_ms
            while tick > after_ms and len(found) < limit:
                found.append(tick)
                tick -= self.every_ms
        else:
            itr = croniter(self.cron or "", _aware(until_ms + 1, self.timezone))
            while len(found) < limit:
                tick = _ms(itr.get_prev(datetime.datetime))
                if tick <= after_ms:
                    break
                if tick <= until_ms:
                    found.append(tick)
        return found[::-1]

    def due(self, state: dict[str, str], now_ms: int) -> tuple[list[int], int | None]:
        """The ticks to submit now, oldest first, and the latest tick handled (None if
        none is due), given the schedule's stored record.

        Every tick due while a worker of the queue lived is submitted, however late the
        fleet finds it: a tick no later than `MISSED_AFTER_MS` after the first tick that
        followed ``seen``, its latest firing pass (``last``, its latest tick, in a record
        no pass of this version fired), whatever the period. Of the ticks that passed
        while none did, ``misfire`` keeps the latest, all (at most `MAX_MISFIRED`), or
        the latest if not late.
        """
        ticks = self.ticks(counted_from(state, now_ms), now_ms, MAX_DUE)
        fired = next((int(state[f]) for f in ("seen", "last") if state.get(f, "").isdigit()), None)
        alive_until = None if fired is None else self.next_after(fired) + MISSED_AFTER_MS
        live = [t for t in ticks if alive_until is not None and t <= alive_until]
        missed = ticks[len(live) :]
        if self.misfire == "all":
            kept = missed[-MAX_MISFIRED:]
        elif self.misfire == "skip" and missed and now_ms - missed[-1] > self.grace_ms:
            kept = []
        else:
            kept = missed[-1:]
        return live + kept, (ticks[-1] if ticks else None)

    def next_after(self, ms: int) -> int:
        """The first tick after ``ms``."""
        if self.every_ms is not None:
            return ms - ms % self.every_ms + self.every_ms
        itr = croniter(self.cron or "", _aware(ms, self.timezone))
        return _ms(itr.get_next(datetime.datetime))

    def info(self, name: str, queue: str, state: dict[str, str], now_ms: int) -> ScheduleInfo:
        """What a caller reads of this schedule, given its stored state."""
        last = state.get("last")
        skipped, late = state.get("skipped", "0"), state.get("late", "0")
        return ScheduleInfo(
            name=name,
            queue=queue,
            payload=self.payload,
            cron=self.cron,
            every=None if self.every_ms is None else self.every_ms / 1000,
            timezone=self.timezone,
            misfire=self.misfire,
            overlap=self.overlap,
            last_tick=int(last) / 1000 if last and last.isdigit() else None,
            next_tick=self.next_after(now_ms) / 1000,
            skipped=int(skipped) if skipped.isdigit() else 0,
            last_job_id=state.get("job"),
            priority=str(self.options.get("priority", "normal")),
            late=int(late) if late.isdigit() else 0,
        )


def counted_from(state: dict[str, str], default: int) -> int:
    """The time after which a schedule's ticks are still to be handled: the later of
    ``since`` (its definition stored) and ``last`` (its latest tick handled), from its
    stored record; ``default`` where the record holds neither."""
    times = [int(state[f]) for f in ("since", "last") if state.get(f, "").isdigit()]
    return max(times, default=default)


def _aware(ms: int, zone: str) -> datetime.datetime:
    """Unix ms as an aware datetime in ``zone`` (ms kept)."""
    at = datetime.datetime.fromtimestamp(ms / 1000, _UTC)
    return at.astimezone(zoneinfo.ZoneInfo(zone))


def _ms(at: datetime.datetime) -> int:
    return round(at.timestamp() * 1000)


def tick_id(name: str, tick_ms: int, *, precise: bool = False) -> str:
    """The job id of a schedule's tick: ``<name>@<UTC ISO 8601 time>``, with ms when
    ``precise`` (a period that is no whole number of seconds: then every id of the
    schedule has them, and its ids sort as its ticks do)."""
    at = datetime.datetime.fromtimestamp(tick_ms // 1000, _UTC)
    return f"{name}@{at:%Y-%m-%dT%H:%M:%S}{f'.{tick_ms % 1000:03d}' if precise else ''}Z"


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid schedule name."""
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, not {type(name).__name__}")
    if not 0 < len(name) <= MAX_NAME or not _NAME.fullmatch(name):
        raise ValueError(
            f"schedule name must be 1-{MAX_NAME} characters of A-Z a-z 0-9 _ . : -, got {name!r}"
        )
    return name


def stored_options(given: Options) -> dict[str, Any]:
    """The submit options a definition keeps (as JSON) for each tick's job."""
    b = given.backoff
    return {
        "max_attempts": given.max_attempts,
        "backoff": [b.initial, b.factor, b.maximum, b.jitter],
        "timeout": given.timeout,
        "result_ttl": given.result_ttl,
        "priority": given.priority,
    }


def definition(
    payload: str,
    *,
    cron: object,
    every: object,
    timezone: object,
    misfire: object,
    overlap: object,
    options: dict[str, Any],
) -> Definition:
    """Check `Worqr.schedule`'s arguments, saying what is wrong with the first bad one."""
    if (cron is None) == (every is None):
        raise ValueError("give exactly one of cron and every")
    every_ms = None
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int | float):
            raise TypeError(f"every must be a number of seconds, not {type(every).__name__}")
        if not MIN_EVERY <= every <= MAX_EVERY:
            raise ValueError(
                f"every must be from 0.001 seconds to 366 days ({MAX_EVERY:.0f} s), got {every!r}"
            )
        every_ms = round(every * 1000)
    if cron is not None:
        if not isinstance(cron, str):
            raise TypeError(f"cron must be a str, not {type(cron).__name__}")
        if len(cron.split()) not in (5, 6):
            raise ValueError(
                f"cron must have 5 fields (or 6, the last one seconds), got {len(cron.split())}:"
                f" {cron!r}"
            )
        try:
            croniter(cron)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cron {cron!r} is not a valid cron expression: {exc}") from exc
    if not isinstance(timezone, str):
        raise TypeError(f"timezone must be a str, not {type(timezone).__name__}")
    try:
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"timezone must be an IANA time zone name, got {timezone!r}") from exc
    if misfire not in MISFIRES:
        raise ValueError(f"misfire must be one of {', '.join(MISFIRES)}, got {misfire!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, not {type(overlap).__name__}")
    made = Definition(
        payload=payload,
        cron=cron,
        every_ms=every_ms,
        timezone=timezone,
        misfire=str(misfire),
        overlap=overlap,
        options=options,
    )
    if cron is not None:
        try:
            made.next_after(0)
        except ValueError as exc:  # croniter found no date: 30 February, say
            raise ValueError(f"cron {cron!r} never fires") from exc
    return made
