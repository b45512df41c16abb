"""Release of waiting jobs: each worker judges the jobs handed to its queues'
``released`` sets (`_ops.deps.release`) when the ``released`` event says that a
dependency ended.

No peer owns a queue's releases: every worker of the queue hears the event, and WATCH
lets the one that comes first judge each job while the others find nothing left. An
event missed (a reconnect) or a release that failed is made up for by each worker's
periodic self-check, which counts the ``released`` set of every queue it works on.
"""

from __future__ import annotations

import anyio

from .. import _ops
from .._errors import BackendError
from .._layout.keys import Keys
from .._log import PeerLog
from .._redis.connections import Client
from .._redis.reach import Reach
from .timer import Timer


class Releaser(Timer):
    """The releases of one worker, for the queues it works on."""

    failure = "releasing waiting jobs failed"

    def __init__(self, client: Client, keys: Keys, log: PeerLog, reach: Reach) -> None:
        super().__init__(client, keys, log, reach)
        self._pending: set[str] = set()  # queues whose released set may hold jobs

    def watch(self, queue: str) -> None:
        """Release for ``queue`` from now on, starting with a look at once."""
        self._queues.add(queue)
        self.note(queue)

    def note(self, queue: str) -> None:
        """``queue``'s released set may hold jobs: release soon."""
        if queue in self._queues:
            self._pending.add(queue)
            self._wake.set()

    def hook(self, queue: str, kind: str, message: str) -> None:
        """Take the ``released`` event."""
        if kind == _ops.writes.RELEASED_EVENT:
            self.note(queue)

    def forget(self, queue: str) -> None:
        """Stop releasing for a queue this worker no longer works on."""
        super().forget(queue)
        self._pending.discard(queue)

    def _after_failure(self) -> None:
        self._pending.update(self._queues)  # look at every queue again

    async def _round(self) -> None:
        """Release each noted queue once woken. A release that fails is logged and not
        tried again until the queue is noted anew (by an event or the self-check, so
        at most once per self-check for a fault that stays)."""
        await self._wake.wait()
        self._wake = anyio.Event()
        while self._pending:
            queue = self._pending.pop()
            try:
                await _ops.deps.release(self._client, self._keys, queue)
            except BackendError as exc:
                self._reach.failed(self.failure, exc, queue=queue)
            except Exception:
                self._log.exception(self.failure, extra={"queue": queue})
            else:
                self._reach.answered()
