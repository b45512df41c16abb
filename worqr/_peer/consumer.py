"""The handler loop behind `Worqr.consume`: concurrency, cancellation, failures."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import anyio

from .._errors import BackendError, CorruptDataError
from .._layout.flow import Throttled
from .._layout.jobs import Retry
from .._layout.models import Process, escaped
from .._log import PeerLog, excerpt
from .._redis.reach import Reach
from .events import work_count
from .handlers import Refused, check_result

Handler = Callable[[Process], Awaitable[str | None]]

_MAX_BACKOFF = 2.0
_TAKE_LIMIT = 10.0
_THROTTLE_NAP = 30.0
_HAND_BACK_LIMIT = 10.0
_PRETAKEN_WINDOW = 0.05  # seconds within which a blocking take's push is announced
_HANDED_BACK = "handed back"  # why a handler was stopped: its process goes back in order
_TIMED_OUT = "timeout"  # a job's attempt ran past its timeout: a failed attempt
_REFUSED = "refused"  # no retry can change the outcome (`Refused`): failed for good


class Host(Protocol):
    """What a consumer needs from the worker that runs it (`_peer.worker.Worker`)."""

    async def take(
        self, queue: str, count: int, *, announced: bool, policy: str, normal: bool = True
    ) -> list[Process]: ...

    async def settle(
        self,
        process: Process,
        outcome: str,
        detail: str | None,
        *,
        trace: str = "",
        delay: float | None = None,
    ) -> None: ...

    def report_corrupt(self, keys: Sequence[str]) -> None: ...

    def can_block(self, queue: str) -> bool: ...

    async def block_take(self, queue: str, received: Callable[[], None]) -> list[Process]: ...

    def lease_lapsed(self) -> bool: ...

    @property
    def max_payload_bytes(self) -> int: ...


class Consumer:
    """Runs up to ``concurrency`` handlers for one queue until told to stop.

    Why a handler ends decides what happens to its process: returned -> finished;
    raised (or raised `Retry`, or ran past a job's timeout) -> a failed attempt (the
    failed list, or another attempt of a job); ``cancel`` event -> finished (a job:
    ended as cancelled; not requeued); lease lost,
    queue deleted, work stopped -> nothing (Redis already moved it); the caller
    cancelled `consume` -> back to the front of the queue.
    """

    def __init__(
        self,
        host: Host,
        queue: str,
        handler: Handler,
        concurrency: int,
        log: PeerLog,
        reach: Reach,
        *,
        policy: str = "weighted",
    ) -> None:
        self.queue = queue
        self._policy = policy
        self._log = log
        self._reach = reach
        self._host = host
        self._handler = handler
        self._concurrency = concurrency
        self._running: dict[str, tuple[Process, asyncio.Task[None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # handler tasks not yet done
        self._settling = 0  # handlers returned whose end is not yet written
        self._ending: dict[str, str] = {}
        self._wake = anyio.Event()
        self._look = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._taking = True
        self._dequeuing = False
        self._cancelled_meanwhile: set[str] = set()
        self._announced = 0  # tasks announced by ``work`` events since the last take
        self._backlog = False  # tasks may wait that the free slots could not take
        self._look_first = False  # a bare ``work:`` came: the next take reads the levels
        self._lent = False  # the waiting take's slot serves the other levels meanwhile
        self._returning = 0  # tasks of the take on their way back to the front
        self._blocker: asyncio.Task[None] | None = None  # the blocking take, while idle
        self._blocked_cancels: set[str] = set()  # cancelled as its task came in
        self._pretaken = 0  # tasks it took whose ``work`` event may still come
        self._claimed = False  # a ``work`` event counted one task as the take's
        self._block_waiting = False  # the take waits: it may be cancelled
        self._asked = 0  # tasks the dequeue in flight may return
        self._pretaken_until = 0.0
        self._name = handler_name(handler)
        self._last_return: tuple[Process, float] | None = None  # for `suspects`
        self.reason: str | None = None

    # -- signals (synchronous, called from event hooks and the facade) -----------------

    def hook(self, kind: str, message: str) -> None:
        """React to an event on the queue."""
        if kind == "work":  # "work:N" announces N tasks; a bare "work:" asks for a look
            count = work_count(message)
            if count and self._pretaken and time.monotonic() <= self._pretaken_until:
                absorbed = min(count, self._pretaken)  # the blocking take had them
                self._pretaken -= absorbed
                count -= absorbed
                if not count:
                    return
            if count and self._blocker is not None and not self._claimed:
                self._claimed = True  # the blocking take gets one of them
                count -= 1
                if not count:
                    return
            if not message:  # another level may hold them: a blocking take cannot see
                self._look_first = True  # them, nor may a take of announced normal ones
                self._lent = self._blocker is not None and self._block_waiting
            self._announced += count
            self._backlog = True
            self._wake.set()
        elif kind == "flow":  # paused, resumed or limited: look again, throttled or not
            # (a blocking take reads the flow control as its block returns: it goes on)
            self._backlog = True
            self._look.set()
            self._wake.set()
        elif kind == "cancel":
            if self._dequeuing:  # the dequeue in flight may return it
                self._cancelled_meanwhile.add(message)
            if self._blocker is not None and not self._block_waiting:
                # The take's task arrived and is on its way to a handler. A cancel
                # that came while the block still waited may predate the push that
                # fed it (a task enqueued again after `cancel_tasks` returned): it
                # must not stop that task, so only a cancel after the reply counts.
                self._blocked_cancels.add(message)
            for process, _ in list(self._running.values()):
                if process.stored == message:
                    self._end(process.id, "cancelled")
        elif kind == "lost":
            self._end(message, "lost")
        elif kind == "delete":
            self.stop("deleted", cancel=True)

    def stop(self, reason: str, *, cancel: bool) -> None:
        """Stop taking work; with ``cancel`` also cancel the running handlers."""
        self.reason = self.reason or reason
        self._halt(reason if cancel else None)

    def _halt(self, outcome: str | None) -> None:
        """Stop taking work and, given an ``outcome``, end the running handlers with it."""
        self._taking = False
        self.unblock()
        if outcome is not None:
            for pid in list(self._running):
                self._end(pid, outcome)
        self._wake.set()

    def unblock(self) -> None:
        """Stop the blocking take, if one waits (it gives its id up as it ends); one
        that received its task already goes on to start it."""
        if self._blocker is not None and self._block_waiting:
            self._blocker.cancel()

    def _end_now(self, pid: str, outcome: str) -> None:
        """Record why a handler that already returned ends otherwise (no cancel)."""
        if pid in self._running and pid not in self._ending:
            self._ending[pid] = outcome

    def _end(self, pid: str, outcome: str) -> None:
        """Cancel a running handler, recording why (the first reason decides its
        outcome). Asked again (a shutdown, a lost lease after a timeout), it cancels
        again: a handler that went on (it, or a library under it, swallowed the
        cancellation) would otherwise hold its slot, and a shutdown, for good."""
        entry = self._running.get(pid)
        if entry is None:
            return
        if pid in self._ending:
            self._log.warning(
                "cancelling again a handler that went on after its cancellation",
                extra={"queue": self.queue, "process_id": pid},
            )
        self._ending.setdefault(pid, outcome)
        entry[1].cancel()

    def suspects(self, since: float) -> list[str]:
        """The handlers of this consumer that ran at some time after ``since``
        (monotonic): those running now, and the last one that returned, if it did
        after ``since``. One of them held the event loop if it was held then."""
        found = {pid: process for pid, (process, _) in self._running.items()}
        if self._last_return is not None and self._last_return[1] >= since:
            found.setdefault(self._last_return[0].id, self._last_return[0])
        return [
            f"handler {self._name} ran process {process.id} of {process.queue!r}"
            f" (task {excerpt(process.task)})"
            for process in found.values()
        ]

    async def wait_idle(self) -> None:
        """Wait until no handler runs and no handler's end is on its way (a shutdown
        that handed back a process whose end was still being written would have its
        task run again)."""
        await self._idle.wait()

    def _check_idle(self) -> None:
        if not self._running and not self._settling:
            self._idle.set()

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Take and run work until stopped; on the caller's cancellation, hand back.

        The loop runs in a task of its own, so that the caller's cancellation never
        interrupts a dequeue midway (which would leave processes taken in Redis that
        this consumer does not know about): it becomes a request to stop, and the
        call returns (raising the cancellation) once the running handlers were
        stopped and their processes handed back.
        """
        loop = asyncio.get_running_loop().create_task(self._loop())
        try:
            await asyncio.shield(loop)
        except asyncio.CancelledError:
            self._halt(_HANDED_BACK)  # no reason: the caller cancelled, nothing ended
            with anyio.CancelScope(shield=True):
                await asyncio.wait([loop])
            raise

    async def _loop(self) -> None:
        """Each round takes as many tasks as there are free slots, in one transaction;
        fewer than asked means the queue is empty, so the loop waits for a wake-up
        (a ``work`` event or a handler ending) instead of polling."""
        backoff = 0.05
        while self._taking:
            self._wake = anyio.Event()
            free = self._free()
            try:
                if free > 0 and await self._take_and_start(free):
                    continue  # every free slot was filled: more may wait
                backoff = 0.05
            except Throttled as exc:  # the rate limit: sleep until the window frees a start
                await self._sleep(exc.wait)
                continue
            except CorruptDataError as exc:  # logged once a minute: it lasts until repaired
                self._host.report_corrupt([exc.key or f"a key of queue {self.queue!r}"])
                await anyio.sleep(_MAX_BACKOFF)
                continue
            except BackendError as exc:
                self._reach.failed("dequeue failed", exc, queue=self.queue)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            if self._taking:
                self._arm()
                await self._wake.wait()
        if self._blocker is not None:  # stopped by `_halt`: its end is awaited here
            await asyncio.wait([self._blocker])
        await self._handlers_ended()
        # Handlers stopped for the caller's cancellation are still listed: hand their
        # processes back newest first, so that the oldest ends at the head of the queue.
        with anyio.move_on_after(_HAND_BACK_LIMIT):
            for process in reversed([process for process, _ in self._running.values()]):
                self._running.pop(process.id, None)
                await self._host.settle(process, "requeue", None)
        self._check_idle()

    def _arm(self) -> None:
        """With a slot free and the queue found empty, wait for its next task in a
        blocking take too (it holds that slot): Redis hands the task over as it is
        pushed, without the round trip after a ``work`` event."""
        if (
            self._blocker is None
            and self._free() > self._asked
            and self._host.can_block(self.queue)
        ):
            self._blocked_cancels, self._claimed = set(), False
            self._block_waiting = True
            self._blocker = asyncio.get_running_loop().create_task(self._block())

    def _free(self) -> int:
        """Slots free for new tasks: the running handlers and the blocking take hold
        one each. A returned handler's slot is free before its end is written (the next
        take overlaps that end's transaction), but no more than `concurrency` ends may
        be on their way: a slow end holds the takes back instead of letting processes
        pile up."""
        held = len(self._running) + (self._blocker is not None and not self._lent)
        return min(self._concurrency - held, 2 * self._concurrency - held - self._settling)

    def _normal_free(self) -> bool:
        """Whether a take may serve the normal level: not while the waiting take's
        slot is lent (the task it may bring goes back to the front) nor while such a
        task is on its way back (a task taken behind it would run first)."""
        return not (self._lent and self._blocker is not None) and not self._returning

    def _received(self) -> None:
        """The blocking take received its task: no cancelling it from now on."""
        self._block_waiting = False

    async def _block(self) -> None:
        """The blocking take, then its task's handler; wakes the loop either way."""
        taken: list[Process] = []
        try:
            taken = await self._host.block_take(self.queue, self._received)
        except asyncio.CancelledError:
            return  # `unblock`: the take gave its id up
        except Exception as exc:  # its own failures are handled inside: not expected
            self._reach.failed("blocking take failed", exc, queue=self.queue)
            return
        finally:
            lent, self._lent = self._lent, False
            self._blocker, self._block_waiting = None, False
            if not taken:  # none came, or the queue changed: the loop looks and re-arms
                self._wake.set()
        if not taken:
            return
        if lent and len(self._running) + self._asked >= self._concurrency:  # slot lent out
            self._returning += 1
            try:
                for process in reversed(taken):
                    await self._host.settle(process, "requeue", None)
            finally:
                self._returning -= 1
                self._backlog = True
                self._wake.set()
            return
        # Its push's ``work`` event counted it already, or may still come.
        if self._claimed:
            self._claimed = False
        else:
            self._pretaken += len(taken)
            self._pretaken_until = time.monotonic() + _PRETAKEN_WINDOW
        await self._start_taken(taken, self._blocked_cancels)
        if self._announced:
            self._wake.set()  # more were announced than it took: the loop takes them
        elif self._taking:
            self._arm()  # wait for the next one the same way

    async def _sleep(self, seconds: float) -> None:
        """Sleep while throttled, waking early only to stop or for a ``flow:`` event
        (the flow control changed): work announced or a handler ending cannot make a
        rate-limited start come sooner. At most `_THROTTLE_NAP` seconds, in case that
        event was missed."""
        self._look = anyio.Event()
        with anyio.move_on_after(min(seconds, _THROTTLE_NAP)):
            while self._taking and not self._look.is_set():
                self._wake = anyio.Event()
                await self._wake.wait()

    async def _handlers_ended(self) -> None:
        """Wait until every handler task is over, its settle included (a handler
        leaves `_running` before its settle is sent)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _take_and_start(self, free: int) -> bool:
        """Dequeue up to ``free`` tasks and start a handler for each; return whether
        every free slot was filled (then more may be waiting).

        After a ``work`` event the announced count is taken without first asking
        for the queue's length, saving a round trip on the way to the handler. When
        the queue held no more than that, the consumer then waits for the next event,
        and a handler ending wakes it only while a backlog may remain: an idle
        worker spends one round trip per task on taking it, none on looking again.
        """
        if self._host.lease_lapsed():  # back from a stall: nothing until re-registered
            return False  # (the recovery announces a look at every queue)
        announced, self._announced = min(self._announced, free), 0
        if self._look_first:  # tasks of a higher level may come before the announced
            announced, self._look_first = 0, False
        count = announced or free
        self._dequeuing, self._cancelled_meanwhile = True, set()
        self._asked = count
        try:
            # A dequeue cut off here may have been applied: the take hands what it took
            # back to the front before it returns (what it cannot reach, the audit
            # returns at its next cleanup tick).
            with anyio.move_on_after(_TAKE_LIMIT):
                taken = await self._host.take(
                    self.queue,
                    count,
                    announced=bool(announced),
                    policy=self._policy,
                    normal=self._normal_free(),
                )
                await self._start_taken(taken, self._cancelled_meanwhile)
                self._backlog = len(taken) == free
                return self._backlog
            # Cut off: what it took is back at the head of the queue. Take again now,
            # not after arming the blocking take, which would race that next take for
            # those tasks and could start them out of order.
            self._backlog = True
            return True
        finally:
            self._dequeuing, self._asked = False, 0

    async def _start_taken(self, taken: list[Process], cancelled: set[str]) -> None:
        """Start a handler per process, unless the consumer stopped (hand them back,
        newest first) or the task was cancelled while the dequeue ran (in
        ``cancelled``: finish it)."""
        for position, process in enumerate(taken):
            if not self._taking:
                for late in reversed(taken[position:]):
                    await self._host.settle(late, "requeue", None)
                return
            if process.stored in cancelled:
                await self._host.settle(process, "cancelled", None)
                continue
            self._start(process)

    def _start(self, process: Process) -> None:
        """Run the handler in an asyncio task of its own (cheaper than a task group
        child with a cancel scope, which matters at thousands of tasks per second)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run_one(process))
        self._running[process.id] = (process, task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if process.timeout is not None:  # a job's attempt: cancelled when it runs over
            timer = loop.call_later(process.timeout, self._end, process.id, _TIMED_OUT)
            task.add_done_callback(lambda _: timer.cancel())
        if self._idle.is_set():
            self._idle = anyio.Event()

    async def _run_one(self, process: Process) -> None:
        if self._host.lease_lapsed():
            # The worker stalled past worker_timeout (a SIGSTOP, a blocked event loop)
            # between the dequeue and now: peers may be handing this process back
            # already, so its handler must not start. It goes back to the front of its
            # queue (fenced: not if a peer did that first), as at a fence of the whole
            # worker; the next heartbeat may well succeed, and then nothing else would.
            await self._returned(process, "requeue", None)
            return
        outcome, detail, trace, delay = "finish", None, "", None
        error: BaseException | None = None  # what the handler raised, for the log
        started = time.monotonic()
        try:
            try:
                result = await self._handler(process)
            finally:
                self._last_return = (process, time.monotonic())
            detail = check_result(result, self._host.max_payload_bytes)
            if process.timeout is not None and time.monotonic() - started > process.timeout:
                self._end_now(process.id, _TIMED_OUT)  # it ran over without yielding
        except asyncio.CancelledError as exc:
            if process.id not in self._ending:
                if not _stray():
                    raise  # not ours: the event loop is closing
                outcome, detail, error = "fail", _STRAY_CANCEL, exc
        except Retry as exc:
            outcome, detail, delay = "retry", f"Retry: {exc}", exc.delay
            if process.attempt >= process.max_attempts:
                detail += f", but attempt {process.attempt} of {process.max_attempts} was the last"
        except Refused as exc:
            outcome, detail, error = _REFUSED, escaped(f"{exc.kind}: {exc}"), exc
        except (KeyboardInterrupt, SystemExit):
            raise  # they stop the program: its tasks go back, as at any exit
        except BaseException as exc:  # an Exception, or another kind (pytest.fail's)
            outcome, detail, error = "fail", escaped(f"{type(exc).__name__}: {exc}"), exc
        if process.id in self._ending:  # cancelled by us, even if the handler swallowed it
            _uncancel()
            outcome, detail, trace, error = self._ending.pop(process.id), None, "", None
            if outcome == _HANDED_BACK:  # the loop hands it back, in queue order
                return
            if outcome == _TIMED_OUT:
                detail = (
                    f"TimeoutError: attempt {process.attempt} ran past its timeout"
                    f" of {process.timeout:g} s"
                )
        last = process.attempt >= process.max_attempts or outcome == _REFUSED
        if outcome == "fail" and error is not None and last:  # kept in the failed list
            trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        if outcome in ("fail", _TIMED_OUT, _REFUSED) or (outcome == "retry" and last):
            self._failed(process, detail or "", error, last=last)
        await self._returned(process, outcome, detail, trace=trace, delay=delay)

    async def _returned(
        self,
        process: Process,
        outcome: str,
        detail: str | None,
        *,
        trace: str = "",
        delay: float | None = None,
    ) -> None:
        """A handler's slot is free, its end on its way: the next take may overlap
        that end's transaction (see `_free`)."""
        self._running.pop(process.id, None)
        self._settling += 1
        if self._backlog:
            self._wake.set()
        try:  # no shield needed: only `_end` cancels this task, and not after the pop
            await self._host.settle(process, outcome, detail, trace=trace, delay=delay)
        finally:
            self._settling -= 1
            self._check_idle()
            if self._backlog:  # a take held back by ends on their way may go now
                self._wake.set()

    def _failed(
        self, process: Process, detail: str, exc: BaseException | None, *, last: bool
    ) -> None:
        """Log a failed attempt: a warning when another attempt comes, else an error
        (with the traceback of ``exc``, if given)."""
        what = "handler failed" if process.job_id is None else f"job {process.job_id} failed"
        self._log.log(
            logging.ERROR if last else logging.WARNING,
            "%s (attempt %d of %d%s) in %r, process %s, task %s: %s",
            what,
            process.attempt,
            process.max_attempts,
            _after(process, last, isinstance(exc, Refused)),
            process.queue,
            process.id,
            excerpt(process.task),
            detail,
            exc_info=exc if last else None,
            extra={"queue": process.queue, "process_id": process.id},
        )


def _after(process: Process, last: bool, refused: bool) -> str:
    """What comes after a failed attempt, for its log line."""
    if not last:
        return ", another follows"
    return ", not tried again" if refused and process.attempt < process.max_attempts else ""


_STRAY_CANCEL = (
    "CancelledError: the handler raised CancelledError that worqr did not send"
    " (from a task or future it awaited, cancelled elsewhere?)"
)


def handler_name(handler: Handler) -> str:
    """The module and qualified name of ``handler`` (of its class, for a callable
    instance), for log lines."""
    named = handler if hasattr(handler, "__qualname__") else type(handler)
    module = getattr(named, "__module__", None)
    name = getattr(named, "__qualname__", repr(handler))
    return f"{module}.{name}" if module else name


def _stray() -> bool:
    """Whether a CancelledError out of a handler is the handler's own (a task or
    future it awaited was cancelled by someone else), not a cancellation of the
    handler's task: its attempt fails, rather than its slot staying taken. Python
    3.10 cannot tell the two apart (no ``Task.cancelling``): there it is taken as the
    loop closing, as before."""
    if sys.version_info < (3, 11):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def _uncancel() -> None:
    """Withdraw the cancellation `Consumer._end` requested from the current task, so
    that what runs next (the settle) is not cancelled by it."""
    if sys.version_info >= (3, 11):  # before 3.11, a caught cancellation is gone
        task = asyncio.current_task()
        while task is not None and task.cancelling():
            task.uncancel()
