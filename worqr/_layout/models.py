"""Immutable values handed to callers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .envelope import Envelope
from .flow import RateLimit
from .names import parse_process_id

Listener = Callable[[str, str], Awaitable[None] | None]
"""An event listener: ``listener(type, message)``, a plain or a coroutine function."""


@dataclass(frozen=True, slots=True)
class Process:
    """A task being worked on: ``id`` finishes or stops exactly this copy of ``task``.

    For a job, ``task`` is its payload, and ``job_id``, ``attempt`` (1-based) and
    ``max_attempts`` say which job and attempt this is; a plain task has no job id
    and is attempt 1 of 1."""

    id: str
    task: str
    queue: str
    job_id: str | None = None
    attempt: int = 1
    max_attempts: int = 1
    envelope: Envelope | None = field(default=None, repr=False, compare=False)
    """The job's envelope as stored (None for a plain task): how the job travels."""

    @property
    def stored(self) -> str:
        """The task exactly as the queue holds it (a job's envelope)."""
        return self.task if self.envelope is None else self.envelope.raw

    @property
    def timeout(self) -> float | None:
        """Seconds this attempt may run (a job's ``timeout``), None for no limit."""
        return None if self.envelope is None else self.envelope.header.timeout

    @property
    def worker_id(self) -> str:
        """The worker holding this process."""
        return parse_process_id(self.id).worker_id

    @property
    def dequeued_at(self) -> float:
        """Unix time of the dequeue, by the dequeuing worker's clock."""
        return parse_process_id(self.id).dequeued_at


@dataclass(frozen=True, slots=True)
class FailedTask:
    """A task whose handler raised, kept in its queue's failed list until retried."""

    task: str
    """The task; bytes that are not valid UTF-8 show as lone surrogates (see `raw`)."""
    error: str
    worker_id: str
    failed_at: float
    """Unix time, by the failing worker's clock (for display only)."""
    job_id: str | None = None
    """The job's id; None for a plain task."""
    attempts: int = 1
    """How many attempts ran (1 for a plain task)."""
    traceback: str = ""
    """The traceback of the last attempt's exception, when it raised one."""
    envelope: str | None = field(default=None, repr=False, compare=False)
    """A job's last envelope as stored: `Worqr.retry_failed` submits it anew from it."""
    id: str = field(default="", compare=False)
    """The record's id, for `Worqr.retry_failed` (``only=``) and `Worqr.drop_failed`:
    16 hex digits, a digest of the record as stored. Records identical byte for byte
    (written by hand or by another client) share their id: each call takes one."""

    @property
    def raw(self) -> bytes:
        """The task's bytes exactly as they were stored in Redis."""
        return self.task.encode("utf-8", "surrogateescape")

    @property
    def readable(self) -> bool:
        """False for a task whose bytes are not valid UTF-8 (no handler can take it)."""
        return readable(self.task)


def storable(text: str) -> bool:
    """Whether worqr's clients can write ``text``: valid Unicode text, or text whose
    lone surrogates (U+DC80 to U+DCFF) stand for the undecodable bytes of a value read
    from Redis (see `readable`). Other lone surrogates have no bytes to stand for."""
    if text.isascii():  # the common case, without a copy
        return True
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def escaped(text: str) -> str:
    """``text``, with any lone surrogate that stands for no byte written as an escape
    (``\\ud800``): for messages, which must be stored and logged, not refused."""
    return text if storable(text) else text.encode("utf-8", "backslashreplace").decode()


def readable(task: str) -> bool:
    """Whether a task read from Redis is valid UTF-8 text: worqr's clients decode
    other bytes to lone surrogates, so that they survive the round trip unchanged."""
    if task.isascii():  # the common case, without a copy
        return True
    try:
        task.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A registered worker as seen from Redis."""

    id: str
    queues: tuple[str, ...]
    in_process: int
    heartbeat_age: float | None
    """Seconds since its last heartbeat (by this host's clock), None if it has none."""


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    """A snapshot of one queue: fleet-wide counts from Redis, and what this `Worqr` did
    with the queue since it was created."""

    queue: str
    queued: int
    in_process: int
    failed: int
    workers: int
    """Workers working on the queue."""
    completed_here: int
    """Processes this `Worqr` finished since it was created."""
    failed_here: int
    """Processes this `Worqr` moved to the failed list since it was created."""
    duration_p50: float | None
    """Dequeue-to-finish seconds of this `Worqr`'s recent processes, median."""
    duration_p90: float | None
    duration_p99: float | None
    delayed: int = 0
    """Jobs waiting for their due time (retries waiting out their backoff included)."""
    paused: bool = False
    rate_limit: RateLimit | None = None
    levels: dict[str, int] = field(default_factory=dict)
    """Queued tasks per priority level (``high``, ``normal``, ``low``)."""
