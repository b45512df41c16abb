"""Waiting for the outcome of jobs: futures woken by the ``done`` channel.

A waiter is registered before the subscription to the queue's ``done`` channel is
confirmed, and the job's record is read after that: a job that ended before the
call is found by the read, one that ends later by its ``done`` notice. A notice that
names the life the read found (``life``) and carries the whole outcome is the
answer; any other (an earlier life of the id, one cut short, one from an end that
does not name its life) makes the waiter read the record again. A waiter never
polls; after the subscriber reconnects (notices may have been missed), and when the
queue is deleted, every waiter reads the record again. A queue's ``done`` channel stays
subscribed a moment after its last waiter left, so that waiting on jobs one after
another does not subscribe anew each time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import ClosedError, JobFailedError
from .._layout.deps import dependencies_of
from .._layout.jobs import JobInfo, JobStatus, fraction_of
from .._layout.state import JobState
from .._ops.inspect import JobRecord
from .events import Events


class Results:
    """The waiters of one `Worqr`, per queue and job id."""

    def __init__(self, events: Events) -> None:
        self._events = events
        self._waiting: dict[str, dict[str, set[asyncio.Future[dict[str, Any] | None]]]] = {}
        self._leaving: dict[str, asyncio.TimerHandle] = {}  # queue -> its unsubscription

    async def wait(
        self, queue: str, job_id: str, record: Callable[[], Awaitable[JobRecord | None]]
    ) -> JobInfo:
        """The job's record once it ended (`JobFailedError` if there is none): read
        once subscribed to the ``done`` channel, and again after each notice of the
        job, reconnect or deletion of the queue."""
        while True:
            notice = self.expect(queue, job_id)
            try:
                await self._events.settled(queue)
                found = await record()
                if found is None:
                    raise JobFailedError(
                        job_id, "unknown job (never submitted, deleted, or expired)", 0
                    )
                info = job_info(queue, job_id, found)
                if info.status in _ENDED:
                    return info
                heard = await notice
                if heard is None:
                    continue  # a reconnect or a deletion: read again
                told = _told(info, found, heard)
                if told is not None:  # the whole outcome of the life read above
                    return told
                found = await record()
                info = (
                    from_notice(queue, job_id, heard)
                    if found is None
                    else job_info(queue, job_id, found)
                )
                if info.status in _ENDED:
                    return info
                # The notice was of an earlier life (submitted anew since): wait on.
            finally:
                self.drop(queue, job_id, notice)

    def expect(self, queue: str, job_id: str) -> asyncio.Future[dict[str, Any] | None]:
        """A future set with the job's ``done`` record when one is heard (None: look
        again, after a reconnect). The first waiter of a queue subscribes to its
        ``done`` channel."""
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        leaving = self._leaving.pop(queue, None)
        if leaving is not None:
            leaving.cancel()  # still subscribed: no new subscription needed
        if queue not in self._waiting:
            self._waiting[queue] = {}
            if leaving is None:
                self._events.watch_done(queue, self._hook(queue))
        self._waiting[queue].setdefault(job_id, set()).add(future)
        return future

    def drop(self, queue: str, job_id: str, future: asyncio.Future[Any]) -> None:
        """Forget a waiter; `_LINGER` seconds after the last one of a queue left, the
        queue's ``done`` channel is unsubscribed."""
        jobs = self._waiting.get(queue)
        if jobs is None:
            return
        futures = jobs.get(job_id, set())
        futures.discard(future)
        if not futures:
            jobs.pop(job_id, None)
        if not jobs and queue not in self._leaving:  # the next wait may come soon
            self._leaving[queue] = asyncio.get_running_loop().call_later(
                _LINGER, self._leave, queue
            )

    def _leave(self, queue: str) -> None:
        """Unsubscribe from a queue's ``done`` channel that no one waited on lately."""
        self._leaving.pop(queue, None)
        if not self._waiting.get(queue):
            self._waiting.pop(queue, None)
            self._events.unwatch_done(queue)

    def close(self) -> None:
        """End every wait: the `Worqr` closed (`ClosedError`)."""
        for leaving in self._leaving.values():
            leaving.cancel()
        self._leaving.clear()
        for jobs in self._waiting.values():
            for futures in jobs.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(ClosedError("this Worqr was closed"))

    def wake_all(self) -> None:
        """Make every waiter read its job's record again (notices may have been lost)."""
        for jobs in self._waiting.values():
            for futures in jobs.values():
                for future in futures:
                    if not future.done():
                        future.set_result(None)

    def _hook(self, queue: str) -> Any:
        def hook(kind: str, message: str) -> None:
            jobs = self._waiting.get(queue)
            if not jobs or kind not in ("done", "delete"):
                return
            if kind == "delete":  # the records went with the queue: look again
                for futures in jobs.values():
                    for future in futures:
                        if not future.done():
                            future.set_result(None)
                return
            try:
                record = json.loads(message)
            except (ValueError, RecursionError):
                return
            job_id = record.get("job_id") if isinstance(record, dict) else None
            for future in jobs.get(job_id, ()) if isinstance(job_id, str) else ():
                if not future.done():
                    future.set_result(record)

        return hook


