"""How a worker ends the processes it holds: finish, stop (back to the front), fail,
and the outcome of a handler, written until Redis takes it or the lease is lost."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from .. import _ops
from .._errors import BackendError, CorruptDataError
from .._layout.keys import Keys
from .._layout.models import Process
from .._layout.names import ProcessRef, split_process_id
from .._ops.end import Failure
from .._redis.batch import GroupCommit
from .._redis.connections import Client
from .holdings import Holdings, Parts
from .leases import Leases

_END_BATCH = 256  # processes ended in one transaction at most
_End = TypeVar("_End", str | None, Failure)


_EndMany = Callable[
    [Client, Keys, str, str, Sequence[tuple[Process, _End]], int | None], Awaitable[list[bool]]
]
"""`finish_many` or `fail_many`."""


class Settler:
    """Ends this worker's processes, each fenced against a lost lease.

    A process stays held, marked as ending, until Redis has answered its end:
    forgotten earlier, the audit would find it recorded but unknown and return it to
    the queue although its handler is done.
    """

    def __init__(self, parts: Parts, holdings: Holdings, leases: Leases) -> None:
        self._parts = parts
        self._holdings = holdings
        self._leases = leases
        self.finishers: dict[str, GroupCommit[tuple[Process, str | None], bool]] = {}
        """queue -> the group commit of its finishes (made at a finish, dropped idle)."""
        self.failers: dict[str, GroupCommit[tuple[Process, Failure], bool]] = {}
        """queue -> the group commit of its failed attempts (as ``finishers``)."""

    async def finish(self, ref: ProcessRef, result: str | None) -> bool:
        """Finish a process (checked by the caller); False if it no longer exists or
        its lease was lost."""
        parts, holdings = self._parts, self._holdings
        if await self._leases.fenced(ref):
            return False
        now = await parts.clock.now_ms(parts.redis)
        with holdings.ending_process(ref.id):
            task = await _ops.end.finish(parts.redis, parts.keys, ref, result, now)
        holdings.held.pop(ref.id, None)  # known until Redis answered (an error keeps it)
        self.note(ref, task, failed=False)
        return task is not None

    async def stop(self, ref: ProcessRef, job_id: str | None, *, look: bool) -> bool:
        """Give a process up: back to the FRONT of its queue (see `_ops.stop.stop`);
        False if it no longer exists or its lease was lost."""
        parts, holdings = self._parts, self._holdings
        if await self._leases.fenced(ref):
            return False
        with holdings.ending_process(ref.id):
            task = await _ops.stop.stop(parts.once, parts.keys, ref, job_id, look=look)
        holdings.held.pop(ref.id, None)
        return task is not None

    async def settle(
        self,
        process: Process,
        outcome: str,
        detail: str | None,
        *,
        trace: str = "",
        delay: float | None = None,
    ) -> None:
        """Apply a handler's outcome to its process, retrying while Redis refuses it
        and the lease holds (a lost lease hands every process back anyway).

        ``fail``, ``retry`` (the handler raised `Retry`, ``delay`` from it) and
        ``timeout`` end the attempt as failed with the error ``detail`` (a job may be
        tried again); ``refused`` (a result neither str nor None) ends it failed for
        good; ``cancelled`` finishes a plain task and ends a job as cancelled;
        ``requeue`` sends it back to the front of its queue.
        """
        holdings = self._holdings
        ref = split_process_id(process.id)
        if await self._leases.fenced(ref):  # reported lost with the rest of the leases
            return
        action: Callable[[], Awaitable[object]]
        if outcome == "cancelled" and process.envelope is not None:
            failure = Failure(_ops.writes.CANCELLED, final=True)
            action = lambda: self._fail_batched(process, ref, failure)  # noqa: E731
        elif outcome in ("finish", "cancelled"):
            result = detail if outcome == "finish" else None
            action = lambda: self._finish_batched(process, ref, result)  # noqa: E731
        elif outcome in ("fail", "retry", "timeout", "refused"):
            # refused: the handler's work is done, never tried again
            failure = Failure(detail or "", trace, delay, final=outcome == "refused")
            action = lambda: self._fail_batched(process, ref, failure)  # noqa: E731
        elif outcome == "requeue":
            action = lambda: self.stop(ref, process.job_id, look=False)  # noqa: E731
        else:  # lost, deleted, stopped, failed, shutdown, closed: Redis already moved it
            holdings.held.pop(process.id, None)
            return
        if holdings.closed:
            return
        kept = False
        try:
            with holdings.ending_process(process.id):
                kept = await self._with_retries(process, outcome, action)
        finally:
            if not kept:
                holdings.held.pop(process.id, None)

    async def _with_retries(
        self, process: Process, outcome: str, action: Callable[[], Awaitable[object]]
    ) -> bool:
        """Run ``action`` until it succeeds or the lease is lost (a slot migrating on a
        Cluster can refuse it for longer than ``worker_timeout`` while the heartbeat,
        in another slot, goes on; given up, the audit would run the task again); True when
        it met a key of the wrong type: then the process stays held by this worker
        (forgotten, the audit would return it to the queue and run it again and again)
        until the key is repaired and the worker hands it back."""
        leases = self._leases
        epoch = leases.epoch
        try:  # outside any cancel scope: the common case costs no timer
            await action()
            return False
        except CorruptDataError as exc:
            self._failed(process, outcome, exc)
            leases.report_corrupt([exc.key or f"a key of queue {process.queue!r}"])
            return True
        except BackendError as exc:
            self._failed(process, outcome, exc)
        except Exception as exc:  # a stored value that breaks the outcome's writes
            return await self._broken(process, exc)
        backoff = 0.05
        while True:  # as long as the lease holds: giving up would run the task again
            await anyio.sleep(backoff)
            if epoch != leases.epoch or leases.lost or self._holdings.closed:
                return False
            try:
                await action()
                return False
            except CorruptDataError as exc:
                self._failed(process, outcome, exc)
                return True
            except BackendError as exc:
                self._failed(process, outcome, exc)
            except Exception as exc:
                return await self._broken(process, exc)
            backoff = min(backoff * 2, 1.0)

    async def _broken(self, process: Process, exc: Exception) -> bool:
        """End an attempt whose outcome could not be written for a reason other than
        Redis (a value in the job's envelope out of range): to the failed list, for
        good, rather than back to the queue to fail the same way again; True (keep
        it held) if even that fails."""
        log = self._parts.log
        log.exception(
            "could not apply a handler's outcome; failing the attempt for good",
            extra={"queue": process.queue, "process_id": process.id},
        )
        ref = split_process_id(process.id)
        error = f"cannot apply the outcome: {type(exc).__name__}: {exc}"
        try:
            await self.fail(ref, error, final=True, known=process.stored)
        except Exception:
            log.exception("could not fail the attempt either; it stays held")
            return True
        return False

    def _failed(self, process: Process, outcome: str, exc: BackendError) -> None:
        self._parts.reach.failed(
            f"could not {outcome} process {process.id}", exc, queue=process.queue
        )

    async def _finish_batched(self, process: Process, ref: ProcessRef, result: str | None) -> bool:
        """Finish a process this peer dequeued, together with the other processes of
        its queue that end in the same moment (one transaction per batch)."""
        finish_many = _ops.end.finish_many
        finished = await self._batched(self.finishers, finish_many, process, result)
        if not finished:
            await self._leases.fenced(ref)  # gone: see `fail`
        self.note(ref, process.task if finished else None, failed=False)
        return finished

    async def _fail_batched(self, process: Process, ref: ProcessRef, failure: Failure) -> bool:
        """End a failed attempt of a process this peer dequeued, together with the other
        failed attempts of its queue in the same moment (one transaction per batch).
        A key of the wrong type refuses the whole batch: each of its processes is then
        failed alone, so that only those whose writes meet that key stay held."""
        try:
            ended = await self._batched(self.failers, _ops.end.fail_many, process, failure)
        except CorruptDataError:
            return await self.fail(
                ref,
                failure.error,
                trace=failure.trace,
                delay=failure.delay,
                final=failure.final,
                known=process.stored,
            )
        if not ended:
            await self._leases.fenced(ref)
        self.note(ref, process.task if ended else None, failed=True)
        return ended

    async def _batched(
        self,
        groups: dict[str, GroupCommit[tuple[Process, _End], bool]],
        end: _EndMany[_End],
        process: Process,
        outcome: _End,
    ) -> bool:
        """End ``process`` with ``outcome`` in the next batch of its queue's group commit
        in ``groups`` (made at the first end, dropped once idle: none is kept idle)."""
        queue = process.queue
        group = groups.get(queue)
        if group is None:
            group = groups[queue] = self._group(queue, end)
        try:
            return await group.submit((process, outcome))
        finally:
            if group.idle and groups.get(queue) is group:
                del groups[queue]

    def _group(self, queue: str, end: _EndMany[_End]) -> GroupCommit[tuple[Process, _End], bool]:
        """The group commit of one queue's ends of one kind (`finish_many`, `fail_many`)."""
        parts = self._parts

        async def write(ends: Sequence[tuple[Process, _End]]) -> list[bool]:
            if self._leases.lost:
                return [False] * len(ends)
            now = parts.clock.estimate_ms()
            return await end(parts.redis, parts.keys, parts.worker_id, queue, ends, now)

        return GroupCommit(write, _END_BATCH)

    async def fail(
        self,
        ref: ProcessRef,
        error: str,
        *,
        trace: str = "",
        delay: float | None = None,
        final: bool = False,
        known: str | None = None,
    ) -> bool:
        """End an attempt as failed (see `_ops.end.fail`); False if the process no
        longer exists or its lease was lost."""
        parts, holdings = self._parts, self._holdings
        if await self._leases.fenced(ref):
            return False
        now = await parts.clock.now_ms(parts.redis)
        with holdings.ending_process(ref.id):
            task = await _ops.end.fail(
                parts.redis,
                parts.keys,
                ref,
                error,
                now,
                trace=trace,
                delay=delay,
                final=final,
                known=known,
            )
        if task is None:  # gone: if the lease lapsed while the end was on its way (a peer
            await self._leases.fenced(ref)  # reclaimed it), it is reported lost with the rest
        holdings.held.pop(ref.id, None)
        self.note(ref, task, failed=True)
        return task is not None

    async def reject(self, process: Process, why: str) -> None:
        """Move an unreadable task (``why``) to the failed list: one attempt, so that the tasks
        taken with it are not held up; if it fails the process stays held here (the
        audit leaves it alone) rather than going back to the head of the queue."""
        parts, holdings = self._parts, self._holdings
        ref = split_process_id(process.id)
        try:
            with holdings.ending_process(process.id):
                now = parts.clock.estimate_ms()
                task = await _ops.end.fail(parts.redis, parts.keys, ref, why, now, final=True)
        except BackendError as exc:
            parts.log.error(
                "could not move an unreadable task to the failed list: %s",
                exc,
                extra={"queue": process.queue, "process_id": process.id},
            )
            return
        holdings.held.pop(process.id, None)
        self.note(ref, task, failed=True)
        parts.log.error(
            "moved an unreadable task to the failed list",
            extra={"queue": process.queue, "process_id": process.id},
        )

    def note(self, ref: ProcessRef, task: str | None, *, failed: bool) -> None:
        """Count a process this peer ended, and keep its dequeue-to-end time."""
        if task is None:
            return
        mine = ref.worker_id == self._parts.worker_id
        duration = max(0.0, time.time() - ref.dequeued_at) if mine else None
        self._parts.stats.note(ref.queue, failed=failed, duration=duration)
