"""The job handle: a job's id and queue, with the calls that read or change it, and
the ``after`` list of a submit, which names jobs by id or by handle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from ._layout.deps import MAX_DEPENDENCIES
from ._layout.envelope import check_job_id
from ._layout.jobs import JobInfo, JobStatus


@dataclass(frozen=True, slots=True)
class JobCalls:
    """What a `Job` asks of the `Worqr` that made it: (queue, id) -> answer."""

    result: Callable[[str, str, float | None], Awaitable[str | None]]
    info: Callable[[str, str], Awaitable[JobInfo | None]]
    cancel: Callable[[str, str], Awaitable[bool]]


class Job:
    """A handle on a job: its id and queue, and calls that read or change it from any
    peer. Made by `Worqr.submit` or, from an id alone, by `Worqr.job` (no I/O)."""

    __slots__ = ("_calls", "id", "queue")

    def __init__(self, calls: JobCalls, queue: str, job_id: str) -> None:
        self._calls = calls
        self.queue = queue
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job(queue={self.queue!r}, id={self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Job) and (other.queue, other.id) == (self.queue, self.id)

    def __hash__(self) -> int:
        return hash((self.queue, self.id))

    async def result(self, timeout: float | None = None) -> str | None:
        """Wait for the job to end and return what its handler returned.

        Raises `JobFailedError` if it ended in the failed list (or was cancelled),
        `TimeoutError` if ``timeout`` seconds pass first, and `JobFailedError` too if
        the job is unknown (never submitted, deleted, or its outcome expired). No
        polling: it listens on the queue's ``done`` channel, and reads the stored
        outcome once subscribed (a job that ended before the call returns at once).
        """
        return await self._calls.result(self.queue, self.id, timeout)

    async def status(self) -> JobStatus:
        """Where the job is now (`JobStatus.UNKNOWN` if never seen or expired)."""
        info = await self.info()
        return JobStatus.UNKNOWN if info is None else info.status

    async def info(self) -> JobInfo | None:
        """The job's record, None if unknown."""
        return await self._calls.info(self.queue, self.id)

    async def cancel(self) -> bool:
        """Remove the job if it is waiting, queued or delayed, else cancel its running attempt
        (the ``cancel`` event). Either way it ends as failed with the error
        ``cancelled``. False if it had already ended (or is unknown)."""
        return await self._calls.cancel(self.queue, self.id)


def check_after(after: object, queue: str) -> list[str]:
    """The ids of ``after`` (a sequence of job ids or `Job` handles of ``queue``, or
    None), each once, in order."""
    if after is None:
        return []
    if isinstance(after, str | bytes) or not isinstance(after, Sequence):
        raise TypeError(f"after must be a list of job ids, not {type(after).__name__}")
    ids = list(dict.fromkeys(_id_of(item, queue) for item in after))
    if len(ids) > MAX_DEPENDENCIES:
        raise ValueError(f"a job may wait for at most {MAX_DEPENDENCIES} jobs, not {len(ids)}")
    return ids


def _id_of(item: object, queue: str) -> str:
    if isinstance(item, Job):
        if item.queue != queue:
            raise ValueError(
                f"job {item.id!r} is of queue {item.queue!r}: a job waits only for jobs"
                f" of its own queue ({queue!r})"
            )
        return item.id
    return check_job_id(item)
