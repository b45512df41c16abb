"""Driving schedules: every worker keeps a timer for the schedules of the queues it
works on, and at each tick tries `_ops.schedules.fire_due` for all of a queue's due
schedules at once.

No peer owns a schedule: each worker of its queue wakes at the tick, and the watched
transaction of `fire_due` lets exactly one of them submit it (the others find the tick
handled), so a killed, stalled or partitioned worker delays nothing while another one
lives. Workers learn of schedules when they start work on a queue, from the
``schedule:<name>`` event each store or drop publishes and, in case one was missed,
by reading the queue's schedules again every `_RELOAD` seconds. Their clocks need
not agree: the transaction judges by the server's ``TIME``.
"""

from __future__ import annotations

import anyio

from .. import _ops
from .._errors import BackendError, CorruptDataError
from .._layout.keys import Keys
from .._layout.schedules import counted_from
from .._log import PeerLog
from .._redis.clock import ServerClock
from .._redis.connections import Client
from .._redis.reach import Reach
from .timer import MAX_WAIT, RETRY_AFTER_MS, Timer

_RELOAD = 10.0  # seconds between reads of a queue's schedules (missed events)
_MIN_WAIT = 0.001


class Scheduler(Timer):
    """Timers of one worker for the schedules of the queues it works on."""

    failure = "driving schedules failed"

    def __init__(
        self, client: Client, keys: Keys, clock: ServerClock, log: PeerLog, reach: Reach
    ) -> None:
        super().__init__(client, keys, log, reach)
        self._clock = clock
        self._stale: set[str] = set()  # queues whose schedules are to be read again
        self._due: dict[tuple[str, str], int] = {}  # (queue, name) -> next tick (server ms)
        self._loaded: dict[str, float] = {}  # queue -> monotonic time of its last read
        self._late: dict[str, tuple[int, int, float]] = {}  # queue -> (ticks, most ms, since)

    def watch(self, queue: str) -> None:
        """Drive the schedules of ``queue`` from now on."""
        self._queues.add(queue)
        self._reload(queue)

    def forget(self, queue: str) -> None:
        """Stop driving the schedules of a queue this worker no longer works on."""
        super().forget(queue)
        self._stale.discard(queue)
        self._loaded.pop(queue, None)
        for key in [key for key in self._due if key[0] == queue]:
            del self._due[key]

    def hook(self, queue: str, kind: str, message: str) -> None:
        """A ``schedule:<name>`` event: read the queue's schedules again."""
        if kind == _ops.schedules.SCHEDULE_EVENT and queue in self._queues:
            self._reload(queue)

    def _reload(self, queue: str) -> None:
        self._stale.add(queue)
        self._wake.set()

    def _after_failure(self) -> None:
        self._stale.update(self._queues)  # read every queue's schedules again

    async def _round(self) -> None:
        self._wake = anyio.Event()  # set by what comes from now on (a watch, an event)
        now_mono = anyio.current_time()
        for queue in self._queues:
            if now_mono - self._loaded.get(queue, -_RELOAD) >= _RELOAD:
                self._stale.add(queue)
        for queue in list(self._stale):
            self._stale.discard(queue)
            await self._load(queue)
        now = self._clock.estimate_ms()
        due: dict[str, list[str]] = {}
        for (queue, name), tick in self._due.items():
            if tick <= now:
                due.setdefault(queue, []).append(name)
        async with anyio.create_task_group() as tg:  # queues at once: none waits for another
            for queue, names in due.items():
                tg.start_soon(self._fire, queue, names)
        if self._stale:  # queues watched while this round ran: load them now
            return
        now = self._clock.estimate_ms()
        earliest = min(self._due.values(), default=None)
        wait = MAX_WAIT if earliest is None else max(_MIN_WAIT, (earliest - now) / 1000)
        with anyio.move_on_after(min(wait, MAX_WAIT)):
            await self._wake.wait()

    async def _load(self, queue: str) -> None:
        """Read a queue's schedules; each one's next tick is the first after the
        latest it handled (a tick missed while no worker was alive fires at once)."""
        try:
            found = await _ops.schedules.of_queue(self._client, self._keys, queue)
        except BackendError as exc:
            self._reach.failed("reading schedules failed", exc, queue=queue)
            self._stale.add(queue)
            return
        self._reach.answered()
        if queue not in self._queues:
            return
        self._loaded[queue] = anyio.current_time()
        for key in [key for key in self._due if key[0] == queue]:
            del self._due[key]
        for stored in found:
            if stored.definition is None:
                continue  # check() reports it
            since = counted_from(stored.state, 0)
            self._due[(queue, stored.name)] = stored.definition.next_after(since)

    async def _fire(self, queue: str, names: list[str]) -> None:
        """Fire a queue's due schedules together: one transaction for them all, so that
        a pass costs the same few round trips however many are due."""
        try:
            fired = await _ops.schedules.fire_due(self._client, self._keys, queue, names)
        except Exception as exc:  # the queue's trouble must not stop the other queues
            if not isinstance(exc, CorruptDataError):
                self._reach.failed("firing schedules failed", exc, queue=queue)
            retry = self._clock.estimate_ms() + RETRY_AFTER_MS
            for name in names:
                self._due[(queue, name)] = retry
            return
        self._reach.answered()
        late: list[int] = []
        for name, done in fired.items():
            late += done.late_ms
            if done.skipped:
                self._log.info(
                    "schedule %r skipped a tick: its previous run is still live",
                    name,
                    extra={"queue": queue},
                )
            if done.next_ms is None or queue not in self._queues:
                self._due.pop((queue, name), None)
                continue
            # As the promoter does: the next tick as this peer's estimate will reach it.
            self._due[(queue, name)] = self._clock.estimate_ms() + done.next_ms - done.now_ms
        if late:
            self._tell_late(queue, late)

    def _tell_late(self, queue: str, late: list[int]) -> None:
        """Log the ticks submitted late, at most once every `_RELOAD` seconds per queue
        (summed meanwhile): a fleet that stays busy must not log at every pass."""
        count, most, since = self._late.get(queue, (0, 0, -_RELOAD))
        count, most = count + len(late), max(most, *late)
        now = anyio.current_time()
        if now - since < _RELOAD:
            self._late[queue] = (count, most, since)
            return
        self._late[queue] = (0, 0, now)
        self._log.warning(
            "%d schedule tick(s) submitted late, up to %.3f s: the queue's workers are busy",
            count,
            most / 1000,
            extra={"queue": queue},
        )