def job_info(queue: str, job_id: str, found: JobRecord) -> JobInfo:
    """A job's record as a `JobInfo`: a live job queued by its record but not in the
    task list is running (or on its way between the two)."""
    fields = found.fields
    state = fields.get("state", "")
    attempts = _int(fields.get("attempts"))
    if state == JobState.QUEUED.value and not found.queued:
        status, attempts = JobStatus.RUNNING, attempts + 1
    else:
        status = JobStatus(state) if state in _STATES else JobStatus.UNKNOWN
    return JobInfo(
        id=job_id,
        queue=queue,
        status=status,
        attempts=attempts,
        max_attempts=max(1, _int(fields.get("max"))),
        result=fields.get("result"),
        error=fields.get("error"),
        enqueued_at=_int(fields.get("enqueued")) / 1000,
        due_at=_seconds(fields.get("due")),
        finished_at=_seconds(fields.get("finished")),
        after=tuple(dependencies_of(fields.get("after")))
        if state == JobState.WAITING.value
        else (),
        function=fields.get("fn"),
        progress=fraction_of(fields.get("progress")),
        progress_note=fields.get("note"),
    )


def _told(info: JobInfo, found: JobRecord, heard: dict[str, Any]) -> JobInfo | None:
    """The outcome a ``done`` notice gives whole (not cut) for the life of the job that
    ``found`` holds (the notice names that life: ``life``), as ``info`` updated; None
    when the record must be read again (another life, or a notice without one). Only
    what `Job.result` reads comes from the notice (status, result, error, attempts);
    the other fields are those of the read before the end."""
    life = heard.get("life")
    if life is None or life != found.fields.get("life") or heard.get("truncated"):
        return None
    result, error, attempts = heard.get("result"), heard.get("error"), heard.get("attempts")
    failed = heard.get("status") == "failed"
    if not isinstance(attempts, int) or isinstance(attempts, bool):
        return None
    if not (isinstance(error, str) if failed else result is None or isinstance(result, str)):
        return None
    return dataclasses.replace(
        info,
        status=JobStatus.FAILED if failed else JobStatus.DONE,
        attempts=attempts,
        result=None if failed else result,
        error=error if failed else None,
    )


def from_notice(queue: str, job_id: str, record: dict[str, Any]) -> JobInfo:
    """What a ``done`` notice says of a job whose record has expired already."""
    failed = record.get("status") == "failed"
    result, error, attempts = record.get("result"), record.get("error"), record.get("attempts")
    if record.get("truncated"):  # a result cut to fit the notice is no result
        failed, error = True, _CUT
    return JobInfo(
        id=job_id,
        queue=queue,
        status=JobStatus.FAILED if failed else JobStatus.DONE,
        attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 0,
        max_attempts=1,
        result=result if isinstance(result, str) else None,
        error=error if isinstance(error, str) else None,
        enqueued_at=0.0,
        due_at=None,
        finished_at=None,
    )


_CUT = (
    "the outcome expired before it was read (a result_ttl shorter than the wait),"
    " and the notice carried only part of it"
)
_LINGER = 2.0  # seconds a done channel stays subscribed after its last waiter left
_STATES = {state.value for state in JobState}
_ENDED = (JobStatus.DONE, JobStatus.FAILED)


def _int(raw: str | None) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def _seconds(raw: str | None) -> float | None:
    try:
        return None if raw is None else int(raw) / 1000
    except ValueError:
        return None
