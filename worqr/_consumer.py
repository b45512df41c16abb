"""The handler loop behind `Worqr.consume`: concurrency, cancellation, failures."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio

from ._errors import BackendError
from ._log import PeerLog
from ._models import Process

Handler = Callable[[Process], Awaitable[str | None]]

_MAX_BACKOFF = 2.0
_TAKE_LIMIT = 10.0


class Host(Protocol):
    """What a consumer needs from the `Worqr` that runs it."""

    async def _take(self, queue: str, count: int, *, announced: bool) -> list[Process]: ...

    async def _settle(self, process: Process, outcome: str, detail: str | None) -> None: ...


class Consumer:
    """Runs up to ``concurrency`` handlers for one queue until told to stop.

    Why a handler ends decides what happens to its process: returned -> finished;
    raised -> failed list; ``cancel`` event -> finished (not requeued); lease lost,
    queue deleted, work stopped -> nothing (Redis already moved it); the caller
    cancelled `consume` -> back to the front of the queue.
    """

    def __init__(
        self, host: Host, queue: str, handler: Handler, concurrency: int, log: PeerLog
    ) -> None:
        self.queue = queue
        self._log = log
        self._host = host
        self._handler = handler
        self._concurrency = concurrency
        self._running: dict[str, tuple[Process, asyncio.Task[None]]] = {}
        self._ending: dict[str, str] = {}
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._taking = True
        self._dequeuing = False
        self._cancelled_meanwhile: set[str] = set()
        self._strays: set[asyncio.Future[None]] = set()
        self._announced = 0  # tasks announced by ``work`` events since the last take
        self.reason: str | None = None

    # -- signals (synchronous, called from event hooks and the facade) -----------------

    def hook(self, kind: str, message: str) -> None:
        """React to an event on the queue."""
        if kind == "work":
            self._announced += int(message) if message.isdigit() else 1
            self._wake.set()
        elif kind == "cancel":
            if self._dequeuing:  # the dequeue in flight may return it
                self._cancelled_meanwhile.add(message)
            for process, _ in list(self._running.values()):
                if process.task == message:
                    self._end(process.id, "cancelled")
        elif kind == "lost":
            self._end(message, "lost")
        elif kind == "delete":
            self.stop("deleted", cancel=True)

    def stop(self, reason: str, *, cancel: bool) -> None:
        """Stop taking work; with ``cancel`` also cancel the running handlers."""
        self._taking = False
        self.reason = self.reason or reason
        if cancel:
            for pid in list(self._running):
                self._end(pid, reason)
        self._wake.set()

    def _end(self, pid: str, outcome: str) -> None:
        """Cancel a running handler once, recording why (which decides its outcome)."""
        if pid in self._running and pid not in self._ending:
            self._ending[pid] = outcome
            self._running[pid][1].cancel()

    async def wait_idle(self) -> None:
        """Wait until no handler runs."""
        await self._idle.wait()

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Take and run work until stopped; on the caller's cancellation, hand back.

        Each round takes as many tasks as there are free slots, in one transaction;
        fewer than asked means the queue is empty, so the loop waits for a wake-up
        (a ``work`` event or a handler ending) instead of polling.
        """
        try:
            backoff = 0.05
            while self._taking:
                self._wake = anyio.Event()
                free = self._concurrency - len(self._running)
                try:
                    if free > 0 and await self._take_and_start(free):
                        continue  # every slot asked for was filled: more may wait
                    backoff = 0.05
                except BackendError as exc:
                    self._log.warning("dequeue failed: %s", exc, extra={"queue": self.queue})
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF)
                    continue
                if self._taking:
                    await self._wake.wait()
            with anyio.CancelScope(shield=True):
                await self._handlers_ended()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                # The caller cancelled: stop the handlers, then hand their processes
                # back newest first, so that the oldest ends at the head of the queue.
                running = [process for process, _ in self._running.values()]
                for process in running:
                    self._end(process.id, "handed back")
                await self._handlers_ended()
                for process in reversed(running):
                    self._running.pop(process.id, None)
                    await self._host._settle(process, "requeue", None)
                if not self._running:
                    self._idle.set()

    async def _handlers_ended(self) -> None:
        """Wait until every handler task (and its settle) is over."""
        tasks = [task for _, task in self._running.values()]
        if tasks:
            await asyncio.wait(tasks)

    async def _take_and_start(self, free: int) -> bool:
        """Dequeue up to ``free`` tasks and start a handler for each; return whether
        every task asked for came (then more may be waiting).

        After a ``work`` event the announced count is taken without first asking
        for the queue's length, saving a round trip on the way to the handler.
        """
        announced, self._announced = min(self._announced, free), 0
        count = announced or free
        taken = await self._take(count, announced=bool(announced))
        for position, process in enumerate(taken):
            if not self._taking:  # stopped while the dequeue ran: hand back, newest first
                with anyio.CancelScope(shield=True):
                    for late in reversed(taken[position:]):
                        await self._host._settle(late, "requeue", None)
                break
            if process.task in self._cancelled_meanwhile:
                with anyio.CancelScope(shield=True):
                    await self._host._settle(process, "cancelled", None)
                continue
            self._start(process)
        return len(taken) == count

    async def _take(self, count: int, *, announced: bool) -> list[Process]:
        """Dequeue in a task of its own, so that no cancellation can interrupt it
        midway and leave processes taken in Redis that this consumer does not know
        about. If this consumer is cancelled meanwhile, what the dequeue took goes
        back to the queue before the cancellation propagates; if the dequeue outlasts
        `_TAKE_LIMIT`, whatever it takes later goes back too."""
        self._dequeuing, self._cancelled_meanwhile = True, set()
        attempt = asyncio.ensure_future(self._host._take(self.queue, count, announced=announced))
        try:
            await asyncio.wait({attempt}, timeout=_TAKE_LIMIT)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await asyncio.wait({attempt}, timeout=_TAKE_LIMIT)
                await self._hand_back(attempt)
            raise
        finally:
            self._dequeuing = False
        if not attempt.done():
            attempt.add_done_callback(self._hand_back_later)
            return []
        return attempt.result()

    async def _hand_back(self, attempt: asyncio.Future[list[Process]]) -> None:
        """Return the processes of a finished dequeue nobody will run, newest first."""
        if not attempt.done():
            attempt.add_done_callback(self._hand_back_later)
        elif not attempt.cancelled() and attempt.exception() is None:
            for process in reversed(attempt.result()):
                await self._host._settle(process, "requeue", None)

    def _hand_back_later(self, attempt: asyncio.Future[list[Process]]) -> None:
        hand_back = asyncio.ensure_future(self._hand_back(attempt))
        self._strays.add(hand_back)
        hand_back.add_done_callback(self._strays.discard)

    def _start(self, process: Process) -> None:
        """Run the handler in an asyncio task of its own (cheaper than a task group
        child with a cancel scope, which matters at thousands of tasks per second)."""
        task = asyncio.get_running_loop().create_task(self._run_one(process))
        self._running[process.id] = (process, task)
        if self._idle.is_set():
            self._idle = anyio.Event()

    async def _run_one(self, process: Process) -> None:
        outcome, detail = "finish", None
        try:
            result = await self._handler(process)
            if result is not None and not isinstance(result, str):
                raise TypeError(f"handler must return str or None, not {type(result).__name__}")
            detail = result
        except asyncio.CancelledError:
            if process.id not in self._ending:
                raise  # not ours (the event loop is closing)
        except Exception as exc:
            self._log.exception(
                "handler failed", extra={"queue": process.queue, "process_id": process.id}
            )
            outcome, detail = "fail", f"{type(exc).__name__}: {exc}"
        if process.id in self._ending:  # cancelled by us, even if the handler swallowed it
            _uncancel()
            outcome, detail = self._ending.pop(process.id), None
            if outcome == "handed back":  # the loop hands it back, in queue order
                return
        self._running.pop(process.id, None)
        try:
            with anyio.CancelScope(shield=True):
                await self._host._settle(process, outcome, detail)
        finally:
            if not self._running:
                self._idle.set()
            self._wake.set()


def _uncancel() -> None:
    """Withdraw the cancellation `Consumer._end` requested from the current task, so
    that what runs next (the settle, under a shield) is not cancelled by it."""
    if sys.version_info >= (3, 11):  # before 3.11, a caught cancellation is gone
        task = asyncio.current_task()
        while task is not None and task.cancelling():
            task.uncancel()
