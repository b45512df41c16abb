"""The handler loop behind `Worqr.consume`: concurrency, cancellation, failures."""

from __future__ import annotations

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

    async def _take(self, queue: str) -> Process | None: ...

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
        self._running: dict[str, tuple[Process, anyio.CancelScope]] = {}
        self._ending: dict[str, str] = {}
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._taking = True
        self._dequeuing = False
        self._cancelled_meanwhile: set[str] = set()
        self.reason: str | None = None

    # -- signals (synchronous, called from event hooks and the facade) -----------------

    def hook(self, kind: str, message: str) -> None:
        """React to an event on the queue."""
        if kind == "work":
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
        if pid in self._running:
            self._ending.setdefault(pid, outcome)
            self._running[pid][1].cancel()

    async def wait_idle(self) -> None:
        """Wait until no handler runs."""
        await self._idle.wait()

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Take and run work until stopped; on the caller's cancellation, hand back."""
        try:
            async with anyio.create_task_group() as tg:
                backoff = 0.05
                while self._taking:
                    self._wake = anyio.Event()
                    try:
                        while self._taking and len(self._running) < self._concurrency:
                            process = await self._take()
                            if process is None:
                                break
                            if not self._taking:  # stopped while the dequeue ran
                                with anyio.CancelScope(shield=True):
                                    await self._host._settle(process, "requeue", None)
                                break
                            if process.task in self._cancelled_meanwhile:
                                with anyio.CancelScope(shield=True):
                                    await self._host._settle(process, "cancelled", None)
                                continue
                            self._start(tg, process)
                        backoff = 0.05
                    except BackendError as exc:
                        self._log.warning("dequeue failed: %s", exc, extra={"queue": self.queue})
                        await anyio.sleep(backoff)
                        backoff = min(backoff * 2, _MAX_BACKOFF)
                        continue
                    if self._taking:
                        await self._wake.wait()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                # Newest first, so that the oldest ends at the head of the queue.
                for process, _ in reversed(list(self._running.values())):
                    await self._host._settle(process, "requeue", None)

    async def _take(self) -> Process | None:
        """Dequeue, shielded: a cancellation arriving mid-command must not leave a
        process taken in Redis that this consumer does not know about."""
        self._dequeuing, self._cancelled_meanwhile = True, set()
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_TAKE_LIMIT):
                return await self._host._take(self.queue)
            return None
        finally:
            self._dequeuing = False

    def _start(self, tg: anyio.abc.TaskGroup, process: Process) -> None:
        scope = anyio.CancelScope()
        self._running[process.id] = (process, scope)
        self._idle = anyio.Event()
        tg.start_soon(self._run_one, process, scope)

    async def _run_one(self, process: Process, scope: anyio.CancelScope) -> None:
        outcome, detail = "finish", None
        try:
            with scope:
                result = await self._handler(process)
                if result is not None and not isinstance(result, str):
                    raise TypeError(f"handler must return str or None, not {type(result).__name__}")
                detail = result
        except Exception as exc:
            self._log.exception(
                "handler failed", extra={"queue": process.queue, "process_id": process.id}
            )
            outcome, detail = "fail", f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            outcome, detail = self._ending.get(process.id, "cancelled"), None
        self._running.pop(process.id, None)
        self._ending.pop(process.id, None)
        try:
            with anyio.CancelScope(shield=True):
                await self._host._settle(process, outcome, detail)
        finally:
            if not self._running:
                self._idle.set()
            self._wake.set()
