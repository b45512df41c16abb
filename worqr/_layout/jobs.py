"""The job model's public values: options, backoff, retries, and what a job looks
like now."""

from __future__ import annotations

import datetime
import enum
import hashlib
import math
import random
from dataclasses import dataclass
from typing import ClassVar

from .._errors import WorqrError
from .envelope import MAX_SECONDS, MAX_UNIX_MS, Envelope, Header, new_job_id, wrap
from .levels import check_priority
from .state import JobState

_RANDOM = random.Random()  # not the module's generator, which the application owns


MAX_ATTEMPTS = 1_000_000


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before attempt n+1: ``min(maximum, initial * factor**(n-1))`` seconds, drawn
    from [d/2, d] with ``jitter`` (so that jobs failing together do not retry together)."""

    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 300.0
    jitter: bool = True

    def __post_init__(self) -> None:
        for name in ("initial", "factor", "maximum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"Backoff.{name} must be a number, not {type(value).__name__}")
            if not 0 <= value <= MAX_SECONDS:
                raise ValueError(
                    f"Backoff.{name} must be between 0 and {MAX_SECONDS:g}, got {value!r}"
                )
        if not isinstance(self.jitter, bool):
            raise TypeError(f"Backoff.jitter must be a bool, not {type(self.jitter).__name__}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based)."""
        try:
            base = self.initial * self.factor ** (attempt - 1) if self.initial else 0.0
        except OverflowError:
            base = math.inf
        d = min(self.maximum, base)
        return _RANDOM.uniform(d / 2, d) if self.jitter else d

    @classmethod
    def of(cls, value: object) -> Backoff:
        """A `Backoff` from the ``backoff`` argument: None (the default), a `Backoff`, or
        a number of seconds (a constant delay)."""
        if value is None:
            return cls()
        if isinstance(value, Backoff):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"backoff must be a Backoff or a number of seconds, not {type(value).__name__}"
            )
        return cls(initial=float(value), factor=1.0, maximum=float(value), jitter=False)


class Retry(WorqrError):
    """Raised by a handler to ask for another attempt of its job after ``delay``
    seconds (default: the job's backoff). It counts as an attempt: after the last one
    the job goes to the failed list."""

    def __init__(self, delay: float | None = None) -> None:
        if delay is not None:
            if isinstance(delay, bool) or not isinstance(delay, int | float):
                raise TypeError(f"delay must be a number of seconds, not {type(delay).__name__}")
            if not 0 <= delay <= MAX_SECONDS:
                raise ValueError(f"delay must be between 0 and {MAX_SECONDS:g} s, got {delay!r}")
        super().__init__(delay)
        self.delay = delay

    def __str__(self) -> str:
        return "retry requested" if self.delay is None else f"retry requested in {self.delay:g} s"


class JobStatus(str, enum.Enum):
    """Where a job is now: its record's `JobState`, or running, or unknown."""

    WAITING = JobState.WAITING.value
    """Submitted with ``after``: waits for those jobs to end done."""
    QUEUED = JobState.QUEUED.value
    DELAYED = JobState.DELAYED.value
    RUNNING = "running"
    DONE = JobState.DONE.value
    FAILED = JobState.FAILED.value
    UNKNOWN = "unknown"
    """Never seen, deleted, or its outcome expired (``result_ttl``)."""
    # The same members under their wire names (``JobStatus.done is JobStatus.DONE``),
    # set below the class: names, not members, so a type checker sees each status once.
    waiting: ClassVar[JobStatus]
    queued: ClassVar[JobStatus]
    delayed: ClassVar[JobStatus]
    running: ClassVar[JobStatus]
    done: ClassVar[JobStatus]
    failed: ClassVar[JobStatus]
    unknown: ClassVar[JobStatus]

    def __str__(self) -> str:
        return str.__str__(self)


for _status in JobStatus:
    setattr(JobStatus, _status.name.lower(), _status)
del _status


@dataclass(frozen=True, slots=True)
class JobInfo:
    """A job as Redis records it. Times are Unix seconds by the Redis server's clock."""

    id: str
    queue: str
    status: JobStatus
    attempts: int
    """Attempts started so far (a running attempt included)."""
    max_attempts: int
    result: str | None
    """The handler's return value, once done."""
    error: str | None
    """The error ("Type: message") of the latest failed attempt, if one failed (also
    when a later attempt succeeded)."""
    enqueued_at: float
    due_at: float | None
    """When a delayed job becomes due (also for a retry waiting out its backoff)."""
    finished_at: float | None
    after: tuple[str, ...] = ()
    """The ids a waiting job still waits for (those found live when last judged)."""
    function: str | None = None
    """The name of the task function the job calls (see `Tasks`); None for a plain
    payload."""
    progress: float | None = None
    """The fraction (0 to 1) its running attempt last reported (`Context.progress`,
    `Worqr.report_progress`); None before any report."""
    progress_note: str | None = None
    """The note that came with the last progress report, if any."""


