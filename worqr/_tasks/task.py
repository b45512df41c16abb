"""`Task`: a function registered on a `Tasks` registry, submitted with its own typed
arguments; `TaskJob`: the handle on one call, whose result comes back decoded."""

from __future__ import annotations

import dataclasses
import datetime
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from typing_extensions import ParamSpec, TypedDict, Unpack

from .._job import Job
from .._layout.envelope import MAX_FUNCTION
from .._layout.jobs import Backoff, JobInfo, JobStatus, Options
from .._layout.jobs import options as job_options
from .._peer.handlers import is_async
from .._worqr import Worqr, submit_with
from .codecs import Codec
from .shape import Shape

if TYPE_CHECKING:
    from .context import Context as Context

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class CallOptions(TypedDict, total=False):
    """The job options of one call (`Task.with_options`); each one left out keeps the
    task's own (see `Tasks.task`), and for the rest `Worqr.submit`'s default."""

    delay: float | None
    at: datetime.datetime | float | None
    job_id: str | None
    priority: str
    unique: bool
    max_attempts: int
    backoff: Backoff | float | None
    timeout: float | None
    result_ttl: float
    after: Sequence[str | Job | TaskJob[Any]] | None


_JOB_OPTIONS = frozenset(
    ("max_attempts", "backoff", "timeout", "delay", "at", "result_ttl", "unique", "priority")
)
"""The options that `_layout.jobs.options` checks (``job_id`` and ``after`` go apart)."""
_OPTIONS = frozenset(CallOptions.__annotations__)


def merged(base: Mapping[str, Any], given: Mapping[str, object]) -> dict[str, Any]:
    """``base`` with the options ``given`` over it, checked: `TypeError` naming an
    unknown one. A due time given (``delay`` or ``at``) replaces the other one."""
    unknown = sorted(set(given) - _OPTIONS)
    if unknown:
        raise TypeError(
            f"with_options got an unknown option {unknown[0]!r}"
            f" (the options are {', '.join(sorted(_OPTIONS))})"
        )
    options = dict(base)
    for due, other in (("delay", "at"), ("at", "delay")):
        if due in given:
            options.pop(other, None)
    options.update(given)
    checked_options(options)
    return options


class TaskJob(Generic[R_co]):
    """A handle on one call of a task function: a `Job` whose `result` is the
    function's return value, decoded to its declared type."""

    __slots__ = ("_decode", "job")

    def __init__(self, job: Job, decode: Callable[[str | None], R_co]) -> None:
        self.job = job
        """The job underneath (its result as stored: the encoded text)."""
        self._decode = decode

    def __repr__(self) -> str:
        return f"TaskJob(queue={self.job.queue!r}, id={self.job.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskJob) and other.job == self.job

    def __hash__(self) -> int:
        return hash(self.job)

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def queue(self) -> str:
        return self.job.queue

    async def result(self, timeout: float | None = None) -> R_co:
        """Wait for the call to end and return what the function returned, decoded
        (`Job.result` for the waiting: `JobFailedError` if it failed, `TimeoutError`
        after ``timeout`` seconds); `ValueError` if the stored result does not decode
        to the declared type (a worker whose function returns another)."""
        return self._decode(await self.job.result(timeout))

    async def status(self) -> JobStatus:
        return await self.job.status()

    async def info(self) -> JobInfo | None:
        return await self.job.info()

    async def cancel(self) -> bool:
        return await self.job.cancel()


