"""Promotion of delayed jobs: each worker wakes at the earliest due time of the queues
it works on and moves what is due to the back of the queue (`_ops.promote`).

No peer owns a queue's delayed set: every worker of the queue keeps a timer, so the
death of any one of them delays nothing. They learn due times from the ``delayed``
event that each write to the set publishes, from `_ops.promote` itself (the next due
time) and, in case an event was missed, from each worker's periodic self-check. The
promotion is guarded by WATCH, so when several workers wake at once, each job moves
once and the others find nothing left to move: a wake-up per due time per worker,
never a poll.
"""

from __future__ import annotations

import math

import anyio

from .. import _ops
from .._errors import BackendError, CorruptDataError
from .._layout.keys import Keys
from .._log import PeerLog
from .._redis.clock import ServerClock
from .._redis.connections import Client
from .._redis.reach import Reach
from .timer import MAX_WAIT, RETRY_AFTER_MS, Timer

_MAX_DIGITS = 15  # of a due time in Unix ms (the year 5138 has 15)


class Promoter(Timer):
    """Timers of one worker for the delayed sets of the queues it works on."""

    failure = "promoting delayed jobs failed"

    def __init__(
        self, client: Client, keys: Keys, clock: ServerClock, log: PeerLog, reach: Reach
    ) -> None:
        super().__init__(client, keys, log, reach)
        self._clock = clock
        self._due: dict[str, int] = {}  # queue -> earliest known due time (server ms)

    def watch(self, queue: str, due_ms: int | None) -> None:
        """Promote for ``queue`` from now on; ``due_ms`` as in `note`."""
        self._queues.add(queue)
        self.note(queue, due_ms)

    async def catch_up(self, queue: str, due_ms: int | None) -> None:
        """`note` the earliest due time of a queue this worker starts on; jobs already
        due then are promoted now, before the worker's first take (so that a strict
        consumer sees an overdue high job beside the tasks queued meanwhile), not
        when the timer comes round."""
        if due_ms is not None and queue in self._queues and due_ms <= self._clock.estimate_ms():
            await self._promote(queue)
        else:
            self.note(queue, due_ms)

    def note(self, queue: str, due_ms: int | None) -> None:
        """A due time of ``queue`` (None: nothing delayed as far as this caller knows)."""
        if due_ms is None or queue not in self._queues:
            return
        known = self._due.get(queue)
        if known is None or due_ms < known:
            self._due[queue] = due_ms
            self._wake.set()

    def hook(self, queue: str, kind: str, message: str) -> None:
        """Take the due time a ``delayed:<ms>`` event announces."""
        # A time in ms has at most `_MAX_DIGITS` digits: anything longer is not ours.
        if kind == _ops.writes.DUE_EVENT and message.isascii() and message.isdigit():
            self.note(queue, int(message[:_MAX_DIGITS]) if len(message) <= _MAX_DIGITS else None)

    def forget(self, queue: str) -> None:
        """Stop promoting for a queue this worker no longer works on."""
        super().forget(queue)
        self._due.pop(queue, None)

    def _after_failure(self) -> None:
        self._due.clear()  # each queue's self-check gives its due time back

    async def _round(self) -> None:
        """Promote what is due, then wait for the next due time or a new one."""
        now = self._clock.estimate_ms()
        for queue in [q for q, due in self._due.items() if due <= now]:
            if self._due.pop(queue, None) is not None:  # not forgotten meanwhile
                await self._promote(queue)
        self._wake = anyio.Event()  # set by what comes from now on (due times are kept)
        now = self._clock.estimate_ms()
        earliest = min(self._due.values(), default=None)
        # A long wait is cut into short ones: the clock estimate it was computed from
        # may change meanwhile (a new sample after this host's clock was stepped). A
        # due time already reached (it came while promoting) is promoted at once:
        # one the server has not reached yet comes back from `_promote` as the time
        # the estimate will reach it, so this never spins.
        wait = math.inf if earliest is None else max(0.0, (earliest - now) / 1000)
        wait = min(wait, MAX_WAIT)
        with anyio.move_on_after(wait):
            await self._wake.wait()

    async def _promote(self, queue: str) -> None:
        try:
            done = await _ops.promote.promote(
                self._client, self._keys, queue, self._clock.estimate_ms()
            )
        except BackendError as exc:
            if not isinstance(exc, CorruptDataError):
                self._reach.failed("promoting delayed jobs failed", exc, queue=queue)
            self.note(queue, self._clock.estimate_ms() + RETRY_AFTER_MS)
            return
        self._reach.answered()
        if done.next_due_ms is not None:
            # The next due time as this peer's estimate will reach it: the server said
            # how far off it is, so an estimate ahead of the server's clock does not
            # make the timer fire (and promote nothing) again and again.
            self.note(queue, self._clock.estimate_ms() + done.next_due_ms - done.now_ms)