@dataclass(frozen=True, slots=True)
class Options:
    """The checked options of a submit (see `Worqr.submit`)."""

    max_attempts: int
    backoff: Backoff
    timeout: float | None
    delay: float | None
    at_ms: int | None
    result_ttl: float
    unique: bool
    priority: str = "normal"
    function: str | None = None
    """The task function each payload calls (see `Header.function`)."""
    codec: str = "json"

    def due_ms(self, now_ms: int) -> int | None:
        """When jobs submitted at ``now_ms`` (server time) are due; None for now."""
        if self.delay is not None:
            due = now_ms + round(self.delay * 1000)
        elif self.at_ms is not None:
            due = self.at_ms
        else:
            return None
        return due if due > now_ms else None

    def envelopes(self, payloads: list[str], given: str | None, now_ms: int) -> list[Envelope]:
        """The first envelope of a job per payload: id ``given``, else one derived from
        the payload (``unique``: the same payload makes the same id), else a new one."""
        b = self.backoff
        found = []
        for payload in payloads:
            if given is not None:
                job_id = given
            elif self.unique:
                job_id = "u-" + hashlib.sha1(self._identity(payload)).hexdigest()
            else:
                job_id = new_job_id()
            header = Header(
                id=job_id,
                attempt=1,
                max_attempts=self.max_attempts,
                backoff=(b.initial, b.factor, b.maximum, b.jitter),
                timeout=self.timeout,
                result_ttl=self.result_ttl,
                enqueued_at=now_ms,
                priority=self.priority,
                function=self.function,
                codec=self.codec,
            )
            found.append(Envelope(header, payload, wrap(header, payload)))
        return found

    def _identity(self, payload: str) -> bytes:
        """What a unique job's id is derived from: the payload, and for a call the
        function too (the same arguments to two functions are two jobs)."""
        data = payload.encode("utf-8", "surrogateescape")
        if self.function is None:
            return data
        return b"%s\0%s\0%s" % (self.function.encode(), self.codec.encode(), data)


RESULT_TTL = 86400.0
"""Seconds a job's outcome stays readable unless its submit says otherwise: a day."""


def options(
    *,
    max_attempts: object = 1,
    backoff: object = None,
    timeout: object = None,
    delay: object = None,
    at: object = None,
    result_ttl: object = RESULT_TTL,
    unique: object = False,
    priority: object = "normal",
) -> Options:
    """Check the options of a submit, saying what is wrong with the first bad one
    (those not given take `Worqr.submit`'s defaults)."""
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
        raise TypeError(f"max_attempts must be an int, not {type(max_attempts).__name__}")
    if not 1 <= max_attempts <= MAX_ATTEMPTS:
        shown = max_attempts if abs(max_attempts) < MAX_ATTEMPTS * 1000 else "far out"
        raise ValueError(f"max_attempts must be from 1 to {MAX_ATTEMPTS:,}, got {shown}")
    if delay is not None and at is not None:
        raise ValueError("give delay or at, not both")
    if not isinstance(unique, bool):
        raise TypeError(f"unique must be a bool, not {type(unique).__name__}")
    return Options(
        max_attempts=max_attempts,
        backoff=Backoff.of(backoff),
        timeout=None if timeout is None else _seconds("timeout", timeout, positive=True),
        delay=None if delay is None else _seconds("delay", delay),
        at_ms=None if at is None else _unix_ms(at),
        result_ttl=_seconds("result_ttl", result_ttl),
        unique=unique,
        priority=check_priority(priority),
    )


def _seconds(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not (seconds > 0 if positive else seconds >= 0) or not seconds <= MAX_SECONDS:
        rule = "a positive" if positive else "a non-negative"
        raise ValueError(
            f"{name} must be {rule} number of seconds, at most {MAX_SECONDS:g}, got {value!r}"
        )
    return seconds


def _unix_ms(at: object) -> int:
    """``at`` (an aware datetime, or Unix seconds) as Unix ms."""
    if isinstance(at, datetime.datetime):
        if at.tzinfo is None or at.tzinfo.utcoffset(at) is None:
            raise ValueError("at must be an aware datetime (with a tzinfo), or Unix seconds")
        at = at.timestamp()
    elif isinstance(at, bool) or not isinstance(at, int | float):
        raise TypeError(f"at must be an aware datetime or Unix seconds, not {type(at).__name__}")
    if not 0 <= at <= MAX_UNIX_MS / 1000:
        raise ValueError(
            f"at must be Unix seconds between 0 and {MAX_UNIX_MS / 1000:g}, got {at!r}"
        )
    return round(at * 1000)


def fraction_of(raw: str | bytes | None) -> float | None:
    """A stored progress fraction (``progress`` of a job's record), None for none or
    for anything that is not a number from 0 to 1."""
    try:
        value = None if raw is None else float(raw)
    except ValueError:
        return None
    return value if value is not None and 0.0 <= value <= 1.0 else None