class Task(Generic[P, R]):
    """A task function on its registry. ``await task.submit(worqr, *args, **kwargs)``
    submits a call (the function's own parameters, its Context left out) as a job
    and returns its `TaskJob`; ``task.with_options(delay=5).submit(...)`` sets job
    options for one call. ``task.function`` is the function itself, for tests."""

    __slots__ = ("_options", "codec", "function", "is_async", "name", "queue", "shape")

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        name: str,
        queue: str,
        codec: Codec,
        shape: Shape,
        options: Mapping[str, Any],
    ) -> None:
        self.function = function
        self.is_async = is_async(function) or is_async(inspect.unwrap(function))
        """A coroutine function; else a plain ``def``, run in a worker thread."""
        self.name = name
        self.queue = queue
        self.codec = codec
        self.shape = shape
        self._options = dict(options)

    def __repr__(self) -> str:
        return f"Task({self.name!r}, queue={self.queue!r})"

    @property
    def options(self) -> Mapping[str, Any]:
        """The job options every call gets unless it sets its own."""
        return dict(self._options)

    def with_options(self, **options: Unpack[CallOptions]) -> TaskCall[P, R]:
        """This task with job options for one call (checked now)."""
        return TaskCall(self, merged(self._options, options))

    async def submit(self, worqr: Worqr, /, *args: P.args, **kwargs: P.kwargs) -> TaskJob[R]:
        """Submit a call of the function with these arguments (see `Tasks`)."""
        return await TaskCall(self, self._options).submit(worqr, *args, **kwargs)

    def job(self, worqr: Worqr, job_id: str) -> TaskJob[R]:
        """A handle on the call ``job_id`` of this task, made earlier (no I/O)."""
        return TaskJob(worqr.job(self.queue, job_id), self.decode_result)

    def decode_result(self, raw: str | None) -> R:
        """A call's stored result as the declared type (`TaskJob.result`)."""
        if raw is None:  # finished with no result by a handler that is not a Tasks'
            return None  # type: ignore[return-value]  # what that handler stored
        value: R = self.codec.decode(raw, self.shape.result)
        return value


class TaskCall(Generic[P, R]):
    """A task with the job options of one call (`Task.with_options`)."""

    __slots__ = ("_options", "task")

    def __init__(self, task: Task[P, R], options: Mapping[str, Any]) -> None:
        self.task = task
        self._options = options

    def with_options(self, **options: Unpack[CallOptions]) -> TaskCall[P, R]:
        return TaskCall(self.task, merged(self._options, options))

    async def submit(self, worqr: Worqr, /, *args: P.args, **kwargs: P.kwargs) -> TaskJob[R]:
        """Submit a call of the function with these arguments and this call's options."""
        task = self.task
        if not isinstance(worqr, Worqr):
            raise TypeError(
                f"submit takes the Worqr first, then {task.name}'s arguments;"
                f" got {type(worqr).__name__}"
            )
        unique = bool(self._options.get("unique"))
        try:
            payload = task.shape.encode_call(task.codec, args, kwargs, deterministic=unique)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            kind = ValueError if isinstance(exc, ValueError) else TypeError
            raise kind(f"{task.name}: {exc}") from None
        job = await submit_call(
            worqr, task.queue, task.name, payload, self._options, codec=task.codec.name
        )
        return TaskJob(job, task.decode_result)


async def submit_call(
    worqr: Worqr,
    queue: str,
    function: str,
    payload: str,
    options: Mapping[str, Any],
    *,
    codec: str = "json",
) -> Job:
    """Submit a call of ``function`` whose arguments ``payload`` holds, encoded in
    ``codec`` already, with the job options ``options`` (`CallOptions`): a typed
    `Task`'s submit, and the HTTP API's for other languages."""
    if not isinstance(function, str) or not 0 < len(function) <= MAX_FUNCTION:
        raise ValueError(f"a function's name must be 1-{MAX_FUNCTION} characters")
    choices = dataclasses.replace(checked_options(options), function=function, codec=codec)
    after = options.get("after")
    if after is not None and not isinstance(after, str | bytes):
        after = [item.job if isinstance(item, TaskJob) else item for item in after]
    return await submit_with(worqr, queue, payload, options.get("job_id"), choices, after)


def checked_options(options: Mapping[str, Any]) -> Options:
    """The checked `Options` of ``options`` (Worqr.submit's checks and defaults)."""
    return job_options(**{k: v for k, v in options.items() if k in _JOB_OPTIONS})
